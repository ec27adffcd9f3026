//! Stitched chunks (GMLake's sBlocks): a chunk whose memory is that of *home* ranges taken
//! out of the pool ([`BestFitPolicy::carve`]) and mapped a second time, side by side, by the
//! caller. While any of its blocks is handed out, its homes stay out of the pool; once all are
//! free, the homes come back (joined with the chunks they meet) and the stitched chunk leaves
//! the pool, *idle*: its address stays mapped, and a later request that it fits takes it back
//! in ([`BestFitPolicy::reuse_stitched`]) as soon as all its homes are free, with no new
//! mapping. The policy never holds a home range and its stitched chunk at once, so no memory
//! is in two blocks.

use std::collections::{BTreeMap, BTreeSet};

use super::{BestFitPolicy, Class};
use crate::error::Result;

/// The stitched chunks of a policy, in use or idle.
#[derive(Debug, Default)]
pub(super) struct Stitches {
    /// Every stitched chunk, by address.
    ranges: BTreeMap<u64, Stitch>,
    /// The idle ones, as `(size, addr)`.
    idle: BTreeSet<(u64, u64)>,
}

#[derive(Debug)]
struct Stitch {
    size: u64,
    class: Class,
    /// The home ranges whose memory the chunk maps, in order, each with its class.
    homes: Vec<(Class, u64, u64)>,
    /// A chunk of the pool, rather than idle.
    active: bool,
}

impl Stitches {
    pub(super) fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }
}

impl BestFitPolicy {
    /// Adds `[addr, addr + size)` as a segment of `class` and joins it with the chunks of
    /// `class` that end at `addr` or start at its end (a virtual-memory backing mapped them
    /// back to back).
    pub fn add_joined(&mut self, class: Class, addr: u64, size: u64) -> Result<()> {
        self.add_segment(class, addr, size)?;
        let mut start = addr;
        if let Some((s, k, _)) = self.chunk_ending_at(addr) {
            if k == class && self.join(s).is_ok() {
                start = s;
            }
        }
        if let Some((len, _, _)) = self.chunk_at(start) {
            if self.chunk_at(start + len).is_some_and(|(_, k, _)| k == class) {
                let _ = self.join(start);
            }
        }
        Ok(())
    }

    /// Adds the stitched chunk `[addr, addr + size)` of `class`, which maps the memory of
    /// `homes` (`(class, addr, len)`, taken out with [`BestFitPolicy::carve`]) in order. It is
    /// never joined with another chunk, nor moved to another policy.
    pub fn add_stitched(
        &mut self,
        class: Class,
        addr: u64,
        size: u64,
        homes: Vec<(Class, u64, u64)>,
    ) -> Result<()> {
        self.add_segment(class, addr, size)?;
        self.stitches.ranges.insert(addr, Stitch { size, class, homes, active: true });
        Ok(())
    }

    /// When the wholly free chunk at `addr` is a stitched one: its homes come back and it
    /// becomes idle.
    pub(super) fn settle_stitched(&mut self, addr: u64) -> Result<()> {
        let Some(s) = self.stitches.ranges.get(&addr).filter(|s| s.active) else { return Ok(()) };
        let (size, homes) = (s.size, s.homes.clone());
        self.carve(addr, size)?;
        for (class, a, len) in homes {
            self.add_joined(class, a, len)?;
        }
        if let Some(s) = self.stitches.ranges.get_mut(&addr) {
            s.active = false;
        }
        self.stitches.idle.insert((size, addr));
        Ok(())
    }

    /// Takes back into the pool the smallest idle stitched chunk of `size` to `most` bytes
    /// whose homes are all free (they leave the pool). Whether there was one.
    pub fn reuse_stitched(&mut self, size: u64, most: u64) -> Result<bool> {
        let Stitches { ranges, idle } = &self.stitches;
        let found = idle
            .range((size, 0)..=(most, u64::MAX))
            .find(|(_, addr)| {
                ranges.get(addr).is_some_and(|s| s.homes.iter().all(|&(_, a, l)| self.is_free(a, l)))
            })
            .copied();
        let Some((size, addr)) = found else { return Ok(false) };
        let Some(s) = self.stitches.ranges.get(&addr) else { return Ok(false) };
        let (class, homes) = (s.class, s.homes.clone());
        for &(_, a, len) in &homes {
            self.carve(a, len)?;
        }
        self.add_segment(class, addr, size)?;
        self.stitches.idle.remove(&(size, addr));
        if let Some(s) = self.stitches.ranges.get_mut(&addr) {
            s.active = true;
        }
        Ok(true)
    }

    /// Forgets every idle stitched chunk and returns them as `(addr, size)`, for the caller to
    /// unmap once nothing uses them.
    pub fn take_idle_stitched(&mut self) -> Vec<(u64, u64)> {
        let Stitches { ranges, idle } = &mut self.stitches;
        let taken: Vec<(u64, u64)> =
            std::mem::take(idle).into_iter().map(|(size, addr)| (addr, size)).collect();
        for (addr, _) in &taken {
            ranges.remove(addr);
        }
        taken
    }

    /// Forgets every stitched chunk and returns, as `(addr, size)`, the idle ones and the
    /// homes of those in use: with [`BestFitPolicy::chunks`], every range the caller mapped
    /// for the pool, to be unmapped when it is dropped.
    pub fn take_stitches(&mut self) -> Vec<(u64, u64)> {
        let Stitches { ranges, idle } = std::mem::take(&mut self.stitches);
        idle.into_iter()
            .map(|(size, addr)| (addr, size))
            .chain(ranges.into_values().filter(|s| s.active).flat_map(|s| s.homes).map(|(_, a, l)| (a, l)))
            .collect()
    }
}
