//! `rollfleet-operator`: runs the RLJob controller in a cluster, or prints its CRD.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser;
use futures_util::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::Api;
use kube::runtime::{Controller, watcher};
use rollfleet_operator::controller::{self, Context};
use rollfleet_operator::crd::{self, RLJob};
use rollfleet_operator::desired::Settings;

/// The rollfleet Kubernetes operator.
#[derive(Debug, Parser)]
#[command(
    version,
    after_help = "Examples:\n  \
        rollfleet-operator crd | kubectl apply -f -\n  \
        rollfleet-operator run --image ghcr.io/rollfleet/rollfleet:0.1.0\n\n\
        Manifests: manifests/operator/ (CRD, RBAC, the operator's Deployment)."
)]
enum Command {
    /// Watch RLJobs in every namespace and run them (uses the in-cluster service account, or
    /// the current kubeconfig context outside a cluster).
    Run {
        /// The image with the `rollfleet` binary that schedulers and workers run.
        #[arg(long, env = "ROLLFLEET_IMAGE")]
        image: String,
    },
    /// Print the CustomResourceDefinition of RLJob as YAML.
    Crd,
}

fn main() -> ExitCode {
    let result = match Command::parse() {
        Command::Crd => crd::crd_yaml()
            .map(|yaml| print!("{yaml}"))
            .map_err(anyhow::Error::from),
        Command::Run { image } => run(image),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // kube's errors repeat their causes in their own text: the context and the root.
            let root = e.root_cause().to_string();
            if root == e.to_string() {
                eprintln!("error: {e}");
            } else {
                eprintln!("error: {e}: {root}");
            }
            ExitCode::FAILURE
        }
    }
}

fn run(image: String) -> anyhow::Result<()> {
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
        let ctx = Arc::new(Context::in_cluster(client.clone(), Settings { image }));
        eprintln!("rollfleet-operator: watching RLJobs in every namespace");
        Controller::new(jobs, watcher::Config::default())
            .owns(Api::<Deployment>::all(client), watcher::Config::default())
            .shutdown_on_signal()
            .run(controller::reconcile, controller::error_policy, ctx)
            .for_each(|result| async move {
                if let Err(e) = result {
                    eprintln!("rollfleet-operator: {e}");
                }
            })
            .await;
        anyhow::Ok(())
    })
}
