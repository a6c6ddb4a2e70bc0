//! Results: what workers report on their work stream, the stage results settled with the core,
//! the trainer's feed, failed weight updates, and an external trainer's weight publications.

use super::*;

impl Actor {
    /// Whether an external trainer publishes the versions (`rl.trainer: external`).
    pub(super) fn external_trainer(&self) -> bool {
        self.plan.spec().rl.trainer == rollfleet_spec::TrainerMode::External
    }

    /// An external trainer's publication: taken when the core takes it (the next version, after
    /// the batch that completes its step was handed out), refused with the reason otherwise.
    pub(super) fn publish_weights(&mut self, publish: PublishWeights) -> PublicationAnswer {
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

    pub(super) fn message(&mut self, worker: u64, message: WorkerMessage) {
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

    /// Why a generation's ids cannot join its trajectory: more token ids, log-probabilities or
    /// prompt ids than its task's whole context (`contextLimit`), counting what an interrupted
    /// part of the same turn already holds. `None` when they fit.
    fn oversized_generation(
        &self,
        traj: TrajId,
        turn: u32,
        o: &rollfleet_proto::v1::StageOutput,
    ) -> Option<String> {
        let t = self.trajs.get(&traj)?;
        let task = self.plan.spec().tasks.get(t.task as usize)?;
        let context = task.context_limit.max(1) as u64;
        let held = t.partial.as_ref().filter(|p| p.turn == turn);
        let (held_ids, held_logprobs) = held.map_or((0, 0), |p| {
            (p.tokens.action.len() as u64, p.tokens.logprobs.len() as u64)
        });
        let fields = [
            ("output.tokens", held_ids, o.tokens.len() as u64),
            ("output.logprobs", held_logprobs, o.logprobs.len() as u64),
            (
                "output.prompt_tokens",
                0,
                if held.is_some() {
                    0
                } else {
                    o.prompt_tokens.len() as u64
                },
            ),
        ];
        fields
            .into_iter()
            .find(|(_, held, sent)| held + sent > context)
            .map(|(field, held, sent)| {
                let already = if held > 0 {
                    format!(" (after {held} the turn holds)")
                } else {
                    String::new()
                };
                format!(
                    "{field}: {sent} values{already}, more than task {}'s whole context \
                     (contextLimit {context})",
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
                        if let Some(reason) = self.oversized_generation(traj, turn, &o) {
                            // Kept, the ids would grow the trajectory (and every message that
                            // carries it) past any context: the stage fails and is retried,
                            // what the turn already holds stays, the worker stays.
                            let peer = self
                                .workers
                                .get(&worker)
                                .map_or_else(|| format!("w{worker}"), |w| w.name.clone());
                            let reason = format!("{peer} answered assignment {id} with {reason}");
                            log!(self, "scheduler: {reason}");
                            if let Some(t) = self.trajs.get_mut(&traj) {
                                t.last_failure = reason;
                            }
                            self.metrics.oversized_results.inc();
                            self.deferred.push_back(Input::StageFailed { stage });
                            return;
                        }
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
    pub(super) fn update_failed(
        &mut self,
        worker: u64,
        replica: ReplicaId,
        version: u64,
        why: &str,
    ) {
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
    pub(super) fn retry_updates(&mut self) {
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
}

/// Appends `more` to `to`, taking its buffer when `to` is empty (no copy).
fn extend_or_take<T>(to: &mut Vec<T>, more: &mut Vec<T>) {
    if to.is_empty() {
        std::mem::swap(to, more);
    } else {
        to.append(more);
    }
}
