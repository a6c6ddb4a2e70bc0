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
    EnvVarSource, GRPCAction, KeyToPath, PersistentVolumeClaimVolumeSource, PodSpec,
    PodTemplateSpec, Probe, ResourceRequirements, SecretKeySelector, SecretVolumeSource, Service,
    ServicePort, ServiceSpec, TCPSocketAction, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use rollfleet_fleet::{JobPlan, PlanError, PoolRole};

use crate::crd::{KIND, RLJob};
use crate::placement;

mod objects;
mod settings;

use objects::{
    deployment, fnv1a, journal_volume, labels, meta, scheduler_probes, tls_files, tmp_mount,
    tmp_volume, token_env, worker_container,
};
pub use objects::{dns_name, job_file, scheduler_name};
pub use settings::{
    KUBERNETES_FIELD, SUSPEND_FIELD, finished, kubernetes_block, suspended, tls_secret,
    token_secret,
};
use settings::{annotation, emulated_gpus, journal_claim, settings_of};

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
    let (startup, readiness, liveness) = scheduler_probes(tls.is_some());
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
        startup_probe: Some(startup),
        readiness_probe: Some(readiness),
        liveness_probe: Some(liveness),
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
mod tests;
