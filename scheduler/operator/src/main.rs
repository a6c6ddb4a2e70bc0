//! `rollfleet-operator`: runs the RLJob controller in a cluster, or prints its CRD.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use futures_util::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::{Controller, watcher};
use rollfleet_operator::controller::{self, Context};
use rollfleet_operator::crd::{self, RLJob};
use rollfleet_operator::desired::{JOB_LABEL, Settings};
use rollfleet_operator::k8s_openapi::jiff::Timestamp;
use rollfleet_operator::lease::{self, LeaseLock};
use rollfleet_operator::logs::{self, LogFormat};
use rollfleet_operator::metrics::Metrics;

/// The rollfleet Kubernetes operator.
#[derive(Debug, Parser)]
#[command(
    version,
    after_help = "Examples:\n  \
        rollfleet-operator crd | kubectl apply -f -\n  \
        rollfleet-operator run --image ghcr.io/rollfleet/rollfleet:0.1.0 --metrics-addr 0.0.0.0:9465\n\n\
        Environment: RUST_LOG (log levels, default info), ROLLFLEET_LOG_FORMAT (text or json).\n\
        Manifests: manifests/operator/ (CRD, RBAC, the operator's Deployment)."
)]
struct Cli {
    /// How the operator writes its log to stderr: text for people, or one JSON object per line
    /// for a log collector. `RUST_LOG` sets the levels (default `info`).
    #[arg(long, global = true, value_enum, default_value_t = LogFormatArg::Text, env = "ROLLFLEET_LOG_FORMAT")]
    log_format: LogFormatArg,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormatArg {
    Text,
    Json,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Watch RLJobs in every namespace and run them (uses the in-cluster service account, or
    /// the current kubeconfig context outside a cluster).
    Run {
        /// The image with the `rollfleet` binary that schedulers and workers run.
        #[arg(long, env = "ROLLFLEET_IMAGE")]
        image: String,
        /// Serve the operator's Prometheus metrics (reconciles, their duration and errors, jobs
        /// by phase) over HTTP on this address, e.g. 0.0.0.0:9465.
        #[arg(long, env = "ROLLFLEET_OPERATOR_METRICS_ADDR")]
        metrics_addr: Option<SocketAddr>,
        #[command(flatten)]
        election: Election,
    },
    /// Print the CustomResourceDefinition of RLJob as YAML.
    Crd,
    /// Print the objects the operator would apply for an RLJob file (its ConfigMap, Service and
    /// Deployments) as YAML, without a cluster: to review them, or to validate them offline.
    Desired {
        /// The RLJob (e.g. examples/jobs/quickstart.yaml).
        file: PathBuf,
        /// The image with the `rollfleet` binary that schedulers and workers run.
        #[arg(
            long,
            env = "ROLLFLEET_IMAGE",
            default_value = "ghcr.io/rollfleet/rollfleet:0.1.0"
        )]
        image: String,
    },
}

/// Leader election: which of several replicas reconciles.
#[derive(Debug, clap::Args)]
struct Election {
    /// Reconcile only while holding a Lease, so that several replicas can run (one leads, the
    /// others stand by and take over when it stops renewing). Without it, run one replica.
    #[arg(long, env = "ROLLFLEET_LEADER_ELECT")]
    leader_elect: bool,
    /// The Lease's namespace (in a pod: its own, from the downward API).
    #[arg(long, env = "POD_NAMESPACE", default_value = "rollfleet-system")]
    lease_namespace: String,
    /// The Lease's name.
    #[arg(long, default_value = "rollfleet-operator")]
    lease_name: String,
    /// This replica's identity in the Lease (in a pod: its name; default: host name and pid).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Seconds a leader keeps the Lease without renewing it: how long a standby waits to take
    /// over from a leader that died. The leader renews every third of it and stops leading when
    /// it could not renew for two thirds.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(3..))]
    lease_duration: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let format = match cli.log_format {
        LogFormatArg::Text => LogFormat::Text,
        LogFormatArg::Json => LogFormat::Json,
    };
    if let Err(e) = logs::init(format) {
        // No log yet to write it to.
        let mut stderr = std::io::stderr();
        let _ = writeln!(stderr, "error: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Crd => crd::crd_yaml()
            .map(|yaml| print!("{yaml}"))
            .map_err(anyhow::Error::from),
        Command::Desired { file, image } => desired_yaml(&file, image).map(|yaml| print!("{yaml}")),
        Command::Run {
            image,
            metrics_addr,
            election,
        } => run(image, metrics_addr, election),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // kube's errors repeat their causes in their own text: the context and the root.
            let root = e.root_cause().to_string();
            if root == e.to_string() {
                tracing::error!("{e}");
            } else {
                tracing::error!("{e}: {root}");
            }
            ExitCode::FAILURE
        }
    }
}

/// The objects the operator would apply for the RLJob in `file`, as YAML documents.
fn desired_yaml(file: &Path, image: String) -> anyhow::Result<String> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let mut job: RLJob = serde_yaml_ng::from_str(&text)
        .with_context(|| format!("{} is not an RLJob", file.display()))?;
    if job.metadata.namespace.is_none() {
        job.metadata.namespace = Some("default".into());
    }
    let wanted = rollfleet_operator::desired::desired(&job, &Settings { image })
        .with_context(|| format!("{}: invalid", file.display()))?;
    let mut docs = vec![
        serde_yaml_ng::to_string(&with_kind(&wanted.config_map, "v1", "ConfigMap")?)?,
        serde_yaml_ng::to_string(&with_kind(&wanted.service, "v1", "Service")?)?,
    ];
    for deployment in &wanted.deployments {
        docs.push(serde_yaml_ng::to_string(&with_kind(
            deployment,
            "apps/v1",
            "Deployment",
        )?)?);
    }
    Ok(docs.join("---\n"))
}

/// `object` as JSON with its `apiVersion` and `kind` (k8s-openapi writes them; set here so the
/// output does not depend on it).
fn with_kind(
    object: &impl serde::Serialize,
    api_version: &str,
    kind: &str,
) -> anyhow::Result<serde_json::Value> {
    let mut value = serde_json::to_value(object)?;
    if let Some(fields) = value.as_object_mut() {
        fields.insert("apiVersion".into(), api_version.into());
        fields.insert("kind".into(), kind.into());
    }
    Ok(value)
}

fn run(image: String, metrics_addr: Option<SocketAddr>, election: Election) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let client = kube::Client::try_default()
            .await
            .context("no Kubernetes API: neither a service account nor a kubeconfig")?;
        let jobs: Api<RLJob> = Api::all(client.clone());
        // A clear error when the CRD is missing, rather than a watch that retries forever.
        jobs.list(&Default::default())
            .await
            .context("listing RLJobs (is manifests/operator/crd.yaml applied?)")?;
        let lock = election.leader_elect.then(|| {
            let identity = election.identity.clone().unwrap_or_else(|| {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|h| h.trim().to_owned())
                    .unwrap_or_else(|_| "operator".into());
                format!("{host}-{}", std::process::id())
            });
            LeaseLock::new(
                client.clone(),
                &election.lease_namespace,
                &election.lease_name,
                &identity,
                Duration::from_secs(election.lease_duration),
            )
        });
        let metrics = Arc::new(Metrics::new().context("the operator's metrics")?);
        if let Some(addr) = metrics_addr {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("metrics address {addr}"))?;
            tracing::info!(
                "Prometheus metrics on http://{}/metrics",
                listener.local_addr().unwrap_or(addr)
            );
            tokio::spawn(rollfleet_operator::metrics::serve(
                listener,
                metrics.clone(),
            ));
        }
        if let Some(lock) = &lock {
            tracing::info!(
                identity = lock.identity(),
                "a candidate for lease {}/{}",
                election.lease_namespace,
                election.lease_name
            );
            lease::acquire(lock, Duration::from_secs(2), |line| {
                tracing::info!("{line}")
            })
            .await;
            tracing::info!(identity = lock.identity(), "leads");
        }
        let ctx = Arc::new(Context::in_cluster(
            client.clone(),
            Settings { image },
            election.identity.clone(),
            metrics,
        ));
        tracing::info!("watching RLJobs in every namespace");
        let controller = Controller::new(jobs, watcher::Config::default())
            .owns(
                Api::<Deployment>::all(client.clone()),
                watcher::Config::default(),
            )
            // A pod of a job that changes (placed, Pending as Unschedulable, failed, gone)
            // reconciles its RLJob at once; the requeue stays as the fallback.
            .watches(
                Api::<Pod>::all(client),
                watcher::Config::default().labels(JOB_LABEL),
                controller::rljob_of_pod,
            )
            .shutdown_on_signal()
            .run(controller::reconcile, controller::error_policy, ctx)
            .for_each(|result| async move {
                if let Err(e) = result {
                    tracing::warn!("{e}");
                }
            });
        let Some(lock) = &lock else {
            controller.await;
            return anyhow::Ok(());
        };
        let duration = lock.duration();
        tokio::select! {
            () = controller => {
                // Stopped (SIGTERM): hand the lease to a standby at once.
                if let Err(e) = lock.release(Timestamp::now()).await {
                    tracing::warn!("releasing the lease: {e}");
                }
                anyhow::Ok(())
            }
            // Exiting, the pod is restarted as a candidate: no two replicas reconcile at once.
            lost = lease::keep(lock, duration / 3, duration * 2 / 3) => {
                Err(anyhow::anyhow!("{lost}; stopping, to start again as a candidate"))
            }
        }
    })
}
