//! The `rollfleet-lambda-host` program end to end: it listens where told, answers an Invoke
//! request over real TCP, and exits cleanly on SIGINT (Ctrl-C), as `rollfleet serverless serve`
//! will.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn the_host_program_serves_an_invocation_and_stops_on_ctrl_c() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_rollfleet-lambda-host"))
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--cold-start-ms",
            "1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the host");

    let deadline = Instant::now() + Duration::from_secs(20);
    let mut stream = loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => {
                let _ = child.kill();
                panic!("host did not start listening: {e}");
            }
        }
    };
    let body = r#"{"response":"\\boxed{42}","reference":"42"}"#;
    let request = format!(
        "POST /2015-03-31/functions/math_answer/invocations HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).expect("send");
    let mut reply = String::new();
    stream.read_to_string(&mut reply).expect("read");
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.contains("\"reward\":1.0"), "{reply}");

    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("host did not stop on SIGINT");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
}
