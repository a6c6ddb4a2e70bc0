//! Where a pool's worker pods go, what they ask the cluster for, and the restricted security
//! context every pod the operator makes runs with.
//!
//! Defaults, per pool:
//! - a GPU pool's pods require the node label [`GPU_PRODUCT_LABEL`] that NVIDIA's GPU Feature
//!   Discovery sets, with the product name of the pool's catalogue GPU ([`gpu_product_label`]),
//!   tolerate the `nvidia.com/gpu` taint (`NoSchedule`) that GPU node pools commonly carry to keep
//!   other pods off them, and limit `nvidia.com/gpu` to the GPUs of the pod;
//! - a CPU environment pool's pods request the cores and memory of the pool's catalogue shape;
//! - a serverless pool's one pod (it invokes the functions) asks for nothing in particular.
//!
//! The pool's `kubernetes` block (`rollfleet_spec::KubernetesPlacement`) overrides them: a
//! `nodeSelector` replaces the default one, `tolerations` are added to the default ones,
//! `resources` replace the default request or limit of each resource they name (a GPU pool keeps
//! its `nvidia.com/gpu`), and `affinity` and `priorityClassName` are set as given. With
//! `spec.kubernetes.emulatedGpus` a GPU pool gets none of the GPU defaults: the point is to run on
//! nodes without GPUs.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, Container, PodSecurityContext, ResourceRequirements, SeccompProfile,
    SecurityContext, Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use rollfleet_spec::{GPU_RESOURCE, KubernetesPlacement, TaintEffect, TolerationOperator};

/// The node label NVIDIA's GPU Feature Discovery (part of the NVIDIA device plugin and the GPU
/// Operator) sets to the product name of the node's GPUs.
pub const GPU_PRODUCT_LABEL: &str = "nvidia.com/gpu.product";

/// The user and group every pod the operator makes runs as (the image's own non-root user,
/// `manifests/operator/Dockerfile`).
pub const RUN_AS: i64 = 65532;

/// Where every pod gets a writable `emptyDir`: its root filesystem is read-only, and temporary
/// files (the code-tests reward's sandbox, Python's) go here.
pub const TMP_DIR: &str = "/tmp";

/// The value GPU Feature Discovery gives [`GPU_PRODUCT_LABEL`] on nodes with the catalogue's GPU
/// `name` (matched without regard to case), or `None` for a GPU this table does not know (a
/// job's own catalogue entry: such a pool has no default selector).
///
/// GFD takes the name NVML reports for the device (`nvidia-smi --query-gpu=name`) and replaces
/// its spaces with `-`. The names are those of the variant each catalogue entry describes, by
/// its figures (`docs/hardware-catalogue.md`): the SXM boards of the A100 80 GB, H100, H800 and
/// H200 (an H100 PCIe or NVL node reports another name: give such a pool a `nodeSelector`).
pub fn gpu_product_label(name: &str) -> Option<&'static str> {
    const PRODUCTS: &[(&str, &str)] = &[
        ("A100-80G", "NVIDIA-A100-SXM4-80GB"),
        ("H100", "NVIDIA-H100-80GB-HBM3"),
        ("H800", "NVIDIA-H800"),
        ("H20", "NVIDIA-H20"),
        ("H200", "NVIDIA-H200"),
        ("L20", "NVIDIA-L20"),
        ("L40S", "NVIDIA-L40S"),
        ("B200", "NVIDIA-B200"),
    ];
    PRODUCTS
        .iter()
        .find(|(catalogue, _)| catalogue.eq_ignore_ascii_case(name.trim()))
        .map(|&(_, label)| label)
}

/// The toleration a GPU pool's pods get by default: of the `nvidia.com/gpu` taint's
/// `NoSchedule` effect, whatever its value.
pub fn default_gpu_toleration() -> Toleration {
    Toleration {
        key: Some(GPU_RESOURCE.into()),
        operator: Some("Exists".into()),
        effect: Some("NoSchedule".into()),
        ..Default::default()
    }
}

/// What a pool's pods get by default, before its `kubernetes` block.
#[derive(Debug, Clone, PartialEq)]
pub enum Defaults {
    /// A GPU pool on real GPUs: the catalogue's GPU name and the GPUs of each pod.
    Gpu {
        /// The catalogue's GPU name.
        product: String,
        /// GPUs per pod.
        gpus: u32,
    },
    /// A CPU pool: the cores and memory (GiB) of its catalogue shape.
    Cpu {
        /// Virtual CPUs.
        vcpus: u32,
        /// Memory, GiB.
        memory_gib: f64,
    },
    /// Nothing in particular (a serverless pool's pod; GPU pods with emulated GPUs).
    None,
}

/// Where a pod goes and what it asks for.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Placement {
    /// Required node labels.
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Tolerated taints.
    pub tolerations: Option<Vec<Toleration>>,
    /// Affinity, as the job gives it.
    pub affinity: Option<Affinity>,
    /// Requests and limits.
    pub resources: Option<ResourceRequirements>,
    /// The PriorityClass.
    pub priority_class_name: Option<String>,
}

/// A memory size in GiB as a Kubernetes quantity: whole GiB as `Gi`, else whole MiB.
fn gib_quantity(gib: f64) -> Quantity {
    if gib.fract() == 0.0 {
        Quantity(format!("{gib:.0}Gi"))
    } else {
        Quantity(format!("{:.0}Mi", (gib * 1024.0).ceil()))
    }
}

/// The placement of a pod of pool `path` (`spec.pools[i]`, for errors) with `defaults` and the
/// pool's `kubernetes` block; an `affinity` that is not a Kubernetes `Affinity` is an error
/// naming its field.
pub fn placement(
    defaults: &Defaults,
    spec: Option<&KubernetesPlacement>,
    path: &str,
) -> Result<Placement, String> {
    let mut node_selector = BTreeMap::new();
    let mut tolerations = Vec::new();
    let mut limits = BTreeMap::new();
    let mut requests = BTreeMap::new();
    match defaults {
        Defaults::Gpu { product, gpus } => {
            if let Some(label) = gpu_product_label(product) {
                node_selector.insert(GPU_PRODUCT_LABEL.to_owned(), label.to_owned());
            }
            tolerations.push(default_gpu_toleration());
            limits.insert(GPU_RESOURCE.to_owned(), Quantity(gpus.to_string()));
        }
        Defaults::Cpu { vcpus, memory_gib } => {
            requests.insert("cpu".to_owned(), Quantity(vcpus.to_string()));
            requests.insert("memory".to_owned(), gib_quantity(*memory_gib));
        }
        Defaults::None => {}
    }
    let mut affinity = None;
    let mut priority_class_name = None;
    if let Some(spec) = spec {
        if let Some(selector) = &spec.node_selector {
            node_selector = selector.clone();
        }
        tolerations.extend(spec.tolerations.iter().map(|t| Toleration {
            key: t.key.clone(),
            operator: t.operator.map(|o| {
                match o {
                    TolerationOperator::Equal => "Equal",
                    TolerationOperator::Exists => "Exists",
                }
                .into()
            }),
            value: t.value.clone(),
            effect: t.effect.map(|e| {
                match e {
                    TaintEffect::NoSchedule => "NoSchedule",
                    TaintEffect::PreferNoSchedule => "PreferNoSchedule",
                    TaintEffect::NoExecute => "NoExecute",
                }
                .into()
            }),
            toleration_seconds: t.toleration_seconds,
        }));
        for (name, quantity) in &spec.resources.requests {
            requests.insert(name.clone(), Quantity(quantity.0.clone()));
        }
        for (name, quantity) in &spec.resources.limits {
            // The GPUs of a pod are the pool's, never the block's (the spec refuses them too).
            if name != GPU_RESOURCE {
                limits.insert(name.clone(), Quantity(quantity.0.clone()));
            }
        }
        if let Some(value) = &spec.affinity {
            let json = serde_json::to_value(value)
                .map_err(|e| format!("{path}.kubernetes.affinity: {e}"))?;
            affinity = Some(
                serde_json::from_value::<Affinity>(json)
                    .map_err(|e| format!("{path}.kubernetes.affinity: {e}"))?,
            );
        }
        priority_class_name = spec.priority_class_name.clone();
    }
    let resources = (!requests.is_empty() || !limits.is_empty()).then(|| ResourceRequirements {
        requests: (!requests.is_empty()).then_some(requests),
        limits: (!limits.is_empty()).then_some(limits),
        ..Default::default()
    });
    Ok(Placement {
        node_selector: (!node_selector.is_empty()).then_some(node_selector),
        tolerations: (!tolerations.is_empty()).then_some(tolerations),
        affinity,
        resources,
        priority_class_name,
    })
}

/// The pod security context of every pod the operator makes: Kubernetes' `restricted` Pod
/// Security Standard (a non-root user, the runtime's default seccomp profile), and the group
/// that owns its volumes, so the scheduler can write its journal on a claim.
pub fn pod_security_context() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(RUN_AS),
        run_as_group: Some(RUN_AS),
        fs_group: Some(RUN_AS),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// `container` with the `restricted` standard's container settings: no privilege escalation, no
/// capabilities, a read-only root filesystem (what it writes goes to its volumes).
pub fn restricted(container: Container) -> Container {
    Container {
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Default::default()
            }),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..container
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_gpu_has_the_product_label_gpu_feature_discovery_gives_it() {
        for gpu in rollfleet_catalog::Catalog::builtin().gpus() {
            let label = gpu_product_label(&gpu.name).unwrap_or_default();
            assert!(label.starts_with("NVIDIA-"), "{}: {label:?}", gpu.name);
            assert!(!label.contains(' '), "GFD replaces spaces: {label}");
        }
        assert_eq!(gpu_product_label(" h800 "), Some("NVIDIA-H800"));
        assert_eq!(gpu_product_label("MyGPU"), None);
    }

    #[test]
    fn cpu_memory_is_requested_in_whole_gibibytes_or_mebibytes() {
        assert_eq!(gib_quantity(64.0), Quantity("64Gi".into()));
        assert_eq!(gib_quantity(1.5), Quantity("1536Mi".into()));
    }

    #[test]
    fn an_affinity_that_is_not_a_kubernetes_affinity_is_refused_with_its_field_path() {
        let spec: KubernetesPlacement = serde_yaml_ng::from_str(
            "affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: 3}}",
        )
        .expect("a placement");
        let err = placement(&Defaults::None, Some(&spec), "spec.pools[2]").unwrap_err();
        assert!(
            err.starts_with("spec.pools[2].kubernetes.affinity: "),
            "{err}"
        );
    }
}
