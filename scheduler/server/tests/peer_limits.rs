//! What a faulty or hostile worker can still make the scheduler keep: a scheduler served on
//! loopback (real gRPC, the job waiting for workers that never all come), and test peers that
//! flood it with load reports, report GPUs they never registered, or stop heartbeating.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::path::PathBuf;
use std::time::Duration;

use rollfleet_proto::v1::worker_service_client::WorkerServiceClient;
use rollfleet_proto::v1::{
    GpuDevice, GpuReading, GpuTelemetryInfo, HardwareInventory, HeartbeatRequest, Lease,
    ProfileKind, ProfileSample, RegisterRequest, WorkerHello, WorkerLoad, WorkerMessage,
    worker_message,
};
use rollfleet_server::ServerOptions;
use tonic::transport::Channel;

mod common;
use common::quickstart_yaml;

/// A scheduler serving the quick-start job on loopback until the test ends.
struct Scheduler {
    url: String,
    journal: PathBuf,
    _stop: tokio::sync::oneshot::Sender<()>,
    _dir: Dir,
}

/// A temporary folder, removed at the end.
struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn scheduler(name: &str, lease_ttl: Duration) -> Scheduler {
    let dir = std::env::temp_dir().join(format!("rollfleet-limits-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let journal = dir.join("journal");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let opts = ServerOptions {
        job_yaml: Some(quickstart_yaml()),
        origin: "quickstart.yaml".into(),
        seed: 7,
        time_scale: 1.0,
        lease_ttl,
        // The job never starts: only the peers' treatment is tested.
        expect_workers: 100,
        stage_timeout: Duration::from_secs(60),
        report: None,
        metrics_addr: None,
        replan_on_drift: None,
        token: None,
        journal: Some(journal.clone()),
        tls: None,
        tls_client_ca: None,
        journal_sync: false,
        until_stopped: false,
        weights_root: None,
        window_chooser: None,
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(rollfleet_server::serve_until(listener, opts, stopped));
    Scheduler {
        url,
        journal,
        _stop: stop,
        _dir: Dir(dir),
    }
}

async fn client(url: &str) -> WorkerServiceClient<Channel> {
    for _ in 0..100 {
        if let Ok(c) = WorkerServiceClient::connect(url.to_owned()).await {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the scheduler at {url} did not answer");
}

/// A decode node (H20s) with GPU telemetry for GPUs 0 and 1.
fn gpu_node(hostname: &str) -> HardwareInventory {
    let device = |index: u32| GpuDevice {
        index,
        name: "NVIDIA H20".into(),
        uuid: format!("GPU-test-{index}"),
        memory_bytes: 96 << 30,
    };
    HardwareInventory {
        hostname: hostname.into(),
        pool: "decode".into(),
        gpu_telemetry: Some(GpuTelemetryInfo {
            available: true,
            unavailable_reason: String::new(),
            devices: vec![device(0), device(1)],
        }),
        ..Default::default()
    }
}

async fn register(
    client: &mut WorkerServiceClient<Channel>,
    inventory: HardwareInventory,
) -> Lease {
    client
        .register(RegisterRequest {
            inventory: Some(inventory),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .lease
        .unwrap()
}

fn reading(index: u32) -> GpuReading {
    GpuReading {
        index,
        utilization: 0.5,
        memory_used_bytes: 1 << 30,
    }
}

fn beat(lease: &Lease, load: Option<WorkerLoad>) -> HeartbeatRequest {
    HeartbeatRequest {
        worker_id: lease.worker_id.clone(),
        epoch: lease.epoch,
        load,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_flooding_load_reports_has_most_dropped_before_the_journal_and_keeps_its_lease() {
    let s = scheduler("flood", Duration::from_secs(4)).await;
    let mut c = client(&s.url).await;
    let lease = register(&mut c, gpu_node("flooder")).await;
    let before = std::fs::metadata(&s.journal).unwrap().len();
    // The most a report may carry: a reading per registered GPU and 512 profile samples.
    let load = WorkerLoad {
        gpus: vec![reading(0), reading(1)],
        samples: vec![
            ProfileSample {
                kind: ProfileKind::Decode as i32,
                flops: 1.234_567e12,
                bytes: 9.876_543e9,
                seconds: 0.012_345,
                gpus: 1,
                emulated: true,
            };
            512
        ],
        ..Default::default()
    };
    let reports = 300;
    let started = tokio::time::Instant::now();
    for _ in 0..reports {
        c.heartbeat(beat(&lease, Some(load.clone()))).await.unwrap();
    }
    let took = started.elapsed();
    let grew = std::fs::metadata(&s.journal).unwrap().len() - before;
    let one = prost::Message::encoded_len(&load) as u64;
    // The burst and what the rate refills over the flood, with room for a slow machine.
    let allowed = 8 + (took.as_secs_f64() * 2.0).ceil() as u64 + 4;
    assert!(
        grew < allowed * one + reports * 200,
        "{reports} reports of {one} bytes in {took:?} grew the journal by {grew} bytes (at most \
         {allowed} reports should be journaled)"
    );
    // Still its lease: the dropped reports' heartbeats renewed it.
    c.heartbeat(beat(&lease, None)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_report_with_more_gpu_readings_than_the_worker_registered_is_refused_naming_the_field()
 {
    let s = scheduler("gpus", Duration::from_secs(4)).await;
    let mut c = client(&s.url).await;
    let lease = register(&mut c, gpu_node("liar")).await;
    // Three readings from a node that registered two GPUs (each reading names a declared GPU).
    let load = WorkerLoad {
        gpus: vec![reading(0), reading(1), reading(0)],
        ..Default::default()
    };
    let refused = c.heartbeat(beat(&lease, Some(load))).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(
        refused.message().starts_with("load.gpus: 3 readings")
            && refused.message().contains("registered (2)"),
        "{refused:?}"
    );
}

/// Opens a work stream with a hello for `worker_id`; the scheduler's answer to it.
async fn open_stream(
    client: &mut WorkerServiceClient<Channel>,
    worker_id: &str,
) -> Result<tonic::Streaming<rollfleet_proto::v1::SchedulerMessage>, tonic::Status> {
    let hello = WorkerMessage {
        message: Some(worker_message::Message::Hello(WorkerHello {
            worker_id: worker_id.to_owned(),
            epoch: 1,
        })),
    };
    // The stream stays open after the hello (a worker's does): the sender is leaked.
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(hello).unwrap();
    std::mem::forget(tx);
    client
        .work(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .map(tonic::Response::into_inner)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_peer_using_a_lease_without_its_secret_is_refused_permission_denied_naming_the_lease()
 {
    let s = scheduler("identity", Duration::from_secs(4)).await;
    let mut owner = client(&s.url).await;
    let lease = register(&mut owner, gpu_node("owner")).await;
    let (number, secret) = lease.worker_id.split_once('-').unwrap();
    let mut other = client(&s.url).await;
    let forged = format!("{number}-{}", "f".repeat(32));
    let refused = other
        .heartbeat(HeartbeatRequest {
            worker_id: forged.clone(),
            epoch: 1,
            load: None,
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(
        refused.message().contains(&format!("lease {number} "))
            && !refused.message().contains(secret),
        "{refused:?}"
    );
    let refused = open_stream(&mut other, &forged).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(
        refused.message().starts_with("hello.worker_id: lease "),
        "{refused:?}"
    );
    // The owner, on a new connection (as after a network blip), proves the lease is its own by
    // its id, and attaches.
    let mut again = client(&s.url).await;
    again.heartbeat(beat(&lease, None)).await.unwrap();
    open_stream(&mut again, &lease.worker_id).await.unwrap();
}
