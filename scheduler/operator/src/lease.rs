//! Leader election over a `coordination.k8s.io/v1` Lease, the way client-go's `leaderelection`
//! does it, so that several operator replicas can run and only one reconciles.
//!
//! Each replica calls [`LeaseLock::try_acquire_or_renew`] every few seconds. The holder renews
//! the Lease (`renewTime`); a candidate takes it when it has no holder, or when the record it
//! reads has not changed for a whole `leaseDurationSeconds` of the candidate's own monotonic
//! clock. Expiry is judged by how long the candidate has seen the same record, not by comparing
//! `renewTime` with its wall clock, so clocks that disagree between nodes cannot make two
//! leaders (client-go's `observedTime`). Every write carries the `resourceVersion` read, so of
//! two candidates racing for a free Lease the API server lets one win and answers the other
//! `409 Conflict`.
//!
//! There is no fencing: a leader that stops renewing keeps acting until it notices, so the
//! operator's `run` exits once it cannot renew within two thirds of the duration, before a
//! candidate may take over (a third of the duration after that), and the pod restarts as a
//! candidate.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};

/// What went wrong with the Lease.
#[derive(Debug, thiserror::Error)]
#[error("lease {namespace}/{name}: {source}")]
pub struct LeaseError {
    /// The Lease's namespace.
    pub namespace: String,
    /// The Lease's name.
    pub name: String,
    /// What the API server said.
    #[source]
    pub source: kube::Error,
}

/// Who leads, as one round of [`LeaseLock::try_acquire_or_renew`] left it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leadership {
    /// This replica holds the Lease.
    Leading,
    /// Another holds it (or won the race for it just now).
    Following {
        /// The holder's identity.
        holder: String,
    },
}

/// What to do with the Lease as read, by [`decide`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// There is none: create it, held by us.
    Create,
    /// It is ours: renew it.
    Renew,
    /// It has no holder, or its holder has not renewed it for a whole duration: take it.
    TakeOver,
    /// Another holds it and renews it.
    Follow {
        /// The holder's identity.
        holder: String,
    },
}

/// Decides what to do with the Lease read (`None`: there is none), for the candidate `me`, the
/// record having looked the same to us for `unchanged_for` (zero the first time we see it).
pub fn decide(lease: Option<&Lease>, me: &str, unchanged_for: Duration) -> Decision {
    let Some(lease) = lease else {
        return Decision::Create;
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let holder = spec.holder_identity.unwrap_or_default();
    if holder.is_empty() {
        return Decision::TakeOver;
    }
    if holder == me {
        return Decision::Renew;
    }
    let duration = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(1) as u64);
    if unchanged_for >= duration {
        Decision::TakeOver
    } else {
        Decision::Follow { holder }
    }
}

/// One candidate's handle on the Lease.
pub struct LeaseLock {
    api: Api<Lease>,
    namespace: String,
    name: String,
    identity: String,
    duration: Duration,
    /// The record last read (holder, renew time, resource version) and when we first saw it.
    observed: Mutex<Option<(String, Instant)>>,
}

impl LeaseLock {
    /// A candidate `identity` for the Lease `namespace/name`, which a holder keeps for
    /// `duration` without renewing.
    pub fn new(
        client: kube::Client,
        namespace: &str,
        name: &str,
        identity: &str,
        duration: Duration,
    ) -> LeaseLock {
        LeaseLock {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            identity: identity.to_owned(),
            duration,
            observed: Mutex::new(None),
        }
    }

    /// This candidate's identity.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// How long a holder keeps the Lease without renewing it.
    pub fn duration(&self) -> Duration {
        self.duration
    }

    /// One round: creates, renews or takes the Lease when this candidate may, and says who
    /// leads. `now` is this candidate's monotonic clock (expiry is judged by it), `wall` the
    /// time written into the Lease for people to read.
    pub async fn try_acquire_or_renew(
        &self,
        now: Instant,
        wall: Timestamp,
    ) -> Result<Leadership, LeaseError> {
        let current = self
            .api
            .get_opt(&self.name)
            .await
            .map_err(|e| self.error(e))?;
        let unchanged_for = self.unchanged_for(current.as_ref(), now);
        let leadership = match decide(current.as_ref(), &self.identity, unchanged_for) {
            Decision::Follow { holder } => return Ok(Leadership::Following { holder }),
            Decision::Create => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.name.clone()),
                        namespace: Some(self.namespace.clone()),
                        ..Default::default()
                    },
                    spec: Some(self.held(wall, None)),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
            Decision::Renew | Decision::TakeOver => {
                let Some(mut lease) = current else {
                    // `decide` answers Create for a missing Lease.
                    return Ok(Leadership::Following {
                        holder: String::new(),
                    });
                };
                lease.spec = Some(self.held(wall, lease.spec.take()));
                // The resourceVersion read rides along: a Lease changed since is a conflict.
                self.api
                    .replace(&self.name, &PostParams::default(), &lease)
                    .await
            }
        };
        match leadership {
            Ok(written) => {
                self.unchanged_for(Some(&written), now);
                Ok(Leadership::Leading)
            }
            // Another candidate wrote first (409), or created it first (409 on create).
            Err(kube::Error::Api(status)) if status.code == 409 => {
                let holder = self
                    .api
                    .get_opt(&self.name)
                    .await
                    .map_err(|e| self.error(e))?
                    .and_then(|l| l.spec.and_then(|s| s.holder_identity))
                    .unwrap_or_default();
                Ok(Leadership::Following { holder })
            }
            Err(e) => Err(self.error(e)),
        }
    }

    /// Gives the Lease up, if this candidate holds it, so that another takes it at once rather
    /// than after a whole duration.
    pub async fn release(&self, wall: Timestamp) -> Result<(), LeaseError> {
        let Some(mut lease) = self
            .api
            .get_opt(&self.name)
            .await
            .map_err(|e| self.error(e))?
        else {
            return Ok(());
        };
        let mut spec = lease.spec.take().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.renew_time = Some(MicroTime(wall));
        spec.lease_duration_seconds = Some(1);
        lease.spec = Some(spec);
        self.api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
            .map(|_| ())
            .map_err(|e| self.error(e))
    }

    /// The spec of the Lease held by this candidate as of `wall`, from the one read.
    fn held(&self, wall: Timestamp, read: Option<LeaseSpec>) -> LeaseSpec {
        let read = read.unwrap_or_default();
        let ours = read.holder_identity.as_deref() == Some(self.identity.as_str());
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.duration.as_secs().clamp(1, i32::MAX as u64) as i32),
            acquire_time: if ours {
                read.acquire_time
            } else {
                Some(MicroTime(wall))
            },
            renew_time: Some(MicroTime(wall)),
            lease_transitions: Some(match (ours, read.holder_identity.is_some()) {
                (true, _) => read.lease_transitions.unwrap_or(0),
                (false, true) => read.lease_transitions.unwrap_or(0).saturating_add(1),
                (false, false) => read.lease_transitions.unwrap_or(0),
            }),
            ..read
        }
    }

    /// Notes the record read at `now`; how long it has looked the same.
    fn unchanged_for(&self, lease: Option<&Lease>, now: Instant) -> Duration {
        let key = lease.map(|l| {
            let spec = l.spec.clone().unwrap_or_default();
            format!(
                "{:?}/{:?}/{:?}",
                spec.holder_identity,
                spec.renew_time.map(|t| t.0),
                l.metadata.resource_version
            )
        });
        let mut observed = self.observed.lock().unwrap_or_else(|e| e.into_inner());
        match (key, observed.as_ref()) {
            (Some(key), Some((seen, since))) if *seen == key => {
                now.saturating_duration_since(*since)
            }
            (Some(key), _) => {
                *observed = Some((key, now));
                Duration::ZERO
            }
            (None, _) => {
                *observed = None;
                Duration::ZERO
            }
        }
    }

    fn error(&self, source: kube::Error) -> LeaseError {
        LeaseError {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            source,
        }
    }
}

/// Why a leader stopped leading.
#[derive(Debug, thiserror::Error)]
pub enum LostLease {
    /// Another candidate holds the Lease now.
    #[error("lost the lease to {holder}")]
    TakenBy {
        /// Its identity.
        holder: String,
    },
    /// The Lease could not be renewed in time: another may take it soon, so this one stops.
    #[error("could not renew the lease for {for_s:.1} s: {last}")]
    NotRenewed {
        /// Seconds since the last renewal.
        for_s: f64,
        /// The last failure.
        last: LeaseError,
    },
}

/// Waits until `lock`'s candidate leads, trying every `retry`; `log` hears who else holds the
/// Lease, or why the API server could not be asked, whenever that changes.
pub async fn acquire(lock: &LeaseLock, retry: Duration, mut log: impl FnMut(String)) {
    // Each state is said once, not at every try: a standby may wait for days.
    let mut told: Option<String> = None;
    loop {
        let said = match lock
            .try_acquire_or_renew(Instant::now(), Timestamp::now())
            .await
        {
            Ok(Leadership::Leading) => return,
            Ok(Leadership::Following { holder }) => {
                format!("the lease is held by {holder}; waiting to take it over (standby)")
            }
            Err(e) => format!("{e}; trying again every {retry:?}"),
        };
        if told.as_ref() != Some(&said) {
            log(said.clone());
            told = Some(said);
        }
        tokio::time::sleep(retry).await;
    }
}

/// Renews `lock`'s Lease every `every` while its candidate leads; returns when it no longer
/// does: another holds the Lease, or no renewal succeeded for `deadline` (which must be shorter
/// than the Lease's duration, so that this leader stops before another may start).
pub async fn keep(lock: &LeaseLock, every: Duration, deadline: Duration) -> LostLease {
    let mut renewed = Instant::now();
    loop {
        tokio::time::sleep(every).await;
        match lock
            .try_acquire_or_renew(Instant::now(), Timestamp::now())
            .await
        {
            Ok(Leadership::Leading) => renewed = Instant::now(),
            Ok(Leadership::Following { holder }) => return LostLease::TakenBy { holder },
            Err(last) => {
                let since = renewed.elapsed();
                if since >= deadline {
                    return LostLease::NotRenewed {
                        for_s: since.as_secs_f64(),
                        last,
                    };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: Option<&str>, duration: i32) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some("rollfleet-operator".into()),
                resource_version: Some("7".into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(Into::into),
                lease_duration_seconds: Some(duration),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn a_missing_lease_is_created_and_ones_own_is_renewed() {
        assert_eq!(decide(None, "a", Duration::ZERO), Decision::Create);
        assert_eq!(
            decide(Some(&lease(Some("a"), 15)), "a", Duration::from_secs(60)),
            Decision::Renew
        );
    }

    #[test]
    fn another_holders_lease_is_taken_only_after_it_looked_unchanged_for_its_whole_duration() {
        let held = lease(Some("b"), 15);
        let follow = Decision::Follow { holder: "b".into() };
        assert_eq!(decide(Some(&held), "a", Duration::ZERO), follow);
        assert_eq!(decide(Some(&held), "a", Duration::from_secs(14)), follow);
        assert_eq!(
            decide(Some(&held), "a", Duration::from_secs(15)),
            Decision::TakeOver
        );
    }

    #[test]
    fn a_released_lease_is_taken_at_once() {
        assert_eq!(
            decide(Some(&lease(None, 1)), "a", Duration::ZERO),
            Decision::TakeOver
        );
        assert_eq!(
            decide(Some(&lease(Some(""), 15)), "a", Duration::ZERO),
            Decision::TakeOver
        );
    }
}
