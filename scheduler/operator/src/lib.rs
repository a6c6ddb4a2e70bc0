//! The rollfleet Kubernetes operator: `RLJob` objects, applied with `kubectl`, become a running
//! rollfleet job.
//!
//! - [`crd`]: the `RLJob` resource and its CustomResourceDefinition;
//! - [`desired`]: what an RLJob should run (its scheduler, a Deployment of workers per pool), a
//!   pure function tested without a cluster;
//! - [`controller`]: the reconciler that applies it and reports the scheduler's status back;
//! - [`events`]: the Kubernetes Events of what happened to each RLJob;
//! - [`metrics`]: the operator's own Prometheus metrics and their HTTP endpoint;
//! - [`lease`]: leader election over a Lease, so that only one of several replicas reconciles;
//! - [`placement`]: where each pool's pods go, what they ask for, and the restricted security
//!   context of every pod.
//!
//! It depends on kube and k8s-openapi, which the scheduler core and the simulator never do.

/// The Kubernetes API types the operator's objects are made of.
pub use k8s_openapi;

pub mod controller;
pub mod crd;
pub mod desired;
pub mod events;
pub mod lease;
pub mod logs;
pub mod metrics;
pub mod placement;
