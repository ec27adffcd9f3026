//! Status codes, the thread-local last error, and the guards that keep
//! errors and panics from crossing the C boundary.

use std::cell::RefCell;
use std::ffi::{CStr, CString};
use std::os::raw::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};

use core_alloc::{Error, Result};

/// What a C API call returns. The variants are named as C sees them.
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamallocStatus {
    /// Success.
    STREAMALLOC_OK = 0,
    /// The device or the allocator is out of memory (the message has the figures).
    STREAMALLOC_OUT_OF_MEMORY = 1,
    /// An argument was rejected: null output pointer, negative or absurd size, unknown
    /// device, or a pointer that is not a live allocation (double free).
    STREAMALLOC_INVALID_ARGUMENT = 2,
    /// A CUDA driver call failed.
    STREAMALLOC_DRIVER_ERROR = 3,
    /// The CUDA driver could not be loaded.
    STREAMALLOC_NO_DRIVER = 4,
    /// The configured `limit` would be exceeded.
    STREAMALLOC_LIMIT_EXCEEDED = 5,
    /// A bounded wait (e.g. `retry_timeout`) ran out.
    STREAMALLOC_TIMEOUT = 6,
    /// The configured strategy or device does not offer this; or the process is a child
    /// forked after the library came into use, where every call fails so, at once (CUDA cannot
    /// be used there, and the parent's other threads may have held the library's locks).
    STREAMALLOC_UNSUPPORTED = 7,
    /// The configuration (`STREAMALLOC_CONF` or `streamalloc_configure`) is bad or conflicts.
    STREAMALLOC_CONFIG_ERROR = 8,
    /// Writing the trace file failed.
    STREAMALLOC_IO_ERROR = 9,
    /// A bug in streamalloc: one of its invariants broken, or a panic caught at the boundary.
    STREAMALLOC_INTERNAL = 10,
}

impl StreamallocStatus {
    fn of(e: &Error) -> Self {
        match e {
            Error::OutOfMemory(_) => Self::STREAMALLOC_OUT_OF_MEMORY,
            Error::InvalidArgument(_) => Self::STREAMALLOC_INVALID_ARGUMENT,
            Error::Internal(_) => Self::STREAMALLOC_INTERNAL,
            Error::Driver { .. } => Self::STREAMALLOC_DRIVER_ERROR,
            Error::NoDriver(_) => Self::STREAMALLOC_NO_DRIVER,
            Error::LimitExceeded { .. } => Self::STREAMALLOC_LIMIT_EXCEEDED,
            Error::Timeout { .. } => Self::STREAMALLOC_TIMEOUT,
            Error::Unsupported(_) => Self::STREAMALLOC_UNSUPPORTED,
            Error::Config(_) => Self::STREAMALLOC_CONFIG_ERROR,
            Error::Trace { .. } | Error::Io(_) => Self::STREAMALLOC_IO_ERROR,
            Error::HeldBack { first, .. } => Self::of(first),
        }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// What [`last_error`] returns while the thread's slot is gone (during or after the thread's
/// teardown, e.g. from a C++ `thread_local` destructor or a global destructor after `main`).
const TORN_DOWN: &CStr = c"(the last error is not kept during thread or process teardown)";

/// The calling thread's last error message (empty if none). The pointer stays valid until
/// the next failing call on this thread. Never panics: the slot is reached with `try_with`.
pub(crate) fn last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|e| e.try_borrow().map_or(TORN_DOWN.as_ptr(), |e| e.as_ptr()))
        .unwrap_or(TORN_DOWN.as_ptr())
}

/// Keeps `message` as the thread's last error, unless the slot is gone (thread teardown), when
/// only stderr (written by the framework ABIs) has it. Never panics.
fn set_last_error(message: String) {
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|e| {
        if let Ok(mut slot) = e.try_borrow_mut() {
            *slot = message;
        }
    });
}

fn panic_error(payload: &(dyn std::any::Any + Send)) -> String {
    let what = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic");
    format!("internal error (a bug in streamalloc): {what}")
}

/// Runs a C API call: an error or a panic becomes its status, with the message kept as the
/// thread's last error.
pub(crate) fn status(f: impl FnOnce() -> Result<()>) -> StreamallocStatus {
    let outcome = catch_unwind(AssertUnwindSafe(f));
    // Keeping the message cannot panic, but the boundary promises no unwinding whatever happens.
    catch_unwind(AssertUnwindSafe(|| report(outcome))).unwrap_or(StreamallocStatus::STREAMALLOC_INTERNAL)
}

fn report(outcome: std::thread::Result<Result<()>>) -> StreamallocStatus {
    match outcome {
        Ok(Ok(())) => StreamallocStatus::STREAMALLOC_OK,
        Ok(Err(e)) => {
            let s = StreamallocStatus::of(&e);
            set_last_error(e.to_string());
            s
        }
        Err(payload) => {
            set_last_error(panic_error(&*payload));
            StreamallocStatus::STREAMALLOC_INTERNAL
        }
    }
}

/// Runs a call of a framework ABI (PyTorch's or CuPy's), which has no error channel: an error
/// or a panic yields `fail`, sets the last error, and is written to stderr, the only place a
/// framework user will see why.
pub(crate) fn abi<T>(call: &str, fail: T, f: impl FnOnce() -> Result<T>) -> T {
    let message = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => return v,
        Ok(Err(e)) => e.to_string(),
        Err(payload) => panic_error(&*payload),
    };
    let _ = catch_unwind(AssertUnwindSafe(|| {
        write_stderr(&format!("streamalloc: {call}: {message}\n"));
        set_last_error(message);
    }));
    fail
}

/// Writes `line` to file descriptor 2 in one call, without the lock of `std::io::stderr()`
/// (which, in a forked child, a thread of the parent may have held). Nothing better to do if
/// stderr is closed or the write falls short.
fn write_stderr(line: &str) {
    // SAFETY: the pointer and length are those of `line`, alive across the call; `write` only
    // reads them.
    let _ = unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
}
