//! Peers that misbehave across real processes: a worker reporting a stage it was never given,
//! an environment answering with megabytes of text, a silent worker and garbage on the port;
//! none wedges a job or another worker. A scheduler told to stop while it plans a big job stops.
//!
//! Every wait is bounded by a generous deadline and polls a real condition (a status over gRPC,
//! a process exit), so the tests hold on a loaded two-core machine. The shared harness is
//! `common/runtime.rs`.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rollfleet_proto::v1::job_service_client::JobServiceClient;
use rollfleet_proto::v1::worker_service_client::WorkerServiceClient;
use rollfleet_proto::v1::{
    GpuInventory, HardwareInventory, HeartbeatRequest, JobRef, RegisterRequest, StageOutput,
    WorkResult, WorkerMessage, hardware_inventory, scheduler_message, work_result, worker_message,
};

#[path = "common/runtime.rs"]
mod harness;
use harness::*;

#[test]
fn a_worker_that_reports_a_stage_it_was_never_given_is_cut_off_and_its_work_redone() {
    let dir = temp_dir("rogue");
    let job = job_file(&dir, 2);
    let report = dir.join("report.json");
    let (sched, url) = scheduler(&job, &report, 7, &[]);
    let mut procs = Procs(vec![sched]);
    // Two of the seven workers are rogues: one in the environment pool takes an assignment, then
    // reports one it was never given; one in the reward pool reports its first assignment twice.
    let reasons = rt().block_on(async {
        let mut client = WorkerServiceClient::connect(url.clone()).await.unwrap();

        // Bad registrations are refused with the field named.
        let bad = client
            .register(RegisterRequest {
                inventory: Some(HardwareInventory {
                    pool: "no-such-pool".into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert!(bad.message().contains("inventory.pool"), "{bad:?}");
        // A node that declares more GPUs than its pool has, or another product.
        for (gpu, field) in [
            (
                GpuInventory {
                    count: 99,
                    ..Default::default()
                },
                "inventory.gpu.count",
            ),
            (
                GpuInventory {
                    product: "B200".into(),
                    count: 1,
                    ..Default::default()
                },
                "inventory.gpu.product",
            ),
        ] {
            let bad = client
                .register(RegisterRequest {
                    inventory: Some(HardwareInventory {
                        pool: "decode".into(),
                        device: Some(hardware_inventory::Device::Gpu(gpu)),
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .await
                .unwrap_err();
            assert!(bad.message().contains(field), "{bad:?}");
        }

        // The rogues register before the honest workers: the least-loaded rule breaks ties by
        // registration, so each rogue gets its pool's first assignment (rewards are few).
        let (envs, rewards) = tokio::join!(
            Rogue::attach(&url, "rogue", "envs"),
            Rogue::attach(&url, "echo", "rewards")
        );
        for pool in ["prefill", "decode", "train", "envs", "rewards"] {
            procs.0.push(worker(&url, pool, &format!("{pool}-0")));
        }
        tokio::join!(
            envs.lie(|first| vec![result_for(first + 1_000_000)]),
            rewards.lie(|first| vec![result_for(first), result_for(first)]),
        )
    });
    assert!(reasons.0.contains("never given"), "{reasons:?}");
    assert!(reasons.1.contains("reported already"), "{reasons:?}");
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the scheduler failed: {status:?}");
    let report = check_report(&report, 2, 2);
    let lost = report["workers_lost"].to_string();
    assert!(
        lost.contains("rogue") && lost.contains("never given"),
        "{lost}"
    );
    assert!(
        lost.contains("echo") && lost.contains("reported already"),
        "{lost}"
    );
}

/// A result with an empty output for assignment `id`.
fn result_for(id: u64) -> WorkerMessage {
    WorkerMessage {
        message: Some(worker_message::Message::Result(WorkResult {
            assignment_id: id,
            outcome: Some(work_result::Outcome::Output(StageOutput::default())),
            duration_us: 1,
        })),
    }
}

/// A test peer with an open work stream that misbehaves on request.
struct Rogue {
    client: WorkerServiceClient<tonic::transport::Channel>,
    worker_id: String,
    outbox: tokio::sync::mpsc::UnboundedSender<WorkerMessage>,
    inbound: tonic::Streaming<rollfleet_proto::v1::SchedulerMessage>,
    heartbeats: tokio::task::JoinHandle<()>,
}

impl Rogue {
    /// Registers in `pool`, opens its work stream and keeps its lease.
    async fn attach(url: &str, hostname: &str, pool: &str) -> Rogue {
        let mut client = WorkerServiceClient::connect(url.to_owned()).await.unwrap();
        let lease = register_peer(
            &mut client,
            HardwareInventory {
                hostname: hostname.into(),
                pool: pool.into(),
                ..Default::default()
            },
        )
        .await;
        let (outbox, inbound) = open_work_stream(&mut client, &lease).await;
        let mut hb = client.clone();
        let id = lease.worker_id.clone();
        let heartbeats = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let _ = hb
                    .heartbeat(HeartbeatRequest {
                        worker_id: id.clone(),
                        epoch: 1,
                        load: None,
                    })
                    .await;
            }
        });
        Rogue {
            client,
            worker_id: lease.worker_id,
            outbox,
            inbound,
            heartbeats,
        }
    }

    /// Serves as an environment worker until its stream ends, answering the first `huge` steps
    /// of the first trajectory it steps with an applied action of `bytes` bytes, and everything
    /// else as a small environment would. Returns how many huge answers it sent.
    async fn serve_env_with_huge_answers(mut self, huge: u32, bytes: usize) -> u32 {
        use rollfleet_proto::v1::work_assignment::Work;
        let mut target = None;
        let mut sent = 0;
        while let Ok(Some(m)) = self.inbound.message().await {
            let a = match m.message {
                Some(scheduler_message::Message::Assign(a)) => a,
                Some(scheduler_message::Message::Drain(_)) => break,
                _ => continue,
            };
            let traj = a.trajectory.as_ref().map_or(0, |t| t.id);
            let output = match &a.work {
                Some(Work::EnvStep(e))
                    if !e.reset && sent < huge && *target.get_or_insert(traj) == traj =>
                {
                    sent += 1;
                    StageOutput {
                        token_count: 60,
                        text: "x".repeat(bytes),
                        observation: "ok".into(),
                        ..Default::default()
                    }
                }
                Some(Work::EnvStep(e)) => StageOutput {
                    token_count: if e.reset { 200 } else { 60 },
                    done: !e.reset && a.turn >= 3,
                    text: "up".into(),
                    observation: "ok".into(),
                    ..Default::default()
                },
                Some(Work::Reward(_)) => StageOutput {
                    reward: 1.0,
                    ..Default::default()
                },
                _ => StageOutput::default(),
            };
            let result = WorkerMessage {
                message: Some(worker_message::Message::Result(WorkResult {
                    assignment_id: a.assignment_id,
                    outcome: Some(work_result::Outcome::Output(output)),
                    duration_us: 1,
                })),
            };
            if self.outbox.send(result).is_err() {
                break;
            }
        }
        self.heartbeats.abort();
        sent
    }

    /// Waits for its first assignment, then sends what `lie` makes of its id; returns why the
    /// scheduler closed its stream, after checking that its lease is gone too.
    async fn lie(mut self, lie: fn(u64) -> Vec<WorkerMessage>) -> String {
        let first = tokio::time::timeout(DEADLINE, async {
            loop {
                let m = self.inbound.message().await.unwrap().unwrap();
                if let Some(scheduler_message::Message::Assign(a)) = m.message {
                    return a.assignment_id;
                }
            }
        })
        .await
        .unwrap();
        for message in lie(first) {
            self.outbox.send(message).unwrap();
        }
        let end = tokio::time::timeout(DEADLINE, async {
            loop {
                match self.inbound.message().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => return "closed without a reason".to_owned(),
                    Err(status) => return status.message().to_owned(),
                }
            }
        })
        .await
        .unwrap();
        self.heartbeats.abort();
        let hb = self
            .client
            .heartbeat(HeartbeatRequest {
                worker_id: self.worker_id.clone(),
                epoch: 1,
                load: None,
            })
            .await
            .unwrap_err();
        assert_eq!(hb.code(), tonic::Code::NotFound);
        end
    }
}

#[test]
fn an_environment_answering_with_megabytes_of_text_fails_its_stages_and_no_worker_or_job_is_wedged()
{
    let dir = temp_dir("huge-env");
    let job = job_file(&dir, 2);
    let report = dir.join("report.json");
    let (sched, url, log) = scheduler_with_log(&job, &report, 6);
    let mut procs = Procs(vec![sched]);
    // The hostile environment registers first, so that it is given the first episodes. Two of
    // its answers carry 2.2 MB each: kept, the episode's history (resent with every step) would
    // pass the 4 MiB a worker takes, and every worker it went to would die on it.
    let (attached, is_attached) = std::sync::mpsc::channel();
    let rogue = {
        let url = url.clone();
        std::thread::spawn(move || {
            rt().block_on(async {
                let rogue = Rogue::attach(&url, "huge", "envs").await;
                attached.send(()).unwrap();
                rogue.serve_env_with_huge_answers(2, 2_200_000).await
            })
        })
    };
    is_attached.recv().unwrap();
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        procs.0.push(worker(&url, pool, &format!("{pool}-0")));
    }
    let status = wait_exit(&mut procs.0[0], DEADLINE);
    assert!(status.success(), "the scheduler failed: {status:?}");
    assert_eq!(rogue.join().unwrap(), 2, "the hostile answers were sent");
    let report = check_report(&report, 2, 0);
    assert_eq!(
        report["workers_lost"],
        serde_json::json!([]),
        "no worker died or was cut off for an environment's answer: {report:#}"
    );
    let lines: Vec<String> = log.try_iter().collect();
    let refused = lines
        .iter()
        .filter(|l| l.contains("bytes of text") && l.contains("over its budget of 131072 bytes"))
        .count();
    assert_eq!(refused, 2, "each huge answer failed its stage, saying why");
    // The honest workers are still alive, and leave with the job.
    for worker in &mut procs.0[1..] {
        assert!(wait_exit(worker, DEADLINE).success());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The quick-start job with 200 more GPU pools of assorted sizes: valid, and a minute or more
/// of planning (the search grows with every pool).
fn slow_to_plan_job(dir: &Path) -> PathBuf {
    let path = job_file(dir, 1);
    add_gpu_pools(&path, 200);
    path
}

#[test]
fn a_scheduler_told_to_stop_while_it_plans_a_big_job_exits_within_seconds_with_its_normal_code() {
    let dir = temp_dir("stop-planning");
    let job = slow_to_plan_job(&dir);
    let child = Command::new(BIN)
        .arg("scheduler")
        .arg(&job)
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut procs = Procs(vec![child]);
    // Well into the planning (a plan of this job takes minutes).
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        procs.0[0].try_wait().unwrap().is_none(),
        "the scheduler ended before it was told to stop"
    );
    let pid = procs.0[0].id().to_string();
    let signalled = Instant::now();
    let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(sent.success());
    let status = wait_exit(&mut procs.0[0], Duration::from_secs(20));
    let took = signalled.elapsed();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut procs.0[0].stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(0), "{status:?}: {stderr}");
    assert!(
        took < Duration::from_secs(5),
        "it took {took:?} to stop: {stderr}"
    );
    assert!(stderr.contains("stopped while planning"), "{stderr}");
}

#[test]
fn a_silent_worker_loses_its_lease_and_garbage_on_the_port_harms_nothing() {
    let dir = temp_dir("silent");
    let job = job_file(&dir, 1);
    let report = dir.join("report.json");
    // The job never starts (it waits for 100 workers): only the peers' treatment is tested.
    let (sched, url) = scheduler(&job, &report, 100, &[]);
    let _procs = Procs(vec![sched]);
    let addr = url.trim_start_matches("http://").to_owned();
    // Garbage bytes where HTTP/2 is expected.
    {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(b"\x00\xffthis is not HTTP/2 at all\r\n\r\n\x16\x03\x01")
            .unwrap();
    }
    // A connection that says nothing at all: the scheduler gives it up (within 10 s of it
    // opening), rather than holding it for good.
    let silent = std::net::TcpStream::connect(&addr).unwrap();
    let opened = Instant::now();
    rt().block_on(async {
        let mut client = WorkerServiceClient::connect(url.clone()).await.unwrap();
        // A hostile 100 KB name is refused with the field named and the name cut short: echoed
        // whole, the error overflowed the client's HTTP/2 header limit (found by fuzzing).
        let long = "x".repeat(100_000);
        let refused = client
            .register(RegisterRequest {
                inventory: Some(HardwareInventory {
                    pool: long.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(
            refused
                .message()
                .starts_with("inventory.pool: job quickstart has no pool \"xxx")
                && refused.message().contains("... (100000 bytes)"),
            "{refused:?}"
        );
        // A hostname with a newline (it would forge a log line) is refused, quoted escaped.
        let forged = client
            .register(RegisterRequest {
                inventory: Some(HardwareInventory {
                    pool: "decode".into(),
                    hostname: "node\nscheduler: job quickstart ends".into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(forged.code(), tonic::Code::InvalidArgument, "{forged:?}");
        assert!(
            forged.message().starts_with("inventory.hostname: ")
                && !forged.message().contains('\n'),
            "{forged:?}"
        );
        let mut jobs = JobServiceClient::connect(url.clone()).await.unwrap();
        let unknown = jobs.status(JobRef { job: long.clone() }).await.unwrap_err();
        assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");
        assert!(unknown.message().len() < 300, "{unknown:?}");
        // A submitted job that is not valid is told why; a valid one that is another job is
        // refused as such (this scheduler runs the one it was started with).
        let submit = |job_yaml: String| rollfleet_proto::v1::SubmitJobRequest {
            job_yaml,
            request_id: String::new(),
            job_dir: String::new(),
        };
        let invalid = jobs.submit(submit("spec: [".into())).await.unwrap_err();
        assert_eq!(invalid.code(), tonic::Code::InvalidArgument, "{invalid:?}");
        assert!(invalid.message().starts_with("job_yaml: "), "{invalid:?}");
        // A directory for its CSV paths must be absolute: a relative one would be the
        // scheduler's, not the submitter's.
        let relative = rollfleet_proto::v1::SubmitJobRequest {
            job_dir: "jobs/here".into(),
            ..submit("name: j\n".into())
        };
        let invalid = jobs.submit(relative).await.unwrap_err();
        assert_eq!(invalid.code(), tonic::Code::InvalidArgument, "{invalid:?}");
        assert!(invalid.message().starts_with("job_dir: "), "{invalid:?}");
        // A problem that quotes a 100 KB name is cut short (an error travels in a header).
        let yaml = std::fs::read_to_string(&job).unwrap();
        assert!(yaml.contains("name: quickstart"));
        let long_name = yaml.replace(
            "name: quickstart",
            &format!("name: {}", "X".repeat(100_000)),
        );
        let invalid = jobs.submit(submit(long_name)).await.unwrap_err();
        assert_eq!(invalid.code(), tonic::Code::InvalidArgument, "{invalid:?}");
        assert!(invalid.message().contains("metadata.name"), "{invalid:?}");
        assert!(invalid.message().ends_with("more bytes)"), "{invalid:?}");
        let other = jobs
            .submit(submit(yaml.replace("steps: 1", "steps: 2")))
            .await
            .unwrap_err();
        assert_eq!(other.code(), tonic::Code::FailedPrecondition, "{other:?}");
        let lease = register_peer(
            &mut client,
            HardwareInventory {
                hostname: "silent".into(),
                pool: "envs".into(),
                ..Default::default()
            },
        )
        .await;
        assert_eq!(lease.ttl_ms, 2000);
        // A lease id is a capability: its number alone, or with another secret, is refused as
        // another worker's lease, named by its number only.
        let (number, secret) = lease.worker_id.split_once('-').unwrap();
        assert_eq!(secret.len(), 32, "128 random bits: {}", lease.worker_id);
        for guess in [number.to_owned(), format!("{number}-{}", "0".repeat(32))] {
            let refused = client
                .heartbeat(HeartbeatRequest {
                    worker_id: guess.clone(),
                    epoch: 1,
                    load: None,
                })
                .await
                .unwrap_err();
            assert_eq!(
                refused.code(),
                tonic::Code::PermissionDenied,
                "{guess}: {refused:?}"
            );
            assert!(
                refused.message().contains(&format!("lease {number} "))
                    && !refused.message().contains(secret),
                "{guess}: {refused:?}"
            );
        }
        // A first message that is not a hello is refused.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(WorkerMessage {
            message: Some(worker_message::Message::Load(Default::default())),
        })
        .unwrap();
        let refused = client
            .work(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap_err();
        assert!(refused.message().contains("WorkerHello"), "{refused:?}");
        // A heartbeat within the lease renews it.
        let beat = || HeartbeatRequest {
            worker_id: lease.worker_id.clone(),
            epoch: 1,
            load: None,
        };
        client.heartbeat(beat()).await.unwrap();
        // A load report of 50,000 GPU readings is refused before the scheduler keeps any of it.
        let flood = HeartbeatRequest {
            load: Some(rollfleet_proto::v1::WorkerLoad {
                gpus: vec![Default::default(); 50_000],
                ..Default::default()
            }),
            ..beat()
        };
        let refused = client.heartbeat(flood).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().starts_with("load.gpus: 50000 readings"),
            "{refused:?}"
        );
        // Then silence, twice the lease: the worker is declared lost, and the lease is gone.
        tokio::time::sleep(Duration::from_millis(2 * lease.ttl_ms)).await;
        let late = client.heartbeat(beat()).await.unwrap_err();
        assert_eq!(late.code(), tonic::Code::NotFound, "{late:?}");
    });
    {
        use std::io::Read;
        silent
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        // Whatever the server says first (its HTTP/2 settings, a goodbye), then the end.
        let closed = loop {
            match (&silent).read(&mut [0u8; 256]) {
                Ok(n) if n > 0 => continue,
                other => break other,
            }
        };
        assert!(
            matches!(closed, Ok(0))
                || closed
                    .as_ref()
                    .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
            "the silent connection was not closed: {closed:?}"
        );
        assert!(
            opened.elapsed() < Duration::from_secs(18),
            "{:?}",
            opened.elapsed()
        );
    }
}
