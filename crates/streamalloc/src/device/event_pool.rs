//! A pool of reusable events, so that steady-state frees create none.

use std::sync::Arc;

use parking_lot::Mutex;

use super::{Device, Event};
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
