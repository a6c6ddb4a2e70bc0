//! The scripted Kubernetes API server the reconciler tests talk to (tower-test: each request
//! the controller makes is seen and answered by the test), a real rollfleet scheduler on
//! loopback, and the checks of the shipped RBAC against the requests made.

#![allow(dead_code)] // each test file uses part of it

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use k8s_openapi::api::rbac::v1::ClusterRole;
use kube::client::Body;
use kube::runtime::controller::Action;
use rollfleet_operator::controller::{self, Context, FINALIZER};
use rollfleet_operator::crd::RLJob;
use rollfleet_operator::desired::{Settings, job_file};
use rollfleet_operator::metrics::Metrics;
use serde_json::{Value, json};

pub type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

pub fn quickstart() -> RLJob {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/jobs/quickstart.yaml"
    );
    let mut job: RLJob = serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    job.metadata.namespace = Some("rl".into());
    job.metadata.uid = Some("uid-1".into());
    job.metadata.generation = Some(3);
    job.metadata.finalizers = Some(vec![FINALIZER.into()]);
    job
}

pub type ServerRun = Result<Option<rollfleet_server::Report>, rollfleet_server::ServerError>;

/// A real scheduler serving `job` on loopback, expecting five workers (none come); its URL and
/// the task that ends with its report.
pub async fn scheduler(job: &RLJob) -> (String, tokio::task::JoinHandle<ServerRun>) {
    scheduler_with_token(job, None).await
}

/// [`scheduler`], requiring `token` on every call.
pub async fn scheduler_with_token(
    job: &RLJob,
    token: Option<&str>,
) -> (String, tokio::task::JoinHandle<ServerRun>) {
    scheduler_serving(job, token, None).await
}

/// [`scheduler_with_token`], serving TLS with `(certificate, key)` when given.
pub async fn scheduler_serving(
    job: &RLJob,
    token: Option<&str>,
    tls: Option<(std::path::PathBuf, std::path::PathBuf)>,
) -> (String, tokio::task::JoinHandle<ServerRun>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let opts = rollfleet_server::ServerOptions {
        job_yaml: Some(job_file(job).unwrap()),
        origin: "test".into(),
        seed: 0,
        time_scale: 1.0,
        lease_ttl: Duration::from_secs(10),
        expect_workers: 5,
        stage_timeout: Duration::from_secs(120),
        report: None,
        metrics_addr: None,
        replan_on_drift: None,
        token: token.map(|t| rollfleet_proto::auth::Token::parse(t, "test").unwrap()),
        journal: None,
        tls,
        tls_client_ca: None,
        journal_sync: false,
        until_stopped: false,
        weights_root: None,
        window_chooser: None,
    };
    (url, tokio::spawn(rollfleet_server::serve(listener, opts)))
}

/// One request the controller made: method, path and query, content type, body as JSON.
pub struct Seen {
    pub method: String,
    pub uri: String,
    pub content_type: String,
    pub body: Value,
}

pub async fn next(handle: &mut Handle) -> (Seen, tower_test::mock::SendResponse<Response<Body>>) {
    let (request, send) = tokio::time::timeout(Duration::from_secs(30), handle.next_request())
        .await
        .expect("a request within 30 s")
        .expect("the client is alive");
    (seen(request).await, send)
}

pub async fn seen(request: Request<Body>) -> Seen {
    let method = request.method().to_string();
    let uri = request.uri().to_string();
    let content_type = request
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let bytes = request.into_body().collect_bytes().await.unwrap();
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    Seen {
        method,
        uri,
        content_type,
        body,
    }
}

pub fn answer(send: tower_test::mock::SendResponse<Response<Body>>, body: &Value) {
    send.send_response(
        Response::builder()
            .body(Body::from(serde_json::to_vec(body).unwrap()))
            .unwrap(),
    );
}

pub type Reconciling =
    tokio::task::JoinHandle<Result<Action, kube::runtime::finalizer::Error<controller::Error>>>;

/// Answers the Events a pass posts after its status until the pass ends: its action and each
/// Event as posted.
pub async fn events_until_done(
    reconciling: Reconciling,
    handle: &mut Handle,
) -> (Action, Vec<Value>) {
    let mut reconciling = reconciling;
    let mut events = Vec::new();
    loop {
        tokio::select! {
            done = &mut reconciling => return (done.unwrap().unwrap(), events),
            request = handle.next_request() => {
                let Some((request, send)) = request else {
                    return ((&mut reconciling).await.unwrap().unwrap(), events);
                };
                let seen = seen(request).await;
                assert_eq!(
                    (seen.method.as_str(), seen.uri.split('?').next().unwrap()),
                    ("POST", "/apis/events.k8s.io/v1/namespaces/rl/events"),
                );
                answer(send, &seen.body);
                events.push(seen.body);
            }
        }
    }
}

/// Each Event's reason and type.
pub fn reasons(events: &[Value]) -> Vec<(String, String)> {
    events
        .iter()
        .map(|e| {
            (
                e["reason"].as_str().unwrap_or_default().to_owned(),
                e["type"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// Whether `manifests/operator/rbac.yaml` lets the operator do `verb` on `resource` of `group`.
pub fn granted(group: &str, resource: &str, verb: &str) -> bool {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../manifests/operator/rbac.yaml"
    );
    let text = std::fs::read_to_string(path).unwrap();
    text.split("\n---\n")
        .map(|doc| serde_yaml_ng::from_str::<Value>(doc).unwrap())
        .filter(|doc| doc["kind"] == "ClusterRole")
        .map(|doc| serde_json::from_value::<ClusterRole>(doc).unwrap())
        .flat_map(|role| role.rules.unwrap_or_default())
        .any(|rule| {
            let has = |list: &Option<Vec<String>>, x: &str| {
                list.iter().flatten().any(|v| v == x || v == "*")
            };
            has(&rule.api_groups, group)
                && has(&rule.resources, resource)
                && has(&Some(rule.verbs), verb)
        })
}

/// Whether `manifests/operator/secrets-role.yaml`, the Role applied in each job namespace whose
/// RLJobs name a Secret, lets the operator do `verb` on `resource` of `group` there; and that
/// its RoleBinding binds that Role to the operator's service account.
pub fn granted_in_job_namespace(group: &str, resource: &str, verb: &str) -> bool {
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../manifests/operator/secrets-role.yaml"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let docs: Vec<Value> = text
        .split("\n---\n")
        .map(|doc| serde_yaml_ng::from_str::<Value>(doc).unwrap())
        .collect();
    let of = |kind: &str| docs.iter().find(|d| d["kind"] == kind).cloned().unwrap();
    let role: Role = serde_json::from_value(of("Role")).unwrap();
    let binding: RoleBinding = serde_json::from_value(of("RoleBinding")).unwrap();
    // Namespaced by `kubectl apply -n`: neither names a namespace of its own.
    assert!(role.metadata.namespace.is_none() && binding.metadata.namespace.is_none());
    assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
    let subject = &binding.subjects.unwrap()[0];
    assert_eq!(
        (subject.name.as_str(), subject.namespace.as_deref()),
        ("rollfleet-operator", Some("rollfleet-system"))
    );
    role.rules.unwrap_or_default().iter().any(|rule| {
        let has =
            |list: &Option<Vec<String>>, x: &str| list.iter().flatten().any(|v| v == x || v == "*");
        has(&rule.api_groups, group)
            && has(&rule.resources, resource)
            && has(&Some(rule.verbs.clone()), verb)
    })
}

/// Whether the shipped RBAC lets the operator make a request of `(group, resource, verb)`:
/// Secrets through the per-namespace Role only, everything else through the ClusterRole.
pub fn allowed((group, resource, verb): &(String, String, String)) -> bool {
    if resource == "secrets" {
        granted_in_job_namespace(group, resource, verb)
    } else {
        granted(group, resource, verb)
    }
}

/// The (group, resource, verb) a request needs, from its method and path.
pub fn permission(seen: &Seen) -> (String, String, String) {
    let path = seen.uri.split('?').next().unwrap_or_default();
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (group, rest) = match parts[0] {
        "api" => (String::new(), &parts[2..]),
        _ => (parts[1].to_owned(), &parts[3..]),
    };
    // namespaces/NS/RESOURCE[/NAME[/SUBRESOURCE]]
    let rest = if rest.first() == Some(&"namespaces") {
        &rest[2..]
    } else {
        rest
    };
    let mut resource = rest[0].to_owned();
    if rest.len() > 2 {
        resource = format!("{resource}/{}", rest[2]);
    }
    let verb = match (seen.method.as_str(), rest.len()) {
        ("GET", 1) => "list",
        ("GET", _) => "get",
        ("PATCH", _) => "patch",
        ("DELETE", _) => "delete",
        ("POST", _) => "create",
        (other, _) => panic!("unexpected method {other}"),
    };
    (group, resource, verb.to_owned())
}

/// Starts reconciling `job` against a scripted API server (the returned handle answers it), with
/// its scheduler at `url`.
pub fn reconciling(job: &RLJob, url: String) -> (Reconciling, Handle) {
    reconciling_with(job, url, Arc::new(Metrics::new().unwrap()))
}

/// [`reconciling`], counting into `metrics`.
pub fn reconciling_with(job: &RLJob, url: String, metrics: Arc<Metrics>) -> (Reconciling, Handle) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "rl");
    let ctx = Arc::new(Context {
        recorder: controller::recorder(client.clone(), Some("test".into())),
        client,
        settings: Settings {
            image: "rollfleet:test".into(),
        },
        scheduler_url: Box::new(move |_| url.clone()),
        plans: Default::default(),
        metrics,
    });
    (
        tokio::spawn(controller::reconcile(Arc::new(job.clone()), ctx)),
        handle,
    )
}

pub fn pod_list(pods: &[Value]) -> Value {
    json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": pods})
}

/// A worker pod of the quickstart's pool `pool` that the cluster's scheduler has found no node
/// for since `since` (RFC 3339), saying `why`.
pub fn unschedulable_pod(name: &str, pool: &str, since: &str, why: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "rl", "labels": {
            "rollfleet.dev/job": "quickstart", "rollfleet.dev/component": "worker",
            "rollfleet.dev/pool": pool}},
        "spec": {"containers": [{"name": "worker"}]},
        "status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": why, "lastTransitionTime": since}]}
    })
}

/// What one reconciliation did against the scripted API server.
pub struct Pass {
    /// The Deployments applied, by name, as sent.
    pub deployments: Vec<(String, Value)>,
    /// The ConfigMap applied.
    pub config_map: Value,
    /// Whether the job's pods were listed.
    pub listed_pods: bool,
    /// The status written, if one was.
    pub status: Option<Value>,
    /// What the pass asked of the controller next.
    pub action: Action,
    /// The Events it posted.
    pub events: Vec<Value>,
}

/// Reconciles `job` once with its scheduler at `url`, answering every apply with what was sent,
/// the list of the job's Deployments with none and the list of its Pending pods with `pods`.
pub async fn pass(job: &RLJob, url: String, pods: &[Value]) -> Pass {
    pass_with(job, url, pods, Arc::new(Metrics::new().unwrap())).await
}

/// [`pass`], counting into `metrics`.
pub async fn pass_with(job: &RLJob, url: String, pods: &[Value], metrics: Arc<Metrics>) -> Pass {
    let (mut reconciling, mut handle) = reconciling_with(job, url, metrics);
    let mut out = Pass {
        deployments: Vec::new(),
        config_map: Value::Null,
        listed_pods: false,
        status: None,
        action: Action::await_change(),
        events: Vec::new(),
    };
    loop {
        tokio::select! {
            done = &mut reconciling => {
                out.action = done.unwrap().unwrap();
                return out;
            }
            request = handle.next_request() => {
                // The client goes with the pass that ended: its result is ready.
                let Some((request, send)) = request else {
                    out.action = (&mut reconciling).await.unwrap().unwrap();
                    return out;
                };
                let seen = seen(request).await;
                let path = seen.uri.split('?').next().unwrap().to_owned();
                match (seen.method.as_str(), path.as_str()) {
                    ("GET", "/api/v1/namespaces/rl/pods") => {
                        out.listed_pods = true;
                        answer(send, &pod_list(pods));
                    }
                    ("GET", p) if p.starts_with("/api/v1/namespaces/rl/secrets/") => {
                        send.send_response(
                            Response::builder()
                                .status(404)
                                .body(Body::from(
                                    serde_json::to_vec(&json!({
                                        "apiVersion": "v1", "kind": "Status",
                                        "status": "Failure", "reason": "NotFound", "code": 404,
                                        "message": "not found"}))
                                    .unwrap(),
                                ))
                                .unwrap(),
                        );
                    }
                    ("GET", "/apis/apps/v1/namespaces/rl/deployments") => answer(
                        send,
                        &json!({"apiVersion": "apps/v1", "kind": "DeploymentList",
                                "metadata": {}, "items": []}),
                    ),
                    ("POST", "/apis/events.k8s.io/v1/namespaces/rl/events") => {
                        out.events.push(seen.body.clone());
                        answer(send, &seen.body);
                    }
                    ("PATCH", p) if p.ends_with("/rljobs/quickstart/status") => {
                        out.status = Some(seen.body["status"].clone());
                        answer(send, &serde_json::to_value(job).unwrap());
                    }
                    ("PATCH", _) => {
                        match seen.body["kind"].as_str() {
                            Some("Deployment") => out.deployments.push((
                                seen.body["metadata"]["name"].as_str().unwrap().to_owned(),
                                seen.body.clone(),
                            )),
                            Some("ConfigMap") => out.config_map = seen.body.clone(),
                            _ => {}
                        }
                        answer(send, &seen.body);
                    }
                    (method, _) => panic!("unexpected {method} {}", seen.uri),
                }
            }
        }
    }
}

/// The pod template's spec of the Deployment `name` a pass applied.
pub fn pod_of<'a>(pass: &'a Pass, name: &str) -> &'a Value {
    let (_, deployment) = pass
        .deployments
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no Deployment {name}"));
    &deployment["spec"]["template"]["spec"]
}

/// A condition of a written status: its status, reason and message.
pub fn condition_of(status: &Value, type_: &str) -> Option<(String, String, String)> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_owned(),
                c["reason"].as_str().unwrap_or_default().to_owned(),
                c["message"].as_str().unwrap_or_default().to_owned(),
            )
        })
}

pub const GPU_TOLERATION: &str =
    r#"{"effect":"NoSchedule","key":"nvidia.com/gpu","operator":"Exists"}"#;
