//! The simulated replicas' engines and the CPU and serverless pools: the engines' measured
//! durations turned into profiles, their wake-ups and busy meters, the vCPUs in use, and the
//! start of a generation on a replica.

use super::*;

impl<'a> Sim<'a> {
    /// Moves the engine's measured durations into the estimates of its pool (the profile
    /// store is built from them at the end, see [`Sim::profiles`]).
    pub(super) fn drain_samples(&mut self, r: usize) {
        let e = &mut self.engines[r];
        if e.measured.is_empty() {
            return;
        }
        let name = self.engine_pool_name[r];
        for m in e.measured.drain(..) {
            // Created by the first usable sample, as `ProfileStore::record` does.
            if !(m.seconds.is_finite() && m.seconds > 0.0) {
                continue;
            }
            let at = name * WorkKind::ALL.len() + m.kind as usize;
            if self.estimate_index.len() <= at {
                self.estimate_index.resize(at + 1, u32::MAX);
            }
            let i = match self.estimate_index[at] {
                u32::MAX => {
                    self.estimates.push((m.kind, name, Estimate::default()));
                    self.estimate_index[at] = (self.estimates.len() - 1) as u32;
                    self.estimates.len() - 1
                }
                i => i as usize,
            };
            self.estimates[i].2.add_measured(
                m.kind,
                m.work,
                e.peak_flops,
                e.peak_bandwidth,
                m.seconds,
                // The simulator's durations are its own roofline's.
                Origin::Modelled,
            );
        }
    }

    /// The measured durations of environment steps and rewards, by task and reward function.
    fn timed_profiles(&self, store: &mut ProfileStore) {
        let named = |estimates: &[Estimate], names: Vec<&String>| {
            names
                .into_iter()
                .zip(estimates)
                .filter(|(_, e)| e.total > 0)
                .map(|(n, e)| (n.clone(), e.clone()))
                .collect()
        };
        let tasks = self.spec.tasks.iter().map(|t| &t.name).collect();
        store.environment_steps = named(&self.env_step_estimates, tasks);
        let rewards = self.spec.rewards.iter().map(|r| &r.name).collect();
        store.rewards = named(&self.reward_estimates, rewards);
    }

    /// The measured profiles so far (the estimates stay).
    pub(super) fn profiles_now(&self) -> ProfileStore {
        let mut store = ProfileStore::default();
        self.timed_profiles(&mut store);
        for (kind, name, estimate) in &self.estimates {
            let pool = self.pool_names.get(*name).map_or("", String::as_str);
            store
                .measured
                .entry(*kind)
                .or_default()
                .insert(pool.to_owned(), estimate.clone());
        }
        store
    }

    /// The measured profiles, by work kind and pool name: what `ProfileStore::record` of every
    /// sample in turn would have built (the samples of a kind and pool reach one estimate in the
    /// same order).
    pub(super) fn profiles(&mut self) -> ProfileStore {
        let mut store = ProfileStore::default();
        self.timed_profiles(&mut store);
        self.estimate_index.clear();
        for (kind, name, estimate) in self.estimates.drain(..) {
            let pool = self.pool_names.get(name).map_or("", String::as_str);
            store
                .measured
                .entry(kind)
                .or_default()
                .insert(pool.to_owned(), estimate);
        }
        store
    }

    pub(super) fn refresh_engine(&mut self, r: usize) {
        self.drain_samples(r);
        let busy = self.engines[r].busy();
        if busy != self.engine_busy[r] {
            self.engine_busy[r] = busy;
            let gpus = self.engines[r].gpus as f64;
            let now = self.now;
            if let Some(m) = self.meters.get_mut(self.engine_pool[r] as usize) {
                m.add(now, if busy { gpus } else { -gpus });
            }
        }
        // At most one live wake-up per engine, the earliest needed: a later one is pushed when
        // the earlier one fires, so superseded wake-ups do not pile up in the event queue.
        let next = self.engines[r].next_wake();
        let push = match (next, self.engine_scheduled[r]) {
            (Some(n), Some(s)) => n < s,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if push && let Some(at) = next {
            self.engine_scheduled[r] = next;
            let epoch = self.engines[r].epoch;
            self.push(at.max(self.now), Event::Wake(r as u32, epoch));
        }
    }

    pub(super) fn cpu_take(&mut self, pool: u32, millicpus: u64) {
        let p = pool as usize;
        if self.cpu_in_use.len() <= p {
            self.cpu_in_use.resize(p + 1, 0);
        }
        self.cpu_in_use[p] += millicpus;
        let used = self.cpu_in_use[p];
        let cap = self.capacity.get(&pool).copied().unwrap_or(0.0);
        if used as f64 > cap * 1000.0 + 0.5 {
            self.violation(format!(
                "CPU pool {pool}: {used} millicpus in use > {cap} vCPUs"
            ));
        }
        let now = self.now;
        if let Some(m) = self.meters.get_mut(pool as usize) {
            m.add(now, millicpus as f64 / 1000.0);
        }
    }

    pub(super) fn cpu_release(&mut self, pool: u32, millicpus: u64) {
        if let Some(used) = self.cpu_in_use.get_mut(pool as usize) {
            *used = used.saturating_sub(millicpus);
        }
        let now = self.now;
        if let Some(m) = self.meters.get_mut(pool as usize) {
            m.add(now, -(millicpus as f64) / 1000.0);
        }
    }

    pub(super) fn serverless_cold_start(&self, pool: u32) -> f64 {
        self.cold_start_s.get(&pool).copied().unwrap_or(0.25)
    }

    pub(super) fn engine_ok(&mut self, r: usize, stage: StageId) -> bool {
        if r >= self.engines.len() {
            self.violation(format!("stage {} sent to unknown replica {r}", stage.0));
            return false;
        }
        if !self.engine_alive[r] || self.engines[r].version.is_none() {
            self.violation(format!(
                "stage {} sent to replica {r}, which cannot serve",
                stage.0
            ));
        }
        true
    }

    pub(super) fn check_slots(&mut self, r: usize) {
        if self.engine_running[r] > self.engine_max_seqs[r] {
            self.violation(format!("replica {r}: more stages than batch slots"));
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_generation(
        &mut self,
        r: usize,
        stage: StageId,
        traj: TrajId,
        cached: u64,
        prefill: u64,
        action: u64,
        pulled: bool,
    ) {
        let now = self.now;
        let version = self.engines[r].version.unwrap_or(0);
        // A pulled KV cache was computed by the prefill replica's version.
        let prefilled = self.prefill_versions.remove(&traj);
        let v = if pulled {
            prefilled.map_or(version, |p| p.min(version))
        } else {
            version
        };
        if let Some(s) = self.stages.get_mut(stage.0) {
            s.info.version = v;
        }
        if prefill > 0 {
            self.engines[r].add_prefill(
                now,
                PrefillJob {
                    stage,
                    traj,
                    cached,
                    tokens: prefill,
                    decode: Some(action),
                },
            );
        } else {
            self.engines[r].add_decode(now, stage, cached, action);
        }
        self.refresh_engine(r);
    }
}
