//! `Retry`: on out-of-memory, release caches, wait (bounded) for frees, and try again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{FreeHook, Owners};
use crate::allocation::{Allocation, Allocator, Block, BlockOwner, Stats, StreamAllocator};
use crate::device::Stream;
use crate::error::{Error, Result};

/// Longest single wait between two attempts: frees that complete on the device (pending
/// releases) do not notify the host, so the adaptor looks again at least this often.
const SLICE: Duration = Duration::from_millis(5);

/// On [`Error::OutOfMemory`], releases the wrapped allocator's caches and tries again,
/// then waits for frees (through this adaptor, or pending on the device) and retries until
/// `timeout` has passed. The final error is the last out-of-memory error, its hint saying
/// how long it waited. Other errors pass through at once. A zero timeout still makes the
/// one release-and-retry.
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
}

impl<A: Allocator> Retry<A> {
    /// Wraps `inner`, waiting at most `timeout` for memory.
    pub fn new(inner: A, timeout: Duration) -> Self {
        let shared = Shared { timeout, frees: Mutex::new(0), freed: Condvar::new() };
        Self { inner, shared: Arc::new(shared), owners: Owners::new() }
    }

    fn retry(&self, make: impl Fn() -> Result<Allocation>) -> Result<Allocation> {
        match make() {
            Err(e) if e.is_out_of_memory() => {}
            other => return self.adopt(other?),
        }
        let start = Instant::now();
        let mut last = loop {
            // A failing release must not hide the out-of-memory error the caller needs.
            let _ = self.inner.release();
            let e = match make() {
                Err(e) if e.is_out_of_memory() => e,
                other => return self.adopt(other?),
            };
            let left = self.shared.timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                break e;
            }
            let mut frees = self.shared.frees.lock();
            let seen = *frees;
            self.shared.freed.wait_while_for(&mut frees, |n| *n == seen, left.min(SLICE));
        };
        if let Error::OutOfMemory(report) = &mut last {
            let waited = format!("retried after releasing caches and waited {:?} for frees", start.elapsed());
            report.hint = if report.hint.is_empty() { waited } else { format!("{}; {waited}", report.hint) };
        }
        Err(last)
    }

    fn adopt(&self, a: Allocation) -> Result<Allocation> {
        Ok(self.owners.adopt(&self.shared, a, |_| ()))
    }
}

impl FreeHook for Shared {
    fn free(&self, block: Block, inner: &dyn BlockOwner) {
        inner.free(block);
        *self.frees.lock() += 1;
        self.freed.notify_all();
    }
}

impl<A: Allocator> Allocator for Retry<A> {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        self.retry(|| self.inner.allocate(size))
    }
    pass_through_allocator!();
}

impl<A: StreamAllocator> StreamAllocator for Retry<A> {
    fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation> {
        self.retry(|| self.inner.allocate_on(size, stream))
    }
    pass_through_default_stream!();
}
