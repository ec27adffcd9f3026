//! `BestFit`: the auto-growth best-fit caching pool (Paddle's `AutoGrowthBestFitAllocator`,
//! PyTorch's `CUDACachingAllocator`, RMM's `pool_memory_resource`).

use std::collections::hash_map::Entry;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard, RwLock};
use rustc_hash::{FxHashMap, FxHashSet};

use super::backing::{Backing, BackingKind, ChunkSource, DeviceChunks, Want};
use super::retry;
use crate::allocation::{
    Allocation, Allocator, Block, BlockOwner, BlockState, KeptBlock, PointerEntry, ReservedGauge, Segment,
    SegmentBlock, Stats,
};
use crate::device::{Device, DevicePtr, Event, EventPool, Stream};
use crate::error::{Error, HeldErrors, OutOfMemory, Result};
use crate::policy::best_fit::{BestFitPolicy, ChunkBlock, Class, Classes, Grant, Growth};
use crate::policy::AddrRange;

/// A wholly free chunk moving from one pool to another (see [`BestFit::take_free_chunk`]).
#[derive(Debug)]
pub struct FreeChunk {
    class: Class,
    addr: u64,
    size: u64,
}

/// Settings of a [`BestFit`] pool.
///
/// # Examples
///
/// ```
/// use streamalloc::allocators::{BackingKind, BestFit, BestFitConfig};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::Allocator;
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// // Expandable segments that grow 16 MiB at a time (`backing=segments,growth=16MiB`).
/// let config = BestFitConfig { growth: 16 << 20, backing: BackingKind::SEGMENTS, ..Default::default() };
/// let pool = BestFit::new(sim, config)?;
/// let a = pool.allocate(5 << 20)?;
/// assert_eq!(pool.stats().allocated, 5 << 20);
/// # drop(a);
/// # Ok::<(), streamalloc::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BestFitConfig {
    /// `growth` (as in `STREAMALLOC_CONF`): size of the chunks large requests (over 1 MiB) are
    /// carved from, in bytes; a request larger than this gets a chunk of its own, rounded up
    /// to 2 MiB. Default 32 MiB, chosen
    /// by replaying the sample traces (`traces/`) with growth sizes from 2 to 64 MiB: it gave
    /// a lower peak reserved than PyTorch's 20 MiB or 2 MiB on each trace, with fewer device
    /// allocations; larger sizes gave no steady gain.
    pub growth: usize,
    /// Size of the chunks small requests (1 MiB or less) are carved from. Default 2 MiB.
    pub small_chunk_size: usize,
    /// The stream every allocation belongs to. Default [`Stream::DEFAULT`].
    pub stream: Stream,
    /// What the pool's blocks are backed with ([`backing`](super::backing)): chunks of plain
    /// allocations, expandable segments or stitched virtual-memory ranges. The memory of the
    /// last two is mapped: another process opens it through exported file descriptors
    /// ([`share_mapped`](super::backing::share_mapped)), not CUDA IPC handles. Default
    /// [`BackingKind::CHUNKS`].
    pub backing: BackingKind,
    /// The longest the pool waits for its stream's work before giving memory back to the
    /// device (see [`BestFit`]'s release). Default 2 s.
    pub wait_timeout: Duration,
}

impl Default for BestFitConfig {
    fn default() -> Self {
        Self {
            growth: 32 << 20,
            small_chunk_size: 2 << 20,
            stream: Stream::DEFAULT,
            backing: BackingKind::CHUNKS,
            wait_timeout: Duration::from_secs(2),
        }
    }
}

/// A caching pool: memory obtained from a [`Backing`] (chunks, expandable segments or
/// stitched ranges: [`BestFitConfig::backing`]), carved into blocks by best fit, split and
/// coalesced, and kept after free for reuse. The policy (size classes, rounding, splitting)
/// is [`policy::best_fit`](crate::policy::best_fit).
///
/// * **Growth.** When no cached block fits, the backing adds memory (see
///   [`backing`](super::backing)); on out-of-memory the pool releases what the backing can
///   give back and tries once more, else fails with [`Error::OutOfMemory`].
/// * **Release.** [`Allocator::release`] gives free memory back through the backing; dropping
///   the pool (and every allocation) returns all of it. Before giving memory back the pool
///   waits for the work enqueued on its stream, at most [`BestFitConfig::wait_timeout`]; past
///   it nothing is given back and the error ([`Error::Timeout`]) says what was waited for. See
///   DESIGN.md, Note [wait before giving memory back].
/// * **Recorded streams.** All allocations belong to the pool's one stream. A freed block whose
///   allocation recorded other streams becomes reusable once an event recorded on each at the
///   free has completed (checked without blocking at the next allocation or release). A free
///   never blocks; if an event cannot be recorded the block is never reused and the error is
///   reported by the next [`Allocator::release`].
/// * **Exact reuse.** A freed block of the small class ([`Classes::small_max`](crate::policy::best_fit::Classes::small_max)) is parked under
///   its rounded size for the next request of that size, and given back to the policy before
///   the pool grows, releases or gives a chunk away. See DESIGN.md, Note [park small blocks].
/// * **Concurrency.** One lock guards the pool; reusing a cached block takes it once and
///   allocates nothing on the heap. See DESIGN.md, Note [grow under the pool's lock].
///
/// # Examples
///
/// ```
/// use streamalloc::allocators::{BestFit, BestFitConfig};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::Allocator;
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let pool = BestFit::new(sim, BestFitConfig::default())?;
/// let a = pool.allocate(3 << 20)?; // carved from a chunk the pool reserves
/// let reserved = pool.stats().reserved;
/// drop(a); // cached, not returned to the device
/// let b = pool.allocate(3 << 20)?; // served from the cache
/// assert_eq!(pool.stats().reserved, reserved);
/// drop(b);
/// assert!(pool.release()? > 0); // the cache goes back to the device
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct BestFit {
    inner: Arc<Inner>,
}

/// Aligned to two cache lines so that the lock and the reference count, written by every
/// allocation and free, share no line with another pool's (threads on different streams
/// then touch disjoint lines).
#[repr(align(128))]
struct Inner {
    /// Mirrors `!state.pending.is_empty()`, readable without the lock.
    has_pending: AtomicBool,
    /// Where the pool's reserved bytes are also counted, with other pools' ([`BestFit::count_reserved_in`]).
    gauge: std::sync::OnceLock<Arc<ReservedGauge>>,
    backing: Box<dyn Backing>,
    device: Arc<dyn Device>,
    events: EventPool,
    stream: Stream,
    ordinal: usize,
    /// [`BestFitConfig::wait_timeout`].
    wait: Duration,
    /// Held, shared, by each release from its first step to its last
    /// ([`Backing::release_begin`]), and alone by the first step of a sleep, which begins
    /// once no release is under way.
    releases: RwLock<()>,
    /// The pool's books. Locked before the backing's own state: the pool calls its backing
    /// with it held, and the backing never calls the pool.
    state: Mutex<State>,
}

struct State {
    policy: BestFitPolicy,
    /// Freed small blocks parked for exact reuse, not yet given back to the policy. See
    /// [`BestFit`]'s docs.
    parked: Parked,
    /// Byte and count figures; `cached`, `largest_free_block` and `pending_release` are
    /// filled in by [`BestFit::stats`].
    stats: Stats,
    /// Freed blocks waiting for events on recorded streams.
    pending: Vec<Pending>,
    /// Bytes (as asked for) of `pending`.
    pending_bytes: usize,
    /// Bytes (as asked for) of `stuck`.
    stuck_bytes: usize,
    /// Blocks freed with a recorded stream no event could be recorded on (destroyed before
    /// the free): free again once the device has synchronized ([`Inner::adopt_stuck`]).
    stuck: Vec<Pending>,
    /// Errors met where they could not be returned (frees), reported by the next release.
    held: HeldErrors,
    /// The allocations kept by pointer ([`BestFit::allocate_kept`]), under the same lock as
    /// the books: an allocation and its free by pointer take this one lock.
    kept: FxHashMap<DevicePtr, KeptBlock>,
}

struct Pending {
    token: u64,
    ptr: u64,
    size: usize,
    /// Events still to complete, one per recorded stream.
    events: Vec<Event>,
}

impl BestFitConfig {
    /// Checks the sizes as [`BestFit::new`] does, without building a pool: fails with
    /// [`InvalidArgument`](crate::Error::InvalidArgument) where they are not multiples of
    /// [`ALIGNMENT`](crate::ALIGNMENT), the small chunk is under 1 MiB or the growth size is not
    /// above 1 MiB.
    pub fn validate(&self) -> Result<()> {
        self.classes().validate()
    }

    /// The size classes these settings give, before a backing adjusts them.
    fn classes(&self) -> Classes {
        Classes {
            small_chunk: self.small_chunk_size as u64,
            growth: self.growth as u64,
            ..Classes::default()
        }
    }
}

impl BestFit {
    /// A pool on `device`, backed as [`BestFitConfig::backing`] says.
    pub fn new(device: Arc<dyn Device>, config: BestFitConfig) -> Result<Self> {
        Self::with_source(Arc::new(DeviceChunks::new(device)), config)
    }

    /// A pool whose chunks (those of requests larger than the growth size, with expandable
    /// segments) come from `source`, backed as [`BestFitConfig::backing`] says. Fails if the
    /// configured sizes are not multiples of [`ALIGNMENT`](crate::ALIGNMENT), the small chunk
    /// is under 1 MiB or the growth size is not above 1 MiB.
    pub fn with_source(source: Arc<dyn ChunkSource>, config: BestFitConfig) -> Result<Self> {
        let backing = (config.backing.spec().make)(source, config.stream);
        Self::with_backing(backing, config)
    }

    /// A pool over `backing` ([`BestFitConfig::backing`] is not read). Fails as
    /// [`BestFit::with_source`] does.
    pub fn with_backing(backing: Box<dyn Backing>, config: BestFitConfig) -> Result<Self> {
        let classes = backing.classes(config.classes());
        classes.validate()?;
        let device = backing.device().clone();
        let state = State {
            policy: BestFitPolicy::new(classes),
            parked: Parked::default(),
            stats: Stats::default(),
            pending: Vec::new(),
            pending_bytes: 0,
            stuck_bytes: 0,
            stuck: Vec::new(),
            held: HeldErrors::default(),
            kept: FxHashMap::default(),
        };
        let inner = Inner {
            has_pending: AtomicBool::new(false),
            gauge: std::sync::OnceLock::new(),
            ordinal: device.ordinal(),
            events: EventPool::new(device.clone()),
            backing,
            device,
            stream: config.stream,
            wait: config.wait_timeout,
            releases: RwLock::new(()),
            state: Mutex::new(state),
        };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// Counts the pool's reserved bytes in `gauge` too, from now on (what it holds now
    /// included), beside other pools'; once (a second gauge is ignored).
    pub fn count_reserved_in(&self, gauge: Arc<ReservedGauge>) {
        let st = self.inner.state.lock();
        if self.inner.gauge.set(gauge.clone()).is_ok() {
            gauge.add(st.stats.reserved);
        }
    }

    /// Allocates like [`Allocator::allocate`]; with `poll` false, frees pending on recorded
    /// streams are not checked (no event query: for use while a stream captures a graph).
    pub fn allocate_polling(&self, size: usize, poll: bool) -> Result<Allocation> {
        let made = self.allocate_uncounted(size, poll);
        Ok(self.inner.count(made)?.0)
    }

    /// [`BestFit::allocate_polling`] without counting a failure or a retry in the pool's
    /// statistics (the caller counts): the allocation, and whether it succeeded only after
    /// the pool gave memory back or polled pending frees and tried again.
    pub(crate) fn allocate_uncounted(&self, size: usize, poll: bool) -> Result<(Allocation, bool)> {
        if size == 0 {
            return Ok((Allocation::empty(self.inner.ordinal, self.inner.stream), false));
        }
        let rounded = Self::round(size)?;
        let (block, retried) = match self.cached_or_growth(size, rounded, poll) {
            Ok(b) => (b, false),
            Err(Some(growth)) => self.grow_and_allocate(size, rounded, growth, poll)?,
            Err(None) => return Err(Error::InvalidArgument(format!("allocation size {size} overflows"))),
        };
        Ok((Allocation::new(block, self.inner.clone()), retried))
    }

    /// Gives free memory back through the backing after polling pending frees (and a
    /// bounded wait, see [`BestFit`]), as [`Allocator::release`] does, without reporting the
    /// errors held back (the caller is another allocation's out-of-memory path, which must
    /// not swallow them).
    pub(crate) fn release_cached(&self) -> Result<usize> {
        self.inner.poll_pending();
        self.inner.release_free()
    }

    /// Allocates from cached blocks only: `Ok(None)` when none fits (the pool does not
    /// grow). `poll` as in [`BestFit::allocate_polling`]. Not counted as a failure when it
    /// fails (the caller, which goes on to another path, counts).
    pub fn allocate_cached(&self, size: usize, poll: bool) -> Result<Option<Allocation>> {
        if size == 0 {
            return Ok(Some(Allocation::empty(self.inner.ordinal, self.inner.stream)));
        }
        let hit = self.cached_or_growth(size, Self::round(size)?, poll).ok();
        Ok(hit.map(|b| Allocation::new(b, self.inner.clone())))
    }

    /// [`BestFit::allocate_cached`], the allocation kept in the pool by its pointer with the
    /// front end's `word` (no handle is made): its pointer, under the pool's one lock.
    /// `Ok(None)` on a miss; `size` must not be 0.
    pub(crate) fn allocate_kept(&self, size: usize, poll: bool, word: u64) -> Result<Option<DevicePtr>> {
        let rounded = Self::round(size)?;
        let mut st = self.lock_polled(poll);
        let Some(grant) = st.allocate(rounded, size) else { return Ok(None) };
        let block = self.handout(grant, size);
        let ptr = block.ptr;
        st.keep(KeptBlock::new(block, word));
        Ok(Some(ptr))
    }

    /// Hands `[ptr, ptr + size)` out again as an allocation of `size` bytes kept with `word`,
    /// as [`BestFit::allocate_kept`] keeps its own ([`BestFitPolicy::allocate_at`]): the range
    /// must be free in this pool. With `poll`, frees pending on recorded streams are polled
    /// and, while the range is not free, waited for once (at most the pool's `wait_timeout`).
    /// Whether the range was handed out; never grows the pool.
    pub(crate) fn allocate_kept_at(
        &self,
        ptr: DevicePtr,
        size: usize,
        word: u64,
        poll: bool,
    ) -> Result<bool> {
        let rounded = Self::round(size)?;
        for wait in [false, true] {
            if wait {
                if !poll || !self.has_pending() {
                    break;
                }
                self.inner.wait_pending();
            }
            let mut st = self.lock_polled(poll);
            // Parked blocks go back to the policy: merged, their bytes can be handed out.
            st.unpark();
            if let Some(grant) = st.policy.allocate_at(ptr, rounded) {
                st.stats.on_allocate(size);
                let block = self.handout(grant, size);
                st.keep(KeptBlock::new(block, word));
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Keeps `allocation`, one of this pool's, by its pointer with `word`, as
    /// [`BestFit::allocate_kept`] does (for an allocation of the slow path): its pointer; the
    /// allocation back if it is not this pool's or has no memory.
    pub(crate) fn keep(
        &self,
        allocation: Allocation,
        word: u64,
    ) -> std::result::Result<DevicePtr, Allocation> {
        let (device, stream) = (allocation.device(), allocation.owning_stream());
        let Some((block, owner)) = allocation.into_parts() else {
            return Err(Allocation::empty(device, stream));
        };
        if !std::ptr::addr_eq(Arc::as_ptr(&owner), Arc::as_ptr(&self.inner)) {
            return Err(Allocation::new(block, owner));
        }
        let ptr = block.ptr;
        self.inner.state.lock().keep(KeptBlock::new(block, word));
        Ok(ptr)
    }

    /// Frees the allocation kept at `ptr` ([`BestFit::allocate_kept`]), as the drop of its
    /// handle would: what was kept for it, `None` if the pool keeps none there.
    ///
    /// With recorded streams, the allocation stays kept (its streams listed by
    /// [`BestFit::each_kept`]) until its block is pending on their events, under one hold of
    /// the lock: a sleep that looks at both in turn never misses it (DESIGN.md, Note [frees
    /// under way]).
    pub(crate) fn take_kept(&self, ptr: DevicePtr) -> Option<PointerEntry> {
        let inner = &self.inner;
        let mut st = inner.state.lock();
        // One hash lookup: an unrecorded allocation leaves through its entry. (`entry` makes
        // room for an insertion on a miss: the map kept half full has it, an empty one may not.)
        if st.kept.is_empty() {
            return None;
        }
        let Entry::Occupied(found) = st.kept.entry(ptr) else { return None };
        let entry = found.get().entry();
        if !entry.recorded {
            let block = found.remove().into_block();
            st.take_back(block.token, block.ptr, block.size);
            return Some(entry);
        }
        let streams = found.get().recorded_streams().to_vec();
        drop(st);
        // The events are recorded without the lock, as a handle's free records them.
        let (events, failed) = inner.record_events(&streams);
        let mut st = inner.state.lock();
        let Some(kept) = st.kept.remove(&ptr) else {
            // Freed meanwhile by another thread (a double free): nothing of it is left here.
            drop(st);
            events.into_iter().for_each(|e| inner.events.put(e));
            return None;
        };
        let mut block = kept.into_block();
        // Streams recorded meanwhile (a race of the caller's) had no event: none waits here.
        block.recorded.retain(|s| streams.contains(s));
        inner.park_recorded(st, block, events, failed);
        Some(entry)
    }

    /// Runs `f` on the allocation kept at `ptr`, under the pool's lock; whether one is.
    pub(crate) fn with_kept(&self, ptr: DevicePtr, f: &mut dyn FnMut(&mut KeptBlock)) -> bool {
        let mut st = self.inner.state.lock();
        st.kept.get_mut(&ptr).map(f).is_some()
    }

    /// Runs `f` on every allocation kept, under the pool's lock.
    pub(crate) fn each_kept(&self, f: &mut dyn FnMut(DevicePtr, &mut KeptBlock)) {
        let mut st = self.inner.state.lock();
        for (&ptr, kept) in st.kept.iter_mut() {
            f(ptr, kept);
        }
    }

    /// Moves pending frees whose events have completed to the free lists (event queries,
    /// no wait): what an allocation does first, without allocating.
    pub(crate) fn poll_pending(&self) {
        self.inner.poll_pending();
    }

    /// Whether freed blocks wait on recorded streams' events (read without locking).
    pub fn has_pending(&self) -> bool {
        self.inner.has_pending.load(Ordering::Relaxed)
    }

    /// Takes the smallest wholly free chunk that could serve `size` bytes out of this pool,
    /// for another pool of the same device to [`adopt`](BestFit::adopt_chunk). The memory's
    /// last use was in the order of this pool's stream: the adopter must order itself after
    /// it. `None` if no such chunk is cached.
    pub fn take_free_chunk(&self, size: usize) -> Option<FreeChunk> {
        let mut st = self.inner.state.lock();
        st.unpark();
        let (class, AddrRange { addr, len: size }) = st.policy.take_free_chunk(u64::try_from(size).ok()?)?;
        st.stats.reserved -= size as usize;
        Some(FreeChunk { class, addr, size })
    }

    /// Adds a chunk taken from another pool of the same device with
    /// [`BestFit::take_free_chunk`].
    pub fn adopt_chunk(&self, chunk: FreeChunk) -> Result<()> {
        let mut st = self.inner.state.lock();
        st.policy.add_chunk(chunk.class, chunk.addr, chunk.size)?;
        st.stats.reserved += chunk.size as usize;
        st.stats.reserved_peak = st.stats.reserved_peak.max(st.stats.reserved);
        Ok(())
    }

    /// Another handle on the same pool (a sleep keeps the pools it put to sleep).
    pub(crate) fn handle(&self) -> BestFit {
        BestFit { inner: self.inner.clone() }
    }

    /// Makes `waiter` wait for the events of the frees pending on recorded streams (the last
    /// uses of their blocks), for a sleep. The caller keeps the pool from polling meanwhile
    /// (no allocation or release of it runs): an event polled complete goes back to the
    /// pool's events, and waiting on it once recorded again would wait for later work too.
    pub(crate) fn order_after_pending(&self, waiter: Stream) -> Result<()> {
        let st = self.inner.state.lock();
        let events: Vec<Event> = st.pending.iter().flat_map(|p| p.events.iter().copied()).collect();
        drop(st);
        events.into_iter().try_for_each(|e| self.inner.device.stream_wait_event(waiter, e))
    }

    /// [`Backing::sleep_begin`] over the pool's books, once no release is under way: the
    /// mapped ranges that hold its data.
    pub(crate) fn sleep_begin(&self) -> Result<Vec<(DevicePtr, usize)>> {
        let inner = &self.inner;
        let bound = inner.wait.saturating_mul(2);
        let _between_releases = inner.releases.try_write_for(bound).ok_or_else(|| Error::Timeout {
            waited_for: format!("the releases under way of the pool of stream {:?}", inner.stream),
            after: bound,
        })?;
        inner.with_backing(&mut inner.state.lock(), |backing, books| backing.sleep_begin(books))
    }

    /// [`Backing::sleep_end`] over the pool's books: the bytes given back at their addresses.
    pub(crate) fn sleep_end(&self, commit: bool) -> Result<usize> {
        let inner = &self.inner;
        inner.with_backing(&mut inner.state.lock(), |backing, books| backing.sleep_end(books, commit))
    }

    /// [`Backing::wake`]: the ranges mapped again.
    pub(crate) fn wake(&self) -> Result<Vec<(DevicePtr, usize)>> {
        self.inner.backing.wake()
    }

    fn round(size: usize) -> Result<u64> {
        u64::try_from(size)
            .ok()
            .and_then(BestFitPolicy::round)
            .ok_or_else(|| Error::InvalidArgument(format!("allocation size {size} overflows")))
    }

    /// The cached path: a hit, or on a miss the growth the pool would need (`None` if the
    /// size is too large to grow for).
    #[inline(always)]
    fn cached_or_growth(
        &self,
        size: usize,
        rounded: u64,
        poll: bool,
    ) -> std::result::Result<Block, Option<Growth>> {
        let mut st = self.lock_polled(poll);
        if let Some(grant) = st.allocate(rounded, size) {
            drop(st);
            return Ok(self.handout(grant, size));
        }
        Err(st.policy.growth_for(rounded))
    }

    /// The pool's state, locked, after (with `poll`) moving completed pending frees to the
    /// free lists.
    fn lock_polled(&self, poll: bool) -> MutexGuard<'_, State> {
        let mut st = self.inner.state.lock();
        if poll && !st.pending.is_empty() {
            drop(st);
            self.inner.poll_pending();
            st = self.inner.state.lock();
        }
        st
    }

    fn handout(&self, grant: Grant, size: usize) -> Block {
        Block {
            ptr: grant.addr,
            size,
            stream: self.inner.stream,
            device: self.inner.ordinal,
            token: grant.token,
            recorded: Default::default(),
        }
    }

    /// The slow path: under the pool's lock, a block freed meanwhile, else the backing adds
    /// memory and the request is served from it; on out-of-memory, once (the shared loop with
    /// a zero timeout): what was freed meanwhile is looked at, then what is free goes back
    /// through the backing and the backing is tried again. The block, and whether it came
    /// only after that retry.
    #[cold]
    #[inline(never)]
    fn grow_and_allocate(
        &self,
        size: usize,
        rounded: u64,
        growth: Growth,
        poll: bool,
    ) -> Result<(Block, bool)> {
        let inner = &self.inner;
        let grow = || {
            let mut st = inner.state.lock();
            if let Some(grant) = st.allocate(rounded, size) {
                return Ok(grant);
            }
            let want =
                Want { class: st.policy.class_of(rounded), rounded, chunk: growth.size, own: growth.own };
            inner.with_backing(&mut st, |backing, books| backing.grow(books, &want))?;
            st.allocate(rounded, size).ok_or_else(|| {
                Error::Internal(format!("the backing grew the pool for {size} bytes and they did not fit"))
            })
        };
        let release = || {
            // Memory freed meanwhile (by other threads or completed events) may fit now,
            // after a bounded wait for the frees pending on recorded streams (memory behind a
            // short kernel is not out of memory); otherwise give back what is free.
            if poll {
                inner.wait_pending();
                inner.poll_pending();
            }
            if let Some(grant) = inner.state.lock().allocate(rounded, size) {
                return Ok(Some(grant));
            }
            inner.release_free().map(|_| None)
        };
        let retried = retry::on_out_of_memory(Duration::ZERO, grow, release, |_| ());
        let again = retried.retried();
        match retried.result {
            Ok(grant) => Ok((self.handout(grant, size), again)),
            Err(e) => Err(inner.failure(e, size, growth.size as usize, retried.release_error)),
        }
    }
}

/// Parked small blocks.
#[derive(Default)]
struct Parked {
    /// The blocks parked under each rounded request size, at the size's index
    /// ([`Parked::index`]): only small sizes are parked, so the vector stays short (at most
    /// the small class's largest size over 256 entries), and a lookup indexes it where a hash
    /// map hashed and probed. Lists emptied by reuse keep their capacity, so parking again
    /// does not allocate.
    by_size: Vec<SizeList>,
    /// The indices of the sizes whose lists were pushed to since the last unpark, each once:
    /// unparking visits only these, not every size ever seen.
    listed: Vec<usize>,
    /// Bytes of the blocks parked.
    bytes: u64,
}

impl Parked {
    /// The index in [`Parked::by_size`] of a rounded size (a positive multiple of
    /// [`ALIGNMENT`](crate::ALIGNMENT)).
    fn index(rounded: u64) -> usize {
        (rounded / crate::ALIGNMENT as u64).saturating_sub(1) as usize
    }

    /// Every block parked, as (token, address, block size).
    fn blocks(&self) -> impl Iterator<Item = &(u64, u64, u64)> + '_ {
        self.by_size.iter().flat_map(|list| &list.blocks)
    }
}

/// The blocks parked under one rounded size.
#[derive(Default)]
struct SizeList {
    /// (token, address, block size).
    blocks: Vec<(u64, u64, u64)>,
    /// Whether the size is in [`Parked::listed`].
    listed: bool,
}

impl State {
    /// Allocates from the cache and counts it: for a small request, a parked block of exactly
    /// its rounded size; else [`State::allocate_harder`].
    fn allocate(&mut self, rounded: u64, size: usize) -> Option<Grant> {
        // Only small blocks are parked: a large request looks in the policy alone.
        let grant = if self.policy.class_of(rounded) == Class::Small {
            let parked = &mut self.parked;
            match parked.by_size.get_mut(Parked::index(rounded)).and_then(|list| list.blocks.pop()) {
                Some((token, addr, block)) => {
                    parked.bytes -= block;
                    Grant { addr, size: block, token }
                }
                None => self.allocate_harder(rounded)?,
            }
        } else {
            self.allocate_harder(rounded)?
        };
        self.stats.on_allocate(size);
        Some(grant)
    }

    /// What the pool serves without its backing when no parked block fits: best fit (for a
    /// small request, once more after giving every parked block back), else from an idle
    /// stitched chunk that fits the size whose homes are free
    /// ([`BestFitPolicy::reuse_stitched`]: a repeated workload's misses on a stitched backing
    /// end here, with no device call), else from the frontier block
    /// ([`BestFitPolicy::allocate_frontier`]); the last three in one call
    /// ([`BestFitPolicy::allocate_or_reuse`]).
    fn allocate_harder(&mut self, rounded: u64) -> Option<Grant> {
        // Parked blocks are small: giving them back helps small requests only (and a large
        // request served by the frontier block would give them back at every pass).
        if self.parked.bytes > 0 && self.policy.class_of(rounded) == Class::Small {
            if let Some(g) = self.policy.allocate(rounded) {
                return Some(g);
            }
            self.unpark();
        }
        match self.policy.allocate_or_reuse(rounded) {
            Ok(grant) => grant,
            Err(e) => {
                self.held.hold(e);
                None
            }
        }
    }

    /// Keeps `kept` by its pointer, the map at most half full (see DESIGN.md, Note [maps kept
    /// half full]).
    fn keep(&mut self, kept: KeptBlock) {
        let len = self.kept.len();
        if len * 2 >= self.kept.capacity() {
            self.kept.reserve(len.max(64));
        }
        let ptr = kept.ptr();
        self.kept.insert(ptr, kept);
    }

    /// Takes back the block of `token` at `ptr`, freed by an allocation of `size` bytes:
    /// parked for exact reuse if small, else merged at once. A block not handed out is a bug
    /// in the caller, held back as the error the next release reports.
    fn take_back(&mut self, token: u64, ptr: u64, size: usize) {
        self.stats.on_free(size);
        let rounded = BestFitPolicy::round(size as u64);
        let (Some(rounded), Some(block)) = (rounded, self.policy.allocated_size(token, ptr)) else {
            let e = Error::InvalidArgument(format!(
                "free of {ptr:#x} (token {token}), which is not allocated: this is a bug in the caller"
            ));
            self.held.hold(e);
            return;
        };
        if self.policy.class_of(rounded) == Class::Large {
            if let Err(e) = self.policy.free(token, ptr) {
                self.held.hold(e);
            }
            return;
        }
        let parked = &mut self.parked;
        let index = Parked::index(rounded);
        if parked.by_size.len() <= index {
            parked.by_size.resize_with(index + 1, SizeList::default);
        }
        let Some(list) = parked.by_size.get_mut(index) else {
            // Not reached (the vector was just grown): merged at once rather than lost.
            if let Err(e) = self.policy.free(token, ptr) {
                self.held.hold(e);
            }
            return;
        };
        list.blocks.push((token, ptr, block));
        if !list.listed {
            list.listed = true;
            parked.listed.push(index);
        }
        parked.bytes += block;
    }

    /// Gives every parked block back to the policy, which coalesces it.
    fn unpark(&mut self) {
        let State { parked, policy, held, .. } = self;
        let Parked { by_size, listed, bytes } = parked;
        if *bytes == 0 {
            return;
        }
        for index in listed.drain(..) {
            let Some(list) = by_size.get_mut(index) else { continue };
            list.listed = false;
            for (token, addr, _) in list.blocks.drain(..) {
                if let Err(e) = policy.free(token, addr) {
                    held.hold(e);
                }
            }
        }
        *bytes = 0;
    }
}

impl Inner {
    /// Waits, at most the pool's `wait_timeout` in all, for the events of the frees pending
    /// on recorded streams, before an allocation fails for lack of memory (memory pending
    /// behind a short kernel must not fail it). Past the bound, or on an
    /// error, it stops; the caller polls what completed. Events go back to the pool's event
    /// pool only, never destroyed while it lives: one polled and reused meanwhile is waited
    /// for (bounded) for nothing, never freed under the wait.
    fn wait_pending(&self) {
        let events: Vec<Event> =
            self.state.lock().pending.iter().flat_map(|p| p.events.iter().copied()).collect();
        let start = std::time::Instant::now();
        for e in events {
            let left = self.wait.saturating_sub(start.elapsed());
            if left.is_zero() || !matches!(self.device.wait_event(e, left), Ok(true)) {
                return;
            }
        }
    }

    /// Frees the blocks freed with a destroyed recorded stream once the device has
    /// synchronized (all its work, the destroyed stream's included, as `cuMemFree` waits); a
    /// synchronize that fails keeps them out of use, its error held.
    fn adopt_stuck(&self) {
        if self.state.lock().stuck.is_empty() {
            return;
        }
        let synced = self.device.synchronize();
        let mut st = self.state.lock();
        let st = &mut *st;
        if let Err(e) = synced {
            st.held.hold(e);
            return;
        }
        for p in std::mem::take(&mut st.stuck) {
            st.stuck_bytes -= p.size;
            if let Err(e) = st.policy.free(p.token, p.ptr) {
                st.held.hold(e);
            }
        }
    }

    /// Moves pending blocks whose events have all completed to the free lists. Queries the
    /// device outside the lock; never blocks.
    fn poll_pending(&self) {
        let mut batch = {
            let mut st = self.state.lock();
            if st.pending.is_empty() {
                return;
            }
            std::mem::take(&mut st.pending)
        };
        let mut query_error = None;
        for p in &mut batch {
            p.events.retain(|&e| match self.device.query_event(e) {
                Ok(true) => {
                    self.events.put(e);
                    false
                }
                Ok(false) => true,
                Err(err) => {
                    query_error.get_or_insert(err);
                    true
                }
            });
        }
        let mut st = self.state.lock();
        let st = &mut *st;
        batch.retain(|p| {
            if !p.events.is_empty() {
                return true;
            }
            st.pending_bytes -= p.size;
            if let Err(e) = st.policy.free(p.token, p.ptr) {
                st.held.hold(e);
            }
            false
        });
        batch.append(&mut st.pending);
        st.pending = batch;
        self.has_pending.store(!st.pending.is_empty(), Ordering::Relaxed);
        if let Some(e) = query_error {
            st.held.hold(e);
        }
    }

    /// Gives free memory back through the backing; the bytes given back, or the first error
    /// met (after trying everything). The backing takes what goes back out of the books
    /// ([`Backing::release_begin`]), then the pool waits, without its lock and at most
    /// [`BestFitConfig::wait_timeout`], for the work enqueued on its stream until then, where
    /// every use of a free block is ordered (blocks freed with recorded streams join the free
    /// lists after their events), and only then does the backing unmap or free it
    /// ([`Backing::release_end`]): a chunk's `cuMemFree` would wait for that work without a
    /// bound, and an unmap would not wait at all. Past the bound nothing is given back and
    /// the error ([`Error::Timeout`]) says what was waited for.
    fn release_free(&self) -> Result<usize> {
        // Only the first step of a sleep holds it alone, and not for long.
        let _under_way = self.releases.try_read_recursive_for(self.wait).ok_or_else(|| Error::Timeout {
            waited_for: format!("a sleep of the pool of stream {:?} to begin", self.stream),
            after: self.wait,
        })?;
        let taken = {
            let mut st = self.state.lock();
            if st.policy.figures().cached == 0 && st.parked.bytes == 0 {
                return Ok(0);
            }
            self.with_backing(&mut st, |backing, books| backing.release_begin(books))?
        };
        if taken.is_empty() {
            return Ok(0);
        }
        let waited = super::wait_for_streams(self.device.as_ref(), &self.events, &[self.stream], self.wait);
        self.with_backing(&mut self.state.lock(), |backing, books| backing.release_end(books, taken, waited))
    }

    /// Runs `f`, a call of the backing, on the pool's books (`st`, locked) after parked
    /// blocks went back to the policy; counts the bytes reserved that it added or gave back.
    fn with_backing<T>(&self, st: &mut State, f: impl FnOnce(&dyn Backing, &mut BestFitPolicy) -> T) -> T {
        st.unpark();
        let before = st.policy.figures();
        let done = f(self.backing.as_ref(), &mut st.policy);
        let after = st.policy.figures();
        if after.reserved > before.reserved {
            st.stats.on_reserve((after.reserved - before.reserved) as usize);
            if let Some(gauge) = self.gauge.get() {
                gauge.add((after.reserved - before.reserved) as usize);
            }
        } else if after.reserved < before.reserved {
            st.stats.on_unreserve((before.reserved - after.reserved) as usize);
            if let Some(gauge) = self.gauge.get() {
                gauge.sub((before.reserved - after.reserved) as usize);
            }
            // One device call per chunk given back whole.
            st.stats.device_frees += before.chunks.saturating_sub(after.chunks).max(1) as u64 - 1;
        }
        done
    }

    /// Counts `made` in the statistics: a failure, or a success that came only after a
    /// retry.
    fn count<T>(&self, made: Result<(T, bool)>) -> Result<(T, bool)> {
        match &made {
            Ok((_, false)) => {}
            Ok((_, true)) => self.state.lock().stats.retries += 1,
            Err(_) => self.state.lock().stats.failures += 1,
        }
        made
    }

    /// For out-of-memory, fills in the pool's figures and `release`, the error of the release
    /// made before the last attempt (a bounded wait that ran out).
    fn failure(&self, error: Error, size: usize, chunk: usize, release: Option<Error>) -> Error {
        let Error::OutOfMemory(device_report) = error else { return error };
        let beyond = device_report.exceeds_device().then(|| device_report.beyond_device_hint());
        let mem = self.device.mem_info().unwrap_or_default();
        let st = self.state.lock();
        let figures = st.policy.figures();
        let mut detail = device_report.detail;
        if let Some(e) = release {
            detail.push(super::release_failed(&e));
        }
        detail.push(format!(
            "BestFit needed a chunk of {chunk} bytes; its largest free block is {} bytes in {} chunks",
            figures.largest_free, figures.chunks
        ));
        Error::oom(OutOfMemory {
            device: self.ordinal,
            requested: size,
            allocated: st.stats.allocated,
            cached: figures.cached as usize,
            pending_release: st.pending_bytes + st.stuck_bytes,
            reserved: st.stats.reserved,
            device_free: mem.free,
            device_total: mem.total,
            detail,
            hint: beyond.unwrap_or_else(|| {
                "BestFit returned its free chunks and retried once; free allocations, use a smaller \
                 growth size or a stream-ordered pool to reduce fragmentation"
                    .into()
            }),
            host: false,
        })
    }

    /// The slow part of a free: record an event on each recorded stream and park the block.
    fn free_recorded(&self, block: Block) {
        let (events, failed) = self.record_events(&block.recorded);
        self.park_recorded(self.state.lock(), block, events, failed);
    }

    /// An event recorded on each of `streams` (from the pool's events): the events recorded,
    /// and the error that stopped it, if one did.
    fn record_events(&self, streams: &[Stream]) -> (Vec<Event>, Option<Error>) {
        let mut events = Vec::with_capacity(streams.len());
        for &stream in streams {
            let event = match self.events.get() {
                Ok(event) => event,
                Err(e) => return (events, Some(e)),
            };
            events.push(event);
            if let Err(e) = self.device.record_event(event, stream) {
                return (events, Some(e));
            }
        }
        (events, None)
    }

    /// Counts `block` freed and puts it among the frees pending on `events`; after `failed`,
    /// keeps it out of use until a release has synchronized the device (the error held back).
    fn park_recorded(
        &self,
        mut st: MutexGuard<'_, State>,
        block: Block,
        events: Vec<Event>,
        failed: Option<Error>,
    ) {
        st.stats.on_free(block.size);
        match failed {
            None => {
                st.pending_bytes += block.size;
                st.pending.push(Pending { token: block.token, ptr: block.ptr, size: block.size, events });
                self.has_pending.store(true, Ordering::Relaxed);
            }
            Some(e) => {
                st.stuck_bytes += block.size;
                st.stuck.push(Pending {
                    token: block.token,
                    ptr: block.ptr,
                    size: block.size,
                    events: Vec::new(),
                });
                st.held.hold(e);
                drop(st);
                for event in events {
                    self.events.put(event);
                }
            }
        }
    }
}

impl Allocator for BestFit {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        self.allocate_polling(size, true)
    }

    /// Gives free memory back (after a bounded wait, see [`BestFit`]); then reports the
    /// errors frees held back, if any. After a free whose recorded stream was destroyed
    /// first, it synchronizes the device before, which frees that block.
    fn release(&self) -> Result<usize> {
        self.inner.adopt_stuck();
        let released = self.release_cached();
        self.inner.state.lock().held.take()?;
        released
    }

    fn stats(&self) -> Stats {
        let st = self.inner.state.lock();
        let figures = st.policy.figures();
        Stats {
            cached: (figures.cached + st.parked.bytes) as usize,
            largest_free_block: st
                .parked
                .blocks()
                .map(|&(_, _, block)| block)
                .fold(figures.largest_free, u64::max) as usize,
            pending_release: st.pending_bytes + st.stuck_bytes,
            ..st.stats
        }
    }

    fn reset_peak_stats(&self) {
        self.inner.state.lock().stats.reset_peaks();
    }

    fn device(&self) -> usize {
        self.inner.ordinal
    }

    /// The policy's chunks, each a segment of the pool's stream; a block the policy counts
    /// allocated is free here if parked for exact reuse, pending if its free waits for
    /// recorded streams.
    fn segments(&self, out: &mut Vec<Segment>) -> Result<()> {
        let st = self.inner.state.lock();
        let parked: FxHashSet<u64> = st.parked.blocks().map(|&(_, addr, _)| addr).collect();
        let pending: FxHashSet<u64> = st.pending.iter().map(|p| p.ptr).collect();
        for (AddrRange { addr, len: size }, blocks) in st.policy.chunk_blocks() {
            let blocks = blocks
                .into_iter()
                .map(|ChunkBlock { range: AddrRange { addr, len: size }, allocated }| SegmentBlock {
                    addr,
                    size: size as usize,
                    state: match allocated {
                        false => BlockState::Free,
                        true if parked.contains(&addr) => BlockState::Free,
                        true if pending.contains(&addr) => BlockState::Pending,
                        true => BlockState::Allocated,
                    },
                })
                .collect();
            out.push(Segment { addr, size: size as usize, stream: self.inner.stream, blocks });
        }
        Ok(())
    }
}

impl BlockOwner for Inner {
    fn free(&self, block: Block) {
        if !block.recorded.is_empty() {
            return self.free_recorded(block);
        }
        self.state.lock().take_back(block.token, block.ptr, block.size);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Allocations still kept by pointer are freed with the pool: those that recorded
        // streams wait for them below, as frees pending.
        let kept = std::mem::take(&mut self.state.get_mut().kept);
        for block in kept.into_values().map(KeptBlock::into_block) {
            if !block.recorded.is_empty() {
                self.free_recorded(block);
            }
        }
        let st = self.state.get_mut();
        for p in st.pending.drain(..) {
            for event in p.events {
                // The memory goes back to the device below: let the recorded streams' work
                // finish first. A failure here leaves only the device's own ordering.
                let _ = self.device.synchronize_event(event);
                self.events.put(event);
            }
        }
        let mut chunks: Vec<AddrRange> = st.policy.chunks().collect();
        chunks.extend(st.policy.take_stitches());
        self.backing.teardown(chunks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::sim::{SimConfig, SimDevice};
    use crate::device::{DeviceMemory, DeviceTestExt, Streams, VirtualMemory};

    const MIB: usize = 1 << 20;

    fn pool(capacity: usize) -> (Arc<SimDevice>, BestFit) {
        let sim = SimDevice::new(SimConfig::with_capacity(capacity));
        // 20 MiB chunks keep the figures below small; the default is tested on its own.
        let config = BestFitConfig { growth: 20 * MIB, ..Default::default() };
        let pool = BestFit::new(sim.clone(), config).unwrap();
        (sim, pool)
    }

    fn device_free(sim: &SimDevice) -> usize {
        sim.mem_info().unwrap().free
    }

    /// An expandable pool on a simulated device of 1 GiB, for the device's first stream when
    /// `on_own_stream`, else for the legacy default stream.
    fn expandable_pool(on_own_stream: bool) -> (Arc<SimDevice>, BestFit, Stream) {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let stream = if on_own_stream { sim.create_stream().unwrap() } else { Stream::DEFAULT };
        let config =
            BestFitConfig { growth: 20 * MIB, stream, backing: BackingKind::SEGMENTS, ..Default::default() };
        let pool = BestFit::new(sim.clone(), config).unwrap();
        (sim, pool, stream)
    }

    #[test]
    fn expandable_pool_grows_by_what_is_lacking_and_merges_across_growths() {
        let (sim, pool, _) = expandable_pool(false);
        let start = device_free(&sim);
        // 3 MiB maps two 2 MiB granules; the 1 MiB left over is handed out with the block.
        let a = pool.allocate(3 * MIB).unwrap();
        let b = pool.allocate(3 * MIB).unwrap();
        assert_eq!(b.ptr(), a.ptr() + 4 * MIB as u64, "one segment, grown at its end");
        assert_eq!((pool.stats().reserved, start - device_free(&sim)), (8 * MIB, 8 * MIB));
        drop((a, b));
        // The two growths are one free block now: 6 MiB needs no growth (chunks of 4 MiB
        // could not serve it).
        let c = pool.allocate(6 * MIB).unwrap();
        assert_eq!(pool.stats().reserved, 8 * MIB);
        // A free tail counts: 2 MiB are free past `c`, so 3 MiB more maps one granule.
        let d = pool.allocate(3 * MIB).unwrap();
        assert_eq!(d.ptr(), c.ptr() + 6 * MIB as u64);
        assert_eq!(pool.stats().reserved, 10 * MIB);
        // Beyond the growth size, a request gets a chunk of its own, outside the segment.
        let e = pool.allocate(30 * MIB).unwrap();
        assert!(e.ptr() < c.ptr() || e.ptr() >= c.ptr() + 10 * MIB as u64);
        assert_eq!(pool.stats().reserved, 40 * MIB);
        // Small requests have a segment of their own.
        let f = pool.allocate(4096).unwrap();
        assert_eq!(pool.stats().reserved, 42 * MIB);
        drop((c, d, e, f));
        assert!(sim.violations().is_empty());
    }

    #[test]
    fn expandable_segments_go_back_after_their_streams_work() {
        let (sim, pool, s) = expandable_pool(true);
        let start = device_free(&sim);
        let a = pool.allocate(6 * MIB).unwrap();
        let keep = pool.allocate(4096).unwrap();
        // The stream still uses `a` when it is freed and the segment released: the release
        // waits for it (the simulator refuses to unmap memory in use).
        sim.use_range(a.ptr(), a.size(), s, 1_000_000).unwrap();
        drop(a);
        assert_eq!(pool.release().unwrap(), 6 * MIB, "the wholly free large segment");
        assert_eq!(start - device_free(&sim), 2 * MIB, "the small segment stays: `keep` is in it");
        // The released segment grows anew from its start.
        let b = pool.allocate(6 * MIB).unwrap();
        assert_eq!(pool.stats().reserved, 8 * MIB);
        drop((b, keep));
        drop(pool);
        assert_eq!(device_free(&sim), start, "dropping the pool unmaps its segments");
        assert!(sim.violations().is_empty());
    }

    #[test]
    fn zero_size_is_empty() {
        let (_, p) = pool(64 * MIB);
        let a = p.allocate(0).unwrap();
        assert_eq!((a.ptr(), a.size()), (0, 0));
        assert_eq!(p.stats(), Stats::default());
    }

    #[test]
    fn reuses_cached_blocks() {
        let (_, p) = pool(64 * MIB);
        let a = p.allocate(1000).unwrap();
        let ptr = a.ptr();
        assert_eq!(ptr % 256, 0);
        drop(a);
        let b = p.allocate(1000).unwrap();
        assert_eq!(b.ptr(), ptr);
        let s = p.stats();
        assert_eq!((s.device_allocs, s.total_allocations, s.total_frees, s.live_allocations), (1, 2, 1, 1));
        assert_eq!((s.allocated, s.reserved, s.cached), (1000, 2 * MIB, 2 * MIB - 1024));
    }

    #[test]
    fn the_smallest_and_largest_small_sizes_are_parked_and_served_again() {
        let (_, p) = pool(64 * MIB);
        // 1 byte rounds to the first size parked, 1 MiB (the small class's largest) to the last.
        let (one, largest) = (p.allocate(1).unwrap(), p.allocate(MIB).unwrap());
        let (one_ptr, largest_ptr) = (one.ptr(), largest.ptr());
        drop((one, largest));
        assert_eq!(p.stats().largest_free_block, MIB, "the free rest of the chunk is smaller");
        let segments = {
            let mut out = Vec::new();
            p.segments(&mut out).unwrap();
            out
        };
        let free: Vec<_> =
            segments[0].blocks.iter().filter(|b| b.state == BlockState::Free).map(|b| b.addr).collect();
        assert!(free.contains(&one_ptr) && free.contains(&largest_ptr), "parked blocks are free");
        assert_eq!(p.allocate(MIB).unwrap().ptr(), largest_ptr);
        assert_eq!(p.allocate(200).unwrap().ptr(), one_ptr);
        assert_eq!(p.stats().reserved, 2 * MIB);
    }

    #[test]
    fn parked_blocks_serve_their_size_and_merge_before_growth() {
        let (_, p) = pool(64 * MIB);
        // Four 512 KiB blocks fill a small chunk; two freed neighbours are parked, not merged.
        let mut xs: Vec<_> = (0..4).map(|_| p.allocate(512 << 10).unwrap()).collect();
        let (b, c) = (xs.remove(1), xs.remove(1));
        let (b_ptr, c_ptr) = (b.ptr(), c.ptr());
        drop((b, c));
        let s = p.stats();
        assert_eq!((s.cached, s.largest_free_block, s.reserved), (MIB, 512 << 10, 2 * MIB));
        // The same size comes back from the parked blocks.
        let again = p.allocate(512 << 10).unwrap();
        assert!(again.ptr() == b_ptr || again.ptr() == c_ptr);
        drop(again);
        // A 1 MiB request fits only once the two parked neighbours merge: no growth.
        let merged = p.allocate(MIB).unwrap();
        assert_eq!(merged.ptr(), b_ptr.min(c_ptr));
        assert_eq!(p.stats().reserved, 2 * MIB);
        drop(merged);
        drop(xs);
        // Release returns the chunk whole: parked blocks are given back first.
        assert_eq!(p.release().unwrap(), 2 * MIB);
    }

    #[test]
    fn default_grows_large_requests_by_32_mib() {
        let sim = SimDevice::new(SimConfig::with_capacity(256 * MIB));
        let p = BestFit::new(sim, BestFitConfig::default()).unwrap();
        let _a = p.allocate(MIB + 1).unwrap();
        let _b = p.allocate(40 * MIB).unwrap();
        assert_eq!(p.stats().reserved, 32 * MIB + 40 * MIB);
    }

    #[test]
    fn grows_by_class() {
        let (_, p) = pool(256 * MIB);
        let _small = p.allocate(4096).unwrap();
        assert_eq!(p.stats().reserved, 2 * MIB);
        let _large = p.allocate(5 * MIB).unwrap();
        assert_eq!(p.stats().reserved, 22 * MIB);
        let _huge = p.allocate(50 * MIB + 1).unwrap();
        let s = p.stats();
        assert_eq!((s.reserved, s.device_allocs), (74 * MIB, 3));
        assert_eq!(s.largest_free_block, 15 * MIB);
        assert_eq!(s.cached, 2 * MIB - 4096 + 15 * MIB + (2 * MIB - 256));
    }

    #[test]
    fn release_returns_only_free_chunks() {
        let (sim, p) = pool(256 * MIB);
        let before = device_free(&sim);
        let a = p.allocate(3 * MIB).unwrap();
        let b = p.allocate(30 * MIB).unwrap();
        let c = p.allocate(100).unwrap();
        drop(b);
        drop(c);
        assert_eq!(p.release().unwrap(), 32 * MIB);
        let s = p.stats();
        assert_eq!((s.reserved, s.device_frees, s.reserved_peak), (20 * MIB, 2, 52 * MIB));
        assert_eq!(device_free(&sim), before - 20 * MIB);
        drop(a);
        assert_eq!(p.release().unwrap(), 20 * MIB);
        assert_eq!(device_free(&sim), before);
        assert_eq!(p.release().unwrap(), 0);
    }

    #[test]
    fn out_of_memory_releases_and_retries_then_reports() {
        let (sim, p) = pool(48 * MIB);
        let a = p.allocate(10 * MIB).unwrap();
        let b = p.allocate(10 * MIB).unwrap();
        drop((a, b));
        assert_eq!(p.stats().reserved, 20 * MIB);
        let big = p.allocate(40 * MIB).unwrap();
        let s = p.stats();
        assert_eq!((s.reserved, s.device_frees, s.failures), (40 * MIB, 1, 0));
        let err = p.allocate(9 * MIB).unwrap_err();
        let Error::OutOfMemory(report) = err else { panic!("not an out-of-memory error: {err}") };
        assert_eq!(report.requested, 9 * MIB);
        assert_eq!(report.allocated, 40 * MIB);
        assert_eq!(report.reserved, 40 * MIB);
        assert_eq!(report.device_total, 48 * MIB);
        assert_eq!(report.device_free, device_free(&sim));
        assert!(!report.hint.is_empty());
        assert_eq!(p.stats().failures, 1);
        drop(big);
        assert!(p.allocate(9 * MIB).is_ok(), "the freed block is reused");
    }

    #[test]
    fn recorded_streams_delay_reuse() {
        let (sim, p) = pool(256 * MIB);
        let side = sim.create_stream().unwrap();
        let mut a = p.allocate(4096).unwrap();
        let ptr = a.ptr();
        a.record_stream(side);
        sim.use_range(ptr, 4096, side, 1_000_000).unwrap();
        drop(a);
        assert_eq!(p.stats().pending_release, 4096);
        let b = p.allocate(4096).unwrap();
        assert_ne!(b.ptr(), ptr, "reused while the side stream still uses it");
        assert_eq!(sim.check_handout(b.ptr(), 4096, Stream::DEFAULT), 0);
        sim.advance(2_000_000);
        let c = p.allocate(4096).unwrap();
        assert_eq!(c.ptr(), ptr, "reused once the side stream's work is done");
        assert_eq!(sim.check_handout(c.ptr(), 4096, Stream::DEFAULT), 0);
        assert_eq!(p.stats().pending_release, 0);
        assert!(sim.violations().is_empty());
        assert_eq!(p.inner.events.idle(), 1, "the event went back to the pool");
    }

    #[test]
    fn allocations_kept_by_pointer_hold_no_reference_and_free_as_handles_do() {
        let (sim, p) = pool(256 * MIB);
        let side = sim.create_stream().unwrap();
        drop(p.allocate(4096).unwrap());
        let a = p.allocate_kept(4096, true, 7).unwrap().expect("a cached block");
        let b = p.allocate_kept(100, true, 8).unwrap().expect("a cached block");
        // No handle, no reference count: the pool's own is the only one.
        assert_eq!(Arc::strong_count(&p.inner), 1);
        assert_eq!(p.stats().live_allocations, 2);
        assert!(p.with_kept(a, &mut |k| k.record_stream(side)));
        sim.use_range(a, 4096, side, 1_000_000).unwrap();
        let taken = p.take_kept(a).unwrap();
        assert_eq!((taken.size, taken.word, taken.recorded), (4096, 7, true));
        assert_eq!((p.take_kept(a), p.stats().pending_release), (None, 4096));
        let c = p.allocate_kept(4096, true, 9).unwrap().expect("a cached block");
        assert_ne!(c, a, "reused while the side stream still uses it");
        // A handle of the slow path, kept after; another pool's is given back.
        let d = p.allocate(3 * MIB).unwrap();
        let d = p.keep(d, 10).unwrap();
        let (_, other) = pool(256 * MIB);
        assert!(p.keep(other.allocate(4096).unwrap(), 11).is_err());
        let mut kept = Vec::new();
        p.each_kept(&mut |ptr, k| kept.push((ptr, k.entry().word)));
        kept.sort_unstable();
        let mut want = vec![(b, 8), (c, 9), (d, 10)];
        want.sort_unstable();
        assert_eq!(kept, want);
        // Dropped with the pool, a recorded one after its stream's work.
        let before = device_free(&sim);
        assert!(p.with_kept(b, &mut |k| k.record_stream(side)));
        sim.use_range(b, 100, side, 5_000_000).unwrap();
        let reserved = p.stats().reserved;
        drop(p);
        assert_eq!(device_free(&sim), before + reserved);
        assert!(sim.violations().is_empty());
    }

    #[test]
    fn a_freed_range_is_handed_out_again_at_its_address() {
        let (sim, p) = pool(256 * MIB);
        let side = sim.create_stream().unwrap();
        // Kept as a front end keeps them: from the cache, else through the slow path.
        let kept = |size, word| match p.allocate_kept(size, true, word).unwrap() {
            Some(ptr) => ptr,
            None => p.keep(p.allocate(size).unwrap(), word).unwrap(),
        };
        let (a, b, c) = (kept(4096, 1), kept(5 * MIB, 2), kept(3 * MIB, 3));
        p.take_kept(a).unwrap();
        p.take_kept(b).unwrap();
        let reserved = p.stats().reserved;
        // A small block is parked for exact reuse, a large one merged: both come back.
        assert!(p.allocate_kept_at(b, 5 * MIB, 12, true).unwrap());
        assert!(p.allocate_kept_at(a, 4096, 11, true).unwrap());
        assert!(!p.allocate_kept_at(c, 3 * MIB, 13, true).unwrap(), "still handed out");
        assert!(!p.allocate_kept_at(b + 4096, 4096, 13, true).unwrap(), "inside a block handed out");
        assert!(p.with_kept(b, &mut |k| assert_eq!((k.entry().size, k.entry().word), (5 * MIB, 12))));
        assert_eq!(p.take_kept(a).map(|e| e.word), Some(11));
        assert_eq!((p.stats().reserved, p.stats().live_allocations), (reserved, 2));
        // Freed with a recorded stream: handed out again once that stream's work is done.
        assert!(p.with_kept(c, &mut |k| k.record_stream(side)));
        sim.use_range(c, 3 * MIB, side, 1_000_000).unwrap();
        p.take_kept(c).unwrap();
        assert_eq!(p.stats().pending_release, 3 * MIB);
        assert!(!p.allocate_kept_at(c, 3 * MIB, 14, false).unwrap(), "pending, and no polling");
        assert!(p.allocate_kept_at(c, 3 * MIB, 14, true).unwrap(), "waited for the side stream");
        assert_eq!(p.stats().pending_release, 0);
        p.take_kept(b).unwrap();
        p.take_kept(c).unwrap();
        assert_eq!(p.stats().live_allocations, 0);
        assert!(sim.violations().is_empty());
    }

    #[test]
    fn release_waits_for_nothing_and_keeps_pending_chunks() {
        let (sim, p) = pool(256 * MIB);
        let side = sim.create_stream().unwrap();
        let mut a = p.allocate(4096).unwrap();
        a.record_stream(side);
        sim.use_range(a.ptr(), 4096, side, 1_000_000).unwrap();
        drop(a);
        assert_eq!(p.release().unwrap(), 0, "the chunk holds a pending block");
        sim.advance(2_000_000);
        assert_eq!(p.release().unwrap(), 2 * MIB);
    }

    #[test]
    fn dropping_the_pool_returns_everything() {
        let (sim, p) = pool(256 * MIB);
        let before = device_free(&sim);
        let side = sim.create_stream().unwrap();
        let mut a = p.allocate(7 * MIB).unwrap();
        a.record_stream(side);
        let b = p.allocate(100).unwrap();
        drop(a);
        drop(p);
        drop(b);
        assert_eq!(device_free(&sim), before);
    }

    #[test]
    fn rejects_bad_configs_and_sizes() {
        let sim = SimDevice::new(SimConfig::with_capacity(64 * MIB));
        let bad = [
            BestFitConfig { growth: MIB, ..Default::default() },
            BestFitConfig { small_chunk_size: MIB / 2, ..Default::default() },
            BestFitConfig { growth: 32 * MIB + 1, ..Default::default() },
        ];
        for config in bad {
            assert!(BestFit::new(sim.clone(), config).is_err(), "{config:?}");
        }
        let p = BestFit::new(sim, BestFitConfig::default()).unwrap();
        assert!(matches!(p.allocate(usize::MAX), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn threads_share_one_pool() {
        let (_, p) = pool(1 << 30);
        let p = Arc::new(p);
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let p = p.clone();
                std::thread::spawn(move || {
                    let mut live = Vec::new();
                    for i in 0..500usize {
                        let size = 1 + (i * 7919 + t * 104_729) % (3 * MIB);
                        live.push(p.allocate(size).unwrap());
                        if live.len() > 16 {
                            live.swap_remove((i * 31) % live.len());
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let s = p.stats();
        assert_eq!((s.allocated, s.live_allocations, s.total_allocations, s.total_frees), (0, 0, 2000, 2000));
        assert_eq!(s.cached, s.reserved);
        assert_eq!(p.release().unwrap(), s.reserved);
    }

    /// A sleep that begins while a release waits for the pool's stream waits for that release
    /// to end: it lists no memory the release took out, and gives none of it back twice. The
    /// release's wait runs a host function that lets the sleep start, then sleeps itself.
    #[test]
    fn a_sleep_begins_once_the_release_under_way_has_ended() {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let g = sim.map_granularity().unwrap();
        let s = sim.create_stream().unwrap();
        let config = BestFitConfig {
            growth: 20 * MIB,
            stream: s,
            backing: BackingKind::STITCHED,
            wait_timeout: Duration::from_secs(10),
            ..Default::default()
        };
        let pool = Arc::new(BestFit::new(sim.clone(), config).unwrap());
        let live = pool.allocate(g).unwrap();
        drop(pool.allocate(4 * g).unwrap());
        let scratch = sim.alloc(4096).unwrap();
        sim.use_range(scratch, 4096, s, 1_000).unwrap();
        let (waiting, in_wait) = std::sync::mpsc::channel();
        let wait_ends = Duration::from_millis(300);
        let host = Box::new(move || {
            waiting.send(()).unwrap();
            std::thread::sleep(wait_ends);
        });
        sim.launch_host_func(s, host).unwrap();
        let p = pool.clone();
        let sleeper = std::thread::spawn(move || {
            in_wait.recv().unwrap();
            let listed = p.sleep_begin();
            (listed, p.sleep_end(true))
        });
        let released = pool.release();
        let (listed, slept) = sleeper.join().unwrap();
        assert_eq!(released, Ok(4 * g));
        assert_eq!(listed.unwrap(), vec![(live.ptr(), g)], "only the live block's granule holds data");
        assert_eq!(slept, Ok(g));
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
        pool.wake().unwrap();
        drop(live);
    }
}
