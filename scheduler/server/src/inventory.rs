//! Bounds on what a registering worker says of itself (`HardwareInventory`), checked before the
//! scheduler keeps any of it: every string a peer sends ends up in logs, in the metrics' labels
//! and in the journal, and every GPU it declares is a metric series. A name with a newline would
//! forge a log line, a megabyte name held per worker adds up, and a node of 20,000 GPUs makes a
//! metrics page of megabytes; each is refused with the field named.

use rollfleet_proto::v1::{HardwareInventory, hardware_inventory::Device};

/// The longest hostname taken: a DNS name's limit.
pub const MAX_HOSTNAME_BYTES: usize = 253;

/// GPUs one node may declare telemetry for (and so readings and metric series): more than any
/// machine holds.
pub const MAX_GPUS_PER_NODE: usize = 64;

/// The longest free-form string taken otherwise (a backend, its version, a GPU's name or UUID,
/// a CPU shape, an environment or function name, the reason telemetry is missing).
pub const MAX_LABEL_BYTES: usize = 256;

/// Entries of a list of names (environments, functions) a node may declare.
const MAX_NAMES: usize = 256;

/// Why `inventory` is refused, naming the field; `None` when it is within bounds.
pub fn check(inventory: &HardwareInventory) -> Option<String> {
    if let Some(problem) = hostname(&inventory.hostname) {
        return Some(problem);
    }
    let mut labels: Vec<(String, &str)> = vec![
        ("inventory.backend".into(), &inventory.backend),
        (
            "inventory.backend_version".into(),
            &inventory.backend_version,
        ),
    ];
    if let Some(t) = &inventory.gpu_telemetry {
        if t.devices.len() > MAX_GPUS_PER_NODE {
            return Some(format!(
                "inventory.gpu_telemetry.devices: {} GPUs (a node declares at most \
                 {MAX_GPUS_PER_NODE})",
                t.devices.len()
            ));
        }
        labels.push((
            "inventory.gpu_telemetry.unavailable_reason".into(),
            &t.unavailable_reason,
        ));
        for (i, d) in t.devices.iter().enumerate() {
            labels.push((
                format!("inventory.gpu_telemetry.devices[{i}].name"),
                &d.name,
            ));
            labels.push((
                format!("inventory.gpu_telemetry.devices[{i}].uuid"),
                &d.uuid,
            ));
        }
    }
    let names: &[String] = match &inventory.device {
        Some(Device::Gpu(g)) => {
            labels.push(("inventory.gpu.product".into(), &g.product));
            &[]
        }
        Some(Device::Cpu(c)) => {
            labels.push(("inventory.cpu.shape".into(), &c.shape));
            &c.environments
        }
        Some(Device::Serverless(s)) => {
            labels.push(("inventory.serverless.platform".into(), &s.platform));
            &s.functions
        }
        None => &[],
    };
    if names.len() > MAX_NAMES {
        return Some(format!(
            "inventory: {} environments or functions declared (at most {MAX_NAMES})",
            names.len()
        ));
    }
    for (i, name) in names.iter().enumerate() {
        labels.push((format!("inventory: declared name [{i}]"), name));
    }
    labels
        .into_iter()
        .find_map(|(field, value)| label(&field, value))
}

/// Letters, digits, `.`, `-`, `_` and `:` (an IPv6 address), at most [`MAX_HOSTNAME_BYTES`].
fn hostname(name: &str) -> Option<String> {
    if name.len() > MAX_HOSTNAME_BYTES {
        return Some(format!(
            "inventory.hostname: {} ({} bytes; at most {MAX_HOSTNAME_BYTES})",
            crate::quoted(name),
            name.len()
        ));
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':');
    (!name.chars().all(allowed)).then(|| {
        format!(
            "inventory.hostname: {} has a character other than letters, digits, '.', '-', '_' \
             and ':'",
            crate::quoted(name)
        )
    })
}

/// Printable, without control characters, at most [`MAX_LABEL_BYTES`].
fn label(field: &str, value: &str) -> Option<String> {
    if value.len() > MAX_LABEL_BYTES {
        return Some(format!(
            "{field}: {} ({} bytes; at most {MAX_LABEL_BYTES})",
            crate::quoted(value),
            value.len()
        ));
    }
    value
        .chars()
        .any(char::is_control)
        .then(|| format!("{field}: {} has a control character", crate::quoted(value)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rollfleet_proto::v1::{GpuDevice, GpuTelemetryInfo};

    fn named(hostname: &str) -> HardwareInventory {
        HardwareInventory {
            hostname: hostname.into(),
            pool: "decode".into(),
            ..Default::default()
        }
    }

    #[test]
    fn ordinary_hostnames_pod_names_and_addresses_are_taken() {
        for name in [
            "",
            "gpu-node-7",
            "rljob-decode-0.rollfleet.svc",
            "10.0.0.7",
            "fe80::1",
        ] {
            assert_eq!(check(&named(name)), None, "{name}");
        }
    }

    #[test]
    fn a_hostname_that_would_forge_a_log_line_or_is_megabytes_long_is_refused_by_field() {
        let forged = check(&named("node\nscheduler: job quickstart ends")).unwrap();
        assert!(forged.starts_with("inventory.hostname: "), "{forged}");
        assert!(
            !forged.contains('\n'),
            "the refusal quotes it escaped: {forged}"
        );
        let long = check(&named(&"x".repeat(3_500_000))).unwrap();
        assert!(long.contains("3500000 bytes; at most 253"), "{long}");
        assert!(
            long.len() < 300,
            "the refusal quotes it cut short: {}",
            long.len()
        );
    }

    #[test]
    fn a_node_declaring_twenty_thousand_gpus_or_a_control_character_in_a_label_is_refused() {
        let device = GpuDevice {
            name: "NVIDIA H800".into(),
            ..Default::default()
        };
        let mut many = named("node");
        many.gpu_telemetry = Some(GpuTelemetryInfo {
            available: true,
            devices: vec![device.clone(); 20_000],
            ..Default::default()
        });
        let refused = check(&many).unwrap();
        assert!(refused.contains("20000 GPUs"), "{refused}");
        let mut eight = named("node");
        eight.gpu_telemetry = Some(GpuTelemetryInfo {
            available: true,
            devices: vec![device; 8],
            ..Default::default()
        });
        assert_eq!(check(&eight), None);
        let mut bell = named("node");
        bell.backend = "emulated\u{7}".into();
        assert!(check(&bell).unwrap().starts_with("inventory.backend: "));
    }
}
