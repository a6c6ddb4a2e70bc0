//! What the job did: the report written at its end, the trained trajectories' figures, and the
//! status and metrics the actor publishes as it runs.
//!
//! The report's types live here with what fills them: the outcome tallies per RL step and task,
//! the per-pool summaries, the workers lost or released, and the phase the job ended in.

use super::*;

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
    /// Finished groups found past the staleness bound when the trainer came to take them, and
    /// generated again (the core's count).
    #[serde(default)]
    pub groups_expired_waiting: u64,
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
pub(super) struct TrajectoryOutcome {
    pub(super) reward: f64,
    /// Its reward was modelled, not computed.
    pub(super) modelled: bool,
    pub(super) turns: u64,
    pub(super) prompt_tokens: u64,
    pub(super) action_tokens: u64,
    /// Policy versions its oldest turn was behind the trainer.
    pub(super) staleness: u64,
}

/// Sums of trained trajectories' figures, from which [`OutcomeFigures`] are taken.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Tally {
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
    pub(super) fn add(&mut self, o: &TrajectoryOutcome) {
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

    pub(super) fn figures(&self, task: &str) -> OutcomeFigures {
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
pub(super) fn outcomes(
    by_step: &BTreeMap<u64, BTreeMap<u32, Tally>>,
    tasks: &[String],
) -> Outcomes {
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

impl Actor {
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

    /// What `w` said at registration about GPU telemetry, for the report.
    pub(super) fn telemetry_of(&self, w: &Worker) -> WorkerTelemetry {
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

    /// Counts a trajectory handed to the trainer at RL step `step` in its task's figures.
    pub(super) fn record_outcome(&mut self, step: u64, info: &TrajInfo) {
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
    pub(super) fn export_step_outcomes(&self, step: u64) {
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
        m.groups_expired_waiting.inc_by(
            stats
                .groups_expired_waiting
                .saturating_sub(m.groups_expired_waiting.get()),
        );
    }

    pub(super) fn publish(&mut self) {
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
                .with_label_values(&[p.name()])
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

    pub(super) fn finish(&mut self, phase: JobPhase) {
        // Half a step after a re-plan given up for a stop: a replay of the journal may not end
        // the job here, so neither does this.
        if self.interrupted {
            return;
        }
        self.ended = Some((self.at, phase));
        // Unix time, not the job's clock: the alert on a scheduler that stops answering
        // compares it with the process's start time.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.metrics
            .job_end_time
            .with_label_values(&[phase.name()])
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
            phase: phase.name().to_string(),
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
            groups_expired_waiting: stats.groups_expired_waiting,
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
