//! What the Kubernetes operator needs beyond the job: how it runs the job on a cluster
//! (`spec.kubernetes`: an inference engine, Secrets, a claim for the journal), and where a pool's
//! pods go and what they ask the cluster for (`spec.pools[i].kubernetes`).
//!
//! Only the Kubernetes operator reads them (every other entry point ignores them), but they are
//! part of the job spec so that one file says how and where the job runs, and they are validated
//! here with the rest of the spec, every problem with its field path. The types are plain serde types: this
//! crate is a core crate and never depends on the Kubernetes API crates; the operator converts
//! them to the Kubernetes API's own.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

use crate::validate::Problem;

/// The resource a GPU pool's pods ask for their GPUs with (NVIDIA's device plugin). The operator
/// sets it from the pool's `gpusPerNode`; a pool's `resources` may not.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// How the Kubernetes operator runs the job: `spec.kubernetes`. Each field left out keeps the
/// operator's default (`docs/operator.md`). It is the RLJob object's, not the job's: the job file
/// the scheduler reads leaves it out, so changing it keeps the job file, its hash and its
/// journal's name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KubernetesJob {
    /// The URL of an OpenAI-compatible engine (vLLM, SGLang) the GPU workers generate with
    /// (`rollfleet worker --engine openai --engine-url URL`), instead of the emulated engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_url: Option<String>,
    /// `true` runs the GPU workers on the emulated engine without asking the cluster for GPUs
    /// (no GPU node selector, toleration or `nvidia.com/gpu` limit), to try a job on a cluster
    /// that has none; every GPU figure is then emulated.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub emulated_gpus: bool,
    /// A Secret of the job's namespace whose key `token` holds the bearer token the job's
    /// scheduler requires; the scheduler and every worker get it as `ROLLFLEET_TOKEN`, and the
    /// operator sends it with its own calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret: Option<String>,
    /// A `kubernetes.io/tls` Secret of the job's namespace (`tls.crt`, `tls.key`, `ca.crt`, as
    /// cert-manager writes them) the job's scheduler serves gRPC with; the workers and the
    /// operator call it at `https://`, trusting `ca.crt`. The certificate must name
    /// `<job>-scheduler` and `<job>-scheduler.<namespace>.svc`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_secret: Option<String>,
    /// A PersistentVolumeClaim of the job's namespace to keep the scheduler's journal on
    /// (synced to its disk before the scheduler acts on it), instead of the pod's `emptyDir`:
    /// then a replaced scheduler pod resumes the job too, not only a restarted container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal_claim: Option<String>,
}

/// A pool's placement on Kubernetes. Each field left out keeps the operator's default for the
/// pool (`docs/operator.md`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KubernetesPlacement {
    /// Node labels the pods require. Set, it replaces the default (a GPU pool's
    /// `nvidia.com/gpu.product` label); `{}` requires none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Taints the pods tolerate, besides the default ones (a GPU pool's `nvidia.com/gpu`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// A Kubernetes `Affinity` object (`nodeAffinity`, `podAffinity`, `podAntiAffinity`), as
    /// the Kubernetes API spells it; the operator checks its fields when it converts it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(schema_with = "crate::schema::affinity"))]
    pub affinity: Option<serde_yaml_ng::Value>,
    /// Requests and limits, each replacing the default of the same resource.
    #[serde(default, skip_serializing_if = "Resources::is_empty")]
    pub resources: Resources,
    /// The PriorityClass of the pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
}

/// A toleration, as Kubernetes spells it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Toleration {
    /// The taint's key; empty (with `Exists`) tolerates every taint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// `Equal` (the default) or `Exists`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator: Option<TolerationOperator>,
    /// The taint's value, for `Equal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// The taint's effect; none tolerates every effect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<TaintEffect>,
    /// How long a pod stays on a node tainted `NoExecute` once tainted (only with `NoExecute`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toleration_seconds: Option<i64>,
}

/// How a toleration matches a taint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum TolerationOperator {
    /// Key and value equal.
    Equal,
    /// The key exists, whatever its value.
    Exists,
}

/// A taint's effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum TaintEffect {
    /// New pods are not scheduled on the node.
    NoSchedule,
    /// New pods avoid the node.
    PreferNoSchedule,
    /// Running pods are evicted from the node.
    NoExecute,
}

/// Requests and limits by resource name (`cpu`, `memory`, `ephemeral-storage`, extended
/// resources).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Resources {
    /// What the scheduler reserves for the pod on its node.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub requests: BTreeMap<String, Quantity>,
    /// The most the pod may use.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, Quantity>,
}

impl Resources {
    /// Whether neither requests nor limits are set.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty() && self.limits.is_empty()
    }
}

/// A Kubernetes quantity (`4`, `500m`, `64Gi`, `1.5`), kept as written; YAML numbers are taken
/// as their text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Quantity(pub String);

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Text(String),
            Whole(u64),
            Real(f64),
        }
        Ok(Quantity(match Written::deserialize(deserializer)? {
            Written::Text(text) => text,
            Written::Whole(n) => n.to_string(),
            Written::Real(x) => x.to_string(),
        }))
    }
}

#[cfg(feature = "schema")]
impl schemars::JsonSchema for Quantity {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Quantity".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        crate::schema::quantity()
    }
}

/// Whether `text` is a non-negative Kubernetes quantity: a decimal number and an optional
/// binary (`Ki`..`Ei`) or decimal (`n`, `u`, `m`, `k`, `M`..`E`) suffix or exponent.
fn is_quantity(text: &str) -> bool {
    let text = text.strip_prefix('+').unwrap_or(text);
    let digits_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(digits_end);
    let number_ok = number.chars().filter(|&c| c == '.').count() <= 1
        && number.chars().any(|c| c.is_ascii_digit());
    let exponent_ok = |rest: &str| {
        let rest = rest.strip_prefix(['+', '-']).unwrap_or(rest);
        !rest.is_empty() && rest.chars().all(|c| c.is_ascii_digit())
    };
    let suffix_ok = matches!(
        suffix,
        "" | "Ki"
            | "Mi"
            | "Gi"
            | "Ti"
            | "Pi"
            | "Ei"
            | "n"
            | "u"
            | "m"
            | "k"
            | "M"
            | "G"
            | "T"
            | "P"
            | "E"
    ) || suffix.strip_prefix(['e', 'E']).is_some_and(exponent_ok);
    number_ok && suffix_ok
}

/// Whether `name` is a DNS-1123 label fragment as label names use it: at most 63 characters,
/// letters, digits, `-`, `_` and `.`, starting and ending with a letter or digit.
fn is_label_part(name: &str, allow_empty: bool) -> bool {
    if name.is_empty() {
        return allow_empty;
    }
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    name.len() <= 63
        && edge(name.chars().next())
        && edge(name.chars().last())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Whether `name` is a DNS-1123 subdomain: at most 253 characters of lowercase letters, digits,
/// `-` and `.`, starting and ending with a letter or digit.
fn is_dns_subdomain(name: &str) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    !name.is_empty()
        && name.len() <= 253
        && edge(name.chars().next())
        && edge(name.chars().last())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.'))
}

/// Whether `key` is a label key: an optional DNS subdomain prefix and `/`, then a name.
fn is_label_key(key: &str) -> bool {
    match key.split_once('/') {
        Some((prefix, name)) => is_dns_subdomain(prefix) && is_label_part(name, false),
        None => is_label_part(key, false),
    }
}

/// Whether `url` is an `http://` or `https://` URL with a host.
fn is_http_url(url: &str) -> bool {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"));
    rest.and_then(|r| r.split(['/', '?', '#']).next())
        .is_some_and(|host| !host.is_empty() && !host.contains(char::is_whitespace))
}

/// The problems of the job's `spec.kubernetes` block, each with its field path.
pub(crate) fn job_problems(job: Option<&KubernetesJob>) -> Vec<Problem> {
    let mut out = Vec::new();
    let Some(job) = job else {
        return out;
    };
    let path = "spec.kubernetes";
    if let Some(url) = &job.engine_url
        && !is_http_url(url)
    {
        out.push(Problem {
            path: format!("{path}.engineUrl"),
            message: format!("{url:?} is not an http:// or https:// URL"),
        });
    }
    for (field, name, what) in [
        ("tokenSecret", &job.token_secret, "Secret"),
        ("tlsSecret", &job.tls_secret, "Secret"),
        ("journalClaim", &job.journal_claim, "PersistentVolumeClaim"),
    ] {
        if let Some(name) = name
            && !is_dns_subdomain(name)
        {
            out.push(Problem {
                path: format!("{path}.{field}"),
                message: format!(
                    "{name:?} is not a {what} name (lowercase letters, digits, `-` and `.`)"
                ),
            });
        }
    }
    out
}

/// The problems of pool `path`'s placement (`path` is `spec.pools[i]`), each with its field
/// path.
pub(crate) fn problems(placement: Option<&KubernetesPlacement>, path: &str) -> Vec<Problem> {
    let mut out = Vec::new();
    let Some(placement) = placement else {
        return out;
    };
    let path = format!("{path}.kubernetes");
    let mut error = |at: String, message: String| out.push(Problem { path: at, message });
    for (key, value) in placement.node_selector.iter().flatten() {
        let at = format!("{path}.nodeSelector[{key:?}]");
        if !is_label_key(key) {
            error(
                at.clone(),
                "is not a label key (an optional DNS-subdomain prefix and `/`, then at most 63 \
                 letters, digits, `-`, `_` or `.`, starting and ending with a letter or digit)"
                    .into(),
            );
        }
        if !is_label_part(value, true) {
            error(
                at,
                format!(
                    "{value:?} is not a label value (at most 63 letters, digits, `-`, `_` or \
                     `.`, starting and ending with a letter or digit)"
                ),
            );
        }
    }
    for (i, toleration) in placement.tolerations.iter().enumerate() {
        let at = format!("{path}.tolerations[{i}]");
        let key = toleration.key.as_deref().unwrap_or_default();
        let exists = toleration.operator == Some(TolerationOperator::Exists);
        if !key.is_empty() && !is_label_key(key) {
            error(format!("{at}.key"), format!("{key:?} is not a taint key"));
        }
        if key.is_empty() && !exists {
            error(
                format!("{at}.operator"),
                "must be `Exists` when the key is empty (it then tolerates every taint)".into(),
            );
        }
        if exists && toleration.value.as_deref().is_some_and(|v| !v.is_empty()) {
            error(
                format!("{at}.value"),
                "must be empty with `operator: Exists`".into(),
            );
        }
        if toleration.toleration_seconds.is_some()
            && toleration.effect != Some(TaintEffect::NoExecute)
        {
            error(
                format!("{at}.tolerationSeconds"),
                "applies only to `effect: NoExecute`".into(),
            );
        }
    }
    if let Some(affinity) = &placement.affinity {
        match affinity.as_mapping() {
            Some(mapping) => {
                for key in mapping.keys() {
                    let known = ["nodeAffinity", "podAffinity", "podAntiAffinity"];
                    if !key.as_str().is_some_and(|k| known.contains(&k)) {
                        error(
                            format!("{path}.affinity"),
                            format!(
                                "unknown field {}; expected one of {}",
                                serde_yaml_ng::to_string(key).unwrap_or_default().trim_end(),
                                known.join(", ")
                            ),
                        );
                    }
                }
            }
            None => error(
                format!("{path}.affinity"),
                "must be an object (`nodeAffinity`, `podAffinity`, `podAntiAffinity`)".into(),
            ),
        }
    }
    for (which, map) in [
        ("requests", &placement.resources.requests),
        ("limits", &placement.resources.limits),
    ] {
        for (name, quantity) in map {
            let at = format!("{path}.resources.{which}[{name:?}]");
            if name == GPU_RESOURCE {
                error(
                    at,
                    "is set by the operator from the pool's `gpusPerNode` (the GPUs of each \
                     pod); change that instead"
                        .into(),
                );
            } else if !is_label_key(name) {
                error(at, "is not a resource name".into());
            } else if !is_quantity(&quantity.0) {
                error(
                    at,
                    format!(
                        "{:?} is not a quantity (e.g. `4`, `500m`, `64Gi`, `1.5`)",
                        quantity.0
                    ),
                );
            }
        }
    }
    if let Some(name) = &placement.priority_class_name
        && !is_dns_subdomain(name)
    {
        error(
            format!("{path}.priorityClassName"),
            format!(
                "{name:?} is not a PriorityClass name (lowercase letters, digits, `-` and `.`)"
            ),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placement(yaml: &str) -> KubernetesPlacement {
        serde_yaml_ng::from_str(yaml).expect("a placement")
    }

    fn paths(yaml: &str) -> Vec<String> {
        problems(Some(&placement(yaml)), "spec.pools[1]")
            .into_iter()
            .map(|p| p.path)
            .collect()
    }

    #[test]
    fn a_full_placement_is_valid_and_takes_numbers_as_quantities() {
        let p = placement(
            r#"
nodeSelector: {nvidia.com/gpu.product: NVIDIA-H20, pool: rl}
tolerations:
  - {key: dedicated, operator: Equal, value: rl, effect: NoSchedule}
  - {operator: Exists}
  - {key: node.kubernetes.io/unreachable, operator: Exists, effect: NoExecute, tolerationSeconds: 60}
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms: [{matchExpressions: [{key: zone, operator: In, values: [a]}]}]
resources:
  requests: {cpu: 4, memory: 64Gi, ephemeral-storage: 1.5}
  limits: {memory: 500e6}
priorityClassName: rl-high
"#,
        );
        assert_eq!(problems(Some(&p), "spec.pools[0]"), []);
        assert_eq!(p.resources.requests["cpu"], Quantity("4".into()));
        assert_eq!(
            p.resources.requests["ephemeral-storage"],
            Quantity("1.5".into())
        );
    }

    #[test]
    fn each_wrong_field_is_named_by_its_path() {
        assert_eq!(
            paths(
                r#"
nodeSelector: {"bad key!": x, ok: "not ok!"}
tolerations:
  - {value: x}
  - {key: a, operator: Exists, value: x, tolerationSeconds: 5}
affinity: {nodeAfinity: {}}
resources:
  requests: {cpu: lots, nvidia.com/gpu: 8}
priorityClassName: High
"#
            ),
            [
                r#"spec.pools[1].kubernetes.nodeSelector["bad key!"]"#,
                r#"spec.pools[1].kubernetes.nodeSelector["ok"]"#,
                "spec.pools[1].kubernetes.tolerations[0].operator",
                "spec.pools[1].kubernetes.tolerations[1].value",
                "spec.pools[1].kubernetes.tolerations[1].tolerationSeconds",
                "spec.pools[1].kubernetes.affinity",
                r#"spec.pools[1].kubernetes.resources.requests["cpu"]"#,
                r#"spec.pools[1].kubernetes.resources.requests["nvidia.com/gpu"]"#,
                "spec.pools[1].kubernetes.priorityClassName",
            ]
        );
    }

    #[test]
    fn the_jobs_kubernetes_block_names_each_wrong_field_by_its_path() {
        let good: KubernetesJob = serde_yaml_ng::from_str(
            "{engineUrl: 'http://vllm.rl.svc:8000/v1', emulatedGpus: true, tokenSecret: rl-token, \
             tlsSecret: rl.tls, journalClaim: rl-journals}",
        )
        .expect("a block");
        assert_eq!(job_problems(Some(&good)), []);
        assert!(good.emulated_gpus);
        let bad: KubernetesJob = serde_yaml_ng::from_str(
            "{engineUrl: 'vllm:8000', tokenSecret: Rl_Token, tlsSecret: '', journalClaim: -x}",
        )
        .expect("a block");
        let paths: Vec<String> = job_problems(Some(&bad))
            .into_iter()
            .map(|p| p.path)
            .collect();
        assert_eq!(
            paths,
            [
                "spec.kubernetes.engineUrl",
                "spec.kubernetes.tokenSecret",
                "spec.kubernetes.tlsSecret",
                "spec.kubernetes.journalClaim",
            ]
        );
        assert!(serde_yaml_ng::from_str::<KubernetesJob>("{tokenSecrets: a}").is_err());
        assert!(!is_http_url("https://"));
        assert!(!is_http_url("http://a b"));
    }

    #[test]
    fn an_unknown_operator_or_effect_is_refused_by_the_parser() {
        for yaml in [
            "tolerations: [{key: a, operator: Has}]",
            "tolerations: [{key: a, effect: NoRun}]",
            "nodeSelectr: {a: b}",
        ] {
            assert!(
                serde_yaml_ng::from_str::<KubernetesPlacement>(yaml).is_err(),
                "{yaml}"
            );
        }
    }

    #[test]
    fn quantities_are_recognised_as_kubernetes_writes_them() {
        for good in [
            "1",
            "0.5",
            "500m",
            "64Gi",
            "1e3",
            "1.5E+2",
            "+2",
            "128974848",
            ".5",
        ] {
            assert!(is_quantity(good), "{good}");
        }
        for bad in ["", "-1", "lots", "1.2.3", "64GB", "1e", "Gi", "m"] {
            assert!(!is_quantity(bad), "{bad}");
        }
    }
}
