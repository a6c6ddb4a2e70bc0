//! Child processes of a test, killed and reaped when the test ends, however it ends (a failed
//! assertion unwinds through the drop), so no scheduler or worker outlives its test.

use std::process::Child;

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
