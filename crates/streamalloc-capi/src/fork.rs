//! `fork()` and the library. A child forked while another thread of the parent was inside the
//! library inherits the library's locks as that thread held them, and nothing in the child
//! will ever release them: its first call, or the trace's flush at its exit, would wait
//! forever. CUDA cannot be used in a forked child anyway (the parent's contexts are not the
//! child's). So a `pthread_atfork` handler, registered when the library is loaded, marks a
//! child forked once the library was in use, and there every call fails at once
//! ([`check`], before any lock is touched) and the exit-time cleanup does nothing.
//!
//! A child forked before the library was first used (a worker of a parent that only loaded
//! it) inherits nothing it could wait on, and may use the library.

use std::sync::atomic::{AtomicBool, Ordering};

use core_alloc::{Error, Result};

/// Set before the library's state is first built (or configured): from then on a forked
/// child may inherit its locks held.
static IN_USE: AtomicBool = AtomicBool::new(false);

/// Whether this process is a child forked after the library came into use.
static FORKED: AtomicBool = AtomicBool::new(false);

/// The `pthread_atfork` child handler: only atomics, as is allowed in a forked child.
extern "C" fn in_child() {
    if IN_USE.load(Ordering::Relaxed) {
        FORKED.store(true, Ordering::Relaxed);
    }
}

/// Registers [`in_child`] when the library is loaded (before any thread can be inside it).
extern "C" fn register() {
    // SAFETY: `in_child` is an `extern "C"` function that only touches atomics and never
    // unwinds; registering it has no other precondition. glibc unregisters it if the library
    // is unloaded. A failure (ENOMEM) leaves forked children as they were before this module.
    unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
}

/// Runs [`register`] when the library is loaded, as a C constructor would.
#[used]
#[cfg_attr(any(target_os = "linux", target_os = "android"), link_section = ".init_array")]
#[cfg_attr(target_vendor = "apple", link_section = "__DATA,__mod_init_func")]
static REGISTER: extern "C" fn() = register;

/// Notes that the library's state is about to be built (call before touching it).
pub(crate) fn note_use() {
    IN_USE.store(true, Ordering::Relaxed);
}

/// Whether this process is a child forked after the library came into use.
pub(crate) fn forked() -> bool {
    FORKED.load(Ordering::Relaxed)
}

/// Fails in a child forked after the library came into use; touches no lock.
pub(crate) fn check() -> Result<()> {
    if forked() {
        return Err(Error::Unsupported(
            "CUDA cannot be used in a forked child; streamalloc refuses calls after fork (the library \
             was in use in the parent; a child forked before its first use may use it)"
                .into(),
        ));
    }
    Ok(())
}
