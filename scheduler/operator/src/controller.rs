//! The reconciler: makes the cluster run what [`crate::desired`] says an RLJob should, and writes
//! what its scheduler reports into the object's status.
//!
//! One pass, for an RLJob that exists:
//! 1. validate and plan its spec; an invalid one gets `phase: Invalid` with every problem and its
//!    field path in `status.message`, and nothing is created;
//! 2. apply the ConfigMap, the scheduler's Service and every Deployment (server-side apply, field
//!    manager `rollfleet-operator`), and delete the job's worker Deployments no longer wanted (a
//!    pool the changed spec no longer uses);
//! 3. ask the scheduler for the job's status over gRPC (`JobService.Status`) and write phase, RL
//!    step, trajectories trained and message, with `Valid` and `SchedulerReachable` conditions
//!    that carry the generation they describe;
//! 4. look again in 10 s while the job runs, in 5 minutes once it has ended; on the pass after
//!    the end was written, every Deployment of the job is scaled to zero (its scheduler and
//!    workers, run `--until-stopped`, wait at the end for that) and the status is left as it
//!    is, until the spec changes.
//!
//! An RLJob annotated `rollfleet.dev/tls-secret: NAME` has its scheduler serve TLS with that
//! `kubernetes.io/tls` Secret; the operator calls it at `https://`, trusting the Secret's
//! `ca.crt` (a Secret without one makes `SchedulerReachable` false, naming it).
//!
//! An RLJob annotated `rollfleet.dev/token-secret: NAME` has its scheduler require the token in
//! that Secret (key `token`); its pods read it as `ROLLFLEET_TOKEN`, and the operator reads the
//! Secret to send it with its own calls. A Secret it cannot use makes `SchedulerReachable` false,
//! naming the Secret.
//!
//! A finalizer (`rollfleet.dev/cancel-job`) cancels the job through its scheduler before the
//! RLJob goes, so the workers are drained and a trainer reading the feed sees the job end; the
//! owned objects are then deleted by the API server's garbage collector. A scheduler that does
//! not answer within 5 s does not hold the deletion up.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event, finalizer};
use rollfleet_proto::auth::{AuthChannel, ClientAuth, Token};
use rollfleet_proto::v1::job_service_client::JobServiceClient;
use rollfleet_proto::v1::{JobRef, JobStatus};

use crate::crd::{RLJob, RLJobStatus};
use crate::desired::{self, JOB_LABEL, Settings};

/// The finalizer that cancels a job before its RLJob is deleted.
pub const FINALIZER: &str = "rollfleet.dev/cancel-job";
/// The field manager of every object the operator applies.
pub const MANAGER: &str = "rollfleet-operator";
/// How long the operator waits for a scheduler's answer.
const SCHEDULER_TIMEOUT: Duration = Duration::from_secs(5);
/// The most of a spec's problems `status.message` holds.
const MAX_MESSAGE_CHARS: usize = 4000;

/// What a reconciliation needs.
pub struct Context {
    /// The Kubernetes client.
    pub client: kube::Client,
    /// What shapes the objects created.
    pub settings: Settings,
    /// Where an RLJob's scheduler answers gRPC (in the cluster: its Service).
    pub scheduler_url: Box<dyn Fn(&RLJob) -> String + Send + Sync>,
    /// Each RLJob's plan, made again only when its job file changes.
    pub plans: desired::PlanCache,
}

impl Context {
    /// A context whose schedulers are reached through their Services' cluster DNS names.
    pub fn in_cluster(client: kube::Client, settings: Settings) -> Context {
        Context {
            client,
            settings,
            scheduler_url: Box::new(|job| {
                format!(
                    "http://{}.{}.svc:{}",
                    desired::scheduler_name(job),
                    job.namespace(),
                    desired::GRPC_PORT
                )
            }),
            plans: desired::PlanCache::default(),
        }
    }
}

/// Why a reconciliation failed (it is retried).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused or failed a request.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The RLJob has no name.
    #[error("the RLJob has no metadata.name")]
    Unnamed,
}

/// Reconciles one RLJob (the controller's entry point).
pub async fn reconcile(
    job: Arc<RLJob>,
    ctx: Arc<Context>,
) -> Result<Action, kube::runtime::finalizer::Error<Error>> {
    let api: Api<RLJob> = Api::namespaced(ctx.client.clone(), job.namespace());
    finalizer(&api, FINALIZER, job, |event| async {
        match event {
            Event::Apply(job) => apply(&job, &ctx).await,
            Event::Cleanup(job) => cleanup(&job, &ctx).await,
        }
    })
    .await
}

/// Retries a failed reconciliation after 30 s.
pub fn error_policy(
    job: Arc<RLJob>,
    error: &kube::runtime::finalizer::Error<Error>,
    _: Arc<Context>,
) -> Action {
    eprintln!(
        "rollfleet-operator: rljob {}/{}: {error}; retrying in 30 s",
        job.namespace(),
        job.name()
    );
    Action::requeue(Duration::from_secs(30))
}

fn condition(
    previous: Option<&RLJobStatus>,
    type_: &str,
    ok: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) -> Condition {
    let status = if ok { "True" } else { "False" };
    // The transition time moves only when the condition's status does.
    let since = previous
        .and_then(|p| p.conditions.iter().find(|c| c.type_ == type_))
        .filter(|c| c.status == status)
        .map(|c| c.last_transition_time.clone());
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message: message.into(),
        observed_generation: generation,
        last_transition_time: since.unwrap_or_else(|| Time(k8s_openapi::jiff::Timestamp::now())),
    }
}

/// How to call `job`'s scheduler: its URL (`https://` when the job names a TLS Secret), the
/// token its Secret holds, and the CA certificate to trust from the TLS Secret.
struct Call {
    url: String,
    token: Option<Token>,
    ca: Option<Vec<u8>>,
}

async fn call(job: &RLJob, ctx: &Context) -> Result<Call, String> {
    let token = job_token(job, ctx).await?;
    let ca = job_tls_ca(job, ctx).await?;
    let url = (ctx.scheduler_url)(job);
    let url = match (&ca, url.strip_prefix("http://")) {
        (Some(_), Some(rest)) => format!("https://{rest}"),
        _ => url,
    };
    Ok(Call { url, token, ca })
}

async fn scheduler_client(call: &Call) -> Result<JobServiceClient<AuthChannel>, String> {
    let url = &call.url;
    let endpoint = rollfleet_proto::tls::endpoint_trusting(url, call.ca.clone())
        .map_err(|e| e.to_string())?
        .connect_timeout(SCHEDULER_TIMEOUT)
        .timeout(SCHEDULER_TIMEOUT);
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| format!("cannot reach {url}: {e}"))?;
    Ok(JobServiceClient::with_interceptor(
        channel,
        ClientAuth::new(call.token.as_ref()),
    ))
}

/// The value of `key` in the Secret `name` of `job`'s namespace, with where it came from (for
/// errors); a Secret that is missing or lacks the key is an error naming both (`what` says what
/// the key should hold).
async fn secret_value(
    job: &RLJob,
    ctx: &Context,
    name: &str,
    key: &str,
    what: &str,
) -> Result<(Vec<u8>, String), String> {
    let origin = format!("secret {}/{name}", job.namespace());
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), job.namespace());
    let secret = secrets
        .get(name)
        .await
        .map_err(|e| format!("{origin}: {e}"))?;
    let value = secret
        .data
        .and_then(|mut d| d.remove(key))
        .ok_or_else(|| format!("{origin}: no key {key:?} ({what})"))?;
    Ok((value.0, origin))
}

/// The CA certificate in the TLS Secret `job` names (none without one).
async fn job_tls_ca(job: &RLJob, ctx: &Context) -> Result<Option<Vec<u8>>, String> {
    let Some(name) = desired::tls_secret(job) else {
        return Ok(None);
    };
    let what = "the CA certificate that signed the scheduler's";
    let (ca, _) = secret_value(job, ctx, &name, desired::TLS_CA_KEY, what).await?;
    Ok(Some(ca))
}

/// The token `job`'s scheduler requires, from the Secret its annotation names (none without
/// one); one that is not UTF-8 or not a valid token is an error naming the Secret.
async fn job_token(job: &RLJob, ctx: &Context) -> Result<Option<Token>, String> {
    let Some(name) = desired::token_secret(job) else {
        return Ok(None);
    };
    let what = "the scheduler's bearer token";
    let (bytes, origin) = secret_value(job, ctx, &name, desired::TOKEN_SECRET_KEY, what).await?;
    let text =
        std::str::from_utf8(&bytes).map_err(|_| format!("{origin}: the token is not UTF-8"))?;
    Token::parse(text, &origin)
        .map(Some)
        .map_err(|e| e.to_string())
}

async fn scheduler_status(call: &Call, name: &str) -> Result<JobStatus, String> {
    let mut client = scheduler_client(call).await?;
    client
        .status(JobRef { job: name.into() })
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| format!("{} answered: {}", call.url, s.message()))
}

async fn write_status(api: &Api<RLJob>, name: &str, status: &RLJobStatus) -> Result<(), Error> {
    let patch = serde_json::json!({ "status": status });
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

async fn apply(job: &RLJob, ctx: &Context) -> Result<Action, Error> {
    let name = job.metadata.name.as_deref().ok_or(Error::Unnamed)?;
    let ns = job.namespace();
    let generation = job.metadata.generation;
    let previous = job.status.as_ref();
    let jobs: Api<RLJob> = Api::namespaced(ctx.client.clone(), ns);
    let wanted = match desired::desired_with(job, &ctx.settings, &ctx.plans) {
        Ok(wanted) => wanted,
        Err(invalid) => {
            let text = invalid.to_string();
            let message: String = text.chars().take(MAX_MESSAGE_CHARS).collect();
            let status = RLJobStatus {
                phase: "Invalid".into(),
                observed_generation: generation,
                message: message.clone(),
                conditions: vec![condition(
                    previous,
                    "Valid",
                    false,
                    "InvalidSpec",
                    &message,
                    generation,
                )],
                ..Default::default()
            };
            write_status(&jobs, name, &status).await?;
            // Nothing to do until the spec changes.
            return Ok(Action::await_change());
        }
    };

    let apply = PatchParams::apply(MANAGER).force();
    let config_maps: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), ns);
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), ns);
    let deployments: Api<Deployment> = Api::namespaced(ctx.client.clone(), ns);
    let object_name = |meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        meta.name.clone().unwrap_or_default()
    };
    config_maps
        .patch(
            &object_name(&wanted.config_map.metadata),
            &apply,
            &Patch::Apply(&wanted.config_map),
        )
        .await?;
    services
        .patch(
            &object_name(&wanted.service.metadata),
            &apply,
            &Patch::Apply(&wanted.service),
        )
        .await?;
    for deployment in &wanted.deployments {
        deployments
            .patch(
                &object_name(&deployment.metadata),
                &apply,
                &Patch::Apply(deployment),
            )
            .await?;
    }
    // A pool the spec no longer uses keeps no workers.
    let selector = format!("{JOB_LABEL}={}", desired::dns_name(&[name]));
    let existing = deployments
        .list(&ListParams::default().labels(&selector))
        .await?;
    for stale in existing.items {
        let stale_name = object_name(&stale.metadata);
        let ours = stale
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| Some(&o.uid) == job.metadata.uid.as_ref() && o.controller == Some(true));
        let still_wanted = wanted
            .deployments
            .iter()
            .any(|d| d.metadata.name.as_deref() == Some(stale_name.as_str()));
        if ours && !still_wanted {
            deployments
                .delete(&stale_name, &DeleteParams::default())
                .await?;
        }
    }

    // An ended job's pods are scaled to nothing (above); its status stays as it was written,
    // and nothing is asked of a scheduler that is gone.
    if desired::finished(job) {
        return Ok(Action::await_change());
    }
    let answer = match call(job, ctx).await {
        Ok(call) => scheduler_status(&call, name).await,
        Err(why) => Err(why),
    };
    let valid = condition(previous, "Valid", true, "Planned", "", generation);
    let ended = answer
        .as_ref()
        .is_ok_and(|s| rollfleet_server::job::ended(s.phase()));
    let status = match answer {
        Ok(s) => RLJobStatus {
            phase: rollfleet_server::job::phase_name(s.phase()),
            observed_generation: generation,
            rl_step: s.rl_step,
            rl_steps_total: s.rl_steps_total,
            trajectories_trained: s.trajectories_trained,
            workers: wanted.workers,
            message: s.message.clone(),
            conditions: vec![
                valid,
                condition(
                    previous,
                    "SchedulerReachable",
                    true,
                    "Answered",
                    "",
                    generation,
                ),
            ],
        },
        Err(why) => RLJobStatus {
            phase: "Starting".into(),
            observed_generation: generation,
            workers: wanted.workers,
            message: format!("the scheduler is not answering yet: {why}"),
            conditions: vec![
                valid,
                condition(
                    previous,
                    "SchedulerReachable",
                    false,
                    "NoAnswer",
                    &why,
                    generation,
                ),
            ],
            ..previous.cloned().unwrap_or_default()
        },
    };
    write_status(&jobs, name, &status).await?;
    Ok(Action::requeue(Duration::from_secs(if ended {
        300
    } else {
        10
    })))
}

async fn cleanup(job: &RLJob, ctx: &Context) -> Result<Action, Error> {
    ctx.plans.forget(job);
    let cancelled = async {
        let call = call(job, ctx).await?;
        let mut client = scheduler_client(&call).await?;
        client
            .cancel(JobRef {
                job: job.name().into(),
            })
            .await
            .map_err(|s| format!("{} answered: {}", call.url, s.message()))
    };
    match tokio::time::timeout(SCHEDULER_TIMEOUT, cancelled).await {
        Ok(Ok(_)) => eprintln!(
            "rollfleet-operator: rljob {}/{}: job cancelled before deletion",
            job.namespace(),
            job.name()
        ),
        Ok(Err(why)) => eprintln!(
            "rollfleet-operator: rljob {}/{}: not cancelled ({why}); deleting it anyway",
            job.namespace(),
            job.name()
        ),
        Err(_) => eprintln!(
            "rollfleet-operator: rljob {}/{}: the scheduler did not answer in {} s; deleting it \
             anyway",
            job.namespace(),
            job.name(),
            SCHEDULER_TIMEOUT.as_secs()
        ),
    }
    Ok(Action::await_change())
}
