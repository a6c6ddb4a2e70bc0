//! The connection and lease loop: a worker connects and registers, holds its lease with
//! heartbeats, takes assignments from its work stream, and registers again when the scheduler
//! goes away, until the job drains it.

use super::*;

/// Completes once `leave` says the node must go (never without a `leave`, or once its sender
/// is gone without saying so).
async fn leave_asked(leave: &mut Option<watch::Receiver<bool>>) {
    if let Some(rx) = leave
        && rx.wait_for(|go| *go).await.is_ok()
    {
        return;
    }
    std::future::pending::<()>().await
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending::<()>().await,
    }
}

/// Whether `leave` says the node must go.
fn leaving(leave: &Option<watch::Receiver<bool>>) -> bool {
    leave.as_ref().is_some_and(|rx| *rx.borrow())
}

/// How a refusal from the scheduler ends the session (`prefix` says which call it answered).
fn gone_or_refused(status: &tonic::Status, prefix: &str) -> Ended {
    let reason = format!("{prefix}{}", status.message());
    if scheduler_gone(status) {
        Ended::SchedulerGone {
            reason,
            closed: false,
        }
    } else {
        Ended::Error(NodeError::Refused(reason))
    }
}

async fn connect(
    opts: &WorkerOptions,
    connect_for: Duration,
) -> Result<WorkerServiceClient<AuthChannel>, NodeError> {
    let refused = |reason: String| NodeError::Connect {
        url: opts.scheduler.clone(),
        reason,
    };
    let identity = opts
        .tls_identity
        .as_ref()
        .map(|(cert, key)| (cert.as_path(), key.as_path()));
    let endpoint =
        rollfleet_proto::tls::endpoint(&opts.scheduler, opts.tls_ca.as_deref(), identity)
            .map_err(|e| refused(e.to_string()))?;
    let deadline = tokio::time::Instant::now() + connect_for;
    loop {
        match endpoint.connect().await {
            Ok(channel) => {
                return Ok(WorkerServiceClient::with_interceptor(
                    channel,
                    ClientAuth::new(opts.token.as_ref()),
                )
                .max_decoding_message_size(rollfleet_proto::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(rollfleet_proto::MAX_MESSAGE_BYTES));
            }
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(refused(e.to_string()));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Registers, then serves assignments until the job ends or the scheduler cuts the worker off.
pub async fn run(opts: WorkerOptions) -> Result<WorkerExit, NodeError> {
    let (telemetry_info, telemetry) = gpu_telemetry();
    let telemetry = telemetry.map(Arc::new);
    let openai = match &opts.engine {
        EngineChoice::OpenAi {
            url,
            model,
            temperature,
        } => Some(Arc::new(
            openai_backend(url, model.as_deref(), *temperature, opts.connect_timeout).await?,
        )),
        _ => None,
    };
    let tokens = token_engine::backend(&opts).await?.map(Arc::new);
    let software = Software {
        backend: match (&openai, &tokens) {
            (Some(_), _) => "openai",
            (None, Some(t)) => t.kind,
            (None, None) => "emulated",
        },
        version: match (&openai, &tokens) {
            (Some(b), _) => format!(
                "rollfleet-node {}; model {:?} at {}",
                env!("CARGO_PKG_VERSION"),
                b.engine.model(),
                b.engine.base_url()
            ),
            (None, Some(t)) => format!(
                "rollfleet-node {}; {} at {}",
                env!("CARGO_PKG_VERSION"),
                t.kind,
                t.urls().join(", ")
            ),
            (None, None) => env!("CARGO_PKG_VERSION").to_owned(),
        },
        telemetry_info,
        telemetry,
        openai,
        tokens,
    };
    let mut connect_for = opts.connect_timeout;
    loop {
        match session(&opts, &software, connect_for).await {
            Ok(exit) => return Ok(exit),
            Err(Ended::Error(e)) => return Err(e),
            // A node that is going does not come back.
            Err(Ended::SchedulerGone { .. }) if leaving(&opts.leave) => {
                return Ok(WorkerExit::Closed);
            }
            Err(Ended::SchedulerGone { reason, .. }) if !opts.rejoin_for.is_zero() => {
                tracing::warn!(
                    "worker ({}): the scheduler went away ({reason}); registering again for up \
                     to {} s",
                    opts.hostname,
                    opts.rejoin_for.as_secs_f64()
                );
                connect_for = opts.rejoin_for;
                // A scheduler that takes the registration and loses the worker again at once
                // is not hammered.
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(Ended::SchedulerGone { closed: true, .. }) => return Ok(WorkerExit::Closed),
            Err(Ended::SchedulerGone { reason, .. }) => return Err(NodeError::Refused(reason)),
        }
    }
}

/// What a node runs its work with, the same in every session.
struct Software {
    backend: &'static str,
    version: String,
    telemetry_info: GpuTelemetryInfo,
    telemetry: Option<Arc<rollfleet_gpu::Telemetry>>,
    openai: Option<Arc<OpenAiBackend>>,
    tokens: Option<Arc<token_engine::TokenBackend>>,
}

/// How a session with the scheduler ended, short of the job's drain.
enum Ended {
    /// The scheduler went away or forgot the lease: a worker may register again.
    SchedulerGone {
        /// What the worker saw.
        reason: String,
        /// The scheduler closed the stream (rather than the stream breaking).
        closed: bool,
    },
    /// Anything else ends the worker.
    Error(NodeError),
}

impl From<NodeError> for Ended {
    fn from(e: NodeError) -> Ended {
        Ended::Error(e)
    }
}

/// Whether a refusal means the scheduler is gone or no longer knows this worker (so registering
/// again may work), rather than that it refuses this worker.
fn scheduler_gone(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Cancelled
            | tonic::Code::Internal
            | tonic::Code::NotFound
    )
}

/// One registration with the scheduler and the work it gives until the job drains it or the
/// scheduler goes away.
async fn session(
    opts: &WorkerOptions,
    software: &Software,
    connect_for: Duration,
) -> Result<WorkerExit, Ended> {
    let Software {
        backend,
        version: backend_version,
        telemetry_info,
        telemetry,
        openai,
        tokens,
    } = software;
    let (backend, backend_version) = (*backend, backend_version.clone());
    let telemetry = telemetry.clone();
    let openai = openai.clone();
    let tokens = tokens.clone();
    if leaving(&opts.leave) {
        return Ok(WorkerExit::Closed);
    }
    let mut client = connect(opts, connect_for).await?;
    let response = client
        .register(RegisterRequest {
            inventory: Some(HardwareInventory {
                hostname: opts.hostname.clone(),
                pool: opts.pool.clone(),
                device: opts.gpus.map(|count| {
                    hardware_inventory::Device::Gpu(GpuInventory {
                        count,
                        emulated: openai.is_none() && tokens.is_none(),
                        ..Default::default()
                    })
                }),
                backend: backend.into(),
                backend_version,
                gpu_telemetry: Some(telemetry_info.clone()),
            }),
            requested_lease_ms: opts.lease_ms,
            previous_worker_id: String::new(),
        })
        .await;
    let response = match response {
        Ok(response) => response.into_inner(),
        // A scheduler that comes back to find its job over (it was resumed from its journal
        // after the end) has nothing for the worker: the job is drained.
        Err(status) if status.code() == tonic::Code::FailedPrecondition => {
            tracing::info!(
                "worker ({}): the scheduler says {}; nothing left to do",
                opts.hostname,
                status.message()
            );
            return Ok(WorkerExit::Drained);
        }
        Err(status) => return Err(gone_or_refused(&status, "")),
    };
    let lease = response
        .lease
        .ok_or_else(|| NodeError::Refused("the registration answer has no lease".into()))?;
    let plan = JobPlan::from_yaml(&response.job_yaml, "the scheduler's job", 0)
        .map_err(NodeError::from)?;
    let pool = plan
        .pool_index(&opts.pool)
        .ok_or_else(|| NodeError::Refused(format!("the job has no pool {:?}", opts.pool)))?;
    let time_scale = if response.time_scale > 0.0 {
        response.time_scale
    } else {
        1.0
    };
    if openai.is_some() && plan.pool_role(pool) != Some(PoolRole::Gpu) {
        return Err(Ended::Error(NodeError::Engine(format!(
            "--engine openai serves generation, which runs on GPU pools; pool {:?} is a {:?} pool",
            opts.pool,
            plan.pool_role(pool)
        ))));
    }
    if let Some(t) = &tokens {
        if plan.pool_role(pool) != Some(PoolRole::Gpu) {
            return Err(Ended::Error(NodeError::Engine(format!(
                "--engine {} serves generation, which runs on GPU pools; pool {:?} is a {:?} pool",
                t.kind,
                opts.pool,
                plan.pool_role(pool)
            ))));
        }
        if plan.spec().rl.trainer != rollfleet_spec::TrainerMode::External {
            return Err(Ended::Error(NodeError::Engine(format!(
                "--engine {} loads every policy version's real weights, and the job's trainer is \
                 emulated (it publishes none): run the job with rl.trainer: external, or use \
                 --engine openai, whose engine keeps its weights under the emulated trainer",
                t.kind
            ))));
        }
        tracing::info!(
            "worker {} ({}): registered for pool {}; generation token-in, token-out on {} {} \
             engine(s): {}",
            shown_lease(&lease.worker_id),
            opts.hostname,
            opts.pool,
            t.urls().len(),
            t.kind,
            t.urls().join(", ")
        );
    }
    match &openai {
        None if tokens.is_some() => {}
        None => tracing::info!(
            "worker {} ({}): registered for pool {} ({}); emulated hardware at time scale \
             {time_scale}",
            shown_lease(&lease.worker_id),
            opts.hostname,
            opts.pool,
            match plan.pool_role(pool) {
                Some(PoolRole::Gpu) => "GPUs",
                Some(PoolRole::Cpu) => "CPU nodes",
                Some(PoolRole::Serverless) => "serverless functions",
                None => "not in the job",
            }
        ),
        Some(b) => tracing::info!(
            "worker {} ({}): registered for pool {}; generation on the OpenAI-compatible engine \
             at {} (model \"{}\"); training emulated at time scale {time_scale}",
            shown_lease(&lease.worker_id),
            opts.hostname,
            opts.pool,
            b.engine.base_url(),
            b.engine.model()
        ),
    }
    // Said once: the scheduler has it in the registration too.
    if telemetry_info.available {
        let names: Vec<&str> = telemetry_info
            .devices
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        tracing::info!(
            "worker {} ({}): GPU telemetry (NVML) from {} GPUs ({}) with every heartbeat",
            shown_lease(&lease.worker_id),
            opts.hostname,
            names.len(),
            names.join(", ")
        );
    } else {
        tracing::warn!(
            "worker {} ({}): no GPU telemetry on this node, reported once and never as zeros: {}",
            shown_lease(&lease.worker_id),
            opts.hostname,
            telemetry_info.unavailable_reason
        );
    }
    let node = Arc::new(Node {
        plan,
        pool,
        time_scale,
        engines: Mutex::new(BTreeMap::new()),
        started_replicas: Mutex::new(BTreeMap::new()),
        slowdown: opts.slowdown,
        openai,
        tokens,
        host: env_host(opts),
        episodes: Mutex::new(BTreeMap::new()),
        slots: opts.env_slots.max(1),
        rewards: rollfleet_rewards::Handler::default(),
        model_environments: opts.model_environments,
    });

    // Heartbeats on their own task; losing the lease ends the worker.
    let (lost_tx, mut lost_rx) = mpsc::unbounded_channel::<tonic::Status>();
    let mut hb_client = client.clone();
    let hb_id = lease.worker_id.clone();
    let epoch = lease.epoch;
    let interval = Duration::from_millis(lease.heartbeat_interval_ms.max(50));
    let hb_node = node.clone();
    let heartbeat = tokio::spawn(async move {
        loop {
            tokio::time::sleep(interval).await;
            let mut load = hb_node.load().await;
            if let Some(t) = &telemetry {
                let t = t.clone();
                // NVML calls block (briefly): off the async threads.
                if let Ok(samples) = tokio::task::spawn_blocking(move || t.sample()).await {
                    add_gpu_readings(&mut load, &samples);
                }
            }
            let r = hb_client
                .heartbeat(HeartbeatRequest {
                    worker_id: hb_id.clone(),
                    epoch,
                    load: Some(load),
                })
                .await;
            if let Err(status) = r {
                let _ = lost_tx.send(status);
                return;
            }
        }
    });

    let (out, out_rx) = mpsc::unbounded_channel();
    let _ = out.send(WorkerMessage {
        message: Some(worker_message::Message::Hello(WorkerHello {
            worker_id: lease.worker_id.clone(),
            epoch,
        })),
    });
    let mut inbound = client
        .work(UnboundedReceiverStream::new(out_rx))
        .await
        .map_err(|s| gone_or_refused(&s, ""))?
        .into_inner();
    let running: Arc<Mutex<BTreeMap<u64, Running>>> = Arc::new(Mutex::new(BTreeMap::new()));
    let mut leave = opts.leave.clone();
    let mut release_by: Option<tokio::time::Instant> = None;
    let result = loop {
        let message = tokio::select! {
            m = inbound.next() => m,
            status = lost_rx.recv() => {
                let status = status.unwrap_or_else(|| tonic::Status::unknown("the heartbeat task ended"));
                break Err(gone_or_refused(&status, "heartbeat refused: "));
            }
            () = leave_asked(&mut leave), if release_by.is_none() => {
                tracing::info!(
                    "worker {} ({}): leaving: the scheduler gives this node nothing new and \
                     releases it once what it runs is done (at most {} s)",
                    shown_lease(&lease.worker_id),
                    opts.hostname,
                    opts.leave_timeout.as_secs_f64()
                );
                let _ = out.send(WorkerMessage {
                    message: Some(worker_message::Message::Leaving(WorkerLeaving {
                        reason: format!("node {} is going away", opts.hostname),
                    })),
                });
                release_by = Some(tokio::time::Instant::now() + opts.leave_timeout);
                continue;
            }
            () = sleep_until_opt(release_by) => {
                break Err(Ended::Error(NodeError::Refused(format!(
                    "leaving: the scheduler did not release this node within {:?}",
                    opts.leave_timeout
                ))));
            }
        };
        match message {
            None => {
                break Err(Ended::SchedulerGone {
                    reason: "the scheduler closed the work stream".into(),
                    closed: true,
                });
            }
            Some(Err(status)) => break Err(gone_or_refused(&status, "")),
            Some(Ok(SchedulerMessage { message: None })) => {}
            Some(Ok(SchedulerMessage {
                message: Some(m), ..
            })) => match m {
                scheduler_message::Message::Assign(a) => {
                    let id = a.assignment_id;
                    let node = node.clone();
                    let out = out.clone();
                    let running2 = running.clone();
                    let (interrupt, interrupted) = watch::channel(false);
                    let task = tokio::spawn(async move {
                        let started = tokio::time::Instant::now();
                        let outcome = node.execute(&a, Interrupt(interrupted)).await;
                        running2
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .remove(&id);
                        let _ = out.send(WorkerMessage {
                            message: Some(worker_message::Message::Result(WorkResult {
                                assignment_id: id,
                                outcome: Some(outcome),
                                duration_us: started.elapsed().as_micros() as u64,
                            })),
                        });
                    });
                    running
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(id, (task.abort_handle(), interrupt));
                }
                scheduler_message::Message::AbortAssignmentId(id) => {
                    if let Some((h, _)) = running
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&id)
                    {
                        h.abort();
                    }
                }
                scheduler_message::Message::InterruptAssignmentId(id) => {
                    if let Some((_, interrupt)) =
                        running.lock().unwrap_or_else(|p| p.into_inner()).get(&id)
                    {
                        interrupt.send_replace(true);
                    }
                }
                scheduler_message::Message::Drain(_) => break Ok(WorkerExit::Drained),
                scheduler_message::Message::StartReplica(start) => {
                    if let Err(reason) = node.start_replica(&start) {
                        tracing::warn!("worker: {reason}");
                    } else {
                        tracing::info!(
                            "worker: serves replica {} from now on ({} x {} GPUs)",
                            start.replica,
                            start.role,
                            start.gpus
                        );
                    }
                }
                scheduler_message::Message::StopReplica(replica) => {
                    node.stop_replica(replica);
                    tracing::info!("worker: replica {replica} retired");
                }
            },
        }
    };
    heartbeat.abort();
    for (_, (h, _)) in std::mem::take(&mut *running.lock().unwrap_or_else(|p| p.into_inner())) {
        h.abort();
    }
    result
}

/// A lease id as logs show it: its number (`w<N>`), without the secret that makes it a
/// capability.
fn shown_lease(worker_id: &str) -> &str {
    worker_id.split('-').next().unwrap_or(worker_id)
}
