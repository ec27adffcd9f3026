//! `Tagged`: allocations made under a [tag](crate::tags) come from a pool of the tag's own,
//! which can sleep (its memory given back to the device, its addresses kept) and wake (fresh
//! memory at the same addresses, the contents copied back where they were offloaded).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock, RwLockWriteGuard};

use super::best_fit::BestFit;
use super::pinned_host::{PinnedBuffer, PinnedHost, PinnedHostConfig};
use super::retry;
use super::stream_safe::{StreamSafe, StreamSafeConfig};
use crate::allocation::{
    Allocation, Allocator, Kept, KeptBlock, PointerEntry, Segment, Stats, StreamAllocator,
};
use crate::device::{CaptureStatus, Device, DevicePtr, EventPool, Stream};
use crate::error::{try_each, Error, Result};
use crate::tags::{self, Tag};

/// Allocations under a tag ([`tags::scope`]) from a [`StreamSafe`] pool of the tag's own over
/// stitched ranges; the others from the allocator it wraps, as if it were not there (one
/// thread-local read more).
///
/// * **Pools apart.** A tag's allocations never share a granule with another tag's or with
///   untagged ones, so that putting one tag to sleep takes no one else's memory. A tag's pool
///   is made at its first allocation (or sleep). When a tag's pool runs out of
///   memory, the others (the wrapped allocator's and the awake tags') give their free memory
///   back and the allocation is tried once more. An untagged allocation is the wrapped
///   allocator's call, its answer passed on as it is while no tag holds memory; after, one
///   that runs out of memory has the awake tags give their free memory back and is tried once
///   more.
/// * **Sleep** ([`Tagged::sleep`]) is stream-ordered, with no device-wide synchronization: an
///   internal stream waits on events recorded on the streams that use the tags' memory (the
///   owning stream of each of their pools, the streams recorded on allocations kept by
///   pointer above, and the events of frees pending on recorded streams); with `offload`, it then
///   copies the memory that holds data to page-locked host memory (a [`PinnedHost`] pool of
///   its own); the host waits for that stream alone, at most the pools' `wait_timeout`. Then
///   the tags' free memory goes back as a release would, and the rest is unmapped, its
///   addresses kept ([`Backing::sleep_begin`](super::Backing::sleep_begin)). Other tags and
///   untagged allocations go on meanwhile. A stream recorded on a handle
///   ([`Allocation::record_stream`]) is known only at its free: free such handles, or wait for
///   those streams, before a sleep. Work enqueued on a tag's memory after its sleep began is
///   the caller's error.
/// * **Wake** ([`Tagged::wake`]) maps fresh memory at the same addresses (all the tags' or
///   none: on out-of-memory the others give their free memory back and it is tried once
///   more), then, where the sleep offloaded, copies the contents back on the internal stream
///   and returns once the copies have completed (the host waits, bounded), so work enqueued
///   on any stream afterwards sees them. Without offload, the memory's contents are undefined.
/// * **Defined answers.** Sleeping a sleeping tag, or waking an awake one, does nothing (0
///   bytes). Allocating in a sleeping tag is an [`Error::InvalidArgument`] naming the tag.
///   Freeing a sleeping tag's allocation is allowed: the block goes back to the pool's books,
///   its memory already given back (a wake maps it again with the rest). A release
///   (`empty_cache`) leaves sleeping tags alone (they hold no memory). A sleep or wake that
///   fails leaves each tag as it was (but an unmap failing at the end of a sleep, which leaves
///   the tag asleep with what it could give back, and reports the error).
/// * **Statistics** ([`Allocator::stats`]) add the tags' pools to the wrapped allocator's: a
///   sleeping tag counts its live allocations but no `reserved` or `cached` bytes;
///   [`Tagged::tag_stats`] has each tag's, with the bytes slept.
pub struct Tagged<A> {
    main: A,
    device: Arc<dyn Device>,
    /// The settings of each tag's pool.
    config: StreamSafeConfig,
    /// The tags' pools, in the order made.
    tags: RwLock<Vec<Arc<TagPool>>>,
    /// `tags.len()`, read without the lock by the frees the wrapped allocator did not make
    /// and by untagged allocations.
    count: AtomicUsize,
    /// Serializes sleeps and wakes; holds the internal stream they order their work on.
    moving: Mutex<Option<Stream>>,
    events: EventPool,
    /// Page-locked host memory for offloaded contents, kept across releases (see DESIGN.md,
    /// Note [offload buffers stay pinned]).
    pinned: PinnedHost,
    /// Allocations that failed in a pool and succeeded once the others gave memory back: the
    /// pool counted a failure, which [`Allocator::stats`] counts as a retry instead.
    recovered: AtomicU64,
    /// Allocations that failed in a pool again after the others gave memory back: the pool
    /// counted two failures, which [`Allocator::stats`] counts as one.
    repeated: AtomicU64,
}

/// A tag's pool.
struct TagPool {
    tag: Tag,
    alloc: StreamSafe,
    /// Read by allocations (and calls that reach the pool's books other than frees), written
    /// by sleeps and wakes.
    phase: RwLock<Phase>,
}

enum Phase {
    Awake,
    Asleep(Slumber),
    /// Dropped ([`Tagged::drop_tag`]): out of the list; a caller that found it before takes
    /// the tag's next pool.
    Dropped,
}

/// What a sleeping tag gave back.
struct Slumber {
    /// Each pool put to sleep (kept, so that a wake finds it whatever its allocator did with
    /// it meanwhile), with the copies of its contents when offloaded.
    pools: Vec<(BestFit, Vec<Piece>)>,
    /// Bytes given back at their addresses.
    bytes: usize,
    offloaded: bool,
}

/// Offloaded contents: the device range at `addr`, of the buffer's size.
struct Piece {
    addr: DevicePtr,
    buffer: PinnedBuffer,
}

/// One tag's figures ([`Tagged::tag_stats`]); the C ABI's `streamalloc_tag_stats_t` too.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TagStats {
    /// Whether the tag sleeps.
    pub asleep: bool,
    /// Whether its contents were offloaded (they come back at the wake).
    pub offloaded: bool,
    /// Bytes given back to the device at their addresses while it sleeps (0 awake).
    pub slept: usize,
    /// Its pool's figures: while it sleeps, `reserved` is what could not be given back (0
    /// normally) and `cached` 0.
    pub stats: Stats,
}

/// A pool put to sleep by one call: the index of its tag among the call's, the pool, and the
/// ranges that hold its data.
type Falling = (usize, BestFit, Vec<(DevicePtr, usize)>);

impl<A: StreamAllocator> Tagged<A> {
    /// Tags over `main` on `device`; each tag's pool is a [`StreamSafe`] with `config`, whose
    /// backing must give memory back at its addresses
    /// ([`BackingSpec::sleeps`](super::backing::BackingSpec::sleeps): stitched ranges;
    /// [`Error::Unsupported`] otherwise). Makes no device call.
    pub fn new(main: A, device: Arc<dyn Device>, config: StreamSafeConfig) -> Result<Self> {
        if !config.pool.backing.spec().sleeps {
            return Err(Error::Unsupported(format!(
                "tags sleep over a backing that gives memory back at its addresses (stitched), not {}",
                config.pool.backing.name()
            )));
        }
        // Validates the settings once, up front.
        StreamSafe::new(device.clone(), config)?;
        let pinned = PinnedHost::new(
            device.clone(),
            PinnedHostConfig { wait_timeout: config.pool.wait_timeout, ..Default::default() },
        )?;
        Ok(Self {
            main,
            events: EventPool::new(device.clone()),
            device,
            config,
            tags: RwLock::new(Vec::new()),
            count: AtomicUsize::new(0),
            moving: Mutex::new(None),
            pinned,
            recovered: AtomicU64::new(0),
            repeated: AtomicU64::new(0),
        })
    }

    /// The allocator that serves untagged allocations.
    pub fn main(&self) -> &A {
        &self.main
    }

    /// The pool of `tag`, made if it has none.
    fn pool(&self, tag: Tag) -> Result<Arc<TagPool>> {
        if let Some(p) = self.tags.read().iter().find(|p| p.tag == tag) {
            return Ok(p.clone());
        }
        let mut tags = self.tags.write();
        if let Some(p) = tags.iter().find(|p| p.tag == tag) {
            return Ok(p.clone());
        }
        let alloc = StreamSafe::new(self.device.clone(), self.config)?;
        let pool = Arc::new(TagPool { tag, alloc, phase: RwLock::new(Phase::Awake) });
        tags.push(pool.clone());
        self.count.store(tags.len(), Ordering::Release);
        Ok(pool)
    }

    /// The tags' pools.
    fn snapshot(&self) -> Vec<Arc<TagPool>> {
        if self.count.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        self.tags.read().clone()
    }

    /// Allocates from `tag`'s pool unless the tag sleeps; on out-of-memory, the others give
    /// their free memory back and it is tried once more. Kept out of line: the untagged path
    /// stays as small as the wrapped allocator's call.
    #[inline(never)]
    fn allocate_in_tag(&self, tag: Tag, size: usize, stream: Stream) -> Result<Allocation> {
        let attempt = || loop {
            let pool = self.pool(tag)?;
            let phase = pool.phase.read();
            return match &*phase {
                Phase::Awake => pool.alloc.allocate_on(size, stream),
                Phase::Asleep(_) => Err(Error::InvalidArgument(format!(
                    "allocation of {size} bytes in tag `{tag}` on device {}, which sleeps: wake it first",
                    self.device.ordinal()
                ))),
                // Dropped since it was looked up: the tag's next pool.
                Phase::Dropped => continue,
            };
        };
        self.recover(attempt, &[tag], true)
    }

    /// Runs `attempt`; on out-of-memory, gives back the free memory of the wrapped allocator
    /// (with `main`) and of the awake tags not in `except`, and runs it once more.
    fn recover<T>(&self, attempt: impl FnMut() -> Result<T>, except: &[Tag], main: bool) -> Result<T> {
        let release = || self.release_others(except, main).map(|_| None);
        let retried = retry::on_out_of_memory(Duration::ZERO, attempt, release, |_| ());
        if retried.retried() {
            self.recovered.fetch_add(1, Ordering::Relaxed);
        } else if retried.result.is_err() && retried.failed > 1 {
            self.repeated.fetch_add(retried.failed - 1, Ordering::Relaxed);
        }
        retried.result
    }

    /// An untagged allocation that ran out of memory, after the wrapped allocator
    /// gave back its own free memory: the awake tags give back theirs, and it is tried once
    /// more, as [`Tagged::recover`] does (kept off the untagged path, which looks at the
    /// answer's kind only once a tag has a pool).
    #[cold]
    fn untagged_again(&self, size: usize, stream: Stream) -> Result<Allocation> {
        // A release that failed gave back what it could: the retry says whether that was
        // enough (its out-of-memory error, with the figures after the release, if not).
        let _ = self.release_others(&[], false);
        let made = self.main.allocate_on(size, stream);
        let counter = if made.is_ok() { &self.recovered } else { &self.repeated };
        counter.fetch_add(1, Ordering::Relaxed);
        made
    }

    /// Gives back the free memory of the wrapped allocator (with `main`) and of the awake tags
    /// not in `except` (a tag busy with a sleep or wake is passed over); the bytes.
    fn release_others(&self, except: &[Tag], main: bool) -> Result<usize> {
        let mut total = 0;
        let main = if main { self.main.release().map(|n| total += n) } else { Ok(()) };
        let tags = try_each(self.snapshot().iter().filter(|p| !except.contains(&p.tag)), |pool| {
            // Released under the read lock of its phase: no sleep or wake begins meanwhile.
            if let Some(phase) = pool.phase.try_read() {
                if matches!(*phase, Phase::Awake) {
                    total += pool.alloc.release()?;
                }
            }
            Ok(())
        });
        main.and(tags).map(|()| total)
    }

    /// Forgets `tag` (issue 52, #7): its pool leaves, its memory (cached blocks, stitched
    /// ranges) goes back to the device and its address reservations are freed, so that a
    /// dropped tag costs nothing; a later allocation under the same name starts a new pool.
    /// The bytes its pool had reserved. A tag that sleeps is dropped too (its offloaded
    /// contents go back to the pinned pool); a tag that has allocated nothing here is 0.
    /// Refused with [`Error::InvalidArgument`], nothing changed, while it has live
    /// allocations (free them first); the frees it waits on for recorded streams are waited
    /// for (bounded by the pools' `wait_timeout`, [`Error::Timeout`] past it, nothing changed).
    pub fn drop_tag(&self, tag: Tag) -> Result<usize> {
        let mut moving = self.moving.lock();
        let Some(pool) = self.snapshot().into_iter().find(|p| p.tag == tag) else { return Ok(0) };
        let mut phase = pool.phase.write();
        let stats = pool.alloc.stats();
        if stats.live_allocations > 0 {
            return Err(Error::InvalidArgument(format!(
                "drop of tag `{tag}` on device {}: {} allocations ({} bytes) of it are live; free them first",
                self.device.ordinal(),
                stats.live_allocations,
                stats.allocated
            )));
        }
        if matches!(*phase, Phase::Awake) {
            // Every block free before the pool goes: the frees pending on recorded streams are
            // waited for (bounded), then the pool's free memory goes back, as a release.
            let pending = stats.pending_release;
            if pending > 0 {
                let stream = self.stream(&mut moving)?;
                for (_, held) in pool.alloc.pools_held() {
                    held.order_after_pending(stream)?;
                }
                self.wait(stream, || {
                    format!(
                        "the streams recorded on {pending} bytes freed in tag `{tag}`, before dropping it; it \
                         was not dropped"
                    )
                })?;
            }
            pool.alloc.release()?;
        }
        let mut tags = self.tags.write();
        tags.retain(|p| !Arc::ptr_eq(p, &pool));
        self.count.store(tags.len(), Ordering::Release);
        drop(tags);
        // The slumber's pools and pinned buffers go with it; the pool's memory and
        // reservations once the last handle on it drops (here, or as a lookup that found it
        // before moves on).
        *phase = Phase::Dropped;
        Ok(stats.reserved)
    }

    /// The figures of `tag` (zeros for a tag that has allocated nothing here).
    pub fn tag_stats(&self, tag: Tag) -> TagStats {
        let pool = self.snapshot().into_iter().find(|p| p.tag == tag);
        pool.map_or_else(TagStats::default, |p| p.stats())
    }

    /// The pools of `tags`, made where missing, each once, in the order of their tags (the
    /// order their phases are locked in).
    fn pools_of(&self, tags: &[Tag]) -> Result<Vec<Arc<TagPool>>> {
        let mut tags = tags.to_vec();
        tags.sort_unstable();
        tags.dedup();
        tags.into_iter().map(|t| self.pool(t)).collect()
    }

    /// The internal stream, made at the first sleep.
    fn stream(&self, held: &mut Option<Stream>) -> Result<Stream> {
        match *held {
            Some(s) => Ok(s),
            None => Ok(*held.insert(self.device.create_stream()?)),
        }
    }

    /// Makes `waiter` wait for the work enqueued so far on `stream`, which uses `tag`'s memory.
    /// A capturing stream is refused: its work does not run now, and recording on it would
    /// join `waiter` to its capture.
    fn order_after(&self, stream: Stream, waiter: Stream, tag: Tag) -> Result<()> {
        if self.device.capture_status(stream)? != CaptureStatus::None {
            return Err(Error::Unsupported(format!(
                "sleep of tag `{tag}`: stream {:#x}, which uses its memory, is capturing a graph; sleep \
                 after the capture ends",
                stream.raw()
            )));
        }
        self.events.order_after(waiter, stream)
    }

    /// Waits, at most the pools' `wait_timeout`, for the work enqueued so far on `stream`;
    /// on a timeout, an [`Error::Timeout`] saying it waited for `what`.
    fn wait(&self, stream: Stream, what: impl FnOnce() -> String) -> Result<()> {
        let timeout = self.config.pool.wait_timeout;
        let event = self.events.get()?;
        let done =
            self.device.record_event(event, stream).and_then(|()| self.device.wait_event(event, timeout));
        self.events.put(event);
        match done? {
            true => Ok(()),
            false => Err(Error::Timeout { waited_for: what(), after: timeout }),
        }
    }

    /// The figures of the page-locked host memory kept for offloads (`reserved`: the bytes
    /// pinned; `allocated`: those holding a sleeping tag's contents).
    pub fn offload_stats(&self) -> Stats {
        self.pinned.stats()
    }

    /// Restarts the peaks of [`Tagged::offload_stats`] from the current figures.
    pub fn reset_offload_peak_stats(&self) {
        self.pinned.reset_peak_stats();
    }

    /// Gives back the page-locked host memory kept for offloads that no sleeping tag holds;
    /// the bytes. [`Allocator::release`] leaves it, so that the next sleep pins nothing.
    pub fn release_offload_memory(&self) -> Result<usize> {
        self.pinned.release()
    }

    /// Puts `tags` to sleep (see [`Tagged`]): their memory goes back to the device, their
    /// addresses stay reserved, and with `offload` their contents are kept in page-locked host
    /// memory until [`Tagged::wake`]. The bytes given back at their addresses. A tag asleep
    /// already is left as it is. `recorded`: the streams recorded on allocations kept above
    /// this layer ([`Pointers::recorded_streams`](crate::adaptors::Pointers::recorded_streams)),
    /// whose work the sleep waits for too.
    pub fn sleep(&self, tags: &[Tag], offload: bool, recorded: &[Stream]) -> Result<usize> {
        let mut moving = self.moving.lock();
        let pools = self.pools_of(tags)?;
        let mut phases: Vec<RwLockWriteGuard<'_, Phase>> = pools.iter().map(|p| p.phase.write()).collect();
        let falling: Vec<usize> = (0..pools.len()).filter(|&i| matches!(*phases[i], Phase::Awake)).collect();
        if falling.is_empty() {
            return Ok(0);
        }
        let stream = self.stream(&mut moving)?;
        // The internal stream waits for every use of the tags' memory.
        let mut users: Vec<Stream> = Vec::new();
        let mut held = Vec::new();
        for &i in &falling {
            let (tag, alloc) = (pools[i].tag, &pools[i].alloc);
            for (owner, pool) in alloc.pools_held() {
                if let Some(owner) = owner {
                    self.order_after(owner, stream, tag)?;
                    users.push(owner);
                }
                pool.order_after_pending(stream)?;
                held.push((i, pool));
            }
        }
        for &s in recorded {
            let tag = pools[falling[0]].tag;
            self.order_after(s, stream, tag).map_err(|e| match e {
                // Issue 52, #12: say which stream and why.
                Error::InvalidArgument(m) => Error::InvalidArgument(format!(
                    "sleep of tag(s) {}: stream {:#x}, recorded (record_stream) on an allocation still live, \
                     cannot be waited for ({m}); a stream destroyed without retire_stream stays recorded: \
                     retire streams before destroying them, or free the allocations that recorded them; \
                     nothing was put to sleep",
                    names(falling.iter().map(|&i| pools[i].tag)),
                    s.raw()
                )),
                e => e,
            })?;
            users.push(s);
        }
        users.sort_unstable();
        users.dedup();
        // The books: free memory taken out, the ranges with data listed.
        let mut begun: Vec<Falling> = Vec::new();
        for (i, pool) in held {
            match pool.sleep_begin() {
                Ok(ranges) => begun.push((i, pool, ranges)),
                Err(e) => return Err(Self::fall_back(&begun, e)),
            }
        }
        // Memory another process may map (issue 52 #3): the sleep would give it back here
        // while that process keeps the old memory, and the wake would map fresh memory.
        if let Err(e) = self.refuse_exported(&begun) {
            return Err(Self::fall_back(&begun, e));
        }
        let mut pieces: Vec<Vec<Piece>> = Vec::new();
        if offload {
            for (_, _, ranges) in &begun {
                match self.copy_out(ranges, stream) {
                    Ok(p) => pieces.push(p),
                    Err(e) => return Err(Self::fall_back(&begun, e)),
                }
            }
        }
        let waited = self.wait(stream, || {
            let bytes: usize = begun.iter().flat_map(|(_, _, r)| r).map(|&(_, len)| len).sum();
            let copies = if offload { format!(", and the copies of {bytes} bytes to host memory") } else { String::new() };
            format!(
                "the work enqueued on the streams that use the memory of tag(s) {} ({}){copies}, before putting \
                 them to sleep; nothing was put to sleep",
                names(falling.iter().map(|&i| pools[i].tag)),
                users.iter().map(|s| format!("{:#x}", s.raw())).collect::<Vec<_>>().join(", ")
            )
        });
        if let Err(e) = waited {
            // The copies may still run: their buffers go back once the stream is done.
            return Err(Self::fall_back(&begun, e));
        }
        let mut total = 0;
        let mut first_error = None;
        let mut slumbers: Vec<Slumber> =
            falling.iter().map(|_| Slumber { pools: Vec::new(), bytes: 0, offloaded: offload }).collect();
        let mut pieces = pieces.into_iter();
        for (i, pool, _) in begun {
            let slumber = &mut slumbers[falling.iter().position(|&f| f == i).unwrap_or(0)];
            match pool.sleep_end(true) {
                Ok(bytes) => slumber.bytes += bytes,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
            slumber.pools.push((pool, pieces.next().unwrap_or_default()));
        }
        for (&i, slumber) in falling.iter().zip(slumbers) {
            total += slumber.bytes;
            *phases[i] = Phase::Asleep(slumber);
        }
        first_error.map_or(Ok(total), Err)
    }

    /// Refuses the sleep of `begun` when a range with data of theirs is exported
    /// ([`Ipc::exports_any`](crate::device::Ipc::exports_any)): see DESIGN.md, Note [IPC trust model].
    fn refuse_exported(&self, begun: &[Falling]) -> Result<()> {
        let granule = self.device.map_granularity()? as u64;
        for (_, _, ranges) in begun {
            for &(addr, len) in ranges {
                let start = addr - addr % granule;
                let end = (addr + len as u64).next_multiple_of(granule);
                if self.device.exports_any(start, (end - start) as usize)? {
                    return Err(Error::InvalidArgument(format!(
                        "a tag's memory at {addr:#x}+{len} on device {} is shared with another process \
                         (streamalloc_ipc_export): sleeping it would leave that process on memory the wake \
                         does not bring back; free the shared allocations and release, then sleep",
                        self.device.ordinal()
                    )));
                }
            }
        }
        Ok(())
    }

    /// Ends the sleeps `begun` without committing them (each pool awake as it was); `error`.
    fn fall_back(begun: &[Falling], error: Error) -> Error {
        for (_, pool, _) in begun {
            let _ = pool.sleep_end(false);
        }
        error
    }

    /// Copies `ranges` to page-locked host memory on `stream`, in pieces of powers of two (the
    /// pinned pool's blocks, so none is larger than its range).
    fn copy_out(&self, ranges: &[(DevicePtr, usize)], stream: Stream) -> Result<Vec<Piece>> {
        let mut pieces = Vec::new();
        for &(addr, len) in ranges {
            let mut at = 0;
            while at < len {
                let n = 1 << (len - at).ilog2();
                let mut buffer = self.pinned.allocate(n)?;
                // Reused only once the stream's copies from and to it are done.
                buffer.record_stream(&self.device, stream)?;
                self.device.copy_to_pinned(buffer.ptr(), addr + at as u64, n, stream)?;
                pieces.push(Piece { addr: addr + at as u64, buffer });
                at += n;
            }
        }
        Ok(pieces)
    }

    /// Wakes `tags` (see [`Tagged`]): fresh memory at the addresses they slept, and, where
    /// they were offloaded, their contents copied back before this returns. The bytes mapped
    /// again. An awake tag is left as it is.
    pub fn wake(&self, tags: &[Tag]) -> Result<usize> {
        let mut moving = self.moving.lock();
        let pools = self.pools_of(tags)?;
        let mut phases: Vec<RwLockWriteGuard<'_, Phase>> = pools.iter().map(|p| p.phase.write()).collect();
        let rising: Vec<usize> =
            (0..pools.len()).filter(|&i| matches!(*phases[i], Phase::Asleep(_))).collect();
        if rising.is_empty() {
            return Ok(0);
        }
        let woken: Vec<Tag> = rising.iter().map(|&i| pools[i].tag).collect();
        let mut slumbers: Vec<Slumber> = Vec::new();
        for &i in &rising {
            if let Phase::Asleep(slumber) = std::mem::replace(&mut *phases[i], Phase::Awake) {
                slumbers.push(slumber);
            }
        }
        // Every pool maps again, or none does: the ranges mapped, per pool of each slumber.
        let mut mapped: Vec<Vec<Vec<(DevicePtr, usize)>>> = Vec::new();
        let mut failed = None;
        'map: for slumber in &slumbers {
            let mut ranges = Vec::new();
            for (pool, _) in &slumber.pools {
                match self.recover(|| pool.wake(), &woken, true) {
                    Ok(r) => ranges.push(r),
                    Err(e) => {
                        failed = Some(e);
                        mapped.push(ranges);
                        break 'map;
                    }
                }
            }
            mapped.push(ranges);
        }
        if let Some(e) = failed {
            // Nothing used what was mapped: back to sleep at once, and the tags sleep on.
            for (slumber, ranges) in slumbers.iter().zip(&mapped) {
                for (pool, _) in &slumber.pools[..ranges.len()] {
                    let _ = pool.sleep_begin().and_then(|_| pool.sleep_end(true));
                }
            }
            for (&i, slumber) in rising.iter().zip(slumbers) {
                *phases[i] = Phase::Asleep(slumber);
            }
            return Err(e);
        }
        let bytes: usize = mapped.iter().flatten().flatten().map(|&(_, len)| len).sum();
        let mut copies = Vec::new();
        for (slumber, ranges) in slumbers.iter().zip(&mapped) {
            for ((_, pieces), ranges) in slumber.pools.iter().zip(ranges) {
                copies.extend(pieces.iter().flat_map(|p| clip(p, ranges)));
            }
        }
        if copies.is_empty() {
            return Ok(bytes);
        }
        let stream = self.stream(&mut moving)?;
        for &(dst, src, len) in &copies {
            self.device.copy_from_pinned(dst, src, len, stream)?;
        }
        let copied: usize = copies.iter().map(|&(_, _, len)| len).sum();
        // The buffers go back to the pinned pool as the slumbers drop, reused once the copies
        // are done (they recorded the stream).
        self.wait(stream, || {
            format!(
                "the copies of {copied} bytes from host memory back into tag(s) {}; they are awake, their \
                 contents complete once the copies are",
                names(woken.iter().copied())
            )
        })?;
        Ok(bytes)
    }
}

/// The parts of `piece` that lie in `ranges`, as copies `(device address, host address,
/// bytes)`.
fn clip(piece: &Piece, ranges: &[(DevicePtr, usize)]) -> Vec<(DevicePtr, u64, usize)> {
    let (start, end) = (piece.addr, piece.addr + piece.buffer.size() as u64);
    ranges
        .iter()
        .filter_map(|&(a, len)| {
            let (from, to) = (start.max(a), end.min(a + len as u64));
            (from < to).then(|| (from, piece.buffer.ptr() + (from - start), (to - from) as usize))
        })
        .collect()
}

/// `tags` as an error lists them: `a`, `b`.
fn names(tags: impl Iterator<Item = Tag>) -> String {
    tags.map(|t| format!("`{t}`")).collect::<Vec<_>>().join(", ")
}

impl TagPool {
    fn stats(&self) -> TagStats {
        let mut stats = self.alloc.stats();
        match &*self.phase.read() {
            Phase::Awake => TagStats { stats, ..TagStats::default() },
            Phase::Dropped => TagStats::default(),
            Phase::Asleep(s) => {
                stats.reserved = stats.reserved.saturating_sub(s.bytes);
                stats.cached = 0;
                stats.largest_free_block = 0;
                TagStats { asleep: true, offloaded: s.offloaded, slept: s.bytes, stats }
            }
        }
    }
}

impl<A: StreamAllocator> Allocator for Tagged<A> {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        self.allocate_on(size, self.main.default_stream())
    }

    /// The wrapped allocator's release, then each awake tag's. The page-locked memory kept for
    /// offloads stays, cached for the next sleep ([`Tagged::release_offload_memory`] gives it
    /// back): phases that alternate release device memory between them, and a sleep that
    /// pinned its buffers afresh each time would run at the speed of pinning, not of copies.
    fn release(&self) -> Result<usize> {
        self.release_others(&[], true)
    }

    /// The wrapped allocator's figures and every tag's ([`TagStats::stats`]).
    fn stats(&self) -> Stats {
        let mut stats: Stats =
            std::iter::once(self.main.stats()).chain(self.snapshot().iter().map(|p| p.stats().stats)).sum();
        let recovered = self.recovered.load(Ordering::Relaxed);
        stats.failures = stats.failures.saturating_sub(recovered + self.repeated.load(Ordering::Relaxed));
        stats.retries += recovered;
        stats
    }

    fn reset_peak_stats(&self) {
        self.main.reset_peak_stats();
        for p in self.snapshot() {
            p.alloc.reset_peak_stats();
        }
    }

    fn device(&self) -> usize {
        self.main.device()
    }

    /// The wrapped allocator's and every tag's pool's (a sleeping tag's: what it still holds).
    fn segments(&self, out: &mut Vec<Segment>) -> Result<()> {
        self.main.segments(out)?;
        try_each(self.snapshot(), |p| {
            let _phase = p.phase.read();
            p.alloc.segments(out)
        })
    }
}

impl<A: StreamAllocator> StreamAllocator for Tagged<A> {
    fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation> {
        if let Some(tag) = tags::current() {
            return self.allocate_in_tag(tag, size, stream);
        }
        if self.count.load(Ordering::Relaxed) == 0 {
            // No tag holds memory: the strategy's answer, passed on as it is.
            return self.main.allocate_on(size, stream);
        }
        let made = self.main.allocate_on(size, stream);
        if matches!(&made, Err(e) if e.is_out_of_memory()) {
            return self.untagged_again(size, stream);
        }
        made
    }

    fn default_stream(&self) -> Stream {
        self.main.default_stream()
    }

    fn set_default_stream(&self, stream: Stream) {
        self.main.set_default_stream(stream);
    }

    /// The wrapped allocator and every tag's pool forget `stream`; the first error.
    fn retire_stream(&self, stream: Stream) -> Result<()> {
        let main = self.main.retire_stream(stream);
        let tags = try_each(self.snapshot(), |p| {
            let _phase = p.phase.read();
            p.alloc.retire_stream(stream)
        });
        main.and(tags)
    }

    /// Under a tag, the tag pool's handle; otherwise the wrapped allocator's (which keeps it
    /// where it can), as [`StreamAllocator::allocate_on`] does.
    fn allocate_kept(&self, size: usize, stream: Stream, word: u64) -> Result<Kept> {
        if let Some(tag) = tags::current() {
            return self.allocate_in_tag(tag, size, stream).map(Kept::Handle);
        }
        if self.count.load(Ordering::Relaxed) == 0 {
            return self.main.allocate_kept(size, stream, word);
        }
        let made = self.main.allocate_kept(size, stream, word);
        if matches!(&made, Err(e) if e.is_out_of_memory()) {
            return self.untagged_again(size, stream).map(Kept::Handle);
        }
        made
    }

    /// The wrapped allocator's (the tags' pools keep handles).
    fn take_kept(&self, ptr: DevicePtr, hint: Option<Stream>) -> Option<PointerEntry> {
        self.main.take_kept(ptr, hint)
    }

    fn with_kept(&self, ptr: DevicePtr, hint: Option<Stream>, f: &mut dyn FnMut(&mut KeptBlock)) -> bool {
        self.main.with_kept(ptr, hint, f)
    }

    fn each_kept(&self, f: &mut dyn FnMut(DevicePtr, &mut KeptBlock)) {
        self.main.each_kept(f)
    }
}

impl<A> Drop for Tagged<A> {
    fn drop(&mut self) {
        if let Some(stream) = self.moving.get_mut().take() {
            // Work enqueued on it still completes; the pinned buffers wait for it as they go.
            let _ = self.device.destroy_stream(stream);
        }
    }
}
