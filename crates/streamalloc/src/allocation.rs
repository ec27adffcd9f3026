//! The allocator traits, the RAII [`Allocation`] handle and the statistics every allocator
//! reports.
//!
//! # The stream-ordering contract
//!
//! This contract is stated once, here; every stream-aware allocator links to it.
//!
//! * An allocation belongs to the stream it was allocated on (its *owning stream*). Work
//!   enqueued on that stream after the allocation call may use it at once, and once it is
//!   freed, later allocations on the same stream may reuse its memory at once: stream order
//!   already separates the two uses.
//! * [`Allocation::record_stream`] says "work enqueued on this other stream, up to the moment
//!   the allocation is freed, uses this memory". The allocator must not hand the memory to
//!   anyone else until that work has completed. Work enqueued on a recorded stream *after*
//!   the free is the caller's bug.
//! * Freeing (dropping the [`Allocation`]) never blocks on the device; what waits is the
//!   reuse.
//! * Non-stream-aware allocators ([`Allocator`] only) still honour recorded streams, in the
//!   simplest safe way each can (see each allocator's documentation).

use std::sync::Arc;

use crate::device::{DevicePtr, Stream};
use crate::error::Result;

pub use crate::policy::ALIGNMENT;

/// Rounds `size` up to a multiple of [`ALIGNMENT`]; `None` on overflow.
pub fn align_up(size: usize) -> Option<usize> {
    size.checked_add(ALIGNMENT - 1).map(|s| s & !(ALIGNMENT - 1))
}

/// What an allocator gets back when an [`Allocation`] is dropped.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Block {
    /// Device address.
    pub ptr: DevicePtr,
    /// Size the caller asked for, in bytes.
    pub size: usize,
    /// The owning stream.
    pub stream: Stream,
    /// Device ordinal.
    pub device: usize,
    /// Allocator-private datum (e.g. an index into its block table).
    pub token: u64,
    /// Streams other than the owning one whose work uses the memory (see the
    /// [module docs](self)). Empty in the common case, and then it does not allocate.
    pub recorded: Recorded,
}

/// The streams recorded on a block: one word, and no allocation, while there are none (the
/// common case), so that a handle stays one cache line (64 bytes) as it moves through the
/// layers and into the pointer table. See DESIGN.md, Note [a handle is one cache line].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
// A boxed `Vec` on purpose: one word where a `Vec` is three and a boxed slice two.
#[allow(clippy::box_collection)]
pub struct Recorded(Option<Box<Vec<Stream>>>);

impl Recorded {
    /// Adds `stream` at the end.
    pub fn push(&mut self, stream: Stream) {
        self.0.get_or_insert_with(Default::default).push(stream);
    }

    /// Keeps the streams `keep` says yes to.
    pub fn retain(&mut self, keep: impl FnMut(&Stream) -> bool) {
        if let Some(streams) = &mut self.0 {
            streams.retain(keep);
            if streams.is_empty() {
                self.0 = None;
            }
        }
    }
}

impl std::ops::Deref for Recorded {
    type Target = [Stream];

    fn deref(&self) -> &[Stream] {
        self.0.as_deref().map_or(&[], Vec::as_slice)
    }
}

impl<'a> IntoIterator for &'a Recorded {
    type Item = &'a Stream;
    type IntoIter = std::slice::Iter<'a, Stream>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl Block {
    /// Marks `stream` as a user of the block until its free ([`Allocation::record_stream`]):
    /// nothing for the owning stream or a stream recorded already.
    pub fn record_stream(&mut self, stream: Stream) {
        if stream != self.stream && !self.recorded.contains(&stream) {
            self.recorded.push(stream);
        }
    }

    /// Undoes [`Block::record_stream`] for `stream` ([`Allocation::erase_stream`]).
    pub fn erase_stream(&mut self, stream: Stream) {
        self.recorded.retain(|s| *s != stream);
    }
}

/// Takes blocks back when their [`Allocation`] is dropped.
///
/// Implemented by every allocator and adaptor. `free` must not panic and must not block on
/// the device; an error it meets is kept by the allocator and reported by its next call or
/// counted in its [`Stats`].
pub trait BlockOwner: Send + Sync {
    /// Takes `block` back.
    fn free(&self, block: Block);
}

/// An RAII handle to device memory. Dropping it frees the memory (stream-ordered, see the
/// [module docs](self)).
///
/// A zero-size allocation has a null pointer, touches no device memory and frees for
/// nothing, as in PyTorch's allocator.
///
/// # Examples
///
/// ```
/// use streamalloc::allocators::{StreamSafe, StreamSafeConfig};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::{Streams, StreamAllocator};
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let alloc = StreamSafe::new(sim.clone(), StreamSafeConfig::default())?;
/// let (compute, copy) = (sim.create_stream()?, sim.create_stream()?);
/// let mut a = alloc.allocate_on(1 << 20, compute)?;
/// assert_eq!((a.size(), a.owning_stream()), (1 << 20, compute));
/// a.record_stream(copy); // `copy` uses it too: reuse waits for `copy`'s work
/// assert_eq!(a.recorded_streams(), &[copy]);
/// drop(a); // freed, stream-ordered
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct Allocation {
    block: Block,
    owner: Option<Arc<dyn BlockOwner>>,
}

impl Allocation {
    /// Wraps a block that `owner` takes back on drop.
    pub fn new(block: Block, owner: Arc<dyn BlockOwner>) -> Self {
        Self { block, owner: Some(owner) }
    }

    /// A zero-size allocation: null pointer, nothing to free.
    pub fn empty(device: usize, stream: Stream) -> Self {
        Self { block: Block { device, stream, ..Block::default() }, owner: None }
    }

    /// The device address (null for a zero-size allocation).
    pub fn ptr(&self) -> DevicePtr {
        self.block.ptr
    }

    /// The size asked for, in bytes.
    pub fn size(&self) -> usize {
        self.block.size
    }

    /// The device ordinal.
    pub fn device(&self) -> usize {
        self.block.device
    }

    /// The stream the allocation belongs to.
    pub fn owning_stream(&self) -> Stream {
        self.block.stream
    }

    /// Marks `stream` as a user of this memory until the allocation is freed. Recording the
    /// owning stream, or a stream twice, does nothing. The handle keeps the streams it
    /// recorded: the free orders the memory's reuse after each of them, so each must still
    /// exist then; before destroying one, erase it ([`Allocation::erase_stream`]) once its
    /// work on this memory is done.
    pub fn record_stream(&mut self, stream: Stream) {
        self.block.record_stream(stream);
    }

    /// Undoes [`Allocation::record_stream`] for `stream` (the caller has ordered that
    /// stream's work before the free by other means).
    pub fn erase_stream(&mut self, stream: Stream) {
        self.block.erase_stream(stream);
    }

    /// The streams recorded so far.
    pub fn recorded_streams(&self) -> &[Stream] {
        &self.block.recorded
    }

    /// Splits the handle into its block and owner without freeing; the caller becomes
    /// responsible for handing the block to the owner. Adaptors use this to wrap an inner
    /// allocator's allocations. `None` for a zero-size allocation.
    pub fn into_parts(mut self) -> Option<(Block, Arc<dyn BlockOwner>)> {
        let owner = self.owner.take()?;
        Some((std::mem::take(&mut self.block), owner))
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if let Some(owner) = self.owner.take() {
            owner.free(std::mem::take(&mut self.block));
        }
    }
}

impl std::fmt::Debug for Allocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocation")
            .field("ptr", &format_args!("{:#x}", self.block.ptr))
            .field("size", &self.block.size)
            .field("device", &self.block.device)
            .field("stream", &self.block.stream)
            .field("recorded", &self.block.recorded)
            .finish()
    }
}

/// What is kept for an allocation known by its pointer ([`StreamAllocator::take_kept`],
/// [`Pointers`](crate::adaptors::Pointers)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointerEntry {
    /// Its size, as asked for.
    pub size: usize,
    /// The stream it was asked for on (its owning stream, except under an allocator of one
    /// stream's pool, which owns it then).
    pub stream: Stream,
    /// The front end's word given when it was made (0 if none was).
    pub word: u64,
    /// Whether streams other than its owner were recorded on it.
    pub recorded: bool,
}

/// An allocation that its allocator keeps by pointer, under the lock of the pool that made it
/// ([`StreamAllocator::allocate_kept`]): its block and the front end's word. No handle and no
/// reference count: the pool holds it until [`StreamAllocator::take_kept`] frees it.
#[derive(Debug)]
pub struct KeptBlock {
    block: Block,
    word: u64,
}

impl KeptBlock {
    /// Keeps `block` with the front end's `word`.
    pub fn new(block: Block, word: u64) -> Self {
        Self { block, word }
    }

    /// What is kept for it.
    pub fn entry(&self) -> PointerEntry {
        let b = &self.block;
        PointerEntry { size: b.size, stream: b.stream, word: self.word, recorded: !b.recorded.is_empty() }
    }

    /// Its device address.
    pub fn ptr(&self) -> DevicePtr {
        self.block.ptr
    }

    /// The stream it belongs to.
    pub fn owning_stream(&self) -> Stream {
        self.block.stream
    }

    /// [`Allocation::record_stream`] for it.
    pub fn record_stream(&mut self, stream: Stream) {
        self.block.record_stream(stream);
    }

    /// [`Allocation::erase_stream`] for it.
    pub fn erase_stream(&mut self, stream: Stream) {
        self.block.erase_stream(stream);
    }

    /// The streams recorded so far.
    pub fn recorded_streams(&self) -> &[Stream] {
        &self.block.recorded
    }

    /// Its block, for the pool to take back.
    pub fn into_block(self) -> Block {
        self.block
    }
}

/// What [`StreamAllocator::allocate_kept`] made.
#[derive(Debug)]
pub enum Kept {
    /// An allocation the allocator keeps by its pointer (never null).
    Ptr(DevicePtr),
    /// A handle for the caller to keep: the allocator keeps nothing by pointer, or not this
    /// allocation (a null pointer for a zero-size request).
    Handle(Allocation),
}

/// A range of device memory an allocator holds (a device allocation, or a mapped range), with
/// its blocks in address order, which tile it ([`Allocator::segments`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// Its first byte.
    pub addr: DevicePtr,
    /// Its bytes.
    pub size: usize,
    /// The stream whose pool holds it (the allocator's default stream where it has one pool).
    pub stream: Stream,
    /// Its blocks, in address order, from `addr` to `addr + size`.
    pub blocks: Vec<SegmentBlock>,
}

/// One block of a [`Segment`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentBlock {
    /// Its first byte.
    pub addr: DevicePtr,
    /// Its bytes (as the allocator rounded the request).
    pub size: usize,
    /// What it is now.
    pub state: BlockState,
}

/// What a [`SegmentBlock`] is now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    /// Free for reuse.
    Free,
    /// Handed out and not freed.
    Allocated,
    /// Freed; its reuse waits for work of streams recorded on it.
    Pending,
}

/// Statistics every allocator reports. Figures an allocator does not track stay 0. Laid out
/// as C lays it out: it is the C ABI's `streamalloc_stats_t` too.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes handed out to callers and not yet freed (sizes as asked for).
    pub allocated: usize,
    /// Peak of `allocated`. Of several pools (a sum of [`Stats`], or
    /// [`StreamSafe`](crate::allocators::StreamSafe)'s pools, one per stream), the sum of each
    /// one's peak: an upper bound of the peak of all together.
    pub allocated_peak: usize,
    /// Bytes held from the device (by device allocations or pool reservations).
    pub reserved: usize,
    /// Peak of `reserved` (of [`StreamSafe`](crate::allocators::StreamSafe), the peak of all its
    /// pools together).
    pub reserved_peak: usize,
    /// Bytes held from the device and free for reuse.
    pub cached: usize,
    /// Largest single block in `cached`.
    pub largest_free_block: usize,
    /// Bytes freed by callers whose reuse still waits on another stream's work.
    pub pending_release: usize,
    /// Allocations live now.
    pub live_allocations: u64,
    /// Allocations made since creation.
    pub total_allocations: u64,
    /// Frees since creation.
    pub total_frees: u64,
    /// Calls that allocated from the device.
    pub device_allocs: u64,
    /// Calls that returned memory to the device.
    pub device_frees: u64,
    /// Allocations that failed, each counted once by the allocator or adaptor the caller
    /// called (refusals under a limit included).
    pub failures: u64,
    /// Allocations that succeeded only after the allocator released cached memory, waited
    /// for pending frees or tried again.
    pub retries: u64,
}

impl Stats {
    /// Records an allocation of `size` bytes in the byte and count figures.
    pub fn on_allocate(&mut self, size: usize) {
        self.allocated += size;
        self.allocated_peak = self.allocated_peak.max(self.allocated);
        self.live_allocations += 1;
        self.total_allocations += 1;
    }

    /// Records a free of `size` bytes in the byte and count figures.
    pub fn on_free(&mut self, size: usize) {
        self.allocated = self.allocated.saturating_sub(size);
        self.live_allocations = self.live_allocations.saturating_sub(1);
        self.total_frees += 1;
    }

    /// Records `bytes` reserved from the device in one call.
    pub fn on_reserve(&mut self, bytes: usize) {
        self.reserved += bytes;
        self.reserved_peak = self.reserved_peak.max(self.reserved);
        self.device_allocs += 1;
    }

    /// Records `bytes` returned to the device in one call.
    pub fn on_unreserve(&mut self, bytes: usize) {
        self.reserved = self.reserved.saturating_sub(bytes);
        self.device_frees += 1;
    }

    /// Restarts the peaks from the current figures ([`Allocator::reset_peak_stats`]).
    pub fn reset_peaks(&mut self) {
        self.allocated_peak = self.allocated;
        self.reserved_peak = self.reserved;
    }
}

/// Reserved bytes of several pools together and their peak, kept as the pools reserve and give
/// back memory (rare: device calls), so that the peak is the peak of the sum and not the sum of
/// each pool's peak, which overstates it when pools peak at different times
/// ([`StreamSafe`](crate::allocators::StreamSafe)'s pools, one per stream).
#[derive(Debug, Default)]
pub struct ReservedGauge {
    current: std::sync::atomic::AtomicUsize,
    peak: std::sync::atomic::AtomicUsize,
}

impl ReservedGauge {
    /// Counts `bytes` more reserved.
    pub fn add(&self, bytes: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        let now = self.current.fetch_add(bytes, Relaxed) + bytes;
        self.peak.fetch_max(now, Relaxed);
    }

    /// Counts `bytes` given back.
    pub fn sub(&self, bytes: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        let _ = self.current.fetch_update(Relaxed, Relaxed, |c| Some(c.saturating_sub(bytes)));
    }

    /// The reserved bytes now.
    pub fn current(&self) -> usize {
        self.current.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The most reserved at once since creation or [`ReservedGauge::reset_peak`].
    pub fn peak(&self) -> usize {
        self.peak.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Restarts the peak from the current figure.
    pub fn reset_peak(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.peak.store(self.current.load(Relaxed), Relaxed);
    }
}

/// Adds up the figures of several allocators (or pools): byte and count figures add, so a
/// sum's peaks are the sum of each one's peak (an upper bound of the peak of the whole), and
/// `largest_free_block` is the largest of any.
impl std::iter::Sum for Stats {
    fn sum<I: Iterator<Item = Stats>>(iter: I) -> Stats {
        iter.fold(Stats::default(), |a, b| Stats {
            allocated: a.allocated + b.allocated,
            allocated_peak: a.allocated_peak + b.allocated_peak,
            reserved: a.reserved + b.reserved,
            reserved_peak: a.reserved_peak + b.reserved_peak,
            cached: a.cached + b.cached,
            largest_free_block: a.largest_free_block.max(b.largest_free_block),
            pending_release: a.pending_release + b.pending_release,
            live_allocations: a.live_allocations + b.live_allocations,
            total_allocations: a.total_allocations + b.total_allocations,
            total_frees: a.total_frees + b.total_frees,
            device_allocs: a.device_allocs + b.device_allocs,
            device_frees: a.device_frees + b.device_frees,
            failures: a.failures + b.failures,
            retries: a.retries + b.retries,
        })
    }
}

/// An allocator of device memory. Allocations are made on the allocator's stream (its
/// default stream) and belong to it; see the [module docs](self) for the ordering contract.
///
/// # Examples
///
/// Code written against the trait takes any allocator, or any stack of adaptors over one:
///
/// ```
/// use std::time::Duration;
/// use streamalloc::adaptors::{Limit, Retry};
/// use streamalloc::allocators::{BestFit, BestFitConfig, Plain};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::{Allocator, Stream};
///
/// fn scratch(alloc: &dyn Allocator) -> streamalloc::Result<usize> {
///     let buffer = alloc.allocate(3 << 20)?;
///     Ok(buffer.size()) // freed here, on the allocator's stream
/// }
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// assert_eq!(scratch(&Plain::new(sim.clone(), Stream::DEFAULT))?, 3 << 20);
/// let stack = Limit::new(Retry::new(BestFit::new(sim, BestFitConfig::default())?, Duration::ZERO), 64 << 20);
/// assert_eq!(scratch(&stack)?, 3 << 20);
/// assert!(stack.stats().reserved > 0 && stack.release()? > 0);
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub trait Allocator: Send + Sync {
    /// Allocates `size` bytes, aligned to [`ALIGNMENT`].
    fn allocate(&self, size: usize) -> Result<Allocation>;
    /// Returns cached memory that nobody uses to the device; the bytes returned.
    fn release(&self) -> Result<usize>;
    /// A snapshot of the allocator's statistics.
    fn stats(&self) -> Stats;
    /// Restarts `allocated_peak` and `reserved_peak` from the current figures (PyTorch's
    /// `reset_peak_memory_stats`).
    fn reset_peak_stats(&self);
    /// The device ordinal this allocator serves.
    fn device(&self) -> usize;
    /// Appends the segments it holds from the device to `out`, each with its blocks;
    /// [`Error::Unsupported`](crate::Error::Unsupported) where the memory is the driver's to
    /// place (`AsyncPool`). Taken pool by pool: concurrent calls may move blocks meanwhile.
    fn segments(&self, out: &mut Vec<Segment>) -> Result<()>;
}

/// An allocator as its widest interface: one without stream methods, or a stream-aware one.
/// What a program that runs either holds (a trace replay, a conformance suite).
#[derive(Clone)]
pub enum AnyAllocator {
    /// An allocator without stream methods: every allocation is on its own stream.
    Single(Arc<dyn Allocator>),
    /// A stream-aware allocator.
    Streams(Arc<dyn StreamAllocator>),
}

impl AnyAllocator {
    /// The allocator, without its stream methods.
    pub fn allocator(&self) -> &dyn Allocator {
        match self {
            AnyAllocator::Single(a) => a.as_ref(),
            AnyAllocator::Streams(a) => a.as_ref(),
        }
    }

    /// Allocates `size` bytes on `stream` if the allocator is stream-aware, else on its own
    /// stream; fails as its `allocate` or `allocate_on` does.
    pub fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation> {
        match self {
            AnyAllocator::Single(a) => a.allocate(size),
            AnyAllocator::Streams(a) => a.allocate_on(size, stream),
        }
    }
}

/// An allocator that allocates on any stream, following the ordering contract of the
/// [module docs](self).
///
/// # Examples
///
/// ```
/// use streamalloc::allocators::{AsyncPool, AsyncPoolConfig, StreamSafe, StreamSafeConfig};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::{Streams, Stream, StreamAllocator};
///
/// /// A buffer on each stream, from whichever stream-aware allocator is given.
/// fn per_stream(alloc: &dyn StreamAllocator, streams: &[Stream]) -> streamalloc::Result<()> {
///     for &stream in streams {
///         let buffer = alloc.allocate_on(4 << 20, stream)?;
///         assert_eq!(buffer.owning_stream(), stream); // freed in `stream`'s order
///     }
///     Ok(())
/// }
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let streams = [sim.create_stream()?, sim.create_stream()?];
/// per_stream(&StreamSafe::new(sim.clone(), StreamSafeConfig::default())?, &streams)?;
/// per_stream(&AsyncPool::new(sim.clone(), AsyncPoolConfig::default()), &streams)?;
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub trait StreamAllocator: Allocator {
    /// Allocates `size` bytes owned by `stream`.
    fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation>;
    /// The stream [`Allocator::allocate`] uses.
    fn default_stream(&self) -> Stream;
    /// Sets the stream [`Allocator::allocate`] uses.
    fn set_default_stream(&self, stream: Stream);
    /// Forgets what the allocator keeps for `stream`, which the caller is about to destroy,
    /// so that no later call names it (a destroyed stream's handle is undefined in every
    /// driver call): [`StreamSafe`](crate::allocators::StreamSafe) waits (bounded) for the
    /// stream's work, then drops the stream's pool (its free memory goes back at once,
    /// memory still handed out at a later release once freed);
    /// [`Pointers`](crate::adaptors::Pointers) takes the stream out of the streams recorded
    /// on the allocations it keeps; allocators that keep nothing per stream do nothing. Call it once no allocation owned by `stream` is live, before destroying the
    /// stream; handles that recorded it erase it themselves ([`Allocation::record_stream`]).
    /// An error (the stream's work outlasted the wait) means the stream must not be
    /// destroyed yet.
    fn retire_stream(&self, stream: Stream) -> Result<()>;

    /// Allocates like [`StreamAllocator::allocate_on`] for a caller that knows allocations by
    /// pointer ([`Pointers`](crate::adaptors::Pointers)): an allocator that can keeps the
    /// allocation itself, with the caller's `word`, in the stream's pool under the pool's own
    /// lock ([`Kept::Ptr`], freed by [`StreamAllocator::take_kept`]); any other returns the
    /// handle ([`Kept::Handle`], the default). Errors as `allocate_on`.
    fn allocate_kept(&self, size: usize, stream: Stream, word: u64) -> Result<Kept> {
        let _ = word;
        self.allocate_on(size, stream).map(Kept::Handle)
    }

    /// Frees the allocation kept at `ptr` ([`StreamAllocator::allocate_kept`]), as dropping its
    /// handle would; what was kept for it, or `None` if none is kept there. `hint` names the
    /// one stream whose pool is looked in; `None` looks in every pool. The default keeps
    /// nothing.
    fn take_kept(&self, ptr: DevicePtr, hint: Option<Stream>) -> Option<PointerEntry> {
        let _ = (ptr, hint);
        None
    }

    /// Runs `f` on the allocation kept at `ptr`, under its pool's lock (`f` must take no lock
    /// of the allocator); whether one is kept there. `hint` as in
    /// [`StreamAllocator::take_kept`].
    fn with_kept(&self, ptr: DevicePtr, hint: Option<Stream>, f: &mut dyn FnMut(&mut KeptBlock)) -> bool {
        let _ = (ptr, hint, f);
        false
    }

    /// Runs `f` on every allocation kept, pool by pool under each pool's lock (`f` must take
    /// no lock of the allocator).
    fn each_kept(&self, f: &mut dyn FnMut(DevicePtr, &mut KeptBlock)) {
        let _ = f;
    }
}

impl<A: Allocator + ?Sized> Allocator for Arc<A> {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        (**self).allocate(size)
    }
    fn release(&self) -> Result<usize> {
        (**self).release()
    }
    fn stats(&self) -> Stats {
        (**self).stats()
    }
    fn reset_peak_stats(&self) {
        (**self).reset_peak_stats()
    }
    fn device(&self) -> usize {
        (**self).device()
    }
    fn segments(&self, out: &mut Vec<Segment>) -> Result<()> {
        (**self).segments(out)
    }
}

impl<A: StreamAllocator + ?Sized> StreamAllocator for Arc<A> {
    fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation> {
        (**self).allocate_on(size, stream)
    }
    fn default_stream(&self) -> Stream {
        (**self).default_stream()
    }
    fn set_default_stream(&self, stream: Stream) {
        (**self).set_default_stream(stream)
    }
    fn retire_stream(&self, stream: Stream) -> Result<()> {
        (**self).retire_stream(stream)
    }
    fn allocate_kept(&self, size: usize, stream: Stream, word: u64) -> Result<Kept> {
        (**self).allocate_kept(size, stream, word)
    }
    fn take_kept(&self, ptr: DevicePtr, hint: Option<Stream>) -> Option<PointerEntry> {
        (**self).take_kept(ptr, hint)
    }
    fn with_kept(&self, ptr: DevicePtr, hint: Option<Stream>, f: &mut dyn FnMut(&mut KeptBlock)) -> bool {
        (**self).with_kept(ptr, hint, f)
    }
    fn each_kept(&self, f: &mut dyn FnMut(DevicePtr, &mut KeptBlock)) {
        (**self).each_kept(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A handle fits one cache line (see [`Recorded`]); a field added to it costs every
    /// allocation by pointer.
    #[test]
    fn a_handle_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Allocation>(), 64);
        assert_eq!(std::mem::size_of::<Recorded>(), 8);
    }

    struct Keep(parking_lot::Mutex<Vec<Block>>);

    impl BlockOwner for Keep {
        fn free(&self, block: Block) {
            self.0.lock().push(block);
        }
    }

    #[test]
    fn recorded_streams_travel_to_the_owner() {
        let owner = Arc::new(Keep(parking_lot::Mutex::new(Vec::new())));
        let block = Block { ptr: 0x1000, size: 256, stream: Stream::forged(1), ..Block::default() };
        let mut a = Allocation::new(block, owner.clone());
        a.record_stream(Stream::forged(1)); // the owning stream: nothing to do
        a.record_stream(Stream::forged(2));
        a.record_stream(Stream::forged(3));
        a.record_stream(Stream::forged(2)); // twice: once
        assert_eq!(a.recorded_streams(), &[Stream::forged(2), Stream::forged(3)]);
        a.erase_stream(Stream::forged(2));
        assert_eq!((a.owning_stream(), a.recorded_streams()), (Stream::forged(1), &[Stream::forged(3)][..]));
        drop(a);
        let freed = owner.0.lock();
        assert_eq!((freed.len(), freed[0].ptr, &*freed[0].recorded), (1, 0x1000, &[Stream::forged(3)][..]));
    }
}
