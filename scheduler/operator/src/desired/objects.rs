//! The Kubernetes objects of a job, piece by piece: the job file and its hash, names, owner
//! references, labels and metadata, the Deployments and the worker container, and the volumes,
//! mounts and environment of the token, TLS and journal.

use super::*;

/// The job file the scheduler runs: the object's kind, name and spec (none of the cluster's
/// bookkeeping, and neither `suspend` nor `kubernetes`, so that suspending, resuming and changing
/// how the operator runs it keep the job file, its hash and so its journal), as YAML.
pub fn job_file(job: &RLJob) -> Result<String, serde_yaml_ng::Error> {
    let mut spec = job.spec.clone();
    if let Some(fields) = spec.as_object_mut() {
        fields.remove(SUSPEND_FIELD);
        fields.remove(KUBERNETES_FIELD);
    }
    serde_yaml_ng::to_string(&serde_json::json!({
        "apiVersion": format!("{}/{}", crate::crd::GROUP, crate::crd::VERSION),
        "kind": KIND,
        "metadata": {
            "name": job.name(),
            "labels": job.metadata.labels.clone().unwrap_or_default(),
        },
        "spec": spec,
    }))
}

/// FNV-1a, for a stable hash of the job file (the standard library's hasher is seeded per
/// process, and the pod template must not change when the operator restarts).
pub(super) fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A DNS-1123 name from `parts`: lowercase letters, digits and `-`, at most 63 characters
/// (longer names keep a hash of the whole, so two long names stay apart).
pub fn dns_name(parts: &[&str]) -> String {
    let joined = parts.join("-");
    let mut name: String = joined
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9') => c,
            _ => '-',
        })
        .collect();
    name = name.trim_matches('-').to_owned();
    if name.len() > 63 {
        let hash = format!("{:08x}", fnv1a(&joined) as u32);
        name.truncate(63 - hash.len() - 1);
        name = format!("{}-{hash}", name.trim_end_matches('-'));
    }
    if name.is_empty() {
        "rljob".into()
    } else {
        name
    }
}

fn owner(job: &RLJob) -> OwnerReference {
    OwnerReference {
        api_version: format!("{}/{}", crate::crd::GROUP, crate::crd::VERSION),
        kind: KIND.into(),
        name: job.name().into(),
        uid: job.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

pub(super) fn labels(job: &RLJob, component: &str, pool: Option<&str>) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::from([
        ("app.kubernetes.io/name".to_owned(), "rollfleet".to_owned()),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            "rollfleet-operator".to_owned(),
        ),
        (JOB_LABEL.to_owned(), dns_name(&[job.name()])),
        (COMPONENT_LABEL.to_owned(), component.to_owned()),
    ]);
    if let Some(pool) = pool {
        labels.insert(POOL_LABEL.to_owned(), dns_name(&[pool]));
    }
    labels
}

pub(super) fn meta(job: &RLJob, name: String, labels: BTreeMap<String, String>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(job.namespace().to_owned()),
        labels: Some(labels),
        owner_references: Some(vec![owner(job)]),
        ..Default::default()
    }
}

/// The scheduler's Service name, which is also its host name in the namespace.
pub fn scheduler_name(job: &RLJob) -> String {
    dns_name(&[job.name(), "scheduler"])
}

pub(super) fn deployment(
    job: &RLJob,
    name: String,
    labels: BTreeMap<String, String>,
    replicas: i32,
    pod: PodSpec,
    pod_annotations: BTreeMap<String, String>,
    recreate: bool,
) -> Deployment {
    Deployment {
        metadata: meta(job, name, labels.clone()),
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(labels.clone()),
                ..Default::default()
            },
            strategy: recreate.then(|| DeploymentStrategy {
                type_: Some("Recreate".into()),
                ..Default::default()
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    annotations: (!pod_annotations.is_empty()).then_some(pod_annotations),
                    ..Default::default()
                }),
                spec: Some(pod),
            },
            ..Default::default()
        }),
        status: None,
    }
}

/// A worker pod's container for `pool`, with `gpus` GPUs of its node (0: a CPU or serverless
/// pool) and `resources` (the pool's placement).
pub(super) fn worker_container(
    job: &RLJob,
    settings: &Settings,
    pool: &str,
    gpus: u32,
    resources: Option<ResourceRequirements>,
) -> Container {
    let tls = tls_files(job, &[TLS_CA_KEY]);
    let mut args = vec![
        "worker".to_owned(),
        "--scheduler".to_owned(),
        format!(
            "{}://{}:{GRPC_PORT}",
            if tls.is_some() { "https" } else { "http" },
            scheduler_name(job)
        ),
        "--pool".to_owned(),
        pool.to_owned(),
        // At the job's end a worker waits to be scaled down rather than exiting: a Deployment
        // would start it again only to be told the job has ended.
        "--until-stopped".to_owned(),
    ];
    if tls.is_some() {
        args.extend(["--tls-ca".to_owned(), format!("{TLS_DIR}/{TLS_CA_KEY}")]);
    }
    let annotation = |key: &str| annotation(job, key);
    if gpus > 0 {
        args.extend(["--gpus".to_owned(), gpus.to_string()]);
        if let Some(url) = settings_of(job)
            .engine_url
            .or_else(|| annotation(ENGINE_URL_ANNOTATION))
        {
            args.extend([
                "--engine".to_owned(),
                "openai".to_owned(),
                "--engine-url".to_owned(),
                url,
            ]);
        }
    }
    placement::restricted(Container {
        name: "worker".into(),
        image: Some(settings.image.clone()),
        command: Some(vec!["rollfleet".into()]),
        args: Some(args),
        resources,
        env: token_env(job),
        volume_mounts: Some(
            [tmp_mount()]
                .into_iter()
                .chain(tls.map(|(_, mount)| mount))
                .collect(),
        ),
        ..Default::default()
    })
}

/// The writable `emptyDir` every pod has at [`placement::TMP_DIR`] (its root filesystem is
/// read-only).
pub(super) fn tmp_volume() -> Volume {
    Volume {
        name: "tmp".into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    }
}

pub(super) fn tmp_mount() -> VolumeMount {
    VolumeMount {
        name: "tmp".into(),
        mount_path: placement::TMP_DIR.into(),
        ..Default::default()
    }
}

/// The volume and mount of the TLS Secret's files `keys` (the scheduler: its certificate and
/// key; a worker: the CA only), when the job names one.
pub(super) fn tls_files(job: &RLJob, keys: &[&str]) -> Option<(Volume, VolumeMount)> {
    let secret = tls_secret(job)?;
    let volume = Volume {
        name: "tls".into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret),
            items: Some(
                keys.iter()
                    .map(|&key| KeyToPath {
                        key: key.into(),
                        path: key.into(),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mount = VolumeMount {
        name: "tls".into(),
        mount_path: TLS_DIR.into(),
        read_only: Some(true),
        ..Default::default()
    };
    Some((volume, mount))
}

/// The volume the scheduler's journal is on: the claim the job names, or the pod's `emptyDir`.
pub(super) fn journal_volume(job: &RLJob) -> Volume {
    let claim = journal_claim(job);
    Volume {
        name: "journal".into(),
        empty_dir: claim.is_none().then(EmptyDirVolumeSource::default),
        persistent_volume_claim: claim.map(|claim_name| PersistentVolumeClaimVolumeSource {
            claim_name,
            read_only: Some(false),
        }),
        ..Default::default()
    }
}

/// `ROLLFLEET_TOKEN` from the job's token Secret, for its scheduler and workers.
pub(super) fn token_env(job: &RLJob) -> Option<Vec<EnvVar>> {
    let secret = token_secret(job)?;
    Some(vec![EnvVar {
        name: rollfleet_proto::auth::TOKEN_ENV.into(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret,
                key: TOKEN_SECRET_KEY.into(),
                optional: Some(false),
            }),
            ..Default::default()
        }),
        ..Default::default()
    }])
}

/// The scheduler's startup, readiness and liveness probes: the kubelet asks its
/// `grpc.health.v1` service on the gRPC port (no token needed: the health service is outside the
/// token guard). A kubelet's gRPC probe speaks plaintext only, so a scheduler serving TLS is
/// probed by opening a TCP connection to the port instead. The startup probe gives a scheduler
/// five minutes to plan its job and replay its journal before liveness counts.
pub(super) fn scheduler_probes(tls: bool) -> (Probe, Probe, Probe) {
    let probe = |period: i32, failures: i32| Probe {
        grpc: (!tls).then_some(GRPCAction {
            port: GRPC_PORT,
            service: None,
        }),
        tcp_socket: tls.then_some(TCPSocketAction {
            port: IntOrString::Int(GRPC_PORT),
            host: None,
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: Some(2),
        ..Default::default()
    };
    (probe(5, 60), probe(5, 2), probe(10, 3))
}
