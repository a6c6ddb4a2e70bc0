//! Child processes of a test, killed and reaped when the test ends, however it ends (a failed
//! assertion unwinds through the drop), so no scheduler or worker outlives its test; and the
//! bounded wait for one to exit.

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// The processes a test started.
pub struct Procs(pub Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits for `child` to exit, failing the test after `limit`.
pub fn wait_exit(child: &mut Child, limit: Duration) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            start.elapsed() < limit,
            "the process did not exit within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
