//! Failures, losses and migrations: a replica taken away, part of a pool lost for good, a
//! migration run wave by wave, and the next injected failure drawn.

use super::*;

impl<'a> Sim<'a> {
    /// Takes replica `r` away: its engine forgets everything, its stages are gone, and the core
    /// is told (it reschedules the work).
    pub(super) fn lose_replica(&mut self, r: usize) {
        let now = self.now;
        self.engine_alive[r] = false;
        self.engines[r].wipe(now);
        self.engine_scheduled[r] = None;
        self.engines[r].version = None;
        self.engine_running[r] = 0;
        let lost: Vec<StageId> = self
            .stages
            .iter()
            .filter(|(_, s)| {
                matches!(s.loc, Some(Loc::Engine(x) | Loc::Transfer(x)) if x as usize == r)
            })
            .map(|(s, _)| StageId(s))
            .collect();
        for s in lost {
            self.stages.remove(s.0);
        }
        self.refresh_engine(r);
        self.input(Input::ReplicaLost {
            replica: ReplicaId(r as u64),
        });
    }

    /// The pool loss of the options, if this publication is its step: the pool's serving
    /// replicas from the highest-numbered down, until they cover the lost share of its GPUs (a
    /// replica with any lost GPU is lost whole). They never come back (a replica down from an
    /// injected failure at that moment is skipped and does come back).
    pub(super) fn maybe_lose_pool(&mut self) {
        let Some(loss) = self.opts.pool_loss else {
            return;
        };
        if self.version != loss.at_step || self.loss.is_some() {
            return;
        }
        let count = self
            .spec
            .pools
            .get(loss.pool as usize)
            .and_then(|p| p.count)
            .unwrap_or(0)
            .max(0) as f64;
        let serving: Vec<(u32, u32, bool)> = (0..self.engines.len())
            .map(|r| {
                (
                    self.engine_pool[r],
                    self.engines[r].gpus,
                    self.engine_alive[r],
                )
            })
            .collect();
        let (replicas, gpus) = crate::loss::replicas_lost(&serving, &loss, count);
        let now = self.now;
        for &r in &replicas {
            // One event each: the core's answer to one loss (work moved to the survivors) is
            // carried out before it hears of the next, as a real driver's would be.
            self.push(now, Event::LoseReplica(r));
        }
        // The re-plan after the loss, once its replicas are gone.
        if self
            .opts
            .migration
            .as_ref()
            .is_some_and(|m| m.at_step == self.version)
        {
            self.push(now, Event::Migrate);
        }
        self.loss = Some(LossReport {
            at_s: self.now.as_secs_f64(),
            replicas,
            gpus,
        });
    }

    /// Starts the migration of the options: the pools grow, and the first wave begins.
    pub(super) fn start_migration(&mut self) {
        let Some(m) = self.opts.migration.as_ref() else {
            return;
        };
        if self.options_migration.is_some() {
            return;
        }
        // One migration at a time: a re-plan on drift under way finishes first.
        if self.active_migration.is_some() {
            let later = self.now.plus(Span::from_secs_f64(1.0));
            self.push(later, Event::Migrate);
            return;
        }
        for &(pool, gpus) in &m.added_gpus {
            *self.capacity.entry(pool).or_default() += gpus as f64;
        }
        let waves = m.waves.clone();
        self.options_migration = Some(self.begin_migration(waves));
    }

    /// Starts moving to a new placement by `waves`; returns the migration's index.
    pub(super) fn begin_migration(&mut self, waves: Vec<MigrationWave>) -> usize {
        self.migrations.push(MigrationReport {
            at_s: self.now.as_secs_f64(),
            waves_done: 0,
            started: 0,
            retired: 0,
            done_at_s: None,
            trainer_gpus: None,
        });
        let index = self.migrations.len() - 1;
        self.active_migration = Some(index);
        self.active_waves = waves;
        self.start_wave(0);
        index
    }

    /// The migration under way.
    pub(super) fn migration_report(&mut self) -> Option<&mut MigrationReport> {
        self.migrations.get_mut(self.active_migration?)
    }

    /// Starts wave `index` (or ends the migration if there is none): its replicas are added
    /// and its others retired; the wave waits for every one of them.
    fn start_wave(&mut self, index: usize) {
        let Some(wave) = self.active_waves.get(index).cloned() else {
            self.migration_wave = None;
            let now = self.now.as_secs_f64();
            if let Some(report) = self.migration_report() {
                report.done_at_s = Some(now);
            }
            self.active_migration = None;
            return;
        };
        let mut waiting = BTreeSet::new();
        for rc in &wave.start {
            let r = self.engines.len();
            let peaks = self
                .pool_peaks
                .get(&rc.pool)
                .copied()
                .unwrap_or((1e15, 1e12));
            self.engines
                .push(engine_for(rc, peaks, &self.opts.hardware, self.costs));
            self.engines[r].version = None;
            // A replica started on a slowed pool is as slow as the rest of it.
            if let Some(slow) = self
                .opts
                .slowdown
                .filter(|s| s.pool == rc.pool && self.version >= s.at_step)
            {
                let now = self.now;
                self.engines[r].slow_down(now, slow.share);
            }
            self.engine_pool.push(rc.pool);
            let name = pool_name_index(&mut self.pool_names, self.spec, rc.pool);
            self.engine_pool_name.push(name);
            self.engine_max_seqs.push(rc.max_seqs);
            self.engine_running.push(0);
            self.engine_scheduled.push(None);
            self.engine_busy.push(false);
            self.engine_alive.push(true);
            self.engine_role.push(rc.role);
            self.engine_retiring.push(false);
            waiting.insert(r as u32);
            if let Some(report) = self.migration_report() {
                report.started += 1;
            }
            self.input(Input::ReplicaAdded { config: rc.clone() });
        }
        for group in &wave.stop {
            let mut left = group.replicas;
            for r in (0..self.engines.len()).rev() {
                if left == 0 {
                    break;
                }
                let fits = self.engine_pool[r] == group.pool
                    && self.engine_role[r] == group.role
                    && self.engines[r].gpus == group.gpus;
                if !fits || self.engine_retiring[r] || waiting.contains(&(r as u32)) {
                    continue;
                }
                // A replica down from an injected failure comes back: retire a live one.
                if !self.engine_alive[r] {
                    continue;
                }
                self.engine_retiring[r] = true;
                waiting.insert(r as u32);
                left -= 1;
                self.input(Input::RetireReplica {
                    replica: ReplicaId(r as u64),
                });
            }
        }
        self.migration_wave = Some((index, waiting));
        // A wave with nothing to wait for ends at once.
        self.migration_progress(u32::MAX);
    }

    /// Replica `r` loaded its weights or was handed back: the wave may be over.
    pub(super) fn migration_progress(&mut self, r: u32) {
        let Some((index, waiting)) = self.migration_wave.as_mut() else {
            return;
        };
        waiting.remove(&r);
        if waiting.is_empty() {
            let next = *index + 1;
            let resize = self.active_waves.get(*index).and_then(|w| w.trainer_gpus);
            if let Some(gpus) = resize {
                // Its GPUs change hands between training batches: the one running (if any)
                // finishes on the GPUs it started on.
                self.trainer_gpus = f64::from(gpus.max(1));
            }
            if let Some(report) = self.migration_report() {
                report.waves_done = next;
                if resize.is_some() {
                    report.trainer_gpus = resize;
                }
            }
            self.start_wave(next);
        }
    }

    pub(super) fn schedule_failure(&mut self) {
        if let Some(mtbf) = self.opts.failure_mtbf_s.filter(|m| *m > 0.0) {
            let u = self.failure_rng.next_f64().max(1e-12);
            let at = self.now.plus(Span::from_secs_f64(-u.ln() * mtbf));
            self.push(at, Event::Fail);
        }
    }
}
