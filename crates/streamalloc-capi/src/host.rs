//! Page-locked (pinned) host memory through the C ABI: one [`PinnedHost`] pool per process,
//! for every device (pinned memory is portable), with the conventions of the other functions
//! (status codes, the thread's last error, nothing unwinds into C).
//!
//! The pool is made at the first [`streamalloc_host_alloc`], on the device that call names:
//! that device's context pins all the pool's memory (its stack is built then), as PyTorch pins
//! through a device already in use rather than device 0. With `device=sim` the simulator of
//! that device hands out real host memory, and its ordering checker sees every block handed
//! out ([`streamalloc_sim_use_host`] enqueues the copies it checks them against).

use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::{Arc, OnceLock};

use core_alloc::allocators::{PinnedHost, PinnedHostConfig};
use core_alloc::device::sim::SimDevice;
use core_alloc::{Error, Result, Stats};

use crate::state::{ordinal, State};
use crate::status::{self, StreamallocStatus};
use crate::CudaStream;

/// The process's pinned pool and what the C functions need beside it.
struct Host {
    pool: PinnedHost,
    /// The device whose context pins the memory.
    device: usize,
    /// The simulator of that device, with `device=sim`.
    sim: Option<Arc<SimDevice>>,
}

/// Made by the first allocation that succeeds in making it (a device that cannot be opened
/// leaves it to the next).
static HOST: OnceLock<Host> = OnceLock::new();

/// The pool, made on `device` if it does not exist yet. Two threads that make it at once
/// each make one; the one kept is the first stored, and the other has pinned nothing yet.
fn host_on(state: &State, device: c_int) -> Result<&'static Host> {
    if let Some(host) = HOST.get() {
        return Ok(host);
    }
    let stack = state.stack(device)?;
    let pool = PinnedHost::new(stack.device.clone(), PinnedHostConfig::default())?;
    let made = Host { pool, device: ordinal(device)?, sim: stack.sim.clone() };
    Ok(HOST.get_or_init(|| made))
}

/// The pool, if an allocation made it; an error in a child forked after the library came
/// into use.
fn host() -> Result<Option<&'static Host>> {
    State::get()?;
    Ok(HOST.get())
}

fn not_live(ptr: *mut c_void) -> Error {
    Error::InvalidArgument(format!("{:#x} is not a live pinned allocation of streamalloc", ptr as u64))
}

/// Allocates `size` bytes of page-locked host memory from the process's pinned pool and
/// writes the address to `*out` (NULL for size 0, which succeeds, and on failure). Blocks are
/// powers of two and reused once the work of the streams recorded on them
/// ([`streamalloc_host_record_stream`]) has completed. `device` is a device in use: the first
/// call makes the pool, whose memory that device's context pins (it serves every device).
///
/// # Safety
/// `out` is null (an error) or valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_host_alloc(
    size: usize,
    device: c_int,
    out: *mut *mut c_void,
) -> StreamallocStatus {
    status::status(|| {
        if out.is_null() {
            return Err(Error::InvalidArgument("out is null".into()));
        }
        let result = State::get().and_then(|state| {
            ordinal(device)?;
            let host = host_on(state, device)?;
            let ptr = host.pool.allocate_ptr(size)?;
            if let Some(sim) = host.sim.as_ref().filter(|_| ptr != 0) {
                sim.check_host_handout(ptr, size);
            }
            Ok(ptr as *mut c_void)
        });
        // SAFETY: `out` is non-null and, by the caller's contract, valid for writes.
        unsafe { out.write(*result.as_ref().unwrap_or(&ptr::null_mut())) };
        result.map(drop)
    })
}

/// Frees pinned memory from [`streamalloc_host_alloc`]: reusable at once, or, when streams
/// were recorded on it, once their work enqueued until now has completed. NULL succeeds; a
/// pointer that is not a live pinned allocation (a double free) is
/// `STREAMALLOC_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn streamalloc_host_free(ptr: *mut c_void) -> StreamallocStatus {
    status::status(|| {
        let host = host()?;
        if ptr.is_null() {
            return Ok(());
        }
        host.and_then(|h| h.pool.free_ptr(ptr as u64)).map(drop).ok_or_else(|| not_live(ptr))
    })
}

/// Says that work on `stream`, a stream of `device`, enqueued until the pinned memory at `ptr`
/// is freed uses it (a copy from or to it): the memory is not handed out again before that
/// work completes. NULL succeeds. `STREAMALLOC_INVALID_ARGUMENT`, nothing recorded, when `ptr`
/// is not a live pinned allocation (the address a block starts at) or `stream` not a live
/// stream of `device`. Memory that a stream uses while capturing a CUDA graph is never handed
/// out again (a replay may copy at any time).
#[no_mangle]
pub extern "C" fn streamalloc_host_record_stream(
    ptr: *mut c_void,
    device: c_int,
    stream: CudaStream,
) -> StreamallocStatus {
    status::status(|| {
        let state = State::get()?;
        let ordinal = ordinal(device)?;
        if ptr.is_null() {
            return Ok(());
        }
        let host = host()?.ok_or_else(|| not_live(ptr))?;
        let stream = state.stream(stream as u64, Some(ordinal))?;
        let device = &state.stack(device)?.device;
        match host.pool.record_stream_ptr(ptr as u64, device, stream)? {
            true => Ok(()),
            false => Err(not_live(ptr)),
        }
    })
}

/// Whether `ptr` is a live pinned allocation of the pool (the address a block starts at, not
/// freed yet): what tells a pointer that is none of the pool's from a call refused for another
/// reason (a front end hands the former to another allocator, and reports the latter). False
/// before the pool's first allocation, and on any error.
#[no_mangle]
pub extern "C" fn streamalloc_host_is_live(ptr: *const c_void) -> bool {
    let mut live = false;
    status::status(|| {
        live = host()?.is_some_and(|h| h.pool.is_live(ptr as u64));
        Ok(())
    });
    live
}

/// Gives the pinned memory no allocation uses back (`cuMemFreeHost`): the pool's, and that
/// which sleeps with offload keep (`streamalloc_sleep`; no device's `streamalloc_empty_cache`
/// gives it back, so that the next sleep pins nothing), but for a sleeping tag's contents.
/// Writes the bytes given back to `*released` unless it is NULL. Waits for nothing: memory
/// whose streams are still at work stays.
///
/// # Safety
/// `released` is null or valid for writing a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_host_release(released: *mut usize) -> StreamallocStatus {
    status::status(|| {
        let pool = match host()? {
            Some(h) => h.pool.release(),
            None => Ok(0),
        };
        let offloads = State::get()?.facade().release_offload_memory();
        let bytes = pool? + offloads?;
        if !released.is_null() {
            // SAFETY: non-null, and valid for writes by the caller's contract.
            unsafe { released.write(bytes) };
        }
        Ok(())
    })
}

/// Writes the statistics of the pinned memory to `*out` (zeros before its first allocation),
/// the pool's and that kept for offloads together: `allocated` the bytes asked for (a
/// sleeping tag's contents included), `reserved` the bytes pinned, `cached` those free,
/// `pending_release` those waiting for streams' work (or kept for a CUDA graph),
/// `device_allocs` and `device_frees` the pinned allocations and frees.
///
/// # Safety
/// `out` is null (an error) or valid for writing a `streamalloc_stats_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_host_stats(out: *mut Stats) -> StreamallocStatus {
    status::status(|| {
        if out.is_null() {
            return Err(Error::InvalidArgument("out is null".into()));
        }
        let pool = host()?.map(|h| h.pool.stats()).unwrap_or_default();
        let stats: Stats = [pool, State::get()?.facade().offload_stats()].into_iter().sum();
        // SAFETY: `out` is non-null and, by the caller's contract, valid for writes.
        unsafe { out.write(stats) };
        Ok(())
    })
}

/// Restarts the peak figures of the pinned memory (`allocated_peak`, `reserved_peak`: the
/// pool's and that kept for offloads) from the current ones.
#[no_mangle]
pub extern "C" fn streamalloc_host_reset_peak_stats() -> StreamallocStatus {
    status::status(|| {
        if let Some(h) = host()? {
            h.pool.reset_peak_stats();
        }
        State::get()?.facade().reset_offload_peak_stats();
        Ok(())
    })
}

/// With `device=sim`: enqueues on `stream` a simulated copy that uses `len` bytes of pinned
/// memory at `ptr` for `duration_ns` (virtual time), for the ordering checker to compare later
/// handouts and frees of that memory with. `device` is the device whose context pins the
/// pool's memory (the checker sees host memory there only) and `stream` a stream of it.
/// `STREAMALLOC_INVALID_ARGUMENT`, nothing enqueued, for another device or stream, a range
/// that is not all one live pinned block, or a copy that would end past
/// `STREAMALLOC_SIM_MAX_TIME_NS`; `STREAMALLOC_UNSUPPORTED` off the simulator.
#[no_mangle]
pub extern "C" fn streamalloc_sim_use_host(
    device: c_int,
    ptr: *mut c_void,
    len: usize,
    stream: CudaStream,
    duration_ns: u64,
) -> StreamallocStatus {
    status::status(|| {
        let state = State::get()?;
        let ordinal = ordinal(device)?;
        let host = host()?.ok_or_else(|| not_live(ptr))?;
        let sim = host
            .sim
            .as_ref()
            .ok_or_else(|| Error::Unsupported("streamalloc_sim_use_host needs device=sim".into()))?;
        if ordinal != host.device {
            return Err(Error::InvalidArgument(format!(
                "the pinned pool's memory is checked on device {}, whose context pins it, not on device {device}",
                host.device
            )));
        }
        sim.use_host(ptr as u64, len, state.stream(stream as u64, Some(ordinal))?, duration_ns)
    })
}
