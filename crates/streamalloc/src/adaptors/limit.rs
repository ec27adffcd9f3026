//! `Limit`: a hard byte limit over any allocator.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::{FreeHook, Owners};
use crate::allocation::{Allocation, Allocator, Block, BlockOwner, Stats, StreamAllocator};
use crate::device::Stream;
use crate::error::{Error, Result};

/// Fails allocations that would take the bytes handed out (as asked for) past a limit, with
/// [`Error::LimitExceeded`] naming it.
///
/// # Examples
///
/// ```
/// use streamalloc::adaptors::Limit;
/// use streamalloc::allocators::Plain;
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::{Allocator, Error, Stream};
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let limited = Limit::new(Plain::new(sim, Stream::DEFAULT), 8 << 20);
/// let a = limited.allocate(6 << 20)?;
/// assert!(matches!(limited.allocate(4 << 20), Err(Error::LimitExceeded { .. })));
/// drop(a);
/// let b = limited.allocate(4 << 20)?; // fits once `a` is freed
/// # drop(b);
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct Limit<A> {
    inner: A,
    shared: Arc<Shared>,
    owners: Owners<Shared>,
}

struct Shared {
    limit: usize,
    in_use: AtomicUsize,
}

impl<A: Allocator> Limit<A> {
    /// Wraps `inner` with a limit of `limit` bytes.
    pub fn new(inner: A, limit: usize) -> Self {
        Self { inner, shared: Arc::new(Shared { limit, in_use: AtomicUsize::new(0) }), owners: Owners::new() }
    }

    fn wrap(&self, size: usize, make: impl FnOnce() -> Result<Allocation>) -> Result<Allocation> {
        let s = &self.shared;
        let before = s.in_use.fetch_add(size, Ordering::Relaxed);
        if before.checked_add(size).is_none_or(|total| total > s.limit) {
            s.in_use.fetch_sub(size, Ordering::Relaxed);
            return Err(Error::LimitExceeded {
                device: self.inner.device(),
                requested: size,
                in_use: before,
                limit: s.limit,
            });
        }
        match make() {
            Ok(a) => Ok(self.owners.adopt(&self.shared, a, |_| ())),
            Err(e) => {
                s.in_use.fetch_sub(size, Ordering::Relaxed);
                Err(e)
            }
        }
    }
}

impl FreeHook for Shared {
    fn free(&self, block: Block, inner: &dyn BlockOwner) {
        self.in_use.fetch_sub(block.size, Ordering::Relaxed);
        inner.free(block);
    }
}

impl<A: Allocator> Allocator for Limit<A> {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        self.wrap(size, || self.inner.allocate(size))
    }
    pass_through_allocator!();
}

impl<A: StreamAllocator> StreamAllocator for Limit<A> {
    fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation> {
        self.wrap(size, || self.inner.allocate_on(size, stream))
    }
    pass_through_default_stream!();
}
