//! The default placement: which GPU pool does what, and how big a replica is.
//!
//! This is a small, pure function of the job spec and the catalogue, deliberately simple so that
//! the profiler-driven planner of a later issue can replace it wholesale. The rules:
//!
//! 1. **Roles.** A pool pinned with `roles:` keeps them. Among the unpinned GPU pools, ordered by
//!    ridge point (peak FLOP/s over HBM bytes/s, highest first; ties by total FLOP/s, then by
//!    position in the spec):
//!    - if no pool is pinned to `train`, the first (most compute-bound) unpinned pool trains;
//!    - if no pool is pinned to a serving role and there is only one unpinned GPU pool, it
//!      generates (prefill and decode colocated);
//!    - otherwise the first unpinned pool prefills (prefill is compute-bound) and the others
//!      decode (decode is bandwidth-bound). A pool pinned to `decode` alone with nobody to
//!      prefill decodes with local prefill (as `generate`).
//! 2. **Replica size.** The smallest power-of-two number of GPUs, within one node, whose usable
//!    memory ([`USABLE_MEMORY_FRACTION`]) holds the weights and leaves at least as much again for
//!    KV cache (so batches are large enough to amortise the weight reads); failing that, the
//!    smallest that holds the weights plus one full context.
//! 3. **Train/prefill split.** A pool that both trains and prefills is split in proportion to
//!    the estimated work of each: training `6 * N * tokens / trainMfu` against prefill
//!    `2 * N * prefill tokens / PREFILL_MFU_ESTIMATE`, rounded to whole replicas, leaving at
//!    least one replica to prefill.
//!
//! [`colocated_placement`] is the monolithic alternative used by the `sync` baseline: the GPU
//! pool with the most compute does everything, time-sliced.

use rollfleet_catalog::{Catalog, GpuProduct};
use rollfleet_spec::{JobSpec, PoolKind, Role, USABLE_MEMORY_FRACTION};
use serde::{Deserialize, Serialize};

use crate::protocol::PoolIndex;

/// The share of peak FLOP/s the core assumes for prefill when sizing pools. It is the core's own
/// estimate; the simulator's hardware model has its own figures, on purpose.
pub const PREFILL_MFU_ESTIMATE: f64 = 0.5;

/// Sequences one replica batches at most (vLLM's default `max_num_seqs`).
pub const MAX_SEQS_PER_REPLICA: u32 = 256;

/// What a serving replica does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ServeRole {
    /// Prefill only; hands KV caches to decode replicas.
    Prefill,
    /// Decode, after pulling the KV cache from a prefill replica (or prefilling short inputs
    /// locally).
    Decode,
    /// Prefill and decode colocated.
    Generate,
}

/// One serving replica.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplicaConfig {
    /// Its pool.
    pub pool: PoolIndex,
    /// Its role.
    pub role: ServeRole,
    /// GPUs in its tensor-parallel group.
    pub gpus: u32,
    /// Tokens of KV cache it can hold.
    pub kv_capacity_tokens: u64,
    /// Sequences it batches at most.
    pub max_seqs: u32,
}

/// The training group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerConfig {
    /// Its pool.
    pub pool: PoolIndex,
    /// GPUs it uses.
    pub gpus: u32,
    /// Nodes it spans (each can feed one rolling weight update at a time).
    pub nodes: u32,
}

/// Where everything runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Placement {
    /// Serving replicas, in pool order.
    pub replicas: Vec<ReplicaConfig>,
    /// The trainer.
    pub trainer: TrainerConfig,
    /// Whether the trainer shares its GPUs with the serving replicas (time-sliced).
    pub colocated: bool,
}

/// Average tokens per trajectory, the only workload figures the placement needs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WorkloadMeans {
    /// Tokens prefilled per trajectory with perfect KV reuse (prompt plus observations).
    pub prefill_tokens: f64,
    /// Tokens trained on per trajectory (prompt, actions, observations).
    pub train_tokens: f64,
}

/// Why no placement was found.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlacementError {
    /// No GPU pool can train.
    #[error("no GPU pool can train: pin `roles: [train]` on one, or leave one unpinned")]
    NoTrainer,
    /// No GPU pool can serve.
    #[error("no GPU pool can serve the policy (prefill/decode/generate)")]
    NoServing,
    /// A pool's replica does not fit.
    #[error("pool \"{pool}\": one replica of the model does not fit in one node of {gpu}")]
    DoesNotFit {
        /// The pool.
        pool: String,
        /// Its GPU.
        gpu: String,
    },
    /// A pool refers to an unknown GPU.
    #[error("pool \"{0}\": unknown GPU")]
    UnknownGpu(String),
}

/// A GPU pool as the role assignment sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuPoolView {
    /// Ridge point, FLOP per byte.
    pub ridge: f64,
    /// Total peak FLOP/s of the pool.
    pub total_flops: f64,
    /// Roles pinned in the spec (empty: unpinned).
    pub pinned: Vec<Role>,
}

/// Assigns roles to GPU pools (rule 1 of the module docs). Pure; the result is parallel to
/// `pools`.
pub fn assign_roles(pools: &[GpuPoolView]) -> Vec<Vec<Role>> {
    let mut roles: Vec<Vec<Role>> = pools.iter().map(|p| p.pinned.clone()).collect();
    let mut unpinned: Vec<usize> = (0..pools.len())
        .filter(|&i| pools[i].pinned.is_empty())
        .collect();
    unpinned.sort_by(|&a, &b| {
        pools[b]
            .ridge
            .total_cmp(&pools[a].ridge)
            .then(pools[b].total_flops.total_cmp(&pools[a].total_flops))
            .then(a.cmp(&b))
    });
    let train_pinned = pools.iter().any(|p| p.pinned.contains(&Role::Train));
    let serve_pinned = pools.iter().any(|p| {
        p.pinned
            .iter()
            .any(|r| matches!(r, Role::Prefill | Role::Decode | Role::Generate))
    });
    if let Some(&first) = unpinned.first() {
        if !train_pinned {
            roles[first].push(Role::Train);
        }
        if unpinned.len() == 1 && !serve_pinned {
            roles[first].push(Role::Generate);
        } else {
            roles[first].push(Role::Prefill);
            for &other in &unpinned[1..] {
                roles[other].push(Role::Decode);
            }
        }
    }
    roles
}

/// GPUs per replica (rule 2 of the module docs), or `None` if no replica fits in a node.
pub fn replica_gpus(
    gpu: &GpuProduct,
    count: u32,
    gpus_per_node: u32,
    weight_bytes: f64,
    context_bytes: f64,
) -> Option<u32> {
    let limit = count.min(gpus_per_node).max(1);
    let sizes: Vec<u32> = (0..6).map(|s| 1u32 << s).filter(|&g| g <= limit).collect();
    let free = |g: u32| g as f64 * gpu.memory_bytes() * USABLE_MEMORY_FRACTION - weight_bytes;
    sizes
        .iter()
        .copied()
        .find(|&g| free(g) >= weight_bytes.max(context_bytes))
        .or_else(|| sizes.iter().copied().find(|&g| free(g) >= context_bytes))
}

fn pool_gpu<'a>(
    spec: &JobSpec,
    catalog: &'a Catalog,
    index: usize,
) -> Result<(&'a GpuProduct, u32, u32), PlacementError> {
    let pool = &spec.pools[index];
    let name = pool.gpu.as_deref().unwrap_or_default();
    let gpu = catalog
        .gpu(name)
        .map_err(|_| PlacementError::UnknownGpu(pool.name.clone()))?;
    let count = u32::try_from(pool.count.unwrap_or(0).max(0)).unwrap_or(u32::MAX);
    let per_node = u32::try_from(pool.gpus_per_node().max(1)).unwrap_or(8);
    Ok((gpu, count, per_node))
}

fn kv_tokens(gpu: &GpuProduct, gpus: u32, spec: &JobSpec) -> u64 {
    let free =
        gpus as f64 * gpu.memory_bytes() * USABLE_MEMORY_FRACTION - spec.model.weight_bytes();
    let per_token = spec.model.kv_bytes_per_token().max(1.0);
    (free / per_token).max(0.0) as u64
}

fn longest_context(spec: &JobSpec) -> f64 {
    spec.tasks
        .iter()
        .map(|t| t.context_limit.max(0))
        .max()
        .unwrap_or(0) as f64
}

/// The default disaggregated placement (see the module docs).
pub fn default_placement(
    spec: &JobSpec,
    catalog: &Catalog,
    means: &WorkloadMeans,
) -> Result<Placement, PlacementError> {
    let gpu_pools: Vec<usize> = (0..spec.pools.len())
        .filter(|&i| spec.pools[i].kind() == Some(PoolKind::Gpu))
        .collect();
    let mut views = Vec::new();
    for &i in &gpu_pools {
        let (gpu, count, _) = pool_gpu(spec, catalog, i)?;
        views.push(GpuPoolView {
            ridge: gpu.ridge_point_flop_per_byte(),
            total_flops: gpu.peak_flops() * count as f64,
            pinned: spec.pools[i].roles.clone(),
        });
    }
    let roles = assign_roles(&views);
    let weight_bytes = spec.model.weight_bytes();
    let context_bytes = spec.model.kv_bytes_per_token() * longest_context(spec);
    let has_prefill = roles.iter().flatten().any(|r| *r == Role::Prefill);

    let mut replicas = Vec::new();
    let mut trainer: Option<(TrainerConfig, f64)> = None;
    for (slot, &i) in gpu_pools.iter().enumerate() {
        let (gpu, count, per_node) = pool_gpu(spec, catalog, i)?;
        let pool_roles = &roles[slot];
        let serve = if pool_roles.contains(&Role::Generate) {
            Some(ServeRole::Generate)
        } else if pool_roles.contains(&Role::Prefill) {
            Some(ServeRole::Prefill)
        } else if pool_roles.contains(&Role::Decode) {
            Some(if has_prefill {
                ServeRole::Decode
            } else {
                ServeRole::Generate
            })
        } else {
            None
        };
        let trains = pool_roles.contains(&Role::Train);
        let mut serving_gpus = if serve.is_some() { count } else { 0 };
        let tp = match serve {
            Some(_) => replica_gpus(gpu, count, per_node, weight_bytes, context_bytes).ok_or_else(
                || PlacementError::DoesNotFit {
                    pool: spec.pools[i].name.clone(),
                    gpu: gpu.name.clone(),
                },
            )?,
            None => 1,
        };
        if trains {
            let train_gpus = if serve.is_some() {
                let train_work = 6.0 * means.train_tokens / spec.rl.train_mfu.clamp(0.01, 1.0);
                let prefill_work = 2.0 * means.prefill_tokens / PREFILL_MFU_ESTIMATE;
                let share = if train_work + prefill_work > 0.0 {
                    train_work / (train_work + prefill_work)
                } else {
                    0.5
                };
                let serving_replicas_max = count / tp;
                if serving_replicas_max < 2 {
                    return Err(PlacementError::DoesNotFit {
                        pool: spec.pools[i].name.clone(),
                        gpu: gpu.name.clone(),
                    });
                }
                let train_replicas = ((count as f64 * share / tp as f64).round() as u32)
                    .clamp(1, serving_replicas_max - 1);
                train_replicas * tp
            } else {
                count
            };
            serving_gpus = count.saturating_sub(train_gpus);
            let candidate = TrainerConfig {
                pool: i as PoolIndex,
                gpus: train_gpus,
                nodes: train_gpus.div_ceil(per_node).max(1),
            };
            let flops = gpu.peak_flops() * train_gpus as f64;
            if trainer.as_ref().is_none_or(|(_, best)| flops > *best) {
                trainer = Some((candidate, flops));
            }
        }
        if let Some(role) = serve {
            for _ in 0..serving_gpus / tp {
                replicas.push(ReplicaConfig {
                    pool: i as PoolIndex,
                    role,
                    gpus: tp,
                    kv_capacity_tokens: kv_tokens(gpu, tp, spec),
                    max_seqs: MAX_SEQS_PER_REPLICA,
                });
            }
        }
    }
    let (trainer, _) = trainer.ok_or(PlacementError::NoTrainer)?;
    if !replicas
        .iter()
        .any(|r| matches!(r.role, ServeRole::Decode | ServeRole::Generate))
    {
        return Err(PlacementError::NoServing);
    }
    Ok(Placement {
        replicas,
        trainer,
        colocated: false,
    })
}

/// The monolithic placement of the `sync` baseline: the GPU pool with the most peak FLOP/s
/// serves (prefill and decode colocated) and trains on the same GPUs, time-sliced, at the
/// smallest tensor-parallel degree that fits the model.
pub fn colocated_placement(spec: &JobSpec, catalog: &Catalog) -> Result<Placement, PlacementError> {
    let smallest = colocated_degrees(spec, catalog)?
        .first()
        .copied()
        .ok_or(PlacementError::NoServing)?;
    colocated_placement_at(spec, catalog, smallest)
}

/// The GPU pool a colocated placement uses: the one with the most peak FLOP/s.
fn colocated_pool(spec: &JobSpec, catalog: &Catalog) -> Result<usize, PlacementError> {
    let mut best: Option<(usize, f64)> = None;
    for i in 0..spec.pools.len() {
        if spec.pools[i].kind() != Some(PoolKind::Gpu) {
            continue;
        }
        let (gpu, count, _) = pool_gpu(spec, catalog, i)?;
        let flops = gpu.peak_flops() * count as f64;
        if best.is_none_or(|(_, f)| flops > f) {
            best = Some((i, flops));
        }
    }
    Ok(best.ok_or(PlacementError::NoServing)?.0)
}

/// The tensor-parallel degrees a colocated placement can serve at, smallest first: every power
/// of two from the smallest that fits the model and its longest context up to a node (or the
/// pool, if smaller).
pub fn colocated_degrees(spec: &JobSpec, catalog: &Catalog) -> Result<Vec<u32>, PlacementError> {
    let i = colocated_pool(spec, catalog)?;
    let (gpu, count, per_node) = pool_gpu(spec, catalog, i)?;
    let context_bytes = spec.model.kv_bytes_per_token() * longest_context(spec);
    let smallest = replica_gpus(
        gpu,
        count,
        per_node,
        spec.model.weight_bytes(),
        context_bytes,
    )
    .ok_or_else(|| PlacementError::DoesNotFit {
        pool: spec.pools[i].name.clone(),
        gpu: gpu.name.clone(),
    })?;
    let limit = count.min(per_node).max(1);
    Ok((0..6)
        .map(|s| 1u32 << s)
        .filter(|&g| g >= smallest && g <= limit)
        .collect())
}

/// The colocated placement (see [`colocated_placement`]) at tensor-parallel degree `tp`, one of
/// [`colocated_degrees`].
pub fn colocated_placement_at(
    spec: &JobSpec,
    catalog: &Catalog,
    tp: u32,
) -> Result<Placement, PlacementError> {
    let i = colocated_pool(spec, catalog)?;
    let (gpu, count, per_node) = pool_gpu(spec, catalog, i)?;
    let tp = tp.max(1);
    if !colocated_degrees(spec, catalog)?.contains(&tp) {
        return Err(PlacementError::DoesNotFit {
            pool: spec.pools[i].name.clone(),
            gpu: gpu.name.clone(),
        });
    }
    let replicas = (0..count / tp)
        .map(|_| ReplicaConfig {
            pool: i as PoolIndex,
            role: ServeRole::Generate,
            gpus: tp,
            kv_capacity_tokens: kv_tokens(gpu, tp, spec),
            max_seqs: MAX_SEQS_PER_REPLICA,
        })
        .collect();
    Ok(Placement {
        replicas,
        trainer: TrainerConfig {
            pool: i as PoolIndex,
            gpus: count,
            nodes: count.div_ceil(per_node).max(1),
        },
        colocated: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(ridge: f64, pinned: Vec<Role>) -> GpuPoolView {
        GpuPoolView {
            ridge,
            total_flops: 1.0,
            pinned,
        }
    }

    #[test]
    fn the_compute_rich_pool_prefills_and_trains_and_the_bandwidth_rich_pool_decodes() {
        let roles = assign_roles(&[view(37.0, vec![]), view(295.0, vec![])]);
        assert_eq!(roles[0], vec![Role::Decode]);
        assert_eq!(roles[1], vec![Role::Train, Role::Prefill]);
    }

    #[test]
    fn pinned_roles_are_kept_and_the_rest_serve() {
        let roles = assign_roles(&[
            view(295.0, vec![]),
            view(37.0, vec![]),
            view(295.0, vec![Role::Train]),
        ]);
        assert_eq!(roles[0], vec![Role::Prefill]);
        assert_eq!(roles[1], vec![Role::Decode]);
        assert_eq!(roles[2], vec![Role::Train]);
    }

    #[test]
    fn a_single_unpinned_pool_generates_and_trains() {
        let roles = assign_roles(&[view(100.0, vec![])]);
        assert_eq!(roles[0], vec![Role::Train, Role::Generate]);
    }

    #[test]
    fn a_replica_is_the_smallest_power_of_two_with_room_for_kv() {
        let catalog = Catalog::builtin();
        let h20 = catalog.gpu("H20").unwrap();
        // 65.6 GB of weights: one H20 (86.4 GB usable) leaves 20.8 GB < 65.6 GB, two leave 107.
        assert_eq!(replica_gpus(h20, 320, 8, 65.6e9, 17.2e9), Some(2));
        // A small model fits in one GPU.
        assert_eq!(replica_gpus(h20, 2, 8, 3.1e9, 0.1e9), Some(1));
        // Nothing fits a 2 TB model within one node.
        assert_eq!(replica_gpus(h20, 320, 8, 2e12, 1e9), None);
    }

    #[test]
    fn a_colocated_placement_may_serve_at_every_power_of_two_from_the_smallest_fit_to_a_node() {
        let yaml = include_str!("../../../examples/jobs/rollart-agentic.yaml");
        let job = rollfleet_spec::parse_job(yaml.as_bytes(), "rollart-agentic.yaml").unwrap();
        let spec = job.spec();
        let degrees = colocated_degrees(spec, &job.catalog).unwrap();
        assert_eq!(degrees, vec![2, 4, 8]);
        assert_eq!(
            colocated_placement(spec, &job.catalog).unwrap(),
            colocated_placement_at(spec, &job.catalog, 2).unwrap()
        );
        let at8 = colocated_placement_at(spec, &job.catalog, 8).unwrap();
        assert!(at8.replicas.iter().all(|r| r.gpus == 8));
        assert_eq!(at8.replicas.len() as u32 * 8, at8.trainer.gpus);
        assert!(colocated_placement_at(spec, &job.catalog, 1).is_err());
        assert!(colocated_placement_at(spec, &job.catalog, 16).is_err());
    }
}
