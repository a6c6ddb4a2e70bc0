//! What the sandbox's test files share.

/// Switches the wrapper's audit hook off through the garbage collector, then proves it is off
/// by opening a file the hook refuses.
pub const HOOK_OFF: &str = r#"
import gc, types
for _f in gc.get_objects():
    if isinstance(_f, types.FunctionType) and _f.__name__ == "hook" and "busy" in _f.__globals__:
        _f.__globals__["busy"][0] = True
open("/proc/self/status").close()
print("hook-off", flush=True)
"#;

/// `body` run by a fresh interpreter whose command line carries `marker`, so that `pgrep -f`
/// finds every process of the run and its children (the wrapper's own command line is the same
/// for every run). The audit hook refuses `exec`, so it is switched off first, as an attacker
/// would: what such a test checks is that nothing outlives the run, not the hook.
#[allow(dead_code)] // each test file includes this module and uses part of it
pub fn marked(marker: &str, body: &str) -> String {
    format!(
        "{HOOK_OFF}\nimport os, sys\nos.execv(sys.executable, [sys.executable, '-c', {body:?}, \
         '{marker}'])\n"
    )
}
