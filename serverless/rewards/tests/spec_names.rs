//! The job spec's list of reward functions is this crate's: validation accepts exactly the
//! `function` names the reward workers can run.

use rollfleet_rewards::RewardFunction;

#[test]
fn the_job_specs_reward_functions_are_exactly_the_ones_this_crate_implements() {
    let mut ours: Vec<&str> = RewardFunction::ALL.iter().map(|f| f.name()).collect();
    ours.sort_unstable();
    assert_eq!(ours, rollfleet_spec::BUILTIN_REWARD_FUNCTIONS);
    for name in rollfleet_spec::BUILTIN_REWARD_FUNCTIONS {
        assert!(RewardFunction::from_name(name).is_some(), "{name}");
    }
}
