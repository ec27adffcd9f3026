//! `Retry`: on out-of-memory, release caches, wait (bounded) for frees, and try again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::{FreeHook, Owners};
use crate::allocation::{Allocation, Allocator, Block, BlockOwner, Stats, StreamAllocator};
use crate::allocators::retry::on_out_of_memory;
use crate::device::Stream;
use crate::error::{Error, HeldErrors, Result};

/// Longest single wait between two attempts: frees that complete on the device (pending
/// releases) do not notify the host, so the adaptor looks again at least this often.
const SLICE: Duration = Duration::from_millis(5);

/// On [`Error::OutOfMemory`], releases the wrapped allocator's caches and tries again,
/// then waits for frees (through this adaptor, or pending on the device) and retries until
/// `timeout` has passed. The final error is the last out-of-memory error, its hint saying
/// how long it waited. Other errors pass through at once. A zero timeout still makes the
/// one release-and-retry.
///
/// In its [`Stats`], an allocation counts once: a failure if the last attempt failed (the
/// wrapped allocator's failed attempts before it are not counted), a retry if an attempt
/// after the first succeeded. Errors the wrapped allocator's release reports as held back
/// ([`Error::HeldBack`]) are kept for this adaptor's own [`Allocator::release`].
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use streamalloc::adaptors::Retry;
/// use streamalloc::allocators::Plain;
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::{Allocator, Stream};
///
/// let sim = SimDevice::new(SimConfig::with_capacity(64 << 20));
/// let pool = Retry::new(Plain::new(sim, Stream::DEFAULT), Duration::from_secs(10));
/// let first = pool.allocate(48 << 20)?;
/// let freer = std::thread::spawn(move || {
///     std::thread::sleep(Duration::from_millis(20));
///     drop(first);
/// });
/// // 48 MiB more do not fit in 64 until `first` is freed: this waits for that free
/// // (at most 10 s, then the out-of-memory error says how long it waited).
/// let second = pool.allocate(48 << 20)?;
/// freer.join().unwrap();
/// # drop(second);
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct Retry<A> {
    inner: A,
    shared: Arc<Shared>,
    owners: Owners<Shared>,
}

struct Shared {
    timeout: Duration,
    frees: Mutex<u64>,
    freed: Condvar,
    /// Failed attempts of the wrapped allocator that were not the allocation's last.
    absorbed: AtomicU64,
    /// Allocations that succeeded after a failed attempt.
    retries: AtomicU64,
    /// What the wrapped allocator's releases reported as held back.
    held: Mutex<HeldErrors>,
}

impl<A: Allocator> Retry<A> {
    /// Wraps `inner`, waiting at most `timeout` for memory.
    pub fn new(inner: A, timeout: Duration) -> Self {
        let shared = Shared {
            timeout,
            frees: Mutex::new(0),
            freed: Condvar::new(),
            absorbed: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            held: Mutex::default(),
        };
        Self { inner, shared: Arc::new(shared), owners: Owners::new() }
    }

    /// The shared loop ([`on_out_of_memory`]) with this adaptor's release (the wrapped
    /// allocator's) and wait (for a free through this adaptor, a slice at a time).
    fn retry<T>(&self, make: impl Fn() -> Result<T>) -> Result<T> {
        let s = &self.shared;
        let release = || {
            // A release that cannot give memory back (e.g. a wait that ran out) leaves the
            // out-of-memory error, which says so, to the caller; errors held back are kept.
            if let Err(e @ Error::HeldBack { .. }) = self.inner.release() {
                s.held.lock().hold(e);
            }
            Ok(None)
        };
        let wait = |left: Duration| {
            let mut frees = s.frees.lock();
            let seen = *frees;
            s.freed.wait_while_for(&mut frees, |n| *n == seen, left.min(SLICE));
        };
        let retried = on_out_of_memory(s.timeout, make, release, wait);
        // The wrapped allocator counted each failed attempt; only a last one stays a failure.
        let absorbed = retried.failed - u64::from(retried.out_of_memory());
        s.absorbed.fetch_add(absorbed, Ordering::Relaxed);
        if retried.retried() {
            s.retries.fetch_add(1, Ordering::Relaxed);
        }
        let waited = retried.waited;
        retried.result.map_err(|mut e| {
            if let Error::OutOfMemory(report) = &mut e {
                if report.exceeds_device() {
                    return e; // not retried: the hint of the allocator below says why
                }
                let line = format!("retried after releasing caches and waited {waited:?} for frees");
                report.hint = if report.hint.is_empty() { line } else { format!("{}; {line}", report.hint) };
            }
            e
        })
    }

    fn adopt(&self, a: Allocation) -> Allocation {
        self.owners.adopt(&self.shared, a, |_| ())
    }
}

impl Shared {
    fn notify(&self) {
        *self.frees.lock() += 1;
        self.freed.notify_all();
    }
}

impl FreeHook for Shared {
    fn free(&self, block: Block, inner: &dyn BlockOwner) {
        inner.free(block);
        self.notify();
    }
}

impl<A: Allocator> Allocator for Retry<A> {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        Ok(self.adopt(self.retry(|| self.inner.allocate(size))?))
    }
    /// The wrapped allocator's release; then the errors held back that its releases made
    /// during retries reported.
    fn release(&self) -> Result<usize> {
        let released = self.inner.release();
        self.shared.held.lock().take()?;
        released
    }
    /// The wrapped allocator's, each allocation counted once (see [`Retry`]).
    fn stats(&self) -> Stats {
        let mut stats = self.inner.stats();
        stats.failures = stats.failures.saturating_sub(self.shared.absorbed.load(Ordering::Relaxed));
        stats.retries += self.shared.retries.load(Ordering::Relaxed);
        stats
    }
    pass_through_allocator!();
}

impl<A: StreamAllocator> StreamAllocator for Retry<A> {
    fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation> {
        Ok(self.adopt(self.retry(|| self.inner.allocate_on(size, stream))?))
    }
    pass_through_default_stream!();
}
