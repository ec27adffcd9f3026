//! The allocators: each implements [`Allocator`](crate::Allocator), and the stream-aware
//! ones [`StreamAllocator`](crate::StreamAllocator); [`PinnedHost`], a pool of page-locked
//! host memory, has methods of its own (host memory is not device memory); [`Tagged`] serves
//! tagged allocations from pools that sleep and wake, the others from the allocator it wraps.

pub mod async_pool;
pub mod backing;
mod best_fit;
mod pinned_host;
mod plain;
pub(crate) mod retry;
mod stream_safe;
mod tagged;

pub use async_pool::{AsyncPool, AsyncPoolConfig, Capture, CapturedGraph, PoolMode, ReuseFlags};
pub use backing::{Backing, BackingKind, ChunkSource, DeviceChunks, Want};
pub use best_fit::{BestFit, BestFitConfig, FreeChunk};
pub use pinned_host::{PinnedBuffer, PinnedHost, PinnedHostConfig};
pub use plain::Plain;
pub use stream_safe::{StreamSafe, StreamSafeConfig};
pub use tagged::{TagStats, Tagged};

use std::time::{Duration, Instant};

use crate::device::{Device, EventPool, Stream};
use crate::error::{Error, Result};

/// Waits, at most `timeout` in all, for the work enqueued so far on each of `streams` (an
/// event recorded on each, waited for with the time left). On a timeout, an
/// [`Error::Timeout`] naming the stream still at work.
pub(crate) fn wait_for_streams(
    device: &dyn Device,
    events: &EventPool,
    streams: &[Stream],
    timeout: Duration,
) -> Result<()> {
    let start = Instant::now();
    for &stream in streams {
        let event = events.get()?;
        let done = device
            .record_event(event, stream)
            .and_then(|()| device.wait_event(event, timeout.saturating_sub(start.elapsed())));
        events.put(event);
        if !done? {
            return Err(Error::Timeout {
                waited_for: format!(
                    "the work enqueued on stream {:#x} (it uses cached memory, which could not go back \
                     to the device before it completes)",
                    stream.raw()
                ),
                after: timeout,
            });
        }
    }
    Ok(())
}

/// The line an out-of-memory error gets when the release before its last attempt failed.
pub(crate) fn release_failed(error: &Error) -> String {
    match error {
        Error::Timeout { waited_for, after } => {
            format!("waited {after:?} (wait_timeout) for {waited_for}; nothing was given back meanwhile")
        }
        other => format!("giving cached memory back failed: {other}"),
    }
}
