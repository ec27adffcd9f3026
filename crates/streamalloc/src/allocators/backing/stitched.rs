//! Stitched virtual-memory ranges (GMLake, ASPLOS'24): one address reservation whose mapped
//! ranges are placed where they merge with free blocks, and whose free granules are unmapped
//! to pay for a growth that would otherwise raise the pool's peak.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::{Backing, Ledger, Want};
use crate::device::{Device, Stream};
use crate::error::{Error, OutOfMemory, Result};
use crate::policy::best_fit::{BestFitPolicy, Class, Grant};

/// The stitched backing: one address reservation per pool (twice the device's memory),
/// mapped in granules ([`Device::map_granularity`]) as the pool grows. Every mapped range
/// is a segment of the policy, and ranges that meet are joined so that their blocks merge.
///
/// * **Placement.** A miss maps the fewest granules that, with a free block at the end of a
///   mapped range before an unmapped run, or at the start of one after it, make a free block
///   the request fits (PyTorch's expandable segments do this at the end of one segment
///   only). Filling a run between two free blocks merges all three. Both classes share the
///   reservation, so small and large requests reuse each other's unmapped granules.
/// * **Stitching.** When the growth would raise the bytes mapped above their highest mark
///   so far, free granules (whole granules inside free blocks, those of the smallest free
///   blocks first) are first taken out of the pool and unmapped, as many as the excess:
///   free memory is defragmented without moving live data, and the pool's peak rises only
///   when the free memory, however scattered, cannot pay for the growth. Below the mark a
///   growth only maps, as expandable segments do. A request of any size is served from the
///   reservation: a freed block of a large request leaves a hole whose granules are stitched
///   into the next growth.
/// * **Ordering.** Unmapping does not wait for the device as `cuMemFree` does, and a free
///   block's last use is ordered on the pool's stream: before unmapping, the work enqueued
///   on the pool's stream is waited for, at most the pool's
///   [`wait_timeout`](crate::allocators::BestFitConfig::wait_timeout) (by the pool before a
///   release, through [`Ledger::wait_for_stream`] before stitching). Past the bound nothing
///   is unmapped: a release fails with the error that says so, a growth maps without
///   stitching (the peak rises).
/// * **Release** unmaps every free granule of the pool (PyTorch's `empty_cache` over
///   expandable segments).
///
/// GMLake maps a physical granule at a second address without unmapping it; here
/// ([`Device::map`] creates the memory it maps) the granule is unmapped and a fresh one
/// mapped, which costs a wait for the pool's stream per stitching.
pub struct Stitched {
    device: Arc<dyn Device>,
    stream: Stream,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The device's mapping granularity (0 until the first growth).
    granularity: u64,
    /// Start of the reservation (0 until the first growth).
    base: u64,
    /// Size of the reservation.
    reservation: u64,
    /// Unmapped runs of the reservation: start -> length, no two adjacent.
    holes: BTreeMap<u64, u64>,
    /// Bytes mapped now.
    mapped: u64,
    /// The most bytes mapped at once so far.
    high_water: u64,
}

/// Where to map a growth: `len` bytes at `at`, inside one unmapped run.
#[derive(Debug, Clone, Copy)]
struct Placement {
    at: u64,
    len: u64,
}

impl Stitched {
    /// A stitched backing on `device` for a pool whose blocks are used in the order of
    /// `stream`.
    pub fn new(device: Arc<dyn Device>, stream: Stream) -> Self {
        Self { device, stream, state: Mutex::new(State::default()) }
    }

    /// Reserves the address space at the first growth.
    fn reserve(&self, st: &mut State) -> Result<()> {
        if st.base != 0 {
            return Ok(());
        }
        let granularity = self.device.map_granularity()? as u64;
        let total = self.device.mem_info()?.total as u64;
        let reservation = total.div_ceil(granularity) * granularity * 2;
        st.base = self.device.reserve_address(reservation as usize)?;
        st.granularity = granularity;
        st.reservation = reservation;
        st.holes.insert(st.base, reservation);
        Ok(())
    }

    /// Takes `bytes` of free granules out of the pool through `ledger`, unmaps them and
    /// returns how many bytes it unmapped; blocks that end at `keep.0` or start at
    /// `keep.0 + keep.1` (those a placement counts on) stay. Calls `wait` (which waits for the
    /// pool's stream, or tells why it could not) before unmapping anything. A range that
    /// cannot be unmapped goes back to the pool.
    fn reclaim(
        &self,
        st: &mut State,
        ledger: &dyn Ledger,
        bytes: u64,
        keep: Option<Placement>,
        wait: &dyn Fn() -> Result<()>,
    ) -> Result<u64> {
        let g = st.granularity;
        let mut carved = Vec::new();
        ledger.update(&mut |p| {
            carved = carve_free_granules(p, g, bytes, keep);
            Ok(())
        })?;
        if carved.is_empty() {
            return Ok(0);
        }
        let mut first_error = wait().err();
        let mut unmapped = 0;
        for (class, addr, len) in carved {
            let result = match first_error {
                Some(_) => Err(None),
                None => self.device.unmap(addr, len as usize).map_err(Some),
            };
            match result {
                Ok(()) => {
                    insert_hole(&mut st.holes, addr, len);
                    st.mapped -= len;
                    unmapped += len;
                }
                Err(e) => {
                    if let Some(e) = e {
                        first_error.get_or_insert(e);
                    }
                    // Still mapped: back into the pool, where it was.
                    let _ = ledger.update(&mut |p| add_and_join(p, class, addr, len));
                }
            }
        }
        first_error.map_or(Ok(unmapped), Err)
    }
}

impl Backing for Stitched {
    fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    fn grow(&self, ledger: &dyn Ledger, want: &Want) -> Result<Option<Grant>> {
        let mut st = self.state.lock();
        self.reserve(&mut st)?;
        let mut placement = None;
        let served = ledger.update(&mut |p| {
            placement = place(p, &st.holes, st.granularity, want.class, want.rounded);
            Ok(())
        })?;
        // Another thread may have grown the pool while this one waited for it.
        if served.is_some() {
            return Ok(served);
        }
        let Some(pl) = placement else {
            return Err(Error::oom(OutOfMemory {
                device: self.device.ordinal(),
                requested: want.rounded as usize,
                hint: format!("no run of {} bytes is left unmapped in the pool's reservation", want.rounded),
                ..OutOfMemory::default()
            }));
        };
        let excess = (st.mapped + pl.len).saturating_sub(st.high_water);
        if excess > 0 {
            match self.reclaim(&mut st, ledger, excess, Some(pl), &|| ledger.wait_for_stream()) {
                // The pool's stream still uses the free granules past the wait bound: grow
                // without stitching (the peak rises) rather than wait longer or fail.
                Ok(_) | Err(Error::Timeout { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        self.device.map(pl.at, pl.len as usize)?;
        take_hole(&mut st.holes, pl.at, pl.len);
        st.mapped += pl.len;
        st.high_water = st.high_water.max(st.mapped);
        let added = ledger.update(&mut |p| add_and_join(p, want.class, pl.at, pl.len));
        if added.is_err() && self.device.unmap(pl.at, pl.len as usize).is_ok() {
            // A bug: the policy refused memory that is mapped; give it back.
            insert_hole(&mut st.holes, pl.at, pl.len);
            st.mapped -= pl.len;
        }
        added
    }

    fn grows_into_free_tails(&self) -> bool {
        true
    }

    fn release(&self, ledger: &dyn Ledger, unwaited: Option<&Error>) -> Result<usize> {
        let mut st = self.state.lock();
        if st.base == 0 {
            return Ok(0);
        }
        // The pool waited for its stream before this release.
        let waited = || unwaited.map_or(Ok(()), |e| Err(e.clone()));
        let unmapped = self.reclaim(&mut st, ledger, u64::MAX, None, &waited)?;
        Ok(unmapped as usize)
    }

    fn teardown(&mut self, chunks: Vec<(u64, u64)>) {
        let st = std::mem::take(self.state.get_mut());
        if st.base == 0 {
            return;
        }
        if !chunks.is_empty() {
            // As in `reclaim`: an unmap does not wait for the last uses.
            let _ = self.device.synchronize_stream(self.stream);
        }
        for (addr, size) in chunks {
            let _ = self.device.unmap(addr, size as usize);
        }
        let _ = self.device.free_address(st.base, st.reservation as usize);
    }
}

/// The placement of a growth for a request of `rounded` bytes of `class` that maps the
/// fewest bytes (the smallest unmapped run among equals), counting the free block of
/// `class` at the end of the mapped range before a run and at the start of the one after
/// it; `None` if no run is large enough.
fn place(
    p: &BestFitPolicy,
    holes: &BTreeMap<u64, u64>,
    g: u64,
    class: Class,
    rounded: u64,
) -> Option<Placement> {
    let round = |n: u64| n.div_ceil(g) * g;
    let mut best: Option<(u64, u64, Placement)> = None;
    for (&start, &run) in holes {
        let free_of =
            |c: Option<(u64, Class, u64)>| c.filter(|&(_, k, _)| k == class).map_or(0, |(_, _, f)| f);
        let before = free_of(p.chunk_ending_at(start));
        let after = free_of(p.chunk_at(start + run));
        let after_len = round(rounded.saturating_sub(after));
        let candidates = [
            Placement { at: start, len: round(rounded.saturating_sub(before)) },
            Placement { at: (start + run).saturating_sub(after_len), len: after_len },
            Placement { at: start, len: if before + run + after >= rounded { run } else { u64::MAX } },
        ];
        for c in candidates {
            if c.len == 0 || c.len > run {
                continue;
            }
            if best.is_none_or(|(len, r, _)| (c.len, run) < (len, r)) {
                best = Some((c.len, run, c));
            }
        }
    }
    best.map(|(_, _, pl)| pl)
}

/// Takes up to `bytes` of whole free granules out of `p` (those of the smallest free blocks
/// first, each block's from its end), except from blocks next to `keep`; the ranges taken.
fn carve_free_granules(
    p: &mut BestFitPolicy,
    g: u64,
    bytes: u64,
    keep: Option<Placement>,
) -> Vec<(Class, u64, u64)> {
    let kept = |addr: u64, size: u64| keep.is_some_and(|k| addr + size == k.at || addr == k.at + k.len);
    let mut candidates: Vec<(u64, u64, Class)> = p
        .free_blocks()
        .filter(|&(_, a, s)| !kept(a, s))
        .filter_map(|(class, a, s)| {
            let (lo, hi) = (a.div_ceil(g) * g, (a + s) / g * g);
            (hi > lo).then(|| (hi - lo, lo, class))
        })
        .collect();
    candidates.sort_unstable_by_key(|&(len, lo, _)| (len, lo));
    let mut carved = Vec::new();
    let mut left = bytes;
    for (len, lo, class) in candidates {
        if left == 0 {
            break;
        }
        let take = if left >= len { len } else { left.div_ceil(g) * g };
        let at = lo + len - take;
        if p.carve(at, take).is_ok() {
            carved.push((class, at, take));
            left = left.saturating_sub(take);
        }
    }
    carved
}

/// Adds the mapped range `[addr, addr + len)` to `p` as a segment of `class` and joins it
/// with the ranges it meets of the same class.
fn add_and_join(p: &mut BestFitPolicy, class: Class, addr: u64, len: u64) -> Result<()> {
    p.add_segment(class, addr, len)?;
    let mut start = addr;
    if let Some((s, k, _)) = p.chunk_ending_at(addr) {
        if k == class && p.join(s).is_ok() {
            start = s;
        }
    }
    if let Some((size, _, _)) = p.chunk_at(start) {
        if p.chunk_at(start + size).is_some_and(|(_, k, _)| k == class) {
            let _ = p.join(start);
        }
    }
    Ok(())
}

/// Adds the unmapped run `[addr, addr + len)` to `holes`, merged with the runs it meets.
fn insert_hole(holes: &mut BTreeMap<u64, u64>, mut addr: u64, mut len: u64) {
    if let Some((&s, &l)) = holes.range(..addr).next_back() {
        if s + l == addr {
            holes.remove(&s);
            addr = s;
            len += l;
        }
    }
    if let Some(l) = holes.remove(&(addr + len)) {
        len += l;
    }
    holes.insert(addr, len);
}

/// Removes `[at, at + len)`, inside one run, from `holes`.
fn take_hole(holes: &mut BTreeMap<u64, u64>, at: u64, len: u64) {
    let Some((&s, &l)) = holes.range(..=at).next_back() else { return };
    holes.remove(&s);
    if at > s {
        holes.insert(s, at - s);
    }
    if at + len < s + l {
        holes.insert(at + len, s + l - at - len);
    }
}
