//! Seeded fault injection of the scheduler's actor: the real actor runs a short quick-start job
//! on tokio's paused clock (so a case of minutes of job time takes milliseconds), with one
//! in-process worker per pool that answers what it is given, and a seeded generator that makes
//! them misbehave: results late, never, twice or for assignments they do not hold, failures of
//! every cause, oversized texts, workers that vanish without a word and come back, workers
//! that leave, answers with more token ids than the task's context; and in one case in four,
//! the scheduler itself is killed mid-run (its queue lost) and restarted from its journal.
//! Every case must end with the job Succeeded (the faults are all ones the scheduler recovers
//! from), every trajectory trained once and none twice.
//!
//! `ROLLFLEET_FAULT_CASES` (default 1,000) sets the number of seeds, `ROLLFLEET_FAULT_SEED` runs
//! one alone: a failing case prints the command that reproduces it.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::sync::Arc;
use std::time::Duration;

use rollfleet_proto::v1::JournalHeader;
use rollfleet_proto::v1::{
    HardwareInventory, JobStatus, StageFailure, StageOutput, WorkResult, WorkerLeaving,
    WorkerMessage, scheduler_message, stage_failure, work_assignment::Work, work_result,
    worker_message,
};
use rollfleet_server::actor::{Actor, ActorOptions, Event, Report};
use rollfleet_server::feed::FeedLog;
use rollfleet_server::job::JobSlot;
use rollfleet_server::journal::{FORMAT, JournalReader, JournalWriter};
use rollfleet_server::metrics::Metrics;
use tokio::sync::{mpsc, oneshot, watch};

mod common;
use common::{Rng, quickstart_yaml};

impl Rng {
    fn millis(&mut self, max: u64) -> Duration {
        Duration::from_millis(self.next() % max.max(1))
    }
}

const STEPS: u64 = 3;
/// The quick-start's `rolloutBatchSize`: trajectories trained per RL step.
const TRAIN_BATCH: u64 = 32;
const POOLS: [&str; 5] = ["prefill", "decode", "train", "envs", "rewards"];
/// The quick-start tasks' `contextLimit`.
const CONTEXT_LIMIT: u64 = 4096;

fn job_yaml() -> String {
    quickstart_yaml().replace("steps: 5", &format!("steps: {STEPS}"))
}

/// What a worker does with one assignment.
enum Fault {
    Answer,
    Late(Duration),
    Never,
    Twice,
    NotHeld,
    Fail(stage_failure::Cause),
    Oversized,
    /// More token ids and log-probabilities than the task's whole context.
    TooManyIds,
    /// The process dies: its stream ends and it registers again.
    Vanish,
    /// A node drain: it says it is leaving, finishes what it runs, and comes back as a new node.
    Leave,
}

impl Fault {
    fn name(&self) -> &'static str {
        match self {
            Fault::Answer => "answer",
            Fault::Late(_) => "late answer",
            Fault::Never => "no answer",
            Fault::Twice => "two answers",
            Fault::NotHeld => "answer for an assignment not held",
            Fault::Fail(_) => "failure",
            Fault::Oversized => "oversized answer",
            Fault::TooManyIds => "answer with too many token ids",
            Fault::Vanish => "vanishing",
            Fault::Leave => "leaving",
        }
    }
}

fn fault(rng: &mut Rng) -> Fault {
    let draw = rng.next() % 1000;
    if std::env::var_os("ROLLFLEET_FAULTS_OFF").is_some() {
        return Fault::Answer;
    }
    match draw {
        0..=19 => Fault::Late(rng.millis(3000)),
        20..=24 => Fault::Never,
        25..=29 => Fault::Twice,
        30..=32 => Fault::NotHeld,
        33..=42 => Fault::Fail(stage_failure::Cause::Infrastructure),
        43..=45 => Fault::Fail(stage_failure::Cause::Aborted),
        46..=47 => Fault::Oversized,
        48 => Fault::Vanish,
        49 => Fault::Leave,
        50..=52 => Fault::TooManyIds,
        _ => Fault::Answer,
    }
}

/// A plausible answer to `work`, as the bench's instant workers give.
fn output(work: Option<&Work>, turn: u32) -> StageOutput {
    match work {
        Some(Work::Generation(g)) => StageOutput {
            token_count: u64::from(g.max_new_tokens.clamp(1, 48)),
            emulated: true,
            ..Default::default()
        },
        Some(Work::EnvStep(e)) => StageOutput {
            token_count: if e.reset { 200 } else { 60 },
            done: !e.reset && turn >= 3,
            text: "up".into(),
            ..Default::default()
        },
        Some(Work::Reward(_)) => StageOutput {
            reward: 1.0,
            ..Default::default()
        },
        _ => StageOutput::default(),
    }
}

fn result(assignment_id: u64, outcome: work_result::Outcome) -> WorkerMessage {
    WorkerMessage {
        message: Some(worker_message::Message::Result(WorkResult {
            assignment_id,
            outcome: Some(outcome),
            duration_us: 0,
        })),
    }
}

/// Registers, attaches and serves until the job drains it; registers again when it vanishes,
/// leaves, or is cut off.
async fn worker(inbox: mpsc::UnboundedSender<Event>, pool: &'static str, seed: u64) {
    let mut rng = Rng::new(seed);
    for life in 0..20u32 {
        let (reply, answer) = oneshot::channel();
        // No device: the scheduler gives a node of the pool's own shape, as to emulated workers.
        let inventory = HardwareInventory {
            hostname: format!("{pool}-{life}"),
            pool: pool.into(),
            ..Default::default()
        };
        let secret = format!("{:032x}", u128::from(rng.next()));
        if inbox
            .send(Event::Register {
                inventory,
                secret,
                identity: None,
                reply,
            })
            .is_err()
        {
            return;
        }
        let registered = match answer.await {
            Ok(Ok(registered)) => registered,
            // Refused: the job is over.
            Ok(Err(_)) => return,
            // The scheduler died with the registration in its queue: try again once it is back.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let lease = registered.into_inner_lease();
        let (outbox, mut assignments) = mpsc::unbounded_channel();
        let (reply, answer) = oneshot::channel();
        let _ = inbox.send(Event::Attach {
            worker_id: lease.0.clone(),
            epoch: lease.1,
            outbox,
            identity: None,
            reply,
        });
        let stream = match answer.await {
            Ok(Ok(stream)) => stream,
            Ok(Err(_)) => return,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let beats = tokio::spawn(heartbeat(inbox.clone(), lease.0.clone(), lease.1));
        let send = |message: WorkerMessage| {
            let _ = inbox.send(Event::Message {
                worker: stream,
                message,
                received: tokio::time::Instant::now(),
            });
        };
        let mut leaving = false;
        let ended_how = loop {
            let Some(Ok(message)) = assignments.recv().await else {
                break "cut off";
            };
            let assign = match message.message {
                Some(scheduler_message::Message::Assign(a)) => a,
                Some(scheduler_message::Message::Drain(_)) => {
                    beats.abort();
                    if leaving {
                        break "left";
                    }
                    return;
                }
                _ => continue,
            };
            let id = assign.assignment_id;
            let answer = work_result::Outcome::Output(output(assign.work.as_ref(), assign.turn));
            let fault = fault(&mut rng);
            if std::env::var_os("ROLLFLEET_FAULT_TRACE").is_some()
                && !matches!(fault, Fault::Answer)
            {
                let kind = match &assign.work {
                    Some(Work::Generation(_)) => "generation",
                    Some(Work::EnvStep(_)) => "environment step",
                    Some(Work::Reward(_)) => "reward",
                    Some(Work::Train(_)) => "train",
                    Some(Work::WeightSync(_)) => "weight sync",
                    _ => "other",
                };
                eprintln!(
                    "{:?} {pool}: {} of assignment {id} ({kind})",
                    tokio::time::Instant::now(),
                    fault.name()
                );
            }
            match fault {
                Fault::Answer => send(result(id, answer)),
                Fault::Late(delay) => {
                    let inbox = inbox.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        let _ = inbox.send(Event::Message {
                            worker: stream,
                            message: result(id, answer),
                            received: tokio::time::Instant::now(),
                        });
                    });
                }
                Fault::Never => {}
                Fault::Twice => {
                    send(result(id, answer.clone()));
                    send(result(id, answer));
                }
                Fault::NotHeld => send(result(id + 1_000_000, answer)),
                Fault::Fail(cause) => send(result(
                    id,
                    work_result::Outcome::Failure(StageFailure {
                        cause: cause as i32,
                        message: "injected".into(),
                    }),
                )),
                Fault::Oversized => {
                    let mut big = output(assign.work.as_ref(), assign.turn);
                    big.text = "x".repeat(3 << 20);
                    big.observation = "y".repeat(3 << 20);
                    send(result(id, work_result::Outcome::Output(big)));
                }
                Fault::TooManyIds => {
                    let mut big = output(assign.work.as_ref(), assign.turn);
                    let n = CONTEXT_LIMIT as usize + 1;
                    big.tokens = vec![7; n];
                    big.logprobs = vec![-0.5; n];
                    rollfleet_proto::packed::pack(&mut big);
                    send(result(id, work_result::Outcome::Output(big)));
                }
                Fault::Vanish => {
                    let _ = inbox.send(Event::Detach {
                        worker: stream,
                        reason: "injected: the process died".into(),
                    });
                    beats.abort();
                    break "vanished";
                }
                Fault::Leave => {
                    send(result(id, answer));
                    if !leaving {
                        leaving = true;
                        send(WorkerMessage {
                            message: Some(worker_message::Message::Leaving(WorkerLeaving {
                                reason: "injected: node drain".into(),
                            })),
                        });
                    }
                }
            }
        };
        beats.abort();
        // A worker comes back a moment later, as a restarted process or a replacement node.
        let _ = ended_how;
        tokio::time::sleep(rng.millis(2000)).await;
    }
}

async fn heartbeat(inbox: mpsc::UnboundedSender<Event>, worker_id: String, epoch: u64) {
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (reply, answer) = oneshot::channel();
        if inbox
            .send(Event::Heartbeat {
                worker_id: worker_id.clone(),
                epoch,
                load: None,
                heard: tokio::time::Instant::now(),
                identity: None,
                reply,
            })
            .is_err()
        {
            return;
        }
        if !matches!(answer.await, Ok(Ok(_))) {
            return;
        }
    }
}

trait LeaseOf {
    fn into_inner_lease(self) -> (String, u64);
}

impl LeaseOf for rollfleet_proto::v1::RegisterResponse {
    fn into_inner_lease(self) -> (String, u64) {
        let lease = self.lease.unwrap();
        (lease.worker_id, lease.epoch)
    }
}

/// The job planned with `seed`. Planning is the slowest part of a case in a debug build and
/// only the seed differs between cases (the core's configuration carries it, nothing else
/// reads it), so the job is planned once.
fn plan_for(seed: u64) -> rollfleet_server::JobPlan {
    static PLANNED: std::sync::OnceLock<rollfleet_server::JobPlan> = std::sync::OnceLock::new();
    let mut plan = PLANNED
        .get_or_init(|| {
            JobSlot::new(0, Duration::from_secs(30))
                .plan(&job_yaml(), "the fault harness's job")
                .unwrap()
        })
        .clone();
    plan.config.seed = seed;
    plan
}

/// When case `seed`'s scheduler is killed and restarted from its journal, if it is: one case
/// in four, at a seeded moment of job time (a case that has ended by then runs without one).
fn restart_at(seed: u64) -> Option<Duration> {
    let mut rng = Rng::new(seed ^ 0x0005_eed0_f4e5_7a27);
    rng.next()
        .is_multiple_of(4)
        .then(|| Duration::from_millis(500 + rng.next() % 20_000))
}

/// The journal of case `seed`, in a folder of the test's own.
fn journal_path(seed: u64) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("rollfleet-fault-harness-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("case-{seed}.journal"))
}

fn journal_header(seed: u64) -> JournalHeader {
    JournalHeader {
        format: FORMAT.into(),
        job_yaml: job_yaml(),
        seed,
        time_scale: 1.0,
        lease_ttl_ms: 2000,
        expect_workers: POOLS.len() as u64,
        replan_on_drift: None,
        stage_timeout_ms: 30_000,
    }
}

/// What a case ran: the last scheduler's report, the metrics all of them counted into, and
/// whether the scheduler was killed and restarted from its journal.
struct Ran {
    report: Report,
    metrics: Arc<Metrics>,
    restarted: bool,
}

/// Runs case `seed` to its end on the paused clock. The workers reach the scheduler through a
/// relay, so that a scheduler killed mid-run (its task aborted, its queue lost, as a SIGKILL
/// loses them) is replaced by one replayed from its journal at the same address.
fn run_case(seed: u64) -> Ran {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let journal = journal_path(seed);
    let ran = runtime.block_on(async {
        let plan = Arc::new(plan_for(seed));
        let options = ActorOptions {
            time_scale: 1.0,
            lease_ttl: Duration::from_secs(2),
            expect_workers: POOLS.len(),
            report: None,
            replan_on_drift: None,
            until_stopped: false,
        };
        let status = Arc::new(watch::channel(JobStatus::default()).0);
        let mut watching = status.subscribe();
        let metrics = Arc::new(Metrics::new().unwrap());
        let mut actor = Actor::new(
            plan.clone(),
            options.clone(),
            status,
            metrics.clone(),
            Arc::new(FeedLog::default()),
        );
        // Only a case that restarts keeps a journal: writing one more than doubles a case.
        let restart = restart_at(seed);
        if restart.is_some() {
            actor.set_journal(JournalWriter::create(&journal, &journal_header(seed)).unwrap());
        }
        let (to_actor, events) = mpsc::unbounded_channel();
        let target = Arc::new(std::sync::Mutex::new(to_actor));
        let mut job = tokio::spawn(actor.run(events));
        let (inbox, mut relayed) = mpsc::unbounded_channel::<Event>();
        let relay_target = target.clone();
        tokio::spawn(async move {
            while let Some(event) = relayed.recv().await {
                let _ = relay_target.lock().unwrap().send(event);
            }
        });
        for (i, pool) in POOLS.iter().enumerate() {
            tokio::spawn(worker(
                inbox.clone(),
                pool,
                seed.wrapping_mul(31).wrapping_add(i as u64),
            ));
        }
        drop(inbox);
        let mut restarted = false;
        let mut ended = None;
        if let Some(at) = restart {
            match tokio::time::timeout(at, &mut job).await {
                Ok(report) => ended = Some(report),
                Err(_) => restarted = true,
            }
        }
        if restarted {
            // Killed: whatever was queued and not journaled is gone.
            job.abort();
            let _ = (&mut job).await;
            let status = Arc::new(watch::channel(JobStatus::default()).0);
            watching = status.subscribe();
            let mut actor = Actor::new(
                plan,
                options,
                status,
                metrics.clone(),
                Arc::new(FeedLog::default()),
            );
            let (_, mut reader) = JournalReader::open(&journal).unwrap().unwrap();
            actor
                .replay(&mut reader)
                .unwrap_or_else(|e| panic!("case {seed}: the journal does not replay: {e}"));
            actor.set_journal(JournalWriter::append(&journal, reader.valid_bytes()).unwrap());
            let (to_actor, events) = mpsc::unbounded_channel();
            *target.lock().unwrap() = to_actor;
            job = tokio::spawn(actor.run(events));
        }
        let ended = match ended {
            Some(report) => Ok(report),
            // Hours of job time: a case that has not ended by then is stuck.
            None => tokio::time::timeout(Duration::from_secs(4 * 3600), job).await,
        };
        match ended {
            Ok(Ok(report)) => Ran {
                report,
                metrics,
                restarted,
            },
            Ok(Err(e)) => panic!("case {seed}: the actor panicked: {e}"),
            Err(_) => panic!(
                "case {seed}: the job did not end in 4 hours of job time; it stands at {:?}",
                *watching.borrow()
            ),
        }
    });
    drop(runtime);
    let _ = std::fs::remove_file(&journal);
    ran
}

#[test]
fn seeded_faults_end_every_job_succeeded_with_every_trajectory_trained_once() {
    let seeds = rollfleet_rng::test_seeds("ROLLFLEET_FAULT", 1000);
    let started = std::time::Instant::now();
    let (mut restarts, mut hung_training, mut hung_weights) = (0, 0, 0);
    for &seed in &seeds {
        let reproduce = format!(
            "reproduce with: ROLLFLEET_FAULT_SEED={seed} cargo test -p rollfleet-server --test \
             fault_harness"
        );
        let Ran {
            report,
            restarted,
            metrics,
        } = run_case(seed);
        restarts += usize::from(restarted);
        hung_training += metrics
            .hung_assignments
            .with_label_values(&["training"])
            .get();
        hung_weights += metrics
            .hung_assignments
            .with_label_values(&["weights"])
            .get();
        assert_eq!(report.phase, "Succeeded", "case {seed}: {reproduce}");
        assert_eq!(report.policy_version, STEPS, "case {seed}: {reproduce}");
        assert_eq!(
            report.trained.len() as u64,
            STEPS * TRAIN_BATCH,
            "case {seed}: {reproduce}"
        );
        assert!(
            report.trained_twice.is_empty(),
            "case {seed}: trained twice: {:?}; {reproduce}",
            report.trained_twice
        );
        let mut trained = report.trained.clone();
        trained.sort_unstable();
        trained.dedup();
        assert_eq!(
            trained.len(),
            report.trained.len(),
            "case {seed}: {reproduce}"
        );
    }
    eprintln!(
        "{} cases ({restarts} with the scheduler killed and restarted from its journal, \
         {hung_training} training batches and {hung_weights} weight updates given up as hung) \
         in {:?}",
        seeds.len(),
        started.elapsed()
    );
    if seeds.len() >= 100 {
        assert!(
            restarts * 8 >= seeds.len(),
            "only {restarts} of {} cases restarted the scheduler before the job ended",
            seeds.len()
        );
        // A training batch and a weight update that never get an answer are each given up
        // after the bound (`Actor::give_up_hung`), and the job still succeeds.
        assert!(
            hung_training > 0 && hung_weights > 0,
            "{hung_training} training batches and {hung_weights} weight updates went \
             unanswered in {} cases: both kinds must be given up at least once",
            seeds.len()
        );
    }
}

/// A `tracing` writer into a shared buffer, to read what the scheduler logged.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_generation_answered_with_more_token_ids_than_the_context_fails_its_stage_naming_the_field_and_the_peer()
 {
    // The first seeds whose decode worker sends too many ids (the fault is drawn per
    // assignment, so most cases have one or none).
    let mut refused = 0;
    let mut lines = Vec::new();
    for seed in (0..40).filter(|&s| restart_at(s).is_none()) {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let Ran {
            report, metrics, ..
        } = tracing::subscriber::with_default(subscriber, || run_case(seed));
        // Nothing already accepted is lost: the job ends as every other case does.
        assert_eq!(report.phase, "Succeeded", "case {seed}");
        assert_eq!(
            report.trained.len() as u64,
            STEPS * TRAIN_BATCH,
            "case {seed}"
        );
        assert!(report.trained_twice.is_empty(), "case {seed}");
        refused += metrics.oversized_results.get();
        let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        lines.extend(
            log.lines()
                .filter(|l| l.contains("more than task"))
                .map(str::to_owned),
        );
        if refused >= 3 {
            break;
        }
    }
    assert!(
        refused >= 3,
        "only {refused} oversized results refused in 40 cases"
    );
    // A thread-local subscriber can miss the first events while the harness's other test, on
    // another thread, registers the same log site: at least one line, and never more lines
    // than refusals.
    assert!(
        !lines.is_empty() && lines.len() as u64 <= refused,
        "{refused} refused: {lines:#?}"
    );
    for line in &lines {
        // The field, its count, the limit and the peer (by number and hostname) are named.
        assert!(
            line.contains("output.tokens: 4097 values")
                && line.contains("contextLimit 4096")
                && ["(prefill@prefill-", "(decode@decode-"]
                    .iter()
                    .any(|peer| line.contains(peer))
                && line.contains(" answered assignment "),
            "{line}"
        );
    }
}
