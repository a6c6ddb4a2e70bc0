//! When a job fails for its infrastructure: the rule the scheduler server and the simulator share.
//!
//! The core gives a group up when one of its trajectories fails `stage_failure_limit` times in a
//! row (its `AbandonGroup` command). One group given up is that trajectory's problem; many in a
//! row with no batch trained between them are the fleet's (an environment that cannot start, a
//! reward function that always errs, an engine that answers nothing), and sampling more groups
//! would only repeat them: the job fails, saying why.

/// Groups given up in a row that fail a job, however small its rollout batch.
pub const MIN_GROUPS_GIVEN_UP: u64 = 4;

/// Counts the groups given up since the last batch trained, and says when the job fails.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupsGivenUp {
    in_a_row: u64,
    limit: u64,
    failed: bool,
}

impl GroupsGivenUp {
    /// The rule for a job whose RL step samples `rollout_batch_size` trajectories in groups of
    /// `group_size`: the job fails when a step's worth of groups (at least
    /// [`MIN_GROUPS_GIVEN_UP`]) is given up with no batch trained in between.
    pub fn new(rollout_batch_size: u32, group_size: u32) -> GroupsGivenUp {
        GroupsGivenUp {
            in_a_row: 0,
            limit: u64::from(rollout_batch_size / group_size.max(1)).max(MIN_GROUPS_GIVEN_UP),
            failed: false,
        }
    }

    /// Groups given up in a row that fail the job.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// A group was given up; `last_failure` is why its trajectory failed the last time (empty
    /// for a timeout). Returns why the job fails, once: the first time the limit is reached.
    pub fn given_up(&mut self, last_failure: &str) -> Option<String> {
        self.in_a_row += 1;
        if self.failed || self.in_a_row < self.limit {
            return None;
        }
        self.failed = true;
        Some(format!(
            "{} groups in a row were given up with no batch trained in between, so the fault is \
             not one trajectory's; the last one's failure: {}",
            self.limit,
            if last_failure.is_empty() {
                "a timeout"
            } else {
                last_failure
            }
        ))
    }

    /// A batch was trained: the groups given up before it do not count against the next.
    pub fn trained(&mut self) {
        self.in_a_row = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_fails_once_a_steps_worth_of_groups_is_given_up_in_a_row() {
        // 64 trajectories in groups of 8: 8 groups a step.
        let mut rule = GroupsGivenUp::new(64, 8);
        assert_eq!(rule.limit(), 8);
        for _ in 0..7 {
            assert_eq!(rule.given_up("env crashed"), None);
        }
        let reason = rule
            .given_up("env crashed")
            .expect("the eighth group fails the job");
        assert!(reason.starts_with("8 groups in a row"), "{reason}");
        assert!(
            reason.ends_with("the last one's failure: env crashed"),
            "{reason}"
        );
        // It says so once.
        assert_eq!(rule.given_up("env crashed"), None);
    }

    #[test]
    fn a_trained_batch_forgives_the_groups_given_up_before_it() {
        let mut rule = GroupsGivenUp::new(64, 8);
        for _ in 0..7 {
            assert_eq!(rule.given_up(""), None);
        }
        rule.trained();
        for _ in 0..7 {
            assert_eq!(rule.given_up(""), None);
        }
        let reason = rule.given_up("").expect("eight in a row after the batch");
        assert!(reason.ends_with("a timeout"), "{reason}");
    }

    #[test]
    fn a_small_job_still_tolerates_a_few_groups_given_up() {
        // One group a step: one lost group must not fail the job.
        let mut rule = GroupsGivenUp::new(8, 8);
        assert_eq!(rule.limit(), MIN_GROUPS_GIVEN_UP);
        assert_eq!(rule.given_up(""), None);
        // A group size of zero (refused by validation) does not divide by zero.
        assert_eq!(GroupsGivenUp::new(8, 0).limit(), 8);
    }
}
