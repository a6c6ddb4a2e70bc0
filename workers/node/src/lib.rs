//! The node worker: one daemon per node that registers with the scheduler, holds its lease with
//! heartbeats, and runs the assignments that arrive on its work stream.
//!
//! What it runs depends on its pool, as the job (sent back on registration) defines it:
//! - **GPU pools**, with the default [`EngineChoice::Emulated`]: each inference replica the
//!   scheduler places on this node is an [`EmulatedEngine`] (the simulator's roofline on the
//!   scaled real clock; no GPU is used and every output says `emulated`). Generated tokens are
//!   synthetic; how many is drawn from the task's `actionTokens` distribution, seeded per
//!   trajectory and turn, as the simulator draws it.
//! - **GPU pools**, with [`EngineChoice::OpenAi`]: every replica placed on this node is served by
//!   one real engine behind the OpenAI completions API (vLLM, SGLang), through
//!   [`OpenAiEngine`]. The scheduler sends the turn's whole context as text (rendered by the
//!   agent's prompt template); the engine's text goes back in the result, and the scheduler
//!   relays it to the environment step.
//! - In both cases the trainer is emulated: a batch takes the simulator's training time.
//! - **CPU pools**: real environments from `agents/` on the [`EnvHost`] (slots, deadlines, crash
//!   isolation). When the step carries the policy's text (`EnvStepWork.policy_output`, from a
//!   real engine), the action is extracted from it as the agent loop does; an action the
//!   environment cannot parse is an invalid action by its rules. When it does not (the emulated
//!   policy writes no meaningful text), the action applied is a random legal move of that
//!   environment, seeded per trajectory and turn. Either way the action applied is returned to
//!   the scheduler so that any worker can rebuild the episode by replay.
//! - **Serverless pools**: the reward functions of `serverless/rewards`, called in process (the
//!   code AWS Lambda would run through the custom runtime).
//!
//! An abort from the scheduler aborts the task running the assignment, which drops the engine
//! request (freeing its KV) or the environment call. An interrupt (its replica is due for new
//! weights) stops a generation where it is and reports the tokens it had, marked `interrupted`:
//! the emulated engine and SGLang can stop one request; other engines finish it.
//!
//! **Telemetry**: at start-up the worker reads the node's GPUs through NVML
//! ([`rollfleet_gpu`]). Where a driver exists, it says so at registration
//! (`HardwareInventory.gpu_telemetry`, with the devices) and sends a reading per GPU with every
//! heartbeat. Where none exists, it says why once (a log line, and the reason in the
//! registration), and its heartbeats carry no GPU figures: absent, never zero.

pub mod token_engine;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rollfleet_core::rng::SplitMix64;
use rollfleet_engine::emulated::{EmulatedConfig, EmulatedEngine};
use rollfleet_engine::openai::{OpenAiConfig, OpenAiEngine, WeightUpdate};
use rollfleet_engine::{Engine, EngineError, GenerateEvent, GenerateRequest, Prompt};
use rollfleet_envhost::{EnvHost, EpisodeId, Factory, HostConfig};
use rollfleet_fleet::hardware::{ModelCosts, WorkKind};
use rollfleet_fleet::plan::{JobPlan, PoolRole};
use rollfleet_proto::auth::{AuthChannel, ClientAuth, Token};
use rollfleet_proto::v1::{
    GenerationWork, GpuDevice, GpuInventory, GpuReading, GpuTelemetryInfo, HardwareInventory,
    HeartbeatRequest, ProfileKind, ProfileSample, RegisterRequest, SchedulerMessage, StageFailure,
    StageOutput, WorkAssignment, WorkResult, WorkerHello, WorkerLeaving, WorkerLoad, WorkerMessage,
    hardware_inventory, scheduler_message, stage_failure::Cause, work_assignment::Work,
    work_result, worker_message, worker_service_client::WorkerServiceClient,
};
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

mod execute;
mod openai;
mod options;
mod report;
mod session;
mod synthetic;

use execute::{Interrupt, Running, engine_failure, failure};
use openai::{OpenAiBackend, generate_openai, openai_backend, tokens_of, weight_sync_openai};
use options::env_host;
pub use options::{EngineChoice, WorkerOptions};
pub use report::gpu_telemetry;
use report::{DecodeTiming, InFlight, MAX_SAMPLES_PER_REPORT, add_gpu_readings};
pub use session::run;
pub use synthetic::emulated_action;
use synthetic::{synthetic_ids, synthetic_tokens};

/// Why a worker stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The scheduler could not be reached.
    #[error("scheduler {url}: {reason}")]
    Connect {
        /// Its address.
        url: String,
        /// What happened.
        reason: String,
    },
    /// The scheduler refused or broke the conversation.
    #[error("scheduler refused: {0}")]
    Refused(String),
    /// The job the scheduler sent could not be planned.
    #[error("the scheduler's job: {0}")]
    Plan(#[from] rollfleet_fleet::PlanError),
    /// The LLM engine could not be set up.
    #[error("engine: {0}")]
    Engine(String),
}

/// How a worker ended without error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerExit {
    /// The scheduler said the job is over (drain).
    Drained,
    /// The scheduler closed the stream.
    Closed,
}

struct Node {
    plan: JobPlan,
    pool: u32,
    time_scale: f64,
    engines: Mutex<BTreeMap<u64, Arc<EmulatedEngine>>>,
    /// Replicas a re-plan started on this node mid-run (the job's own placement has the rest).
    started_replicas: Mutex<BTreeMap<u64, rollfleet_core::ReplicaConfig>>,
    /// Share of the modelled rates its emulated GPUs achieve.
    slowdown: f64,
    openai: Option<Arc<OpenAiBackend>>,
    tokens: Option<Arc<token_engine::TokenBackend>>,
    host: EnvHost,
    episodes: Mutex<BTreeMap<(u64, u32), (EpisodeId, usize)>>,
    slots: usize,
    rewards: rollfleet_rewards::Handler,
    model_environments: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::execute::env_failure;

    #[test]
    fn an_environment_refused_for_its_configuration_is_invalid_and_a_crash_is_infrastructure() {
        use rollfleet_envhost::HostError;
        use rollfleet_environments::EnvError;
        let cause = |outcome: work_result::Outcome| match outcome {
            work_result::Outcome::Failure(f) => (f.cause(), f.message),
            other => panic!("not a failure: {other:?}"),
        };
        let unknown = HostError::UnknownEnvironment {
            kind: "webshop".into(),
            known: vec!["sokoban".into()],
        };
        let (c, message) = cause(env_failure("webshop", unknown));
        assert_eq!(c, Cause::Invalid);
        assert!(
            message.contains("unknown environment \"webshop\""),
            "{message}"
        );
        assert!(message.contains("--remote-env webshop=URL"), "{message}");
        let refused = HostError::Environment {
            episode: 3,
            error: EnvError::InvalidConfig(
                "http://127.0.0.1:9: HTTP 404: unknown_environment: 'wordle'".into(),
            ),
        };
        let (c, message) = cause(env_failure("wordle", refused));
        assert_eq!(c, Cause::Invalid);
        assert!(message.starts_with("environment \"wordle\": "), "{message}");
        assert!(message.contains("unknown_environment"), "{message}");
        for infrastructure in [
            HostError::Infrastructure {
                episode: 4,
                reason: "the environment panicked".into(),
            },
            HostError::NoFreeSlot(8),
            HostError::UnknownEpisode(5),
            HostError::Environment {
                episode: 6,
                error: EnvError::NotRunning,
            },
        ] {
            let (c, _) = cause(env_failure("sokoban", infrastructure));
            assert_eq!(c, Cause::Infrastructure);
        }
    }

    #[test]
    fn readings_fill_the_load_and_no_reading_leaves_every_gpu_field_absent() {
        let mut load = WorkerLoad::default();
        add_gpu_readings(&mut load, &[]);
        assert_eq!(load, WorkerLoad::default(), "no reading: absent, not zero");

        let sample = |index, utilization, memory_used_bytes| rollfleet_gpu::GpuSample {
            index,
            utilization,
            memory_used_bytes,
        };
        add_gpu_readings(&mut load, &[sample(0, 0.5, 100), sample(3, 1.0, 300)]);
        assert_eq!(load.gpus.len(), 2);
        assert_eq!(
            (load.gpus[1].index, load.gpus[1].utilization),
            (3, 1.0),
            "indices are the driver's"
        );
        assert_eq!(load.gpu_utilization, Some(0.75));
        assert_eq!(load.gpu_memory_used_bytes, Some(400.0));
    }

    /// This project's machines have no NVIDIA driver; on one that has, the devices are listed.
    #[test]
    fn the_node_says_whether_it_has_gpu_telemetry_and_why_not() {
        let (info, reader) = gpu_telemetry();
        if info.available {
            assert!(reader.is_some() && !info.devices.is_empty());
            assert!(info.unavailable_reason.is_empty());
        } else {
            assert!(reader.is_none() && info.devices.is_empty());
            assert!(
                info.unavailable_reason.contains("NVML")
                    || info.unavailable_reason.contains("no GPU"),
                "{}",
                info.unavailable_reason
            );
        }
    }

    #[test]
    fn a_streamed_answer_gives_one_decode_sample_at_the_batch_in_flight() {
        let costs = ModelCosts {
            flops_per_token: 3e9,
            attention_flops_per_context: 1e5,
            active_weight_bytes: 3e9,
            weight_reads: rollfleet_spec::WeightReads::dense(3e9),
            kv_bytes_per_token: 3e4,
        };
        let start = tokio::time::Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut timing = DecodeTiming::default();
        timing.chunk(at(0), 1);
        assert!(
            timing.sample(&costs, 100, 5, 2).is_none(),
            "one chunk times no iteration"
        );
        timing.chunk(at(20), 3);
        timing.chunk(at(40), 2);
        // 5 tokens: the 4 after the first came over 40 ms, 10 ms an iteration; the batch is the
        // mean of 1, 3 and 2 requests in flight; the context the prompt plus half the answer.
        let s = timing.sample(&costs, 100, 5, 2).unwrap();
        assert!((s.seconds - 0.010).abs() < 1e-12, "{}", s.seconds);
        let (batch, context) = (2.0, 102.5);
        assert!((s.flops - batch * (3e9 + 1e5 * context)).abs() < 1.0);
        assert!((s.bytes - (3e9 + 3e4 * batch * context)).abs() < 1.0);
        assert_eq!((s.gpus, s.emulated), (2, false));
        assert_eq!(s.kind, ProfileKind::Decode as i32);
        assert!(
            timing.sample(&costs, 100, 1, 2).is_none(),
            "one token, no iteration"
        );
    }
}
