//! A pool of reusable events, so that steady-state frees create none.

use std::sync::Arc;

use parking_lot::Mutex;

use super::{Device, Event, Stream};
use crate::error::Result;

/// Recycles events of one device: [`EventPool::get`] hands out an idle event (creating one
/// only when none is idle) and [`EventPool::put`] returns it. Dropping the pool destroys the
/// idle events.
pub struct EventPool {
    device: Arc<dyn Device>,
    idle: Mutex<Vec<Event>>,
}

impl EventPool {
    /// An empty pool for `device`.
    pub fn new(device: Arc<dyn Device>) -> Self {
        Self { device, idle: Mutex::new(Vec::new()) }
    }

    /// An idle event, or a new one when none is idle.
    pub fn get(&self) -> Result<Event> {
        if let Some(e) = self.idle.lock().pop() {
            return Ok(e);
        }
        self.device.create_event()
    }

    /// Returns an event whose last recording is no longer needed.
    pub fn put(&self, event: Event) {
        self.idle.lock().push(event);
    }

    /// Makes later work on `waiter` wait for the work enqueued so far on `stream`: records an
    /// idle event on `stream`, makes `waiter` wait for it, and gives the event back (the wait
    /// took its state), whether or not the record and the wait succeeded.
    pub fn order_after(&self, waiter: Stream, stream: Stream) -> Result<()> {
        let event = self.get()?;
        let ordered = self
            .device
            .record_event(event, stream)
            .and_then(|()| self.device.stream_wait_event(waiter, event));
        self.put(event);
        ordered
    }

    /// How many events are idle in the pool.
    pub fn idle(&self) -> usize {
        self.idle.lock().len()
    }
}

impl Drop for EventPool {
    fn drop(&mut self) {
        for e in self.idle.get_mut().drain(..) {
            // Nothing to report to: a failing destroy at teardown only leaks one event.
            let _ = self.device.destroy_event(e);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::device::sim::{SimConfig, SimDevice};
    use crate::device::{DeviceMemory, Streams};

    #[test]
    fn order_after_makes_the_waiter_wait_and_keeps_one_event() {
        let sim = SimDevice::new(SimConfig::h200());
        let events = EventPool::new(sim.clone());
        let (busy, waiter) = (sim.create_stream().unwrap(), sim.create_stream().unwrap());
        let ptr = sim.alloc(1 << 20).unwrap();
        sim.use_range(ptr, 1 << 20, busy, 5_000_000).unwrap();
        let busy_until = sim.stream_ready_at(busy).unwrap();
        assert!(sim.stream_ready_at(waiter).unwrap() < busy_until);
        events.order_after(waiter, busy).unwrap();
        assert!(sim.stream_ready_at(waiter).unwrap() >= busy_until, "the waiter runs after the busy stream");
        // Again: the same event serves, none is made.
        events.order_after(waiter, busy).unwrap();
        assert_eq!(events.idle(), 1);
        // A stream the device does not know: an error, and the event still comes back.
        sim.destroy_stream(busy).unwrap();
        assert!(events.order_after(waiter, busy).is_err());
        assert_eq!(events.idle(), 1);
    }
}
