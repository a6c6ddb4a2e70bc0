//! The scheduler actor: the one task that owns the sans-IO core and every book about workers.
//!
//! gRPC handlers never touch the core; they send an [`Event`] to the actor's inbox and, where
//! they need an answer, wait on a oneshot. The actor feeds facts to the core with the wall clock
//! (nanoseconds since the job started), turns the core's commands into `WorkAssignment`s on the
//! right worker's stream, wakes the core when `poll_timeout` says, and expires leases.
//!
//! What keeps "no trajectory lost, none delivered twice" across worker failures:
//! - every assignment is booked on exactly one worker; a worker reports only against its own
//!   bookings (anything else cuts it off);
//! - a worker that is lost (stream gone, lease expired, cut off) has every booking undone: its
//!   replicas are reported lost to the core (which re-dispatches their stages) and handed to
//!   another worker of the pool, its CPU and serverless stages are reported failed (retried,
//!   never scored), and a training batch it held goes to another trainer;
//! - the core itself ignores reports about stages it no longer expects.
//!
//! With a journal (`--journal`, [`crate::journal`]), every event is recorded with its time before
//! the actor acts on it, and the actor reads no clock in the middle of a decision (each event's
//! handling sees the one time `at` it was taken at): a scheduler restarted on the journal
//! replays it into the same state, then loses the killed scheduler's workers as above.
//!
//! When a GPU pool's nodes come or go mid-run so that the GPUs present differ from the ones the
//! running plan was made for, the planner plans again ([`crate::replan`]): replicas on a lost
//! node are retired (their GPUs are gone), and the run moves to the new plan in waves, each
//! starting replicas on free GPUs (`ReplicaStart` to the node, `ReplicaAdded` to the core) before
//! retiring others, so rollout never stops as a whole. A lost node whose GPUs a spare of the pool
//! covers is not a change: its replicas move to the spare as they are.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rollfleet_core::{
    BatchId, Command, Core, Input, ReplicaConfig, ReplicaId, ServeRole, StageCommand, StageId,
    StageOutcome, StageWork, Time, TrajId,
};
use rollfleet_fleet::hardware::Meter;
use rollfleet_fleet::migration::MigrationWave;
use rollfleet_proto::v1::{
    CompletedTrajectory, EnvStepWork, GenerationWork, GpuTelemetryInfo, HardwareInventory,
    HeartbeatResponse, JobPhase, JobStatus, JournalDetach, JournalHeartbeat, JournalMessage,
    JournalRecord, JournalRegister, Lease, PoolStatus, PublicationAnswer, PublishWeights,
    RegisterResponse, ReplicaStart, RewardWork, SchedulerMessage, Segment, StageKind, TrainWork,
    TrajectoryId, Turn, WeightSyncWork, WorkAssignment, WorkResult, WorkerHello, WorkerLoad,
    WorkerMessage, hardware_inventory::Device, journal_record, scheduler_message, work_assignment,
    work_result, worker_message,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tonic::Status;

use crate::feed::FeedLog;
use crate::journal::{JournalError, JournalReader, JournalWriter};
use crate::metrics::Metrics;
use crate::plan::{JobPlan, PoolRole, episode_seed};
use crate::replan::Replanner;
use crate::tokens::{PolicyInput, TurnTokens, feed_turn, token_context};
use rollfleet_planner::replan::{Drift, Settle, Settling};

/// Logs a line, except while a journal is replayed (the scheduler that wrote it logged it then).
macro_rules! log {
    ($actor:expr, $($arg:tt)*) => {
        if !$actor.replaying {
            tracing::info!($($arg)*)
        }
    };
}

/// The sending half of a worker's work stream.
pub type Outbox = mpsc::UnboundedSender<Result<SchedulerMessage, Status>>;

/// Where a worker's assignments go: its stream, or nowhere for a worker of a replayed journal
/// (its stream died with the scheduler that wrote the journal).
enum Sink {
    Stream(Outbox),
    Replayed,
}

impl Sink {
    /// Whether the message went. A replayed stream takes everything: when a send failed live,
    /// the worker's detach that followed is in the journal, and is replayed in its place.
    fn send(&self, message: Result<SchedulerMessage, Status>) -> bool {
        match self {
            Sink::Stream(outbox) => outbox.send(message).is_ok(),
            Sink::Replayed => true,
        }
    }
}

/// What the actor takes next: an event from the handlers, or one of its own timers.
// A step lives on the stack for the one event it carries; boxing it would allocate per message.
#[allow(clippy::large_enum_variant)]
enum Step {
    Event(Event),
    /// The core's timer fired.
    Wake,
    /// The periodic tick: leases, drift, meters.
    Tick,
    /// This actor replayed a journal: every worker of the scheduler that wrote it is gone.
    Recovered,
}

/// What the gRPC handlers tell the actor.
pub enum Event {
    /// `WorkerService.Register`.
    Register {
        /// What the node offers.
        inventory: HardwareInventory,
        /// The random part of the lease id to give it (drawn outside the actor, journaled, so
        /// that a replay gives the same lease).
        secret: String,
        /// The SHA-256 of the client certificate it presented (mutual TLS), if any: its lease
        /// is then bound to that certificate.
        identity: Option<[u8; 32]>,
        /// The answer.
        reply: oneshot::Sender<Result<RegisterResponse, Status>>,
    },
    /// `WorkerService.Heartbeat`.
    Heartbeat {
        /// Who.
        worker_id: String,
        /// Its lease epoch.
        epoch: u64,
        /// Its load, with GPU telemetry where it has any.
        load: Option<WorkerLoad>,
        /// The SHA-256 of the client certificate of the call, if any.
        identity: Option<[u8; 32]>,
        /// The answer.
        reply: oneshot::Sender<Result<HeartbeatResponse, Status>>,
    },
    /// A work stream opened with a `WorkerHello`.
    Attach {
        /// Who.
        worker_id: String,
        /// Its lease epoch.
        epoch: u64,
        /// Where its assignments go.
        outbox: Outbox,
        /// The SHA-256 of the client certificate of the stream, if any.
        identity: Option<[u8; 32]>,
        /// The worker's number, for the reader task's later events.
        reply: oneshot::Sender<Result<u64, Status>>,
    },
    /// A message on an attached stream.
    Message {
        /// The worker's number.
        worker: u64,
        /// What it said.
        message: WorkerMessage,
        /// When the stream reader took it off the wire.
        received: Instant,
    },
    /// A stream ended or broke.
    Detach {
        /// The worker's number.
        worker: u64,
        /// Why.
        reason: String,
    },
    /// `JobService.Cancel`.
    Cancel,
    /// A trainer subscribed to the feed for the first time.
    FeedSubscribed,
    /// An external trainer published weights (its `uri` already checked by the feed).
    Publish {
        /// What it published.
        publish: PublishWeights,
        /// The answer, for the trainer's feed stream.
        reply: oneshot::Sender<PublicationAnswer>,
    },
}

/// How long a subscribed trainer has after the end to acknowledge the rest of the feed.
const FEED_GRACE: Duration = Duration::from_secs(30);

/// Events taken (and journaled) together, at most.
const MAX_BATCH: usize = 64;

/// Events the server's gRPC handlers may have waiting for the actor ([`Inbox`]): a handler that
/// finds it full waits for room (its peer's stream stops being read, and HTTP/2 flow control
/// holds the peer back) rather than dropping what it accepted. Four batches: the actor takes
/// [`MAX_BATCH`] at a time.
pub const INBOX_CAPACITY: usize = 4 * MAX_BATCH;

/// Load reports a worker may have taken per second on average, at least ([`LoadLimit`]).
const LOAD_REPORTS_PER_SECOND: f64 = 2.0;
/// Load reports a worker may send in a row before [`LOAD_REPORTS_PER_SECOND`] applies.
const LOAD_REPORT_BURST: f64 = 8.0;

/// The actor's inbox: bounded, as the server makes it ([`INBOX_CAPACITY`]), or unbounded, for a
/// test that drives the actor with events of its own.
pub enum Inbox {
    /// What the server's handlers send to.
    Bounded(mpsc::Receiver<Event>),
    /// For tests.
    Unbounded(mpsc::UnboundedReceiver<Event>),
}

impl From<mpsc::Receiver<Event>> for Inbox {
    fn from(r: mpsc::Receiver<Event>) -> Inbox {
        Inbox::Bounded(r)
    }
}

impl From<mpsc::UnboundedReceiver<Event>> for Inbox {
    fn from(r: mpsc::UnboundedReceiver<Event>) -> Inbox {
        Inbox::Unbounded(r)
    }
}

impl Inbox {
    async fn recv(&mut self) -> Option<Event> {
        match self {
            Inbox::Bounded(r) => r.recv().await,
            Inbox::Unbounded(r) => r.recv().await,
        }
    }

    fn try_recv(&mut self) -> Option<Event> {
        match self {
            Inbox::Bounded(r) => r.try_recv().ok(),
            Inbox::Unbounded(r) => r.try_recv().ok(),
        }
    }
}

/// A worker's load reports, limited by a token bucket: [`LOAD_REPORT_BURST`] in a row, then one
/// per half heartbeat interval (at least [`LOAD_REPORTS_PER_SECOND`] a second). An honest worker
/// reports once per heartbeat and never meets it.
///
/// A report over the limit is dropped before it is journaled (a heartbeat that carried it still
/// renews the lease), not refused: only the latest load matters to the gauges, the profile
/// samples are a statistical estimate that a peer reporting slower would not have sent either,
/// and refusing would cut off a worker whose reports merely bunched up behind a slow network.
struct LoadLimit {
    tokens: f64,
    /// On the job's clock (wall time, live).
    refilled: Duration,
}

impl LoadLimit {
    fn new(now: Duration) -> LoadLimit {
        LoadLimit {
            tokens: LOAD_REPORT_BURST,
            refilled: now,
        }
    }

    /// Whether a report at `now` is within the limit (taking its token when it is).
    fn take(&mut self, now: Duration, per_second: f64) -> bool {
        let elapsed = now.saturating_sub(self.refilled).as_secs_f64();
        self.refilled = self.refilled.max(now);
        self.tokens = (self.tokens + elapsed * per_second).min(LOAD_REPORT_BURST);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Lost or released workers the report names, at most; the rest are counted.
const MAX_WORKERS_LISTED: usize = 1000;

/// Adds `entry` to a report's list of workers, unless it holds [`MAX_WORKERS_LISTED`] already
/// (`total` counts it either way).
fn listed(list: &mut Vec<String>, total: &mut usize, entry: String) {
    *total += 1;
    if list.len() < MAX_WORKERS_LISTED {
        list.push(entry);
    }
}

/// A report's list of workers, with a last line counting those it does not name.
fn unlisted(list: &[String], total: usize) -> Vec<String> {
    let mut all = list.to_vec();
    if total > list.len() {
        all.push(format!("{} more not listed", total - list.len()));
    }
    all
}

/// Dispatch latencies kept for the report, at most.
const MAX_LATENCY_SAMPLES: usize = 4_000_000;

/// How long a replica whose weight update failed stays out of service before it is updated
/// again; each failure in a row doubles it, up to [`UPDATE_RETRY_MAX`]. An engine that cannot
/// load weights is retried at a bounded pace instead of in a loop.
const UPDATE_RETRY_FIRST: Duration = Duration::from_secs(1);
const UPDATE_RETRY_MAX: Duration = Duration::from_secs(60);
/// The least time a training batch or a weight update may run before it is taken for hung
/// (the stage timeout, when longer, is the bound).
const HUNG_AFTER_AT_LEAST: Duration = Duration::from_secs(600);

/// Bytes of environment text (its observations and applied actions) a trajectory may hold per
/// token of its task's `contextLimit`: far above what text takes per token (about 4 bytes in
/// English), so an honest environment never meets it.
const TEXT_BYTES_PER_CONTEXT_TOKEN: u64 = 32;

/// Bytes of environment text a trajectory may hold whatever its context: its history travels in
/// every environment step (and a text engine's prompt), and each message must stay well within
/// what a worker takes ([`rollfleet_proto::MAX_MESSAGE_BYTES`]).
const MAX_TRAJECTORY_TEXT_BYTES: u64 = 1 << 20;

/// A replica whose last weight update failed: out of service, to be updated again at
/// `retry_at` on the job's clock (`None` while that attempt runs).
struct UpdateRetry {
    failures: u32,
    retry_at: Option<Duration>,
}

/// Settings of the actor.
#[derive(Debug, Clone)]
pub struct ActorOptions {
    /// Wall seconds per modelled second, passed to emulated workers.
    pub time_scale: f64,
    /// Lease length.
    pub lease_ttl: Duration,
    /// Workers to wait for before the job starts (at least one per pool it needs).
    pub expect_workers: usize,
    /// Where to write the final report (JSON).
    pub report: Option<PathBuf>,
    /// Re-plan when a measured share of peak drifts from the running plan's by more than this
    /// (relative); `None`: never on drift.
    pub replan_on_drift: Option<f64>,
    /// After the job ends, keep serving (its status, the trainer feed, "the job has ended" to
    /// workers that register) until stopped, instead of stopping once a trainer has everything:
    /// a scheduler that a Deployment runs must not exit at the end, or it is started again.
    pub until_stopped: bool,
}

/// One line of the final report per pool.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PoolSummary {
    /// Pool name.
    pub pool: String,
    /// `gpu`, `cpu` or `serverless`.
    pub kind: String,
    /// Workers that served it (alive at the end).
    pub workers: u32,
    /// Assignments it finished (stages, weight updates, training batches), failed ones included.
    pub assignments_done: u64,
    /// Share of its capacity in use over the run, 0..1 (GPUs for GPU pools, vCPUs for CPU pools,
    /// concurrency for serverless pools).
    pub busy_share: f64,
}

/// What a worker said at registration about GPU telemetry.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerTelemetry {
    /// The worker (`w3 (decode@host)`).
    pub worker: String,
    /// Its pool.
    pub pool: String,
    /// `available`, `unavailable` or `not said`.
    pub gpu_telemetry: String,
    /// Why not, when unavailable.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// The GPUs it reads, as the driver names them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<String>,
}

/// What the job did, written at the end.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Job name.
    pub job: String,
    /// Final phase.
    pub phase: String,
    /// Wall seconds from start to end.
    pub wall_s: f64,
    /// Wall seconds per modelled second of emulated hardware.
    pub time_scale: f64,
    /// True: every GPU figure came from the emulated engine.
    pub emulated_gpus: bool,
    /// Generation stages answered by a real (OpenAI-compatible) engine; 0 when every one was
    /// emulated. Training is emulated either way.
    #[serde(default)]
    pub engine_generations: u64,
    /// Generations interrupted by their replica's weight update and resumed on the new weights
    /// (`rl.interruptGeneration`).
    #[serde(default)]
    pub interrupted_generations: u64,
    /// Policy version reached (= RL steps trained).
    pub policy_version: u64,
    /// RL steps asked for.
    pub steps: u64,
    /// Trajectories handed to the trainer, in order.
    pub trained: Vec<u64>,
    /// Trajectories handed to the trainer more than once (must be empty).
    pub trained_twice: Vec<u64>,
    /// What the trained trajectories scored and cost: per task, over every task, and per RL step.
    #[serde(default)]
    pub outcomes: Outcomes,
    /// Stages completed over gRPC.
    pub stages_completed: u64,
    /// Median time from a worker's message coming off the wire to the scheduler having handed
    /// every command it caused to the workers' outboxes, microseconds.
    pub dispatch_p50_us: u32,
    /// The same, 99th percentile.
    pub dispatch_p99_us: u32,
    /// Stages retried after a failure or a lost worker (the core's count).
    pub stage_retries: u64,
    /// Turns regenerated to keep the staleness bound.
    pub regenerated_turns: u64,
    /// Groups restarted on new weights, having started too late in a step (the core's count).
    #[serde(default)]
    pub groups_restarted: u64,
    /// Groups given up as infrastructure failures (a trajectory's stages failed too often in a
    /// row), with the failing trajectory and what its last failure said; never trained on.
    #[serde(default)]
    pub groups_abandoned: Vec<AbandonedGroup>,
    /// Why the job failed, when it did.
    #[serde(default)]
    pub failure: Option<String>,
    /// What the workers' replicas measured, per kind of work and pool: the online profiles
    /// (`rollfleet plan --profiles` takes them; emulated replicas measure the model's figures).
    #[serde(default)]
    pub profiles: rollfleet_planner::profile::ProfileStore,
    /// Profile samples received from workers.
    #[serde(default)]
    pub profile_samples: u64,
    /// Workers lost or cut off, with the reason.
    pub workers_lost: Vec<String>,
    /// Workers that said they were leaving and were released once they held nothing (nothing
    /// of theirs was lost or redone).
    #[serde(default)]
    pub workers_left: Vec<String>,
    /// Inference replicas handed to another worker of their pool after theirs was lost.
    #[serde(default)]
    pub replicas_moved: u64,
    /// Weight updates a replica failed (refused, timed out, faked, or sent for a replica its
    /// worker does not serve); each takes the replica out of service for a backoff.
    #[serde(default)]
    pub weight_update_failures: u64,
    /// Re-plans while the job ran (a GPU pool's nodes came or went, or, with
    /// `--replan-on-drift`, measured profiles drifted), in order.
    #[serde(default)]
    pub replans: Vec<ReplanRecord>,
    /// What each worker said at registration about GPU telemetry.
    #[serde(default)]
    pub gpu_telemetry: Vec<WorkerTelemetry>,
    /// Per pool.
    pub pools: Vec<PoolSummary>,
}

/// The reward at or above which a trajectory counts as a success. It is what every built-in
/// environment and reward function gives a solved episode and nothing else: FrozenLake's goal,
/// the calculator's right answer and the serverless functions' match give 1 (otherwise 0); a
/// solved Sokoban level ends on 10.9, a last move that does not solve it on at most 0.9; a code
/// test's pass rate is 1 only when every test passes.
pub const SUCCESS_REWARD: f64 = 1.0;

/// What the trained trajectories scored and cost (`Report::outcomes`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Outcomes {
    /// The reward at or above which a trajectory counts as a success ([`SUCCESS_REWARD`]).
    pub success_reward: f64,
    /// Over every task.
    pub overall: OutcomeFigures,
    /// Per task, in the job's task order (a task with no trained trajectory included).
    pub tasks: Vec<OutcomeFigures>,
    /// Per RL step trained, in order.
    pub steps: Vec<StepOutcomes>,
}

/// What one RL step's trajectories scored and cost.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepOutcomes {
    /// The RL step: the policy version its batches were trained from.
    pub step: u64,
    /// Over every task.
    pub overall: OutcomeFigures,
    /// Per task, in the job's task order.
    pub tasks: Vec<OutcomeFigures>,
}

/// What some trained trajectories (a task's, every task's, one step's) scored and cost. Means
/// and extremes are 0 when there is no trajectory.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OutcomeFigures {
    /// The task; empty over every task.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub task: String,
    /// Trajectories handed to the trainer.
    pub trajectories: u64,
    pub mean_reward: f64,
    pub min_reward: f64,
    pub max_reward: f64,
    /// Trajectories whose reward reached [`Outcomes::success_reward`].
    pub successes: u64,
    /// Their share, 0..1.
    pub success_rate: f64,
    pub mean_turns: f64,
    /// Prompt and observation tokens (what the policy read) per trajectory.
    pub mean_prompt_tokens: f64,
    /// Action tokens (what the policy generated) per trajectory.
    pub mean_action_tokens: f64,
    /// Policy versions behind the trainer at training (the trajectory's oldest turn's).
    pub mean_staleness: f64,
    pub max_staleness: u64,
    /// Trajectories whose reward was modelled from the job spec (`--model-environments`), not
    /// computed by an environment or a reward function.
    pub modelled_rewards: u64,
}

impl OutcomeFigures {
    /// As the job status carries them.
    fn to_proto(&self, step: u64) -> rollfleet_proto::v1::TrajectoryOutcomes {
        rollfleet_proto::v1::TrajectoryOutcomes {
            task: self.task.clone(),
            step,
            trajectories: self.trajectories,
            mean_reward: self.mean_reward,
            min_reward: self.min_reward,
            max_reward: self.max_reward,
            successes: self.successes,
            success_rate: self.success_rate,
            mean_turns: self.mean_turns,
            mean_prompt_tokens: self.mean_prompt_tokens,
            mean_action_tokens: self.mean_action_tokens,
            mean_staleness: self.mean_staleness,
            max_staleness: self.max_staleness,
            modelled_rewards: self.modelled_rewards,
        }
    }
}

/// One trained trajectory's figures.
#[derive(Debug, Clone, Copy, Default)]
struct TrajectoryOutcome {
    reward: f64,
    /// Its reward was modelled, not computed.
    modelled: bool,
    turns: u64,
    prompt_tokens: u64,
    action_tokens: u64,
    /// Policy versions its oldest turn was behind the trainer.
    staleness: u64,
}

/// Sums of trained trajectories' figures, from which [`OutcomeFigures`] are taken.
#[derive(Debug, Clone, Copy, Default)]
struct Tally {
    trajectories: u64,
    reward_sum: f64,
    /// Lowest and highest reward (`None`: no trajectory yet).
    reward_range: Option<(f64, f64)>,
    successes: u64,
    turns: u64,
    prompt_tokens: u64,
    action_tokens: u64,
    staleness_sum: u64,
    staleness_max: u64,
    modelled: u64,
}

impl Tally {
    fn add(&mut self, o: &TrajectoryOutcome) {
        self.trajectories += 1;
        self.reward_sum += o.reward;
        self.reward_range = Some(match self.reward_range {
            Some((lo, hi)) => (lo.min(o.reward), hi.max(o.reward)),
            None => (o.reward, o.reward),
        });
        self.successes += u64::from(o.reward >= SUCCESS_REWARD);
        self.turns += o.turns;
        self.prompt_tokens += o.prompt_tokens;
        self.action_tokens += o.action_tokens;
        self.staleness_sum += o.staleness;
        self.staleness_max = self.staleness_max.max(o.staleness);
        self.modelled += u64::from(o.modelled);
    }

    fn merge(&mut self, other: &Tally) {
        self.trajectories += other.trajectories;
        self.reward_sum += other.reward_sum;
        self.reward_range = match (self.reward_range, other.reward_range) {
            (Some((a, b)), Some((c, d))) => Some((a.min(c), b.max(d))),
            (mine, theirs) => mine.or(theirs),
        };
        self.successes += other.successes;
        self.turns += other.turns;
        self.prompt_tokens += other.prompt_tokens;
        self.action_tokens += other.action_tokens;
        self.staleness_sum += other.staleness_sum;
        self.staleness_max = self.staleness_max.max(other.staleness_max);
        self.modelled += other.modelled;
    }

    fn figures(&self, task: &str) -> OutcomeFigures {
        let n = self.trajectories;
        let mean = |sum: f64| if n == 0 { 0.0 } else { sum / n as f64 };
        let (min_reward, max_reward) = self.reward_range.unwrap_or((0.0, 0.0));
        OutcomeFigures {
            task: task.to_owned(),
            trajectories: n,
            mean_reward: mean(self.reward_sum),
            min_reward,
            max_reward,
            successes: self.successes,
            success_rate: mean(self.successes as f64),
            mean_turns: mean(self.turns as f64),
            mean_prompt_tokens: mean(self.prompt_tokens as f64),
            mean_action_tokens: mean(self.action_tokens as f64),
            mean_staleness: mean(self.staleness_sum as f64),
            max_staleness: self.staleness_max,
            modelled_rewards: self.modelled,
        }
    }
}

/// The figures of every task (named by `tasks`, in order) and over them all, from the tallies
/// of the tasks that have trajectories (by task index).
fn task_figures(
    tallies: &BTreeMap<u32, Tally>,
    tasks: &[String],
) -> (OutcomeFigures, Vec<OutcomeFigures>) {
    let mut overall = Tally::default();
    let per_task = tasks
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let tally = tallies.get(&(i as u32)).copied().unwrap_or_default();
            overall.merge(&tally);
            tally.figures(name)
        })
        .collect();
    (overall.figures(""), per_task)
}

/// The report's figures from the tallies per RL step and task.
fn outcomes(by_step: &BTreeMap<u64, BTreeMap<u32, Tally>>, tasks: &[String]) -> Outcomes {
    let mut totals: BTreeMap<u32, Tally> = BTreeMap::new();
    let steps = by_step
        .iter()
        .map(|(&step, tallies)| {
            for (&task, tally) in tallies {
                totals.entry(task).or_default().merge(tally);
            }
            let (overall, tasks) = task_figures(tallies, tasks);
            StepOutcomes {
                step,
                overall,
                tasks,
            }
        })
        .collect();
    let (overall, tasks) = task_figures(&totals, tasks);
    Outcomes {
        success_reward: SUCCESS_REWARD,
        overall,
        tasks,
        steps,
    }
}

/// One re-plan of a running job, and how far moving to it got.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReplanRecord {
    /// Wall seconds after the start.
    pub at_s: f64,
    /// What changed.
    pub reason: String,
    /// The pool whose GPUs changed (on drift: the first pool that drifted).
    pub pool: String,
    /// Its GPUs the running plan was made for.
    pub gpus_before: u32,
    /// Its GPUs present now.
    pub gpus_after: u32,
    /// The planner's full prediction of the step (modelled seconds) for the replicas that were
    /// still running; `None` when they could not run the job.
    pub running_step_s: Option<f64>,
    /// The same for the new plan.
    pub planned_step_s: f64,
    /// Replicas retired because their node was gone.
    pub replicas_lost: u32,
    /// Waves of the move to the new plan (0: the replicas that run are the plan).
    pub waves: usize,
    /// Waves finished.
    pub waves_done: usize,
    /// Replicas started by the waves.
    pub replicas_started: u32,
    /// Replicas retired by the waves.
    pub replicas_retired: u32,
    /// Wall seconds after the start at which the last wave ended (`None`: still under way, or
    /// superseded by a later re-plan).
    pub done_at_s: Option<f64>,
    /// The trainer's GPUs after the move resized it on its pool (`None`: not resized).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainer_gpus: Option<u32>,
}

impl ReplanRecord {
    /// The record of `decision`, made at `at_s` for `reason` on `pool`, whose GPUs went from
    /// `gpus.0` to `gpus.1`, with `replicas_lost` retired with their node; nothing moved yet.
    fn new(
        at_s: f64,
        reason: String,
        pool: String,
        (gpus_before, gpus_after): (u32, u32),
        replicas_lost: u32,
        decision: &crate::replan::Decision,
    ) -> ReplanRecord {
        ReplanRecord {
            at_s,
            reason,
            pool,
            gpus_before,
            gpus_after,
            running_step_s: decision.running_step_s,
            planned_step_s: decision.planned_step_s,
            replicas_lost,
            waves: decision.waves.len(),
            waves_done: 0,
            replicas_started: 0,
            replicas_retired: 0,
            done_at_s: None,
            trainer_gpus: None,
        }
    }
}

/// A move to a new plan under way.
struct Migration {
    waves: Vec<MigrationWave>,
    /// The next wave to start.
    next: usize,
    /// Replicas of the wave under way still loading their weights or draining.
    waiting: BTreeSet<u64>,
    /// Its record in `Actor::replans`.
    record: usize,
    /// The trainer's GPUs once the wave under way is over, when it resizes the trainer.
    resize_trainer: Option<u32>,
}

/// A group the core gave up.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbandonedGroup {
    /// The group.
    pub group: u64,
    /// Its trajectories.
    pub trajectories: Vec<u64>,
    /// The trajectory whose stages kept failing.
    pub failed: u64,
    /// What its last failure said (the worker's message), if one was reported.
    pub last_failure: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StageKindOf {
    Env { millicpus: u64 },
    Prefill(ReplicaId),
    Generate(ReplicaId),
    Reward { serverless: bool, millicpus: u64 },
}

/// The `kind` label of the stage metrics ([`crate::metrics::STAGE_KINDS`]).
fn metric_kind(what: &What) -> &'static str {
    match what {
        What::Stage {
            kind: StageKindOf::Prefill(_),
            ..
        } => "prefill",
        What::Stage {
            kind: StageKindOf::Generate(_),
            ..
        } => "decode",
        What::Stage {
            kind: StageKindOf::Env { .. },
            reset: true,
            ..
        } => "environment_reset",
        What::Stage {
            kind: StageKindOf::Env { .. },
            ..
        } => "environment_step",
        What::Stage {
            kind: StageKindOf::Reward { .. },
            ..
        } => "reward",
        What::Train(_) => "train",
        What::Weights { .. } => "weight_sync",
    }
}

#[derive(Debug, Clone)]
enum What {
    Stage {
        stage: StageId,
        traj: TrajId,
        kind: StageKindOf,
        reset: bool,
    },
    Train(BatchId),
    Weights {
        replica: ReplicaId,
        version: u64,
    },
}

struct Assignment {
    worker: Option<u64>,
    pool: u32,
    what: What,
    message: WorkAssignment,
    /// When it was sent to its worker (the actor's `at`).
    sent_at: Option<Duration>,
}

struct Worker {
    name: String,
    /// The random part of its lease id (`w<N>-<secret>`).
    secret: String,
    host: String,
    pool: u32,
    /// What it said about GPU telemetry at registration (`None`: nothing).
    telemetry: Option<GpuTelemetryInfo>,
    /// GPUs whose readings are exported now.
    gpu_series: BTreeSet<u32>,
    /// What its engine takes as a prompt.
    policy_input: PolicyInput,
    /// On the job's clock (the actor's `at`).
    lease_until: Duration,
    outbox: Option<Sink>,
    alive: bool,
    assignments: BTreeSet<u64>,
    cancelled: BTreeSet<u64>,
    replicas: BTreeSet<u64>,
    /// GPUs it declared (`GpuInventory.count`); 0 when it did not say.
    gpus: u32,
    /// It said it is leaving: it gets nothing new, and is released once it holds nothing.
    leaving: bool,
    /// Its load reports' rate ([`LoadLimit`]); live only, before the journal.
    load_limit: LoadLimit,
    /// The client certificate it registered with (its SHA-256), under mutual TLS: its
    /// heartbeats and its stream must come with the same one. Live only (checked before the
    /// journal); a replayed worker has none.
    identity: Option<[u8; 32]>,
}

#[derive(Default)]
struct TrajInfo {
    attempt: u32,
    group: u64,
    task: u32,
    /// The environment's task and first observation (its reset).
    prompt: String,
    /// The action applied at each step, in order (what a replay needs).
    actions: Vec<String>,
    /// The observation after each step, in order.
    observations: Vec<String>,
    /// The text a real engine generated, per turn (none for emulated generations).
    outputs: BTreeMap<u32, String>,
    /// Bytes of `prompt`, `actions` and `observations`: what the environment's answers brought.
    env_text_bytes: u64,
    env_worker: Option<u64>,
    /// Policy version of each turn's generation.
    versions: BTreeMap<u32, u64>,
    /// The tokens of each turn's generation.
    tokens: BTreeMap<u32, TurnTokens>,
    /// Tokens of the message each turn's generation starts from (the prompt for turn 0, then
    /// the observation before the turn), as the environment counted them.
    message_tokens: BTreeMap<u32, u64>,
    /// Tokens each turn's generation produced (ids, or the emulated engine's count).
    action_tokens: BTreeMap<u32, u64>,
    reward: f64,
    /// Its reward came from an environment or reward function modelled from the job spec.
    reward_modelled: bool,
    /// What its last failed stage's worker said.
    last_failure: String,
    /// The part of a turn generated before an interrupt, to resume from.
    partial: Option<PartialTurn>,
    /// When its last stage answered (on the job's clock): its next stage is ready from then
    /// (`rollfleet_stage_queue_wait_seconds`).
    ready_at: Option<Duration>,
}

/// What a turn generated before its generation was interrupted (one segment per interrupted
/// generation, each under its own version).
struct PartialTurn {
    turn: u32,
    tokens: TurnTokens,
    /// Its text (a real engine's), to which the resumed generation's is appended.
    text: String,
    /// Tokens generated (ids, or the emulated engine's count).
    count: u64,
}

/// The actor.
pub struct Actor {
    plan: Arc<JobPlan>,
    opts: ActorOptions,
    core: Core,
    /// The job's clock: `at` is when the event being handled was taken, as an offset from when
    /// the actor was created (across restarts: the first actor of the journal). Live, the
    /// offset at `origin` was `base`.
    at: Duration,
    origin: Instant,
    base: Duration,
    /// Where every event goes before it is acted on (`None`: no journal).
    journal: Option<JournalWriter>,
    /// A journal was replayed and its `recovered` step is still to be taken.
    recovering: bool,
    /// A stop (Ctrl-C, SIGTERM, a `Cancel`) came to this scheduler live. Only whether to exit
    /// after the end depends on it, never a decision, so a replay leaves it unset: a scheduler
    /// serving until stopped, started again on its journal, serves again until it is stopped.
    stop_seen: bool,
    /// A journal is being replayed (nothing is logged).
    replaying: bool,
    /// Events the actor caused itself (a worker whose stream was found closed), taken after the
    /// one being handled, and journaled as they are.
    loopback: VecDeque<Event>,
    started: Option<Duration>,
    ended: Option<(Duration, JobPhase)>,
    /// The report as the job's end left it (what `--report` holds).
    final_report: Option<Report>,
    workers: BTreeMap<u64, Worker>,
    next_worker: u64,
    owner: Vec<Option<u64>>,
    /// Every serving replica: the job's placement, then those re-plans started.
    replicas: Vec<ReplicaConfig>,
    /// Replicas told to retire, not yet handed back by the core.
    retiring: BTreeSet<u64>,
    /// Replicas handed back: they serve nothing any more.
    retired: BTreeSet<u64>,
    /// GPUs a worker of a GPU pool that did not declare its own stands for: the pool's count
    /// over the workers it started with.
    gpu_share: BTreeMap<u32, u32>,
    /// GPUs per GPU pool the running plan was made for.
    planned_gpus: BTreeMap<u32, u32>,
    /// The job's planning problem (`None`: the planner cannot pose it; nothing is re-planned).
    replanner: Option<Replanner>,
    migration: Option<Migration>,
    replans: Vec<ReplanRecord>,
    /// The policy version at which the profiles were last checked for drift.
    drift_checked: u64,
    /// Drifted pools waiting for fresh samples before the re-plan.
    settling: Settling,
    assignments: BTreeMap<u64, Assignment>,
    next_assignment: u64,
    by_stage: BTreeMap<StageId, u64>,
    pending: BTreeMap<u32, VecDeque<u64>>,
    deferred: VecDeque<Input>,
    trajs: BTreeMap<TrajId, TrajInfo>,
    /// Groups the core gave up, in order.
    abandoned: Vec<AbandonedGroup>,
    /// Groups given up since the trainer last got a batch: when a whole batch's worth is, the
    /// fault is not one trajectory's but the job's (an engine refusing every request), and
    /// the job fails with the reason instead of giving up groups forever.
    abandoned_since_training: u64,
    /// Configuration errors in a row per task, of its environment (`false`) or its reward
    /// (`true`): see [`Actor::configuration_failure`].
    configuration_failures: BTreeMap<(u32, bool), u32>,
    failure: Option<String>,
    profiles: rollfleet_planner::profile::ProfileStore,
    profile_samples: u64,
    trained: Vec<u64>,
    trained_set: BTreeSet<u64>,
    trained_twice: Vec<u64>,
    /// What the trained trajectories scored and cost, per RL step and task.
    outcomes: BTreeMap<u64, BTreeMap<u32, Tally>>,
    /// The same per task over every step (what the status carries at each tick).
    outcome_totals: BTreeMap<u32, Tally>,
    // Busy accounting, per pool: a meter of units in use and the capacity it is divided by.
    meters: BTreeMap<u32, Meter>,
    capacity: BTreeMap<u32, f64>,
    replica_running: Vec<u32>,
    /// GPUs of replicas running at least one stage, per pool (kept incrementally: a job may have
    /// hundreds of replicas).
    gpus_busy: BTreeMap<u32, u64>,
    trainer_busy: u32,
    cpu_in_use: BTreeMap<u32, u64>,
    serverless_running: BTreeMap<u32, u64>,
    completed_by_pool: BTreeMap<u32, u64>,
    last_busy: BTreeMap<u32, (f64, Time)>,
    recent_busy: BTreeMap<u32, f64>,
    /// Meter totals already counted in `rollfleet_pool_busy_seconds_total`, per pool.
    busy_exported: BTreeMap<u32, f64>,
    /// The policy version last seen and when (`rollfleet_rl_step_duration_seconds`).
    version_seen: (u64, Duration),
    stages_completed: u64,
    /// Generations answered by a real engine (`StageOutput.emulated` false).
    engine_generations: u64,
    interrupted_generations: u64,
    /// Replicas handed to another worker after theirs was lost.
    replicas_moved: u64,
    weight_update_failures: u64,
    latencies_us: Vec<u32>,
    /// Workers lost, with why: the first [`MAX_WORKERS_LISTED`] (`lost_total` counts them all).
    lost: Vec<String>,
    lost_total: usize,
    /// Workers released after they said they were leaving (the first [`MAX_WORKERS_LISTED`];
    /// `left_total` counts them all).
    left: Vec<String>,
    left_total: usize,
    /// What each GPU pool's workers took as a prompt, for the report ([`Actor::pool_kind`]):
    /// kept apart from the workers, which are forgotten once gone.
    pool_inputs: Vec<(u32, PolicyInput)>,
    /// What the first [`MAX_WORKERS_LISTED`] workers gone said about GPU telemetry, by number,
    /// for the report (the workers themselves are forgotten).
    gone_telemetry: BTreeMap<u64, WorkerTelemetry>,
    /// Workers leaving: given nothing new, released once they hold nothing.
    leaving: BTreeSet<u64>,
    status: Arc<watch::Sender<JobStatus>>,
    metrics: Arc<Metrics>,
    feed: Arc<FeedLog>,
    /// An external trainer's accepted publications, by version: where each version's weights are.
    publications: BTreeMap<u64, PublishWeights>,
    /// Replicas whose weight update failed, by replica.
    update_retries: BTreeMap<u64, UpdateRetry>,
}

impl Actor {
    /// A new actor for a planned job.
    pub fn new(
        plan: Arc<JobPlan>,
        opts: ActorOptions,
        status: Arc<watch::Sender<JobStatus>>,
        metrics: Arc<Metrics>,
        feed: Arc<FeedLog>,
    ) -> Actor {
        let core = Core::new(plan.config.clone());
        if plan.spec().rl.trainer != rollfleet_spec::TrainerMode::External {
            feed.without_trainer();
        }
        let replicas = plan.placement.replicas.len();
        let mut capacity = BTreeMap::new();
        for (i, pool) in plan.spec().pools.iter().enumerate() {
            let i = i as u32;
            let cap = match plan.pool_role(i) {
                Some(PoolRole::Gpu) => pool.count.unwrap_or(0).max(0) as f64,
                Some(PoolRole::Cpu) => plan
                    .config
                    .cpu_pools
                    .iter()
                    .find(|c| c.pool == i)
                    .map_or(0.0, |c| c.millicpus as f64 / 1000.0),
                Some(PoolRole::Serverless) => plan
                    .config
                    .serverless_pools
                    .iter()
                    .find(|s| s.pool == i)
                    .map_or(1.0, |s| s.concurrency as f64),
                None => 0.0,
            };
            capacity.insert(i, cap.max(1e-9));
        }
        let mut actor = Actor {
            core,
            at: Duration::ZERO,
            origin: Instant::now(),
            base: Duration::ZERO,
            journal: None,
            recovering: false,
            stop_seen: false,
            replaying: false,
            loopback: VecDeque::new(),
            started: None,
            ended: None,
            final_report: None,
            workers: BTreeMap::new(),
            next_worker: 1,
            owner: vec![None; replicas],
            replicas: plan.placement.replicas.clone(),
            retiring: BTreeSet::new(),
            retired: BTreeSet::new(),
            gpu_share: BTreeMap::new(),
            planned_gpus: BTreeMap::new(),
            replanner: Replanner::new(plan.spec(), plan.catalog(), &plan.placement.trainer),
            migration: None,
            replans: Vec::new(),
            drift_checked: 0,
            settling: Settling::default(),
            assignments: BTreeMap::new(),
            next_assignment: 1,
            by_stage: BTreeMap::new(),
            pending: BTreeMap::new(),
            deferred: VecDeque::new(),
            trajs: BTreeMap::new(),
            abandoned: Vec::new(),
            abandoned_since_training: 0,
            configuration_failures: BTreeMap::new(),
            failure: None,
            profiles: Default::default(),
            profile_samples: 0,
            trained: Vec::new(),
            trained_set: BTreeSet::new(),
            trained_twice: Vec::new(),
            outcomes: BTreeMap::new(),
            outcome_totals: BTreeMap::new(),
            meters: capacity.keys().map(|&p| (p, Meter::default())).collect(),
            capacity,
            replica_running: vec![0; replicas],
            gpus_busy: BTreeMap::new(),
            trainer_busy: 0,
            cpu_in_use: BTreeMap::new(),
            serverless_running: BTreeMap::new(),
            completed_by_pool: BTreeMap::new(),
            last_busy: BTreeMap::new(),
            recent_busy: BTreeMap::new(),
            busy_exported: BTreeMap::new(),
            version_seen: (0, Duration::ZERO),
            stages_completed: 0,
            engine_generations: 0,
            interrupted_generations: 0,
            replicas_moved: 0,
            weight_update_failures: 0,
            latencies_us: Vec::new(),
            lost: Vec::new(),
            lost_total: 0,
            left: Vec::new(),
            left_total: 0,
            pool_inputs: Vec::new(),
            gone_telemetry: BTreeMap::new(),
            leaving: BTreeSet::new(),
            status,
            metrics,
            feed,
            publications: BTreeMap::new(),
            update_retries: BTreeMap::new(),
            plan,
            opts,
        };
        // Every task's counters from the start (at 0), so that increase() counts its first
        // trajectories.
        let m = &actor.metrics.outcomes;
        for task in &actor.plan.spec().tasks {
            let label = [task.name.as_str()];
            for c in [
                &m.trajectories,
                &m.successes,
                &m.turns,
                &m.prompt_tokens,
                &m.action_tokens,
                &m.staleness_versions,
            ] {
                c.with_label_values(&label);
            }
            m.reward_sum.with_label_values(&label);
        }
        // Whoever asks for the job's status before it runs sees it whole (its steps, its
        // pools), not a blank.
        actor.publish();
        actor
    }

    /// What a pool is, for the report: what runs its work, and whether it is emulated.
    fn pool_kind(&self, pool: u32) -> &'static str {
        let inputs = || {
            self.pool_inputs
                .iter()
                .filter(move |(p, _)| *p == pool)
                .map(|(_, input)| *input)
        };
        match self.plan.pool_role(pool) {
            Some(PoolRole::Gpu) if inputs().any(|p| p == PolicyInput::Text) => {
                if self.external_trainer() {
                    "gpu (openai engine; external trainer)"
                } else {
                    "gpu (openai engine; training emulated)"
                }
            }
            Some(PoolRole::Gpu) if inputs().any(|p| p == PolicyInput::Tokens) => {
                "gpu (token-in engine; external trainer)"
            }
            Some(PoolRole::Gpu) => "gpu (emulated)",
            Some(PoolRole::Cpu) => "cpu",
            Some(PoolRole::Serverless) => "serverless (local)",
            None => "?",
        }
    }

    /// Whether an external trainer publishes the versions (`rl.trainer: external`).
    fn external_trainer(&self) -> bool {
        self.plan.spec().rl.trainer == rollfleet_spec::TrainerMode::External
    }

    /// An external trainer's publication: taken when the core takes it (the next version, after
    /// the batch that completes its step was handed out), refused with the reason otherwise.
    fn publish_weights(&mut self, publish: PublishWeights) -> PublicationAnswer {
        let version = publish.version;
        let refusal = if !self.external_trainer() {
            Some(
                "the job's trainer is emulated (rl.trainer: emulated): it publishes its own \
                 versions; set rl.trainer: external to train outside rollfleet"
                    .to_owned(),
            )
        } else if self.ended.is_some() {
            Some("the job has ended".to_owned())
        } else if self.started.is_none() {
            Some("the job has not started yet".to_owned())
        } else {
            self.core.publication_refusal(version)
        };
        if let Some(reason) = refusal {
            log!(
                self,
                "scheduler: publication of version {version} refused: {reason}"
            );
            return PublicationAnswer {
                version,
                accepted: false,
                reason: format!("publish.version: {reason}"),
            };
        }
        log!(
            self,
            "scheduler: the trainer published version {version} ({})",
            publish.uri
        );
        self.publications.insert(version, publish);
        let now = self.now();
        self.core.handle_input(now, Input::Published { version });
        self.pump();
        PublicationAnswer {
            version,
            accepted: true,
            reason: String::new(),
        }
    }

    /// Runs until the job ends and its end has been announced; returns the report written at
    /// the end.
    pub async fn run(mut self, inbox: impl Into<Inbox>) -> Report {
        let mut inbox = inbox.into();
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.publish();
        if self.recovering {
            self.recovering = false;
            self.take(vec![Step::Recovered]);
        }
        loop {
            let wake = self.core_wake();
            let step = tokio::select! {
                event = inbox.recv() => match event {
                    Some(event) => Step::Event(event),
                    None => break,
                },
                _ = sleep_until_opt(wake) => Step::Wake,
                _ = tick.tick() => Step::Tick,
            };
            // Under load, the events already waiting are taken together: one journal write for
            // all of them, before any is acted on.
            let mut steps = vec![step];
            while steps.len() < MAX_BATCH {
                match inbox.try_recv() {
                    Some(event) => steps.push(Step::Event(event)),
                    None => break,
                }
            }
            self.take(steps);
            while let Some(event) = self.loopback.pop_front() {
                self.take(vec![Step::Event(event)]);
            }
            // After the end, a subscribed trainer gets a while to acknowledge the whole feed;
            // after a restart (at `base`), a while again, to subscribe again first.
            if let Some((at, _)) = self.ended {
                let since = self.wall().saturating_sub(at.max(self.base));
                let done = if self.opts.until_stopped {
                    self.stop_seen
                } else {
                    self.feed.drained() || since > FEED_GRACE
                };
                if since > Duration::from_millis(500) && done {
                    break;
                }
            }
        }
        let unsuccessful = match self.ended {
            Some((_, JobPhase::Succeeded)) | None => None,
            // "job NAME ended PHASE: ...": a trainer (the Python SDK's) reads the phase there.
            Some((_, phase)) => Some(format!(
                "job {} ended {}: the feed has nothing more to give{}",
                self.plan.name(),
                crate::job::phase_name(phase),
                self.final_report
                    .as_ref()
                    .and_then(|r| r.failure.clone())
                    .map_or_else(String::new, |f| format!(" ({f})"))
            )),
        };
        self.feed.close(unsuccessful);
        // The report the end wrote (`--report`), so that what the caller gets is what the file
        // holds and what a replay of the journal gives.
        self.final_report.take().unwrap_or_else(|| self.report())
    }

    /// Starts writing every event to `journal` (a new one, or one just replayed).
    pub fn set_journal(&mut self, journal: JournalWriter) {
        self.journal = Some(journal);
    }

    /// Replays a journal's records into this fresh actor; the next [`Actor::run`] starts by
    /// losing every worker of the scheduler that wrote them. Returns how many were replayed.
    pub fn replay(&mut self, reader: &mut JournalReader) -> Result<u64, JournalError> {
        self.replaying = true;
        let replayed = self.replay_records(reader);
        self.replaying = false;
        self.feed.replayed();
        // The clock goes on from the last record.
        self.base = self.at;
        self.origin = Instant::now();
        self.recovering = true;
        replayed
    }

    fn replay_records(&mut self, reader: &mut JournalReader) -> Result<u64, JournalError> {
        let mut replayed = 0;
        while let Some(record) = reader.next_record()? {
            self.at = self.at.max(Duration::from_nanos(record.at_ns));
            let Some(event) = record.event else {
                continue;
            };
            match event {
                journal_record::Event::Register(r) => {
                    let _ = self.register(r.inventory.unwrap_or_default(), r.lease_secret);
                }
                journal_record::Event::Heartbeat(h) => {
                    let _ = self.heartbeat(&h.worker_id, h.epoch, h.load);
                }
                journal_record::Event::Attach(hello) => {
                    let _ = self.attach_stream(&hello.worker_id, hello.epoch, Sink::Replayed);
                }
                journal_record::Event::Message(m) => {
                    if let Some(message) = m.message {
                        self.message(m.worker, message);
                        self.pump();
                    }
                }
                journal_record::Event::Detach(d) => self.detach(d.worker, &d.reason),
                journal_record::Event::Cancel(_) => self.cancel_job(),
                journal_record::Event::FeedSubscribed(_) => self.feed.mark_subscribed(),
                journal_record::Event::Publish(publish) => {
                    self.publish_weights(publish);
                }
                journal_record::Event::Wake(_) => self.wake(),
                journal_record::Event::Tick(_) => self.on_tick(),
                journal_record::Event::Recovered(_) => self.recover(),
            }
            replayed += 1;
        }
        Ok(replayed)
    }

    /// The job's clock now (live only: a replay takes each record's time).
    fn wall(&self) -> Duration {
        self.base + self.origin.elapsed()
    }

    /// The instant at which the job's clock reads `offset`.
    fn instant_at(&self, offset: Duration) -> Instant {
        self.origin + offset.saturating_sub(self.base)
    }

    /// Takes steps live: stamps them with the clock, journals them (handing the records to the
    /// operating system before acting on any), and handles them in order.
    fn take(&mut self, steps: Vec<Step>) {
        self.at = self.at.max(self.wall());
        self.stop_seen |= steps
            .iter()
            .any(|step| matches!(step, Step::Event(Event::Cancel)));
        let steps: Vec<Step> = steps
            .into_iter()
            .filter_map(|step| self.admit(step).map(|step| self.journal_step(step)))
            .collect();
        if let Some(journal) = &mut self.journal {
            let flushed = journal.flush();
            self.journal_written(flushed);
        }
        for step in steps {
            match step {
                Step::Event(event) => self.handle(event),
                Step::Wake => self.wake(),
                Step::Tick => self.on_tick(),
                Step::Recovered => self.recover(),
            }
        }
    }

    /// A live step as it is to be journaled and handled: a load report over its worker's rate
    /// ([`LoadLimit`]) is dropped here, before the journal, so that a replay sees what was
    /// handled (a heartbeat keeps its lease renewal, without the load; a load message on the
    /// work stream goes whole).
    fn admit(&mut self, step: Step) -> Option<Step> {
        let step = self.admit_identity(step)?;
        let worker = match &step {
            Step::Event(Event::Heartbeat {
                worker_id,
                load: Some(_),
                ..
            }) => self.worker_number(worker_id),
            Step::Event(Event::Message {
                worker,
                message:
                    WorkerMessage {
                        message: Some(worker_message::Message::Load(_)),
                    },
                ..
            }) => Some(*worker),
            _ => None,
        };
        let Some(worker) = worker else {
            return Some(step);
        };
        let now = self.at;
        // Twice an honest worker's pace (one report per heartbeat, a quarter lease apart).
        let per_second =
            (8.0 / self.opts.lease_ttl.as_secs_f64().max(1e-3)).max(LOAD_REPORTS_PER_SECOND);
        let within = self
            .workers
            .get_mut(&worker)
            .is_none_or(|w| w.load_limit.take(now, per_second));
        if within {
            return Some(step);
        }
        self.metrics.load_reports_dropped.inc();
        match step {
            Step::Event(Event::Heartbeat {
                worker_id,
                epoch,
                identity,
                reply,
                ..
            }) => Some(Step::Event(Event::Heartbeat {
                worker_id,
                epoch,
                load: None,
                identity,
                reply,
            })),
            _ => None,
        }
    }

    /// A heartbeat or a stream for a lease bound to a client certificate ([`Worker::identity`])
    /// that comes with another certificate, or none, is refused `PERMISSION_DENIED` here,
    /// before the journal (a replay has no certificates to compare).
    fn admit_identity(&mut self, step: Step) -> Option<Step> {
        let (worker_id, identity) = match &step {
            Step::Event(Event::Heartbeat {
                worker_id,
                identity,
                ..
            })
            | Step::Event(Event::Attach {
                worker_id,
                identity,
                ..
            }) => (worker_id, identity),
            _ => return Some(step),
        };
        let Some(id) = self.worker_number(worker_id) else {
            return Some(step);
        };
        let bound = self.workers.get(&id).and_then(|w| w.identity);
        if bound.is_none() || bound == *identity {
            return Some(step);
        }
        let presented = if identity.is_some() {
            "another"
        } else {
            "none"
        };
        let refusal = |field: &str| {
            Status::permission_denied(format!(
                "{field}: lease w{id} is bound to the client certificate it registered with; \
                 this call presented {presented}"
            ))
        };
        match step {
            Step::Event(Event::Heartbeat { reply, .. }) => {
                let _ = reply.send(Err(refusal("worker_id")));
            }
            Step::Event(Event::Attach { reply, .. }) => {
                let _ = reply.send(Err(refusal("hello.worker_id")));
            }
            _ => {}
        }
        None
    }

    /// What of a load report the journal keeps: all of it, except GPU readings the actor will
    /// take (they only feed the metrics, which a replay does not serve); readings it will refuse
    /// are kept, so that a replay refuses them too.
    fn journaled_load(&self, worker: Option<u64>, load: &mut WorkerLoad) {
        let taken = worker.is_none_or(|w| self.gpu_readings_problem(w, load).is_none());
        if taken {
            load.gpus.clear();
            load.gpu_utilization = None;
            load.gpu_memory_used_bytes = None;
        }
    }

    /// Writes `step` to the journal, if there is one (a worker's message is moved into the
    /// record and back rather than copied).
    fn journal_step(&mut self, step: Step) -> Step {
        if self.journal.is_none() {
            return step;
        }
        let at_ns = self.at.as_nanos().min(u128::from(u64::MAX)) as u64;
        let (event, step) = match step {
            Step::Event(Event::Message {
                worker,
                message:
                    WorkerMessage {
                        message: Some(worker_message::Message::Load(load)),
                    },
                received,
            }) => {
                let mut journaled = load.clone();
                self.journaled_load(Some(worker), &mut journaled);
                let message = |load| WorkerMessage {
                    message: Some(worker_message::Message::Load(load)),
                };
                (
                    journal_record::Event::Message(JournalMessage {
                        worker,
                        message: Some(message(journaled)),
                    }),
                    Step::Event(Event::Message {
                        worker,
                        message: message(load),
                        received,
                    }),
                )
            }
            Step::Event(Event::Message {
                worker,
                message,
                received,
            }) => {
                let record = JournalRecord {
                    at_ns,
                    event: Some(journal_record::Event::Message(JournalMessage {
                        worker,
                        message: Some(message),
                    })),
                };
                let written = self.journal.as_mut().map_or(Ok(()), |j| j.write(&record));
                let message = match record.event {
                    Some(journal_record::Event::Message(JournalMessage {
                        message: Some(message),
                        ..
                    })) => message,
                    // Never: the record was built with the message just above.
                    _ => WorkerMessage::default(),
                };
                let step = Step::Event(Event::Message {
                    worker,
                    message,
                    received,
                });
                self.journal_written(written);
                return step;
            }
            Step::Event(event) => {
                let recorded = match &event {
                    Event::Register {
                        inventory, secret, ..
                    } => journal_record::Event::Register(JournalRegister {
                        inventory: Some(inventory.clone()),
                        lease_secret: secret.clone(),
                    }),
                    Event::Heartbeat {
                        worker_id,
                        epoch,
                        load,
                        ..
                    } => journal_record::Event::Heartbeat(JournalHeartbeat {
                        worker_id: worker_id.clone(),
                        epoch: *epoch,
                        load: load.clone().map(|mut load| {
                            self.journaled_load(self.worker_number(worker_id), &mut load);
                            load
                        }),
                    }),
                    Event::Attach {
                        worker_id, epoch, ..
                    } => journal_record::Event::Attach(WorkerHello {
                        worker_id: worker_id.clone(),
                        epoch: *epoch,
                    }),
                    // Never: a message is journaled by the arm above, without a copy.
                    Event::Message { worker, .. } => {
                        journal_record::Event::Message(JournalMessage {
                            worker: *worker,
                            message: None,
                        })
                    }
                    Event::Detach { worker, reason } => {
                        journal_record::Event::Detach(JournalDetach {
                            worker: *worker,
                            reason: reason.clone(),
                        })
                    }
                    Event::Cancel => journal_record::Event::Cancel(true),
                    Event::FeedSubscribed => journal_record::Event::FeedSubscribed(true),
                    Event::Publish { publish, .. } => {
                        journal_record::Event::Publish(publish.clone())
                    }
                };
                (recorded, Step::Event(event))
            }
            Step::Wake => (journal_record::Event::Wake(true), Step::Wake),
            Step::Tick => (journal_record::Event::Tick(true), Step::Tick),
            Step::Recovered => (journal_record::Event::Recovered(true), Step::Recovered),
        };
        let record = JournalRecord {
            at_ns,
            event: Some(event),
        };
        let written = self.journal.as_mut().map_or(Ok(()), |j| j.write(&record));
        self.journal_written(written);
        step
    }

    /// A journal that cannot be written is emptied and dropped: the job goes on, but a restart
    /// must not resume from a journal with a gap in it.
    fn journal_written(&mut self, written: Result<(), JournalError>) {
        let Err(e) = written else {
            return;
        };
        let Some(journal) = self.journal.take() else {
            return;
        };
        let emptied = journal.abandon();
        eprintln!(
            "scheduler: {e}; the job goes on without a journal{}",
            match emptied {
                Ok(()) =>
                    " (the file is emptied: a restart on it starts the job afresh)".to_owned(),
                Err(e) =>
                    format!(" (and the file could not be emptied: {e}; do not restart on it)"),
            }
        );
        self.metrics.journal_failures.inc();
    }

    /// The core's time: since the job started, on the job's clock.
    fn now(&self) -> Time {
        self.started.map_or(Time::ZERO, |s| {
            Time(
                self.at
                    .saturating_sub(s)
                    .as_nanos()
                    .min(u128::from(u64::MAX)) as u64,
            )
        })
    }

    fn core_wake(&self) -> Option<Instant> {
        let start = self.started?;
        if self.ended.is_some() {
            return None;
        }
        let t = self.core.poll_timeout()?;
        Some(self.instant_at(start + Duration::from_nanos(t.0.min(u64::MAX / 2))))
    }

    fn wake(&mut self) {
        let now = self.now();
        self.core.handle_timeout(now);
        self.pump();
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Register {
                inventory,
                secret,
                identity,
                reply,
            } => {
                let registered = self.register(inventory, secret);
                if registered.is_ok()
                    && let Some(w) = self.workers.get_mut(&(self.next_worker - 1))
                {
                    w.identity = identity;
                }
                let _ = reply.send(registered);
            }
            Event::Heartbeat {
                worker_id,
                epoch,
                load,
                reply,
                ..
            } => {
                let _ = reply.send(self.heartbeat(&worker_id, epoch, load));
            }
            Event::Attach {
                worker_id,
                epoch,
                outbox,
                reply,
                ..
            } => {
                let _ = reply.send(self.attach_stream(&worker_id, epoch, Sink::Stream(outbox)));
            }
            Event::Message {
                worker,
                message,
                received,
            } => {
                self.message(worker, message);
                self.pump();
                // From off the wire to every command it caused handed to the outboxes.
                if self.latencies_us.len() < MAX_LATENCY_SAMPLES {
                    let us = received.elapsed().as_micros().min(u32::MAX as u128) as u32;
                    self.latencies_us.push(us);
                }
            }
            Event::Detach { worker, reason } => self.detach(worker, &reason),
            Event::Cancel => self.cancel_job(),
            // The feed's handler marked it already; the event is there for the journal.
            Event::FeedSubscribed => self.feed.mark_subscribed(),
            Event::Publish { publish, reply } => {
                let _ = reply.send(self.publish_weights(publish));
                // The new version shows in the status at once, not at the next tick.
                self.publish();
            }
        }
    }

    fn attach_stream(&mut self, worker_id: &str, epoch: u64, sink: Sink) -> Result<u64, Status> {
        let result = self.attach(worker_id, epoch, sink);
        if result.is_ok() {
            self.maybe_start();
            self.pump();
        }
        result
    }

    fn detach(&mut self, worker: u64, reason: &str) {
        if self.ended.is_some() {
            // After the drain, workers leave: that is no failure.
            if let Some(w) = self.workers.get_mut(&worker) {
                w.alive = false;
                w.outbox = None;
            }
            self.forget_gpus(worker);
            self.forget(worker);
            self.update_worker_gauges();
        } else {
            self.cut_off(worker, reason);
            self.pump();
        }
    }

    fn cancel_job(&mut self) {
        if self.ended.is_none() {
            self.finish(JobPhase::Cancelled);
        }
    }

    /// After a replay: the workers of the scheduler that wrote the journal are gone with its
    /// streams. Their stages go back to the queues and their replicas wait for the workers that
    /// register again, as for any lost worker; but no pool is re-planned for the moment with no
    /// workers at all (the workers coming back are the pool; if fewer come back, the re-plan
    /// follows when they attach).
    fn recover(&mut self) {
        let gone: Vec<u64> = self
            .workers
            .iter()
            .filter(|(_, w)| w.alive)
            .map(|(&id, _)| id)
            .collect();
        match self.ended {
            Some((_, phase)) => log!(
                self,
                "scheduler: resumed job {} from its journal: it had ended ({phase:?}) at version {}",
                self.plan.name(),
                self.core.version()
            ),
            None => log!(
                self,
                "scheduler: resumed job {} at version {} from its journal; the {} workers of the \
                 scheduler before are gone, their work waits for the workers that register again",
                self.plan.name(),
                self.core.version(),
                gone.len()
            ),
        }
        for id in gone {
            self.lose_worker(
                id,
                "the scheduler restarted (its work stream ended with the scheduler before)",
                false,
            );
        }
        self.pump();
    }

    /// The worker a lease id (`w<N>-<secret>`) names, when its secret is that worker's: a lease
    /// id is a capability, so a peer cannot heartbeat or attach to another node's lease by
    /// guessing its number.
    fn worker_number(&self, worker_id: &str) -> Option<u64> {
        let (number, secret) = worker_id.strip_prefix('w')?.split_once('-')?;
        let id = number.parse().ok()?;
        let w = self.workers.get(&id)?;
        let same = w.secret.len() == secret.len()
            && w.secret
                .bytes()
                .zip(secret.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
        same.then_some(id)
    }

    /// The refusal of a lease id that names a live lease (`w<N>`) without its secret: another
    /// node's lease, or a guess. It names the lease by its number only (never a secret).
    fn not_yours(&self, field: &str, worker_id: &str) -> Option<Status> {
        let number = worker_id.strip_prefix('w')?;
        let number = number.split_once('-').map_or(number, |(n, _)| n);
        let id: u64 = number.parse().ok()?;
        self.workers.get(&id).filter(|w| w.alive)?;
        Some(Status::permission_denied(format!(
            "{field}: lease w{id} is another worker's: the id does not carry its secret (a lease \
             is used only by the worker that registered for it; register for a lease of your own)"
        )))
    }

    fn register(
        &mut self,
        inventory: HardwareInventory,
        secret: String,
    ) -> Result<RegisterResponse, Status> {
        if let Some(problem) = crate::inventory::check(&inventory) {
            return Err(Status::invalid_argument(problem));
        }
        let pools: Vec<&str> = self
            .plan
            .spec()
            .pools
            .iter()
            .map(|p| p.name.as_str())
            .collect();
        let pool = self.plan.pool_index(&inventory.pool).ok_or_else(|| {
            Status::invalid_argument(format!(
                "inventory.pool: job {} has no pool {} (pools: {})",
                self.plan.name(),
                crate::quoted(&inventory.pool),
                pools.join(", ")
            ))
        })?;
        let role = self.plan.pool_role(pool);
        // A worker with no device of its own registers to emulate whatever the pool needs.
        let matches = matches!(
            (&inventory.device, role),
            (None, Some(_))
                | (Some(Device::Gpu(_)), Some(PoolRole::Gpu))
                | (Some(Device::Cpu(_)), Some(PoolRole::Cpu))
                | (Some(Device::Serverless(_)), Some(PoolRole::Serverless))
        );
        if !matches {
            return Err(Status::invalid_argument(format!(
                "inventory.device: pool {} is a {:?} pool; the worker offers {}",
                crate::quoted(&inventory.pool),
                role,
                match inventory.device {
                    Some(Device::Gpu(_)) => "GPUs",
                    Some(Device::Cpu(_)) => "CPUs",
                    Some(Device::Serverless(_)) => "a serverless platform",
                    None => "nothing",
                }
            )));
        }
        if let Some(Device::Gpu(gpu)) = &inventory.device {
            let spec = &self.plan.spec().pools[pool as usize];
            let product = spec.gpu.as_deref().unwrap_or_default();
            if !gpu.product.is_empty() && !gpu.product.eq_ignore_ascii_case(product) {
                return Err(Status::invalid_argument(format!(
                    "inventory.gpu.product: pool {} is of {product} GPUs; the worker offers {}",
                    crate::quoted(&inventory.pool),
                    crate::quoted(&gpu.product)
                )));
            }
            let count = spec.count.unwrap_or(0).max(0) as u64;
            if u64::from(gpu.count) > count {
                return Err(Status::invalid_argument(format!(
                    "inventory.gpu.count: the worker offers {} GPUs; pool {} has {count}",
                    gpu.count,
                    crate::quoted(&inventory.pool)
                )));
            }
        }
        if self.ended.is_some() {
            return Err(Status::failed_precondition("the job has ended"));
        }
        let id = self.next_worker;
        self.next_worker += 1;
        let ttl = self.opts.lease_ttl;
        self.workers.insert(
            id,
            Worker {
                name: format!("w{id} ({}@{})", inventory.pool, inventory.hostname),
                secret,
                host: inventory.hostname.clone(),
                pool,
                telemetry: inventory.gpu_telemetry.clone(),
                gpu_series: BTreeSet::new(),
                policy_input: PolicyInput::of_backend(&inventory.backend),
                lease_until: self.at + ttl,
                outbox: None,
                alive: true,
                assignments: BTreeSet::new(),
                cancelled: BTreeSet::new(),
                replicas: BTreeSet::new(),
                gpus: match &inventory.device {
                    Some(Device::Gpu(g)) => g.count,
                    _ => 0,
                },
                leaving: false,
                load_limit: LoadLimit::new(self.at),
                identity: None,
            },
        );
        self.metrics.workers_registered.inc();
        let input = (pool, PolicyInput::of_backend(&inventory.backend));
        if !self.pool_inputs.contains(&input) {
            self.pool_inputs.push(input);
        }
        match &inventory.gpu_telemetry {
            Some(t) if t.available => {
                for d in &t.devices {
                    let gpu = d.index.to_string();
                    let worker = format!("w{id}");
                    let labels = [
                        self.plan.pool_name(pool),
                        &worker,
                        &inventory.hostname,
                        &gpu,
                    ];
                    self.metrics
                        .gpu_memory_total
                        .with_label_values(&labels)
                        .set(d.memory_bytes as f64);
                    self.metrics
                        .gpu_info
                        .with_label_values(&[
                            labels[0], labels[1], labels[2], labels[3], &d.name, &d.uuid,
                        ])
                        .set(1.0);
                }
            }
            Some(t) if role == Some(PoolRole::Gpu) => log!(
                self,
                "scheduler: worker w{id} ({}@{}) has no GPU telemetry: {}",
                inventory.pool,
                inventory.hostname,
                t.unavailable_reason
            ),
            _ => {}
        }
        self.update_worker_gauges();
        Ok(RegisterResponse {
            lease: Some(self.lease(id)),
            job_yaml: self.plan.yaml.clone(),
            time_scale: self.opts.time_scale,
        })
    }

    fn lease(&self, id: u64) -> Lease {
        let ttl = self.opts.lease_ttl.as_millis() as u64;
        let secret = self.workers.get(&id).map_or("", |w| w.secret.as_str());
        Lease {
            worker_id: format!("w{id}-{secret}"),
            ttl_ms: ttl,
            heartbeat_interval_ms: (ttl / 4).max(1),
            epoch: 1,
        }
    }

    fn heartbeat(
        &mut self,
        worker_id: &str,
        epoch: u64,
        load: Option<WorkerLoad>,
    ) -> Result<HeartbeatResponse, Status> {
        let ttl = self.opts.lease_ttl;
        let id = self.worker_number(worker_id);
        // A lease that ran out is not renewed, even if the periodic check has not seen it yet.
        if let Some(id) = id
            && self
                .workers
                .get(&id)
                .is_some_and(|w| w.alive && w.lease_until < self.at)
        {
            self.cut_off(id, &format!("lease expired: no heartbeat within {ttl:?}"));
            self.pump();
        }
        match id.and_then(|id| self.workers.get_mut(&id).map(|w| (id, w))) {
            Some((id, w)) if w.alive && epoch == 1 => {
                w.lease_until = self.at + ttl;
                if let Some(load) = load
                    && let Err(reason) = self.load_report(id, &load)
                {
                    self.cut_off(id, &reason);
                    self.pump();
                    return Err(Status::invalid_argument(reason));
                }
                Ok(HeartbeatResponse {
                    lease: Some(self.lease(id)),
                    drain: self.ended.is_some(),
                })
            }
            _ => Err(id
                .is_none()
                .then(|| self.not_yours("worker_id", worker_id))
                .flatten()
                .unwrap_or_else(|| {
                    Status::not_found(format!(
                        "worker_id: {} (epoch {epoch}) holds no lease (expired, cut off, or \
                         never registered); register again",
                        crate::quoted(worker_id)
                    ))
                })),
        }
    }

    fn attach(&mut self, worker_id: &str, epoch: u64, outbox: Sink) -> Result<u64, Status> {
        let id = self
            .worker_number(worker_id)
            .filter(|id| self.workers.get(id).is_some_and(|w| w.alive))
            .ok_or_else(|| {
                self.not_yours("hello.worker_id", worker_id)
                    .unwrap_or_else(|| {
                        Status::not_found(format!(
                            "hello.worker_id: {} holds no lease; register first",
                            crate::quoted(worker_id)
                        ))
                    })
            })?;
        if epoch != 1 {
            return Err(Status::failed_precondition(format!(
                "hello.epoch: {epoch} is not the lease's epoch 1"
            )));
        }
        let Some(w) = self.workers.get_mut(&id) else {
            return Err(Status::internal("worker vanished"));
        };
        if w.outbox.is_some() {
            return Err(Status::already_exists(format!(
                "worker {worker_id} already has a work stream"
            )));
        }
        w.outbox = Some(outbox);
        let pool = w.pool;
        log!(
            self,
            "scheduler: worker {} attached its work stream",
            w.name
        );
        self.update_worker_gauges();
        if self.started.is_some() {
            let name = self
                .workers
                .get(&id)
                .map_or_else(String::new, |w| w.name.clone());
            self.pool_changed(pool, &format!("worker {name} joined"));
            self.flush_pending(pool);
        }
        Ok(id)
    }

    fn attached(&self, pool: u32) -> impl Iterator<Item = (u64, &Worker)> {
        self.workers
            .iter()
            .filter(move |(_, w)| w.alive && w.outbox.is_some() && !w.leaving && w.pool == pool)
            .map(|(&id, w)| (id, w))
    }

    fn maybe_start(&mut self) {
        if self.started.is_some() || self.ended.is_some() {
            return;
        }
        let attached = self
            .workers
            .values()
            .filter(|w| w.alive && w.outbox.is_some())
            .count();
        if attached < self.opts.expect_workers {
            return;
        }
        let missing: Vec<&str> = self
            .plan
            .pools_needed()
            .into_iter()
            .filter(|&p| self.attached(p).next().is_none())
            .map(|p| self.plan.pool_name(p))
            .collect();
        if !missing.is_empty() {
            log!(
                self,
                "scheduler: {} attached; waiting for pools {}",
                crate::counted(attached, "worker", "workers"),
                missing.join(", ")
            );
            return;
        }
        for pool in 0..self.plan.spec().pools.len() as u32 {
            if self.plan.pool_role(pool) != Some(PoolRole::Gpu) {
                continue;
            }
            let count = self.pool_gpus(pool);
            // Workers that did not declare their GPUs share what those that did left.
            let (declared, silent) =
                self.attached(pool)
                    .fold((0u32, 0u32), |(gpus, silent), (_, w)| match w.gpus {
                        0 => (gpus, silent + 1),
                        n => (gpus.saturating_add(n), silent),
                    });
            let left = count.saturating_sub(declared);
            self.gpu_share
                .insert(pool, left.div_ceil(silent.max(1)).max(1));
            self.planned_gpus.insert(pool, count);
        }
        // Each replica goes to the worker of its pool with the most GPUs free, so nodes of
        // different sizes get replicas in proportion (round-robin gave a 2-GPU node as many as
        // an 8-GPU one). When the nodes declare fewer GPUs than the plan uses, the last ones
        // go where the shortfall is least, and the re-plan for the GPUs present follows.
        for r in 0..self.owner.len() {
            let pool = self.replicas[r].pool;
            let Some(id) = self.roomiest_worker(pool, 0) else {
                continue;
            };
            if self.workers.get(&id).map(|w| self.free_gpus(w)) < Some(self.replicas[r].gpus) {
                log!(
                    self,
                    "scheduler: pool {}: no worker has {} GPUs free for replica {r}; it goes to \
                     worker w{id}, which has the most",
                    self.plan.pool_name(pool),
                    self.replicas[r].gpus
                );
            }
            self.owner[r] = Some(id);
            if let Some(w) = self.workers.get_mut(&id) {
                w.replicas.insert(r as u64);
            }
        }
        for w in self
            .workers
            .values()
            .filter(|w| w.alive && !w.replicas.is_empty())
        {
            let gpus = self.worker_gpus(w);
            log!(
                self,
                "scheduler: worker {}, with {gpus} GPUs{}, serves {} replica{} of pool {} on {} GPUs",
                w.name,
                if w.gpus > 0 { "" } else { ", its share" },
                w.replicas.len(),
                if w.replicas.len() == 1 { "" } else { "s" },
                self.plan.pool_name(w.pool),
                self.used_gpus(w)
            );
        }
        self.started = Some(self.at);
        log!(
            self,
            "scheduler: job {} starts with {} ({}, time scale {})",
            self.plan.name(),
            crate::counted(attached, "worker", "workers"),
            crate::counted(self.owner.len(), "replica", "replicas"),
            self.opts.time_scale
        );
        self.core.handle_timeout(Time::ZERO);
    }

    /// GPUs the job gives a pool.
    fn pool_gpus(&self, pool: u32) -> u32 {
        self.plan
            .spec()
            .pools
            .get(pool as usize)
            .and_then(|p| p.count)
            .map_or(0, |c| u32::try_from(c.max(0)).unwrap_or(u32::MAX))
    }

    /// GPUs a worker stands for: what it declared, else its pool's share.
    fn worker_gpus(&self, w: &Worker) -> u32 {
        if w.gpus > 0 {
            w.gpus
        } else {
            self.gpu_share.get(&w.pool).copied().unwrap_or(1)
        }
    }

    /// GPUs of a pool its attached workers stand for, at most what the job gives it.
    fn gpus_present(&self, pool: u32) -> u32 {
        let sum: u32 = self
            .attached(pool)
            .map(|(_, w)| self.worker_gpus(w))
            .fold(0u32, u32::saturating_add);
        sum.min(self.pool_gpus(pool))
    }

    /// Whether replica `r` still serves or will (not retiring, not retired).
    fn in_service(&self, r: usize) -> bool {
        let id = r as u64;
        !self.retiring.contains(&id) && !self.retired.contains(&id)
    }

    /// GPUs a pool's replicas in service (those no worker holds included) and its trainer take.
    fn gpus_wanted(&self, pool: u32) -> u32 {
        let replicas: u32 = (0..self.replicas.len())
            .filter(|&r| self.replicas[r].pool == pool && self.in_service(r))
            .map(|r| self.replicas[r].gpus)
            .sum();
        let trainer = &self.plan.placement.trainer;
        replicas
            + if trainer.pool == pool {
                trainer.gpus
            } else {
                0
            }
    }

    /// A worker of `pool` came or went. If the GPUs present are still those the running plan was
    /// made for (a spare covers a lost node, a node comes back), replicas no worker holds move to
    /// a worker of the pool as they are; otherwise the planner plans again.
    fn pool_changed(&mut self, pool: u32, why: &str) {
        let present = self.gpus_present(pool);
        let changed = self.plan.pool_role(pool) == Some(PoolRole::Gpu)
            && self.replanner.is_some()
            && self.planned_gpus.get(&pool).is_some_and(|&p| p != present);
        if changed {
            self.replan(pool, present, why, 0);
        } else {
            self.adopt_orphans(pool);
        }
    }

    /// Plans again for `present` GPUs in `pool`: replicas on a node that is gone are retired,
    /// and the move to the new plan starts (superseding one under way). When no placement fits
    /// what is left, nothing is re-planned: as before, the lost node's replicas move as they are
    /// to the pool's other workers, or wait for a node if none is left.
    /// `leaving`: replicas already retiring because their worker is leaving (counted with those
    /// retired here, as replicas that went with their node).
    fn replan(&mut self, pool: u32, present: u32, why: &str, leaving: u32) {
        let before = self.planned_gpus.get(&pool).copied().unwrap_or(0);
        if present >= self.gpus_wanted(pool) {
            self.adopt_orphans(pool);
        }
        let mut gpus = self.planned_gpus.clone();
        gpus.insert(pool, present);
        let running = self.running_replicas();
        let name = self.plan.pool_name(pool).to_owned();
        let Some(decision) = self
            .replanner
            .as_ref()
            .and_then(|p| p.decide(&gpus, &running, 0.0))
        else {
            log!(
                self,
                "scheduler: {why}; no placement fits the {present} GPUs of pool {name} left, so \
                 nothing is re-planned: its replicas move as they are to the pool's other \
                 workers, or wait for a node"
            );
            self.adopt_orphans(pool);
            return;
        };
        self.planned_gpus.insert(pool, present);
        // Replicas of the pool that no worker holds now were on the GPUs that are gone.
        let orphans: Vec<usize> = (0..self.replicas.len())
            .filter(|&r| {
                self.replicas[r].pool == pool && self.owner[r].is_none() && self.in_service(r)
            })
            .collect();
        for &r in &orphans {
            self.retiring.insert(r as u64);
            self.deferred.push_back(Input::RetireReplica {
                replica: ReplicaId(r as u64),
            });
        }
        let record = ReplanRecord::new(
            self.now().as_secs_f64(),
            why.to_owned(),
            name,
            (before, present),
            orphans.len() as u32 + leaving,
            &decision,
        );
        self.begin_move(record, decision.waves);
    }

    /// The replicas in service that a live worker holds.
    fn running_replicas(&self) -> Vec<ReplicaConfig> {
        (0..self.replicas.len())
            .filter(|&r| self.in_service(r) && self.owner[r].is_some())
            .map(|r| self.replicas[r].clone())
            .collect()
    }

    /// At a new policy version, with `--replan-on-drift`: if a share of peak the workers
    /// measured drifted past the margin from the one the running plan assumed, plans again with
    /// the measured profiles, which are from then on what the next check compares with. Not
    /// while a move is under way.
    fn check_drift(&mut self) {
        let Some(margin) = self.opts.replan_on_drift else {
            return;
        };
        let version = self.core.version();
        let idle = self.started.is_some() && self.ended.is_none() && self.migration.is_none();
        if !idle || version <= self.drift_checked {
            return;
        }
        self.drift_checked = version;
        let Some(replanner) = &self.replanner else {
            return;
        };
        let drifts = replanner.drift(&self.profiles, margin);
        match self.settling.check(&drifts, &self.profiles, version) {
            Settle::Quiet | Settle::Waiting => return,
            Settle::Restart { forget, wait } => {
                // Estimates of the pool's other kinds of work may still describe the hardware
                // as it was (they are measured at different rates): forget them, and plan once
                // those that were trusted are measured again.
                for (pool, kinds) in &forget {
                    for &kind in kinds {
                        self.profiles.restart(kind, pool);
                    }
                }
                if wait {
                    let pools: Vec<&str> = forget.iter().map(|(p, _)| p.as_str()).collect();
                    log!(
                        self,
                        "scheduler: measured profiles drifted at version {version} ({}); \
                         re-planning once the other kinds of work on {} are measured afresh",
                        describe_drifts(&drifts),
                        pools.join(", ")
                    );
                    return;
                }
            }
            Settle::Ready => {}
        }
        // Measured again where samples were forgotten.
        let drifts = replanner.drift(&self.profiles, margin);
        let Some(first) = drifts.first() else {
            return;
        };
        let Some(remeasured) =
            replanner.remeasured(self.plan.spec(), self.plan.catalog(), &self.profiles)
        else {
            return;
        };
        let why = match self.settling.take_seen().filter(|&seen| seen < version) {
            Some(seen) => format!(
                "measured profiles drifted at version {version} (seen at version {seen}, \
                 measured afresh since): {}",
                describe_drifts(&drifts)
            ),
            None => format!(
                "measured profiles drifted at version {version}: {}",
                describe_drifts(&drifts)
            ),
        };
        let pool = first.pool.clone();
        let gpus = self
            .plan
            .pool_index(&pool)
            .and_then(|p| self.planned_gpus.get(&p).copied())
            .unwrap_or(0);
        let running = self.running_replicas();
        let decision = remeasured.decide(&self.planned_gpus, &running, crate::replan::MIN_GAIN);
        self.replanner = Some(remeasured);
        let Some(decision) = decision else {
            log!(
                self,
                "scheduler: {why}; no placement fits with the measured profiles"
            );
            return;
        };
        let record = ReplanRecord::new(
            self.now().as_secs_f64(),
            why,
            pool,
            (gpus, gpus),
            0,
            &decision,
        );
        self.begin_move(record, decision.waves);
    }

    /// Records a re-plan and starts moving to it in `waves` (superseding a move under way).
    fn begin_move(&mut self, record: ReplanRecord, waves: Vec<MigrationWave>) {
        let running = record.running_step_s.map_or_else(
            || "none as it runs (it no longer fits the GPUs or cannot decode)".to_owned(),
            |s| format!("{s:.1} s as it runs"),
        );
        log!(
            self,
            "scheduler: {}: pool {} has {} GPUs (the plan had {}); re-plan: replicas retired \
             with their node: {}; predicted step (modelled) {}, {:.1} s on the new plan; {}",
            record.reason,
            record.pool,
            record.gpus_after,
            record.gpus_before,
            record.replicas_lost,
            running,
            record.planned_step_s,
            match waves.len() {
                0 => "nothing moves".to_owned(),
                n => format!("moving in {n} waves"),
            }
        );
        self.metrics.replans.inc();
        self.replans.push(record);
        self.migration = Some(Migration {
            waves,
            next: 0,
            waiting: BTreeSet::new(),
            record: self.replans.len() - 1,
            resize_trainer: None,
        });
        self.start_wave();
    }

    /// Starts the next wave of the move under way (ending the move when there is none): its
    /// replicas are started, then its others retired; the wave lasts until each new one has
    /// loaded the weights and each retired one has drained.
    fn start_wave(&mut self) {
        loop {
            let Some(m) = self.migration.as_mut() else {
                return;
            };
            let record = m.record;
            let Some(wave) = m.waves.get(m.next).cloned() else {
                let moved = m.next > 0;
                self.migration = None;
                let now = self.now().as_secs_f64();
                if let Some(r) = self.replans.get_mut(record) {
                    r.done_at_s = Some(now);
                }
                if moved {
                    log!(self, "scheduler: the move to the new plan is done");
                }
                return;
            };
            m.next += 1;
            m.resize_trainer = wave.trainer_gpus;
            let mut waiting = BTreeSet::new();
            for config in wave.start {
                if let Some(r) = self.start_replica(config) {
                    waiting.insert(r);
                }
            }
            let started = waiting.len() as u32;
            let mut retired = 0;
            for group in &wave.stop {
                let mut left = group.replicas;
                for r in (0..self.replicas.len()).rev() {
                    if left == 0 {
                        break;
                    }
                    let rc = &self.replicas[r];
                    let fits =
                        rc.pool == group.pool && rc.role == group.role && rc.gpus == group.gpus;
                    let id = r as u64;
                    if !fits
                        || self.owner[r].is_none()
                        || !self.in_service(r)
                        || waiting.contains(&id)
                    {
                        continue;
                    }
                    self.retiring.insert(id);
                    waiting.insert(id);
                    left -= 1;
                    retired += 1;
                    self.deferred.push_back(Input::RetireReplica {
                        replica: ReplicaId(id),
                    });
                }
            }
            if let Some(r) = self.replans.get_mut(record) {
                r.replicas_started += started;
                r.replicas_retired += retired;
            }
            if let Some(m) = self.migration.as_mut()
                && !waiting.is_empty()
            {
                m.waiting = waiting;
                return;
            }
            // A wave with nothing to wait for is over at once.
            self.wave_over();
        }
    }

    /// The wave under way is over: counted, and the trainer takes its new size if the wave
    /// resizes it (training batches dispatched from now on carry it; one running finishes on
    /// the GPUs it started on). `replan::migration` shrinks the trainer in a wave whose end
    /// comes before the next wave starts replicas on the GPUs it frees, and grows it only once
    /// retirements left it room.
    fn wave_over(&mut self) {
        let Some(m) = self.migration.as_mut() else {
            return;
        };
        let record = m.record;
        let resize = m.resize_trainer.take();
        if let Some(r) = self.replans.get_mut(record) {
            r.waves_done += 1;
        }
        if let Some(gpus) = resize {
            let before = self.plan.placement.trainer.gpus;
            if gpus != before {
                Arc::make_mut(&mut self.plan).placement.trainer.gpus = gpus;
                if let Some(replanner) = self.replanner.as_mut() {
                    replanner.trainer_resized(gpus);
                }
                if let Some(r) = self.replans.get_mut(record) {
                    r.trainer_gpus = Some(gpus);
                }
                log!(
                    self,
                    "scheduler: the trainer now trains on {gpus} GPUs (was {before})"
                );
            }
        }
    }

    /// Replica `r` loaded its weights or was handed back: the wave it belongs to may be over.
    fn migration_progress(&mut self, r: u64) {
        let Some(m) = self.migration.as_mut() else {
            return;
        };
        if !m.waiting.remove(&r) || !m.waiting.is_empty() {
            return;
        }
        self.wave_over();
        self.start_wave();
    }

    /// GPUs a worker's replicas use.
    fn used_gpus(&self, w: &Worker) -> u32 {
        w.replicas
            .iter()
            .filter_map(|&r| self.replicas.get(r as usize))
            .map(|rc| rc.gpus)
            .sum()
    }

    /// GPUs of a worker that none of its replicas use.
    fn free_gpus(&self, w: &Worker) -> u32 {
        self.worker_gpus(w).saturating_sub(self.used_gpus(w))
    }

    /// The attached worker of `pool` with the most GPUs free, at least `gpus` (the lowest id
    /// among equals, so the choice does not depend on map order).
    fn roomiest_worker(&self, pool: u32, gpus: u32) -> Option<u64> {
        self.attached(pool)
            .map(|(id, w)| (self.free_gpus(w), id))
            .filter(|&(free, _)| free >= gpus)
            .max_by_key(|&(free, id)| (free, std::cmp::Reverse(id)))
            .map(|(_, id)| id)
    }

    /// Starts a replica of a new plan on the worker of its pool with the most free GPUs (at
    /// least the replica's): the worker hears of it before any work for it, the core books it.
    /// `None` when no worker has the room.
    fn start_replica(&mut self, config: ReplicaConfig) -> Option<u64> {
        let Some(worker) = self.roomiest_worker(config.pool, config.gpus) else {
            log!(
                self,
                "scheduler: no worker of pool {} has {} GPUs free: a replica of the new plan is not \
                 started",
                self.plan.pool_name(config.pool),
                config.gpus
            );
            return None;
        };
        let id = self.replicas.len() as u64;
        let (role, message) = start_message(id, &config);
        self.replicas.push(config.clone());
        self.owner.push(Some(worker));
        self.replica_running.push(0);
        if let Some(w) = self.workers.get_mut(&worker) {
            w.replicas.insert(id);
            // A closed stream is noticed by its reader, which reports the worker lost.
            if let Some(outbox) = &w.outbox {
                outbox.send(Ok(message));
            }
            log!(
                self,
                "scheduler: replica {id} ({role}, {} GPUs) starts on worker {}",
                config.gpus,
                w.name
            );
        }
        self.deferred.push_back(Input::ReplicaAdded { config });
        Some(id)
    }

    /// The core handed a retired replica back: its worker stops serving it.
    fn replica_retired(&mut self, r: u64) {
        self.retiring.remove(&r);
        self.retired.insert(r);
        if let Some(owner) = self.owner.get_mut(r as usize).and_then(Option::take)
            && let Some(w) = self.workers.get_mut(&owner)
        {
            w.replicas.remove(&r);
            let message = SchedulerMessage {
                message: Some(scheduler_message::Message::StopReplica(r)),
            };
            if let Some(outbox) = &w.outbox {
                outbox.send(Ok(message));
            }
        }
        self.migration_progress(r);
    }

    /// Gives the orphaned replicas of `pool` (their worker was lost) to its attached workers,
    /// the least loaded first. A replica a re-plan started is not in the plan the workers know,
    /// so its new worker is told to start it, as its first worker was.
    fn adopt_orphans(&mut self, pool: u32) {
        for r in 0..self.owner.len() {
            let gone = self.retiring.contains(&(r as u64)) || self.retired.contains(&(r as u64));
            if self.owner[r].is_some() || self.replicas[r].pool != pool || gone {
                continue;
            }
            let Some(id) = self
                .attached(pool)
                .min_by_key(|(id, w)| (w.replicas.len(), *id))
                .map(|(id, _)| id)
            else {
                return;
            };
            self.owner[r] = Some(id);
            let started_by_a_replan = r >= self.plan.placement.replicas.len();
            let start = started_by_a_replan.then(|| start_message(r as u64, &self.replicas[r]).1);
            if let Some(w) = self.workers.get_mut(&id) {
                w.replicas.insert(r as u64);
                if let (Some(message), Some(outbox)) = (start, &w.outbox) {
                    outbox.send(Ok(message));
                }
            }
            log!(self, "scheduler: replica {r} moves to worker w{id}");
            self.replicas_moved += 1;
            self.update_retries.remove(&(r as u64));
            self.deferred.push_back(Input::ReplicaRecovered {
                replica: ReplicaId(r as u64),
            });
        }
    }

    /// Drains the core's commands and the inputs queued while executing them.
    fn pump(&mut self) {
        if self.started.is_none() {
            return;
        }
        loop {
            while let Some(command) = self.core.poll_command() {
                self.execute(command);
            }
            match self.deferred.pop_front() {
                Some(input) => {
                    let now = self.now();
                    self.core.handle_input(now, input);
                }
                None => break,
            }
        }
        self.release_leavers();
        self.observe_rl_steps();
        if self.ended.is_none() && self.core.finished() {
            self.finish(JobPhase::Succeeded);
        }
    }

    /// Observes the RL steps trained since the last call: the time since the version before
    /// (the first: since the job's start), in the job's seconds, shared evenly when several
    /// versions came at once.
    fn observe_rl_steps(&mut self) {
        let version = self.core.version();
        let (seen, at) = self.version_seen;
        if version <= seen {
            return;
        }
        let from = if seen == 0 {
            self.started.unwrap_or(at)
        } else {
            at
        };
        let steps = version - seen;
        let seconds = self.at.saturating_sub(from).as_secs_f64()
            / self.opts.time_scale.max(1e-9)
            / steps as f64;
        for _ in 0..steps {
            self.metrics.rl_step_duration.observe(seconds);
        }
        self.version_seen = (version, self.at);
    }

    /// A worker said it is leaving (its node is drained, preempted or scaled down): from now on
    /// it gets no new work, its replicas are retired (the core lets the stages running on them
    /// finish and places nothing new there), the pool is planned again for the GPUs left, so that
    /// the others start replicas where they have room, and the worker is released once it holds
    /// nothing. What it runs is neither lost nor redone; if it goes before it is released, it is
    /// lost as any worker is.
    fn worker_leaving(&mut self, worker: u64, reason: &str) {
        let Some(w) = self.workers.get_mut(&worker) else {
            return;
        };
        // After the end every worker was told to drain: a node going then changes nothing.
        if !w.alive || w.leaving || self.ended.is_some() {
            return;
        }
        w.leaving = true;
        let (name, pool) = (w.name.clone(), w.pool);
        let replicas: Vec<u64> = w.replicas.iter().copied().collect();
        self.leaving.insert(worker);
        let reason = if reason.is_empty() {
            "no reason given"
        } else {
            reason
        };
        log!(
            self,
            "scheduler: worker {name} is leaving ({reason}): it gets nothing new, and is released \
             once what it runs is done"
        );
        self.update_worker_gauges();
        if self.started.is_none() {
            self.release_leavers();
            return;
        }
        if self.replanner.is_none() && !replicas.is_empty() {
            // With no planner to start its replicas elsewhere, retiring them would shrink the
            // pool for good: they stay, and move as a lost worker's do when it goes.
            log!(
                self,
                "scheduler: no planner for this job: the replicas of worker {name} move to the \
                 pool's other workers when it goes"
            );
            self.pump();
            return;
        }
        let mut retiring = 0;
        for r in replicas {
            if self.in_service(r as usize) {
                retiring += 1;
                self.retiring.insert(r);
                self.deferred.push_back(Input::RetireReplica {
                    replica: ReplicaId(r),
                });
            }
        }
        if self.plan.pool_role(pool) == Some(PoolRole::Gpu) && self.replanner.is_some() {
            let present = self.gpus_present(pool);
            let planned = self.planned_gpus.get(&pool).copied();
            self.replan(
                pool,
                present,
                &format!("worker {name} is leaving"),
                retiring,
            );
            // Nothing fitted the GPUs left: the next node to join is planned for afresh.
            if self.planned_gpus.get(&pool).copied() == planned {
                self.planned_gpus.insert(pool, present);
            }
        }
        self.pump();
    }

    /// Releases every leaving worker that holds nothing any more: it is told to drain, and goes
    /// as a worker does at the job's end (not lost).
    fn release_leavers(&mut self) {
        if self.leaving.is_empty() {
            return;
        }
        let done: Vec<u64> = self
            .leaving
            .iter()
            .copied()
            .filter(|id| {
                self.workers
                    .get(id)
                    .is_none_or(|w| !w.alive || (w.assignments.is_empty() && w.replicas.is_empty()))
            })
            .collect();
        for id in done {
            self.leaving.remove(&id);
            let Some(w) = self.workers.get_mut(&id) else {
                continue;
            };
            if !w.alive {
                continue;
            }
            w.alive = false;
            let name = w.name.clone();
            if let Some(outbox) = w.outbox.take() {
                outbox.send(Ok(SchedulerMessage {
                    message: Some(scheduler_message::Message::Drain(true)),
                }));
            }
            self.forget_gpus(id);
            self.update_worker_gauges();
            self.forget(id);
            listed(&mut self.left, &mut self.left_total, name.clone());
            self.metrics.workers_left.inc();
            log!(
                self,
                "scheduler: worker {name} left: released, nothing of it lost"
            );
        }
    }

    fn new_assignment(&mut self, pool: u32, what: What, mut message: WorkAssignment) -> u64 {
        let id = self.next_assignment;
        self.next_assignment += 1;
        message.assignment_id = id;
        if let What::Stage { stage, .. } = &what {
            self.by_stage.insert(*stage, id);
        }
        self.assignments.insert(
            id,
            Assignment {
                worker: None,
                pool,
                what,
                message,
                sent_at: None,
            },
        );
        id
    }

    fn execute(&mut self, command: Command) {
        if self.ended.is_some() {
            return;
        }
        match command {
            Command::Run(cmd) => self.run_stage(cmd),
            Command::UpdateWeights {
                replica,
                version,
                bytes,
                ..
            } => {
                let r = replica.0 as usize;
                let Some(Some(owner)) = self.owner.get(r).copied() else {
                    // The replica is lost; the core was told and will update it on recovery.
                    return;
                };
                let pool = self.replicas[r].pool;
                // An external trainer's version loads what it published; version 0 (and every
                // version of the emulated trainer) has no weights to move.
                let sync = match self.publications.get(&version) {
                    Some(p) => WeightSyncWork {
                        to_version: version,
                        weight_bytes: if p.bytes > 0 { p.bytes } else { bytes },
                        source: p.uri.clone(),
                        replica: replica.0,
                        format: p.format.clone(),
                        sha256: p.sha256.clone(),
                    },
                    None => WeightSyncWork {
                        to_version: version,
                        weight_bytes: bytes,
                        source: "emulated://trainer".into(),
                        replica: replica.0,
                        ..Default::default()
                    },
                };
                let message = WorkAssignment {
                    kind: StageKind::WeightSync as i32,
                    policy_version: version,
                    work: Some(work_assignment::Work::WeightSync(sync)),
                    ..Default::default()
                };
                let id = self.new_assignment(pool, What::Weights { replica, version }, message);
                self.send_to(id, owner);
            }
            // The emulated engine keeps no KV between stages (the core keeps those books); a real
            // engine's prefix cache evicts on its own.
            Command::ReleaseKv { .. } => {}
            Command::Cancel { stage } => self.cancel(stage),
            Command::Interrupt { stage } => self.interrupt(stage),
            Command::ReplicaRetired { replica } => self.replica_retired(replica.0),
            Command::AbandonGroup {
                group,
                trajectories,
                failed,
            } => {
                let last_failure = self
                    .trajs
                    .get(&failed)
                    .map(|t| t.last_failure.clone())
                    .unwrap_or_default();
                for t in &trajectories {
                    self.trajs.remove(t);
                }
                log!(
                    self,
                    "scheduler: gave up group {} ({} trajectories) as an infrastructure failure: \
                     trajectory {} failed {} times in a row; last: {}",
                    group.0,
                    trajectories.len(),
                    failed.0,
                    self.plan.config.stage_failure_limit,
                    if last_failure.is_empty() {
                        "a timeout"
                    } else {
                        &last_failure
                    }
                );
                self.metrics.groups_abandoned.inc();
                self.abandoned_since_training += 1;
                let cfg = &self.plan.config;
                let limit = u64::from(cfg.rollout_batch_size / cfg.group_size.max(1)).max(4);
                if self.abandoned_since_training >= limit && self.failure.is_none() {
                    let reason = format!(
                        "{limit} groups in a row were given up with no batch trained in between, \
                         so the fault is not one trajectory's; the last one's failure: {}",
                        if last_failure.is_empty() {
                            "a timeout"
                        } else {
                            &last_failure
                        }
                    );
                    log!(self, "scheduler: job fails: {reason}");
                    self.failure = Some(reason);
                }
                self.abandoned.push(AbandonedGroup {
                    group: group.0,
                    trajectories: trajectories.iter().map(|t| t.0).collect(),
                    failed: failed.0,
                    last_failure,
                });
                // A job already ended (by a configuration error) is not ended again.
                if self.failure.is_some() && self.ended.is_none() {
                    self.finish(JobPhase::Failed);
                }
            }
            Command::Train {
                batch,
                step,
                publishes,
                trajectories,
                tokens,
            } => {
                self.abandoned_since_training = 0;
                for (i, t) in trajectories.iter().enumerate() {
                    if !self.trained_set.insert(t.0) {
                        self.trained_twice.push(t.0);
                    }
                    self.trained.push(t.0);
                    let known = self.trajs.remove(t);
                    if let Some(info) = &known {
                        self.record_outcome(step, info);
                    }
                    let mut info = known.unwrap_or_default();
                    let last_of_group = trajectories
                        .get(i + 1)
                        .and_then(|n| self.trajs.get(n))
                        .is_none_or(|n| n.group != info.group);
                    let task = self.plan.spec().tasks.get(info.task as usize);
                    let completed = CompletedTrajectory {
                        sequence: 0,
                        trajectory: Some(TrajectoryId {
                            job: self.plan.name().to_owned(),
                            group: info.group,
                            index: (t.0 % u64::from(self.plan.config.group_size.max(1))) as u32,
                            id: t.0,
                            attempt: info.attempt,
                        }),
                        turns: info
                            .versions
                            .iter()
                            .map(|(&index, &policy_version)| {
                                let tokens = info.tokens.remove(&index);
                                feed_turn(
                                    Turn {
                                        index,
                                        policy_version,
                                        observation: info
                                            .observations
                                            .get_mut(index as usize)
                                            .map(std::mem::take)
                                            .unwrap_or_default(),
                                        action: info
                                            .actions
                                            .get_mut(index as usize)
                                            .map(std::mem::take)
                                            .unwrap_or_default(),
                                        output: info.outputs.remove(&index).unwrap_or_default(),
                                        ..Default::default()
                                    },
                                    tokens,
                                )
                            })
                            .collect(),
                        reward: info.reward,
                        oldest_policy_version: info.versions.values().min().copied().unwrap_or(0),
                        task: task.map_or_else(String::new, |t| t.name.clone()),
                        prompt: std::mem::take(&mut info.prompt),
                    };
                    self.feed
                        .append(completed, last_of_group.then_some(info.group));
                }
                self.metrics
                    .trajectories_trained
                    .inc_by(trajectories.len() as u64);
                self.export_step_outcomes(step);
                if self.external_trainer() {
                    // The trajectories are on the feed: the trainer takes them from there. A
                    // batch within a step is handed over at once; the one that completes the
                    // step is over when the trainer publishes the next version.
                    if !publishes {
                        self.deferred.push_back(Input::TrainFinished { batch });
                    }
                    return;
                }
                let job = self.plan.name().to_owned();
                let batch_ids = trajectories
                    .iter()
                    .map(|t| TrajectoryId {
                        job: job.clone(),
                        id: t.0,
                        ..Default::default()
                    })
                    .collect();
                let pool = self.plan.placement.trainer.pool;
                let message = WorkAssignment {
                    kind: StageKind::Train as i32,
                    policy_version: step,
                    work: Some(work_assignment::Work::Train(TrainWork {
                        batch: batch_ids,
                        from_version: step,
                        batch_id: batch.0,
                        tokens,
                        publishes,
                        trainer_gpus: self.plan.placement.trainer.gpus,
                    })),
                    ..Default::default()
                };
                let id = self.new_assignment(pool, What::Train(batch), message);
                self.dispatch_pooled(id);
            }
        }
    }

    fn run_stage(&mut self, cmd: StageCommand) {
        let plan = self.plan.clone();
        let spec = plan.spec();
        let task = spec.tasks.get(cmd.task as usize);
        let environment = task.map_or("", |t| t.environment.as_str()).to_owned();
        let seed = episode_seed(plan.config.seed, cmd.traj.0);
        // What the replica's engine takes as the turn's prompt.
        let policy_input = match cmd.work {
            StageWork::Generate { replica, .. } => self
                .owner
                .get(replica.0 as usize)
                .copied()
                .flatten()
                .and_then(|w| self.workers.get(&w))
                .map_or(PolicyInput::Counts, |w| w.policy_input),
            _ => PolicyInput::Counts,
        };
        let info = self.trajs.entry(cmd.traj).or_default();
        if info.attempt != cmd.attempt {
            // Regenerated from turn `cmd.turn`: the turns before it stand (same episode, replayed
            // up to there); everything from it on is redone.
            let keep = cmd.turn as usize;
            info.attempt = cmd.attempt;
            info.actions.truncate(keep);
            info.observations.truncate(keep);
            info.outputs.retain(|&turn, _| turn < cmd.turn);
            info.versions.retain(|&turn, _| turn < cmd.turn);
            info.tokens.retain(|&turn, _| turn < cmd.turn);
            info.message_tokens.retain(|&turn, _| turn <= cmd.turn);
            info.action_tokens.retain(|&turn, _| turn < cmd.turn);
            info.reward = 0.0;
            info.reward_modelled = false;
            info.partial = None;
        }
        info.group = cmd.group.0;
        info.task = cmd.task;
        // A resumed turn: what it generated before its interrupt.
        let resumed = info
            .partial
            .as_ref()
            .filter(|p| p.turn == cmd.turn && p.count > 0);
        if matches!(cmd.work, StageWork::Generate { .. }) {
            // A resumed turn is as old as its oldest part.
            let oldest = resumed
                .and_then(|p| p.tokens.segments.iter().map(|s| s.policy_version).min())
                .map_or(cmd.version, |v| v.min(cmd.version));
            info.versions.insert(cmd.turn, oldest);
        }
        let trajectory = Some(TrajectoryId {
            job: plan.name().to_owned(),
            group: cmd.group.0,
            index: (cmd.traj.0 % u64::from(plan.config.group_size.max(1))) as u32,
            id: cmd.traj.0,
            attempt: cmd.attempt,
        });
        let session = format!("{}/{}", cmd.traj.0, cmd.attempt);
        let base = WorkAssignment {
            trajectory,
            turn: cmd.turn,
            policy_version: cmd.version,
            task: cmd.task,
            ..Default::default()
        };
        let what = |kind, reset| What::Stage {
            stage: cmd.stage,
            traj: cmd.traj,
            kind,
            reset,
        };
        match cmd.work {
            StageWork::EnvReset { pool, millicpus }
            | StageWork::EnvStep {
                pool, millicpus, ..
            } => {
                let reset = matches!(cmd.work, StageWork::EnvReset { .. });
                if reset {
                    info.actions.clear();
                    info.observations.clear();
                    info.outputs.clear();
                    info.tokens.clear();
                    info.message_tokens.clear();
                    info.partial = None;
                }
                // A step applies the turn just generated (turn - 1); a real engine's text is
                // relayed, an emulated generation has none.
                let policy_output = if reset {
                    None
                } else {
                    cmd.turn
                        .checked_sub(1)
                        .and_then(|t| info.outputs.get(&t).cloned())
                };
                let message = WorkAssignment {
                    kind: StageKind::EnvStep as i32,
                    work: Some(work_assignment::Work::EnvStep(EnvStepWork {
                        environment,
                        seed,
                        action: String::new(),
                        reset,
                        timeout_ms: 30_000,
                        history: if reset {
                            Vec::new()
                        } else {
                            info.actions.clone()
                        },
                        policy_output,
                    })),
                    ..base
                };
                let id =
                    self.new_assignment(pool, what(StageKindOf::Env { millicpus }, reset), message);
                self.dispatch_pooled(id);
            }
            StageWork::Prefill { replica, tokens } => {
                let message = WorkAssignment {
                    kind: StageKind::Prefill as i32,
                    work: Some(work_assignment::Work::Generation(GenerationWork {
                        session,
                        prefill_only: true,
                        replica: replica.0,
                        prefill_token_count: tokens,
                        ..Default::default()
                    })),
                    ..base
                };
                self.dispatch_replica(replica, what(StageKindOf::Prefill(replica), false), message);
            }
            StageWork::Generate {
                replica,
                cached_tokens,
                prefill_tokens,
                max_new_tokens,
                kv_from,
                kv_tokens,
            } => {
                let prompt_text = if policy_input == PolicyInput::Text {
                    render_context(info)
                } else {
                    String::new()
                };
                let (context_tokens, new_messages) =
                    if let (PolicyInput::Tokens, Some(p)) = (policy_input, resumed) {
                        // The answer goes on where it stopped: no new message.
                        let (mut context, _) = token_context(&info.tokens, cmd.turn, String::new());
                        context.extend_from_slice(&p.tokens.prompt);
                        context.extend_from_slice(&p.tokens.action);
                        (context, Vec::new())
                    } else if policy_input == PolicyInput::Tokens {
                        let message = match cmd.turn.checked_sub(1) {
                            None => info.prompt.clone(),
                            Some(last) => info
                                .observations
                                .get(last as usize)
                                .cloned()
                                .unwrap_or_default(),
                        };
                        token_context(&info.tokens, cmd.turn, message)
                    } else {
                        (Vec::new(), Vec::new())
                    };
                let message = WorkAssignment {
                    kind: StageKind::Decode as i32,
                    work: Some(work_assignment::Work::Generation(GenerationWork {
                        prompt_text,
                        session,
                        max_new_tokens: u32::try_from(max_new_tokens).unwrap_or(u32::MAX),
                        cached_prefix_tokens: u32::try_from(cached_tokens).unwrap_or(u32::MAX),
                        kv_source_worker: kv_from
                            .and_then(|r| self.owner.get(r.0 as usize).copied().flatten())
                            .map(|w| format!("w{w}"))
                            .unwrap_or_default(),
                        decode_only: kv_from.is_some(),
                        replica: replica.0,
                        prefill_token_count: prefill_tokens,
                        kv_pull_tokens: kv_tokens,
                        context_tokens,
                        new_messages,
                        // A resumed turn's messages went with its first part.
                        new_message_tokens: match resumed {
                            Some(_) => 0,
                            None => info.message_tokens.get(&cmd.turn).copied().unwrap_or(0),
                        },
                        resumed_tokens: resumed.map_or(0, |p| p.count),
                        ..Default::default()
                    })),
                    ..base
                };
                self.dispatch_replica(
                    replica,
                    what(StageKindOf::Generate(replica), false),
                    message,
                );
            }
            StageWork::Reward {
                pool,
                serverless,
                millicpus,
            } => {
                let reward = task.and_then(|t| spec.rewards.iter().find(|r| r.name == t.reward));
                let function = reward
                    .and_then(|r| r.function.clone())
                    .unwrap_or_else(|| "exact_match".into());
                let last = info.actions.last().cloned().unwrap_or_default();
                let response = last
                    .strip_prefix("answer:")
                    .map_or(last.as_str(), str::trim)
                    .to_owned();
                // The calculator task knows its true answer from the episode seed; other tasks
                // have no reference, so the function scores the response against nothing.
                let reference = if environment == "calculator" {
                    let task = rollfleet_environments::conversion::Task::generate(seed);
                    format!("{:.3}", task.answer)
                } else {
                    String::new()
                };
                let key = format!("{}/{}", cmd.traj.0, cmd.attempt);
                let payload = serde_json::json!({
                    "response": response,
                    "reference": reference,
                    "idempotency_key": key,
                });
                let message = WorkAssignment {
                    kind: StageKind::Reward as i32,
                    work: Some(work_assignment::Work::Reward(RewardWork {
                        function,
                        payload: payload.to_string().into_bytes(),
                        idempotency_key: key,
                    })),
                    ..base
                };
                let id = self.new_assignment(
                    pool,
                    what(
                        StageKindOf::Reward {
                            serverless,
                            millicpus,
                        },
                        false,
                    ),
                    message,
                );
                self.dispatch_pooled(id);
            }
        }
    }

    fn dispatch_replica(&mut self, replica: ReplicaId, what: What, message: WorkAssignment) {
        let r = replica.0 as usize;
        let pool = self.replicas.get(r).map_or(0, |c| c.pool);
        let stage = match &what {
            What::Stage { stage, .. } => *stage,
            _ => return,
        };
        match self.owner.get(r).copied().flatten() {
            Some(owner) => {
                let id = self.new_assignment(pool, what, message);
                self.replica_running[r] += 1;
                if self.replica_running[r] == 1 {
                    *self.gpus_busy.entry(pool).or_default() += u64::from(self.replicas[r].gpus);
                }
                self.level_changed(pool);
                self.send_to(id, owner);
            }
            None => self.deferred.push_back(Input::StageFailed { stage }),
        }
    }

    /// Sends a pool-placed assignment to the best worker of its pool, or queues it until one
    /// attaches.
    fn dispatch_pooled(&mut self, id: u64) {
        let Some(a) = self.assignments.get(&id) else {
            return;
        };
        let pool = a.pool;
        let sticky = match &a.what {
            What::Stage {
                traj,
                kind: StageKindOf::Env { .. },
                ..
            } => self.trajs.get(traj).and_then(|t| t.env_worker),
            _ => None,
        };
        let target = sticky
            .filter(|w| {
                self.workers
                    .get(w)
                    .is_some_and(|w| w.alive && w.outbox.is_some() && !w.leaving && w.pool == pool)
            })
            .or_else(|| {
                self.attached(pool)
                    .min_by_key(|(id, w)| (w.assignments.len(), *id))
                    .map(|(id, _)| id)
            });
        match target {
            Some(w) => self.send_to(id, w),
            None => self.pending.entry(pool).or_default().push_back(id),
        }
    }

    /// Counts a pool-placed assignment in (+1) or out (-1) of its pool's busy level.
    fn book_units(&mut self, pool: u32, what: &What, sign: i64) {
        match *what {
            What::Stage {
                kind: StageKindOf::Env { millicpus },
                ..
            }
            | What::Stage {
                kind:
                    StageKindOf::Reward {
                        serverless: false,
                        millicpus,
                    },
                ..
            } => {
                let v = self.cpu_in_use.entry(pool).or_default();
                *v = v.saturating_add_signed(sign * millicpus as i64);
            }
            What::Stage {
                kind:
                    StageKindOf::Reward {
                        serverless: true, ..
                    },
                ..
            } => {
                let v = self.serverless_running.entry(pool).or_default();
                *v = v.saturating_add_signed(sign);
            }
            What::Train(_) => {
                self.trainer_busy = self.trainer_busy.saturating_add_signed(sign as i32);
            }
            _ => {}
        }
        self.level_changed(pool);
    }

    fn level_changed(&mut self, pool: u32) {
        let level = match self.plan.pool_role(pool) {
            Some(PoolRole::Gpu) => {
                // As in the simulator, a replica is busy while it runs stages.
                let mut gpus = self.gpus_busy.get(&pool).copied().unwrap_or(0) as f64;
                if self.plan.placement.trainer.pool == pool && self.trainer_busy > 0 {
                    gpus += self.plan.placement.trainer.gpus as f64;
                }
                gpus
            }
            Some(PoolRole::Cpu) => self.cpu_in_use.get(&pool).copied().unwrap_or(0) as f64 / 1000.0,
            Some(PoolRole::Serverless) => {
                self.serverless_running.get(&pool).copied().unwrap_or(0) as f64
            }
            None => 0.0,
        };
        let now = self.now();
        if let Some(m) = self.meters.get_mut(&pool) {
            m.set(now, level);
        }
    }

    fn send_to(&mut self, id: u64, worker: u64) {
        let Some(a) = self.assignments.get_mut(&id) else {
            return;
        };
        let Some(w) = self.workers.get_mut(&worker) else {
            return;
        };
        a.worker = Some(worker);
        a.sent_at = Some(self.at);
        w.assignments.insert(id);
        let (pool, what) = (a.pool, a.what.clone());
        if let What::Stage { traj, .. } = &what
            && let Some(ready) = self.trajs.get_mut(traj).and_then(|t| t.ready_at.take())
        {
            let seconds =
                self.at.saturating_sub(ready).as_secs_f64() / self.opts.time_scale.max(1e-9);
            self.metrics
                .stage_queue_wait
                .with_label_values(&[metric_kind(&what)])
                .observe(seconds);
        }
        if let What::Stage {
            traj,
            kind: StageKindOf::Env { .. },
            ..
        } = a.what
            && let Some(t) = self.trajs.get_mut(&traj)
        {
            t.env_worker = Some(worker);
        }
        let message = SchedulerMessage {
            message: Some(scheduler_message::Message::Assign(a.message.clone())),
        };
        let sent = w.outbox.as_ref().is_some_and(|o| o.send(Ok(message)));
        if !matches!(
            what,
            What::Weights { .. }
                | What::Stage {
                    kind: StageKindOf::Prefill(_) | StageKindOf::Generate(_),
                    ..
                }
        ) {
            self.book_units(pool, &what, 1);
        }
        if !sent {
            // Handled as the stream's reader would report it, after this event and journaled
            // as an event of its own (a replay sends nothing, so never fails here).
            self.loopback.push_back(Event::Detach {
                worker,
                reason: "its work stream is closed".into(),
            });
        }
    }

    fn flush_pending(&mut self, pool: u32) {
        let queued: Vec<u64> = self
            .pending
            .get_mut(&pool)
            .map(|q| q.drain(..).collect())
            .unwrap_or_default();
        for id in queued {
            self.dispatch_pooled(id);
        }
    }

    /// Asks the worker running `stage` to stop it where it is and report what it generated.
    fn interrupt(&mut self, stage: StageId) {
        let Some(&id) = self.by_stage.get(&stage) else {
            return;
        };
        let Some(worker) = self.assignments.get(&id).and_then(|a| a.worker) else {
            return;
        };
        if let Some(w) = self.workers.get(&worker).filter(|w| w.alive)
            && let Some(o) = &w.outbox
        {
            o.send(Ok(SchedulerMessage {
                message: Some(scheduler_message::Message::InterruptAssignmentId(id)),
            }));
        }
    }

    fn cancel(&mut self, stage: StageId) {
        let Some(id) = self.by_stage.remove(&stage) else {
            return;
        };
        let Some(a) = self.assignments.remove(&id) else {
            return;
        };
        self.unbook(&a);
        match a.worker {
            Some(w) => self.abort_on(w, id),
            None => {
                if let Some(q) = self.pending.get_mut(&a.pool) {
                    q.retain(|x| *x != id);
                }
            }
        }
    }

    /// Takes assignment `id` back from `worker`: a live worker is told to abort it, and its
    /// late answer, if one comes, is ignored instead of cutting the worker off.
    fn abort_on(&mut self, worker: u64, id: u64) {
        let Some(w) = self.workers.get_mut(&worker) else {
            return;
        };
        w.assignments.remove(&id);
        if w.alive {
            w.cancelled.insert(id);
            if let Some(o) = &w.outbox {
                o.send(Ok(SchedulerMessage {
                    message: Some(scheduler_message::Message::AbortAssignmentId(id)),
                }));
            }
        }
    }

    /// A training batch or a weight update that a live worker holds and never answers (a hung
    /// trainer or engine whose process still heartbeats) would hold the job for good: stages
    /// have the core's timeout, these had none. Past the bound it is aborted on its worker (a
    /// late answer is then ignored, as for any aborted assignment); a batch goes to a trainer
    /// again, and an update counts as failed: the replica leaves service and is updated again
    /// after its backoff.
    fn give_up_hung(&mut self) {
        let bound = HUNG_AFTER_AT_LEAST.max(Duration::from_secs_f64(
            self.plan.config.stage_timeout.as_secs_f64(),
        ));
        let now = self.at;
        let hung: Vec<u64> = self
            .assignments
            .iter()
            .filter(|(_, a)| matches!(a.what, What::Train(_) | What::Weights { .. }))
            .filter(|(_, a)| {
                a.sent_at
                    .is_some_and(|sent| now.saturating_sub(sent) > bound)
            })
            .map(|(&id, _)| id)
            .collect();
        for id in hung {
            let Some(a) = self.assignments.remove(&id) else {
                continue;
            };
            self.unbook(&a);
            let Some(worker) = a.worker else {
                continue;
            };
            let name = self
                .workers
                .get(&worker)
                .map_or_else(|| "?".to_owned(), |w| w.name.clone());
            self.abort_on(worker, id);
            self.metrics.hung_assignments.inc();
            let waited = bound.as_secs();
            match a.what {
                What::Train(batch) => {
                    log!(
                        self,
                        "scheduler: assignment {id} (training) on w{worker} ({name}) had no \
                         answer in {waited} s; aborted there and given to a trainer again"
                    );
                    let again = self.new_assignment(a.pool, What::Train(batch), a.message);
                    self.dispatch_pooled(again);
                }
                What::Weights { replica, version } => self.update_failed(
                    worker,
                    replica,
                    version,
                    &format!("assignment {id} had no answer in {waited} s"),
                ),
                What::Stage { .. } => {}
            }
        }
    }

    /// Takes a finished, failed or abandoned assignment out of the busy accounting.
    fn unbook(&mut self, a: &Assignment) {
        match a.what {
            What::Stage {
                kind: StageKindOf::Prefill(r) | StageKindOf::Generate(r),
                ..
            } => {
                let r = r.0 as usize;
                if self.replica_running[r] == 1 {
                    let busy = self.gpus_busy.entry(a.pool).or_default();
                    *busy = busy.saturating_sub(u64::from(self.replicas[r].gpus));
                }
                self.replica_running[r] = self.replica_running[r].saturating_sub(1);
                self.level_changed(a.pool);
            }
            // As in the simulator, loading weights is accounted apart from utilisation.
            What::Weights { .. } => {}
            _ => {
                if a.worker.is_some() {
                    self.book_units(a.pool, &a.what, -1);
                }
            }
        }
    }

    fn message(&mut self, worker: u64, message: WorkerMessage) {
        match message.message {
            Some(worker_message::Message::Result(result)) => self.result(worker, result),
            Some(worker_message::Message::Load(load)) => {
                if let Err(reason) = self.load_report(worker, &load) {
                    self.cut_off(worker, &reason);
                }
            }
            Some(worker_message::Message::Hello(_)) => {
                self.cut_off(worker, "sent a second hello on its work stream")
            }
            Some(worker_message::Message::Leaving(leaving)) => {
                self.worker_leaving(worker, &leaving.reason)
            }
            None => self.cut_off(worker, "sent an empty message (no field of the oneof set)"),
        }
    }

    fn result(&mut self, worker: u64, result: WorkResult) {
        let id = result.assignment_id;
        let Some(w) = self.workers.get_mut(&worker) else {
            return;
        };
        if !w.alive {
            return;
        }
        if !w.assignments.remove(&id) {
            if w.cancelled.remove(&id) {
                return;
            }
            // Said precisely, so that whoever reads the log knows whether to look for a
            // duplicated report or a confused peer.
            let why = if id >= self.next_assignment || id == 0 {
                "which it was never given".to_owned()
            } else if let Some(other) = self.assignments.get(&id).and_then(|a| a.worker) {
                let name = self.workers.get(&other).map_or("?", |w| w.name.as_str());
                format!("which was given to another worker (w{other}, {name})")
            } else {
                "which it does not hold (reported already, or never given)".to_owned()
            };
            self.cut_off(worker, &format!("reported assignment {id}, {why}"));
            return;
        }
        let Some(a) = self.assignments.remove(&id) else {
            return;
        };
        if let What::Stage { stage, .. } = a.what {
            self.by_stage.remove(&stage);
        }
        *self.completed_by_pool.entry(a.pool).or_default() += 1;
        self.unbook(&a);
        // A result without an outcome, or with packed tokens that are not whole values, is a
        // protocol violation: the work counts as failed (and is redone), then the worker is cut
        // off.
        let mut violation = None;
        // What the worker called invalid: for an environment or a reward, a configuration error.
        let mut invalid = None;
        let output = match result.outcome {
            Some(work_result::Outcome::Output(mut o)) => {
                match rollfleet_proto::packed::unpack(&mut o) {
                    Ok(()) => Ok(o),
                    Err(reason) => {
                        let reason = format!("result of assignment {id}: {reason}");
                        violation = Some(reason.clone());
                        Err(reason)
                    }
                }
            }
            Some(work_result::Outcome::Failure(f)) => {
                log!(
                    self,
                    "scheduler: assignment {id} failed on w{worker} ({:?}): {}",
                    f.cause(),
                    f.message
                );
                if f.cause() == rollfleet_proto::v1::stage_failure::Cause::Invalid {
                    invalid = Some(f.message.clone());
                }
                if let What::Stage { traj, .. } = a.what
                    && let Some(t) = self.trajs.get_mut(&traj)
                {
                    t.last_failure = format!("{:?} on w{worker}: {}", f.cause(), f.message);
                }
                Err(f.message)
            }
            None => {
                let reason = format!("result of assignment {id} has no outcome");
                violation = Some(reason.clone());
                Err(reason)
            }
        };
        if let (
            What::Stage {
                traj, kind, reset, ..
            },
            Ok(o),
        ) = (&a.what, &output)
        {
            self.record_timed(*traj, kind, *reset, o.emulated, result.duration_us);
        }
        // In the job's seconds, as the profiles are; a failure's time is not the stage's.
        if output.is_ok() {
            let seconds = result.duration_us as f64 / 1e6 / self.opts.time_scale.max(1e-9);
            self.metrics
                .stage_duration
                .with_label_values(&[metric_kind(&a.what)])
                .observe(seconds);
        }
        // The trajectory's next stage (or this one again, after a failure) is ready now; after
        // its reward, it waits for its group or the trainer, which is no stage's queue.
        if let What::Stage { traj, kind, .. } = &a.what
            && !matches!(kind, StageKindOf::Reward { .. })
            && let Some(t) = self.trajs.get_mut(traj)
        {
            t.ready_at = Some(self.at);
        }
        self.configuration_failure(&a.what, invalid.as_deref(), output.is_ok());
        self.settle(worker, id, a, output);
        if let Some(reason) = violation {
            self.cut_off(worker, &reason);
        }
    }

    /// Counts a task's configuration errors: an environment or reward stage the worker called
    /// invalid (an environment it does not know, a remote environment's `InvalidConfig`, a
    /// reward function it does not implement). When one task's environment or reward has
    /// failed so `stage_failure_limit` times in a row, the job fails with that reason: retrying
    /// cannot fix a configuration, and giving the task's groups up as infrastructure failures
    /// would let the job succeed on a different task mix than the one asked for. A success of
    /// the same task's environment (or reward) starts the count again.
    fn configuration_failure(&mut self, what: &What, invalid: Option<&str>, succeeded: bool) {
        let What::Stage { traj, kind, .. } = what else {
            return;
        };
        let reward = match kind {
            StageKindOf::Env { .. } => false,
            StageKindOf::Reward { .. } => true,
            StageKindOf::Prefill(_) | StageKindOf::Generate(_) => return,
        };
        let Some(task_index) = self.trajs.get(traj).map(|t| t.task) else {
            return;
        };
        let key = (task_index, reward);
        let Some(message) = invalid else {
            if succeeded {
                self.configuration_failures.remove(&key);
            }
            return;
        };
        let count = self.configuration_failures.entry(key).or_default();
        *count += 1;
        let count = *count;
        if count < self.plan.config.stage_failure_limit.max(1) || self.ended.is_some() {
            return;
        }
        let spec = self.plan.spec();
        let what = match spec.tasks.get(task_index as usize) {
            Some(task) if reward => {
                let function = spec
                    .rewards
                    .iter()
                    .find(|r| r.name == task.reward)
                    .and_then(|r| r.function.as_deref())
                    .map(|f| format!(" (function {})", crate::quoted(f)))
                    .unwrap_or_default();
                format!(
                    "task {}: its reward {}{function}",
                    crate::quoted(&task.name),
                    crate::quoted(&task.reward)
                )
            }
            Some(task) => format!(
                "task {}: its environment {}",
                crate::quoted(&task.name),
                crate::quoted(&task.environment)
            ),
            None => format!("task {task_index}"),
        };
        let reason = format!(
            "{what} failed {count} times in a row with a configuration error, which retrying \
             cannot fix (not an infrastructure fault); the last: {message}"
        );
        log!(self, "scheduler: job fails: {reason}");
        self.failure = Some(reason);
        self.finish(JobPhase::Failed);
    }

    /// Why an environment step's answer cannot join its trajectory: an observation longer than
    /// the task's whole context, or text that would take the trajectory past its budget
    /// ([`TEXT_BYTES_PER_CONTEXT_TOKEN`] per token of `contextLimit`, at most
    /// [`MAX_TRAJECTORY_TEXT_BYTES`]), and with it every message that carries its history past
    /// what a worker takes. `None` when it fits.
    fn oversized_step(
        &self,
        traj: TrajId,
        reset: bool,
        o: &rollfleet_proto::v1::StageOutput,
    ) -> Option<String> {
        let t = self.trajs.get(&traj)?;
        let task = self.plan.spec().tasks.get(t.task as usize)?;
        let context = task.context_limit.max(1) as u64;
        if o.token_count > context {
            return Some(format!(
                "the environment's observation is {} tokens, more than task {}'s whole context \
                 (contextLimit {context})",
                o.token_count,
                crate::quoted(&task.name)
            ));
        }
        let budget = context
            .saturating_mul(TEXT_BYTES_PER_CONTEXT_TOKEN)
            .min(MAX_TRAJECTORY_TEXT_BYTES);
        let held = if reset { 0 } else { t.env_text_bytes };
        let brought = o.observation.len() as u64 + if reset { 0 } else { o.text.len() as u64 };
        (held + brought > budget).then(|| {
            format!(
                "the environment's answer brings {brought} bytes of text to a trajectory holding \
                 {held}: over its budget of {budget} bytes ({TEXT_BYTES_PER_CONTEXT_TOKEN} per \
                 token of task {}'s contextLimit {context}, at most {MAX_TRAJECTORY_TEXT_BYTES})",
                crate::quoted(&task.name)
            )
        })
    }

    /// Records how long a worker took for an environment step (not a reset) or a reward, in the
    /// job's time (the wall time over the time scale), as the task's or reward function's online
    /// profile.
    fn record_timed(
        &mut self,
        traj: TrajId,
        kind: &StageKindOf,
        reset: bool,
        emulated: bool,
        duration_us: u64,
    ) {
        use rollfleet_planner::profile::{Origin, Timed};
        let Some(task) = self
            .trajs
            .get(&traj)
            .and_then(|t| self.plan.spec().tasks.get(t.task as usize))
        else {
            return;
        };
        let (what, name) = match kind {
            StageKindOf::Env { .. } if !reset => (Timed::EnvironmentStep, &task.name),
            StageKindOf::Reward { .. } => (Timed::Reward, &task.reward),
            _ => return,
        };
        let seconds = duration_us as f64 / 1e6 / self.opts.time_scale.max(1e-9);
        let origin = if emulated {
            Origin::Modelled
        } else {
            Origin::Hardware
        };
        self.profiles.record_timed(what, name, seconds, origin);
    }

    /// Turns a finished or failed assignment into the core's input (or a redo).
    fn settle(
        &mut self,
        worker: u64,
        id: u64,
        a: Assignment,
        output: Result<rollfleet_proto::v1::StageOutput, String>,
    ) {
        match a.what {
            What::Stage {
                stage,
                traj,
                kind,
                reset,
            } => {
                let Ok(mut o) = output else {
                    self.deferred.push_back(Input::StageFailed { stage });
                    return;
                };
                self.stages_completed += 1;
                self.metrics
                    .stage_completions
                    .with_label_values(&[self.plan.pool_name(a.pool)])
                    .inc();
                let outcome = match kind {
                    StageKindOf::Env { .. } => {
                        if let Some(reason) = self.oversized_step(traj, reset, &o) {
                            // The environment's answer, not the worker, is at fault: the stage
                            // fails (and is retried, or its group given up) and the worker stays.
                            log!(self, "scheduler: assignment {id} on w{worker}: {reason}");
                            if let Some(t) = self.trajs.get_mut(&traj) {
                                t.last_failure = reason;
                            }
                            self.metrics.oversized_environment_steps.inc();
                            self.deferred.push_back(Input::StageFailed { stage });
                            return;
                        }
                        if let Some(t) = self.trajs.get_mut(&traj) {
                            let next_turn = if reset { 0 } else { a.message.turn };
                            t.message_tokens.insert(next_turn, o.token_count);
                            let brought = (o.observation.len() + o.text.len()) as u64;
                            if reset {
                                t.env_text_bytes = o.observation.len() as u64;
                                t.prompt = o.observation.clone();
                            } else {
                                t.env_text_bytes += brought;
                                t.actions.push(o.text.clone());
                                t.observations.push(o.observation.clone());
                                if o.done {
                                    t.reward = o.reward;
                                    t.reward_modelled = o.emulated;
                                }
                            }
                        }
                        StageOutcome::Observed {
                            tokens: o.token_count,
                            done: o.done,
                        }
                    }
                    StageKindOf::Prefill(_) => StageOutcome::Prefilled,
                    StageKindOf::Generate(_) => {
                        let stamped = a.message.policy_version;
                        if let Some(reported) = o.engine_weight_version
                            && reported != stamped
                        {
                            // The engine did not serve the weights the turn is stamped with
                            // (an update it said it made and did not): never a trained turn.
                            let reason = format!(
                                "the engine reported weight version {reported} for a generation \
                                 stamped with version {stamped}"
                            );
                            log!(self, "scheduler: assignment {id} on w{worker}: {reason}");
                            if let Some(t) = self.trajs.get_mut(&traj) {
                                t.last_failure = reason;
                            }
                            self.metrics.engine_version_mismatches.inc();
                            self.deferred.push_back(Input::StageFailed { stage });
                            return;
                        }
                        let turn = a.message.turn;
                        let generated = o.token_count.max(o.tokens.len() as u64);
                        if !o.emulated {
                            self.engine_generations += 1;
                        }
                        let t = self.trajs.entry(traj).or_default();
                        // This generation's part of the turn, after what an interrupted one
                        // left (its prompt came with the first part).
                        let mut part = match t.partial.take().filter(|p| p.turn == turn) {
                            Some(p) => p,
                            None => PartialTurn {
                                turn,
                                tokens: TurnTokens {
                                    prompt: std::mem::take(&mut o.prompt_tokens),
                                    ..Default::default()
                                },
                                text: String::new(),
                                count: 0,
                            },
                        };
                        let ids = o.tokens.len() as u32;
                        // Moved, not copied, unless a part came before.
                        extend_or_take(&mut part.tokens.action, &mut o.tokens);
                        extend_or_take(&mut part.tokens.logprobs, &mut o.logprobs);
                        part.tokens.emulated |= o.emulated;
                        // One run per version: a turn resumed on a replica still serving the
                        // version it was cut under goes on with the same run.
                        let segments = &mut part.tokens.segments;
                        match segments.last_mut() {
                            Some(last) if last.policy_version == stamped => last.tokens += ids,
                            // An empty run adds no version to a turn that has one.
                            Some(_) if ids == 0 => {}
                            _ => segments.push(Segment {
                                policy_version: stamped,
                                tokens: ids,
                            }),
                        }
                        part.text.push_str(&o.text);
                        part.count += generated;
                        if o.interrupted {
                            // Nothing generated: the turn starts over (as the core has it).
                            t.partial = (part.count > 0).then_some(part);
                            self.interrupted_generations += 1;
                            StageOutcome::Interrupted { tokens: generated }
                        } else {
                            if !o.emulated {
                                // A real engine's text: the environment step of this turn
                                // applies it.
                                t.outputs.insert(turn, std::mem::take(&mut part.text));
                            }
                            t.action_tokens.insert(turn, part.count);
                            if !part.tokens.action.is_empty() || !part.tokens.prompt.is_empty() {
                                t.tokens.insert(turn, part.tokens);
                            }
                            StageOutcome::Generated {
                                tokens: generated.max(1),
                            }
                        }
                    }
                    StageKindOf::Reward { .. } => {
                        if !o.reward.is_finite() {
                            self.cut_off(
                                worker,
                                &format!("assignment {id}: reward is not a number"),
                            );
                            self.deferred.push_back(Input::StageFailed { stage });
                            return;
                        }
                        StageOutcome::Rewarded { score: o.reward }
                    }
                };
                if let StageOutcome::Rewarded { score } = outcome
                    && let Some(t) = self.trajs.get_mut(&traj)
                {
                    t.reward = score;
                    t.reward_modelled = o.emulated;
                }
                self.deferred
                    .push_back(Input::StageFinished { stage, outcome });
            }
            What::Weights { replica, version } => match output {
                Ok(_) => {
                    if let Some(retry) = self.update_retries.remove(&replica.0) {
                        log!(
                            self,
                            "scheduler: replica {} loaded version {version} after {} failed \
                             update(s); back in service",
                            replica.0,
                            retry.failures
                        );
                    }
                    self.deferred
                        .push_back(Input::WeightsUpdated { replica, version });
                    self.migration_progress(replica.0);
                }
                Err(why) => self.update_failed(worker, replica, version, &why),
            },
            What::Train(batch) => match output {
                Ok(_) => self.deferred.push_back(Input::TrainFinished { batch }),
                Err(_) => {
                    let id = self.new_assignment(a.pool, What::Train(batch), a.message);
                    self.dispatch_pooled(id);
                }
            },
        }
    }

    /// A replica's engine could not load `version`: the replica leaves service at once (the
    /// fleet goes on generating on the others) and is updated again after a backoff, in
    /// [`Self::retry_updates`]. The core has no "update failed" fact: out of service is
    /// `ReplicaLost`, and the retry is `ReplicaRecovered`, which loads the current weights.
    fn update_failed(&mut self, worker: u64, replica: ReplicaId, version: u64, why: &str) {
        let retry = self.update_retries.entry(replica.0).or_insert(UpdateRetry {
            failures: 0,
            retry_at: None,
        });
        retry.failures += 1;
        let doublings = (retry.failures - 1).min(16);
        let wait = UPDATE_RETRY_FIRST
            .saturating_mul(1 << doublings)
            .min(UPDATE_RETRY_MAX);
        retry.retry_at = Some(self.at + wait);
        let failures = retry.failures;
        self.metrics.weight_update_failures.inc();
        self.weight_update_failures += 1;
        let name = self.workers.get(&worker).map_or("?", |w| w.name.as_str());
        log!(
            self,
            "scheduler: replica {} on {name} failed to load version {version} ({failures} in a \
             row): {why}; out of service, updated again in {}s",
            replica.0,
            wait.as_secs()
        );
        self.deferred.push_back(Input::ReplicaLost { replica });
    }

    /// Puts back in service, to be updated again, the replicas whose backoff is over (those
    /// still placed on a live worker: a moved or retired replica starts afresh or not at all).
    fn retry_updates(&mut self) {
        let now = self.at;
        let due: Vec<u64> = self
            .update_retries
            .iter()
            .filter(|(_, r)| r.retry_at.is_some_and(|at| at <= now))
            .map(|(&r, _)| r)
            .collect();
        for r in due {
            let placed = self.owner.get(r as usize).copied().flatten().is_some()
                && !self.retiring.contains(&r)
                && !self.retired.contains(&r);
            if !placed {
                self.update_retries.remove(&r);
                continue;
            }
            if let Some(retry) = self.update_retries.get_mut(&r) {
                retry.retry_at = None;
            }
            self.deferred.push_back(Input::ReplicaRecovered {
                replica: ReplicaId(r),
            });
        }
    }

    /// A worker's load report: its GPU readings and its replicas' profile samples.
    fn load_report(&mut self, worker: u64, load: &WorkerLoad) -> Result<(), String> {
        self.gpu_readings(worker, load)?;
        self.profile_samples(worker, load)
    }

    /// Records the samples of a load report in the online profiles, under the worker's pool.
    /// Checked whole before any is kept: a report with one bad sample adds nothing.
    fn profile_samples(&mut self, worker: u64, load: &WorkerLoad) -> Result<(), String> {
        use rollfleet_planner::roofline::{Work, WorkKind};
        use rollfleet_proto::v1::ProfileKind;
        if load.samples.is_empty() {
            return Ok(());
        }
        let Some(w) = self.workers.get(&worker).filter(|w| w.alive) else {
            return Ok(());
        };
        let pool = w.pool;
        if load.samples.len() > crate::MAX_PROFILE_SAMPLES_PER_REPORT {
            return Err(format!(
                "load.samples: {} samples in one report (at most {})",
                load.samples.len(),
                crate::MAX_PROFILE_SAMPLES_PER_REPORT
            ));
        }
        if self.plan.pool_role(pool) != Some(PoolRole::Gpu) {
            return Err(format!(
                "load.samples: profile samples from a worker of pool \"{}\", which has no GPUs",
                self.plan.pool_name(pool)
            ));
        }
        let mut checked = Vec::with_capacity(load.samples.len());
        for (i, s) in load.samples.iter().enumerate() {
            let kind = match s.kind() {
                ProfileKind::Prefill => WorkKind::Prefill,
                ProfileKind::Decode => WorkKind::Decode,
                ProfileKind::Unspecified => {
                    return Err(format!("load.samples[{i}].kind: unspecified"));
                }
            };
            let sane = |x: f64| x.is_finite() && x >= 0.0;
            if !(sane(s.flops) && sane(s.bytes) && sane(s.seconds) && s.seconds > 0.0) {
                return Err(format!(
                    "load.samples[{i}]: flops {}, bytes {}, seconds {}: not finite and \
                     non-negative with a positive duration",
                    s.flops, s.bytes, s.seconds
                ));
            }
            if s.gpus == 0 || s.gpus > 1024 {
                return Err(format!(
                    "load.samples[{i}].gpus: {} is not in 1..=1024",
                    s.gpus
                ));
            }
            checked.push((kind, s));
        }
        let (peak_flops, peak_bandwidth) = self.plan.gpu_peaks(pool);
        let name = self.plan.pool_name(pool).to_owned();
        for (kind, s) in checked {
            let gpus = f64::from(s.gpus);
            self.profiles.record(
                kind,
                &name,
                Work {
                    flops: s.flops,
                    bytes: s.bytes,
                },
                gpus * peak_flops,
                gpus * peak_bandwidth,
                s.seconds,
                if s.emulated {
                    rollfleet_planner::profile::Origin::Modelled
                } else {
                    rollfleet_planner::profile::Origin::Hardware
                },
            );
            self.profile_samples += 1;
        }
        Ok(())
    }

    /// Exports a worker's GPU readings. Readings from a worker that registered without GPU
    /// telemetry (they could only be made up), for a GPU it did not declare, or with a
    /// utilisation outside 0..1 are a protocol violation: the reason is returned.
    fn gpu_readings(&mut self, worker: u64, load: &WorkerLoad) -> Result<(), String> {
        if let Some(problem) = self.gpu_readings_problem(worker, load) {
            return Err(problem);
        }
        // A reading still in flight from a worker already gone adds nothing back.
        let Some(w) = self.workers.get(&worker).filter(|w| w.alive) else {
            return Ok(());
        };
        let any = !load.gpus.is_empty()
            || load.gpu_utilization.is_some()
            || load.gpu_memory_used_bytes.is_some();
        if !any && w.gpu_series.is_empty() {
            return Ok(());
        }
        let pool = self.plan.pool_name(w.pool).to_owned();
        let id = format!("w{worker}");
        let host = w.host.clone();
        let now: BTreeSet<u32> = load.gpus.iter().map(|r| r.index).collect();
        // A GPU left out of this reading (its reading failed) is not kept at its old value.
        for gone in w.gpu_series.difference(&now) {
            let gpu = gone.to_string();
            let labels = [pool.as_str(), &id, &host, &gpu];
            let _ = self.metrics.gpu_utilization.remove_label_values(&labels);
            let _ = self.metrics.gpu_memory_used.remove_label_values(&labels);
        }
        for r in &load.gpus {
            let gpu = r.index.to_string();
            let labels = [pool.as_str(), &id, &host, &gpu];
            self.metrics
                .gpu_utilization
                .with_label_values(&labels)
                .set(r.utilization);
            self.metrics
                .gpu_memory_used
                .with_label_values(&labels)
                .set(r.memory_used_bytes as f64);
        }
        if let Some(w) = self.workers.get_mut(&worker) {
            w.gpu_series = now;
        }
        Ok(())
    }

    /// Why a live worker's GPU readings are refused, if they are: more readings than the GPUs it
    /// registered (at most [`crate::inventory::MAX_GPUS_PER_NODE`]), readings after registering
    /// without telemetry, for a GPU it did not declare, or with a utilisation outside 0..1.
    /// `None` for a worker already gone (its readings are ignored).
    fn gpu_readings_problem(&self, worker: u64, load: &WorkerLoad) -> Option<String> {
        let w = self.workers.get(&worker).filter(|w| w.alive)?;
        let any = !load.gpus.is_empty()
            || load.gpu_utilization.is_some()
            || load.gpu_memory_used_bytes.is_some();
        let declared: Option<BTreeSet<u32>> = match &w.telemetry {
            Some(t) if !t.available && any => {
                return Some(format!(
                    "load.gpus: sent GPU readings after registering without GPU telemetry ({})",
                    t.unavailable_reason
                ));
            }
            Some(t) => Some(t.devices.iter().map(|d| d.index).collect()),
            None => None,
        };
        let registered = match &declared {
            Some(d) => d.len(),
            None if w.gpus > 0 => w.gpus as usize,
            None => crate::inventory::MAX_GPUS_PER_NODE,
        }
        .min(crate::inventory::MAX_GPUS_PER_NODE);
        if load.gpus.len() > registered {
            return Some(format!(
                "load.gpus: {} readings in one report; at most one per GPU the worker \
                 registered ({registered})",
                load.gpus.len()
            ));
        }
        for (i, r) in load.gpus.iter().enumerate() {
            if !(r.utilization.is_finite() && (0.0..=1.0).contains(&r.utilization)) {
                return Some(format!(
                    "load.gpus[{i}].utilization: {} is not a share between 0 and 1",
                    r.utilization
                ));
            }
            if declared.as_ref().is_some_and(|d| !d.contains(&r.index)) {
                return Some(format!(
                    "load.gpus[{i}].index: GPU {} was not declared at registration",
                    r.index
                ));
            }
        }
        None
    }

    /// Takes a gone worker's GPU series out of the exposition.
    fn forget_gpus(&mut self, worker: u64) {
        let Some(w) = self.workers.get_mut(&worker) else {
            return;
        };
        let pool = self.plan.pool_name(w.pool).to_owned();
        let id = format!("w{worker}");
        let mut gpus = std::mem::take(&mut w.gpu_series);
        if let Some(t) = w.telemetry.as_ref().filter(|t| t.available) {
            for d in &t.devices {
                gpus.insert(d.index);
                let gpu = d.index.to_string();
                let _ = self
                    .metrics
                    .gpu_info
                    .remove_label_values(&[&pool, &id, &w.host, &gpu, &d.name, &d.uuid]);
            }
        }
        for gpu in gpus {
            let gpu = gpu.to_string();
            let labels = [pool.as_str(), &id, &w.host, &gpu];
            let _ = self.metrics.gpu_utilization.remove_label_values(&labels);
            let _ = self.metrics.gpu_memory_used.remove_label_values(&labels);
            let _ = self.metrics.gpu_memory_total.remove_label_values(&labels);
        }
    }

    /// Cuts a worker off: closes its stream with the reason, and undoes every booking it held.
    fn cut_off(&mut self, worker: u64, reason: &str) {
        self.lose_worker(worker, reason, true);
    }

    /// Undoes every booking of a lost worker; with `replan`, the pool is re-planned for the
    /// GPUs left when they differ from the plan's.
    fn lose_worker(&mut self, worker: u64, reason: &str, replan: bool) {
        let Some(w) = self.workers.get_mut(&worker) else {
            return;
        };
        if !w.alive {
            return;
        }
        w.alive = false;
        let name = w.name.clone();
        log!(self, "scheduler: worker {name} is cut off: {reason}");
        listed(
            &mut self.lost,
            &mut self.lost_total,
            format!("{name}: {reason}"),
        );
        self.metrics.workers_lost.inc();
        if let Some(outbox) = w.outbox.take() {
            outbox.send(Err(Status::aborted(format!("cut off: {reason}"))));
        }
        self.forget_gpus(worker);
        let Some(w) = self.workers.get_mut(&worker) else {
            return;
        };
        let pool = w.pool;
        let held: Vec<u64> = std::mem::take(&mut w.assignments).into_iter().collect();
        let replicas: Vec<u64> = std::mem::take(&mut w.replicas).into_iter().collect();
        w.cancelled.clear();
        self.update_worker_gauges();
        for id in held {
            let Some(a) = self.assignments.remove(&id) else {
                continue;
            };
            self.unbook(&a);
            match a.what {
                What::Stage { stage, kind, .. } => {
                    self.by_stage.remove(&stage);
                    if !matches!(kind, StageKindOf::Prefill(_) | StageKindOf::Generate(_)) {
                        self.deferred.push_back(Input::StageFailed { stage });
                    }
                }
                What::Train(batch) => {
                    let id = self.new_assignment(a.pool, What::Train(batch), a.message);
                    self.dispatch_pooled(id);
                }
                What::Weights { .. } => {}
            }
        }
        for r in replicas {
            if self.owner.get(r as usize).copied().flatten() == Some(worker) {
                self.owner[r as usize] = None;
                self.deferred.push_back(Input::ReplicaLost {
                    replica: ReplicaId(r),
                });
            }
        }
        self.forget(worker);
        if self.started.is_some() && replan {
            self.pool_changed(pool, &format!("worker {name} was lost ({reason})"));
        }
    }

    /// Forgets a worker that is gone (lost, released, or drained at the end): its hostname, its
    /// GPUs and its lease go with it, so that workers coming and going (or a peer registering
    /// again and again) do not grow the scheduler. Its metric series went already
    /// ([`Actor::forget_gpus`]); its lease id names no lease from now on.
    fn forget(&mut self, worker: u64) {
        if self.workers.get(&worker).is_none_or(|w| w.alive) {
            return;
        }
        if let Some(w) = self.workers.remove(&worker)
            && self.gone_telemetry.len() < MAX_WORKERS_LISTED
        {
            let said = self.telemetry_of(&w);
            self.gone_telemetry.insert(worker, said);
        }
    }

    /// What `w` said at registration about GPU telemetry, for the report.
    fn telemetry_of(&self, w: &Worker) -> WorkerTelemetry {
        WorkerTelemetry {
            worker: w.name.clone(),
            pool: self.plan.pool_name(w.pool).to_owned(),
            gpu_telemetry: match &w.telemetry {
                Some(t) if t.available => "available",
                Some(_) => "unavailable",
                None => "not said",
            }
            .into(),
            reason: w
                .telemetry
                .as_ref()
                .map(|t| t.unavailable_reason.clone())
                .unwrap_or_default(),
            gpus: w
                .telemetry
                .as_ref()
                .map(|t| t.devices.iter().map(|d| d.name.clone()).collect())
                .unwrap_or_default(),
        }
    }

    fn on_tick(&mut self) {
        let now = self.at;
        let expired: Vec<(u64, Duration)> = self
            .workers
            .iter()
            .filter(|(_, w)| w.alive && w.lease_until < now)
            .map(|(&id, _)| (id, self.opts.lease_ttl))
            .collect();
        for (id, ttl) in expired {
            self.cut_off(id, &format!("lease expired: no heartbeat within {ttl:?}"));
        }
        self.check_drift();
        self.give_up_hung();
        self.retry_updates();
        self.pump();
        let t = self.now();
        for (&pool, m) in &mut self.meters {
            m.flush(t);
            let (total, at) = self
                .last_busy
                .get(&pool)
                .copied()
                .unwrap_or((0.0, Time::ZERO));
            let span = t.since(at).as_secs_f64();
            if span >= 0.9 {
                let cap = self.capacity.get(&pool).copied().unwrap_or(1.0);
                let share = ((m.total - total) / span / cap).clamp(0.0, 1.0);
                self.recent_busy.insert(pool, share);
                self.last_busy.insert(pool, (m.total, t));
            }
        }
        self.publish();
    }

    fn update_worker_gauges(&self) {
        for i in 0..self.plan.spec().pools.len() as u32 {
            let n = self.attached(i).count();
            self.metrics
                .workers
                .with_label_values(&[self.plan.pool_name(i)])
                .set(n as i64);
            let without = self
                .workers
                .values()
                .filter(|w| {
                    w.alive && w.pool == i && w.telemetry.as_ref().is_some_and(|t| !t.available)
                })
                .count();
            self.metrics
                .workers_without_gpu_telemetry
                .with_label_values(&[self.plan.pool_name(i)])
                .set(without as i64);
        }
    }

    /// Counts a trajectory handed to the trainer at RL step `step` in its task's figures.
    fn record_outcome(&mut self, step: u64, info: &TrajInfo) {
        let outcome = TrajectoryOutcome {
            reward: info.reward,
            modelled: info.reward_modelled,
            turns: info.versions.len() as u64,
            // The prompt, then the observation before each turn and the one that ended it.
            prompt_tokens: info.message_tokens.values().sum(),
            action_tokens: info.action_tokens.values().sum(),
            staleness: info
                .versions
                .values()
                .min()
                .map_or(0, |&v| step.saturating_sub(v)),
        };
        self.outcomes
            .entry(step)
            .or_default()
            .entry(info.task)
            .or_default()
            .add(&outcome);
        self.outcome_totals
            .entry(info.task)
            .or_default()
            .add(&outcome);
        let Some(task) = self.plan.spec().tasks.get(info.task as usize) else {
            return;
        };
        let m = &self.metrics.outcomes;
        let label = [task.name.as_str()];
        m.trajectories.with_label_values(&label).inc();
        m.reward_sum.with_label_values(&label).add(outcome.reward);
        m.successes
            .with_label_values(&label)
            .inc_by(u64::from(outcome.reward >= SUCCESS_REWARD));
        m.turns.with_label_values(&label).inc_by(outcome.turns);
        m.prompt_tokens
            .with_label_values(&label)
            .inc_by(outcome.prompt_tokens);
        m.action_tokens
            .with_label_values(&label)
            .inc_by(outcome.action_tokens);
        m.staleness_versions
            .with_label_values(&label)
            .inc_by(outcome.staleness);
    }

    /// Sets the last step's gauges of every task that has trajectories in RL step `step`.
    fn export_step_outcomes(&self, step: u64) {
        let Some(tallies) = self.outcomes.get(&step) else {
            return;
        };
        let m = &self.metrics.outcomes;
        for (&task, tally) in tallies {
            let Some(spec) = self.plan.spec().tasks.get(task as usize) else {
                continue;
            };
            let figures = tally.figures(&spec.name);
            let label = [spec.name.as_str()];
            m.last_step_mean_reward
                .with_label_values(&label)
                .set(figures.mean_reward);
            m.last_step_success_ratio
                .with_label_values(&label)
                .set(figures.success_rate);
        }
    }

    fn task_names(&self) -> Vec<String> {
        self.plan
            .spec()
            .tasks
            .iter()
            .map(|t| t.name.clone())
            .collect()
    }

    /// The core's trajectory figures as metrics. Its counts are cumulative, so each counter is
    /// raised by what it lacks.
    fn export_trajectory_metrics(&self, in_flight: u64, complete: u64) {
        let m = &self.metrics;
        let gauge = |state: &str, n: u64| {
            m.trajectories
                .with_label_values(&[state])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        };
        gauge("generating", in_flight);
        gauge("waiting", complete);
        let stats = self.core.stats();
        for (versions, &n) in stats.staleness_histogram.iter().enumerate() {
            let counter = m
                .trained_by_staleness
                .with_label_values(&[&versions.to_string()]);
            counter.inc_by(n.saturating_sub(counter.get()));
        }
        m.regenerated_turns.inc_by(
            stats
                .regenerated_turns
                .saturating_sub(m.regenerated_turns.get()),
        );
        m.groups_restarted.inc_by(
            stats
                .groups_restarted
                .saturating_sub(m.groups_restarted.get()),
        );
    }

    fn publish(&mut self) {
        let (in_flight, complete, consumed) = self.core.trajectory_counts();
        let phase = match (self.started, self.ended) {
            (_, Some((_, phase))) => phase,
            (Some(_), None) => JobPhase::Running,
            (None, None) => JobPhase::Pending,
        };
        self.export_phase_and_busy_seconds(phase);
        let pools = (0..self.plan.spec().pools.len() as u32)
            .map(|p| {
                let busy = self.recent_busy.get(&p).copied().unwrap_or(0.0);
                self.metrics
                    .pool_busy
                    .with_label_values(&[self.plan.pool_name(p)])
                    .set(busy);
                let queued_stages = self.pending.get(&p).map_or(0, |q| q.len() as u32);
                self.metrics
                    .pending_stages
                    .with_label_values(&[self.plan.pool_name(p)])
                    .set(i64::from(queued_stages));
                PoolStatus {
                    pool: self.plan.pool_name(p).to_owned(),
                    workers: self.attached(p).count() as u32,
                    busy,
                    queued_stages,
                }
            })
            .collect();
        self.metrics.policy_version.set(self.core.version() as i64);
        self.export_trajectory_metrics(in_flight, complete);
        let message = match phase {
            JobPhase::Pending => format!(
                "waiting for workers: {} attached, {} expected",
                self.workers
                    .values()
                    .filter(|w| w.alive && w.outbox.is_some())
                    .count(),
                self.opts.expect_workers
            ),
            JobPhase::Failed if self.failure.is_some() => {
                format!("failed: {}", self.failure.as_deref().unwrap_or_default())
            }
            _ if self.engine_generations > 0 => format!(
                "{} completed, {} lost; {} by an OpenAI-compatible engine, other GPU figures \
                 emulated (time scale {})",
                crate::counted(self.stages_completed, "stage", "stages"),
                crate::counted(self.lost_total, "worker", "workers"),
                crate::counted(self.engine_generations, "generation", "generations"),
                self.opts.time_scale
            ),
            _ => format!(
                "{} completed, {} lost; GPU figures are emulated (time scale {})",
                crate::counted(self.stages_completed, "stage", "stages"),
                crate::counted(self.lost_total, "worker", "workers"),
                self.opts.time_scale
            ),
        };
        let (overall, tasks) = task_figures(&self.outcome_totals, &self.task_names());
        let last_step =
            self.outcomes
                .last_key_value()
                .map_or_else(Default::default, |(&step, tallies)| {
                    let mut all = Tally::default();
                    for tally in tallies.values() {
                        all.merge(tally);
                    }
                    all.figures("").to_proto(step)
                });
        let status = JobStatus {
            job: self.plan.name().to_owned(),
            phase: phase as i32,
            policy_version: self.core.version(),
            rl_step: self.core.version(),
            rl_steps_total: self.plan.config.steps,
            trajectories_in_flight: in_flight,
            trajectories_completed: complete + consumed,
            trajectories_trained: self.trained.len() as u64,
            pools,
            message,
            tasks: tasks.iter().map(|t| t.to_proto(0)).collect(),
            overall: Some(overall.to_proto(0)),
            last_step: Some(last_step),
            success_reward: SUCCESS_REWARD,
        };
        self.status.send_replace(status);
    }

    /// The job's phase, and each pool's busy time since the last call, as metrics.
    fn export_phase_and_busy_seconds(&mut self, phase: JobPhase) {
        for p in [
            JobPhase::Pending,
            JobPhase::Running,
            JobPhase::Succeeded,
            JobPhase::Failed,
            JobPhase::Cancelled,
        ] {
            self.metrics
                .job_phase
                .with_label_values(&[&crate::job::phase_name(p)])
                .set(i64::from(p == phase));
        }
        for (&pool, m) in &self.meters {
            // Made at 0 before the pool's first busy second, so that rate() counts that one.
            let counter = self
                .metrics
                .pool_busy_seconds
                .with_label_values(&[self.plan.pool_name(pool)]);
            let exported = self.busy_exported.entry(pool).or_default();
            let cap = self.capacity.get(&pool).copied().unwrap_or(1.0);
            if m.total > *exported && cap > 0.0 {
                counter.inc_by((m.total - *exported) / cap);
                *exported = m.total;
            }
        }
    }

    fn finish(&mut self, phase: JobPhase) {
        self.ended = Some((self.at, phase));
        // Unix time, not the job's clock: the alert on a scheduler that stops answering
        // compares it with the process's start time.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.metrics
            .job_end_time
            .with_label_values(&[&crate::job::phase_name(phase)])
            .set(now);
        log!(
            self,
            "scheduler: job {} ends: {phase:?} at version {}",
            self.plan.name(),
            self.core.version()
        );
        for w in self.workers.values() {
            if let Some(o) = &w.outbox {
                o.send(Ok(SchedulerMessage {
                    message: Some(scheduler_message::Message::Drain(true)),
                }));
            }
        }
        self.on_tick_meters();
        self.publish();
        let report = self.report();
        self.final_report = Some(report.clone());
        if let Some(path) = &self.opts.report {
            match serde_json::to_vec_pretty(&report) {
                Ok(bytes) => {
                    if let Err(e) = std::fs::write(path, bytes) {
                        log!(self, "scheduler: cannot write {}: {e}", path.display());
                    }
                }
                Err(e) => log!(self, "scheduler: cannot encode the report: {e}"),
            }
        }
    }

    fn on_tick_meters(&mut self) {
        let t = self.now();
        for m in self.meters.values_mut() {
            m.flush(t);
        }
    }

    /// The report written at the job's end (`--report`); `None` while it runs.
    pub fn final_report(&self) -> Option<&Report> {
        self.final_report.as_ref()
    }

    /// What the job did so far.
    pub fn report(&self) -> Report {
        let wall = match (self.started, self.ended) {
            (Some(s), Some((e, _))) => e.saturating_sub(s).as_secs_f64(),
            (Some(s), None) => self.at.saturating_sub(s).as_secs_f64(),
            _ => 0.0,
        };
        let phase = self.ended.map_or(JobPhase::Running, |(_, p)| p);
        let pools = self
            .plan
            .spec()
            .pools
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let i = i as u32;
                let cap = self.capacity.get(&i).copied().unwrap_or(1.0);
                let total = self.meters.get(&i).map_or(0.0, |m| m.total);
                PoolSummary {
                    pool: p.name.clone(),
                    kind: self.pool_kind(i).into(),
                    workers: self.attached(i).count() as u32,
                    assignments_done: self.completed_by_pool.get(&i).copied().unwrap_or(0),
                    busy_share: if wall > 0.0 {
                        (total / wall / cap).clamp(0.0, 1.0)
                    } else {
                        0.0
                    },
                }
            })
            .collect();
        let stats = self.core.stats();
        let mut lat = self.latencies_us.clone();
        lat.sort_unstable();
        let pct = |q: f64| {
            lat.get(((lat.len() as f64 - 1.0) * q).round().max(0.0) as usize)
                .copied()
                .unwrap_or(0)
        };
        Report {
            job: self.plan.name().to_owned(),
            phase: crate::job::phase_name(phase),
            wall_s: wall,
            time_scale: self.opts.time_scale,
            emulated_gpus: self.engine_generations == 0,
            engine_generations: self.engine_generations,
            interrupted_generations: self.interrupted_generations,
            policy_version: self.core.version(),
            steps: self.plan.config.steps,
            trained: self.trained.clone(),
            trained_twice: self.trained_twice.clone(),
            outcomes: outcomes(&self.outcomes, &self.task_names()),
            stages_completed: self.stages_completed,
            dispatch_p50_us: pct(0.5),
            dispatch_p99_us: pct(0.99),
            stage_retries: stats.stage_retries,
            regenerated_turns: stats.regenerated_turns,
            groups_restarted: stats.groups_restarted,
            groups_abandoned: self.abandoned.clone(),
            failure: self.failure.clone(),
            profiles: self.profiles.clone(),
            profile_samples: self.profile_samples,
            workers_lost: unlisted(&self.lost, self.lost_total),
            workers_left: unlisted(&self.left, self.left_total),
            replicas_moved: self.replicas_moved,
            weight_update_failures: self.weight_update_failures,
            replans: self.replans.clone(),
            gpu_telemetry: {
                // The workers gone (those kept) and those here, in the order they registered.
                let mut said = self.gone_telemetry.clone();
                for (&id, w) in &self.workers {
                    said.insert(id, self.telemetry_of(w));
                }
                said.into_values().collect()
            },
            pools,
        }
    }
}

/// The whole context of a trajectory's next turn, as the agent's prompt template renders it: the
/// task, then every earlier turn's output and observation. A turn generated by an emulated engine
/// has no text; the action applied stands in for it.
/// The drifts as a line of the log: each kind and pool at its measured share against the plan's.
/// The message that has a worker start replica `id` of a re-plan (the worker knows only the
/// replicas of the first plan), and the replica's role by name.
fn start_message(id: u64, config: &ReplicaConfig) -> (&'static str, SchedulerMessage) {
    let role = match config.role {
        ServeRole::Prefill => "prefill",
        ServeRole::Decode => "decode",
        ServeRole::Generate => "generate",
    };
    let message = SchedulerMessage {
        message: Some(scheduler_message::Message::StartReplica(ReplicaStart {
            replica: id,
            gpus: config.gpus,
            kv_capacity_tokens: config.kv_capacity_tokens,
            max_seqs: config.max_seqs,
            role: role.into(),
        })),
    };
    (role, message)
}

fn describe_drifts(drifts: &[Drift]) -> String {
    drifts
        .iter()
        .map(|d| {
            format!(
                "{} on {} at {:.0}% of peak (the plan assumed {:.0}%)",
                d.kind.name(),
                d.pool,
                d.now * 100.0,
                d.planned * 100.0
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn render_context(info: &TrajInfo) -> String {
    use rollfleet_agent::{PromptTemplate, Transcript, Turn};
    let turns = info
        .actions
        .iter()
        .zip(&info.observations)
        .enumerate()
        .map(|(i, (action, observation))| Turn {
            policy_version: info.versions.get(&(i as u32)).copied().unwrap_or(0),
            output: info
                .outputs
                .get(&(i as u32))
                .cloned()
                .unwrap_or_else(|| format!("<action>{action}</action>")),
            output_tokens: 0,
            observation: observation.clone(),
            observation_tokens: 0,
            reward: 0.0,
            invalid_action: false,
        })
        .collect();
    PromptTemplate::default().render(&Transcript {
        task: info.prompt.clone(),
        task_tokens: 0,
        turns,
    })
}

/// Appends `more` to `to`, taking its buffer when `to` is empty (no copy).
fn extend_or_take<T>(to: &mut Vec<T>, more: &mut Vec<T>) {
    if to.is_empty() {
        std::mem::swap(to, more);
    } else {
        to.append(more);
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trajectory(reward: f64, turns: u64, staleness: u64) -> TrajectoryOutcome {
        TrajectoryOutcome {
            reward,
            modelled: false,
            turns,
            prompt_tokens: 100 * turns,
            action_tokens: 10 * turns,
            staleness,
        }
    }

    /// An actor of the quick-start job that waits for 100 workers (the job never starts).
    fn waiting_actor() -> Actor {
        let yaml = include_str!("../../../../examples/jobs/quickstart.yaml");
        let plan = crate::job::JobSlot::new(7, Duration::from_secs(60))
            .plan(yaml, "quickstart.yaml")
            .expect("the quick-start job plans");
        let options = ActorOptions {
            time_scale: 1.0,
            lease_ttl: Duration::from_secs(2),
            expect_workers: 100,
            report: None,
            replan_on_drift: None,
            until_stopped: false,
        };
        Actor::new(
            Arc::new(plan),
            options,
            Arc::new(watch::channel(JobStatus::default()).0),
            Arc::new(Metrics::new().expect("metrics")),
            Arc::new(FeedLog::default()),
        )
    }

    #[test]
    fn a_worker_whose_lease_expired_or_that_left_is_forgotten_with_its_hostname_and_gpu_series() {
        let mut actor = waiting_actor();
        let host = |i: usize| format!("node-{i}-{}", "x".repeat(200));
        let device = |index: u32| rollfleet_proto::v1::GpuDevice {
            index,
            name: "NVIDIA H20".into(),
            uuid: format!("GPU-{index}"),
            memory_bytes: 96 << 30,
        };
        for i in 0..100 {
            let inventory = HardwareInventory {
                hostname: host(i),
                pool: "decode".into(),
                gpu_telemetry: Some(GpuTelemetryInfo {
                    available: true,
                    unavailable_reason: String::new(),
                    devices: vec![device(0), device(1)],
                }),
                ..Default::default()
            };
            actor
                .register(inventory, format!("{i:032x}"))
                .expect("registered");
        }
        assert_eq!(actor.workers.len(), 100);
        assert!(actor.metrics.render().contains(&host(99)));
        // One says it is leaving (it holds nothing, so it is released at once)...
        actor.worker_leaving(1, "node drain");
        // ... and the others' leases run out.
        actor.at += Duration::from_secs(3);
        actor.on_tick();
        assert!(
            actor.workers.is_empty(),
            "{} gone workers still kept",
            actor.workers.len()
        );
        assert!(!actor.metrics.render().contains("node-"));
        // Worker w6 was the sixth to register (secret 5).
        let lease = format!("w6-{:032x}", 5);
        let refused = actor.heartbeat(&lease, 1, None).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::NotFound, "{refused:?}");
        let report = actor.report();
        assert_eq!(report.workers_left.len(), 1, "{:?}", report.workers_left);
        assert_eq!(report.workers_lost.len(), 99);
    }

    #[test]
    fn each_task_averages_its_own_trajectories_and_the_overall_figures_average_them_all() {
        let names = [
            "sokoban".to_owned(),
            "frozenlake".to_owned(),
            "idle".to_owned(),
        ];
        let mut by_step: BTreeMap<u64, BTreeMap<u32, Tally>> = BTreeMap::new();
        // Step 0: a solved Sokoban level (10.9) and an unsolved one (-0.1); a FrozenLake goal.
        for (task, o) in [
            (0, trajectory(10.9, 4, 0)),
            (0, trajectory(-0.1, 8, 0)),
            (1, trajectory(1.0, 2, 0)),
        ] {
            by_step
                .entry(0)
                .or_default()
                .entry(task)
                .or_default()
                .add(&o);
        }
        // Step 1: a hole in FrozenLake, one version stale.
        by_step
            .entry(1)
            .or_default()
            .entry(1)
            .or_default()
            .add(&trajectory(0.0, 6, 1));
        let o = outcomes(&by_step, &names);

        assert_eq!(o.success_reward, SUCCESS_REWARD);
        assert_eq!(o.tasks.len(), 3, "every task, trained or not: {o:?}");
        let sokoban = &o.tasks[0];
        assert_eq!(sokoban.task, "sokoban");
        assert_eq!((sokoban.trajectories, sokoban.successes), (2, 1));
        assert!((sokoban.mean_reward - 5.4).abs() < 1e-9, "{sokoban:?}");
        assert_eq!((sokoban.min_reward, sokoban.max_reward), (-0.1, 10.9));
        assert_eq!(sokoban.success_rate, 0.5);
        assert_eq!(sokoban.mean_turns, 6.0);
        assert_eq!(sokoban.mean_prompt_tokens, 600.0);
        assert_eq!(sokoban.mean_action_tokens, 60.0);
        let frozenlake = &o.tasks[1];
        assert_eq!((frozenlake.trajectories, frozenlake.successes), (2, 1));
        assert_eq!(frozenlake.mean_reward, 0.5);
        assert_eq!(frozenlake.mean_staleness, 0.5);
        assert_eq!(frozenlake.max_staleness, 1);
        let idle = &o.tasks[2];
        assert_eq!(
            (idle.trajectories, idle.mean_reward, idle.success_rate),
            (0, 0.0, 0.0)
        );

        assert_eq!(o.overall.task, "");
        assert_eq!((o.overall.trajectories, o.overall.successes), (4, 2));
        assert!((o.overall.mean_reward - 11.8 / 4.0).abs() < 1e-9, "{o:?}");
        assert_eq!(o.overall.mean_turns, 5.0);
        assert_eq!(
            (o.overall.mean_staleness, o.overall.max_staleness),
            (0.25, 1)
        );

        // Per step: each step's own trajectories.
        assert_eq!(o.steps.iter().map(|s| s.step).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(o.steps[0].overall.trajectories, 3);
        assert_eq!(o.steps[0].tasks[1].mean_reward, 1.0);
        assert_eq!(o.steps[1].overall.trajectories, 1);
        assert_eq!(o.steps[1].tasks[0].trajectories, 0);
        assert_eq!(o.steps[1].overall.success_rate, 0.0);
    }

    #[test]
    fn a_reward_counts_as_a_success_from_the_threshold_on_and_a_modelled_one_is_counted_apart() {
        let mut tally = Tally::default();
        for reward in [SUCCESS_REWARD, SUCCESS_REWARD - 1e-9, 0.9, 10.9] {
            tally.add(&trajectory(reward, 1, 0));
        }
        tally.add(&TrajectoryOutcome {
            modelled: true,
            ..trajectory(0.0, 1, 0)
        });
        let f = tally.figures("t");
        assert_eq!((f.trajectories, f.successes, f.modelled_rewards), (5, 2, 1));
        assert_eq!(f.success_rate, 0.4);
    }

    #[test]
    fn the_figures_read_back_from_their_json_as_they_were_written() {
        let mut by_step: BTreeMap<u64, BTreeMap<u32, Tally>> = BTreeMap::new();
        by_step
            .entry(0)
            .or_default()
            .entry(0)
            .or_default()
            .add(&trajectory(1.0, 3, 0));
        let o = outcomes(&by_step, &["calc".to_owned()]);
        let json = serde_json::to_string(&o).expect("figures encode");
        let back: Outcomes = serde_json::from_str(&json).expect("figures decode");
        assert_eq!(back, o);
        // The overall figures name no task.
        assert!(!json.contains("\"task\":\"\""), "{json}");
    }
}
