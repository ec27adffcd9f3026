//! `Traced`: writes every allocation and free as RMM's logging CSV, and the streams recorded
//! on allocations.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use super::{FreeHook, Owners};
use crate::allocation::{Allocation, Allocator, Block, BlockOwner, Stats, StreamAllocator};
use crate::device::{DevicePtr, Stream};
use crate::error::{Error, Result};
use crate::trace::{Action, Record, TraceWriter};

/// Logs each allocation, failure, free and recorded stream (`record_stream` rows, just before
/// the free of the allocation that recorded them) to a [`TraceWriter`], and the `use` and `wait`
/// rows a program writes ([`Traced::write_use`], [`Traced::write_wait`]) (buffered; flushed by
/// [`Traced::flush`] and when the adaptor and its last allocation are dropped). Safe
/// from many threads: rows are written under one lock. A write error is kept and returned by
/// the next [`Traced::flush`]. Streams are written as their handle values: an allocation's
/// row names the stream the caller asked for, its free's row the stream that owns the memory
/// (the same, but under an allocator that serves every stream from one, such as
/// [`SingleStream`](super::SingleStream), whose `record_stream` row of the asked stream comes
/// before the free).
///
/// # Examples
///
/// ```
/// use streamalloc::adaptors::Traced;
/// use streamalloc::allocators::Plain;
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::trace::TraceWriter;
/// use streamalloc::{Allocator, Stream};
///
/// let path = std::env::temp_dir().join(format!("streamalloc-doc-{}.csv", std::process::id()));
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let traced = Traced::new(Plain::new(sim, Stream::DEFAULT), TraceWriter::create(&path)?);
/// drop(traced.allocate(1 << 20)?);
/// traced.flush()?;
/// let csv = std::fs::read_to_string(&path).unwrap();
/// assert_eq!(csv.lines().count(), 3); // the header, the allocation, the free
/// # std::fs::remove_file(&path).unwrap();
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct Traced<A, W: Write + Send + 'static> {
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
        let record = Record { thread: thread_number(), time_us, action, ptr, size, stream: stream.raw() };
        let Output { writer, error } = out;
        if let Some(w) = writer {
            if let Err(e) = w.write(&record) {
                error.get_or_insert(e);
            }
        }
    }
}

impl<A: Allocator, W: Write + Send + 'static> Traced<A, W> {
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

    /// Writes a `use` row: work enqueued now on `stream` uses the allocation at `ptr` for
    /// `duration_ns` (measured, or estimated, by the caller). For programs that tell a replay
    /// what their streams do (`streamalloc_trace_use` of the C ABI).
    pub fn write_use(&self, ptr: DevicePtr, stream: Stream, duration_ns: u64) {
        let duration = usize::try_from(duration_ns).unwrap_or(usize::MAX);
        self.shared.log(Action::Use, ptr, duration, stream);
    }

    /// Writes a `wait` row: `stream` now waits for the work enqueued so far on `other`
    /// (`streamalloc_trace_wait` of the C ABI).
    pub fn write_wait(&self, stream: Stream, other: Stream) {
        self.shared.log(Action::Wait, other.raw(), 0, stream);
    }

    /// Logs `made`, asked for on `asked` (`None`: by [`Allocator::allocate`], on the
    /// allocator's own stream).
    fn logged(&self, size: usize, asked: Option<Stream>, made: Result<Allocation>) -> Result<Allocation> {
        let a = match made {
            Ok(a) => a,
            Err(e) => {
                self.shared.log(Action::AllocateFailure, 0, size, asked.unwrap_or(Stream::DEFAULT));
                return Err(e);
            }
        };
        Ok(self.owners.adopt(&self.shared, a, |block| {
            self.shared.log(Action::Allocate, block.ptr, block.size, asked.unwrap_or(block.stream))
        }))
    }
}

impl<W: Write + Send + 'static> FreeHook for Shared<W> {
    /// An allocation keeps its recorded streams itself ([`Allocation::record_stream`] calls
    /// no allocator, nor does a record by pointer), so their `record_stream` rows are written
    /// here, just before the free's: what a replay needs, the streams recorded when the memory
    /// is freed.
    fn free(&self, block: Block, inner: &dyn BlockOwner) {
        {
            let mut out = self.out.lock();
            for &stream in &block.recorded {
                Self::write(&mut out, Action::RecordStream, block.ptr, 0, stream);
            }
            Self::write(&mut out, Action::Free, block.ptr, block.size, block.stream);
        }
        inner.free(block);
    }
}

impl<A: Allocator, W: Write + Send + 'static> Allocator for Traced<A, W> {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        self.logged(size, None, self.inner.allocate(size))
    }
    fn release(&self) -> Result<usize> {
        self.inner.release()
    }
    fn stats(&self) -> Stats {
        self.inner.stats()
    }
    pass_through_allocator!();
}

impl<A: StreamAllocator, W: Write + Send + 'static> StreamAllocator for Traced<A, W> {
    fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation> {
        self.logged(size, Some(stream), self.inner.allocate_on(size, stream))
    }
    pass_through_default_stream!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adaptors::Pointers;
    use crate::allocators::{StreamSafe, StreamSafeConfig};
    use crate::device::sim::{SimConfig, SimDevice};
    use crate::device::Streams;

    /// A writer whose bytes the test reads while the adaptor holds it.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The rows written so far, the header and the Thread and Time columns left out.
    fn rows<A: Allocator>(traced: &Traced<A, Shared>, out: &Shared) -> Vec<String> {
        traced.flush().unwrap();
        let text = String::from_utf8(out.0.lock().clone()).unwrap();
        text.lines().skip(1).map(|l| l.splitn(3, ',').nth(2).unwrap().to_owned()).collect()
    }

    /// Issue 37: a record_stream, by pointer or on a handle, wrote no row, so a replay
    /// reused memory a side stream still read.
    #[test]
    fn record_stream_writes_its_row_by_pointer_and_by_handle() {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let side = sim.create_stream().unwrap();
        let out = Shared::default();
        let traced = Arc::new(Traced::new(
            StreamSafe::new(sim.clone(), StreamSafeConfig::default()).unwrap(),
            TraceWriter::new(out.clone()).unwrap(),
        ));
        let stack = Pointers::new(traced.clone(), sim.clone(), std::time::Duration::from_secs(1));
        let p = stack.allocate_ptr(4096, Stream::DEFAULT).unwrap();
        assert!(stack.record_stream_ptr(p, side).unwrap());
        // A pointer no allocation lives at records nothing and writes nothing.
        assert!(!stack.record_stream_ptr(p + 1, side).unwrap());
        assert!(stack.free_ptr(p, Stream::DEFAULT));
        let mut a = traced.allocate_on(8192, Stream::DEFAULT).unwrap();
        a.record_stream(side);
        let q = a.ptr();
        drop(a);
        let s = side.raw();
        assert_eq!(
            rows(&traced, &out),
            [
                format!("allocate,{p:#x},4096,0"),
                format!("record_stream,{p:#x},0,{s}"),
                format!("free,{p:#x},4096,0"),
                format!("allocate,{q:#x},8192,0"),
                format!("record_stream,{q:#x},0,{s}"),
                format!("free,{q:#x},8192,0"),
            ]
        );
    }

    /// Under an allocator that serves every stream from one (best_fit, plain: `SingleStream`),
    /// an allocation asked for on a side stream was written on the pool's stream, so a replay
    /// through a stream-aware allocator put it in the wrong stream's pool. The allocate row
    /// names the stream the program asked for; the free, the stream that owns the memory,
    /// after the `record_stream` row of the asked stream that orders the reuse after it.
    #[test]
    fn an_allocate_row_names_the_stream_asked_for() {
        use crate::adaptors::SingleStream;
        use crate::allocators::{BestFit, BestFitConfig};
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let side = sim.create_stream().unwrap();
        let out = Shared::default();
        let pool = BestFit::new(sim.clone(), BestFitConfig::default()).unwrap();
        let traced = Traced::new(
            SingleStream::new(pool, sim.clone(), Stream::DEFAULT),
            TraceWriter::new(out.clone()).unwrap(),
        );
        let a = traced.allocate_on(4096, side).unwrap();
        let p = a.ptr();
        drop(a);
        let s = side.raw();
        assert_eq!(
            rows(&traced, &out),
            [
                format!("allocate,{p:#x},4096,{s}"),
                format!("record_stream,{p:#x},0,{s}"),
                format!("free,{p:#x},4096,0")
            ]
        );
    }

    #[test]
    fn use_and_wait_rows_are_written_as_given() {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let side = sim.create_stream().unwrap();
        let out = Shared::default();
        let traced = Traced::new(
            StreamSafe::new(sim.clone(), StreamSafeConfig::default()).unwrap(),
            TraceWriter::new(out.clone()).unwrap(),
        );
        traced.write_use(0x7f00, side, 2_500);
        traced.write_wait(Stream::DEFAULT, side);
        let s = side.raw();
        assert_eq!(rows(&traced, &out), [format!("use,0x7f00,2500,{s}"), format!("wait,{s:#x},0,0")]);
    }
}
