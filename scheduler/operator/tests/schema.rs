//! The RLJob CRD's schema, generated from the job spec's types: structural as Kubernetes
//! requires, closed to fields the spec lacks, documented for `kubectl explain`, and agreeing
//! with the field paths `rollfleet validate` reports and with every example RLJob in the
//! repository.
//!
//! No API server runs here: the checks an API server makes of a CRD (structural rules) and of an
//! object (types, required fields, unknown fields) are made by the small checker below, which
//! follows the Kubernetes documentation's rules for the subset of OpenAPI the generated schema
//! uses.

use std::path::{Path, PathBuf};

use rollfleet_operator::crd;
use serde_json::{Value, json};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The RLJob object's schema, as JSON.
fn schema() -> Value {
    serde_json::to_value(crd::object_schema().expect("the schema")).expect("JSON")
}

/// Every problem the API server would find in `value` against the structural schema `schema`,
/// each as `path: what`: a wrong type, a missing required field, a field the schema lacks (the
/// API server prunes or, with `kubectl apply`'s strict field validation, refuses it), a value not
/// in an `enum`.
fn problems(schema: &Value, value: &Value, path: &str, out: &mut Vec<String>) {
    if value.is_null() {
        if schema["nullable"] != json!(true) {
            out.push(format!("{path}: null is not allowed"));
        }
        return;
    }
    if schema["x-kubernetes-int-or-string"] == json!(true) {
        if !(value.is_i64() || value.is_u64() || value.is_string()) {
            out.push(format!(
                "{path}: must be an integer or a string, got {value}"
            ));
        }
        return;
    }
    let preserve = schema["x-kubernetes-preserve-unknown-fields"] == json!(true);
    if let Some(values) = schema["enum"].as_array()
        && !values.contains(value)
    {
        out.push(format!("{path}: {value} is not one of {values:?}"));
    }
    match schema["type"].as_str() {
        Some("object") => {
            let Some(fields) = value.as_object() else {
                out.push(format!("{path}: must be an object, got {value}"));
                return;
            };
            for required in schema["required"].as_array().into_iter().flatten() {
                let name = required.as_str().unwrap_or_default();
                if !fields.contains_key(name) {
                    out.push(format!("{path}.{name}: required"));
                }
            }
            for (name, field) in fields {
                let at = format!("{path}.{name}");
                if let Some(property) = schema["properties"].get(name) {
                    problems(property, field, &at, out);
                } else if let Some(each) = schema.get("additionalProperties") {
                    problems(each, field, &at, out);
                } else if !preserve {
                    out.push(format!("{at}: unknown field"));
                }
            }
        }
        Some("array") => {
            let Some(items) = value.as_array() else {
                out.push(format!("{path}: must be an array, got {value}"));
                return;
            };
            for (i, item) in items.iter().enumerate() {
                problems(&schema["items"], item, &format!("{path}[{i}]"), out);
            }
        }
        Some("string") if !value.is_string() => {
            out.push(format!("{path}: must be a string, got {value}"));
        }
        Some("integer") if !(value.is_i64() || value.is_u64()) => {
            out.push(format!("{path}: must be an integer, got {value}"));
        }
        Some("number") if !value.is_number() => {
            out.push(format!("{path}: must be a number, got {value}"));
        }
        Some("boolean") if !value.is_boolean() => {
            out.push(format!("{path}: must be a boolean, got {value}"));
        }
        Some(_) => {}
        None if preserve => {}
        None => out.push(format!("{path}: the schema has no type")),
    }
}

/// The problems of an RLJob object (only its `spec` and `status`: the API server checks the rest
/// itself).
fn object_problems(object: &Value) -> Vec<String> {
    let schema = schema();
    let mut out = Vec::new();
    let mut checked = json!({});
    for field in ["spec", "status"] {
        if let Some(value) = object.get(field) {
            checked[field] = value.clone();
        }
    }
    problems(&schema, &checked, "", &mut out);
    out
}

/// Every place in a structural schema where Kubernetes' rules are broken, as `path: what`.
fn unstructural(schema: &Value, path: &str, out: &mut Vec<String>) {
    let Some(node) = schema.as_object() else {
        out.push(format!("{path}: not a schema object"));
        return;
    };
    for banned in [
        "$ref",
        "$defs",
        "definitions",
        "$schema",
        "default",
        "title",
    ] {
        if node.contains_key(banned) {
            out.push(format!("{path}: has `{banned}`"));
        }
    }
    let escape = node.get("x-kubernetes-int-or-string") == Some(&json!(true))
        || node.get("x-kubernetes-preserve-unknown-fields") == Some(&json!(true));
    match node.get("type") {
        Some(Value::String(_)) => {}
        Some(other) => out.push(format!("{path}: type {other} is not one type")),
        None if escape => {}
        None => out.push(format!("{path}: no type")),
    }
    if node.contains_key("properties") && node.contains_key("additionalProperties") {
        out.push(format!("{path}: both properties and additionalProperties"));
    }
    if node
        .get("additionalProperties")
        .is_some_and(Value::is_boolean)
    {
        out.push(format!("{path}: a boolean additionalProperties"));
    }
    // Value validations may not say what the structure is.
    for combinator in ["anyOf", "oneOf", "allOf"] {
        for (i, branch) in node
            .get(combinator)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            for structural in [
                "type",
                "description",
                "default",
                "nullable",
                "additionalProperties",
            ] {
                if branch.get(structural).is_some() {
                    out.push(format!("{path}.{combinator}[{i}]: sets `{structural}`"));
                }
            }
        }
    }
    for (name, property) in node
        .get("properties")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
    {
        unstructural(property, &format!("{path}.{name}"), out);
    }
    if let Some(items) = node.get("items") {
        unstructural(items, &format!("{path}[]"), out);
    } else if node.get("type") == Some(&json!("array")) {
        out.push(format!("{path}: an array without items"));
    }
    if let Some(each) = node.get("additionalProperties")
        && each.is_object()
    {
        unstructural(each, &format!("{path}[*]"), out);
    }
}

/// The schema at a field path as `rollfleet validate` writes it (`spec.pools[1].kubernetes.
/// nodeSelector["a b"]`), if the schema has that field.
fn schema_at<'a>(schema: &'a Value, path: &str) -> Option<&'a Value> {
    let mut node = schema;
    let mut rest = path;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix('[') {
            let end = if let Some(quoted) = after.strip_prefix('"') {
                quoted.find('"').map(|i| i + 2)?
            } else {
                after.find(']')?
            };
            let key = &after[..end];
            node = if key.starts_with('"') {
                node.get("additionalProperties")?
            } else {
                key.parse::<usize>().ok()?;
                node.get("items")?
            };
            rest = after[end..].strip_prefix(']')?;
        } else {
            let rest_of = rest.strip_prefix('.').unwrap_or(rest);
            let end = rest_of.find(['.', '[']).unwrap_or(rest_of.len());
            node = node.get("properties")?.get(&rest_of[..end])?;
            rest = &rest_of[end..];
        }
    }
    Some(node)
}

fn yaml_file(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

#[test]
fn the_crds_schema_is_structural_as_the_api_server_requires() {
    let mut out = Vec::new();
    unstructural(&schema(), "", &mut out);
    assert!(out.is_empty(), "not structural:\n{}", out.join("\n"));
    // And the shipped manifest carries that schema.
    let shipped = yaml_file(&repo().join("manifests/operator/crd.yaml"));
    assert_eq!(
        shipped["spec"]["versions"][0]["schema"]["openAPIV3Schema"],
        schema()
    );
}

#[test]
fn a_spec_field_the_job_spec_lacks_is_refused_and_the_spec_is_no_longer_open() {
    let schema = schema();
    let spec = &schema["properties"]["spec"];
    assert_eq!(spec["x-kubernetes-preserve-unknown-fields"], Value::Null);
    assert!(spec["properties"].get("nonsense").is_none());
    let problems = object_problems(&json!({"spec": {"nonsense": 42}}));
    assert!(
        problems.contains(&".spec.nonsense: unknown field".to_owned()),
        "{problems:?}"
    );
    for required in ["model", "rl", "tasks", "rewards", "pools"] {
        assert!(
            problems.contains(&format!(".spec.{required}: required")),
            "{required}: {problems:?}"
        );
    }
    // A wrong type and an unknown enum value deep in a pool, as the API server would refuse them.
    let mut job = yaml_file(&repo().join("examples/jobs/quickstart.yaml"));
    job["spec"]["pools"][0]["count"] = json!("many");
    job["spec"]["pools"][0]["roles"] = json!(["cook"]);
    job["spec"]["pools"][0]["kubernetes"] = json!({"tolerations": [{"operator": "Has"}]});
    job["spec"]["kubernetes"] = json!({"tokenSecrets": "rl-token"});
    let problems = object_problems(&job);
    for expected in [
        ".spec.pools[0].count: must be an integer",
        ".spec.pools[0].roles[0]: \"cook\" is not one of",
        ".spec.pools[0].kubernetes.tolerations[0].operator: \"Has\" is not one of",
        ".spec.kubernetes.tokenSecrets: unknown field",
    ] {
        assert!(
            problems.iter().any(|p| p.starts_with(expected)),
            "{expected}: {problems:?}"
        );
    }
}

#[test]
fn every_field_has_a_description_for_kubectl_explain() {
    let schema = schema();
    let pools = &schema["properties"]["spec"]["properties"]["pools"];
    assert_eq!(pools["description"], "Hardware pools.");
    assert!(
        pools["items"]["properties"]["kubernetes"]["description"]
            .as_str()
            .is_some_and(|d| d.contains("Kubernetes")),
        "{pools:#}"
    );
    fn undocumented(node: &Value, path: &str, out: &mut Vec<String>) {
        for (name, property) in node["properties"].as_object().into_iter().flatten() {
            let at = format!("{path}.{name}");
            if property["description"]
                .as_str()
                .is_none_or(|d| d.trim().is_empty())
            {
                out.push(at.clone());
            }
            undocumented(property, &at, out);
            undocumented(&property["items"], &format!("{at}[]"), out);
            undocumented(&property["additionalProperties"], &format!("{at}[*]"), out);
        }
    }
    let mut out = Vec::new();
    undocumented(&schema, "", &mut out);
    assert!(out.is_empty(), "fields without a description: {out:?}");
}

#[test]
fn every_field_path_validate_reports_for_a_pool_is_a_field_of_the_schema() {
    let mut job = yaml_file(&repo().join("examples/jobs/quickstart.yaml"));
    job["spec"]["pools"] = json!([
        {"name": "", "gpu": "H900", "count": -1, "gpusPerNode": 0, "roles": ["environment"]},
        {"name": "a", "cpu": "no-such-shape", "count": 0, "gpusPerNode": 8},
        {"name": "b", "serverless": "no-such-platform", "concurrency": -5, "count": 3},
        {"name": "c", "gpu": "H800", "cpu": "c7i.8xlarge"},
        {"name": "d", "gpu": "H800", "count": 8, "kubernetes": {
            "nodeSelector": {"bad key!": "x"},
            "tolerations": [{"value": "x"}, {"key": "a", "operator": "Exists", "value": "x",
                "tolerationSeconds": 5}],
            "affinity": {"nodeAfinity": {}},
            "resources": {"requests": {"cpu": "lots", "nvidia.com/gpu": 8}, "limits": {"memory": "1GB"}},
            "priorityClassName": "High",
        }},
    ]);
    job["spec"]["kubernetes"] = json!({
        "engineUrl": "vllm:8000", "tokenSecret": "A", "tlsSecret": "B", "journalClaim": "C",
    });
    let text = serde_yaml_ng::to_string(&job).expect("YAML");
    let problems = match rollfleet_spec::parse_job(text.as_bytes(), "test") {
        Err(e) => e.problems(),
        Ok(_) => panic!("the job is invalid"),
    };
    let paths: Vec<&str> = problems
        .iter()
        .map(|p| p.path.as_str())
        .filter(|p| p.starts_with("spec.pools") || p.starts_with("spec.kubernetes"))
        .collect();
    for expected in [
        "spec.pools[0].gpu",
        "spec.pools[0].count",
        "spec.pools[0].gpusPerNode",
        "spec.pools[0].roles[0]",
        "spec.pools[1].cpu",
        "spec.pools[2].concurrency",
        "spec.pools[3]",
        "spec.pools[4].kubernetes.nodeSelector[\"bad key!\"]",
        "spec.pools[4].kubernetes.tolerations[1].tolerationSeconds",
        "spec.pools[4].kubernetes.affinity",
        "spec.pools[4].kubernetes.resources.requests[\"cpu\"]",
        "spec.pools[4].kubernetes.priorityClassName",
        "spec.kubernetes.engineUrl",
        "spec.kubernetes.journalClaim",
    ] {
        assert!(paths.contains(&expected), "{expected} not in {paths:?}");
    }
    let schema = schema();
    for path in &paths {
        assert!(
            schema_at(&schema, path).is_some(),
            "`rollfleet validate` reports {path}, which the CRD's schema does not have"
        );
    }
    // The resolver itself refuses a field the schema lacks.
    assert!(schema_at(&schema, "spec.pools[0].colour").is_none());
    assert!(schema_at(&schema, "spec.nonsense").is_none());
}

#[test]
fn every_example_rljob_in_the_repository_fits_the_schema() {
    let mut files: Vec<String> = std::fs::read_dir(repo().join("examples/jobs"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".yaml"))
        .map(|name| format!("examples/jobs/{name}"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{files:?}");
    files.push("examples/real-cpu/job.yaml".into());
    files.push("scheduler/sim/benches/scale-3000.yaml".into());
    for file in &files {
        let object = yaml_file(&repo().join(file));
        assert_eq!(object["kind"], "RLJob", "{file}");
        assert_eq!(object_problems(&object), Vec::<String>::new(), "{file}");
    }
    // The YAML blocks of the docs that are whole RLJobs (or a spec's `kubernetes` block).
    for doc in ["docs/operator.md", "docs/job-spec.md"] {
        let text = std::fs::read_to_string(repo().join(doc)).expect("the doc");
        for block in text.split("```yaml\n").skip(1) {
            let block = block.split("```").next().unwrap_or_default();
            let Ok(object) = serde_yaml_ng::from_str::<Value>(block) else {
                continue;
            };
            // Outlines (`model: {...}`) and excerpts are not whole objects.
            let excerpt = block.contains("{...}") || block.contains("# model, rl, tasks");
            if object["kind"] != "RLJob" || excerpt {
                continue;
            }
            assert_eq!(
                object_problems(&object),
                Vec::<String>::new(),
                "{doc}:\n{block}"
            );
        }
    }
    // With every operator setting, suspended, and with a status the operator writes.
    let mut job = yaml_file(&repo().join("examples/jobs/quickstart.yaml"));
    job["spec"]["suspend"] = json!(true);
    job["spec"]["kubernetes"] = json!({
        "engineUrl": "http://vllm:8000", "emulatedGpus": true, "tokenSecret": "rl-token",
        "tlsSecret": "rl-tls", "journalClaim": "rl-journals",
    });
    let status = rollfleet_operator::crd::RLJobStatus {
        phase: "Running".into(),
        observed_generation: Some(2),
        conditions: vec![
            rollfleet_operator::k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                type_: "Ready".into(),
                status: "True".into(),
                reason: "Running".into(),
                message: String::new(),
                observed_generation: Some(2),
                last_transition_time:
                    rollfleet_operator::k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                        rollfleet_operator::k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                    ),
            },
        ],
        ..Default::default()
    };
    job["status"] = serde_json::to_value(&status).expect("JSON");
    assert_eq!(object_problems(&job), Vec::<String>::new());
}
