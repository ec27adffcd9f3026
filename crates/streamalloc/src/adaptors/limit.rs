//! `Limit`: a hard byte limit over any allocator.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use super::{FreeHook, Owners};
use crate::allocation::{Allocation, Allocator, Block, BlockOwner, Stats, StreamAllocator};
use crate::device::Stream;
use crate::error::{Error, Result};

/// Fails allocations that would take the bytes handed out (as asked for) past a limit, with
/// [`Error::LimitExceeded`] naming it; each refusal counts as a failure in its [`Stats`].
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
    refused: AtomicU64,
}

impl<A: Allocator> Limit<A> {
    /// Wraps `inner` with a limit of `limit` bytes.
    pub fn new(inner: A, limit: usize) -> Self {
        let shared = Shared { limit, in_use: AtomicUsize::new(0), refused: AtomicU64::new(0) };
        Self { inner, shared: Arc::new(shared), owners: Owners::new() }
    }

    /// Takes `size` bytes of the limit, or refuses.
    fn take(&self, size: usize) -> Result<()> {
        let s = &self.shared;
        let before = s.in_use.fetch_add(size, Ordering::Relaxed);
        if before.checked_add(size).is_none_or(|total| total > s.limit) {
            s.in_use.fetch_sub(size, Ordering::Relaxed);
            s.refused.fetch_add(1, Ordering::Relaxed);
            return Err(Error::LimitExceeded {
                device: self.inner.device(),
                requested: size,
                in_use: before,
                limit: s.limit,
            });
        }
        Ok(())
    }

    /// Runs `make` within the limit: `size` bytes are taken first and given back if it fails.
    fn within<T>(&self, size: usize, make: impl FnOnce() -> Result<T>) -> Result<T> {
        self.take(size)?;
        make().inspect_err(|_| {
            self.shared.in_use.fetch_sub(size, Ordering::Relaxed);
        })
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
        let a = self.within(size, || self.inner.allocate(size))?;
        Ok(self.owners.adopt(&self.shared, a, |_| ()))
    }
    fn release(&self) -> Result<usize> {
        self.inner.release()
    }
    /// The wrapped allocator's, with the refusals counted as failures.
    fn stats(&self) -> Stats {
        let mut stats = self.inner.stats();
        stats.failures += self.shared.refused.load(Ordering::Relaxed);
        stats
    }
    pass_through_allocator!();
}

impl<A: StreamAllocator> StreamAllocator for Limit<A> {
    fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation> {
        let a = self.within(size, || self.inner.allocate_on(size, stream))?;
        Ok(self.owners.adopt(&self.shared, a, |_| ()))
    }
    pass_through_default_stream!();
}
