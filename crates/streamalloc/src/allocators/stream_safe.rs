//! `StreamSafe`: a caching pool per stream, with `record_stream`, deferred frees, stealing
//! across streams and retry on out-of-memory (Paddle's `StreamSafeCUDAAllocator`, PyTorch's
//! caching allocator semantics).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use parking_lot::{Mutex, RwLock};
use rustc_hash::FxHashMap;

use super::best_fit::{BestFit, BestFitConfig};
use super::retry;
use crate::allocation::{
    Allocation, Allocator, Kept, KeptBlock, PointerEntry, ReservedGauge, Segment, Stats, StreamAllocator,
};
use crate::device::{AtomicStream, CaptureStatus, Device, DevicePtr, EventPool, Stream};
use crate::error::{try_each, Error, OutOfMemory, Result};
use crate::stream_table::StreamSlots;

/// Settings of a [`StreamSafe`] allocator.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use streamalloc::allocators::{BestFitConfig, StreamSafe, StreamSafeConfig};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::{Streams, StreamAllocator};
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

/// Slots of the table of live pools that is read without a lock; pools that find none share a
/// locked map.
const SLOTS: usize = 256;
/// Slots a pool may take, from its stream's home slot on (a lookup reads at most these).
const PROBE: usize = 8;
/// Pools that can be promoted ([`StreamSafe::promote`]) in an allocator's lifetime.
const HOT: usize = 32;
/// Slots of the table of promoted pools.
const HOT_SLOTS: usize = 64;
/// Slots a promoted pool may take, from its stream's home slot on.
const HOT_PROBE: usize = 4;
/// Lookups of a pool in the second table after which it is promoted.
const PROMOTE_AFTER: u64 = 1024;
/// Pause between two attempts while waiting for pending frees.
const RETRY_PAUSE: Duration = Duration::from_millis(1);
/// Streams an out-of-memory error names, those holding the most; the rest are summed up.
const STREAMS_NAMED: usize = 8;

/// A caching pool per stream, following the [ordering contract](crate::allocation).
///
/// * **Ownership.** Each stream has its own [`BestFit`] pool, made at its first allocation. An
///   allocation belongs to the stream it was made on; freed, its block is reusable at once by
///   that stream.
/// * **`record_stream`.** A freed block whose allocation recorded other streams stays out of
///   use until an event recorded on each at the free has completed; completion is checked
///   without blocking (when the pool allocates, misses or releases), never during a capture.
/// * **Stealing.** While device memory is short (free below
///   [`StreamSafeConfig::steal_below_free_percent`]), a pool that misses takes a wholly free
///   chunk of an idle stream's pool, after an event wait, instead of growing. See DESIGN.md,
///   Note [steal only from idle pools].
/// * **Out of memory.** The pool returns its own free chunks and retries; then every pool gives
///   its free chunks back, after a wait for every stream's work bounded by the pools'
///   [`wait_timeout`](BestFitConfig::wait_timeout), and the allocation is retried for up to
///   [`StreamSafeConfig::retry_wait`]. Fails with [`Error::OutOfMemory`], which names the 8
///   streams whose pools hold the most and, when the wait ran out (nothing was given back), says
///   so.
/// * **Retiring streams.** Call [`StreamSafe::retire_stream`] before destroying a stream: it
///   waits (bounded) for the stream's work, and the stream's pool leaves the allocator, at once
///   or, while it still holds memory, at a later [`Allocator::release`]. The allocator's memory
///   and per-call cost do not grow with the number of streams ever used. A stream recorded on
///   an [`Allocation`] handle is erased from it ([`Allocation::erase_stream`]) before it is
///   destroyed; a free whose recorded stream is gone keeps its block out of use until the next
///   release, which reports the driver's error, synchronizes the device and frees the block. See DESIGN.md, Note [retire streams].
/// * **Concurrency.** Allocating and freeing take the one lock of the stream's pool; finding
///   the pool takes none. See DESIGN.md, Note [promoted pools].
///
/// # Examples
///
/// ```
/// use streamalloc::allocators::{StreamSafe, StreamSafeConfig};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::{Allocator, Streams, StreamAllocator};
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let alloc = StreamSafe::new(sim.clone(), StreamSafeConfig::default())?;
/// let stream = sim.create_stream()?;
/// let a = alloc.allocate_on(1 << 20, stream)?; // from `stream`'s own pool
/// assert_eq!(a.owning_stream(), stream);
/// drop(a); // back to that pool, reusable at once on `stream`
/// assert_eq!(alloc.stats().allocated, 0);
/// alloc.retire_stream(stream)?; // before destroying it: the pool goes
/// sim.destroy_stream(stream)?;
/// assert_eq!(alloc.pool_count(), 0);
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct StreamSafe {
    device: Arc<dyn Device>,
    config: StreamSafeConfig,
    events: EventPool,
    default_stream: AtomicStream,
    /// The live pools promoted for lookups that write nothing: the streams holding the
    /// [`HOT_SLOTS`] slots, each looking at [`HOT_PROBE`] (see [`StreamSafe::promote`]), ...
    hot: StreamSlots,
    /// ... and each slot's pool's index in [`StreamSafe::promoted`] + 1 (promoted pools are
    /// never dropped, so a lookup reads them without holding them, and checks the stream).
    hot_index: Box<[AtomicUsize]>,
    /// The pools promoted so far, in order: kept until the allocator is dropped.
    promoted: Box<[OnceLock<Arc<StreamPool>>]>,
    /// How many pools were promoted.
    promoted_len: AtomicUsize,
    /// The other live pools: the streams holding the [`SLOTS`] slots, each looking at
    /// [`PROBE`], ...
    slots: StreamSlots,
    /// ... and each slot's pool. A slot's stream is written after its pool when a pool comes
    /// and before it when it goes, so a lookup loads the pool (the one write-free read that
    /// holds it) only where the stream matches, and checks it. Finding a pool here takes no
    /// lock (it writes a slot of the calling thread's own, to hold the pool while in use).
    slot_pools: Box<[ArcSwapOption<StreamPool>]>,
    /// The live pools that found no slot.
    overflow: Mutex<FxHashMap<Stream, Arc<StreamPool>>>,
    /// `overflow.len()`, read without the lock.
    overflowed: AtomicUsize,
    /// Every pool held: the live ones, and the retired ones that still hold memory. For
    /// statistics, release and stealing.
    pools: Mutex<Vec<Arc<StreamPool>>>,
    /// The figures of the pools dropped so far: their counts and peaks stay in the sums.
    forgotten: Mutex<Stats>,
    /// The reserved bytes of all pools together, and their true peak (the pools' own peaks
    /// add up to more when they peak at different times).
    reserved: Arc<ReservedGauge>,
    /// Counts the looks for a chunk to take ([`StreamSafe::steal`]); a pool notes its value
    /// at each allocation.
    clock: AtomicU64,
    /// Serializes the creation and retirement of pools.
    creating: Mutex<()>,
    /// Failed allocations, counted once each here (the pools count none of StreamSafe's).
    failures: AtomicU64,
    /// Allocations that succeeded only after a release, a wait or another attempt.
    retries: AtomicU64,
}

/// A live pool as a lookup found it, held as long as it is in use.
enum Found<'a> {
    /// A promoted pool, which the allocator keeps.
    Hot(&'a StreamPool),
    /// A pool of the second table, held by the calling thread's slot.
    Held(arc_swap::Guard<Option<Arc<StreamPool>>>),
    /// A pool held by a reference of its own.
    Owned(Arc<StreamPool>),
}

impl Found<'_> {
    /// The pool (always there: a lookup makes a [`Found::Held`] of a pool only).
    fn get(&self) -> Result<&StreamPool> {
        match self {
            Found::Hot(p) => Ok(p),
            Found::Held(held) => {
                held.as_deref().ok_or_else(|| Error::Internal("StreamSafe lost a pool".into()))
            }
            Found::Owned(p) => Ok(p),
        }
    }
}

struct StreamPool {
    stream: Stream,
    pool: BestFit,
    /// Lookups of this pool in the second table ([`PROMOTE_AFTER`]); written by the threads
    /// that use it without a read-modify-write (a lost count only delays a promotion).
    uses: AtomicU64,
    /// Whether the pool was promoted (the allocator keeps it until it is dropped).
    hot: AtomicBool,
    /// Set (under `creating`) when retire_stream takes the pool out of the tables, for good.
    unslotted: AtomicBool,
    /// The allocator's [`StreamSafe::clock`] at this pool's latest allocation.
    allocated_at: AtomicU64,
    /// The clock at this pool's previous look for a chunk to take (0: none yet); locked for
    /// the whole look.
    looked: Mutex<u64>,
    /// Set by [`StreamSafe::retire_stream`], under `naming`'s write lock: the stream may be
    /// gone, and no call names it.
    retired: AtomicBool,
    /// Held (read) by the calls of other threads that name the pool's stream (releases,
    /// waits, steals), which check `retired` under it: once retire_stream has set `retired`,
    /// none is under way and none follows, so the caller may destroy the stream.
    naming: RwLock<()>,
    /// Index in [`StreamSafe::pools`] (kept under that lock).
    at: AtomicUsize,
}

impl StreamPool {
    fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// Runs `f`, which names the pool's stream, unless the pool is retired.
    fn naming<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        let _naming = self.naming.read();
        (!self.is_retired()).then(f)
    }
}

/// Removes `pool` from `list`; whether it was there.
fn unlist(list: &mut Vec<Arc<StreamPool>>, pool: &Arc<StreamPool>) -> bool {
    let at = pool.at.load(Ordering::Relaxed);
    let at = match list.get(at) {
        Some(p) if Arc::ptr_eq(p, pool) => at,
        _ => match list.iter().position(|p| Arc::ptr_eq(p, pool)) {
            Some(at) => at,
            None => return false,
        },
    };
    list.swap_remove(at);
    if let Some(moved) = list.get(at) {
        moved.at.store(at, Ordering::Relaxed);
    }
    true
}

impl StreamSafe {
    /// A stream-safe allocator on `device`. Makes no device call.
    pub fn new(device: Arc<dyn Device>, config: StreamSafeConfig) -> Result<Self> {
        config.pool.validate()?;
        Ok(Self {
            hot: StreamSlots::new(HOT_SLOTS, HOT_PROBE),
            hot_index: (0..HOT_SLOTS).map(|_| AtomicUsize::new(0)).collect(),
            promoted: (0..HOT).map(|_| OnceLock::new()).collect(),
            promoted_len: AtomicUsize::new(0),
            events: EventPool::new(device.clone()),
            device,
            config,
            default_stream: AtomicStream::new(config.default_stream),
            slots: StreamSlots::new(SLOTS, PROBE),
            slot_pools: (0..SLOTS).map(|_| ArcSwapOption::empty()).collect(),
            overflow: Mutex::new(FxHashMap::default()),
            overflowed: AtomicUsize::new(0),
            pools: Mutex::new(Vec::new()),
            forgotten: Mutex::new(Stats::default()),
            reserved: Arc::default(),
            clock: AtomicU64::new(0),
            creating: Mutex::new(()),
            failures: AtomicU64::new(0),
            retries: AtomicU64::new(0),
        })
    }

    /// How many pools the allocator holds: one per stream it has allocated on and not
    /// retired, and one per retired stream whose pool still holds memory (until a release
    /// finds it empty, see [`StreamSafe::retire_stream`]). However many streams come and go,
    /// this stays the number of streams in use.
    pub fn pool_count(&self) -> usize {
        self.pools.lock().len()
    }

    /// Every pool held (live and retired), as handles of their own, each with its stream
    /// while it is live (a retired one's may be gone), for a sleep, during which the caller
    /// keeps allocations, releases and retirements of this allocator from running.
    pub(crate) fn pools_held(&self) -> Vec<(Option<Stream>, BestFit)> {
        let pools = self.snapshot();
        pools.iter().map(|p| (p.naming(|| p.stream), p.pool.handle())).collect()
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

    /// Forgets `stream`, which the caller is about to destroy (see [`StreamSafe`]'s
    /// retiring streams). Waits for the work enqueued on the stream so far, at most the pools'
    /// [`wait_timeout`](BestFitConfig::wait_timeout); then the stream's pool leaves the
    /// allocator and gives its free memory back (what is still in use goes back at a later
    /// [`Allocator::release`] once freed). Work enqueued on the stream after this
    /// call must not use memory of this allocator. A stream the allocator knows nothing of
    /// costs no device call. (The retirement of a promoted pool's stream, see [`StreamSafe`]'s
    /// concurrency, also waits within the bound for the frees pending in its pool.)
    ///
    /// Fails with [`Error::Timeout`] when the stream's work outlasts the wait: the allocator
    /// then forgets nothing, and the stream must not be destroyed yet (retire it again later).
    /// A stream that cannot be waited for at all (destroyed already) is forgotten all the
    /// same, but the allocations that recorded it keep it, and their frees fail to record
    /// an event on it (see [`StreamSafe`]): the error is returned.
    pub fn retire_stream(&self, stream: Stream) -> Result<()> {
        let Some(pool) = self.find_live(stream) else { return Ok(()) };
        let (start, timeout) = (Instant::now(), self.config.pool.wait_timeout);
        let waited = super::wait_for_streams(self.device.as_ref(), &self.events, &[stream], timeout);
        if let Err(Error::Timeout { .. }) = waited {
            return waited;
        }
        {
            let _creating = self.creating.lock();
            self.unslot(&pool);
            pool.unslotted.store(true, Ordering::Release);
        }
        {
            // Waits for the calls of other threads that name the stream.
            let _naming = pool.naming.write();
            pool.retired.store(true, Ordering::Release);
        }
        // Only a stream that was waited for is named again, to give the free memory back.
        let released = match waited {
            Ok(()) => {
                if pool.hot.load(Ordering::Acquire) {
                    // A promoted pool is never dropped: what its pending frees hold goes back
                    // now, or stays with it.
                    Self::wait_pending(&pool, timeout.saturating_sub(start.elapsed()));
                }
                pool.pool.release().map(drop)
            }
            Err(e) => Err(e),
        };
        self.drop_if_empty(&pool);
        released
    }

    /// Waits, at most `timeout`, for the frees pending in `pool`, a retired one, polling
    /// them (from 20 us apart, doubling up to 1 ms).
    fn wait_pending(pool: &StreamPool, timeout: Duration) {
        let (start, mut pause) = (Instant::now(), Duration::from_micros(20));
        while pool.pool.has_pending() {
            Self::poll_retired(pool);
            let left = timeout.saturating_sub(start.elapsed());
            if !pool.pool.has_pending() || left.is_zero() {
                break;
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(RETRY_PAUSE);
        }
    }

    /// Takes `pool` out of the tables of live pools (under `creating`).
    fn unslot(&self, pool: &Arc<StreamPool>) {
        for i in self.hot.held_by(pool.stream) {
            if self.promoted_pool(i).is_some_and(|p| Arc::ptr_eq(p, pool)) {
                self.hot.leave(i);
                self.hot_index[i].store(0, Ordering::Release);
            }
        }
        self.unslot_second(pool);
    }

    /// Takes `pool` out of the second table of live pools and the locked map (under
    /// `creating`).
    fn unslot_second(&self, pool: &Arc<StreamPool>) {
        for i in self.slots.held_by(pool.stream) {
            if self.slot_pools[i].load().as_ref().is_some_and(|p| Arc::ptr_eq(p, pool)) {
                self.slots.leave(i);
                self.slot_pools[i].store(None);
                return;
            }
        }
        let mut overflow = self.overflow.lock();
        if overflow.get(&pool.stream).is_some_and(|p| Arc::ptr_eq(p, pool)) {
            overflow.remove(&pool.stream);
            self.overflowed.store(overflow.len(), Ordering::Release);
        }
    }

    /// Drops `pool`, a retired one, if nothing of it is in use any more: no live allocation,
    /// no pending free (polled first). Its memory goes back as it is dropped (naming no
    /// stream); the bytes it held. A promoted pool, which the allocator keeps until it is
    /// dropped, leaves the pools held only once it holds no memory.
    fn drop_if_empty(&self, pool: &Arc<StreamPool>) -> usize {
        if pool.pool.has_pending() {
            Self::poll_retired(pool);
        }
        let mut figures = pool.pool.stats();
        let kept = pool.hot.load(Ordering::Acquire) && figures.reserved > 0;
        if kept
            || figures.live_allocations > 0
            || pool.pool.has_pending()
            || !unlist(&mut self.pools.lock(), pool)
        {
            return 0;
        }
        // Its counts and peaks stay in the allocator's figures; what it holds goes back now:
        // the teardown gives back every chunk (counted as one device call) once the caller
        // drops the last reference, or waits for the device first where memory is mapped.
        let held = figures.reserved;
        self.reserved.sub(held);
        figures.device_frees += u64::from(held > 0);
        figures.allocated = 0;
        figures.reserved = 0;
        figures.cached = 0;
        figures.largest_free_block = 0;
        figures.pending_release = 0;
        figures.live_allocations = 0;
        let mut forgotten = self.forgotten.lock();
        *forgotten = [*forgotten, figures].into_iter().sum();
        held
    }

    /// Moves the completed pending frees of a retired pool to its free lists, without naming
    /// its stream (event queries only).
    fn poll_retired(pool: &StreamPool) {
        pool.pool.poll_pending();
    }

    /// The promoted pool in slot `i` of [`StreamSafe::hot`], if any.
    #[inline]
    fn promoted_pool(&self, i: usize) -> Option<&Arc<StreamPool>> {
        let index = self.hot_index[i].load(Ordering::Acquire).checked_sub(1)?;
        self.promoted.get(index)?.get()
    }

    /// The live promoted pool of `stream`, if there is one: reads atomics and writes none.
    #[inline]
    fn hot_pool(&self, stream: Stream) -> Option<&Arc<StreamPool>> {
        if self.promoted_len.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.hot.held_by(stream).find_map(|i| self.promoted_pool(i).filter(|p| p.stream == stream))
    }

    /// The live pool of `stream` in the tables, if there is one; takes no lock.
    fn slotted(&self, stream: Stream) -> Option<Found<'_>> {
        if let Some(p) = self.hot_pool(stream) {
            return Some(Found::Hot(p.as_ref()));
        }
        for i in self.slots.held_by(stream) {
            let pool = self.slot_pools[i].load();
            if let Some(p) = pool.as_ref().filter(|p| p.stream == stream) {
                self.count_use(p);
                return Some(Found::Held(pool));
            }
        }
        None
    }

    /// Counts a lookup of `pool` outside the promoted pools, and promotes it after
    /// [`PROMOTE_AFTER`].
    fn count_use(&self, pool: &Arc<StreamPool>) {
        let uses = pool.uses.load(Ordering::Relaxed) + 1;
        pool.uses.store(uses, Ordering::Relaxed);
        if uses == PROMOTE_AFTER {
            self.promote(pool);
        }
    }

    /// Promotes `pool`, whose stream many calls name: from now on it is found without
    /// writing anything (a lookup in the second table holds the pool it finds, which costs
    /// two atomic read-modify-writes). A promoted pool is kept until the allocator is
    /// dropped, retired or not, so that reading it needs no hold; at most [`HOT`] are, and
    /// the pools of streams named less often (those that come and go) are not.
    fn promote(&self, pool: &Arc<StreamPool>) {
        let _creating = self.creating.lock();
        let n = self.promoted_len.load(Ordering::Acquire);
        let gone = pool.unslotted.load(Ordering::Acquire);
        if n >= HOT || gone || pool.hot.load(Ordering::Acquire) {
            return;
        }
        let Some(i) = self.hot.vacant(pool.stream) else { return };
        if self.promoted[n].set(pool.clone()).is_err() {
            return;
        }
        pool.hot.store(true, Ordering::Release);
        self.hot_index[i].store(n + 1, Ordering::Release);
        self.hot.hold(i, pool.stream);
        self.promoted_len.store(n + 1, Ordering::Release);
        // Found first among the promoted: its slot in the second table goes to others.
        self.unslot_second(pool);
    }

    /// The live pool of `stream`, if there is one, as a reference of its own.
    fn find_live(&self, stream: Stream) -> Option<Arc<StreamPool>> {
        if let Some(p) = self.hot_pool(stream) {
            return Some(p.clone());
        }
        let slotted = self
            .slots
            .held_by(stream)
            .find_map(|i| self.slot_pools[i].load_full().filter(|p| p.stream == stream));
        slotted.or_else(|| self.overflowed_pool(stream))
    }

    /// The live pool of `stream` among those that found no slot.
    fn overflowed_pool(&self, stream: Stream) -> Option<Arc<StreamPool>> {
        if self.overflowed.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.overflow.lock().get(&stream).cloned()
    }

    /// The live pool of `stream`, made on the stream's first use.
    fn pool_of(&self, stream: Stream) -> Result<Found<'_>> {
        if let Some(found) = self.slotted(stream) {
            return Ok(found);
        }
        let pool = self.pool(stream)?;
        self.count_use(&pool);
        Ok(Found::Owned(pool))
    }

    /// The live pool of `stream` outside the table's fast path: among those that found no
    /// slot, or made now.
    fn pool(&self, stream: Stream) -> Result<Arc<StreamPool>> {
        if let Some(p) = self.overflowed_pool(stream) {
            return Ok(p);
        }
        let _creating = self.creating.lock();
        if let Some(p) = self.find_live(stream) {
            return Ok(p);
        }
        let pool = BestFit::new(self.device.clone(), BestFitConfig { stream, ..self.config.pool })?;
        pool.count_reserved_in(self.reserved.clone());
        let pool = Arc::new(StreamPool {
            stream,
            pool,
            allocated_at: AtomicU64::new(self.clock.load(Ordering::Acquire)),
            looked: Mutex::new(0),
            uses: AtomicU64::new(0),
            hot: AtomicBool::new(false),
            unslotted: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            naming: RwLock::new(()),
            at: AtomicUsize::new(0),
        });
        {
            let mut pools = self.pools.lock();
            pool.at.store(pools.len(), Ordering::Relaxed);
            pools.push(pool.clone());
        }
        match self.slots.vacant(stream) {
            Some(i) => {
                self.slot_pools[i].store(Some(pool.clone()));
                self.slots.hold(i, stream);
            }
            None => {
                let mut overflow = self.overflow.lock();
                overflow.insert(stream, pool.clone());
                self.overflowed.store(overflow.len(), Ordering::Release);
            }
        }
        Ok(pool)
    }

    /// Every pool held, live and retired, as references of their own.
    fn snapshot(&self) -> Vec<Arc<StreamPool>> {
        self.pools.lock().clone()
    }

    /// Notes an allocation of `pool` for the idleness [`StreamSafe::steal`] looks at.
    fn note_allocation(&self, pool: &StreamPool) {
        let now = self.clock.load(Ordering::Relaxed);
        if pool.allocated_at.load(Ordering::Relaxed) != now {
            pool.allocated_at.store(now, Ordering::Relaxed);
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

    /// Moves a wholly free chunk that fits `size` from another stream's idle pool into
    /// `pool`, ordering `pool`'s stream after the chunk's last use. Whether one was moved.
    fn steal(&self, pool: &StreamPool, size: usize) -> Result<bool> {
        // Held while other pools' state locks are taken and released one at a time. A
        // `looked` is locked only here, never under a state lock, and a thread holds one
        // `looked` at a time, so the lock order cannot cycle.
        let mut looked = pool.looked.lock();
        let now = self.clock.fetch_add(1, Ordering::AcqRel) + 1;
        let before = std::mem::replace(&mut *looked, now);
        if before == 0 {
            // The first look: any pool may be busy.
            return Ok(false);
        }
        for other in self.snapshot() {
            if other.stream == pool.stream || other.is_retired() {
                continue;
            }
            // In use, or busy since this pool's previous look: it keeps its memory.
            if other.allocated_at.load(Ordering::Acquire) >= before || other.pool.stats().live_allocations > 0
            {
                continue;
            }
            let took = other.naming(|| {
                let Some(chunk) = other.pool.take_free_chunk(size) else { return Ok(false) };
                if self.events.order_after(pool.stream, other.stream).is_err() {
                    // The giving stream cannot be waited on (e.g. it was destroyed without
                    // retire_stream), or no event could be had: its chunk stays where it is,
                    // and another is tried.
                    other.pool.adopt_chunk(chunk)?;
                    return Ok(false);
                }
                pool.pool.adopt_chunk(chunk)?;
                Ok(true)
            });
            if took.transpose()? == Some(true) {
                return Ok(true);
            }
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
        // The release waits (bounded) for every live stream's work, then each live pool
        // gives back its free chunks and retired pools with nothing in use go; between
        // attempts the loop sleeps while frees pending on other streams' events complete
        // (they notify no one).
        let release = || {
            self.wait_for_pools()?;
            for p in self.snapshot() {
                // A pool that cannot release now still lets the others try; the errors its
                // frees held back stay held for its next release.
                if p.naming(|| p.pool.release_cached()).is_none() {
                    self.drop_if_empty(&p);
                }
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
    /// with a live pool: a `cuMemFree` of any pool's chunk would wait for all of it.
    fn wait_for_pools(&self) -> Result<()> {
        let (start, timeout) = (Instant::now(), self.config.pool.wait_timeout);
        for p in self.snapshot() {
            let left = timeout.saturating_sub(start.elapsed());
            let waited =
                p.naming(|| super::wait_for_streams(self.device.as_ref(), &self.events, &[p.stream], left));
            match waited {
                Some(Err(Error::Timeout { waited_for, .. })) => {
                    return Err(Error::Timeout { waited_for, after: timeout })
                }
                Some(Err(e)) => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }

    fn out_of_memory(&self, error: Error, size: usize, waited: Duration, release: Option<Error>) -> Error {
        let Error::OutOfMemory(report) = error else { return error };
        let mut held: Vec<(Stream, bool, Stats)> =
            self.pools.lock().iter().map(|p| (p.stream, p.is_retired(), p.pool.stats())).collect();
        let total: Stats = held.iter().map(|(_, _, s)| *s).sum();
        // The streams holding the most first: a line each for a few, one line for the rest.
        held.sort_unstable_by_key(|(stream, _, s)| (std::cmp::Reverse((s.reserved, s.allocated)), *stream));
        let named = held.len().min(STREAMS_NAMED);
        let mut detail: Vec<String> = held[..named]
            .iter()
            .map(|(stream, retired, s)| {
                format!(
                    "stream {:#x}{}: allocated {}, cached {}, pending release {}, reserved {}",
                    stream.raw(),
                    if *retired { " (retired)" } else { "" },
                    s.allocated,
                    s.cached,
                    s.pending_release,
                    s.reserved
                )
            })
            .collect();
        if held.len() > named {
            let rest: Stats = held[named..].iter().map(|(_, _, s)| *s).sum();
            detail.push(format!(
                "and {} more streams holding {} bytes (allocated {}, cached {}, pending release {})",
                held.len() - named,
                rest.reserved,
                rest.allocated,
                rest.cached,
                rest.pending_release
            ));
        }
        let beyond = report.exceeds_device().then(|| report.beyond_device_hint());
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
            hint: match (beyond, timed_out) {
                (Some(hint), _) => hint,
                (None, false) => format!(
                    "every stream's pool released its free chunks and the allocation was retried for \
                     {waited:?}; free memory, or raise the retry wait if frees are pending on other streams"
                ),
                (None, true) => format!(
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

    /// Releases every live stream's free chunks, and drops the retired streams' pools that
    /// nothing is in use in any more. While any of the live streams is capturing a graph,
    /// nothing is released (that would synchronize the device) and 0 is returned.
    fn release(&self) -> Result<usize> {
        let pools = self.snapshot();
        for p in &pools {
            // A stream that cannot be asked (destroyed without retire_stream) captures nothing.
            if p.naming(|| self.capturing(p.stream).unwrap_or(false)) == Some(true) {
                return Ok(0);
            }
        }
        let mut total = 0;
        let released = try_each(&pools, |p| {
            match p.naming(|| p.pool.release()) {
                Some(n) => total += n?,
                None => total += self.drop_if_empty(p),
            }
            Ok(())
        });
        released.map(|()| total)
    }

    /// The sum over every pool held and every pool dropped (peaks are sums of each pool's
    /// peak), with the failures and retries StreamSafe counts.
    fn stats(&self) -> Stats {
        let forgotten = *self.forgotten.lock();
        let mut stats: Stats =
            self.pools.lock().iter().map(|p| p.pool.stats()).chain(std::iter::once(forgotten)).sum();
        // The peak of the pools together; `allocated_peak` stays the sum of each pool's (an
        // upper bound: a shared count on every allocation would cost the threads' scaling).
        stats.reserved_peak = self.reserved.peak().max(stats.reserved);
        stats.failures += self.failures.load(Ordering::Relaxed);
        stats.retries += self.retries.load(Ordering::Relaxed);
        stats
    }

    fn reset_peak_stats(&self) {
        for p in self.pools.lock().iter() {
            p.pool.reset_peak_stats();
        }
        // The pools dropped hold nothing now.
        self.forgotten.lock().reset_peaks();
        self.reserved.reset_peak();
    }

    fn device(&self) -> usize {
        self.device.ordinal()
    }

    /// Every pool's, live and retired, each of its own stream.
    fn segments(&self, out: &mut Vec<Segment>) -> Result<()> {
        try_each(self.snapshot(), |p| p.pool.segments(out))
    }
}

impl StreamSafe {
    /// Runs `f` on the pool of `stream` (made at its first use), held while `f` runs. The
    /// promoted pools are found first, on a path of their own that builds nothing.
    #[inline]
    fn with_pool<T>(&self, stream: Stream, f: impl FnOnce(&StreamPool) -> Result<T>) -> Result<T> {
        if let Some(pool) = self.hot_pool(stream) {
            return f(pool);
        }
        let found = self.pool_of(stream)?;
        f(found.get()?)
    }

    fn allocate_uncounted(&self, size: usize, stream: Stream) -> Result<(Allocation, bool)> {
        self.with_pool(stream, |pool| self.allocate_in(pool, size, stream))
    }

    /// [`StreamAllocator::allocate_kept`] in `pool`, the live pool of `stream`: the cached
    /// path keeps the allocation under the pool's one lock; the slow path's handle is kept
    /// after.
    fn allocate_kept_in(
        &self,
        pool: &StreamPool,
        size: usize,
        stream: Stream,
        word: u64,
    ) -> Result<(Kept, bool)> {
        self.note_allocation(pool);
        if let Some(ptr) = pool.pool.allocate_kept(size, self.polls(pool, stream)?, word)? {
            return Ok((Kept::Ptr(ptr), false));
        }
        let (allocation, retried) = self.allocate_slow(pool, size, stream)?;
        Ok((pool.pool.keep(allocation, word).map_or_else(Kept::Handle, Kept::Ptr), retried))
    }

    /// Hands `[ptr, ptr + size)` out again as an allocation of `size` bytes kept with `word`,
    /// from the live stream pool whose free memory holds the range (`stream`'s looked at
    /// first; [`BestFit::allocate_kept_at`]): for a framework that restores allocations at the
    /// addresses a recorded CUDA graph uses. Frees pending on recorded streams are waited for
    /// (bounded) unless `stream` captures. Whether a pool held the range free.
    pub(crate) fn allocate_kept_at(
        &self,
        ptr: DevicePtr,
        size: usize,
        stream: Stream,
        word: u64,
    ) -> Result<bool> {
        let poll = !self.capturing(stream)?;
        let mut pools = self.snapshot();
        pools.retain(|p| !p.retired.load(Ordering::Acquire));
        pools.sort_by_key(|p| p.stream != stream);
        for pool in pools {
            if pool.pool.allocate_kept_at(ptr, size, word, poll)? {
                self.note_allocation(&pool);
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Runs `f` on the pools that may keep an allocation: with `hint`, the live pool of that
    /// stream (none made); without, every pool held, live and retired, until `f` returns
    /// `Some`.
    fn find_kept<T>(&self, hint: Option<Stream>, mut f: impl FnMut(&BestFit) -> Option<T>) -> Option<T> {
        match hint {
            Some(stream) => {
                if let Some(pool) = self.hot_pool(stream) {
                    return f(&pool.pool);
                }
                let found =
                    self.slotted(stream).or_else(|| self.overflowed_pool(stream).map(Found::Owned))?;
                f(&found.get().ok()?.pool)
            }
            None => self.snapshot().iter().find_map(|p| f(&p.pool)),
        }
    }

    fn allocate_in(&self, pool: &StreamPool, size: usize, stream: Stream) -> Result<(Allocation, bool)> {
        self.note_allocation(pool);
        match pool.pool.allocate_cached(size, self.polls(pool, stream)?)? {
            Some(a) => Ok((a, false)),
            None => self.allocate_slow(pool, size, stream),
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
        self.default_stream.load()
    }

    fn set_default_stream(&self, stream: Stream) {
        self.default_stream.store(stream);
    }

    fn retire_stream(&self, stream: Stream) -> Result<()> {
        StreamSafe::retire_stream(self, stream)
    }

    /// Kept in the stream's pool, under the pool's one lock: no handle, no reference count.
    fn allocate_kept(&self, size: usize, stream: Stream, word: u64) -> Result<Kept> {
        if size == 0 {
            return Ok(Kept::Handle(Allocation::empty(self.device.ordinal(), stream)));
        }
        self.count(self.with_pool(stream, |pool| self.allocate_kept_in(pool, size, stream, word)))
    }

    fn take_kept(&self, ptr: DevicePtr, hint: Option<Stream>) -> Option<PointerEntry> {
        self.find_kept(hint, |pool| pool.take_kept(ptr))
    }

    fn with_kept(&self, ptr: DevicePtr, hint: Option<Stream>, f: &mut dyn FnMut(&mut KeptBlock)) -> bool {
        self.find_kept(hint, |pool| pool.with_kept(ptr, f).then_some(())).is_some()
    }

    fn each_kept(&self, f: &mut dyn FnMut(DevicePtr, &mut KeptBlock)) {
        for p in self.snapshot() {
            p.pool.each_kept(f);
        }
    }
}
