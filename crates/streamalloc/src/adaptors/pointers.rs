//! `Pointers`: allocations known by their pointer alone, for front ends that hand raw pointers
//! to C. The one table in a stack that maps a pointer back to its allocation.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use crate::allocation::{
    Allocation, Allocator, Kept as KeptBelow, KeptBlock, PointerEntry, Stats, StreamAllocator,
};
use crate::device::{Device, DevicePtr, EventPool, Stream};
use crate::error::{Error, Result};
use crate::stream_table::StreamSlots;

/// Shards of the table (a bit each in [`Pointers::occupied`]).
const SHARDS: usize = 256;
/// Words of [`Pointers::occupied`].
const WORDS: usize = SHARDS / u64::BITS as usize;
/// Shards a stream looks at, from its home on, for one it claimed or one to claim.
const PROBE: usize = 8;

/// A stack's allocations by pointer: `allocate_ptr` makes an allocation through the allocator
/// it wraps and keeps it, `free_ptr` frees it, `record_stream_ptr` records a stream on it. See
/// DESIGN.md, Note [one pointer table].
///
/// * **Kept below where it can be.** An allocator that keeps allocations by pointer itself
///   ([`StreamAllocator::allocate_kept`]) keeps them in the stream's pool under the pool's own
///   lock, and no handle is made; every other allocation is an [`Allocation`] handle kept in
///   the table here, whose free is the free of the handle. A look by pointer tries the pool of
///   the stream given, then the table, then every pool. See DESIGN.md, Note [one lock per
///   operation].
/// * **Sharded by stream.** The table is 256 maps, each under a lock of its own; a stream
///   claims one, so threads on different streams take different locks, and a free given the
///   stream it was allocated on finds the allocation in one lookup (a free on another stream,
///   or a `record_stream`, looks in the shards that hold anything). See DESIGN.md, Note
///   [shards claimed by streams].
/// * **Bounded.** The table holds the live allocations and a claim per shard, nothing per
///   thread or per stream; each map grows to at most twice the most allocations its shard held
///   at once.
/// * **Recorded streams** stay on the allocation until its free, and are listed
///   ([`Pointers::recorded_streams`]) until that free has returned (see DESIGN.md, Note [frees
///   under way]). [`StreamAllocator::retire_stream`] takes the stream out of them, after waiting
///   (at most the `wait_timeout` given) for its work if an allocation kept here recorded it.
/// * Dropping the table frees the allocations it still keeps (their pointers must not be used
///   after that).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use streamalloc::adaptors::Pointers;
/// use streamalloc::allocators::{StreamSafe, StreamSafeConfig};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::{Allocator, Streams};
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let alloc = StreamSafe::new(sim.clone(), StreamSafeConfig::default())?;
/// let stack = Pointers::new(alloc, sim.clone(), Duration::from_secs(10));
/// let (compute, copy) = (sim.create_stream()?, sim.create_stream()?);
/// let ptr = stack.allocate_ptr(1 << 20, compute)?;
/// assert!(stack.record_stream_ptr(ptr, copy)?); // `copy` uses it too
/// assert_eq!(stack.stats().allocated, 1 << 20);
/// assert!(stack.free_ptr(ptr, compute)); // reused once `copy`'s work is done
/// assert!(!stack.free_ptr(ptr, compute)); // not live any more
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct Pointers<A> {
    inner: A,
    device: Arc<dyn Device>,
    events: EventPool,
    /// The longest [`StreamAllocator::retire_stream`] waits for the stream's work.
    wait_timeout: Duration,
    shards: Box<[Shard]>,
    /// The stream that claimed each shard: read at every allocation and free by pointer that
    /// reaches the table, written only by a claim, so apart from the shards' locks.
    claims: StreamSlots,
    /// Bit `i` is set while shard `i` may hold an allocation: set by the insert that finds it
    /// clear, cleared by a look through the shards that finds the shard empty (both under the
    /// shard's lock), so a stream that allocates and frees one block writes no shared word.
    occupied: [AtomicU64; WORDS],
    /// Allocations kept (here or below) that recorded a stream, and those whose free is under
    /// way ([`Pointers::freeing`]): [`StreamAllocator::retire_stream`] and
    /// [`Pointers::recorded_streams`] look through the allocations only when this is not 0.
    recording: AtomicUsize,
    /// The streams recorded on allocations taken out of the table whose free has not yet
    /// returned: the allocator below orders the reuse after them only once it does, and a
    /// sleep that looked between the two saw them nowhere (issue 52, #1).
    freeing: Mutex<Vec<Stream>>,
}

/// An allocation kept, with its front end's word.
struct Kept {
    allocation: Allocation,
    /// The stream it was asked for on.
    stream: Stream,
    word: u64,
}

/// What is kept for an allocation, in the table or by the allocator below.
trait Held {
    fn entry(&self) -> PointerEntry;
    fn owning_stream(&self) -> Stream;
    fn recorded_streams(&self) -> &[Stream];
    fn record_stream(&mut self, stream: Stream);
    fn erase_stream(&mut self, stream: Stream);
}

impl Held for Kept {
    fn entry(&self) -> PointerEntry {
        PointerEntry {
            size: self.allocation.size(),
            stream: self.stream,
            word: self.word,
            recorded: !self.allocation.recorded_streams().is_empty(),
        }
    }
    fn owning_stream(&self) -> Stream {
        self.allocation.owning_stream()
    }
    fn recorded_streams(&self) -> &[Stream] {
        self.allocation.recorded_streams()
    }
    fn record_stream(&mut self, stream: Stream) {
        self.allocation.record_stream(stream)
    }
    fn erase_stream(&mut self, stream: Stream) {
        self.allocation.erase_stream(stream)
    }
}

impl Held for KeptBlock {
    fn entry(&self) -> PointerEntry {
        KeptBlock::entry(self)
    }
    fn owning_stream(&self) -> Stream {
        KeptBlock::owning_stream(self)
    }
    fn recorded_streams(&self) -> &[Stream] {
        KeptBlock::recorded_streams(self)
    }
    fn record_stream(&mut self, stream: Stream) {
        KeptBlock::record_stream(self, stream)
    }
    fn erase_stream(&mut self, stream: Stream) {
        KeptBlock::erase_stream(self, stream)
    }
}

/// One map of the table, alone on its cache lines.
#[repr(align(128))]
#[derive(Default)]
struct Shard {
    live: Mutex<FxHashMap<DevicePtr, Kept>>,
}

impl<A: StreamAllocator> Pointers<A> {
    /// Keeps `inner`'s allocations by pointer; `device` is the device `inner` allocates on
    /// (whose streams `record_stream_ptr` checks); `wait_timeout` bounds the wait of
    /// [`StreamAllocator::retire_stream`] for a stream recorded on allocations kept.
    pub fn new(inner: A, device: Arc<dyn Device>, wait_timeout: Duration) -> Self {
        Self {
            inner,
            events: EventPool::new(device.clone()),
            device,
            wait_timeout,
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            claims: StreamSlots::new(SHARDS, PROBE),
            occupied: Default::default(),
            recording: AtomicUsize::new(0),
            freeing: Mutex::new(Vec::new()),
        }
    }

    /// The allocator it wraps.
    pub fn inner(&self) -> &A {
        &self.inner
    }

    /// Allocates `size` bytes on `stream` ([`StreamAllocator::allocate_on`]) and keeps the
    /// allocation until [`Pointers::free_ptr`]; the pointer. Size 0 gives the null pointer
    /// and keeps nothing.
    pub fn allocate_ptr(&self, size: usize, stream: Stream) -> Result<DevicePtr> {
        self.allocate_ptr_with(size, stream, 0)
    }

    /// [`Pointers::allocate_ptr`], keeping `word` with the allocation: a front end's own word
    /// for it (an index, a pointer to its records), returned by [`Pointers::take_ptr`] and
    /// [`Pointers::entry`], so that the front end keeps no table of its own.
    pub fn allocate_ptr_with(&self, size: usize, stream: Stream, word: u64) -> Result<DevicePtr> {
        let allocation = match self.inner.allocate_kept(size, stream, word)? {
            // Kept below, in the stream's pool under its own lock: the table takes no lock.
            KeptBelow::Ptr(ptr) => return Ok(ptr),
            KeptBelow::Handle(allocation) => allocation,
        };
        let ptr = allocation.ptr();
        if ptr == 0 {
            return Ok(0);
        }
        let i = self.claim(stream);
        let mut live = self.shards[i].live.lock();
        // Kept at most half full. See Note [maps kept half full] in DESIGN.md.
        let len = live.len();
        if len * 2 >= live.capacity() {
            live.reserve(len.max(64));
        }
        live.insert(ptr, Kept { allocation, stream, word });
        let (word, bit) = (&self.occupied[i / 64], 1u64 << (i % 64));
        if word.load(Ordering::Relaxed) & bit == 0 {
            word.fetch_or(bit, Ordering::Relaxed);
        }
        Ok(ptr)
    }

    /// Frees the allocation at `ptr`, as dropping its handle does; whether one was kept there.
    /// `owner` is the stream it was asked for on, looked at first (any stream is correct, a
    /// wrong one only slower).
    pub fn free_ptr(&self, ptr: DevicePtr, owner: Stream) -> bool {
        self.take_ptr(ptr, owner).is_some()
    }

    /// [`Pointers::free_ptr`], returning what was kept for the allocation.
    pub fn take_ptr(&self, ptr: DevicePtr, owner: Stream) -> Option<PointerEntry> {
        let entry = match self.inner.take_kept(ptr, Some(owner)) {
            Some(entry) => entry,
            None => self.take_from_table(ptr, owner).or_else(|| self.inner.take_kept(ptr, None))?,
        };
        if entry.recorded {
            // Release: its block is pending below by now (see `recorded_streams`).
            self.recording.fetch_sub(1, Ordering::Release);
        }
        Some(entry)
    }

    /// Takes the allocation at `ptr` out of the table and frees it, outside the table's lock;
    /// its recorded streams stay listed in [`Pointers::freeing`] until the free has returned.
    fn take_from_table(&self, ptr: DevicePtr, owner: Stream) -> Option<PointerEntry> {
        let taken = self.find(Some(owner), |live| {
            let kept = live.remove(&ptr)?;
            // Listed as freeing before the shard's lock goes (see `recorded_streams`).
            let recorded = kept.allocation.recorded_streams();
            if !recorded.is_empty() {
                self.freeing.lock().extend_from_slice(recorded);
            }
            Some(kept)
        })?;
        let entry = taken.entry();
        if !entry.recorded {
            drop(taken);
            return Some(entry);
        }
        let recorded = taken.allocation.recorded_streams().to_vec();
        // The free orders the block's reuse after the recorded streams (events recorded on
        // them, the block pending below) before they leave the list.
        drop(taken);
        let mut freeing = self.freeing.lock();
        for s in &recorded {
            if let Some(i) = freeing.iter().position(|f| f == s) {
                freeing.swap_remove(i);
            }
        }
        Some(entry)
    }

    /// What is kept for the allocation at `ptr`, if one is; `hint` is the stream looked at
    /// first.
    pub fn entry(&self, ptr: DevicePtr, hint: Option<Stream>) -> Option<PointerEntry> {
        self.with_entry(ptr, hint, |k| k.entry())
    }

    /// [`Allocation::record_stream`] for the allocation at `ptr`; `Ok(false)` if none is kept
    /// there. Fails, recording nothing, when `stream` is not a live stream of the device (no
    /// event could be recorded on it at the free).
    pub fn record_stream_ptr(&self, ptr: DevicePtr, stream: Stream) -> Result<bool> {
        self.device.check_stream(stream)?;
        let found = self.with_entry(ptr, None, |kept| {
            let before = kept.recorded_streams().len();
            kept.record_stream(stream);
            if before == 0 && !kept.recorded_streams().is_empty() {
                // Counted under the lock that holds the entry, as the free that takes it out
                // counts.
                self.recording.fetch_add(1, Ordering::Release);
            }
        });
        Ok(found.is_some())
    }

    /// The owning stream of the allocation at `ptr`, if one is kept there.
    pub fn owner_of(&self, ptr: DevicePtr, hint: Stream) -> Option<Stream> {
        self.with_entry(ptr, Some(hint), |k| k.owning_stream())
    }

    /// Every allocation kept, with what is kept for it.
    pub fn entries(&self) -> Vec<(DevicePtr, PointerEntry)> {
        let mut all = Vec::new();
        self.each_entry(|p, k| all.push((p, k.entry())));
        all
    }

    /// The size of the allocation kept at `ptr` (its start), if one is.
    pub fn size_of(&self, ptr: DevicePtr) -> Option<usize> {
        self.with_entry(ptr, None, |k| k.entry().size)
    }

    /// The streams recorded on the allocations kept and on those whose free is under way,
    /// each once: what a sleep waits for besides the owning streams and the frees pending
    /// below. A free that ran before this call began has its block pending below by then.
    pub fn recorded_streams(&self) -> Vec<Stream> {
        let mut streams = Vec::new();
        // Acquire: a free counted out here has its block pending below, seen by later calls.
        if self.recording.load(Ordering::Acquire) == 0 {
            return streams;
        }
        self.each_entry(|_, kept| {
            for s in kept.recorded_streams() {
                if !streams.contains(s) {
                    streams.push(*s);
                }
            }
        });
        // After the shards: a free that took its allocation out of a shard after that shard
        // was read listed its streams here first.
        for s in self.freeing.lock().iter() {
            if !streams.contains(s) {
                streams.push(*s);
            }
        }
        streams
    }

    /// Runs `f` on what is kept for `ptr`: below in the pool of `hint` (if given), in the
    /// table, then below in every pool.
    fn with_entry<T>(
        &self,
        ptr: DevicePtr,
        hint: Option<Stream>,
        mut f: impl FnMut(&mut dyn Held) -> T,
    ) -> Option<T> {
        let mut out = None;
        if hint.is_some() && self.inner.with_kept(ptr, hint, &mut |k| out = Some(f(k))) {
            return out;
        }
        if let Some(found) = self.find(hint, |live| live.get_mut(&ptr).map(|k| f(k))) {
            return Some(found);
        }
        self.inner.with_kept(ptr, None, &mut |k| out = Some(f(k)));
        out
    }

    /// Runs `f` on every allocation kept, in the table and below.
    fn each_entry(&self, mut f: impl FnMut(DevicePtr, &mut dyn Held)) {
        self.each_occupied(|live| {
            for (&p, k) in live.iter_mut() {
                f(p, k);
            }
        });
        self.inner.each_kept(&mut |p, k| f(p, k));
    }

    /// Runs `f` on the shard of `hint` first (if given), then on every other shard that may
    /// hold an allocation, until it returns `Some`.
    fn find<T>(
        &self,
        hint: Option<Stream>,
        mut f: impl FnMut(&mut FxHashMap<DevicePtr, Kept>) -> Option<T>,
    ) -> Option<T> {
        let first = hint.map(|stream| self.claims.find(stream).unwrap_or_else(|| self.claims.home(stream)));
        if let Some(i) = first {
            if let Some(found) = f(&mut self.shards[i].live.lock()) {
                return Some(found);
            }
        }
        let mut found = None;
        self.each_occupied_until(first, |live| {
            found = f(live);
            found.is_some()
        });
        found
    }

    /// The shard `stream` allocates into: the one it claimed, else the first it looks at that
    /// it can claim (no stream claimed it, or its stream keeps nothing in it), else its home,
    /// shared (a stream finding the 8 shards it looks at held by others tries their locks at
    /// each allocation; with 256 shards, that takes many streams holding allocations at once).
    /// A shard is claimed again only once emptied, so the claims stay 256 however many streams
    /// come and go. Which shard holds an allocation is a matter of speed only: a free that
    /// misses the shard it looks in first looks in the others.
    #[inline]
    fn claim(&self, stream: Stream) -> usize {
        self.claims.find(stream).unwrap_or_else(|| self.claim_new(stream))
    }

    /// [`Pointers::claim`] for a stream that holds no claim.
    #[cold]
    #[inline(never)]
    fn claim_new(&self, stream: Stream) -> usize {
        let emptied = |i: usize, _| self.shards[i].live.try_lock().is_some_and(|live| live.is_empty());
        self.claims.claim(stream, emptied).unwrap_or_else(|| self.claims.home(stream))
    }

    /// Runs `f` on every shard that may hold an allocation.
    fn each_occupied(&self, mut f: impl FnMut(&mut FxHashMap<DevicePtr, Kept>)) {
        self.each_occupied_until(None, |live| {
            f(live);
            false
        });
    }

    /// Runs `f` on every shard but `skip` that may hold an allocation, until it returns true;
    /// clears the bit of each shard found empty.
    fn each_occupied_until(
        &self,
        skip: Option<usize>,
        mut f: impl FnMut(&mut FxHashMap<DevicePtr, Kept>) -> bool,
    ) {
        for (w, word) in self.occupied.iter().enumerate() {
            let mut mask = word.load(Ordering::Relaxed);
            while mask != 0 {
                let i = w * 64 + mask.trailing_zeros() as usize;
                mask &= mask - 1;
                if Some(i) == skip {
                    continue;
                }
                let mut live = self.shards[i].live.lock();
                if live.is_empty() {
                    word.fetch_and(!(1u64 << (i % 64)), Ordering::Relaxed);
                    continue;
                }
                if f(&mut live) {
                    return;
                }
            }
        }
    }
}

impl<A: StreamAllocator> Allocator for Pointers<A> {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        self.inner.allocate(size)
    }
    fn release(&self) -> Result<usize> {
        self.inner.release()
    }
    fn stats(&self) -> Stats {
        self.inner.stats()
    }
    pass_through_allocator!();
}

impl<A: StreamAllocator> StreamAllocator for Pointers<A> {
    fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation> {
        self.inner.allocate_on(size, stream)
    }
    fn default_stream(&self) -> Stream {
        self.inner.default_stream()
    }
    fn set_default_stream(&self, stream: Stream) {
        self.inner.set_default_stream(stream)
    }
    /// Once the work enqueued so far on `stream` is done (the host waits, at most
    /// `wait_timeout`, if an allocation kept recorded it), takes it out of the streams
    /// recorded on the allocations kept (none may follow); then retires it below. A timeout
    /// forgets nothing and is returned; a stream that cannot be waited for (destroyed
    /// already) stays recorded, and the first error is returned after the retirement below.
    fn retire_stream(&self, stream: Stream) -> Result<()> {
        let mut waited = Ok(());
        if self.recording.load(Ordering::Acquire) != 0 && self.recorded_streams().contains(&stream) {
            let device = self.device.as_ref();
            waited = crate::allocators::wait_for_streams(device, &self.events, &[stream], self.wait_timeout);
            match &waited {
                Err(Error::Timeout { .. }) => return waited,
                Err(_) => {}
                Ok(()) => self.each_entry(|_, kept| {
                    if !kept.recorded_streams().is_empty() {
                        kept.erase_stream(stream);
                        if kept.recorded_streams().is_empty() {
                            self.recording.fetch_sub(1, Ordering::Release);
                        }
                    }
                }),
            }
        }
        let below = self.inner.retire_stream(stream);
        waited.and(below)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adaptors::Limit;
    use crate::allocators::{StreamSafe, StreamSafeConfig};
    use crate::device::sim::{SimConfig, SimDevice};
    use crate::device::Streams;

    #[test]
    fn frees_on_any_stream_and_forgets_retired_streams() {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let alloc = StreamSafe::new(sim.clone(), StreamSafeConfig::default()).unwrap();
        let stack = Pointers::new(alloc, sim.clone(), Duration::from_secs(1));
        let streams: Vec<Stream> = (0..4).map(|_| sim.create_stream().unwrap()).collect();
        let ptrs: Vec<DevicePtr> = streams.iter().map(|&s| stack.allocate_ptr(4096, s).unwrap()).collect();
        assert_eq!(stack.allocate_ptr(0, streams[0]).unwrap(), 0);
        assert!(stack.record_stream_ptr(ptrs[0], streams[1]).unwrap());
        assert!(stack.record_stream_ptr(ptrs[0], streams[2]).unwrap());
        assert_eq!(stack.recorded_streams(), vec![streams[1], streams[2]]);
        assert_eq!(stack.owner_of(ptrs[0], streams[3]), Some(streams[0]));
        // The wrong stream: found all the same.
        assert!(stack.free_ptr(ptrs[3], streams[0]));
        assert!(!stack.free_ptr(ptrs[3], streams[3]));
        stack.retire_stream(streams[3]).unwrap();
        stack.retire_stream(streams[1]).unwrap();
        assert_eq!(stack.recorded_streams(), vec![streams[2]]);
        assert!(!stack.record_stream_ptr(0x1234, streams[2]).unwrap());
        assert!(stack.record_stream_ptr(ptrs[1], Stream::forged(0xdead)).is_err());
        for (&p, &s) in ptrs[..3].iter().zip(&streams) {
            assert!(stack.free_ptr(p, s));
        }
        assert_eq!(stack.recorded_streams(), Vec::<Stream>::new());
        assert_eq!((stack.stats().allocated, stack.recording.load(Ordering::Relaxed)), (0, 0));
        assert!(sim.violations().is_empty());
    }

    #[test]
    fn the_stream_pools_keep_their_allocations_and_the_table_holds_none() {
        // Over StreamSafe an allocation by pointer is kept in its stream's pool, under the
        // pool's one lock: the table's shards stay empty, and every look by pointer finds it.
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let alloc = StreamSafe::new(sim.clone(), StreamSafeConfig::default()).unwrap();
        let stack = Pointers::new(alloc, sim.clone(), Duration::from_secs(1));
        let (a, b) = (sim.create_stream().unwrap(), sim.create_stream().unwrap());
        let ptrs: Vec<(DevicePtr, Stream)> = (0..64u64)
            .map(|i| {
                let s = if i % 2 == 0 { a } else { b };
                (stack.allocate_ptr_with(4096 << (i % 5), s, 1000 + i).unwrap(), s)
            })
            .collect();
        assert!(stack.shards.iter().all(|s| s.live.lock().is_empty()), "the table holds allocations");
        assert_eq!(stack.entries().len(), 64);
        let (p0, s0) = ptrs[0];
        assert_eq!(
            stack.entry(p0, None),
            Some(PointerEntry { size: 4096, stream: a, word: 1000, recorded: false })
        );
        assert_eq!((stack.owner_of(p0, b), stack.size_of(p0)), (Some(a), Some(4096)));
        assert!(stack.record_stream_ptr(p0, b).unwrap());
        assert_eq!(stack.recorded_streams(), vec![b]);
        // Freed on the other stream: found all the same, with its word and recorded stream.
        let taken = stack.take_ptr(p0, b).unwrap();
        assert_eq!((taken.word, taken.recorded, stack.recorded_streams()), (1000, true, vec![]));
        for &(p, s) in &ptrs[1..] {
            assert!(stack.free_ptr(p, s));
        }
        assert!(!stack.free_ptr(p0, s0));
        assert_eq!((stack.stats().allocated, stack.stats().live_allocations), (0, 0));
        assert_eq!(stack.recording.load(Ordering::Relaxed), 0);
        assert!(sim.violations().is_empty());
    }

    /// A table over a simulated device of `capacity` bytes, and `n` of the device's streams
    /// whose handles hash to one home shard (its index last). Under [`Limit`], which gives
    /// handles, the table keeps them.
    fn streams_of_one_home(
        capacity: usize,
        n: usize,
    ) -> (Arc<SimDevice>, Pointers<Limit<StreamSafe>>, Vec<Stream>, usize) {
        let sim = SimDevice::new(SimConfig::with_capacity(capacity));
        let alloc = StreamSafe::new(sim.clone(), StreamSafeConfig::default()).unwrap();
        let stack = Pointers::new(Limit::new(alloc, usize::MAX), sim.clone(), Duration::from_secs(1));
        let first = sim.create_stream().unwrap();
        let home = stack.claims.home(first);
        let others =
            std::iter::repeat_with(|| sim.create_stream().unwrap()).filter(|&s| stack.claims.home(s) == home);
        let alike: Vec<Stream> = std::iter::once(first).chain(others).take(n).collect();
        (sim, stack, alike, home)
    }

    #[test]
    fn streams_whose_handles_hash_alike_take_shards_of_their_own() {
        // Four streams of one home shard: the first three each take a lock of their own.
        let (_sim, stack, alike, home) = streams_of_one_home(1 << 30, 4);
        let ptrs: Vec<DevicePtr> = alike[..3].iter().map(|&s| stack.allocate_ptr(4096, s).unwrap()).collect();
        let held = |i: usize| stack.shards[i % SHARDS].live.lock().len();
        assert_eq!([held(home), held(home + 1), held(home + 2)], [1, 1, 1]);
        for (&p, &s) in ptrs.iter().zip(&alike) {
            assert!(stack.free_ptr(p, s));
        }
        // Emptied, the home shard goes to the next stream that needs one (the claims stay 256
        // however many streams come and go).
        let ptr = stack.allocate_ptr(4096, alike[3]).unwrap();
        assert_eq!(held(home), 1);
        assert!(stack.free_ptr(ptr, alike[3]));
        assert_eq!(stack.stats().allocated, 0);
    }

    #[test]
    fn threads_on_streams_that_hash_alike_find_every_allocation_while_claims_change_hands() {
        // 24 streams of one home shard, more than the 8 shards they look at: claims are taken,
        // emptied and taken again by others while allocations stay where they were put.
        let (sim, stack, alike, _) = streams_of_one_home(4 << 30, 24);
        let handed = std::sync::Mutex::new(Vec::<DevicePtr>::new());
        std::thread::scope(|scope| {
            for t in 0..4 {
                let (stack, alike, handed) = (&stack, &alike, &handed);
                scope.spawn(move || {
                    let mut rng = 0x2545_F491_4F6C_DD1Du64 ^ t;
                    let mut next = || {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        rng
                    };
                    let mut mine = Vec::new();
                    for _ in 0..3000 {
                        let stream = alike[(next() % 24) as usize];
                        match next() % 4 {
                            0 | 1 => mine.push((
                                stack.allocate_ptr(256 + (next() % 4096) as usize, stream).unwrap(),
                                stream,
                            )),
                            2 if !mine.is_empty() => {
                                // Freed on its own stream, or on another (found all the same).
                                let (ptr, owner) = mine.swap_remove((next() as usize) % mine.len());
                                let on = if next() % 2 == 0 { owner } else { stream };
                                assert!(stack.free_ptr(ptr, on), "an allocation was not found");
                            }
                            // Handed to another thread, which frees it.
                            _ => {
                                let taken = handed.lock().unwrap().pop();
                                match taken {
                                    Some(ptr) => {
                                        assert!(
                                            stack.free_ptr(ptr, stream),
                                            "a handed allocation was not found"
                                        )
                                    }
                                    None => {
                                        if let Some((ptr, _)) = mine.pop() {
                                            handed.lock().unwrap().push(ptr);
                                        }
                                    }
                                }
                            }
                        }
                    }
                    for (ptr, owner) in mine {
                        assert!(stack.free_ptr(ptr, owner));
                    }
                });
            }
        });
        for ptr in handed.into_inner().unwrap() {
            assert!(stack.free_ptr(ptr, alike[0]));
        }
        assert_eq!(stack.stats().allocated, 0);
        assert!(stack.shards.iter().all(|s| s.live.lock().is_empty()));
        assert!(sim.violations().is_empty());
    }
}
