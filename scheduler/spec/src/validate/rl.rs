//! The RL section: the batch, group and staleness settings and their limits.

use super::*;

pub(super) fn check_rl(spec: &JobSpec, problems: &mut Problems) {
    let rl = &spec.rl;
    let batch = "trajectories (far past published RL batches; the simulator and the planner work \
                 through every trajectory of a step)";
    problems.within(
        "spec.rl.groupSize",
        rl.group_size,
        1,
        MAX_GROUP_SIZE,
        "trajectories (GRPO groups hold 4 to 64)",
    );
    problems.within(
        "spec.rl.rolloutBatchSize",
        rl.rollout_batch_size,
        1,
        MAX_BATCH_SIZE,
        batch,
    );
    problems.within(
        "spec.rl.trainBatchSize",
        rl.train_batch_size,
        1,
        MAX_BATCH_SIZE,
        batch,
    );
    problems.within(
        "spec.rl.maxStaleness",
        rl.max_staleness,
        0,
        MAX_STALENESS,
        "policy versions (asynchronous RL stays within a handful)",
    );
    problems.within(
        "spec.rl.steps",
        rl.steps,
        1,
        MAX_STEPS,
        "steps (published RL runs take hundreds to thousands)",
    );
    problems.finite_in("spec.rl.overProvisioning", rl.over_provisioning, 0.0, 4.0);
    if !rl.train_mfu.is_finite() || rl.train_mfu <= 0.0 || rl.train_mfu > 1.0 {
        problems.error(
            "spec.rl.trainMfu",
            format!("must be in (0, 1], got {}", rl.train_mfu),
        );
    }
    if rl.group_size >= 1 && rl.rollout_batch_size >= 1 && rl.train_batch_size >= 1 {
        if rl.rollout_batch_size % rl.group_size != 0 {
            problems.error(
                "spec.rl.rolloutBatchSize",
                format!(
                    "must be a multiple of groupSize ({}) so that every group is complete, got {}",
                    rl.group_size, rl.rollout_batch_size
                ),
            );
        }
        if rl.train_batch_size % rl.group_size != 0 {
            problems.error(
                "spec.rl.trainBatchSize",
                format!(
                    "must be a multiple of groupSize ({}), got {}",
                    rl.group_size, rl.train_batch_size
                ),
            );
        }
        if rl.rollout_batch_size % rl.train_batch_size != 0 {
            problems.error(
                "spec.rl.trainBatchSize",
                format!(
                    "must divide rolloutBatchSize ({}), got {}",
                    rl.rollout_batch_size, rl.train_batch_size
                ),
            );
        }
    }
}
