//! The scheduler state machine: trajectories, replicas, pools, the trainer and weight sync.
//!
//! [`Core`] follows quinn-proto's shape: [`Core::handle_input`] and [`Core::handle_timeout`] feed
//! it facts, [`Core::poll_command`] drains the commands they caused, and [`Core::poll_timeout`]
//! says when it next wants [`Core::handle_timeout`]. After every input the core runs one admission
//! pass (`pump`), the single place where work is booked on a resource:
//!
//! 1. rolling weight sync (drain a replica, then update it) or the global sync of the batched
//!    baselines;
//! 2. new groups, as the discipline allows;
//! 3. environment resets and steps, on CPU pools with free vCPUs;
//! 4. generation: routed by `crate::router`, after the staleness check at admission;
//! 5. decode of prefilled contexts (the second half of prefill/decode disaggregation);
//! 6. rewards, within serverless concurrency or local vCPUs;
//! 7. training, on whole groups, after the staleness check at consumption.
//!
//! A trajectory's life: `EnvReset` (prompt) → for each turn: generation (sticky `Generate`, or
//! `Prefill` then `Generate` with a KV pull, or local `Generate`) → `EnvStep` → ... → `Reward` →
//! complete → trained once, with its whole group. Each generated turn is stamped with the version
//! that produced it; a trajectory whose oldest turn falls out of the bound is regenerated from
//! that turn, at admission or at consumption, and never trained on.
//!
//! This file holds the core's public face ([`Core`], its [`Stats`]); the work is split by phase
//! into `books` (the state and its bookkeeping), `admission` (the admission pass, new groups and
//! the staleness floor), `dispatch` (booking stages and taking their results back), `sync`
//! (weight sync and publication) and `failure` (failed stages, lost and changed replicas).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use crate::config::{Config, Discipline};
use crate::idset::IdSet;
use crate::placement::ServeRole;
use crate::protocol::{Command, GroupId, Input, ReplicaId, StageId, Version};
use crate::router::LoadOrder;
use crate::slab::IdSlab;
use crate::time::Time;

mod admission;
mod books;
mod dispatch;
mod failure;
mod sync;

pub use admission::AdmissionTerms;
use books::{Group, Phase, Replica, StageRec, TrainBatch, Traj, TurnBooks};

/// Counters the core keeps about its own decisions.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Groups started.
    pub groups_started: u64,
    /// Trajectories completed (rewarded), counting regenerated ones again.
    pub trajectories_completed: u64,
    /// Trajectories handed to the trainer.
    pub trajectories_consumed: u64,
    /// Staleness at consumption: index = versions behind, value = trajectories.
    pub staleness_histogram: Vec<u64>,
    /// Turns thrown away to keep the staleness bound.
    pub regenerated_turns: u64,
    /// Trajectories regenerated at admission.
    pub regenerated_at_admission: u64,
    /// Trajectories regenerated at consumption.
    pub regenerated_at_consumption: u64,
    /// Finished groups found past the staleness bound when the trainer came to take them: their
    /// whole attempt is lost and they generate again. Many of them mean finished groups wait
    /// for the trainer longer than the bound allows (a trainer too slow for the window, or a
    /// bound too tight for the lives), not that generation is slow.
    #[serde(default)]
    pub groups_expired_waiting: u64,
    /// Finished trajectories regenerated at the publication that expired them, being all that
    /// kept their group from training.
    pub regenerated_at_publish: u64,
    /// Groups restarted on the weights just published, having started too late on the previous
    /// ones to finish before those expire ([`Core::restart_late_groups`]).
    #[serde(default)]
    pub groups_restarted: u64,
    /// Turns that reused a KV cache kept on their replica.
    pub sticky_hits: u64,
    /// Prefills done on a prefill replica (with a KV transfer after).
    pub disaggregated_prefills: u64,
    /// Idle KV caches evicted to make room.
    pub kv_evictions: u64,
    /// Stages retried after a failure, a timeout or a lost replica.
    pub stage_retries: u64,
    /// Groups given up after a trajectory's stages failed too often in a row.
    pub groups_abandoned: u64,
    /// Serving replicas added mid-run.
    pub replicas_added: u64,
    /// Serving replicas retired mid-run.
    pub replicas_retired: u64,
    /// Reports about stages the core no longer expected (ignored).
    pub ignored_reports: u64,
    /// Weight updates issued.
    pub weight_updates: u64,
    /// Generations interrupted by their replica's weight update, to resume on the new weights.
    pub interrupted_generations: u64,
    /// Training batches issued.
    pub train_batches: u64,
    /// How the groups the trainer took lived, per task (indexed as the job's tasks).
    #[serde(default)]
    pub task_lives: Vec<TaskLives>,
}

/// How one task's groups lived, summed over the groups the trainer took, in seconds on the core's
/// clock: the measured side of the planner's model of a group's life (its members' lives, the
/// slowest of them, the slot it holds in the admission window), which `rollfleet sim` prints
/// beside the model's.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TaskLives {
    /// Groups of the task the trainer took.
    pub groups: u64,
    /// From a group's admission to the trainer taking it: its slot in the window, every attempt
    /// and every wait included.
    pub slot_s: f64,
    /// From the first turn of the attempt that was trained to its last member's finish: the
    /// slowest member's life.
    pub group_s: f64,
    /// From that first turn to each member's finish, over the members.
    pub member_s: f64,
    /// Members counted in `member_s`.
    pub members: u64,
    /// From a group's last member's finish to the trainer taking it.
    pub trainer_wait_s: f64,
}

impl TaskLives {
    /// Mean seconds of a slot, of the slowest member, of a member and of the wait for the
    /// trainer; `None` before any group of the task was trained.
    pub fn means(&self) -> Option<[f64; 4]> {
        (self.groups > 0 && self.members > 0).then(|| {
            let g = self.groups as f64;
            [
                self.slot_s / g,
                self.group_s / g,
                self.member_s / self.members as f64,
                self.trainer_wait_s / g,
            ]
        })
    }
}

/// The scheduler core. See the module docs.
#[derive(Debug, Clone)]
pub struct Core {
    cfg: Config,
    /// [`Core::admission_terms`] of `cfg` (continuous discipline; zeros, unused, otherwise).
    admission_terms: AdmissionTerms,
    now: Time,
    version: Version,
    trajs: Vec<Traj>,
    groups: Vec<Group>,
    replicas: Vec<Replica>,
    prefill_set: LoadOrder,
    decode_set: LoadOrder,
    disaggregated: bool,
    cpu_free: Vec<u64>,
    serverless_free: Vec<u64>,
    stages: IdSlab<StageRec>,
    next_stage: u64,
    /// The queues, indexed by [`Queue`] (an array: one is looked up on every enqueue).
    /// Each holds trajectory ids, so it is walked oldest group first: trajectories are numbered
    /// group by group, in the order groups start ([`Core::start_group`]).
    queues: [IdSet; 4],
    ready: BTreeSet<(Version, GroupId)>,
    batch_complete: BTreeMap<u64, u32>,
    batch_done: BTreeMap<u64, u32>,
    batches_admitted: u64,
    active: u64,
    gpu_stages: u64,
    trainer: Option<TrainBatch>,
    minibatches_in_step: u32,
    next_batch: u64,
    pending_update: BTreeSet<ReplicaId>,
    /// Replicas changed since the router's sets were last brought up to date.
    dirty: Vec<ReplicaId>,
    draining: BTreeSet<ReplicaId>,
    updating: u32,
    /// Replicas told to retire and not retired yet: while there are none, the admission pass
    /// need not look for drained ones (it runs on every input, and fleets have many replicas).
    retiring: u32,
    commands: VecDeque<Command>,
    repump: bool,
    open_groups: BTreeSet<GroupId>,
    groups_closed: u64,
    hold_checked: u64,
    hold_until: Option<Time>,
    last_publish: Time,
    last_step: crate::time::Span,
    /// Per task: the time its turns took, from ready to generate to the environment's next
    /// observation, summed, and how many turns that is (for [`Core::restart_late_groups`]).
    turn_time: Vec<TurnBooks>,
    stats: Stats,
}

impl Core {
    /// A core for a job; it starts working on the first input or timeout.
    pub fn new(cfg: Config) -> Core {
        let replicas: Vec<Replica> = cfg.replicas.iter().map(Replica::new).collect();
        let disaggregated = replicas.iter().any(|r| r.role == ServeRole::Prefill);
        // Worked out for the discipline that uses them only, as before they were kept.
        let admission_terms = match cfg.policy.discipline {
            Discipline::Continuous => Self::admission_terms(&cfg),
            Discipline::Batched { .. } => AdmissionTerms::default(),
        };
        let turn_time = vec![TurnBooks::default(); cfg.tasks.len()];
        let mut core = Core {
            admission_terms,
            cpu_free: cfg.cpu_pools.iter().map(|p| p.millicpus).collect(),
            serverless_free: cfg.serverless_pools.iter().map(|p| p.concurrency).collect(),
            cfg,
            now: Time::ZERO,
            version: 0,
            trajs: Vec::new(),
            groups: Vec::new(),
            replicas,
            prefill_set: LoadOrder::new(),
            decode_set: LoadOrder::new(),
            disaggregated,
            stages: IdSlab::new(),
            next_stage: 0,
            queues: Default::default(),
            ready: BTreeSet::new(),
            batch_complete: BTreeMap::new(),
            batch_done: BTreeMap::new(),
            batches_admitted: 0,
            active: 0,
            gpu_stages: 0,
            trainer: None,
            minibatches_in_step: 0,
            next_batch: 0,
            pending_update: BTreeSet::new(),
            dirty: Vec::new(),
            draining: BTreeSet::new(),
            updating: 0,
            retiring: 0,
            commands: VecDeque::new(),
            repump: false,
            open_groups: BTreeSet::new(),
            groups_closed: 0,
            hold_checked: u64::MAX,
            hold_until: None,
            last_publish: Time::ZERO,
            last_step: crate::time::Span::ZERO,
            turn_time,
            stats: Stats::default(),
        };
        for i in 0..core.replicas.len() {
            core.touch(ReplicaId(i as u64));
        }
        core
    }

    /// Its configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The latest published policy version (= RL steps trained).
    #[inline]
    pub fn version(&self) -> Version {
        self.version
    }

    /// Its counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Whether every RL step has been trained.
    #[inline]
    pub fn finished(&self) -> bool {
        self.version >= self.cfg.steps
    }

    /// Feeds a fact.
    pub fn handle_input(&mut self, now: Time, input: Input) {
        self.now = self.now.max(now);
        match input {
            Input::StageFinished { stage, outcome } => self.stage_finished(stage, outcome),
            Input::StageFailed { stage } => self.stage_failed(stage, false),
            Input::ReplicaLost { replica } => self.replica_lost(replica),
            Input::ReplicaRecovered { replica } => self.replica_recovered(replica),
            Input::ReplicaAdded { config } => self.replica_added(config),
            Input::RetireReplica { replica } => self.retire_replica(replica),
            Input::WeightsUpdated { replica, version } => self.weights_updated(replica, version),
            Input::TrainFinished { batch } => self.train_finished(batch),
            Input::Published { version } => match self.trainer.as_ref() {
                Some(b) if self.publication_refusal(version).is_none() => {
                    let batch = b.id;
                    self.train_finished(batch);
                }
                _ => self.stats.ignored_reports += 1,
            },
        }
        self.pump();
    }

    /// Why an external trainer's publication of `version` cannot be taken now, or `None` when it
    /// can: it must be the next version, and the batch that completes the step it comes from must
    /// have been handed out (a trainer cannot have trained on trajectories it was never given).
    pub fn publication_refusal(&self, version: Version) -> Option<String> {
        let next = self.version + 1;
        if version <= self.version {
            return Some(format!(
                "version {version} is already published (the policy is at version {})",
                self.version
            ));
        }
        if version > next {
            return Some(format!(
                "version {version} skips a version: the next one is {next}"
            ));
        }
        if self.finished() {
            return Some(format!(
                "the job has trained all its {} steps",
                self.cfg.steps
            ));
        }
        match &self.trainer {
            Some(b) if b.publishes => None,
            _ => Some(format!(
                "version {next} comes from step {}, whose last batch has not been handed to \
                 the trainer yet ({} of {} batches of the step so far)",
                self.version,
                self.minibatches_in_step,
                (self.cfg.rollout_batch_size / self.cfg.train_batch_size).max(1)
            )),
        }
    }

    /// Wakes the core at (or after) the time [`Core::poll_timeout`] asked for; also starts the
    /// job when called first.
    pub fn handle_timeout(&mut self, now: Time) {
        self.now = self.now.max(now);
        // Every stage gets the same timeout and the clock never goes back, so deadlines grow
        // with stage ids: the oldest live stage has the earliest one.
        loop {
            let Some((id, deadline)) = self.stages.iter().next().map(|(id, s)| (id, s.deadline))
            else {
                break;
            };
            let stage = StageId(id);
            if deadline > self.now {
                break;
            }
            if let Some(replica) = self.stages.get(stage.0).and_then(|s| s.replica) {
                if let Some(r) = self.replicas.get_mut(replica.0 as usize) {
                    r.failures = r.failures.saturating_add(1);
                }
                self.touch(replica);
            }
            self.stage_failed(stage, true);
        }
        self.pump();
    }

    /// The next command, if any.
    #[inline]
    pub fn poll_command(&mut self) -> Option<Command> {
        self.commands.pop_front()
    }

    /// When the core next needs [`Core::handle_timeout`], if ever.
    #[inline]
    pub fn poll_timeout(&self) -> Option<Time> {
        let stage = self.stages.iter().next().map(|(_, s)| s.deadline);
        match (stage, self.hold_until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Trajectories by state: `(in flight, complete and waiting for the trainer, consumed)`.
    pub fn trajectory_counts(&self) -> (u64, u64, u64) {
        let mut counts = (0, 0, 0);
        for t in &self.trajs {
            match t.phase {
                Phase::Consumed => counts.2 += 1,
                Phase::Complete => counts.1 += 1,
                Phase::Abandoned => {}
                _ => counts.0 += 1,
            }
        }
        counts
    }

    /// A one-line summary of where everything is, for diagnostics (e.g. a stalled run).
    pub fn summary(&self) -> String {
        let mut phases: BTreeMap<String, u64> = BTreeMap::new();
        for t in &self.trajs {
            *phases.entry(format!("{:?}", t.phase)).or_default() += 1;
        }
        let replicas: Vec<String> = self
            .replicas
            .iter()
            .map(|r| {
                format!(
                    "{:?}/v{:?}/{}{}{}/seq{}/kv{}+{}",
                    r.role,
                    r.version,
                    if r.healthy { "" } else { "lost," },
                    if r.draining { "draining," } else { "" },
                    if r.updating { "updating" } else { "" },
                    r.in_flight,
                    r.kv_reserved,
                    r.held.len()
                )
            })
            .collect();
        format!(
            "version {} trainer {:?} phases {:?} ready {} pending_update {} updating {} replicas [{}]",
            self.version,
            self.trainer.as_ref().map(|b| b.id),
            phases,
            self.ready.len(),
            self.pending_update.len(),
            self.updating,
            replicas.join(" ")
        )
    }
}
