//! How rollfleet's groups lived in a simulated run, per task, and the planner's model of the
//! same beside it (`rollfleet sim`'s group-lives table).
#![allow(clippy::unwrap_used)]

use rollfleet_sim::{Baseline, OutputFormat, SimArgs};

mod common;
use common::example;

fn f(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap()
}

#[test]
fn every_trained_group_is_booked_under_its_task_with_its_members_slowest_member_and_slot() {
    let path = example("quickstart.yaml");
    let job = rollfleet_spec::load_job_file(&path).unwrap();
    let args = SimArgs {
        baselines: vec![Baseline::Rollfleet],
        ..SimArgs::new(path)
    };
    let mut out = Vec::new();
    rollfleet_sim::run(&args, OutputFormat::Json, &mut out, &mut Vec::new()).unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let lives = report["group_lives"].as_array().unwrap();
    let tasks: Vec<&str> = job.spec().tasks.iter().map(|t| t.name.as_str()).collect();
    let named: Vec<&str> = lives.iter().map(|l| l["task"].as_str().unwrap()).collect();
    assert_eq!(named, tasks);

    let consumed = report["policies"][0]["core"]["trajectories_consumed"]
        .as_u64()
        .unwrap();
    let groups: u64 = lives.iter().map(|l| l["groups"].as_u64().unwrap()).sum();
    assert_eq!(
        groups * u64::try_from(job.spec().rl.group_size).unwrap(),
        consumed
    );

    // The model's wait for the trainer is a batch's fill and the trainer's queue, whatever the
    // task.
    let model_wait = f(&lives[0]["model"]["trainer_wait_s"]);
    assert!(model_wait > 0.0, "{lives:?}");
    for life in lives {
        assert_eq!(f(&life["model"]["trainer_wait_s"]), model_wait, "{life}");
        let (member, group) = (f(&life["member_s"]), f(&life["group_s"]));
        let (done, wait, slot) = (
            f(&life["until_done_s"]),
            f(&life["trainer_wait_s"]),
            f(&life["slot_s"]),
        );
        assert!(
            0.0 < member && member <= group && group <= done + 1e-9,
            "{life}"
        );
        assert!(wait >= 0.0 && (slot - done - wait).abs() < 1e-9, "{life}");
        // The planner predicted the run's placement, so its model of each task is beside it.
        let model = &life["model"];
        let (m_member, m_group) = (f(&model["member_s"]), f(&model["group_s"]));
        assert!(
            0.0 < m_member && m_member <= m_group && m_group <= f(&model["until_done_s"]) + 1e-9,
            "{life}"
        );
    }
}

#[test]
fn the_table_shows_each_task_simulated_beside_the_model_with_its_error() {
    let args = SimArgs {
        baselines: vec![Baseline::Rollfleet],
        ..SimArgs::new(example("quickstart.yaml"))
    };
    let mut out = Vec::new();
    rollfleet_sim::run(&args, OutputFormat::Table, &mut out, &mut Vec::new()).unwrap();
    let table = String::from_utf8(out).unwrap();
    let section = table
        .split("how rollfleet's groups lived")
        .nth(1)
        .unwrap_or_else(|| panic!("{table}"));
    for task in ["sokoban", "frozenlake", "unit-conversion"] {
        let row = section
            .lines()
            .find(|l| l.trim_start().starts_with(task))
            .unwrap_or_else(|| panic!("{section}"));
        // Four simulated / model pairs, each with its error.
        assert_eq!(row.matches(" / ").count(), 4, "{row}");
        assert_eq!(row.matches('%').count(), 4, "{row}");
    }
}
