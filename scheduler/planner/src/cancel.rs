//! Stopping a plan midway: a caller that may have to give up on a plan (a scheduler told to
//! stop while it plans a job) runs the planning [`within`] a flag it can set from another
//! thread; the search checks [`requested`] at every node and gives up, and [`crate::plan()`]
//! then answers [`crate::PlanError::Cancelled`].
//!
//! The flag is held per thread for the length of the call, rather than passed down, so that the
//! crates between the caller and the search (the simulator's placement choice) need not carry
//! it. Without a flag (or with one never set) a plan is what it always is: the crate stays
//! deterministic.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

thread_local! {
    static FLAG: RefCell<Option<Arc<AtomicBool>>> = const { RefCell::new(None) };
}

/// Runs `f` (planning on this thread) with `flag` as its cancellation flag: once the flag is
/// set, from any thread, [`requested`] is true on this one until `f` returns.
pub fn within<T>(flag: &Arc<AtomicBool>, f: impl FnOnce() -> T) -> T {
    let before = FLAG.with(|cell| cell.replace(Some(flag.clone())));
    // Put back on the way out, even by a panic: a thread of a pool is used again.
    struct Restore(Option<Option<Arc<AtomicBool>>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(before) = self.0.take() {
                FLAG.with(|cell| cell.replace(before));
            }
        }
    }
    let _restore = Restore(Some(before));
    f()
}

/// Whether the planning on this thread was asked to stop.
pub fn requested() -> bool {
    FLAG.with(|cell| {
        cell.borrow()
            .as_ref()
            .is_some_and(|flag| flag.load(Ordering::Relaxed))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flag_counts_only_within_its_call_and_on_its_thread() {
        let flag = Arc::new(AtomicBool::new(true));
        assert!(!requested());
        assert!(within(&flag, requested));
        assert!(!requested());
        let other = std::thread::spawn(requested).join().unwrap_or(true);
        assert!(!other);
    }
}
