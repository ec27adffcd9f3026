//! Private pools: memory a CUDA graph (or a framework's memory pool) allocates lives apart
//! from the device's main stack, as PyTorch's graph-private pools do.
//!
//! A framework says when allocations go to a pool ([`PrivatePools::begin`], with a filter that
//! picks the allocations by their stream: PyTorch passes one that matches the streams of one
//! capture, or the calling thread for `torch.cuda.use_mem_pool`), when they stop going there
//! ([`PrivatePools::end`]) and when it no longer needs the pool ([`PrivatePools::release`]).
//!
//! * **Routing.** While any pool is active on a device, each allocation asks the active
//!   filters, newest first; the first that matches takes it. With none active, the cost is
//!   one relaxed atomic load.
//! * **Pools.** Each pool id has a [`StreamSafe`] of its own over plain device chunks, so its
//!   memory is never handed to work outside the pool: a graph replays over the same addresses
//!   while eager work runs beside it. Graphs given one pool id share it (the caller promises
//!   their order, as with PyTorch's `pool=` argument), and blocks freed by one capture serve
//!   the next. Frees of a pool's allocations, during or after the capture, return there.
//! * **Captures.** Inside a capture nothing queries an event, trims or synchronizes: the
//!   pool's [`StreamSafe`] polls no event while its stream captures, and a pool grows with
//!   `cuMemAlloc` in the relaxed capture mode (see [`crate::device::cuda`]), as PyTorch's
//!   allocator grows its pools.
//! * **Driver graph memory.** With `driver_captures` (the `async` strategy), an allocation
//!   that a filter routes but that is made on a capturing stream goes to the main stack
//!   instead, where `cuMemAllocFromPoolAsync` becomes a graph memory node: the driver keeps
//!   that memory for the graph and shares it between graphs. A free on a capturing stream of
//!   main-stack memory that was not allocated in a capture (a warm-up's output reassigned
//!   inside the capture) would become a free node that frees the memory at every launch: it
//!   is deferred until no pool is active ([`PrivatePools::defer_free`]), as PyTorch's
//!   cudaMallocAsync backend defers such frees until no capture is under way.
//! * **Release.** A pool is used once per [`PrivatePools::begin`] and once less per
//!   [`PrivatePools::release`]; when no use is left its free memory goes back to the device,
//!   and the rest as its last allocations are freed, but never while a pool is active
//!   (freeing device memory during a capture would end it).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::adaptors::{PointerEntry, Pointers};
use crate::allocation::{Segment, Stats, StreamAllocator};
use crate::allocators::{BackingKind, BestFitConfig, StreamSafe, StreamSafeConfig};
use crate::device::{CaptureStatus, Device, DevicePtr, Stream};
use crate::error::{try_each, Error, Result};
use crate::Allocator;

/// A pool's id, as PyTorch's `MempoolId_t`: a pair of integers.
pub type PoolId = (u64, u64);

/// Which allocations go to an active pool, by the stream each is made on.
pub type StreamFilter = Arc<dyn Fn(Stream) -> bool + Send + Sync>;

/// Where [`PrivatePools::allocate`] sent an allocation.
#[derive(Debug)]
pub enum Routed {
    /// A private pool allocated it, here.
    Pool(DevicePtr),
    /// The main stack is to allocate it; `graphed`: on a capturing stream while a pool is
    /// active, under `driver_captures`, so the caller passes the pointer to
    /// [`PrivatePools::note_graphed`] (graph memory, whose free in the capture is not deferred).
    Main {
        /// Whether the allocation is graph memory.
        graphed: bool,
    },
}

/// The private pools of one device; see the [module docs](self).
pub struct PrivatePools {
    device: Arc<dyn Device>,
    /// Growth settings of each pool's chunks.
    pool: BestFitConfig,
    /// Whether allocations on capturing streams stay on the main stack (the driver's pool).
    driver_captures: bool,
    /// Active filters; allocations look at the pools only when this is not 0.
    active: AtomicUsize,
    /// Pools that exist (in use, or with allocations left); frees look at the pools only when
    /// this is not 0.
    pools: AtomicUsize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Active (pool, filter) pairs, oldest first.
    active: Vec<(PoolId, StreamFilter)>,
    pools: HashMap<PoolId, Entry>,
    /// With `driver_captures`: main-stack memory allocated on a capturing stream while a pool
    /// was active (graph memory), until it is freed or no pool is active.
    graphed: HashSet<DevicePtr>,
    /// With `driver_captures`: frees deferred until no pool is active, as `(ptr, owner)`.
    deferred: Vec<(DevicePtr, Stream)>,
}

struct Entry {
    alloc: Arc<Pointers<StreamSafe>>,
    /// `begin` calls not yet matched by `release`.
    uses: usize,
}

impl Entry {
    fn is_dead(&self) -> bool {
        self.uses == 0 && self.alloc.stats().live_allocations == 0
    }
}

impl PrivatePools {
    /// No pools yet, on `device`; pools grow by `pool`'s chunk sizes (never by expandable
    /// segments: a capture should not map memory). `driver_captures` leaves allocations on
    /// capturing streams to the main stack.
    pub fn new(device: Arc<dyn Device>, pool: BestFitConfig, driver_captures: bool) -> Self {
        Self {
            device,
            pool: BestFitConfig { backing: BackingKind::CHUNKS, ..pool },
            driver_captures,
            active: AtomicUsize::new(0),
            pools: AtomicUsize::new(0),
            state: Mutex::new(State::default()),
        }
    }

    /// From now on, allocations that `filter` matches go to pool `id` (made now if it does
    /// not exist), until [`PrivatePools::end`]; the pool gains a use.
    pub fn begin(&self, id: PoolId, filter: StreamFilter) -> Result<()> {
        let mut st = self.state.lock();
        let entry = match st.pools.entry(id) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let config =
                    StreamSafeConfig { pool: self.pool, steal_below_free_percent: 0, ..Default::default() };
                let alloc = StreamSafe::new(self.device.clone(), config)?;
                let alloc = Arc::new(Pointers::new(alloc, self.device.clone(), self.pool.wait_timeout));
                self.pools.fetch_add(1, Ordering::Relaxed);
                v.insert(Entry { alloc, uses: 0 })
            }
        };
        entry.uses += 1;
        st.active.push((id, filter));
        self.active.store(st.active.len(), Ordering::Release);
        Ok(())
    }

    /// Allocations stop going to pool `id` (its newest filter is dropped). Pools released
    /// while this or another pool was active are freed now if none is active any more.
    /// Returns the frees [`PrivatePools::defer_free`] deferred, as `(ptr, owner)`, once no pool
    /// is active: the caller frees them on the main stack now.
    pub fn end(&self, id: PoolId) -> Vec<(DevicePtr, Stream)> {
        let (filter, dead, deferred) = {
            let mut st = self.state.lock();
            let filter = st.active.iter().rposition(|(p, _)| *p == id).map(|i| st.active.remove(i));
            self.active.store(st.active.len(), Ordering::Release);
            let mut deferred = Vec::new();
            if st.active.is_empty() {
                st.graphed.clear();
                deferred = std::mem::take(&mut st.deferred);
            }
            (filter, self.take_dead(&mut st), deferred)
        };
        // Dropped unlocked: a framework's filter is foreign code.
        drop((filter, dead));
        deferred
    }

    /// Notes main-stack memory `ptr` as graph memory (made in a capture while a pool was
    /// active), as [`Routed::Main`] asked, if a pool is still active.
    pub fn note_graphed(&self, ptr: DevicePtr) {
        let mut st = self.state.lock();
        if !st.active.is_empty() {
            st.graphed.insert(ptr);
        }
    }

    /// With `driver_captures`, whether the free of main-stack memory `ptr` on `owner` waits
    /// for the end of the captures (it is then returned by [`PrivatePools::end`]): while a
    /// pool is active, `owner` captures and `ptr` was not allocated in a capture
    /// ([`PrivatePools::note_graphed`]). Such a free, captured, would free memory from
    /// outside the graph at every launch.
    pub fn defer_free(&self, ptr: DevicePtr, owner: Stream) -> Result<bool> {
        if !self.driver_captures || !self.is_active() {
            return Ok(false);
        }
        if self.device.capture_status(owner)? == CaptureStatus::None {
            return Ok(false);
        }
        let mut st = self.state.lock();
        if st.active.is_empty() || st.graphed.remove(&ptr) {
            return Ok(false);
        }
        st.deferred.push((ptr, owner));
        Ok(true)
    }

    /// Pool `id` loses a use; with none left its memory returns to the device once its
    /// allocations are freed and no pool is active. Unknown ids are ignored.
    pub fn release(&self, id: PoolId) {
        let dead = {
            let mut st = self.state.lock();
            if let Some(e) = st.pools.get_mut(&id) {
                e.uses = e.uses.saturating_sub(1);
            }
            self.take_dead(&mut st)
        };
        drop(dead);
    }

    /// Removes the pools nobody uses any more, unless a pool is active; the caller drops
    /// them (which frees their device memory) after unlocking.
    fn take_dead(&self, st: &mut State) -> Vec<Entry> {
        if !st.active.is_empty() {
            return Vec::new();
        }
        let ids: Vec<PoolId> = st.pools.iter().filter(|(_, e)| e.is_dead()).map(|(id, _)| *id).collect();
        let dead: Vec<Entry> = ids.iter().filter_map(|id| st.pools.remove(id)).collect();
        self.pools.fetch_sub(dead.len(), Ordering::Relaxed);
        dead
    }

    /// Allocates `size` bytes on `stream` from the active pool whose filter matches, if one
    /// does (failing if that pool fails); [`Routed::Main`] leaves the allocation to the main
    /// stack. With `driver_captures`, an allocation on a capturing stream stays on the main
    /// stack (whether the stream captures is asked once, and only while a pool is active).
    pub fn allocate(&self, size: usize, stream: Stream) -> Result<Routed> {
        self.allocate_with(size, stream, 0).map(|(routed, _)| routed)
    }

    /// [`PrivatePools::allocate`], keeping `word` with a pool's allocation
    /// ([`Pointers::allocate_ptr_with`]); with the pool that took it, if one did.
    pub fn allocate_with(&self, size: usize, stream: Stream, word: u64) -> Result<(Routed, Option<PoolId>)> {
        if self.active.load(Ordering::Acquire) == 0 {
            return Ok((Routed::Main { graphed: false }, None));
        }
        if self.driver_captures && self.device.capture_status(stream)? != CaptureStatus::None {
            return Ok((Routed::Main { graphed: true }, None));
        }
        let active: Vec<(PoolId, StreamFilter)> = self.state.lock().active.clone();
        // Filters run unlocked: a framework's filter may call the driver.
        let id = active.iter().rev().find(|(_, f)| f(stream)).map(|(id, _)| *id);
        let alloc = id.and_then(|id| self.state.lock().pools.get(&id).map(|e| (id, e.alloc.clone())));
        match alloc {
            Some((id, alloc)) => Ok((Routed::Pool(alloc.allocate_ptr_with(size, stream, word)?), Some(id))),
            None => Ok((Routed::Main { graphed: false }, None)),
        }
    }

    /// Hands `[ptr, ptr + size)` of pool `id` out again as an allocation of `size` bytes on
    /// `stream`, kept with `word` ([`Pointers::allocate_ptr_with`]), where its free memory
    /// holds the range: PyTorch's cudagraph trees restore a checkpoint of a pool so, at the
    /// addresses its recorded graphs use. Frees pending on recorded streams are waited for
    /// (bounded) first. Fails with [`Error::InvalidArgument`] naming the range when the pool
    /// does not exist or does not hold it free.
    pub fn allocate_at(
        &self,
        id: PoolId,
        ptr: DevicePtr,
        size: usize,
        stream: Stream,
        word: u64,
    ) -> Result<()> {
        let alloc = self.state.lock().pools.get(&id).map(|e| e.alloc.clone());
        let held = match &alloc {
            Some(alloc) => alloc.inner().allocate_kept_at(ptr, size, stream, word)?,
            None => false,
        };
        if held {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "{ptr:#x}+{size} is not free memory of private pool {id:?}{}",
            if alloc.is_some() { "" } else { " (no such pool)" }
        )))
    }

    /// Frees `ptr` if a pool made it; whether one did.
    pub fn free(&self, ptr: DevicePtr, owner: Stream) -> bool {
        self.take(ptr, owner).is_some()
    }

    /// The pools' allocators, with their ids.
    fn allocs(&self) -> Vec<(PoolId, Arc<Pointers<StreamSafe>>)> {
        self.state.lock().pools.iter().map(|(id, e)| (*id, e.alloc.clone())).collect()
    }

    /// What a pool keeps for `ptr` ([`Pointers::entry`]), with the pool's id, if a pool made
    /// it.
    pub fn entry(&self, ptr: DevicePtr) -> Option<(PoolId, PointerEntry)> {
        if self.pools.load(Ordering::Relaxed) == 0 {
            return None;
        }
        self.allocs().into_iter().find_map(|(id, a)| a.entry(ptr, None).map(|e| (id, e)))
    }

    /// The live allocations of pool `id`, with what is kept for each.
    pub fn live(&self, id: PoolId) -> Vec<(DevicePtr, PointerEntry)> {
        let alloc = self.state.lock().pools.get(&id).map(|e| e.alloc.clone());
        alloc.map(|a| a.entries()).unwrap_or_default()
    }

    /// [`PrivatePools::free`], returning the pool's id and what it kept for `ptr`.
    pub fn take(&self, ptr: DevicePtr, owner: Stream) -> Option<(PoolId, PointerEntry)> {
        if self.pools.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let allocs = self.allocs();
        let (id, entry) = allocs.iter().find_map(|(id, a)| a.take_ptr(ptr, owner).map(|e| (*id, e)))?;
        drop(allocs);
        let dead = {
            let mut st = self.state.lock();
            match st.pools.get(&id) {
                Some(e) if e.is_dead() => self.take_dead(&mut st),
                _ => Vec::new(),
            }
        };
        drop(dead);
        Some((id, entry))
    }

    /// `record_stream` for `ptr` if a pool made it; whether one did. Fails, recording
    /// nothing, when `stream` is not a live stream of the device.
    pub fn record_stream(&self, ptr: DevicePtr, stream: Stream) -> Result<bool> {
        if self.pools.load(Ordering::Relaxed) == 0 {
            return Ok(false);
        }
        let allocs: Vec<Arc<Pointers<StreamSafe>>> =
            self.state.lock().pools.values().map(|e| e.alloc.clone()).collect();
        for a in allocs {
            if a.record_stream_ptr(ptr, stream)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Retires `stream`'s pool in every private pool ([`StreamSafe::retire_stream`]): the
    /// caller is about to destroy it. Every pool is tried; the first error is returned.
    pub fn retire_stream(&self, stream: Stream) -> Result<()> {
        let allocs: Vec<Arc<Pointers<StreamSafe>>> =
            self.state.lock().pools.values().map(|e| e.alloc.clone()).collect();
        try_each(allocs, |a| a.retire_stream(stream))
    }

    /// Restarts the peaks of every pool's statistics.
    pub fn reset_peak_stats(&self) {
        for e in self.state.lock().pools.values() {
            e.alloc.reset_peak_stats();
        }
    }

    /// Every pool's segments ([`Allocator::segments`]), each with its pool's id.
    pub fn segments(&self, out: &mut Vec<(PoolId, Segment)>) -> Result<()> {
        let pools: Vec<_> = self.state.lock().pools.iter().map(|(id, e)| (*id, e.alloc.clone())).collect();
        try_each(pools, |(id, alloc)| {
            let mut segments = Vec::new();
            alloc.segments(&mut segments)?;
            out.extend(segments.into_iter().map(|s| (id, s)));
            Ok(())
        })
    }

    /// Statistics summed over the pools.
    pub fn stats(&self) -> Stats {
        self.state.lock().pools.values().map(|e| e.alloc.stats()).sum()
    }

    /// Whether a pool is active (a capture or a `use_mem_pool` block is under way).
    #[inline]
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire) != 0
    }

    /// The number of pools that exist.
    pub fn len(&self) -> usize {
        self.pools.load(Ordering::Relaxed)
    }

    /// Whether no pool exists.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::sim::{SimConfig, SimDevice};
    use crate::device::{DeviceMemory, Streams};

    fn pools(sim: &Arc<SimDevice>) -> PrivatePools {
        PrivatePools::new(sim.clone(), BestFitConfig::default(), false)
    }

    /// What a pool allocated; `None` when the allocation was left to the main stack.
    fn pooled(p: &PrivatePools, size: usize, stream: Stream) -> Option<DevicePtr> {
        match p.allocate(size, stream).unwrap() {
            Routed::Pool(ptr) => Some(ptr),
            Routed::Main { .. } => None,
        }
    }

    #[test]
    fn routed_allocations_live_in_the_pool_until_it_is_released() {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let p = pools(&sim);
        let s = sim.create_stream().unwrap();
        assert!(pooled(&p, 1 << 20, s).is_none(), "nothing is active");
        p.begin((0, 1), Arc::new(move |x| x == s)).unwrap();
        assert!(pooled(&p, 1 << 20, Stream::forged(0xdead)).is_none(), "the filter does not match");
        let a = pooled(&p, 1 << 20, s).unwrap();
        let b = pooled(&p, 1 << 20, s).unwrap();
        assert!(p.free(a, s));
        p.end((0, 1));
        assert!(pooled(&p, 1 << 20, s).is_none(), "ended");
        let reserved = sim.mem_info().unwrap().used();
        p.release((0, 1));
        assert_eq!(p.len(), 1, "b is still live");
        assert_eq!(sim.mem_info().unwrap().used(), reserved);
        assert!(p.free(b, s));
        assert_eq!(p.len(), 0);
        assert_eq!(sim.mem_info().unwrap().used(), 0, "the pool's chunks went back");
        assert!(!p.free(b, s), "freed twice");
    }

    /// A checkpoint restored (PyTorch's cudagraph trees): allocations freed meanwhile, their
    /// memory reused by the pool in between, are handed out again at their addresses, with no
    /// growth; a range not free, or of no pool, is refused by name.
    #[test]
    fn a_pools_allocations_are_handed_out_again_at_their_addresses() {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let p = pools(&sim);
        let s = sim.create_stream().unwrap();
        p.begin((0, 1), Arc::new(move |x| x == s)).unwrap();
        let (a, _) = p.allocate_with(3 << 20, s, 7).unwrap();
        let Routed::Pool(a) = a else { panic!("not pooled") };
        let b = pooled(&p, 5 << 20, s).unwrap();
        let c = pooled(&p, 4096, s).unwrap();
        let used = sim.mem_info().unwrap().used();
        assert!(p.free(a, s) && p.free(c, s));
        // Another allocation takes `a`'s memory meanwhile, and goes.
        let d = pooled(&p, 3 << 20, s).unwrap();
        assert_eq!(d, a);
        assert!(p.free(d, s));
        p.allocate_at((0, 1), a, 3 << 20, s, 8).unwrap();
        p.allocate_at((0, 1), c, 4096, s, 9).unwrap();
        assert_eq!(sim.mem_info().unwrap().used(), used, "no growth");
        let words: Vec<_> = p.live((0, 1)).into_iter().map(|(ptr, e)| (ptr, e.size, e.word)).collect();
        assert!(words.contains(&(a, 3 << 20, 8)) && words.contains(&(c, 4096, 9)), "{words:?}");
        let refused = p.allocate_at((0, 1), b + 4096, 4096, s, 0).unwrap_err();
        assert!(
            matches!(refused, Error::InvalidArgument(ref m) if m.contains("not free memory")),
            "{refused}"
        );
        assert!(
            matches!(p.allocate_at((0, 2), a, 4096, s, 0), Err(Error::InvalidArgument(m)) if m.contains("no such pool"))
        );
        for x in [a, b, c] {
            assert!(p.free(x, s));
        }
        p.end((0, 1));
        p.release((0, 1));
        assert_eq!((p.len(), sim.mem_info().unwrap().used()), (0, 0));
        assert!(sim.violations().is_empty());
    }

    /// A stream retired before it is destroyed is named by no later call of a private pool
    /// (here its retry on out-of-memory, which waits for every stream with a pool); without
    /// retiring it, the pool names it.
    #[test]
    fn a_retired_stream_is_named_by_no_later_call_of_a_pool() {
        for retire in [true, false] {
            let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
            let p = pools(&sim);
            let (s, s2) = (sim.create_stream().unwrap(), sim.create_stream().unwrap());
            p.begin((0, 1), Arc::new(move |x| x == s || x == s2)).unwrap();
            let a = pooled(&p, 600 << 20, s).unwrap();
            assert!(p.free(a, s));
            if retire {
                p.retire_stream(s).unwrap();
            }
            sim.destroy_stream(s).unwrap();
            // The 600 MiB cached on `s` must go back before `s2` gets as much: retired, they
            // went back at once; else the retry names `s` (on a GPU, a crash; here the
            // allocation fails).
            let b = p.allocate(600 << 20, s2);
            assert_eq!(sim.unknown_stream_calls() == 0, retire, "retire={retire}");
            match b {
                Ok(Routed::Pool(b)) => assert!(p.free(b, s2)),
                other => assert!(!retire, "retired, yet {other:?}"),
            }
            p.end((0, 1));
            p.release((0, 1));
        }
    }

    #[test]
    fn graphs_sharing_a_pool_reuse_its_blocks_and_private_ones_do_not() {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 34));
        let p = pools(&sim);
        let s = sim.create_stream().unwrap();
        let capture = |id: PoolId| {
            p.begin(id, Arc::new(|_| true)).unwrap();
            let x = pooled(&p, 256 << 20, s).unwrap();
            assert!(p.free(x, s));
            p.end(id);
            x
        };
        let first = capture((0, 7));
        assert_eq!(capture((0, 7)), first, "a shared pool serves the next capture");
        assert_ne!(capture((0, 8)), first, "another pool has memory of its own");
        assert_eq!(p.len(), 2);
        for id in [(0, 7), (0, 7), (0, 8)] {
            p.release(id);
        }
        assert_eq!((p.len(), sim.mem_info().unwrap().used()), (0, 0));
    }

    #[test]
    fn nothing_is_freed_while_a_pool_is_active() {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let p = pools(&sim);
        let s = sim.create_stream().unwrap();
        p.begin((0, 1), Arc::new(|_| true)).unwrap();
        let a = pooled(&p, 1 << 20, s).unwrap();
        p.end((0, 1));
        p.begin((0, 2), Arc::new(|_| true)).unwrap();
        assert!(p.free(a, s));
        p.release((0, 1));
        assert_eq!(p.len(), 2, "pool 1 is dead but another capture is under way");
        p.end((0, 2));
        assert_eq!(p.len(), 1, "freed at the end of the capture");
        p.release((0, 2));
        assert_eq!(p.len(), 0);
    }

    #[test]
    fn the_newest_matching_filter_wins() {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let p = pools(&sim);
        let (s1, s2) = (sim.create_stream().unwrap(), sim.create_stream().unwrap());
        p.begin((1, 0), Arc::new(|_| true)).unwrap();
        p.begin((0, 2), Arc::new(move |x| x == s2)).unwrap();
        let a = pooled(&p, 4096, s1).unwrap();
        let b = pooled(&p, 4096, s2).unwrap();
        let st = p.state.lock();
        let owner = |ptr| {
            st.pools
                .iter()
                .find(|(_, e)| e.alloc.record_stream_ptr(ptr, Stream::forged(0)).unwrap())
                .map(|(id, _)| *id)
        };
        assert_eq!((owner(a), owner(b)), (Some((1, 0)), Some((0, 2))));
    }
}
