//! What a [`BestFit`](super::BestFit) pool backs its blocks with. The pool keeps the blocks
//! (a [`BestFitPolicy`]); a [`Backing`] obtains the memory under them and gives it back,
//! into the pool's books, under the pool's lock. Three backings:
//!
//! * [`Chunks`]: chunks from a [`ChunkSource`] (plain device allocations by default), each
//!   given back whole.
//! * [`Segments`]: PyTorch's expandable segments: one address reservation per size class,
//!   mapped from its start as the pool grows.
//! * [`Stitched`]: GMLake's stitching on one address reservation: mapped ranges are placed
//!   next to free blocks so they merge, and the memory of free granules is mapped a second
//!   time, side by side, into a range that serves a request which would otherwise raise the
//!   pool's peak; such ranges are kept and reused without a device call.
//!
//! The memory of a live block of a pool over mapped memory (stitched or segments) is shared
//! with another process by [`share_mapped`]; that of chunks goes through CUDA IPC handles
//! (`cudaIpcGetMemHandle`) instead.

mod chunks;
mod segments;
mod stitched;

pub use chunks::{ChunkSource, Chunks, DeviceChunks};
pub use segments::Segments;
pub use stitched::Stitched;

use std::sync::Arc;

use crate::device::ipc::SharedPiece;
use crate::device::{Device, DevicePtr, Stream};
use crate::error::{Error, Result};
use crate::policy::best_fit::{BestFitPolicy, Class, Classes, TakenChunk};
use crate::policy::AddrRange;

/// What a pool knows of a backing: one entry each in [`BACKINGS`], which the configuration
/// (`backing=NAME`) and the presets take every backing from, so adding one is its file and
/// its entry here (DESIGN.md, "Adding a strategy or a backing").
#[derive(Debug)]
pub struct BackingSpec {
    /// The name `backing=` takes.
    pub name: &'static str,
    /// Whether it maps memory with virtual memory management: on a device without it, the
    /// facade's pools fall back to [`BackingKind::CHUNKS`].
    pub mapped: bool,
    /// Whether it can give memory back at its addresses and map it there again (what a tag's
    /// sleep needs).
    pub sleeps: bool,
    /// Makes it for a pool whose chunks come from `source`, on `stream` (the pool's).
    pub make: fn(source: Arc<dyn ChunkSource>, stream: Stream) -> Box<dyn Backing>,
}

/// [`Chunks`] of plain device allocations.
pub static CHUNKS: BackingSpec = BackingSpec {
    name: "chunks",
    mapped: false,
    sleeps: false,
    make: |source, _| Box::new(Chunks::new(source)),
};

/// [`Segments`]: expandable segments.
pub static SEGMENTS: BackingSpec = BackingSpec {
    name: "segments",
    mapped: true,
    sleeps: false,
    make: |source, _| Box::new(Segments::new(Chunks::new(source))),
};

/// [`Stitched`]: stitched virtual-memory ranges.
pub static STITCHED: BackingSpec = BackingSpec {
    name: "stitched",
    mapped: true,
    sleeps: true,
    make: |source, stream| Box::new(Stitched::new(source.device().clone(), stream)),
};

/// Every backing, in the order the configuration lists them.
pub static BACKINGS: &[&BackingSpec] = &[&STITCHED, &SEGMENTS, &CHUNKS];

/// Which [`Backing`] a pool built from a [`BestFitConfig`](super::BestFitConfig) gets: an
/// entry of [`BACKINGS`].
#[derive(Clone, Copy)]
pub struct BackingKind(&'static BackingSpec);

impl BackingKind {
    /// [`Chunks`] of plain device allocations (the default of a bare pool).
    pub const CHUNKS: BackingKind = BackingKind(&CHUNKS);
    /// [`Segments`]: expandable segments.
    pub const SEGMENTS: BackingKind = BackingKind(&SEGMENTS);
    /// [`Stitched`]: stitched virtual-memory ranges.
    pub const STITCHED: BackingKind = BackingKind(&STITCHED);

    /// Every backing of the registry, in its order.
    pub fn all() -> impl Iterator<Item = BackingKind> {
        BACKINGS.iter().map(|spec| BackingKind(spec))
    }

    /// The backing named `name`, if there is one.
    pub fn named(name: &str) -> Option<BackingKind> {
        Self::all().find(|b| b.name() == name)
    }

    /// The name `backing=` takes.
    pub fn name(self) -> &'static str {
        self.0.name
    }

    /// What the registry says of it.
    pub fn spec(self) -> &'static BackingSpec {
        self.0
    }
}

impl Default for BackingKind {
    fn default() -> Self {
        Self::CHUNKS
    }
}

impl PartialEq for BackingKind {
    fn eq(&self, other: &Self) -> bool {
        self.0.name == other.0.name
    }
}

impl Eq for BackingKind {}

impl std::fmt::Debug for BackingKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.name)
    }
}

/// A request the pool found no free block for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Want {
    /// The request's class.
    pub class: Class,
    /// The request rounded up to [`ALIGNMENT`](crate::ALIGNMENT): the block it needs.
    pub rounded: u64,
    /// The chunk a chunked pool grows by for it
    /// ([`BestFitPolicy::growth_for`](crate::policy::best_fit::BestFitPolicy::growth_for)).
    pub chunk: u64,
    /// Whether that chunk is the request's own (it is larger than the pool's growth size).
    pub own: bool,
}

/// What a release took out of a pool's books ([`Backing::release_begin`]): given back to the
/// device by [`Backing::release_end`], or to the books if the pool's wait failed.
#[derive(Debug, Default)]
pub struct Taken {
    /// Wholly free chunks (chunks of their own, segments).
    pub chunks: Vec<TakenChunk>,
    /// Free granules of mapped memory, each with its class.
    pub granules: Vec<(Class, AddrRange)>,
    /// Mapped ranges that no block of the books holds (stitched ranges idle or evicted).
    pub ranges: Vec<AddrRange>,
}

impl Taken {
    /// Whether nothing was taken.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty() && self.granules.is_empty() && self.ranges.is_empty()
    }
}

/// Where a [`BestFit`](super::BestFit) pool's memory comes from and goes back to.
///
/// The pool calls its backing with its lock held and its books in hand (`books`, the pool's
/// [`BestFitPolicy`]); a backing adds memory to the books and takes memory out of them, and
/// never calls back into the pool (the pool counts the bytes reserved from what the books
/// hold before and after each call). Growing and giving memory back run under the pool's lock,
/// as in RMM's pool and PyTorch's caching allocator; what waits for the device (a release's
/// wait for the pool's stream, a sleep's wait for its users) runs without it, between two
/// calls. Memory in a free block was last used in the order of the pool's stream (blocks freed
/// with recorded streams become free only once those streams' events completed), so free
/// memory may be given back only after the pool's stream's work enqueued before it was taken
/// out of the books. A backing that reuses free memory while growing does so in the order of
/// the pool's stream, without unmapping it ([`Stitched`] maps it a second time). No backing
/// waits without a bound (but at teardown).
pub trait Backing: Send + Sync {
    /// The device the memory lives on.
    fn device(&self) -> &Arc<dyn Device>;
    /// Adds memory to `books` so that `want` fits there: the pool serves it from them under
    /// the same lock. Out-of-memory errors are the device's; the pool releases and retries
    /// once.
    fn grow(&self, books: &mut BestFitPolicy, want: &Want) -> Result<()>;
    /// Gives the pool's free memory back to the device, first step: takes what goes back out
    /// of `books`, so that no thread can allocate it, use it on the pool's stream and free it
    /// again. Unless nothing was taken, the pool then waits, with a bound and without its
    /// lock, for the work enqueued on its stream until then, which holds every use of what was
    /// taken, and ends the release ([`Backing::release_end`]). (Waiting first and taking what
    /// is free afterwards would give back blocks allocated, used and freed during the wait.)
    /// Growths, and other releases, go on during the wait: what was taken is in neither the
    /// books nor the backing's free address space.
    fn release_begin(&self, books: &mut BestFitPolicy) -> Result<Taken>;
    /// Gives back what [`Backing::release_begin`] took (`taken`), once the pool's wait is over
    /// (`waited`): the bytes given back, or the first error met after trying everything. An
    /// unmap does not wait for the memory's last uses, so when the wait failed what was taken
    /// goes back into `books` (chunks whose `cuMemFree` orders itself after the device's work
    /// may still go back to the device when the error is not a
    /// [`Timeout`](crate::Error::Timeout), a stream that cannot be waited for) and the error
    /// is returned.
    fn release_end(&self, books: &mut BestFitPolicy, taken: Taken, waited: Result<()>) -> Result<usize>;
    /// The size classes of a pool over this backing, from those its configuration asks for
    /// (unchanged by default).
    fn classes(&self, configured: Classes) -> Classes {
        configured
    }
    /// Puts the pool's memory to sleep, first step (see [`Tagged`](crate::allocators::Tagged)):
    /// takes the pool's free memory out of its books, as a release does, and lists the mapped
    /// ranges left, which hold the pool's data (live blocks, blocks whose frees wait on
    /// events); [`Backing::sleep_end`] then gives their memory back and keeps their addresses.
    /// Between the two the caller waits for every use of the pool's memory, and may copy the
    /// ranges out. While the pool sleeps it neither grows nor releases. A backing whose memory
    /// cannot be given back at its addresses (chunks, and segments, whose largest requests
    /// have chunks of their own) cannot sleep: [`Error::Unsupported`], the default.
    fn sleep_begin(&self, books: &mut BestFitPolicy) -> Result<Vec<(DevicePtr, usize)>> {
        let _ = books;
        Err(Error::Unsupported("sleep: this backing's memory cannot be given back at its addresses".into()))
    }
    /// Second step of a sleep: with `commit` (the caller's wait succeeded), unmaps what
    /// [`Backing::sleep_begin`] took out and listed, keeping the addresses of what it listed;
    /// the bytes listed and given back. Without, the pool stays awake as it was (the free
    /// memory goes back into its books) and 0 is returned.
    fn sleep_end(&self, books: &mut BestFitPolicy, commit: bool) -> Result<usize> {
        let _ = (books, commit);
        Err(Error::Unsupported("sleep: this backing cannot sleep".into()))
    }
    /// Wakes a sleeping pool: maps fresh memory at the addresses it slept, as they were
    /// mapped (stitched ranges over their homes again); the ranges
    /// [`Backing::sleep_begin`] listed, whose contents are undefined until the caller copies
    /// them back. Maps all or nothing: on an error the pool still sleeps.
    fn wake(&self) -> Result<Vec<(DevicePtr, usize)>> {
        Err(Error::Unsupported("wake: this backing cannot sleep".into()))
    }
    /// Gives back every chunk the pool holds and what its stitched chunks left out of them
    /// ([`BestFitPolicy::take_stitches`]), `chunks`, when the pool is dropped. Errors only
    /// leak memory: nothing is left to report them to.
    fn teardown(&mut self, chunks: Vec<AddrRange>);
}

/// The memory under a live block of a pool over mapped memory, exported for another process
/// ([`share_mapped`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedRange {
    /// Start of the range: the block's first granule.
    pub base: DevicePtr,
    /// The physical allocations that the range maps, in address order, each exported: their
    /// lengths add up to the range's.
    pub pieces: Vec<SharedPiece>,
}

impl SharedRange {
    /// Bytes of the range: whole granules, from [`SharedRange::base`].
    pub fn len(&self) -> u64 {
        self.pieces.iter().map(|p| p.len).sum()
    }

    /// Whether the range holds nothing (never, for a range [`share_mapped`] gives).
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }
}

/// Exports the memory under `[ptr, ptr + size)`, a live block of a pool backed by
/// [`Stitched`] or [`Segments`] ranges, for another process: the granule-aligned range that
/// holds the block, and its physical allocations ([`Ipc::export_mapped`](crate::device::Ipc::export_mapped)). A block of a
/// stitched range is shared through the stitched addresses, whose allocations are those of
/// its home granules (the same descriptors). The block's granules may hold other blocks too:
/// a receiver that maps the range sees them, as with PyTorch's expandable segments.
/// Memory that is not mapped (chunks, the driver's pool) is an
/// [`InvalidArgument`](Error::InvalidArgument).
pub fn share_mapped(device: &dyn Device, ptr: DevicePtr, size: usize) -> Result<SharedRange> {
    let granularity = device.map_granularity()? as u64;
    let end = ptr
        .checked_add(size as u64)
        .filter(|_| ptr != 0 && size > 0 && granularity > 0)
        .and_then(|end| end.checked_next_multiple_of(granularity));
    let Some(end) = end else {
        return Err(Error::InvalidArgument(format!("no block to share at {ptr:#x}+{size}")));
    };
    let base = ptr - ptr % granularity;
    let pieces = device.export_mapped(base, (end - base) as usize)?;
    Ok(SharedRange { base, pieces })
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;
    use crate::allocators::{BestFit, BestFitConfig};
    use crate::device::ipc::fetch_fds;
    use crate::device::sim::{SimConfig, SimDevice};
    use crate::device::{DeviceTestExt, Ipc, Streams, VirtualMemory};
    use crate::{Allocation, Allocator, Stream};

    const MIB: usize = 1 << 20;

    fn pool(sim: &Arc<SimDevice>, backing: BackingKind, stream: Stream) -> BestFit {
        BestFit::new(sim.clone(), BestFitConfig { backing, stream, ..Default::default() }).unwrap()
    }

    /// Maps `range` into a reservation of its own, as a receiving process does (with copies of
    /// the descriptors); the reservation.
    fn receive(sim: &SimDevice, range: &SharedRange) -> DevicePtr {
        let fds: Vec<_> = range.pieces.iter().map(|p| p.fd).collect();
        let fds = fetch_fds(std::process::id(), &fds).unwrap();
        let at = sim.reserve_address(range.len() as usize).unwrap();
        let mut next = at;
        for (piece, fd) in range.pieces.iter().zip(&fds) {
            sim.map_shared(next, fd.as_fd(), piece.offset as usize, piece.len as usize).unwrap();
            next += piece.len;
        }
        at
    }

    fn check_range(range: &SharedRange, block: &Allocation, granularity: u64) {
        assert_eq!(range.base % granularity, 0);
        assert!(range.base <= block.ptr() && block.ptr() - range.base < granularity);
        let end = range.base + range.len();
        assert!(
            end >= block.ptr() + block.size() as u64
                && end - (block.ptr() + block.size() as u64) < granularity
        );
        assert!(range.pieces.iter().all(|p| p.len == granularity && p.offset == 0));
    }

    /// Blocks of stitched and segments pools: the granules that hold each, exported once, and
    /// mapped elsewhere the same bytes both ways.
    #[test]
    fn blocks_of_mapped_pools_are_shared_by_their_granules() {
        for backing in [BackingKind::STITCHED, BackingKind::SEGMENTS] {
            let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
            let s = sim.create_stream().unwrap();
            let g = sim.map_granularity().unwrap() as u64;
            let pool = pool(&sim, backing, s);
            let pad = pool.allocate(MIB + 4096).unwrap();
            let block = pool.allocate(5 * MIB).unwrap();
            let range = share_mapped(&*sim, block.ptr(), block.size()).unwrap();
            check_range(&range, &block, g);
            let from = block.ptr() - range.base;
            assert_eq!(
                range.pieces.len() as u64,
                (from + 5 * MIB as u64).div_ceil(g),
                "{backing:?}: from {from:#x}"
            );
            let data: Vec<u8> = (0..block.size()).map(|i| (i % 249) as u8).collect();
            sim.copy_from_host(block.ptr(), &data, s).unwrap();
            let at = receive(&sim, &range);
            let mine = at + (block.ptr() - range.base);
            let mut back = vec![0; block.size()];
            sim.copy_to_host(&mut back, mine, s).unwrap();
            assert!(back == data, "{backing:?}: the receiver reads the block");
            sim.memset_async(mine, 3, 4096, s).unwrap();
            let mut head = vec![0; 4096];
            sim.copy_to_host(&mut head, block.ptr(), s).unwrap();
            assert!(head.iter().all(|&x| x == 3), "{backing:?}: the block holds what the receiver wrote");
            // Exported once: the same descriptors again, and for a neighbour in the same granule.
            assert_eq!(share_mapped(&*sim, block.ptr(), block.size()).unwrap(), range);
            let pad_range = share_mapped(&*sim, pad.ptr(), pad.size()).unwrap();
            let (last, first) = (pad_range.pieces.last(), range.pieces.first());
            assert_eq!(pad_range.base + pad_range.len() > range.base, last == first, "{backing:?}");
            sim.unmap(at, range.len() as usize).unwrap();
            sim.free_address(at, range.len() as usize).unwrap();
            drop((pad, block));
        }
    }

    /// A block of a stitched range maps the memory of its home granules: shared, it is the
    /// same physical memory, under the descriptors the homes were exported with.
    #[test]
    fn a_block_of_a_stitched_range_shares_its_homes() {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let s = sim.create_stream().unwrap();
        let pool = pool(&sim, BackingKind::STITCHED, s);
        let small: Vec<Allocation> = (0..8).map(|_| pool.allocate(256 << 10).unwrap()).collect();
        let a = pool.allocate(6 * MIB).unwrap();
        let b = pool.allocate(6 * MIB).unwrap();
        let homes = share_mapped(&*sim, a.ptr(), a.size()).unwrap();
        drop(a);
        drop(small);
        let aliases = sim.aliases();
        let c = pool.allocate(12 * MIB).unwrap();
        assert_eq!(sim.aliases(), aliases + 1, "stitched");
        let range = share_mapped(&*sim, c.ptr(), c.size()).unwrap();
        check_range(&range, &c, sim.map_granularity().unwrap() as u64);
        let files: Vec<_> = range.pieces.iter().map(|p| (p.fd, p.serial)).collect();
        assert!(
            homes.pieces.iter().all(|p| files.contains(&(p.fd, p.serial))),
            "the homes' descriptors {homes:?} are not among the range's {range:?}"
        );
        drop((b, c));
        // The pool gives its memory back: every descriptor closes with its last mapping.
        pool.release().unwrap();
        assert_eq!((pool.stats().reserved, sim.exported()), (0, 0));
    }

    #[test]
    fn memory_that_is_not_mapped_is_not_shared() {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let chunks = pool(&sim, BackingKind::CHUNKS, Stream::DEFAULT);
        let block = chunks.allocate(MIB).unwrap();
        let e = share_mapped(&*sim, block.ptr(), block.size()).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(share_mapped(&*sim, 0, MIB).is_err());
        assert!(share_mapped(&*sim, block.ptr(), 0).is_err());
        assert!(share_mapped(&*sim, u64::MAX - 10, 100).is_err());
    }
}
