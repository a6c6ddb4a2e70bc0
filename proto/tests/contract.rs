//! The generated contract works end to end: messages survive the wire, hostile bytes are
//! refused without a panic, and a generated client talks to a generated server over real
//! loopback TCP.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use prost::Message;
use rollfleet_proto::v1::{
    GenerationWork, GpuInventory, HardwareInventory, Lease, RegisterRequest, RegisterResponse,
    StageKind, TrajectoryId, WorkAssignment, hardware_inventory, work_assignment,
    worker_service_client::WorkerServiceClient,
    worker_service_server::{WorkerService, WorkerServiceServer},
};
use tonic::{Request, Response, Status};

fn assignment() -> WorkAssignment {
    WorkAssignment {
        assignment_id: 42,
        kind: StageKind::Decode as i32,
        trajectory: Some(TrajectoryId {
            job: "quickstart".into(),
            group: 7,
            index: 3,
            ..Default::default()
        }),
        turn: 2,
        policy_version: 5,
        work: Some(work_assignment::Work::Generation(GenerationWork {
            prompt_tokens: vec![1, 2, 3],
            max_new_tokens: 256,
            session: "quickstart/7/3".into(),
            cached_prefix_tokens: 1024,
            decode_only: true,
            ..Default::default()
        })),
        deadline_ms: 60_000,
        ..Default::default()
    }
}

#[test]
fn an_assignment_survives_encoding_and_decoding() {
    let original = assignment();
    let bytes = original.encode_to_vec();
    assert_eq!(WorkAssignment::decode(bytes.as_slice()).unwrap(), original);
}

#[test]
fn truncated_and_random_bytes_are_refused_without_panicking() {
    let bytes = assignment().encode_to_vec();
    for cut in 1..bytes.len() {
        // Every strict prefix either fails or decodes to something else; none may panic.
        if let Ok(decoded) = WorkAssignment::decode(&bytes[..cut]) {
            assert_ne!(decoded, assignment());
        }
    }
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    for _ in 0..10_000 {
        let noise: Vec<u8> = (0..64)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        let _ = WorkAssignment::decode(noise.as_slice());
    }
}

#[test]
fn a_policy_output_that_is_empty_is_not_an_absent_one() {
    use rollfleet_proto::v1::EnvStepWork;
    // Absent: the policy is emulated (a random legal move). Present but empty: a real engine
    // wrote nothing, which the environment judges as an (invalid) action.
    let absent = EnvStepWork {
        environment: "sokoban".into(),
        ..Default::default()
    };
    let empty = EnvStepWork {
        policy_output: Some(String::new()),
        ..absent.clone()
    };
    assert_ne!(absent.encode_to_vec(), empty.encode_to_vec());
    let decoded = EnvStepWork::decode(empty.encode_to_vec().as_slice()).unwrap();
    assert_eq!(decoded.policy_output.as_deref(), Some(""));
    let decoded = EnvStepWork::decode(absent.encode_to_vec().as_slice()).unwrap();
    assert_eq!(decoded.policy_output, None);
}

#[test]
fn a_load_without_gpu_readings_says_nothing_about_gpus() {
    use rollfleet_proto::v1::{GpuReading, WorkerLoad};
    let load = WorkerLoad {
        running_stages: 3,
        ..Default::default()
    };
    let decoded = WorkerLoad::decode(load.encode_to_vec().as_slice()).unwrap();
    assert_eq!(decoded.gpu_utilization, None, "absent, not zero");
    assert_eq!(decoded.gpu_memory_used_bytes, None);
    assert!(decoded.gpus.is_empty());
    let with = WorkerLoad {
        gpus: vec![GpuReading {
            index: 1,
            utilization: 0.0,
            memory_used_bytes: 0,
        }],
        ..load
    };
    // A real reading of an idle GPU (zeros) survives as a reading.
    let decoded = WorkerLoad::decode(with.encode_to_vec().as_slice()).unwrap();
    assert_eq!(decoded.gpus.len(), 1);
}

/// A server that grants every registration a lease, to check the generated plumbing.
struct LeaseGranter;

#[tonic::async_trait]
impl WorkerService for LeaseGranter {
    async fn register(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        let inventory = request
            .into_inner()
            .inventory
            .ok_or_else(|| Status::invalid_argument("inventory: required"))?;
        Ok(Response::new(RegisterResponse {
            lease: Some(Lease {
                worker_id: format!("{}/{}", inventory.pool, inventory.hostname),
                ttl_ms: 10_000,
                heartbeat_interval_ms: 2_000,
                epoch: 1,
            }),
            ..Default::default()
        }))
    }

    async fn heartbeat(
        &self,
        _: Request<rollfleet_proto::v1::HeartbeatRequest>,
    ) -> Result<Response<rollfleet_proto::v1::HeartbeatResponse>, Status> {
        Err(Status::unimplemented("not part of this test"))
    }

    type WorkStream = tokio_stream::Empty<Result<rollfleet_proto::v1::SchedulerMessage, Status>>;

    async fn work(
        &self,
        _: Request<tonic::Streaming<rollfleet_proto::v1::WorkerMessage>>,
    ) -> Result<Response<Self::WorkStream>, Status> {
        Err(Status::unimplemented("not part of this test"))
    }
}

#[tokio::test]
async fn a_generated_client_registers_with_a_generated_server_over_loopback() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(WorkerServiceServer::new(LeaseGranter))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let mut client = WorkerServiceClient::connect(format!("http://{address}"))
        .await
        .unwrap();

    let lease = client
        .register(RegisterRequest {
            inventory: Some(HardwareInventory {
                hostname: "node-1".into(),
                pool: "decode".into(),
                device: Some(hardware_inventory::Device::Gpu(GpuInventory {
                    product: "H20".into(),
                    count: 8,
                    memory_bytes: 96_000_000_000,
                    emulated: true,
                    interconnect_gbps: 900.0,
                    tensor_parallel: 1,
                })),
                backend: "emulated".into(),
                backend_version: String::new(),
                gpu_telemetry: None,
            }),
            requested_lease_ms: 10_000,
            previous_worker_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .lease
        .unwrap();
    assert_eq!(lease.worker_id, "decode/node-1");
    assert_eq!(lease.ttl_ms, 10_000);

    let refused = client
        .register(RegisterRequest::default())
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert_eq!(refused.message(), "inventory: required");
    server.abort();
}
