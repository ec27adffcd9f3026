//! `Plain`: one device allocation per allocation, no caching. The baseline.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::allocation::{align_up, Allocation, Allocator, Block, BlockOwner, Stats};
use crate::device::{Device, Stream};
use crate::error::{Error, Result};

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
    device: Arc<dyn Device>,
    stream: Stream,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    stats: Stats,
    /// The first error a free met, reported by the next call.
    free_error: Option<Error>,
}

impl Plain {
    /// A plain allocator on `device`; allocations belong to `stream`.
    pub fn new(device: Arc<dyn Device>, stream: Stream) -> Self {
        Self { inner: Arc::new(Inner { device, stream, state: Mutex::new(State::default()) }) }
    }

    fn take_free_error(&self) -> Result<()> {
        match self.inner.state.lock().free_error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Allocator for Plain {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        self.take_free_error()?;
        let device = self.inner.device.ordinal();
        if size == 0 {
            return Ok(Allocation::empty(device, self.inner.stream));
        }
        let rounded = align_up(size)
            .ok_or_else(|| Error::InvalidArgument(format!("allocation size {size} overflows")))?;
        let ptr = match self.inner.device.alloc(rounded) {
            Ok(ptr) => ptr,
            Err(e) => {
                let mut state = self.inner.state.lock();
                state.stats.failures += 1;
                return Err(match e {
                    Error::OutOfMemory(mut report) => {
                        report.requested = size;
                        report.allocated = state.stats.allocated;
                        report.reserved = state.stats.reserved;
                        report.hint = "Plain caches nothing; the device itself is full".into();
                        Error::OutOfMemory(report)
                    }
                    other => other,
                });
            }
        };
        let mut state = self.inner.state.lock();
        state.stats.on_allocate(size);
        state.stats.on_reserve(rounded);
        drop(state);
        let block = Block {
            ptr,
            size,
            stream: self.inner.stream,
            device,
            token: rounded as u64,
            recorded: Vec::new(),
        };
        Ok(Allocation::new(block, self.inner.clone()))
    }

    fn release(&self) -> Result<usize> {
        self.take_free_error()?;
        Ok(0)
    }

    fn stats(&self) -> Stats {
        self.inner.state.lock().stats
    }

    fn device(&self) -> usize {
        self.inner.device.ordinal()
    }
}

impl BlockOwner for Inner {
    fn free(&self, block: Block) {
        let result = self.device.free(block.ptr);
        let mut state = self.state.lock();
        state.stats.on_free(block.size);
        state.stats.on_unreserve(block.token as usize);
        if let Err(e) = result {
            state.free_error.get_or_insert(e);
        }
    }
}
