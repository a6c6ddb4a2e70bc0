//! The planner end to end on job specs: where each role goes, exactness against brute force,
//! infeasible inputs, determinism.

use rollfleet_planner::plan::{self, PlanError};
use rollfleet_planner::predict::{self, Role};
use rollfleet_planner::roofline::Efficiency;
use rollfleet_planner::{compare, search};
use rollfleet_spec::{Distribution, JobSpec, ValidatedJob, parse_job};

fn mean(d: &Distribution) -> f64 {
    d.mean().unwrap_or(0.0)
}

/// A RollArt-like job (the example's task mix without trace columns), on the given pools.
fn job(model: &str, pools: &str) -> ValidatedJob {
    let yaml = format!(
        r#"
apiVersion: rollfleet.dev/v1alpha1
kind: RLJob
metadata: {{ name: planner-test }}
spec:
  model: {model}
  rl: {{ groupSize: 8, rolloutBatchSize: 1024, trainBatchSize: 256, maxStaleness: 2, overProvisioning: 0.25, steps: 5 }}
  tasks:
    - name: swe
      environment: swe-sandbox
      share: 0.5
      maxTurns: 30
      turns: {{ distribution: uniform, min: 8, max: 30 }}
      promptTokens: {{ distribution: lognormal, median: 3000, p99: 9000, max: 12000 }}
      actionTokens: {{ distribution: lognormal, median: 300, p99: 2000, max: 4096 }}
      observationTokens: {{ distribution: lognormal, median: 600, p99: 4000, max: 8000 }}
      contextLimit: 65536
      envStepMs: {{ distribution: lognormal, median: 2500, p99: 30000, max: 120000 }}
      envCpus: 2
      reward: unit-tests
    - name: sokoban
      environment: sokoban
      share: 0.5
      maxTurns: 20
      promptTokens: 400
      actionTokens: {{ distribution: lognormal, median: 200, p99: 1500, max: 2048 }}
      observationTokens: 150
      contextLimit: 16384
      envStepMs: {{ distribution: uniform, min: 2, max: 20 }}
      reward: env-score
  environments:
    - {{ name: swe-sandbox, servedBy: remote }}
  rewards:
    - {{ name: unit-tests, runsOn: serverless, pool: lambda, function: code_tests, latencyMs: 4000, memoryMb: 2048 }}
    - {{ name: env-score, runsOn: environment, latencyMs: 0 }}
  network: {{ crossPoolGBps: 50 }}
  pools:
{pools}
    - {{ name: env-nodes, cpu: c7i.16xlarge, count: 48 }}
    - {{ name: lambda, serverless: aws-lambda, concurrency: 800 }}
"#
    );
    parse_job(yaml.as_bytes(), "test").unwrap_or_else(|e| panic!("{e}"))
}

const QWEN_32B: &str = "{ name: Qwen3-32B, parameters: 32.8e9, layers: 64, hiddenSize: 5120, kvHeads: 8, headDim: 128 }";
const QWEN_7B: &str = "{ name: Qwen2.5-7B, parameters: 7.61e9, layers: 28, hiddenSize: 3584, kvHeads: 4, headDim: 128 }";

fn spec(job: &ValidatedJob) -> &JobSpec {
    job.spec()
}

#[test]
fn training_goes_to_the_compute_rich_pool_and_the_bandwidth_rich_pool_serves() {
    let job = job(
        QWEN_32B,
        "    - { name: h800, gpu: H800, count: 192 }\n    - { name: h20, gpu: H20, count: 320 }",
    );
    let plan = plan::plan(spec(&job), &job.catalog, &mean).unwrap();
    let c = &plan.candidate;
    // Pool 0 is the H800s, pool 1 the H20s.
    assert_eq!(c.trainer_pool, 0, "{plan:#?}");
    assert!(
        c.groups
            .iter()
            .any(|g| g.pool == 1 && g.role != Role::Prefill && g.replicas > 0),
        "{:#?}",
        c.groups
    );
    let serving = plan.roles.iter().find(|r| r.pool == "h20").unwrap();
    assert!(serving.why.contains("bandwidth-bound"), "{}", serving.why);
    let train = plan.roles.iter().find(|r| r.role == "train").unwrap();
    assert!(train.why.contains("compute-bound"), "{}", train.why);
    // Every replica holds the weights plus a longest context in its GPUs.
    for r in &plan.placement.replicas {
        assert!(r.kv_capacity_tokens >= 65_536, "{r:?}");
    }
}

/// Small inventories: two or three pools of a few GPUs each, different products and node sizes.
fn small_inventories() -> Vec<(&'static str, String)> {
    let cases = [
        ("H800 8 + H20 8", "H800", 8, "H20", 8, None),
        ("H800 16 + H20 8", "H800", 16, "H20", 8, None),
        ("H100 8 + L20 16", "H100", 8, "L20", 16, None),
        (
            "B200 8 + H20 16 + A100 8",
            "B200",
            8,
            "H20",
            16,
            Some(("A100-80G", 8)),
        ),
        (
            "H200 4 + H20 4 + L40S 8",
            "H200",
            4,
            "H20",
            4,
            Some(("L40S", 8)),
        ),
    ];
    cases
        .into_iter()
        .map(|(name, a, na, b, nb, c)| {
            let mut pools = format!(
                "    - {{ name: a, gpu: {a}, count: {na}, gpusPerNode: 4 }}\n    - {{ name: b, gpu: {b}, count: {nb}, gpusPerNode: 4 }}"
            );
            if let Some((g, n)) = c {
                pools.push_str(&format!(
                    "\n    - {{ name: c, gpu: {g}, count: {n}, gpusPerNode: 4 }}"
                ));
            }
            (name, pools)
        })
        .collect()
}

#[test]
fn branch_and_bound_finds_the_brute_force_optimum_on_small_instances() {
    let mut checked = 0;
    for model in [QWEN_7B, QWEN_32B] {
        for (name, pools) in small_inventories() {
            let job = job(model, &pools);
            // Tensor-parallel degrees searched too: the larger space.
            let Ok(p) = plan::problem_with(
                spec(&job),
                &job.catalog,
                &mean,
                &Efficiency::default(),
                true,
                &Default::default(),
            ) else {
                continue;
            };
            let exact = search::solve_within(&p, 0.0);
            let brute = search::brute_force(&p);
            let default = search::solve(&p);
            if let (Some(d), Some(b)) = (&default, &brute) {
                assert!(
                    d.step_s <= b.step_s * (1.0 + search::DEFAULT_GAP) + 1e-12,
                    "{name}: {d:?} {b:?}"
                );
            }
            match (exact, brute) {
                (Some(e), Some(b)) => {
                    let gap = (e.step_s - b.step_s) / b.step_s;
                    println!(
                        "{name}: branch and bound {:.6} s ({} nodes), brute force {:.6} s ({} nodes), gap {gap:.2e}",
                        e.step_s, e.nodes, b.step_s, b.nodes
                    );
                    assert!(gap.abs() < 1e-9, "{name}: gap {gap}");
                    assert!(e.nodes <= b.nodes, "{name}: pruning explored more");
                    // The reported optimum is the predictor's figure for that candidate.
                    let again = predict::step_time(&p, &e.candidate).unwrap();
                    assert_eq!(again, e.step_s);
                    checked += 1;
                }
                (None, None) => {}
                (e, b) => panic!("{name}: one search found a plan, the other not: {e:?} {b:?}"),
            }
        }
    }
    assert!(checked >= 6, "only {checked} instances were feasible");
}

#[test]
fn a_model_that_fits_nowhere_is_an_error_naming_the_pool_and_the_bytes_short() {
    // 300B parameters in BF16: 600 GB of weights; one node of 8 L20 has 8 x 48 x 0.9 = 345.6 GB.
    // (Spec validation rejects this too; the planner must also say it for an `--inventory`.)
    let job = job(
        QWEN_7B,
        "    - { name: l20s, gpu: L20, count: 64 }\n    - { name: l40s, gpu: L40S, count: 16, gpusPerNode: 4 }",
    );
    let mut huge = spec(&job).clone();
    huge.model.parameters = 300e9;
    huge.model.layers = 96;
    huge.model.hidden_size = 16384;
    huge.model.kv_heads = 8;
    let err = plan::plan(&huge, &job.catalog, &mean).unwrap_err();
    let PlanError::DoesNotFit {
        ref pool,
        usable_gb,
        short_gb,
        needed_gb,
        ..
    } = err
    else {
        panic!("{err}");
    };
    assert_eq!(pool, "l20s");
    assert!((usable_gb - 345.6).abs() < 1e-9, "{usable_gb}");
    // 600 GB + 2 x 96 x 8 x 128 x 2 bytes x 65,536 tokens = 600 + 25.77 GB.
    assert!((needed_gb - (600.0 + 393_216.0 * 65_536.0 / 1e9)).abs() < 1e-6);
    assert!((short_gb - (needed_gb - 345.6)).abs() < 1e-9);
    let message = err.to_string();
    assert!(
        message.contains("pool \"l20s\"") && message.contains("GB short"),
        "{message}"
    );
}

#[test]
fn a_pool_too_small_to_hold_the_training_state_is_named() {
    // 32.8B x 16 bytes = 524.8 GB to train; 4 H20s hold 4 x 96 x 0.9 = 345.6 GB.
    let job = job(
        QWEN_32B,
        "    - { name: tiny, gpu: H20, count: 4, gpusPerNode: 4 }",
    );
    let err = plan::plan(spec(&job), &job.catalog, &mean).unwrap_err();
    match err {
        PlanError::NoTrainer {
            ref pool, short_gb, ..
        } => {
            assert_eq!(pool, "tiny");
            assert!((short_gb - (524.8 - 345.6)).abs() < 1e-9, "{short_gb}");
        }
        other => panic!("{other}"),
    }
}

#[test]
fn a_measured_profile_slower_than_the_model_slows_the_prediction() {
    use rollfleet_planner::profile::{MIN_SAMPLES, Origin, ProfileStore};
    use rollfleet_planner::roofline::{WorkKind, decode_step};
    let job = job(
        QWEN_32B,
        "    - { name: h800, gpu: H800, count: 64 }\n    - { name: h20, gpu: H20, count: 96 }",
    );
    let model = plan::plan(spec(&job), &job.catalog, &mean).unwrap();
    // H20 decode measured at 40% of peak bandwidth instead of the model's 80%.
    let mut store = ProfileStore::default();
    let work = decode_step(&spec(&job).model, 8.0, 4096.0);
    let h20 = job.catalog.gpu("H20").unwrap();
    let at_peak = work.seconds(h20.peak_flops(), h20.memory_bandwidth_bytes_per_s());
    for _ in 0..MIN_SAMPLES {
        store.record(
            WorkKind::Decode,
            "h20",
            work,
            h20.peak_flops(),
            h20.memory_bandwidth_bytes_per_s(),
            at_peak / 0.4,
            Origin::Hardware,
        );
    }
    let p = plan::problem_profiled(
        spec(&job),
        &job.catalog,
        &mean,
        &Efficiency::default(),
        &store,
    )
    .unwrap();
    let h20_pool = p.gpu_pools.iter().find(|g| g.name == "h20").unwrap();
    assert!((h20_pool.rates.bandwidth - 0.4 * 4000e9).abs() < 1e-3);
    let slower = search::solve(&p).unwrap();
    assert!(
        slower.step_s > model.prediction.step_s,
        "{} vs {}",
        slower.step_s,
        model.prediction.step_s
    );
}

#[test]
fn a_measured_share_beyond_the_margin_is_drift_and_one_within_it_is_not() {
    use rollfleet_planner::profile::{Estimate, Origin, ProfileStore};
    use rollfleet_planner::replan::drift;
    use rollfleet_planner::roofline::WorkKind;
    let job = job(
        QWEN_32B,
        "    - { name: h800, gpu: H800, count: 64 }\n    - { name: h20, gpu: H20, count: 96 }",
    );
    let p = plan::problem(spec(&job), &job.catalog, &mean, &Efficiency::default()).unwrap();
    let store_at = |share: f64| {
        let mut e = Estimate::default();
        for _ in 0..30 {
            e.add(share, Origin::Hardware);
        }
        let mut s = ProfileStore::default();
        s.measured
            .entry(WorkKind::Decode)
            .or_default()
            .insert("h20".into(), e);
        s
    };
    // Planned at 80% of peak bandwidth; 78% is within a 10% margin, 40% is not.
    assert!(drift(&p, &store_at(0.78), 0.1).is_empty());
    let moved = drift(&p, &store_at(0.4), 0.1);
    assert_eq!(moved.len(), 1, "{moved:?}");
    assert_eq!(moved[0].pool, "h20");
    assert_eq!(moved[0].kind, WorkKind::Decode);
    assert!((moved[0].planned - 0.8).abs() < 1e-12 && (moved[0].now - 0.4).abs() < 1e-12);
}

/// The 32B model on 64 H800s and 96 H20s.
fn h800_h20_problem() -> predict::Problem {
    let job = job(
        QWEN_32B,
        "    - { name: h800, gpu: H800, count: 64 }\n    - { name: h20, gpu: H20, count: 96 }",
    );
    plan::problem(spec(&job), &job.catalog, &mean, &Efficiency::default())
        .expect("the 32B model fits these pools")
}

/// A store with `n` samples of each `(kind, pool, share)`.
fn measured(
    entries: &[(rollfleet_planner::roofline::WorkKind, &str, f64, usize)],
) -> rollfleet_planner::profile::ProfileStore {
    use rollfleet_planner::profile::{Estimate, Origin, ProfileStore};
    let mut s = ProfileStore::default();
    for &(kind, pool, share, n) in entries {
        let mut e = Estimate::default();
        for _ in 0..n {
            e.add(share, Origin::Hardware);
        }
        s.measured.entry(kind).or_default().insert(pool.into(), e);
    }
    s
}

#[test]
fn a_pool_that_drifts_forgets_its_other_kinds_and_re_plans_only_once_they_are_measured_afresh() {
    use rollfleet_planner::replan::{Settle, Settling, drift};
    use rollfleet_planner::roofline::WorkKind::{Decode, Prefill};
    let p = h800_h20_problem();
    let mut gate = Settling::default();
    // As planned: nothing to do.
    let as_planned = measured(&[(Prefill, "h20", 0.6, 30), (Decode, "h20", 0.8, 30)]);
    assert_eq!(
        gate.check(&drift(&p, &as_planned, 0.2), &as_planned, 3),
        Settle::Quiet
    );
    // Decode drifted; the prefill window still reads the hardware as it was: it is forgotten,
    // and the re-plan waits for it.
    let mut half_stale = measured(&[(Prefill, "h20", 0.6, 30), (Decode, "h20", 0.4, 30)]);
    let drifts = drift(&p, &half_stale, 0.2);
    assert_eq!(
        gate.check(&drifts, &half_stale, 4),
        Settle::Restart {
            forget: vec![("h20".into(), vec![Prefill])],
            wait: true
        }
    );
    half_stale.restart(Prefill, "h20");
    assert!(!half_stale.measured_ready(Prefill, "h20") && half_stale.measured_ready(Decode, "h20"));
    assert_eq!(
        gate.check(&drift(&p, &half_stale, 0.2), &half_stale, 4),
        Settle::Waiting
    );
    // Too few fresh prefill samples: still waiting.
    let few = measured(&[(Prefill, "h20", 0.24, 5), (Decode, "h20", 0.4, 30)]);
    assert_eq!(gate.check(&drift(&p, &few, 0.2), &few, 5), Settle::Waiting);
    // Enough: ready, and the drift now has both halves of the change.
    let fresh = measured(&[(Prefill, "h20", 0.24, 25), (Decode, "h20", 0.4, 30)]);
    assert_eq!(
        gate.check(&drift(&p, &fresh, 0.2), &fresh, 6),
        Settle::Ready
    );
    let now = drift(&p, &fresh, 0.2);
    assert_eq!(now.len(), 2, "{now:?}");
    assert!(
        now.iter()
            .any(|d| d.kind == Prefill && (d.now - 0.24).abs() < 1e-12)
    );
    // The pool drifts again later (measured afresh since its first drift): at once.
    assert_eq!(gate.check(&now, &fresh, 9), Settle::Ready);
}

#[test]
fn a_pool_that_drifts_with_nothing_else_trusted_re_plans_at_once() {
    use rollfleet_planner::replan::{Settle, Settling, drift};
    use rollfleet_planner::roofline::WorkKind::{Decode, Prefill};
    let p = h800_h20_problem();
    let mut gate = Settling::default();
    // Five prefill samples are too few to trust: they are forgotten, nothing is waited for.
    let store = measured(&[(Prefill, "h20", 0.6, 5), (Decode, "h20", 0.4, 30)]);
    assert_eq!(
        gate.check(&drift(&p, &store, 0.2), &store, 2),
        Settle::Restart {
            forget: vec![("h20".into(), vec![Prefill])],
            wait: false
        }
    );
}

#[test]
fn a_drifted_pool_whose_other_kind_sends_no_fresh_samples_is_planned_for_after_the_wait() {
    use rollfleet_planner::replan::{SETTLE_VERSIONS, Settle, Settling, drift};
    use rollfleet_planner::roofline::WorkKind::{Decode, Prefill};
    let p = h800_h20_problem();
    let mut gate = Settling::default();
    let before = measured(&[(Prefill, "h20", 0.6, 30), (Decode, "h20", 0.4, 30)]);
    assert!(matches!(
        gate.check(&drift(&p, &before, 0.2), &before, 7),
        Settle::Restart { wait: true, .. }
    ));
    let after = measured(&[(Decode, "h20", 0.4, 30)]);
    for v in 7..7 + SETTLE_VERSIONS {
        assert_eq!(
            gate.check(&drift(&p, &after, 0.2), &after, v),
            Settle::Waiting,
            "version {v}"
        );
    }
    assert_eq!(
        gate.check(&drift(&p, &after, 0.2), &after, 7 + SETTLE_VERSIONS),
        Settle::Ready
    );
}

#[test]
fn after_losing_a_third_of_the_decode_pool_the_new_plan_is_reached_in_waves_without_stopping() {
    use rollfleet_planner::replan::replan_after_loss;
    let job = job(
        QWEN_32B,
        "    - { name: h800, gpu: H800, count: 192 }\n    - { name: h20, gpu: H20, count: 320 }",
    );
    let p = plan::problem(spec(&job), &job.catalog, &mean, &Efficiency::default()).unwrap();
    let before = search::solve(&p).unwrap();
    let lost = 320 / 3;
    let per_wave = 4;
    let (smaller, survivor, after, waves) =
        replan_after_loss(&p, &before.candidate, 1, lost, per_wave).unwrap();
    assert_eq!(smaller.gpu_pools[1].count, 320 - lost);
    // Re-planning is never worse than running on what survived, by the full prediction that
    // chooses between placements; here it is better, so replicas move.
    let full = |c: &predict::Candidate| predict::predict(&smaller, c).unwrap().step_s;
    let kept = full(&survivor);
    assert!(
        full(&after.candidate) < kept,
        "{} >= {kept}",
        full(&after.candidate)
    );
    assert!(!waves.is_empty());
    println!(
        "predicted: survivors {kept:.1} s, re-planned {:.1} s, {} waves",
        full(&after.candidate),
        waves.len()
    );
    // Replay the waves: never more GPUs than the pools have, never fewer serving replicas than
    // the smaller of the two placements less one wave, and the new plan at the end.
    use std::collections::BTreeMap;
    let count = |c: &predict::Candidate| {
        let mut m: BTreeMap<(usize, Role, u32), u32> = BTreeMap::new();
        for g in &c.groups {
            *m.entry((g.pool, g.role, g.tp)).or_insert(0) += g.replicas;
        }
        m
    };
    let mut now = count(&survivor);
    let floor = now
        .values()
        .sum::<u32>()
        .min(count(&after.candidate).values().sum::<u32>());
    let mut trainer = survivor.trainer_gpus;
    for w in &waves {
        for g in &w.start {
            *now.entry((g.pool, g.role, g.tp)).or_insert(0) += g.replicas;
        }
        let mut used = vec![0u32; smaller.gpu_pools.len()];
        for (&(pool, _, tp), &n) in &now {
            used[pool] += n * tp;
        }
        used[survivor.trainer_pool] += trainer;
        for (i, u) in used.iter().enumerate() {
            assert!(
                *u <= smaller.gpu_pools[i].count,
                "pool {i}: {u} GPUs in use"
            );
        }
        for g in &w.stop {
            let e = now.entry((g.pool, g.role, g.tp)).or_insert(0);
            assert!(*e >= g.replicas);
            *e -= g.replicas;
        }
        now.retain(|_, n| *n > 0);
        trainer = w.trainer_gpus;
        let serving: u32 = now.values().sum();
        assert!(
            serving + per_wave >= floor,
            "{serving} serving, floor {floor}"
        );
        assert!(serving > 0, "rollout stopped");
    }
    if after.candidate.trainer_pool == survivor.trainer_pool {
        assert_eq!(now, count(&after.candidate));
        assert_eq!(trainer, after.candidate.trainer_gpus);
    }
}

#[test]
fn the_same_job_gives_the_same_plan_byte_for_byte() {
    let job = job(
        QWEN_32B,
        "    - { name: h800, gpu: H800, count: 64 }\n    - { name: h20, gpu: H20, count: 96 }",
    );
    let a = serde_json::to_string(&plan::plan(spec(&job), &job.catalog, &mean).unwrap()).unwrap();
    let b = serde_json::to_string(&plan::plan(spec(&job), &job.catalog, &mean).unwrap()).unwrap();
    assert_eq!(a, b);
}

#[test]
fn more_replicas_never_make_the_predicted_step_slower() {
    let job = job(
        QWEN_32B,
        "    - { name: h800, gpu: H800, count: 64 }\n    - { name: h20, gpu: H20, count: 96 }",
    );
    let p = plan::problem(spec(&job), &job.catalog, &mean, &Efficiency::default()).unwrap();
    let base = predict::Candidate {
        groups: vec![
            predict::Group {
                pool: 0,
                role: Role::Prefill,
                tp: 2,
                replicas: 8,
            },
            predict::Group {
                pool: 1,
                role: Role::Decode,
                tp: 2,
                replicas: 20,
            },
        ],
        trainer_pool: 0,
        trainer_gpus: 32,
    };
    let t0 = predict::step_time(&p, &base).unwrap();
    for (i, extra) in [
        predict::Group {
            pool: 1,
            role: Role::Decode,
            tp: 2,
            replicas: 8,
        },
        predict::Group {
            pool: 0,
            role: Role::Decode,
            tp: 1,
            replicas: 4,
        },
        predict::Group {
            pool: 0,
            role: Role::Prefill,
            tp: 4,
            replicas: 2,
        },
        predict::Group {
            pool: 1,
            role: Role::Prefill,
            tp: 2,
            replicas: 8,
        },
    ]
    .into_iter()
    .enumerate()
    {
        let mut c = base.clone();
        c.groups.push(extra);
        let t = predict::step_time(&p, &c).unwrap();
        assert!(t <= t0 * (1.0 + 1e-9), "case {i}: {t} > {t0}");
    }
}

#[test]
fn many_one_gpu_replicas_on_a_slowed_pool_are_predicted_slower_than_its_eight_gpu_ones() {
    // The drift case: the H20s achieve a quarter of their rates. 320 one-GPU replicas each read
    // the 65.6 GB of weights at 0.8 TB/s (82 ms a token alone) and the router still fills them
    // by their room, so the prediction that gates a move must not see a gain in them.
    let job = job(
        QWEN_32B,
        "    - { name: h800, gpu: H800, count: 192 }\n    - { name: h20, gpu: H20, count: 320 }",
    );
    let mut p = plan::problem(spec(&job), &job.catalog, &mean, &Efficiency::default()).unwrap();
    let h800 = p.gpu_pools.iter().position(|g| g.name == "h800").unwrap();
    let h20 = p.gpu_pools.iter().position(|g| g.name == "h20").unwrap();
    p.gpu_pools[h20].rates.bandwidth *= 0.25;
    p.gpu_pools[h20].rates.flops *= 0.25;
    let lone = p.active_weight_bytes / p.gpu_pools[h20].rates.bandwidth;
    assert!((lone - 0.082).abs() < 0.001, "{lone}");
    let placement = |h20_tp: u32| predict::Candidate {
        groups: vec![
            predict::Group {
                pool: h800,
                role: Role::Generate,
                tp: 8,
                replicas: 10,
            },
            predict::Group {
                pool: h20,
                role: Role::Generate,
                tp: h20_tp,
                replicas: 320 / h20_tp,
            },
        ],
        trainer_pool: h800,
        trainer_gpus: 112,
    };
    let (tp8, tp1) = (placement(8), placement(1));
    let (full8, full1) = (
        predict::predict(&p, &tp8).unwrap(),
        predict::predict(&p, &tp1).unwrap(),
    );
    assert!(
        full1.step_s > 1.05 * full8.step_s,
        "{full1:?} against {full8:?}"
    );
    // The router fills the one-GPU replicas too, by their room (86.4 GB usable less 65.6 GB
    // of weights: 20.8 GB of KV each), where water-filling left them empty: each decodes
    // about one sequence at a time (0.87), the H800s' replicas 4.4.
    assert!(full1.decode_batch[1] > 0.5, "{:?}", full1.decode_batch);
    assert!(full1.decode_batch[0] > 0.5 && full8.decode_batch[1] > 0.5);
    // The one-GPU replicas' trajectories decode at 82 ms a token or more: the mean over the
    // tokens rises too.
    assert!(
        full1.token_s > full8.token_s,
        "{} {}",
        full1.token_s,
        full8.token_s
    );
}

#[test]
fn the_chosen_placement_keeps_the_degree_the_full_prediction_prefers_where_the_search_would_not() {
    // The drift `rollfleet sim --slow h20:0.25@5 --replan-on-drift` measures on the RollArt-like
    // job: the H20s decode at a quarter of their bandwidth (their prefills, measured alone, keep
    // their compute). The search's first-order objective splits decode by water-filling, so it
    // sees one-GPU H20 replicas as room no sequence waits on and proposes 320 of them; the
    // placement chosen gives each pool the degree the full prediction prefers.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/jobs/rollart-agentic.yaml");
    let job = rollfleet_spec::load_job_file(&path).unwrap();
    let mut p = plan::problem(spec(&job), &job.catalog, &mean, &Efficiency::default()).unwrap();
    let h20 = p.gpu_pools.iter().position(|g| g.name == "h20").unwrap();
    let h20_degree = |c: &predict::Candidate| {
        c.groups
            .iter()
            .find(|g| g.pool == h20 && g.replicas > 0)
            .map(|g| g.tp)
    };
    // Without the drift the degrees are the search's own: 8 on the H20s.
    let (searched, chosen) = (search::solve(&p).unwrap(), search::choose(&p).unwrap());
    assert_eq!(h20_degree(&searched.candidate), Some(8));
    assert_eq!(h20_degree(&chosen.candidate), Some(8));
    p.gpu_pools[h20].rates.bandwidth *= 0.25;
    let searched = search::solve(&p).unwrap().candidate;
    assert_eq!(h20_degree(&searched), Some(1), "{searched:?}");
    let (chosen, choice) = search::search_or_affinity(&p).unwrap();
    assert_eq!(h20_degree(&chosen.candidate), Some(8), "{chosen:?}");
    let full = |c: &predict::Candidate| predict::predict(&p, c).unwrap().step_s;
    assert!(
        full(&chosen.candidate) < 0.7 * full(&searched),
        "{} against {}",
        full(&chosen.candidate),
        full(&searched)
    );
    // The family comparison saw the optimum with its degree checked, not the one-GPU replicas.
    let (search_s, _) = choice.compared.unwrap();
    assert!(search_s < 0.7 * full(&searched), "{choice:?}");
    // The placement run is that one, or a compared one predicted faster than it by more than
    // the prediction can rank (with the H20s this slow, leaving them out is).
    let (run, reason) = search::choose_with_reason(&p).unwrap();
    match reason.replaced_by {
        None => assert_eq!(run.candidate, chosen.candidate),
        Some((_, replaced_s, run_s)) => {
            assert_eq!(replaced_s, full(&chosen.candidate));
            assert_eq!(run_s, full(&run.candidate));
            assert!(
                run_s < replaced_s * (1.0 - search::PREDICTION_TIE),
                "{reason:?}"
            );
        }
    }
}

#[test]
fn the_plan_is_never_a_placement_its_own_comparison_ranks_behind_another() {
    // On every example job, the compared placements (`rollfleet plan --compare`) are predicted
    // no faster than the plan, but for ties closer than the prediction can rank.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/jobs");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let job = rollfleet_spec::load_job_file(&path).unwrap();
        let p = plan::problem(spec(&job), &job.catalog, &mean, &Efficiency::default()).unwrap();
        let plan = search::choose(&p).unwrap();
        let planned = predict::predict(&p, &plan.candidate).unwrap().step_s;
        for other in [compare::uniform(&p), compare::best_gpu(&p)]
            .into_iter()
            .flatten()
        {
            let other_s = predict::predict(&p, &other.candidate).unwrap().step_s;
            assert!(
                other_s >= planned * (1.0 - search::PREDICTION_TIE),
                "{}: a compared placement is predicted at {other_s} s, the plan at {planned} s",
                path.display()
            );
        }
        checked += 1;
    }
    assert!(checked >= 5, "{checked} example jobs");
}

#[test]
fn a_window_of_many_batches_cannot_predict_a_step_shorter_than_the_longest_chain_allows() {
    // At `maxStaleness` 8 with four batches over-provisioned, six batches are started and not
    // yet trained: Little's law through that window alone would put the step far below what
    // the job's longest chains take, which need `maxStaleness + 1` steps at least. (H800s
    // enough that training, prefill and decode all fit in less than the chain.)
    let job = job(
        QWEN_7B,
        "    - { name: h800, gpu: H800, count: 192 }\n    - { name: h20, gpu: H20, count: 128 }",
    );
    let mut wide = spec(&job).clone();
    wide.rl.max_staleness = 8;
    wide.rl.over_provisioning = 4.0;
    let p = plan::problem(&wide, &job.catalog, &mean, &Efficiency::default()).unwrap();
    let plan = search::choose(&p).unwrap();
    let pr = predict::predict(&p, &plan.candidate).unwrap();
    assert!(pr.terms.chain_s > pr.terms.latency_s, "{:?}", pr.terms);
    assert_eq!(pr.binding, predict::Binding::Staleness, "{:?}", pr.terms);
    assert!(pr.step_s >= pr.terms.chain_s, "{pr:?}");
}

#[test]
fn at_most_half_of_the_decoding_replicas_update_at_once_however_many_nodes_the_trainer_has() {
    // The core updates a replica per trainer node at a time, but never more than half of the
    // decoding ones (at least one): a trainer of many nodes does not take them all out at once.
    assert_eq!(predict::decoding_updated_at_once(16, 8), 4);
    assert_eq!(predict::decoding_updated_at_once(3, 40), 3);
    assert_eq!(predict::decoding_updated_at_once(2, 2), 1);
    assert_eq!(predict::decoding_updated_at_once(4, 1), 1);
    // Two H20 replicas of 4 GPUs and an 8-GPU trainer of two nodes (4 GPUs a node) or one
    // (8 a node): either way one replica updates while the other serves, so turns wait alike.
    let predict_with = |per_node: u32| {
        let job = job(
            QWEN_7B,
            &format!(
                "    - {{ name: a, gpu: H800, count: 8, gpusPerNode: {per_node} }}\n    - {{ name: b, gpu: H20, count: 8, gpusPerNode: {per_node} }}"
            ),
        );
        let p = plan::problem(spec(&job), &job.catalog, &mean, &Efficiency::default()).unwrap();
        let c = predict::Candidate {
            groups: vec![predict::Group {
                pool: 1,
                role: Role::Generate,
                tp: 4,
                replicas: 2,
            }],
            trainer_pool: 0,
            trainer_gpus: 8,
        };
        predict::predict(&p, &c).unwrap()
    };
    let (two_nodes, one_node) = (predict_with(4), predict_with(8));
    assert_eq!(
        two_nodes.slot_lifetime_s, one_node.slot_lifetime_s,
        "{two_nodes:?} against {one_node:?}"
    );
    assert_eq!(two_nodes.step_s, one_node.step_s);
}

#[test]
fn the_affinity_mapping_prefills_on_the_compute_rich_pool_and_decodes_on_the_others() {
    let mixed = job(
        QWEN_32B,
        "    - { name: h800, gpu: H800, count: 192 }\n    - { name: h20, gpu: H20, count: 320 }",
    );
    let p = plan::problem(spec(&mixed), &mixed.catalog, &mean, &Efficiency::default()).unwrap();
    // Pool 0 is the H800s (ridge 295 FLOP/byte), pool 1 the H20s (ridge 37).
    assert_eq!(
        search::affinity_roles(&p),
        Some(vec![Role::Prefill, Role::Decode])
    );
    let found = search::solve_affinity(&p).unwrap();
    for g in found.candidate.groups.iter().filter(|g| g.replicas > 0) {
        let expected = if g.pool == 0 {
            Role::Prefill
        } else {
            Role::Decode
        };
        assert_eq!(g.role, expected, "{:#?}", found.candidate);
    }
    // One product everywhere: there is no compute-rich pool to map prefill to.
    let same = job(
        QWEN_32B,
        "    - { name: a, gpu: H20, count: 64 }\n    - { name: b, gpu: H20, count: 64 }",
    );
    let p = plan::problem(spec(&same), &same.catalog, &mean, &Efficiency::default()).unwrap();
    assert_eq!(search::affinity_roles(&p), None);
    assert_eq!(search::choose(&p), search::solve(&p));
}

#[test]
fn under_a_loose_staleness_bound_the_trainer_is_sized_by_the_full_prediction_and_leaves_prefill_more()
 {
    // At `maxStaleness: 4` the window holds two batches and every weight update makes about
    // two thousand trajectories prefill their whole context again. The first-order objective
    // gives training 144 of the 192 H800s; with the refills' burst the full prediction rates
    // that clearly slower than a smaller trainer (simulated: 89.3 s per step with 144, 77.3 s
    // with the 120 chosen, seed 0).
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/jobs/rollart-agentic.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.contains("maxStaleness: 2"));
    let text = text.replace("maxStaleness: 2", "maxStaleness: 4");
    let job = rollfleet_spec::parse_job(text.as_bytes(), "loose.yaml").unwrap();
    let p = plan::problem(spec(&job), &job.catalog, &mean, &Efficiency::default()).unwrap();
    let optimum = search::solve_affinity(&p).unwrap().candidate;
    let chosen = search::choose(&p).unwrap().candidate;
    let full = |c: &predict::Candidate| predict::predict(&p, c).unwrap().step_s;
    assert!(
        chosen.trainer_gpus < optimum.trainer_gpus,
        "{chosen:?} against {optimum:?}"
    );
    assert!(
        chosen.replicas(Role::Prefill) > optimum.replicas(Role::Prefill),
        "{chosen:?} against {optimum:?}"
    );
    assert!(
        full(&chosen) < 0.95 * full(&optimum),
        "{} s against {} s",
        full(&chosen),
        full(&optimum)
    );
    // No trainer size on the pool is predicted more than the 2% tie below the one chosen.
    let best = search::trainer_sizes(&p, chosen.trainer_pool)
        .into_iter()
        .filter_map(|g| {
            let pinned = p.clone().with_trainer(chosen.trainer_pool, g);
            search::solve_affinity(&pinned).map(|f| full(&f.candidate))
        })
        .fold(f64::INFINITY, f64::min);
    assert!(
        full(&chosen) <= best * 1.02,
        "{} s, best {best} s",
        full(&chosen)
    );
}

#[test]
fn the_chosen_placement_is_never_predicted_slower_than_the_searchs_optimum() {
    // The family comparison's prediction: refills as a Poisson stream (see `choose`).
    let full = |p: &predict::Problem, c: &predict::Candidate| {
        predict::predict_with(p, c, predict::RefillArrivals::Poisson)
            .unwrap()
            .step_s
    };
    for (name, pools) in [
        (
            "rollart-like",
            "    - { name: h800, gpu: H800, count: 192 }\n    - { name: h20, gpu: H20, count: 320 }",
        ),
        (
            "one decode replica",
            "    - { name: h800, gpu: H800, count: 16 }\n    - { name: h20, gpu: H20, count: 8 }",
        ),
    ] {
        let job = job(QWEN_32B, pools);
        let p = plan::problem(spec(&job), &job.catalog, &mean, &Efficiency::default()).unwrap();
        let first = search::solve(&p).unwrap();
        let (chosen, choice) = search::choose_with_reason(&p).unwrap();
        assert!(
            full(&p, &chosen.candidate) <= full(&p, &first.candidate),
            "{name}: {chosen:#?} against {first:#?}"
        );
        if let Some((compared, replaced_s, taken_s)) = choice.replaced_by {
            // A placement `--compare` shows, taken because the plan's own prediction ranks it
            // ahead of the one it replaced by more than a tie: the plan is never one its
            // comparison ranks behind another.
            let predicted = predict::predict(&p, &chosen.candidate).unwrap().step_s;
            assert_eq!(predicted, taken_s, "{name}: {compared}");
            assert!(
                taken_s < replaced_s * (1.0 - search::PREDICTION_TIE),
                "{name}: {compared} {taken_s} s against {replaced_s} s"
            );
        } else if chosen.candidate != first.candidate {
            // It only ever moves to the affinity placement (with the serving replicas the
            // affinity search gives its trainer size), with more decode replicas than the
            // trainer's nodes update at once.
            let pinned = p
                .clone()
                .with_trainer(chosen.candidate.trainer_pool, chosen.candidate.trainer_gpus);
            assert_eq!(
                Some(&chosen.candidate),
                search::solve_affinity(&pinned)
                    .map(|f| f.candidate)
                    .as_ref()
            );
            let nodes = chosen.candidate.trainer_gpus.div_ceil(8);
            let decode = chosen.candidate.replicas(Role::Decode);
            assert!(
                decode > nodes,
                "{name}: {decode} decode replicas, {nodes} trainer nodes"
            );
        }
    }
    // On the RollArt-like example the full prediction prefers the affinity placement: prefill on
    // the H800s, decode on the H20s (simulated: 113.7 s per step against 126.0 s, seed 0).
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/jobs/rollart-agentic.yaml");
    let job = rollfleet_spec::load_job_file(&path).unwrap();
    let p = plan::problem(spec(&job), &job.catalog, &mean, &Efficiency::default()).unwrap();
    let chosen = search::choose(&p).unwrap();
    assert!(
        chosen
            .candidate
            .groups
            .iter()
            .any(|g| g.pool == 0 && g.role == Role::Prefill && g.replicas > 0),
        "{chosen:#?}"
    );
    assert_ne!(chosen.candidate, search::solve(&p).unwrap().candidate);
}

#[test]
fn a_pinned_trainer_is_kept_and_the_serving_replicas_fit_on_the_gpus_it_leaves() {
    let job = job(
        QWEN_32B,
        "    - { name: h800, gpu: H800, count: 192 }\n    - { name: h20, gpu: H20, count: 32 }",
    );
    let p = plan::problem(spec(&job), &job.catalog, &mean, &Efficiency::default()).unwrap();
    let free = search::choose(&p).unwrap().candidate;
    // Pinned to a size the free plan does not choose: kept, and nothing over-commits its pool.
    let pinned_gpus = if free.trainer_gpus == 128 { 112 } else { 128 };
    let pinned = p.clone().with_trainer(0, pinned_gpus);
    let found = search::choose(&pinned).unwrap().candidate;
    assert_eq!((found.trainer_pool, found.trainer_gpus), (0, pinned_gpus));
    let on_h800: u32 = found
        .groups
        .iter()
        .filter(|g| g.pool == 0)
        .map(|g| g.replicas * g.tp)
        .sum();
    assert!(on_h800 + pinned_gpus <= 192, "{found:?}");
    // A pin on a pool that cannot hold it leaves nothing to plan.
    assert!(search::choose(&p.clone().with_trainer(1, 64)).is_none());
    // A re-plan that would move the trainer to another pool keeps it where it runs instead.
    let running = predict::Candidate {
        trainer_pool: 1,
        trainer_gpus: 16,
        ..free.clone()
    };
    let kept =
        rollfleet_planner::replan::on_trainer_pool(&p, &running, search::choose(&p).unwrap())
            .unwrap()
            .candidate;
    assert_eq!((kept.trainer_pool, kept.trainer_gpus), (1, 16));
}

#[test]
fn measured_environment_steps_and_rewards_replace_the_job_specs_means_once_there_are_enough() {
    use rollfleet_planner::profile::{MIN_SAMPLES, Origin, ProfileStore, Timed};
    let job = job(
        QWEN_32B,
        "    - { name: h800, gpu: H800, count: 64 }\n    - { name: h20, gpu: H20, count: 96 }",
    );
    let spec = spec(&job);
    let task = &spec.tasks[0];
    let planned = |store: &ProfileStore| {
        let p = plan::problem_profiled(spec, &job.catalog, &mean, &Efficiency::default(), store)
            .unwrap();
        (p.workload.tasks[0].env_step_s, p.workload.tasks[0].reward_s)
    };
    let from_spec = planned(&ProfileStore::default());
    let mut store = ProfileStore::default();
    // One fewer than enough: still the spec's.
    for _ in 0..MIN_SAMPLES - 1 {
        store.record_timed(Timed::EnvironmentStep, &task.name, 7.0, Origin::Hardware);
        store.record_timed(Timed::Reward, &task.reward, 0.5, Origin::Hardware);
    }
    assert_eq!(planned(&store), from_spec);
    // Enough: their mean, over every sample (not the window's median).
    store.record_timed(
        Timed::EnvironmentStep,
        &task.name,
        7.0 + 20.0,
        Origin::Hardware,
    );
    store.record_timed(Timed::Reward, &task.reward, 0.5, Origin::Hardware);
    let (env, reward) = planned(&store);
    let n = MIN_SAMPLES as f64;
    assert!((env - (7.0 * n + 20.0) / n).abs() < 1e-9, "{env}");
    assert!((reward - 0.5).abs() < 1e-12, "{reward}");
    // A malformed duration is no sample.
    store.record_timed(Timed::Reward, &task.reward, f64::NAN, Origin::Hardware);
    store.record_timed(Timed::Reward, &task.reward, -1.0, Origin::Hardware);
    store.record_timed(Timed::Reward, &task.reward, 1e13, Origin::Hardware);
    assert_eq!(store.rewards[&task.reward].total, MIN_SAMPLES as u64);
}
