//! The `RLJob` custom resource: a rollfleet job spec as a Kubernetes object.
//!
//! The object is the job file itself (`apiVersion: rollfleet.dev/v1alpha1`, `kind: RLJob`), so
//! `kubectl apply -f examples/jobs/quickstart.yaml` submits the same job `rollfleet run` runs.
//!
//! The CRD's schema is generated from the job spec's own Rust types (`rollfleet-spec` with its
//! `schema` feature, through schemars and `kube::core::schema`'s structural-schema transforms),
//! so the API server refuses a field the spec does not have or a value of the wrong type at
//! `kubectl apply`, and `kubectl explain rljob.spec.pools` shows the spec's own documentation.
//! What a schema cannot say (a GPU the catalogue lacks, shares that do not sum to 1) is checked
//! by `rollfleet-spec`, the one validator every rollfleet entry point uses, which reports every
//! problem with its field path; the operator writes them into the object's status.
//! `manifests/operator/crd.yaml` is `rollfleet-operator crd`'s output, and a test keeps it so.

use std::borrow::Cow;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceColumnDefinition, CustomResourceDefinition, CustomResourceDefinitionNames,
    CustomResourceDefinitionSpec, CustomResourceDefinitionVersion, CustomResourceSubresourceStatus,
    CustomResourceSubresources, CustomResourceValidation, JSONSchemaProps,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use kube_core::schema::{OptionalEnum, OptionalIntOrString, StructuralSchemaRewriter};
use schemars::transform::{Transform, transform_subschemas};
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

/// The API group.
pub const GROUP: &str = "rollfleet.dev";
/// The served version.
pub const VERSION: &str = "v1alpha1";
/// The kind.
pub const KIND: &str = "RLJob";
/// The resource's plural name.
pub const PLURAL: &str = "rljobs";

/// An RL job, as applied with `kubectl`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RLJob {
    /// `rollfleet.dev/v1alpha1`.
    #[serde(default)]
    pub api_version: String,
    /// `RLJob`.
    #[serde(default)]
    pub kind: String,
    /// Name, namespace, labels, annotations, generation, finalizers.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// The job spec, as `docs/job-spec.md` describes it.
    #[serde(default)]
    pub spec: serde_json::Value,
    /// What the operator last saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<RLJobStatus>,
}

/// The spec of an RLJob as its schema describes it: the job spec, and `suspend`.
///
/// The operator reads the spec as JSON ([`RLJob::spec`]), so that an object the schema let
/// through but the spec's validation refuses still gets a status naming every problem; this type
/// only describes it.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RLJobSpec {
    /// The job, as `rollfleet validate` reads it.
    #[serde(flatten)]
    pub job: rollfleet_spec::JobSpec,
    /// `true` scales every Deployment of the job to zero (as Kueue and other queueing
    /// controllers set it); `false` or unset runs it. The object's, not the job's: the job file
    /// leaves it out, so suspending and resuming keep its journal.
    #[serde(default)]
    pub suspend: bool,
}

/// The status the operator writes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct RLJobStatus {
    /// `Invalid`, `Suspended`, `Starting` (objects applied, the scheduler not answering yet), or
    /// the scheduler's own phase: `Pending`, `Running`, `Succeeded`, `Failed`, `Cancelled`.
    pub phase: String,
    /// The generation of the spec this status describes.
    pub observed_generation: Option<i64>,
    /// RL steps trained.
    pub rl_step: u64,
    /// RL steps the job asks for.
    pub rl_steps_total: u64,
    /// Trajectories handed to the trainer.
    pub trajectories_trained: u64,
    /// Worker pods the job runs (its scheduler waits for this many).
    pub workers: u32,
    /// Workers registered with the scheduler at its last answer (a fall while the job runs is a
    /// worker lost, reported as a `WorkerLost` Event).
    pub workers_joined: u32,
    /// What the phase means now: the spec's problems, the scheduler's message.
    pub message: String,
    /// `Valid` (the spec passed validation and planning), `SchedulerReachable`, `Ready` (the job
    /// runs: every worker it waits for has joined), `Complete` and `Failed` (the job ended, as
    /// `kubectl wait --for=condition=Complete` waits for), and `Suspended` once `spec.suspend`
    /// was set.
    #[serde(default)]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// When the job started for the spec it has (reset by a changed spec and by a resume, as a
    /// Kubernetes Job's is).
    #[serde(default)]
    #[schemars(schema_with = "time_schema")]
    pub start_time: Option<Time>,
    /// When the job ended (succeeded, failed or was cancelled).
    #[serde(default)]
    #[schemars(schema_with = "time_schema")]
    pub completion_time: Option<Time>,
}

impl RLJob {
    /// The object's name (empty when it has none, which the API server never allows).
    pub fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or_default()
    }

    /// The object's namespace (`default` when unset).
    pub fn namespace(&self) -> &str {
        self.metadata.namespace.as_deref().unwrap_or("default")
    }
}

impl kube::Resource for RLJob {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        Cow::Borrowed(KIND)
    }

    fn group(_: &()) -> Cow<'_, str> {
        Cow::Borrowed(GROUP)
    }

    fn version(_: &()) -> Cow<'_, str> {
        Cow::Borrowed(VERSION)
    }

    fn plural(_: &()) -> Cow<'_, str> {
        Cow::Borrowed(PLURAL)
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// A time, as Kubernetes writes it (RFC 3339), or null.
fn time_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "string", "format": "date-time", "nullable": true })
}

/// Kubernetes' `Condition`s, as `status.conditions` holds them.
fn conditions_schema(_: &mut SchemaGenerator) -> Schema {
    let text = |description: &str| json_schema!({ "type": "string", "description": description });
    json_schema!({
        "type": "array",
        "items": {
            "type": "object",
            "required": ["type", "status"],
            "properties": {
                "type": text("`Valid`, `SchedulerReachable`, `Ready`, `Complete`, `Failed` or \
                    `Suspended`."),
                "status": text("`True`, `False` or `Unknown`."),
                "reason": text("Why, in one CamelCase word."),
                "message": text("Why, in words."),
                "lastTransitionTime": {
                    "type": "string",
                    "format": "date-time",
                    "description": "When the condition's status last changed.",
                },
                "observedGeneration": {
                    "type": "integer",
                    "format": "int64",
                    "description": "The generation of the spec the condition describes.",
                },
            },
        },
    })
}

/// Drops every `default` from a schema: the API server would write defaults into the stored
/// object, and so into the job file and its hash; the spec's own defaults apply when the job file
/// is read. And joins the lines of each description's paragraphs (doc comments are wrapped at
/// 100 columns; `kubectl explain` wraps them again).
#[derive(Debug, Clone)]
struct NoDefaults;

impl Transform for NoDefaults {
    fn transform(&mut self, schema: &mut Schema) {
        transform_subschemas(self, schema);
        if let Some(object) = schema.as_object_mut() {
            object.remove("default");
            if let Some(serde_json::Value::String(text)) = object.get_mut("description") {
                *text = text
                    .split("\n\n")
                    .map(|paragraph| paragraph.split('\n').collect::<Vec<_>>().join(" "))
                    .collect::<Vec<_>>()
                    .join("\n\n");
            }
        }
    }
}

/// Why the CRD could not be written.
#[derive(Debug, thiserror::Error)]
pub enum CrdError {
    /// A generated schema is not an OpenAPI schema Kubernetes reads.
    #[error("the schema of {what} is not a Kubernetes schema: {source}")]
    Schema {
        /// `spec` or `status`.
        what: &'static str,
        /// Why.
        source: serde_json::Error,
    },
    /// The CRD could not be written as YAML.
    #[error("the CRD cannot be written as YAML: {0}")]
    Yaml(#[from] serde_yaml_ng::Error),
}

/// The structural OpenAPI schema of `T`, as kube's `CustomResource` derive makes it: every
/// subschema inlined (no `$ref`), enums and tagged unions made objects and lists of values
/// (`kube::core::schema`), and no defaults ([`NoDefaults`]).
fn structural_schema<T: JsonSchema>(what: &'static str) -> Result<JSONSchemaProps, CrdError> {
    let generator = schemars::generate::SchemaSettings::openapi3()
        .with(|settings| {
            settings.inline_subschemas = true;
            settings.meta_schema = None;
        })
        .with_transform(StructuralSchemaRewriter)
        .with_transform(OptionalEnum)
        .with_transform(OptionalIntOrString)
        .with_transform(NoDefaults)
        .into_generator();
    let mut schema = generator.into_root_schema_for::<T>();
    if let Some(object) = schema.as_object_mut() {
        object.remove("title");
    }
    serde_json::from_value(schema.to_value()).map_err(|source| CrdError::Schema { what, source })
}

/// The schema of the RLJob object: its `spec` and `status`.
pub fn object_schema() -> Result<JSONSchemaProps, CrdError> {
    let mut spec = structural_schema::<RLJobSpec>("spec")?;
    spec.description = Some(
        "The rollfleet job spec (docs/job-spec.md), and `suspend`. The API server checks its \
         fields and their types; the operator validates the rest and writes every problem, with \
         its field path, into status.message."
            .into(),
    );
    let mut status = structural_schema::<RLJobStatus>("status")?;
    status.description = Some("What the operator last saw; written by the operator.".into());
    Ok(JSONSchemaProps {
        type_: Some("object".into()),
        required: Some(vec!["spec".into()]),
        properties: Some([("spec".to_owned(), spec), ("status".to_owned(), status)].into()),
        ..Default::default()
    })
}

fn column(name: &str, type_: &str, path: &str) -> CustomResourceColumnDefinition {
    CustomResourceColumnDefinition {
        name: name.into(),
        type_: type_.into(),
        json_path: path.into(),
        ..Default::default()
    }
}

/// The CustomResourceDefinition (`rollfleet-operator crd`; `manifests/operator/crd.yaml`).
pub fn crd() -> Result<CustomResourceDefinition, CrdError> {
    let schema = object_schema()?;
    Ok(CustomResourceDefinition {
        metadata: ObjectMeta {
            name: Some(format!("{PLURAL}.{GROUP}")),
            ..Default::default()
        },
        spec: CustomResourceDefinitionSpec {
            group: GROUP.into(),
            names: CustomResourceDefinitionNames {
                kind: KIND.into(),
                plural: PLURAL.into(),
                singular: Some("rljob".into()),
                short_names: Some(vec!["rlj".into()]),
                categories: Some(vec!["rollfleet".into()]),
                ..Default::default()
            },
            scope: "Namespaced".into(),
            versions: vec![CustomResourceDefinitionVersion {
                name: VERSION.into(),
                served: true,
                storage: true,
                schema: Some(CustomResourceValidation {
                    open_api_v3_schema: Some(schema),
                }),
                subresources: Some(CustomResourceSubresources {
                    // `status: {}`: an empty object enables the subresource.
                    status: Some(CustomResourceSubresourceStatus(serde_json::json!({}))),
                    ..Default::default()
                }),
                additional_printer_columns: Some(vec![
                    column("Phase", "string", ".status.phase"),
                    column("Step", "integer", ".status.rlStep"),
                    column("Steps", "integer", ".status.rlStepsTotal"),
                    column("Trained", "integer", ".status.trajectoriesTrained"),
                    column("Workers", "integer", ".status.workers"),
                    column("Age", "date", ".metadata.creationTimestamp"),
                    column("Message", "string", ".status.message"),
                ]),
                ..Default::default()
            }],
            ..Default::default()
        },
        status: None,
    })
}

/// The command that writes `manifests/operator/crd.yaml`.
pub const REGENERATE: &str = "cargo run -p rollfleet-operator -- crd > manifests/operator/crd.yaml";

/// The CRD as YAML, as `manifests/operator/crd.yaml` holds it.
pub fn crd_yaml() -> Result<String, CrdError> {
    Ok(format!(
        "# Generated from the job spec's types by `rollfleet-operator crd` ({REGENERATE});\n\
         # a test checks that it matches.\n{}",
        serde_yaml_ng::to_string(&crd()?)?
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(name: &str) -> String {
        std::fs::read_to_string(format!(
            "{}/../../manifests/operator/{name}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap_or_else(|e| panic!("manifests/operator/{name}: {e}"))
    }

    #[test]
    fn the_shipped_crd_is_the_one_the_operator_generates() {
        let generated = crd_yaml().expect("the CRD");
        assert!(
            manifest("crd.yaml") == generated,
            "manifests/operator/crd.yaml is not the CRD the operator generates from the job \
             spec's types; regenerate it with `{REGENERATE}`"
        );
        let parsed: CustomResourceDefinition =
            serde_yaml_ng::from_str(&manifest("crd.yaml")).expect("a CustomResourceDefinition");
        assert_eq!(
            parsed.metadata.name.as_deref(),
            Some("rljobs.rollfleet.dev")
        );
        assert_eq!(parsed.spec.versions[0].name, VERSION);
    }

    #[test]
    fn the_operator_manifests_are_kubernetes_objects_that_fit_together() {
        use k8s_openapi::api::apps::v1::Deployment;
        use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
        use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};

        let docs: Vec<serde_json::Value> = manifest("rbac.yaml")
            .split("\n---\n")
            .map(|doc| serde_yaml_ng::from_str(doc).expect("YAML"))
            .collect();
        let of = |kind: &str| -> serde_json::Value {
            docs.iter()
                .find(|d| d["kind"] == kind)
                .cloned()
                .unwrap_or_else(|| panic!("no {kind} in rbac.yaml"))
        };
        // Each parses as its API type (which checks apiVersion, kind and every field's type).
        let namespace: Namespace = serde_json::from_value(of("Namespace")).expect("Namespace");
        let account: ServiceAccount =
            serde_json::from_value(of("ServiceAccount")).expect("ServiceAccount");
        let role: ClusterRole = serde_json::from_value(of("ClusterRole")).expect("ClusterRole");
        let binding: ClusterRoleBinding =
            serde_json::from_value(of("ClusterRoleBinding")).expect("ClusterRoleBinding");
        let operator: Deployment =
            serde_yaml_ng::from_str(&manifest("operator.yaml")).expect("Deployment");

        assert_eq!(
            binding.role_ref.name,
            role.metadata.name.clone().unwrap_or_default()
        );
        let subject = &binding.subjects.unwrap_or_default()[0];
        assert_eq!(Some(&subject.name), account.metadata.name.as_ref());
        assert_eq!(subject.namespace, namespace.metadata.name);
        assert_eq!(operator.metadata.namespace, namespace.metadata.name);
        let pod = operator
            .spec
            .clone()
            .and_then(|s| s.template.spec)
            .expect("a pod template");
        assert_eq!(pod.service_account_name, account.metadata.name);
        let container = &pod.containers[0];
        let command = container.command.clone().unwrap_or_default();
        assert_eq!(
            command[..3],
            ["rollfleet-operator", "run", "--leader-elect"]
        );
        // Its metrics, on the port the headless Service (scraped by Prometheus) selects.
        let after = |flag: &str| {
            command
                .iter()
                .position(|a| a == flag)
                .and_then(|i| command.get(i + 1))
                .cloned()
        };
        assert_eq!(after("--metrics-addr").as_deref(), Some("0.0.0.0:9465"));
        assert_eq!(after("--log-format").as_deref(), Some("json"));
        let service: k8s_openapi::api::core::v1::Service =
            serde_yaml_ng::from_str(&manifest("service.yaml")).expect("Service");
        let service_spec = service.spec.expect("a Service spec");
        assert_eq!(service_spec.cluster_ip.as_deref(), Some("None"));
        assert_eq!(service.metadata.namespace, namespace.metadata.name);
        assert_eq!(
            service_spec.selector.as_ref(),
            operator
                .spec
                .as_ref()
                .and_then(|s| s.template.metadata.as_ref())
                .and_then(|m| m.labels.as_ref())
        );
        let ports = service_spec.ports.unwrap_or_default();
        assert_eq!(ports[0].port, 9465);
        assert!(
            container
                .ports
                .iter()
                .flatten()
                .any(|p| p.container_port == 9465 && p.name.as_deref() == Some("metrics"))
        );
        let prometheus = std::fs::read_to_string(format!(
            "{}/../../manifests/monitoring/prometheus.yml",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap_or_default();
        assert!(
            prometheus.contains("rollfleet-operator-metrics.rollfleet-system.svc"),
            "prometheus.yml scrapes the operator's Service"
        );
        let env = container.env.clone().unwrap_or_default();
        assert!(
            env.iter()
                .any(|e| e.name == "ROLLFLEET_IMAGE" && e.value.is_some())
        );
        // Leader election: each replica's identity and the Lease's namespace, from the pod.
        for (name, field) in [
            ("POD_NAME", "metadata.name"),
            ("POD_NAMESPACE", "metadata.namespace"),
        ] {
            let from = env
                .iter()
                .find(|e| e.name == name)
                .and_then(|e| e.value_from.as_ref())
                .and_then(|v| v.field_ref.as_ref())
                .map(|f| f.field_path.as_str());
            assert_eq!(from, Some(field), "{name}");
        }
        let role: Role = serde_json::from_value(of("Role")).expect("Role");
        let role_binding: RoleBinding =
            serde_json::from_value(of("RoleBinding")).expect("RoleBinding");
        assert_eq!(role.metadata.namespace, namespace.metadata.name);
        assert_eq!(
            role_binding.role_ref.name,
            role.metadata.name.clone().unwrap_or_default()
        );
        let subject = &role_binding.subjects.unwrap_or_default()[0];
        assert_eq!(Some(&subject.name), account.metadata.name.as_ref());
    }

    #[test]
    fn every_example_job_file_is_an_rljob_object() {
        for file in ["quickstart.yaml", "rollart-agentic.yaml"] {
            let path = format!("{}/../../examples/jobs/{file}", env!("CARGO_MANIFEST_DIR"));
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let job: RLJob = serde_yaml_ng::from_str(&text).expect("an RLJob");
            assert_eq!(
                (job.api_version.as_str(), job.kind.as_str()),
                ("rollfleet.dev/v1alpha1", KIND),
                "{file}"
            );
            assert!(job.spec.get("pools").is_some(), "{file}");
        }
    }
}
