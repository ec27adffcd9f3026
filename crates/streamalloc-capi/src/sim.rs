//! The simulator through the C ABI (`device=sim`): simulated streams created and destroyed by
//! C, simulated kernels that use a range on a stream, synchronization, and the ordering
//! checker's violation count, so that C and Python tests fuzz the C path against the checker.
//!
//! A simulated stream reaches C as a handle drawn at random from the 64-bit space, never as the
//! simulator's own id (small integers, which would let a guessed value reach a stream the
//! allocator made for itself, such as `async`'s free stream). With `device=sim` every stream
//! a C call is given must be NULL (the legacy default stream) or such a handle, and a handle
//! is its device's only (each simulator numbers its streams from the same start, so another
//! device's stream would otherwise name one of this device). On another device every function
//! here is `STREAMALLOC_UNSUPPORTED`.
//!
//! Virtual time stops at [`STREAMALLOC_SIM_MAX_TIME_NS`]: advancing the clock, or a kernel
//! that would end, past it is `STREAMALLOC_INVALID_ARGUMENT`, so no sum of times wraps; and no
//! call takes host time in proportion to the virtual time or the range it is given.

use std::os::raw::{c_int, c_void};
use std::sync::Arc;

use core_alloc::device::sim::SimDevice;
use core_alloc::device::Streams;
use core_alloc::{Error, Result, Stream};

use crate::state::{ordinal, State};
use crate::status::{self, StreamallocStatus};
use crate::CudaStream;

/// The latest virtual time, in ns, of the simulator's clock and of the work on its streams
/// (2^62 ns, about 146 years): [`streamalloc_sim_advance`] and [`streamalloc_sim_use`] refuse
/// to go past it.
pub const STREAMALLOC_SIM_MAX_TIME_NS: u64 = 4_611_686_018_427_387_904;

const _: () = assert!(STREAMALLOC_SIM_MAX_TIME_NS == core_alloc::device::sim::MAX_TIME_NS);

/// The simulator of `device` (built on first use), or `STREAMALLOC_UNSUPPORTED` off `device=sim`.
fn simulator(state: &State, device: c_int) -> Result<Arc<SimDevice>> {
    let stack = state.stack(device)?;
    stack.sim.clone().ok_or_else(|| {
        Error::Unsupported(format!(
            "the simulator functions need device=sim; the library is configured with device={}",
            match state.config().device {
                core_alloc::facade::DeviceKind::Cuda => "cuda",
                core_alloc::facade::DeviceKind::Sim => "sim",
            }
        ))
    })
}

/// The simulator's stream behind `handle` on `device`.
fn sim_stream(state: &State, device: c_int, handle: CudaStream) -> Result<(Arc<SimDevice>, Stream)> {
    let sim = simulator(state, device)?;
    let (owner, stream) = state.sim_streams().get(handle as u64)?;
    if owner.is_some_and(|d| d != ordinal(device).unwrap_or(usize::MAX)) {
        return Err(Error::InvalidArgument(format!(
            "stream {:#x} is not a stream of device {device}",
            handle as u64
        )));
    }
    Ok((sim, stream))
}

/// Creates a simulated stream on `device` (`device=sim` only) and writes its handle to `*out`.
///
/// # Safety
/// `out` is null (an error) or valid for writing a `cudaStream_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_sim_create_stream(
    device: c_int,
    out: *mut CudaStream,
) -> StreamallocStatus {
    status::status(|| {
        if out.is_null() {
            return Err(Error::InvalidArgument("out is null".into()));
        }
        let state = State::get()?;
        let sim = simulator(state, device)?;
        let stream = sim.create_stream()?;
        let handle = state.sim_streams().insert(ordinal(device)?, stream);
        // SAFETY: `out` is non-null and, by the caller's contract, valid for writes.
        unsafe { out.write(handle as *mut c_void) };
        Ok(())
    })
}

/// Destroys a simulated stream made by [`streamalloc_sim_create_stream`]; its handle is no
/// longer accepted. Work already enqueued on it still completes.
#[no_mangle]
pub extern "C" fn streamalloc_sim_destroy_stream(device: c_int, stream: CudaStream) -> StreamallocStatus {
    status::status(|| {
        let state = State::get()?;
        let (sim, s) = sim_stream(state, device, stream)?;
        if s == Stream::DEFAULT {
            return Err(Error::InvalidArgument("the legacy default stream cannot be destroyed".into()));
        }
        state.sim_streams().remove(stream as u64);
        sim.destroy_stream(s)
    })
}

/// Enqueues a simulated kernel on `stream` that uses `len` bytes at `ptr` for `duration_ns`
/// (virtual time), for the ordering checker to compare later handouts with.
/// `STREAMALLOC_INVALID_ARGUMENT`, nothing enqueued, if `stream` is not a stream of `device`,
/// if the range is not all `device`'s memory (or address reservations), or if the kernel would
/// end past [`STREAMALLOC_SIM_MAX_TIME_NS`].
#[no_mangle]
pub extern "C" fn streamalloc_sim_use(
    device: c_int,
    ptr: *mut c_void,
    len: usize,
    stream: CudaStream,
    duration_ns: u64,
) -> StreamallocStatus {
    status::status(|| {
        let (sim, s) = sim_stream(State::get()?, device, stream)?;
        sim.use_range(ptr as u64, len, s, duration_ns)
    })
}

/// Blocks (in virtual time) until the work enqueued on `stream` has completed.
#[no_mangle]
pub extern "C" fn streamalloc_sim_synchronize(device: c_int, stream: CudaStream) -> StreamallocStatus {
    status::status(|| {
        let (sim, s) = sim_stream(State::get()?, device, stream)?;
        sim.synchronize_stream(s)
    })
}

/// Lets `ns` of virtual host time pass on `device`; `STREAMALLOC_INVALID_ARGUMENT`, the clock
/// unmoved, if that would take it past [`STREAMALLOC_SIM_MAX_TIME_NS`].
#[no_mangle]
pub extern "C" fn streamalloc_sim_advance(device: c_int, ns: u64) -> StreamallocStatus {
    status::status(|| simulator(State::get()?, device)?.try_advance(ns))
}

/// Writes to `*out` how many early reuses the ordering checker of `device` has found: memory
/// handed out (by any allocation function, each checked as it returns) while a kernel on
/// another stream could still be using it.
///
/// # Safety
/// `out` is null (an error) or valid for writing a `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_sim_violations(device: c_int, out: *mut u64) -> StreamallocStatus {
    status::status(|| {
        if out.is_null() {
            return Err(Error::InvalidArgument("out is null".into()));
        }
        let count = simulator(State::get()?, device)?.violations().len() as u64;
        // SAFETY: `out` is non-null and, by the caller's contract, valid for writes.
        unsafe { out.write(count) };
        Ok(())
    })
}
