//! The simulation's events handled: engine wake-ups, finished and failed stages, KV caches
//! arriving, training and weight loads finishing, failures and recoveries, each turned into the
//! core's input.

use super::*;

impl<'a> Sim<'a> {
    pub(super) fn handle(&mut self, event: Event) {
        match event {
            Event::Wake(r, epoch) => {
                let r = r as usize;
                if self.engines[r].epoch != epoch || self.engine_scheduled[r] != Some(self.now) {
                    return;
                }
                self.engine_scheduled[r] = None;
                if self.engines[r].next_wake().is_none_or(|n| n > self.now) {
                    // Woken early (its work moved later): just ask again for the right time.
                    self.refresh_engine(r);
                    return;
                }
                // One buffer for every wake-up, instead of a fresh vector each time.
                let mut done = std::mem::take(&mut self.done);
                self.engines[r].wake_into(self.now, &mut done);
                self.refresh_engine(r);
                for d in done.drain(..) {
                    let (stage, outcome) = match d {
                        EngineDone::Prefilled(stage) => {
                            if let Some(info) = self.stages.get(stage.0).map(|s| s.info) {
                                let v = self.engines[r].version.unwrap_or(0);
                                self.prefill_versions.insert(info.traj, v);
                            }
                            (stage, StageOutcome::Prefilled)
                        }
                        EngineDone::Generated(stage, tokens) => {
                            if let Some(info) = self
                                .stages
                                .get(stage.0)
                                .filter(|s| s.loc.is_some())
                                .map(|s| s.info)
                            {
                                let l = self.ledger_mut(info.traj);
                                let k = info.turn as usize;
                                l.truncate_turns(k);
                                // Each turn's context is the one before it plus what it added;
                                // a resumed turn is as old as its oldest part.
                                let context_before = l.context_end;
                                let input = l.input(k);
                                let (version, action) = match l.partial.take() {
                                    Some(p) if p.turn == info.turn && p.attempt == info.attempt => {
                                        (p.version.min(info.version), p.tokens + tokens)
                                    }
                                    _ => (info.version, tokens),
                                };
                                l.push_turn(TurnWork {
                                    version,
                                    context_before,
                                    input,
                                    action,
                                    env_cpu_s: 0.0,
                                    env_s: 0.0,
                                });
                            }
                            (stage, StageOutcome::Generated { tokens })
                        }
                    };
                    if self.end_stage(stage).is_some() {
                        self.engine_running[r] = self.engine_running[r].saturating_sub(1);
                        self.input(Input::StageFinished { stage, outcome });
                    }
                }
                self.done = done;
            }
            Event::Done(stage, outcome) => {
                let Some((loc, _)) = self.end_stage(stage) else {
                    return;
                };
                self.release_loc(loc);
                self.input(Input::StageFinished { stage, outcome });
            }
            Event::Failed(stage) => {
                let Some((loc, _)) = self.end_stage(stage) else {
                    return;
                };
                self.release_loc(loc);
                self.input(Input::StageFailed { stage });
            }
            Event::KvArrived(arrival) => {
                let KvArrival {
                    replica,
                    epoch,
                    stage,
                    traj,
                    from,
                    context,
                    prefill,
                    action,
                } = *arrival;
                let r = replica as usize;
                if self.engines[r].epoch != epoch || !self.placed(stage) {
                    return;
                }
                if let Some(p) = self.engines.get_mut(from as usize) {
                    p.release_kv(traj);
                }
                self.set_loc(stage, Loc::Engine(replica));
                self.start_generation(r, stage, traj, context, prefill, action, true);
            }
            Event::TrainDone(batch, publishes) => {
                let now = self.now;
                let gpus = self.training_gpus;
                if let Some(m) = self.meters.get_mut(self.trainer_pool as usize) {
                    m.add(now, -gpus);
                }
                if publishes {
                    self.version += 1;
                    self.publish_times.push(now.as_secs_f64());
                }
                self.input(Input::TrainFinished { batch });
                if publishes {
                    self.on_publish();
                }
                // Its own event, so that the core's answer to the publication is carried out
                // before it hears of the loss, as with any other failure.
                if publishes
                    && self
                        .opts
                        .pool_loss
                        .is_some_and(|l| l.at_step == self.version)
                {
                    self.push(now, Event::LosePool);
                }
                // With a loss at the same step, the loss starts the migration once its replicas
                // are gone (`maybe_lose_pool`).
                let loss_now = self
                    .opts
                    .pool_loss
                    .is_some_and(|l| l.at_step == self.version);
                if publishes
                    && !loss_now
                    && self
                        .opts
                        .migration
                        .as_ref()
                        .is_some_and(|m| m.at_step == self.version)
                {
                    self.push(now, Event::Migrate);
                }
            }
            Event::WeightsDone(r, version, epoch) => {
                let ri = r as usize;
                if self.engines[ri].epoch != epoch || !self.engine_alive[ri] {
                    return;
                }
                self.engines[ri].version = Some(version);
                self.input(Input::WeightsUpdated {
                    replica: ReplicaId(r as u64),
                    version,
                });
                self.migration_progress(r);
            }
            Event::Fail => {
                let alive: Vec<usize> = (0..self.engines.len())
                    .filter(|&r| self.engine_alive[r])
                    .collect();
                if alive.len() > 1 {
                    let r = alive[self.failure_rng.below(alive.len() as u64) as usize];
                    let now = self.now;
                    self.lose_replica(r);
                    let back = now.plus(Span::from_secs_f64(self.opts.repair_s));
                    self.push(back, Event::Recover(r as u32));
                }
                self.schedule_failure();
            }
            Event::LosePool => self.maybe_lose_pool(),
            Event::Migrate => self.start_migration(),
            Event::LoseReplica(r) => {
                if self.engine_alive[r as usize] {
                    self.lose_replica(r as usize);
                }
            }
            Event::Recover(r) => {
                // A replica retired while it was down stays gone (the core ignores its return).
                if self.engine_retiring[r as usize] {
                    return;
                }
                self.engine_alive[r as usize] = true;
                self.input(Input::ReplicaRecovered {
                    replica: ReplicaId(r as u64),
                });
            }
        }
    }
}
