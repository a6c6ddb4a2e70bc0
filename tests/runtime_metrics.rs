//! Monitoring across real processes: GPU telemetry exported as workers report it, and a real
//! Prometheus scraping the scheduler with the shipped rules and answering every dashboard query.
//!
//! Every wait is bounded by a generous deadline and polls a real condition (a status over gRPC,
//! a process exit), so the tests hold on a loaded two-core machine. The shared harness is
//! `common/runtime.rs`.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rollfleet_proto::v1::worker_service_client::WorkerServiceClient;
use rollfleet_proto::v1::{HardwareInventory, HeartbeatRequest};
use serde_json::Value;

#[path = "common/runtime.rs"]
mod harness;
use harness::*;

/// A test peer `gpu-peer` of the decode pool that declares two GPUs of `name` with telemetry.
fn gpu_peer(name: &str, memory_bytes: u64) -> HardwareInventory {
    use rollfleet_proto::v1::{GpuDevice, GpuTelemetryInfo};
    let device = |index: u32| GpuDevice {
        index,
        name: name.into(),
        uuid: format!("GPU-test-{index}"),
        memory_bytes,
    };
    HardwareInventory {
        hostname: "gpu-peer".into(),
        pool: "decode".into(),
        gpu_telemetry: Some(GpuTelemetryInfo {
            available: true,
            unavailable_reason: String::new(),
            devices: vec![device(0), device(1)],
        }),
        ..Default::default()
    }
}

#[test]
fn gpu_telemetry_is_exported_as_workers_report_it_and_absent_where_there_is_no_driver() {
    use rollfleet_proto::v1::{GpuReading, GpuTelemetryInfo, WorkerLoad};
    let dir = temp_dir("telemetry");
    let job = job_file(&dir, 1);
    let report = dir.join("report.json");
    // The job never starts (it waits for 100 workers): only registration, heartbeats and the
    // exposition are tested.
    let mut sched = Command::new(BIN)
        .arg("scheduler")
        .arg(&job)
        .args(["--listen", "127.0.0.1:0", "--lease-ms", "2000"])
        .args(["--expect-workers", "100", "--metrics-addr", "127.0.0.1:0"])
        .arg("--report")
        .arg(&report)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(sched.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = format!(
        "http://{}",
        line.trim().strip_prefix("listening on ").unwrap()
    );
    let sched_log = stderr_lines(&mut sched);
    let metrics = metrics_address(&sched_log);
    let mut procs = Procs(vec![sched]);

    // A real worker on this machine. With no NVIDIA driver (this project's machines) it says so
    // once, and its heartbeats carry no GPU figure.
    let no_driver = rollfleet_gpu::discover().err();
    let mut real = Command::new(BIN)
        .args(["worker", "--scheduler", &url, "--pool", "decode"])
        .args(["--name", "real-node"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let real_log = stderr_lines(&mut real);
    procs.0.push(real);
    let said = wait_line(&real_log, "GPU telemetry");
    if let Some(reason) = &no_driver {
        assert!(said.contains("no GPU telemetry"), "{said}");
        assert!(said.contains(&reason.0), "{said} / {reason}");
        let told = wait_line(&sched_log, "(decode@real-node) has no GPU telemetry");
        assert!(told.contains("NVML"), "{told}");
    }

    let lease_ms = rt().block_on(async {
        let mut client = WorkerServiceClient::connect(url.clone()).await.unwrap();
        // A peer that reads two GPUs: it declares them, then reports them with a heartbeat.
        let lease = register_peer(&mut client, gpu_peer("NVIDIA H800", 85_899_345_920)).await;
        let reading = |index, utilization, memory_used_bytes| GpuReading {
            index,
            utilization,
            memory_used_bytes,
        };
        client
            .heartbeat(HeartbeatRequest {
                worker_id: lease.worker_id.clone(),
                epoch: 1,
                load: Some(WorkerLoad {
                    gpus: vec![reading(0, 0.42, 1_234_567), reading(1, 0.9, 7_654_321)],
                    gpu_utilization: Some(0.66),
                    gpu_memory_used_bytes: Some(8_888_888.0),
                    ..Default::default()
                }),
            })
            .await
            .unwrap();

        // A peer that registered without GPU telemetry and then sends readings (made up: it has
        // no driver to read them from) is refused and cut off.
        let liar = register_peer(
            &mut client,
            HardwareInventory {
                hostname: "liar".into(),
                pool: "decode".into(),
                gpu_telemetry: Some(GpuTelemetryInfo {
                    available: false,
                    unavailable_reason: "no driver".into(),
                    devices: vec![],
                }),
                ..Default::default()
            },
        )
        .await;
        let zeros = HeartbeatRequest {
            worker_id: liar.worker_id.clone(),
            epoch: 1,
            load: Some(WorkerLoad {
                gpus: vec![reading(0, 0.0, 0)],
                ..Default::default()
            }),
        };
        let refused = client.heartbeat(zeros.clone()).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().contains("without GPU telemetry"),
            "{refused:?}"
        );
        let gone = client.heartbeat(zeros).await.unwrap_err();
        assert_eq!(gone.code(), tonic::Code::NotFound, "{gone:?}");

        // A peer whose profile sample is not a number is refused and cut off, naming the
        // sample and the field.
        let nan = register_peer(
            &mut client,
            HardwareInventory {
                hostname: "nan".into(),
                pool: "decode".into(),
                ..Default::default()
            },
        )
        .await;
        let sample = |seconds: f64| rollfleet_proto::v1::ProfileSample {
            kind: rollfleet_proto::v1::ProfileKind::Decode as i32,
            flops: 1e12,
            bytes: 1e9,
            seconds,
            gpus: 2,
            emulated: true,
        };
        let bad = HeartbeatRequest {
            worker_id: nan.worker_id.clone(),
            epoch: 1,
            load: Some(WorkerLoad {
                samples: vec![sample(0.01), sample(f64::NAN)],
                ..Default::default()
            }),
        };
        let refused = client.heartbeat(bad.clone()).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().contains("load.samples[1]"), "{refused:?}");
        let gone = client.heartbeat(bad).await.unwrap_err();
        assert_eq!(gone.code(), tonic::Code::NotFound, "{gone:?}");
        (lease.ttl_ms, lease.worker_id)
    });
    // Metrics name a worker by its number, never by its lease's secret.
    let (ttl_ms, lease_id) = lease_ms;
    let peer = lease_id.split('-').next().unwrap().to_owned();
    assert!(
        peer.starts_with('w') && peer.len() < lease_id.len(),
        "{lease_id}"
    );

    // Two of the real worker's heartbeats (every ttl/4) have come and gone.
    std::thread::sleep(Duration::from_millis(ttl_ms / 2 + 300));
    let exposition = scrape(&metrics);
    let series = |name: &str, gpu: u32| {
        format!(
            "rollfleet_{name}{{gpu=\"{gpu}\",host=\"gpu-peer\",pool=\"decode\",worker=\"{peer}\"}}"
        )
    };
    assert_eq!(
        sample(&exposition, &series("gpu_utilization_ratio", 0)),
        Some(0.42),
        "{exposition}"
    );
    assert_eq!(
        sample(&exposition, &series("gpu_utilization_ratio", 1)),
        Some(0.9)
    );
    assert_eq!(
        sample(&exposition, &series("gpu_memory_used_bytes", 0)),
        Some(1_234_567.0)
    );
    assert_eq!(
        sample(&exposition, &series("gpu_memory_used_bytes", 1)),
        Some(7_654_321.0)
    );
    assert_eq!(
        sample(&exposition, &series("gpu_memory_total_bytes", 1)),
        Some(85_899_345_920.0)
    );
    assert!(exposition.contains("name=\"NVIDIA H800\""), "{exposition}");
    // Nothing, not zeros, for the workers without a driver (the real one here, and the liar).
    let gpu_lines: Vec<&str> = exposition
        .lines()
        .filter(|l| l.starts_with("rollfleet_gpu_"))
        .collect();
    assert!(
        gpu_lines.iter().all(|l| l.contains("host=\"gpu-peer\"")),
        "{gpu_lines:#?}"
    );
    // Per GPU: utilisation, memory used, memory total, info.
    assert_eq!(gpu_lines.len(), 2 * 4, "{gpu_lines:#?}");
    if no_driver.is_some() {
        assert_eq!(
            sample(
                &exposition,
                "rollfleet_workers_without_gpu_telemetry{pool=\"decode\"}"
            ),
            Some(1.0),
            "the real worker (the liar is cut off): {exposition}"
        );
    }

    // The peer goes silent: its lease runs out and its GPUs leave the exposition.
    let start = Instant::now();
    while scrape(&metrics).contains("host=\"gpu-peer\"") {
        assert!(start.elapsed() < DEADLINE, "the silent peer's GPUs stayed");
        std::thread::sleep(Duration::from_millis(200));
    }

    // Stop: the report says what each worker said; the real worker said it once.
    let pid = procs.0[0].id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert_eq!(status.code(), Some(1));
    assert!(wait_exit(&mut procs.0[1], DEADLINE).success());
    let report: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let said: Vec<&Value> = report["gpu_telemetry"].as_array().unwrap().iter().collect();
    let of = |host: &str| {
        *said
            .iter()
            .find(|t| {
                t["worker"]
                    .as_str()
                    .unwrap()
                    .ends_with(&format!("@{host})"))
            })
            .unwrap()
    };
    assert_eq!(of("gpu-peer")["gpu_telemetry"], "available");
    assert_eq!(of("gpu-peer")["gpus"].as_array().unwrap().len(), 2);
    assert_eq!(of("liar")["gpu_telemetry"], "unavailable");
    if let Some(reason) = &no_driver {
        assert_eq!(of("real-node")["gpu_telemetry"], "unavailable");
        assert_eq!(of("real-node")["reason"], reason.0.as_str());
        // Everything else it wrote, to its exit.
        let lines: Vec<String> = real_log.iter().collect();
        let again = lines.iter().filter(|l| l.contains("GPU telemetry")).count();
        assert_eq!(again, 0, "the absence is said once: {lines:#?}");
    }
}

// ---------------------------------------------------------------- a real Prometheus

/// The monitoring manifests: `manifests/monitoring/NAME`.
fn monitoring_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../manifests/monitoring")
        .join(name)
}

/// A `prometheus` server on loopback, run from the shipped `prometheus.yml` and rules with the
/// scrape target, the intervals and the rules' path changed for the test.
struct Prometheus {
    child: Child,
    addr: String,
}

impl Prometheus {
    fn start(dir: &Path, target: &str) -> Prometheus {
        let shipped = std::fs::read_to_string(monitoring_file("prometheus.yml")).unwrap();
        let rules = monitoring_file("rollfleet-rules.yaml");
        let config = shipped
            .replace("scrape_interval: 15s", "scrape_interval: 200ms")
            .replace("evaluation_interval: 15s", "evaluation_interval: 500ms")
            .replace("- rollfleet-rules.yaml", &format!("- {}", rules.display()))
            .replace("rollfleet-scheduler:9464", target);
        assert!(
            config.contains(target) && config.contains("200ms"),
            "{config}"
        );
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config).unwrap();
        // A free port: bound, read and let go (Prometheus cannot report a port it picked).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run `prometheus` ({e}): install Prometheus 2.x (Debian: `apt-get install \
                     prometheus`; .ci/run does)"
                )
            });
        let prometheus = Prometheus { child, addr };
        let start = Instant::now();
        while !prometheus.get("/-/ready").starts_with("HTTP/1.0 200") {
            assert!(start.elapsed() < DEADLINE, "Prometheus never became ready");
            std::thread::sleep(Duration::from_millis(200));
        }
        prometheus
    }

    /// The whole answer (head and body) to `GET path`. HTTP/1.0, so the body is never chunked;
    /// an empty string while nothing listens.
    fn get(&self, path: &str) -> String {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(&self.addr) else {
            return String::new();
        };
        let request = format!("GET {path} HTTP/1.0\r\nHost: prometheus\r\n\r\n");
        let mut out = String::new();
        if s.write_all(request.as_bytes()).is_err() || s.read_to_string(&mut out).is_err() {
            return String::new();
        }
        out
    }

    /// The JSON body of an API answer, checked for `"status": "success"`.
    fn api(&self, path: &str) -> Value {
        let answer = self.get(path);
        let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer}"));
        assert_eq!(v["status"], "success", "{path}: {v:#}");
        v["data"].clone()
    }

    /// An instant query evaluated at `time` (Unix seconds): the result's series.
    fn query(&self, promql: &str, time: f64) -> Vec<Value> {
        let data = self.api(&format!(
            "/api/v1/query?query={}&time={time:.3}",
            percent_encoded(promql)
        ));
        data["result"].as_array().cloned().unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn percent_encoded(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Every query of the shipped Grafana dashboard, with its panel's title, as Prometheus would get
/// it from Grafana with the job `rljob` of `namespace` and every pool selected.
fn dashboard_queries(rljob: &str, namespace: &str) -> Vec<(String, String)> {
    let dashboard: Value =
        serde_json::from_slice(&std::fs::read(monitoring_file("grafana-dashboard.json")).unwrap())
            .unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            queries.push((
                panel["title"].as_str().unwrap().to_owned(),
                expr.replace("$pool", ".*")
                    .replace("$rljob", rljob)
                    .replace("$namespace", namespace)
                    .replace("$__rate_interval", "1m"),
            ));
        }
    }
    queries
}

#[test]
fn a_real_prometheus_scrapes_the_scheduler_runs_the_shipped_rules_and_answers_every_dashboard_query()
 {
    use rollfleet_proto::v1::{GpuReading, WorkerLoad};
    let dir = temp_dir("prometheus");
    let job = job_file(&dir, 5);
    // In a namespace, as the operator's jobs are: every series carries it.
    let yaml = std::fs::read_to_string(&job).unwrap();
    assert!(yaml.contains("\n  name: quickstart\n"));
    let yaml = yaml.replace(
        "\n  name: quickstart\n",
        "\n  name: quickstart\n  namespace: rl-team\n",
    );
    std::fs::write(&job, yaml).unwrap();
    let report = dir.join("report.json");
    let (mut sched, url) = start_scheduler(
        &job,
        &report,
        5,
        &["--metrics-addr", "127.0.0.1:0"],
        Stdio::piped(),
    );
    let sched_log = stderr_lines(&mut sched);
    let metrics = metrics_address(&sched_log);
    let mut procs = Procs(vec![sched]);
    let prometheus = Prometheus::start(&dir, &metrics);
    // Scraped before the job starts, so that every rate has samples on both sides of it.
    let start = Instant::now();
    loop {
        let targets = prometheus.api("/api/v1/targets");
        if targets["activeTargets"][0]["health"] == "up" {
            break;
        }
        assert!(start.elapsed() < DEADLINE, "never scraped: {targets:#}");
        std::thread::sleep(Duration::from_millis(200));
    }

    // A peer reading two GPUs (this machine has none), so that the GPU panels have series too.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let peer = {
        let (url, stop) = (url.clone(), stop.clone());
        std::thread::spawn(move || {
            rt().block_on(async {
                let mut client = WorkerServiceClient::connect(url).await.unwrap();
                let lease =
                    register_peer(&mut client, gpu_peer("NVIDIA H20", 103_079_215_104)).await;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let reading = |index, utilization| GpuReading {
                        index,
                        utilization,
                        memory_used_bytes: 60_000_000_000,
                    };
                    let beat = HeartbeatRequest {
                        worker_id: lease.worker_id.clone(),
                        epoch: 1,
                        load: Some(WorkerLoad {
                            gpus: vec![reading(0, 0.7), reading(1, 0.8)],
                            ..Default::default()
                        }),
                    };
                    if client.heartbeat(beat).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            });
        })
    };
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }

    // A time when trajectories had been trained for three scrapes (a rate needs two samples of
    // a series, and the staleness counters are born with the first trajectory trained): the
    // queries are evaluated at it, so the job may end (and its series go stale) before they are.
    let start = Instant::now();
    let at = loop {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let trained = prometheus.query(
            "min(count_over_time(rollfleet_trajectories_trained_by_staleness_total[1m])) >= 3",
            now,
        );
        if let Some(sample) = trained.first() {
            break sample["value"][0].as_f64().unwrap();
        }
        assert!(
            start.elapsed() < DEADLINE,
            "no trajectory trained was scraped"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    // A scrape mid-job passes Prometheus's own linter, histograms included, and every sample
    // names the job.
    let exposition = scrape(&metrics);
    let body = exposition.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let lint = promtool_check_metrics(body);
    assert_eq!(lint, "", "promtool check metrics:\n{lint}");
    assert_eq!(
        sample(&exposition, "rollfleet_job_phase{phase=\"Running\"}"),
        Some(1.0),
        "{body}"
    );
    for present in [
        "rollfleet_stage_duration_seconds_bucket{kind=\"decode\"",
        "rollfleet_stage_duration_seconds_bucket{kind=\"environment_step\"",
        "rollfleet_stage_queue_wait_seconds_bucket{kind=\"decode\"",
        "rollfleet_rl_step_duration_seconds_bucket{",
        "rollfleet_pool_busy_seconds_total{pool=\"decode\"",
        "rollfleet_build_info{version=",
        "process_cpu_seconds_total{",
        "process_resident_memory_bytes{",
        "process_open_fds{",
    ] {
        assert!(body.contains(present), "{present} not in {body}");
    }
    for line in body.lines().filter(|l| !l.starts_with('#')) {
        assert!(
            line.contains("rljob=\"quickstart\"") && line.contains("namespace=\"rl-team\""),
            "{line}"
        );
    }
    for (panel, expr) in dashboard_queries("quickstart", "rl-team") {
        let series = prometheus.query(&expr, at);
        assert!(
            !series.is_empty(),
            "panel {panel:?}: {expr} returned nothing"
        );
        if expr.contains("rollfleet_gpu_") {
            let text = Value::Array(series).to_string();
            assert!(text.contains("gpu-peer"), "panel {panel:?}: {text}");
        }
    }
    // Trained trajectories are within the job's staleness bound (maxStaleness 1).
    for series in prometheus.query("rollfleet_trajectories_trained_by_staleness_total", at) {
        let versions: u64 = series["metric"]["versions"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(versions <= 1, "{series}");
    }
    // Each pool's busy share, as the scheduler computed it.
    let pools: Vec<String> = prometheus
        .query("rollfleet_pool_busy_ratio", at)
        .iter()
        .map(|s| s["metric"]["pool"].as_str().unwrap().to_owned())
        .collect();
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        assert!(pools.iter().any(|p| p == pool), "{pool} not in {pools:?}");
    }

    // The shipped rules loaded and evaluated without an error, and the recording rules recorded.
    let start = Instant::now();
    loop {
        let groups = prometheus.api("/api/v1/rules")["groups"].clone();
        let rules: Vec<&Value> = groups
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["rules"].as_array().unwrap())
            .collect();
        assert_eq!(rules.len(), 15, "{groups:#}");
        for rule in &rules {
            assert_ne!(rule["health"], "err", "{rule:#}");
        }
        if rules.iter().all(|r| r["health"] == "ok") {
            break;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "rules never evaluated: {groups:#}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    for record in [
        "rollfleet:pool_busy_ratio:avg5m",
        "rollfleet:trajectories_trained:rate5m",
        "rollfleet:stage_completions:rate5m",
        "rollfleet:gpu_memory_used:ratio",
    ] {
        let recorded = prometheus.query(&format!("last_over_time({record}[5m])"), at + 5.0);
        assert!(!recorded.is_empty(), "{record} was never recorded");
    }

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    peer.join().unwrap();
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the scheduler failed: {status:?}");
    check_report(&report, 5, 0);

    // The job ended normally and its scheduler exited: Prometheus scraped its end before it
    // went, and the alert on a scheduler that stops answering holds its peace.
    let start = Instant::now();
    let now = loop {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        if !prometheus
            .query("up{job=\"rollfleet\"} == 0", now)
            .is_empty()
        {
            break now;
        }
        assert!(start.elapsed() < DEADLINE, "the exit was never scraped");
        std::thread::sleep(Duration::from_millis(200));
    };
    let ended = prometheus.query(
        "last_over_time(rollfleet_job_end_time_seconds{phase=\"Succeeded\", rljob=\"quickstart\", namespace=\"rl-team\"}[5m])",
        now,
    );
    assert_eq!(ended.len(), 1, "the end was not scraped: {ended:?}");
    let down = alert_expr("RollfleetSchedulerDown");
    let fired = prometheus.query(&down, now);
    assert!(fired.is_empty(), "{down} after a normal end: {fired:?}");
}

/// The expression of the shipped alert `name`.
fn alert_expr(name: &str) -> String {
    let rules: serde_yaml_ng::Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(monitoring_file("rollfleet-rules.yaml")).unwrap(),
    )
    .unwrap();
    let groups = rules["groups"].as_sequence().unwrap();
    let rule = groups
        .iter()
        .flat_map(|g| g["rules"].as_sequence().unwrap())
        .find(|r| r["alert"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no alert {name}"));
    rule["expr"].as_str().unwrap().to_owned()
}
