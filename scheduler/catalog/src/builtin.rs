//! The built-in catalogue entries. Each figure is copied from the public document named by its
//! `source` key; `docs/hardware-catalogue.md` lists the documents and how each figure was read
//! (dense, not sparse; per GPU, not per board). Prices are indicative and meant to be overridden.

use crate::{CpuShape, GpuProduct, ServerlessPlatform};

/// Every source key used below; a test checks that the docs resolve each of them.
pub const SOURCES: &[&str] = &[
    "nvidia-a100-datasheet",
    "nvidia-h100-datasheet",
    "nvidia-h800-datasheet",
    "nvidia-h20-specs",
    "nvidia-h200-datasheet",
    "nvidia-l20-specs",
    "nvidia-l40s-datasheet",
    "nvidia-hgx-b200-datasheet",
    "aws-ec2-on-demand-pricing",
    "aws-lambda-pricing-and-quotas",
];

fn gpu(
    name: &str,
    bf16_dense_tflops: f64,
    memory_gb: f64,
    memory_bandwidth_gbps: f64,
    interconnect_gbps: f64,
    price_per_hour_usd: f64,
    source: &str,
) -> GpuProduct {
    GpuProduct {
        name: name.to_owned(),
        bf16_dense_tflops,
        memory_gb,
        memory_bandwidth_gbps,
        interconnect_gbps,
        price_per_hour_usd,
        source: source.to_owned(),
    }
}

pub(crate) fn gpus() -> Vec<GpuProduct> {
    vec![
        //   name        TFLOP/s  GB     GB/s    link GB/s  $/h
        gpu(
            "A100-80G",
            312.0,
            80.0,
            2039.0,
            600.0,
            1.79,
            "nvidia-a100-datasheet",
        ),
        gpu(
            "H100",
            989.0,
            80.0,
            3350.0,
            900.0,
            2.99,
            "nvidia-h100-datasheet",
        ),
        gpu(
            "H800",
            989.0,
            80.0,
            3350.0,
            400.0,
            2.60,
            "nvidia-h800-datasheet",
        ),
        gpu("H20", 148.0, 96.0, 4000.0, 900.0, 1.10, "nvidia-h20-specs"),
        gpu(
            "H200",
            989.0,
            141.0,
            4800.0,
            900.0,
            3.79,
            "nvidia-h200-datasheet",
        ),
        gpu("L20", 119.5, 48.0, 864.0, 64.0, 0.65, "nvidia-l20-specs"),
        gpu(
            "L40S",
            362.0,
            48.0,
            864.0,
            64.0,
            1.05,
            "nvidia-l40s-datasheet",
        ),
        gpu(
            "B200",
            2250.0,
            180.0,
            8000.0,
            1800.0,
            4.99,
            "nvidia-hgx-b200-datasheet",
        ),
    ]
}

fn cpu(name: &str, vcpus: u32, memory_gib: f64, price_per_hour_usd: f64) -> CpuShape {
    CpuShape {
        name: name.to_owned(),
        vcpus,
        memory_gib,
        price_per_hour_usd,
        source: "aws-ec2-on-demand-pricing".to_owned(),
    }
}

pub(crate) fn cpu_shapes() -> Vec<CpuShape> {
    vec![
        cpu("c7i.8xlarge", 32, 64.0, 1.428),
        cpu("c7i.16xlarge", 64, 128.0, 2.856),
        cpu("c7i.48xlarge", 192, 384.0, 8.568),
        cpu("m7i.8xlarge", 32, 128.0, 1.6128),
    ]
}

pub(crate) fn serverless_platforms() -> Vec<ServerlessPlatform> {
    vec![ServerlessPlatform {
        name: "aws-lambda".to_owned(),
        cold_start_ms: 250.0,
        price_per_gb_second_usd: 0.000_016_666_7,
        price_per_million_requests_usd: 0.20,
        default_concurrency: 1000,
        max_memory_mb: 10_240,
        max_timeout_s: 900,
        max_payload_bytes: 6 * 1024 * 1024,
        source: "aws-lambda-pricing-and-quotas".to_owned(),
    }]
}
