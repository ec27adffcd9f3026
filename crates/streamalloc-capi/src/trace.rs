//! Rows a program adds to the trace (`trace=PATH`) to tell a replay what its streams do:
//! `use` rows (a stream's work on an allocation, and how long it ran) and `wait` rows (a stream
//! waiting for another's work), which `streamalloc replay` runs on the simulator's clock. The
//! library cannot see either (it allocates; kernels and stream waits go to the driver without
//! it), so a program that wants its replays to know them says so here. Without `trace=`
//! these functions do nothing. `record_stream` rows need no call of their own: the trace
//! writes one for every `streamalloc_record_stream` (and PyTorch's record_stream hook).

use std::os::raw::{c_int, c_void};

use crate::state::{ordinal, State};
use crate::status::{self, StreamallocStatus};
use crate::CudaStream;

/// Writes a `use` row to `device`'s trace: work enqueued now on `stream` uses the allocation
/// at `ptr` for `duration_ns` (measured, e.g. between two CUDA events, or estimated). Call it
/// while the allocation is live, when the work is enqueued. NULL (a zero-size allocation)
/// writes nothing; so does a library configured without `trace=`. A stream that is not one
/// of `device` (with `device=sim`: not NULL or a handle of `streamalloc_sim_create_stream`) is
/// `STREAMALLOC_INVALID_ARGUMENT`, with a trace or without.
#[no_mangle]
pub extern "C" fn streamalloc_trace_use(
    device: c_int,
    ptr: *mut c_void,
    stream: CudaStream,
    duration_ns: u64,
) -> StreamallocStatus {
    status::status(|| {
        let state = State::get()?;
        let stream = state.stream(stream as u64, Some(ordinal(device)?))?;
        if let (Some(trace), false) = (&state.stack(device)?.trace, ptr.is_null()) {
            trace.write_use(ptr as u64, stream, duration_ns);
        }
        Ok(())
    })
}

/// Writes a `wait` row to `device`'s trace: `stream` waits, from now on, for the work enqueued
/// so far on `other` (as after `cudaStreamWaitEvent` on an event recorded on `other`, or
/// PyTorch's `stream.wait_stream(other)`). A library configured without `trace=` writes
/// nothing. Streams are checked as by [`streamalloc_trace_use`].
#[no_mangle]
pub extern "C" fn streamalloc_trace_wait(
    device: c_int,
    stream: CudaStream,
    other: CudaStream,
) -> StreamallocStatus {
    status::status(|| {
        let state = State::get()?;
        let on = Some(ordinal(device)?);
        let (stream, other) = (state.stream(stream as u64, on)?, state.stream(other as u64, on)?);
        if let Some(trace) = &state.stack(device)?.trace {
            trace.write_wait(stream, other);
        }
        Ok(())
    })
}
