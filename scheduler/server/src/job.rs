//! The one job a scheduler serves: given when it starts (`rollfleet scheduler JOB.yaml`), or by
//! the first valid `Submit` (`rollfleet scheduler` with no job, then `rollfleet job submit`).
//!
//! The slot is filled once. Until then workers that register wait in the actor's inbox (the actor
//! starts with the job), and the job and trainer-feed services answer that no job was submitted
//! yet. A resubmission of the same YAML is answered with the job's name, so a retried submit
//! creates nothing; any other job is refused: one scheduler runs one job.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::plan::{JobPlan, PlanError};

/// A job the scheduler took: its YAML as submitted and its plan.
#[derive(Debug)]
pub struct AcceptedJob {
    /// The YAML, to recognise a resubmission.
    pub yaml: String,
    /// The job, planned.
    pub plan: Arc<JobPlan>,
}

/// Why a submitted job was not taken.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The YAML is not a job this scheduler can run (its problems, with their field paths).
    #[error("{0}")]
    Invalid(#[from] PlanError),
    /// The scheduler runs another job already.
    #[error(
        "job_yaml: this scheduler runs job {running:?}; one scheduler runs one job: start another \
         scheduler for another job"
    )]
    Busy {
        /// The job it runs.
        running: String,
    },
}

/// Chooses the core's admission window for a planned job (`Policy::window_widening_quarters`),
/// by simulating it: the `rollfleet` binary gives one, so that this server does not link the
/// simulator. It must be a pure function of the plan (its seed included): a scheduler resumed
/// from its journal plans the job again and must decide alike.
pub trait WindowChooser: Send + Sync + std::fmt::Debug {
    /// The widening, in quarters of a rollout batch (negative: a narrowing); an error says why
    /// none could be chosen (the job then runs the core's rule).
    fn widening_quarters(&self, plan: &JobPlan) -> Result<i32, String>;
}

/// The slot a scheduler's job goes in, and how a job is planned for it.
#[derive(Debug)]
pub struct JobSlot {
    seed: u64,
    stage_timeout: Duration,
    /// Without one, a job runs the core's rule for its admission window.
    window: Option<Arc<dyn WindowChooser>>,
    chosen: watch::Sender<Option<Arc<AcceptedJob>>>,
}

impl JobSlot {
    /// An empty slot; jobs are planned with `seed` and presume a stage lost after
    /// `stage_timeout` of wall time.
    pub fn new(seed: u64, stage_timeout: Duration) -> JobSlot {
        JobSlot {
            seed,
            stage_timeout,
            window: None,
            chosen: watch::channel(None).0,
        }
    }

    /// The slot, its jobs' admission windows chosen by `window` (`None`: the core's rule).
    pub fn choosing_window(mut self, window: Option<Arc<dyn WindowChooser>>) -> JobSlot {
        self.window = window;
        self
    }

    /// The slot holding the job `yaml` from the start (`rollfleet scheduler JOB.yaml`).
    pub fn with_job(self, yaml: &str, origin: &str) -> Result<JobSlot, PlanError> {
        let plan = Arc::new(self.plan(yaml, origin)?);
        self.chosen.send_replace(Some(Arc::new(AcceptedJob {
            yaml: yaml.to_owned(),
            plan,
        })));
        Ok(self)
    }

    /// Plans `yaml` as this scheduler runs it.
    pub fn plan(&self, yaml: &str, origin: &str) -> Result<JobPlan, PlanError> {
        let mut plan = JobPlan::from_yaml(yaml, origin, self.seed)?;
        plan.config.stage_timeout =
            rollfleet_core::Span::from_secs_f64(self.stage_timeout.as_secs_f64());
        match &self.window {
            // The rule is always a window the job can run with: a choice that failed costs the
            // job its widening, not its run.
            Some(window) => match window.widening_quarters(&plan) {
                Ok(quarters) => Ok(plan.with_window_widening(quarters)),
                Err(why) => {
                    tracing::warn!(
                        job = plan.name(),
                        "admission window: none chosen ({why}); running the core's rule"
                    );
                    Ok(plan)
                }
            },
            None => Ok(plan),
        }
    }

    /// Takes `yaml` as the job when the slot is empty (planning it first), or recognises it as
    /// the job already taken. Planning takes seconds (more on a large job: the window chooser
    /// simulates it): call it off the async threads.
    pub fn accept(&self, yaml: &str, origin: &str) -> Result<Arc<AcceptedJob>, SubmitError> {
        if let Some(job) = self.job() {
            return Self::same(job, yaml, origin);
        }
        let job = Arc::new(AcceptedJob {
            yaml: yaml.to_owned(),
            plan: Arc::new(self.plan(yaml, origin)?),
        });
        let mut taken = None;
        self.chosen.send_if_modified(|slot| match slot {
            None => {
                *slot = Some(job.clone());
                true
            }
            Some(earlier) => {
                taken = Some(earlier.clone());
                false
            }
        });
        // Another submit may have filled the slot while this one planned.
        match taken {
            Some(earlier) => Self::same(earlier, yaml, origin),
            None => Ok(job),
        }
    }

    /// `job` when `yaml` is it again. Otherwise the submitter learns first what is wrong with
    /// its YAML, if anything, and then that this scheduler is taken.
    fn same(
        job: Arc<AcceptedJob>,
        yaml: &str,
        origin: &str,
    ) -> Result<Arc<AcceptedJob>, SubmitError> {
        if job.yaml.trim() == yaml.trim() {
            return Ok(job);
        }
        rollfleet_spec::parse_job(yaml.as_bytes(), origin).map_err(PlanError::from)?;
        Err(SubmitError::Busy {
            running: job.plan.name().to_owned(),
        })
    }

    /// The job taken, if any.
    pub fn job(&self) -> Option<Arc<AcceptedJob>> {
        self.chosen.borrow().clone()
    }

    /// The job's name, if a job was taken.
    pub fn name(&self) -> Option<String> {
        self.chosen
            .borrow()
            .as_ref()
            .map(|j| j.plan.name().to_owned())
    }

    /// Completes with the job once one is taken.
    pub async fn taken(&self) -> Arc<AcceptedJob> {
        let mut chosen = self.chosen.subscribe();
        loop {
            if let Some(job) = chosen.borrow_and_update().clone() {
                return job;
            }
            // The sender lives in `self`, so the channel cannot close while this waits.
            if chosen.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// The error a request about job `asked` gets when it is not this scheduler's job (`None`
    /// when it is).
    pub fn unknown(&self, asked: &str, field: &str) -> Option<String> {
        match self.name() {
            Some(name) if name == asked => None,
            Some(name) => Some(format!(
                "{field}: {} is not known here; this scheduler runs {name:?}",
                crate::quoted(asked)
            )),
            None => Some(format!(
                "{field}: {} is not known here; no job was submitted to this scheduler yet",
                crate::quoted(asked)
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quickstart() -> String {
        std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../examples/jobs/quickstart.yaml"
        ))
        .unwrap_or_default()
    }

    fn slot() -> JobSlot {
        JobSlot::new(0, Duration::from_secs(120))
    }

    #[test]
    fn the_first_valid_job_is_taken_and_the_same_yaml_again_is_recognised() {
        let slot = slot();
        assert!(slot.job().is_none());
        let job = slot
            .accept(&quickstart(), "submit")
            .map_err(|e| e.to_string());
        assert_eq!(
            job.map(|j| j.plan.name().to_owned()),
            Ok("quickstart".into())
        );
        let again = slot.accept(&format!("{}\n\n", quickstart()), "submit");
        assert!(again.is_ok(), "a resubmission is recognised: {again:?}");
        assert_eq!(slot.name().as_deref(), Some("quickstart"));
        assert_eq!(
            slot.job().map(|j| j.plan.config.stage_timeout),
            Some(rollfleet_core::Span::from_secs_f64(120.0))
        );
    }

    #[test]
    fn an_invalid_job_leaves_the_slot_empty_and_says_which_field_is_wrong() {
        let slot = slot();
        let broken = quickstart().replace("groupSize: ", "groupSize: -");
        let err = slot.accept(&broken, "submit").map(|_| ()).unwrap_err();
        assert!(matches!(err, SubmitError::Invalid(_)));
        assert!(err.to_string().contains("groupSize"), "{err}");
        assert!(slot.job().is_none());
        assert!(slot.accept(&quickstart(), "submit").is_ok());
    }

    #[test]
    fn another_job_is_refused_while_one_is_taken_naming_the_one_it_runs() {
        let slot = slot();
        assert!(slot.accept(&quickstart(), "submit").is_ok());
        let other = quickstart().replace("name: quickstart", "name: another");
        let err = slot.accept(&other, "submit").map(|_| ()).unwrap_err();
        assert!(matches!(&err, SubmitError::Busy { running } if running == "quickstart"));
        // An invalid one is told what is wrong with it first.
        let broken = other.replace("groupSize: ", "groupSize: -");
        let err = slot.accept(&broken, "submit").map(|_| ()).unwrap_err();
        assert!(matches!(err, SubmitError::Invalid(_)), "{err}");
        assert_eq!(slot.name().as_deref(), Some("quickstart"));
    }

    /// A chooser that answers the same whatever the plan.
    #[derive(Debug)]
    struct Fixed(Result<i32, String>);

    impl WindowChooser for Fixed {
        fn widening_quarters(&self, _plan: &JobPlan) -> Result<i32, String> {
            self.0.clone()
        }
    }

    #[test]
    fn a_job_runs_the_window_its_chooser_gives_and_the_cores_rule_when_the_choice_fails() {
        let chosen = slot().choosing_window(Some(Arc::new(Fixed(Ok(2)))));
        let job = chosen
            .accept(&quickstart(), "submit")
            .map_err(|e| e.to_string());
        assert_eq!(job.map(|j| j.plan.policy().window_widening_quarters), Ok(2));
        // Without a chooser, the core's rule.
        let plain = slot()
            .plan(&quickstart(), "submit")
            .map_err(|e| e.to_string());
        assert_eq!(plain.map(|p| p.policy().window_widening_quarters), Ok(0));
        let failing =
            slot().choosing_window(Some(Arc::new(Fixed(Err("the simulation stopped".into())))));
        let job = failing
            .accept(&quickstart(), "submit")
            .map_err(|e| e.to_string());
        assert_eq!(job.map(|j| j.plan.policy().window_widening_quarters), Ok(0));
        assert_eq!(failing.name().as_deref(), Some("quickstart"));
    }

    #[test]
    fn questions_about_another_job_are_answered_with_what_this_scheduler_runs() {
        let slot = slot();
        let before = slot.unknown("quickstart", "job");
        assert!(before.is_some_and(|m| m.contains("no job was submitted")));
        assert!(slot.accept(&quickstart(), "submit").is_ok());
        assert_eq!(slot.unknown("quickstart", "job"), None);
        let other = slot.unknown("other", "job").unwrap_or_default();
        assert!(
            other.contains("\"other\"") && other.contains("runs \"quickstart\""),
            "{other}"
        );
    }
}
