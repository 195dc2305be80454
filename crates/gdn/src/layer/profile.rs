//! Stage times of the layer's forward and backward, for benchmarks (`gdn bench`).
//!
//! The layer marks the end of each stage (in_proj, prep, rule, norm, out_proj and their
//! backward); with `GDN_PROFILE` set it prints them to stderr, and inside [`capture`] it also
//! hands them to the caller. Either way each mark synchronizes the GPU, so a profiled pass is
//! slower than an unprofiled one: time the step without it, and use this only for the split.

use std::cell::RefCell;

/// One stage: the layer's name for it and its wall time in milliseconds (after a GPU sync).
pub type Stage = (&'static str, f64);

thread_local! {
    static CAPTURE: RefCell<Option<Vec<Stage>>> = const { RefCell::new(None) };
}

/// Run `f` (forward and / or backward calls of a layer on this thread) and return its result with
/// the stages they went through, in order.
pub fn capture<R>(f: impl FnOnce() -> R) -> (R, Vec<Stage>) {
    let outer = CAPTURE.with(|c| c.borrow_mut().replace(Vec::new()));
    let r = f();
    let stages = CAPTURE.with(|c| std::mem::replace(&mut *c.borrow_mut(), outer));
    (r, stages.unwrap_or_default())
}

/// Whether a [`capture`] is under way on this thread.
pub(crate) fn capturing() -> bool {
    CAPTURE.with(|c| c.borrow().is_some())
}

/// Hand the stages of one forward or backward to the [`capture`] under way, if any.
pub(crate) fn record(stages: &[Stage]) {
    CAPTURE.with(|c| {
        if let Some(v) = c.borrow_mut().as_mut() {
            v.extend_from_slice(stages);
        }
    });
}
