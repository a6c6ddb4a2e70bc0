//! What an `RLJob` should run, as Kubernetes objects: a pure function of the object and the
//! operator's settings, so it is tested without a cluster.
//!
//! - a ConfigMap `<job>-job` holding the job file the scheduler reads;
//! - the scheduler: a one-pod Deployment `<job>-scheduler` (recreated, never two at once: it
//!   keeps the job's state in memory) and a Service of the same name for its gRPC and metrics
//!   ports;
//! - one Deployment of workers per pool the plan uses, `<job>-<pool>`: a pod per GPU node
//!   (`gpusPerNode` GPUs, requested as `nvidia.com/gpu`; a last, smaller node gets its own
//!   Deployment `<job>-<pool>-partial`), a pod per CPU node, one pod for a serverless pool (it
//!   invokes the functions).
//!
//! Every object is owned by the RLJob (deleted with it) and labelled with it. The scheduler pod
//! carries a hash of the job file, so a changed spec restarts the job with it.
//!
//! Planning a job takes a fifth of a second for the RollArt-like one, and the reconciler looks
//! at every running RLJob each 10 s; [`PlanCache`] keeps each RLJob's plan until its job file
//! changes, so an operator with many jobs does not spend its CPU planning them again and again.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy};
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource, EnvVar,
    EnvVarSource, KeyToPath, PersistentVolumeClaimVolumeSource, PodSpec, PodTemplateSpec,
    ResourceRequirements, SecretKeySelector, SecretVolumeSource, Service, ServicePort, ServiceSpec,
    Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use rollfleet_fleet::{JobPlan, PlanError, PoolRole};

use crate::crd::{KIND, RLJob};
use crate::placement;

/// The scheduler's gRPC port.
pub const GRPC_PORT: i32 = 7070;
/// The scheduler's Prometheus port.
pub const METRICS_PORT: i32 = 9464;
/// Label: the RLJob an object belongs to.
pub const JOB_LABEL: &str = "rollfleet.dev/job";
/// Label: `scheduler` or `worker`.
pub const COMPONENT_LABEL: &str = "rollfleet.dev/component";
/// Label: a worker's pool.
pub const POOL_LABEL: &str = "rollfleet.dev/pool";
/// Annotation on an RLJob, read when `spec.kubernetes.engineUrl` is unset (deprecated: the
/// field replaces it, and the annotation is read for this release only).
pub const ENGINE_URL_ANNOTATION: &str = "rollfleet.dev/engine-url";
/// Annotation on an RLJob, read when `spec.kubernetes.emulatedGpus` is unset (deprecated).
pub const EMULATED_GPUS_ANNOTATION: &str = "rollfleet.dev/emulated-gpus";
/// Annotation on an RLJob, read when `spec.kubernetes.tokenSecret` is unset (deprecated).
pub const TOKEN_SECRET_ANNOTATION: &str = "rollfleet.dev/token-secret";
/// The key of the token in that Secret.
pub const TOKEN_SECRET_KEY: &str = "token";
/// Annotation on an RLJob, read when `spec.kubernetes.journalClaim` is unset (deprecated).
pub const JOURNAL_CLAIM_ANNOTATION: &str = "rollfleet.dev/journal-claim";
/// Annotation on an RLJob, read when `spec.kubernetes.tlsSecret` is unset (deprecated).
pub const TLS_SECRET_ANNOTATION: &str = "rollfleet.dev/tls-secret";
/// The keys of that Secret.
pub const TLS_CERT_KEY: &str = "tls.crt";
/// The private key's key in it.
pub const TLS_KEY_KEY: &str = "tls.key";
/// The CA certificate's key in it.
pub const TLS_CA_KEY: &str = "ca.crt";
/// Where the TLS Secret's files are mounted, in the scheduler's pod and the workers' (beside the
/// job file's directory, not in it: a mount point cannot be made inside a read-only ConfigMap).
const TLS_DIR: &str = "/etc/rollfleet-tls";
/// Annotation on the scheduler's pod: a hash of the job file it runs.
pub const JOB_HASH_ANNOTATION: &str = "rollfleet.dev/job-hash";
/// Where the job file is mounted in the scheduler's pod.
const JOB_DIR: &str = "/etc/rollfleet";
/// Where the scheduler keeps its journal: the pod's `emptyDir`, which outlives the scheduler's
/// container (a crash, an OOM kill: the kubelet restarts the container in the same pod, and it
/// resumes the job) but not its pod; or the claim `spec.kubernetes.journalClaim` names, which
/// outlives the pod.
pub const JOURNAL_DIR: &str = "/var/lib/rollfleet";

/// The operator's settings that shape what it creates.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The image with the `rollfleet` binary.
    pub image: String,
}

/// Why an RLJob cannot run.
#[derive(Debug, thiserror::Error)]
pub enum InvalidJob {
    /// The object could not be written out as a job file.
    #[error("the object cannot be read as a job file: {0}")]
    Encode(#[from] serde_yaml_ng::Error),
    /// The spec is invalid or cannot be planned (every problem, with its field path).
    #[error("{0}")]
    Plan(#[from] rollfleet_fleet::PlanError),
    /// A pool's placement cannot be made into a pod's (its field path, what is wrong).
    #[error("{0}")]
    Placement(String),
    /// The spec's `kubernetes` block is invalid (every problem, with its field path).
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Kubernetes(Vec<rollfleet_spec::Problem>),
}

/// Everything an RLJob should run.
#[derive(Debug, Clone)]
pub struct Desired {
    /// The job file.
    pub config_map: ConfigMap,
    /// The scheduler's Service.
    pub service: Service,
    /// The scheduler, then one Deployment of workers per pool (and per partial node).
    pub deployments: Vec<Deployment>,
    /// Worker pods in all: the scheduler waits for this many.
    pub workers: u32,
}

/// The field of an RLJob's spec that suspends it (`true`: every Deployment of the job scaled to
/// zero), as Kueue and other queueing controllers drive it. It is the object's, not the job's:
/// the job file leaves it out.
pub const SUSPEND_FIELD: &str = "suspend";

/// Whether `job`'s spec asks for it to be suspended.
pub fn suspended(job: &RLJob) -> bool {
    job.spec
        .get(SUSPEND_FIELD)
        .and_then(serde_json::Value::as_bool)
        == Some(true)
}

/// The field of an RLJob's spec that says how the operator runs it
/// (`rollfleet_spec::KubernetesJob`): the object's, not the job's, as [`SUSPEND_FIELD`] is.
pub const KUBERNETES_FIELD: &str = "kubernetes";

/// `job`'s `spec.kubernetes` block, as written (none when unset); one that is not such a block
/// is an error naming its fields.
pub fn kubernetes_block(job: &RLJob) -> Result<rollfleet_spec::KubernetesJob, InvalidJob> {
    let Some(value) = job.spec.get(KUBERNETES_FIELD) else {
        return Ok(Default::default());
    };
    let origin = format!("rljob/{}", job.name());
    let problem = |path: String, message: String| {
        InvalidJob::Kubernetes(vec![rollfleet_spec::Problem { path, message }])
    };
    let text = serde_json::to_string(value)
        .map_err(|e| problem(format!("spec.{KUBERNETES_FIELD}"), e.to_string()))?;
    // Parsed as the job file's other fields are, so the error names the field.
    let block: rollfleet_spec::KubernetesJob =
        rollfleet_spec::parse_yaml(&text, &origin).map_err(|e| match e {
            rollfleet_spec::SpecError::Syntax { path, message, .. } => {
                let path = match path.as_str() {
                    "." => format!("spec.{KUBERNETES_FIELD}"),
                    _ => format!("spec.{KUBERNETES_FIELD}.{path}"),
                };
                problem(path, message)
            }
            other => problem(format!("spec.{KUBERNETES_FIELD}"), other.to_string()),
        })?;
    let problems = rollfleet_spec::kubernetes_job_problems(&block);
    if problems.is_empty() {
        Ok(block)
    } else {
        Err(InvalidJob::Kubernetes(problems))
    }
}

/// `job`'s `spec.kubernetes` block, or the default when it has none or an invalid one (which
/// [`desired`] refuses, naming its problems).
fn settings_of(job: &RLJob) -> rollfleet_spec::KubernetesJob {
    kubernetes_block(job).unwrap_or_default()
}

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
fn fnv1a(text: &str) -> u64 {
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

fn labels(job: &RLJob, component: &str, pool: Option<&str>) -> BTreeMap<String, String> {
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

fn meta(job: &RLJob, name: String, labels: BTreeMap<String, String>) -> ObjectMeta {
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

fn deployment(
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
fn worker_container(
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

/// Whether `job`'s GPU workers emulate their GPUs (and ask the cluster for none).
fn emulated_gpus(job: &RLJob) -> bool {
    settings_of(job).emulated_gpus
        || annotation(job, EMULATED_GPUS_ANNOTATION).as_deref() == Some("true")
}

/// The writable `emptyDir` every pod has at [`placement::TMP_DIR`] (its root filesystem is
/// read-only).
fn tmp_volume() -> Volume {
    Volume {
        name: "tmp".into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    }
}

fn tmp_mount() -> VolumeMount {
    VolumeMount {
        name: "tmp".into(),
        mount_path: placement::TMP_DIR.into(),
        ..Default::default()
    }
}

/// The value of one of `job`'s annotations.
fn annotation(job: &RLJob, key: &str) -> Option<String> {
    job.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .cloned()
}

/// The name of the Secret holding `job`'s token, when it names one.
pub fn token_secret(job: &RLJob) -> Option<String> {
    settings_of(job)
        .token_secret
        .or_else(|| annotation(job, TOKEN_SECRET_ANNOTATION))
        .filter(|s| !s.trim().is_empty())
}

/// Whether `job`'s status says its job ended (succeeded, failed or was cancelled) for the spec it
/// has now: a changed spec is a new job.
pub fn finished(job: &RLJob) -> bool {
    job.status.as_ref().is_some_and(|s| {
        s.observed_generation == job.metadata.generation
            && ["Succeeded", "Failed", "Cancelled"].contains(&s.phase.as_str())
    })
}

/// The claim the job names for its scheduler's journal, if any.
fn journal_claim(job: &RLJob) -> Option<String> {
    settings_of(job)
        .journal_claim
        .or_else(|| annotation(job, JOURNAL_CLAIM_ANNOTATION))
        .filter(|c| !c.trim().is_empty())
}

/// The name of the TLS Secret `job` names for its scheduler, if any.
pub fn tls_secret(job: &RLJob) -> Option<String> {
    settings_of(job)
        .tls_secret
        .or_else(|| annotation(job, TLS_SECRET_ANNOTATION))
        .filter(|s| !s.trim().is_empty())
}

/// The volume and mount of the TLS Secret's files `keys` (the scheduler: its certificate and
/// key; a worker: the CA only), when the job names one.
fn tls_files(job: &RLJob, keys: &[&str]) -> Option<(Volume, VolumeMount)> {
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
fn journal_volume(job: &RLJob) -> Volume {
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
fn token_env(job: &RLJob) -> Option<Vec<EnvVar>> {
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

/// Each RLJob's plan, kept while its job file stays the same.
#[derive(Default)]
pub struct PlanCache {
    /// By `namespace/name`: the job file planned, and its plan.
    plans: Mutex<BTreeMap<String, (String, Arc<JobPlan>)>>,
    /// Plans made (not found in the cache).
    made: AtomicU64,
}

impl PlanCache {
    /// The plan of `job`'s job file `yaml`: the one kept, when it was made from the same file.
    fn plan(&self, job: &RLJob, yaml: &str) -> Result<Arc<JobPlan>, PlanError> {
        let key = format!("{}/{}", job.namespace(), job.name());
        let lock = || {
            self.plans
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
        };
        if let Some((planned, plan)) = lock().get(&key)
            && planned == yaml
        {
            return Ok(plan.clone());
        }
        // Planned without the lock: other RLJobs' passes need not wait for this one's plan.
        let origin = format!("rljob/{}", job.name());
        let plan = Arc::new(JobPlan::from_yaml(yaml, &origin, 0)?);
        self.made.fetch_add(1, Ordering::Relaxed);
        lock().insert(key, (yaml.to_owned(), plan.clone()));
        Ok(plan)
    }

    /// Drops `job`'s plan (the RLJob is gone).
    pub fn forget(&self, job: &RLJob) {
        let key = format!("{}/{}", job.namespace(), job.name());
        self.plans
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(&key);
    }

    /// Plans made so far, as opposed to taken from the cache.
    pub fn plans_made(&self) -> u64 {
        self.made.load(Ordering::Relaxed)
    }
}

/// What `job` should run, or why it cannot.
pub fn desired(job: &RLJob, settings: &Settings) -> Result<Desired, InvalidJob> {
    desired_with(job, settings, &PlanCache::default())
}

/// [`desired`], planning through `plans`.
pub fn desired_with(
    job: &RLJob,
    settings: &Settings,
    plans: &PlanCache,
) -> Result<Desired, InvalidJob> {
    let yaml = job_file(job)?;
    let plan = plans.plan(job, &yaml)?;
    kubernetes_block(job)?;
    let name = job.name();

    let mut deployments = Vec::new();
    let mut workers = 0u32;
    for pool in plan.pools_needed() {
        let Some(spec) = plan.spec().pools.get(pool as usize) else {
            continue;
        };
        let pool_name = spec.name.as_str();
        let worker_labels = |suffix: Option<&str>| {
            let mut l = labels(job, "worker", Some(pool_name));
            if let Some(s) = suffix {
                l.insert("rollfleet.dev/node-size".into(), s.into());
            }
            l
        };
        let path = format!("spec.pools[{pool}]");
        let pod = |gpus: u32| -> Result<PodSpec, InvalidJob> {
            let defaults = match plan.pool_role(pool) {
                Some(PoolRole::Gpu) if !emulated_gpus(job) => placement::Defaults::Gpu {
                    product: spec.gpu.clone().unwrap_or_default(),
                    gpus,
                },
                Some(PoolRole::Cpu) => spec
                    .cpu
                    .as_deref()
                    .and_then(|shape| plan.catalog().cpu_shape(shape).ok())
                    .map_or(placement::Defaults::None, |shape| {
                        placement::Defaults::Cpu {
                            vcpus: shape.vcpus,
                            memory_gib: shape.memory_gib,
                        }
                    }),
                _ => placement::Defaults::None,
            };
            let placed = placement::placement(&defaults, spec.kubernetes.as_ref(), &path)
                .map_err(InvalidJob::Placement)?;
            Ok(PodSpec {
                containers: vec![worker_container(
                    job,
                    settings,
                    pool_name,
                    gpus,
                    placed.resources,
                )],
                volumes: Some(
                    [tmp_volume()]
                        .into_iter()
                        .chain(tls_files(job, &[TLS_CA_KEY]).map(|(volume, _)| volume))
                        .collect(),
                ),
                node_selector: placed.node_selector,
                tolerations: placed.tolerations,
                affinity: placed.affinity,
                priority_class_name: placed.priority_class_name,
                security_context: Some(placement::pod_security_context()),
                ..Default::default()
            })
        };
        let count = u32::try_from(spec.count.unwrap_or(1).max(1)).unwrap_or(u32::MAX);
        match plan.pool_role(pool) {
            Some(PoolRole::Gpu) => {
                let per_node = u32::try_from(spec.gpus_per_node.unwrap_or(8).max(1))
                    .unwrap_or(8)
                    .min(count);
                let (full, rest) = (count / per_node, count % per_node);
                deployments.push(deployment(
                    job,
                    dns_name(&[name, pool_name]),
                    worker_labels(None),
                    i32::try_from(full).unwrap_or(i32::MAX),
                    pod(per_node)?,
                    BTreeMap::new(),
                    false,
                ));
                workers = workers.saturating_add(full);
                if rest > 0 {
                    deployments.push(deployment(
                        job,
                        dns_name(&[name, pool_name, "partial"]),
                        worker_labels(Some("partial")),
                        1,
                        pod(rest)?,
                        BTreeMap::new(),
                        false,
                    ));
                    workers = workers.saturating_add(1);
                }
            }
            Some(PoolRole::Cpu) => {
                deployments.push(deployment(
                    job,
                    dns_name(&[name, pool_name]),
                    worker_labels(None),
                    i32::try_from(count).unwrap_or(i32::MAX),
                    pod(0)?,
                    BTreeMap::new(),
                    false,
                ));
                workers = workers.saturating_add(count);
            }
            Some(PoolRole::Serverless) | None => {
                deployments.push(deployment(
                    job,
                    dns_name(&[name, pool_name]),
                    worker_labels(None),
                    1,
                    pod(0)?,
                    BTreeMap::new(),
                    false,
                ));
                workers = workers.saturating_add(1);
            }
        }
    }

    let scheduler_labels = labels(job, "scheduler", None);
    let config_map_name = dns_name(&[name, "job"]);
    let job_hash = format!("{:016x}", fnv1a(&yaml));
    let mut scheduler_args = vec![
        "scheduler".into(),
        format!("{JOB_DIR}/job.yaml"),
        "--listen".into(),
        format!("0.0.0.0:{GRPC_PORT}"),
        "--metrics-addr".into(),
        format!("0.0.0.0:{METRICS_PORT}"),
        "--expect-workers".into(),
        workers.to_string(),
        "--time-scale".into(),
        "1".into(),
        // At the job's end it keeps answering its status until the operator, having read the
        // end, scales the Deployment down; exiting, it would be started again.
        "--until-stopped".into(),
        // Named by the job file: a changed spec starts a journal of its own.
        "--journal".into(),
        format!("{JOURNAL_DIR}/{job_hash}.journal"),
    ];
    if journal_claim(job).is_some() {
        scheduler_args.push("--journal-sync".into());
    }
    let tls = tls_files(job, &[TLS_CERT_KEY, TLS_KEY_KEY]);
    if tls.is_some() {
        scheduler_args.extend([
            "--tls-cert".into(),
            format!("{TLS_DIR}/{TLS_CERT_KEY}"),
            "--tls-key".into(),
            format!("{TLS_DIR}/{TLS_KEY_KEY}"),
        ]);
    }
    let scheduler = placement::restricted(Container {
        name: "scheduler".into(),
        image: Some(settings.image.clone()),
        command: Some(vec!["rollfleet".into()]),
        args: Some(scheduler_args),
        ports: Some(vec![
            ContainerPort {
                name: Some("grpc".into()),
                container_port: GRPC_PORT,
                ..Default::default()
            },
            ContainerPort {
                name: Some("metrics".into()),
                container_port: METRICS_PORT,
                ..Default::default()
            },
        ]),
        volume_mounts: Some(
            vec![
                VolumeMount {
                    name: "job".into(),
                    mount_path: JOB_DIR.into(),
                    read_only: Some(true),
                    ..Default::default()
                },
                VolumeMount {
                    name: "journal".into(),
                    mount_path: JOURNAL_DIR.into(),
                    ..Default::default()
                },
                tmp_mount(),
            ]
            .into_iter()
            .chain(tls.clone().map(|(_, mount)| mount))
            .collect(),
        ),
        env: token_env(job),
        ..Default::default()
    });
    let scheduler_pod = PodSpec {
        containers: vec![scheduler],
        volumes: Some(
            vec![
                Volume {
                    name: "job".into(),
                    config_map: Some(ConfigMapVolumeSource {
                        name: config_map_name.clone(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                journal_volume(job),
                tmp_volume(),
            ]
            .into_iter()
            .chain(tls.map(|(volume, _)| volume))
            .collect(),
        ),
        security_context: Some(placement::pod_security_context()),
        ..Default::default()
    };
    let pod_annotations = BTreeMap::from([
        (JOB_HASH_ANNOTATION.to_owned(), job_hash.clone()),
        ("prometheus.io/scrape".to_owned(), "true".to_owned()),
        ("prometheus.io/port".to_owned(), METRICS_PORT.to_string()),
    ]);
    deployments.insert(
        0,
        deployment(
            job,
            scheduler_name(job),
            scheduler_labels.clone(),
            1,
            scheduler_pod,
            pod_annotations,
            true,
        ),
    );
    // An ended job keeps no pods: a scheduler or worker that exits after the end would only be
    // started again (the status the operator wrote stays in the object). A suspended one keeps
    // none until it is resumed.
    if finished(job) || suspended(job) {
        for d in &mut deployments {
            if let Some(spec) = d.spec.as_mut() {
                spec.replicas = Some(0);
            }
        }
    }

    let port = |name: &str, port: i32| ServicePort {
        name: Some(name.into()),
        port,
        target_port: Some(IntOrString::String(name.into())),
        ..Default::default()
    };
    Ok(Desired {
        config_map: ConfigMap {
            metadata: meta(job, config_map_name, labels(job, "job", None)),
            data: Some(BTreeMap::from([("job.yaml".to_owned(), yaml)])),
            ..Default::default()
        },
        service: Service {
            metadata: meta(job, scheduler_name(job), scheduler_labels.clone()),
            spec: Some(ServiceSpec {
                selector: Some(scheduler_labels),
                ports: Some(vec![port("grpc", GRPC_PORT), port("metrics", METRICS_PORT)]),
                ..Default::default()
            }),
            status: None,
        },
        deployments,
        workers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn example(file: &str) -> RLJob {
        let path = format!("{}/../../examples/jobs/{file}", env!("CARGO_MANIFEST_DIR"));
        let mut job: RLJob =
            serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap_or_default())
                .expect("an RLJob");
        job.metadata.namespace = Some("rl".into());
        job.metadata.uid = Some("uid-1".into());
        job
    }

    fn settings() -> Settings {
        Settings {
            image: "rollfleet:test".into(),
        }
    }

    fn args(d: &Deployment) -> Vec<String> {
        d.spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .and_then(|p| p.containers[0].args.clone())
            .unwrap_or_default()
    }

    fn replicas(d: &Deployment) -> i32 {
        d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(-1)
    }

    fn gpu_limit(d: &Deployment) -> Option<String> {
        d.spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .and_then(|p| p.containers[0].resources.as_ref())
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get("nvidia.com/gpu"))
            .map(|q| q.0.clone())
    }

    fn named<'a>(d: &'a Desired, name: &str) -> &'a Deployment {
        d.deployments
            .iter()
            .find(|x| x.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no deployment {name}"))
    }

    #[test]
    fn the_rollart_job_gets_a_worker_per_gpu_node_and_per_cpu_node_and_one_for_lambda() {
        let d = desired(&example("rollart-agentic.yaml"), &settings()).expect("valid");
        let h800 = named(&d, "rollart-agentic-h800");
        assert_eq!((replicas(h800), gpu_limit(h800)), (24, Some("8".into())));
        assert!(
            args(h800).ends_with(&["--gpus".into(), "8".into()]),
            "{:?}",
            args(h800)
        );
        let h20 = named(&d, "rollart-agentic-h20");
        assert_eq!((replicas(h20), gpu_limit(h20)), (40, Some("8".into())));
        let env = named(&d, "rollart-agentic-env-nodes");
        assert_eq!((replicas(env), gpu_limit(env)), (48, None));
        assert_eq!(replicas(named(&d, "rollart-agentic-lambda")), 1);
        assert_eq!(d.workers, 24 + 40 + 48 + 1);
        let scheduler = named(&d, "rollart-agentic-scheduler");
        let a = args(scheduler);
        let expect = a
            .iter()
            .position(|x| x == "--expect-workers")
            .expect("the flag");
        assert_eq!(a[expect + 1], "113");
        assert!(
            args(h20).contains(&"http://rollart-agentic-scheduler:7070".to_owned()),
            "{:?}",
            args(h20)
        );
    }

    #[test]
    fn a_pool_whose_gpus_do_not_fill_whole_nodes_gets_a_partial_node() {
        let mut job = example("rollart-agentic.yaml");
        job.spec["pools"][1]["count"] = 324.into();
        let d = desired(&job, &settings()).expect("valid");
        let full = named(&d, "rollart-agentic-h20");
        let partial = named(&d, "rollart-agentic-h20-partial");
        assert_eq!((replicas(full), gpu_limit(full)), (40, Some("8".into())));
        assert_eq!(
            (replicas(partial), gpu_limit(partial)),
            (1, Some("4".into()))
        );
        assert_eq!(d.workers, 24 + 41 + 48 + 1);
    }

    #[test]
    fn the_scheduler_reads_the_job_from_its_config_map_keeps_a_journal_and_restarts_when_it_changes()
     {
        let job = example("quickstart.yaml");
        let d = desired(&job, &settings()).expect("valid");
        let file = &d.config_map.data.as_ref().expect("data")["job.yaml"];
        let parsed = rollfleet_spec::parse_job(file.as_bytes(), "config map").expect("a job");
        assert_eq!(parsed.manifest.metadata.name, "quickstart");
        let hash = |d: &Desired| {
            d.deployments[0]
                .spec
                .as_ref()
                .and_then(|s| s.template.metadata.as_ref())
                .and_then(|m| m.annotations.as_ref())
                .map(|a| a[JOB_HASH_ANNOTATION].clone())
        };
        let mut changed = job.clone();
        changed.spec["rl"]["steps"] = 7.into();
        let d2 = desired(&changed, &settings()).expect("valid");
        assert!(hash(&d).is_some());
        assert_ne!(hash(&d), hash(&d2));
        assert_eq!(hash(&d), hash(&desired(&job, &settings()).expect("valid")));
        let scheduler = &d.deployments[0];
        let strategy = scheduler.spec.as_ref().and_then(|s| s.strategy.clone());
        assert_eq!(strategy.and_then(|s| s.type_).as_deref(), Some("Recreate"));
        // Its journal is on an emptyDir, named by the job file's hash.
        let pod = scheduler
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.clone())
            .expect("a pod");
        let a = pod.containers[0].args.clone().expect("args");
        let at = a.iter().position(|x| x == "--journal").expect("the flag");
        assert_eq!(
            Some(a[at + 1].clone()),
            hash(&d).map(|h| format!("{JOURNAL_DIR}/{h}.journal"))
        );
        let mounts = pod.containers[0].volume_mounts.clone().expect("mounts");
        let journal = mounts
            .iter()
            .find(|m| m.name == "journal")
            .expect("mounted");
        assert_eq!(journal.mount_path, JOURNAL_DIR);
        let volume = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == "journal")
            .expect("a volume");
        assert!(volume.empty_dir.is_some(), "{volume:?}");
        for object in d
            .deployments
            .iter()
            .map(|x| &x.metadata)
            .chain([&d.config_map.metadata])
        {
            let owner = &object.owner_references.as_ref().expect("owned")[0];
            assert_eq!(
                (owner.kind.as_str(), owner.uid.as_str()),
                ("RLJob", "uid-1")
            );
            assert_eq!(object.namespace.as_deref(), Some("rl"));
        }
    }

    #[test]
    fn an_engine_url_annotation_puts_the_gpu_workers_on_that_engine() {
        let mut job = example("quickstart.yaml");
        job.metadata.annotations = Some(BTreeMap::from([(
            ENGINE_URL_ANNOTATION.to_owned(),
            "http://vllm:8000".to_owned(),
        )]));
        let d = desired(&job, &settings()).expect("valid");
        let decode = args(named(&d, "quickstart-decode"));
        assert!(decode.ends_with(&["--engine-url".into(), "http://vllm:8000".into()]));
        assert!(!args(named(&d, "quickstart-envs")).contains(&"--engine".to_owned()));
    }

    fn token_source(container: &Container) -> Option<(String, String)> {
        let env = container.env.as_ref()?;
        assert_eq!(env.len(), 1, "{env:?}");
        assert_eq!(env[0].name, "ROLLFLEET_TOKEN");
        let key = env[0].value_from.as_ref()?.secret_key_ref.as_ref()?;
        Some((key.name.clone(), key.key.clone()))
    }

    #[test]
    fn a_token_secret_annotation_gives_the_scheduler_and_every_worker_the_token() {
        let mut job = example("quickstart.yaml");
        let plain = desired(&job, &settings()).expect("valid");
        job.metadata.annotations = Some(BTreeMap::from([(
            TOKEN_SECRET_ANNOTATION.to_owned(),
            "rl-token".to_owned(),
        )]));
        let d = desired(&job, &settings()).expect("valid");
        assert_eq!(d.deployments.len(), plain.deployments.len());
        for (with, without) in d.deployments.iter().zip(&plain.deployments) {
            let container = |d: &Deployment| {
                d.spec
                    .as_ref()
                    .and_then(|s| s.template.spec.as_ref())
                    .expect("pod")
                    .containers[0]
                    .clone()
            };
            assert_eq!(
                token_source(&container(with)),
                Some(("rl-token".to_owned(), TOKEN_SECRET_KEY.to_owned())),
                "{:?}",
                with.metadata.name
            );
            assert_eq!(container(without).env, None, "{:?}", without.metadata.name);
        }
    }

    #[test]
    fn an_ended_job_keeps_no_pods_until_its_spec_changes() {
        let replicas = |d: &Desired| -> Vec<i32> {
            d.deployments
                .iter()
                .map(|d| d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(-1))
                .collect()
        };
        let mut job = example("quickstart.yaml");
        job.metadata.generation = Some(3);
        let running = replicas(&desired(&job, &settings()).expect("valid"));
        assert!(running.iter().all(|&r| r >= 1), "{running:?}");
        for (phase, generation, scaled) in [
            ("Running", 3, false),
            ("Succeeded", 3, true),
            ("Failed", 3, true),
            ("Cancelled", 3, true),
            // The spec changed since the job ended: the new one runs.
            ("Succeeded", 2, false),
        ] {
            job.status = Some(crate::crd::RLJobStatus {
                phase: phase.into(),
                observed_generation: Some(generation),
                ..Default::default()
            });
            let now = replicas(&desired(&job, &settings()).expect("valid"));
            let expected = if scaled {
                vec![0; running.len()]
            } else {
                running.clone()
            };
            assert_eq!(now, expected, "{phase} at generation {generation}");
        }
    }

    #[test]
    fn a_journal_claim_annotation_puts_the_schedulers_journal_on_that_claim_synced_to_its_disk() {
        let synced = |d: &Desired| {
            d.deployments[0]
                .spec
                .as_ref()
                .and_then(|s| s.template.spec.as_ref())
                .and_then(|p| p.containers[0].args.as_ref())
                .expect("the scheduler's args")
                .contains(&"--journal-sync".to_owned())
        };
        let journal = |d: &Desired| {
            d.deployments[0]
                .spec
                .as_ref()
                .and_then(|s| s.template.spec.as_ref())
                .and_then(|p| p.volumes.as_ref())
                .and_then(|v| v.iter().find(|v| v.name == "journal").cloned())
                .expect("a journal volume")
        };
        let mut job = example("quickstart.yaml");
        let plain = desired(&job, &settings()).expect("valid");
        assert!(
            !synced(&plain),
            "an emptyDir goes with its node: syncing it buys nothing"
        );
        let plain = journal(&plain);
        assert!(plain.empty_dir.is_some() && plain.persistent_volume_claim.is_none());
        job.metadata.annotations = Some(BTreeMap::from([(
            JOURNAL_CLAIM_ANNOTATION.to_owned(),
            "rl-journals".to_owned(),
        )]));
        let claimed = desired(&job, &settings()).expect("valid");
        assert!(
            synced(&claimed),
            "a claim outlives the node: the journal is synced"
        );
        let claimed = journal(&claimed);
        assert!(claimed.empty_dir.is_none(), "{claimed:?}");
        assert_eq!(
            claimed
                .persistent_volume_claim
                .map(|c| (c.claim_name, c.read_only)),
            Some(("rl-journals".to_owned(), Some(false)))
        );
    }

    #[test]
    fn a_tls_secret_gives_the_scheduler_its_certificate_and_the_workers_only_the_ca_and_https() {
        let mut job = example("quickstart.yaml");
        job.metadata.annotations = Some(BTreeMap::from([(
            TLS_SECRET_ANNOTATION.to_owned(),
            "rl-tls".to_owned(),
        )]));
        let d = desired(&job, &settings()).expect("valid");
        let pod = |deployment: &Deployment| {
            deployment
                .spec
                .as_ref()
                .and_then(|s| s.template.spec.clone())
                .expect("a pod")
        };
        let items = |pod: &PodSpec| -> Vec<String> {
            pod.volumes
                .iter()
                .flatten()
                .filter(|v| v.name == "tls")
                .filter_map(|v| v.secret.as_ref())
                .inspect(|s| assert_eq!(s.secret_name.as_deref(), Some("rl-tls")))
                .flat_map(|s| s.items.clone().unwrap_or_default())
                .map(|item| item.key)
                .collect()
        };
        let scheduler = pod(&d.deployments[0]);
        assert_eq!(items(&scheduler), ["tls.crt", "tls.key"]);
        let args = scheduler.containers[0].args.clone().expect("args");
        let after = |flag: &str| {
            args.iter()
                .position(|a| a == flag)
                .map(|i| args[i + 1].clone())
        };
        assert_eq!(
            after("--tls-cert").as_deref(),
            Some("/etc/rollfleet-tls/tls.crt")
        );
        assert_eq!(
            after("--tls-key").as_deref(),
            Some("/etc/rollfleet-tls/tls.key")
        );
        for deployment in &d.deployments[1..] {
            let worker = pod(deployment);
            // The private key never reaches a worker's pod.
            assert_eq!(items(&worker), ["ca.crt"]);
            let args = worker.containers[0].args.clone().expect("args");
            assert!(
                args.contains(&"https://quickstart-scheduler:7070".to_owned()),
                "{args:?}"
            );
            let ca = args
                .iter()
                .position(|a| a == "--tls-ca")
                .map(|i| &args[i + 1]);
            assert_eq!(ca.map(String::as_str), Some("/etc/rollfleet-tls/ca.crt"));
            let mounts = worker.containers[0]
                .volume_mounts
                .clone()
                .unwrap_or_default();
            assert!(
                mounts
                    .iter()
                    .any(|m| m.name == "tls" && m.read_only == Some(true))
            );
        }
        // Without the annotation: plain gRPC, no TLS volume.
        let plain = desired(&example("quickstart.yaml"), &settings()).expect("valid");
        for deployment in &plain.deployments {
            let pod = pod(deployment);
            assert!(items(&pod).is_empty());
            let args = pod.containers[0].args.clone().expect("args");
            assert!(!args.iter().any(|a| a.starts_with("--tls")), "{args:?}");
        }
    }

    #[test]
    fn every_container_of_a_job_waits_at_its_end_to_be_scaled_down_rather_than_exiting() {
        let d = desired(&example("rollart-agentic.yaml"), &settings()).expect("valid");
        assert!(d.deployments.len() > 1, "a scheduler and worker pools");
        for deployment in &d.deployments {
            let pod = deployment
                .spec
                .as_ref()
                .and_then(|s| s.template.spec.as_ref())
                .expect("a pod");
            for container in &pod.containers {
                let args = container.args.clone().expect("args");
                assert!(
                    args.contains(&"--until-stopped".to_owned()),
                    "{}: {args:?}",
                    container.name
                );
            }
        }
    }

    #[test]
    fn a_job_is_planned_again_only_when_its_job_file_changes() {
        let cache = PlanCache::default();
        let mut job = example("rollart-agentic.yaml");
        let fresh = desired(&job, &settings()).expect("valid");
        let objects = |d: &Desired| serde_json::to_string(&d.deployments).expect("json");
        let first = desired_with(&job, &settings(), &cache).expect("valid");
        let again = desired_with(&job, &settings(), &cache).expect("valid");
        assert_eq!(cache.plans_made(), 1);
        assert_eq!(objects(&first), objects(&fresh));
        assert_eq!(objects(&again), objects(&fresh));
        // An annotation is not part of the job file: the plan is kept, the objects follow it.
        job.metadata.annotations = Some(BTreeMap::from([(
            EMULATED_GPUS_ANNOTATION.to_owned(),
            "true".to_owned(),
        )]));
        let annotated = desired_with(&job, &settings(), &cache).expect("valid");
        assert_eq!(cache.plans_made(), 1);
        assert_eq!(
            objects(&annotated),
            objects(&desired(&job, &settings()).expect("valid"))
        );
        // A changed spec is planned again, once.
        job.spec["pools"][1]["count"] = 160.into();
        let smaller = desired_with(&job, &settings(), &cache).expect("valid");
        desired_with(&job, &settings(), &cache).expect("valid");
        assert_eq!(cache.plans_made(), 2);
        assert_ne!(objects(&smaller), objects(&fresh));
        // A job that is gone is forgotten: the same spec under it is planned again.
        cache.forget(&job);
        desired_with(&job, &settings(), &cache).expect("valid");
        assert_eq!(cache.plans_made(), 3);
    }

    #[test]
    fn emulated_gpus_ask_the_cluster_for_none() {
        let mut job = example("quickstart.yaml");
        let plain = desired(&job, &settings()).expect("valid");
        assert_eq!(
            gpu_limit(named(&plain, "quickstart-decode")),
            Some("2".into())
        );
        job.metadata.annotations = Some(BTreeMap::from([(
            EMULATED_GPUS_ANNOTATION.to_owned(),
            "true".to_owned(),
        )]));
        let d = desired(&job, &settings()).expect("valid");
        assert_eq!(gpu_limit(named(&d, "quickstart-decode")), None);
        assert!(args(named(&d, "quickstart-decode")).ends_with(&["--gpus".into(), "2".into()]));
    }

    #[test]
    fn the_specs_kubernetes_block_sets_engine_gpus_secrets_and_claim_and_wins_over_annotations() {
        let plain = example("quickstart.yaml");
        let mut job = plain.clone();
        job.spec["kubernetes"] = serde_json::json!({
            "engineUrl": "http://vllm:8000",
            "emulatedGpus": true,
            "tokenSecret": "rl-token",
            "tlsSecret": "rl-tls",
            "journalClaim": "rl-journals",
        });
        // The deprecated annotations are read only where the block says nothing.
        job.metadata.annotations = Some(BTreeMap::from([
            (TOKEN_SECRET_ANNOTATION.to_owned(), "old-token".to_owned()),
            (ENGINE_URL_ANNOTATION.to_owned(), "http://old:1".to_owned()),
        ]));
        let d = desired(&job, &settings()).expect("valid");
        let decode = named(&d, "quickstart-decode");
        assert!(args(decode).ends_with(&["--engine-url".into(), "http://vllm:8000".into()]));
        assert_eq!(gpu_limit(decode), None, "emulated GPUs ask for none");
        let pod = |deployment: &Deployment| {
            deployment
                .spec
                .as_ref()
                .and_then(|s| s.template.spec.clone())
                .expect("a pod")
        };
        let scheduler = pod(&d.deployments[0]);
        assert_eq!(
            token_source(&scheduler.containers[0]),
            Some(("rl-token".to_owned(), TOKEN_SECRET_KEY.to_owned()))
        );
        let volume = |name: &str| {
            scheduler
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == name)
                .cloned()
                .expect("a volume")
        };
        assert_eq!(
            volume("tls").secret.and_then(|s| s.secret_name).as_deref(),
            Some("rl-tls")
        );
        assert_eq!(
            volume("journal")
                .persistent_volume_claim
                .map(|c| c.claim_name)
                .as_deref(),
            Some("rl-journals")
        );
        assert!(args(&d.deployments[0]).contains(&"--journal-sync".to_owned()));
        assert_eq!(token_secret(&job).as_deref(), Some("rl-token"));
        assert_eq!(tls_secret(&job).as_deref(), Some("rl-tls"));
        // The block is the object's, not the job's: the job file, so its hash and journal, stay.
        assert_eq!(
            job_file(&job).expect("a job file"),
            job_file(&plain).expect("a job file")
        );
    }

    #[test]
    fn an_invalid_kubernetes_block_is_refused_with_its_field_path() {
        for (block, path) in [
            (
                serde_json::json!({"tokenSecret": "Not_A_Name"}),
                "spec.kubernetes.tokenSecret",
            ),
            (
                serde_json::json!({"engineUrl": "vllm:8000"}),
                "spec.kubernetes.engineUrl",
            ),
            (
                serde_json::json!({"tlsSecrets": "rl-tls"}),
                "spec.kubernetes",
            ),
            (
                serde_json::json!({"emulatedGpus": "yes"}),
                "spec.kubernetes.emulatedGpus",
            ),
        ] {
            let mut job = example("quickstart.yaml");
            job.spec["kubernetes"] = block.clone();
            let err = desired(&job, &settings()).map(|_| ()).unwrap_err();
            let text = err.to_string();
            assert!(text.starts_with(path), "{block}: {text}");
        }
    }

    #[test]
    fn an_invalid_spec_is_refused_with_its_field_path() {
        let mut job = example("quickstart.yaml");
        job.spec["pools"][0]["gpu"] = "NoSuchGpu".into();
        let err = desired(&job, &settings()).map(|_| ()).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("pools[0].gpu") && text.contains("NoSuchGpu"),
            "{text}"
        );
    }

    #[test]
    fn names_are_valid_dns_labels_even_from_long_or_odd_parts() {
        assert_eq!(
            dns_name(&["Quick_Start", "env.nodes"]),
            "quick-start-env-nodes"
        );
        let long = "x".repeat(80);
        let a = dns_name(&[&long, "a"]);
        let b = dns_name(&[&long, "b"]);
        assert!(a.len() <= 63 && b.len() <= 63, "{a} {b}");
        assert_ne!(a, b);
        assert_eq!(dns_name(&["--"]), "rljob");
    }
}
