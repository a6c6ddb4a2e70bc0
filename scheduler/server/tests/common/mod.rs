//! What the actor's seeded tests share: their generator and their job.

#![allow(dead_code)] // each test file includes this module and uses part of it

/// SplitMix64: a seeded generator, so that every case is reproducible from its seed alone.
/// Each test file adds the draws it needs in its own `impl Rng`.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// The quick-start job's YAML, as `examples/jobs/quickstart.yaml` has it.
pub fn quickstart_yaml() -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/jobs/quickstart.yaml");
    std::fs::read_to_string(path).expect("examples/jobs/quickstart.yaml is readable")
}
