//! A job's phase as people read it, and whether it has ended.

use crate::v1::JobPhase;

impl JobPhase {
    /// The phase by the name the report, the CLI and the operator print (`Succeeded`, ...).
    pub fn name(self) -> &'static str {
        match self {
            JobPhase::Unspecified => "Unspecified",
            JobPhase::Pending => "Pending",
            JobPhase::Running => "Running",
            JobPhase::Succeeded => "Succeeded",
            JobPhase::Failed => "Failed",
            JobPhase::Cancelled => "Cancelled",
        }
    }

    /// Whether a job in this phase has ended: succeeded, failed or cancelled.
    pub fn ended(self) -> bool {
        matches!(
            self,
            JobPhase::Succeeded | JobPhase::Failed | JobPhase::Cancelled
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_succeeded_failed_and_cancelled_jobs_have_ended() {
        let ended: Vec<_> = [
            JobPhase::Unspecified,
            JobPhase::Pending,
            JobPhase::Running,
            JobPhase::Succeeded,
            JobPhase::Failed,
            JobPhase::Cancelled,
        ]
        .into_iter()
        .filter(|p| p.ended())
        .map(JobPhase::name)
        .collect();
        assert_eq!(ended, ["Succeeded", "Failed", "Cancelled"]);
    }
}
