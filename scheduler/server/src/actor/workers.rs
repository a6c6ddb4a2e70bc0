//! Workers: registration, leases and heartbeats, attaching work streams, load reports and GPU
//! telemetry, and a worker's end: leaving (released once it holds nothing), loss (every
//! booking undone) and being forgotten.

use super::*;

impl Actor {
    /// The worker a lease id (`w<N>-<secret>`) names, when its secret is that worker's: a lease
    /// id is a capability, so a peer cannot heartbeat or attach to another node's lease by
    /// guessing its number.
    pub(super) fn worker_number(&self, worker_id: &str) -> Option<u64> {
        let (number, secret) = worker_id.strip_prefix('w')?.split_once('-')?;
        let id = number.parse().ok()?;
        let w = self.workers.get(&id)?;
        let same = w.secret.len() == secret.len()
            && w.secret
                .bytes()
                .zip(secret.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
        same.then_some(id)
    }

    /// The refusal of a lease id that names a live lease (`w<N>`) without its secret: another
    /// node's lease, or a guess. It names the lease by its number only (never a secret).
    fn not_yours(&self, field: &str, worker_id: &str) -> Option<Status> {
        let number = worker_id.strip_prefix('w')?;
        let number = number.split_once('-').map_or(number, |(n, _)| n);
        let id: u64 = number.parse().ok()?;
        self.workers.get(&id).filter(|w| w.alive)?;
        Some(Status::permission_denied(format!(
            "{field}: lease w{id} is another worker's: the id does not carry its secret (a lease \
             is used only by the worker that registered for it; register for a lease of your own)"
        )))
    }

    pub(super) fn register(
        &mut self,
        inventory: HardwareInventory,
        secret: String,
    ) -> Result<RegisterResponse, Status> {
        if let Some(problem) = crate::inventory::check(&inventory) {
            return Err(Status::invalid_argument(problem));
        }
        let pools: Vec<&str> = self
            .plan
            .spec()
            .pools
            .iter()
            .map(|p| p.name.as_str())
            .collect();
        let pool = self.plan.pool_index(&inventory.pool).ok_or_else(|| {
            Status::invalid_argument(format!(
                "inventory.pool: job {} has no pool {} (pools: {})",
                self.plan.name(),
                crate::quoted(&inventory.pool),
                pools.join(", ")
            ))
        })?;
        let role = self.plan.pool_role(pool);
        // A worker with no device of its own registers to emulate whatever the pool needs.
        let matches = matches!(
            (&inventory.device, role),
            (None, Some(_))
                | (Some(Device::Gpu(_)), Some(PoolRole::Gpu))
                | (Some(Device::Cpu(_)), Some(PoolRole::Cpu))
                | (Some(Device::Serverless(_)), Some(PoolRole::Serverless))
        );
        if !matches {
            return Err(Status::invalid_argument(format!(
                "inventory.device: pool {} is a {:?} pool; the worker offers {}",
                crate::quoted(&inventory.pool),
                role,
                match inventory.device {
                    Some(Device::Gpu(_)) => "GPUs",
                    Some(Device::Cpu(_)) => "CPUs",
                    Some(Device::Serverless(_)) => "a serverless platform",
                    None => "nothing",
                }
            )));
        }
        if let Some(Device::Gpu(gpu)) = &inventory.device {
            let spec = &self.plan.spec().pools[pool as usize];
            let product = spec.gpu.as_deref().unwrap_or_default();
            if !gpu.product.is_empty() && !gpu.product.eq_ignore_ascii_case(product) {
                return Err(Status::invalid_argument(format!(
                    "inventory.gpu.product: pool {} is of {product} GPUs; the worker offers {}",
                    crate::quoted(&inventory.pool),
                    crate::quoted(&gpu.product)
                )));
            }
            let count = spec.count.unwrap_or(0).max(0) as u64;
            if u64::from(gpu.count) > count {
                return Err(Status::invalid_argument(format!(
                    "inventory.gpu.count: the worker offers {} GPUs; pool {} has {count}",
                    gpu.count,
                    crate::quoted(&inventory.pool)
                )));
            }
        }
        if self.ended.is_some() {
            return Err(Status::failed_precondition("the job has ended"));
        }
        let cap = self.worker_cap(pool);
        let held = self.workers.values().filter(|w| w.pool == pool).count();
        if held >= cap {
            return Err(Status::resource_exhausted(format!(
                "inventory.pool: pool {} already has {held} workers registered, at most {cap} \
                 (twice the pool's size, at least {MIN_WORKERS_PER_POOL}); a worker gone \
                 without a word frees its place when its lease expires",
                crate::quoted(&inventory.pool)
            )));
        }
        let id = self.next_worker;
        self.next_worker += 1;
        let ttl = self.opts.lease_ttl;
        self.workers.insert(
            id,
            Worker {
                name: format!("w{id} ({}@{})", inventory.pool, inventory.hostname),
                secret,
                host: inventory.hostname.clone(),
                pool,
                telemetry: inventory.gpu_telemetry.clone(),
                gpu_series: BTreeSet::new(),
                policy_input: PolicyInput::of_backend(&inventory.backend),
                lease_until: self.at + ttl,
                outbox: None,
                alive: true,
                assignments: BTreeSet::new(),
                cancelled: BTreeSet::new(),
                replicas: BTreeSet::new(),
                gpus: match &inventory.device {
                    Some(Device::Gpu(g)) => g.count,
                    _ => 0,
                },
                leaving: false,
                load_limit: LoadLimit::new(self.at),
                identity: None,
            },
        );
        self.metrics.workers_registered.inc();
        let input = (pool, PolicyInput::of_backend(&inventory.backend));
        if !self.pool_inputs.contains(&input) {
            self.pool_inputs.push(input);
        }
        match &inventory.gpu_telemetry {
            Some(t) if t.available => {
                for d in &t.devices {
                    let gpu = d.index.to_string();
                    let worker = format!("w{id}");
                    let labels = [
                        self.plan.pool_name(pool),
                        &worker,
                        &inventory.hostname,
                        &gpu,
                    ];
                    self.metrics
                        .gpu_memory_total
                        .with_label_values(&labels)
                        .set(d.memory_bytes as f64);
                    self.metrics
                        .gpu_info
                        .with_label_values(&[
                            labels[0], labels[1], labels[2], labels[3], &d.name, &d.uuid,
                        ])
                        .set(1.0);
                }
            }
            Some(t) if role == Some(PoolRole::Gpu) => log!(
                self,
                "scheduler: worker w{id} ({}@{}) has no GPU telemetry: {}",
                inventory.pool,
                inventory.hostname,
                t.unavailable_reason
            ),
            _ => {}
        }
        self.update_worker_gauges();
        Ok(RegisterResponse {
            lease: Some(self.lease(id)),
            job_yaml: self.plan.yaml.clone(),
            time_scale: self.opts.time_scale,
        })
    }

    fn lease(&self, id: u64) -> Lease {
        let ttl = self.opts.lease_ttl.as_millis() as u64;
        let secret = self.workers.get(&id).map_or("", |w| w.secret.as_str());
        Lease {
            worker_id: format!("w{id}-{secret}"),
            ttl_ms: ttl,
            heartbeat_interval_ms: (ttl / 4).max(1),
            epoch: 1,
        }
    }

    /// A worker's heartbeat, heard at `heard_at` on the job's clock: it renews the lease from
    /// then, unless the lease had run out by then.
    pub(super) fn heartbeat(
        &mut self,
        worker_id: &str,
        epoch: u64,
        load: Option<WorkerLoad>,
        heard_at: Duration,
    ) -> Result<HeartbeatResponse, Status> {
        let ttl = self.opts.lease_ttl;
        let id = self.worker_number(worker_id);
        // A lease that ran out is not renewed, even if the periodic check has not seen it yet.
        if let Some(id) = id
            && self
                .workers
                .get(&id)
                .is_some_and(|w| w.alive && w.lease_until < heard_at)
        {
            self.cut_off(id, &format!("lease expired: no heartbeat within {ttl:?}"));
            self.pump();
        }
        match id.and_then(|id| self.workers.get_mut(&id).map(|w| (id, w))) {
            Some((id, w)) if w.alive && epoch == 1 => {
                // A heartbeat the actor gets to late never shortens a lease a later one set.
                w.lease_until = w.lease_until.max(heard_at + ttl);
                if let Some(load) = load
                    && let Err(reason) = self.load_report(id, &load)
                {
                    self.cut_off(id, &reason);
                    self.pump();
                    return Err(Status::invalid_argument(reason));
                }
                Ok(HeartbeatResponse {
                    lease: Some(self.lease(id)),
                    drain: self.ended.is_some(),
                })
            }
            _ => Err(id
                .is_none()
                .then(|| self.not_yours("worker_id", worker_id))
                .flatten()
                .unwrap_or_else(|| {
                    Status::not_found(format!(
                        "worker_id: {} (epoch {epoch}) holds no lease (expired, cut off, or \
                         never registered); register again",
                        crate::quoted(worker_id)
                    ))
                })),
        }
    }

    pub(super) fn attach(
        &mut self,
        worker_id: &str,
        epoch: u64,
        outbox: Sink,
    ) -> Result<u64, Status> {
        let id = self
            .worker_number(worker_id)
            .filter(|id| self.workers.get(id).is_some_and(|w| w.alive))
            .ok_or_else(|| {
                self.not_yours("hello.worker_id", worker_id)
                    .unwrap_or_else(|| {
                        Status::not_found(format!(
                            "hello.worker_id: {} holds no lease; register first",
                            crate::quoted(worker_id)
                        ))
                    })
            })?;
        if epoch != 1 {
            return Err(Status::failed_precondition(format!(
                "hello.epoch: {epoch} is not the lease's epoch 1"
            )));
        }
        let Some(w) = self.workers.get_mut(&id) else {
            return Err(Status::internal("worker vanished"));
        };
        if w.outbox.is_some() {
            return Err(Status::already_exists(format!(
                "worker {worker_id} already has a work stream"
            )));
        }
        w.outbox = Some(outbox);
        let pool = w.pool;
        log!(
            self,
            "scheduler: worker {} attached its work stream",
            w.name
        );
        self.update_worker_gauges();
        if self.started.is_some() {
            let name = self
                .workers
                .get(&id)
                .map_or_else(String::new, |w| w.name.clone());
            self.pool_changed(pool, &format!("worker {name} joined"));
            self.flush_pending(pool);
        }
        Ok(id)
    }

    pub(super) fn attached(&self, pool: u32) -> impl Iterator<Item = (u64, &Worker)> {
        self.workers
            .iter()
            .filter(move |(_, w)| w.alive && w.outbox.is_some() && !w.leaving && w.pool == pool)
            .map(|(&id, w)| (id, w))
    }

    pub(super) fn maybe_start(&mut self) {
        if self.started.is_some() || self.ended.is_some() {
            return;
        }
        let attached = self
            .workers
            .values()
            .filter(|w| w.alive && w.outbox.is_some())
            .count();
        if attached < self.opts.expect_workers {
            return;
        }
        let missing: Vec<&str> = self
            .plan
            .pools_needed()
            .into_iter()
            .filter(|&p| self.attached(p).next().is_none())
            .map(|p| self.plan.pool_name(p))
            .collect();
        if !missing.is_empty() {
            log!(
                self,
                "scheduler: {} attached; waiting for pools {}",
                crate::counted(attached, "worker", "workers"),
                missing.join(", ")
            );
            return;
        }
        for pool in 0..self.plan.spec().pools.len() as u32 {
            if self.plan.pool_role(pool) != Some(PoolRole::Gpu) {
                continue;
            }
            let count = self.pool_gpus(pool);
            // Workers that did not declare their GPUs share what those that did left.
            let (declared, silent) =
                self.attached(pool)
                    .fold((0u32, 0u32), |(gpus, silent), (_, w)| match w.gpus {
                        0 => (gpus, silent + 1),
                        n => (gpus.saturating_add(n), silent),
                    });
            let left = count.saturating_sub(declared);
            self.gpu_share
                .insert(pool, left.div_ceil(silent.max(1)).max(1));
            self.planned_gpus.insert(pool, count);
        }
        // Each replica goes to the worker of its pool with the most GPUs free, so nodes of
        // different sizes get replicas in proportion (round-robin gave a 2-GPU node as many as
        // an 8-GPU one). When the nodes declare fewer GPUs than the plan uses, the last ones
        // go where the shortfall is least, and the re-plan for the GPUs present follows.
        for r in 0..self.owner.len() {
            let pool = self.replicas[r].pool;
            let Some(id) = self.roomiest_worker(pool, 0) else {
                continue;
            };
            if self.workers.get(&id).map(|w| self.free_gpus(w)) < Some(self.replicas[r].gpus) {
                log!(
                    self,
                    "scheduler: pool {}: no worker has {} GPUs free for replica {r}; it goes to \
                     worker w{id}, which has the most",
                    self.plan.pool_name(pool),
                    self.replicas[r].gpus
                );
            }
            self.owner[r] = Some(id);
            if let Some(w) = self.workers.get_mut(&id) {
                w.replicas.insert(r as u64);
            }
        }
        for w in self
            .workers
            .values()
            .filter(|w| w.alive && !w.replicas.is_empty())
        {
            let gpus = self.worker_gpus(w);
            log!(
                self,
                "scheduler: worker {}, with {gpus} GPUs{}, serves {} replica{} of pool {} on {} GPUs",
                w.name,
                if w.gpus > 0 { "" } else { ", its share" },
                w.replicas.len(),
                if w.replicas.len() == 1 { "" } else { "s" },
                self.plan.pool_name(w.pool),
                self.used_gpus(w)
            );
        }
        self.started = Some(self.at);
        log!(
            self,
            "scheduler: job {} starts with {} ({}, time scale {})",
            self.plan.name(),
            crate::counted(attached, "worker", "workers"),
            crate::counted(self.owner.len(), "replica", "replicas"),
            self.opts.time_scale
        );
        self.core.handle_timeout(Time::ZERO);
    }

    /// A worker said it is leaving (its node is drained, preempted or scaled down): from now on
    /// it gets no new work, its replicas are retired (the core lets the stages running on them
    /// finish and places nothing new there), the pool is planned again for the GPUs left, so that
    /// the others start replicas where they have room, and the worker is released once it holds
    /// nothing. What it runs is neither lost nor redone; if it goes before it is released, it is
    /// lost as any worker is.
    pub(super) fn worker_leaving(&mut self, worker: u64, reason: &str) {
        let Some(w) = self.workers.get_mut(&worker) else {
            return;
        };
        // After the end every worker was told to drain: a node going then changes nothing.
        if !w.alive || w.leaving || self.ended.is_some() {
            return;
        }
        w.leaving = true;
        let (name, pool) = (w.name.clone(), w.pool);
        let replicas: Vec<u64> = w.replicas.iter().copied().collect();
        self.leaving.insert(worker);
        let reason = if reason.is_empty() {
            "no reason given"
        } else {
            reason
        };
        log!(
            self,
            "scheduler: worker {name} is leaving ({reason}): it gets nothing new, and is released \
             once what it runs is done"
        );
        self.update_worker_gauges();
        if self.started.is_none() {
            self.release_leavers();
            return;
        }
        if self.replanner.is_none() && !replicas.is_empty() {
            // With no planner to start its replicas elsewhere, retiring them would shrink the
            // pool for good: they stay, and move as a lost worker's do when it goes.
            log!(
                self,
                "scheduler: no planner for this job: the replicas of worker {name} move to the \
                 pool's other workers when it goes"
            );
            self.pump();
            return;
        }
        let mut retiring = 0;
        for r in replicas {
            if self.in_service(r as usize) {
                retiring += 1;
                self.retiring.insert(r);
                self.deferred.push_back(Input::RetireReplica {
                    replica: ReplicaId(r),
                });
            }
        }
        if self.plan.pool_role(pool) == Some(PoolRole::Gpu) && self.replanner.is_some() {
            let present = self.gpus_present(pool);
            let planned = self.planned_gpus.get(&pool).copied();
            self.replan(
                pool,
                present,
                &format!("worker {name} is leaving"),
                retiring,
            );
            // Nothing fitted the GPUs left: the next node to join is planned for afresh.
            if self.planned_gpus.get(&pool).copied() == planned {
                self.planned_gpus.insert(pool, present);
            }
        }
        self.pump();
    }

    /// Releases every leaving worker that holds nothing any more: it is told to drain, and goes
    /// as a worker does at the job's end (not lost).
    pub(super) fn release_leavers(&mut self) {
        if self.leaving.is_empty() {
            return;
        }
        let done: Vec<u64> = self
            .leaving
            .iter()
            .copied()
            .filter(|id| {
                self.workers
                    .get(id)
                    .is_none_or(|w| !w.alive || (w.assignments.is_empty() && w.replicas.is_empty()))
            })
            .collect();
        for id in done {
            self.leaving.remove(&id);
            let Some(w) = self.workers.get_mut(&id) else {
                continue;
            };
            if !w.alive {
                continue;
            }
            w.alive = false;
            let name = w.name.clone();
            if let Some(outbox) = w.outbox.take() {
                outbox.send(Ok(SchedulerMessage {
                    message: Some(scheduler_message::Message::Drain(true)),
                }));
            }
            self.forget_gpus(id);
            self.update_worker_gauges();
            self.forget(id);
            listed(&mut self.left, &mut self.left_total, name.clone());
            self.metrics.workers_left.inc();
            log!(
                self,
                "scheduler: worker {name} left: released, nothing of it lost"
            );
        }
    }

    /// A worker's load report: its GPU readings and its replicas' profile samples.
    pub(super) fn load_report(&mut self, worker: u64, load: &WorkerLoad) -> Result<(), String> {
        self.gpu_readings(worker, load)?;
        self.profile_samples(worker, load)
    }

    /// Records the samples of a load report in the online profiles, under the worker's pool.
    /// Checked whole before any is kept: a report with one bad sample adds nothing.
    fn profile_samples(&mut self, worker: u64, load: &WorkerLoad) -> Result<(), String> {
        use rollfleet_planner::roofline::{Work, WorkKind};
        use rollfleet_proto::v1::ProfileKind;
        if load.samples.is_empty() {
            return Ok(());
        }
        let Some(w) = self.workers.get(&worker).filter(|w| w.alive) else {
            return Ok(());
        };
        let pool = w.pool;
        if load.samples.len() > crate::MAX_PROFILE_SAMPLES_PER_REPORT {
            return Err(format!(
                "load.samples: {} samples in one report (at most {})",
                load.samples.len(),
                crate::MAX_PROFILE_SAMPLES_PER_REPORT
            ));
        }
        if self.plan.pool_role(pool) != Some(PoolRole::Gpu) {
            return Err(format!(
                "load.samples: profile samples from a worker of pool \"{}\", which has no GPUs",
                self.plan.pool_name(pool)
            ));
        }
        let mut checked = Vec::with_capacity(load.samples.len());
        for (i, s) in load.samples.iter().enumerate() {
            let kind = match s.kind() {
                ProfileKind::Prefill => WorkKind::Prefill,
                ProfileKind::Decode => WorkKind::Decode,
                ProfileKind::Unspecified => {
                    return Err(format!("load.samples[{i}].kind: unspecified"));
                }
            };
            let sane = |x: f64| x.is_finite() && x >= 0.0;
            if !(sane(s.flops) && sane(s.bytes) && sane(s.seconds) && s.seconds > 0.0) {
                return Err(format!(
                    "load.samples[{i}]: flops {}, bytes {}, seconds {}: not finite and \
                     non-negative with a positive duration",
                    s.flops, s.bytes, s.seconds
                ));
            }
            if s.gpus == 0 || s.gpus > 1024 {
                return Err(format!(
                    "load.samples[{i}].gpus: {} is not in 1..=1024",
                    s.gpus
                ));
            }
            checked.push((kind, s));
        }
        let (peak_flops, peak_bandwidth) = self.plan.gpu_peaks(pool);
        let name = self.plan.pool_name(pool).to_owned();
        for (kind, s) in checked {
            let gpus = f64::from(s.gpus);
            self.profiles.record(
                kind,
                &name,
                Work {
                    flops: s.flops,
                    bytes: s.bytes,
                },
                gpus * peak_flops,
                gpus * peak_bandwidth,
                s.seconds,
                if s.emulated {
                    rollfleet_planner::profile::Origin::Modelled
                } else {
                    rollfleet_planner::profile::Origin::Hardware
                },
            );
            self.profile_samples += 1;
        }
        Ok(())
    }

    /// Exports a worker's GPU readings. Readings from a worker that registered without GPU
    /// telemetry (they could only be made up), for a GPU it did not declare, or with a
    /// utilisation outside 0..1 are a protocol violation: the reason is returned.
    fn gpu_readings(&mut self, worker: u64, load: &WorkerLoad) -> Result<(), String> {
        if let Some(problem) = self.gpu_readings_problem(worker, load) {
            return Err(problem);
        }
        // A reading still in flight from a worker already gone adds nothing back.
        let Some(w) = self.workers.get(&worker).filter(|w| w.alive) else {
            return Ok(());
        };
        let any = !load.gpus.is_empty()
            || load.gpu_utilization.is_some()
            || load.gpu_memory_used_bytes.is_some();
        if !any && w.gpu_series.is_empty() {
            return Ok(());
        }
        let pool = self.plan.pool_name(w.pool).to_owned();
        let id = format!("w{worker}");
        let host = w.host.clone();
        let now: BTreeSet<u32> = load.gpus.iter().map(|r| r.index).collect();
        // A GPU left out of this reading (its reading failed) is not kept at its old value.
        for gone in w.gpu_series.difference(&now) {
            let gpu = gone.to_string();
            let labels = [pool.as_str(), &id, &host, &gpu];
            let _ = self.metrics.gpu_utilization.remove_label_values(&labels);
            let _ = self.metrics.gpu_memory_used.remove_label_values(&labels);
        }
        for r in &load.gpus {
            let gpu = r.index.to_string();
            let labels = [pool.as_str(), &id, &host, &gpu];
            self.metrics
                .gpu_utilization
                .with_label_values(&labels)
                .set(r.utilization);
            self.metrics
                .gpu_memory_used
                .with_label_values(&labels)
                .set(r.memory_used_bytes as f64);
        }
        if let Some(w) = self.workers.get_mut(&worker) {
            w.gpu_series = now;
        }
        Ok(())
    }

    /// Why a live worker's GPU readings are refused, if they are: more readings than the GPUs it
    /// registered (at most [`crate::inventory::MAX_GPUS_PER_NODE`]), readings after registering
    /// without telemetry, for a GPU it did not declare, or with a utilisation outside 0..1.
    /// `None` for a worker already gone (its readings are ignored).
    pub(super) fn gpu_readings_problem(&self, worker: u64, load: &WorkerLoad) -> Option<String> {
        let w = self.workers.get(&worker).filter(|w| w.alive)?;
        let any = !load.gpus.is_empty()
            || load.gpu_utilization.is_some()
            || load.gpu_memory_used_bytes.is_some();
        let declared: Option<BTreeSet<u32>> = match &w.telemetry {
            Some(t) if !t.available && any => {
                return Some(format!(
                    "load.gpus: sent GPU readings after registering without GPU telemetry ({})",
                    t.unavailable_reason
                ));
            }
            Some(t) => Some(t.devices.iter().map(|d| d.index).collect()),
            None => None,
        };
        let registered = match &declared {
            Some(d) => d.len(),
            None if w.gpus > 0 => w.gpus as usize,
            None => crate::inventory::MAX_GPUS_PER_NODE,
        }
        .min(crate::inventory::MAX_GPUS_PER_NODE);
        if load.gpus.len() > registered {
            return Some(format!(
                "load.gpus: {} readings in one report; at most one per GPU the worker \
                 registered ({registered})",
                load.gpus.len()
            ));
        }
        for (i, r) in load.gpus.iter().enumerate() {
            if !(r.utilization.is_finite() && (0.0..=1.0).contains(&r.utilization)) {
                return Some(format!(
                    "load.gpus[{i}].utilization: {} is not a share between 0 and 1",
                    r.utilization
                ));
            }
            if declared.as_ref().is_some_and(|d| !d.contains(&r.index)) {
                return Some(format!(
                    "load.gpus[{i}].index: GPU {} was not declared at registration",
                    r.index
                ));
            }
        }
        None
    }

    /// Takes a gone worker's GPU series out of the exposition.
    pub(super) fn forget_gpus(&mut self, worker: u64) {
        let Some(w) = self.workers.get_mut(&worker) else {
            return;
        };
        let pool = self.plan.pool_name(w.pool).to_owned();
        let id = format!("w{worker}");
        let mut gpus = std::mem::take(&mut w.gpu_series);
        if let Some(t) = w.telemetry.as_ref().filter(|t| t.available) {
            for d in &t.devices {
                gpus.insert(d.index);
                let gpu = d.index.to_string();
                let _ = self
                    .metrics
                    .gpu_info
                    .remove_label_values(&[&pool, &id, &w.host, &gpu, &d.name, &d.uuid]);
            }
        }
        for gpu in gpus {
            let gpu = gpu.to_string();
            let labels = [pool.as_str(), &id, &w.host, &gpu];
            let _ = self.metrics.gpu_utilization.remove_label_values(&labels);
            let _ = self.metrics.gpu_memory_used.remove_label_values(&labels);
            let _ = self.metrics.gpu_memory_total.remove_label_values(&labels);
        }
    }

    /// Cuts a worker off: closes its stream with the reason, and undoes every booking it held.
    pub(super) fn cut_off(&mut self, worker: u64, reason: &str) {
        self.lose_worker(worker, reason, true);
    }

    /// Undoes every booking of a lost worker; with `replan`, the pool is re-planned for the
    /// GPUs left when they differ from the plan's.
    pub(super) fn lose_worker(&mut self, worker: u64, reason: &str, replan: bool) {
        let Some(w) = self.workers.get_mut(&worker) else {
            return;
        };
        if !w.alive {
            return;
        }
        w.alive = false;
        let name = w.name.clone();
        log!(self, "scheduler: worker {name} is cut off: {reason}");
        listed(
            &mut self.lost,
            &mut self.lost_total,
            format!("{name}: {reason}"),
        );
        self.metrics.workers_lost.inc();
        if let Some(outbox) = w.outbox.take() {
            outbox.send(Err(Status::aborted(format!("cut off: {reason}"))));
        }
        self.forget_gpus(worker);
        let Some(w) = self.workers.get_mut(&worker) else {
            return;
        };
        let pool = w.pool;
        let held: Vec<u64> = std::mem::take(&mut w.assignments).into_iter().collect();
        let replicas: Vec<u64> = std::mem::take(&mut w.replicas).into_iter().collect();
        w.cancelled.clear();
        self.update_worker_gauges();
        for id in held {
            let Some(a) = self.assignments.remove(&id) else {
                continue;
            };
            self.unbook(&a);
            match a.what {
                What::Stage { stage, kind, .. } => {
                    self.by_stage.remove(&stage);
                    if !matches!(kind, StageKindOf::Prefill(_) | StageKindOf::Generate(_)) {
                        self.deferred.push_back(Input::StageFailed { stage });
                    }
                }
                What::Train(batch) => {
                    let id = self.new_assignment(a.pool, What::Train(batch), a.message);
                    self.dispatch_pooled(id);
                }
                What::Weights { .. } => {}
            }
        }
        for r in replicas {
            if self.owner.get(r as usize).copied().flatten() == Some(worker) {
                self.owner[r as usize] = None;
                self.deferred.push_back(Input::ReplicaLost {
                    replica: ReplicaId(r),
                });
            }
        }
        self.forget(worker);
        if self.started.is_some() && replan {
            self.pool_changed(pool, &format!("worker {name} was lost ({reason})"));
        }
    }

    /// How many workers `pool` may hold at once, live or not yet attached: twice its size
    /// (its `count` of GPUs or nodes, or a serverless pool's `concurrency`), so that every node may
    /// register again while its old lease runs out, and never fewer than
    /// [`MIN_WORKERS_PER_POOL`] or the workers the job waits for. Registrations past it are
    /// refused, so that a token holder registering again and again cannot grow the scheduler.
    pub(super) fn worker_cap(&self, pool: u32) -> usize {
        let size = self.plan.spec().pools.get(pool as usize).map_or(0, |p| {
            p.count.unwrap_or(0).max(p.concurrency.unwrap_or(0)).max(0)
        });
        usize::try_from(size)
            .unwrap_or(usize::MAX)
            .saturating_mul(2)
            .max(MIN_WORKERS_PER_POOL)
            .max(self.opts.expect_workers)
    }

    /// Forgets a worker that is gone (lost, released, or drained at the end): its hostname, its
    /// GPUs and its lease go with it, so that workers coming and going (or a peer registering
    /// again and again) do not grow the scheduler. Its metric series went already
    /// ([`Actor::forget_gpus`]); its lease id names no lease from now on.
    pub(super) fn forget(&mut self, worker: u64) {
        if self.workers.get(&worker).is_none_or(|w| w.alive) {
            return;
        }
        if let Some(w) = self.workers.remove(&worker)
            && self.gone_telemetry.len() < MAX_WORKERS_LISTED
        {
            let said = self.telemetry_of(&w);
            self.gone_telemetry.insert(worker, said);
        }
    }

    pub(super) fn update_worker_gauges(&self) {
        for i in 0..self.plan.spec().pools.len() as u32 {
            let n = self.attached(i).count();
            self.metrics
                .workers
                .with_label_values(&[self.plan.pool_name(i)])
                .set(n as i64);
            let without = self
                .workers
                .values()
                .filter(|w| {
                    w.alive && w.pool == i && w.telemetry.as_ref().is_some_and(|t| !t.available)
                })
                .count();
            self.metrics
                .workers_without_gpu_telemetry
                .with_label_values(&[self.plan.pool_name(i)])
                .set(without as i64);
        }
    }
}
