//! The code-execution sandbox against real Python 3 subprocesses, including hostile programs:
//! infinite loops, fork bombs, memory hogs, floods of output, and attempts to read or write
//! outside the run directory.

// Test helpers outside #[test] functions panic on setup failures too; clippy.toml's
// allow-unwrap-in-tests does not reach them.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use rollfleet_rewards::sandbox::{
    CodeTests, IoCase, Sandbox, SandboxLimits, Termination, run_code_tests,
};

mod common;
use common::marked;

fn sandbox() -> Sandbox {
    Sandbox::new(SandboxLimits {
        cpu_seconds: 2,
        wall_time_ms: 4_000,
        memory_bytes: 256 << 20,
        max_processes: 16,
        max_file_bytes: 1 << 20,
        max_output_bytes: 64 << 10,
    })
}

#[test]
fn a_correct_program_reads_stdin_and_exits_cleanly() {
    let out = sandbox()
        .run(
            "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))",
            b"1 2 3",
        )
        .unwrap();
    assert_eq!(out.termination, Termination::Exited(0));
    assert_eq!(out.stdout.trim(), "6");
}

#[test]
fn an_uncaught_exception_is_a_non_zero_exit_with_the_traceback_on_stderr() {
    let out = sandbox().run("raise ValueError('nope')", b"").unwrap();
    assert_eq!(out.termination, Termination::Exited(1));
    assert!(out.stderr.contains("ValueError: nope"), "{}", out.stderr);
}

#[test]
fn a_busy_infinite_loop_is_stopped_by_the_cpu_limit() {
    // A wall limit far above the CPU limit, so that on a loaded machine the CPU limit still
    // fires first.
    let limits = SandboxLimits {
        cpu_seconds: 1,
        wall_time_ms: 60_000,
        ..SandboxLimits::default()
    };
    let out = Sandbox::new(limits)
        .run("while True:\n    pass", b"")
        .unwrap();
    // SIGXCPU (24) at the soft limit, or SIGKILL (9) if the hard limit is reached first.
    assert!(
        matches!(
            out.termination,
            Termination::Signaled(24) | Termination::Signaled(9)
        ),
        "{:?}",
        out.termination
    );
}

#[test]
fn a_sleeping_program_is_stopped_by_the_wall_clock_limit() {
    let started = Instant::now();
    let out = sandbox().run("import time\ntime.sleep(60)", b"").unwrap();
    assert_eq!(out.termination, Termination::WallTimeout);
    assert!(started.elapsed() < Duration::from_secs(20));
}

#[test]
fn a_fork_bomb_is_contained_and_leaves_no_process_behind() {
    let marker = format!("rollfleet-forkbomb-{}", std::process::id());
    let bomb = "import os, time\nprint('bomb up', flush=True)\nn = 0\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        n += 1\n        time.sleep(0.01)\n";
    let out = sandbox().run(&marked(&marker, bomb), b"").unwrap();
    assert!(
        out.stdout.contains("bomb up"),
        "the marked bomb never ran, so the test proves nothing: {}",
        out.stderr
    );
    assert!(
        matches!(
            out.termination,
            Termination::WallTimeout | Termination::Signaled(_)
        ),
        "{:?}",
        out.termination
    );
    std::thread::sleep(Duration::from_millis(300));
    let survivors = std::process::Command::new("pgrep")
        .arg("-f")
        .arg(&marker)
        .output()
        .unwrap();
    assert!(
        survivors.stdout.is_empty(),
        "fork bomb processes survived: {}",
        String::from_utf8_lossy(&survivors.stdout)
    );
}

#[test]
fn the_process_limit_makes_fork_fail_inside_the_sandbox() {
    let code = "import os\nkids = []\ntry:\n    for _ in range(100):\n        pid = os.fork()\n        if pid == 0:\n            import time; time.sleep(5); os._exit(0)\n        kids.append(pid)\n    print('forked', len(kids))\nexcept OSError as e:\n    print('refused after', len(kids))\n";
    let out = sandbox().run(code, b"").unwrap();
    assert!(out.stdout.starts_with("refused after"), "{}", out.stdout);
}

#[test]
fn a_memory_hog_fails_to_allocate_past_the_address_space_limit() {
    let out = sandbox()
        .run("x = bytearray(1024 * 1024 * 1024)\nprint('allocated')", b"")
        .unwrap();
    assert!(!out.succeeded());
    assert!(out.stderr.contains("MemoryError"), "{}", out.stderr);
}

#[test]
fn a_flood_of_output_is_truncated_at_the_byte_limit_and_the_program_killed() {
    let started = Instant::now();
    let out = sandbox()
        .run("while True:\n    print('x' * 10000)", b"")
        .unwrap();
    assert_eq!(out.termination, Termination::OutputLimit);
    assert!(out.stdout_truncated);
    assert_eq!(out.stdout.len(), 64 << 10);
    assert!(started.elapsed() < Duration::from_secs(4));
}

#[test]
fn reading_files_outside_the_run_directory_is_refused() {
    for path in [
        "/etc/passwd",
        "/etc/hostname",
        "../../etc/passwd",
        "/proc/self/environ",
    ] {
        let code = format!("print(open({path:?}).read())");
        let out = sandbox().run(&code, b"").unwrap();
        assert!(!out.succeeded(), "{path} was readable: {}", out.stdout);
        assert!(
            out.stderr.contains("PermissionError"),
            "{path}: {}",
            out.stderr
        );
    }
}

#[test]
fn writing_outside_the_run_directory_is_refused_but_inside_is_allowed() {
    let out = sandbox()
        .run("open('/tmp/rollfleet-escape', 'w').write('x')", b"")
        .unwrap();
    assert!(out.stderr.contains("PermissionError"), "{}", out.stderr);
    assert!(!std::path::Path::new("/tmp/rollfleet-escape").exists());

    let out = sandbox()
        .run(
            "open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())",
            b"",
        )
        .unwrap();
    assert_eq!(out.stdout.trim(), "ok", "{}", out.stderr);
}

#[test]
fn the_run_directory_is_private_to_the_run() {
    let out = sandbox()
        .run(
            "import os\nst = os.stat('.')\nprint(oct(st.st_mode & 0o777), st.st_uid == os.getuid())",
            b"",
        )
        .unwrap();
    assert_eq!(out.stdout.trim(), "0o700 True", "{}", out.stderr);
}

#[test]
fn writing_a_huge_file_is_stopped_by_the_file_size_limit() {
    let out = sandbox()
        .run("f = open('big', 'wb')\nfor _ in range(100):\n    f.write(b'x' * (1 << 20))\n    f.flush()", b"")
        .unwrap();
    assert!(!out.succeeded());
}

#[test]
fn subprocesses_network_sockets_and_ctypes_are_refused() {
    for code in [
        "import ctypes\nctypes.CDLL('libc.so.6').system(b'true')",
        "import subprocess\nsubprocess.run(['cat', '/etc/passwd'])",
        "import os\nos.system('cat /etc/passwd')",
        "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
    ] {
        let out = sandbox().run(code, b"").unwrap();
        assert!(
            out.stderr.contains("PermissionError"),
            "{code}: {}",
            out.stderr
        );
    }
}

#[test]
fn a_background_child_does_not_outlive_the_run() {
    let marker = format!("rollfleet-orphan-{}", std::process::id());
    let code = "import os, time\nif os.fork() == 0:\n    print('child up', flush=True)\n    time.sleep(30)\n    os._exit(0)\ntime.sleep(0.5)\nprint('parent done', flush=True)\n";
    let out = sandbox().run(&marked(&marker, code), b"").unwrap();
    assert!(
        out.stdout.contains("child up") && out.stdout.contains("parent done"),
        "{} {}",
        out.stdout,
        out.stderr
    );
    std::thread::sleep(Duration::from_millis(300));
    let survivors = std::process::Command::new("pgrep")
        .arg("-f")
        .arg(&marker)
        .output()
        .unwrap();
    assert!(survivors.stdout.is_empty());
}

#[test]
fn io_tests_score_the_fraction_of_cases_with_matching_output() {
    let code = "n = int(input())\nprint(n * 2 if n < 10 else n)";
    let tests = CodeTests::Io(vec![
        IoCase {
            stdin: "2\n".into(),
            expected_stdout: "4\n".into(),
        },
        IoCase {
            stdin: "5".into(),
            expected_stdout: "10   \n\n".into(),
        },
        IoCase {
            stdin: "20".into(),
            expected_stdout: "40".into(),
        },
    ]);
    let report = run_code_tests(&sandbox(), code, &tests, Duration::from_secs(30)).unwrap();
    assert_eq!((report.passed, report.total), (2, 3));
    assert!(!report.cases[2].passed);
}

#[test]
fn unit_tests_pass_only_when_their_asserts_hold() {
    let code = "def add(a, b):\n    return a + b";
    let tests = CodeTests::Unit(vec![
        "assert add(1, 2) == 3".into(),
        "assert add('a', 'b') == 'ab'".into(),
        "assert add(2, 2) == 5".into(),
    ]);
    let report = run_code_tests(&sandbox(), code, &tests, Duration::from_secs(30)).unwrap();
    assert_eq!((report.passed, report.total), (2, 3));
    assert!(report.cases[2].stderr_tail.contains("AssertionError"));
}

#[test]
fn cases_past_the_time_budget_are_not_run_and_count_as_failed() {
    let tests = CodeTests::Unit(vec!["import time; time.sleep(10)".into(), "pass".into()]);
    let report = run_code_tests(&sandbox(), "", &tests, Duration::from_millis(500)).unwrap();
    assert_eq!(report.passed, 0);
    assert_eq!(report.cases[1].termination, None);
}

#[test]
fn a_missing_interpreter_is_an_error_not_a_zero_score() {
    let s = Sandbox::with_python("/nonexistent/python3", SandboxLimits::default());
    assert!(s.run("print(1)", b"").is_err());
}

#[test]
fn limits_asked_for_in_a_payload_can_only_lower_the_hosts_limits() {
    let host = SandboxLimits::default();
    let greedy = SandboxLimits {
        cpu_seconds: 10_000,
        wall_time_ms: u64::MAX,
        memory_bytes: u64::MAX,
        max_processes: 100_000,
        max_file_bytes: u64::MAX,
        max_output_bytes: usize::MAX,
    };
    assert_eq!(greedy.clamped_to(&host), host);
    let modest = SandboxLimits {
        cpu_seconds: 1,
        wall_time_ms: 500,
        memory_bytes: 128 << 20,
        max_processes: 4,
        max_file_bytes: 1024,
        max_output_bytes: 100,
    };
    assert_eq!(modest.clamped_to(&host), modest);
    let zero = SandboxLimits {
        cpu_seconds: 0,
        wall_time_ms: 0,
        memory_bytes: 0,
        max_processes: 0,
        max_file_bytes: 0,
        max_output_bytes: 0,
    };
    let clamped = zero.clamped_to(&host);
    assert_eq!((clamped.cpu_seconds, clamped.wall_time_ms), (1, 1));
    assert_eq!(clamped.memory_bytes, 64 << 20);
    // A host configured below the floors does not panic either.
    let _ = greedy.clamped_to(&zero);
}
