//! Kubernetes Events for what happened to an RLJob, as `kubectl describe rljob NAME` lists them:
//! published through kube-rs's event recorder (`events.k8s.io/v1`, reporting controller
//! `rollfleet-operator`), regarding the RLJob.
//!
//! Which Events a pass publishes is a pure function of the status before it and the status it
//! wrote ([`happened`]), so each is published once, when its change is first seen:
//!
//! | reason | type | when |
//! |---|---|---|
//! | `Planned` | Normal | a spec is planned for the first time |
//! | `Replanned` | Normal | a changed spec (a new generation) is planned again |
//! | `PoolPlaced` | Normal | with either: one per worker Deployment applied, with its pods and where they go |
//! | `InvalidSpec` | Warning | a spec cannot be planned |
//! | `Unschedulable` | Warning | some pool's pods stayed unschedulable past the grace |
//! | `Running` | Normal | the scheduler reports the job running |
//! | `WorkerLost` | Warning | fewer workers are registered with the running job's scheduler than at its last answer |
//! | `Succeeded` | Normal | the job ended and succeeded |
//! | `Failed`, `Cancelled` | Warning | the job ended otherwise |
//! | `Suspended`, `Resumed` | Normal | `spec.suspend` was set, or cleared again |
//!
//! A failure to publish is logged and never fails the pass: Events are for people, the status is
//! the record.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder};

use crate::crd::{RLJob, RLJobStatus};
use crate::desired::{COMPONENT_LABEL, Desired};

/// The reporting controller of every Event the operator publishes.
pub const REPORTER: &str = "rollfleet-operator";

/// The most characters of an Event's note (the API server refuses notes over 1 kB).
const MAX_NOTE_CHARS: usize = 1000;

fn event(type_: EventType, reason: &str, action: &str, note: String) -> Event {
    Event {
        type_,
        reason: reason.into(),
        note: Some(note.chars().take(MAX_NOTE_CHARS).collect()),
        action: action.into(),
        secondary: None,
    }
}

fn ready_reason(status: &RLJobStatus) -> Option<&str> {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready" && c.status == "False")
        .map(|c| c.reason.as_str())
}

/// A worker Deployment applied: what its `PoolPlaced` Event says, and the Deployment (the
/// Event's related object, which also keeps each pool's Event apart from the others').
#[derive(Debug, Clone)]
pub struct Placed {
    /// Which pool, how many pods of how many GPUs, on which nodes.
    pub note: String,
    /// The Deployment.
    pub deployment: ObjectReference,
}

/// What each worker Deployment of `wanted` runs and where.
pub fn placements(wanted: &Desired) -> Vec<Placed> {
    wanted
        .deployments
        .iter()
        .filter(|d| {
            d.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(COMPONENT_LABEL))
                .is_some_and(|c| c == "worker")
        })
        .map(placement_note)
        .collect()
}

fn placement_note(d: &Deployment) -> Placed {
    let name = d.metadata.name.as_deref().unwrap_or_default();
    let replicas = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(0);
    let pod = d.spec.as_ref().and_then(|s| s.template.spec.as_ref());
    let pool = d
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(crate::desired::POOL_LABEL))
        .map_or(name, String::as_str);
    let pods = if replicas == 1 { "pod" } else { "pods" };
    let gpus = pod
        .and_then(|p| p.containers.first())
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("nvidia.com/gpu"))
        .map(|q| {
            let gpus = if q.0 == "1" { "GPU" } else { "GPUs" };
            format!(" of {} {gpus} each", q.0)
        })
        .unwrap_or_default();
    let selector = pod
        .and_then(|p| p.node_selector.as_ref())
        .filter(|s| !s.is_empty())
        .map(|s| {
            let pairs: Vec<String> = s.iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!(" on nodes {}", pairs.join(","))
        })
        .unwrap_or_else(|| " on any node".into());
    Placed {
        note: format!("pool {pool}: Deployment {name}, {replicas} {pods}{gpus}{selector}"),
        deployment: ObjectReference {
            api_version: Some("apps/v1".into()),
            kind: Some("Deployment".into()),
            name: Some(name.into()),
            namespace: d.metadata.namespace.clone(),
            ..Default::default()
        },
    }
}

/// The Events a pass publishes: what changed from `previous` to `now`. `placed` are the
/// `PoolPlaced` notes of the objects the pass applied (see [`placements`]).
pub fn happened(
    previous: Option<&RLJobStatus>,
    now: &RLJobStatus,
    placed: &[Placed],
) -> Vec<Event> {
    let mut events = Vec::new();
    let before = |f: fn(&RLJobStatus) -> bool| previous.is_some_and(f);
    let was_phase = |phase: &str| previous.is_some_and(|p| p.phase == phase);
    let new_generation = previous.is_none_or(|p| p.observed_generation != now.observed_generation);
    if now.phase == "Invalid" {
        if new_generation || !was_phase("Invalid") {
            events.push(event(
                EventType::Warning,
                "InvalidSpec",
                "Plan",
                now.message.clone(),
            ));
        }
        return events;
    }
    // Planned, when this generation was not yet (a suspended or ended job's too: its objects
    // were applied at zero).
    // Suspending or resuming changes the spec, not the job file: no new plan to report.
    let suspend_toggled = was_phase("Suspended") != (now.phase == "Suspended");
    if previous.is_none() || (new_generation && !suspend_toggled) || was_phase("Invalid") {
        let replanned = before(|p| p.observed_generation.is_some());
        let (reason, note) = if replanned {
            (
                "Replanned",
                format!(
                    "the spec changed (generation {}): planned again for {} workers",
                    now.observed_generation.unwrap_or_default(),
                    now.workers
                ),
            )
        } else {
            ("Planned", format!("planned for {} workers", now.workers))
        };
        events.push(event(EventType::Normal, reason, "Plan", note));
        for p in placed {
            events.push(Event {
                secondary: Some(p.deployment.clone()),
                ..event(EventType::Normal, "PoolPlaced", "Apply", p.note.clone())
            });
        }
    }
    let unschedulable = ready_reason(now) == Some("Unschedulable");
    let was_unschedulable = previous.and_then(ready_reason) == Some("Unschedulable");
    if unschedulable && (!was_unschedulable || new_generation) {
        events.push(event(
            EventType::Warning,
            "Unschedulable",
            "Place",
            now.message.clone(),
        ));
    }
    // A worker lost while the job runs: fewer registered than at the last answer.
    if let Some(before) = previous
        && !new_generation
        && before.phase == "Running"
        && now.phase == "Running"
        && now.workers_joined < before.workers_joined
    {
        events.push(event(
            EventType::Warning,
            "WorkerLost",
            "Watch",
            format!(
                "workers registered with the scheduler fell from {} to {} (of {} the job runs)",
                before.workers_joined, now.workers_joined, now.workers
            ),
        ));
    }
    if was_phase(&now.phase) && !new_generation {
        return events;
    }
    if was_phase("Suspended") && now.phase != "Suspended" {
        events.push(event(
            EventType::Normal,
            "Resumed",
            "Resume",
            "spec.suspend cleared: the job's Deployments are scaled up again".into(),
        ));
    }
    let (type_, action) = match now.phase.as_str() {
        "Running" => (EventType::Normal, "Run"),
        "Succeeded" => (EventType::Normal, "End"),
        "Failed" | "Cancelled" => (EventType::Warning, "End"),
        "Suspended" => (EventType::Normal, "Suspend"),
        _ => return events,
    };
    let note = match now.phase.as_str() {
        "Running" => format!(
            "the scheduler runs the job with its {} workers",
            now.workers
        ),
        "Succeeded" => format!(
            "{} of {} RL steps, {} trajectories trained",
            now.rl_step, now.rl_steps_total, now.trajectories_trained
        ),
        _ => now.message.clone(),
    };
    events.push(event(type_, &now.phase, action, note));
    events
}

/// Publishes `events` about `job`; a failure is logged, never returned.
pub async fn publish(recorder: &Recorder, job: &RLJob, events: &[Event]) {
    let regarding = kube::Resource::object_ref(job, &());
    for e in events {
        if let Err(error) = recorder.publish(e, &regarding).await {
            tracing::warn!(
                rljob = %format!("{}/{}", job.namespace(), job.name()),
                reason = %e.reason,
                "could not publish the event: {error}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(phase: &str, generation: i64) -> RLJobStatus {
        RLJobStatus {
            phase: phase.into(),
            observed_generation: Some(generation),
            workers: 5,
            ..Default::default()
        }
    }

    fn reasons(events: &[Event]) -> Vec<String> {
        events.iter().map(|e| e.reason.clone()).collect()
    }

    #[test]
    fn a_first_pass_is_planned_with_each_pool_placed_and_a_second_one_publishes_nothing() {
        let placed = [Placed {
            note: "pool decode: Deployment q-decode, 1 pod".into(),
            deployment: ObjectReference::default(),
        }];
        let first = status("Pending", 1);
        assert_eq!(
            reasons(&happened(None, &first, &placed)),
            ["Planned", "PoolPlaced"]
        );
        assert!(happened(Some(&first), &first, &placed).is_empty());
    }

    #[test]
    fn a_changed_spec_is_replanned_and_each_phase_change_is_published_once() {
        let placed: [Placed; 0] = [];
        let running = status("Running", 1);
        let changed = status("Running", 2);
        assert_eq!(
            reasons(&happened(Some(&running), &changed, &placed)),
            ["Replanned", "Running"]
        );
        let pending = status("Pending", 1);
        assert_eq!(
            reasons(&happened(Some(&pending), &running, &placed)),
            ["Running"]
        );
        let failed = status("Failed", 1);
        let events = happened(Some(&running), &failed, &placed);
        assert_eq!(reasons(&events), ["Failed"]);
        assert_eq!(events[0].type_, EventType::Warning);
        let suspended = status("Suspended", 1);
        assert_eq!(
            reasons(&happened(Some(&running), &suspended, &placed)),
            ["Suspended"]
        );
        assert_eq!(
            reasons(&happened(Some(&suspended), &pending, &placed)),
            ["Resumed"]
        );
        assert!(happened(Some(&suspended), &suspended, &placed).is_empty());
    }

    #[test]
    fn fewer_workers_registered_while_the_job_runs_is_a_worker_lost_and_more_is_not() {
        let running = |joined: u32| RLJobStatus {
            workers_joined: joined,
            ..status("Running", 1)
        };
        let events = happened(Some(&running(5)), &running(4), &[]);
        assert_eq!(reasons(&events), ["WorkerLost"]);
        assert_eq!(events[0].type_, EventType::Warning);
        let note = events[0].note.clone().unwrap_or_default();
        assert!(note.contains("from 5 to 4 (of 5"), "{note}");
        assert!(happened(Some(&running(4)), &running(5), &[]).is_empty());
        // A job that ended lets its workers go: no loss.
        let ended = RLJobStatus {
            workers_joined: 0,
            ..status("Succeeded", 1)
        };
        assert_eq!(
            reasons(&happened(Some(&running(5)), &ended, &[])),
            ["Succeeded"]
        );
    }
}
