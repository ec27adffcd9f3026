//! Where a caching pool's chunks come from.

use std::sync::Arc;

use crate::device::{Device, DevicePtr};
use crate::error::Result;

/// A source of chunks of device address space for a caching pool such as
/// [`BestFit`](super::BestFit). Today's implementation is [`DeviceChunks`] (plain device
/// allocations). Expandable segments are not a source: a pool grows them in place
/// ([`BestFitConfig::expandable`](super::BestFitConfig::expandable)).
pub trait ChunkSource: Send + Sync {
    /// Obtains a chunk of `size` bytes, aligned to [`ALIGNMENT`](crate::ALIGNMENT).
    fn grow(&self, size: usize) -> Result<DevicePtr>;
    /// Gives back a chunk obtained with [`ChunkSource::grow`], whole.
    fn shrink(&self, addr: DevicePtr, size: usize) -> Result<()>;
    /// The device the chunks live on (for events, memory information and its ordinal).
    fn device(&self) -> &Arc<dyn Device>;
}

/// Chunks from the device's plain allocation calls (`cuMemAlloc` / `cuMemFree`). Giving a
/// chunk back synchronizes the device, as `cuMemFree` does.
pub struct DeviceChunks {
    device: Arc<dyn Device>,
}

impl DeviceChunks {
    /// A source of plain allocations on `device`.
    pub fn new(device: Arc<dyn Device>) -> Self {
        Self { device }
    }
}

impl ChunkSource for DeviceChunks {
    fn grow(&self, size: usize) -> Result<DevicePtr> {
        self.device.alloc(size)
    }

    fn shrink(&self, addr: DevicePtr, _size: usize) -> Result<()> {
        self.device.free(addr)
    }

    fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }
}
