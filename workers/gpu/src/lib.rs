//! GPUs as a node worker sees them: what is installed, how busy it is, and how fast it really is.
//!
//! - [`discover`] lists the GPUs through NVML (product, memory, clocks, bus width) and maps
//!   each to its catalogue name;
//! - [`Telemetry`] samples utilisation and memory in use, for the router's load figures;
//! - [`probe`] measures achieved BF16 GEMM FLOP/s (cuBLAS) and device-memory bandwidth (a
//!   device-to-device copy) on one GPU, for the profiler.
//!
//! On a machine without an NVIDIA driver (every CI machine of this project) each of them returns
//! [`Unavailable`] with the reason, once; nothing here invents a number. NVML and CUDA are loaded
//! at run time, so this crate builds everywhere.

mod probe;

use serde::Serialize;

pub use probe::{ProbeResult, probe};

/// Why GPU information is unavailable on this machine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("GPU unavailable: {0}")]
pub struct Unavailable(pub String);

/// One GPU as NVML reports it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInfo {
    /// Index of the device on this node.
    pub index: u32,
    /// Name as the driver reports it, e.g. `NVIDIA H800`.
    pub name: String,
    /// Catalogue product, if the name is recognised.
    pub catalog_name: Option<String>,
    /// Device UUID.
    pub uuid: String,
    /// Device memory, bytes.
    pub memory_bytes: u64,
    /// Peak memory bandwidth from the maximum memory clock and the bus width, bytes/s
    /// (clock x 2 transfers per cycle x width / 8).
    pub peak_memory_bandwidth_bytes_per_s: Option<f64>,
    /// Maximum SM clock, MHz.
    pub max_sm_clock_mhz: Option<u32>,
}

/// Maps a driver-reported product name to the catalogue's name (`"NVIDIA H800 PCIe"` → `H800`).
pub fn catalog_name(driver_name: &str) -> Option<&'static str> {
    let name = driver_name.to_ascii_uppercase();
    let name = name.trim_start_matches("NVIDIA ").trim();
    // Longest, most specific patterns first: "H200" must not be read as "H20".
    const PATTERNS: &[(&str, &str)] = &[
        ("A100-SXM4-80GB", "A100-80G"),
        ("A100 80GB", "A100-80G"),
        ("A100-PCIE-80GB", "A100-80G"),
        ("B200", "B200"),
        ("H200", "H200"),
        ("H800", "H800"),
        ("H100", "H100"),
        ("H20", "H20"),
        ("L40S", "L40S"),
        ("L20", "L20"),
    ];
    PATTERNS
        .iter()
        .find(|(pattern, _)| {
            name.starts_with(pattern)
                && !name[pattern.len()..].starts_with(|c: char| c.is_ascii_digit())
        })
        .map(|(_, catalog)| *catalog)
}

fn nvml() -> Result<nvml_wrapper::Nvml, Unavailable> {
    nvml_wrapper::Nvml::init().map_err(|e| {
        Unavailable(format!(
            "NVML could not be initialised ({e}); no NVIDIA driver on this machine?"
        ))
    })
}

/// Lists this node's GPUs.
pub fn discover() -> Result<Vec<GpuInfo>, Unavailable> {
    let nvml = nvml()?;
    let count = nvml
        .device_count()
        .map_err(|e| Unavailable(format!("NVML device count: {e}")))?;
    if count == 0 {
        return Err(Unavailable("the NVIDIA driver reports no GPU".to_owned()));
    }
    let mut gpus = Vec::with_capacity(count as usize);
    for index in 0..count {
        let device = nvml
            .device_by_index(index)
            .map_err(|e| Unavailable(format!("NVML device {index}: {e}")))?;
        let name = device.name().unwrap_or_else(|_| "unknown".to_owned());
        let memory_clock = device
            .max_clock_info(nvml_wrapper::enum_wrappers::device::Clock::Memory)
            .ok();
        let bus_width = device.memory_bus_width().ok();
        gpus.push(GpuInfo {
            index,
            catalog_name: catalog_name(&name).map(str::to_owned),
            name,
            uuid: device.uuid().unwrap_or_default(),
            memory_bytes: device.memory_info().map(|m| m.total).unwrap_or(0),
            peak_memory_bandwidth_bytes_per_s: memory_clock
                .zip(bus_width)
                .map(|(mhz, bits)| f64::from(mhz) * 1e6 * 2.0 * f64::from(bits) / 8.0),
            max_sm_clock_mhz: device
                .max_clock_info(nvml_wrapper::enum_wrappers::device::Clock::SM)
                .ok(),
        });
    }
    Ok(gpus)
}

/// One telemetry sample of one GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuSample {
    /// Device index.
    pub index: u32,
    /// Share of the last sample period a kernel was running, 0..1.
    pub utilization: f64,
    /// Device memory in use, bytes.
    pub memory_used_bytes: u64,
}

/// Periodic GPU readings. Open it once: if it is unavailable, report the reason once and do not
/// try again (a machine does not grow a driver while a worker runs).
pub struct Telemetry {
    nvml: nvml_wrapper::Nvml,
    count: u32,
}

impl Telemetry {
    /// Opens NVML.
    pub fn open() -> Result<Telemetry, Unavailable> {
        let nvml = nvml()?;
        let count = nvml
            .device_count()
            .map_err(|e| Unavailable(format!("NVML device count: {e}")))?;
        Ok(Telemetry { nvml, count })
    }

    /// One reading per GPU; a GPU whose reading fails is left out rather than reported as zero.
    pub fn sample(&self) -> Vec<GpuSample> {
        (0..self.count)
            .filter_map(|index| {
                let device = self.nvml.device_by_index(index).ok()?;
                let utilization = device.utilization_rates().ok()?;
                let memory = device.memory_info().ok()?;
                Some(GpuSample {
                    index,
                    utilization: f64::from(utilization.gpu) / 100.0,
                    memory_used_bytes: memory.used,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_names_map_to_catalogue_names() {
        let cases = [
            ("NVIDIA H800", Some("H800")),
            ("NVIDIA H800 PCIe", Some("H800")),
            ("NVIDIA H20", Some("H20")),
            ("NVIDIA H200", Some("H200")),
            ("NVIDIA H100 80GB HBM3", Some("H100")),
            ("NVIDIA A100-SXM4-80GB", Some("A100-80G")),
            ("NVIDIA A100-SXM4-40GB", None),
            ("NVIDIA L20", Some("L20")),
            ("NVIDIA L40S", Some("L40S")),
            ("NVIDIA L4", None),
            ("NVIDIA B200", Some("B200")),
            ("Tesla T4", None),
        ];
        for (driver, expected) in cases {
            assert_eq!(catalog_name(driver), expected, "{driver}");
        }
    }

    /// These machines have no NVIDIA driver; on one that has, the test checks real readings.
    #[test]
    fn discovery_either_lists_real_gpus_or_says_why_not() {
        match discover() {
            Ok(gpus) => {
                assert!(!gpus.is_empty());
                assert!(gpus.iter().all(|g| g.memory_bytes > 0));
            }
            Err(Unavailable(reason)) => {
                assert!(
                    reason.contains("NVML") || reason.contains("no GPU"),
                    "{reason}"
                )
            }
        }
        match Telemetry::open() {
            Ok(telemetry) => {
                for sample in telemetry.sample() {
                    assert!((0.0..=1.0).contains(&sample.utilization));
                }
            }
            Err(Unavailable(reason)) => assert!(reason.contains("NVML"), "{reason}"),
        }
    }
}
