//! The tests of the desired objects: the example RLJobs and what the operator makes of them,
//! object by object, with the settings from the spec and the annotations.

use super::*;

pub(crate) fn example(file: &str) -> RLJob {
    let path = format!("{}/../../examples/jobs/{file}", env!("CARGO_MANIFEST_DIR"));
    let mut job: RLJob =
        serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap_or_default())
            .expect("an RLJob");
    job.metadata.namespace = Some("rl".into());
    job.metadata.uid = Some("uid-1".into());
    job
}

fn settings() -> Settings {
    Settings {
        image: "rollfleet:test".into(),
    }
}

fn args(d: &Deployment) -> Vec<String> {
    d.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.containers[0].args.clone())
        .unwrap_or_default()
}

fn replicas(d: &Deployment) -> i32 {
    d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(-1)
}

fn gpu_limit(d: &Deployment) -> Option<String> {
    d.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.containers[0].resources.as_ref())
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("nvidia.com/gpu"))
        .map(|q| q.0.clone())
}

fn named<'a>(d: &'a Desired, name: &str) -> &'a Deployment {
    d.deployments
        .iter()
        .find(|x| x.metadata.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("no deployment {name}"))
}

#[test]
fn the_rollart_job_gets_a_worker_per_gpu_node_and_per_cpu_node_and_one_for_lambda() {
    let d = desired(&example("rollart-agentic.yaml"), &settings()).expect("valid");
    let h800 = named(&d, "rollart-agentic-h800");
    assert_eq!((replicas(h800), gpu_limit(h800)), (24, Some("8".into())));
    assert!(
        args(h800).ends_with(&["--gpus".into(), "8".into()]),
        "{:?}",
        args(h800)
    );
    let h20 = named(&d, "rollart-agentic-h20");
    assert_eq!((replicas(h20), gpu_limit(h20)), (40, Some("8".into())));
    let env = named(&d, "rollart-agentic-env-nodes");
    assert_eq!((replicas(env), gpu_limit(env)), (48, None));
    assert_eq!(replicas(named(&d, "rollart-agentic-lambda")), 1);
    assert_eq!(d.workers, 24 + 40 + 48 + 1);
    let scheduler = named(&d, "rollart-agentic-scheduler");
    let a = args(scheduler);
    let expect = a
        .iter()
        .position(|x| x == "--expect-workers")
        .expect("the flag");
    assert_eq!(a[expect + 1], "113");
    assert!(
        args(h20).contains(&"http://rollart-agentic-scheduler:7070".to_owned()),
        "{:?}",
        args(h20)
    );
}

#[test]
fn a_pool_whose_gpus_do_not_fill_whole_nodes_gets_a_partial_node() {
    let mut job = example("rollart-agentic.yaml");
    job.spec["pools"][1]["count"] = 324.into();
    let d = desired(&job, &settings()).expect("valid");
    let full = named(&d, "rollart-agentic-h20");
    let partial = named(&d, "rollart-agentic-h20-partial");
    assert_eq!((replicas(full), gpu_limit(full)), (40, Some("8".into())));
    assert_eq!(
        (replicas(partial), gpu_limit(partial)),
        (1, Some("4".into()))
    );
    assert_eq!(d.workers, 24 + 41 + 48 + 1);
}

#[test]
fn the_scheduler_reads_the_job_from_its_config_map_keeps_a_journal_and_restarts_when_it_changes() {
    let job = example("quickstart.yaml");
    let d = desired(&job, &settings()).expect("valid");
    let file = &d.config_map.data.as_ref().expect("data")["job.yaml"];
    let parsed = rollfleet_spec::parse_job(file.as_bytes(), "config map").expect("a job");
    assert_eq!(parsed.manifest.metadata.name, "quickstart");
    let hash = |d: &Desired| {
        d.deployments[0]
            .spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.annotations.as_ref())
            .map(|a| a[JOB_HASH_ANNOTATION].clone())
    };
    let mut changed = job.clone();
    changed.spec["rl"]["steps"] = 7.into();
    let d2 = desired(&changed, &settings()).expect("valid");
    assert!(hash(&d).is_some());
    assert_ne!(hash(&d), hash(&d2));
    assert_eq!(hash(&d), hash(&desired(&job, &settings()).expect("valid")));
    let scheduler = &d.deployments[0];
    let strategy = scheduler.spec.as_ref().and_then(|s| s.strategy.clone());
    assert_eq!(strategy.and_then(|s| s.type_).as_deref(), Some("Recreate"));
    // Its journal is on an emptyDir, named by the job file's hash.
    let pod = scheduler
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.clone())
        .expect("a pod");
    let a = pod.containers[0].args.clone().expect("args");
    let at = a.iter().position(|x| x == "--journal").expect("the flag");
    assert_eq!(
        Some(a[at + 1].clone()),
        hash(&d).map(|h| format!("{JOURNAL_DIR}/{h}.journal"))
    );
    let mounts = pod.containers[0].volume_mounts.clone().expect("mounts");
    let journal = mounts
        .iter()
        .find(|m| m.name == "journal")
        .expect("mounted");
    assert_eq!(journal.mount_path, JOURNAL_DIR);
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "journal")
        .expect("a volume");
    assert!(volume.empty_dir.is_some(), "{volume:?}");
    for object in d
        .deployments
        .iter()
        .map(|x| &x.metadata)
        .chain([&d.config_map.metadata])
    {
        let owner = &object.owner_references.as_ref().expect("owned")[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("RLJob", "uid-1")
        );
        assert_eq!(object.namespace.as_deref(), Some("rl"));
    }
}

#[test]
fn an_engine_url_annotation_puts_the_gpu_workers_on_that_engine() {
    let mut job = example("quickstart.yaml");
    job.metadata.annotations = Some(BTreeMap::from([(
        ENGINE_URL_ANNOTATION.to_owned(),
        "http://vllm:8000".to_owned(),
    )]));
    let d = desired(&job, &settings()).expect("valid");
    let decode = args(named(&d, "quickstart-decode"));
    assert!(decode.ends_with(&["--engine-url".into(), "http://vllm:8000".into()]));
    assert!(!args(named(&d, "quickstart-envs")).contains(&"--engine".to_owned()));
}

fn token_source(container: &Container) -> Option<(String, String)> {
    let env = container.env.as_ref()?;
    assert_eq!(env.len(), 1, "{env:?}");
    assert_eq!(env[0].name, "ROLLFLEET_TOKEN");
    let key = env[0].value_from.as_ref()?.secret_key_ref.as_ref()?;
    Some((key.name.clone(), key.key.clone()))
}

#[test]
fn a_token_secret_annotation_gives_the_scheduler_and_every_worker_the_token() {
    let mut job = example("quickstart.yaml");
    let plain = desired(&job, &settings()).expect("valid");
    job.metadata.annotations = Some(BTreeMap::from([(
        TOKEN_SECRET_ANNOTATION.to_owned(),
        "rl-token".to_owned(),
    )]));
    let d = desired(&job, &settings()).expect("valid");
    assert_eq!(d.deployments.len(), plain.deployments.len());
    for (with, without) in d.deployments.iter().zip(&plain.deployments) {
        let container = |d: &Deployment| {
            d.spec
                .as_ref()
                .and_then(|s| s.template.spec.as_ref())
                .expect("pod")
                .containers[0]
                .clone()
        };
        assert_eq!(
            token_source(&container(with)),
            Some(("rl-token".to_owned(), TOKEN_SECRET_KEY.to_owned())),
            "{:?}",
            with.metadata.name
        );
        assert_eq!(container(without).env, None, "{:?}", without.metadata.name);
    }
}

#[test]
fn an_ended_job_keeps_no_pods_until_its_spec_changes() {
    let replicas = |d: &Desired| -> Vec<i32> {
        d.deployments
            .iter()
            .map(|d| d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(-1))
            .collect()
    };
    let mut job = example("quickstart.yaml");
    job.metadata.generation = Some(3);
    let running = replicas(&desired(&job, &settings()).expect("valid"));
    assert!(running.iter().all(|&r| r >= 1), "{running:?}");
    for (phase, generation, scaled) in [
        ("Running", 3, false),
        ("Succeeded", 3, true),
        ("Failed", 3, true),
        ("Cancelled", 3, true),
        // The spec changed since the job ended: the new one runs.
        ("Succeeded", 2, false),
    ] {
        job.status = Some(crate::crd::RLJobStatus {
            phase: phase.into(),
            observed_generation: Some(generation),
            ..Default::default()
        });
        let now = replicas(&desired(&job, &settings()).expect("valid"));
        let expected = if scaled {
            vec![0; running.len()]
        } else {
            running.clone()
        };
        assert_eq!(now, expected, "{phase} at generation {generation}");
    }
}

#[test]
fn a_journal_claim_annotation_puts_the_schedulers_journal_on_that_claim_synced_to_its_disk() {
    let synced = |d: &Desired| {
        d.deployments[0]
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .and_then(|p| p.containers[0].args.as_ref())
            .expect("the scheduler's args")
            .contains(&"--journal-sync".to_owned())
    };
    let journal = |d: &Desired| {
        d.deployments[0]
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .and_then(|p| p.volumes.as_ref())
            .and_then(|v| v.iter().find(|v| v.name == "journal").cloned())
            .expect("a journal volume")
    };
    let mut job = example("quickstart.yaml");
    let plain = desired(&job, &settings()).expect("valid");
    assert!(
        !synced(&plain),
        "an emptyDir goes with its node: syncing it buys nothing"
    );
    let plain = journal(&plain);
    assert!(plain.empty_dir.is_some() && plain.persistent_volume_claim.is_none());
    job.metadata.annotations = Some(BTreeMap::from([(
        JOURNAL_CLAIM_ANNOTATION.to_owned(),
        "rl-journals".to_owned(),
    )]));
    let claimed = desired(&job, &settings()).expect("valid");
    assert!(
        synced(&claimed),
        "a claim outlives the node: the journal is synced"
    );
    let claimed = journal(&claimed);
    assert!(claimed.empty_dir.is_none(), "{claimed:?}");
    assert_eq!(
        claimed
            .persistent_volume_claim
            .map(|c| (c.claim_name, c.read_only)),
        Some(("rl-journals".to_owned(), Some(false)))
    );
}

#[test]
fn a_tls_secret_gives_the_scheduler_its_certificate_and_the_workers_only_the_ca_and_https() {
    let mut job = example("quickstart.yaml");
    job.metadata.annotations = Some(BTreeMap::from([(
        TLS_SECRET_ANNOTATION.to_owned(),
        "rl-tls".to_owned(),
    )]));
    let d = desired(&job, &settings()).expect("valid");
    let pod = |deployment: &Deployment| {
        deployment
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.clone())
            .expect("a pod")
    };
    let items = |pod: &PodSpec| -> Vec<String> {
        pod.volumes
            .iter()
            .flatten()
            .filter(|v| v.name == "tls")
            .filter_map(|v| v.secret.as_ref())
            .inspect(|s| assert_eq!(s.secret_name.as_deref(), Some("rl-tls")))
            .flat_map(|s| s.items.clone().unwrap_or_default())
            .map(|item| item.key)
            .collect()
    };
    let scheduler = pod(&d.deployments[0]);
    assert_eq!(items(&scheduler), ["tls.crt", "tls.key"]);
    let args = scheduler.containers[0].args.clone().expect("args");
    let after = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .map(|i| args[i + 1].clone())
    };
    assert_eq!(
        after("--tls-cert").as_deref(),
        Some("/etc/rollfleet-tls/tls.crt")
    );
    assert_eq!(
        after("--tls-key").as_deref(),
        Some("/etc/rollfleet-tls/tls.key")
    );
    for deployment in &d.deployments[1..] {
        let worker = pod(deployment);
        // The private key never reaches a worker's pod.
        assert_eq!(items(&worker), ["ca.crt"]);
        let args = worker.containers[0].args.clone().expect("args");
        assert!(
            args.contains(&"https://quickstart-scheduler:7070".to_owned()),
            "{args:?}"
        );
        let ca = args
            .iter()
            .position(|a| a == "--tls-ca")
            .map(|i| &args[i + 1]);
        assert_eq!(ca.map(String::as_str), Some("/etc/rollfleet-tls/ca.crt"));
        let mounts = worker.containers[0]
            .volume_mounts
            .clone()
            .unwrap_or_default();
        assert!(
            mounts
                .iter()
                .any(|m| m.name == "tls" && m.read_only == Some(true))
        );
    }
    // Without the annotation: plain gRPC, no TLS volume.
    let plain = desired(&example("quickstart.yaml"), &settings()).expect("valid");
    for deployment in &plain.deployments {
        let pod = pod(deployment);
        assert!(items(&pod).is_empty());
        let args = pod.containers[0].args.clone().expect("args");
        assert!(!args.iter().any(|a| a.starts_with("--tls")), "{args:?}");
    }
}

#[test]
fn every_container_of_a_job_waits_at_its_end_to_be_scaled_down_rather_than_exiting() {
    let d = desired(&example("rollart-agentic.yaml"), &settings()).expect("valid");
    assert!(d.deployments.len() > 1, "a scheduler and worker pools");
    for deployment in &d.deployments {
        let pod = deployment
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .expect("a pod");
        for container in &pod.containers {
            let args = container.args.clone().expect("args");
            assert!(
                args.contains(&"--until-stopped".to_owned()),
                "{}: {args:?}",
                container.name
            );
        }
    }
}

#[test]
fn a_job_is_planned_again_only_when_its_job_file_changes() {
    let cache = PlanCache::default();
    let mut job = example("rollart-agentic.yaml");
    let fresh = desired(&job, &settings()).expect("valid");
    let objects = |d: &Desired| serde_json::to_string(&d.deployments).expect("json");
    let first = desired_with(&job, &settings(), &cache).expect("valid");
    let again = desired_with(&job, &settings(), &cache).expect("valid");
    assert_eq!(cache.plans_made(), 1);
    assert_eq!(objects(&first), objects(&fresh));
    assert_eq!(objects(&again), objects(&fresh));
    // An annotation is not part of the job file: the plan is kept, the objects follow it.
    job.metadata.annotations = Some(BTreeMap::from([(
        EMULATED_GPUS_ANNOTATION.to_owned(),
        "true".to_owned(),
    )]));
    let annotated = desired_with(&job, &settings(), &cache).expect("valid");
    assert_eq!(cache.plans_made(), 1);
    assert_eq!(
        objects(&annotated),
        objects(&desired(&job, &settings()).expect("valid"))
    );
    // A changed spec is planned again, once.
    job.spec["pools"][1]["count"] = 160.into();
    let smaller = desired_with(&job, &settings(), &cache).expect("valid");
    desired_with(&job, &settings(), &cache).expect("valid");
    assert_eq!(cache.plans_made(), 2);
    assert_ne!(objects(&smaller), objects(&fresh));
    // A job that is gone is forgotten: the same spec under it is planned again.
    cache.forget(&job);
    desired_with(&job, &settings(), &cache).expect("valid");
    assert_eq!(cache.plans_made(), 3);
}

#[test]
fn emulated_gpus_ask_the_cluster_for_none() {
    let mut job = example("quickstart.yaml");
    let plain = desired(&job, &settings()).expect("valid");
    assert_eq!(
        gpu_limit(named(&plain, "quickstart-decode")),
        Some("2".into())
    );
    job.metadata.annotations = Some(BTreeMap::from([(
        EMULATED_GPUS_ANNOTATION.to_owned(),
        "true".to_owned(),
    )]));
    let d = desired(&job, &settings()).expect("valid");
    assert_eq!(gpu_limit(named(&d, "quickstart-decode")), None);
    assert!(args(named(&d, "quickstart-decode")).ends_with(&["--gpus".into(), "2".into()]));
}

#[test]
fn the_specs_kubernetes_block_sets_engine_gpus_secrets_and_claim_and_wins_over_annotations() {
    let plain = example("quickstart.yaml");
    let mut job = plain.clone();
    job.spec["kubernetes"] = serde_json::json!({
        "engineUrl": "http://vllm:8000",
        "emulatedGpus": true,
        "tokenSecret": "rl-token",
        "tlsSecret": "rl-tls",
        "journalClaim": "rl-journals",
    });
    // The deprecated annotations are read only where the block says nothing.
    job.metadata.annotations = Some(BTreeMap::from([
        (TOKEN_SECRET_ANNOTATION.to_owned(), "old-token".to_owned()),
        (ENGINE_URL_ANNOTATION.to_owned(), "http://old:1".to_owned()),
    ]));
    let d = desired(&job, &settings()).expect("valid");
    let decode = named(&d, "quickstart-decode");
    assert!(args(decode).ends_with(&["--engine-url".into(), "http://vllm:8000".into()]));
    assert_eq!(gpu_limit(decode), None, "emulated GPUs ask for none");
    let pod = |deployment: &Deployment| {
        deployment
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.clone())
            .expect("a pod")
    };
    let scheduler = pod(&d.deployments[0]);
    assert_eq!(
        token_source(&scheduler.containers[0]),
        Some(("rl-token".to_owned(), TOKEN_SECRET_KEY.to_owned()))
    );
    let volume = |name: &str| {
        scheduler
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == name)
            .cloned()
            .expect("a volume")
    };
    assert_eq!(
        volume("tls").secret.and_then(|s| s.secret_name).as_deref(),
        Some("rl-tls")
    );
    assert_eq!(
        volume("journal")
            .persistent_volume_claim
            .map(|c| c.claim_name)
            .as_deref(),
        Some("rl-journals")
    );
    assert!(args(&d.deployments[0]).contains(&"--journal-sync".to_owned()));
    assert_eq!(token_secret(&job).as_deref(), Some("rl-token"));
    assert_eq!(tls_secret(&job).as_deref(), Some("rl-tls"));
    // The block is the object's, not the job's: the job file, so its hash and journal, stay.
    assert_eq!(
        job_file(&job).expect("a job file"),
        job_file(&plain).expect("a job file")
    );
}

#[test]
fn an_invalid_kubernetes_block_is_refused_with_its_field_path() {
    for (block, path) in [
        (
            serde_json::json!({"tokenSecret": "Not_A_Name"}),
            "spec.kubernetes.tokenSecret",
        ),
        (
            serde_json::json!({"engineUrl": "vllm:8000"}),
            "spec.kubernetes.engineUrl",
        ),
        (
            serde_json::json!({"tlsSecrets": "rl-tls"}),
            "spec.kubernetes",
        ),
        (
            serde_json::json!({"emulatedGpus": "yes"}),
            "spec.kubernetes.emulatedGpus",
        ),
    ] {
        let mut job = example("quickstart.yaml");
        job.spec["kubernetes"] = block.clone();
        let err = desired(&job, &settings()).map(|_| ()).unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with(path), "{block}: {text}");
    }
}

#[test]
fn an_invalid_spec_is_refused_with_its_field_path() {
    let mut job = example("quickstart.yaml");
    job.spec["pools"][0]["gpu"] = "NoSuchGpu".into();
    let err = desired(&job, &settings()).map(|_| ()).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("pools[0].gpu") && text.contains("NoSuchGpu"),
        "{text}"
    );
}

#[test]
fn names_are_valid_dns_labels_even_from_long_or_odd_parts() {
    assert_eq!(
        dns_name(&["Quick_Start", "env.nodes"]),
        "quick-start-env-nodes"
    );
    let long = "x".repeat(80);
    let a = dns_name(&[&long, "a"]);
    let b = dns_name(&[&long, "b"]);
    assert!(a.len() <= 63 && b.len() <= 63, "{a} {b}");
    assert_ne!(a, b);
    assert_eq!(dns_name(&["--"]), "rljob");
}

#[test]
fn the_scheduler_is_probed_through_its_grpc_health_service_or_its_port_when_it_serves_tls() {
    let container = |job: &RLJob| {
        desired(job, &settings()).expect("valid").deployments[0]
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .map(|p| p.containers[0].clone())
            .expect("a scheduler container")
    };
    let plain = container(&example("quickstart.yaml"));
    for probe in [
        &plain.startup_probe,
        &plain.readiness_probe,
        &plain.liveness_probe,
    ] {
        let probe = probe.as_ref().expect("a probe");
        assert_eq!(probe.grpc.as_ref().map(|g| g.port), Some(GRPC_PORT));
        assert!(probe.tcp_socket.is_none());
    }
    // The startup probe allows minutes (planning, a journal's replay); liveness does not.
    let budget = |p: &Option<Probe>| {
        p.as_ref()
            .map(|p| p.period_seconds.unwrap_or(10) * p.failure_threshold.unwrap_or(3))
            .unwrap_or_default()
    };
    assert!(budget(&plain.startup_probe) >= 300);
    assert!(budget(&plain.liveness_probe) <= 60);
    // Workers have none: the scheduler sees a lost worker through its lease.
    let d = desired(&example("quickstart.yaml"), &settings()).expect("valid");
    for worker in &d.deployments[1..] {
        let pod = worker.spec.as_ref().and_then(|s| s.template.spec.as_ref());
        assert!(pod.is_some_and(|p| p.containers[0].liveness_probe.is_none()));
    }
    // A kubelet's gRPC probe cannot speak TLS: a TLS scheduler's port is probed instead.
    let mut job = example("quickstart.yaml");
    job.spec["kubernetes"] = serde_json::json!({"tlsSecret": "rl-tls"});
    let tls = container(&job);
    let probe = tls.readiness_probe.expect("a probe");
    assert!(probe.grpc.is_none());
    assert_eq!(
        probe.tcp_socket.map(|t| t.port),
        Some(IntOrString::Int(GRPC_PORT))
    );
}
