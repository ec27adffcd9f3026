//! Chunks from a [`ChunkSource`], each given back whole.

use std::sync::Arc;

use super::{Backing, Taken, Want};
use crate::device::{Device, DevicePtr};
use crate::error::{try_each, Error, Result};
use crate::policy::best_fit::{BestFitPolicy, TakenChunk};
use crate::policy::AddrRange;

/// A source of chunks of device address space for a caching pool such as
/// [`BestFit`](crate::allocators::BestFit), which the [`Chunks`] backing draws on. Today's
/// implementation is [`DeviceChunks`] (plain device allocations).
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

/// The backing of chunks: a miss grows the pool by one chunk of the size the policy asks
/// for ([`Want::chunk`]); a release gives back every wholly free chunk.
pub struct Chunks {
    source: Arc<dyn ChunkSource>,
}

impl Chunks {
    /// Chunks from `source`.
    pub fn new(source: Arc<dyn ChunkSource>) -> Self {
        Self { source }
    }

    /// Gives back the chunk `[addr, addr + size)`, obtained from this backing's source.
    pub(super) fn shrink(&self, addr: u64, size: u64) -> Result<()> {
        self.source.shrink(addr, size as usize)
    }
}

impl Backing for Chunks {
    fn device(&self) -> &Arc<dyn Device> {
        self.source.device()
    }

    fn grow(&self, books: &mut BestFitPolicy, want: &Want) -> Result<()> {
        let size = usize::try_from(want.chunk)
            .map_err(|_| Error::InvalidArgument(format!("a chunk of {} bytes", want.chunk)))?;
        let addr = self.source.grow(size)?;
        books.add_chunk(want.class, addr, want.chunk).inspect_err(|_| {
            // A bug: the policy refused a chunk just obtained; give it back.
            let _ = self.source.shrink(addr, size);
        })
    }

    fn release_begin(&self, books: &mut BestFitPolicy) -> Result<Taken> {
        Ok(Taken { chunks: books.release_free_chunks(), ..Taken::default() })
    }

    /// A `cuMemFree` orders itself after the device's work, without a bound: the pool's
    /// stream is waited for first, with one. Chunks go back also when the stream cannot be
    /// waited for (an error other than a timeout).
    fn release_end(&self, books: &mut BestFitPolicy, taken: Taken, waited: Result<()>) -> Result<usize> {
        let chunks = taken.chunks;
        if let Err(timeout @ Error::Timeout { .. }) = waited {
            restore(books, &chunks);
            return Err(timeout);
        }
        // A chunk that fails is out of the pool; the device keeps it (a leak the error reports).
        let mut released = 0;
        try_each(chunks, |TakenChunk { addr, size, .. }| {
            self.shrink(addr, size)?;
            released += size as usize;
            Ok(())
        })?;
        Ok(released)
    }

    fn teardown(&mut self, chunks: Vec<AddrRange>) {
        for c in chunks {
            let _ = self.shrink(c.addr, c.len);
        }
    }
}

/// Puts `chunks`, taken out of the pool for a release that could not wait, back into
/// `books`. Only a bug makes the policy refuse them (they were its own): the memory then
/// stays out of the pool.
pub(super) fn restore(books: &mut BestFitPolicy, chunks: &[TakenChunk]) {
    for &chunk in chunks {
        let _ = books.restore_chunk(chunk);
    }
}
