//! The `rollfleet` binary's runtime commands as a user meets them, short of running a job
//! (`run`, `scheduler`, `worker`, `job`, `serverless serve`): the flags they refuse and why, and
//! the schedulers they cannot reach; run as a separate process, judged by its exit code, its
//! stdout and its stderr.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::process::Command;

#[path = "common/cli.rs"]
mod harness;
use harness::*;

#[test]
fn run_refuses_a_slowdown_of_a_pool_the_job_has_no_gpus_in_or_a_share_past_one() {
    let out = rollfleet(&[
        "run",
        "examples/jobs/quickstart.yaml",
        "--emulate-slowdown",
        "envs=0.5",
    ]);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        text(&out.stderr).contains("job quickstart has no GPU pool \"envs\""),
        "{}",
        text(&out.stderr)
    );
    let out = rollfleet(&[
        "run",
        "examples/jobs/quickstart.yaml",
        "--emulate-slowdown",
        "decode=1.5",
    ]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a malformed flag is a usage error"
    );
    assert!(
        text(&out.stderr).contains("SHARE in (0, 1]"),
        "{}",
        text(&out.stderr)
    );
    let out = rollfleet(&[
        "scheduler",
        "examples/jobs/quickstart.yaml",
        "--replan-on-drift",
        "0",
    ]);
    assert_eq!(out.status.code(), Some(3));
    assert!(text(&out.stderr).contains("--replan-on-drift 0: the margin must be a positive share"));
}

#[test]
fn a_journal_that_cannot_be_written_or_is_not_a_journal_is_refused_naming_the_file() {
    // A full disk: the scheduler does not start a job it could not resume.
    let out = rollfleet(&[
        "scheduler",
        "examples/jobs/quickstart.yaml",
        "--listen",
        "127.0.0.1:0",
        "--journal",
        "/dev/full",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("journal /dev/full:"),
        "{}",
        text(&out.stderr)
    );
    // A job file given as the journal is not replayed, and not overwritten.
    let job = scratch("journal-is-a-job.yaml", "name: not a journal\n");
    let out = rollfleet(&[
        "scheduler",
        "--listen",
        "127.0.0.1:0",
        "--journal",
        job.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("journal-is-a-job.yaml"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(&job).unwrap(),
        "name: not a journal\n"
    );
}

#[test]
fn a_scheduler_given_half_a_tls_identity_or_a_key_file_without_a_key_serves_nothing_and_says_why() {
    let cert = scratch(
        "tls-cert.pem",
        "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
    );
    let out = rollfleet(&[
        "scheduler",
        "examples/jobs/quickstart.yaml",
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        cert.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("--tls-key"),
        "{}",
        text(&out.stderr)
    );
    let key = scratch("tls-key.pem", "not a key\n");
    let out = rollfleet(&[
        "scheduler",
        "examples/jobs/quickstart.yaml",
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let said = text(&out.stderr);
    assert!(
        said.contains("--tls-key") && said.contains("tls-key.pem") && said.contains("PRIVATE KEY"),
        "{said}"
    );
    assert!(
        text(&out.stdout).is_empty(),
        "it listened: {}",
        text(&out.stdout)
    );
}

#[test]
fn client_certificate_flags_come_with_what_they_need() {
    // A client certificate needs its key and the CA that signed the scheduler's.
    let out = rollfleet(&["job", "status", "quickstart", "--tls-cert", "client.pem"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let said = text(&out.stderr);
    assert!(
        said.contains("--tls-key") && said.contains("--tls-ca"),
        "{said}"
    );
    // A scheduler asks for client certificates only when it serves TLS itself.
    let out = rollfleet(&[
        "scheduler",
        "examples/jobs/quickstart.yaml",
        "--listen",
        "127.0.0.1:0",
        "--tls-client-ca",
        "ca.pem",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("--tls-cert"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn journal_sync_without_a_journal_is_refused_naming_the_flag_it_needs() {
    let out = rollfleet(&[
        "scheduler",
        "examples/jobs/quickstart.yaml",
        "--listen",
        "127.0.0.1:0",
        "--journal-sync",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("--journal <FILE>"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn serverless_serve_answers_the_lambda_invoke_api_and_stops_on_ctrl_c() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::process::Stdio;

    let mut child = Command::new(env!("CARGO_BIN_EXE_rollfleet"))
        .args(["serverless", "serve", "--listen", "127.0.0.1:0"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut banner = String::new();
    BufReader::new(child.stderr.take().unwrap())
        .read_line(&mut banner)
        .unwrap();
    let address = banner
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {banner:?}"))
        .to_owned();
    let mut stream = std::net::TcpStream::connect(&address).unwrap();
    let body = r#"{"response":"the answer is \\boxed{42}","reference":"42"}"#;
    write!(
        stream,
        "POST /2015-03-31/functions/math_answer/invocations HTTP/1.1\r\nhost: localhost\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.contains("\"reward\":1.0"), "{reply}");

    let interrupted = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(interrupted.success());
    assert_eq!(child.wait().unwrap().code(), Some(0));
}

#[test]
fn rollfleet_job_says_when_the_address_answers_but_is_no_scheduler() {
    // A plain HTTP/1.1 server on the port (a web server, a proxy): it answers every request
    // with the same page and closes.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            use std::io::{Read, Write};
            let mut buf = [0u8; 1024];
            let _ = stream.read(&mut buf);
            let _ = stream.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello",
            );
        }
    });
    let out = rollfleet(&["job", "status", "quickstart", "--scheduler", &url]);
    assert_eq!(out.status.code(), Some(1));
    let said = text(&out.stderr);
    assert!(
        said.contains(&format!("{url} did not answer as a rollfleet scheduler")),
        "{said}"
    );
}

#[test]
fn rollfleet_job_names_the_scheduler_it_cannot_reach_and_refuses_a_url_that_is_not_one() {
    // Port 1 on loopback: nothing listens there.
    let out = rollfleet(&[
        "job",
        "status",
        "quickstart",
        "--scheduler",
        "http://127.0.0.1:1",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let said = text(&out.stderr);
    assert!(
        said.contains("cannot reach the scheduler at http://127.0.0.1:1"),
        "{said}"
    );
    // A value that is no URL is a bad command line, refused by the argument parser.
    let out = rollfleet(&["job", "cancel", "quickstart", "--scheduler", "not a url"]);
    assert_eq!(out.status.code(), Some(2));
    let said = text(&out.stderr);
    assert!(
        said.contains("--scheduler") && said.contains("\"not a url\" is not a URL"),
        "{said}"
    );
}

#[test]
fn a_scheduler_url_without_a_scheme_is_a_usage_error_saying_what_to_write() {
    let checkpoints = std::env::temp_dir().join(format!(
        "rollfleet-cli-{}-no-scheme-checkpoints",
        std::process::id()
    ));
    for args in [
        &["job", "status", "quickstart", "--scheduler", "127.0.0.1:1"][..],
        &["job", "watch", "quickstart", "--scheduler", "127.0.0.1:1"],
        &["job", "cancel", "quickstart", "--scheduler", "127.0.0.1:1"],
        &[
            "job",
            "submit",
            "examples/jobs/quickstart.yaml",
            "--scheduler",
            "127.0.0.1:1",
        ],
        &["worker", "--pool", "decode", "--scheduler", "127.0.0.1:1"],
        &[
            "train",
            "examples/jobs/quickstart-external.yaml",
            "--checkpoints",
            checkpoints.to_str().unwrap(),
            "--scheduler",
            "127.0.0.1:1",
        ],
    ] {
        let out = rollfleet(args);
        let said = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {said}");
        assert!(said.contains("--scheduler"), "{args:?}: {said}");
        assert!(
            said.contains(
                "127.0.0.1:1 has no scheme; use http://127.0.0.1:1 or https://127.0.0.1:1"
            ),
            "{args:?}: {said}"
        );
        assert!(
            !said.contains("unreachable") && !said.contains("cannot reach"),
            "{said}"
        );
    }
    assert!(!checkpoints.exists());
}

#[test]
fn rollfleet_scheduler_in_the_environment_is_the_default_of_every_scheduler_flag() {
    const VAR: &str = "ROLLFLEET_SCHEDULER";
    // Read: a value with no scheme is refused as the flag's would be, naming the variable.
    for args in [
        &["job", "status", "quickstart"][..],
        &["worker", "--pool", "decode"],
    ] {
        let out = rollfleet_with_env(args, VAR, "127.0.0.1:9");
        let said = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {said}");
        assert!(
            said.contains("127.0.0.1:9 has no scheme") && said.contains(VAR),
            "{args:?}: {said}"
        );
    }
    // A good one is used.
    let out = rollfleet_with_env(&["job", "status", "quickstart"], VAR, "http://127.0.0.1:1");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("cannot reach the scheduler at http://127.0.0.1:1"),
        "{}",
        text(&out.stderr)
    );
    // The flag wins over the variable.
    let out = rollfleet_with_env(
        &[
            "job",
            "status",
            "quickstart",
            "--scheduler",
            "http://127.0.0.1:1",
        ],
        VAR,
        "127.0.0.1:9",
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("http://127.0.0.1:1"));
    // Unset, the scheduler's own default address, as before.
    let out = rollfleet(&["job", "status", "quickstart"]);
    let said = text(&out.stderr);
    assert_ne!(out.status.code(), Some(2), "{said}");
    assert!(said.contains("http://127.0.0.1:7070"), "{said}");
    // Every command with the flag says so in its help.
    for args in [
        &["job", "submit", "--help"][..],
        &["job", "status", "--help"],
        &["job", "watch", "--help"],
        &["job", "cancel", "--help"],
        &["worker", "--help"],
        &["train", "--help"],
    ] {
        let out = rollfleet(args);
        assert_eq!(out.status.code(), Some(0));
        assert!(
            text(&out.stdout).contains("[env: ROLLFLEET_SCHEDULER="),
            "{args:?}: {}",
            text(&out.stdout)
        );
    }
}

#[test]
fn rollfleet_job_submit_checks_the_job_before_contacting_any_scheduler() {
    let job = scratch(
        "bad-submit.yaml",
        &std::fs::read_to_string(repo().join("examples/jobs/quickstart.yaml"))
            .unwrap()
            .replace("gpu: ", "gpu: NoSuchGpu-"),
    );
    // The scheduler URL is unreachable: an invalid job must be refused before that matters.
    let out = rollfleet(&[
        "job",
        "submit",
        job.to_str().unwrap(),
        "--scheduler",
        "http://127.0.0.1:1",
    ]);
    assert_eq!(out.status.code(), Some(3));
    let said = text(&out.stderr);
    assert!(
        said.contains("gpu") && !said.contains("cannot reach"),
        "{said}"
    );
}
