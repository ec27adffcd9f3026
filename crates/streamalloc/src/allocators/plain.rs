//! `Plain`: one device allocation per allocation, no caching. The baseline.

use std::sync::Arc;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use crate::allocation::{
    align_up, Allocation, Allocator, Block, BlockOwner, BlockState, Segment, SegmentBlock, Stats,
};
use crate::device::{DeviceMemory, DevicePtr, Stream};
use crate::error::{Error, HeldErrors, Result};

/// No caching: every allocation is a device allocation (`cuMemAlloc`) and every free a
/// device free (`cuMemFree`).
///
/// Recorded streams need no handling: a device free synchronizes the device, so work on
/// every stream that could use the memory has completed before it can be handed out again.
///
/// # Examples
///
/// ```
/// use streamalloc::allocators::Plain;
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::{Allocator, Stream};
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let plain = Plain::new(sim, Stream::DEFAULT);
/// let a = plain.allocate(1 << 20)?; // one device allocation
/// assert_eq!(plain.stats().device_allocs, 1);
/// drop(a); // one device free
/// assert_eq!(plain.stats().reserved, 0);
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct Plain {
    inner: Arc<Inner>,
}

struct Inner {
    device: Arc<dyn DeviceMemory>,
    stream: Stream,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    stats: Stats,
    /// Errors frees met, reported by the next [`Allocator::release`].
    held: HeldErrors,
    /// Each live allocation's device allocation, by pointer: its rounded size.
    live: FxHashMap<DevicePtr, usize>,
}

impl Plain {
    /// A plain allocator on `device`; allocations belong to `stream`.
    pub fn new(device: Arc<dyn DeviceMemory>, stream: Stream) -> Self {
        Self { inner: Arc::new(Inner { device, stream, state: Mutex::new(State::default()) }) }
    }

    /// A device allocation of `size` bytes (not zero), counted: the pointer and the bytes
    /// allocated. A failure counts once.
    fn allocate_device(&self, size: usize) -> Result<(DevicePtr, usize)> {
        let made = align_up(size)
            .ok_or_else(|| Error::InvalidArgument(format!("allocation size {size} overflows")))
            .and_then(|rounded| Ok((self.inner.device.alloc(rounded)?, rounded)));
        let mut state = self.inner.state.lock();
        match made {
            Ok((ptr, rounded)) => {
                state.live.insert(ptr, rounded);
                state.stats.on_allocate(size);
                state.stats.on_reserve(rounded);
                Ok((ptr, rounded))
            }
            Err(e) => {
                state.stats.failures += 1;
                Err(match e {
                    Error::OutOfMemory(mut report) => {
                        report.requested = size;
                        report.allocated = state.stats.allocated;
                        report.reserved = state.stats.reserved;
                        report.hint = plain_hint(size, &report);
                        Error::OutOfMemory(report)
                    }
                    other => other,
                })
            }
        }
    }
}

/// Why the device refused a plain allocation, from its figures (issue 52: "the device
/// itself is full" was said of an empty device asked for more than it has).
fn plain_hint(size: usize, report: &crate::error::OutOfMemory) -> String {
    let (free, total) = (report.device_free, report.device_total);
    if size > total {
        format!("the request is larger than the device's memory ({total} bytes)")
    } else if size <= free {
        format!(
            "the device reports {free} bytes free, but no free range of {size} bytes (its free memory is \
             fragmented)"
        )
    } else if report.reserved == 0 {
        format!(
            "Plain holds nothing; the device's memory is held elsewhere (other allocators or processes): \
             {free} of {total} bytes free"
        )
    } else {
        format!(
            "Plain caches nothing: its live allocations and memory held elsewhere leave {free} bytes free"
        )
    }
}

impl Allocator for Plain {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        let device = self.inner.device.ordinal();
        if size == 0 {
            return Ok(Allocation::empty(device, self.inner.stream));
        }
        let (ptr, rounded) = self.allocate_device(size)?;
        let block = Block {
            ptr,
            size,
            stream: self.inner.stream,
            device,
            token: rounded as u64,
            recorded: Default::default(),
        };
        Ok(Allocation::new(block, self.inner.clone()))
    }

    /// Caches nothing: returns 0, or the errors frees met since the last call.
    fn release(&self) -> Result<usize> {
        self.inner.state.lock().held.take()?;
        Ok(0)
    }

    fn stats(&self) -> Stats {
        self.inner.state.lock().stats
    }

    fn reset_peak_stats(&self) {
        self.inner.state.lock().stats.reset_peaks();
    }

    fn device(&self) -> usize {
        self.inner.device.ordinal()
    }

    /// Each live allocation is a device allocation of its own: a segment of one block.
    fn segments(&self, out: &mut Vec<Segment>) -> Result<()> {
        let state = self.inner.state.lock();
        out.extend(state.live.iter().map(|(&addr, &size)| Segment {
            addr,
            size,
            stream: self.inner.stream,
            blocks: vec![SegmentBlock { addr, size, state: BlockState::Allocated }],
        }));
        Ok(())
    }
}

impl BlockOwner for Inner {
    fn free(&self, block: Block) {
        let result = self.device.free(block.ptr);
        let mut state = self.state.lock();
        state.live.remove(&block.ptr);
        state.stats.on_free(block.size);
        state.stats.on_unreserve(block.token as usize);
        if let Err(e) = result {
            state.held.hold(e);
        }
    }
}
