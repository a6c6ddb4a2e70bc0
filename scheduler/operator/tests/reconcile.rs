//! The reconciler against a scripted Kubernetes API server (tower-test: every request the
//! controller makes is checked and answered here) and a real rollfleet scheduler on loopback
//! (the status it reports is what the operator writes back).

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use http::Response;
use kube::client::Body;
use kube::runtime::controller::Action;
use rollfleet_operator::controller::FINALIZER;
use rollfleet_operator::crd::RLJob;
use rollfleet_operator::desired::job_file;
use rollfleet_operator::metrics::Metrics;
use serde_json::{Value, json};

mod scripted;
use scripted::*;

#[path = "../../../tests/common/tls.rs"]
mod tls;

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
    // The job's Pending worker pods, to see whether a pool cannot be placed: none.
    let (seen, send) = next(&mut handle).await;
    permissions.insert(permission(&seen));
    assert_eq!(seen.method, "GET");
    assert!(
        seen.uri.starts_with("/api/v1/namespaces/rl/pods?")
            && seen.uri.contains(
                "labelSelector=rollfleet.dev%2Fjob%3Dquickstart%2Crollfleet.dev%2Fcomponent%3Dworker"
            )
            && seen.uri.contains("fieldSelector=status.phase%3DPending"),
        "{}",
        seen.uri
    );
    answer(send, &pod_list(&[]));
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
            ("SchedulerReachable".into(), "True".into(), 3),
            ("Ready".into(), "False".into(), 3),
            ("Complete".into(), "False".into(), 3),
            ("Failed".into(), "False".into(), 3),
        ]
    );
    assert_eq!(status["conditions"][2]["reason"], "Pending", "{status:#}");
    assert!(status["startTime"].is_string(), "{status:#}");
    assert!(status["completionTime"].is_null(), "{status:#}");
    answer(send, &serde_json::to_value(&job).unwrap());
    let (action, events) = events_until_done(reconciling, &mut handle).await;
    assert_eq!(action, Action::requeue(Duration::from_secs(10)));
    // The Events `kubectl describe` shows: planned, then each pool's Deployment and where its
    // pods go, regarding the RLJob.
    let normal = |reason: &str| (reason.to_owned(), "Normal".to_owned());
    assert_eq!(
        reasons(&events),
        [
            normal("Planned"),
            normal("PoolPlaced"),
            normal("PoolPlaced"),
            normal("PoolPlaced"),
            normal("PoolPlaced"),
            normal("PoolPlaced"),
        ]
    );
    for event in &events {
        let regarding = &event["regarding"];
        assert_eq!(
            (
                &regarding["kind"],
                &regarding["name"],
                &regarding["namespace"],
                &regarding["uid"],
                &regarding["apiVersion"]
            ),
            (
                &json!("RLJob"),
                &json!("quickstart"),
                &json!("rl"),
                &json!("uid-1"),
                &json!("rollfleet.dev/v1alpha1")
            ),
            "{event:#}"
        );
        assert_eq!(event["reportingController"], "rollfleet-operator");
        assert_eq!(event["metadata"]["namespace"], "rl");
    }
    let decode = events
        .iter()
        .filter_map(|e| e["note"].as_str())
        .find(|n| n.starts_with("pool decode:"))
        .expect("the decode pool's placement");
    assert!(
        decode.contains("Deployment quickstart-decode")
            && decode.contains("nvidia.com/gpu.product="),
        "{decode}"
    );
    let notes: Vec<&str> = events.iter().filter_map(|e| e["note"].as_str()).collect();
    assert_eq!(
        notes,
        [
            "planned for 5 workers",
            "pool prefill: Deployment quickstart-prefill, 1 pod of 1 GPU each on nodes nvidia.com/gpu.product=NVIDIA-H800",
            "pool decode: Deployment quickstart-decode, 1 pod of 2 GPUs each on nodes nvidia.com/gpu.product=NVIDIA-H20",
            "pool train: Deployment quickstart-train, 1 pod of 1 GPU each on nodes nvidia.com/gpu.product=NVIDIA-H800",
            "pool envs: Deployment quickstart-envs, 1 pod on any node",
            "pool rewards: Deployment quickstart-rewards, 1 pod on any node",
        ]
    );
    // Each pool's Event is related to its Deployment.
    let related: Vec<&str> = events
        .iter()
        .filter(|e| e["reason"] == "PoolPlaced")
        .map(|e| e["related"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        related,
        [
            "quickstart-prefill",
            "quickstart-decode",
            "quickstart-train",
            "quickstart-envs",
            "quickstart-rewards"
        ]
    );
    permissions.insert(("events.k8s.io".into(), "events".into(), "create".into()));
    // A repeated Event is patched (its series counted).
    permissions.insert(("events.k8s.io".into(), "events".into(), "patch".into()));

    // What the controller did, and what its Controller watches, the shipped RBAC allows.
    permissions.insert(("rollfleet.dev".into(), "rljobs".into(), "watch".into()));
    permissions.insert(("rollfleet.dev".into(), "rljobs".into(), "list".into()));
    permissions.insert(("apps".into(), "deployments".into(), "watch".into()));
    // The jobs' pods, watched so that a pod's change reconciles its RLJob at once.
    permissions.insert(("".into(), "pods".into(), "watch".into()));
    permissions.insert(("".into(), "pods".into(), "list".into()));
    for (group, resource, verb) in &permissions {
        assert!(
            granted(group, resource, verb),
            "rbac.yaml does not allow {verb} {group}/{resource}"
        );
    }
    // No Secret anywhere through the ClusterRole; in a job namespace given the Role, it reads
    // the one Secret an RLJob names (`get`), and can never list or watch the namespace's.
    for verb in ["get", "list", "watch", "create", "patch", "delete"] {
        assert!(
            !granted("", "secrets", verb),
            "the ClusterRole lets the operator {verb} secrets"
        );
    }
    assert!(granted_in_job_namespace("", "secrets", "get"));
    for verb in ["list", "watch", "create", "patch", "delete"] {
        assert!(
            !granted_in_job_namespace("", "secrets", verb),
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
    let (action, events) = events_until_done(reconciling, &mut handle).await;
    assert_eq!(action, Action::await_change());
    assert_eq!(
        reasons(&events),
        [("InvalidSpec".to_owned(), "Warning".to_owned())]
    );
    let note = events[0]["note"].as_str().unwrap();
    assert!(note.contains("pools[1].gpu"), "{note}");
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
            "GET" if path == "/api/v1/namespaces/rl/pods" => answer(send, &pod_list(&[])),
            "GET" => answer(
                send,
                &json!({"apiVersion": "apps/v1", "kind": "DeploymentList", "metadata": {},
                        "items": []}),
            ),
            "PATCH" if path.ends_with("/rljobs/quickstart/status") => {
                let status = seen.body["status"].clone();
                answer(send, &serde_json::to_value(job).unwrap());
                events_until_done(reconciling, &mut handle).await;
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
    for permission in &permissions {
        assert!(
            allowed(permission),
            "the shipped RBAC does not grant {permission:?}"
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
    for permission in &permissions {
        assert!(
            allowed(permission),
            "the shipped RBAC does not grant {permission:?}"
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

/// A `PodList` answer holding `pods`.
#[tokio::test]
async fn a_two_gpu_type_job_pins_each_gpu_pools_workers_to_its_product_label_with_the_gpu_toleration()
 {
    let done = pass(&quickstart(), "http://127.0.0.1:1".into(), &[]).await;
    for (pool, product, gpus) in [
        ("quickstart-prefill", "NVIDIA-H800", "1"),
        ("quickstart-decode", "NVIDIA-H20", "2"),
        ("quickstart-train", "NVIDIA-H800", "1"),
    ] {
        let pod = pod_of(&done, pool);
        assert_eq!(
            pod["nodeSelector"],
            json!({"nvidia.com/gpu.product": product}),
            "{pool}"
        );
        assert_eq!(
            pod["tolerations"].to_string(),
            format!("[{GPU_TOLERATION}]"),
            "{pool}"
        );
        assert_eq!(
            pod["containers"][0]["resources"],
            json!({"limits": {"nvidia.com/gpu": gpus}}),
            "{pool}"
        );
    }
    // The CPU environment pool asks for the cores and memory of its shape (c7i.8xlarge: 32
    // vCPUs, 64 GiB), on any node; the serverless pool's one pod, for nothing in particular.
    let envs = pod_of(&done, "quickstart-envs");
    assert_eq!(
        envs["containers"][0]["resources"],
        json!({"requests": {"cpu": "32", "memory": "64Gi"}})
    );
    assert!(
        envs["nodeSelector"].is_null() && envs["tolerations"].is_null(),
        "{envs:#}"
    );
    let rewards = pod_of(&done, "quickstart-rewards");
    assert!(
        rewards["containers"][0]["resources"].is_null(),
        "{rewards:#}"
    );
    assert!(rewards["nodeSelector"].is_null(), "{rewards:#}");
    // The scheduler's pod is placed by the cluster alone.
    assert!(pod_of(&done, "quickstart-scheduler")["nodeSelector"].is_null());
}

#[tokio::test]
async fn a_pools_kubernetes_block_wins_over_the_defaults_but_keeps_the_pods_gpus() {
    let mut job = quickstart();
    job.spec["pools"][1]["kubernetes"] = json!({
        "nodeSelector": {"cloud.example.com/node-pool": "h20-spot"},
        "tolerations": [{"key": "spot", "operator": "Equal", "value": "true",
                         "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1"]}]}]}}},
        "resources": {"requests": {"cpu": 16, "memory": "256Gi"}, "limits": {"memory": "512Gi"}},
        "priorityClassName": "rl-high"
    });
    job.spec["pools"][3]["kubernetes"] = json!({"resources": {"requests": {"cpu": "30"}}});
    let done = pass(&job, "http://127.0.0.1:1".into(), &[]).await;
    let decode = pod_of(&done, "quickstart-decode");
    assert_eq!(
        decode["nodeSelector"],
        json!({"cloud.example.com/node-pool": "h20-spot"}),
        "the pool's selector replaces the product label"
    );
    assert_eq!(
        decode["tolerations"].to_string(),
        format!(
            r#"[{GPU_TOLERATION},{{"effect":"NoSchedule","key":"spot","operator":"Equal","value":"true"}}]"#
        ),
        "the pool's tolerations come besides the default one"
    );
    assert_eq!(
        decode["containers"][0]["resources"],
        json!({"requests": {"cpu": "16", "memory": "256Gi"},
               "limits": {"memory": "512Gi", "nvidia.com/gpu": "2"}})
    );
    assert_eq!(decode["priorityClassName"], "rl-high");
    assert_eq!(
        decode["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            [0]["matchExpressions"][0]["values"],
        json!(["z1"])
    );
    // Only the pool that says so: the other H20-less pools keep their defaults.
    assert_eq!(
        pod_of(&done, "quickstart-prefill")["nodeSelector"],
        json!({"nvidia.com/gpu.product": "NVIDIA-H800"})
    );
    // A CPU pool's request of one resource replaces that one only.
    assert_eq!(
        pod_of(&done, "quickstart-envs")["containers"][0]["resources"],
        json!({"requests": {"cpu": "30", "memory": "64Gi"}})
    );

    // A block that asks for the pod's GPUs itself is refused, naming the field.
    job.spec["pools"][1]["kubernetes"] = json!({"resources": {"limits": {"nvidia.com/gpu": 8}}});
    let refused = pass(&job, "http://127.0.0.1:1".into(), &[]).await;
    let status = refused.status.expect("a status");
    assert_eq!(status["phase"], "Invalid");
    let message = status["message"].as_str().unwrap();
    assert!(
        message.contains(r#"spec.pools[1].kubernetes.resources.limits["nvidia.com/gpu"]"#),
        "{message}"
    );
    assert!(refused.deployments.is_empty());
}

#[tokio::test]
async fn a_pool_whose_pods_stay_unschedulable_past_the_grace_is_named_in_an_unschedulable_condition()
 {
    let job = quickstart();
    let long_ago = "2020-01-01T00:00:00Z";
    let just_now = k8s_openapi::jiff::Timestamp::now().to_string();
    let why = "0/12 nodes are available: 12 node(s) didn't match Pod's node affinity/selector.";
    let pods = [
        unschedulable_pod("quickstart-decode-a", "decode", long_ago, why),
        unschedulable_pod("quickstart-decode-b", "decode", long_ago, why),
        // Within its grace: a cluster autoscaler may still be adding its node.
        unschedulable_pod("quickstart-prefill-a", "prefill", &just_now, "no node yet"),
    ];
    let (url, _scheduler) = scheduler(&job).await;
    let done = pass(&job, url.clone(), &pods).await;
    assert!(done.listed_pods);
    let status = done.status.expect("a status");
    let (ready, reason, message) = condition_of(&status, "Ready").expect("Ready");
    assert_eq!(
        (ready.as_str(), reason.as_str()),
        ("False", "Unschedulable")
    );
    assert!(
        message.contains("pool decode: 2 pods cannot be placed") && message.contains(why),
        "{message}"
    );
    assert!(!message.contains("prefill"), "{message}");
    assert_eq!(status["message"], message.as_str(), "{status:#}");
    // The scheduler is still asked: the status says where the job is, besides.
    assert_eq!(status["phase"], "Pending");
    // A Warning Event names the pool, once.
    let unschedulable: Vec<&Value> = done
        .events
        .iter()
        .filter(|e| e["reason"] == "Unschedulable")
        .collect();
    assert_eq!(unschedulable.len(), 1, "{:#?}", done.events);
    assert_eq!(unschedulable[0]["type"], "Warning");
    let note = unschedulable[0]["note"].as_str().unwrap();
    assert!(note.contains("pool decode"), "{note}");
    let mut job = job;
    job.status = Some(serde_json::from_value(status.clone()).unwrap());
    let again = pass(&job, url.clone(), &pods).await;
    assert!(again.events.is_empty(), "{:#?}", again.events);

    // Placed at last: the condition says so no more.
    let done = pass(&job, url, &[]).await;
    let (_, reason, _) = condition_of(&done.status.unwrap(), "Ready").unwrap();
    assert_eq!(reason, "Pending");
}

#[tokio::test]
async fn a_suspended_rljob_has_every_deployment_at_zero_until_resumed_with_the_same_job_file() {
    let mut job = quickstart();
    job.metadata.annotations = Some(
        [(
            rollfleet_operator::desired::JOURNAL_CLAIM_ANNOTATION.to_owned(),
            "rl-journals".to_owned(),
        )]
        .into(),
    );
    let running = pass(&job, "http://127.0.0.1:1".into(), &[]).await;
    job.status = Some(serde_json::from_value(running.status.clone().unwrap()).unwrap());
    job.spec["suspend"] = true.into();
    job.metadata.generation = Some(4);
    // No scheduler there: a suspended job asks nothing of it.
    let suspended = pass(&job, "http://127.0.0.1:1".into(), &[]).await;
    let replicas = |pass: &Pass| -> Vec<(String, i64)> {
        pass.deployments
            .iter()
            .map(|(name, d)| (name.clone(), d["spec"]["replicas"].as_i64().unwrap()))
            .collect()
    };
    assert_eq!(replicas(&suspended).len(), 6);
    assert!(
        replicas(&suspended).iter().all(|(_, r)| *r == 0),
        "{:?}",
        replicas(&suspended)
    );
    assert!(!suspended.listed_pods);
    assert_eq!(suspended.action, Action::await_change());
    let status = suspended.status.clone().expect("a status");
    assert_eq!(status["phase"], "Suspended");
    assert_eq!(
        condition_of(&status, "Suspended").map(|c| (c.0, c.1)),
        Some(("True".into(), "Suspended".into()))
    );
    assert_eq!(condition_of(&status, "Ready").unwrap().0, "False");
    // Suspending is no new plan: only the suspension is told.
    assert_eq!(
        reasons(&suspended.events),
        [("Suspended".to_owned(), "Normal".to_owned())]
    );
    // The journal's claim stays on the scheduler's pod, and the job file (so the journal's name)
    // is the running one's: resuming resumes the job.
    let scheduler_pod = pod_of(&suspended, "quickstart-scheduler");
    assert_eq!(
        scheduler_pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "journal")
            .map(|v| v["persistentVolumeClaim"]["claimName"].clone()),
        Some(json!("rl-journals"))
    );
    assert_eq!(suspended.config_map, running.config_map);
    assert_eq!(
        scheduler_pod["containers"][0]["args"],
        pod_of(&running, "quickstart-scheduler")["containers"][0]["args"]
    );

    // Resumed: every Deployment back at its replicas, and the condition turned false.
    job.spec["suspend"] = false.into();
    job.metadata.generation = Some(5);
    job.status = Some(serde_json::from_value(status).unwrap());
    let (url, _scheduler) = scheduler(&job).await;
    let resumed = pass(&job, url, &[]).await;
    assert_eq!(replicas(&resumed), replicas(&running));
    assert!(replicas(&resumed).iter().all(|(_, r)| *r >= 1));
    let status = resumed.status.expect("a status");
    assert_eq!(status["phase"], "Pending", "{status:#}");
    assert_eq!(
        condition_of(&status, "Suspended").map(|c| (c.0, c.1)),
        Some(("False".into(), "Resumed".into()))
    );
    assert!(status["startTime"].is_string(), "{status:#}");
    assert_eq!(
        reasons(&resumed.events),
        [("Resumed".to_owned(), "Normal".to_owned())]
    );
}

#[tokio::test]
async fn a_cancelled_job_is_failed_and_complete_is_not_with_its_completion_time() {
    let job = quickstart();
    // A scheduler that waits at the job's end, as the operator's pods run it.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let opts = rollfleet_server::ServerOptions {
        job_yaml: Some(job_file(&job).unwrap()),
        origin: "test".into(),
        seed: 0,
        time_scale: 1.0,
        lease_ttl: Duration::from_secs(10),
        expect_workers: 5,
        stage_timeout: Duration::from_secs(120),
        report: None,
        metrics_addr: None,
        replan_on_drift: None,
        token: None,
        journal: None,
        tls: None,
        tls_client_ca: None,
        journal_sync: false,
        until_stopped: true,
        weights_root: None,
        window_chooser: None,
    };
    let _scheduler = tokio::spawn(rollfleet_server::serve(listener, opts));
    let before = pass(&job, url.clone(), &[]).await;
    let mut job = job;
    job.status = Some(serde_json::from_value(before.status.unwrap()).unwrap());
    let mut client =
        rollfleet_proto::v1::job_service_client::JobServiceClient::connect(url.clone())
            .await
            .unwrap();
    client
        .cancel(rollfleet_proto::v1::JobRef {
            job: "quickstart".into(),
        })
        .await
        .unwrap();
    let ended = pass(&job, url, &[]).await;
    let status = ended.status.expect("a status");
    assert_eq!(status["phase"], "Cancelled", "{status:#}");
    let of = |t: &str| condition_of(&status, t).map(|c| (c.0, c.1)).unwrap();
    assert_eq!(of("Failed"), ("True".into(), "Cancelled".into()));
    assert_eq!(of("Complete"), ("False".into(), "Cancelled".into()));
    assert_eq!(of("Ready"), ("False".into(), "Cancelled".into()));
    assert!(status["completionTime"].is_string(), "{status:#}");
    assert_eq!(
        reasons(&ended.events),
        [("Cancelled".to_owned(), "Warning".to_owned())]
    );
    // The start is the one written before, not the end's.
    assert_eq!(
        status["startTime"],
        serde_json::to_value(&job.status.as_ref().unwrap().start_time).unwrap()
    );
    assert_eq!(ended.action, Action::requeue(Duration::from_secs(300)));
}

#[tokio::test]
async fn every_pod_the_operator_makes_runs_restricted_with_only_its_volumes_writable() {
    let mut job = quickstart();
    job.metadata.annotations = Some(
        [
            (
                rollfleet_operator::desired::TLS_SECRET_ANNOTATION.to_owned(),
                "rl-tls".to_owned(),
            ),
            (
                rollfleet_operator::desired::JOURNAL_CLAIM_ANNOTATION.to_owned(),
                "rl-journals".to_owned(),
            ),
        ]
        .into(),
    );
    let done = pass(&job, "http://127.0.0.1:1".into(), &[]).await;
    assert_eq!(done.deployments.len(), 6);
    for (name, deployment) in &done.deployments {
        let pod = &deployment["spec"]["template"]["spec"];
        assert_eq!(
            pod["securityContext"],
            json!({"runAsNonRoot": true, "runAsUser": 65532, "runAsGroup": 65532,
                   "fsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}}),
            "{name}"
        );
        for container in pod["containers"].as_array().unwrap() {
            assert_eq!(
                container["securityContext"],
                json!({"allowPrivilegeEscalation": false,
                       "capabilities": {"drop": ["ALL"]},
                       "readOnlyRootFilesystem": true,
                       "runAsNonRoot": true,
                       "seccompProfile": {"type": "RuntimeDefault"}}),
                "{name}"
            );
            // What it writes goes to an emptyDir (`/tmp`) or the journal's claim; every other
            // mount is read-only.
            let mounts = container["volumeMounts"].as_array().unwrap();
            assert!(
                mounts
                    .iter()
                    .any(|m| m["mountPath"] == "/tmp" && m["readOnly"].is_null()),
                "{name}: {mounts:?}"
            );
            for mount in mounts {
                let writable = ["tmp", "journal"].contains(&mount["name"].as_str().unwrap());
                assert_eq!(
                    mount["readOnly"] != json!(true),
                    writable,
                    "{name}: {mount}"
                );
            }
        }
        let tmp = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "tmp")
            .cloned();
        assert_eq!(tmp, Some(json!({"name": "tmp", "emptyDir": {}})), "{name}");
    }
}

/// What an HTTP GET of `path` on `addr` answers: its status line and body.
async fn http_get(addr: std::net::SocketAddr, path: &str) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut text = String::new();
    socket.read_to_string(&mut text).await.unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_owned(), body.to_owned())
}

#[tokio::test]
async fn the_operators_metrics_endpoint_counts_each_pass_its_duration_errors_and_jobs_by_phase() {
    let metrics = Arc::new(Metrics::new().unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(rollfleet_operator::metrics::serve(
        listener,
        metrics.clone(),
    ));

    // A pass that writes the status the real scheduler reports.
    let job = quickstart();
    let (url, _scheduler) = scheduler(&job).await;
    let done = pass_with(&job, url, &[], metrics.clone()).await;
    assert_eq!(done.status.unwrap()["phase"], "Pending");
    // A pass the API server fails: its first apply answered 500.
    let (reconciling, mut handle) = reconciling_with(&job, "http://127.0.0.1:1".into(), metrics);
    let (_, send) = next(&mut handle).await;
    send.send_response(
        Response::builder()
            .status(500)
            .body(Body::from(
                serde_json::to_vec(&json!({"apiVersion": "v1", "kind": "Status",
                    "status": "Failure", "reason": "InternalError", "code": 500,
                    "message": "etcd is down"}))
                .unwrap(),
            ))
            .unwrap(),
    );
    assert!(reconciling.await.unwrap().is_err());

    let (status, body) = http_get(addr, "/metrics").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    for line in [
        "rollfleet_operator_reconciles_total{result=\"ok\"} 1",
        "rollfleet_operator_reconciles_total{result=\"error\"} 1",
        "rollfleet_operator_reconcile_errors_total 1",
        "rollfleet_operator_reconcile_duration_seconds_count 2",
        "rollfleet_operator_jobs{phase=\"Pending\"} 1",
    ] {
        assert!(body.lines().any(|l| l == line), "no {line:?} in:\n{body}");
    }
    assert!(body.contains("# TYPE rollfleet_operator_reconcile_duration_seconds histogram"));
}
