//! Dispatch: turning the core's commands into work assignments booked on one worker each, and
//! sending, interrupting, cancelling and giving up on them.

use super::*;

impl Actor {
    pub(super) fn new_assignment(
        &mut self,
        pool: u32,
        what: What,
        mut message: WorkAssignment,
    ) -> u64 {
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

    pub(super) fn execute(&mut self, command: Command) {
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
                if let Some(reason) = self.groups_given_up.given_up(&last_failure)
                    && self.failure.is_none()
                {
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
                causal_pairs,
            } => {
                self.groups_given_up.trained();
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
                        causal_pairs,
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
    pub(super) fn dispatch_pooled(&mut self, id: u64) {
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

    pub(super) fn flush_pending(&mut self, pool: u32) {
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
    pub(super) fn give_up_hung(&mut self) {
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
            let kind = if matches!(a.what, What::Train(_)) {
                "training"
            } else {
                "weights"
            };
            self.metrics
                .hung_assignments
                .with_label_values(&[kind])
                .inc();
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
    pub(super) fn unbook(&mut self, a: &Assignment) {
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
}

/// The whole context of a trajectory's next turn, as the agent's prompt template renders it: the
/// task, then every earlier turn's output and observation. A turn generated by an emulated engine
/// has no text; the action applied stands in for it.
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
