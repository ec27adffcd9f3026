//! The C ABI of streamalloc, built as `libstreamalloc.so`, with three faces:
//!
//! * PyTorch's `CUDAPluggableAllocator` ABI: [`streamalloc_malloc`] and [`streamalloc_free`].
//! * CuPy's `CFunctionAllocator` ABI: [`streamalloc_cupy_malloc`] and
//!   [`streamalloc_cupy_free`].
//! * A C API with status codes and a thread-local last-error string: `streamalloc_allocate`,
//!   `_deallocate`, `_record_stream`, `_release`, `_stats`, `_reset_peak_stats`, `_configure`,
//!   `_last_error`; with `trace=`, rows a program adds to the trace (`streamalloc_trace_*`, see
//!   [`trace`]); sharing mapped memory with another process (`streamalloc_ipc_*`, see
//!   [`ipc`]); a pool of page-locked host memory (`streamalloc_host_*`, see [`host`]); tags
//!   whose memory sleeps and wakes at the same addresses (`streamalloc_tag_*`,
//!   `streamalloc_sleep`, `streamalloc_wake`, see [`sleep`]); and with
//!   `device=sim`, the simulator (`streamalloc_sim_*`, see [`sim`]).
//!
//! All three share one process-wide facade (per-device allocator stacks), configured by
//! [`streamalloc_configure`] or else, at the first call, from `STREAMALLOC_CONF` (e.g.
//! `device=sim,strategy=plain`). Each device's stack keeps its live allocations by pointer in
//! one table at its top ([`Pointers`](core_alloc::adaptors::Pointers), sharded by stream),
//! with no state per thread; so a pointer from any face can be freed by the free of any
//! other, from any thread. No call unwinds into C or aborts: errors and
//! panics become a status (or a null pointer) and the thread's last error. Zero-size requests
//! give a null pointer (PyTorch's convention), and freeing null does nothing. In a child
//! forked after the library came into use every call fails at once, taking no lock (see
//! `fork.rs`).
//!
//! Every stream a caller passes (`cudaStream_t`, CuPy's stream source) is NULL, the legacy
//! default stream, or a live stream of the device the call names, made in its primary context
//! (PyTorch's and CuPy's streams are); with `device=sim`, a handle of
//! `streamalloc_sim_create_stream`. CUDA streams go to the driver as they are
//! ([`Stream::from_raw`](core_alloc::Stream::from_raw)), which does not reliably refuse a
//! bad one.
//!
//! `include/streamalloc.h` is generated from this crate by cbindgen; `cargo test -p
//! streamalloc-capi` fails when it is out of date, and regenerates it with
//! `STREAMALLOC_BLESS=1`.

// The C ABI: `extern "C"` entry points, raw pointers from C and the callbacks it installs.
// Each `unsafe` block has its `// SAFETY:` comment; the workspace denies `unsafe` elsewhere
// but in the core crate's device layer.
#![allow(unsafe_code)]
// Rustdoc does not render this crate (its documentation is the generated header, which
// carries these doc comments); the lint keeps every exported item documented.
#![warn(missing_docs)]

mod cupy;
mod entries;
mod fork;
mod host;
mod ipc;
mod opened;
mod segments;
mod sim;
mod sim_streams;
mod sleep;
mod state;
mod status;
mod torch;
mod trace;

use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_void};
use std::ptr;

use core_alloc::facade::Config;
use core_alloc::Error;
use libc::ssize_t;

pub use core_alloc::allocators::TagStats;
pub use core_alloc::Stats;
pub use cupy::{
    streamalloc_cupy_free, streamalloc_cupy_malloc, streamalloc_cupy_set_stream_keeper,
    streamalloc_cupy_set_stream_source, CupyStreamKeeper, CupyStreamSource,
};
pub use entries::{
    streamalloc_allocate_word, streamalloc_entry, streamalloc_free_word, streamalloc_pool_live,
    StreamallocEntry,
};
pub use host::{
    streamalloc_host_alloc, streamalloc_host_free, streamalloc_host_is_live, streamalloc_host_record_stream,
    streamalloc_host_release, streamalloc_host_reset_peak_stats, streamalloc_host_stats,
    streamalloc_sim_use_host,
};
pub use ipc::{
    streamalloc_ipc_close, streamalloc_ipc_export, streamalloc_ipc_open, STREAMALLOC_IPC_KIND,
    STREAMALLOC_IPC_POOL_KIND, STREAMALLOC_IPC_POOL_VERSION, STREAMALLOC_IPC_VERSION,
};
pub use segments::{streamalloc_segments, StreamallocBlock, StreamallocBlockState, StreamallocSegment};
pub use sim::{
    streamalloc_sim_advance, streamalloc_sim_create_stream, streamalloc_sim_destroy_stream,
    streamalloc_sim_synchronize, streamalloc_sim_use, streamalloc_sim_violations,
    STREAMALLOC_SIM_MAX_TIME_NS,
};
pub use sleep::{
    streamalloc_sleep, streamalloc_tag_drop, streamalloc_tag_pop, streamalloc_tag_push,
    streamalloc_tag_stats, streamalloc_wake,
};
use state::State;
pub use status::StreamallocStatus;
pub use torch::*;
pub use trace::{streamalloc_trace_use, streamalloc_trace_wait};

/// A CUDA stream: `cudaStream_t`, the same value as the driver's `CUstream`. Null is the
/// legacy default stream. With `device=sim`, NULL or a handle from
/// [`streamalloc_sim_create_stream`].
pub type CudaStream = *mut c_void;

/// PyTorch `CUDAPluggableAllocator` allocation: `size` bytes on `device`, owned by `stream`.
/// Returns NULL for size 0 (PyTorch's convention) and on failure (the reason goes to the last
/// error and to stderr).
#[no_mangle]
pub extern "C" fn streamalloc_malloc(size: ssize_t, device: c_int, stream: CudaStream) -> *mut c_void {
    status::abi("streamalloc_malloc", ptr::null_mut(), || malloc(size, device, stream))
}

/// The allocation of the PyTorch ABI, errors returned.
fn malloc(size: ssize_t, device: c_int, stream: CudaStream) -> Result<*mut c_void, Error> {
    let size = usize::try_from(size).map_err(|_| Error::InvalidArgument(format!("negative size {size}")))?;
    Ok(State::get()?.allocate(size, device, stream as u64)? as *mut c_void)
}

/// PyTorch `CUDAPluggableAllocator` free. `size` is ignored; `device` and `stream` (those the
/// allocation was made with, as PyTorch passes them) are where the allocation is looked for
/// first, and any other is correct too. An unknown pointer (double free) is reported on
/// stderr and otherwise ignored.
#[no_mangle]
pub extern "C" fn streamalloc_free(ptr: *mut c_void, size: ssize_t, device: c_int, stream: CudaStream) {
    let _ = size;
    status::abi("streamalloc_free", (), || State::get()?.free(ptr as u64, Some(device), stream as u64));
}

/// Allocates `size` bytes on `device`, owned by `stream`, and writes the pointer to `*out`
/// (NULL for size 0, which succeeds, and on failure).
///
/// # Safety
/// `out` is null (an error) or valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_allocate(
    size: usize,
    device: c_int,
    stream: CudaStream,
    out: *mut *mut c_void,
) -> StreamallocStatus {
    status::status(|| {
        if out.is_null() {
            return Err(Error::InvalidArgument("out is null".into()));
        }
        let result = State::get().and_then(|s| s.allocate(size, device, stream as u64));
        // SAFETY: `out` is non-null and, by the caller's contract, valid for writes.
        unsafe { out.write(result.as_ref().map_or(ptr::null_mut(), |p| *p as *mut c_void)) };
        result.map(drop)
    })
}

/// Frees an allocation made by any of the allocation functions, in the order of its owning
/// stream and after the work of every stream recorded on it. Freeing NULL succeeds; an
/// unknown pointer (double free) is `STREAMALLOC_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn streamalloc_deallocate(ptr: *mut c_void) -> StreamallocStatus {
    status::status(|| State::get()?.free(ptr as u64, None, 0))
}

/// Says that work on `stream`, enqueued until the allocation at `ptr` is freed, uses it: the
/// memory is not reused before that work completes. NULL (a zero-size allocation) succeeds.
#[no_mangle]
pub extern "C" fn streamalloc_record_stream(ptr: *mut c_void, stream: CudaStream) -> StreamallocStatus {
    status::status(|| State::get()?.record_stream(ptr as u64, stream as u64))
}

/// Returns the cached memory of `device` that no allocation uses to the driver, and writes the
/// bytes returned to `*released` unless it is NULL.
///
/// # Safety
/// `released` is null or valid for writing a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_release(device: c_int, released: *mut usize) -> StreamallocStatus {
    status::status(|| {
        let bytes = State::get()?.release(device)?;
        if !released.is_null() {
            // SAFETY: non-null, and valid for writes by the caller's contract.
            unsafe { released.write(bytes) };
        }
        Ok(())
    })
}

/// Tells `device`'s allocators, its private pools included, that `stream` is about to be
/// destroyed, once no allocation made on it is live: they forget what they keep for it
/// (`stream_safe` retires the stream's pool, whose free memory goes back once the stream's
/// work is done), so that no later call (a release, a retry on out-of-memory) names a
/// destroyed stream, which the driver does not survive. Front ends whose streams can be
/// destroyed call it first (streamalloc.cupy does, for the CuPy streams it kept alive).
#[no_mangle]
pub extern "C" fn streamalloc_retire_stream(device: c_int, stream: CudaStream) -> StreamallocStatus {
    status::status(|| State::get()?.retire_stream(device, stream as u64))
}

/// Writes the statistics of `device` to `*out` (zeros for a device not used yet).
///
/// # Safety
/// `out` is null (an error) or valid for writing a `streamalloc_stats_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_stats(device: c_int, out: *mut Stats) -> StreamallocStatus {
    status::status(|| {
        if out.is_null() {
            return Err(Error::InvalidArgument("out is null".into()));
        }
        let stats = State::get()?.stats(device)?;
        // SAFETY: `out` is non-null and, by the caller's contract, valid for writes.
        unsafe { out.write(stats) };
        Ok(())
    })
}

/// Restarts the peak figures of `device` (`allocated_peak`, `reserved_peak`) from the
/// current ones, as PyTorch's `reset_peak_memory_stats` does. A device not used yet has
/// nothing to reset.
#[no_mangle]
pub extern "C" fn streamalloc_reset_peak_stats(device: c_int) -> StreamallocStatus {
    status::status(|| State::get()?.reset_peak_stats(device))
}

/// Lets device `peer` read and write, in its kernels and copies, the memory that `device`'s
/// allocators map (`backing=stitched` or `segments`: virtual-memory ranges), both the memory mapped so far
/// and what they map later. Such memory does not follow the context-level peer access that
/// `cudaDeviceEnablePeerAccess` gives, which covers `cudaMalloc` memory (`backing=chunks`,
/// CUDA graphs' private pools) only: a program that enables peer access calls this too, for
/// each direction it uses. Memory of the driver's pool (`strategy=async`) is not covered
/// (`cudaMemPoolSetAccess`). Calling it twice, or with `peer == device`, does nothing more.
#[no_mangle]
pub extern "C" fn streamalloc_enable_peer_access(device: c_int, peer: c_int) -> StreamallocStatus {
    status::status(|| State::get()?.enable_peer_access(device, peer))
}

/// Configures the library with a `STREAMALLOC_CONF`-style string (e.g.
/// `strategy=async,release_threshold=8GiB`), which then takes the place of the environment
/// variable, except for its `trace` key, kept when `conf` has none (so `streamalloc record`
/// traces a program that configures the library itself). Call it before any other function: once the library is in use (configured, or
/// configured from the environment at a first call), only an equal configuration succeeds and
/// any other is `STREAMALLOC_CONFIG_ERROR`.
///
/// # Safety
/// `conf` is null (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_configure(conf: *const c_char) -> StreamallocStatus {
    status::status(|| {
        if conf.is_null() {
            return Err(Error::InvalidArgument("conf is null".into()));
        }
        // SAFETY: non-null, and NUL-terminated by the caller's contract.
        let conf = unsafe { CStr::from_ptr(conf) };
        let conf = conf.to_str().map_err(|_| Error::Config("the configuration is not UTF-8".into()))?;
        State::configure(Config::parse(conf)?)
    })
}

/// Fixes the configuration now (from [`streamalloc_configure`], else `STREAMALLOC_CONF`) and
/// reports a bad one at once, rather than at the first allocation. Touches no device: each
/// device's allocators are still built at its first use.
#[no_mangle]
pub extern "C" fn streamalloc_check_configuration() -> StreamallocStatus {
    status::status(|| State::get().map(|_| ()))
}

/// The text of `streamalloc.h`, the header this library was built with (NUL-terminated, owned
/// by the library, never freed): front ends that reach the library without a compiler (Python's
/// ctypes) take its structs from here, and the torch backend is compiled against it.
#[no_mangle]
pub extern "C" fn streamalloc_header() -> *const c_char {
    concat!(include_str!("../include/streamalloc.h"), "\0").as_ptr().cast()
}

/// The message of the last failed call on the calling thread (an empty string if none). The
/// string belongs to the library and stays valid until the next call on this thread.
#[no_mangle]
pub extern "C" fn streamalloc_last_error() -> *const c_char {
    status::last_error()
}

#[cfg(test)]
mod tests;
