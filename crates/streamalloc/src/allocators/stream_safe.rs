//! `StreamSafe`: a caching pool per stream, with `record_stream`, deferred frees, stealing
//! across streams and retry on out-of-memory (Paddle's `StreamSafeCUDAAllocator`, PyTorch's
//! caching allocator semantics).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;

use super::best_fit::{BestFit, BestFitConfig};
use super::retry;
use crate::allocation::{Allocation, Allocator, Freed, PointerAllocator, Stats, StreamAllocator};
use crate::device::{CaptureStatus, Device, DevicePtr, EventPool, Stream};
use crate::error::{Error, OutOfMemory, Result};

/// Settings of a [`StreamSafe`] allocator.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use streamalloc::allocators::{BestFitConfig, StreamSafe, StreamSafeConfig};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::{Device, StreamAllocator};
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let config = StreamSafeConfig {
///     pool: BestFitConfig { growth: 16 << 20, ..Default::default() }, // each stream's pool
///     retry_wait: Duration::from_millis(100), // on out-of-memory, wait for pending frees
///     ..Default::default()
/// };
/// let alloc = StreamSafe::new(sim.clone(), config)?;
/// let a = alloc.allocate_on(1 << 20, sim.create_stream()?)?;
/// # drop(a);
/// # Ok::<(), streamalloc::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamSafeConfig {
    /// Chunk sizes of each stream's pool (its `stream` field is ignored: each pool belongs
    /// to its own stream).
    pub pool: BestFitConfig,
    /// The stream [`Allocator::allocate`] uses until [`StreamAllocator::set_default_stream`].
    pub default_stream: Stream,
    /// On out-of-memory, after every pool has released its free chunks, how long to keep
    /// retrying while frees pending on other streams' events complete. Default 0: fail
    /// after the one release-and-retry.
    pub retry_wait: Duration,
    /// A pool that misses takes a chunk from another stream's idle pool only while the
    /// device's free memory is below this percentage of its total; above it, the pool grows.
    /// Default 10; 100 takes whenever an idle pool has a fitting chunk, 0 never does.
    pub steal_below_free_percent: u8,
}

impl Default for StreamSafeConfig {
    fn default() -> Self {
        Self {
            pool: BestFitConfig::default(),
            default_stream: Stream::DEFAULT,
            retry_wait: Duration::ZERO,
            steal_below_free_percent: 10,
        }
    }
}

/// How many streams get a lock-free slot; further streams share a locked map.
const SLOTS: usize = 256;
/// In [`StreamPool::looked`], a pool not looked at yet (no allocation count equals it).
const NEVER_SEEN: u64 = u64::MAX;
/// Pause between two attempts while waiting for pending frees.
const RETRY_PAUSE: Duration = Duration::from_millis(1);

/// A caching pool per stream, following the [ordering contract](crate::allocation).
///
/// * **Ownership.** Each stream has its own [`BestFit`] pool, created on the stream's first
///   allocation. An allocation belongs to the stream it was made on; freed, its block goes
///   back to that stream's pool and is reused at once by that stream.
/// * **`record_stream`.** When an allocation that recorded other streams is freed, an event
///   (from a pool of events) is recorded on each of them and the block stays out of the
///   free lists until all have completed. Completion is checked lazily, without blocking:
///   when the pool allocates with pending frees, on a miss, and in [`Allocator::release`];
///   never by a background thread and never while the allocating stream is capturing a
///   graph.
/// * **Stealing.** When a stream's pool has no fitting block while device memory is short
///   (free below [`StreamSafeConfig::steal_below_free_percent`], default 10%, of the total),
///   a wholly free chunk of another stream's idle pool that fits is moved into it before the
///   device footprint grows; with memory to spare the pool grows instead, which costs one
///   device call and no other stream anything. The taking stream waits on an event recorded
///   on the giving stream (so earlier work there is done before it uses the memory), once
///   per chunk, and the chunk then belongs to the taking stream's pool for good, so streams
///   do not pay an event per allocation. Only an idle pool gives a chunk away: one with no
///   live allocation that has made no allocation between the taking pool's previous miss
///   and this one (so nothing is taken at a pool's first miss). Taking from busy streams
///   made chunks ping-pong between streams that each needed them, every move a cross-stream
///   wait and a lock of the other stream's pool (eight threads replaying a trace on their
///   own streams moved chunks hundreds of times per pass); taking from a stream idle only
///   for a moment robbed streams waiting at a barrier between two steps, which then grew
///   again in the next step.
/// * **Out of memory.** Each pool first returns its own free chunks and retries once; then
///   every stream's pool releases its free chunks and the allocation is retried, then
///   retried again every millisecond for up to [`StreamSafeConfig::retry_wait`] while
///   pending frees complete. Before the pools give memory back, the allocation waits for the
///   work enqueued on every stream with a pool, at most the pools'
///   [`wait_timeout`](BestFitConfig::wait_timeout) in all (a `cuMemFree` waits for all the
///   device's work): past it nothing is given back, and the error says which stream it
///   waited for and how long. The final error lists every stream's pool.
/// * **Streams destroyed before their allocations.** Freeing memory owned by a destroyed
///   stream makes no call on that stream, so it is safe. A stream recorded with
///   `record_stream` must still exist when the allocation is freed (an event is recorded on
///   it; [`PointerAllocator::record_stream_ptr`] checks it when recording); if it does not,
///   the block is never reused and the next [`Allocator::release`] reports the driver's
///   error, but nothing crashes. Before destroying a stream, call
///   [`StreamSafe::retire_stream`]: its pool is retired (a new stream that the driver gives
///   the same handle starts afresh), its free chunks return to the device, and the rest
///   returns at a later [`Allocator::release`] once its allocations are freed.
/// * **Concurrency.** Finding a stream's pool takes no lock (the default stream's pool and
///   the first 256 streams' pools are found by reading atomics, writing none); allocating
///   and freeing take the one lock of the stream's pool.
///
/// # Examples
///
/// ```
/// use streamalloc::allocators::{StreamSafe, StreamSafeConfig};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::{Allocator, Device, StreamAllocator};
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let alloc = StreamSafe::new(sim.clone(), StreamSafeConfig::default())?;
/// let stream = sim.create_stream()?;
/// let a = alloc.allocate_on(1 << 20, stream)?; // from `stream`'s own pool
/// assert_eq!(a.owning_stream(), stream);
/// drop(a); // back to that pool, reusable at once on `stream`
/// assert_eq!(alloc.stats().allocated, 0);
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct StreamSafe {
    device: Arc<dyn Device>,
    config: StreamSafeConfig,
    events: EventPool,
    default_stream: AtomicU64,
    /// The pools in use, as registry index + 1 (0: empty), by stream hash with linear
    /// probing; finding a pool here reads atomics and writes none.
    slots: Box<[AtomicUsize]>,
    /// Registry indices of the pools in use that found no slot.
    overflow: Mutex<Vec<usize>>,
    /// Every pool ever made, retired ones included.
    registry: Registry,
    /// Serializes the creation and replacement of pools.
    creating: Mutex<()>,
    /// Failed allocations, counted once each here (the pools count none of StreamSafe's).
    failures: AtomicU64,
    /// Allocations that succeeded only after a release, a wait or another attempt.
    retries: AtomicU64,
}

struct StreamPool {
    stream: Stream,
    pool: BestFit,
    /// Each other pool's allocation count (by registry index) when this pool last looked
    /// for a chunk to take ([`NEVER_SEEN`] before its first look).
    looked: Mutex<Vec<u64>>,
    /// Set by [`StreamSafe::retire_stream`]: the stream may be gone.
    retired: AtomicBool,
}

/// Every pool ever made, retired ones included, for statistics, release and stealing.
/// Pools are only ever appended, so reading the list takes no lock.
struct Registry {
    pages: Box<[OnceLock<Page>]>,
    len: AtomicUsize,
}

/// One page of the registry.
type Page = Box<[OnceLock<StreamPool>]>;

/// Pools per registry page; a registry holds `PAGE * PAGE` pools in all.
const PAGE: usize = 1024;

impl Registry {
    fn new() -> Self {
        Self { pages: (0..PAGE).map(|_| OnceLock::new()).collect(), len: AtomicUsize::new(0) }
    }

    fn get(&self, index: usize) -> Option<&StreamPool> {
        self.pages.get(index / PAGE)?.get()?.get(index % PAGE)?.get()
    }

    /// Every pool made so far, retired ones included.
    fn all(&self) -> impl Iterator<Item = &StreamPool> {
        (0..self.len.load(Ordering::Acquire)).filter_map(|i| self.get(i))
    }

    /// Appends `pool` and returns its index; callers serialize.
    fn push(&self, pool: StreamPool) -> Result<usize> {
        let index = self.len.load(Ordering::Acquire);
        let page = self.pages.get(index / PAGE).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "StreamSafe serves at most {} streams in its lifetime",
                PAGE * PAGE
            ))
        })?;
        let page = page.get_or_init(|| (0..PAGE).map(|_| OnceLock::new()).collect());
        let _ = page[index % PAGE].set(pool);
        self.len.store(index + 1, Ordering::Release);
        Ok(index)
    }
}

impl StreamSafe {
    /// A stream-safe allocator on `device`. Makes no device call.
    pub fn new(device: Arc<dyn Device>, config: StreamSafeConfig) -> Result<Self> {
        // Validate the pool settings once, up front.
        BestFit::new(device.clone(), config.pool)?;
        Ok(Self {
            events: EventPool::new(device.clone()),
            device,
            config,
            default_stream: AtomicU64::new(config.default_stream.0),
            slots: (0..SLOTS).map(|_| AtomicUsize::new(0)).collect(),
            overflow: Mutex::new(Vec::new()),
            registry: Registry::new(),
            creating: Mutex::new(()),
            failures: AtomicU64::new(0),
            retries: AtomicU64::new(0),
        })
    }

    /// Counts `made`: a failure, or a success that came only after a retry.
    fn count<T>(&self, made: Result<(T, bool)>) -> Result<T> {
        match made {
            Ok((value, retried)) => {
                if retried {
                    self.retries.fetch_add(1, Ordering::Relaxed);
                }
                Ok(value)
            }
            Err(e) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// Retires `stream`'s pool; call before destroying the stream. Returns the pool's free
    /// chunks to the device once the stream's work is done (waiting at most the pool's
    /// [`wait_timeout`](BestFitConfig::wait_timeout); past it they return at a later
    /// release); chunks still in use return at a later [`Allocator::release`] once freed.
    pub fn retire_stream(&self, stream: Stream) -> Result<()> {
        let _creating = self.creating.lock();
        let old = match self.find_slot(stream) {
            Some(i) => self.slots[i].swap(0, Ordering::AcqRel).checked_sub(1),
            None => {
                let mut overflow = self.overflow.lock();
                let pos =
                    overflow.iter().position(|&i| self.registry.get(i).is_some_and(|p| p.stream == stream));
                pos.map(|i| overflow.swap_remove(i))
            }
        };
        match old.and_then(|i| self.registry.get(i)) {
            Some(p) => {
                p.retired.store(true, Ordering::Relaxed);
                p.pool.release().map(|_| ())
            }
            None => Ok(()),
        }
    }

    fn home(stream: Stream) -> usize {
        // Stream handles are pointers: mix the bits so neighbours spread over the slots.
        (stream.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize % SLOTS
    }

    /// The pool in slot `i`, if any.
    fn slot(&self, i: usize) -> Option<&StreamPool> {
        self.slots[i].load(Ordering::Acquire).checked_sub(1).and_then(|index| self.registry.get(index))
    }

    /// The slot holding `stream`'s pool, probing linearly from its home slot. Slots are
    /// emptied only by retire_stream, so a hole does not end the probe.
    fn find_slot(&self, stream: Stream) -> Option<usize> {
        let home = Self::home(stream);
        (0..SLOTS).map(|k| (home + k) % SLOTS).find(|&i| self.slot(i).is_some_and(|p| p.stream == stream))
    }

    fn lookup(&self, stream: Stream) -> Option<&StreamPool> {
        if let Some(i) = self.find_slot(stream) {
            return self.slot(i);
        }
        let overflow = self.overflow.lock();
        overflow.iter().filter_map(|&i| self.registry.get(i)).find(|p| p.stream == stream)
    }

    fn pool(&self, stream: Stream) -> Result<&StreamPool> {
        if let Some(p) = self.lookup(stream) {
            return Ok(p);
        }
        let _creating = self.creating.lock();
        if let Some(p) = self.lookup(stream) {
            return Ok(p);
        }
        let pool = BestFit::new(self.device.clone(), BestFitConfig { stream, ..self.config.pool })?;
        let index = self.registry.push(StreamPool {
            stream,
            pool,
            looked: Mutex::new(Vec::new()),
            retired: AtomicBool::new(false),
        })?;
        let home = Self::home(stream);
        let free_slot =
            (0..SLOTS).map(|k| (home + k) % SLOTS).find(|&i| self.slots[i].load(Ordering::Acquire) == 0);
        match free_slot {
            Some(i) => self.slots[i].store(index + 1, Ordering::Release),
            None => self.overflow.lock().push(index),
        }
        self.registry.get(index).ok_or_else(|| Error::Internal("StreamSafe lost a pool it made".into()))
    }

    /// Every pool, retired ones included.
    fn pools(&self) -> impl Iterator<Item = &StreamPool> {
        self.registry.all()
    }

    /// `stream`'s pool, made on its first use; the default stream's pool and the first
    /// streams' are found by reading one slot.
    fn pool_of(&self, stream: Stream) -> Result<&StreamPool> {
        match self.slot(Self::home(stream)).filter(|p| p.stream == stream) {
            Some(p) => Ok(p),
            None => self.pool(stream),
        }
    }

    /// Whether an allocation in `pool`, which belongs to `stream`, may poll pending frees:
    /// only when there are some (no device call otherwise), and then only outside a capture.
    fn polls(&self, pool: &StreamPool, stream: Stream) -> Result<bool> {
        Ok(!pool.pool.has_pending() || !self.capturing(stream)?)
    }

    fn capturing(&self, stream: Stream) -> Result<bool> {
        Ok(self.device.capture_status(stream)? != CaptureStatus::None)
    }

    /// Whether the device's free memory is below [`StreamSafeConfig::steal_below_free_percent`]
    /// of its total.
    fn memory_is_short(&self) -> Result<bool> {
        let percent = u128::from(self.config.steal_below_free_percent);
        if percent == 0 {
            return Ok(false);
        }
        let mem = self.device.mem_info()?;
        Ok((mem.free as u128) * 100 < (mem.total as u128) * percent)
    }

    /// Moves a wholly free chunk that fits `size` from another stream's pool into `pool`,
    /// ordering `pool`'s stream after the chunk's last use. Whether one was moved.
    fn steal(&self, pool: &StreamPool, size: usize) -> Result<bool> {
        // Held while other pools' state locks are taken and released one at a time. A
        // `looked` is locked only here, never under a state lock, and a thread holds one
        // `looked` at a time, so the lock order cannot cycle.
        let mut looked = pool.looked.lock();
        for (index, other) in self.pools().enumerate() {
            if other.stream == pool.stream || other.retired.load(Ordering::Relaxed) {
                continue;
            }
            let stats = other.pool.stats();
            if looked.len() <= index {
                looked.resize(index + 1, NEVER_SEEN);
            }
            let Some(last) = looked.get_mut(index) else { continue };
            let idle = stats.live_allocations == 0 && *last == stats.total_allocations;
            *last = stats.total_allocations;
            if !idle {
                // In use, or busy since this pool's previous look: it keeps its memory.
                continue;
            }
            let Some(chunk) = other.pool.take_free_chunk(size) else { continue };
            let event = self.events.get()?;
            let ordered = self
                .device
                .record_event(event, other.stream)
                .and_then(|()| self.device.stream_wait_event(pool.stream, event));
            // The wait captured the event's state; the event can be reused at once.
            self.events.put(event);
            if ordered.is_err() {
                // The giving stream cannot be waited on (e.g. it was destroyed without
                // retire_stream): its chunk stays where it is, and another is tried.
                other.pool.adopt_chunk(chunk)?;
                continue;
            }
            pool.pool.adopt_chunk(chunk)?;
            return Ok(true);
        }
        Ok(false)
    }

    /// The slow path, not counted: the allocation, and whether it came only after a retry.
    fn allocate_slow(&self, pool: &StreamPool, size: usize, stream: Stream) -> Result<(Allocation, bool)> {
        let poll = !self.capturing(stream)?;
        if self.memory_is_short()? && self.steal(pool, size)? {
            if let Some(a) = pool.pool.allocate_cached(size, poll)? {
                return Ok((a, false));
            }
        }
        if !poll {
            // Nothing is released or waited for while the stream captures a graph.
            return pool.pool.allocate_uncounted(size, false);
        }
        // The release waits (bounded) for every stream's work, then each pool gives back its
        // free chunks; between attempts the loop sleeps while frees pending on other streams'
        // events complete (they notify no one).
        let release = || {
            self.wait_for_pools()?;
            for p in self.pools() {
                // A pool that cannot release now still lets the others try; the errors its
                // frees held back stay held for its next release.
                let _ = p.pool.release_cached();
            }
            Ok(None)
        };
        let retried = retry::on_out_of_memory(
            self.config.retry_wait,
            || pool.pool.allocate_uncounted(size, true),
            release,
            |left| std::thread::sleep(RETRY_PAUSE.min(left)),
        );
        let again = retried.retried();
        match retried.result {
            Ok((a, inner)) => Ok((a, inner || again)),
            Err(e) => Err(self.out_of_memory(e, size, retried.waited, retried.release_error)),
        }
    }

    /// Waits, at most the pools' `wait_timeout` in all, for the work enqueued on every stream
    /// with a pool in use: a `cuMemFree` of any pool's chunk would wait for all of it.
    fn wait_for_pools(&self) -> Result<()> {
        let streams: Vec<Stream> =
            self.pools().filter(|p| !p.retired.load(Ordering::Relaxed)).map(|p| p.stream).collect();
        super::wait_for_streams(self.device.as_ref(), &self.events, &streams, self.config.pool.wait_timeout)
    }

    fn out_of_memory(&self, error: Error, size: usize, waited: Duration, release: Option<Error>) -> Error {
        let Error::OutOfMemory(report) = error else { return error };
        let pools = self.pools();
        let mut total = Stats::default();
        let mut detail: Vec<String> = pools
            .map(|p| {
                let s = p.pool.stats();
                total.allocated += s.allocated;
                total.cached += s.cached;
                total.pending_release += s.pending_release;
                total.reserved += s.reserved;
                format!(
                    "stream {:#x}: allocated {}, cached {}, pending release {}, reserved {}",
                    p.stream.0, s.allocated, s.cached, s.pending_release, s.reserved
                )
            })
            .collect();
        detail.extend(report.detail);
        let timed_out = release.is_some();
        if let Some(e) = release {
            detail.push(super::release_failed(&e));
        }
        Error::oom(OutOfMemory {
            requested: size,
            allocated: total.allocated,
            cached: total.cached,
            pending_release: total.pending_release,
            reserved: total.reserved,
            detail,
            hint: match timed_out {
                false => format!(
                    "every stream's pool released its free chunks and the allocation was retried for \
                     {waited:?}; free memory, or raise the retry wait if frees are pending on other streams"
                ),
                true => format!(
                    "the pools kept their free chunks, as other streams' work still ran at the wait bound \
                     (see above), and the allocation was retried for {waited:?}; raise wait_timeout if that \
                     work is expected to take longer, or look for a stream that hangs"
                ),
            },
            ..*report
        })
    }
}

impl Allocator for StreamSafe {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        self.allocate_on(size, self.default_stream())
    }

    /// Releases every stream's free chunks. While any of the streams is capturing a graph,
    /// nothing is released (that would synchronize the device) and 0 is returned.
    fn release(&self) -> Result<usize> {
        for p in self.pools().filter(|p| !p.retired.load(Ordering::Relaxed)) {
            // A stream that cannot be asked (destroyed without retire_stream) captures nothing.
            if self.capturing(p.stream).unwrap_or(false) {
                return Ok(0);
            }
        }
        let mut total = 0;
        let mut first_error = None;
        for p in self.pools() {
            match p.pool.release() {
                Ok(n) => total += n,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(total), Err)
    }

    /// The sum over every stream's pool (peaks are sums of each pool's peak), with the
    /// failures and retries StreamSafe counts.
    fn stats(&self) -> Stats {
        let mut stats: Stats = self.pools().map(|p| p.pool.stats()).sum();
        stats.failures += self.failures.load(Ordering::Relaxed);
        stats.retries += self.retries.load(Ordering::Relaxed);
        stats
    }

    fn reset_peak_stats(&self) {
        for p in self.pools() {
            p.pool.reset_peak_stats();
        }
    }

    fn device(&self) -> usize {
        self.device.ordinal()
    }
}

impl StreamSafe {
    fn allocate_uncounted(&self, size: usize, stream: Stream) -> Result<(Allocation, bool)> {
        let pool = self.pool_of(stream)?;
        match pool.pool.allocate_cached(size, self.polls(pool, stream)?)? {
            Some(a) => Ok((a, false)),
            None => self.allocate_slow(pool, size, stream),
        }
    }

    fn allocate_ptr_uncounted(&self, size: usize, stream: Stream) -> Result<(DevicePtr, bool)> {
        let pool = self.pool_of(stream)?;
        match pool.pool.allocate_kept(size, self.polls(pool, stream)?)? {
            Some(ptr) => Ok((ptr, false)),
            None => {
                let (a, retried) = self.allocate_slow(pool, size, stream)?;
                Ok((pool.pool.keep(a)?, retried))
            }
        }
    }
}

impl StreamAllocator for StreamSafe {
    fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation> {
        if size == 0 {
            return Ok(Allocation::empty(self.device.ordinal(), stream));
        }
        self.count(self.allocate_uncounted(size, stream))
    }

    fn default_stream(&self) -> Stream {
        Stream(self.default_stream.load(Ordering::Relaxed))
    }

    fn set_default_stream(&self, stream: Stream) {
        self.default_stream.store(stream.0, Ordering::Relaxed);
    }

    fn retire_stream(&self, stream: Stream) -> Result<()> {
        StreamSafe::retire_stream(self, stream)
    }
}

/// Each stream's pool keeps the allocations made on it by pointer, under the lock it takes
/// anyway: allocating and freeing take that one lock and nothing else (no map of handles, no
/// reference count). A free looks in the pool of the stream it is given first, then in every
/// pool.
impl PointerAllocator for StreamSafe {
    fn allocate_ptr(&self, size: usize, stream: Stream) -> Result<DevicePtr> {
        if size == 0 {
            return Ok(0);
        }
        self.count(self.allocate_ptr_uncounted(size, stream))
    }

    fn free_ptr(&self, ptr: DevicePtr, owner: Stream) -> Option<Freed> {
        let first = self.slot(Self::home(owner)).filter(|p| p.stream == owner);
        let freed = |p: &StreamPool| p.pool.free_kept(ptr).map(|size| Freed { size, stream: p.stream });
        first
            .and_then(freed)
            .or_else(|| self.pools().filter(|p| !first.is_some_and(|f| std::ptr::eq(f, *p))).find_map(freed))
    }

    fn record_stream_ptr(&self, ptr: DevicePtr, stream: Stream) -> Result<bool> {
        self.device.check_stream(stream)?;
        Ok(self.pools().any(|p| p.pool.record_kept(ptr, stream)))
    }

    fn owning_stream(&self, asked: Stream) -> Stream {
        asked
    }
}
