//! `Limit`: a hard byte limit over any allocator; `ReservedLimit`: a cap on the memory a
//! pointer stack holds from the device (PyTorch's memory fraction).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use super::{FreeHook, Owners, Pointers};
use crate::allocation::{Allocation, Allocator, Block, BlockOwner, Stats, StreamAllocator};
use crate::device::{DevicePtr, Stream};
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

/// A cap on the device memory a [`Pointers`] stack holds (reserved, whether handed out or
/// cached), settable while the stack serves: PyTorch's per-process memory fraction, applied as
/// its caching allocator applies it.
///
/// With a cap set, [`ReservedLimit::allocate_ptr_with`] refuses a request that would take the
/// bytes handed out past it ([`Error::LimitExceeded`], nothing allocated); a request that leaves
/// the stack holding more than the cap releases the stack's cache
/// ([`Allocator::release`](crate::Allocator::release)), keeping the new allocation, and if the
/// stack still holds more, frees it and fails with the release's error or
/// [`Error::LimitExceeded`]. Nothing is attempted twice (retries are the stack's own). Without
/// a cap the call is the stack's [`Pointers::allocate_ptr_with`], at the cost of one atomic load.
#[derive(Debug, Default)]
pub struct ReservedLimit {
    /// The cap in bytes; 0: none.
    bytes: AtomicUsize,
}

impl ReservedLimit {
    /// Sets the cap to `bytes` (at least 1), or removes it (`None`).
    pub fn set(&self, bytes: Option<usize>) {
        self.bytes.store(bytes.map_or(0, |b| b.max(1)), Ordering::Relaxed);
    }

    /// The cap, if one is set.
    pub fn get(&self) -> Option<usize> {
        match self.bytes.load(Ordering::Relaxed) {
            0 => None,
            b => Some(b),
        }
    }

    /// Allocates `size` bytes on `stream` from `stack` under the cap (see the type's
    /// contract), `word` kept with the allocation as [`Pointers::allocate_ptr_with`] keeps it.
    pub fn allocate_ptr_with<A: StreamAllocator>(
        &self,
        stack: &Pointers<A>,
        size: usize,
        stream: Stream,
        word: u64,
    ) -> Result<DevicePtr> {
        let Some(limit) = self.get() else {
            return stack.allocate_ptr_with(size, stream, word);
        };
        let exceeded =
            |in_use: usize| Error::LimitExceeded { device: stack.device(), requested: size, in_use, limit };
        let before = stack.stats();
        if before.allocated.saturating_add(size) > limit {
            return Err(exceeded(before.allocated));
        }
        let ptr = stack.allocate_ptr_with(size, stream, word)?;
        if stack.stats().reserved <= limit {
            return Ok(ptr);
        }
        // A release that fails (a stream still at work past `wait_timeout`) may still have
        // given enough back; if not, its error is the one returned, after the free.
        let released = stack.release();
        let held = stack.stats().reserved;
        if held <= limit {
            return Ok(ptr);
        }
        stack.free_ptr(ptr, stream);
        released?;
        Err(exceeded(held))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::allocators::{BackingKind, StreamSafe, StreamSafeConfig};
    use crate::device::sim::{SimConfig, SimDevice};
    use crate::device::Streams;

    const MIB: usize = 1 << 20;

    /// A pointer stack over chunks (each cached block a device allocation of its own, so
    /// that a request larger than the cache cannot reuse it).
    fn stack() -> (Arc<SimDevice>, Pointers<StreamSafe>, Stream) {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let mut config = StreamSafeConfig::default();
        config.pool.backing = BackingKind::CHUNKS;
        let alloc = StreamSafe::new(sim.clone(), config).unwrap();
        let s = sim.create_stream().unwrap();
        (sim.clone(), Pointers::new(alloc, sim, Duration::from_secs(1)), s)
    }

    #[test]
    fn a_request_past_the_cap_on_bytes_handed_out_allocates_nothing() {
        let (_sim, stack, s) = stack();
        let cap = ReservedLimit::default();
        cap.set(Some(64 * MIB));
        let a = cap.allocate_ptr_with(&stack, 40 * MIB, s, 0).unwrap();
        let calls = stack.stats().total_allocations;
        let err = cap.allocate_ptr_with(&stack, 40 * MIB, s, 0).unwrap_err();
        assert!(
            matches!(err, Error::LimitExceeded { requested, limit, .. } if requested == 40 * MIB && limit == 64 * MIB)
        );
        assert_eq!(stack.stats().total_allocations, calls, "nothing allocated for a refused request");
        assert!(stack.free_ptr(a, s));
    }

    #[test]
    fn a_cache_over_the_cap_is_released_and_the_allocation_kept() {
        let (_sim, stack, s) = stack();
        let cap = ReservedLimit::default();
        let cached = stack.allocate_ptr(16 * MIB, s).unwrap();
        assert!(stack.free_ptr(cached, s));
        let held = stack.stats().reserved;
        assert!(held >= 16 * MIB, "the free left its chunk cached: {held}");
        // A request larger than the cache cannot reuse it: the stack holds both until the
        // cache goes back, more than the cap, which the request alone fits under.
        let size = held + 16 * MIB;
        cap.set(Some(size + 8 * MIB));
        let a = cap.allocate_ptr_with(&stack, size, s, 7).unwrap();
        let stats = stack.stats();
        assert!(stats.reserved <= size + 8 * MIB, "held {} over the cap", stats.reserved);
        assert_eq!(stats.allocated, size);
        assert_eq!(stack.entry(a, Some(s)).map(|e| e.word), Some(7));
        cap.set(None);
        assert_eq!(cap.get(), None);
        assert!(stack.free_ptr(a, s));
    }
}
