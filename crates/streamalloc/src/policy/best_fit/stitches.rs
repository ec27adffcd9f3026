//! Stitched chunks (GMLake's sBlocks): a chunk whose memory is that of *home* ranges taken
//! out of the pool ([`BestFitPolicy::carve`]) and mapped a second time, side by side, by the
//! caller. While any of its blocks is handed out, its homes stay out of the pool; once all are
//! free, the homes come back (joined with the chunks they meet) and the stitched chunk leaves
//! the pool, *idle*: its address stays mapped, and a later request that it fits takes it back
//! in ([`BestFitPolicy::reuse_stitched`]) as soon as all its homes are free, with no new
//! mapping. The policy never holds a home range and its stitched chunk at once, so no memory
//! is in two blocks.

use std::ops::RangeInclusive;

use super::sorted::Sorted;
use super::{BestFitPolicy, Chunk, Class, Slot, State, NIL};
use crate::error::{Error, Result};
use crate::policy::AddrRange;

/// The stitched chunks of a policy, in use or idle.
#[derive(Debug, Default)]
pub(super) struct Stitches {
    /// Every stitched chunk, by address.
    ranges: Sorted<u64, Stitch>,
    /// The idle ones, as `(size, addr)`, each with what reuse looks at first ([`Idle`]).
    /// Changed only through [`Stitches::add_idle`] and [`Stitches::remove_idle`], which count
    /// them by class.
    idle: Sorted<(u64, u64), Idle>,
    /// How many of `idle` are of each class ([`Class::index`]): a request of a class with none
    /// does not search them (a search reads memory of its own, about ten entries of the
    /// sorted vector).
    idle_of: [usize; 2],
    /// The homes of the stitched chunks in use (out of the pool while they are): start ->
    /// (length, the chunk's address).
    carved: Sorted<u64, (u64, u64)>,
    /// Counts additions and reuses, to tell the least recently used.
    tick: u64,
    /// The granule stitched chunks are made of (0 before the first).
    granule: u64,
    /// Stitched chunks looked up in `ranges` by reuse (what the tests count).
    #[cfg(test)]
    looked_up: u64,
    /// Searches of `idle` by reuse (what the tests count).
    #[cfg(test)]
    searched: u64,
}

/// What [`BestFitPolicy::reuse_stitched`] needs of an idle chunk before it looks the chunk up
/// in the stitched chunks: copies of its class, `made` and `top` (fixed once it is added),
/// and what kept it from being reused when it was last looked at.
#[derive(Debug, Clone, Copy)]
struct Idle {
    class: Class,
    made: u64,
    top: u64,
    blocker: Blocker,
}

#[derive(Debug)]
struct Stitch {
    size: u64,
    class: Class,
    /// The home ranges whose memory the chunk maps, in order, each with its class.
    homes: Vec<(Class, AddrRange)>,
    /// A chunk of the pool, rather than idle.
    active: bool,
    /// The tick of its addition or last reuse.
    used: u64,
    /// The tick of its addition.
    made: u64,
    /// The policy's frontier when it was added ([`BestFitPolicy::set_frontier`]).
    top: u64,
}

/// What kept an idle stitched chunk from being reused when it was last looked at. While it
/// still holds, which one slot of the policy tells without a search, the chunk is passed over:
/// a miss looks through many idle chunks, most of them with a home in use.
#[derive(Debug, Clone, Copy, Default)]
enum Blocker {
    /// Nothing known: its homes are looked up.
    #[default]
    Unknown,
    /// A home overlaps the block handed out in `slot`, at `addr`, of `size` bytes.
    Block { slot: u32, addr: u64, size: u64 },
    /// A home is memory of the stitched chunk at `addr`, in use, whose first block is in `slot`
    /// (the slot is vacated when the chunk leaves the pool).
    Stitch { slot: u32, addr: u64 },
}

impl Blocker {
    /// Whether it still keeps the chunk's homes from being free in `p`.
    fn holds(self, p: &BestFitPolicy) -> bool {
        match self {
            Blocker::Unknown => false,
            Blocker::Block { slot, addr, size } => {
                let s = p.slot(slot);
                s.state == State::Allocated && s.addr == addr && s.size == size
            }
            Blocker::Stitch { slot, addr } => {
                let s = p.slot(slot);
                s.state != State::Vacant && s.addr == addr
            }
        }
    }
}

impl Stitches {
    pub(super) fn is_empty(&self) -> bool {
        self.ranges.0.is_empty()
    }

    /// Adds an idle chunk, counted in its class.
    fn add_idle(&mut self, key: (u64, u64), idle: Idle) {
        if let Some(n) = self.idle_of.get_mut(idle.class.index()) {
            *n += 1;
        }
        if let Some(old) = self.idle.insert(key, idle) {
            // Not reached (a chunk goes idle once before it is reused or forgotten).
            if let Some(n) = self.idle_of.get_mut(old.class.index()) {
                *n -= 1;
            }
        }
    }

    /// Removes the idle chunk at `key`, counted in its class; it, if there was one.
    fn remove_idle(&mut self, key: &(u64, u64)) -> Option<Idle> {
        let removed = self.idle.remove(key)?;
        if let Some(n) = self.idle_of.get_mut(removed.class.index()) {
            *n -= 1;
        }
        Some(removed)
    }

    /// Panics if the idle chunks' counts by class are wrong (for the tests).
    #[cfg(test)]
    pub(super) fn check(&self) {
        for class in [Class::Small, Class::Large] {
            let idle = self.idle.0.iter().filter(|(_, e)| e.class == class).count();
            assert_eq!(self.idle_of.get(class.index()), Some(&idle), "idle chunks of {class:?} miscounted");
        }
    }

    /// Whether any idle chunk is of `class`.
    fn any_idle(&self, class: Class) -> bool {
        self.idle_of.get(class.index()).is_some_and(|&n| n > 0)
    }

    /// Forgets what kept idle chunks from reuse that names a stitched chunk: its address may
    /// be given to another once it is forgotten.
    fn forget_stitch_blockers(&mut self) {
        for (_, e) in &mut self.idle.0 {
            if matches!(e.blocker, Blocker::Stitch { .. }) {
                e.blocker = Blocker::Unknown;
            }
        }
    }
}

impl Stitch {
    /// Whether every home lies inside one free block of `p`; if not, what keeps the first
    /// home that does not from it (`carved`: the homes of the stitched chunks in use).
    fn free_homes(
        &self,
        p: &BestFitPolicy,
        carved: &Sorted<u64, (u64, u64)>,
    ) -> std::result::Result<(), Blocker> {
        for &(_, home) in &self.homes {
            let a = home.addr;
            let Some((_, _, idx)) = p.block_holding(a, super::HOMES) else {
                // Out of the pool: memory of a stitched chunk in use, or being stitched.
                let by = carved.at_or_below(a).filter(|&&(h, (len, _))| h + len > a);
                let first = by.and_then(|&(_, (_, at))| Some((p.chunks.get(&at)?.first, at)));
                return Err(first.map_or(Blocker::Unknown, |(slot, addr)| Blocker::Stitch { slot, addr }));
            };
            let s = p.slot(idx);
            if s.state == State::Free && s.addr + s.size >= home.end() {
                continue;
            }
            return Err(match s.state {
                State::Allocated => Blocker::Block { slot: idx, addr: s.addr, size: s.size },
                _ => Blocker::Unknown,
            });
        }
        Ok(())
    }
}

/// The idle chunks, as `(size, addr)`, that may serve a request of `size` bytes when stitched
/// chunks are made of `granule`-byte granules: from `size` bytes to the size a stitch for the
/// request would have (`size` rounded up to granules) or half as large again as the request,
/// whichever is more. See DESIGN.md, Note [idle range fit].
fn fitting(size: u64, granule: u64) -> RangeInclusive<(u64, u64)> {
    let g = granule.max(1);
    let stitch = size.div_ceil(g).saturating_mul(g);
    (size, 0)..=(stitch.max(size.saturating_add(size / 2)), u64::MAX)
}

impl BestFitPolicy {
    /// Adds `[addr, addr + size)` as a segment of `class` joined with the chunks of `class`
    /// that end at `addr` or start at its end (a virtual-memory backing mapped them back to
    /// back): the chunks and blocks of a segment added and then joined with each neighbour,
    /// made in place (the new bytes grow the free block they meet, the right chunk's blocks
    /// are linked after them). Fails, changing nothing, as [`BestFitPolicy::add_segment`]
    /// does.
    pub fn add_joined(&mut self, class: Class, addr: u64, size: u64) -> Result<()> {
        let below = self.chunk_below_new(addr, size)?;
        let end = addr + size;
        // The chunk that ends at `addr` and its last block, and the chunk that starts at `end`,
        // each when its block at `[addr, end)`'s side is of `class`.
        let left = below
            .filter(|&(a, c)| a + c.size == addr)
            .map(|(a, c)| (a, self.last_block(c.first)))
            .filter(|&(_, last)| self.slot(last).class == class);
        let right = self.chunks.get(&end).copied().filter(|c| self.slot(c.first).class == class);
        // The free block that holds the new bytes: the left chunk's last block grown, or a new one.
        let (keep, mut block) = match left.map(|(_, last)| (last, self.slot(last))) {
            Some((last, tail)) if tail.state == State::Free => {
                self.free_list(class).remove(tail.size, tail.addr);
                (last, Slot { size: tail.size + size, ..tail })
            }
            tail => {
                let prev = tail.map_or(NIL, |(last, _)| last);
                let b = Slot { addr, size, prev, next: NIL, state: State::Free, class };
                let idx = self
                    .new_slot(b)
                    .ok_or_else(|| Error::InvalidArgument("too many blocks (2^32 - 1)".into()))?;
                if let Some(t) = self.slot_mut(prev) {
                    t.next = idx;
                }
                (idx, b)
            }
        };
        if let Some(r) = right {
            let head = self.slot(r.first);
            if head.state == State::Free {
                self.free_list(class).remove(head.size, head.addr);
                block.size += head.size;
                block.next = head.next;
                self.vacate(r.first);
            } else {
                block.next = r.first;
            }
            if let Some(n) = self.slot_mut(block.next) {
                n.prev = keep;
            }
            self.chunks.remove(&end);
        }
        if let Some(s) = self.slot_mut(keep) {
            *s = block;
        }
        self.free_list(class).insert(block.size, block.addr, keep);
        let joined = size + right.map_or(0, |r| r.size);
        match left {
            Some((start, _)) => {
                if let Some(c) = self.chunks.get_mut(&start) {
                    c.size += joined;
                }
            }
            None => {
                self.chunks.insert(addr, Chunk { size: joined, first: keep, segment: true });
            }
        }
        self.reserved += size;
        self.cached += size;
        Ok(())
    }

    /// Adds the stitched chunk `[addr, addr + size)` of `class`, which maps the memory of
    /// `homes` (each with its class, taken out with [`BestFitPolicy::carve`]) in order, in
    /// granules of `granule` bytes (the same for every stitched chunk of a policy). It is
    /// never joined with another chunk, nor moved to another policy.
    pub fn add_stitched(
        &mut self,
        class: Class,
        addr: u64,
        size: u64,
        granule: u64,
        homes: Vec<(Class, AddrRange)>,
    ) -> Result<()> {
        self.add_segment(class, addr, size)?;
        let top = self.frontier(class);
        let st = &mut self.stitches;
        st.granule = granule;
        st.tick += 1;
        for &(_, h) in &homes {
            st.carved.insert(h.addr, (h.len, addr));
        }
        st.ranges
            .insert(addr, Stitch { size, class, homes, active: true, used: st.tick, made: st.tick, top });
        Ok(())
    }

    /// When the wholly free chunk at `addr` is a stitched one: its homes come back and it
    /// becomes idle.
    pub(super) fn settle_stitched(&mut self, addr: u64) -> Result<()> {
        let ranges = &mut self.stitches.ranges;
        let Some(at) = ranges.position(&addr) else { return Ok(()) };
        let Some((_, s)) = ranges.0.get_mut(at).filter(|(_, s)| s.active) else { return Ok(()) };
        // The homes leave the chunk's entry while they go back, and return to it (still at
        // `at`: nothing below adds or removes a stitched chunk) after.
        let (size, homes) = (s.size, std::mem::take(&mut s.homes));
        let idle = Idle { class: s.class, made: s.made, top: s.top, blocker: Blocker::Unknown };
        let settled = self
            .carve(addr, size)
            .and_then(|()| homes.iter().try_for_each(|&(class, h)| self.add_joined(class, h.addr, h.len)));
        let st = &mut self.stitches;
        if settled.is_ok() {
            for (_, h) in &homes {
                st.carved.remove(&h.addr);
            }
            st.add_idle((size, addr), idle);
        }
        if let Some((_, s)) = st.ranges.0.get_mut(at) {
            s.active = settled.is_err();
            s.homes = homes;
        }
        settled
    }

    /// Takes back into the pool, for a request of `size` bytes, an idle stitched chunk of its
    /// class that fits it (at most half as large again, or as large as a stitch for it would be) whose
    /// homes are all free (they leave the pool). Whether there was one.
    ///
    /// Without a frontier ([`BestFitPolicy::set_frontier`]), the smallest such chunk. With
    /// one, the oldest such chunk added while the frontier was below the end the request
    /// would have in the frontier block: memory mapped later than the chunk was added would
    /// serve the request otherwise. A repeated workload's later passes, which find that
    /// memory mapped, thus take the chunk its first pass stitched at the same request, and
    /// not one its first pass stitched later (DESIGN.md, "Warm passes").
    pub fn reuse_stitched(&mut self, size: u64) -> Result<bool> {
        let class = self.class_of(size);
        if !self.stitches.any_idle(class) {
            return Ok(false);
        }
        let frontier = self.frontier(class);
        // Where the request would end in the frontier block: looked up at the first candidate
        // (a walk through the blocks of the frontier's chunk).
        let mut reach = None;
        // The chunk's key, its place in `ranges` and the tick of its addition; what kept each
        // chunk passed over from reuse is noted in `idle`.
        let mut found: Option<((u64, u64), usize, u64)> = None;
        #[cfg(test)]
        {
            self.stitches.searched += 1;
        }
        for i in self.stitches.idle.bounds(&fitting(size, self.stitches.granule)) {
            let Some(&(key, e)) = self.stitches.idle.0.get(i) else { break };
            let older = found.is_none_or(|(_, _, made)| e.made < made);
            if e.class != class || (frontier != 0 && !older) {
                continue;
            }
            // Before the blocker, whose slot is memory of its own to read.
            if frontier != 0 {
                let reach = *reach.get_or_insert_with(|| self.frontier_start(class).saturating_add(size));
                if e.top >= reach {
                    continue;
                }
            }
            if e.blocker.holds(self) {
                continue;
            }
            #[cfg(test)]
            {
                self.stitches.looked_up += 1;
            }
            let Stitches { ranges, carved, .. } = &self.stitches;
            let Some(at) = ranges.position(&key.1) else { continue };
            let Some((_, s)) = ranges.0.get(at) else { continue };
            match s.free_homes(self, carved) {
                Ok(()) => {
                    found = Some((key, at, e.made));
                    if frontier == 0 {
                        break;
                    }
                }
                Err(b) => {
                    if let Some(e) = self.stitches.idle.0.get_mut(i) {
                        e.1.blocker = b;
                    }
                }
            }
        }
        let Some(((size, addr), at, _)) = found else { return Ok(false) };
        let Some((_, s)) = self.stitches.ranges.0.get_mut(at) else { return Ok(false) };
        // As in `settle_stitched`, the homes leave the chunk's entry while they are taken.
        let (class, homes) = (s.class, std::mem::take(&mut s.homes));
        let taken = homes
            .iter()
            .try_for_each(|&(_, h)| self.carve(h.addr, h.len))
            .and_then(|()| self.add_segment(class, addr, size));
        let st = &mut self.stitches;
        if taken.is_ok() {
            st.remove_idle(&(size, addr));
            for &(_, h) in &homes {
                st.carved.insert(h.addr, (h.len, addr));
            }
            st.tick += 1;
        }
        if let Some((_, s)) = st.ranges.0.get_mut(at) {
            if taken.is_ok() {
                s.active = true;
                s.used = st.tick;
            }
            s.homes = homes;
        }
        taken.map(|()| true)
    }

    /// Forgets every idle stitched chunk and returns their ranges, for the caller to unmap
    /// once nothing uses them.
    pub fn take_idle_stitched(&mut self) -> Vec<AddrRange> {
        let Stitches { ranges, idle, idle_of, .. } = &mut self.stitches;
        *idle_of = [0; 2];
        let taken: Vec<AddrRange> = std::mem::take(&mut idle.0)
            .into_iter()
            .map(|((size, addr), _)| AddrRange::new(addr, size))
            .collect();
        ranges.0.retain(|(_, s)| s.active);
        taken
    }

    /// Forgets the least recently used idle stitched chunks of `sizes` beyond the `keep` most
    /// recent and returns their ranges, for the caller to unmap once nothing uses them.
    pub fn take_stale_stitched(&mut self, sizes: RangeInclusive<u64>, keep: usize) -> Vec<AddrRange> {
        let Stitches { ranges, idle, .. } = &self.stitches;
        let (lo, hi) = (*sizes.start(), *sizes.end());
        let mut by_age: Vec<(u64, u64, u64)> = idle
            .range((lo, 0)..=(hi, u64::MAX))
            .iter()
            .filter_map(|&((size, addr), _)| ranges.get(&addr).map(|s| (s.used, addr, size)))
            .collect();
        let Some(excess) = by_age.len().checked_sub(keep).filter(|&n| n > 0) else { return Vec::new() };
        by_age.sort_unstable();
        let stale: Vec<AddrRange> =
            by_age.into_iter().take(excess).map(|(_, addr, size)| AddrRange::new(addr, size)).collect();
        for r in &stale {
            self.stitches.remove_idle(&(r.len, r.addr));
            self.stitches.ranges.remove(&r.addr);
        }
        self.stitches.forget_stitch_blockers();
        stale
    }

    /// Forgets every stitched chunk and returns the ranges of the idle ones and the homes of
    /// those in use: with [`BestFitPolicy::chunks`], every range the caller mapped for the
    /// pool, to be unmapped when it is dropped.
    pub fn take_stitches(&mut self) -> Vec<AddrRange> {
        let Stitches { ranges, idle, .. } = std::mem::take(&mut self.stitches);
        idle.0
            .into_iter()
            .map(|((size, addr), _)| AddrRange::new(addr, size))
            .chain(
                ranges
                    .0
                    .into_iter()
                    .map(|(_, s)| s)
                    .filter(|s| s.active)
                    .flat_map(|s| s.homes)
                    .map(|(_, h)| h),
            )
            .collect()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::super::{Classes, Figures, Grant};
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    impl BestFitPolicy {
        /// Whether `[addr, addr + size)` lies inside one free block.
        fn is_free(&self, addr: u64, size: u64) -> bool {
            self.free_blocks().any(|(_, b)| b.addr <= addr && addr + size <= b.end())
        }
    }

    /// What [`BestFitPolicy::add_joined`] makes, the long way: a segment added, then joined
    /// with the chunk of `class` that ends at `addr` and with the one that starts at its end.
    fn add_then_join(p: &mut BestFitPolicy, class: Class, addr: u64, size: u64) -> Result<()> {
        p.add_segment(class, addr, size)?;
        let mut start = addr;
        if let Some((s, k, _)) = p.chunk_ending_at(addr) {
            if k == class && p.join(s).is_ok() {
                start = s;
            }
        }
        if let Some((len, _, _)) = p.chunk_at(start) {
            if p.chunk_at(start + len).is_some_and(|(_, k, _)| k == class) {
                let _ = p.join(start);
            }
        }
        Ok(())
    }

    /// Chunks, free blocks and figures, to compare two policies.
    type Books = (Vec<AddrRange>, Vec<(Class, AddrRange)>, Figures);

    fn books(p: &BestFitPolicy) -> Books {
        let mut free: Vec<_> = p.free_blocks().collect();
        free.sort_by_key(|&(_, b)| b.addr);
        (p.chunks().collect(), free, p.figures())
    }

    proptest! {
        /// Ranges carved out of a segment (free blocks, or parts of them) come back through
        /// `add_joined`, in any order and of either class, and the policy holds the same chunks
        /// and blocks as after an added segment and two joins.
        #[test]
        fn add_joined_makes_what_a_segment_and_two_joins_make(
            blocks in proptest::collection::vec((1u64..=4, any::<bool>()), 2..24),
            carved in proptest::collection::vec((any::<bool>(), 0u64..4, any::<bool>()), 24),
            order in proptest::collection::vec(any::<u64>(), 24),
        ) {
            // Blocks of 1-4 units, allocated from a large segment; the ranges carved out of the
            // freed ones come back as either class.
            const UNIT: u64 = 2 * MIB;
            let mut policies = [0, 1].map(|_| BestFitPolicy::new(Classes::default()));
            let mut back = Vec::new();
            for p in &mut policies {
                let total = blocks.iter().map(|&(n, _)| n * UNIT).sum();
                p.add_segment(Class::Large, 0, total).unwrap();
                let grants: Vec<_> = blocks.iter().map(|&(n, _)| p.allocate(n * UNIT).unwrap()).collect();
                back.clear();
                for (i, (g, (&(n, freed), &(take, skip, small)))) in
                    grants.iter().zip(blocks.iter().zip(&carved)).enumerate()
                {
                    if freed {
                        p.free(g.token, g.addr).unwrap();
                    }
                    // A part of a freed block: from `skip` units into it, the rest of it.
                    if freed && take && skip < n {
                        let (addr, size) = (g.addr + skip * UNIT, (n - skip) * UNIT);
                        p.carve(addr, size).unwrap();
                        back.push((order[i], if small { Class::Small } else { Class::Large }, addr, size));
                    }
                }
                p.check();
            }
            // In an order of their own, the same for both.
            back.sort_unstable_by_key(|&(key, _, addr, _)| (key, addr));
            let [joined, reference] = &mut policies;
            for &(_, class, addr, size) in &back {
                joined.add_joined(class, addr, size).unwrap();
                add_then_join(reference, class, addr, size).unwrap();
                joined.check();
                prop_assert_eq!(books(joined), books(reference));
                // Memory already held is refused, and nothing changes.
                let before = books(joined);
                prop_assert!(joined.add_joined(class, addr, size).is_err());
                prop_assert_eq!(books(joined), before);
            }
        }
    }

    /// What a pool served without its source before [`BestFitPolicy::allocate_or_reuse`]:
    /// best fit, else an idle stitched chunk, else the frontier block, in three calls.
    fn three_calls(p: &mut BestFitPolicy, size: u64) -> Option<Grant> {
        if let Some(g) = p.allocate(size) {
            return Some(g);
        }
        match p.reuse_stitched(size).unwrap() {
            true => p.allocate(size),
            false => p.allocate_frontier(size),
        }
    }

    proptest! {
        /// `allocate_or_reuse` hands out what best fit, an idle stitched chunk and the
        /// frontier block, called in turn, hand out, and leaves the same books, over random
        /// programs of allocations, frees, stitches and growths at the frontier.
        #[test]
        fn allocate_or_reuse_hands_out_what_the_three_calls_do(
            ops in proptest::collection::vec((0u8..6, 1u64..=12, any::<u64>()), 1..80),
        ) {
            const UNIT: u64 = MIB;
            let mut policies = [0, 1].map(|_| BestFitPolicy::new(Classes::default()));
            let mut frontier = 32 * MIB;
            for p in &mut policies {
                p.add_segment(Class::Large, 0, frontier).unwrap();
                p.set_frontier(Class::Large, frontier);
            }
            let mut live: Vec<Grant> = Vec::new();
            let mut stitches = 0;
            for &(kind, n, pick) in &ops {
                let [one, three] = &mut policies;
                match kind {
                    0..=2 => {
                        // Sizes of 1-12 MiB and a little more, so that blocks split and the
                        // idle chunks' fit (half as large again) is exercised both ways.
                        let size = n * UNIT + (pick % 3) * 256 * 1024;
                        let got = one.allocate_or_reuse(size).unwrap();
                        prop_assert_eq!(got, three_calls(three, size));
                        live.extend(got);
                    }
                    3 if !live.is_empty() => {
                        let g = live.swap_remove((pick % live.len() as u64) as usize);
                        for p in [one, three] {
                            p.free(g.token, g.addr).unwrap();
                        }
                    }
                    4 => {
                        // A stitch over one or two free home blocks of at least 2 MiB (the
                        // frontier block included), whole: a chunk of the pool until its
                        // blocks are all freed, then idle (two homes: no one block of the
                        // pool fits what it fits).
                        let mut free: Vec<AddrRange> = one
                            .free_blocks()
                            .filter(|&(c, b)| c == Class::Large && b.len >= 2 * MIB && b.addr < STITCH)
                            .map(|(_, b)| b)
                            .collect();
                        free.sort_unstable_by_key(|b| b.addr);
                        if free.is_empty() {
                            continue;
                        }
                        let first = (pick % free.len() as u64) as usize;
                        let second = (pick / 7 % free.len() as u64) as usize;
                        let mut homes = vec![free[first]];
                        if second != first {
                            homes.push(free[second]);
                        }
                        let len = homes.iter().map(|h| h.len).sum();
                        let at = STITCH + stitches * (1 << 30);
                        stitches += 1;
                        for p in [one, three] {
                            for h in &homes {
                                p.carve(h.addr, h.len).unwrap();
                            }
                            let homes = homes.iter().map(|&h| (Class::Large, h)).collect();
                            p.add_stitched(Class::Large, at, len, 2 * MIB, homes).unwrap();
                        }
                    }
                    _ => {
                        // The backing grows at the frontier.
                        for p in [one, three] {
                            p.add_joined(Class::Large, frontier, n * UNIT).unwrap();
                            p.set_frontier(Class::Large, frontier + n * UNIT);
                        }
                        frontier += n * UNIT;
                    }
                }
                let [one, three] = &policies;
                one.check();
                prop_assert_eq!(books(one), books(three));
            }
        }
    }

    /// Where the stitched chunk lives: far from the home segment.
    const STITCH: u64 = 1 << 40;

    /// A 16 MiB home segment with four 4 MiB blocks, the second and fourth freed and carved
    /// out, and a stitched chunk of 8 MiB over them: the policy and the first and third blocks.
    fn stitched() -> (BestFitPolicy, [u64; 2]) {
        stitched_while(None)
    }

    /// [`stitched`], the chunk added while the large class's frontier was at `frontier` (where
    /// given).
    fn stitched_while(frontier: Option<u64>) -> (BestFitPolicy, [u64; 2]) {
        let mut p = BestFitPolicy::new(Classes::default());
        p.add_segment(Class::Large, 0, 16 * MIB).unwrap();
        let blocks: Vec<_> = (0..4).map(|_| p.allocate(4 * MIB).unwrap()).collect();
        for b in [&blocks[1], &blocks[3]] {
            p.free(b.token, b.addr).unwrap();
            p.carve(b.addr, b.size).unwrap();
        }
        if let Some(top) = frontier {
            p.set_frontier(Class::Large, top);
        }
        let homes = vec![
            (Class::Large, AddrRange::new(4 * MIB, 4 * MIB)),
            (Class::Large, AddrRange::new(12 * MIB, 4 * MIB)),
        ];
        p.add_stitched(Class::Large, STITCH, 8 * MIB, 2 * MIB, homes).unwrap();
        (p, [blocks[0].token, blocks[2].token])
    }

    /// [`stitched`], its chunk used and freed: idle.
    fn idle() -> (BestFitPolicy, [u64; 2]) {
        let (mut p, tokens) = stitched();
        let x = p.allocate(8 * MIB).unwrap();
        p.free(x.token, x.addr).unwrap();
        (p, tokens)
    }

    #[test]
    fn the_last_free_of_a_stitched_chunk_gives_its_homes_back() {
        let (mut p, _) = stitched();
        assert_eq!(p.figures().reserved, 16 * MIB, "homes out, stitched chunk in");
        let x = p.allocate(8 * MIB).unwrap();
        assert_eq!(x.addr, STITCH);
        assert!(!p.is_free(4 * MIB, 4 * MIB));
        p.free(x.token, x.addr).unwrap();
        assert!(p.chunk_at(STITCH).is_none(), "the idle stitched chunk left the pool");
        assert!(p.is_free(4 * MIB, 4 * MIB) && p.is_free(12 * MIB, 4 * MIB), "homes are free again");
        assert_eq!(p.figures().reserved, 16 * MIB);
        assert_eq!(p.figures().allocated, 8 * MIB);
    }

    #[test]
    fn an_idle_stitched_chunk_is_reused_only_when_its_homes_are_free() {
        let (mut p, _) = idle();
        // Too small for it, or it is more than half as large again as the request: not taken.
        assert!(!p.reuse_stitched(9 * MIB).unwrap());
        assert!(!p.reuse_stitched(2 * MIB).unwrap());
        // A home in use keeps it idle.
        let y = p.allocate(4 * MIB).unwrap();
        assert_eq!(y.addr, 4 * MIB);
        assert!(!p.reuse_stitched(8 * MIB).unwrap());
        p.free(y.token, y.addr).unwrap();
        assert!(p.reuse_stitched(7 * MIB).unwrap());
        assert_eq!(p.chunk_at(STITCH), Some((8 * MIB, Class::Large, 8 * MIB)));
        assert!(!p.is_free(4 * MIB, 4 * MIB) && !p.is_free(12 * MIB, 4 * MIB), "homes left the pool");
        assert_eq!(p.allocate(7 * MIB).map(|g| g.addr), Some(STITCH));
        assert_eq!(p.figures().reserved, 16 * MIB);
    }

    #[test]
    fn an_idle_chunk_serves_no_request_that_would_leave_a_third_of_it_unused() {
        // With up to twice the request, a 5 MiB request took the 8 MiB chunk, and its 3 MiB
        // rest stayed out of the pool's other blocks.
        let (mut p, _) = idle();
        assert!(!p.reuse_stitched(5 * MIB).unwrap());
        assert!(p.reuse_stitched(6 * MIB).unwrap(), "8 MiB is half as large again as 6 MiB at most");
        // A request that rounds up to the chunk's granules takes it even beyond that: a stitch
        // for it would be as large.
        let mut p = BestFitPolicy::new(Classes::default());
        p.add_segment(Class::Large, 0, 2 * MIB).unwrap();
        p.carve(0, 2 * MIB).unwrap();
        p.add_stitched(
            Class::Large,
            STITCH,
            2 * MIB,
            2 * MIB,
            vec![(Class::Large, AddrRange::new(0, 2 * MIB))],
        )
        .unwrap();
        let x = p.allocate(2 * MIB).unwrap();
        p.free(x.token, x.addr).unwrap();
        assert!(
            p.reuse_stitched(MIB + 64 * 1024).unwrap(),
            "more than half as large again, as large as its stitch"
        );
    }

    /// [`idle`], then a second stitched chunk of 6 MiB at `STITCH + 16 MiB` over the first
    /// home and half the second, used and freed (idle).
    fn two_idle() -> (BestFitPolicy, [u64; 2]) {
        let (mut p, tokens) = idle();
        p.carve(4 * MIB, 4 * MIB).unwrap();
        p.carve(12 * MIB, 2 * MIB).unwrap();
        let homes = vec![
            (Class::Large, AddrRange::new(4 * MIB, 4 * MIB)),
            (Class::Large, AddrRange::new(12 * MIB, 2 * MIB)),
        ];
        p.add_stitched(Class::Large, STITCH + 16 * MIB, 6 * MIB, 2 * MIB, homes).unwrap();
        let i = p.allocate(6 * MIB).unwrap();
        assert_eq!(i.addr, STITCH + 16 * MIB);
        p.free(i.token, i.addr).unwrap();
        (p, tokens)
    }

    #[test]
    fn an_idle_chunk_passed_over_for_homes_in_another_chunk_is_taken_once_that_one_is_idle() {
        let (mut p, _) = two_idle();
        assert!(p.reuse_stitched(8 * MIB).unwrap(), "the 8 MiB chunk takes the homes");
        assert!(!p.reuse_stitched(6 * MIB).unwrap(), "its homes are the 8 MiB chunk's");
        let x = p.allocate(8 * MIB).unwrap();
        assert_eq!(x.addr, STITCH);
        p.free(x.token, x.addr).unwrap();
        assert!(p.reuse_stitched(6 * MIB).unwrap());
        assert_eq!(p.allocate(6 * MIB).map(|g| g.addr), Some(STITCH + 16 * MIB));
    }

    #[test]
    fn a_chunk_forgotten_keeps_no_idle_chunk_from_reuse_when_another_takes_its_address() {
        let (mut p, [first, _]) = two_idle();
        assert!(p.reuse_stitched(8 * MIB).unwrap());
        assert!(!p.reuse_stitched(6 * MIB).unwrap(), "passed over for the 8 MiB chunk");
        let x = p.allocate(8 * MIB).unwrap();
        p.free(x.token, x.addr).unwrap();
        let named = |p: &BestFitPolicy| {
            p.stitches.idle.0.iter().any(|(_, e)| matches!(e.blocker, Blocker::Stitch { addr: STITCH, .. }))
        };
        assert!(named(&p), "the 6 MiB chunk was passed over for the one at STITCH");
        assert_eq!(p.take_stale_stitched(8 * MIB..=8 * MIB, 0), vec![AddrRange::new(STITCH, 8 * MIB)]);
        // A slot holding a block at STITCH would no longer say that chunk is in use.
        assert!(!named(&p));
        // A new stitched chunk at the forgotten one's address, over other memory.
        p.free(first, 0).unwrap();
        p.carve(0, 4 * MIB).unwrap();
        p.add_stitched(
            Class::Large,
            STITCH,
            4 * MIB,
            2 * MIB,
            vec![(Class::Large, AddrRange::new(0, 4 * MIB))],
        )
        .unwrap();
        assert!(p.reuse_stitched(6 * MIB).unwrap(), "its homes are free");
    }

    #[test]
    fn take_stitches_returns_idle_ranges_and_the_homes_of_those_in_use() {
        let (mut p, _) = stitched();
        assert_eq!(
            p.take_stitches(),
            vec![AddrRange::new(4 * MIB, 4 * MIB), AddrRange::new(12 * MIB, 4 * MIB)]
        );
        let (mut p, _) = idle();
        assert!(p.take_idle_stitched() == vec![AddrRange::new(STITCH, 8 * MIB)]);
        assert!(p.take_stitches().is_empty() && !p.reuse_stitched(8 * MIB).unwrap());
    }

    /// A 16 MiB segment whose growths go on at its end, four 4 MiB blocks, the second and
    /// fourth carved out for an 8 MiB stitched chunk added while the frontier was at `top`,
    /// used and freed (idle): its homes are a hole and the frontier block.
    fn idle_stitched_at(top: u64) -> BestFitPolicy {
        let (mut p, _) = stitched_while(Some(top));
        p.set_frontier(Class::Large, 16 * MIB);
        let x = p.allocate(8 * MIB).unwrap();
        p.free(x.token, x.addr).unwrap();
        p
    }

    #[test]
    fn an_idle_chunk_serves_a_request_only_if_stitched_before_the_frontier_reached_its_end() {
        // Stitched while the frontier was at 16 MiB: the request would end at 20 MiB in the
        // frontier block (from 12 MiB), past what was mapped then. It takes the chunk, as the
        // pass that stitched it did.
        let mut p = idle_stitched_at(16 * MIB);
        assert!(p.reuse_stitched(8 * MIB).unwrap());
        assert_eq!(p.allocate(8 * MIB).map(|g| g.addr), Some(STITCH));
        // Stitched once the frontier had passed 20 MiB: a later request's. This one takes the
        // frontier block, as a first pass, which found that memory mapped, did.
        let mut p = idle_stitched_at(24 * MIB);
        assert!(!p.reuse_stitched(8 * MIB).unwrap());
        assert_eq!(p.stitches.looked_up, 0, "passed over without a look-up of the chunk");
        assert_eq!(p.allocate_frontier(8 * MIB), None, "the frontier block holds 4 MiB");
        assert_eq!(p.allocate(4 * MIB).map(|g| g.addr), Some(4 * MIB), "the hole first");
        assert_eq!(p.allocate(4 * MIB), None);
        assert_eq!(p.allocate_frontier(4 * MIB).map(|g| g.addr), Some(12 * MIB));
        p.check();
    }

    #[test]
    fn the_least_recently_used_idle_chunks_go_first() {
        let mut p = BestFitPolicy::new(Classes::default());
        p.add_segment(Class::Large, 0, 8 * MIB).unwrap();
        // Three stitched chunks over the same free home range, each used and freed in turn.
        for i in 0..3 {
            p.carve(0, 8 * MIB).unwrap();
            p.add_stitched(
                Class::Large,
                STITCH + i * 16 * MIB,
                8 * MIB,
                2 * MIB,
                vec![(Class::Large, AddrRange::new(0, 8 * MIB))],
            )
            .unwrap();
            let x = p.allocate(8 * MIB).unwrap();
            p.free(x.token, x.addr).unwrap();
        }
        // The first is reused (the smallest address among equals), so the second is the oldest.
        assert!(p.reuse_stitched(8 * MIB).unwrap());
        let x = p.allocate(8 * MIB).unwrap();
        assert_eq!(x.addr, STITCH);
        p.free(x.token, x.addr).unwrap();
        assert!(p.take_stale_stitched(0..=u64::MAX, 3).is_empty());
        assert_eq!(
            p.take_stale_stitched(8 * MIB..=8 * MIB, 1),
            vec![AddrRange::new(STITCH + 16 * MIB, 8 * MIB), AddrRange::new(STITCH + 32 * MIB, 8 * MIB)]
        );
        p.check();
        assert_eq!(p.take_idle_stitched(), vec![AddrRange::new(STITCH, 8 * MIB)]);
        p.check();
    }

    #[test]
    fn idle_chunks_are_counted_by_class_and_only_a_class_with_some_is_searched() {
        let (mut p, _) = idle();
        assert_eq!(p.stitches.idle_of, [0, 1]);
        // A small request finds no idle chunk of its class: none is searched.
        assert!(!p.reuse_stitched(64 * 1024).unwrap());
        assert_eq!(p.stitches.searched, 0);
        assert!(p.reuse_stitched(8 * MIB).unwrap());
        assert_eq!((p.stitches.idle_of, p.stitches.searched), ([0, 0], 1));
        // No idle chunk left: the next large request does not search either.
        assert!(!p.reuse_stitched(8 * MIB).unwrap());
        assert_eq!(p.stitches.searched, 1);
        let x = p.allocate(8 * MIB).unwrap();
        p.free(x.token, x.addr).unwrap();
        assert_eq!(p.stitches.idle_of, [0, 1], "idle again");
        p.check();
        assert_eq!(p.take_idle_stitched().len(), 1);
        assert_eq!(p.stitches.idle_of, [0, 0]);
    }
}
