//! The JSON Schemas of the spec's values that serde reads by hand (feature `schema`): written
//! here so that a Kubernetes API server, which takes only structural schemas (a type at every
//! node, or one of its two escape hatches), can enforce the rest of the spec.
//!
//! - a distribution ([`crate::Dist`]) is a number or a map, which no single type describes: it
//!   keeps any value (`x-kubernetes-preserve-unknown-fields`), and the spec's own validation
//!   checks it;
//! - a quantity ([`crate::Quantity`]) is an integer or a string, as Kubernetes' own quantities
//!   are (`x-kubernetes-int-or-string`);
//! - an affinity is a Kubernetes `Affinity` object: its three fields are named, their contents
//!   kept as written (the operator converts them to the Kubernetes API's type and names what
//!   does not fit).

use schemars::{Schema, SchemaGenerator, json_schema};

/// A distribution: a bare number, or a map tagged by `distribution`.
pub(crate) fn distribution() -> Schema {
    json_schema!({
        "description": "A number (always that value), or a map tagged by `distribution`: \
            `{distribution: fixed, value}`, `{distribution: uniform, min, max}`, \
            `{distribution: lognormal, median, p99, max}`, `{distribution: trace, trace, \
            column, scale, max}` or `{distribution: csv, path, column, scale, max}` \
            (docs/job-spec.md).",
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

/// A Kubernetes quantity: `4`, `500m`, `64Gi`, `"1.5"`.
pub(crate) fn quantity() -> Schema {
    json_schema!({
        "description": "A Kubernetes quantity: an integer or a string (`4`, `500m`, `64Gi`, \
            `\"1.5\"`).",
        "x-kubernetes-int-or-string": true,
    })
}

/// A Kubernetes `Affinity`: `nodeAffinity`, `podAffinity`, `podAntiAffinity`.
pub(crate) fn affinity(_: &mut SchemaGenerator) -> Schema {
    let kept = |what: &str| {
        json_schema!({
            "description": what,
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": true,
        })
    };
    json_schema!({
        "type": "object",
        "nullable": true,
        "properties": {
            "nodeAffinity": kept("Node affinity, as Kubernetes' `NodeAffinity`."),
            "podAffinity": kept("Pod affinity, as Kubernetes' `PodAffinity`."),
            "podAntiAffinity": kept("Pod anti-affinity, as Kubernetes' `PodAntiAffinity`."),
        },
    })
}
