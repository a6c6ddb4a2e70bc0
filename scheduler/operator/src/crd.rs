//! The `RLJob` custom resource: a rollfleet job spec as a Kubernetes object.
//!
//! The object is the job file itself (`apiVersion: rollfleet.dev/v1alpha1`, `kind: RLJob`), so
//! `kubectl apply -f examples/jobs/quickstart.yaml` submits the same job `rollfleet run` runs. Its
//! `spec` is validated by `rollfleet-spec`, the one validator every rollfleet entry point uses,
//! which reports every problem with its field path; the CRD's schema therefore keeps the spec
//! open (`x-kubernetes-preserve-unknown-fields`) instead of repeating the rules in OpenAPI, and
//! the operator writes the problems into the object's status.

use std::borrow::Cow;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceColumnDefinition, CustomResourceDefinition, CustomResourceDefinitionNames,
    CustomResourceDefinitionSpec, CustomResourceDefinitionVersion, CustomResourceSubresourceStatus,
    CustomResourceSubresources, CustomResourceValidation, JSONSchemaProps,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
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

/// The status the operator writes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
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
    /// What the phase means now: the spec's problems, the scheduler's message.
    pub message: String,
    /// `Valid` (the spec passed validation and planning), `SchedulerReachable`, `Ready` (the job
    /// runs: every worker it waits for has joined), `Complete` and `Failed` (the job ended, as
    /// `kubectl wait --for=condition=Complete` waits for), and `Suspended` once `spec.suspend`
    /// was set.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// When the job started for the spec it has (reset by a changed spec and by a resume, as a
    /// Kubernetes Job's is).
    #[serde(default)]
    pub start_time: Option<Time>,
    /// When the job ended (succeeded, failed or was cancelled).
    #[serde(default)]
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

fn open_object(description: &str) -> JSONSchemaProps {
    JSONSchemaProps {
        type_: Some("object".into()),
        description: Some(description.into()),
        x_kubernetes_preserve_unknown_fields: Some(true),
        ..Default::default()
    }
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
pub fn crd() -> CustomResourceDefinition {
    let schema = JSONSchemaProps {
        type_: Some("object".into()),
        required: Some(vec!["spec".into()]),
        properties: Some(
            [
                (
                    "spec".to_owned(),
                    open_object(
                        "The rollfleet job spec (docs/job-spec.md); the operator validates it and \
                         writes its problems, with their field paths, into status.message.",
                    ),
                ),
                ("status".to_owned(), open_object("Written by the operator.")),
            ]
            .into(),
        ),
        ..Default::default()
    };
    CustomResourceDefinition {
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
    }
}

/// The CRD as YAML, as `manifests/operator/crd.yaml` holds it.
pub fn crd_yaml() -> Result<String, serde_yaml_ng::Error> {
    Ok(format!(
        "# Generated by `rollfleet-operator crd`; a test checks that it matches.\n{}",
        serde_yaml_ng::to_string(&crd())?
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
        assert_eq!(manifest("crd.yaml"), crd_yaml().unwrap_or_default());
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
            .and_then(|s| s.template.spec)
            .expect("a pod template");
        assert_eq!(pod.service_account_name, account.metadata.name);
        let container = &pod.containers[0];
        assert_eq!(
            container.command.clone().unwrap_or_default(),
            ["rollfleet-operator", "run", "--leader-elect"]
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
