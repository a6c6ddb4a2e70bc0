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
//! A pass runs when the RLJob, a Deployment it owns or one of its pods changes (the pods are
//! mapped to their RLJob by [`rljob_of_pod`]), and at its requeue, the fallback that reads what
//! only the scheduler knows.
//!
//! An RLJob with `spec.kubernetes.tlsSecret: NAME` has its scheduler serve TLS with that
//! `kubernetes.io/tls` Secret; the operator calls it at `https://`, trusting the Secret's
//! `ca.crt` (a Secret without one makes `SchedulerReachable` false, naming it).
//!
//! An RLJob with `spec.kubernetes.tokenSecret: NAME` has its scheduler require the token in
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
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::finalizer::{Event, finalizer};
use kube::runtime::reflector::ObjectRef;
use rollfleet_proto::auth::{AuthChannel, ClientAuth, Token};
use rollfleet_proto::v1::job_service_client::JobServiceClient;
use rollfleet_proto::v1::{JobRef, JobStatus};

use crate::crd::{RLJob, RLJobStatus};
use crate::desired::{self, COMPONENT_LABEL, JOB_LABEL, POOL_LABEL, Settings};
use crate::events;
use crate::metrics::Metrics;

/// The finalizer that cancels a job before its RLJob is deleted.
pub const FINALIZER: &str = "rollfleet.dev/cancel-job";
/// The field manager of every object the operator applies.
pub const MANAGER: &str = "rollfleet-operator";
/// How long the operator waits for a scheduler's answer.
const SCHEDULER_TIMEOUT: Duration = Duration::from_secs(5);
/// The most of a spec's problems `status.message` holds.
const MAX_MESSAGE_CHARS: usize = 4000;
/// How long a worker pod may stay Pending as Unschedulable before the RLJob says its pool cannot
/// be placed: long enough for a cluster autoscaler to add a node in the common case, short
/// enough that a job waiting on a pool that will never fit says so within minutes.
pub const UNSCHEDULABLE_GRACE: Duration = Duration::from_secs(120);

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
    /// Publishes the Events of what happened to each RLJob ([`crate::events`]).
    pub recorder: Recorder,
    /// The operator's own metrics ([`crate::metrics`]).
    pub metrics: Arc<Metrics>,
}

impl Context {
    /// A context whose schedulers are reached through their Services' cluster DNS names;
    /// `instance` names this replica in the Events it publishes.
    pub fn in_cluster(
        client: kube::Client,
        settings: Settings,
        instance: Option<String>,
        metrics: Arc<Metrics>,
    ) -> Context {
        Context {
            metrics,
            recorder: recorder(client.clone(), instance),
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

/// The recorder of the operator's Events, reporting as `rollfleet-operator` (`instance`: this
/// replica).
pub fn recorder(client: kube::Client, instance: Option<String>) -> Recorder {
    Recorder::new(
        client,
        Reporter {
            controller: events::REPORTER.into(),
            instance,
        },
    )
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
    let started = std::time::Instant::now();
    let api: Api<RLJob> = Api::namespaced(ctx.client.clone(), job.namespace());
    let result = finalizer(&api, FINALIZER, job, |event| async {
        match event {
            Event::Apply(job) => apply(&job, &ctx).await,
            Event::Cleanup(job) => cleanup(&job, &ctx).await,
        }
    })
    .await;
    ctx.metrics.observe(started.elapsed(), result.is_ok());
    result
}

/// Retries a failed reconciliation after 30 s.
pub fn error_policy(
    job: Arc<RLJob>,
    error: &kube::runtime::finalizer::Error<Error>,
    _: Arc<Context>,
) -> Action {
    tracing::warn!(
        rljob = %format!("{}/{}", job.namespace(), job.name()),
        "reconciliation failed: {error}; retrying in 30 s"
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
                conditions: vec![
                    condition(
                        previous,
                        "Valid",
                        false,
                        "InvalidSpec",
                        &message,
                        generation,
                    ),
                    condition(
                        previous,
                        "Ready",
                        false,
                        "InvalidSpec",
                        "the spec is invalid",
                        generation,
                    ),
                ],
                ..Default::default()
            };
            write_status(&jobs, name, &status).await?;
            ctx.metrics.set_phase(job, Some(&status.phase));
            let happened = events::happened(previous, &status, &[]);
            events::publish(&ctx.recorder, job, &happened).await;
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
        ctx.metrics
            .set_phase(job, previous.map(|p| p.phase.as_str()));
        return Ok(Action::await_change());
    }
    let valid = condition(previous, "Valid", true, "Planned", "", generation);
    if desired::suspended(job) {
        // Every Deployment was applied with no replicas; nothing answers until it is resumed.
        let message = "suspended (spec.suspend): every Deployment of the job is scaled to zero";
        let status = RLJobStatus {
            phase: "Suspended".into(),
            observed_generation: generation,
            workers: wanted.workers,
            message: message.into(),
            conditions: vec![
                valid,
                condition(previous, "Ready", false, "Suspended", message, generation),
                condition(previous, "Complete", false, "Suspended", "", generation),
                condition(previous, "Failed", false, "Suspended", "", generation),
                condition(
                    previous,
                    "Suspended",
                    true,
                    "Suspended",
                    message,
                    generation,
                ),
            ],
            workers_joined: 0,
            // A resumed job starts its clock again, as a Kubernetes Job does.
            start_time: None,
            completion_time: None,
            ..previous.cloned().unwrap_or_default()
        };
        write_status(&jobs, name, &status).await?;
        ctx.metrics.set_phase(job, Some(&status.phase));
        let happened = events::happened(previous, &status, &events::placements(&wanted));
        events::publish(&ctx.recorder, job, &happened).await;
        return Ok(Action::await_change());
    }
    let unplaced = unschedulable_pools(job, ctx).await?;
    let answer = match call(job, ctx).await {
        Ok(call) => scheduler_status(&call, name).await,
        Err(why) => Err(why),
    };
    let ended = answer.as_ref().is_ok_and(|s| s.phase().ended());
    let mut status = match answer {
        Ok(s) => RLJobStatus {
            phase: s.phase().name().to_string(),
            observed_generation: generation,
            rl_step: s.rl_step,
            rl_steps_total: s.rl_steps_total,
            trajectories_trained: s.trajectories_trained,
            workers: wanted.workers,
            workers_joined: s.pools.iter().map(|p| p.workers).sum(),
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
            start_time: None,
            completion_time: None,
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
    // Times carry over while the status describes the same spec.
    let same_spec = previous.is_some_and(|p| p.observed_generation == generation);
    let kept = |time: Option<&Time>| time.filter(|_| same_spec).cloned();
    let now = || Some(Time(k8s_openapi::jiff::Timestamp::now()));
    status.start_time = kept(previous.and_then(|p| p.start_time.as_ref())).or_else(now);
    status.completion_time = if ended {
        kept(previous.and_then(|p| p.completion_time.as_ref())).or_else(now)
    } else {
        None
    };
    if let Some(unplaced) = &unplaced
        && !ended
    {
        status.message = unplaced.clone();
    }
    let lifecycle = lifecycle(previous, &status.phase, unplaced.as_deref(), generation);
    status.conditions.extend(lifecycle);
    write_status(&jobs, name, &status).await?;
    ctx.metrics.set_phase(job, Some(&status.phase));
    let happened = events::happened(previous, &status, &events::placements(&wanted));
    events::publish(&ctx.recorder, job, &happened).await;
    Ok(Action::requeue(Duration::from_secs(if ended {
        300
    } else {
        10
    })))
}

/// The conditions `kubectl wait` and dashboards read, from the job's `phase`: `Ready` (the job
/// runs), `Complete` and `Failed` (it ended; a cancelled job is `Failed` with reason
/// `Cancelled`, so that waiting for either condition ends at every end), and `Suspended`
/// turned false once a suspended job runs again. `unplaced` says which pools cannot be placed
/// (`Ready` false, reason `Unschedulable`).
fn lifecycle(
    previous: Option<&RLJobStatus>,
    phase: &str,
    unplaced: Option<&str>,
    generation: Option<i64>,
) -> Vec<Condition> {
    let ready = match (phase, unplaced) {
        ("Running", _) => condition(previous, "Ready", true, "Running", "", generation),
        ("Succeeded" | "Failed" | "Cancelled", _) => {
            condition(previous, "Ready", false, phase, "the job ended", generation)
        }
        (_, Some(why)) => condition(previous, "Ready", false, "Unschedulable", why, generation),
        _ => condition(
            previous,
            "Ready",
            false,
            phase,
            "waiting for the scheduler and every worker",
            generation,
        ),
    };
    let complete = condition(
        previous,
        "Complete",
        phase == "Succeeded",
        phase,
        "",
        generation,
    );
    let failed = condition(
        previous,
        "Failed",
        matches!(phase, "Failed" | "Cancelled"),
        phase,
        "",
        generation,
    );
    let mut conditions = vec![ready, complete, failed];
    let was_suspended = previous
        .into_iter()
        .flat_map(|p| &p.conditions)
        .any(|c| c.type_ == "Suspended");
    if was_suspended {
        conditions.push(condition(
            previous,
            "Suspended",
            false,
            "Resumed",
            "",
            generation,
        ));
    }
    conditions
}

/// The pools of `job` whose worker pods the cluster cannot place: pods Pending with
/// `PodScheduled` false for reason `Unschedulable` for longer than [`UNSCHEDULABLE_GRACE`].
/// `None` when every pod was placed or is still within its grace; else a message naming each
/// such pool, its count of such pods and what the cluster's scheduler said of one of them.
async fn unschedulable_pools(job: &RLJob, ctx: &Context) -> Result<Option<String>, Error> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), job.namespace());
    let selector = format!(
        "{JOB_LABEL}={},{COMPONENT_LABEL}=worker",
        desired::dns_name(&[job.name()])
    );
    let pending = pods
        .list(
            &ListParams::default()
                .labels(&selector)
                .fields("status.phase=Pending"),
        )
        .await?;
    let now = k8s_openapi::jiff::Timestamp::now();
    let grace = k8s_openapi::jiff::SignedDuration::try_from(UNSCHEDULABLE_GRACE)
        .unwrap_or(k8s_openapi::jiff::SignedDuration::MAX);
    // By pool label: pods that cannot be placed, and the cluster's word on the first.
    let mut pools: std::collections::BTreeMap<String, (u32, String)> = Default::default();
    for pod in pending.items {
        let stuck = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .find(|c| {
                c.type_ == "PodScheduled"
                    && c.status == "False"
                    && c.reason.as_deref() == Some("Unschedulable")
                    && c.last_transition_time
                        .as_ref()
                        .is_some_and(|since| now.duration_since(since.0) >= grace)
            });
        let Some(stuck) = stuck else { continue };
        let pool = pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(POOL_LABEL))
            .cloned()
            .unwrap_or_default();
        let entry = pools
            .entry(pool)
            .or_insert_with(|| (0, stuck.message.clone().unwrap_or_default()));
        entry.0 += 1;
    }
    if pools.is_empty() {
        return Ok(None);
    }
    // The pools by the names the spec gives them (the label is the name made a DNS label).
    let spec_name = |label: &str| -> String {
        job.spec["pools"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["name"].as_str())
            .find(|name| desired::dns_name(&[name]) == label)
            .unwrap_or(label)
            .to_owned()
    };
    let parts: Vec<String> = pools
        .iter()
        .map(|(label, (count, why))| {
            let pods = if *count == 1 { "pod" } else { "pods" };
            format!(
                "pool {}: {count} {pods} cannot be placed ({why})",
                spec_name(label)
            )
        })
        .collect();
    let text = format!(
        "Unschedulable for over {} s, so the job cannot start: {}",
        UNSCHEDULABLE_GRACE.as_secs(),
        parts.join("; ")
    );
    Ok(Some(text.chars().take(MAX_MESSAGE_CHARS).collect()))
}

/// The RLJob a pod of the operator's belongs to, from its `rollfleet.dev/job` label and its
/// namespace (the Controller's pod watch maps each pod change to a reconcile of it); `None` for
/// a pod without the label or a namespace. The label is the RLJob's name made a DNS label, so
/// for a name that is not one already (dots, over 63 characters) it names no RLJob and the
/// reconcile finds nothing: such an RLJob is looked at on its regular requeue only.
pub fn rljob_of_pod(pod: Pod) -> Option<ObjectRef<RLJob>> {
    let job = pod.metadata.labels.as_ref()?.get(JOB_LABEL)?;
    let namespace = pod.metadata.namespace.as_deref()?;
    Some(ObjectRef::new(job).within(namespace))
}

async fn cleanup(job: &RLJob, ctx: &Context) -> Result<Action, Error> {
    ctx.plans.forget(job);
    ctx.metrics.set_phase(job, None);
    let rljob = format!("{}/{}", job.namespace(), job.name());
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
        Ok(Ok(_)) => tracing::info!(%rljob, "job cancelled before deletion"),
        Ok(Err(why)) => tracing::warn!(%rljob, "not cancelled ({why}); deleting it anyway"),
        Err(_) => tracing::warn!(
            %rljob,
            "the scheduler did not answer in {} s; deleting it anyway",
            SCHEDULER_TIMEOUT.as_secs()
        ),
    }
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(conditions: &[Condition], type_: &str) -> (String, String) {
        conditions
            .iter()
            .find(|c| c.type_ == type_)
            .map(|c| (c.status.clone(), c.reason.clone()))
            .unwrap_or_default()
    }

    #[test]
    fn a_pod_labelled_with_its_job_maps_to_that_rljob_and_an_unlabelled_one_to_none() {
        let pod = |labels: Option<&[(&str, &str)]>| Pod {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some("quickstart-decode-7d9f-abcde".into()),
                namespace: Some("rl".into()),
                labels: labels.map(|l| {
                    l.iter()
                        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                        .collect()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let worker = pod(Some(&[
            (JOB_LABEL, "quickstart"),
            (COMPONENT_LABEL, "worker"),
            (POOL_LABEL, "decode"),
        ]));
        let job = rljob_of_pod(worker).expect("the pod's RLJob");
        assert_eq!(
            (job.name.as_str(), job.namespace.as_deref()),
            ("quickstart", Some("rl"))
        );
        assert_eq!(job, ObjectRef::<RLJob>::new("quickstart").within("rl"));
        assert_eq!(rljob_of_pod(pod(None)), None);
        assert_eq!(rljob_of_pod(pod(Some(&[("app", "other")]))), None);
    }

    #[test]
    fn a_succeeded_job_is_complete_and_a_failed_one_failed_and_neither_is_ready() {
        let t = |s: &str| s.to_owned();
        for (phase, complete, failed, ready) in [
            ("Succeeded", "True", "False", "False"),
            ("Failed", "False", "True", "False"),
            ("Cancelled", "False", "True", "False"),
            ("Running", "False", "False", "True"),
            ("Pending", "False", "False", "False"),
        ] {
            let conditions = lifecycle(None, phase, None, Some(2));
            assert_eq!(
                of(&conditions, "Complete"),
                (t(complete), t(phase)),
                "{phase}"
            );
            assert_eq!(of(&conditions, "Failed"), (t(failed), t(phase)), "{phase}");
            assert_eq!(of(&conditions, "Ready").0, ready, "{phase}");
            assert!(conditions.iter().all(|c| c.observed_generation == Some(2)));
            // No Suspended condition for a job never suspended.
            assert_eq!(of(&conditions, "Suspended"), Default::default(), "{phase}");
        }
    }

    #[test]
    fn an_unplaced_pool_makes_a_waiting_job_unready_but_not_an_ended_one() {
        let why = "pool decode: 2 pods cannot be placed";
        let waiting = lifecycle(None, "Pending", Some(why), None);
        assert_eq!(
            of(&waiting, "Ready"),
            ("False".into(), "Unschedulable".into())
        );
        let ended = lifecycle(None, "Succeeded", Some(why), None);
        assert_eq!(of(&ended, "Ready"), ("False".into(), "Succeeded".into()));
    }

    #[test]
    fn a_conditions_transition_time_moves_only_when_its_status_does() {
        let first = lifecycle(None, "Running", None, Some(1));
        let previous = RLJobStatus {
            conditions: first.clone(),
            ..Default::default()
        };
        let ready_at = |c: &[Condition]| {
            c.iter()
                .find(|c| c.type_ == "Ready")
                .map(|c| c.last_transition_time.clone())
        };
        std::thread::sleep(Duration::from_millis(5));
        let again = lifecycle(Some(&previous), "Running", None, Some(1));
        assert_eq!(ready_at(&again), ready_at(&first));
        let ended = lifecycle(Some(&previous), "Succeeded", None, Some(1));
        assert_ne!(ready_at(&ended), ready_at(&first));
    }
}
