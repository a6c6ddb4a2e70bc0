//! The journal and its replay: every step is stamped with the job's clock and journaled before
//! the actor acts on it, and a restarted scheduler replays a journal into the same state.
//!
//! Admission (identity checks, rate limits on load reports) happens here too, before a step is
//! written, so that a replay sees exactly the steps the live actor acted on.

use super::*;

impl Actor {
    /// Starts writing every event to `journal` (a new one, or one just replayed).
    pub fn set_journal(&mut self, journal: JournalWriter) {
        self.journal = Some(journal);
    }

    /// Replays a journal's records into this fresh actor; the next [`Actor::run`] starts by
    /// losing every worker of the scheduler that wrote them. Returns how many were replayed.
    pub fn replay(&mut self, reader: &mut JournalReader) -> Result<u64, JournalError> {
        self.replaying = true;
        let replayed = self.replay_records(reader);
        self.replaying = false;
        self.feed.replayed();
        // The clock goes on from the last record.
        self.base = self.at;
        self.origin = Instant::now();
        self.recovering = true;
        replayed
    }

    fn replay_records(&mut self, reader: &mut JournalReader) -> Result<u64, JournalError> {
        let mut replayed = 0;
        while !self.interrupted
            && let Some(record) = reader.next_record()?
        {
            self.at = self.at.max(Duration::from_nanos(record.at_ns));
            let Some(event) = record.event else {
                continue;
            };
            match event {
                journal_record::Event::Register(r) => {
                    let _ = self.register(r.inventory.unwrap_or_default(), r.lease_secret);
                }
                journal_record::Event::Heartbeat(h) => {
                    // Never after the record itself, as live (`clock_at`).
                    let heard_at = match h.heard_at_ns {
                        0 => self.at,
                        ns => Duration::from_nanos(ns).min(self.at),
                    };
                    let _ = self.heartbeat(&h.worker_id, h.epoch, h.load, heard_at);
                }
                journal_record::Event::Attach(hello) => {
                    let _ = self.attach_stream(&hello.worker_id, hello.epoch, Sink::Replayed);
                }
                journal_record::Event::Message(m) => {
                    if let Some(message) = m.message {
                        self.message(m.worker, message);
                        self.pump();
                    }
                }
                journal_record::Event::Detach(d) => self.detach(d.worker, &d.reason),
                journal_record::Event::Cancel(_) => self.cancel_job(),
                journal_record::Event::FeedSubscribed(_) => self.feed.mark_subscribed(),
                journal_record::Event::Publish(publish) => {
                    self.publish_weights(publish);
                }
                journal_record::Event::Wake(_) => self.wake(),
                journal_record::Event::Tick(_) => self.on_tick(),
                journal_record::Event::Recovered(_) => self.recover(),
            }
            replayed += 1;
        }
        Ok(replayed)
    }

    /// The job's clock now (live only: a replay takes each record's time).
    pub(super) fn wall(&self) -> Duration {
        self.base + self.origin.elapsed()
    }

    /// What the job's clock read at `instant` (live only), never past the clock's reading now.
    pub(super) fn clock_at(&self, instant: Instant) -> Duration {
        (self.base + instant.saturating_duration_since(self.origin)).min(self.at)
    }

    /// The instant at which the job's clock reads `offset`.
    pub(super) fn instant_at(&self, offset: Duration) -> Instant {
        self.origin + offset.saturating_sub(self.base)
    }

    /// Takes steps live: stamps them with the clock, journals them (handing the records to the
    /// operating system before acting on any), and handles them in order.
    pub(super) fn take(&mut self, steps: Vec<Step>) {
        self.at = self.at.max(self.wall());
        self.stop_seen |= steps
            .iter()
            .any(|step| matches!(step, Step::Event(Event::Cancel)));
        let steps: Vec<Step> = steps
            .into_iter()
            .filter_map(|step| self.admit(step).map(|step| self.journal_step(step)))
            .collect();
        if let Some(journal) = &mut self.journal {
            let flushed = journal.flush();
            self.journal_written(flushed);
        }
        for step in steps {
            // A re-plan given up for a stop: the rest of the batch is journaled, never acted on.
            if self.interrupted {
                break;
            }
            match step {
                Step::Event(event) => self.handle(event),
                Step::Wake => self.wake(),
                Step::Tick => self.on_tick(),
                Step::Recovered => self.recover(),
            }
        }
    }

    /// A live step as it is to be journaled and handled: a load report over its worker's rate
    /// ([`LoadLimit`]) is dropped here, before the journal, so that a replay sees what was
    /// handled (a heartbeat keeps its lease renewal, without the load; a load message on the
    /// work stream goes whole).
    fn admit(&mut self, step: Step) -> Option<Step> {
        let step = self.admit_identity(step)?;
        let worker = match &step {
            Step::Event(Event::Heartbeat {
                worker_id,
                load: Some(_),
                ..
            }) => self.worker_number(worker_id),
            Step::Event(Event::Message {
                worker,
                message:
                    WorkerMessage {
                        message: Some(worker_message::Message::Load(_)),
                    },
                ..
            }) => Some(*worker),
            _ => None,
        };
        let Some(worker) = worker else {
            return Some(step);
        };
        let now = self.at;
        // Twice an honest worker's pace (one report per heartbeat, a quarter lease apart).
        let per_second =
            (8.0 / self.opts.lease_ttl.as_secs_f64().max(1e-3)).max(LOAD_REPORTS_PER_SECOND);
        let within = self
            .workers
            .get_mut(&worker)
            .is_none_or(|w| w.load_limit.take(now, per_second));
        if within {
            return Some(step);
        }
        self.metrics.load_reports_dropped.inc();
        match step {
            Step::Event(Event::Heartbeat {
                worker_id,
                epoch,
                heard,
                identity,
                reply,
                ..
            }) => Some(Step::Event(Event::Heartbeat {
                worker_id,
                epoch,
                load: None,
                heard,
                identity,
                reply,
            })),
            _ => None,
        }
    }

    /// A heartbeat or a stream for a lease bound to a client certificate ([`Worker::identity`])
    /// that comes with another certificate, or none, is refused `PERMISSION_DENIED` here,
    /// before the journal (a replay has no certificates to compare).
    fn admit_identity(&mut self, step: Step) -> Option<Step> {
        let (worker_id, identity) = match &step {
            Step::Event(Event::Heartbeat {
                worker_id,
                identity,
                ..
            })
            | Step::Event(Event::Attach {
                worker_id,
                identity,
                ..
            }) => (worker_id, identity),
            _ => return Some(step),
        };
        let Some(id) = self.worker_number(worker_id) else {
            return Some(step);
        };
        let bound = self.workers.get(&id).and_then(|w| w.identity);
        if bound.is_none() || bound == *identity {
            return Some(step);
        }
        let presented = if identity.is_some() {
            "another"
        } else {
            "none"
        };
        let refusal = |field: &str| {
            Status::permission_denied(format!(
                "{field}: lease w{id} is bound to the client certificate it registered with; \
                 this call presented {presented}"
            ))
        };
        match step {
            Step::Event(Event::Heartbeat { reply, .. }) => {
                let _ = reply.send(Err(refusal("worker_id")));
            }
            Step::Event(Event::Attach { reply, .. }) => {
                let _ = reply.send(Err(refusal("hello.worker_id")));
            }
            _ => {}
        }
        None
    }

    /// What of a load report the journal keeps: all of it, except GPU readings the actor will
    /// take (they only feed the metrics, which a replay does not serve); readings it will refuse
    /// are kept, so that a replay refuses them too.
    fn journaled_load(&self, worker: Option<u64>, load: &mut WorkerLoad) {
        let taken = worker.is_none_or(|w| self.gpu_readings_problem(w, load).is_none());
        if taken {
            load.gpus.clear();
            load.gpu_utilization = None;
            load.gpu_memory_used_bytes = None;
        }
    }

    /// Writes `step` to the journal, if there is one (a worker's message is moved into the
    /// record and back rather than copied).
    fn journal_step(&mut self, step: Step) -> Step {
        if self.journal.is_none() {
            return step;
        }
        let at_ns = self.at.as_nanos().min(u128::from(u64::MAX)) as u64;
        let (event, step) = match step {
            Step::Event(Event::Message {
                worker,
                message:
                    WorkerMessage {
                        message: Some(worker_message::Message::Load(load)),
                    },
                received,
            }) => {
                let mut journaled = load.clone();
                self.journaled_load(Some(worker), &mut journaled);
                let message = |load| WorkerMessage {
                    message: Some(worker_message::Message::Load(load)),
                };
                (
                    journal_record::Event::Message(JournalMessage {
                        worker,
                        message: Some(message(journaled)),
                    }),
                    Step::Event(Event::Message {
                        worker,
                        message: message(load),
                        received,
                    }),
                )
            }
            Step::Event(Event::Message {
                worker,
                message,
                received,
            }) => {
                let record = JournalRecord {
                    at_ns,
                    event: Some(journal_record::Event::Message(JournalMessage {
                        worker,
                        message: Some(message),
                    })),
                };
                let written = self.journal.as_mut().map_or(Ok(()), |j| j.write(&record));
                let message = match record.event {
                    Some(journal_record::Event::Message(JournalMessage {
                        message: Some(message),
                        ..
                    })) => message,
                    // Never: the record was built with the message just above.
                    _ => WorkerMessage::default(),
                };
                let step = Step::Event(Event::Message {
                    worker,
                    message,
                    received,
                });
                self.journal_written(written);
                return step;
            }
            Step::Event(event) => {
                let recorded = match &event {
                    Event::Register {
                        inventory, secret, ..
                    } => journal_record::Event::Register(JournalRegister {
                        inventory: Some(inventory.clone()),
                        lease_secret: secret.clone(),
                    }),
                    Event::Heartbeat {
                        worker_id,
                        epoch,
                        load,
                        heard,
                        ..
                    } => journal_record::Event::Heartbeat(JournalHeartbeat {
                        worker_id: worker_id.clone(),
                        epoch: *epoch,
                        load: load.clone().map(|mut load| {
                            self.journaled_load(self.worker_number(worker_id), &mut load);
                            load
                        }),
                        heard_at_ns: u64::try_from(self.clock_at(*heard).as_nanos())
                            .unwrap_or(u64::MAX)
                            .max(1),
                    }),
                    Event::Attach {
                        worker_id, epoch, ..
                    } => journal_record::Event::Attach(WorkerHello {
                        worker_id: worker_id.clone(),
                        epoch: *epoch,
                    }),
                    // Never: a message is journaled by the arm above, without a copy.
                    Event::Message { worker, .. } => {
                        journal_record::Event::Message(JournalMessage {
                            worker: *worker,
                            message: None,
                        })
                    }
                    Event::Detach { worker, reason } => {
                        journal_record::Event::Detach(JournalDetach {
                            worker: *worker,
                            reason: reason.clone(),
                        })
                    }
                    Event::Cancel => journal_record::Event::Cancel(true),
                    Event::FeedSubscribed => journal_record::Event::FeedSubscribed(true),
                    Event::Publish { publish, .. } => {
                        journal_record::Event::Publish(publish.clone())
                    }
                };
                (recorded, Step::Event(event))
            }
            Step::Wake => (journal_record::Event::Wake(true), Step::Wake),
            Step::Tick => (journal_record::Event::Tick(true), Step::Tick),
            Step::Recovered => (journal_record::Event::Recovered(true), Step::Recovered),
        };
        let record = JournalRecord {
            at_ns,
            event: Some(event),
        };
        let written = self.journal.as_mut().map_or(Ok(()), |j| j.write(&record));
        self.journal_written(written);
        step
    }

    /// A journal that cannot be written is emptied and dropped: the job goes on, but a restart
    /// must not resume from a journal with a gap in it.
    fn journal_written(&mut self, written: Result<(), JournalError>) {
        let Err(e) = written else {
            return;
        };
        let Some(journal) = self.journal.take() else {
            return;
        };
        let emptied = journal.abandon();
        tracing::error!(
            "scheduler: {e}; the job goes on without a journal{}",
            match emptied {
                Ok(()) =>
                    " (the file is emptied: a restart on it starts the job afresh)".to_owned(),
                Err(e) =>
                    format!(" (and the file could not be emptied: {e}; do not restart on it)"),
            }
        );
        self.metrics.journal_failures.inc();
    }
}
