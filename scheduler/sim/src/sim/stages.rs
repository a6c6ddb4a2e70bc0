//! The core's commands carried out: a stage placed on its engine, CPU pool or serverless
//! platform with its duration drawn, a generation interrupted or cancelled, and the place a
//! stage ran on handed back.

use super::*;

impl<'a> Sim<'a> {
    pub(super) fn execute(&mut self, command: Command) {
        match command {
            Command::Run(cmd) => self.run_stage(cmd),
            Command::UpdateWeights {
                replica,
                version,
                bytes,
                mode,
            } => {
                let r = replica.0 as usize;
                if r >= self.engines.len() {
                    return;
                }
                if self.engine_running[r] > 0 {
                    self.violation(format!("replica {r} updated while running stages"));
                }
                let now = self.now;
                self.engines[r].wipe(now);
                self.engine_scheduled[r] = None;
                self.engines[r].version = None;
                self.refresh_engine(r);
                let secs = match mode {
                    SyncMode::Rolling | SyncMode::Broadcast => bytes as f64 / self.link_bytes_per_s,
                    SyncMode::Colocated => {
                        // Resharding inside the node over NVLink.
                        bytes as f64 / self.interconnect.max(1.0)
                    }
                };
                *self.sync_seconds.entry(self.engine_pool[r]).or_default() +=
                    secs * self.engines[r].gpus as f64;
                let epoch = self.engines[r].epoch;
                self.push(
                    now.plus(Span::from_secs_f64(secs)),
                    Event::WeightsDone(r as u32, version, epoch),
                );
            }
            Command::ReleaseKv { replica, traj } => {
                if let Some(e) = self.engines.get_mut(replica.0 as usize) {
                    e.release_kv(traj);
                }
            }
            Command::Cancel { stage } => self.cancel(stage),
            Command::Interrupt { stage } => self.interrupt(stage),
            // Its stages' cancels already freed what they held; what is left is the rule that
            // fails the job, the scheduler server's. The simulator fails no stage of its own
            // accord, so only timeouts give groups up here.
            Command::AbandonGroup { .. } => {
                if let Some(reason) = self.groups_given_up.given_up("") {
                    self.failure.get_or_insert(reason);
                }
            }
            Command::ReplicaRetired { replica } => {
                let r = replica.0 as usize;
                if r < self.engines.len() {
                    // Its GPUs are free; nothing of it is chosen again.
                    self.engine_alive[r] = false;
                    if let Some(m) = self.migration_report() {
                        m.retired += 1;
                    }
                    self.migration_progress(r as u32);
                }
            }
            Command::Train {
                batch,
                publishes,
                trajectories,
                tokens,
                ..
            } => {
                self.groups_given_up.trained();
                self.train(batch, publishes, trajectories, tokens);
            }
        }
    }

    /// Cuts a generation where it is (its replica is due for new weights) and reports the
    /// tokens it had generated; one still pulling its KV cache had generated none.
    fn interrupt(&mut self, stage: StageId) {
        let on_engine = self
            .stages
            .get(stage.0)
            .is_some_and(|s| matches!(s.loc, Some(Loc::Engine(_) | Loc::Transfer(_))));
        if !on_engine {
            return;
        }
        let Some((Loc::Engine(r) | Loc::Transfer(r), info)) = self.end_stage(stage) else {
            return;
        };
        let r = r as usize;
        let now = self.now;
        let tokens = self.engines[r].cancel(now, stage).unwrap_or(0);
        self.engines[r].release_kv(info.traj);
        self.engine_running[r] = self.engine_running[r].saturating_sub(1);
        self.refresh_engine(r);
        let l = self.ledger_mut(info.traj);
        let kept = match l.partial {
            Some(p) if p.turn == info.turn && p.attempt == info.attempt => p,
            _ => PartialWork {
                turn: info.turn,
                attempt: info.attempt,
                version: info.version,
                tokens: 0,
            },
        };
        // A part with no token in it is no part of the turn: the core keeps none either, and
        // stamping the turn with the interrupted weights' version would make the ledger call a
        // turn generated wholly by the new weights stale.
        if kept.tokens + tokens > 0 {
            l.partial = Some(PartialWork {
                version: kept.version.min(info.version),
                tokens: kept.tokens + tokens,
                ..kept
            });
        }
        self.input(Input::StageFinished {
            stage,
            outcome: StageOutcome::Interrupted { tokens },
        });
    }

    fn cancel(&mut self, stage: StageId) {
        let Some((loc, info)) = self.end_stage(stage) else {
            return;
        };
        let now = self.now;
        match loc {
            Loc::Engine(r) | Loc::Transfer(r) => {
                let r = r as usize;
                self.engines[r].cancel(now, stage);
                self.engines[r].release_kv(info.traj);
                self.engine_running[r] = self.engine_running[r].saturating_sub(1);
                self.refresh_engine(r);
            }
            cpu_or_serverless => self.release_loc(cpu_or_serverless),
        }
    }

    fn run_stage(&mut self, cmd: StageCommand) {
        let StageCommand {
            stage,
            traj,
            group,
            task,
            turn,
            attempt,
            work,
            ..
        } = cmd;
        self.stages.insert(
            stage.0,
            StageState {
                info: StageInfo {
                    traj,
                    turn,
                    attempt,
                    version: 0,
                },
                loc: None,
            },
        );
        let ledger = self.ledger_mut(traj);
        ledger.group = group.0;
        ledger.task = task;
        let Some((task_spec, samplers)) = self.task(task) else {
            self.violation(format!("stage {} names unknown task {task}", stage.0));
            return;
        };
        let now = self.now;
        match work {
            StageWork::EnvReset { pool, millicpus }
            | StageWork::EnvStep {
                pool, millicpus, ..
            } => {
                let reset = matches!(work, StageWork::EnvReset { .. });
                self.cpu_take(pool, millicpus);
                self.set_loc(stage, Loc::Cpu(pool, millicpus));
                let ms = samplers.env_step.sample(&mut self.rng(&[
                    stream::ENV_LATENCY,
                    traj.0,
                    turn as u64,
                    attempt as u64,
                    reset as u64,
                ]));
                let at = now.plus(Span::from_secs_f64(ms / 1000.0));
                let fails = self.rng(&[stream::ENV_FAILURE, stage.0]).next_f64()
                    < task_spec.env_failure_rate.clamp(0.0, 1.0);
                if fails {
                    self.push(at, Event::Failed(stage));
                    return;
                }
                if !reset && let Some(e) = self.env_step_estimates.get_mut(task as usize) {
                    e.add_seconds(ms / 1000.0, Origin::Modelled);
                }
                let cpu_s = ms / 1000.0 * millicpus as f64 / 1000.0;
                // The episode's length is a draw of its own stream (by trajectory only), the same
                // whenever it is drawn: drawn at the reset, it sizes the books before their
                // first entries instead of moving them once they have some.
                let seed = self.opts.seed;
                let wanted = *self.ledger_mut(traj).turns_wanted.get_or_insert_with(|| {
                    let max = task_spec.max_turns.max(1) as f64;
                    let t = task_spec.turns.as_ref().map_or(max, |d| {
                        sample(d, &mut SplitMix64::keyed(seed, &[stream::TURNS, traj.0])).round()
                    });
                    t.clamp(1.0, max) as u32
                });
                // Room for every turn the episode will have, so its books grow once; an episode
                // longer than any measured one grows them as it goes instead of asking up front.
                if let Some(l) = Some(self.ledger_mut(traj)) {
                    let wanted = wanted.min(MAX_TURNS_RESERVED);
                    let more = (wanted as usize + 1).saturating_sub(l.turns.len());
                    l.turns.reserve(more);
                    let more = (wanted as usize + 1).saturating_sub(l.inputs.len());
                    l.inputs.reserve(more);
                }
                let outcome = if reset {
                    let tokens = samplers
                        .prompt
                        .sample(&mut self.rng(&[stream::PROMPT, group.0]))
                        .round()
                        .max(1.0) as u64;
                    if let Some(l) = Some(self.ledger_mut(traj)) {
                        l.reset_cpu_s = cpu_s;
                        l.set_input(0, tokens);
                    }
                    StageOutcome::Observed {
                        tokens,
                        done: false,
                    }
                } else {
                    let tokens = samplers
                        .observation
                        .sample(&mut self.rng(&[stream::OBSERVATION, traj.0, turn as u64]))
                        .round() as u64;
                    if let Some(l) = Some(self.ledger_mut(traj)) {
                        // Turns beyond this one belong to an attempt that was thrown away.
                        l.truncate_turns(turn as usize);
                        if let Some(last) = (turn as usize)
                            .checked_sub(1)
                            .and_then(|k| l.turns.get_mut(k))
                        {
                            last.env_cpu_s = cpu_s;
                            last.env_s = ms / 1000.0;
                        }
                        l.set_input(turn as usize, tokens);
                    }
                    StageOutcome::Observed {
                        tokens,
                        done: turn >= wanted,
                    }
                };
                self.push(at, Event::Done(stage, outcome));
            }
            StageWork::Prefill { replica, tokens } => {
                let r = replica.0 as usize;
                if !self.engine_ok(r, stage) {
                    return;
                }
                self.engine_running[r] += 1;
                self.check_slots(r);
                if !self.engines[r].hold_kv(traj, tokens) {
                    self.violation(format!("replica {r}: KV over capacity after a prefill"));
                }
                self.set_loc(stage, Loc::Engine(r as u32));
                self.engines[r].add_prefill(
                    now,
                    PrefillJob {
                        stage,
                        traj,
                        cached: 0,
                        tokens,
                        decode: None,
                    },
                );
                self.refresh_engine(r);
            }
            StageWork::Generate {
                replica,
                cached_tokens,
                prefill_tokens,
                max_new_tokens,
                kv_from,
                kv_tokens,
            } => {
                let r = replica.0 as usize;
                if !self.engine_ok(r, stage) {
                    return;
                }
                // A resumed turn generates what its draw has left after its interrupted part.
                let already = self.ledger_mut(traj).partial_tokens(turn, attempt) as f64;
                let action = (samplers
                    .action
                    .sample(&mut self.rng(&[stream::ACTION, traj.0, turn as u64, attempt as u64]))
                    .round()
                    - already)
                    .clamp(1.0, max_new_tokens.max(1) as f64) as u64;
                if kv_from.is_none()
                    && cached_tokens > 0
                    && !self.engines[r].kv_held.contains_key(&traj)
                {
                    self.violation(format!("replica {r}: sticky turn without its KV cache"));
                }
                self.engine_running[r] += 1;
                self.check_slots(r);
                if !self.engines[r].hold_kv(traj, cached_tokens + prefill_tokens + action) {
                    self.violation(format!(
                        "replica {r}: KV over capacity ({} > {})",
                        self.engines[r].kv_used, self.engines[r].kv_capacity
                    ));
                }
                match kv_from {
                    Some(p) => {
                        self.set_loc(stage, Loc::Transfer(r as u32));
                        let secs = kv_tokens as f64 * self.costs.kv_bytes_per_token
                            / self.link_bytes_per_s;
                        let epoch = self.engines[r].epoch;
                        self.push(
                            now.plus(Span::from_secs_f64(secs)),
                            Event::KvArrived(Box::new(KvArrival {
                                replica: r as u32,
                                epoch,
                                stage,
                                traj,
                                from: p.0 as u32,
                                context: cached_tokens,
                                prefill: prefill_tokens,
                                action,
                            })),
                        );
                    }
                    None => {
                        self.set_loc(stage, Loc::Engine(r as u32));
                        self.start_generation(
                            r,
                            stage,
                            traj,
                            cached_tokens,
                            prefill_tokens,
                            action,
                            false,
                        );
                    }
                }
            }
            StageWork::Reward {
                pool,
                serverless,
                millicpus,
            } => {
                let reward = self
                    .spec
                    .rewards
                    .iter()
                    .position(|rw| rw.name == task_spec.reward);
                let latency = reward.map_or(0.0, |i| {
                    sample(
                        &self.spec.rewards[i].latency_ms,
                        &mut self.rng(&[stream::REWARD, traj.0, attempt as u64]),
                    ) / 1000.0
                });
                // The function's own latency; a cold start is modelled apart (below).
                if let Some(e) = reward.and_then(|i| self.reward_estimates.get_mut(i)) {
                    e.add_seconds(latency, Origin::Modelled);
                }
                let mut secs = latency;
                if serverless {
                    let keepalive = self.opts.hardware.serverless_keepalive_s;
                    let cold = self.serverless_cold_start(pool);
                    let mut violation = None;
                    if let Some(s) = self.serverless.get_mut(&pool) {
                        s.in_use += 1;
                        s.invocations += 1;
                        if s.in_use > s.concurrency {
                            violation =
                                Some(format!("serverless pool {pool} over its concurrency"));
                        }
                        // Reuse the most recently idle warm instance, if still warm.
                        s.idle.retain(|&t| now.since(t).as_secs_f64() <= keepalive);
                        if s.idle.pop().is_none() {
                            s.cold_starts += 1;
                            s.cold_start_s += cold;
                            secs += cold;
                        }
                    }
                    if let Some(v) = violation {
                        self.violation(v);
                    }
                    if let Some(m) = self.meters.get_mut(pool as usize) {
                        m.add(now, 1.0);
                    }
                    self.set_loc(stage, Loc::Serverless(pool));
                } else {
                    self.cpu_take(pool, millicpus);
                    self.set_loc(stage, Loc::Cpu(pool, millicpus));
                }
                if let Some(l) = Some(self.ledger_mut(traj)) {
                    l.reward_s = latency;
                }
                self.push(
                    now.plus(Span::from_secs_f64(secs)),
                    Event::Done(stage, StageOutcome::Rewarded { score: 0.0 }),
                );
            }
        }
    }

    pub(super) fn release_loc(&mut self, loc: Loc) {
        let now = self.now;
        match loc {
            Loc::Cpu(pool, m) => self.cpu_release(pool, m),
            Loc::Serverless(pool) => {
                if let Some(s) = self.serverless.get_mut(&pool) {
                    s.in_use = s.in_use.saturating_sub(1);
                    s.idle.push(now);
                }
                if let Some(m) = self.meters.get_mut(pool as usize) {
                    m.add(now, -1.0);
                }
            }
            Loc::Engine(_) | Loc::Transfer(_) => {}
        }
    }
}
