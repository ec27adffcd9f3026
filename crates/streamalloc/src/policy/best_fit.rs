//! Best-fit free lists over chunks of address space, with splitting, coalescing and two size
//! classes. Pure bookkeeping on integer addresses: the caller obtains chunks from somewhere
//! (a device, a virtual-memory segment) and hands them in with [`BestFitPolicy::add_chunk`].
//!
//! # Size classes and rounding
//! * Every block size is a multiple of [`ALIGNMENT`] (256 bytes): requests are rounded up to
//!   it ([`BestFitPolicy::round`]) and nothing else is rounded at the block level.
//! * A request of at most [`Classes::small_max`] bytes (1 MiB by default) is *small*; it is
//!   served only from small chunks of [`Classes::small_chunk`] bytes (2 MiB by default).
//!   Larger requests are *large* and served only from large chunks, so that small blocks never
//!   pin or fragment the big chunks (PyTorch's small and large pools).
//! * Growth ([`BestFitPolicy::growth_for`]): a small request grows by one small chunk; a large
//!   request of at most [`Classes::growth`] bytes grows by one large chunk; a larger one
//!   gets a chunk of its own, rounded up to [`LARGE_ROUND`] (2 MiB).
//!
//! # Splitting
//! A free block bigger than the request is split, the request taking the low end, when the
//! remainder is at least the class's minimum: [`ALIGNMENT`] for small blocks (any remainder),
//! and more than `small_max` for large blocks. A large block whose remainder would be 1 MiB or
//! less is handed out whole, so large chunks do not fill with slivers that only small requests
//! could use (and small requests never use large chunks). This is PyTorch's rule.
//!
//! # Coalescing
//! A freed block merges at once with a free neighbour on either side within its chunk, so no
//! two free blocks are ever adjacent. Blocks of different chunks never merge: each chunk goes
//! back to its source whole. A *segment* ([`BestFitPolicy::add_segment`]) is a chunk that
//! grows at its end instead of being joined by new chunks: what it grows by joins its last
//! block when that is free.
//!
//! # Stitched chunks
//! A virtual-memory backing may take ranges out of free blocks ([`BestFitPolicy::carve`]),
//! map their memory again side by side and add the new range as a *stitched* chunk
//! ([`BestFitPolicy::add_stitched`]). Once all its blocks are free, the carved ranges come
//! back and the stitched chunk waits, idle, for a request it fits
//! ([`BestFitPolicy::reuse_stitched`]); see `stitches.rs`.
//!
//! # Frontier
//! A virtual-memory backing may name, per class, where its growths go on
//! ([`BestFitPolicy::set_frontier`]): the free block that ends there is handed out last, after
//! every other fitting block and after an idle stitched chunk, so that a repeated workload
//! lays its blocks out alike whether the memory past the frontier is mapped yet or not.
//!
//! # Storage
//! Blocks live in a slab (`Vec`) indexed by a `u32` *token*, which the caller carries back on
//! free (it fits [`Block::token`](crate::Block::token)). Vacated slots are recycled through a
//! stack, and neighbours within a chunk are linked by slot index, so splitting, freeing and
//! coalescing never allocate once the slab has grown to the working set. The free lists
//! hold `(size, addr, slot)` per class in bins by size, four per doubling (a bitmap marks
//! those with blocks), each bin a vector sorted by `(size, addr)`: best fit is the first
//! entry at or above `(size, 0)` in the request's bin, else the first entry of the next bin
//! with any, i.e. the smallest fitting block, lowest address among equals. Free blocks stay
//! few, where a binary search and a short move of contiguous entries beat a B-tree's node
//! walks (see DESIGN.md, Note [sorted vectors for the books]); bins keep each search and move to the few blocks of about the same size. A vector that
//! outgrows its capacity reallocates; that is the only allocation on the hot path, and it
//! stops once the bins reach their largest size.
#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::sync::atomic::{AtomicU32, Ordering};

use super::{AddrRange, ALIGNMENT};
use crate::error::{Error, Result};

mod sorted;
mod stitches;

use sorted::Sorted;
use stitches::Stitches;

/// Chunks for requests larger than [`Classes::growth`] are rounded up to this (2 MiB).
pub const LARGE_ROUND: u64 = 2 << 20;

/// The size-class boundaries and chunk sizes of a [`BestFitPolicy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Classes {
    /// Largest request of the small class, in bytes.
    pub small_max: u64,
    /// Size of the chunks small requests are served from, in bytes.
    pub small_chunk: u64,
    /// Size of the chunks large requests up to this size are served from, in bytes (the
    /// `growth` of [`BestFitConfig`](crate::allocators::BestFitConfig) and `STREAMALLOC_CONF`).
    pub growth: u64,
    /// Whether a large block is split however small the remainder (any multiple of
    /// [`ALIGNMENT`]), not only when the remainder is over `small_max`. For backings whose
    /// free tails grow into the next request (stitched ranges), where a remainder left
    /// inside a block is lost until the block is freed.
    pub split_large_slivers: bool,
}

impl Default for Classes {
    fn default() -> Self {
        Self { small_max: 1 << 20, small_chunk: 2 << 20, growth: 32 << 20, split_large_slivers: false }
    }
}

impl Classes {
    /// Checks that the sizes are multiples of [`ALIGNMENT`], that a small chunk holds the
    /// largest small request and that a large chunk is bigger than it.
    pub fn validate(&self) -> Result<()> {
        let align = ALIGNMENT as u64;
        if self.small_max == 0 || self.small_max % align != 0 {
            return Err(Error::InvalidArgument(format!(
                "small size limit {} must be a positive multiple of {ALIGNMENT}",
                self.small_max
            )));
        }
        if self.small_chunk < self.small_max || self.small_chunk % align != 0 {
            return Err(Error::InvalidArgument(format!(
                "small chunk size {} must be a multiple of {ALIGNMENT} of at least {}",
                self.small_chunk, self.small_max
            )));
        }
        if self.growth <= self.small_max || self.growth % align != 0 {
            return Err(Error::InvalidArgument(format!(
                "large chunk size {} must be a multiple of {ALIGNMENT} above {}",
                self.growth, self.small_max
            )));
        }
        Ok(())
    }
}

/// Which free lists and chunks a block belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Requests of at most [`Classes::small_max`] bytes.
    Small,
    /// Everything larger.
    Large,
}

impl Class {
    /// 0 for small, 1 for large: an index into per-class arrays.
    pub(crate) fn index(self) -> usize {
        match self {
            Class::Small => 0,
            Class::Large => 1,
        }
    }
}

/// A block handed out by [`BestFitPolicy::allocate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Start address.
    pub addr: u64,
    /// Block size in bytes (the rounded request, or more when the remainder was too small to
    /// split off).
    pub size: u64,
    /// Pass this back to [`BestFitPolicy::free`].
    pub token: u64,
}

/// A wholly free chunk taken out of a [`BestFitPolicy`] by
/// [`release_free_chunks`](BestFitPolicy::release_free_chunks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TakenChunk {
    /// The class of its block.
    pub class: Class,
    /// Its start.
    pub addr: u64,
    /// Its size.
    pub size: u64,
    /// Whether it was a segment ([`BestFitPolicy::add_segment`]).
    pub segment: bool,
}

/// What the policy holds, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Figures {
    /// Bytes in all chunks.
    pub reserved: u64,
    /// Bytes in blocks handed out.
    pub allocated: u64,
    /// Bytes in free blocks.
    pub cached: u64,
    /// The largest free block.
    pub largest_free: u64,
    /// Number of chunks.
    pub chunks: usize,
}

/// A chunk wanted from the source: its class and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Growth {
    /// Class of the chunk (pass to [`BestFitPolicy::add_chunk`]).
    pub class: Class,
    /// Bytes to obtain.
    pub size: u64,
    /// Whether the chunk is the request's own: it is larger than [`Classes::growth`].
    pub own: bool,
}

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Vacant,
    Free,
    Allocated,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    addr: u64,
    size: u64,
    /// Neighbour at lower addresses in the same chunk, or `NIL`.
    prev: u32,
    /// Neighbour at higher addresses in the same chunk, or `NIL`.
    next: u32,
    state: State,
    class: Class,
}

const VACANT: Slot =
    Slot { addr: 0, size: 0, prev: NIL, next: NIL, state: State::Vacant, class: Class::Small };

#[derive(Debug, Clone, Copy)]
struct Chunk {
    size: u64,
    /// Slot of the block at the chunk's start. Stable: splitting keeps the low part in the
    /// original slot and coalescing keeps the lower block's slot.
    first: u32,
    /// A segment: grows at its end ([`BestFitPolicy::extend_segment`]) and is never taken by
    /// [`BestFitPolicy::take_free_chunk`].
    segment: bool,
}

/// A block of a chunk ([`BestFitPolicy::chunk_blocks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkBlock {
    /// The block's addresses.
    pub range: AddrRange,
    /// Whether the block is handed out (else it is free).
    pub allocated: bool,
}

/// A free-list entry: `(size, addr, slot)`.
type Entry = (u64, u64, u32);

/// Size bins per doubling of block size.
const SUB_BINS: u32 = 4;
/// Bins of a free list: every `u64` size has one.
const BINS: usize = 64 * SUB_BINS as usize;

/// The bin of a block of `size` bytes: four per doubling, numbered in size order, so every
/// block of a bin is smaller than every block of a later bin.
fn bin_of(size: u64) -> usize {
    let size = size.max(1);
    let octave = 63 - size.leading_zeros();
    let sub = if octave >= 2 { (size >> (octave - 2)) & 3 } else { 0 };
    (octave * SUB_BINS) as usize + sub as usize
}

/// The order of the free lists as one integer: comparing it compiles to a compare without
/// branches, where comparing the pair branches on the first field (a search through a list
/// of free blocks then mispredicts at about every step).
fn order(size: u64, addr: u64) -> u128 {
    (u128::from(size) << 64) | u128::from(addr)
}

/// Where an entry is in a [`FreeList`]: its bin and its index there.
#[derive(Debug, Clone, Copy)]
struct At {
    bin: usize,
    i: usize,
}

/// Free blocks of one class, in bins by size (see the [module docs](self)); each bin is
/// sorted by `(size, addr)`, and a bitmap says which bins have blocks.
#[derive(Debug)]
struct FreeList {
    bins: Box<[Vec<Entry>]>,
    /// Bit `b % 64` of word `b / 64` is set when bin `b` is not empty.
    filled: [u64; BINS / 64],
}

impl Default for FreeList {
    fn default() -> Self {
        Self { bins: (0..BINS).map(|_| Vec::new()).collect(), filled: [0; BINS / 64] }
    }
}

impl FreeList {
    fn bin(&self, b: usize) -> &[Entry] {
        self.bins.get(b).map_or(&[], Vec::as_slice)
    }

    /// The entry at `at`.
    fn get(&self, at: At) -> Option<Entry> {
        self.bin(at.bin).get(at.i).copied()
    }

    /// Where `(size, addr)` is in the list.
    fn position(&self, size: u64, addr: u64) -> Option<At> {
        let bin = bin_of(size);
        let key = order(size, addr);
        let i = self.bin(bin).binary_search_by(|&(s, a, _)| order(s, a).cmp(&key)).ok()?;
        Some(At { bin, i })
    }

    fn insert(&mut self, size: u64, addr: u64, slot: u32) {
        let bin = bin_of(size);
        let key = order(size, addr);
        let Some(list) = self.bins.get_mut(bin) else { return };
        if let Err(i) = list.binary_search_by(|&(s, a, _)| order(s, a).cmp(&key)) {
            list.insert(i, (size, addr, slot));
            self.mark(bin, true);
        }
    }

    fn remove(&mut self, size: u64, addr: u64) {
        if let Some(at) = self.position(size, addr) {
            self.remove_at(at);
        }
    }

    /// Removes the entry at `at`.
    fn remove_at(&mut self, at: At) {
        let Some(list) = self.bins.get_mut(at.bin) else { return };
        if at.i < list.len() {
            list.remove(at.i);
            let filled = !list.is_empty();
            self.mark(at.bin, filled);
        }
    }

    fn mark(&mut self, bin: usize, filled: bool) {
        if let Some(word) = self.filled.get_mut(bin / 64) {
            let bit = 1u64 << (bin % 64);
            if filled {
                *word |= bit;
            } else {
                *word &= !bit;
            }
        }
    }

    /// The first bin at or after `from` that has blocks.
    fn filled_from(&self, from: usize) -> Option<usize> {
        let mut word = from / 64;
        let mut bits = self.filled.get(word)? & (u64::MAX << (from % 64));
        loop {
            if bits != 0 {
                return Some(word * 64 + bits.trailing_zeros() as usize);
            }
            word += 1;
            bits = *self.filled.get(word)?;
        }
    }

    /// The smallest block of at least `size` bytes (lowest address among equals): the
    /// first fitting entry of `size`'s bin, else the first entry of the next bin with any.
    fn fit(&self, size: u64) -> Option<(At, Entry)> {
        let bin = bin_of(size);
        let i = self.bin(bin).partition_point(|&(s, _, _)| s < size);
        let at = match self.bin(bin).get(i) {
            Some(_) => At { bin, i },
            None => At { bin: self.filled_from(bin + 1)?, i: 0 },
        };
        self.get(at).map(|e| (at, e))
    }

    /// The entry after `at` in the list's order.
    fn after(&self, at: At) -> Option<(At, Entry)> {
        let next = match self.bin(at.bin).get(at.i + 1) {
            Some(_) => At { bin: at.bin, i: at.i + 1 },
            None => At { bin: self.filled_from(at.bin + 1)?, i: 0 },
        };
        self.get(next).map(|e| (next, e))
    }

    /// The blocks of at least `size` bytes, smallest first.
    fn from(&self, size: u64) -> impl Iterator<Item = Entry> + '_ {
        self.bins.iter().skip(bin_of(size)).flatten().copied().filter(move |&(s, _, _)| s >= size)
    }

    /// Replaces the entry at `at` with `(size, addr, slot)`. Within one bin, only the entries
    /// between its old and new places move (one short move, where a remove and an insert
    /// would each move the bin's tail).
    fn replace(&mut self, at: At, size: u64, addr: u64, slot: u32) {
        if bin_of(size) != at.bin {
            self.remove_at(at);
            return self.insert(size, addr, slot);
        }
        let entry = (size, addr, slot);
        let key = |&(s, a, _): &Entry| order(s, a);
        let Some(list) = self.bins.get_mut(at.bin) else { return };
        let i = at.i;
        let Some(&old) = list.get(i) else { return };
        if key(&entry) > key(&old) {
            let tail = list.get(i + 1..).unwrap_or_default();
            let to = i + tail.partition_point(|e| key(e) < key(&entry));
            if let Some(run) = list.get_mut(i..=to) {
                run.rotate_left(1);
                if let Some(last) = run.last_mut() {
                    *last = entry;
                }
            }
        } else {
            let to = list.get(..i).unwrap_or_default().partition_point(|e| key(e) < key(&entry));
            if let Some(run) = list.get_mut(to..=i) {
                run.rotate_right(1);
                if let Some(first) = run.first_mut() {
                    *first = entry;
                }
            }
        }
    }

    /// The largest block's size (0 if none).
    fn largest(&self) -> u64 {
        self.bins.iter().rev().find_map(|b| b.last()).map_or(0, |&(s, _, _)| s)
    }
}

/// The best-fit policy: chunks, blocks and free lists (see the [module docs](self)).
#[derive(Debug)]
pub struct BestFitPolicy {
    classes: Classes,
    slots: Vec<Slot>,
    vacant: Vec<u32>,
    free: [FreeList; 2],
    chunks: Sorted<u64, Chunk>,
    reserved: u64,
    allocated: u64,
    cached: u64,
    stitches: Stitches,
    /// Per class, the end of the memory its growths extend ([`BestFitPolicy::set_frontier`];
    /// 0: none).
    frontier: [u64; 2],
    /// Where [`BestFitPolicy::block_holding`] starts its walk: the slot it found last, per
    /// class for the frontier blocks, one for every other address (see [`Finger`]).
    fingers: [Finger; 3],
    /// Blocks [`BestFitPolicy::block_holding`] visited (what the tests count).
    #[cfg(test)]
    walked: std::sync::atomic::AtomicU64,
}

/// A hint: the slot of a block that a walk through a chunk's blocks found last, from which
/// the next walk for a nearby address starts (forwards or backwards) instead of from the
/// chunk's first block. Checked before use (a live slot inside the chunk), so a stale one
/// costs only the walk from the chunk's start. Atomic so that lookups keep `&self` and the
/// policy `Sync`; its value never affects a result.
#[derive(Debug, Default)]
struct Finger(AtomicU32);

/// [`BestFitPolicy::fingers`]' entry for addresses other than the frontiers'.
const HOMES: usize = 2;

impl BestFitPolicy {
    /// An empty policy with the given classes (check them first with
    /// [`Classes::validate`]).
    pub fn new(classes: Classes) -> Self {
        Self {
            classes,
            slots: Vec::new(),
            vacant: Vec::new(),
            free: [FreeList::default(), FreeList::default()],
            chunks: Sorted::default(),
            reserved: 0,
            allocated: 0,
            cached: 0,
            stitches: Stitches::default(),
            frontier: [0; 2],
            fingers: Default::default(),
            #[cfg(test)]
            walked: Default::default(),
        }
    }

    /// `size` rounded up to a multiple of [`ALIGNMENT`]; `None` for 0 or on overflow.
    pub fn round(size: u64) -> Option<u64> {
        let align = ALIGNMENT as u64;
        if size == 0 {
            return None;
        }
        size.checked_add(align - 1).map(|s| s & !(align - 1))
    }

    /// The class of a request of `size` bytes.
    pub fn class_of(&self, size: u64) -> Class {
        if size <= self.classes.small_max {
            Class::Small
        } else {
            Class::Large
        }
    }

    /// The chunk to obtain when [`BestFitPolicy::allocate`] found no block for `size`;
    /// `None` for 0 or on overflow.
    pub fn growth_for(&self, size: u64) -> Option<Growth> {
        let size = Self::round(size)?;
        Some(match self.class_of(size) {
            Class::Small => Growth { class: Class::Small, size: self.classes.small_chunk, own: false },
            Class::Large if size <= self.classes.growth => {
                Growth { class: Class::Large, size: self.classes.growth, own: false }
            }
            Class::Large => {
                let size = size.checked_add(LARGE_ROUND - 1)? & !(LARGE_ROUND - 1);
                Growth { class: Class::Large, size, own: true }
            }
        })
    }

    /// Smallest remainder worth splitting off a block of `class`.
    fn min_split(&self, class: Class) -> u64 {
        match class {
            Class::Small => ALIGNMENT as u64,
            Class::Large if self.classes.split_large_slivers => ALIGNMENT as u64,
            Class::Large => self.classes.small_max + 1,
        }
    }

    /// Adds the chunk `[addr, addr + size)` to `class`'s free blocks. Fails if it is empty,
    /// not aligned to [`ALIGNMENT`] or overlaps a chunk already held.
    pub fn add_chunk(&mut self, class: Class, addr: u64, size: u64) -> Result<()> {
        self.insert_chunk(class, addr, size, false)
    }

    /// Adds `[addr, addr + size)` as [`BestFitPolicy::add_chunk`] does, as a *segment*: a chunk
    /// whose address space continues past its end, so that [`BestFitPolicy::extend_segment`]
    /// can grow it there (a virtual-memory reservation mapped as needed).
    pub fn add_segment(&mut self, class: Class, addr: u64, size: u64) -> Result<()> {
        self.insert_chunk(class, addr, size, true)
    }

    /// Grows the segment that starts at `addr` by `added` bytes at its end; the new bytes
    /// join its last block if that is free. Fails if there is no such segment, `added` is
    /// not a positive multiple of [`ALIGNMENT`] or the growth would overlap another chunk.
    pub fn extend_segment(&mut self, addr: u64, added: u64) -> Result<()> {
        let Some(&chunk) = self.chunks.get(&addr).filter(|c| c.segment) else {
            return Err(Error::Internal(format!("no segment at {addr:#x}")));
        };
        let end = addr + chunk.size;
        let new_end = end.checked_add(added);
        let overlaps = new_end.is_some_and(|e| self.chunks.from(end).is_some_and(|&(a, _)| a < e));
        if added == 0 || added % ALIGNMENT as u64 != 0 || new_end.is_none() || overlaps {
            return Err(Error::Internal(format!(
                "segment {addr:#x} cannot grow by {added} bytes at {end:#x}"
            )));
        }
        let last = self.last_block(chunk.first);
        let tail = self.slot(last);
        let class = tail.class;
        if tail.state == State::Free {
            let list = self.free_list(class);
            list.remove(tail.size, tail.addr);
            list.insert(tail.size + added, tail.addr, last);
            if let Some(t) = self.slot_mut(last) {
                t.size += added;
            }
        } else {
            let slot = self
                .new_slot(Slot { addr: end, size: added, prev: last, next: NIL, state: State::Free, class })
                .ok_or_else(|| Error::InvalidArgument("too many blocks (2^32 - 1)".into()))?;
            if let Some(t) = self.slot_mut(last) {
                t.next = slot;
            }
            self.free_list(class).insert(added, end, slot);
        }
        if let Some(c) = self.chunks.get_mut(&addr) {
            c.size += added;
        }
        self.reserved += added;
        self.cached += added;
        Ok(())
    }

    /// The free bytes at the end of the segment that starts at `addr` (0 when its last block
    /// is handed out); `None` if there is no such segment.
    pub fn segment_tail_free(&self, addr: u64) -> Option<u64> {
        let chunk = self.chunks.get(&addr).filter(|c| c.segment)?;
        let tail = self.slot(self.last_block(chunk.first));
        Some(if tail.state == State::Free { tail.size } else { 0 })
    }

    /// The slot of the last block of the chunk whose first block is `first`.
    fn last_block(&self, first: u32) -> u32 {
        let mut idx = first;
        loop {
            let next = self.slot(idx).next;
            if next == NIL {
                return idx;
            }
            idx = next;
        }
    }

    /// The chunk below the end of a new chunk `[addr, addr + size)` (which ends at or before
    /// `addr`), if any. Fails if the new chunk is empty, not aligned to [`ALIGNMENT`] or
    /// overlaps a chunk already held.
    fn chunk_below_new(&self, addr: u64, size: u64) -> Result<Option<(u64, Chunk)>> {
        let align = ALIGNMENT as u64;
        let end = addr.checked_add(size).filter(|_| size > 0 && addr % align == 0 && size % align == 0);
        let Some(end) = end else {
            return Err(Error::Internal(format!(
                "chunk {addr:#x}+{size} is empty, unaligned or wraps around"
            )));
        };
        let below = self.chunks.before(end).copied();
        if below.is_some_and(|(a, c)| a + c.size > addr) {
            return Err(Error::Internal(format!("chunk {addr:#x}+{size} overlaps a chunk already held")));
        }
        Ok(below)
    }

    fn insert_chunk(&mut self, class: Class, addr: u64, size: u64, segment: bool) -> Result<()> {
        self.chunk_below_new(addr, size)?;
        let slot = self
            .new_slot(Slot { addr, size, prev: NIL, next: NIL, state: State::Free, class })
            .ok_or_else(|| Error::InvalidArgument("too many blocks (2^32 - 1)".into()))?;
        self.chunks.insert(addr, Chunk { size, first: slot, segment });
        self.free_list(class).insert(size, addr, slot);
        self.reserved += size;
        self.cached += size;
        Ok(())
    }

    /// The smallest free block that fits `size` bytes (rounded up), split when the remainder
    /// is large enough, passing over the frontier block of the request's class (see
    /// [`BestFitPolicy::set_frontier`]), which [`BestFitPolicy::allocate_frontier`] serves.
    /// `None` when no free block fits (the caller must grow) or for 0.
    pub fn allocate(&mut self, size: u64) -> Option<Grant> {
        let size = Self::round(size)?;
        let class = self.class_of(size);
        let found = self.fit_before_frontier(class, size).ok()?;
        self.grant(class, size, found)
    }

    /// Best fit for the rounded `size` in `class`'s free blocks, passing over the frontier
    /// block: `Ok` the block [`BestFitPolicy::allocate`] takes, `Err(Some)` the frontier block
    /// when only it fits, `Err(None)` when none does.
    fn fit_before_frontier(
        &self,
        class: Class,
        size: u64,
    ) -> std::result::Result<(At, Entry), Option<(At, Entry)>> {
        let list = self.free.get(class.index()).ok_or(None)?;
        let found = list.fit(size).ok_or(None)?;
        let (at, (block_size, addr, _)) = found;
        if addr + block_size != self.frontier(class) {
            return Ok(found);
        }
        list.after(at).ok_or(Some(found))
    }

    /// What a pool serves without its source: [`BestFitPolicy::allocate`], else an idle
    /// stitched chunk that fits ([`BestFitPolicy::reuse_stitched`]) and a block of it, else
    /// the frontier block ([`BestFitPolicy::allocate_frontier`]): the same block as those
    /// calls in turn, with one search of the free lists unless a stitched chunk is taken
    /// back (a miss that ends in the frontier block searched them twice). `Ok(None)` when
    /// nothing fits (the caller must grow) or for 0; the error of
    /// [`BestFitPolicy::reuse_stitched`].
    pub fn allocate_or_reuse(&mut self, size: u64) -> Result<Option<Grant>> {
        let Some(size) = Self::round(size) else { return Ok(None) };
        let class = self.class_of(size);
        // What `allocate` hands out, else the frontier block that `allocate_frontier` would.
        let frontier_block = match self.fit_before_frontier(class, size) {
            Ok(found) => return Ok(self.grant(class, size, found)),
            Err(frontier_block) => frontier_block,
        };
        if self.reuse_stitched(size)? {
            return Ok(self.allocate(size));
        }
        // No chunk was taken back: the free lists are as searched above.
        Ok(frontier_block.and_then(|found| self.grant(class, size, found)))
    }

    /// [`BestFitPolicy::allocate`], the frontier block included.
    pub fn allocate_frontier(&mut self, size: u64) -> Option<Grant> {
        let size = Self::round(size)?;
        let class = self.class_of(size);
        let found = self.free.get(class.index())?.fit(size)?;
        self.grant(class, size, found)
    }

    /// Sets the *frontier* of `class`: the end of the memory that its growths extend (a
    /// virtual-memory backing's mapped address where the run it maps next for the class
    /// begins; 0, the default: none). The free block of `class` that ends there, the frontier
    /// block, is handed out only when no other free block and no idle stitched chunk fits the
    /// request. A repeated workload then lays its blocks out alike in every pass: its first
    /// pass found memory beyond the frontier unmapped, later passes find it mapped and free,
    /// and neither hands it out while other memory fits (DESIGN.md, "Warm passes").
    pub fn set_frontier(&mut self, class: Class, end: u64) {
        if let Some(f) = self.frontier.get_mut(class.index()) {
            *f = end;
        }
    }

    /// The frontier of `class` (0: none).
    fn frontier(&self, class: Class) -> u64 {
        self.frontier.get(class.index()).copied().unwrap_or(0)
    }

    /// Where the frontier block of `class` starts: the frontier itself when no free block of
    /// the class ends there. 0 without a frontier.
    pub(super) fn frontier_start(&self, class: Class) -> u64 {
        let end = self.frontier(class);
        match end.checked_sub(1).and_then(|last| self.block_holding(last, class.index())) {
            Some((_, _, idx)) => {
                let s = self.slot(idx);
                if s.state == State::Free && s.class == class && s.addr + s.size == end {
                    s.addr
                } else {
                    end
                }
            }
            None => end,
        }
    }

    /// Hands out `size` bytes of `class` from the free block `found` (a [`FreeList::fit`]).
    fn grant(&mut self, class: Class, size: u64, found: (At, Entry)) -> Option<Grant> {
        let (at, (block_size, addr, slot)) = found;
        let mut granted = block_size;
        let remainder = block_size - size;
        let mut kept_in_list = false;
        if remainder >= self.min_split(class) {
            let next = self.slot(slot).next;
            let tail =
                Slot { addr: addr + size, size: remainder, prev: slot, next, state: State::Free, class };
            if let Some(t) = self.new_slot(tail) {
                if let Some(n) = self.slot_mut(next) {
                    n.prev = t;
                }
                // The remainder takes the block's place in the free list.
                self.free_list(class).replace(at, remainder, addr + size, t);
                kept_in_list = true;
                granted = size;
                if let Some(s) = self.slot_mut(slot) {
                    s.next = t;
                }
            }
        }
        if !kept_in_list {
            self.free_list(class).remove_at(at);
        }
        if let Some(s) = self.slot_mut(slot) {
            s.size = granted;
            s.state = State::Allocated;
        }
        self.allocated += granted;
        self.cached -= granted;
        Some(Grant { addr, size: granted, token: u64::from(slot) })
    }

    /// Hands out exactly `[addr, addr + size)` (`size` rounded up), which must lie inside one
    /// free block: what the block holds before `addr` and past the range stays free. It lets
    /// a framework hand an allocation out again at the address a recorded CUDA graph uses
    /// (PyTorch's cudagraph trees restore a private pool's allocations so). `None`, changing
    /// nothing, when the range is not inside one free block, is unaligned or is empty.
    pub fn allocate_at(&mut self, addr: u64, size: u64) -> Option<Grant> {
        let size = Self::round(size)?;
        let (_, _, idx) = self.free_block_around(addr, size)?;
        let b = self.slot(idx);
        let (class, end, b_end) = (b.class, addr + size, b.addr + b.size);
        let (left, right) = (b.addr < addr, end < b_end);
        // The slots of the parts are made first: without room nothing changes.
        let at = if left { self.new_slot(VACANT)? } else { idx };
        let tail = if right {
            match self.new_slot(VACANT) {
                Some(t) => t,
                None => {
                    if left {
                        self.vacate(at);
                    }
                    return None;
                }
            }
        } else {
            NIL
        };
        self.free_list(class).remove(b.size, b.addr);
        if left {
            // The part before `addr` keeps the block's slot, and so its chunk's first block.
            if let Some(s) = self.slot_mut(idx) {
                s.size = addr - b.addr;
                s.next = at;
            }
            self.free_list(class).insert(addr - b.addr, b.addr, idx);
        }
        let next = if right {
            if let Some(t) = self.slot_mut(tail) {
                *t = Slot { addr: end, size: b_end - end, prev: at, next: b.next, state: State::Free, class };
            }
            self.free_list(class).insert(b_end - end, end, tail);
            tail
        } else {
            b.next
        };
        if let Some(n) = self.slot_mut(b.next) {
            n.prev = if right { tail } else { at };
        }
        let prev = if left { idx } else { b.prev };
        if let Some(s) = self.slot_mut(at) {
            *s = Slot { addr, size, prev, next, state: State::Allocated, class };
        }
        self.allocated += size;
        self.cached -= size;
        Some(Grant { addr, size, token: u64::from(at) })
    }

    /// Whether a free block fits `size` bytes (rounded up): [`BestFitPolicy::allocate`] would
    /// serve it without growing.
    pub fn fits(&self, size: u64) -> bool {
        Self::round(size)
            .is_some_and(|s| self.free.get(self.class_of(s).index()).is_some_and(|l| l.fit(s).is_some()))
    }

    /// The size of the block of `token` if it is handed out and starts at `addr`.
    pub fn allocated_size(&self, token: u64, addr: u64) -> Option<u64> {
        let s = self.slot(u32::try_from(token).ok()?);
        (s.state == State::Allocated && s.addr == addr).then_some(s.size)
    }

    /// Frees the block of `token`, which must start at `addr`, and merges it with its free
    /// neighbours. Returns the block's size. Fails (a bug in the caller) if `token` is not a
    /// block handed out at `addr`.
    pub fn free(&mut self, token: u64, addr: u64) -> Result<u64> {
        let idx = u32::try_from(token).unwrap_or(NIL);
        let block = match self.slot(idx) {
            s if s.state == State::Allocated && s.addr == addr => s,
            _ => {
                return Err(Error::Internal(format!(
                    "free of {addr:#x} (token {token}), which is not allocated: this is a bug in the caller"
                )))
            }
        };
        self.allocated -= block.size;
        self.cached += block.size;
        let class = block.class;
        let mut keep = idx;
        let mut merged = Slot { state: State::Free, ..block };
        // The list entry of a merged neighbour, which the merged block takes over.
        let mut entry = None;
        let next = self.slot(block.next);
        if next.state == State::Free {
            entry = self.free_list(class).position(next.size, next.addr);
            merged.size += next.size;
            merged.next = next.next;
            self.vacate(block.next);
        }
        let prev = self.slot(block.prev);
        if prev.state == State::Free {
            let list = self.free_list(class);
            if let Some(i) = entry {
                list.remove_at(i);
            }
            entry = list.position(prev.size, prev.addr);
            self.vacate(keep);
            keep = block.prev;
            merged = Slot { addr: prev.addr, size: prev.size + merged.size, prev: prev.prev, ..merged };
        }
        if let Some(n) = self.slot_mut(merged.next) {
            n.prev = keep;
        }
        if let Some(s) = self.slot_mut(keep) {
            *s = merged;
        }
        match entry {
            Some(i) => self.free_list(class).replace(i, merged.size, merged.addr, keep),
            None => self.free_list(class).insert(merged.size, merged.addr, keep),
        }
        if merged.prev == NIL && merged.next == NIL && !self.stitches.is_empty() {
            // A whole chunk is free: a stitched one gives its memory back home.
            self.settle_stitched(merged.addr)?;
        }
        Ok(block.size)
    }

    /// Removes every wholly free chunk and returns them, for the caller to give back to its
    /// source (or to [`restore_chunk`](BestFitPolicy::restore_chunk) when it cannot). Chunks
    /// with any block handed out stay.
    pub fn release_free_chunks(&mut self) -> Vec<TakenChunk> {
        let mut released = Vec::new();
        let Self { slots, vacant, free, chunks, reserved, cached, .. } = self;
        chunks.0.retain(|&(addr, ref chunk)| {
            let Some(first) = slots.get_mut(chunk.first as usize) else {
                return true;
            };
            if first.state != State::Free || first.size != chunk.size {
                return true;
            }
            let class = first.class;
            if let Some(list) = free.get_mut(class.index()) {
                list.remove(first.size, addr);
            }
            *first = VACANT;
            vacant.push(chunk.first);
            *reserved -= chunk.size;
            *cached -= chunk.size;
            released.push(TakenChunk { class, addr, size: chunk.size, segment: chunk.segment });
            false
        });
        released
    }

    /// Puts back, wholly free, a chunk [`release_free_chunks`](BestFitPolicy::release_free_chunks)
    /// took. Fails as [`BestFitPolicy::add_chunk`] does.
    pub fn restore_chunk(&mut self, chunk: TakenChunk) -> Result<()> {
        self.insert_chunk(chunk.class, chunk.addr, chunk.size, chunk.segment)
    }

    /// Removes the smallest wholly free chunk (not a segment) of the class of `size` that
    /// could serve `size` bytes, without returning it anywhere: the caller hands it to another
    /// policy with [`BestFitPolicy::add_chunk`]. `None` if there is none.
    pub fn take_free_chunk(&mut self, size: u64) -> Option<(Class, AddrRange)> {
        let size = Self::round(size)?;
        let class = self.class_of(size);
        let Self { slots, vacant, free, chunks, reserved, cached, .. } = self;
        let list = free.get_mut(class.index())?;
        let (block_size, addr, slot) =
            list.from(size).find(|&(n, a, _)| chunks.get(&a).is_some_and(|c| c.size == n && !c.segment))?;
        list.remove(block_size, addr);
        chunks.remove(&addr);
        if let Some(s) = slots.get_mut(slot as usize) {
            *s = VACANT;
        }
        vacant.push(slot);
        *reserved -= block_size;
        *cached -= block_size;
        Some((class, AddrRange::new(addr, block_size)))
    }

    /// Every free block, with its class, in no particular order.
    pub fn free_blocks(&self) -> impl Iterator<Item = (Class, AddrRange)> + '_ {
        self.free.iter().zip([Class::Small, Class::Large]).flat_map(|(list, class)| {
            list.bins.iter().flatten().map(move |&(s, a, _)| (class, AddrRange::new(a, s)))
        })
    }

    /// The chunk that ends at `end`, if any: its start, class and the free bytes at its end.
    pub fn chunk_ending_at(&self, end: u64) -> Option<(u64, Class, u64)> {
        let &(addr, chunk) = self.chunks.before(end).filter(|(a, c)| a + c.size == end)?;
        let tail = self.slot(self.last_block(chunk.first));
        Some((addr, tail.class, if tail.state == State::Free { tail.size } else { 0 }))
    }

    /// The chunk that starts at `addr`, if any: its size, class and the free bytes at its start.
    pub fn chunk_at(&self, addr: u64) -> Option<(u64, Class, u64)> {
        let chunk = self.chunks.get(&addr)?;
        let head = self.slot(chunk.first);
        Some((chunk.size, head.class, if head.state == State::Free { head.size } else { 0 }))
    }

    /// Takes `[addr, addr + size)`, which must lie inside one free block, out of the pool:
    /// its chunk ends at `addr` and a new chunk (a segment if the old one was) starts at
    /// `addr + size`, each only if not empty. The caller gives the range back to its source
    /// (a virtual-memory backing unmaps it). Fails, changing nothing, if the range is empty,
    /// unaligned or not inside one free block.
    pub fn carve(&mut self, addr: u64, size: u64) -> Result<()> {
        let end = addr.checked_add(size).unwrap_or(0);
        let Some((start, chunk, idx)) = self.free_block_around(addr, size) else {
            return Err(Error::Internal(format!("{addr:#x}+{size} is not inside one free block")));
        };
        let b = self.slot(idx);
        self.free_list(b.class).remove(b.size, b.addr);
        // The right part: a new chunk from `end` to the old chunk's end.
        let right_first = if b.addr + b.size > end {
            let r = Slot {
                addr: end,
                size: b.addr + b.size - end,
                prev: NIL,
                next: b.next,
                state: State::Free,
                class: b.class,
            };
            let r_idx = self
                .new_slot(r)
                .ok_or_else(|| Error::InvalidArgument("too many blocks (2^32 - 1)".into()))?;
            if let Some(n) = self.slot_mut(b.next) {
                n.prev = r_idx;
            }
            self.free_list(b.class).insert(r.size, r.addr, r_idx);
            r_idx
        } else {
            if let Some(n) = self.slot_mut(b.next) {
                n.prev = NIL;
            }
            b.next
        };
        // The left part: the old chunk, ending at `addr`.
        if b.addr < addr {
            if let Some(s) = self.slot_mut(idx) {
                s.size = addr - b.addr;
                s.next = NIL;
            }
            self.free_list(b.class).insert(addr - b.addr, b.addr, idx);
        } else {
            if let Some(p) = self.slot_mut(b.prev) {
                p.next = NIL;
            }
            self.vacate(idx);
        }
        if addr > start {
            if let Some(c) = self.chunks.get_mut(&start) {
                c.size = addr - start;
            }
        } else {
            self.chunks.remove(&start);
        }
        if right_first != NIL {
            self.chunks.insert(
                end,
                Chunk { size: start + chunk.size - end, first: right_first, segment: chunk.segment },
            );
        }
        self.reserved -= size;
        self.cached -= size;
        Ok(())
    }

    /// The chunk (start and entry) and the slot of the free block that holds
    /// `[addr, addr + size)`, if that range is non-empty, aligned and inside one free block.
    fn free_block_around(&self, addr: u64, size: u64) -> Option<(u64, Chunk, u32)> {
        let end = addr.checked_add(size)?;
        if size == 0 || addr % ALIGNMENT as u64 != 0 || size % ALIGNMENT as u64 != 0 {
            return None;
        }
        let (start, chunk, idx) = self.block_holding(addr, HOMES)?;
        let s = self.slot(idx);
        (s.state == State::Free && s.addr + s.size >= end).then_some((start, chunk, idx))
    }

    /// The chunk (start and entry) and the slot of the block, free or not, that holds `addr`.
    /// The walk through the chunk's blocks starts at the nearest of its first block and the
    /// blocks the fingers hold, and leaves `fingers[finger]` at the block found.
    fn block_holding(&self, addr: u64, finger: usize) -> Option<(u64, Chunk, u32)> {
        let &(start, chunk) = self.chunks.at_or_below(addr).filter(|(a, c)| a + c.size > addr)?;
        // Start from the nearest (by address) of the chunk's first block and the blocks the
        // fingers hold that are live blocks of the chunk.
        let mut idx = chunk.first;
        let mut distance = addr - start;
        for f in &self.fingers {
            let hint = f.0.load(Ordering::Relaxed);
            let h = self.slot(hint);
            if h.state != State::Vacant && h.addr >= start && h.addr < start + chunk.size {
                let d = h.addr.abs_diff(addr);
                if d < distance {
                    (idx, distance) = (hint, d);
                }
            }
        }
        let finger = self.fingers.get(finger)?;
        // Backwards to the block that starts at or below `addr`, then forwards to the one
        // that holds it (blocks tile their chunk).
        loop {
            #[cfg(test)]
            self.walked.fetch_add(1, Ordering::Relaxed);
            let s = self.slot(idx);
            if s.state == State::Vacant {
                return None;
            }
            if s.addr <= addr {
                break;
            }
            idx = s.prev;
        }
        loop {
            #[cfg(test)]
            self.walked.fetch_add(1, Ordering::Relaxed);
            let s = self.slot(idx);
            if s.state == State::Vacant {
                return None;
            }
            if s.addr + s.size > addr {
                finger.0.store(idx, Ordering::Relaxed);
                return Some((start, chunk, idx));
            }
            idx = s.next;
        }
    }

    /// Every chunk held, whether free or not, in address order.
    pub fn chunks(&self) -> impl Iterator<Item = AddrRange> + '_ {
        self.chunks.0.iter().map(|&(a, c)| AddrRange::new(a, c.size))
    }

    /// Every chunk held, in address order, with its blocks in address order.
    pub fn chunk_blocks(&self) -> impl Iterator<Item = (AddrRange, Vec<ChunkBlock>)> + '_ {
        self.chunks.0.iter().map(|&(addr, chunk)| {
            let mut blocks = Vec::new();
            let mut idx = chunk.first;
            while idx != NIL {
                let slot = self.slot(idx);
                let range = AddrRange::new(slot.addr, slot.size);
                blocks.push(ChunkBlock { range, allocated: slot.state == State::Allocated });
                idx = slot.next;
            }
            (AddrRange::new(addr, chunk.size), blocks)
        })
    }

    /// What the policy holds now. O(1).
    pub fn figures(&self) -> Figures {
        Figures {
            reserved: self.reserved,
            allocated: self.allocated,
            cached: self.cached,
            largest_free: self.free.iter().map(FreeList::largest).max().unwrap_or(0),
            chunks: self.chunks.0.len(),
        }
    }

    fn free_list(&mut self, class: Class) -> &mut FreeList {
        let [small, large] = &mut self.free;
        match class {
            Class::Small => small,
            Class::Large => large,
        }
    }

    /// A copy of slot `idx`; a vacant slot for `NIL` or out of range.
    fn slot(&self, idx: u32) -> Slot {
        self.slots.get(idx as usize).copied().unwrap_or(VACANT)
    }

    fn slot_mut(&mut self, idx: u32) -> Option<&mut Slot> {
        self.slots.get_mut(idx as usize)
    }

    /// Stores `s` in a recycled or new slot; `None` when 2^32 - 1 slots are in use.
    fn new_slot(&mut self, s: Slot) -> Option<u32> {
        if let Some(idx) = self.vacant.pop() {
            if let Some(slot) = self.slot_mut(idx) {
                *slot = s;
                return Some(idx);
            }
        }
        let idx = u32::try_from(self.slots.len()).ok().filter(|&i| i != NIL)?;
        self.slots.push(s);
        Some(idx)
    }

    fn vacate(&mut self, idx: u32) {
        if let Some(s) = self.slot_mut(idx) {
            *s = VACANT;
            self.vacant.push(idx);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    /// The chunks [`BestFitPolicy::release_free_chunks`] takes.
    fn taken(p: &mut BestFitPolicy) -> Vec<AddrRange> {
        p.release_free_chunks().into_iter().map(|c| AddrRange::new(c.addr, c.size)).collect()
    }

    impl BestFitPolicy {
        /// Joins the chunk that starts at `addr` with the chunk that starts at its end, so that
        /// blocks merge across them: the reference [`BestFitPolicy::add_joined`] is compared
        /// with (a segment added, then joined on each side). Fails, changing nothing, if there
        /// are not two such chunks of one class.
        pub(super) fn join(&mut self, addr: u64) -> Result<()> {
            let bad = || Error::Internal(format!("no two chunks of one class meet at the end of {addr:#x}"));
            let left = *self.chunks.get(&addr).ok_or_else(bad)?;
            let right_at = addr + left.size;
            let right = *self.chunks.get(&right_at).ok_or_else(bad)?;
            let last = self.last_block(left.first);
            let (l, r) = (self.slot(last), self.slot(right.first));
            if l.class != r.class {
                return Err(bad());
            }
            self.chunks.remove(&right_at);
            if let Some(c) = self.chunks.get_mut(&addr) {
                c.size += right.size;
            }
            if l.state == State::Free && r.state == State::Free {
                let list = self.free_list(l.class);
                list.remove(l.size, l.addr);
                list.remove(r.size, r.addr);
                list.insert(l.size + r.size, l.addr, last);
                if let Some(n) = self.slot_mut(r.next) {
                    n.prev = last;
                }
                if let Some(s) = self.slot_mut(last) {
                    s.size += r.size;
                    s.next = r.next;
                }
                self.vacate(right.first);
            } else {
                if let Some(s) = self.slot_mut(last) {
                    s.next = right.first;
                }
                if let Some(s) = self.slot_mut(right.first) {
                    s.prev = last;
                }
            }
            Ok(())
        }

        /// Checks every invariant; panics with a description on the first broken one.
        pub(super) fn check(&self) {
            let (mut reserved, mut allocated, mut cached, mut free_blocks) = (0, 0, 0, 0);
            let mut last_end = 0;
            for &(addr, chunk) in &self.chunks.0 {
                assert!(addr >= last_end, "chunks overlap at {addr:#x}");
                last_end = addr + chunk.size;
                reserved += chunk.size;
                let mut idx = chunk.first;
                let mut expected = addr;
                let mut prev = NIL;
                let mut prev_free = false;
                while idx != NIL {
                    let s = self.slots[idx as usize];
                    assert_eq!(s.addr, expected, "block not contiguous");
                    assert_eq!(s.prev, prev, "broken back link");
                    assert!(s.size > 0 && s.size % ALIGNMENT as u64 == 0);
                    match s.state {
                        State::Free => {
                            assert!(!prev_free, "two adjacent free blocks at {:#x}", s.addr);
                            let list = &self.free[s.class.index()];
                            let at = list
                                .position(s.size, s.addr)
                                .unwrap_or_else(|| panic!("free block {idx} not in its list"));
                            assert_eq!(list.get(at).map(|e| e.2), Some(idx));
                            cached += s.size;
                            free_blocks += 1;
                        }
                        State::Allocated => allocated += s.size,
                        State::Vacant => panic!("vacant slot linked in a chunk"),
                    }
                    prev_free = s.state == State::Free;
                    expected += s.size;
                    prev = idx;
                    idx = s.next;
                }
                assert_eq!(expected, addr + chunk.size, "blocks do not add up to the chunk");
            }
            let mut listed = 0;
            for list in &self.free {
                for (b, bin) in list.bins.iter().enumerate() {
                    assert_eq!(list.filled_from(b) == Some(b), !bin.is_empty(), "bitmap wrong for bin {b}");
                    assert!(bin.iter().all(|&(s, _, _)| bin_of(s) == b), "entry in the wrong bin");
                    assert!(
                        bin.windows(2).all(|w| order(w[0].0, w[0].1) < order(w[1].0, w[1].1)),
                        "bin unsorted"
                    );
                    listed += bin.len();
                }
            }
            assert_eq!(free_blocks, listed, "stale free-list entries");
            self.stitches.check();
            assert_eq!((reserved, allocated, cached), (self.reserved, self.allocated, self.cached));
            assert_eq!(reserved, allocated + cached);
        }
    }

    fn classes() -> Classes {
        Classes::default()
    }

    #[test]
    fn policy_is_send_and_sync() {
        // A pool's policy lives under its lock; read-only queries may come from any thread.
        fn shared<T: Send + Sync>() {}
        shared::<BestFitPolicy>();
    }

    #[test]
    fn bins_follow_size_order() {
        let sizes = (1..20_000u64).map(|k| k * 256).chain((23..48).map(|p| (1u64 << p) - 256));
        let mut last = (0, 0);
        for size in sizes {
            let bin = bin_of(size);
            assert!(bin >= last.1, "{size} in bin {bin}, before {} in bin {}", last.0, last.1);
            last = (size, bin);
        }
        assert_eq!(bin_of(1 << 20), bin_of((1 << 20) + (1 << 18) - 1), "four bins per doubling");
        assert_eq!(bin_of(1 << 20) + 1, bin_of((1 << 20) + (1 << 18)));
    }

    #[test]
    fn rounds_to_alignment() {
        assert_eq!(BestFitPolicy::round(0), None);
        assert_eq!(BestFitPolicy::round(1), Some(256));
        assert_eq!(BestFitPolicy::round(256), Some(256));
        assert_eq!(BestFitPolicy::round(257), Some(512));
        assert_eq!(BestFitPolicy::round(u64::MAX), None);
    }

    #[test]
    fn growth_for_each_size() {
        let p = BestFitPolicy::new(classes());
        assert_eq!(p.growth_for(1), Some(Growth { class: Class::Small, size: 2 * MIB, own: false }));
        assert_eq!(p.growth_for(MIB), Some(Growth { class: Class::Small, size: 2 * MIB, own: false }));
        assert_eq!(p.growth_for(MIB + 1), Some(Growth { class: Class::Large, size: 32 * MIB, own: false }));
        assert_eq!(p.growth_for(32 * MIB), Some(Growth { class: Class::Large, size: 32 * MIB, own: false }));
        assert_eq!(
            p.growth_for(32 * MIB + 1),
            Some(Growth { class: Class::Large, size: 34 * MIB, own: true })
        );
        assert_eq!(p.growth_for(0), None);
        assert_eq!(p.growth_for(u64::MAX - 100), None);
    }

    #[test]
    fn validates_classes() {
        assert!(classes().validate().is_ok());
        assert!(Classes { small_chunk: MIB / 2, ..classes() }.validate().is_err());
        assert!(Classes { growth: MIB, ..classes() }.validate().is_err());
        assert!(Classes { small_max: 0, ..classes() }.validate().is_err());
        assert!(Classes { growth: 32 * MIB + 1, ..classes() }.validate().is_err());
    }

    #[test]
    fn empty_policy_asks_to_grow() {
        let mut p = BestFitPolicy::new(classes());
        assert_eq!(p.allocate(100), None);
        assert_eq!(p.allocate(0), None);
        assert_eq!(p.figures(), Figures::default());
    }

    #[test]
    fn split_hands_out_low_end() {
        let mut p = BestFitPolicy::new(classes());
        p.add_chunk(Class::Small, 0x1000_0000, 2 * MIB).unwrap();
        let a = p.allocate(1000).unwrap();
        assert_eq!((a.addr, a.size), (0x1000_0000, 1024));
        let b = p.allocate(256).unwrap();
        assert_eq!((b.addr, b.size), (0x1000_0400, 256));
        p.check();
        let f = p.figures();
        assert_eq!((f.reserved, f.allocated, f.cached), (2 * MIB, 1280, 2 * MIB - 1280));
        assert_eq!(f.largest_free, 2 * MIB - 1280);
    }

    #[test]
    fn large_block_not_split_below_min_remainder() {
        let mut p = BestFitPolicy::new(classes());
        p.add_chunk(Class::Large, 0, 20 * MIB).unwrap();
        let a = p.allocate(19 * MIB).unwrap();
        assert_eq!(a.size, 20 * MIB, "a 1 MiB remainder is not split off");
        p.free(a.token, a.addr).unwrap();
        let b = p.allocate(18 * MIB).unwrap();
        assert_eq!(b.size, 18 * MIB, "a 2 MiB remainder is");
        p.check();
    }

    #[test]
    fn coalesces_both_sides() {
        let mut p = BestFitPolicy::new(classes());
        p.add_chunk(Class::Small, 0, 2 * MIB).unwrap();
        let a = p.allocate(4096).unwrap();
        let b = p.allocate(4096).unwrap();
        let c = p.allocate(4096).unwrap();
        let d = p.allocate(4096).unwrap();
        p.free(a.token, a.addr).unwrap();
        p.free(c.token, c.addr).unwrap();
        p.check();
        assert_eq!(
            p.free[0].bins.iter().map(Vec::len).sum::<usize>(),
            3,
            "a, c and the tail are separate free blocks"
        );
        p.free(b.token, b.addr).unwrap();
        p.check();
        assert_eq!(p.free[0].bins.iter().map(Vec::len).sum::<usize>(), 2, "a, b and c merged");
        assert_eq!(p.figures().largest_free, 2 * MIB - 4 * 4096);
        p.free(d.token, d.addr).unwrap();
        p.check();
        assert_eq!(p.free[0].bins.iter().map(Vec::len).sum::<usize>(), 1);
        assert_eq!(p.figures().largest_free, 2 * MIB);
    }

    #[test]
    fn the_frontier_block_is_handed_out_last() {
        // A 6 MiB hole and the 4 MiB free block at the segment's end, where it grows.
        let grants = |p: &mut BestFitPolicy| {
            p.add_segment(Class::Large, 0, 16 * MIB).unwrap();
            let g: Vec<Grant> = [2, 6, 4].iter().map(|&n| p.allocate(n * MIB).unwrap()).collect();
            p.free(g[1].token, g[1].addr).unwrap();
        };
        let mut plain = BestFitPolicy::new(classes());
        grants(&mut plain);
        assert_eq!(plain.allocate(3 * MIB).map(|g| g.addr), Some(12 * MIB), "best fit: the smallest");
        let mut p = BestFitPolicy::new(classes());
        grants(&mut p);
        p.set_frontier(Class::Large, 16 * MIB);
        assert_eq!(p.allocate(3 * MIB).map(|g| g.addr), Some(2 * MIB), "the hole first");
        assert_eq!(p.allocate(4 * MIB), None, "only the frontier block fits");
        assert_eq!(p.allocate_frontier(4 * MIB).map(|g| g.addr), Some(12 * MIB));
        p.check();
    }

    #[test]
    fn block_lookups_walk_from_the_block_found_last() {
        // A segment of 2000 blocks; the last one, the frontier block, is free.
        let n = 2000;
        let mut p = BestFitPolicy::new(classes());
        p.add_segment(Class::Large, 0, n * 2 * MIB).unwrap();
        let grants: Vec<Grant> = (0..n).map(|_| p.allocate(2 * MIB).unwrap()).collect();
        let last = grants.last().unwrap();
        p.free(last.token, last.addr).unwrap();
        p.set_frontier(Class::Large, n * 2 * MIB);
        let walked = |p: &BestFitPolicy| p.walked.load(Ordering::Relaxed);
        // The first lookup walks the segment; the next ones start where it ended.
        for _ in 0..100 {
            assert_eq!(p.frontier_start(Class::Large), (n - 1) * 2 * MIB);
        }
        assert!(walked(&p) < n + 2 * 100, "{} blocks walked for 100 lookups", walked(&p));
        // Any address, forwards or backwards from the last one found: the block that holds
        // it, a few steps away when that is near, and from the nearest of the chunk's first
        // block and the fingers' blocks when not.
        let start = walked(&p);
        for k in [1999, 3, 1500, 1501, 1499, 0, 7, 6, 1998] {
            let before = walked(&p);
            let (start, _, idx) = p.block_holding(k * 2 * MIB + 4096, HOMES).unwrap();
            assert_eq!((start, p.slot(idx).addr), (0, k * 2 * MIB));
            if [1501, 1499, 6].contains(&k) {
                assert!(walked(&p) - before <= 4, "{} blocks walked", walked(&p) - before);
            }
        }
        assert!(walked(&p) - start < 1000, "{} blocks walked for 9 lookups", walked(&p) - start);
        assert!(p.block_holding(n * 2 * MIB, HOMES).is_none(), "past the segment");
        p.check();
    }

    #[test]
    fn best_fit_picks_smallest_fitting_block() {
        let mut p = BestFitPolicy::new(classes());
        p.add_chunk(Class::Small, 0, 2 * MIB).unwrap();
        // Free holes of 64 KiB, 16 KiB and 32 KiB separated by live blocks.
        let sizes = [64 << 10, 4096, 16 << 10, 4096, 32 << 10, 4096];
        let grants: Vec<Grant> = sizes.iter().map(|&s| p.allocate(s).unwrap()).collect();
        for i in [0, 2, 4] {
            p.free(grants[i].token, grants[i].addr).unwrap();
        }
        let g = p.allocate(10 << 10).unwrap();
        assert_eq!(g.addr, grants[2].addr, "the 16 KiB hole is the best fit");
        let g = p.allocate(20 << 10).unwrap();
        assert_eq!(g.addr, grants[4].addr, "the 32 KiB hole is the best fit");
        let g = p.allocate(64 << 10).unwrap();
        assert_eq!(g.addr, grants[0].addr);
        p.check();
    }

    #[test]
    fn small_and_large_classes_are_separate() {
        let mut p = BestFitPolicy::new(classes());
        p.add_chunk(Class::Large, 128 * MIB, 20 * MIB).unwrap();
        assert_eq!(p.allocate(4096), None, "small requests never use large chunks");
        assert_eq!(taken(&mut p), vec![AddrRange::new(128 * MIB, 20 * MIB)]);
        p.add_chunk(Class::Small, 64 * MIB, 2 * MIB).unwrap();
        assert_eq!(p.allocate(MIB + 256), None, "large requests never use small chunks");
        p.add_chunk(Class::Large, 0, 20 * MIB).unwrap();
        let s = p.allocate(MIB).unwrap();
        p.free(s.token, s.addr).unwrap();
        let l = p.allocate(19 * MIB).unwrap();
        assert_eq!(p.allocate(4096).map(|g| g.addr), Some(64 * MIB), "small chunk, not the large one");
        p.free(l.token, l.addr).unwrap();
        let s = p.allocate(MIB).unwrap();
        assert!(s.addr >= 64 * MIB);
        let l = p.allocate(MIB + 1).unwrap();
        assert!(l.addr < 20 * MIB);
        p.check();
    }

    #[test]
    fn segments_grow_at_their_end_and_stay_in_their_pool() {
        let mut p = BestFitPolicy::new(classes());
        p.add_segment(Class::Large, 64 * MIB, 4 * MIB).unwrap();
        let a = p.allocate(2 * MIB).unwrap();
        assert_eq!(p.segment_tail_free(64 * MIB), Some(2 * MIB));
        assert_eq!(p.segment_tail_free(0), None);
        // The free tail and the growth make one block.
        assert!(p.allocate(5 * MIB).is_none());
        p.extend_segment(64 * MIB, 4 * MIB).unwrap();
        p.check();
        let b = p.allocate(5 * MIB).unwrap();
        assert_eq!((b.addr, b.size), (66 * MIB, 6 * MIB), "a remainder of 1 MiB is not split off");
        assert_eq!(p.segment_tail_free(64 * MIB), Some(0));
        // A growth after a handed-out last block is a block of its own, which merges with the
        // blocks before it once they are free.
        p.extend_segment(64 * MIB, 2 * MIB).unwrap();
        p.check();
        assert_eq!(p.segment_tail_free(64 * MIB), Some(2 * MIB));
        p.free(b.token, b.addr).unwrap();
        assert_eq!(p.segment_tail_free(64 * MIB), Some(8 * MIB));
        p.free(a.token, a.addr).unwrap();
        p.check();
        assert_eq!(p.figures().largest_free, 10 * MIB);
        // Never given to another pool, but released when wholly free.
        assert_eq!(p.take_free_chunk(2 * MIB), None);
        assert_eq!(taken(&mut p), vec![AddrRange::new(64 * MIB, 10 * MIB)]);
        // Growth into another chunk, or of what is not a segment, is refused.
        p.add_segment(Class::Large, 64 * MIB, 2 * MIB).unwrap();
        p.add_chunk(Class::Large, 68 * MIB, 2 * MIB).unwrap();
        assert!(p.extend_segment(64 * MIB, 4 * MIB).is_err());
        assert!(p.extend_segment(68 * MIB, 2 * MIB).is_err());
        assert!(p.extend_segment(64 * MIB, 100).is_err());
        p.check();
    }

    #[test]
    fn release_returns_only_wholly_free_chunks() {
        let mut p = BestFitPolicy::new(classes());
        p.add_chunk(Class::Small, 0, 2 * MIB).unwrap();
        p.add_chunk(Class::Large, 16 * MIB, 20 * MIB).unwrap();
        p.add_chunk(Class::Large, 64 * MIB, 20 * MIB).unwrap();
        let a = p.allocate(4096).unwrap();
        let b = p.allocate(4 * MIB).unwrap();
        let c = p.allocate(4 * MIB).unwrap();
        assert_eq!((b.addr, c.addr), (16 * MIB, 20 * MIB), "lowest address among equal fits");
        p.free(b.token, b.addr).unwrap();
        assert_eq!(taken(&mut p), vec![AddrRange::new(64 * MIB, 20 * MIB)]);
        p.check();
        p.free(a.token, a.addr).unwrap();
        p.free(c.token, c.addr).unwrap();
        assert_eq!(taken(&mut p), vec![AddrRange::new(0, 2 * MIB), AddrRange::new(16 * MIB, 20 * MIB)]);
        p.check();
        assert_eq!(p.figures(), Figures::default());
        assert!(taken(&mut p).is_empty());
    }

    #[test]
    fn rejects_bad_chunks_and_frees() {
        // The allocators above never ask for these: each is a broken invariant of ours.
        fn internal<T>(r: Result<T>) -> bool {
            matches!(r, Err(Error::Internal(_)))
        }
        let mut p = BestFitPolicy::new(classes());
        assert!(internal(p.add_chunk(Class::Small, 0, 0)));
        assert!(internal(p.add_chunk(Class::Small, 100, 2 * MIB)));
        assert!(internal(p.add_chunk(Class::Small, u64::MAX - 255, 512)));
        p.add_chunk(Class::Small, 4 * MIB, 2 * MIB).unwrap();
        assert!(internal(p.add_chunk(Class::Small, 5 * MIB, 2 * MIB)));
        assert!(internal(p.add_chunk(Class::Small, 3 * MIB, 2 * MIB)));
        p.add_chunk(Class::Small, 6 * MIB, 2 * MIB).unwrap();
        let a = p.allocate(256).unwrap();
        assert!(internal(p.free(a.token, a.addr + 256)), "wrong address");
        assert!(internal(p.free(a.token + 7, a.addr)), "free block's token");
        assert!(internal(p.free(u64::MAX, a.addr)));
        p.free(a.token, a.addr).unwrap();
        assert!(internal(p.free(a.token, a.addr)), "double free");
        p.check();
    }

    #[test]
    fn slots_are_recycled() {
        let mut p = BestFitPolicy::new(classes());
        p.add_chunk(Class::Small, 0, 2 * MIB).unwrap();
        for _ in 0..1000 {
            let a = p.allocate(512).unwrap();
            let b = p.allocate(4096).unwrap();
            p.free(a.token, a.addr).unwrap();
            p.free(b.token, b.addr).unwrap();
        }
        assert!(p.slots.len() <= 3, "slab grew to {}", p.slots.len());
        p.check();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Free(usize),
        Release,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u64..=64 << 10).prop_map(Op::Alloc),
            1 => (1u64..=2 * MIB).prop_map(Op::Alloc),
            1 => ((MIB + 1)..=30 * MIB).prop_map(Op::Alloc),
            4 => any::<usize>().prop_map(Op::Free),
            1 => Just(Op::Release),
        ]
    }

    #[test]
    fn allocate_at_hands_out_exactly_the_range_and_leaves_the_rest_free() {
        let mut p = BestFitPolicy::new(classes());
        p.add_chunk(Class::Large, 64 * MIB, 32 * MIB).unwrap();
        let a = p.allocate_at(70 * MIB, 8 * MIB).unwrap();
        assert_eq!((a.addr, a.size), (70 * MIB, 8 * MIB));
        p.check();
        assert_eq!(p.figures().allocated, 8 * MIB);
        assert_eq!(p.figures().largest_free, 18 * MIB, "free before and after it");
        assert!(p.allocate_at(76 * MIB, 4 * MIB).is_none(), "overlaps a block handed out");
        assert!(p.allocate_at(64 * MIB + 100, MIB).is_none(), "unaligned");
        assert!(p.allocate_at(200 * MIB, MIB).is_none(), "not held");
        assert!(p.allocate_at(90 * MIB, 8 * MIB).is_none(), "past the chunk's end");
        // The first and the last bytes of the chunk: no part left on one side.
        let first = p.allocate_at(64 * MIB, 6 * MIB).unwrap();
        let last = p.allocate_at(94 * MIB, 2 * MIB).unwrap();
        p.check();
        assert_eq!(p.figures().largest_free, 16 * MIB);
        for g in [a, first, last] {
            p.free(g.token, g.addr).unwrap();
        }
        p.check();
        assert_eq!(p.figures().largest_free, 32 * MIB, "one free block again");
        assert_eq!(p.figures().allocated, 0);
    }

    #[test]
    fn carve_splits_a_chunk_and_join_merges_it_back() {
        let mut p = BestFitPolicy::new(classes());
        p.add_segment(Class::Large, 64 * MIB, 12 * MIB).unwrap();
        let a = p.allocate(4 * MIB).unwrap();
        p.carve(68 * MIB, 2 * MIB).unwrap();
        p.check();
        assert_eq!(
            p.chunks().collect::<Vec<_>>(),
            [AddrRange::new(64 * MIB, 4 * MIB), AddrRange::new(70 * MIB, 6 * MIB)]
        );
        assert!(p.carve(64 * MIB, 2 * MIB).is_err(), "not free");
        assert!(p.carve(69 * MIB, 2 * MIB).is_err(), "not mapped");
        assert_eq!(p.chunk_ending_at(68 * MIB), Some((64 * MIB, Class::Large, 0)));
        assert_eq!(p.chunk_at(70 * MIB), Some((6 * MIB, Class::Large, 6 * MIB)));
        p.add_segment(Class::Large, 68 * MIB, 2 * MIB).unwrap();
        p.join(68 * MIB).unwrap();
        p.join(64 * MIB).unwrap();
        p.check();
        p.free(a.token, a.addr).unwrap();
        p.check();
        assert_eq!(p.figures().largest_free, 12 * MIB, "one free block again");
    }

    #[test]
    fn blocks_and_free_chunks_come_as_named_ranges() {
        let mut p = BestFitPolicy::new(classes());
        p.add_chunk(Class::Large, 64 * MIB, 12 * MIB).unwrap();
        p.add_chunk(Class::Large, 16 * MIB, 20 * MIB).unwrap();
        let a = p.allocate(4 * MIB).unwrap();
        assert_eq!(a.addr, 64 * MIB, "the smallest chunk that fits");
        let block = |addr, len, allocated| ChunkBlock { range: AddrRange::new(addr, len), allocated };
        assert_eq!(
            p.chunk_blocks().collect::<Vec<_>>(),
            [
                (AddrRange::new(16 * MIB, 20 * MIB), vec![block(16 * MIB, 20 * MIB, false)]),
                (
                    AddrRange::new(64 * MIB, 12 * MIB),
                    vec![block(64 * MIB, 4 * MIB, true), block(68 * MIB, 8 * MIB, false)]
                ),
            ]
        );
        let mut free: Vec<_> = p.free_blocks().collect();
        free.sort_unstable_by_key(|&(_, r)| r);
        let free_of = |addr, len| (Class::Large, AddrRange::new(addr, len));
        assert_eq!(free, [free_of(16 * MIB, 20 * MIB), free_of(68 * MIB, 8 * MIB)]);
        assert_eq!(p.take_free_chunk(2 * MIB), Some(free_of(16 * MIB, 20 * MIB)), "wholly free only");
        assert_eq!(p.take_free_chunk(2 * MIB), None);
        p.free(a.token, a.addr).unwrap();
        p.check();
    }

    proptest! {
        /// Any layout handed out once can be handed out again at its addresses, in any order,
        /// once its blocks are free (what restoring a CUDA graph pool's checkpoint asks).
        #[test]
        fn allocate_at_restores_an_earlier_layout(
            sizes in proptest::collection::vec(prop_oneof![1u64..=64 << 10, (MIB + 1)..=12 * MIB], 1..60),
            keep in proptest::collection::vec(any::<bool>(), 60),
            order in any::<u64>(),
        ) {
            let mut p = BestFitPolicy::new(classes());
            let mut next_addr = 1u64 << 32;
            let mut live = Vec::new();
            for size in sizes {
                let g = match p.allocate(size) {
                    Some(g) => g,
                    None => {
                        let growth = p.growth_for(size).unwrap();
                        p.add_chunk(growth.class, next_addr, growth.size).unwrap();
                        next_addr += growth.size + 2 * MIB;
                        p.allocate(size).unwrap()
                    }
                };
                live.push((g, size));
            }
            // Some blocks are freed (the checkpoint's allocations that died), the others stay.
            let (mut gone, stay): (Vec<_>, Vec<_>) =
                live.into_iter().enumerate().partition(|(i, _)| !keep[*i % keep.len()]);
            for (_, (g, _)) in &gone {
                p.free(g.token, g.addr).unwrap();
            }
            p.check();
            let n = gone.len().max(1) as u64;
            gone.rotate_left((order % n) as usize);
            let mut again = Vec::new();
            for (_, (g, size)) in &gone {
                let back = p.allocate_at(g.addr, *size);
                prop_assert!(back.is_some(), "{:#x}+{} not free again", g.addr, size);
                let back = back.unwrap();
                prop_assert_eq!(back.addr, g.addr);
                prop_assert!(back.size <= g.size && back.size >= *size);
                again.push(back);
                p.check();
            }
            let total: u64 = stay.iter().map(|(_, (g, _))| g.size).chain(again.iter().map(|g| g.size)).sum();
            prop_assert_eq!(p.figures().allocated, total);
            for g in stay.iter().map(|(_, (g, _))| *g).chain(again) {
                p.free(g.token, g.addr).unwrap();
            }
            p.check();
            prop_assert_eq!(p.figures().allocated, 0);
            prop_assert_eq!(p.figures().cached, p.figures().reserved);
        }

        #[test]
        fn random_sequences_keep_invariants(
            ops in proptest::collection::vec(op(), 1..300),
            growth in prop_oneof![Just(4 * MIB), Just(20 * MIB)],
            segments in any::<bool>(),
        ) {
            let mut p = BestFitPolicy::new(Classes { growth, ..classes() });
            let mut live: Vec<(Grant, u64)> = Vec::new();
            let mut next_addr = 1u64 << 32;
            // With `segments`, one segment per class, grown by what a request lacks (as
            // BestFit's expandable pools do), far from the chunks.
            let base = [1u64 << 40, 1u64 << 41];
            for op in ops {
                match op {
                    Op::Alloc(size) => {
                        let g = match p.allocate(size) {
                            Some(g) => g,
                            None => {
                                let growth = p.growth_for(size).unwrap();
                                let at = base[growth.class.index()];
                                if segments && !growth.own {
                                    let rounded = BestFitPolicy::round(size).unwrap();
                                    match p.segment_tail_free(at) {
                                        Some(tail) => {
                                            prop_assert!(tail < rounded);
                                            p.extend_segment(at, (rounded - tail).div_ceil(2 * MIB) * 2 * MIB).unwrap();
                                        }
                                        None => p.add_segment(growth.class, at, rounded.div_ceil(2 * MIB) * 2 * MIB).unwrap(),
                                    }
                                } else {
                                    p.add_chunk(growth.class, next_addr, growth.size).unwrap();
                                    // Leave a gap so that chunks are never adjacent.
                                    next_addr += growth.size + 2 * MIB;
                                }
                                p.allocate(size).unwrap()
                            }
                        };
                        prop_assert!(g.size >= size && g.size % 256 == 0);
                        live.push((g, size));
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let (g, _) = live.swap_remove(i % live.len());
                        prop_assert_eq!(p.free(g.token, g.addr).unwrap(), g.size);
                    }
                    Op::Free(_) => {}
                    Op::Release => {
                        for TakenChunk { addr, size, .. } in p.release_free_chunks() {
                            prop_assert!(live.iter().all(|(g, _)| g.addr + g.size <= addr || g.addr >= addr + size));
                        }
                    }
                }
                p.check();
                let mut sorted: Vec<Grant> = live.iter().map(|(g, _)| *g).collect();
                sorted.sort_by_key(|g| g.addr);
                prop_assert!(sorted.windows(2).all(|w| w[0].addr + w[0].size <= w[1].addr), "live blocks overlap");
                prop_assert_eq!(p.figures().allocated, live.iter().map(|(g, _)| g.size).sum::<u64>());
            }
        }
    }
}
