//! Stitched virtual-memory ranges (GMLake, ASPLOS'24): memory mapped in granules into one
//! address reservation, placed where it merges with free blocks; when a growth would raise
//! the pool's peak, free granules, wherever they lie, are mapped a second time, side by side,
//! into a *stitched range* that serves the request, and stitched ranges are kept to serve
//! later requests without a device call.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::{Backing, Taken, Want};
use crate::device::{CaptureStatus, Device, DevicePtr, Event, EventPool, Stream};
use crate::error::{try_each, Error, OutOfMemory, Result};
use crate::policy::best_fit::{BestFitPolicy, Class, Classes};
use crate::policy::AddrRange;

/// The stitched backing. One address reservation per pool, in two areas: the *home* area
/// (twice the device's memory) where memory is mapped fresh, in granules
/// ([`VirtualMemory::map_granularity`](crate::device::VirtualMemory::map_granularity)), and the *stitch* area (the device's memory) where free
/// granules are mapped a second time.
///
/// * **Placement.** A miss maps the fewest granules that, with a free block next to an
///   unmapped run, make a free block the request fits. Large growths map in the area's lower
///   half, from its bottom up, small ones in its upper half (either in the other half when its
///   own has no room): small blocks never sit in memory large blocks freed. The pool's books
///   know where each class's growths go on ([`BestFitPolicy::set_frontier`]) and hand out the
///   free block there last, so that a repeated workload lays its blocks out alike whether that
///   memory is mapped yet or not. See DESIGN.md, "Warm passes".
/// * **Stitching.** When that growth would raise the memory mapped above its highest mark and
///   the free home granules of large blocks pay for a large request more cheaply, they are
///   taken out of the pool and their memory is mapped again, side by side, as one range that
///   serves the request ([`VirtualMemory::map_alias`](crate::device::VirtualMemory::map_alias)).
///   Free memory is defragmented without moving live data and without waiting for the device.
///   See DESIGN.md, Note [stitching needs no wait].
/// * **Reuse.** A range whose blocks are all free goes idle (its granules back home, the range
///   still mapped); a later miss it fits takes it back from the books, with no device call,
///   once its home granules are free. See DESIGN.md, Note [idle range fit].
/// * **Address space.** The reservation is made at the first growth and given back by a
///   release that leaves nothing mapped in an awake pool; a reservation the device refuses is
///   [`Error::OutOfMemory`] naming it, so that the caller's release of other pools makes room.
///   See DESIGN.md, Note [a pool's address reservation].
/// * **Eviction.** Beyond 1024 idle ranges the least recently used, and all of them when the
///   stitch area has no room, are unmapped once an event recorded after their last use
///   completed.
/// * **Release** takes every idle range and free home granule out of the pool, waits (bounded)
///   for the pool's stream, then unmaps them; past the bound nothing is unmapped.
/// * **Sleep** ([`Backing::sleep_begin`]) unmaps everything but keeps the reservation and a
///   record of what was mapped where; a wake maps fresh memory at the same home addresses and
///   the stitched ranges over it again, so every address the pool handed out is valid again.
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
    /// Start of the small class's half of the home area: large growths map below it, small
    /// ones above it (while their half has room).
    small_area: u64,
    /// Start of the stitch area: home addresses lie below it, stitched ranges above it, with
    /// one unused granule between so that no home chunk meets a stitched one.
    stitch_area: u64,
    /// Unmapped runs of the home area: start -> length, no two adjacent.
    holes: BTreeMap<u64, u64>,
    /// Unused runs of the stitch area, likewise.
    stitch_holes: BTreeMap<u64, u64>,
    /// Evicted stitched ranges, still mapped, waiting for their event.
    retired: Vec<Retired>,
    /// Bytes of memory mapped at home (the memory the pool holds; stitched ranges alias it).
    mapped: u64,
    /// The most bytes mapped at once so far.
    high_water: u64,
    /// The stitched ranges mapped now, by start: their mapped length, and the home ranges
    /// they map ([`VirtualMemory::map_alias`](crate::device::VirtualMemory::map_alias)'s sources), to be mapped again by a wake.
    aliases: BTreeMap<u64, (u64, Sources)>,
    /// Where the pool is in a sleep.
    sleep: Sleep,
}

/// The home ranges a stitched range maps, in its order ([`VirtualMemory::map_alias`](crate::device::VirtualMemory::map_alias)'s sources).
type Sources = Vec<(u64, usize)>;

/// Where a stitched pool is in a sleep ([`Backing::sleep_begin`]).
#[derive(Default)]
enum Sleep {
    /// Awake: it grows and releases.
    #[default]
    Awake,
    /// Between [`Backing::sleep_begin`] and [`Backing::sleep_end`]: what the sleep took.
    Falling(Falling),
    /// Asleep: what a wake maps again.
    Asleep(Slept),
}

/// What [`Backing::sleep_begin`] took out of the pool, as a release does (given back by the
/// sleep's end), and the home ranges it listed (their memory given back too, their addresses
/// kept).
#[derive(Default)]
struct Falling {
    taken: Taken,
    homes: Vec<AddrRange>,
}

/// What a sleeping pool gave back at its addresses: home ranges (runs of the unmapped home
/// area meanwhile, which nothing takes while it sleeps), and the stitched ranges over them.
///
/// `held` and `held_aliases` name those of them still mapped: an unmap that failed (at the
/// sleep's end, or undoing a wake that failed) leaves its range mapped and counted, out of
/// the unmapped runs; a wake maps the others and hands all back as mapped again (issue 52,
/// #1: a failed undo once left the books saying unmapped, and every later wake met "already
/// mapped").
#[derive(Default)]
struct Slept {
    homes: Vec<AddrRange>,
    aliases: Vec<Alias>,
    held: Vec<AddrRange>,
    held_aliases: Vec<u64>,
}

/// A stitched range a sleep unmapped: where it was mapped and the home ranges it maps.
struct Alias {
    range: AddrRange,
    from: Sources,
}

/// Evicted stitched ranges and the event recorded on the pool's stream after their last
/// use: once it completed no work uses them. `None` when no event could be recorded: they
/// are unmapped at the next release.
struct Retired {
    event: Option<Event>,
    ranges: Vec<AddrRange>,
}

/// Idle stitched ranges kept for reuse; beyond them the least recently used are evicted.
const IDLE_KEPT: usize = 1024;

/// The largest request of the small class on a stitched pool (1 MiB over the other backings,
/// as PyTorch's caching allocator classes requests). See DESIGN.md, Note [the small class of
/// stitched pools].
const SMALL_MAX: u64 = 128 << 10;

/// Where to map a growth: `len` bytes at `at`, inside one unmapped run.
#[derive(Debug, Clone, Copy)]
struct Placement {
    at: u64,
    len: u64,
}

/// What a miss does, decided under the pool's lock.
enum Plan {
    /// Map `Placement` fresh at home.
    Grow(Placement),
    /// Stitch the request's granules, after mapping `fresh` bytes at home at `Placement`.
    Stitch { fresh: Option<Placement> },
}

impl Stitched {
    /// A stitched backing on `device` for a pool whose blocks are used in the order of
    /// `stream`.
    pub fn new(device: Arc<dyn Device>, stream: Stream) -> Self {
        let events = EventPool::new(device.clone());
        Self { device, stream, events, state: Mutex::new(State::default()) }
    }

    /// Reserves the address space at the first growth (and at the first after a release that
    /// gave the reservation back). A reservation the device refuses is out of memory for
    /// `requested` bytes, naming the reservation: the caller's release of other pools may
    /// free addresses (see [`Stitched`]'s address space).
    fn reserve(&self, st: &mut State, requested: u64) -> Result<()> {
        if st.base != 0 {
            return Ok(());
        }
        let g = self.device.map_granularity()? as u64;
        let memory = (self.device.mem_info()?.total as u64).div_ceil(g) * g;
        let reservation = 3 * memory + g;
        st.base = self.device.reserve_address(reservation as usize).map_err(|e| match e {
            Error::Unsupported(_) => e,
            e => Error::oom(OutOfMemory {
                device: self.device.ordinal(),
                requested: requested as usize,
                // A line of detail, which the layers above keep (they write their own hints).
                detail: vec![format!(
                    "out of virtual addresses: the pool of stream {:#x} could not reserve its {reservation} bytes \
                     (three times the device's memory and a granule, what each pool over stitched ranges reserves \
                     while it holds memory; with streams, a pool per stream): {e}; free the memory other streams \
                     hold, retire streams no longer used, or use backing=segments, which reserves nothing",
                    self.stream.raw()
                )],
                ..OutOfMemory::default()
            }),
        })?;
        st.granularity = g;
        st.reservation = reservation;
        st.stitch_area = st.base + 2 * memory + g;
        st.small_area = st.base + memory;
        st.holes.insert(st.base, 2 * memory);
        st.stitch_holes.insert(st.stitch_area, memory);
        Ok(())
    }

    /// Gives the reservation of an awake pool back when nothing is mapped in it (no home
    /// memory, no stitched range, none evicted and waiting), as a release leaves a pool whose
    /// every block is free: the pool's books then name no address in it, and the next growth
    /// reserves anew.
    fn free_reservation_if_empty(&self, st: &mut State) -> Result<()> {
        // A sleeping pool keeps its addresses for the wake.
        let awake = matches!(st.sleep, Sleep::Awake);
        if st.base == 0 || !awake || st.mapped != 0 || !st.aliases.is_empty() || !st.retired.is_empty() {
            return Ok(());
        }
        self.device.free_address(st.base, st.reservation as usize)?;
        // The highest mark stays: it is the pool's, not the reservation's.
        *st = State { high_water: st.high_water, ..State::default() };
        Ok(())
    }

    /// Takes out of the pool's books, for a release or a sleep, every idle stitched range (as
    /// the extents they map) and every free home granule, and out of `st` the retired ranges
    /// (their events go back: the caller waits for the pool's stream, which they follow).
    fn take_free(&self, st: &mut State, books: &mut BestFitPolicy) -> Taken {
        let (g, limit) = (st.granularity, st.stitch_area);
        let mut ranges: Vec<AddrRange> =
            books.take_idle_stitched().into_iter().map(|r| extent(g, r)).collect();
        for r in std::mem::take(&mut st.retired) {
            if let Some(e) = r.event {
                self.events.put(e);
            }
            ranges.extend(r.ranges);
        }
        Taken { granules: carve_free_granules(books, g, u64::MAX, limit, None), ranges, chunks: Vec::new() }
    }

    /// Unmaps what a release or a sleep took out of the pool: stitched ranges (their
    /// addresses join the stitch holes; one that fails to unmap waits as retired) and free
    /// home granules (their addresses join the unmapped runs; one that fails goes back to the
    /// pool, still mapped, where it was). Every range is tried; the bytes of home granules
    /// unmapped, or the first error.
    fn unmap_taken(&self, st: &mut State, books: &mut BestFitPolicy, taken: Taken) -> Result<u64> {
        let stitched = try_each(taken.ranges, |r| {
            self.device.unmap(r.addr, r.len as usize).inspect_err(|_| {
                st.retired.push(Retired { event: None, ranges: vec![r] });
            })?;
            insert_hole(&mut st.stitch_holes, r.addr, r.len);
            st.aliases.remove(&r.addr);
            Ok(())
        });
        let mut unmapped = 0;
        let homes = try_each(taken.granules, |(class, r)| {
            self.device.unmap(r.addr, r.len as usize).inspect_err(|_| {
                let _ = books.add_joined(class, r.addr, r.len);
            })?;
            insert_hole(&mut st.holes, r.addr, r.len);
            st.mapped -= r.len;
            unmapped += r.len;
            Ok(())
        });
        sync_frontier(st, books);
        stitched.and(homes).map(|()| unmapped)
    }

    /// Unmaps the ranges of `retired` whose event has completed (all of them when `all`: the
    /// caller took them out of `st` before it waited for the pool's stream), which become
    /// unused runs again; the others go back to `st`. A range that cannot be unmapped goes
    /// back without its event, to be unmapped at the next release.
    fn unmap_retired(&self, st: &mut State, retired: Vec<Retired>, all: bool) {
        for mut r in retired {
            let done = match r.event {
                Some(e) => all || self.device.query_event(e).unwrap_or(false),
                None => all,
            };
            if !done {
                st.retired.push(r);
                continue;
            }
            if let Some(e) = r.event.take() {
                self.events.put(e);
            }
            let mut left = Vec::new();
            for range in r.ranges {
                match self.device.unmap(range.addr, range.len as usize) {
                    Ok(()) => {
                        insert_hole(&mut st.stitch_holes, range.addr, range.len);
                        st.aliases.remove(&range.addr);
                    }
                    Err(_) => left.push(range),
                }
            }
            if !left.is_empty() {
                st.retired.push(Retired { event: None, ranges: left });
            }
        }
    }

    /// Unmaps the retired ranges whose event has completed, unless the pool's stream
    /// captures a graph (an event query there would invalidate the capture).
    fn poll_retired(&self, st: &mut State) -> Result<()> {
        if !st.retired.is_empty() && self.device.capture_status(self.stream)? == CaptureStatus::None {
            let retired = std::mem::take(&mut st.retired);
            self.unmap_retired(st, retired, false);
        }
        Ok(())
    }

    /// Evicts the idle stitched ranges `take` takes out of the pool's books: they are
    /// unmapped once an event recorded now on the pool's stream completed. Nothing is evicted
    /// while the stream captures a graph.
    fn evict(
        &self,
        st: &mut State,
        books: &mut BestFitPolicy,
        take: impl FnOnce(&mut BestFitPolicy) -> Vec<AddrRange>,
    ) -> Result<()> {
        if self.device.capture_status(self.stream)? != CaptureStatus::None {
            return Ok(());
        }
        let ranges = take(books);
        if ranges.is_empty() {
            return Ok(());
        }
        let g = st.granularity;
        let ranges = ranges.into_iter().map(|r| extent(g, r)).collect();
        let event = self.events.get().ok().filter(|&e| match self.device.record_event(e, self.stream) {
            Ok(()) => true,
            Err(_) => {
                self.events.put(e);
                false
            }
        });
        st.retired.push(Retired { event, ranges });
        Ok(())
    }

    /// Maps `len` fresh bytes at `at` at home and adds them to the pool as free memory of
    /// `class`, joined with the free blocks they meet.
    fn grow_home(
        &self,
        st: &mut State,
        books: &mut BestFitPolicy,
        class: Class,
        pl: Placement,
    ) -> Result<()> {
        self.device.map(pl.at, pl.len as usize)?;
        if let Err(e) = books.add_joined(class, pl.at, pl.len) {
            // A bug: the policy refused memory that is mapped; give it back.
            let _ = self.device.unmap(pl.at, pl.len as usize);
            return Err(e);
        }
        take_hole(&mut st.holes, pl.at, pl.len);
        st.mapped += pl.len;
        st.high_water = st.high_water.max(st.mapped);
        sync_frontier(st, books);
        Ok(())
    }

    /// Stitches free home memory for a request of `rounded` bytes into a new range of the
    /// stitch area, a free chunk of the pool that the request fits: whole free granules, and
    /// where they fall short, the free head of a granule at the range's end
    /// ([`carve_stitch`]). `Ok(false)`, with nothing changed, when the free memory does not
    /// make up the request.
    fn stitch(&self, st: &mut State, books: &mut BestFitPolicy, class: Class, rounded: u64) -> Result<bool> {
        let (g, limit) = (st.granularity, st.stitch_area);
        let homes = carve_stitch(books, g, rounded, limit);
        let put_back = |books: &mut BestFitPolicy, homes: &[(Class, AddrRange)]| {
            let _ = homes.iter().try_for_each(|&(k, h)| books.add_joined(k, h.addr, h.len));
        };
        let size: u64 = homes.iter().map(|&(_, h)| h.len).sum();
        if size < rounded {
            put_back(books, &homes);
            return Ok(false);
        }
        // Every home starts at a granule and is mapped by whole granules (a head's granule
        // whole, though the chunk leaves out the rest of it).
        let mapped_len = size.div_ceil(g) * g;
        let at = match smallest_run(&st.stitch_holes, mapped_len) {
            Some(at) => Some(at),
            None => {
                let evicted =
                    self.evict(st, books, |p| p.take_idle_stitched()).and_then(|()| self.poll_retired(st));
                if let Err(e) = evicted {
                    put_back(books, &homes);
                    return Err(e);
                }
                smallest_run(&st.stitch_holes, mapped_len)
            }
        };
        let Some(at) = at else {
            put_back(books, &homes);
            return Err(Error::oom(OutOfMemory {
                device: self.device.ordinal(),
                requested: rounded as usize,
                hint: "no room is left for stitched ranges in the pool's reservation".into(),
                ..OutOfMemory::default()
            }));
        };
        let from: Vec<(u64, usize)> =
            homes.iter().map(|&(_, h)| extent(g, h)).map(|r| (r.addr, r.len as usize)).collect();
        if let Err(e) = self.device.map_alias(&from, at) {
            put_back(books, &homes);
            return Err(e);
        }
        if let Err(e) = books.add_stitched(class, at, size, g, homes.clone()) {
            let _ = self.device.unmap(at, mapped_len as usize);
            put_back(books, &homes);
            return Err(e);
        }
        take_hole(&mut st.stitch_holes, at, mapped_len);
        st.aliases.insert(at, (mapped_len, from));
        self.evict(st, books, |p| p.take_stale_stitched(0..=u64::MAX, IDLE_KEPT))?;
        Ok(true)
    }
}

impl Backing for Stitched {
    fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    fn grow(&self, books: &mut BestFitPolicy, want: &Want) -> Result<()> {
        let mut st = self.state.lock();
        if !matches!(st.sleep, Sleep::Awake) {
            return Err(Error::Internal("a sleeping stitched pool was asked to grow".into()));
        }
        self.reserve(&mut st, want.rounded)?;
        self.poll_retired(&mut st)?;
        let g = st.granularity;
        // The pool found no free block and no idle stitched range for the request: the plan.
        let runs = runs_of(&st, want.class);
        let placement = place(books, &runs, g, want.class, want.rounded)
            .or_else(|| place(books, &st.holes, g, want.class, want.rounded));
        // Mapping fresh memory is free up to the high-water mark; past it, what raises the
        // mark less wins.
        let raise = |len: u64| (st.mapped + len).saturating_sub(st.high_water);
        let grow_raise = placement.map_or(u64::MAX, |pl| raise(pl.len));
        // Whole granules the free home memory a stitch can take lacks for the request.
        let (whole, head) = stitch_sources(books, g, want.rounded, st.stitch_area);
        let lacking = want.rounded.saturating_sub(whole + head.map_or(0, |(_, h)| h.len)).div_ceil(g) * g;
        let plan = match placement {
            // The small class grows apart (see `place`), and stitches only large blocks.
            Some(pl) if grow_raise == 0 || want.class == Class::Small => Some(Plan::Grow(pl)),
            _ if raise(lacking) >= grow_raise => placement.map(Plan::Grow),
            _ if lacking == 0 => Some(Plan::Stitch { fresh: None }),
            _ => match smallest_run(&runs, lacking).or_else(|| smallest_run(&st.holes, lacking)) {
                Some(at) => Some(Plan::Stitch { fresh: Some(Placement { at, len: lacking }) }),
                None => placement.map(Plan::Grow),
            },
        };
        let placement = match plan {
            Some(Plan::Grow(pl)) => Some(pl),
            Some(Plan::Stitch { fresh }) => {
                if let Some(pl) = fresh {
                    self.grow_home(&mut st, books, want.class, pl)?;
                }
                if self.stitch(&mut st, books, want.class, want.rounded)? {
                    return Ok(());
                }
                // The free granules did not make up the request after all: grow where it
                // fits now.
                let runs = runs_of(&st, want.class);
                place(books, &runs, g, want.class, want.rounded)
                    .or_else(|| place(books, &st.holes, g, want.class, want.rounded))
            }
            None => None,
        };
        match placement {
            Some(pl) => self.grow_home(&mut st, books, want.class, pl),
            None => Err(Error::oom(OutOfMemory {
                device: self.device.ordinal(),
                requested: want.rounded as usize,
                hint: format!("no run of {} bytes is left unmapped in the pool's reservation", want.rounded),
                ..OutOfMemory::default()
            })),
        }
    }

    /// Small requests are those of at most 128 KiB (see `SMALL_MAX`); a large block is split
    /// however small the remainder, which the next growth next to it uses.
    fn classes(&self, configured: Classes) -> Classes {
        Classes { small_max: SMALL_MAX.min(configured.small_max), split_large_slivers: true, ..configured }
    }

    /// Takes every idle stitched range, every free home granule and every retired range out
    /// of the pool.
    fn release_begin(&self, books: &mut BestFitPolicy) -> Result<Taken> {
        let mut st = self.state.lock();
        // A sleeping pool holds no memory: its reservation is left alone.
        if st.base == 0 || !matches!(st.sleep, Sleep::Awake) {
            return Ok(Taken::default());
        }
        Ok(self.take_free(&mut st, books))
    }

    /// Unmaps what the release took. If the wait failed, nothing is unmapped: the granules go
    /// back to the pool and the ranges wait for the next release.
    fn release_end(&self, books: &mut BestFitPolicy, taken: Taken, waited: Result<()>) -> Result<usize> {
        let mut st = self.state.lock();
        if let Err(e) = waited {
            put_back(&mut st, books, taken);
            return Err(e);
        }
        let unmapped = self.unmap_taken(&mut st, books, taken)?;
        self.free_reservation_if_empty(&mut st)?;
        Ok(unmapped as usize)
    }

    /// Takes out what a release would (idle stitched ranges, free home granules, retired
    /// ranges) and lists the home memory still mapped: the memory of every live block, at
    /// home or in a stitched range (whose homes stay mapped at home too).
    fn sleep_begin(&self, books: &mut BestFitPolicy) -> Result<Vec<(DevicePtr, usize)>> {
        let mut st = self.state.lock();
        if !matches!(st.sleep, Sleep::Awake) {
            return Err(Error::Internal("a stitched pool was put to sleep twice".into()));
        }
        let mut falling = Falling::default();
        if st.base != 0 {
            falling.taken = self.take_free(&mut st, books);
            let mut cut: Vec<AddrRange> = falling.taken.granules.iter().map(|&(_, r)| r).collect();
            cut.sort_unstable();
            falling.homes = subtract(&mapped_homes(&st), &cut);
        }
        let listed = falling.homes.iter().map(|h| (h.addr, h.len as usize)).collect();
        st.sleep = Sleep::Falling(falling);
        Ok(listed)
    }

    /// With `commit`, unmaps what the sleep took out (as a release would), then every
    /// stitched range still mapped, then the listed homes, which join the unmapped runs while
    /// the pool sleeps. Without, puts back what was taken, as a release whose wait failed.
    /// An unmap that fails leaves the rest mapped (homes stay mapped while a stitched range
    /// over them could not be unmapped); the first error is returned and the pool sleeps
    /// with what was unmapped.
    fn sleep_end(&self, books: &mut BestFitPolicy, commit: bool) -> Result<usize> {
        let mut st = self.state.lock();
        let Sleep::Falling(Falling { taken, homes }) = std::mem::take(&mut st.sleep) else {
            return Err(Error::Internal("the end of a sleep that did not begin".into()));
        };
        if !commit {
            put_back(&mut st, books, taken);
            return Ok(0);
        }
        let taken = self.unmap_taken(&mut st, books, taken).map(drop);
        let mut slept = Slept::default();
        let aliases = try_each(std::mem::take(&mut st.aliases), |(at, (len, from))| {
            match self.device.unmap(at, len as usize) {
                Ok(()) => slept.aliases.push(Alias { range: AddrRange::new(at, len), from }),
                Err(e) => {
                    st.aliases.insert(at, (len, from));
                    return Err(e);
                }
            }
            Ok(())
        });
        let mut bytes = 0;
        // Homes go only once no stitched range maps their memory any more.
        let homes = if st.aliases.is_empty() {
            try_each(homes, |h| {
                slept.homes.push(h);
                if let Err(e) = self.device.unmap(h.addr, h.len as usize) {
                    // Still mapped, its contents kept: a wake hands it back with the rest.
                    slept.held.push(h);
                    return Err(e);
                }
                insert_hole(&mut st.holes, h.addr, h.len);
                st.mapped -= h.len;
                bytes += h.len;
                Ok(())
            })
        } else {
            Ok(())
        };
        st.sleep = Sleep::Asleep(slept);
        taken.and(aliases).and(homes).map(|()| bytes as usize)
    }

    /// Maps fresh memory at every home range slept (but those still mapped), then the
    /// stitched ranges over them; on a failure, unmaps what it mapped and the pool sleeps on.
    /// A range that fails to unmap then stays mapped and counted (`Slept::held`): the pool's
    /// books never say unmapped of memory that is mapped. The home ranges, all mapped now.
    fn wake(&self) -> Result<Vec<(DevicePtr, usize)>> {
        let mut st = self.state.lock();
        let Sleep::Asleep(mut slept) = std::mem::take(&mut st.sleep) else {
            return Err(Error::Internal("a stitched pool that does not sleep was woken".into()));
        };
        let mut homes_done = 0;
        let mut aliases_done = 0;
        let mut mapped = Ok(());
        for h in &slept.homes {
            if !slept.held.contains(h) {
                mapped = self.device.map(h.addr, h.len as usize);
                if mapped.is_err() {
                    break;
                }
            }
            homes_done += 1;
        }
        if mapped.is_ok() {
            for a in &slept.aliases {
                if !slept.held_aliases.contains(&a.range.addr) {
                    mapped = self.device.map_alias(&a.from, a.range.addr);
                    if mapped.is_err() {
                        break;
                    }
                }
                aliases_done += 1;
            }
        }
        if let Err(e) = mapped {
            let mut held_aliases = Vec::new();
            for a in &slept.aliases[..aliases_done] {
                if self.device.unmap(a.range.addr, a.range.len as usize).is_err() {
                    held_aliases.push(a.range.addr);
                }
            }
            slept
                .held_aliases
                .retain(|at| !slept.aliases[..aliases_done].iter().any(|a| a.range.addr == *at));
            slept.held_aliases.extend(held_aliases);
            let mut held = Vec::new();
            for &h in &slept.homes[..homes_done] {
                let was_held = slept.held.contains(&h);
                // Homes go only once no stitched range maps their memory any more.
                let unmapped =
                    slept.held_aliases.is_empty() && self.device.unmap(h.addr, h.len as usize).is_ok();
                match (unmapped, was_held) {
                    (true, true) => {
                        insert_hole(&mut st.holes, h.addr, h.len);
                        st.mapped -= h.len;
                    }
                    (false, false) => {
                        take_hole(&mut st.holes, h.addr, h.len);
                        st.mapped += h.len;
                        held.push(h);
                    }
                    (false, true) => held.push(h),
                    (true, false) => {}
                }
            }
            slept.held.retain(|h| !slept.homes[..homes_done].contains(h));
            slept.held.extend(held);
            st.high_water = st.high_water.max(st.mapped);
            st.sleep = Sleep::Asleep(slept);
            return Err(e);
        }
        for h in &slept.homes {
            if !slept.held.contains(h) {
                take_hole(&mut st.holes, h.addr, h.len);
                st.mapped += h.len;
            }
        }
        st.high_water = st.high_water.max(st.mapped);
        let Slept { homes, aliases, .. } = slept;
        st.aliases.extend(aliases.into_iter().map(|a| (a.range.addr, (a.range.len, a.from))));
        Ok(homes.into_iter().map(|h| (h.addr, h.len as usize)).collect())
    }

    // Waits for the whole device before it unmaps: see Note [teardown waits for the device]
    // in DESIGN.md.
    fn teardown(&mut self, chunks: Vec<AddrRange>) {
        let mut st = std::mem::take(self.state.get_mut());
        if st.base == 0 {
            return;
        }
        if !matches!(st.sleep, Sleep::Awake) {
            // Asleep, the books name memory given back: unmap what is still mapped.
            let _ = self.device.synchronize();
            let retired = std::mem::take(&mut st.retired);
            self.unmap_retired(&mut st, retired, true);
            let mut aliases: Vec<AddrRange> =
                st.aliases.iter().map(|(&at, &(len, _))| AddrRange::new(at, len)).collect();
            if let Sleep::Asleep(slept) = &st.sleep {
                let held = slept.aliases.iter().filter(|a| slept.held_aliases.contains(&a.range.addr));
                aliases.extend(held.map(|a| a.range));
            }
            for r in aliases.into_iter().chain(mapped_homes(&st)) {
                let _ = self.device.unmap(r.addr, r.len as usize);
            }
            let _ = self.device.free_address(st.base, st.reservation as usize);
            return;
        }
        if !chunks.is_empty() || !st.retired.is_empty() {
            // An unmap does not wait for the last uses: wait for the device, as the
            // `cuMemFree` of a chunk would. Not for the pool's stream: a program may have
            // destroyed it once its allocations were freed (its handle would be undefined).
            let _ = self.device.synchronize();
        }
        let retired = std::mem::take(&mut st.retired);
        self.unmap_retired(&mut st, retired, true);
        // Chunks and homes may share a granule (a stitched range's end takes part of one):
        // each granule is unmapped once.
        let g = st.granularity;
        let mut extents: Vec<AddrRange> = chunks.into_iter().map(|c| extent(g, c)).collect();
        extents.sort_unstable();
        let mut merged: Vec<AddrRange> = Vec::new();
        for r in extents {
            match merged.last_mut() {
                Some(m) if r.addr <= m.end() => m.len = m.len.max(r.end() - m.addr),
                _ => merged.push(r),
            }
        }
        for r in merged {
            let _ = self.device.unmap(r.addr, r.len as usize);
        }
        let _ = self.device.free_address(st.base, st.reservation as usize);
    }
}

/// The start of the smallest run of `runs` of at least `len` bytes.
fn smallest_run(runs: &BTreeMap<u64, u64>, len: u64) -> Option<u64> {
    runs.iter().filter(|&(_, &run)| run >= len).min_by_key(|&(&at, &run)| (run, at)).map(|(&at, _)| at)
}

/// The free home blocks (below `limit`) of `only`'s class (of either without), each with its
/// class. Stitches take only large blocks (`only` large): small blocks are left to the small
/// class, whose granules lie apart (see `runs_of`).
fn free_home_blocks(
    p: &BestFitPolicy,
    limit: u64,
    only: Option<Class>,
) -> impl Iterator<Item = (Class, AddrRange)> + '_ {
    p.free_blocks().filter(move |&(class, b)| b.addr < limit && only.is_none_or(|c| c == class))
}

/// The whole granules of each free home block (below `limit`, of `only`'s class) that holds
/// some, as one range with the block's class.
fn whole_granules(
    p: &BestFitPolicy,
    g: u64,
    limit: u64,
    only: Option<Class>,
) -> impl Iterator<Item = (Class, AddrRange)> + '_ {
    free_home_blocks(p, limit, only).filter_map(move |(class, b)| {
        let (lo, hi) = (b.addr.div_ceil(g) * g, b.end() / g * g);
        (hi > lo).then(|| (class, AddrRange::new(lo, hi - lo)))
    })
}

/// The granule-aligned range that maps `r`.
fn extent(g: u64, r: AddrRange) -> AddrRange {
    let start = r.addr / g * g;
    AddrRange::new(start, r.end().div_ceil(g) * g - start)
}

/// The largest free head of a granule among the free home blocks (below `limit`): the part
/// of a granule from its start to the end of a free block that covers that start and ends
/// inside it, with its class. The rest of the granule belongs to the next block. A stitched
/// range may end with one: it maps the whole granule, but its chunk leaves the rest out.
/// Only heads: see DESIGN.md, Note [granule heads].
fn partial_head(p: &BestFitPolicy, g: u64, limit: u64) -> Option<(Class, AddrRange)> {
    free_home_blocks(p, limit, Some(Class::Large))
        .filter_map(|(class, b)| {
            let (down, end) = (b.end() / g * g, b.end());
            (end % g != 0 && b.addr <= down).then_some((class, AddrRange::new(down, end - down)))
        })
        .max_by_key(|&(_, h)| (h.len, std::cmp::Reverse(h.addr)))
}

/// What a stitch for a request of `rounded` bytes can take of the free home memory (below
/// `limit`): the bytes of its whole free granules and, when there are some but fewer than
/// the request's granules, the free head of a granule ([`partial_head`]) the range may end
/// with (a range of a head alone would map a granule again for memory a free block already
/// holds).
fn stitch_sources(p: &BestFitPolicy, g: u64, rounded: u64, limit: u64) -> (u64, Option<(Class, AddrRange)>) {
    let whole: u64 = whole_granules(p, g, limit, Some(Class::Large)).map(|(_, r)| r.len).sum();
    let short = whole > 0 && whole < rounded.div_ceil(g) * g;
    (whole, if short { partial_head(p, g, limit) } else { None })
}

/// Takes the home memory of a stitched range for a request of `rounded` bytes out of `p`
/// (below `limit`), in the order the range maps it ([`stitch_sources`]): the request's
/// granules of whole free granules ([`carve_free_granules`]), or all of them and then a free
/// head that makes up the rest. Less than the request when the free memory does not make it
/// up.
fn carve_stitch(p: &mut BestFitPolicy, g: u64, rounded: u64, limit: u64) -> Vec<(Class, AddrRange)> {
    let (whole, head) = stitch_sources(p, g, rounded, limit);
    let Some((class, head)) = head.filter(|&(_, h)| whole + h.len >= rounded) else {
        return carve_free_granules(p, g, rounded.div_ceil(g) * g, limit, Some(Class::Large));
    };
    let mut homes = carve_free_granules(p, g, whole, limit, Some(Class::Large));
    if p.carve(head.addr, head.len).is_ok() {
        homes.push((class, head));
    }
    homes
}

/// The placement of a growth for a request of `rounded` bytes of `class` in the unmapped
/// `holes` that maps the fewest bytes (the smallest unmapped run among equals), counting the
/// free block of `class` at the end of the mapped range before a run and at the start of the
/// one after it; `None` if no run is large enough.
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

/// The unmapped runs of the home area where growths of `class` map first: those of its half
/// (large below `small_area`, small above it), start -> length.
///
/// Small blocks lie apart from large ones: a pool keeps small blocks parked between uses, so
/// memory that was small once stays small (see DESIGN.md, "Warm passes").
fn runs_of(st: &State, class: Class) -> BTreeMap<u64, u64> {
    let home_end = st.stitch_area.saturating_sub(st.granularity);
    let (lo, hi) = match class {
        Class::Large => (st.base, st.small_area),
        Class::Small => (st.small_area, home_end),
    };
    st.holes
        .iter()
        .filter_map(|(&at, &len)| {
            let (start, end) = (at.max(lo), (at + len).min(hi));
            (end > start).then(|| (start, end - start))
        })
        .collect()
}

/// Tells `books` where the growths of each class extend the home memory: the start of the
/// highest unmapped run of its half ([`BestFitPolicy::set_frontier`]).
fn sync_frontier(st: &State, books: &mut BestFitPolicy) {
    for class in [Class::Large, Class::Small] {
        if let Some((&at, _)) = runs_of(st, class).iter().next_back() {
            books.set_frontier(class, at);
        }
    }
}

/// Puts back what a release or a sleep that did not happen took: the ranges wait as retired,
/// the granules go back to the pool.
fn put_back(st: &mut State, books: &mut BestFitPolicy, taken: Taken) {
    if !taken.ranges.is_empty() {
        st.retired.push(Retired { event: None, ranges: taken.ranges });
    }
    let _ = taken.granules.iter().try_for_each(|&(k, r)| books.add_joined(k, r.addr, r.len));
}

/// Takes up to `bytes` of whole free granules of home blocks (below `limit`) out of `p`,
/// those of the largest free blocks first, each block's from its start; the ranges taken.
/// See DESIGN.md, Note [stitch from the largest free blocks].
fn carve_free_granules(
    p: &mut BestFitPolicy,
    g: u64,
    bytes: u64,
    limit: u64,
    only: Option<Class>,
) -> Vec<(Class, AddrRange)> {
    let mut candidates: Vec<(Class, AddrRange)> = whole_granules(p, g, limit, only).collect();
    candidates.sort_unstable_by_key(|&(_, r)| (std::cmp::Reverse(r.len), r.addr));
    let mut carved = Vec::new();
    let mut left = bytes;
    for (class, r) in candidates {
        if left == 0 {
            break;
        }
        let take = if left >= r.len { r.len } else { left.div_ceil(g) * g };
        if p.carve(r.addr, take).is_ok() {
            carved.push((class, AddrRange::new(r.addr, take)));
            left = left.saturating_sub(take);
        }
    }
    carved
}

/// The mapped runs of the home area, in address order: what its unmapped runs leave.
fn mapped_homes(st: &State) -> Vec<AddrRange> {
    let end = st.stitch_area.saturating_sub(st.granularity);
    let mut runs = Vec::new();
    let mut at = st.base;
    for (&hole, &len) in &st.holes {
        if hole > at {
            runs.push(AddrRange::new(at, hole - at));
        }
        at = hole + len;
    }
    if end > at {
        runs.push(AddrRange::new(at, end - at));
    }
    runs
}

/// `runs` without `cut` (both sorted by address, each without overlaps within itself).
fn subtract(runs: &[AddrRange], cut: &[AddrRange]) -> Vec<AddrRange> {
    let mut out = Vec::new();
    for &run in runs {
        let mut at = run.addr;
        for c in cut.iter().filter(|c| c.overlaps(run)) {
            if c.addr > at {
                out.push(AddrRange::new(at, c.addr - at));
            }
            at = at.max(c.end());
        }
        if run.end() > at {
            out.push(AddrRange::new(at, run.end() - at));
        }
    }
    out
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
