//! Benchmarks of the serverless path, printed as medians:
//!
//! 1. host throughput: cheap reward invocations per second served by the local host to real
//!    aws-sdk-lambda clients over loopback TCP (target: at least 5,000/s on two cores);
//! 2. invoker overhead: the median time of an invoker call minus that of a raw SDK call with the
//!    same request (same payload size, `LogType: Tail`), measured alternately in one run
//!    (target: under 200 µs).
//!
//! Run with `cargo bench -p rollfleet-lambda-invoker --bench invoke`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aws_sdk_lambda::primitives::Blob;
use aws_sdk_lambda::types::LogType;
use rollfleet_lambda_host::HostConfig;
use rollfleet_lambda_invoker::{InvokerConfig, RewardInvoker, RewardRequest, lambda_client};
use serde_json::json;

const THROUGHPUT_ROUNDS: usize = 5;
const ROUND: Duration = Duration::from_secs(3);
const CLIENTS: usize = 64;
const OVERHEAD_SAMPLES: usize = 3000;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

async fn start_host() -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ =
            rollfleet_lambda_host::serve(listener, HostConfig::with_reward_functions(), async {
                let _ = rx.await;
            })
            .await;
    });
    (format!("http://{addr}"), tx)
}

async fn throughput(url: &str) -> Vec<f64> {
    let client = lambda_client(&InvokerConfig::local(url)).await;
    let payload = json!({"response": "Paris", "reference": "Paris"}).to_string();
    let mut rates = Vec::new();
    for _ in 0..THROUGHPUT_ROUNDS + 1 {
        let done = Arc::new(AtomicU64::new(0));
        let stop_at = Instant::now() + ROUND;
        let started = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..CLIENTS {
            let client = client.clone();
            let payload = payload.clone();
            let done = done.clone();
            tasks.push(tokio::spawn(async move {
                while Instant::now() < stop_at {
                    let out = client
                        .invoke()
                        .function_name("exact_match")
                        .payload(Blob::new(payload.as_bytes()))
                        .send()
                        .await
                        .expect("invoke");
                    assert!(out.function_error().is_none());
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        for t in tasks {
            t.await.expect("client task");
        }
        rates.push(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64());
    }
    // The first round warms connections and allocators; it is not counted.
    rates.remove(0);
    rates
}

async fn overhead(url: &str) -> (f64, f64, f64) {
    let mut config = InvokerConfig::local(url);
    config.jitter_seed = Some(1);
    let registry = prometheus::Registry::new();
    let invoker = RewardInvoker::connect(config.clone(), &registry)
        .await
        .expect("invoker");
    let raw = lambda_client(&config).await;
    let mut raw_us = Vec::with_capacity(OVERHEAD_SAMPLES);
    let mut inv_us = Vec::with_capacity(OVERHEAD_SAMPLES);
    let mut diff_us = Vec::with_capacity(OVERHEAD_SAMPLES);
    for i in 0..OVERHEAD_SAMPLES + 200 {
        // The raw call sends what the invoker sends: the same payload with an idempotency key.
        let body = json!({"response": "Paris", "reference": "Paris", "idempotency_key": format!("raw-{i}#0")})
            .to_string();
        let t0 = Instant::now();
        let out = raw
            .invoke()
            .function_name("exact_match")
            .log_type(LogType::Tail)
            .payload(Blob::new(body))
            .send()
            .await
            .expect("raw invoke");
        let raw_t = t0.elapsed().as_secs_f64() * 1e6;
        assert!(out.function_error().is_none());

        let t1 = Instant::now();
        let got = invoker
            .invoke(RewardRequest {
                function: "exact_match".to_owned(),
                trajectory_id: format!("traj-{i}"),
                attempt: 0,
                payload: json!({"response": "Paris", "reference": "Paris"}),
            })
            .await
            .expect("invoker invoke");
        let inv_t = t1.elapsed().as_secs_f64() * 1e6;
        assert_eq!(got.reward.reward, 1.0);
        if i >= 200 {
            raw_us.push(raw_t);
            inv_us.push(inv_t);
            diff_us.push(inv_t - raw_t);
        }
    }
    (
        median(&mut raw_us),
        median(&mut inv_us),
        median(&mut diff_us),
    )
}

fn main() {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("machine: {cores} cores, {cpu}");

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (url, stop) = start_host().await;
        let mut rates = throughput(&url).await;
        let rounds: Vec<String> = rates.iter().map(|r| format!("{r:.0}")).collect();
        println!(
            "host throughput via aws-sdk-lambda, {CLIENTS} concurrent clients, {}s rounds: median {:.0} invocations/s (rounds: {})",
            ROUND.as_secs(),
            median(&mut rates),
            rounds.join(", ")
        );
        let (raw, inv, diff) = overhead(&url).await;
        println!(
            "sequential call latency over {OVERHEAD_SAMPLES} pairs: raw SDK median {raw:.1} us, invoker median {inv:.1} us"
        );
        println!(
            "invoker overhead per call: median of paired differences {diff:.1} us (difference of medians {:.1} us)",
            inv - raw
        );
        let _ = stop.send(());
    });
}
