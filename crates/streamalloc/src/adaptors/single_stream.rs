//! `SingleStream`: an allocator without stream methods, usable on any stream.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::allocation::{Allocation, Allocator, Stats, StreamAllocator};
use crate::device::{Device, EventPool, Stream};
use crate::error::Result;

/// Makes an [`Allocator`] without stream methods (e.g. [`BestFit`](crate::allocators::BestFit)
/// or [`Plain`](crate::allocators::Plain)) a [`StreamAllocator`].
///
/// The wrapped allocator hands out memory in the order of its own stream. When the asking
/// stream is another one, that stream first waits (an event on the own stream, a
/// stream-wait-event on the asking one) so it cannot touch the memory before earlier work
/// of the own stream is done, and the allocation records the asking stream so that the
/// wrapped allocator's free waits for its work (see the [ordering contract](crate::allocation)).
/// Correct on any stream at the cost of two driver calls per allocation off the own
/// stream; a stream-aware allocator avoids both. If that ordering fails (e.g. the asking
/// stream is gone), the memory goes back and the allocation fails, counted once in the
/// [`Stats`].
///
/// # Examples
///
/// ```
/// use streamalloc::adaptors::SingleStream;
/// use streamalloc::allocators::{BestFit, BestFitConfig};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::{Streams, Stream, StreamAllocator};
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let pool = BestFit::new(sim.clone(), BestFitConfig::default())?; // the default stream's
/// let any = SingleStream::new(pool, sim.clone(), Stream::DEFAULT);
/// let side = sim.create_stream()?;
/// // `side` first waits for the default stream's work; the free waits for `side`'s.
/// let a = any.allocate_on(1 << 20, side)?;
/// assert_eq!((a.owning_stream(), a.recorded_streams()), (Stream::DEFAULT, &[side][..]));
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct SingleStream<A> {
    inner: A,
    events: EventPool,
    own: Stream,
    default: Mutex<Stream>,
    /// Allocations that failed in the ordering step (the wrapped allocator counted them as
    /// made and freed).
    failures: AtomicU64,
}

impl<A: Allocator> SingleStream<A> {
    /// Wraps `inner`, whose allocations belong to `own`, on `device`.
    pub fn new(inner: A, device: Arc<dyn Device>, own: Stream) -> Self {
        let events = EventPool::new(device);
        Self { inner, events, own, default: Mutex::new(own), failures: AtomicU64::new(0) }
    }

    /// Makes `stream` wait for the work enqueued so far on the own stream; counts a failure.
    fn order(&self, stream: Stream) -> Result<()> {
        let ordered = self.events.order_after(stream, self.own);
        if ordered.is_err() {
            self.failures.fetch_add(1, Ordering::Relaxed);
        }
        ordered
    }
}

impl<A: Allocator> Allocator for SingleStream<A> {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        self.allocate_on(size, self.default_stream())
    }
    fn release(&self) -> Result<usize> {
        self.inner.release()
    }
    /// The wrapped allocator's, with the failures of the ordering step.
    fn stats(&self) -> Stats {
        let mut stats = self.inner.stats();
        stats.failures += self.failures.load(Ordering::Relaxed);
        stats
    }
    pass_through_allocator!();
}

impl<A: Allocator> StreamAllocator for SingleStream<A> {
    fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation> {
        let mut a = self.inner.allocate(size)?;
        if stream != self.own && a.size() != 0 {
            // On failure `a` is dropped: the memory goes back.
            self.order(stream)?;
            a.record_stream(stream);
        }
        Ok(a)
    }
    fn default_stream(&self) -> Stream {
        *self.default.lock()
    }
    fn set_default_stream(&self, stream: Stream) {
        *self.default.lock() = stream;
    }
    /// Nothing to forget: the allocator below works on the adaptor's own stream, and other
    /// streams are ordered after it at each allocation.
    fn retire_stream(&self, _stream: Stream) -> Result<()> {
        Ok(())
    }
}
