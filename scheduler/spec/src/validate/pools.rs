//! The pools: their kinds, sizes and hardware looked up in the catalogue, their prices, and
//! the counts that must stay within bounds.

use super::*;

/// Whether a price per hour is a finite figure from 0 to [`MAX_PRICE_PER_HOUR_USD`], reporting
/// it if not.
pub(super) fn price_valid(path: &str, price: f64, problems: &mut Problems) -> bool {
    if !price.is_finite() || price < 0.0 {
        problems.error(path, format!("must be >= 0, got {price}"));
        false
    } else if price > MAX_PRICE_PER_HOUR_USD {
        problems.finite_at_most(
            path,
            price,
            MAX_PRICE_PER_HOUR_USD,
            "USD (GPUs rent for a few dollars an hour)",
        );
        false
    } else {
        true
    }
}

pub(super) fn placement_name(placement: RewardPlacement) -> &'static str {
    match placement {
        RewardPlacement::Serverless => "serverless",
        RewardPlacement::Local => "local",
        RewardPlacement::Environment => "environment",
    }
}

pub(super) fn kind_name(kind: PoolKind) -> &'static str {
    match kind {
        PoolKind::Gpu => "gpu",
        PoolKind::Cpu => "cpu",
        PoolKind::Serverless => "serverless",
    }
}

pub(super) fn check_pools(spec: &JobSpec, catalog: &Catalog, problems: &mut Problems) {
    if spec.pools.is_empty() {
        problems.error("spec.pools", "must list at least one pool");
        return;
    }
    problems.at_most_entries(
        "spec.pools",
        spec.pools.len(),
        MAX_POOLS,
        "pools (real inventories have a few dozen at most; the planner's search grows with \
         each one)",
    );
    let mut names = BTreeSet::new();
    for (i, pool) in spec.pools.iter().enumerate() {
        let path = format!("spec.pools[{i}]");
        problems.name(format!("{path}.name"), &pool.name, &mut names, "pool");
        let placement = crate::kubernetes::problems(pool.kubernetes.as_ref(), &path);
        problems.errors.extend(placement);
        let Some(kind) = pool.kind() else {
            problems.error(
                path,
                "must set exactly one of `gpu`, `cpu` and `serverless`".to_owned(),
            );
            continue;
        };
        match kind {
            PoolKind::Gpu => {
                if let Some(Err(unknown)) = pool.gpu.as_deref().map(|g| catalog.gpu(g)) {
                    problems.error(format!("{path}.gpu"), unknown.to_string());
                }
                check_count(pool, &path, "GPUs", problems);
                problems.within(
                    format!("{path}.gpusPerNode"),
                    pool.gpus_per_node(),
                    1,
                    MAX_GPUS_PER_NODE,
                    "GPUs (NVLink domains hold 8 to 72)",
                );
            }
            PoolKind::Cpu => {
                if let Some(Err(unknown)) = pool.cpu.as_deref().map(|c| catalog.cpu_shape(c)) {
                    problems.error(format!("{path}.cpu"), unknown.to_string());
                }
                check_count(pool, &path, "nodes", problems);
            }
            PoolKind::Serverless => {
                let platform = pool.serverless.as_deref().map(|s| catalog.serverless(s));
                if let Some(Err(unknown)) = &platform {
                    problems.error(format!("{path}.serverless"), unknown.to_string());
                }
                match pool.concurrency {
                    None => problems.error(
                        format!("{path}.concurrency"),
                        "is required for a serverless pool",
                    ),
                    Some(concurrency) => {
                        problems.within(
                            format!("{path}.concurrency"),
                            concurrency,
                            1,
                            MAX_CONCURRENCY,
                            "executions (account quotas reach tens of thousands)",
                        );
                        if let Some(Ok(platform)) = platform
                            && concurrency > i64::from(platform.default_concurrency)
                        {
                            problems.warn(
                                format!("{path}.concurrency"),
                                format!(
                                    "{concurrency} is above {}'s default account limit of {}; \
                                     make sure the quota was raised",
                                    platform.name, platform.default_concurrency
                                ),
                            );
                        }
                    }
                }
                if pool.count.is_some() {
                    problems.error(
                        format!("{path}.count"),
                        "does not apply to a serverless pool; set `concurrency`",
                    );
                }
            }
        }
        if kind != PoolKind::Gpu && pool.gpus_per_node.is_some() {
            problems.error(format!("{path}.gpusPerNode"), "only applies to a GPU pool");
        }
        for (r, role) in pool.roles.iter().enumerate() {
            let fits = match kind {
                PoolKind::Gpu => role.is_gpu_role(),
                PoolKind::Cpu => matches!(role, Role::Environment | Role::Reward),
                PoolKind::Serverless => *role == Role::Reward,
            };
            if !fits {
                problems.error(
                    format!("{path}.roles[{r}]"),
                    format!("a {} pool cannot take role {role:?}", kind_name(kind)),
                );
            }
        }
    }
    for (kind, unit) in [(PoolKind::Gpu, "GPUs"), (PoolKind::Cpu, "nodes")] {
        // Each pool is bounded on its own; together they are bounded the same, since the
        // simulator's books and the planner's search grow with the total.
        let total = spec
            .pools
            .iter()
            .filter(|p| p.kind() == Some(kind))
            .filter_map(|p| p.count)
            .filter(|&count| (1..=MAX_POOL_COUNT).contains(&count))
            .fold(0_i64, i64::saturating_add);
        if total > MAX_POOL_COUNT {
            problems.error(
                "spec.pools",
                format!(
                    "the {} pools must count at most {MAX_POOL_COUNT} {unit} together \
                     (several times the largest cluster built), got {total}",
                    kind_name(kind)
                ),
            );
        }
    }
    if !spec.pools.iter().any(|p| p.kind() == Some(PoolKind::Gpu)) {
        problems.error(
            "spec.pools",
            "must include at least one GPU pool for the policy model",
        );
    }
    if !spec.pools.iter().any(|p| p.kind() == Some(PoolKind::Cpu)) {
        problems.error(
            "spec.pools",
            "must include at least one CPU pool for environments",
        );
    }
}

fn check_count(pool: &PoolSpec, path: &str, unit: &str, problems: &mut Problems) {
    match pool.count {
        None => problems.error(
            format!("{path}.count"),
            format!("is required: number of {unit}"),
        ),
        Some(count) => {
            problems.at_least(format!("{path}.count"), count, 1);
            if count > MAX_POOL_COUNT {
                problems.error(
                    format!("{path}.count"),
                    format!(
                        "must be at most {MAX_POOL_COUNT} {unit} (several times the largest \
                         cluster built), got {count}"
                    ),
                );
            }
        }
    }
}
