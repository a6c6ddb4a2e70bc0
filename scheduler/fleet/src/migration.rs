//! Migration waves: how a running placement moves to a new plan without stopping rollout.
//!
//! The planner decides the waves ([`rollfleet_planner::replan::migration`]: at most
//! [`PER_WAVE`] serving replicas per wave, starting before stopping); [`sim_waves`] turns them
//! into the core's terms, the replicas to start with their configuration and the ones to retire.
//! The simulator carries them out on its virtual clock and the scheduler on the wall clock, with
//! the same figures, so a re-plan moves the same replicas in both.

use rollfleet_core::{ReplicaConfig, ServeRole};
use rollfleet_planner::plan;
use rollfleet_planner::predict::{Candidate, Problem, Role};
use rollfleet_planner::replan;

/// Serving replicas the re-plan changes per wave.
pub const PER_WAVE: u32 = 4;

/// Share of the predicted step a new plan must save to be worth moving to: a plan that only
/// ties (the search often finds another placement of the same predicted step) moves replicas
/// for nothing.
pub const MIN_GAIN: f64 = 0.05;

/// One wave of a migration.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MigrationWave {
    /// Replicas to start.
    pub start: Vec<ReplicaConfig>,
    /// Replicas to retire: so many of the given pool, role and size (highest-numbered first).
    pub stop: Vec<RetireGroup>,
    /// The trainer's GPUs once the wave is done, when the wave resizes it (on its own pool):
    /// training batches dispatched from then on run on that many.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trainer_gpus: Option<u32>,
}

/// Replicas of one kind to retire.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct RetireGroup {
    /// Spec pool index.
    pub pool: u32,
    /// Role.
    pub role: ServeRole,
    /// GPUs per replica.
    pub gpus: u32,
    /// How many.
    pub replicas: u32,
}

/// The core's role for a planner role, as [`plan::placement`] maps it for a candidate.
fn serve_role(c: &Candidate, role: Role) -> ServeRole {
    let disaggregated = c
        .groups
        .iter()
        .any(|g| g.role == Role::Prefill && g.replicas > 0);
    match role {
        Role::Prefill => ServeRole::Prefill,
        Role::Decode if disaggregated => ServeRole::Decode,
        Role::Decode | Role::Generate => ServeRole::Generate,
    }
}

/// The planner's waves in the simulator's terms: started replicas with their configuration as
/// the target placement has it, stopped ones by pool, role and size as the running one has them.
pub fn sim_waves(
    p: &Problem,
    from: &Candidate,
    to: &Candidate,
    waves: &[replan::Wave],
) -> Vec<MigrationWave> {
    let target = plan::placement(p, to);
    let spec_index = |pool: usize| p.gpu_pools.get(pool).map_or(0, |g| g.spec_index as u32);
    let mut trainer = from.trainer_gpus;
    waves
        .iter()
        .map(|w| MigrationWave {
            trainer_gpus: (w.trainer_gpus != trainer).then(|| {
                trainer = w.trainer_gpus;
                trainer
            }),
            start: w
                .start
                .iter()
                .flat_map(|g| {
                    let (pool, role) = (spec_index(g.pool), serve_role(to, g.role));
                    let config = target
                        .replicas
                        .iter()
                        .find(|r| r.pool == pool && r.role == role && r.gpus == g.tp)
                        .cloned();
                    std::iter::repeat_n(config, g.replicas as usize).flatten()
                })
                .collect(),
            stop: w
                .stop
                .iter()
                .map(|g| RetireGroup {
                    pool: spec_index(g.pool),
                    role: serve_role(from, g.role),
                    gpus: g.tp,
                    replicas: g.replicas,
                })
                .collect(),
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use rollfleet_planner::predict::Group;
    use rollfleet_planner::roofline::Efficiency;
    use rollfleet_planner::search;
    use rollfleet_spec::JobSpec;

    use super::*;
    use crate::workload::mean;

    fn job() -> rollfleet_spec::ValidatedJob {
        let text = include_str!("../../../examples/jobs/rollart-agentic.yaml");
        rollfleet_spec::parse_job(text.as_bytes(), "rollart-agentic.yaml").unwrap()
    }

    /// The planner's problem after `added` GPUs join the pool named `pool`, the plan running
    /// before they came, and the plan for the bigger cluster (the trainer kept on its pool).
    fn grown(
        job: &rollfleet_spec::ValidatedJob,
        pool: &str,
        added: i64,
    ) -> (Problem, Candidate, Candidate) {
        let spec = job.spec();
        let p = plan::problem(spec, &job.catalog, &mean, &Efficiency::default()).unwrap();
        let running = search::choose(&p).unwrap().candidate;
        let mut bigger: JobSpec = spec.clone();
        let grown_pool = bigger.pools.iter_mut().find(|p| p.name == pool).unwrap();
        grown_pool.count = Some(grown_pool.count.unwrap_or(0) + added);
        let p2 = plan::problem(&bigger, &job.catalog, &mean, &Efficiency::default()).unwrap();
        let found = search::choose(&p2).unwrap();
        let target = replan::on_trainer_pool(&p2, &running, found)
            .unwrap()
            .candidate;
        (p2, running, target)
    }

    #[test]
    fn a_wave_stops_no_more_replicas_than_per_wave_and_starts_only_replicas_of_the_target() {
        let job = job();
        let (p, running, target) = grown(&job, "h20", 80);
        let planned = replan::migration(&p, &running, &target, PER_WAVE);
        let waves = sim_waves(&p, &running, &target, &planned);
        assert_eq!(waves.len(), planned.len());
        assert!(waves.iter().any(|w| !w.start.is_empty()), "{waves:?}");
        let target_replicas = plan::placement(&p, &target).replicas;
        for wave in &waves {
            let stopped: u32 = wave.stop.iter().map(|g| g.replicas).sum();
            assert!(stopped <= PER_WAVE, "{wave:?}");
            for started in &wave.start {
                assert!(
                    target_replicas.contains(started),
                    "{started:?} is not in the target"
                );
            }
        }
    }

    #[test]
    fn every_replica_the_planner_starts_becomes_one_started_replica() {
        let job = job();
        let (p, running, target) = grown(&job, "h20", 80);
        let planned = replan::migration(&p, &running, &target, PER_WAVE);
        let waves = sim_waves(&p, &running, &target, &planned);
        for (wave, planned) in waves.iter().zip(&planned) {
            let planned_starts: u32 = planned.start.iter().map(|g| g.replicas).sum();
            assert_eq!(wave.start.len() as u32, planned_starts);
            let planned_stops: u32 = planned.stop.iter().map(|g| g.replicas).sum();
            assert_eq!(
                wave.stop.iter().map(|g| g.replicas).sum::<u32>(),
                planned_stops
            );
        }
    }

    #[test]
    fn only_the_wave_that_resizes_the_trainer_names_its_new_size() {
        let job = job();
        let (p, running, _) = grown(&job, "h20", 80);
        let keep = running.trainer_gpus;
        let wave = |trainer_gpus| replan::Wave {
            start: vec![],
            stop: vec![],
            trainer_gpus,
        };
        let planned = [wave(keep), wave(keep + 8), wave(keep + 8), wave(keep)];
        let waves = sim_waves(&p, &running, &running, &planned);
        let sizes: Vec<Option<u32>> = waves.iter().map(|w| w.trainer_gpus).collect();
        assert_eq!(sizes, vec![None, Some(keep + 8), None, Some(keep)]);
    }

    #[test]
    fn decode_replicas_decode_only_beside_prefill_replicas_and_generate_otherwise() {
        let group = |role, replicas| Group {
            pool: 0,
            role,
            tp: 1,
            replicas,
        };
        let candidate = |groups| Candidate {
            groups,
            trainer_pool: 0,
            trainer_gpus: 1,
        };
        let disaggregated = candidate(vec![group(Role::Prefill, 2), group(Role::Decode, 4)]);
        assert_eq!(serve_role(&disaggregated, Role::Decode), ServeRole::Decode);
        assert_eq!(
            serve_role(&disaggregated, Role::Prefill),
            ServeRole::Prefill
        );
        // A prefill group with no replica left does not make the decode replicas decode-only.
        let colocated = candidate(vec![group(Role::Prefill, 0), group(Role::Decode, 4)]);
        assert_eq!(serve_role(&colocated, Role::Decode), ServeRole::Generate);
        assert_eq!(serve_role(&colocated, Role::Generate), ServeRole::Generate);
    }
}
