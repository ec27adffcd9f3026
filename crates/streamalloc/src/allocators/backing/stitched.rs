//! Stitched virtual-memory ranges (GMLake, ASPLOS'24): one address reservation whose mapped
//! ranges are placed where they merge with free blocks, and whose free granules are mapped a
//! second time into a growth that would otherwise raise the pool's peak.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::{Backing, Ledger, Want};
use crate::device::{CaptureStatus, Device, Event, EventPool, Stream};
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
/// * **Stitching.** When the growth would raise the memory mapped above its highest mark so
///   far, free granules (whole granules inside free blocks, those of the smallest free
///   blocks first) are taken out of the pool, as many as the excess, and their memory is
///   mapped again as part of the growth's range; fresh memory is mapped only for the rest.
///   Free memory is defragmented without moving live data and without waiting for the
///   device (see below), and the pool's peak rises only when the free
///   memory, however scattered, cannot pay for the growth. Below the mark a growth only
///   maps, as expandable segments do. A request of any size is served from the reservation:
///   a freed block of a large request leaves a hole whose granules are stitched into the
///   next growth. While the pool's stream captures a graph nothing is stitched (no event is
///   recorded in a capture).
/// * **Release** unmaps the old ranges of stitched granules and every free granule of the
///   pool (PyTorch's `empty_cache` over expandable segments), after the pool's bounded wait
///   for its stream; past the bound nothing is unmapped.
///
/// # Why stitching needs no wait
///
/// A stitch takes whole granules out of free blocks and maps *the same memory* again inside
/// the growth's new range ([`Device::map_alias`]); nothing is unmapped and nothing is
/// created for them. The memory's last use before the stitch is ordered on the pool's stream
/// (blocks freed with recorded streams become free only once those streams' events
/// completed), and its next user gets a block of the new range, in the order of the same
/// stream (another stream receives a block of the pool only after waiting for the pool's
/// stream). The stream alone orders the two, as it orders any reuse of a free block: the host
/// waits for nothing.
///
/// The granule's old address, an alias of memory now in use elsewhere, must never be handed
/// out again while it is mapped: it leaves the pool at the stitch (it is in no block of the
/// policy), and only goes back into the reservation's unmapped runs once unmapped. It cannot
/// be unmapped at once, since work queued before the stitch may still use it through that
/// address (an unmap, unlike `cuMemFree`, does not wait). So the stitch records an event on
/// the pool's stream after carving it, and a later growth or release that finds the event
/// complete unmaps the old range; unmapping an alias frees no memory while another mapping
/// of it lives. A release, which waits (with its bound) for the pool's stream, unmaps every
/// retired range before the free granules, so the memory it gives back is really returned.
pub struct Stitched {
    device: Arc<dyn Device>,
    stream: Stream,
    events: EventPool,
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
    /// Old ranges of stitched granules, still mapped, out of the pool and out of `holes`.
    retired: Vec<Retired>,
    /// Bytes of memory the pool's blocks map now (each granule's memory counted once).
    mapped: u64,
    /// The most bytes mapped at once so far.
    high_water: u64,
}

/// The old ranges of the granules one stitch mapped again, and the event recorded on the
/// pool's stream after it: once the event completed no work uses them. `None` when no event
/// could be recorded: they are unmapped at the next release.
struct Retired {
    event: Option<Event>,
    ranges: Vec<(u64, u64)>,
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
        let events = EventPool::new(device.clone());
        Self { device, stream, events, state: Mutex::new(State::default()) }
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

    /// Unmaps the retired ranges whose event has completed (all of them when `all`: the
    /// caller waited for the pool's stream), which become unmapped runs again. A range that
    /// cannot be unmapped stays retired, without its event, until the next release.
    fn unmap_retired(&self, st: &mut State, all: bool) {
        let mut kept = Vec::new();
        for mut r in std::mem::take(&mut st.retired) {
            let done = match r.event {
                Some(e) => all || self.device.query_event(e).unwrap_or(false),
                None => all,
            };
            if !done {
                kept.push(r);
                continue;
            }
            if let Some(e) = r.event.take() {
                self.events.put(e);
            }
            let mut left = Vec::new();
            for (addr, len) in r.ranges {
                match self.device.unmap(addr, len as usize) {
                    Ok(()) => insert_hole(&mut st.holes, addr, len),
                    Err(_) => left.push((addr, len)),
                }
            }
            if !left.is_empty() {
                kept.push(Retired { event: None, ranges: left });
            }
        }
        st.retired = kept;
    }

    /// Maps `pl`: the carved ranges' memory again at its start, in order, and fresh memory
    /// after them. On failure nothing of `pl` is left mapped (the carved ranges stay mapped
    /// where they were).
    fn map_stitched(&self, pl: Placement, carved: &[(Class, u64, u64)]) -> Result<()> {
        let mut at = pl.at;
        let mut result = Ok(());
        for &(_, addr, len) in carved {
            result = self.device.map_alias(addr, at, len as usize);
            if result.is_err() {
                break;
            }
            at += len;
        }
        if result.is_ok() && at < pl.at + pl.len {
            result = self.device.map(at, (pl.at + pl.len - at) as usize);
        }
        if result.is_err() && at > pl.at {
            // Mapped a moment ago and used by nothing yet.
            let _ = self.device.unmap(pl.at, (at - pl.at) as usize);
        }
        result
    }
}

impl Backing for Stitched {
    fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    fn grow(&self, ledger: &dyn Ledger, want: &Want) -> Result<Option<Grant>> {
        let mut st = self.state.lock();
        self.reserve(&mut st)?;
        if !st.retired.is_empty() {
            self.unmap_retired(&mut st, false);
        }
        let mut placement = None;
        let served = ledger.update_and_serve(&mut |p| {
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
        let mut carved = Vec::new();
        if excess > 0 && self.device.capture_status(self.stream)? == CaptureStatus::None {
            let g = st.granularity;
            ledger.update(&mut |p| {
                carved = carve_free_granules(p, g, excess, Some(pl));
                Ok(())
            })?;
        }
        let put_back = |carved: &[(Class, u64, u64)]| {
            for &(class, addr, len) in carved {
                let _ = ledger.update(&mut |p| add_and_join(p, class, addr, len));
            }
        };
        if let Err(e) = self.map_stitched(pl, &carved) {
            put_back(&carved);
            return Err(e);
        }
        let added = ledger.update_and_serve(&mut |p| add_and_join(p, want.class, pl.at, pl.len));
        if added.is_err() {
            // A bug: the policy refused memory that is mapped; give it back.
            if self.device.unmap(pl.at, pl.len as usize).is_ok() {
                put_back(&carved);
            }
            return added;
        }
        let reused: u64 = carved.iter().map(|&(_, _, len)| len).sum();
        take_hole(&mut st.holes, pl.at, pl.len);
        st.mapped += pl.len - reused;
        st.high_water = st.high_water.max(st.mapped);
        if !carved.is_empty() {
            let event = self.events.get().ok().filter(|&e| match self.device.record_event(e, self.stream) {
                Ok(()) => true,
                Err(_) => {
                    self.events.put(e);
                    false
                }
            });
            st.retired.push(Retired { event, ranges: carved.iter().map(|&(_, a, l)| (a, l)).collect() });
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
        // The pool waited for its stream before this release, unless `unwaited` says why not.
        self.unmap_retired(&mut st, unwaited.is_none());
        if let Some(e) = unwaited {
            return Err(e.clone());
        }
        let g = st.granularity;
        let mut carved = Vec::new();
        ledger.update(&mut |p| {
            carved = carve_free_granules(p, g, u64::MAX, None);
            Ok(())
        })?;
        let (mut unmapped, mut first_error) = (0, None);
        for (class, addr, len) in carved {
            match self.device.unmap(addr, len as usize) {
                Ok(()) => {
                    insert_hole(&mut st.holes, addr, len);
                    st.mapped -= len;
                    unmapped += len;
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                    // Still mapped: back into the pool, where it was.
                    let _ = ledger.update(&mut |p| add_and_join(p, class, addr, len));
                }
            }
        }
        first_error.map_or(Ok(unmapped as usize), Err)
    }

    fn teardown(&mut self, chunks: Vec<(u64, u64)>) {
        let mut st = std::mem::take(self.state.get_mut());
        if st.base == 0 {
            return;
        }
        if !chunks.is_empty() || !st.retired.is_empty() {
            // As in `release`: an unmap does not wait for the last uses.
            let _ = self.device.synchronize_stream(self.stream);
        }
        self.unmap_retired(&mut st, true);
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
