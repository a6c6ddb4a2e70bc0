//! The on-node performance probe: achieved BF16 GEMM throughput and device-memory bandwidth.
//!
//! Published peaks (the catalogue) are upper bounds; what a node achieves is lower and differs by
//! clocks, power caps and drivers. The profiler merges these measurements over the model-based
//! figures. The probe runs a square BF16 GEMM with cuBLAS (2n^3 FLOP per call) and a
//! device-to-device copy (each byte read once and written once), each after a warm-up, timed
//! around a stream synchronisation.

use std::time::Instant;

use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::CudaContext;
use half::bf16;
use serde::Serialize;

use crate::{Unavailable, discover};

/// What the probe measured on one GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeResult {
    /// Device index.
    pub index: u32,
    /// Driver-reported name.
    pub name: String,
    /// Catalogue name, if recognised.
    pub catalog_name: Option<String>,
    /// Achieved dense BF16 GEMM throughput, FLOP/s.
    pub gemm_flops: f64,
    /// Achieved device-memory bandwidth (read + write), bytes/s.
    pub memory_bandwidth_bytes_per_s: f64,
}

/// Side of the square GEMM: large enough to saturate tensor cores on every catalogue GPU.
const GEMM_N: usize = 8192;
/// Bytes copied by the bandwidth probe.
const COPY_BYTES: usize = 1 << 30;
const REPEATS: u32 = 10;

/// Probes GPU `index`. Without a driver it says so (via NVML discovery) and touches nothing.
pub fn probe(index: u32) -> Result<ProbeResult, Unavailable> {
    // NVML first: it fails cleanly without a driver, whereas loading CUDA would not.
    let gpus = discover()?;
    let info = gpus
        .into_iter()
        .find(|g| g.index == index)
        .ok_or_else(|| Unavailable(format!("no GPU with index {index} on this node")))?;
    let cuda = |e: &dyn std::fmt::Display| Unavailable(format!("CUDA on GPU {index}: {e}"));

    let context = CudaContext::new(index as usize).map_err(|e| cuda(&e))?;
    let stream = context.default_stream();
    let blas = CudaBlas::new(stream.clone()).map_err(|e| cuda(&e))?;
    let elements = GEMM_N * GEMM_N;
    let a = stream.alloc_zeros::<bf16>(elements).map_err(|e| cuda(&e))?;
    let b = stream.alloc_zeros::<bf16>(elements).map_err(|e| cuda(&e))?;
    let mut c = stream.alloc_zeros::<bf16>(elements).map_err(|e| cuda(&e))?;
    let n = GEMM_N as i32;
    let config = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n,
        n,
        k: n,
        alpha: bf16::ONE,
        lda: n,
        ldb: n,
        beta: bf16::ZERO,
        ldc: n,
    };
    let mut gemm = || -> Result<(), Unavailable> {
        // SAFETY: a, b and c each hold n*n elements, and m = n = k = lda = ldb = ldc = n with
        // no transposition, so cuBLAS reads and writes exactly within the three allocations.
        #[allow(unsafe_code)]
        unsafe {
            blas.gemm(config, &a, &b, &mut c).map_err(|e| cuda(&e))
        }
    };
    gemm()?;
    stream.synchronize().map_err(|e| cuda(&e))?;
    let start = Instant::now();
    for _ in 0..REPEATS {
        gemm()?;
    }
    stream.synchronize().map_err(|e| cuda(&e))?;
    let gemm_seconds = start.elapsed().as_secs_f64();
    let gemm_flops = 2.0 * (GEMM_N as f64).powi(3) * f64::from(REPEATS) / gemm_seconds;

    let source = stream.alloc_zeros::<u8>(COPY_BYTES).map_err(|e| cuda(&e))?;
    let mut target = stream.alloc_zeros::<u8>(COPY_BYTES).map_err(|e| cuda(&e))?;
    stream
        .memcpy_dtod(&source, &mut target)
        .map_err(|e| cuda(&e))?;
    stream.synchronize().map_err(|e| cuda(&e))?;
    let start = Instant::now();
    for _ in 0..REPEATS {
        stream
            .memcpy_dtod(&source, &mut target)
            .map_err(|e| cuda(&e))?;
    }
    stream.synchronize().map_err(|e| cuda(&e))?;
    let copy_seconds = start.elapsed().as_secs_f64();
    let memory_bandwidth_bytes_per_s = 2.0 * COPY_BYTES as f64 * f64::from(REPEATS) / copy_seconds;

    Ok(ProbeResult {
        index,
        name: info.name,
        catalog_name: info.catalog_name,
        gemm_flops,
        memory_bandwidth_bytes_per_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_is_skipped_with_a_reason_where_there_is_no_gpu() {
        match probe(0) {
            Ok(result) => {
                // On a GPU machine: real, positive figures.
                assert!(result.gemm_flops > 1e12, "{result:?}");
                assert!(result.memory_bandwidth_bytes_per_s > 1e11, "{result:?}");
            }
            Err(Unavailable(reason)) => {
                assert!(
                    reason.contains("NVML") || reason.contains("no GPU"),
                    "{reason}"
                )
            }
        }
    }
}
