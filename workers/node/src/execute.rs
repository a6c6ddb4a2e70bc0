//! Running the assignments: each kind of work (generation, environment steps, rewards,
//! training, weight syncs) on the replicas and environments of this node, with its interrupts,
//! aborts and failures.

use super::*;

pub(crate) fn failure(cause: Cause, message: impl Into<String>) -> work_result::Outcome {
    work_result::Outcome::Failure(StageFailure {
        cause: cause as i32,
        message: message.into(),
    })
}

/// An environment host's refusal as a stage failure. An environment this node does not know,
/// or one that calls its configuration impossible (a remote server's `unknown_environment` and
/// other 4xx answers), is a configuration error: retrying on another node cannot fix it, so it
/// is reported as invalid, naming the environment, for the scheduler to fail the job with.
/// Everything else (a crash, a timeout, an unreachable server) is an infrastructure fault.
pub(crate) fn env_failure(kind: &str, error: rollfleet_envhost::HostError) -> work_result::Outcome {
    use rollfleet_envhost::HostError;
    match error {
        HostError::UnknownEnvironment { .. } => failure(
            Cause::Invalid,
            format!(
                "{error}; a remote environment is served by workers started with --remote-env \
                 {kind}=URL"
            ),
        ),
        HostError::Environment {
            error: rollfleet_environments::EnvError::InvalidConfig(_),
            ..
        } => failure(
            Cause::Invalid,
            format!(
                "environment {}: {error}",
                rollfleet_proto::peer::quoted(kind)
            ),
        ),
        _ => failure(Cause::Infrastructure, error.to_string()),
    }
}

/// A failed engine call as a stage failure: an engine that is unreachable, answers 5xx or breaks
/// the protocol is an infrastructure fault (retried, never scored); a refused request is invalid.
pub(crate) fn engine_failure(error: EngineError) -> work_result::Outcome {
    let cause = match error {
        EngineError::Unavailable { .. } | EngineError::Protocol { .. } => Cause::Infrastructure,
        EngineError::Rejected { .. } | EngineError::Unsupported(_) => Cause::Invalid,
    };
    failure(cause, error.to_string())
}

/// An assignment being run: its task, to abort, and its interrupt, to set.
pub(crate) type Running = (AbortHandle, watch::Sender<bool>);

/// A generation's interrupt: set when the scheduler asks the generation to stop where it is.
pub(crate) struct Interrupt(pub(crate) watch::Receiver<bool>);

impl Interrupt {
    /// Resolves once the interrupt is asked for (never, if it cannot be any more).
    pub(crate) async fn asked(&mut self) {
        if self.0.wait_for(|asked| *asked).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Runs an emulated request that an interrupt may stop where it is: its output (the tokens
/// generated until then, when interrupted) and whether it was interrupted. An interrupted
/// request's cache is let go: the turn resumes after a weight update, which drops it anyway.
async fn run_interruptible(
    engine: &EmulatedEngine,
    cached: u64,
    prefill: u64,
    decode: u64,
    mut interrupt: Interrupt,
) -> Result<(rollfleet_engine::emulated::EmulatedOutput, bool), EngineError> {
    use rollfleet_engine::emulated::Interrupted;
    let mut flight = engine.submit(cached, prefill, Some(decode));
    tokio::select! {
        out = flight.finished() => return Ok((out?, false)),
        () = interrupt.asked() => {}
    }
    match flight.interrupt().await? {
        Interrupted::Finished(out) => Ok((out, false)),
        Interrupted::Partial(partial) => {
            engine.release(partial);
            Ok((
                rollfleet_engine::emulated::EmulatedOutput {
                    tokens: partial.generated,
                    policy_version: partial.policy_version,
                    emulated: true,
                },
                true,
            ))
        }
    }
}

impl Node {
    /// Replica `replica` as the job's placement has it, or as a re-plan started it here.
    pub(crate) fn replica_config(&self, replica: u64) -> Option<rollfleet_core::ReplicaConfig> {
        self.plan.replica(replica).cloned().or_else(|| {
            self.started_replicas
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&replica)
                .cloned()
        })
    }

    /// Takes on a replica a re-plan started on this node. A shape that cannot be served (no
    /// GPUs, no KV cache, an unknown role, an id the placement already has) is refused, naming
    /// the field.
    pub(crate) fn start_replica(
        &self,
        start: &rollfleet_proto::v1::ReplicaStart,
    ) -> Result<(), String> {
        use rollfleet_core::ServeRole;
        let role = match start.role.as_str() {
            "prefill" => ServeRole::Prefill,
            "decode" => ServeRole::Decode,
            "generate" => ServeRole::Generate,
            other => {
                return Err(format!(
                    "start_replica.role: {other:?} is not prefill, decode or generate"
                ));
            }
        };
        if start.gpus == 0 || start.kv_capacity_tokens == 0 || start.max_seqs == 0 {
            return Err(format!(
                "start_replica: replica {} has {} GPUs, {} KV tokens and {} sequences; each must \
                 be positive",
                start.replica, start.gpus, start.kv_capacity_tokens, start.max_seqs
            ));
        }
        if self.plan.replica(start.replica).is_some() {
            return Err(format!(
                "start_replica.replica: {} is a replica of the job's own placement",
                start.replica
            ));
        }
        self.started_replicas
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                start.replica,
                rollfleet_core::ReplicaConfig {
                    pool: self.pool,
                    role,
                    gpus: start.gpus,
                    kv_capacity_tokens: start.kv_capacity_tokens,
                    max_seqs: start.max_seqs,
                },
            );
        Ok(())
    }

    /// Drops a replica a re-plan retired: its engine (and the memory it models) goes.
    pub(crate) fn stop_replica(&self, replica: u64) {
        if let Some(t) = &self.tokens {
            t.release(replica);
        }
        self.engines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&replica);
        self.started_replicas
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&replica);
    }

    /// Replica `replica` (named by the work's field `field`, such as `generation.replica`), if
    /// it belongs to this worker's pool.
    fn own_replica(
        &self,
        field: &str,
        replica: u64,
    ) -> Result<rollfleet_core::ReplicaConfig, String> {
        let rc = self.replica_config(replica).ok_or_else(|| {
            format!(
                "{field}: no replica {replica} in the placement (neither the job's plan nor a \
                 re-plan's replica started on this worker)"
            )
        })?;
        if rc.pool != self.pool {
            return Err(format!(
                "{field}: replica {replica} belongs to pool {}, not this worker's {}",
                self.plan.pool_name(rc.pool),
                self.plan.pool_name(self.pool)
            ));
        }
        Ok(rc)
    }

    fn engine(&self, field: &str, replica: u64) -> Result<Arc<EmulatedEngine>, String> {
        let mut engines = self.engines.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = engines.get(&replica) {
            return Ok(e.clone());
        }
        let rc = self.own_replica(field, replica)?;
        let (peak, bw) = self.plan.gpu_peaks(rc.pool);
        let engine = Arc::new(EmulatedEngine::start(EmulatedConfig {
            gpus: rc.gpus,
            peak_flops: peak * self.slowdown,
            bandwidth: bw * self.slowdown,
            hardware: self.plan.hardware,
            costs: self.plan.costs,
            kv_capacity_tokens: rc.kv_capacity_tokens,
            max_seqs: rc.max_seqs,
            link_bytes_per_s: self.plan.link_bytes_per_s(),
            weight_bytes: self.plan.config.weight_bytes,
            time_scale: self.time_scale,
        }));
        engines.insert(replica, engine.clone());
        Ok(engine)
    }

    pub(crate) async fn execute(
        &self,
        a: &WorkAssignment,
        interrupt: Interrupt,
    ) -> work_result::Outcome {
        if self.model_environments
            && let Some(output) = self.modelled(a).await
        {
            return work_result::Outcome::Output(output);
        }
        match self.try_execute(a, interrupt).await {
            Ok(mut output) => {
                // Token ids and log-probabilities travel packed (cheap for the scheduler).
                rollfleet_proto::packed::pack(&mut output);
                work_result::Outcome::Output(output)
            }
            Err(outcome) => outcome,
        }
    }

    async fn try_execute(
        &self,
        a: &WorkAssignment,
        interrupt: Interrupt,
    ) -> Result<StageOutput, work_result::Outcome> {
        let invalid = |m: String| failure(Cause::Invalid, m);
        let infra = |m: String| failure(Cause::Infrastructure, m);
        let role = self.plan.pool_role(self.pool);
        let work = a
            .work
            .as_ref()
            .ok_or_else(|| invalid("work: not set".into()))?;
        let traj = a.trajectory.clone().unwrap_or_default();
        match work {
            Work::Generation(g) => {
                if role != Some(PoolRole::Gpu) {
                    return Err(invalid("generation work sent to a non-GPU pool".into()));
                }
                if let Some(backend) = &self.openai {
                    let gpus = self
                        .own_replica("generation.replica", g.replica)
                        .map_err(invalid)?
                        .gpus;
                    return generate_openai(backend, a, g, &self.plan.costs, gpus).await;
                }
                if let Some(backend) = &self.tokens {
                    self.own_replica("generation.replica", g.replica)
                        .map_err(invalid)?;
                    return token_engine::generate(backend, a, g, interrupt).await;
                }
                let engine = self
                    .engine("generation.replica", g.replica)
                    .map_err(invalid)?;
                if g.prefill_only {
                    let out = engine
                        .run(0, g.prefill_token_count, None)
                        .await
                        .map_err(|e| infra(e.to_string()))?;
                    return Ok(StageOutput {
                        policy_version: out.policy_version,
                        emulated: true,
                        text: "[emulated prefill]".into(),
                        ..Default::default()
                    });
                }
                if g.kv_pull_tokens > 0 {
                    let secs = g.kv_pull_tokens as f64 * self.plan.costs.kv_bytes_per_token
                        / self.plan.link_bytes_per_s();
                    tokio::time::sleep(Duration::from_secs_f64(secs * self.time_scale)).await;
                }
                let task = self.plan.spec().tasks.get(a.task as usize);
                let mut rng = SplitMix64::keyed(
                    self.plan.config.seed,
                    &[
                        0x6465_636f_6465,
                        traj.id,
                        traj.attempt as u64,
                        a.turn as u64,
                    ],
                );
                let drawn = task.map_or(64.0, |t| {
                    rollfleet_fleet::workload::sample(&t.action_tokens, &mut rng)
                });
                // The turn's length is drawn whole; a resumed turn generates what is left of it.
                let n = (drawn.round().max(1.0) as u64)
                    .saturating_sub(g.resumed_tokens)
                    .clamp(1, u64::from(g.max_new_tokens.max(1)));
                let cached = u64::from(g.cached_prefix_tokens) + g.kv_pull_tokens;
                let (out, interrupted) =
                    run_interruptible(&engine, cached, g.prefill_token_count, n, interrupt)
                        .await
                        .map_err(|e| infra(e.to_string()))?;
                let mut key = vec![traj.id, u64::from(traj.attempt), u64::from(a.turn)];
                if g.resumed_tokens > 0 {
                    key.push(g.resumed_tokens);
                }
                let (tokens, logprobs) = synthetic_tokens(self.plan.config.seed, &key, out.tokens);
                let prompt_tokens =
                    synthetic_ids(!self.plan.config.seed, &key, g.new_message_tokens);
                Ok(StageOutput {
                    policy_version: out.policy_version,
                    emulated: true,
                    token_count: out.tokens,
                    text: format!("[emulated: {} synthetic tokens]", out.tokens),
                    tokens,
                    logprobs,
                    prompt_tokens,
                    interrupted,
                    ..Default::default()
                })
            }
            Work::WeightSync(w) => {
                if let Some(backend) = &self.openai {
                    self.own_replica("weight_sync.replica", w.replica)
                        .map_err(invalid)?;
                    return weight_sync_openai(backend, w).await;
                }
                if let Some(backend) = &self.tokens {
                    self.own_replica("weight_sync.replica", w.replica)
                        .map_err(invalid)?;
                    return token_engine::weight_sync(backend, w).await;
                }
                let engine = self
                    .engine("weight_sync.replica", w.replica)
                    .map_err(invalid)?;
                engine
                    .load_weights(w.to_version, w.weight_bytes)
                    .await
                    .map_err(|e| infra(e.to_string()))?;
                Ok(StageOutput {
                    policy_version: w.to_version,
                    emulated: true,
                    ..Default::default()
                })
            }
            Work::Train(t) => {
                if role != Some(PoolRole::Gpu) {
                    return Err(invalid("training sent to a non-GPU pool".into()));
                }
                let secs = self
                    .plan
                    .train_seconds(t.tokens, t.causal_pairs, t.trainer_gpus)
                    * self.time_scale;
                tokio::time::sleep(Duration::from_secs_f64(secs.min(3600.0))).await;
                Ok(StageOutput {
                    policy_version: t.from_version + u64::from(t.publishes),
                    emulated: true,
                    text: format!(
                        "[emulated training: {} trajectories, {} tokens]",
                        t.batch.len(),
                        t.tokens
                    ),
                    ..Default::default()
                })
            }
            Work::EnvStep(e) => {
                if role != Some(PoolRole::Cpu) {
                    return Err(invalid("an environment step sent to a non-CPU pool".into()));
                }
                let key = (traj.id, traj.attempt);
                if e.reset {
                    self.forget(key);
                    self.make_room();
                    let (episode, observation) = self
                        .host
                        .start(&e.environment, e.seed)
                        .await
                        .map_err(|err| env_failure(&e.environment, err))?;
                    self.remember(key, episode, 0);
                    return Ok(StageOutput {
                        token_count: tokens_of(&observation),
                        observation,
                        ..Default::default()
                    });
                }
                let held = self
                    .episodes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&key)
                    .copied();
                let episode = match held {
                    Some((episode, applied)) if applied == e.history.len() => episode,
                    _ => {
                        // Not here (it ran elsewhere, or was lost): rebuild it by replay.
                        self.forget(key);
                        self.make_room();
                        let (episode, _) = self
                            .host
                            .restore(&e.environment, e.seed, &e.history)
                            .await
                            .map_err(|err| env_failure(&e.environment, err))?;
                        episode
                    }
                };
                // The policy's text when a real engine wrote it (the action extracted as the
                // agent loop does); a random legal move when the policy is emulated.
                let action = match &e.policy_output {
                    Some(text) => rollfleet_environments::extract_action(text).to_owned(),
                    None => emulated_action(&e.environment, e.seed, a.turn),
                };
                let step = self.host.step(episode, &action).await.map_err(|err| {
                    self.episodes
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&key);
                    env_failure(&e.environment, err)
                })?;
                if step.done {
                    self.episodes
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&key);
                } else {
                    self.remember(key, episode, e.history.len() + 1);
                }
                Ok(StageOutput {
                    token_count: tokens_of(&step.observation),
                    observation: step.observation,
                    done: step.done,
                    reward: step.reward,
                    text: action,
                    ..Default::default()
                })
            }
            Work::Reward(r) => {
                let function = rollfleet_rewards::RewardFunction::from_name(&r.function)
                    .ok_or_else(|| invalid(format!("reward.function: unknown {:?}", r.function)))?;
                let handler = self.rewards.clone();
                let payload = r.payload.clone();
                let result =
                    tokio::task::spawn_blocking(move || handler.invoke(function, &payload))
                        .await
                        .map_err(|e| infra(format!("reward task: {e}")))?;
                let bytes = result.map_err(|e| {
                    if e.error_type == rollfleet_rewards::FunctionError::INVALID_PAYLOAD {
                        invalid(e.to_string())
                    } else {
                        infra(e.to_string())
                    }
                })?;
                let value: serde_json::Value = serde_json::from_slice(&bytes)
                    .map_err(|e| infra(format!("reward result is not JSON: {e}")))?;
                let reward = value
                    .get("reward")
                    .and_then(serde_json::Value::as_f64)
                    .ok_or_else(|| infra("reward result has no number \"reward\"".into()))?;
                Ok(StageOutput {
                    reward,
                    ..Default::default()
                })
            }
        }
    }

    /// An environment step or reward drawn from the job spec's distributions (what the
    /// simulator does), taking the drawn time on the scaled clock; `None` for other work.
    async fn modelled(&self, a: &WorkAssignment) -> Option<StageOutput> {
        use rollfleet_fleet::workload::sample;
        let traj = a.trajectory.clone().unwrap_or_default();
        let task = self.plan.spec().tasks.get(a.task as usize)?;
        let seed = self.plan.config.seed;
        let keyed =
            |k: u64| SplitMix64::keyed(seed, &[k, traj.id, traj.attempt as u64, a.turn as u64]);
        let output = match a.work.as_ref()? {
            Work::EnvStep(e) => {
                let ms = sample(&task.env_step_ms, &mut keyed(1));
                tokio::time::sleep(Duration::from_secs_f64(ms / 1000.0 * self.time_scale)).await;
                if e.reset {
                    let tokens = sample(&task.prompt_tokens, &mut keyed(2)).round().max(1.0);
                    StageOutput {
                        token_count: tokens as u64,
                        observation: "[modelled environment]".into(),
                        emulated: true,
                        ..Default::default()
                    }
                } else {
                    let max = task.max_turns.max(1) as f64;
                    let mut turns_rng = SplitMix64::keyed(seed, &[3, traj.id, traj.attempt as u64]);
                    let wanted = task
                        .turns
                        .as_ref()
                        .map_or(max, |d| sample(d, &mut turns_rng).round())
                        .clamp(1.0, max) as u32;
                    let tokens = sample(&task.observation_tokens, &mut keyed(4))
                        .round()
                        .max(0.0);
                    StageOutput {
                        token_count: tokens as u64,
                        done: a.turn >= wanted,
                        observation: "[modelled environment]".into(),
                        text: "[modelled action]".into(),
                        emulated: true,
                        ..Default::default()
                    }
                }
            }
            Work::Reward(_) => {
                let reward = self
                    .plan
                    .spec()
                    .rewards
                    .iter()
                    .find(|r| r.name == task.reward)?;
                let ms = sample(&reward.latency_ms, &mut keyed(5));
                tokio::time::sleep(Duration::from_secs_f64(ms / 1000.0 * self.time_scale)).await;
                StageOutput {
                    emulated: true,
                    ..Default::default()
                }
            }
            _ => return None,
        };
        Some(output)
    }

    fn remember(&self, key: (u64, u32), episode: EpisodeId, applied: usize) {
        self.episodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, (episode, applied));
    }

    fn forget(&self, key: (u64, u32)) {
        if let Some((episode, _)) = self
            .episodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key)
        {
            self.host.end(episode);
        }
    }

    /// Episodes abandoned by the scheduler (regenerated trajectories) would fill the slots:
    /// end the oldest ones when the host is nearly full.
    fn make_room(&self) {
        let mut episodes = self.episodes.lock().unwrap_or_else(|p| p.into_inner());
        while episodes.len() + 1 >= self.slots {
            let Some((_, (episode, _))) = episodes.pop_first() else {
                break;
            };
            self.host.end(episode);
        }
    }
}
