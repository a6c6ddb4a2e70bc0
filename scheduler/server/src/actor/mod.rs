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
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rollfleet_core::{
    BatchId, Command, Core, Input, ReplicaConfig, ReplicaId, ServeRole, StageCommand, StageId,
    StageOutcome, StageWork, Time, TrajId,
};
use rollfleet_fleet::failure::GroupsGivenUp;
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

mod dispatch;
mod moves;
mod replay;
mod report;
mod results;
mod workers;

use moves::Migration;
pub use moves::ReplanRecord;
use report::Tally;
pub use report::{
    AbandonedGroup, OutcomeFigures, Outcomes, PoolSummary, Report, SUCCESS_REWARD, StepOutcomes,
    WorkerTelemetry,
};

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
        /// When it reached the scheduler: its lease is judged then, not when the actor gets to
        /// it (a long re-plan would otherwise expire the leases of workers that kept time).
        heard: Instant,
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

/// The fewest workers a pool may hold at once, whatever its size (see
/// `Actor::worker_cap`): room for small pools' nodes to come and go.
pub const MIN_WORKERS_PER_POOL: usize = 64;

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
    /// The scheduler's stop flag (Ctrl-C, SIGTERM): a re-plan's search runs under it
    /// ([`rollfleet_planner::cancel`]), so that a scheduler told to stop mid re-plan stops at once.
    /// `None`: re-plans run to their end (a test's actor, an offline replay).
    stop: Option<Arc<AtomicBool>>,
    /// A re-plan was given up because the scheduler was told to stop: the step that caused it
    /// was journaled but is only half acted on, so the actor acts on nothing more and journals
    /// nothing more. The journal ends as if the scheduler had been killed at that moment, and a
    /// scheduler restarted on it replays that step whole, re-plan included.
    interrupted: bool,
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
    /// Groups given up since the trainer last got a batch, and when they fail the job: the rule
    /// the simulator applies too.
    groups_given_up: GroupsGivenUp,
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
            stop: None,
            interrupted: false,
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
            groups_given_up: GroupsGivenUp::new(
                plan.config.rollout_batch_size,
                plan.config.group_size,
            ),
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
        if self.interrupted {
            return self.stop_mid_replan();
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
            // A tick that fell due while the actor was busy (a long re-plan) comes after the
            // events that waited with it: the heartbeats among them renew their leases before
            // the tick looks for expired ones.
            steps.sort_by_key(|step| matches!(step, Step::Tick));
            self.take(steps);
            while !self.interrupted
                && let Some(event) = self.loopback.pop_front()
            {
                self.take(vec![Step::Event(event)]);
            }
            if self.interrupted {
                return self.stop_mid_replan();
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
                phase.name(),
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

    /// Re-plans from now on run under `flag`, the scheduler's stop flag: once it is set, a
    /// re-plan gives up and the actor stops ([`Actor::interrupted`]).
    pub fn stop_with(&mut self, flag: Arc<AtomicBool>) {
        self.stop = Some(flag);
    }

    /// Whether a re-plan was given up because the scheduler was told to stop: the actor's
    /// state is half a step, good for nothing but dropping (its journal holds the whole step).
    pub fn interrupted(&self) -> bool {
        self.interrupted
    }

    /// Runs a re-plan's search (`plan`) under the stop flag; `None` (and the actor marked
    /// [`Actor::interrupted`]) when the scheduler was told to stop, whether the search gave up
    /// or ended just as the flag was set: what it found is not acted on.
    fn stoppable<T>(&mut self, plan: impl FnOnce(&Actor) -> T) -> Option<T> {
        let found = match self.stop.clone() {
            Some(flag) => rollfleet_planner::cancel::within(&flag, || plan(self)),
            None => plan(self),
        };
        if self
            .stop
            .as_ref()
            .is_some_and(|flag| flag.load(Ordering::Relaxed))
        {
            self.interrupted = true;
            // What the rest of the step would send, a replay would not: the workers' streams
            // and the trainer's feed end here, as if the scheduler had been killed (the workers
            // and the trainer come back to a scheduler restarted on the journal).
            for w in self.workers.values_mut() {
                w.outbox = None;
            }
            self.feed.close(Some(format!(
                "the scheduler stopped while re-planning job {}",
                self.plan.name()
            )));
            return None;
        }
        Some(found)
    }

    /// The end of a run whose re-plan was given up for a stop: nothing more is acted on or
    /// journaled, and the report is where the job stood (the job is not cancelled: no report is
    /// written).
    fn stop_mid_replan(self) -> Report {
        tracing::info!(
            "scheduler: stopped while re-planning job {}; {}",
            self.plan.name(),
            if self.journal.is_some() {
                "its journal ends before the step that caused the re-plan was acted on: a \
                 scheduler restarted on it replays that step, re-plan included, and resumes the job"
            } else {
                "without a journal the job cannot be resumed"
            }
        );
        self.report()
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
                heard,
                reply,
                ..
            } => {
                let heard_at = self.clock_at(heard);
                let _ = reply.send(self.heartbeat(&worker_id, epoch, load, heard_at));
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

    fn on_tick_meters(&mut self) {
        let t = self.now();
        for m in self.meters.values_mut() {
            m.flush(t);
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
