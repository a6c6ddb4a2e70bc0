//! A scheduler told to stop while it plans its job stops at once: the plan is cancelled (the
//! planner's search gives up) rather than run to its end on a thread nobody waits for.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::time::Duration;

use rollfleet_server::ServerOptions;

mod common;
use common::quickstart_yaml;

include!("../../../tests/common/pools.rs");

/// The quick-start job with 200 more GPU pools of assorted sizes: valid, and a minute or more
/// of planning (the search grows with every pool).
fn slow_to_plan_yaml() -> String {
    with_gpu_pools(&quickstart_yaml(), 200)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_stopped_while_it_plans_its_job_returns_within_seconds_without_a_job() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let opts = ServerOptions {
        job_yaml: Some(slow_to_plan_yaml()),
        origin: "big.yaml".into(),
        seed: 7,
        time_scale: 1.0,
        lease_ttl: Duration::from_secs(2),
        expect_workers: 1,
        stage_timeout: Duration::from_secs(60),
        report: None,
        metrics_addr: None,
        replan_on_drift: None,
        token: None,
        journal: None,
        tls: None,
        tls_client_ca: None,
        journal_sync: false,
        until_stopped: false,
        weights_root: None,
        window_chooser: None,
    };
    let stop = tokio::time::sleep(Duration::from_secs(1));
    let started = tokio::time::Instant::now();
    let served = tokio::time::timeout(
        Duration::from_secs(20),
        rollfleet_server::serve_until(listener, opts, stop),
    )
    .await
    .expect("the scheduler did not stop within 20 s of being told to, while planning");
    let took = started.elapsed();
    assert!(
        matches!(served, Ok(None)),
        "{:?}",
        served.map(|r| r.is_some())
    );
    assert!(took < Duration::from_secs(6), "stopped after {took:?}");
}
