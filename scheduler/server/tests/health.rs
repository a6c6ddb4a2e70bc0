//! The scheduler's `grpc.health.v1` service, over real gRPC on loopback: what a kubelet's gRPC
//! probe asks. It answers without the job's token (a probe carries none) while every other
//! service still requires it, says SERVING while the server accepts, and NOT_SERVING once it
//! stops.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::time::Duration;

use rollfleet_proto::v1::JobRef;
use rollfleet_proto::v1::job_service_client::JobServiceClient;
use rollfleet_server::ServerOptions;
use tonic::transport::Channel;
use tonic_health::ServingStatus;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

mod common;
use common::quickstart_yaml;

const TOKEN: &str = "health-test-token-0123456789abcdef";

async fn channel(url: &str) -> Channel {
    for _ in 0..100 {
        if let Ok(c) = Channel::from_shared(url.to_owned())
            .unwrap()
            .connect()
            .await
        {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the scheduler at {url} never accepted");
}

fn check(service: &str) -> HealthCheckRequest {
    HealthCheckRequest {
        service: service.into(),
    }
}

#[tokio::test]
async fn the_health_service_answers_a_probe_without_the_token_serving_until_the_scheduler_stops() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let opts = ServerOptions {
        job_yaml: Some(quickstart_yaml()),
        origin: "quickstart.yaml".into(),
        seed: 7,
        time_scale: 1.0,
        lease_ttl: Duration::from_secs(10),
        // The job waits for workers that never come: the scheduler serves until stopped.
        expect_workers: 100,
        stage_timeout: Duration::from_secs(60),
        report: None,
        metrics_addr: None,
        replan_on_drift: None,
        token: Some(rollfleet_proto::auth::Token::parse(TOKEN, "test").unwrap()),
        journal: None,
        tls: None,
        tls_client_ca: None,
        journal_sync: false,
        until_stopped: false,
        weights_root: None,
        window_chooser: None,
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(rollfleet_server::serve_until(listener, opts, stopped));
    let channel = channel(&url).await;
    let mut health = HealthClient::new(channel.clone());

    // No token, as a kubelet's probe: the server and each of its services are SERVING.
    for service in [
        "",
        "rollfleet.v1.WorkerService",
        "rollfleet.v1.JobService",
        "rollfleet.v1.TrainerFeed",
    ] {
        let answer = health.check(check(service)).await.unwrap().into_inner();
        assert_eq!(
            answer.status(),
            ServingStatus::Serving.into(),
            "{service:?}"
        );
    }
    // A service it does not serve is not found, rather than reported healthy.
    let unknown = health.check(check("no.such.Service")).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    // Nothing else answers without the token.
    let refused = JobServiceClient::new(channel)
        .status(JobRef {
            job: "quickstart".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);

    // A peer watching the health stream sees the scheduler stop serving, and its stream ends
    // so that the scheduler can exit.
    let mut watch = health.watch(check("")).await.unwrap().into_inner();
    let first = watch.message().await.unwrap().expect("a first status");
    assert_eq!(first.status(), ServingStatus::Serving.into());
    stop.send(()).unwrap();
    let next = tokio::time::timeout(Duration::from_secs(10), watch.message())
        .await
        .expect("a status within 10 s")
        .unwrap()
        .expect("a status before the stream ends");
    assert_eq!(next.status(), ServingStatus::NotServing.into());
    let ended = tokio::time::timeout(Duration::from_secs(30), server)
        .await
        .expect("the scheduler exits within 30 s while a peer watches its health");
    ended.unwrap().unwrap();
}
