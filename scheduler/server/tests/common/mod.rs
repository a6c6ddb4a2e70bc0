//! What the actor's seeded tests share: their generator and their job.

#![allow(dead_code)] // each test file includes this module and uses part of it

/// The project's seeded generator (`rollfleet_rng::SplitMix64`), so that every case is
/// reproducible from its seed alone. Each test file adds the draws it needs in its own `impl Rng`.
pub struct Rng(rollfleet_rng::SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(rollfleet_rng::SplitMix64::new(seed))
    }

    pub fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
}

/// The quick-start job's YAML, as `examples/jobs/quickstart.yaml` has it.
pub fn quickstart_yaml() -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/jobs/quickstart.yaml");
    std::fs::read_to_string(path).expect("examples/jobs/quickstart.yaml is readable")
}
