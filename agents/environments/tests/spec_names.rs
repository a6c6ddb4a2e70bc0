//! The job spec's list of built-in environments is this crate's: validation accepts exactly
//! the kinds every CPU worker runs without being told anything.

use rollfleet_environments::{BUILTIN_KINDS, builtin};

#[test]
fn the_job_specs_built_in_environments_are_exactly_the_ones_this_crate_builds() {
    let mut ours = BUILTIN_KINDS.to_vec();
    ours.sort_unstable();
    assert_eq!(ours, rollfleet_spec::BUILTIN_ENVIRONMENTS);
    for kind in rollfleet_spec::BUILTIN_ENVIRONMENTS {
        assert!(builtin(kind).is_some(), "{kind} is not built in");
    }
}
