//! The hardware catalogue: what each kind of device can do and what it costs.
//!
//! The scheduler, the planner and the simulator never hard-code a hardware figure; they ask this
//! crate. Every built-in figure carries a `source` key that `docs/hardware-catalogue.md` resolves
//! to the public document it was taken from, and users can add or override entries from the job
//! spec (`spec.catalog`) with the very same field names.
//!
//! Units are the ones datasheets use, spelled out in field names: decimal gigabytes (10^9 bytes),
//! GB/s, dense (not sparse) TFLOP/s, US dollars per hour.

mod builtin;

/// Every source key the built-in entries cite; `docs/hardware-catalogue.md` resolves each one.
pub use builtin::SOURCES as BUILTIN_SOURCES;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One GPU product: the figures a roofline cost model needs, plus a price.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuProduct {
    /// Canonical product name, e.g. `H800`.
    pub name: String,
    /// Peak dense BF16 tensor throughput, TFLOP/s (no structured sparsity).
    pub bf16_dense_tflops: f64,
    /// Device memory capacity, GB (10^9 bytes).
    pub memory_gb: f64,
    /// Device memory bandwidth, GB/s.
    #[serde(rename = "memoryBandwidthGBps")]
    pub memory_bandwidth_gbps: f64,
    /// GPU-to-GPU bandwidth inside a node (NVLink or PCIe), GB/s per GPU, bidirectional.
    #[serde(rename = "interconnectGBps")]
    pub interconnect_gbps: f64,
    /// Indicative on-demand price, USD per GPU-hour.
    pub price_per_hour_usd: f64,
    /// Key of the public source of these figures (see `docs/hardware-catalogue.md`).
    #[serde(default = "user_source")]
    pub source: String,
}

impl GpuProduct {
    /// The roofline ridge point in FLOP per byte: work with a higher arithmetic intensity is
    /// compute-bound on this GPU, work with a lower one is bandwidth-bound.
    pub fn ridge_point_flop_per_byte(&self) -> f64 {
        (self.bf16_dense_tflops * 1e12) / (self.memory_bandwidth_gbps * 1e9)
    }

    /// Peak dense BF16 FLOP/s.
    pub fn peak_flops(&self) -> f64 {
        self.bf16_dense_tflops * 1e12
    }

    /// Device memory bandwidth in bytes per second.
    pub fn memory_bandwidth_bytes_per_s(&self) -> f64 {
        self.memory_bandwidth_gbps * 1e9
    }

    /// Device memory capacity in bytes.
    pub fn memory_bytes(&self) -> f64 {
        self.memory_gb * 1e9
    }
}

/// One CPU node shape for environment workers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CpuShape {
    /// Shape name, e.g. `c7i.8xlarge`.
    pub name: String,
    /// Virtual CPUs (hardware threads).
    pub vcpus: u32,
    /// Memory, GiB.
    pub memory_gib: f64,
    /// Indicative on-demand price, USD per node-hour.
    pub price_per_hour_usd: f64,
    /// Key of the public source of these figures.
    #[serde(default = "user_source")]
    pub source: String,
}

/// A serverless function platform (the AWS Lambda model, or a user's own).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServerlessPlatform {
    /// Platform name, e.g. `aws-lambda`.
    pub name: String,
    /// Typical cold-start latency added to the first invocation of a new instance, ms.
    pub cold_start_ms: f64,
    /// Price per GB-second of configured memory, USD.
    pub price_per_gb_second_usd: f64,
    /// Price per million requests, USD.
    pub price_per_million_requests_usd: f64,
    /// Default account concurrency limit (concurrent executions).
    pub default_concurrency: u32,
    /// Largest memory size a function may be given, MB.
    pub max_memory_mb: u32,
    /// Longest a single invocation may run, s.
    pub max_timeout_s: u32,
    /// Largest synchronous request payload, bytes.
    pub max_payload_bytes: u64,
    /// Key of the public source of these figures.
    #[serde(default = "user_source")]
    pub source: String,
}

fn user_source() -> String {
    "user".to_owned()
}

/// A lookup that found nothing; the message lists what is known so a typo is easy to fix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("unknown {kind} \"{name}\" (known: {})", known.join(", "))]
pub struct UnknownEntry {
    /// What was looked up: `GPU`, `CPU shape` or `serverless platform`.
    pub kind: &'static str,
    /// The name as the user wrote it.
    pub name: String,
    /// Every name the catalogue knows, sorted.
    pub known: Vec<String>,
}

/// The hardware catalogue: built-in entries plus the user's additions.
///
/// Entries are kept in `BTreeMap`s keyed by upper-cased name so that iteration order is fixed
/// (the scheduler core's decisions must never depend on hash order) and lookups ignore case.
#[derive(Debug, Clone, PartialEq)]
pub struct Catalog {
    gpus: BTreeMap<String, GpuProduct>,
    cpu_shapes: BTreeMap<String, CpuShape>,
    serverless: BTreeMap<String, ServerlessPlatform>,
}

impl Default for Catalog {
    fn default() -> Self {
        Self::builtin()
    }
}

fn key(name: &str) -> String {
    name.trim().to_ascii_uppercase()
}

impl Catalog {
    /// The built-in catalogue (figures cited in `docs/hardware-catalogue.md`).
    pub fn builtin() -> Self {
        let mut catalog = Catalog {
            gpus: BTreeMap::new(),
            cpu_shapes: BTreeMap::new(),
            serverless: BTreeMap::new(),
        };
        for gpu in builtin::gpus() {
            catalog.add_gpu(gpu);
        }
        for shape in builtin::cpu_shapes() {
            catalog.add_cpu_shape(shape);
        }
        for platform in builtin::serverless_platforms() {
            catalog.add_serverless(platform);
        }
        catalog
    }

    /// Adds a GPU product, replacing any entry of the same name (case-insensitive).
    pub fn add_gpu(&mut self, gpu: GpuProduct) {
        self.gpus.insert(key(&gpu.name), gpu);
    }

    /// Adds a CPU node shape, replacing any entry of the same name (case-insensitive).
    pub fn add_cpu_shape(&mut self, shape: CpuShape) {
        self.cpu_shapes.insert(key(&shape.name), shape);
    }

    /// Adds a serverless platform, replacing any entry of the same name (case-insensitive).
    pub fn add_serverless(&mut self, platform: ServerlessPlatform) {
        self.serverless.insert(key(&platform.name), platform);
    }

    /// Looks up a GPU product by name, ignoring case.
    pub fn gpu(&self, name: &str) -> Result<&GpuProduct, UnknownEntry> {
        self.gpus.get(&key(name)).ok_or_else(|| UnknownEntry {
            kind: "GPU",
            name: name.to_owned(),
            known: self.gpus.values().map(|g| g.name.clone()).collect(),
        })
    }

    /// Looks up a CPU node shape by name, ignoring case.
    pub fn cpu_shape(&self, name: &str) -> Result<&CpuShape, UnknownEntry> {
        self.cpu_shapes.get(&key(name)).ok_or_else(|| UnknownEntry {
            kind: "CPU shape",
            name: name.to_owned(),
            known: self.cpu_shapes.values().map(|s| s.name.clone()).collect(),
        })
    }

    /// Looks up a serverless platform by name, ignoring case.
    pub fn serverless(&self, name: &str) -> Result<&ServerlessPlatform, UnknownEntry> {
        self.serverless.get(&key(name)).ok_or_else(|| UnknownEntry {
            kind: "serverless platform",
            name: name.to_owned(),
            known: self.serverless.values().map(|p| p.name.clone()).collect(),
        })
    }

    /// Every GPU product, in name order.
    pub fn gpus(&self) -> impl Iterator<Item = &GpuProduct> {
        self.gpus.values()
    }

    /// Every CPU node shape, in name order.
    pub fn cpu_shapes(&self) -> impl Iterator<Item = &CpuShape> {
        self.cpu_shapes.values()
    }

    /// Every serverless platform, in name order.
    pub fn serverless_platforms(&self) -> impl Iterator<Item = &ServerlessPlatform> {
        self.serverless.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_catalogue_has_every_gpu_the_design_names() {
        let catalog = Catalog::builtin();
        for name in [
            "A100-80G", "H100", "H800", "H20", "H200", "L20", "L40S", "B200",
        ] {
            assert!(catalog.gpu(name).is_ok(), "{name} missing");
        }
    }

    #[test]
    fn every_builtin_figure_is_positive_and_cited() {
        let catalog = Catalog::builtin();
        for gpu in catalog.gpus() {
            for figure in [
                gpu.bf16_dense_tflops,
                gpu.memory_gb,
                gpu.memory_bandwidth_gbps,
                gpu.interconnect_gbps,
                gpu.price_per_hour_usd,
            ] {
                assert!(figure.is_finite() && figure > 0.0, "{}: {figure}", gpu.name);
            }
            assert!(
                builtin::SOURCES.contains(&gpu.source.as_str()),
                "{}",
                gpu.name
            );
        }
        for shape in catalog.cpu_shapes() {
            assert!(shape.vcpus > 0 && shape.memory_gib > 0.0 && shape.price_per_hour_usd > 0.0);
            assert!(
                builtin::SOURCES.contains(&shape.source.as_str()),
                "{}",
                shape.name
            );
        }
        for platform in catalog.serverless_platforms() {
            assert!(platform.price_per_gb_second_usd > 0.0 && platform.default_concurrency > 0);
            assert!(builtin::SOURCES.contains(&platform.source.as_str()));
        }
    }

    #[test]
    fn every_source_key_is_resolved_in_the_catalogue_docs() {
        let docs = include_str!("../../../docs/hardware-catalogue.md");
        for source in builtin::SOURCES {
            assert!(
                docs.contains(&format!("`{source}`")),
                "{source} not cited in docs"
            );
        }
    }

    #[test]
    fn lookup_ignores_case_and_surrounding_space() {
        let catalog = Catalog::builtin();
        assert_eq!(catalog.gpu(" h800 ").unwrap().name, "H800");
        assert_eq!(
            catalog.cpu_shape("C7I.8XLARGE").unwrap().name,
            "c7i.8xlarge"
        );
    }

    #[test]
    fn unknown_gpu_error_lists_every_known_name_in_order() {
        let error = Catalog::builtin().gpu("H900").unwrap_err();
        assert_eq!(
            error.to_string(),
            "unknown GPU \"H900\" (known: A100-80G, B200, H100, H20, H200, H800, L20, L40S)"
        );
    }

    #[test]
    fn decode_favours_h20_and_prefill_favours_h800_by_ridge_point() {
        let catalog = Catalog::builtin();
        let h800 = catalog.gpu("H800").unwrap();
        let h20 = catalog.gpu("H20").unwrap();
        // Decode at small batch runs at ~1 FLOP/byte: far below both ridges, so bandwidth
        // decides, and the H20 has more of it. Prefill runs at hundreds of FLOP/byte: above
        // the H20's ridge, so compute decides, and the H800 has 6.7x more of it.
        assert!(h20.memory_bandwidth_gbps > h800.memory_bandwidth_gbps);
        assert!(h800.bf16_dense_tflops > 6.0 * h20.bf16_dense_tflops);
        assert!(h20.ridge_point_flop_per_byte() < 40.0);
        assert!(h800.ridge_point_flop_per_byte() > 250.0);
    }

    #[test]
    fn user_entry_overrides_builtin_of_same_name() {
        let mut catalog = Catalog::builtin();
        let json = r#"{"name":"h20","bf16DenseTflops":150,"memoryGb":96,
            "memoryBandwidthGBps":4000,"interconnectGBps":900,"pricePerHourUsd":0.9}"#;
        let gpu: GpuProduct = serde_json::from_str(json).unwrap();
        assert_eq!(gpu.source, "user");
        catalog.add_gpu(gpu);
        assert_eq!(catalog.gpu("H20").unwrap().bf16_dense_tflops, 150.0);
        assert_eq!(catalog.gpus().count(), 8);
    }
}
