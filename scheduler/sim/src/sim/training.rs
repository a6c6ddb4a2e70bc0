//! Training and publication: a batch checked against the simulator's own books and trained,
//! and what happens as a version is published (a slowdown, a re-plan on drift).

use super::*;

impl<'a> Sim<'a> {
    pub(super) fn train(
        &mut self,
        batch: BatchId,
        publishes: bool,
        trajectories: Vec<TrajId>,
        tokens: u64,
    ) {
        // Independent checks: no trajectory twice, whole groups, staleness by our own books.
        let floor = self
            .version
            .saturating_sub(self.core.config().policy.max_staleness);
        let mut groups: BTreeMap<u64, u32> = BTreeMap::new();
        let costs = self.costs;
        let mut violations = Vec::new();
        // Causal attention over each trained trajectory's whole context, forward and backward.
        let mut attention_flops = 0.0;
        for &t in &trajectories {
            let Some(l) = self.ledger.get_mut(t.0 as usize) else {
                violations.push(format!("trajectory {} trained but never run", t.0));
                continue;
            };
            attention_flops += rollfleet_spec::train_attention_flops(
                costs.attention_flops_per_context,
                l.context_end as f64,
            );
            if l.consumed {
                violations.push(format!("trajectory {} trained twice", t.0));
            }
            l.consumed = true;
            *groups.entry(l.group).or_default() += 1;
            let oldest = l.turns.iter().map(|w| w.version).min();
            match oldest {
                Some(v) if v < floor => violations.push(format!(
                    "trajectory {} trained with a turn of version {v} at version {}",
                    t.0, self.version
                )),
                None => violations.push(format!("trajectory {} trained with no turns", t.0)),
                _ => {}
            }
            let staleness = oldest.map_or(0, |v| self.version.saturating_sub(v)) as usize;
            if self.staleness.len() <= staleness {
                self.staleness.resize(staleness + 1, 0);
            }
            self.staleness[staleness] += 1;
            // Useful work, for the bound.
            self.work.add_trajectory(
                self.spec,
                &costs,
                &self.rates,
                self.version as usize,
                l,
                &mut self.traces,
            );
        }
        let n = self.core.config().group_size;
        for (g, count) in groups {
            if count != n {
                violations.push(format!(
                    "group {g} trained with {count} of {n} trajectories"
                ));
            }
        }
        for v in violations {
            self.violation(v);
        }
        self.trajectories += trajectories.len() as u64;
        self.trained_tokens += tokens;
        let mfu = self.spec.rl.train_mfu.clamp(0.01, 1.0);
        let secs = (6.0 * self.spec.model.active() * tokens as f64 + attention_flops)
            / (self.trainer_gpus * self.train_peak * mfu);
        self.train_batch_s.push(secs);
        let now = self.now;
        let gpus = self.trainer_gpus;
        self.training_gpus = gpus;
        if let Some(m) = self.meters.get_mut(self.trainer_pool as usize) {
            m.add(now, gpus);
        }
        self.push(
            now.plus(Span::from_secs_f64(secs)),
            Event::TrainDone(batch, publishes),
        );
    }

    /// At a publication: slows the pool down if this is its step, and re-plans if a measured
    /// profile drifted (while no migration is under way).
    pub(super) fn on_publish(&mut self) {
        let now = self.now;
        if let Some(slow) = self.opts.slowdown.filter(|s| s.at_step == self.version) {
            for r in 0..self.engines.len() {
                if self.engine_pool[r] == slow.pool {
                    self.engines[r].slow_down(now, slow.share);
                    self.refresh_engine(r);
                }
            }
        }
        if self.active_migration.is_some() {
            return;
        }
        let Some(mut watch) = self.drift.take() else {
            return;
        };
        for r in 0..self.engines.len() {
            self.drain_samples(r);
        }
        let profiles = self.profiles_now();
        let checked = watch.check(
            self.spec,
            self.catalog,
            &profiles,
            self.version,
            now.as_secs_f64(),
        );
        let replan = watch.replans.len().saturating_sub(1);
        self.drift = Some(watch);
        for (pool, kinds) in &checked.forget {
            for (kind, name, estimate) in &mut self.estimates {
                if kinds.contains(kind) && self.pool_names.get(*name) == Some(pool) {
                    estimate.restart();
                }
            }
        }
        if let Some(waves) = checked.waves.filter(|w| !w.is_empty()) {
            let index = self.begin_migration(waves);
            self.drift_migrations.push((replan, index));
        }
    }
}
