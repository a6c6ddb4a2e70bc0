// Included (`include!`) by the runtime tests' harness and by the scheduler's own tests: the
// quick-start job grown by GPU pools, whose plans take longer.

/// `yaml` (the quick-start job) with `extra` GPU pools of assorted sizes (`g0`, `g1`, ...; H800
/// and H20 in turn, 8 to 40 GPUs) before its `envs` pool: every plan of it takes longer (the
/// search grows with every pool).
pub fn with_gpu_pools(yaml: &str, extra: usize) -> String {
    let pools: String = (0..extra)
        .map(|i| {
            let gpu = ["H800", "H20"][i % 2];
            format!(
                "    - name: g{i}\n      gpu: {gpu}\n      count: {}\n",
                8 * (i % 5 + 1)
            )
        })
        .collect();
    assert!(yaml.contains("    - name: envs\n"));
    yaml.replace("    - name: envs\n", &format!("{pools}    - name: envs\n"))
}
