//! The reconciler against a scripted Kubernetes API server (tower-test: every request the
//! controller makes is checked and answered here) and a real rollfleet scheduler on loopback
//! (the status it reports is what the operator writes back).

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use k8s_openapi::api::rbac::v1::ClusterRole;
use kube::client::Body;
use kube::runtime::controller::Action;
use rollfleet_operator::controller::{self, Context, FINALIZER};
use rollfleet_operator::crd::RLJob;
use rollfleet_operator::desired::{Settings, job_file};
use serde_json::{Value, json};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

#[path = "../../../tests/common/tls.rs"]
mod tls;

fn quickstart() -> RLJob {
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

type ServerRun = Result<Option<rollfleet_server::Report>, rollfleet_server::ServerError>;

/// A real scheduler serving `job` on loopback, expecting five workers (none come); its URL and
/// the task that ends with its report.
async fn scheduler(job: &RLJob) -> (String, tokio::task::JoinHandle<ServerRun>) {
    scheduler_with_token(job, None).await
}

/// [`scheduler`], requiring `token` on every call.
async fn scheduler_with_token(
    job: &RLJob,
    token: Option<&str>,
) -> (String, tokio::task::JoinHandle<ServerRun>) {
    scheduler_serving(job, token, None).await
}

/// [`scheduler_with_token`], serving TLS with `(certificate, key)` when given.
async fn scheduler_serving(
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
    };
    (url, tokio::spawn(rollfleet_server::serve(listener, opts)))
}

/// One request the controller made: method, path and query, content type, body as JSON.
struct Seen {
    method: String,
    uri: String,
    content_type: String,
    body: Value,
}

async fn next(handle: &mut Handle) -> (Seen, tower_test::mock::SendResponse<Response<Body>>) {
    let (request, send) = tokio::time::timeout(Duration::from_secs(30), handle.next_request())
        .await
        .expect("a request within 30 s")
        .expect("the client is alive");
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
    (
        Seen {
            method,
            uri,
            content_type,
            body,
        },
        send,
    )
}

fn answer(send: tower_test::mock::SendResponse<Response<Body>>, body: &Value) {
    send.send_response(
        Response::builder()
            .body(Body::from(serde_json::to_vec(body).unwrap()))
            .unwrap(),
    );
}

/// Whether `manifests/operator/rbac.yaml` lets the operator do `verb` on `resource` of `group`.
fn granted(group: &str, resource: &str, verb: &str) -> bool {
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

/// The (group, resource, verb) a request needs, from its method and path.
fn permission(seen: &Seen) -> (String, String, String) {
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
fn reconciling(
    job: &RLJob,
    url: String,
) -> (
    tokio::task::JoinHandle<Result<Action, kube::runtime::finalizer::Error<controller::Error>>>,
    Handle,
) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let ctx = Arc::new(Context {
        client: kube::Client::new(service, "rl"),
        settings: Settings {
            image: "rollfleet:test".into(),
        },
        scheduler_url: Box::new(move |_| url.clone()),
        plans: Default::default(),
    });
    (
        tokio::spawn(controller::reconcile(Arc::new(job.clone()), ctx)),
        handle,
    )
}

#[tokio::test]
async fn a_valid_rljob_gets_its_scheduler_and_workers_applied_and_the_schedulers_status_written_back()
 {
    let job = quickstart();
    let (url, _scheduler) = scheduler(&job).await;
    let (reconciling, mut handle) = reconciling(&job, url);

    let mut applied = Vec::new();
    let mut permissions = BTreeSet::new();
    // Server-side applies: the job file, the Service, the scheduler and one Deployment a pool.
    loop {
        let (seen, send) = next(&mut handle).await;
        permissions.insert(permission(&seen));
        if seen.method == "GET" {
            assert!(
                seen.uri
                    .starts_with("/apis/apps/v1/namespaces/rl/deployments?")
                    && seen
                        .uri
                        .contains("labelSelector=rollfleet.dev%2Fjob%3Dquickstart"),
                "{}",
                seen.uri
            );
            let owned = |name: &str, uid: &str| {
                json!({"metadata": {"name": name, "namespace": "rl", "ownerReferences": [
                    {"apiVersion": "rollfleet.dev/v1alpha1", "kind": "RLJob", "name": "quickstart",
                     "uid": uid, "controller": true}]}})
            };
            answer(
                send,
                &json!({"apiVersion": "apps/v1", "kind": "DeploymentList", "metadata": {},
                        "items": [owned("quickstart-decode", "uid-1"),
                                  owned("quickstart-retired-pool", "uid-1"),
                                  owned("quickstart-someone-elses", "uid-2")]}),
            );
            break;
        }
        assert_eq!(seen.method, "PATCH", "{}", seen.uri);
        assert_eq!(seen.content_type, "application/apply-patch+yaml");
        assert!(
            seen.uri.contains("fieldManager=rollfleet-operator") && seen.uri.contains("force=true"),
            "{}",
            seen.uri
        );
        applied.push(format!(
            "{} {}",
            seen.body["kind"].as_str().unwrap(),
            seen.body["metadata"]["name"].as_str().unwrap()
        ));
        answer(send, &seen.body);
    }
    assert_eq!(
        applied,
        [
            "ConfigMap quickstart-job",
            "Service quickstart-scheduler",
            "Deployment quickstart-scheduler",
            "Deployment quickstart-prefill",
            "Deployment quickstart-decode",
            "Deployment quickstart-train",
            "Deployment quickstart-envs",
            "Deployment quickstart-rewards",
        ]
    );
    // Only the job's own Deployment that no pool wants any more is deleted.
    let (seen, send) = next(&mut handle).await;
    permissions.insert(permission(&seen));
    assert_eq!(
        (seen.method.as_str(), seen.uri.split('?').next().unwrap()),
        (
            "DELETE",
            "/apis/apps/v1/namespaces/rl/deployments/quickstart-retired-pool"
        )
    );
    answer(
        send,
        &json!({"apiVersion": "apps/v1", "kind": "Deployment",
                          "metadata": {"name": "quickstart-retired-pool"}}),
    );
    // The status, from the real scheduler: waiting for the five workers it was told to expect.
    let (seen, send) = next(&mut handle).await;
    permissions.insert(permission(&seen));
    assert_eq!(seen.method, "PATCH");
    assert!(
        seen.uri
            .starts_with("/apis/rollfleet.dev/v1alpha1/namespaces/rl/rljobs/quickstart/status"),
        "{}",
        seen.uri
    );
    assert_eq!(seen.content_type, "application/merge-patch+json");
    let status = &seen.body["status"];
    assert_eq!(status["phase"], "Pending", "{status:#}");
    assert_eq!(status["workers"], 5);
    assert_eq!(status["observedGeneration"], 3);
    assert!(
        status["message"]
            .as_str()
            .unwrap()
            .contains("waiting for workers"),
        "{status:#}"
    );
    let conditions: Vec<(String, String, i64)> = status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["type"].as_str().unwrap().to_owned(),
                c["status"].as_str().unwrap().to_owned(),
                c["observedGeneration"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        conditions,
        [
            ("Valid".into(), "True".into(), 3),
            ("SchedulerReachable".into(), "True".into(), 3)
        ]
    );
    answer(send, &serde_json::to_value(&job).unwrap());
    let action = reconciling.await.unwrap().unwrap();
    assert_eq!(action, Action::requeue(Duration::from_secs(10)));

    // What the controller did, and what its Controller watches, the shipped RBAC allows.
    permissions.insert(("rollfleet.dev".into(), "rljobs".into(), "watch".into()));
    permissions.insert(("rollfleet.dev".into(), "rljobs".into(), "list".into()));
    permissions.insert(("apps".into(), "deployments".into(), "watch".into()));
    for (group, resource, verb) in &permissions {
        assert!(
            granted(group, resource, verb),
            "rbac.yaml does not allow {verb} {group}/{resource}"
        );
    }
    // It reads the one Secret an RLJob names for its token (`get`), and can never list or
    // watch the namespace's Secrets.
    for verb in ["list", "watch", "create", "patch", "delete"] {
        assert!(
            !granted("", "secrets", verb),
            "the operator may {verb} secrets"
        );
    }
}

#[tokio::test]
async fn an_invalid_rljob_gets_its_problems_in_its_status_and_nothing_else() {
    let mut job = quickstart();
    job.spec["pools"][1]["gpu"] = "H2000".into();
    let (reconciling, mut handle) = reconciling(&job, "http://127.0.0.1:1".into());
    let (seen, send) = next(&mut handle).await;
    assert_eq!(seen.method, "PATCH");
    assert!(
        seen.uri.contains("/rljobs/quickstart/status"),
        "{}",
        seen.uri
    );
    let status = &seen.body["status"];
    assert_eq!(status["phase"], "Invalid");
    let message = status["message"].as_str().unwrap();
    assert!(
        message.contains("pools[1].gpu") && message.contains("H2000"),
        "{message}"
    );
    assert_eq!(status["conditions"][0]["type"], "Valid");
    assert_eq!(status["conditions"][0]["status"], "False");
    assert_eq!(status["conditions"][0]["reason"], "InvalidSpec");
    answer(send, &serde_json::to_value(&job).unwrap());
    assert_eq!(reconciling.await.unwrap().unwrap(), Action::await_change());
    // Nothing was created: no further request came (the client is gone, or silent).
    let more = tokio::time::timeout(Duration::from_millis(200), handle.next_request()).await;
    assert!(matches!(more, Err(_) | Ok(None)), "another request came");
}

#[tokio::test]
async fn an_ended_rljob_has_every_deployment_scaled_to_zero_and_its_status_kept() {
    let mut job = quickstart();
    job.status = Some(rollfleet_operator::crd::RLJobStatus {
        phase: "Succeeded".into(),
        observed_generation: Some(3),
        rl_step: 2,
        rl_steps_total: 2,
        trajectories_trained: 64,
        ..Default::default()
    });
    // No scheduler there: asking one would fail and write a status, which this test would see.
    let (reconciling, mut handle) = reconciling(&job, "http://127.0.0.1:1".into());
    let mut scaled = Vec::new();
    loop {
        let (seen, send) = next(&mut handle).await;
        if seen.method == "GET" {
            answer(
                send,
                &json!({"apiVersion": "apps/v1", "kind": "DeploymentList", "metadata": {},
                        "items": []}),
            );
            break;
        }
        assert_eq!(seen.method, "PATCH", "{}", seen.uri);
        if seen.body["kind"] == "Deployment" {
            scaled.push((
                seen.body["metadata"]["name"].as_str().unwrap().to_owned(),
                seen.body["spec"]["replicas"].as_i64().unwrap(),
            ));
        }
        answer(send, &seen.body);
    }
    assert_eq!(
        scaled,
        [
            "quickstart-scheduler",
            "quickstart-prefill",
            "quickstart-decode",
            "quickstart-train",
            "quickstart-envs",
            "quickstart-rewards"
        ]
        .map(|name| (name.to_owned(), 0))
    );
    let done = tokio::time::timeout(Duration::from_secs(30), reconciling)
        .await
        .expect("the pass ends without asking anything more");
    assert_eq!(done.unwrap().unwrap(), Action::await_change());
    let more = tokio::time::timeout(Duration::from_millis(200), handle.next_request()).await;
    assert!(matches!(more, Err(_) | Ok(None)), "another request came");
}

#[tokio::test]
async fn a_new_rljob_first_gets_the_finalizer_that_cancels_its_job() {
    let mut job = quickstart();
    job.metadata.finalizers = None;
    let (reconciling, mut handle) = reconciling(&job, "http://127.0.0.1:1".into());
    let (seen, send) = next(&mut handle).await;
    assert_eq!(seen.method, "PATCH");
    assert_eq!(seen.content_type, "application/json-patch+json");
    assert!(
        seen.uri
            .starts_with("/apis/rollfleet.dev/v1alpha1/namespaces/rl/rljobs/quickstart")
    );
    assert!(seen.body.to_string().contains(FINALIZER), "{}", seen.body);
    answer(send, &serde_json::to_value(&job).unwrap());
    assert_eq!(reconciling.await.unwrap().unwrap(), Action::await_change());
}

#[tokio::test]
async fn a_deleted_rljob_cancels_its_job_on_the_scheduler_before_its_finalizer_goes() {
    let mut job = quickstart();
    job.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
    ));
    let (url, scheduler) = scheduler(&job).await;
    let (reconciling, mut handle) = reconciling(&job, url);
    let (seen, send) = next(&mut handle).await;
    // By the time the finalizer is removed, the scheduler has been told to cancel.
    let report = tokio::time::timeout(Duration::from_secs(30), scheduler)
        .await
        .expect("the scheduler stops")
        .unwrap()
        .unwrap()
        .expect("a report");
    assert_eq!(report.phase, "Cancelled");
    assert_eq!(seen.method, "PATCH");
    assert_eq!(seen.content_type, "application/json-patch+json");
    let ops = seen.body.as_array().unwrap();
    assert!(ops.iter().any(|op| op["op"] == "remove"), "{}", seen.body);
    answer(send, &serde_json::to_value(&job).unwrap());
    assert_eq!(reconciling.await.unwrap().unwrap(), Action::await_change());
}

#[test]
fn the_job_file_the_scheduler_reads_is_the_rljob_without_the_clusters_bookkeeping() {
    let job = quickstart();
    let file = job_file(&job).unwrap();
    assert!(
        !file.contains("uid-1") && !file.contains(FINALIZER),
        "{file}"
    );
    let parsed = rollfleet_spec::parse_job(file.as_bytes(), "job file").unwrap();
    assert_eq!(parsed.manifest.metadata.name, "quickstart");
}

/// Reconciles `job` against the scripted API server, answering every apply with what was sent,
/// the list of the job's Deployments with none, and a GET of the Secret `rl/rl-token` with
/// `token`; returns the status written and every permission the requests needed.
async fn status_written_with_secret(
    job: &RLJob,
    url: String,
    token: &str,
) -> (Value, BTreeSet<(String, String, String)>) {
    status_written_with_secrets(job, url, &[("rl-token", "token", token)]).await
}

/// [`status_written_with_secret`], for any Secrets of `rl`: `(name, key, value)`, each of
/// which must be read.
async fn status_written_with_secrets(
    job: &RLJob,
    url: String,
    secrets: &[(&str, &str, &str)],
) -> (Value, BTreeSet<(String, String, String)>) {
    let (reconciling, mut handle) = reconciling(job, url);
    let mut permissions = BTreeSet::new();
    let mut read = BTreeSet::new();
    loop {
        let (seen, send) = next(&mut handle).await;
        permissions.insert(permission(&seen));
        let path = seen.uri.split('?').next().unwrap().to_owned();
        let secret = secrets
            .iter()
            .find(|(name, _, _)| path == format!("/api/v1/namespaces/rl/secrets/{name}"));
        match seen.method.as_str() {
            "GET" if secret.is_some() => {
                let (name, key, value) = secret.unwrap();
                read.insert(*name);
                answer(
                    send,
                    &json!({"apiVersion": "v1", "kind": "Secret",
                            "metadata": {"name": name, "namespace": "rl"},
                            "data": {*key: base64_of_token(value)}}),
                );
            }
            "GET" => answer(
                send,
                &json!({"apiVersion": "apps/v1", "kind": "DeploymentList", "metadata": {},
                        "items": []}),
            ),
            "PATCH" if path.ends_with("/rljobs/quickstart/status") => {
                let status = seen.body["status"].clone();
                answer(send, &serde_json::to_value(job).unwrap());
                reconciling.await.unwrap().unwrap();
                assert_eq!(read.len(), secrets.len(), "the operator read only {read:?}");
                return (status, permissions);
            }
            "PATCH" => answer(send, &seen.body),
            other => panic!("unexpected {other} {}", seen.uri),
        }
    }
}

/// Standard base64 of `text`, as the API server encodes a Secret's data.
fn base64_of_token(text: &str) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in text.as_bytes().chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[tokio::test]
async fn an_rljob_with_a_token_secret_reaches_its_scheduler_with_that_token_and_says_when_it_is_wrong()
 {
    const TOKEN: &str = "cluster-secret-0123456789";
    let mut job = quickstart();
    job.metadata.annotations = Some(
        [(
            rollfleet_operator::desired::TOKEN_SECRET_ANNOTATION.to_owned(),
            "rl-token".to_owned(),
        )]
        .into(),
    );
    let (url, _scheduler) = scheduler_with_token(&job, Some(TOKEN)).await;

    let (status, permissions) = status_written_with_secret(&job, url.clone(), TOKEN).await;
    assert_eq!(status["phase"], "Pending", "{status:#}");
    assert_eq!(status["workers"], 5, "{status:#}");
    let reachable = &status["conditions"][1];
    assert_eq!(reachable["type"], "SchedulerReachable");
    assert_eq!(reachable["status"], "True", "{status:#}");
    for (group, resource, verb) in &permissions {
        assert!(
            granted(group, resource, verb),
            "rbac.yaml does not grant {verb} on {group}/{resource}"
        );
    }

    // A Secret holding another token: the scheduler refuses the operator, which says so.
    let (status, _) = status_written_with_secret(&job, url, "another-token-0123456789").await;
    let reachable = &status["conditions"][1];
    assert_eq!(reachable["status"], "False", "{status:#}");
    assert!(
        status["message"]
            .as_str()
            .unwrap()
            .contains("not this scheduler's"),
        "{status:#}"
    );
}

#[tokio::test]
async fn an_rljob_with_a_tls_secret_reaches_its_scheduler_over_tls_trusting_the_secrets_ca() {
    let dir = std::env::temp_dir().join(format!("rollfleet-reconcile-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ca, cert, key) = tls::tls_files(&dir, "good");
    let (other_ca, _, _) = tls::tls_files(&dir, "other");
    let mut job = quickstart();
    job.metadata.annotations = Some(
        [(
            rollfleet_operator::desired::TLS_SECRET_ANNOTATION.to_owned(),
            "rl-tls".to_owned(),
        )]
        .into(),
    );
    let (url, _scheduler) = scheduler_serving(&job, None, Some((cert, key))).await;
    let ca_pem = std::fs::read_to_string(&ca).unwrap();

    // The Secret's CA signed the scheduler's certificate: the operator gets its status.
    let (status, permissions) =
        status_written_with_secrets(&job, url.clone(), &[("rl-tls", "ca.crt", &ca_pem)]).await;
    let reachable = &status["conditions"][1];
    assert_eq!(reachable["status"], "True", "{status:#}");
    assert_eq!(status["phase"], "Pending", "{status:#}");
    for (group, resource, verb) in &permissions {
        assert!(
            granted(group, resource, verb),
            "rbac.yaml does not grant {verb} on {group}/{resource}"
        );
    }

    // Another CA: the handshake fails, and the status says the scheduler is not reachable.
    let other = std::fs::read_to_string(&other_ca).unwrap();
    let (status, _) =
        status_written_with_secrets(&job, url.clone(), &[("rl-tls", "ca.crt", &other)]).await;
    let reachable = &status["conditions"][1];
    assert_eq!(reachable["status"], "False", "{status:#}");
    assert!(
        reachable["message"].as_str().unwrap().contains("https://"),
        "{status:#}"
    );

    // A Secret without the CA: said so, naming it and the key.
    let (status, _) =
        status_written_with_secrets(&job, url, &[("rl-tls", "tls.crt", &ca_pem)]).await;
    let message = status["conditions"][1]["message"].as_str().unwrap();
    assert!(
        message.contains("secret rl/rl-tls") && message.contains("ca.crt"),
        "{status:#}"
    );
}
