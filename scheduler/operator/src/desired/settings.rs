//! The settings an RLJob gives the operator: read from its spec's `kubernetes` block, or from
//! its annotations when the block leaves them out (the token and TLS Secrets, the journal's
//! claim, emulated GPUs), and whether it is suspended or finished.

use super::*;

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
pub(super) fn settings_of(job: &RLJob) -> rollfleet_spec::KubernetesJob {
    kubernetes_block(job).unwrap_or_default()
}

/// Whether `job`'s GPU workers emulate their GPUs (and ask the cluster for none).
pub(super) fn emulated_gpus(job: &RLJob) -> bool {
    settings_of(job).emulated_gpus
        || annotation(job, EMULATED_GPUS_ANNOTATION).as_deref() == Some("true")
}

/// The value of one of `job`'s annotations.
pub(super) fn annotation(job: &RLJob, key: &str) -> Option<String> {
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
pub(super) fn journal_claim(job: &RLJob) -> Option<String> {
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
