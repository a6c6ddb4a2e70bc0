//! The gRPC services (`rollfleet.v1` WorkerService and JobService) in front of the actor.
//!
//! Handlers hold no state of their own: they validate what the wire can get wrong, forward an
//! [`Event`] to the actor, and relay its answer. Job status comes from a `watch` channel the
//! actor publishes to, so `Status` and `Watch` never wait on the actor.

use std::pin::Pin;
use std::sync::Arc;

use futures_util::Stream;
use rollfleet_proto::v1::{
    CancelJobResponse, HeartbeatRequest, HeartbeatResponse, JobList, JobLogsRequest, JobRef,
    JobStatus, ListJobsRequest, LogLine, RegisterRequest, RegisterResponse, SchedulerMessage,
    SubmitJobRequest, SubmitJobResponse, WorkerMessage, job_service_server::JobService,
    worker_message, worker_service_server::WorkerService,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;
use tokio_stream::wrappers::{BroadcastStream, UnboundedReceiverStream, WatchStream};
use tonic::{Request, Response, Status, Streaming};

use crate::actor::Event;
use crate::job::{JobSlot, SubmitError};

/// The WorkerService.
pub struct Workers {
    /// The actor's inbox.
    pub inbox: mpsc::Sender<Event>,
}

/// How much of a rejected job's problems a `Submit` error quotes.
const MAX_ERROR_CHARS: usize = 2000;

fn actor_gone() -> Status {
    Status::unavailable("the scheduler is shutting down")
}

async fn ask<T>(
    inbox: &mpsc::Sender<Event>,
    make: impl FnOnce(oneshot::Sender<Result<T, Status>>) -> Event,
) -> Result<T, Status> {
    let (tx, rx) = oneshot::channel();
    inbox.send(make(tx)).await.map_err(|_| actor_gone())?;
    rx.await.map_err(|_| actor_gone())?
}

type WorkStream = Pin<Box<dyn Stream<Item = Result<SchedulerMessage, Status>> + Send>>;

#[tonic::async_trait]
impl WorkerService for Workers {
    async fn register(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        let identity = identity(&request);
        let inventory = request
            .into_inner()
            .inventory
            .ok_or_else(|| Status::invalid_argument("inventory: required"))?;
        let secret = lease_secret()?;
        ask(&self.inbox, |reply| Event::Register {
            inventory,
            secret,
            identity,
            reply,
        })
        .await
        .map(Response::new)
    }

    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let identity = identity(&request);
        let r = request.into_inner();
        if let Some(problem) = r.load.as_ref().and_then(oversized_load) {
            return Err(Status::invalid_argument(problem));
        }
        let heard = tokio::time::Instant::now();
        ask(&self.inbox, |reply| Event::Heartbeat {
            worker_id: r.worker_id,
            epoch: r.epoch,
            load: r.load,
            heard,
            identity,
            reply,
        })
        .await
        .map(Response::new)
    }

    type WorkStream = WorkStream;

    async fn work(
        &self,
        request: Request<Streaming<WorkerMessage>>,
    ) -> Result<Response<Self::WorkStream>, Status> {
        let identity = identity(&request);
        let mut incoming = request.into_inner();
        let first = tokio::time::timeout(std::time::Duration::from_secs(10), incoming.next())
            .await
            .map_err(|_| Status::deadline_exceeded("no hello within 10 s"))?;
        let hello = match first {
            Some(Ok(WorkerMessage {
                message: Some(worker_message::Message::Hello(hello)),
            })) => hello,
            Some(Ok(_)) => {
                return Err(Status::invalid_argument(
                    "the first message on a work stream must be a WorkerHello",
                ));
            }
            Some(Err(status)) => return Err(status),
            None => return Err(Status::cancelled("the stream ended before its hello")),
        };
        let (outbox, rx) = mpsc::unbounded_channel();
        let worker = ask(&self.inbox, |reply| Event::Attach {
            worker_id: hello.worker_id,
            epoch: hello.epoch,
            outbox,
            identity,
            reply,
        })
        .await?;
        let inbox = self.inbox.clone();
        tokio::spawn(async move {
            let reason = loop {
                let next = tokio::select! {
                    next = incoming.next() => next,
                    // The actor is gone (the scheduler stops): the stream is let go, so that the
                    // server's shutdown does not wait for a peer that keeps its side open.
                    () = inbox.closed() => return,
                };
                match next {
                    Some(Ok(message)) => {
                        if let Some(worker_message::Message::Load(load)) = &message.message
                            && let Some(problem) = oversized_load(load)
                        {
                            break format!("it sent {problem}");
                        }
                        let received = tokio::time::Instant::now();
                        let event = Event::Message {
                            worker,
                            message,
                            received,
                        };
                        // Waits for room in the actor's inbox: meanwhile this stream is not
                        // read, and HTTP/2 flow control holds its peer back.
                        if inbox.send(event).await.is_err() {
                            return;
                        }
                    }
                    Some(Err(status)) => {
                        break format!("its work stream broke: {}", status.message());
                    }
                    None => break "it closed its work stream".to_owned(),
                }
            };
            let _ = inbox.send(Event::Detach { worker, reason }).await;
        });
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }
}

/// The SHA-256 of the client certificate a call came with (mutual TLS), if any: a lease is
/// bound to the one its worker registered with.
fn identity<T>(request: &Request<T>) -> Option<[u8; 32]> {
    use sha2::Digest;
    let certs = request.peer_certs()?;
    let leaf = certs.first()?;
    Some(sha2::Sha256::digest(leaf.as_ref()).into())
}

/// The random part of a lease id: 128 bits from the operating system, in hex.
fn lease_secret() -> Result<String, Status> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes)
        .map_err(|e| Status::unavailable(format!("no randomness for a lease id: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Why a load report is refused before the actor (and its journal) sees it: more GPU readings
/// or profile samples than a node can have, which only grow the scheduler and its journal.
pub fn oversized_load(load: &rollfleet_proto::v1::WorkerLoad) -> Option<String> {
    if load.gpus.len() > crate::inventory::MAX_GPUS_PER_NODE {
        return Some(format!(
            "load.gpus: {} readings (a node has at most {} GPUs)",
            load.gpus.len(),
            crate::inventory::MAX_GPUS_PER_NODE
        ));
    }
    (load.samples.len() > crate::MAX_PROFILE_SAMPLES_PER_REPORT).then(|| {
        format!(
            "load.samples: {} samples in one report (at most {})",
            load.samples.len(),
            crate::MAX_PROFILE_SAMPLES_PER_REPORT
        )
    })
}

/// The JobService of a scheduler that runs one job, given when it started or submitted.
pub struct Jobs {
    /// The actor's inbox.
    pub inbox: mpsc::Sender<Event>,
    /// The job's status, as the actor last published it.
    pub status: Arc<watch::Sender<JobStatus>>,
    /// The job.
    pub slot: Arc<JobSlot>,
    /// Set when the scheduler is told to stop: a submitted job still planning stops planning.
    pub stopping: Arc<std::sync::atomic::AtomicBool>,
}

impl Jobs {
    fn check(&self, job: &str) -> Result<(), Status> {
        match self.slot.unknown(job, "job") {
            Some(message) => Err(Status::not_found(message)),
            None => Ok(()),
        }
    }
}

type WatchResponse = Pin<Box<dyn Stream<Item = Result<JobStatus, Status>> + Send>>;
type LogsResponse = Pin<Box<dyn Stream<Item = Result<LogLine, Status>> + Send>>;

#[tonic::async_trait]
impl JobService for Jobs {
    async fn submit(
        &self,
        request: Request<SubmitJobRequest>,
    ) -> Result<Response<SubmitJobResponse>, Status> {
        let SubmitJobRequest {
            job_yaml, job_dir, ..
        } = request.into_inner();
        let dir = (!job_dir.is_empty()).then(|| std::path::PathBuf::from(&job_dir));
        if dir.as_ref().is_some_and(|d| !d.is_absolute()) {
            return Err(Status::invalid_argument(format!(
                "job_dir: {:?} is not an absolute path (send the job file's directory as the \
                 scheduler's file system names it, or no directory)",
                crate::first_chars(&job_dir, MAX_ERROR_CHARS)
            )));
        }
        let slot = self.slot.clone();
        let stopping = self.stopping.clone();
        // Planning a job takes seconds of CPU (its admission window is chosen by simulating
        // it; a big job, more), and stops when the scheduler does; so does reading the CSV
        // files a job names.
        let accepted = tokio::task::spawn_blocking(move || {
            // A job sent with its directory is kept with its CSV paths made absolute, so that
            // it reads the same files when the scheduler reads its journal again.
            let yaml = match &dir {
                Some(dir) => rollfleet_spec::job_yaml_for_dir(job_yaml.as_bytes(), "job_yaml", dir)
                    .map_err(|e| SubmitError::Invalid(crate::PlanError::from(e)))?,
                None => job_yaml,
            };
            rollfleet_planner::cancel::within(&stopping, || slot.accept(&yaml, "job_yaml"))
        })
        .await
        .map_err(|_| Status::internal("planning the submitted job failed"))?;
        // A plan given up because the scheduler is stopping is no verdict on the job.
        if accepted.is_err() && self.stopping.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(actor_gone());
        }
        match accepted {
            Ok(job) => Ok(Response::new(SubmitJobResponse {
                job: job.plan.name().to_owned(),
            })),
            // A job that is not valid is told why, as `rollfleet validate` would; cut short, as
            // an error travels in a header.
            Err(SubmitError::Invalid(e)) => {
                // A spec's problems already start with their field paths (`job_yaml: ...`).
                let text = match e {
                    crate::PlanError::Spec(spec) => spec.to_string(),
                    other => other.to_string(),
                };
                let shown = crate::first_chars(&text, MAX_ERROR_CHARS);
                let more = text.len() - shown.len();
                Err(Status::invalid_argument(if more > 0 {
                    format!("{shown}... ({more} more bytes)")
                } else {
                    text
                }))
            }
            Err(busy @ SubmitError::Busy { .. }) => {
                Err(Status::failed_precondition(busy.to_string()))
            }
        }
    }

    async fn status(&self, request: Request<JobRef>) -> Result<Response<JobStatus>, Status> {
        self.check(&request.into_inner().job)?;
        Ok(Response::new(self.status.borrow().clone()))
    }

    async fn cancel(
        &self,
        request: Request<JobRef>,
    ) -> Result<Response<CancelJobResponse>, Status> {
        self.check(&request.into_inner().job)?;
        let mut status = self.status.subscribe();
        self.inbox
            .send(Event::Cancel)
            .await
            .map_err(|_| actor_gone())?;
        // The answer says the cancel took: the status once the actor has ended the job (it
        // does at once), not the one before it.
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(2),
            status.wait_for(|s| s.phase().ended()),
        )
        .await;
        let status = status.borrow().clone();
        Ok(Response::new(CancelJobResponse {
            status: Some(status),
        }))
    }

    type WatchStream = WatchResponse;

    async fn watch(&self, request: Request<JobRef>) -> Result<Response<Self::WatchStream>, Status> {
        self.check(&request.into_inner().job)?;
        let mut done = false;
        // Every change, starting with the current status, up to and including a terminal one.
        let stream = WatchStream::new(self.status.subscribe())
            .take_while(move |s| {
                if done {
                    return false;
                }
                done = s.phase().ended();
                true
            })
            .map(Ok);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn list(&self, _request: Request<ListJobsRequest>) -> Result<Response<JobList>, Status> {
        let jobs = match self.slot.job() {
            Some(_) => vec![self.status.borrow().clone()],
            None => Vec::new(),
        };
        Ok(Response::new(JobList { jobs }))
    }

    type LogsStream = LogsResponse;

    async fn logs(
        &self,
        request: Request<JobLogsRequest>,
    ) -> Result<Response<Self::LogsStream>, Status> {
        let request = request.into_inner();
        self.check(&request.job)?;
        let logs = crate::logs::RecentLogs::global();
        let tail = request.tail as usize;
        if !request.follow {
            let lines = logs.tail(tail).into_iter().map(Ok);
            return Ok(Response::new(Box::pin(tokio_stream::iter(lines))));
        }
        let (lines, receiver) = logs.follow(tail);
        let later = BroadcastStream::new(receiver).map(|line| match line {
            Ok(line) => Ok(line),
            // The follower fell behind: it is told what it missed instead of a silent gap.
            Err(BroadcastStreamRecvError::Lagged(missed)) => Ok(LogLine {
                level: "WARN".into(),
                target: "rollfleet::logs".into(),
                message: format!("{missed} lines were missed: this reader fell behind the log"),
                ..Default::default()
            }),
        });
        Ok(Response::new(Box::pin(
            tokio_stream::iter(lines.into_iter().map(Ok)).chain(later),
        )))
    }
}
