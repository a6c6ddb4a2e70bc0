//! The operator's objects, run. Every container the operator would have Kubernetes start for an
//! RLJob is started here as a real `rollfleet` process, as a kubelet would start it: the
//! ConfigMap mounted as a file where the scheduler reads it, the scheduler's Service name
//! resolving to its loopback address, each Deployment's pods as many processes, and the token
//! the RLJob's `rollfleet.dev/token-secret` names set in each one's environment. The job they
//! make must succeed: so the commands, flags and worker counts the operator writes are the ones
//! the binaries take.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rollfleet_operator::crd::RLJob;
use rollfleet_operator::desired::{
    EMULATED_GPUS_ANNOTATION, Settings, TLS_SECRET_ANNOTATION, TOKEN_SECRET_ANNOTATION, desired,
};
use rollfleet_operator::k8s_openapi::api::apps::v1::Deployment;
use rollfleet_operator::k8s_openapi::api::core::v1::Container;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_rollfleet");

#[path = "common/procs.rs"]
mod procs;
use procs::{Procs, wait_exit};
#[path = "common/refused.rs"]
mod refused;
#[path = "common/tls.rs"]
mod tls;
use refused::assert_job_status_refused_without_token;

fn container(d: &Deployment) -> Container {
    d.spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0]
        .clone()
}

/// The Secret the test's namespace holds: its name, key and value.
const SECRET: (&str, &str, &str) = ("rl-token", "token", "namespace-secret-0123456789");

/// A pod's process: the container's command and arguments, with `rewrite` applied to each
/// argument (what the cluster would resolve differently from this machine), and its environment
/// as a kubelet would set it (only [`SECRET`] exists to take values from).
fn start(c: &Container, rewrite: impl Fn(&str) -> String, extra: &[&str], stdout: Stdio) -> Child {
    let command = c.command.clone().unwrap();
    assert_eq!(command, ["rollfleet"], "the image's binary");
    let args: Vec<String> = c.args.clone().unwrap().iter().map(|a| rewrite(a)).collect();
    let mut process = Command::new(BIN);
    process
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default());
    for var in c.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (Some(value), None) => value.clone(),
            (None, Some(from)) => {
                let key = from
                    .secret_key_ref
                    .as_ref()
                    .expect("only Secret references");
                assert_eq!((key.name.as_str(), key.key.as_str()), (SECRET.0, SECRET.1));
                SECRET.2.to_owned()
            }
            other => panic!("{}: {other:?}", var.name),
        };
        process.env(&var.name, value);
    }
    process
        .args(&args)
        .args(extra)
        .stdout(stdout)
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// `rollfleet job status -o json` against the scheduler at `url`, with the namespace's token,
/// as the operator asks it; `None` while it does not answer.
fn job_status(url: &str, ca: Option<&Path>) -> Option<Value> {
    let mut command = Command::new(BIN);
    command
        .args([
            "job",
            "status",
            "quickstart",
            "--scheduler",
            url,
            "-o",
            "json",
        ])
        .env("ROLLFLEET_TOKEN", SECRET.2);
    if let Some(ca) = ca {
        command.arg("--tls-ca").arg(ca);
    }
    let out = command.output().unwrap();
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).unwrap())
}

/// Polls [`job_status`] until the phase is `phase`.
fn wait_phase(url: &str, ca: Option<&Path>, phase: &str) -> Value {
    let start = std::time::Instant::now();
    loop {
        if let Some(status) = job_status(url, ca)
            && status["phase"] == phase
        {
            return status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(240),
            "the scheduler at {url} never said {phase}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// SIGTERM, as the kubelet stops a container when its Deployment is scaled down.
fn terminate(child: &Child) {
    let sent = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
}

/// Reads the `listening on ADDR` line of a scheduler started with its stdout piped.
fn listening(scheduler: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(scheduler.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.trim().strip_prefix("listening on ").unwrap();
    format!("http://{addr}")
}

#[test]
fn the_scheduler_and_workers_the_operator_creates_run_the_quickstart_and_wait_at_its_end_to_be_scaled_down()
 {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let text = std::fs::read_to_string(root.join("examples/jobs/quickstart.yaml")).unwrap();
    let mut job: RLJob = serde_yaml_ng::from_str(&text).unwrap();
    job.spec["rl"]["steps"] = 2.into();
    job.metadata.namespace = Some("rl".into());
    job.metadata.uid = Some("uid-1".into());
    // No GPUs on this machine: the workers emulate them, as on a cluster without any. The
    // scheduler requires the token of the namespace's Secret.
    job.metadata.annotations = Some(BTreeMap::from([
        (EMULATED_GPUS_ANNOTATION.to_owned(), "true".to_owned()),
        (TOKEN_SECRET_ANNOTATION.to_owned(), SECRET.0.to_owned()),
    ]));
    let wanted = desired(
        &job,
        &Settings {
            image: "rollfleet:test".into(),
        },
    )
    .unwrap();

    let dir = std::env::temp_dir().join(format!("rollfleet-operator-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // The ConfigMap's volume.
    let job_file = dir.join("job.yaml");
    std::fs::write(
        &job_file,
        &wanted.config_map.data.as_ref().unwrap()["job.yaml"],
    )
    .unwrap();
    let report = dir.join("report.json");

    let scheduler_container = container(&wanted.deployments[0]);
    // The pod's volumes: the ConfigMap's file, and the emptyDir the journal is on.
    let volumes = |arg: &str| match arg {
        "/etc/rollfleet/job.yaml" => job_file.display().to_string(),
        "0.0.0.0:7070" | "0.0.0.0:9464" => "127.0.0.1:0".into(),
        other => match other.strip_prefix("/var/lib/rollfleet/") {
            Some(file) => dir.join(file).display().to_string(),
            None => other.into(),
        },
    };
    let mut scheduler = start(
        &scheduler_container,
        volumes,
        // What a pod would not keep: the final report, to check every trajectory was trained once.
        &["--report", report.to_str().unwrap()],
        Stdio::piped(),
    );
    let url = listening(&mut scheduler);
    let mut procs = Procs(vec![scheduler]);
    // The scheduler took the Secret's token: a call without it is refused.
    assert_job_status_refused_without_token(BIN, &url);
    let mut pods = 0;
    for deployment in &wanted.deployments[1..] {
        let replicas = deployment.spec.as_ref().unwrap().replicas.unwrap();
        let c = container(deployment);
        for _ in 0..replicas {
            let url = url.clone();
            procs.0.push(start(
                &c,
                |arg| {
                    if arg == "http://quickstart-scheduler:7070" {
                        url.clone()
                    } else {
                        arg.into()
                    }
                },
                &[],
                Stdio::null(),
            ));
            pods += 1;
        }
    }
    assert_eq!(pods, wanted.workers);

    // At the job's end every pod stays, and the scheduler keeps saying how the job ended, for
    // the operator to read and scale the Deployments down (exiting, they would be restarted).
    let ended = wait_phase(&url, None, "Succeeded");
    assert_eq!(ended["rl_step"], 2, "{ended:#}");
    std::thread::sleep(Duration::from_secs(1));
    for process in &mut procs.0 {
        assert!(
            process.try_wait().unwrap().is_none(),
            "a pod's process exited at the job's end"
        );
    }
    assert_eq!(
        job_status(&url, None).expect("still answering")["phase"],
        "Succeeded"
    );
    // Scaled down: SIGTERM to every pod. Each exits, the scheduler with the job's success.
    for process in &procs.0 {
        terminate(process);
    }
    for process in &mut procs.0 {
        let exit = wait_exit(process, Duration::from_secs(60));
        assert!(exit.success(), "{exit:?}");
    }
    let report: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(report["phase"], "Succeeded", "{report:#}");
    assert_eq!(report["policy_version"], 2);
    let trained = report["trained"].as_array().unwrap();
    assert_eq!(trained.len(), 2 * 32);
    assert!(report["trained_twice"].as_array().unwrap().is_empty());

    // Had the scheduler's container died after the end instead (a crash, an OOM kill), the
    // kubelet would start it again in the same pod, on the same emptyDir. It finds the ended job
    // in its journal and says so, without running the job a second time, until stopped.
    let journals: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "journal"))
        .collect();
    assert_eq!(
        journals.len(),
        1,
        "one journal, on the emptyDir: {journals:?}"
    );
    let again = dir.join("report-again.json");
    let mut restarted = start(
        &scheduler_container,
        volumes,
        &["--report", again.to_str().unwrap()],
        Stdio::piped(),
    );
    let url = listening(&mut restarted);
    procs.0.push(restarted);
    let said = wait_phase(&url, None, "Succeeded");
    assert_eq!(said["rl_step"], 2, "{said:#}");
    terminate(procs.0.last().unwrap());
    let exit = wait_exit(procs.0.last_mut().unwrap(), Duration::from_secs(60));
    assert!(exit.success(), "{exit:?}");
    let again: Value = serde_json::from_slice(&std::fs::read(&again).unwrap()).unwrap();
    assert_eq!(again["phase"], "Succeeded");
    assert_eq!(again["trained"], report["trained"], "nothing trained again");
}

#[test]
fn the_pods_of_an_rljob_with_a_tls_secret_serve_and_call_the_scheduler_over_tls() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let text = std::fs::read_to_string(root.join("examples/jobs/quickstart.yaml")).unwrap();
    let mut job: RLJob = serde_yaml_ng::from_str(&text).unwrap();
    job.spec["rl"]["steps"] = 1.into();
    job.metadata.namespace = Some("rl".into());
    job.metadata.uid = Some("uid-2".into());
    job.metadata.annotations = Some(BTreeMap::from([
        (EMULATED_GPUS_ANNOTATION.to_owned(), "true".to_owned()),
        (TLS_SECRET_ANNOTATION.to_owned(), "rl-tls".to_owned()),
    ]));
    let wanted = desired(
        &job,
        &Settings {
            image: "rollfleet:test".into(),
        },
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("rollfleet-operator-tls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let job_file = dir.join("job.yaml");
    std::fs::write(
        &job_file,
        &wanted.config_map.data.as_ref().unwrap()["job.yaml"],
    )
    .unwrap();
    // The Secret's files, as its volume would hold them.
    let (ca, cert, key) = tls::tls_files(&dir, "rl-tls");
    let secret_file = |arg: &str| match arg {
        "/etc/rollfleet-tls/tls.crt" => Some(cert.display().to_string()),
        "/etc/rollfleet-tls/tls.key" => Some(key.display().to_string()),
        "/etc/rollfleet-tls/ca.crt" => Some(ca.display().to_string()),
        _ => None,
    };
    let report = dir.join("report.json");
    let mut scheduler = start(
        &container(&wanted.deployments[0]),
        |arg| {
            secret_file(arg).unwrap_or_else(|| match arg {
                "/etc/rollfleet/job.yaml" => job_file.display().to_string(),
                "0.0.0.0:7070" | "0.0.0.0:9464" => "127.0.0.1:0".into(),
                other => match other.strip_prefix("/var/lib/rollfleet/") {
                    Some(file) => dir.join(file).display().to_string(),
                    None => other.into(),
                },
            })
        },
        &["--report", report.to_str().unwrap()],
        Stdio::piped(),
    );
    // The certificate names 127.0.0.1, where the Service's name would resolve.
    let url = listening(&mut scheduler).replace("http://", "https://");
    let mut procs = Procs(vec![scheduler]);
    for deployment in &wanted.deployments[1..] {
        let c = container(deployment);
        for _ in 0..deployment.spec.as_ref().unwrap().replicas.unwrap() {
            let url = url.clone();
            procs.0.push(start(
                &c,
                |arg| {
                    secret_file(arg).unwrap_or_else(|| {
                        if arg == "https://quickstart-scheduler:7070" {
                            url.clone()
                        } else {
                            arg.into()
                        }
                    })
                },
                &[],
                Stdio::null(),
            ));
        }
    }
    let ended = wait_phase(&url, Some(&ca), "Succeeded");
    assert_eq!(ended["rl_step"], 1, "{ended:#}");
    for process in &procs.0 {
        terminate(process);
    }
    for process in &mut procs.0 {
        let exit = wait_exit(process, Duration::from_secs(60));
        assert!(exit.success(), "{exit:?}");
    }
    let report: Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(report["trained"].as_array().unwrap().len(), 32);
}
