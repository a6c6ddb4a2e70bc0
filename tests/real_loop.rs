//! The real RL loop across processes on loopback: a `rollfleet scheduler`, `rollfleet worker`s
//! driving fake SGLang engines token-in, token-out (`tests/fakes/sglang_server.py`, one per
//! replica, following SGLang's native HTTP API), and an external trainer (`rollfleet train`)
//! that reads the feed and publishes every version as a checkpoint file; the same with the
//! scheduler SIGKILLed mid-run and restarted on its journal, with engines that fail or fake
//! their weight updates, and with partial rollout (generations interrupted by their replica's
//! update and resumed, on the fake engines and on the emulated one). Also the trainer
//! protocol's refusals, driven by a trainer written here.
//!
//! Needs `python3` (the fakes use its standard library only). Every wait is bounded.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_rollfleet");
const DEADLINE: Duration = Duration::from_secs(240);
const JOB: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../examples/jobs/quickstart-external.yaml"
);
const FAKES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fakes");

#[path = "common/procs.rs"]
mod procs;
use procs::{Procs, wait_exit};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rollfleet-loop-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Starts a fake engine (`sglang_server.py` or `vllm_server.py`, with `flags`) logging to
/// `NAME.log`; its URL.
fn fake_engine(procs: &mut Procs, script: &str, dir: &Path, name: &str, flags: &[&str]) -> String {
    let port_file = dir.join(format!("{name}.port"));
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    procs.0.push(
        Command::new("python3")
            .arg(Path::new(FAKES).join(script))
            .args(flags)
            .arg("--port-file")
            .arg(&port_file)
            .stdout(log)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let start = Instant::now();
    loop {
        if let Ok(port) = std::fs::read_to_string(&port_file)
            && !port.trim().is_empty()
        {
            return format!("http://127.0.0.1:{}", port.trim());
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{name} never started"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A scheduler of `job` on a free port, its emulated hardware at `time_scale`; its URL.
fn scheduler(
    procs: &mut Procs,
    dir: &Path,
    job: &Path,
    time_scale: &str,
    extra: &[&str],
) -> String {
    let mut command = Command::new(BIN);
    command.arg("scheduler").arg(job);
    if !extra.contains(&"--listen") {
        command.args(["--listen", "127.0.0.1:0"]);
    }
    let mut child = command
        .args(["--time-scale", time_scale])
        .args(["--expect-workers", "5", "--report"])
        .arg(dir.join("report.json"))
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join("scheduler.log")).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    procs.0.push(child);
    format!(
        "http://{}",
        line.trim().strip_prefix("listening on ").unwrap()
    )
}

fn worker(procs: &mut Procs, url: &str, pool: &str, engine: &[String]) {
    procs.0.push(
        Command::new(BIN)
            .args(["worker", "--scheduler", url, "--pool", pool])
            .args(engine)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
}

/// What a fake engine logged, one JSON object a line.
fn engine_log(dir: &Path, name: &str) -> Vec<Value> {
    std::fs::read_to_string(dir.join(format!("{name}.log")))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Log-probabilities at the precision the feed carries them (`float`): an engine's JSON number
/// and the trained turn's are then equal bit for bit. (Rounding to a few decimals instead is
/// not a comparison: a value near a rounding boundary lands on either side after the cast.)
fn as_f32_bits(logprobs: &[Value]) -> Vec<u32> {
    logprobs
        .iter()
        .map(|l| (l.as_f64().unwrap() as f32).to_bits())
        .collect()
}

/// The quick-start job with an external trainer on fake SGLang engines: one engine per replica
/// of the GPU pools (the two decode engines started with `decode_flags`), a chat tokenizer for
/// the model (SGLang's own /tokenize takes text only), the scheduler (journaled) and a worker
/// per pool. The scheduler's URL.
fn sglang_job(procs: &mut Procs, dir: &Path, job: &Path, decode_flags: [&[&str]; 2]) -> String {
    let prefill = fake_engine(procs, "sglang_server.py", dir, "prefill-0", &[]);
    let decode: Vec<String> = (0..2)
        .map(|i| {
            let name = format!("decode-{i}");
            fake_engine(procs, "sglang_server.py", dir, &name, decode_flags[i])
        })
        .collect();
    let tokenizer = fake_engine(procs, "vllm_server.py", dir, "tokenizer", &[]);
    let journal = dir.join("journal.bin").display().to_string();
    let url = scheduler(procs, dir, job, "1", &["--journal", &journal]);
    let engine_flags = |urls: &[String]| {
        let mut flags = vec!["--engine".to_owned(), "sglang".to_owned()];
        for u in urls {
            flags.extend(["--engine-url".to_owned(), u.clone()]);
        }
        flags.extend(["--chat-tokenizer-url".to_owned(), tokenizer.clone()]);
        flags
    };
    worker(procs, &url, "prefill", &engine_flags(&[prefill]));
    worker(procs, &url, "decode", &engine_flags(&decode));
    for pool in ["train", "envs", "rewards"] {
        worker(procs, &url, pool, &[]);
    }
    url
}

/// Runs `rollfleet train` (with `extra` flags) on the job at `url` to its end; its report.
fn train_to_the_end(url: &str, dir: &Path, job: &Path, extra: &[&str]) -> Value {
    let trainer_report = dir.join("trainer.json");
    let mut trainer = Command::new(BIN)
        .arg("train")
        .arg(job)
        .args(["--scheduler", url, "--step-ms", "100", "--record-tokens"])
        .args(extra)
        .arg("--checkpoints")
        .arg(dir.join("ckpt"))
        .arg("--report")
        .arg(&trainer_report)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let status = wait_exit(&mut trainer, DEADLINE);
    assert!(status.success(), "the trainer failed: {status}");
    serde_json::from_slice(&std::fs::read(&trainer_report).unwrap()).unwrap()
}

/// The path of a generation in the fakes' logs: SGLang's native one, vLLM's completions.
const SGLANG_GENERATE: &str = "/generate";
const VLLM_GENERATE: &str = "/v1/completions";

/// What each engine answered on `path`: `(version, output ids, log-probabilities as `f32`)` of
/// every generation it completed (not those it refused or that were aborted).
fn generations(
    logs: &BTreeMap<String, Vec<Value>>,
    path: &str,
) -> BTreeSet<(u64, Vec<u32>, Vec<u32>)> {
    logs.values()
        .flatten()
        .filter(|e| e["path"] == path && e["output_ids"].is_array())
        .map(|e| {
            (
                e["version"].as_str().unwrap().parse::<u64>().unwrap(),
                serde_json::from_value::<Vec<u32>>(e["output_ids"].clone()).unwrap(),
                as_f32_bits(e["logprobs"].as_array().unwrap()),
            )
        })
        .collect()
}

/// Asserts that every trained turn is exactly what an engine generated under the version it
/// is stamped with: same ids, same log-probabilities.
fn assert_turns_are_engine_output(
    trained: &Value,
    logs: &BTreeMap<String, Vec<Value>>,
    path: &str,
) {
    let generated = generations(logs, path);
    let turns = trained["turns"].as_array().unwrap();
    assert!(turns.len() >= 160, "{} turns", turns.len());
    for turn in turns {
        let versions = turn["versions"].as_array().unwrap();
        assert_eq!(versions.len(), 1, "{turn}");
        let key = (
            versions[0].as_u64().unwrap(),
            serde_json::from_value::<Vec<u32>>(turn["action_tokens"].clone()).unwrap(),
            as_f32_bits(turn["logprobs"].as_array().unwrap()),
        );
        assert!(
            generated.contains(&key),
            "turn {turn} is not what an engine generated under its version"
        );
    }
}

/// The logs of the engines of [`sglang_job`], by name.
fn sglang_job_logs(dir: &Path) -> BTreeMap<String, Vec<Value>> {
    ["prefill-0", "decode-0", "decode-1"]
        .into_iter()
        .map(|n| (n.to_owned(), engine_log(dir, n)))
        .collect()
}

/// The weight versions an engine's log says it loaded, in order.
fn loaded_versions(log: &[Value]) -> Vec<u64> {
    log.iter()
        .filter(|e| e["path"] == "/update_weights_from_disk" && e["success"] == true)
        .map(|e| e["requested_version"].as_str().unwrap().parse().unwrap())
        .collect()
}

/// The weight versions an engine generated under.
fn served_versions(log: &[Value]) -> BTreeSet<u64> {
    log.iter()
        .filter(|e| e["path"] == "/generate")
        .map(|e| e["version"].as_str().unwrap().parse().unwrap())
        .collect()
}

#[test]
fn an_external_trainer_drives_real_engines_replica_by_replica_and_trains_their_exact_tokens() {
    let dir = temp_dir("sglang");
    let mut procs = Procs(Vec::new());
    // Loading takes the decode engines a while, so that two loads at once would show.
    let slow: &[&str] = &["--slow-update-ms", "150"];
    let url = sglang_job(&mut procs, &dir, Path::new(JOB), [slow, slow]);
    let trained = train_to_the_end(&url, &dir, Path::new(JOB), &[]);
    assert_eq!(trained["version"], 5);
    assert_eq!(trained["trajectories"].as_array().unwrap().len(), 160);
    assert_eq!(trained["stale"], serde_json::json!([]));
    assert_eq!(trained["malformed"], serde_json::json!([]));
    assert_eq!(trained["emulated_turns"], 0);
    assert!(trained["engine_turns"].as_u64().unwrap() >= 160);

    let logs = sglang_job_logs(&dir);
    assert_turns_are_engine_output(&trained, &logs, SGLANG_GENERATE);

    // Each replica's engine was loaded by its own weight syncs, version after version in order,
    // and generated only under versions it had loaded.
    for (name, log) in &logs {
        let loaded = loaded_versions(log);
        let served = served_versions(log);
        if served.is_empty() {
            continue;
        }
        assert!(
            loaded.windows(2).all(|w| w[0] < w[1]),
            "{name} loaded versions out of order: {loaded:?}"
        );
        assert!(
            served.iter().all(|v| *v == 0 || loaded.contains(v)),
            "{name} generated under versions {served:?} it never loaded ({loaded:?})"
        );
    }
    // Replica by replica: both decode engines took new versions as they came (one may skip a
    // version published while it waited for the other; the job may end before the last reaches
    // them all), and never loaded at the same time.
    let intervals = |name: &str| -> Vec<(f64, f64)> {
        logs[name]
            .iter()
            .filter(|e| e["path"] == "/update_weights_from_disk")
            .map(|e| {
                (
                    e["started"].as_f64().unwrap(),
                    e["finished"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    for name in ["decode-0", "decode-1"] {
        let loaded = loaded_versions(&logs[name]);
        assert!(
            loaded.len() >= 2 && loaded.last() >= Some(&4),
            "{name} loaded {loaded:?}"
        );
    }
    for (a_start, a_end) in intervals("decode-0") {
        for (b_start, b_end) in intervals("decode-1") {
            assert!(
                a_end <= b_start || b_end <= a_start,
                "both decode replicas were loading at once: [{a_start}, {a_end}] and \
                 [{b_start}, {b_end}]"
            );
        }
    }
    let report: Value =
        serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["phase"], "Succeeded");
    assert_eq!(report["policy_version"], 5);
    assert_eq!(report["trained_twice"], serde_json::json!([]));
    assert!(report["engine_generations"].as_u64().unwrap() >= 160);
    // The journal replays the publications to the same end.
    let shown = Command::new(BIN)
        .args(["journal", "show", "-o", "json"])
        .arg(dir.join("journal.bin"))
        .output()
        .unwrap();
    let shown: Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(shown["report"]["policy_version"], 5, "{shown}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_external_trainer_drives_vllm_engines_replica_by_replica_and_trains_their_exact_tokens() {
    let dir = temp_dir("vllm");
    let mut procs = Procs(Vec::new());
    let names = ["prefill-0", "decode-0", "decode-1"];
    let urls: Vec<String> = names
        .iter()
        .map(|n| fake_engine(&mut procs, "vllm_server.py", &dir, n, &[]))
        .collect();
    let url = scheduler(&mut procs, &dir, Path::new(JOB), "1", &[]);
    // vLLM's own /tokenize applies the model's chat template: no separate tokenizer.
    let engine_flags = |urls: &[String]| {
        let mut flags = vec!["--engine".to_owned(), "vllm".to_owned()];
        for u in urls {
            flags.extend(["--engine-url".to_owned(), u.clone()]);
        }
        flags
    };
    worker(&mut procs, &url, "prefill", &engine_flags(&urls[..1]));
    worker(&mut procs, &url, "decode", &engine_flags(&urls[1..]));
    for pool in ["train", "envs", "rewards"] {
        worker(&mut procs, &url, pool, &[]);
    }
    // vLLM's shared-disk weight transfer loads a directory of safetensors files.
    let trained = train_to_the_end(
        &url,
        &dir,
        Path::new(JOB),
        &["--checkpoint-layout", "safetensors-dir"],
    );
    assert_eq!(trained["version"], 5);
    assert_eq!(trained["trajectories"].as_array().unwrap().len(), 160);
    assert_eq!(trained["stale"], serde_json::json!([]));
    assert_eq!(trained["malformed"], serde_json::json!([]));
    assert_eq!(trained["emulated_turns"], 0);

    let logs: BTreeMap<String, Vec<Value>> = names
        .iter()
        .map(|n| ((*n).to_owned(), engine_log(&dir, n)))
        .collect();
    assert_turns_are_engine_output(&trained, &logs, VLLM_GENERATE);
    // Both decode engines took new versions through vLLM's weight-transfer calls, in order.
    for name in ["decode-0", "decode-1"] {
        let loaded: Vec<u64> = logs[name]
            .iter()
            .filter(|e| e["path"] == "/finish_weight_update" && e["requested_version"].is_string())
            .map(|e| e["requested_version"].as_str().unwrap().parse().unwrap())
            .collect();
        assert!(
            loaded.len() >= 2 && loaded.windows(2).all(|w| w[0] < w[1]),
            "{name} loaded {loaded:?}"
        );
    }
    let report: Value =
        serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["phase"], "Succeeded");
    assert_eq!(report["trained_twice"], serde_json::json!([]));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_replica_whose_engine_fails_or_fakes_a_weight_update_leaves_service_and_is_retried_while_the_other_generates()
 {
    let dir = temp_dir("failing-updates");
    let mut procs = Procs(Vec::new());
    // decode-0 refuses its first two updates; decode-1 says every update succeeded but goes on
    // serving its first weights.
    let url = sglang_job(
        &mut procs,
        &dir,
        Path::new(JOB),
        [&["--fail-updates", "2"], &["--keep-old-weights"]],
    );
    let trained = train_to_the_end(&url, &dir, Path::new(JOB), &[]);
    assert_eq!(trained["version"], 5);
    assert_eq!(trained["trajectories"].as_array().unwrap().len(), 160);
    assert_eq!(trained["stale"], serde_json::json!([]));
    let report: Value =
        serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["phase"], "Succeeded");
    assert_eq!(report["trained_twice"], serde_json::json!([]));

    let logs = sglang_job_logs(&dir);
    // Nothing trained came from weights an engine only claimed to load.
    assert_turns_are_engine_output(&trained, &logs, SGLANG_GENERATE);
    let faking = &logs["decode-1"];
    let faked_versions = served_versions(faking);
    assert!(
        faked_versions.iter().all(|v| *v == 0),
        "the engine that kept its old weights generated under versions {faked_versions:?}"
    );

    // The refusing engine was retried and, once it loaded, served again.
    let refusing = &logs["decode-0"];
    let attempts: Vec<bool> = refusing
        .iter()
        .filter(|e| e["path"] == "/update_weights_from_disk")
        .map(|e| e["success"] == true)
        .collect();
    assert!(
        attempts.len() >= 3 && !attempts[0] && !attempts[1] && attempts[2],
        "decode-0's updates: {attempts:?}"
    );
    let loaded = loaded_versions(refusing);
    assert!(
        served_versions(refusing)
            .iter()
            .any(|v| *v > 0 && loaded.contains(v)),
        "decode-0 never generated again after its retried update: loaded {loaded:?}"
    );

    // The engine that keeps old weights is retried at a backing-off pace, not in a loop: one
    // attempt after 1 s, 2 s, 4 s, ... out of service.
    let faked = faking
        .iter()
        .filter(|e| e["path"] == "/update_weights_from_disk")
        .count();
    let log = std::fs::read_to_string(dir.join("scheduler.log")).unwrap();
    let failures = log
        .lines()
        .filter(|l| l.contains("failed to load version"))
        .count();
    assert!(faked >= 2, "decode-1 was never retried ({faked} updates)");
    assert_eq!(
        failures,
        faked + 2,
        "every failed update is said once in the scheduler's log:\n{log}"
    );
    assert!(
        faked <= 8,
        "decode-1 was updated {faked} times: the retries do not back off"
    );
    assert!(
        log.contains("after 2 failed update(s); back in service"),
        "{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// One answer an engine logged: its version, input, output ids, log-probabilities (as `f32`) and
/// whether it was aborted.
struct Answer {
    version: u64,
    input: Vec<u32>,
    output: Vec<u32>,
    logprobs: Vec<u32>,
    aborted: bool,
}

/// The versions of engine answers that make up `action` from token `at` on: each answer's ids
/// and log-probabilities are the next ones, its input ends with the tokens before it, and every
/// answer but the last was aborted. `None` when no such answers exist.
fn explain(answers: &[Answer], action: &[u32], logprobs: &[u32], at: usize) -> Option<Vec<u64>> {
    if at == action.len() {
        return Some(Vec::new());
    }
    for a in answers {
        let end = at + a.output.len();
        let fits = !a.output.is_empty()
            && action[at..].starts_with(&a.output)
            && a.logprobs[..] == logprobs[at..end]
            && a.input.ends_with(&action[..at])
            && (end == action.len()) != a.aborted;
        if !fits {
            continue;
        }
        if let Some(mut rest) = explain(answers, action, logprobs, end) {
            rest.insert(0, a.version);
            return Some(rest);
        }
    }
    None
}

#[test]
fn with_interrupts_a_turn_cut_by_its_replicas_update_resumes_from_the_engines_tokens_under_the_new_version()
 {
    let dir = temp_dir("interrupts");
    let mut procs = Procs(Vec::new());
    let job = dir.join("job.yaml");
    let spec = std::fs::read_to_string(JOB).unwrap().replace(
        "    trainer: external",
        "    trainer: external\n    interruptGeneration: true",
    );
    assert!(spec.contains("interruptGeneration"));
    std::fs::write(&job, spec).unwrap();
    // Decoding takes the engines long enough (4 ms a token, answers of up to 256) that a weight
    // update often finds a generation running.
    let slow: &[&str] = &["--token-delay-ms", "4", "--slow-update-ms", "50"];
    let url = sglang_job(&mut procs, &dir, &job, [slow, slow]);
    let trained = train_to_the_end(&url, &dir, &job, &[]);
    assert_eq!(trained["version"], 5);
    assert_eq!(trained["trajectories"].as_array().unwrap().len(), 160);
    assert_eq!(trained["stale"], serde_json::json!([]));
    assert_eq!(trained["malformed"], serde_json::json!([]));
    let report: Value =
        serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["phase"], "Succeeded");
    assert_eq!(report["trained_twice"], serde_json::json!([]));
    assert!(
        report["interrupted_generations"].as_u64().unwrap() > 0,
        "no generation was interrupted: {report}"
    );

    // Every trained turn is made of engine answers: each aborted but the last, each given the
    // tokens before it as the end of its input (it went on where the last stopped), and the
    // turn's segments are the versions of those answers, in order.
    let logs = sglang_job_logs(&dir);
    let ids = |v: &Value| serde_json::from_value::<Vec<u32>>(v.clone()).unwrap();
    let answered: Vec<Answer> = logs
        .values()
        .flatten()
        .filter(|e| e["path"] == "/generate" && e["output_ids"].is_array())
        .map(|e| Answer {
            version: e["version"].as_str().unwrap().parse().unwrap(),
            input: ids(&e["input_ids"]),
            output: ids(&e["output_ids"]),
            logprobs: as_f32_bits(e["logprobs"].as_array().unwrap()),
            aborted: e["finish_reason"]["type"] == "abort",
        })
        .collect();
    let mut resumed = 0;
    let mut across_versions = 0;
    for turn in trained["turns"].as_array().unwrap() {
        let versions: Vec<u64> = serde_json::from_value(turn["versions"].clone()).unwrap();
        let action = ids(&turn["action_tokens"]);
        let logprobs = as_f32_bits(turn["logprobs"].as_array().unwrap());
        // Answers that explain the action from token `at` on (answers with the same context and
        // seed share a prefix, so the first that fits is not always the one: search them all).
        let Some(pieces) = explain(&answered, &action, &logprobs, 0) else {
            panic!("{turn} is not made of engine answers")
        };
        let mut runs: Vec<u64> = Vec::new();
        for version in &pieces {
            if runs.last() != Some(version) {
                runs.push(*version);
            }
        }
        let answers = pieces.len();
        assert_eq!(runs, versions, "{turn}");
        assert!(
            versions.windows(2).all(|w| w[0] < w[1]),
            "segments not in version order: {turn}"
        );
        resumed += usize::from(answers > 1);
        across_versions += usize::from(versions.len() > 1);
    }
    assert!(
        resumed > 0 && across_versions > 0,
        "{resumed} trained turns were resumed after an interrupt, {across_versions} of them on \
         newer weights"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_emulated_engine_interrupts_and_resumes_generations_too_and_every_trajectory_is_trained_once()
{
    let dir = temp_dir("emulated-interrupts");
    let job = dir.join("job.yaml");
    let quickstart = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/jobs/quickstart.yaml"
    );
    let spec = std::fs::read_to_string(quickstart)
        .unwrap()
        .replace("\n  rl:\n", "\n  rl:\n    interruptGeneration: true\n");
    assert!(spec.contains("interruptGeneration"));
    std::fs::write(&job, spec).unwrap();
    let out = Command::new(BIN)
        .arg("run")
        .arg(&job)
        .args(["-o", "json"])
        .stderr(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["phase"], "Succeeded");
    assert_eq!(report["policy_version"], 5);
    assert_eq!(report["trained"].as_array().unwrap().len(), 160);
    assert_eq!(report["trained_twice"], serde_json::json!([]));
    assert!(
        report["interrupted_generations"].as_u64().unwrap() > 0,
        "{report}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_cancelled_job_ends_its_trainer_feed_with_the_reason_not_as_a_scheduler_going_away() {
    let dir = temp_dir("cancelled-feed");
    let mut procs = Procs(Vec::new());
    let url = scheduler(&mut procs, &dir, Path::new(JOB), "1", &[]);
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        worker(&mut procs, &url, pool, &[]);
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (_tx, mut feed) = subscribe(&url, "quickstart-external").await;
        let cancelled = Command::new(BIN)
            .args(["job", "cancel", "quickstart-external", "--scheduler", &url])
            .args(["-o", "json"])
            .output()
            .unwrap();
        assert!(cancelled.status.success(), "{cancelled:?}");
        // The answer is the status after the cancel, not before it.
        let status: Value = serde_json::from_slice(&cancelled.stdout).unwrap();
        assert_eq!(status["phase"], "Cancelled", "{status}");
        let end = tokio::time::timeout(DEADLINE, async {
            loop {
                match feed.message().await {
                    Ok(Some(_)) => continue,
                    other => return other,
                }
            }
        })
        .await
        .expect("the feed never ended");
        let Err(status) = end else {
            panic!("the feed ended as if the scheduler went away: {end:?}")
        };
        assert_eq!(status.code(), tonic::Code::Aborted, "{status:?}");
        assert!(status.message().contains("Cancelled"), "{status:?}");
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// What `rollfleet job status` prints.
fn job_status(url: &str) -> String {
    let out = Command::new(BIN)
        .args(["job", "status", "quickstart-external", "--scheduler", url])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A trainer written here: subscribes to the feed; its sender and stream.
async fn subscribe(
    url: &str,
    job: &str,
) -> (
    tokio::sync::mpsc::UnboundedSender<rollfleet_proto::v1::TrainerFeedRequest>,
    tonic::Streaming<rollfleet_proto::v1::TrainerFeedItem>,
) {
    use rollfleet_proto::v1::trainer_feed_client::TrainerFeedClient;
    use rollfleet_proto::v1::{FeedSubscribe, TrainerFeedRequest, trainer_feed_request};
    let mut client = TrainerFeedClient::connect(url.to_owned()).await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(TrainerFeedRequest {
        message: Some(trainer_feed_request::Message::Subscribe(FeedSubscribe {
            job: job.into(),
            resume_from: 0,
            window: 1024,
        })),
    })
    .unwrap();
    let feed = client
        .feed(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (tx, feed)
}

/// Publishes and returns the scheduler's answer (skipping the trajectories that come first).
async fn publish(
    tx: &tokio::sync::mpsc::UnboundedSender<rollfleet_proto::v1::TrainerFeedRequest>,
    feed: &mut tonic::Streaming<rollfleet_proto::v1::TrainerFeedItem>,
    version: u64,
    uri: &str,
    sha256: &str,
) -> rollfleet_proto::v1::PublicationAnswer {
    use rollfleet_proto::v1::{
        PublishWeights, TrainerFeedRequest, trainer_feed_item, trainer_feed_request,
    };
    tx.send(TrainerFeedRequest {
        message: Some(trainer_feed_request::Message::Publish(PublishWeights {
            version,
            uri: uri.into(),
            format: "safetensors".into(),
            sha256: sha256.into(),
            bytes: 0,
        })),
    })
    .unwrap();
    loop {
        let item = tokio::time::timeout(Duration::from_secs(30), feed.message())
            .await
            .expect("no answer within 30 s")
            .unwrap()
            .expect("the feed ended");
        if let Some(trainer_feed_item::Item::Publication(answer)) = item.item {
            return answer;
        }
    }
}

#[test]
fn publications_that_repeat_or_skip_a_version_or_name_unreadable_or_hostile_weights_are_refused_with_the_reason()
 {
    let dir = temp_dir("refusals");
    let weights = dir.join("weights");
    std::fs::create_dir_all(&weights).unwrap();
    let good = weights.join("v1.safetensors");
    std::fs::write(&good, b"policy weights of version 1").unwrap();
    let outside = dir.join("elsewhere.safetensors");
    std::fs::write(&outside, b"other weights").unwrap();
    let mut procs = Procs(Vec::new());
    let weights_flag = weights.display().to_string();
    // Slowed down, so that the first step's trajectories are not all handed out before the
    // publications below are checked.
    let url = scheduler(
        &mut procs,
        &dir,
        Path::new(JOB),
        "8",
        &["--weights-dir", &weights_flag],
    );
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        worker(&mut procs, &url, pool, &[]);
    }
    let start = Instant::now();
    while !job_status(&url).contains("Running") {
        assert!(start.elapsed() < DEADLINE, "the job never ran");
        std::thread::sleep(Duration::from_millis(100));
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (tx, mut feed) = subscribe(&url, "quickstart-external").await;
        let good_uri = format!("file://{}", good.display());
        let zeros = "0".repeat(64);
        let cases: Vec<(u64, String, &str, &str)> = vec![
            (
                1,
                good_uri.clone(),
                "",
                "whose last batch has not been handed to the trainer yet",
            ),
            (
                1,
                "s3://bucket/v1.safetensors".into(),
                "",
                "scheme \"s3\" is not allowed",
            ),
            (
                1,
                "weights/v1.safetensors".into(),
                "",
                "is not an absolute path",
            ),
            (
                1,
                format!("{}/../elsewhere.safetensors", weights.display()),
                "",
                "path traversal",
            ),
            (
                1,
                format!("file://{}", outside.display()),
                "",
                "outside the scheduler's weights directory",
            ),
            (
                1,
                format!("file://{}/missing.safetensors", weights.display()),
                "",
                "cannot be read",
            ),
            (1, good_uri.clone(), &zeros, "hashes to"),
            (
                2,
                good_uri.clone(),
                "",
                "skips a version: the next one is 1",
            ),
            (0, good_uri.clone(), "", "already published"),
        ];
        for (version, uri, sha, reason) in cases {
            let answer = publish(&tx, &mut feed, version, &uri, sha).await;
            assert!(!answer.accepted, "{uri} v{version} was accepted");
            assert!(
                answer.reason.contains(reason),
                "{uri} v{version}: {:?} does not say {reason:?}",
                answer.reason
            );
            assert!(answer.reason.starts_with("publish."), "{:?}", answer.reason);
        }
        // The feed goes on after every refusal: the job's trajectories still arrive.
        let item = tokio::time::timeout(Duration::from_secs(60), feed.message())
            .await
            .expect("no trajectory within 60 s")
            .unwrap();
        assert!(item.is_some());
    });
    let status = job_status(&url);
    assert!(status.contains("Running"), "{status}");
    drop(procs);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The node refuses to run a token-in engine for a job whose trainer is emulated (it would have
/// no weights to load), naming both settings.
#[test]
fn a_token_in_engine_is_refused_for_a_job_whose_trainer_publishes_no_weights() {
    let dir = temp_dir("emulated-trainer");
    let mut procs = Procs(Vec::new());
    let engine = fake_engine(&mut procs, "sglang_server.py", &dir, "sglang", &[]);
    let job = dir.join("job.yaml");
    let yaml = std::fs::read_to_string(JOB)
        .unwrap()
        .replace("    trainer: external", "    trainer: emulated");
    std::fs::write(&job, yaml).unwrap();
    let url = scheduler(&mut procs, &dir, &job, "1", &[]);
    let out = Command::new(BIN)
        .args(["worker", "--scheduler", &url, "--pool", "decode"])
        .args(["--engine", "sglang", "--engine-url", &engine])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rl.trainer: external") && stderr.contains("--engine sglang"),
        "{stderr}"
    );
    drop(procs);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The trainer's own record of the versions it has had accepted (0 before its first).
fn trainer_version(checkpoints: &Path) -> u64 {
    std::fs::read(checkpoints.join("state.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .and_then(|v| v["version"].as_u64())
        .unwrap_or(0)
}

#[test]
fn a_scheduler_killed_under_an_external_trainer_resumes_and_no_trajectory_or_publication_is_lost_or_doubled()
 {
    let dir = temp_dir("failover");
    let mut procs = Procs(Vec::new());
    let journal = dir.join("journal.bin").display().to_string();
    let url = scheduler(
        &mut procs,
        &dir,
        Path::new(JOB),
        "1",
        &["--journal", &journal],
    );
    let addr = url.strip_prefix("http://").unwrap().to_owned();
    for pool in ["prefill", "decode", "train", "envs", "rewards"] {
        worker(&mut procs, &url, pool, &[]);
    }
    let checkpoints = dir.join("ckpt");
    let trainer_report = dir.join("trainer.json");
    let mut trainer = Command::new(BIN)
        .arg("train")
        .arg(JOB)
        .args(["--scheduler", &url, "--step-ms", "300"])
        .arg("--checkpoints")
        .arg(&checkpoints)
        .arg("--report")
        .arg(&trainer_report)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while trainer_version(&checkpoints) < 2 {
        assert!(
            start.elapsed() < DEADLINE,
            "the trainer never published version 2"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // SIGKILL mid-run, then the same command on the same address, on the journal.
    procs.0[0].kill().unwrap();
    procs.0[0].wait().unwrap();
    let killed_at = trainer_version(&checkpoints);
    assert!(killed_at < 5, "killed after the last version");
    scheduler(
        &mut procs,
        &dir,
        Path::new(JOB),
        "1",
        &["--journal", &journal, "--listen", &addr],
    );
    let status = wait_exit(&mut trainer, DEADLINE);
    assert!(status.success(), "the trainer failed: {status}");
    let restarted = procs.0.len() - 1;
    assert!(wait_exit(&mut procs.0[restarted], DEADLINE).success());

    let trained: Value = serde_json::from_slice(&std::fs::read(&trainer_report).unwrap()).unwrap();
    let published: Vec<u64> = trained["published"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["version"].as_u64().unwrap())
        .collect();
    assert_eq!(
        published,
        vec![1, 2, 3, 4, 5],
        "killed at version {killed_at}"
    );
    let consumed: Vec<u64> = serde_json::from_value(trained["trajectories"].clone()).unwrap();
    assert_eq!(consumed.len(), 160);
    assert_eq!(
        consumed.iter().collect::<BTreeSet<_>>().len(),
        160,
        "a trajectory was fed twice"
    );
    assert_eq!(trained["stale"], serde_json::json!([]));
    let report: Value =
        serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["phase"], "Succeeded");
    assert_eq!(report["policy_version"], 5);
    assert_eq!(report["trained_twice"], serde_json::json!([]));
    // The trainer consumed exactly what the scheduler trained, in its order.
    let scheduler_trained: Vec<u64> = serde_json::from_value(report["trained"].clone()).unwrap();
    assert_eq!(consumed, scheduler_trained);
    drop(procs);
    let _ = std::fs::remove_dir_all(&dir);
}
