//! Escapes from the code sandbox that the audit hook alone does not stop, each tried under the
//! namespace sandbox with the hook switched off first (code in the same interpreter can always
//! do that), so only the namespaces stand in the way.
//!
//! Without a working `bwrap` under `ROLLFLEET_SANDBOX=auto` these tests are skipped with a
//! message. `ROLLFLEET_SANDBOX=process` runs them against the process sandbox instead, where
//! they are expected to fail: that is what shows the escapes are real.

// Test helpers outside #[test] functions panic on setup failures too; clippy.toml's
// allow-unwrap-in-tests does not reach them.
#![allow(clippy::unwrap_used)]

use std::io::ErrorKind;
use std::net::{TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rollfleet_rewards::sandbox::{Isolation, Sandbox, SandboxLimits, SandboxMode, Termination};

mod common;
use common::HOOK_OFF;

/// The sandbox under test, or `None` (with a message) when namespaces are unavailable and the
/// process sandbox was not asked for explicitly.
fn contained() -> Option<Sandbox> {
    let sandbox = Sandbox::new(SandboxLimits {
        cpu_seconds: 4,
        wall_time_ms: 8_000,
        memory_bytes: 256 << 20,
        max_processes: 16,
        max_file_bytes: 1 << 20,
        max_output_bytes: 64 << 10,
    });
    match sandbox.isolation() {
        Ok(Isolation::Namespaces) => Some(sandbox),
        Ok(Isolation::Process) if sandbox.mode() == SandboxMode::Process => Some(sandbox),
        Ok(Isolation::Process) => {
            eprintln!(
                "SKIPPED: bwrap is unavailable here, so the namespace sandbox cannot be tested \
                 (install the bubblewrap package; set ROLLFLEET_SANDBOX=process to run these \
                 against the process sandbox)"
            );
            None
        }
        Err(e) => panic!("{e}"),
    }
}

fn marker(what: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("rollfleet-{what}-{}-{nanos}", std::process::id())
}

fn run_hostile(sandbox: &Sandbox, attack: &str) -> String {
    let out = sandbox.run(&format!("{HOOK_OFF}\n{attack}"), b"").unwrap();
    assert!(
        out.stdout.starts_with("hook-off"),
        "the hook was not switched off, so the test proves nothing: {}",
        out.stderr
    );
    format!("{}\n{}", out.stdout, out.stderr)
}

/// A host directory anyone may read and write, as `/tmp` is.
fn open_host_dir() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    dir
}

/// A world-readable file on the host holding a unique secret.
fn host_secret(dir: &Path) -> (PathBuf, String) {
    let secret = marker("secret");
    let path = dir.join("secret.txt");
    std::fs::write(&path, &secret).unwrap();
    (path, secret)
}

fn first_line_of_host_passwd() -> String {
    std::fs::read_to_string("/etc/passwd")
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .to_owned()
}

fn processes_matching(marker: &str) -> Vec<String> {
    let out = std::process::Command::new("pgrep")
        .arg("-f")
        .arg(marker)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// Kills the processes a failing test left behind, one by one by pid, so a failure against
/// the process sandbox does not leave daemons running.
fn kill_all(pids: &[String]) {
    for pid in pids {
        let _ = std::process::Command::new("kill")
            .arg("-9")
            .arg(pid)
            .status();
    }
}

#[test]
fn with_the_hook_off_code_cannot_read_etc_passwd_or_other_host_files() {
    let Some(sandbox) = contained() else { return };
    let dir = open_host_dir();
    let (secret_path, secret) = host_secret(dir.path());
    let attack = format!(
        "for p in ['/etc/passwd', {secret_path:?}]:\n    try:\n        print('read', p, open(p).read())\n    except OSError as e:\n        print('denied', p, type(e).__name__)\n"
    );
    let out = run_hostile(&sandbox, &attack);
    assert!(out.contains("denied /etc/passwd"), "{out}");
    assert!(!out.contains(&first_line_of_host_passwd()), "{out}");
    assert!(!out.contains(&secret), "{out}");
}

#[test]
fn with_the_hook_off_a_subprocess_runs_but_sees_no_host_file_or_process() {
    let Some(sandbox) = contained() else { return };
    let dir = open_host_dir();
    let (secret_path, secret) = host_secret(dir.path());
    // This test's own command line, which any process that can see the host's processes can
    // read from /proc.
    let own_cmdline = std::fs::read("/proc/self/cmdline").unwrap();
    let own_argv0 = String::from_utf8_lossy(own_cmdline.split(|b| *b == 0).next().unwrap());
    let script = format!(
        "id; cat /etc/passwd {}; tr '\\0' ' ' < /proc/{}/cmdline",
        secret_path.display(),
        std::process::id()
    );
    let attack = format!(
        "import subprocess\nr = subprocess.run(['sh', '-c', {script:?}], capture_output=True, text=True)\nprint('ran', r.returncode, r.stdout, r.stderr)\n"
    );
    let out = run_hostile(&sandbox, &attack);
    // The subprocess itself ran (as nobody); the point is what it could reach.
    assert!(out.contains("uid=65534"), "{out}");
    assert!(!out.contains(&first_line_of_host_passwd()), "{out}");
    assert!(!out.contains(&secret), "{out}");
    assert!(!out.contains(own_argv0.as_ref()), "{out}");
}

#[test]
fn with_the_hook_off_nothing_written_outside_the_run_directory_reaches_the_host() {
    let Some(sandbox) = contained() else { return };
    let drop_dir = open_host_dir();
    let name = marker("escape");
    let targets = [
        std::env::temp_dir().join(&name),
        drop_dir.path().join(&name),
        Path::new("/dev/shm").join(&name),
    ];
    let mut attack = String::from(
        "import os\nopen('inside.txt', 'w').write('ok')\nprint('inside', open('inside.txt').read())\n",
    );
    for target in &targets {
        let target = target.display();
        attack += &format!(
            "try:\n    open('{target}', 'w').write('x')\nexcept OSError as e:\n    print('denied', type(e).__name__)\nos.system('echo x > {target}.sh 2>/dev/null')\n"
        );
    }
    let out = run_hostile(&sandbox, &attack);
    assert!(out.contains("inside ok"), "{out}");
    for target in &targets {
        let from_shell = PathBuf::from(format!("{}.sh", target.display()));
        let escaped = [target.exists(), from_shell.exists()];
        let _ = std::fs::remove_file(target);
        let _ = std::fs::remove_file(&from_shell);
        assert_eq!(
            escaped,
            [false, false],
            "{} was written: {out}",
            target.display()
        );
    }
}

#[test]
fn with_the_hook_off_code_cannot_connect_to_a_tcp_listener_on_the_hosts_loopback() {
    let Some(sandbox) = contained() else { return };
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let attack = format!(
        "import socket\ntry:\n    s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    s.sendall(b'escaped')\n    print('connected')\nexcept OSError as e:\n    print('refused', type(e).__name__)\n"
    );
    let out = run_hostile(&sandbox, &attack);
    match listener.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("the sandbox reached the host's listener ({other:?}): {out}"),
    }
}

#[test]
fn with_the_hook_off_code_cannot_deliver_a_udp_datagram_to_the_hosts_loopback() {
    let Some(sandbox) = contained() else { return };
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    socket.set_nonblocking(true).unwrap();
    let port = socket.local_addr().unwrap().port();
    let attack = format!(
        "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nfor send in (lambda: s.sendto(b'escaped', ('127.0.0.1', {port})), lambda: s.sendmsg([b'escaped'], [], 0, ('127.0.0.1', {port}))):\n    try:\n        send()\n        print('sent')\n    except OSError as e:\n        print('refused', type(e).__name__)\n"
    );
    let out = run_hostile(&sandbox, &attack);
    // Loopback delivery is synchronous, but give a slow machine a moment.
    std::thread::sleep(Duration::from_millis(200));
    let mut buf = [0u8; 64];
    match socket.recv_from(&mut buf) {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("a datagram from the sandbox arrived ({other:?}): {out}"),
    }
}

#[test]
fn with_the_hook_off_a_socket_the_code_listens_on_is_not_reachable_from_the_host() {
    let Some(sandbox) = contained() else { return };
    // A port free on the host right now, for the code to listen on.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let attack = format!(
        "import socket\ns = socket.socket()\ns.bind(('0.0.0.0', {port}))\ns.listen()\nprint('listening', flush=True)\ns.settimeout(3)\ntry:\n    s.accept()\n    print('accepted')\nexcept OSError:\n    print('nobody came')\n"
    );
    let run = std::thread::spawn(move || run_hostile(&sandbox, &attack));
    let mut reached = false;
    let until = std::time::Instant::now() + Duration::from_millis(2_500);
    while std::time::Instant::now() < until && !reached {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        reached = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok();
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = run.join().unwrap();
    assert!(out.contains("listening"), "{out}");
    assert!(
        !reached,
        "the host connected to the sandbox's listener: {out}"
    );
}

/// Starts a `setsid` grandchild whose command line carries `marker`, checks from inside that
/// it is running, then runs `then`.
fn setsid_daemon(marker: &str, then: &str) -> String {
    format!(
        r#"import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        fd = os.open("/dev/null", os.O_RDWR)
        for i in (0, 1, 2):
            os.dup2(fd, i)
        os.execv("/bin/sleep", ["{marker}", "60"])
    os._exit(0)
time.sleep(0.5)
for p in os.listdir("/proc"):
    try:
        if p.isdigit() and "{marker}" in open("/proc/%s/cmdline" % p).read():
            print("daemon up", flush=True)
    except OSError:
        pass
{then}
"#
    )
}

fn assert_none_left(marker: &str) {
    std::thread::sleep(Duration::from_millis(300));
    let survivors = processes_matching(marker);
    kill_all(&survivors);
    assert!(survivors.is_empty(), "survived the run: {survivors:?}");
}

#[test]
fn a_setsid_grandchild_does_not_outlive_its_run() {
    let Some(sandbox) = contained() else { return };
    let marker = marker("setsid");
    let out = run_hostile(&sandbox, &setsid_daemon(&marker, ""));
    assert!(
        out.contains("daemon up"),
        "the daemon never started, so the test proves nothing: {out}"
    );
    assert_none_left(&marker);
}

#[test]
fn a_setsid_grandchild_does_not_outlive_a_run_killed_at_the_wall_clock_limit() {
    let Some(sandbox) = contained() else { return };
    let sandbox = sandbox.with_limits(SandboxLimits {
        wall_time_ms: 2_000,
        ..*sandbox.limits()
    });
    let marker = marker("setsid-timeout");
    let code = format!("{HOOK_OFF}\n{}", setsid_daemon(&marker, "time.sleep(60)"));
    let out = sandbox.run(&code, b"").unwrap();
    assert_eq!(out.termination, Termination::WallTimeout);
    assert!(
        out.stdout.contains("daemon up"),
        "the daemon never started, so the test proves nothing: {}",
        out.stderr
    );
    assert_none_left(&marker);
}

#[test]
fn two_concurrent_runs_do_not_see_each_others_directory() {
    let Some(sandbox) = contained() else { return };
    let flag = marker("flag");
    let first = sandbox.clone();
    let first_code = format!(
        "open('{flag}', 'w').write('mine')\nimport time\ntime.sleep(3)\nprint('first done')\n"
    );
    let first = std::thread::spawn(move || first.run(&first_code, b"").unwrap());
    std::thread::sleep(Duration::from_millis(1_000));
    // Look for the first run's files everywhere a neighbour could: the shared temporary
    // directory the runs are made in, and the working directories of visible processes.
    let attack = format!(
        r#"import glob, os
found = []
for d in glob.glob({tmp:?} + "/rollfleet-sandbox-*") + ["/proc/%s/cwd" % p for p in os.listdir("/proc") if p.isdigit()]:
    try:
        found += os.listdir(d)
    except OSError:
        pass
print(sorted(set(found)))
"#,
        tmp = std::env::temp_dir().display().to_string()
    );
    let out = run_hostile(&sandbox, &attack);
    let first = first.join().unwrap();
    assert_eq!(first.stdout.trim(), "first done", "{}", first.stderr);
    assert!(
        !out.contains(&flag),
        "the second run saw the first's files: {out}"
    );
}

#[test]
fn a_daemon_planted_by_one_run_cannot_change_the_next_runs_solution() {
    let Some(sandbox) = contained() else { return };
    let marker = marker("planted");
    let victim = marker.replace("planted", "victim");
    // The daemon replaces every later solution it can find with one that prints "pwned". It
    // only touches this test's victims, so that against the process sandbox it does not
    // disturb tests running next to it.
    let daemon = format!(
        r#"
import glob, os, time
payload = 'print("pwned")\n'
end = time.time() + 15
while time.time() < end:
    targets = glob.glob({tmp:?} + "/rollfleet-sandbox-*/main.py")
    targets += ["/proc/%s/cwd/main.py" % p for p in os.listdir("/proc") if p.isdigit()]
    for t in targets:
        try:
            if "{victim}" in open(t).read():
                tmp = os.path.join(os.path.dirname(t), ".planted")
                open(tmp, "w").write(payload)
                os.replace(tmp, t)
        except OSError:
            pass
"#,
        tmp = std::env::temp_dir().display().to_string()
    );
    let attack = format!(
        r#"import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        fd = os.open("/dev/null", os.O_RDWR)
        for i in (0, 1, 2):
            os.dup2(fd, i)
        os.execv(sys.executable, [sys.executable, "-c", {daemon:?}, "{marker}"])
    os._exit(0)
time.sleep(0.3)
print("planted")
"#
    );
    let out = run_hostile(&sandbox, &attack);
    assert!(out.contains("planted"), "{out}");
    let mut results = Vec::new();
    for i in 0..5 {
        let solution = format!("# {victim}\nimport time\ntime.sleep(0.2)\nprint('own {i}')\n");
        let out = sandbox.run(&solution, b"").unwrap();
        results.push(out.stdout.trim().to_owned());
    }
    kill_all(&processes_matching(&marker));
    let expected: Vec<String> = (0..5).map(|i| format!("own {i}")).collect();
    assert_eq!(results, expected, "a planted daemon changed later runs");
}

#[test]
fn the_isolation_in_use_is_reported() {
    let sandbox = Sandbox::new(SandboxLimits::default());
    let process = sandbox.with_mode(SandboxMode::Process);
    assert_eq!(process.isolation().unwrap(), Isolation::Process);
    assert_eq!(process.run("print(1)", b"").unwrap().stdout.trim(), "1");
    let namespaces = sandbox.with_mode(SandboxMode::Namespaces);
    let auto = sandbox.with_mode(SandboxMode::Auto);
    match namespaces.isolation() {
        // Required and available: auto picks it too.
        Ok(isolation) => {
            assert_eq!(isolation, Isolation::Namespaces);
            assert_eq!(auto.isolation().unwrap(), Isolation::Namespaces);
        }
        // Required but missing: every run fails with the reason, and auto falls back.
        Err(e) => {
            assert!(e.to_string().contains("bwrap"), "{e}");
            assert!(namespaces.run("print(1)", b"").is_err());
            assert_eq!(auto.isolation().unwrap(), Isolation::Process);
        }
    }
    assert!("bogus".parse::<SandboxMode>().is_err());
}
