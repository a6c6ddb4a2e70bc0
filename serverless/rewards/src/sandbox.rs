//! Sandboxed execution of untrusted Python 3 code (model-written solutions) for code rewards.
//!
//! Two isolation levels, chosen by `ROLLFLEET_SANDBOX` (see [`SandboxMode`]):
//!
//! - **namespaces** (the default wherever it works): the interpreter runs under bubblewrap
//!   (`bwrap`) in new user, PID, network, IPC, UTS and cgroup namespaces, as uid/gid 65534 with
//!   every capability dropped, further user namespaces disabled, and a file system made of `/usr`
//!   (and the distro's `/bin`, `/lib*` links) read-only, a fresh `/proc`, a minimal `/dev`, a
//!   small tmpfs `/tmp`, and the run directory bound read-write at `/work`; no `/etc`, no host
//!   home directories, no host network. `bwrap` is PID 1 of the namespace, so killing it (its
//!   process group) kills every process of the run, `setsid` daemons included.
//! - **process**: the older process-level sandbox, for places without user namespaces (inside
//!   AWS Lambda the Firecracker microVM is the boundary). It shares the kernel, the network and
//!   the file system with the host and is defence in depth only.
//!
//! In both, each run gets its own directory (mode 0700, owned by whoever the code runs as,
//! removed afterwards), and a small Python wrapper (below) sets the resource limits on itself
//! before it runs the user's file, so no `unsafe` `pre_exec` is needed on the Rust side:
//! - `RLIMIT_CPU` (CPU seconds), `RLIMIT_AS` (address space), `RLIMIT_FSIZE` (largest file it
//!   may write), `RLIMIT_NOFILE`, `RLIMIT_CORE = 0`, and `RLIMIT_NPROC` against fork bombs;
//! - when started as root (process mode only) it drops to `nobody` (65534) first, because the
//!   kernel does not enforce `RLIMIT_NPROC` for root and root could read every file on the machine;
//! - a Python audit hook refuses `open` outside the run directory (reads are also allowed under
//!   the interpreter's own library paths), and refuses `subprocess`/`os.system`/`exec`/spawn,
//!   sockets and `ctypes`. Code in the same interpreter can switch the hook off, so it is a
//!   tripwire, not a wall.
//!
//! The Rust side enforces a wall-clock limit by killing the whole process group, caps each of
//! stdout and stderr at a byte limit (the group is killed as soon as one is exceeded), and kills
//! the group again after a normal exit. See `docs/serverless.md` for what each mode holds against.

use std::ffi::{OsStr, OsString};
use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

/// Runs inside the child before the user's code: limits, privilege drop, audit hook.
const WRAPPER: &str = r#"
import json, os, resource, sys, runpy
cfg = json.loads(sys.argv[1])
work = os.path.realpath(os.getcwd())
def lim(res, value):
    soft, hard = resource.getrlimit(res)
    if hard != resource.RLIM_INFINITY and hard < value:
        value = hard
    resource.setrlimit(res, (value, value))
lim(resource.RLIMIT_CPU, cfg["cpu_seconds"])
lim(resource.RLIMIT_AS, cfg["memory_bytes"])
lim(resource.RLIMIT_FSIZE, cfg["max_file_bytes"])
lim(resource.RLIMIT_NOFILE, 64)
lim(resource.RLIMIT_CORE, 0)
if os.geteuid() == 0:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
lim(resource.RLIMIT_NPROC, cfg["max_processes"])
read_roots = [work] + [os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)]
read_roots += ["/dev/null", "/dev/urandom", "/dev/zero"]
write_roots = [work, "/dev/null"]
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
BLOCKED = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
           "socket.connect", "socket.bind", "socket.sendto", "ctypes.dlopen", "os.chroot",
           "os.setuid", "os.setgid", "os.setreuid", "os.setregid")
def inside(path, roots):
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)
busy = [False]
def hook(event, args):
    if busy[0]:
        return
    if event in BLOCKED:
        raise PermissionError("sandbox: %s is not allowed" % event)
    if event != "open":
        return
    path, mode, flags = args
    if path is None or isinstance(path, int):
        return
    busy[0] = True
    try:
        real = os.path.realpath(os.fsdecode(path))
    finally:
        busy[0] = False
    writing = bool((flags or 0) & WRITE_FLAGS) or (isinstance(mode, str) and any(c in mode for c in "wax+"))
    if not inside(real, write_roots if writing else read_roots):
        raise PermissionError("sandbox: access to %s is not allowed" % real)
sys.addaudithook(hook)
sys.argv = ["main.py"]
sys.path.insert(0, work)
runpy.run_path("main.py", run_name="__main__")
"#;

/// Limits for one sandboxed run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SandboxLimits {
    pub cpu_seconds: u64,
    pub wall_time_ms: u64,
    pub memory_bytes: u64,
    pub max_processes: u64,
    pub max_file_bytes: u64,
    pub max_output_bytes: usize,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        Self {
            cpu_seconds: 5,
            wall_time_ms: 10_000,
            memory_bytes: 512 << 20,
            max_processes: 32,
            max_file_bytes: 16 << 20,
            max_output_bytes: 1 << 20,
        }
    }
}

impl SandboxLimits {
    /// Clamps caller-supplied limits to what a reward function may ask for, so a payload
    /// cannot lift the host's limits.
    pub fn clamped_to(self, max: &SandboxLimits) -> SandboxLimits {
        // `min` then `max(floor)` rather than `clamp`: `clamp` panics when the host's own limit
        // is below the floor, and a misconfigured host must not panic on a payload.
        SandboxLimits {
            cpu_seconds: self.cpu_seconds.min(max.cpu_seconds).max(1),
            wall_time_ms: self.wall_time_ms.min(max.wall_time_ms).max(1),
            // Python itself needs some address space; below this it cannot start at all.
            memory_bytes: self
                .memory_bytes
                .min(max.memory_bytes)
                .max((64 << 20).min(max.memory_bytes)),
            max_processes: self.max_processes.min(max.max_processes).max(1),
            max_file_bytes: self.max_file_bytes.min(max.max_file_bytes),
            max_output_bytes: self.max_output_bytes.min(max.max_output_bytes).max(1),
        }
    }
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", content = "value", rename_all = "snake_case")]
pub enum Termination {
    /// The process exited on its own with this code.
    Exited(i32),
    /// The process was killed by this signal (SIGXCPU/SIGKILL for CPU limits, SIGSEGV, ...).
    Signaled(i32),
    /// The wall-clock limit passed; the process group was killed.
    WallTimeout,
    /// stdout or stderr went over the byte limit; the process group was killed.
    OutputLimit,
}

/// What a run produced.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SandboxOutput {
    pub termination: Termination,
    pub stdout: String,
    pub stderr: String,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub wall_ms: u64,
}

impl SandboxOutput {
    pub fn succeeded(&self) -> bool {
        self.termination == Termination::Exited(0)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("could not prepare the sandbox directory: {0}")]
    TempDir(#[source] std::io::Error),
    #[error("could not start {python}: {source}")]
    Spawn {
        python: String,
        #[source]
        source: std::io::Error,
    },
    #[error("could not wait for the sandboxed process: {0}")]
    Wait(#[source] std::io::Error),
    #[error("the sandbox is not usable: {0}")]
    Unavailable(String),
    #[error("the interpreter {python} cannot be mounted in the namespace sandbox: {reason}")]
    Interpreter { python: String, reason: String },
}

/// The isolation asked for, from `ROLLFLEET_SANDBOX` (`auto`, `namespaces` or `process`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxMode {
    /// Namespaces when `bwrap` works here, else the process sandbox with a warning.
    Auto,
    /// Namespaces or nothing: runs fail with [`SandboxError::Unavailable`] without them.
    Namespaces,
    /// The process-level sandbox only, for hosts that are themselves the boundary.
    Process,
}

impl SandboxMode {
    /// The environment variable that chooses the mode.
    pub const ENV: &'static str = "ROLLFLEET_SANDBOX";

    /// The mode `ROLLFLEET_SANDBOX` asks for; unset or empty is `auto`.
    pub fn from_env() -> Result<Self, SandboxError> {
        match std::env::var(Self::ENV) {
            Ok(value) => value.parse(),
            Err(std::env::VarError::NotPresent) => Ok(Self::Auto),
            Err(std::env::VarError::NotUnicode(_)) => Err(SandboxError::Unavailable(format!(
                "{} is not valid UTF-8",
                Self::ENV
            ))),
        }
    }
}

impl std::str::FromStr for SandboxMode {
    type Err = SandboxError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "" | "auto" => Ok(Self::Auto),
            "namespaces" => Ok(Self::Namespaces),
            "process" => Ok(Self::Process),
            other => Err(SandboxError::Unavailable(format!(
                "{}={other:?} is not one of auto, namespaces, process",
                Self::ENV
            ))),
        }
    }
}

/// The isolation a [`Sandbox`] actually runs code under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Isolation {
    /// bubblewrap: own user, PID, network, IPC, UTS and cgroup namespaces and a minimal
    /// read-only file system.
    Namespaces,
    /// rlimits, a drop to `nobody` and the audit hook, sharing the host's kernel, network and
    /// file system.
    Process,
}

impl std::fmt::Display for Isolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Isolation::Namespaces => "namespaces (bubblewrap)",
            Isolation::Process => "process (rlimits, nobody, audit hook; not a boundary)",
        })
    }
}

/// A Python interpreter and the limits to run code under.
#[derive(Debug, Clone)]
pub struct Sandbox {
    python: PathBuf,
    limits: SandboxLimits,
    mode: SandboxMode,
    /// Resolved once at construction; an `Err` makes every run fail with that reason.
    isolation: Result<Isolation, String>,
}

impl Sandbox {
    /// Uses `ROLLFLEET_SANDBOX_PYTHON` if set, else the system `/usr/bin/python3`, else the
    /// first `python3` on `PATH`, under the isolation `ROLLFLEET_SANDBOX` asks for. A system
    /// interpreter is preferred because the namespace sandbox mounts only `/usr`, and after the
    /// drop to `nobody` in the process sandbox the library must still be readable.
    pub fn new(limits: SandboxLimits) -> Self {
        let python = std::env::var_os("ROLLFLEET_SANDBOX_PYTHON")
            .map(PathBuf::from)
            .or_else(|| {
                let system = Path::new("/usr/bin/python3");
                system.exists().then(|| system.to_path_buf())
            })
            .unwrap_or_else(|| PathBuf::from("python3"));
        Self::with_python(python, limits)
    }

    pub fn with_python(python: impl Into<PathBuf>, limits: SandboxLimits) -> Self {
        let (mode, isolation) = match SandboxMode::from_env() {
            Ok(mode) => (mode, resolve_isolation(mode)),
            // An unknown mode fails closed: guessing could silently drop the boundary.
            Err(e) => (SandboxMode::Namespaces, Err(e.to_string())),
        };
        Self {
            python: python.into(),
            limits,
            mode,
            isolation,
        }
    }

    /// The same interpreter and limits under the isolation `mode` asks for, whatever
    /// `ROLLFLEET_SANDBOX` says.
    pub fn with_mode(&self, mode: SandboxMode) -> Self {
        Self {
            python: self.python.clone(),
            limits: self.limits,
            mode,
            isolation: resolve_isolation(mode),
        }
    }

    /// The same interpreter and isolation under other limits.
    pub fn with_limits(&self, limits: SandboxLimits) -> Self {
        Self {
            limits,
            ..self.clone()
        }
    }

    pub fn limits(&self) -> &SandboxLimits {
        &self.limits
    }

    /// The mode this sandbox was asked for.
    pub fn mode(&self) -> SandboxMode {
        self.mode
    }

    /// The isolation runs use, or why none is usable (`namespaces` was required and `bwrap`
    /// does not work here, or `ROLLFLEET_SANDBOX` is not a known mode).
    pub fn isolation(&self) -> Result<Isolation, SandboxError> {
        self.isolation.clone().map_err(SandboxError::Unavailable)
    }

    /// Runs `code` as `main.py` in a fresh directory with `stdin` as its standard input.
    pub fn run(&self, code: &str, stdin: &[u8]) -> Result<SandboxOutput, SandboxError> {
        let isolation = self.isolation()?;
        let dir = tempfile::Builder::new()
            .prefix("rollfleet-sandbox-")
            .tempdir()
            .map_err(SandboxError::TempDir)?;
        let main = dir.path().join("main.py");
        std::fs::write(&main, code).map_err(SandboxError::TempDir)?;
        // Only the run itself may enter its directory: another run, or a daemon left behind by
        // one, must not read or replace this run's files.
        set_mode(dir.path(), 0o700)?;
        set_mode(&main, 0o600)?;
        let as_root = nix::unistd::geteuid().is_root();
        if as_root {
            // The code runs as `nobody` in both modes (see `run_as_nobody`); the directory
            // becomes theirs rather than everyone's.
            for path in [dir.path(), main.as_path()] {
                std::os::unix::fs::chown(path, Some(NOBODY), Some(NOBODY))
                    .map_err(SandboxError::TempDir)?;
            }
        }

        let cfg = serde_json::json!({
            "cpu_seconds": self.limits.cpu_seconds,
            "memory_bytes": self.limits.memory_bytes,
            "max_processes": self.limits.max_processes,
            "max_file_bytes": self.limits.max_file_bytes,
        })
        .to_string();

        let mut command = match isolation {
            Isolation::Namespaces => {
                // Inside the user namespace uid 65534 maps to the uid bwrap runs as outside:
                // ours, or `nobody` when we are root. Either way the run owns its directory.
                let bwrap = match probe() {
                    Ok(bwrap) => bwrap,
                    Err(reason) => return Err(SandboxError::Unavailable(reason.clone())),
                };
                let python = self.interpreter()?;
                let extra =
                    interpreter_mounts(&python).map_err(|reason| SandboxError::Interpreter {
                        python: python.display().to_string(),
                        reason,
                    })?;
                let mut command = Command::new(&bwrap.path);
                command
                    .args(bwrap.args(Some(dir.path()), &extra, &self.limits))
                    .arg(&python)
                    .env_clear();
                if as_root {
                    run_as_nobody(&mut command);
                }
                command
            }
            Isolation::Process => {
                // As root, the wrapper itself drops to `nobody` after setting its limits.
                let mut command = Command::new(&self.python);
                command
                    .current_dir(dir.path())
                    .env_clear()
                    .env("PATH", "/usr/local/bin:/usr/bin:/bin")
                    .env("HOME", dir.path())
                    .env("PYTHONDONTWRITEBYTECODE", "1")
                    .env("PYTHONIOENCODING", "utf-8");
                command
            }
        };

        let started = Instant::now();
        let mut child = command
            .arg("-I")
            .arg("-c")
            .arg(WRAPPER)
            .arg(cfg)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // In namespace mode this group holds `bwrap`, whose death takes the whole PID
            // namespace with it; in process mode it holds the interpreter and its children.
            .process_group(0)
            .spawn()
            .map_err(|source| SandboxError::Spawn {
                python: self.python.display().to_string(),
                source,
            })?;
        let pgid = i32::try_from(child.id()).ok().map(Pid::from_raw);

        let over_limit = Arc::new(AtomicBool::new(false));
        let limit = self.limits.max_output_bytes;
        let stdout = child
            .stdout
            .take()
            .map(|s| Capture::start(s, limit, over_limit.clone()));
        let stderr = child
            .stderr
            .take()
            .map(|s| Capture::start(s, limit, over_limit.clone()));
        if let Some(mut pipe) = child.stdin.take() {
            let input = stdin.to_vec();
            // A child that never reads its input must not block us: write from a thread, and
            // a broken pipe just means the child exited or closed stdin.
            std::thread::spawn(move || {
                let _ = pipe.write_all(&input);
            });
        }

        let deadline = started + Duration::from_millis(self.limits.wall_time_ms);
        let mut pause = Duration::from_micros(500);
        let termination = loop {
            if let Some(status) = child.try_wait().map_err(SandboxError::Wait)? {
                break exit_termination(status, isolation);
            }
            if over_limit.load(Ordering::Relaxed) {
                kill_group(pgid);
                let _ = child.wait();
                break Termination::OutputLimit;
            }
            if Instant::now() >= deadline {
                kill_group(pgid);
                let _ = child.wait();
                break Termination::WallTimeout;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(10));
        };
        // Background children of the user's code would otherwise outlive the run. Under
        // namespaces `bwrap` has already exited and the kernel killed its PID namespace with
        // it; in process mode this misses children that left the group with `setsid`.
        kill_group(pgid);
        let wall_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let (stdout, stdout_truncated) = stdout.map(Capture::finish).unwrap_or_default();
        let (stderr, stderr_truncated) = stderr.map(Capture::finish).unwrap_or_default();
        let termination =
            if termination != Termination::OutputLimit && (stdout_truncated || stderr_truncated) {
                Termination::OutputLimit
            } else {
                termination
            };
        Ok(SandboxOutput {
            termination,
            stdout,
            stderr,
            stdout_truncated,
            stderr_truncated,
            wall_ms,
        })
    }

    /// The interpreter as an absolute, symlink-free path, so it can be mounted and named inside
    /// the namespace, and so a missing interpreter is an error rather than a failing run.
    fn interpreter(&self) -> Result<PathBuf, SandboxError> {
        let not_found = |source| SandboxError::Spawn {
            python: self.python.display().to_string(),
            source,
        };
        let found = if self.python.components().count() > 1 {
            self.python.clone()
        } else {
            find_on_path(&self.python).ok_or_else(|| {
                not_found(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "not found on PATH",
                ))
            })?
        };
        std::fs::canonicalize(found).map_err(not_found)
    }
}

/// uid and gid of `nobody`, which sandboxed code runs as.
const NOBODY: u32 = 65534;

/// The top-level entries of `/` that `/usr` alone does not provide: on merged-`/usr` systems
/// they are symlinks into it, elsewhere directories mounted read-only.
const ROOT_LINKS: [&str; 6] = ["bin", "sbin", "lib", "lib32", "lib64", "libx32"];

/// A `bwrap` that was seen to work here, and the optional flags it accepts.
#[derive(Debug)]
struct Bwrap {
    path: PathBuf,
    disable_userns: bool,
    tmpfs_size: bool,
}

impl Bwrap {
    /// Everything before the interpreter's path on the `bwrap` command line.
    fn args(
        &self,
        work: Option<&Path>,
        extra_ro: &[PathBuf],
        limits: &SandboxLimits,
    ) -> Vec<OsString> {
        let mut args: Vec<OsString> = Vec::new();
        let mut push = |items: &[&OsStr]| args.extend(items.iter().map(|s| s.to_os_string()));
        push(&[
            "--unshare-all".as_ref(),
            // `--unshare-all` only tries the user namespace; without it `--uid` fails and, as
            // root, the run would keep real capabilities.
            "--unshare-user".as_ref(),
            "--die-with-parent".as_ref(),
            "--new-session".as_ref(),
            "--uid".as_ref(),
            "65534".as_ref(),
            "--gid".as_ref(),
            "65534".as_ref(),
            "--hostname".as_ref(),
            "sandbox".as_ref(),
            "--cap-drop".as_ref(),
            "ALL".as_ref(),
        ]);
        if self.disable_userns {
            push(&["--disable-userns".as_ref()]);
        }
        push(&["--ro-bind".as_ref(), "/usr".as_ref(), "/usr".as_ref()]);
        for name in ROOT_LINKS {
            let host = Path::new("/").join(name);
            let Ok(meta) = std::fs::symlink_metadata(&host) else {
                continue;
            };
            if meta.file_type().is_symlink() {
                if let Ok(target) = std::fs::read_link(&host) {
                    push(&["--symlink".as_ref(), target.as_os_str(), host.as_os_str()]);
                }
            } else if meta.is_dir() {
                push(&["--ro-bind".as_ref(), host.as_os_str(), host.as_os_str()]);
            }
        }
        for path in extra_ro {
            push(&["--ro-bind".as_ref(), path.as_os_str(), path.as_os_str()]);
        }
        push(&[
            "--proc".as_ref(),
            "/proc".as_ref(),
            "--dev".as_ref(),
            "/dev".as_ref(),
        ]);
        let tmp_bytes = limits.max_file_bytes.max(1 << 20).to_string();
        if self.tmpfs_size {
            push(&["--size".as_ref(), tmp_bytes.as_ref()]);
        }
        push(&["--tmpfs".as_ref(), "/tmp".as_ref()]);
        if let Some(work) = work {
            push(&["--bind".as_ref(), work.as_os_str(), "/work".as_ref()]);
            push(&["--chdir".as_ref(), "/work".as_ref()]);
        }
        push(&[
            // The root is bwrap's own tmpfs; nothing but /work and /tmp needs to be writable.
            "--remount-ro".as_ref(),
            "/".as_ref(),
            "--clearenv".as_ref(),
            "--setenv".as_ref(),
            "PATH".as_ref(),
            "/usr/bin:/bin".as_ref(),
            "--setenv".as_ref(),
            "HOME".as_ref(),
            "/work".as_ref(),
            "--setenv".as_ref(),
            "PYTHONDONTWRITEBYTECODE".as_ref(),
            "1".as_ref(),
            "--setenv".as_ref(),
            "PYTHONIOENCODING".as_ref(),
            "utf-8".as_ref(),
            "--".as_ref(),
        ]);
        args
    }
}

/// Whether the namespace sandbox works on this machine, checked once per process by running
/// `true` under the same `bwrap` options a real run uses.
fn probe() -> &'static Result<Bwrap, String> {
    static PROBE: OnceLock<Result<Bwrap, String>> = OnceLock::new();
    PROBE.get_or_init(|| {
        let path = find_on_path(Path::new("bwrap"))
            .ok_or_else(|| "bwrap (Debian package bubblewrap) is not installed".to_owned())?;
        let mut bwrap = Bwrap {
            path,
            disable_userns: true,
            tmpfs_size: true,
        };
        // Older bwrap releases lack some of the optional flags; drop what they reject.
        loop {
            let mut command = Command::new(&bwrap.path);
            command
                .args(bwrap.args(None, &[], &SandboxLimits::default()))
                .arg("true")
                .env_clear()
                .stdin(Stdio::null());
            if nix::unistd::geteuid().is_root() {
                run_as_nobody(&mut command);
            }
            let output = command
                .output()
                .map_err(|e| format!("could not run {}: {e}", bwrap.path.display()))?;
            if output.status.success() {
                return Ok(bwrap);
            }
            let stderr = String::from_utf8_lossy(&output.stderr).trim().to_owned();
            if bwrap.disable_userns && stderr.contains("--disable-userns") {
                bwrap.disable_userns = false;
            } else if bwrap.tmpfs_size && stderr.contains("--size") {
                bwrap.tmpfs_size = false;
            } else {
                return Err(format!(
                    "{} does not work here (are unprivileged user namespaces enabled?): {stderr}",
                    bwrap.path.display()
                ));
            }
        }
    })
}

/// Starts `command` as `nobody` rather than root. bwrap maps the sandbox's uid to the uid it
/// runs as, and the kernel exempts the host's root from `RLIMIT_NPROC` even inside a user
/// namespace, so a run mapped to root could fork without bound.
fn run_as_nobody(command: &mut Command) {
    // The standard library also clears the supplementary groups when root changes uid.
    command.uid(NOBODY).gid(NOBODY);
}

fn resolve_isolation(mode: SandboxMode) -> Result<Isolation, String> {
    match mode {
        SandboxMode::Process => Ok(Isolation::Process),
        SandboxMode::Namespaces => match probe() {
            Ok(_) => Ok(Isolation::Namespaces),
            Err(reason) => Err(format!(
                "{}=namespaces requires the namespace sandbox: {reason}",
                SandboxMode::ENV
            )),
        },
        SandboxMode::Auto => match probe() {
            Ok(_) => Ok(Isolation::Namespaces),
            Err(reason) => {
                static WARNED: Once = Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        %reason,
                        "code sandbox: namespaces unavailable, falling back to the process \
                         sandbox, which is not a security boundary (set {}=namespaces to \
                         require them)",
                        SandboxMode::ENV
                    );
                });
                Ok(Isolation::Process)
            }
        },
    }
}

/// Read-only mounts an interpreter outside `/usr` needs: its installation prefix (the
/// directory above its `bin`).
fn interpreter_mounts(python: &Path) -> Result<Vec<PathBuf>, String> {
    if python.starts_with("/usr") {
        return Ok(Vec::new());
    }
    match python.parent().and_then(Path::parent) {
        // Mounting `/` or a top-level directory would hand the host's file system to the run.
        Some(prefix) if prefix.components().count() > 2 => Ok(vec![prefix.to_path_buf()]),
        _ => Err("it is neither under /usr nor inside an installation prefix".to_owned()),
    }
}

fn find_on_path(name: &Path) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

fn set_mode(path: &Path, mode: u32) -> Result<(), SandboxError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(SandboxError::TempDir)
}

fn exit_termination(status: ExitStatus, isolation: Isolation) -> Termination {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        // bwrap reports a child killed by signal N as exit status 128 + N.
        (Some(code), _) if isolation == Isolation::Namespaces && (129..=192).contains(&code) => {
            Termination::Signaled(code - 128)
        }
        (Some(code), _) => Termination::Exited(code),
        (None, Some(sig)) => Termination::Signaled(sig),
        (None, None) => Termination::Exited(-1),
    }
}

fn kill_group(pgid: Option<Pid>) {
    if let Some(pgid) = pgid {
        // ESRCH (group already gone) is the normal case after a clean exit.
        let _ = killpg(pgid, Signal::SIGKILL);
    }
}

/// Reads one output pipe on a thread, keeping at most `limit` bytes.
struct Capture {
    buf: Arc<Mutex<(Vec<u8>, bool)>>,
    done: std::sync::mpsc::Receiver<()>,
}

impl Capture {
    fn start(mut pipe: impl Read + Send + 'static, limit: usize, over: Arc<AtomicBool>) -> Self {
        let buf = Arc::new(Mutex::new((Vec::new(), false)));
        let shared = buf.clone();
        let (tx, done) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut chunk = [0u8; 16 * 1024];
            loop {
                match pipe.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        let Ok(mut guard) = shared.lock() else { break };
                        let room = limit.saturating_sub(guard.0.len());
                        if n > room {
                            guard.0.extend_from_slice(&chunk[..room]);
                            guard.1 = true;
                            over.store(true, Ordering::Relaxed);
                            break;
                        }
                        guard.0.extend_from_slice(&chunk[..n]);
                    }
                }
            }
            let _ = tx.send(());
        });
        Self { buf, done }
    }

    /// What was captured. Waits briefly for the reader to see end-of-file; a descendant that
    /// escaped the process group may hold the pipe open, and must not hang the caller.
    fn finish(self) -> (String, bool) {
        let _ = self.done.recv_timeout(Duration::from_millis(500));
        let (bytes, truncated) = match self.buf.lock() {
            Ok(g) => (g.0.clone(), g.1),
            Err(poisoned) => {
                let g = poisoned.into_inner();
                (g.0.clone(), g.1)
            }
        };
        (String::from_utf8_lossy(&bytes).into_owned(), truncated)
    }
}

/// One stdin/expected-stdout case (competitive-programming style).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IoCase {
    #[serde(default)]
    pub stdin: String,
    pub expected_stdout: String,
}

/// The tests a solution is judged against.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CodeTests {
    /// Each case runs the program with the given stdin and compares stdout.
    Io(Vec<IoCase>),
    /// Each snippet (e.g. `assert add(1, 2) == 3`) is appended to the solution and run on its
    /// own; the case passes when the program exits with status 0.
    Unit(Vec<String>),
}

impl CodeTests {
    pub fn len(&self) -> usize {
        match self {
            CodeTests::Io(c) => c.len(),
            CodeTests::Unit(c) => c.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The outcome of one test case.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CaseReport {
    pub passed: bool,
    /// `None` when the case was not run because the time budget was spent.
    pub termination: Option<Termination>,
    /// The last part of stderr, for debugging failed solutions.
    pub stderr_tail: String,
}

/// The outcome of a whole test suite.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CodeTestReport {
    pub passed: usize,
    pub total: usize,
    pub cases: Vec<CaseReport>,
}

impl CodeTestReport {
    /// Fraction of cases passed (0 for an empty suite).
    pub fn pass_rate(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.passed as f64 / self.total as f64
        }
    }
}

/// Runs `code` against every case, each in its own sandboxed process. Cases that would start
/// after `budget` has elapsed are not run and count as failed, so one call stays bounded.
pub fn run_code_tests(
    sandbox: &Sandbox,
    code: &str,
    tests: &CodeTests,
    budget: Duration,
) -> Result<CodeTestReport, SandboxError> {
    let started = Instant::now();
    let mut cases = Vec::with_capacity(tests.len());
    let n = tests.len();
    for i in 0..n {
        if started.elapsed() >= budget {
            cases.push(CaseReport {
                passed: false,
                termination: None,
                stderr_tail: "not run: time budget spent".to_owned(),
            });
            continue;
        }
        let (out, passed) = match tests {
            CodeTests::Io(c) => {
                let case = &c[i];
                let out = sandbox.run(code, case.stdin.as_bytes())?;
                let ok = out.succeeded() && same_output(&out.stdout, &case.expected_stdout);
                (out, ok)
            }
            CodeTests::Unit(c) => {
                let program = format!("{code}\n\n{}\n", c[i]);
                let out = sandbox.run(&program, b"")?;
                let ok = out.succeeded();
                (out, ok)
            }
        };
        cases.push(CaseReport {
            passed,
            termination: Some(out.termination),
            stderr_tail: tail(&out.stderr, 512),
        });
    }
    Ok(CodeTestReport {
        passed: cases.iter().filter(|c| c.passed).count(),
        total: n,
        cases,
    })
}

/// Outputs compare equal up to trailing whitespace on each line and trailing blank lines.
fn same_output(got: &str, want: &str) -> bool {
    let norm = |s: &str| -> Vec<String> {
        let mut lines: Vec<String> = s.lines().map(|l| l.trim_end().to_owned()).collect();
        while lines.last().is_some_and(String::is_empty) {
            lines.pop();
        }
        lines
    };
    norm(got) == norm(want)
}

fn tail(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut start = s.len() - max;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    s[start..].to_owned()
}
