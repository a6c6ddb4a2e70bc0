//! Leader election against a scripted Kubernetes API server (tower-test): every request a
//! candidate makes for the Lease is checked here, answered as the API server would, and checked
//! against the Role `manifests/operator/rbac.yaml` gives the operator.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::time::{Duration, Instant};

use http::{Request, Response, StatusCode};
use k8s_openapi::api::rbac::v1::Role;
use k8s_openapi::jiff::Timestamp;
use kube::client::Body;
use rollfleet_operator::lease::{self, Leadership, LeaseLock, LostLease};
use serde_json::{Value, json};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;
type Send = tower_test::mock::SendResponse<Response<Body>>;

const PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/rollfleet-system/leases";

fn lock(identity: &str) -> (LeaseLock, Handle) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "rollfleet-system");
    let lock = LeaseLock::new(
        client,
        "rollfleet-system",
        "rollfleet-operator",
        identity,
        Duration::from_secs(15),
    );
    (lock, handle)
}

/// The next request: method, path, body; and where to answer it. Checks the operator's Role
/// allows it.
async fn next(handle: &mut Handle) -> (String, String, Value, Send) {
    let (request, send) = tokio::time::timeout(Duration::from_secs(30), handle.next_request())
        .await
        .expect("a request within 30 s")
        .expect("the client is alive");
    let method = request.method().to_string();
    let path = request.uri().path().to_owned();
    let bytes = request.into_body().collect_bytes().await.unwrap();
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    let verb = match method.as_str() {
        "GET" => "get",
        "POST" => "create",
        "PUT" => "update",
        other => panic!("unexpected {other} {path}"),
    };
    assert!(
        role_allows(verb),
        "the Role does not allow {verb} on leases"
    );
    (method, path, body, send)
}

fn answer(send: Send, status: StatusCode, body: &Value) {
    send.send_response(
        Response::builder()
            .status(status)
            .body(Body::from(serde_json::to_vec(body).unwrap()))
            .unwrap(),
    );
}

fn failure(code: u16, reason: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
           "code": code, "message": reason})
}

fn held_by(holder: Option<&str>, resource_version: &str, renewed: &str) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "rollfleet-operator", "namespace": "rollfleet-system",
                     "resourceVersion": resource_version},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "leaseTransitions": 2,
                 "acquireTime": "2026-11-25T10:00:00.000000Z", "renewTime": renewed}
    })
}

/// Whether the Role in `manifests/operator/rbac.yaml` lets the operator `verb` leases.
fn role_allows(verb: &str) -> bool {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../manifests/operator/rbac.yaml"
    );
    let text = std::fs::read_to_string(path).unwrap();
    text.split("\n---\n")
        .map(|doc| serde_yaml_ng::from_str::<Value>(doc).unwrap())
        .filter(|doc| doc["kind"] == "Role" && doc["metadata"]["namespace"] == "rollfleet-system")
        .map(|doc| serde_json::from_value::<Role>(doc).unwrap())
        .flat_map(|role| role.rules.unwrap_or_default())
        .any(|rule| {
            let has = |list: &[String], x: &str| list.iter().any(|v| v == x);
            has(
                rule.api_groups.as_deref().unwrap_or_default(),
                "coordination.k8s.io",
            ) && has(rule.resources.as_deref().unwrap_or_default(), "leases")
                && has(&rule.verbs, verb)
        })
}

#[tokio::test]
async fn a_candidate_creates_a_missing_lease_and_leads() {
    let (lock, mut handle) = lock("operator-a");
    let round = tokio::spawn(async move {
        lock.try_acquire_or_renew(Instant::now(), Timestamp::now())
            .await
    });
    let (method, path, _, send) = next(&mut handle).await;
    assert_eq!(
        (method.as_str(), path.as_str()),
        ("GET", &*format!("{PATH}/rollfleet-operator"))
    );
    answer(send, StatusCode::NOT_FOUND, &failure(404, "NotFound"));
    let (method, path, body, send) = next(&mut handle).await;
    assert_eq!((method.as_str(), path.as_str()), ("POST", PATH));
    assert_eq!(body["metadata"]["name"], "rollfleet-operator");
    assert_eq!(body["spec"]["holderIdentity"], "operator-a");
    assert_eq!(body["spec"]["leaseDurationSeconds"], 15);
    assert_eq!(body["spec"]["leaseTransitions"], 0);
    assert!(body["spec"]["renewTime"].is_string(), "{body:#}");
    let mut created = body.clone();
    created["metadata"]["resourceVersion"] = "1".into();
    answer(send, StatusCode::CREATED, &created);
    assert_eq!(round.await.unwrap().unwrap(), Leadership::Leading);
}

#[tokio::test]
async fn a_standby_follows_a_renewed_lease_and_takes_one_left_unrenewed_for_its_whole_duration() {
    let (lock, mut handle) = lock("operator-a");
    let lock = std::sync::Arc::new(lock);
    let start = Instant::now();
    // Renewed between the first two reads: still led by b.
    for (at, version, renewed) in [
        (0, "5", "2026-11-25T10:00:00.000000Z"),
        (10, "6", "2026-11-25T10:00:05.000000Z"),
        (24, "6", "2026-11-25T10:00:05.000000Z"),
    ] {
        let l = lock.clone();
        let round = tokio::spawn(async move {
            l.try_acquire_or_renew(start + Duration::from_secs(at), Timestamp::now())
                .await
        });
        let (method, _, _, send) = next(&mut handle).await;
        assert_eq!(method, "GET");
        answer(
            send,
            StatusCode::OK,
            &held_by(Some("operator-b"), version, renewed),
        );
        assert_eq!(
            round.await.unwrap().unwrap(),
            Leadership::Following {
                holder: "operator-b".into()
            },
            "at {at} s"
        );
    }
    // The same record, seen unchanged since 10 s, at 25 s: 15 s without a renewal. Taken,
    // with the resourceVersion read (a Lease changed since would be a conflict).
    let l = lock.clone();
    let round = tokio::spawn(async move {
        l.try_acquire_or_renew(start + Duration::from_secs(25), Timestamp::now())
            .await
    });
    let (method, _, _, send) = next(&mut handle).await;
    assert_eq!(method, "GET");
    answer(
        send,
        StatusCode::OK,
        &held_by(Some("operator-b"), "6", "2026-11-25T10:00:05.000000Z"),
    );
    let (method, path, body, send) = next(&mut handle).await;
    assert_eq!(
        (method.as_str(), path.as_str()),
        ("PUT", &*format!("{PATH}/rollfleet-operator"))
    );
    assert_eq!(body["metadata"]["resourceVersion"], "6");
    assert_eq!(body["spec"]["holderIdentity"], "operator-a");
    assert_eq!(body["spec"]["leaseTransitions"], 3);
    assert_ne!(body["spec"]["acquireTime"], "2026-11-25T10:00:00.000000Z");
    let mut taken = body.clone();
    taken["metadata"]["resourceVersion"] = "7".into();
    answer(send, StatusCode::OK, &taken);
    assert_eq!(round.await.unwrap().unwrap(), Leadership::Leading);
}

#[tokio::test]
async fn of_two_candidates_for_a_released_lease_the_one_the_api_server_refuses_follows() {
    let (lock, mut handle) = lock("operator-a");
    let round = tokio::spawn(async move {
        lock.try_acquire_or_renew(Instant::now(), Timestamp::now())
            .await
    });
    let (_, _, _, send) = next(&mut handle).await;
    // Released by its last holder: anyone may take it at once.
    answer(
        send,
        StatusCode::OK,
        &held_by(None, "9", "2026-11-25T10:00:00.000000Z"),
    );
    let (method, _, body, send) = next(&mut handle).await;
    assert_eq!(method, "PUT");
    assert_eq!(body["metadata"]["resourceVersion"], "9");
    answer(send, StatusCode::CONFLICT, &failure(409, "Conflict"));
    // Whoever won is read back and followed.
    let (method, _, _, send) = next(&mut handle).await;
    assert_eq!(method, "GET");
    answer(
        send,
        StatusCode::OK,
        &held_by(Some("operator-b"), "10", "2026-11-25T10:00:01.000000Z"),
    );
    assert_eq!(
        round.await.unwrap().unwrap(),
        Leadership::Following {
            holder: "operator-b".into()
        }
    );
}

#[tokio::test]
async fn a_leader_renews_its_lease_and_stops_leading_when_another_holds_it() {
    let (lock, mut handle) = lock("operator-a");
    let keeping = tokio::spawn(async move {
        lease::keep(&lock, Duration::from_millis(10), Duration::from_secs(10)).await
    });
    let (_, _, _, send) = next(&mut handle).await;
    answer(
        send,
        StatusCode::OK,
        &held_by(Some("operator-a"), "3", "2026-11-25T10:00:00.000000Z"),
    );
    let (method, _, body, send) = next(&mut handle).await;
    assert_eq!(method, "PUT");
    assert_eq!(body["spec"]["holderIdentity"], "operator-a");
    assert_eq!(
        body["spec"]["leaseTransitions"], 2,
        "a renewal is no transition"
    );
    assert_eq!(body["spec"]["acquireTime"], "2026-11-25T10:00:00.000000Z");
    assert_ne!(body["spec"]["renewTime"], "2026-11-25T10:00:00.000000Z");
    answer(send, StatusCode::OK, &body);
    // Another took it (this leader was cut off from the API server for longer than the lease).
    let (_, _, _, send) = next(&mut handle).await;
    answer(
        send,
        StatusCode::OK,
        &held_by(Some("operator-b"), "8", "2026-11-25T10:01:00.000000Z"),
    );
    match keeping.await.unwrap() {
        LostLease::TakenBy { holder } => assert_eq!(holder, "operator-b"),
        other => panic!("{other}"),
    }
}

#[tokio::test]
async fn a_leader_that_cannot_renew_within_its_deadline_stops_leading() {
    let (lock, mut handle) = lock("operator-a");
    let mut keeping = tokio::spawn(async move {
        lease::keep(&lock, Duration::from_millis(10), Duration::from_millis(100)).await
    });
    let started = Instant::now();
    let lost = loop {
        tokio::select! {
            lost = &mut keeping => break lost.unwrap(),
            request = handle.next_request() => {
                // The client goes with the leader that gave up.
                let Some((_, send)) = request else {
                    break (&mut keeping).await.unwrap();
                };
                answer(send, StatusCode::SERVICE_UNAVAILABLE, &failure(503, "ServiceUnavailable"));
            }
        }
        assert!(started.elapsed() < Duration::from_secs(30), "never gave up");
    };
    match lost {
        LostLease::NotRenewed { for_s, last } => {
            assert!(for_s >= 0.1, "{for_s}");
            assert!(
                last.to_string()
                    .contains("rollfleet-system/rollfleet-operator"),
                "{last}"
            );
        }
        other => panic!("{other}"),
    }
}

#[tokio::test]
async fn a_leader_that_stops_hands_its_lease_over_and_one_that_does_not_hold_it_leaves_it_alone() {
    let (lock, mut handle) = lock("operator-a");
    let lock = std::sync::Arc::new(lock);
    let l = lock.clone();
    let releasing = tokio::spawn(async move { l.release(Timestamp::now()).await });
    let (_, _, _, send) = next(&mut handle).await;
    answer(
        send,
        StatusCode::OK,
        &held_by(Some("operator-a"), "4", "2026-11-25T10:00:00.000000Z"),
    );
    let (method, _, body, send) = next(&mut handle).await;
    assert_eq!(method, "PUT");
    assert_eq!(body["metadata"]["resourceVersion"], "4");
    assert!(body["spec"]["holderIdentity"].is_null(), "{body:#}");
    assert_eq!(body["spec"]["leaseDurationSeconds"], 1);
    answer(send, StatusCode::OK, &body);
    releasing.await.unwrap().unwrap();
    // Held by another: nothing is written.
    let l = lock.clone();
    let releasing = tokio::spawn(async move { l.release(Timestamp::now()).await });
    let (_, _, _, send) = next(&mut handle).await;
    answer(
        send,
        StatusCode::OK,
        &held_by(Some("operator-b"), "5", "2026-11-25T10:00:00.000000Z"),
    );
    releasing.await.unwrap().unwrap();
    let more = tokio::time::timeout(Duration::from_millis(200), handle.next_request()).await;
    assert!(more.is_err(), "a lease it does not hold was written");
}

#[tokio::test]
async fn a_standby_waiting_for_the_lease_says_each_new_state_once_and_returns_when_it_leads() {
    let (lock, mut handle) = lock("operator-a");
    let logged = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let log = logged.clone();
    let acquiring = tokio::spawn(async move {
        lease::acquire(&lock, Duration::from_millis(10), |line| {
            log.lock().unwrap().push(line)
        })
        .await
    });
    let held = held_by(Some("operator-b"), "1", "2026-11-25T10:00:00.000000Z");
    for _ in 0..2 {
        let (_, _, _, send) = next(&mut handle).await;
        answer(send, StatusCode::OK, &held);
    }
    for _ in 0..2 {
        let (_, _, _, send) = next(&mut handle).await;
        answer(
            send,
            StatusCode::SERVICE_UNAVAILABLE,
            &failure(503, "ServiceUnavailable"),
        );
    }
    // Deleted by someone: created anew, and led.
    let (_, _, _, send) = next(&mut handle).await;
    answer(send, StatusCode::NOT_FOUND, &failure(404, "NotFound"));
    let (method, _, body, send) = next(&mut handle).await;
    assert_eq!(method, "POST");
    answer(send, StatusCode::CREATED, &body);
    tokio::time::timeout(Duration::from_secs(30), acquiring)
        .await
        .expect("it leads")
        .unwrap();
    let logged = logged.lock().unwrap().clone();
    assert_eq!(logged.len(), 2, "{logged:#?}");
    assert!(logged[0].contains("held by operator-b"), "{logged:#?}");
    assert!(
        logged[1].contains("rollfleet-system/rollfleet-operator"),
        "{logged:#?}"
    );
}
