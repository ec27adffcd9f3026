//! `Trace`: writes every allocation and free as RMM's logging CSV.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use super::{FreeHook, Owners};
use crate::allocation::{
    Allocation, Allocator, Block, BlockOwner, Freed, PointerAllocator, Stats, StreamAllocator,
};
use crate::device::{DevicePtr, Stream};
use crate::error::{Error, Result};
use crate::trace::{Action, Record, TraceWriter};

/// Logs each allocation, failure and free to a [`TraceWriter`] (buffered; flushed by
/// [`Trace::flush`] and when the adaptor and its last allocation are dropped). Safe
/// from many threads: rows are written under one lock. A write error is kept and returned by
/// the next [`Trace::flush`]. Streams are written as their handle values.
///
/// # Examples
///
/// ```
/// use streamalloc::adaptors::Trace;
/// use streamalloc::allocators::Plain;
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::trace::TraceWriter;
/// use streamalloc::{Allocator, Stream};
///
/// let path = std::env::temp_dir().join(format!("streamalloc-doc-{}.csv", std::process::id()));
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let traced = Trace::new(Plain::new(sim, Stream::DEFAULT), TraceWriter::create(&path)?);
/// drop(traced.allocate(1 << 20)?);
/// traced.flush()?;
/// let csv = std::fs::read_to_string(&path).unwrap();
/// assert_eq!(csv.lines().count(), 3); // the header, the allocation, the free
/// # std::fs::remove_file(&path).unwrap();
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct Trace<A, W: Write + Send + 'static> {
    inner: A,
    shared: Arc<Shared<W>>,
    owners: Owners<Shared<W>>,
}

struct Shared<W: Write + Send + 'static> {
    out: Mutex<Output<W>>,
}

struct Output<W: Write> {
    writer: Option<TraceWriter<W>>,
    error: Option<Error>,
}

fn thread_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    thread_local!(static ID: u64 = NEXT.fetch_add(1, Ordering::Relaxed));
    // Never panics, also while the thread is torn down (C++ thread_local destructors).
    ID.try_with(|id| *id).unwrap_or(u64::MAX)
}

impl<W: Write + Send + 'static> Shared<W> {
    fn log(&self, action: Action, ptr: u64, size: usize, stream: Stream) {
        Self::write(&mut self.out.lock(), action, ptr, size, stream);
    }

    fn write(out: &mut Output<W>, action: Action, ptr: u64, size: usize, stream: Stream) {
        let time_us = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        let record = Record { thread: thread_number(), time_us, action, ptr, size, stream: stream.0 };
        let Output { writer, error } = out;
        if let Some(w) = writer {
            if let Err(e) = w.write(&record) {
                error.get_or_insert(e);
            }
        }
    }
}

impl<A: Allocator, W: Write + Send + 'static> Trace<A, W> {
    /// Wraps `inner`, writing rows to `writer`.
    pub fn new(inner: A, writer: TraceWriter<W>) -> Self {
        let out = Mutex::new(Output { writer: Some(writer), error: None });
        Self { inner, shared: Arc::new(Shared { out }), owners: Owners::new() }
    }

    /// Flushes the rows written so far; returns the first write error met since the last
    /// flush, if any.
    pub fn flush(&self) -> Result<()> {
        let mut out = self.shared.out.lock();
        if let Some(e) = out.error.take() {
            return Err(e);
        }
        match out.writer.as_mut() {
            Some(w) => w.flush(),
            None => Ok(()),
        }
    }

    fn logged(&self, size: usize, stream: Stream, made: Result<Allocation>) -> Result<Allocation> {
        let a = match made {
            Ok(a) => a,
            Err(e) => {
                self.shared.log(Action::AllocateFailure, 0, size, stream);
                return Err(e);
            }
        };
        Ok(self.owners.adopt(&self.shared, a, |block| {
            self.shared.log(Action::Allocate, block.ptr, block.size, block.stream)
        }))
    }
}

impl<W: Write + Send + 'static> FreeHook for Shared<W> {
    fn free(&self, block: Block, inner: &dyn BlockOwner) {
        self.log(Action::Free, block.ptr, block.size, block.stream);
        inner.free(block);
    }
}

impl<A: Allocator, W: Write + Send + 'static> Allocator for Trace<A, W> {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        let stream = Stream::DEFAULT;
        self.logged(size, stream, self.inner.allocate(size))
    }
    fn release(&self) -> Result<usize> {
        self.inner.release()
    }
    fn stats(&self) -> Stats {
        self.inner.stats()
    }
    pass_through_allocator!();
}

impl<A: StreamAllocator, W: Write + Send + 'static> StreamAllocator for Trace<A, W> {
    fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation> {
        self.logged(size, stream, self.inner.allocate_on(size, stream))
    }
    pass_through_default_stream!();
}

impl<A: Allocator + PointerAllocator, W: Write + Send + 'static> PointerAllocator for Trace<A, W> {
    fn allocate_ptr(&self, size: usize, stream: Stream) -> Result<DevicePtr> {
        let made = self.inner.allocate_ptr(size, stream);
        match &made {
            Ok(0) => {}
            Ok(ptr) => self.shared.log(Action::Allocate, *ptr, size, self.inner.owning_stream(stream)),
            Err(_) => self.shared.log(Action::AllocateFailure, 0, size, stream),
        }
        made
    }
    /// The free is made under the trace's lock, so that its row comes before the row of
    /// whoever gets the memory next.
    fn free_ptr(&self, ptr: DevicePtr, owner: Stream) -> Option<Freed> {
        let mut out = self.shared.out.lock();
        let freed = self.inner.free_ptr(ptr, owner)?;
        Shared::write(&mut out, Action::Free, ptr, freed.size, freed.stream);
        Some(freed)
    }
    pass_through_pointers!();
}
