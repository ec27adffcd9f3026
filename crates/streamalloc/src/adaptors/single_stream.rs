//! `SingleStream`: an allocator without stream methods, usable on any stream.

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
/// stream; a stream-aware allocator avoids both.
pub struct SingleStream<A> {
    inner: A,
    device: Arc<dyn Device>,
    events: EventPool,
    own: Stream,
    default: Mutex<Stream>,
}

impl<A: Allocator> SingleStream<A> {
    /// Wraps `inner`, whose allocations belong to `own`, on `device`.
    pub fn new(inner: A, device: Arc<dyn Device>, own: Stream) -> Self {
        let events = EventPool::new(device.clone());
        Self { inner, device, events, own, default: Mutex::new(own) }
    }
}

impl<A: Allocator> Allocator for SingleStream<A> {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        self.allocate_on(size, self.default_stream())
    }
    pass_through_allocator!();
}

impl<A: Allocator> StreamAllocator for SingleStream<A> {
    fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation> {
        let mut a = self.inner.allocate(size)?;
        if stream != self.own && a.size() != 0 {
            let event = self.events.get()?;
            let ordered = self
                .device
                .record_event(event, self.own)
                .and_then(|()| self.device.stream_wait_event(stream, event));
            // The wait captured the event's state; the event can be reused at once.
            self.events.put(event);
            ordered?;
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
}
