//! The process-wide state behind the C ABI: one [`Facade`], whose stacks keep the live
//! allocations by pointer, and the events the CuPy free path records.

use std::os::raw::c_int;
use std::sync::OnceLock;

use core_alloc::device::EventPool;
use core_alloc::error::try_each;
use core_alloc::facade::private_pools::{PoolId, Routed, StreamFilter};
use core_alloc::facade::{Config, DeviceKind, DeviceStack, Facade, Freed, StreamHint, MAX_DEVICES};
use core_alloc::{Allocator, DevicePtr, Error, Result, Stats, Stream};

use crate::fork;
use crate::opened::Opened;
use crate::sim_streams::SimStreams;

/// Everything the exported functions share.
pub(crate) struct State {
    facade: Facade,
    /// Per device, events recorded on the legacy default stream by [`State::free_legacy`].
    legacy_events: Box<[OnceLock<EventPool>]>,
    /// With `device=sim`, the simulated streams C holds, by handle.
    sim_streams: SimStreams,
    /// Ranges of other processes' memory mapped by `streamalloc_ipc_open`.
    opened: Opened,
}

extern "C" {
    fn atexit(f: extern "C" fn()) -> c_int;
}

/// Writes out buffered trace rows when the process exits (the state is never dropped); in a
/// forked child, nothing (the trace's lock may have been held by a thread of the parent).
extern "C" fn flush_at_exit() {
    if fork::forked() {
        return;
    }
    let _ = std::panic::catch_unwind(|| {
        if let Some(Ok(state)) = STATE.get() {
            if let Err(e) = state.facade.flush() {
                eprintln!("streamalloc: writing the trace at exit: {e}");
            }
        }
    });
}

/// Built once, at the first call, from [`streamalloc_configure`](crate::streamalloc_configure)
/// or else from `STREAMALLOC_CONF`. A bad `STREAMALLOC_CONF` is kept as the error every call
/// then reports.
static STATE: OnceLock<Result<State>> = OnceLock::new();

impl State {
    pub(crate) fn new(config: Config) -> Self {
        if config.trace.is_some() {
            // SAFETY: `atexit` is given a function with the C ABI that never unwinds; registering
            // it has no other precondition.
            unsafe { atexit(flush_at_exit) };
        }
        Self {
            facade: Facade::new(config),
            legacy_events: (0..MAX_DEVICES).map(|_| OnceLock::new()).collect(),
            sim_streams: SimStreams::default(),
            opened: Opened::default(),
        }
    }

    /// The state, built from `STREAMALLOC_CONF` on first use. In a child forked after the
    /// library came into use, an error, at once (see [`fork`]).
    pub(crate) fn get() -> Result<&'static State> {
        fork::check()?;
        let state = match STATE.get() {
            Some(state) => state,
            None => {
                fork::note_use();
                STATE.get_or_init(|| Config::from_env().map(State::new))
            }
        };
        match state {
            Ok(s) => Ok(s),
            Err(e) => Err(e.clone()),
        }
    }

    /// Builds the state from `config` with the environment's trace
    /// ([`Config::with_env_trace`]); if it is already built, succeeds only when it was built
    /// from an equal configuration.
    pub(crate) fn configure(config: Config) -> Result<()> {
        fork::check()?;
        fork::note_use();
        let config = config.with_env_trace();
        let mut built_here = false;
        let state = STATE.get_or_init(|| {
            built_here = true;
            Ok(State::new(config.clone()))
        });
        match state {
            _ if built_here => Ok(()),
            Ok(s) if *s.facade.config() == config => Ok(()),
            Ok(s) => Err(Error::Config(format!(
                "already configured with `{}` (at first use, or by an earlier configure); cannot change to `{config}`",
                s.facade.config()
            ))),
            Err(e) => Err(Error::Config(format!("the configuration was fixed at first use and is bad: {e}"))),
        }
    }

    /// The facade that serves every device.
    pub(crate) fn facade(&self) -> &Facade {
        &self.facade
    }

    /// The configuration in force.
    pub(crate) fn config(&self) -> &Config {
        self.facade.config()
    }

    /// The stack of `device`, built on first use.
    pub(crate) fn stack(&self, device: c_int) -> Result<&DeviceStack> {
        self.facade.stack(ordinal(device)?)
    }

    /// The simulated streams C holds.
    pub(crate) fn sim_streams(&self) -> &SimStreams {
        &self.sim_streams
    }

    /// The stacks built so far.
    pub(crate) fn stacks(&self) -> impl Iterator<Item = &DeviceStack> {
        self.facade.built_stacks()
    }

    /// The ranges `streamalloc_ipc_open` mapped and not yet closed.
    pub(crate) fn opened(&self) -> &Opened {
        &self.opened
    }

    /// The stream a C handle stands for on `device` (`None`: any): itself on CUDA; with
    /// `device=sim`, NULL or a handle of [`SimStreams`], anything else an error.
    pub(crate) fn stream(&self, handle: u64, device: Option<usize>) -> Result<Stream> {
        let named = self.named(handle)?;
        match (named.device, device) {
            (Some(o), Some(d)) if o != d => {
                Err(Error::InvalidArgument(format!("stream {handle:#x} is not a stream of device {d}")))
            }
            _ => Ok(named.stream),
        }
    }

    /// The C handle of `stream` of `device`: itself on CUDA; with `device=sim`, the handle
    /// [`SimStreams`] gave it (0 for one it gave none).
    pub(crate) fn handle(&self, device: usize, stream: Stream) -> u64 {
        match self.config().device {
            DeviceKind::Sim => self.sim_streams.handle_of(device, stream),
            _ => stream.raw(),
        }
    }

    /// The stream a C handle stands for, with its device when the handle says which.
    fn named(&self, handle: u64) -> Result<StreamHint> {
        if self.config().device != DeviceKind::Sim {
            // SAFETY: a stream handle a caller of the C ABI passes is a live `cudaStream_t` of
            // the device it names, or NULL (the header's contract for every `stream` argument).
            return Ok(StreamHint { device: None, stream: unsafe { Stream::from_raw(handle) } });
        }
        let (device, stream) = self.sim_streams.get(handle)?;
        Ok(StreamHint { device, stream })
    }

    /// Allocates `size` bytes owned by the stream of C handle `stream`; 0 (null) for size 0.
    /// With `device=sim`, the ordering checker sees every handout.
    pub(crate) fn allocate(&self, size: usize, device: c_int, stream: u64) -> Result<DevicePtr> {
        self.allocate_with(size, device, stream, 0).map(|(ptr, _)| ptr)
    }

    /// [`State::allocate`], keeping the front end's `word` with the allocation (see
    /// [`Pointers::allocate_ptr_with`](core_alloc::adaptors::Pointers::allocate_ptr_with));
    /// with the private pool that took it, if one did.
    pub(crate) fn allocate_with(
        &self,
        size: usize,
        device: c_int,
        stream: u64,
        word: u64,
    ) -> Result<(DevicePtr, Option<PoolId>)> {
        let device = ordinal(device)?;
        if size == 0 {
            return Ok((0, None));
        }
        if size > isize::MAX as usize {
            return Err(Error::InvalidArgument(format!("size {size} is larger than any allocation can be")));
        }
        let stream = self.stream(stream, Some(device))?;
        let stack = self.facade.stack(device)?;
        // No private pool active: nothing to route (what `allocate_with` would answer).
        let (routed, pool) = match stack.private.is_active() {
            true => stack.private.allocate_with(size, stream, word)?,
            false => (Routed::Main { graphed: false }, None),
        };
        let ptr = match routed {
            Routed::Pool(ptr) => ptr,
            Routed::Main { graphed } => {
                let ptr = stack.allocate_ptr_with(size, stream, word)?;
                if graphed {
                    stack.private.note_graphed(ptr);
                }
                ptr
            }
        };
        if let Some(sim) = &stack.sim {
            sim.check_handout(ptr, size, stack.allocator.owner_of(ptr, stream).unwrap_or(stream));
        }
        Ok((ptr, pool))
    }

    /// The bytes [`State::set_memory_fraction`] allows on `device`, if it was called.
    pub(crate) fn fraction_limit(&self, device: c_int) -> Result<Option<usize>> {
        Ok(self.facade.stack(ordinal(device)?)?.reserved_limit.get())
    }

    /// Limits device `device` to `fraction` of its memory (0 < fraction <= 1), as
    /// `torch.cuda.set_per_process_memory_fraction`.
    pub(crate) fn set_memory_fraction(&self, device: c_int, fraction: f64) -> Result<()> {
        let ordinal = ordinal(device)?;
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(Error::InvalidArgument(format!("memory fraction {fraction} is not in (0, 1]")));
        }
        let stack = self.facade.stack(ordinal)?;
        let total = stack.device.mem_info()?.total;
        stack.reserved_limit.set(Some((total as f64 * fraction) as usize));
        Ok(())
    }

    /// From now on, allocations on `device` that `filter` matches go to private pool `id`.
    pub(crate) fn pool_begin(&self, device: c_int, id: PoolId, filter: StreamFilter) -> Result<()> {
        self.facade.stack(ordinal(device)?)?.private.begin(id, filter)
    }

    /// Allocations stop going to private pool `id` of `device`; frees deferred during the
    /// captures are done now.
    pub(crate) fn pool_end(&self, device: c_int, id: PoolId) -> Result<()> {
        let ordinal = ordinal(device)?;
        let Some(stack) = self.facade.built(ordinal) else { return Ok(()) };
        // `owner` is a stream of this device, which deferred the free.
        try_each(stack.private.end(id), |(ptr, owner)| {
            self.facade
                .free_now(ptr, Some(ordinal), StreamHint { device: Some(ordinal), stream: owner })
                .map(drop)
        })
    }

    /// Private pool `id` of `device` loses a use (see `PrivatePools::release`).
    pub(crate) fn pool_release(&self, device: c_int, id: PoolId) -> Result<()> {
        if let Some(stack) = self.facade.built(ordinal(device)?) {
            stack.private.release(id);
        }
        Ok(())
    }

    /// The device allocation that holds `ptr`: its base and size.
    pub(crate) fn base_allocation(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
        let mut last = None;
        for stack in self.stacks_from(None) {
            match stack.device.address_range(ptr) {
                Ok(found) => return Ok(found),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| not_live(ptr)))
    }

    /// Returns the cached memory of every device in use to the driver, except while a private
    /// pool is active (a graph capture may be under way); the bytes returned.
    pub(crate) fn empty_cache(&self) -> Result<usize> {
        if self.facade.built_stacks().any(|s| s.private.is_active()) {
            return Ok(0);
        }
        self.facade.release_all()
    }

    /// Frees the allocation at `ptr` (null: nothing to do). `device` and `owner` (a C handle)
    /// are where the caller says it was made, looked at first.
    ///
    /// Under `async`, memory from outside a capture freed on its capturing stream waits for
    /// the capture's end (see `PrivatePools::defer_free`), which only the stack holding `ptr`
    /// decides. The stacks are asked in turn; one that cannot tell (its device does not know
    /// `owner`: a stream of another device) frees nothing here, and its error stands only if
    /// `ptr` is none of the other stacks' (its memory then stays allocated rather than be
    /// freed into a graph): another device's error never cancels the free.
    pub(crate) fn free(&self, ptr: DevicePtr, device: Option<c_int>, owner: u64) -> Result<()> {
        self.take(ptr, device, owner).map(drop)
    }

    /// [`State::free`], returning what the library kept for the allocation (`None` for null):
    /// [`Facade::free_ptr`] with `owner`'s stream as the C handle names it.
    pub(crate) fn take(&self, ptr: DevicePtr, device: Option<c_int>, owner: u64) -> Result<Option<Freed>> {
        // Only a hint: one that stands for no stream is no reason to keep the memory.
        let owner = self.named(owner).unwrap_or(StreamHint::DEFAULT);
        self.facade.free_ptr(ptr, device.and_then(|d| usize::try_from(d).ok()), owner)
    }

    /// What the library keeps for the live allocation at `ptr` ([`Facade::entry`]).
    pub(crate) fn entry(&self, ptr: DevicePtr) -> Result<Freed> {
        self.facade.entry(ptr)
    }

    /// Frees the allocation at `ptr` (null: nothing to do), made on the legacy default stream
    /// of `device`, whose users may be any *blocking* streams: an event recorded on the
    /// legacy default stream first waits for all work already enqueued on every blocking
    /// stream, and all later work on those streams waits for it, so whoever reuses the memory
    /// next is ordered after its last use. If the record fails, the memory is leaked rather
    /// than handed out while a kernel may still use it.
    pub(crate) fn free_legacy(&self, ptr: DevicePtr, device: c_int) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        for stack in self.stacks_from(Some(device)) {
            // Recorded before the free, so that nobody can reuse the memory ahead of it.
            self.record_legacy(stack)?;
            if stack.allocator.free_ptr(ptr, Stream::DEFAULT) || stack.private.free(ptr, Stream::DEFAULT) {
                return Ok(());
            }
        }
        Err(not_live(ptr))
    }

    /// Records an event on the legacy default stream of `stack`'s device.
    fn record_legacy(&self, stack: &DeviceStack) -> Result<()> {
        let device = &stack.device;
        let events = self
            .legacy_events
            .get(device.ordinal())
            .ok_or_else(|| Error::InvalidArgument(format!("device {} has no slot", device.ordinal())))?
            .get_or_init(|| EventPool::new(device.clone()));
        let event = events.get()?;
        let recorded = device.record_event(event, Stream::DEFAULT);
        // Nothing waits on the event itself: it can be recorded again at once.
        events.put(event);
        recorded
    }

    /// Marks `stream` as a user of the allocation at `ptr` (null: nothing to do). A stream
    /// that is not a live stream of the allocation's device is an error, and nothing is
    /// recorded; so is, with `device=sim`, the handle of another device's stream (the
    /// simulators number their streams alike: it would name a stream of this device).
    pub(crate) fn record_stream(&self, ptr: DevicePtr, stream: u64) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        self.facade.record_stream(ptr, self.named(stream)?)
    }

    /// The stacks built so far, that of `device` (if it is one in use) first.
    fn stacks_from(&self, device: Option<c_int>) -> impl Iterator<Item = &DeviceStack> {
        self.facade.stacks_from(device.and_then(|d| usize::try_from(d).ok()))
    }

    /// Returns cached memory of `device` to the driver; the bytes returned (0 for a device
    /// not used yet, whose stack is not built for this).
    pub(crate) fn release(&self, device: c_int) -> Result<usize> {
        let device = ordinal(device)?;
        self.facade.built(device).map_or(Ok(0), |s| s.allocator.release())
    }

    /// Forgets what `device`'s stack and private pools keep for `stream`, which the caller is
    /// about to destroy ([`Facade::retire_stream`]); nothing for a device not used yet.
    pub(crate) fn retire_stream(&self, device: c_int, stream: u64) -> Result<()> {
        let device = ordinal(device)?;
        let stream = self.stream(stream, Some(device))?;
        self.facade.retire_stream(device, stream)
    }

    /// Grants device `peer` access to the memory `device`'s stack maps, now and later.
    pub(crate) fn enable_peer_access(&self, device: c_int, peer: c_int) -> Result<()> {
        self.facade.enable_peer_access(ordinal(device)?, ordinal(peer)?)
    }

    /// Restarts the peaks of `device`'s statistics (nothing to do for a device not used yet).
    pub(crate) fn reset_peak_stats(&self, device: c_int) -> Result<()> {
        if let Some(stack) = self.facade.built(ordinal(device)?) {
            stack.allocator.reset_peak_stats();
            stack.private.reset_peak_stats();
        }
        Ok(())
    }

    /// Statistics of `device`, its private pools included (zeros for a device not used
    /// yet).
    pub(crate) fn stats(&self, device: c_int) -> Result<Stats> {
        let ordinal = ordinal(device)?;
        let private = self.facade.built(ordinal).map(|s| s.private.stats()).unwrap_or_default();
        Ok([self.facade.stats(ordinal), private].into_iter().sum())
    }
}

pub(crate) fn ordinal(device: c_int) -> Result<usize> {
    usize::try_from(device).ok().filter(|d| *d < MAX_DEVICES).ok_or_else(|| {
        Error::InvalidArgument(format!("device {device} is not a device ordinal in 0..{MAX_DEVICES}"))
    })
}

fn not_live(ptr: DevicePtr) -> Error {
    Error::InvalidArgument(format!(
        "{ptr:#x} is not a live streamalloc allocation (freed twice, or not made by streamalloc)"
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use core_alloc::device::{CaptureStatus, Graphs, Streams};

    use super::*;

    /// PyTorch's warm-up then capture on one stream under `async`: the warm-up's output,
    /// reassigned inside the capture, is freed on the capturing stream. The free waits for the
    /// capture's end; captured, it would free memory from outside the graph at every replay
    /// (the simulator fails the second replay's free of an unknown pointer, as the memory may
    /// meanwhile belong to someone else).
    #[test]
    fn under_async_a_free_in_a_capture_of_memory_from_before_it_waits_for_the_end() {
        let live = capture_that_frees_the_warm_up(|state, warm_up, handle, _| {
            state.free(warm_up, Some(0), handle).unwrap();
        });
        assert_eq!(live, 1, "the graph's output is live, the warm-up's freed");
    }

    /// Issue 48: the torch backend keeps no table, so its free names the current stream, not
    /// the allocation's: the warm-up's output, freed inside the capture with the legacy default
    /// stream as the hint, still waits for the capture's end (the allocation's own stream
    /// decides), or every replay would free it.
    #[test]
    fn under_async_a_free_in_a_capture_is_deferred_whatever_stream_the_free_names() {
        capture_that_frees_the_warm_up(|state, warm_up, _, s| {
            let freed = state.take(warm_up, None, 0).unwrap().expect("the warm-up's entry");
            assert_eq!(freed.entry.stream, s);
        });
    }

    /// Under async, on the simulator: a warm-up allocation on a stream, then a capture on that
    /// stream into a private pool that allocates the graph's output and, inside it, `free`s the
    /// warm-up (given the state, the warm-up, the stream's handle and the stream); the graph is
    /// replayed twice, which must free nothing it did not allocate and break no ordering rule.
    /// The stack's live allocations after.
    fn capture_that_frees_the_warm_up(free: impl FnOnce(&State, DevicePtr, u64, Stream)) -> u64 {
        let state = State::new(Config::parse("device=sim,strategy=async,sim_capacity=4GiB").unwrap());
        let stack = state.stack(0).unwrap();
        let sim = stack.sim.clone().unwrap();
        let s = sim.create_stream().unwrap();
        let handle = state.sim_streams().insert(0, s);
        let warm_up = state.allocate(4 << 20, 0, handle).unwrap();
        let filter_sim = sim.clone();
        let filter: StreamFilter =
            Arc::new(move |x| filter_sim.capture_status(x).is_ok_and(|c| c != CaptureStatus::None));
        state.pool_begin(0, (0, 1), filter).unwrap();
        sim.begin_capture(s).unwrap();
        let out = state.allocate(4 << 20, 0, handle).unwrap();
        sim.use_range(out, 4 << 20, s, 1_000).unwrap();
        free(&state, warm_up, handle, s);
        let graph = sim.end_capture(s).unwrap();
        state.pool_end(0, (0, 1)).unwrap();
        let exec = sim.instantiate_graph_auto_free(graph).unwrap();
        sim.launch_graph(exec, s).unwrap();
        sim.launch_graph(exec, s).expect("the second replay frees nothing the graph did not allocate");
        sim.synchronize_stream(s).unwrap();
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
        stack.allocator.stats().live_allocations
    }

    /// Issue 33: under a memory fraction, a release that failed inside an allocation returned
    /// its error and leaked the block just allocated. Here the release times out: the cache
    /// it would give back is still used by a kernel an hour long, and `wait_timeout` is 1 ms.
    #[test]
    fn a_release_that_fails_under_a_memory_fraction_frees_the_block_it_allocated() {
        let conf = "device=sim,strategy=stream_safe,sim_capacity=1GiB,wait_timeout=1ms";
        let state = State::new(Config::parse(conf).unwrap());
        let sim = state.stack(0).unwrap().sim.clone().unwrap();
        let s = sim.create_stream().unwrap();
        let handle = state.sim_streams().insert(0, s);
        let busy = state.allocate(300 << 20, 0, handle).unwrap();
        sim.use_range(busy, 300 << 20, s, 3_600_000_000_000).unwrap();
        state.free(busy, Some(0), handle).unwrap();
        state.set_memory_fraction(0, 0.5).unwrap();
        let before = state.stats(0).unwrap();
        let e = state.allocate(300 << 20, 0, 0).expect_err("the release before the limit's check fails");
        assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
        let after = state.stats(0).unwrap();
        assert_eq!(
            (after.allocated, after.live_allocations),
            (before.allocated, before.live_allocations),
            "the block allocated before the failed release is freed"
        );
        sim.synchronize_stream(s).unwrap();
        let p = state.allocate(300 << 20, 0, 0).expect("once the kernel is done the release succeeds");
        state.free(p, Some(0), 0).unwrap();
    }

    /// Issue 33: under `async`, while device 1 had a graph pool active, freeing memory of
    /// device 0 failed ("unknown or destroyed stream": device 1 was asked about device 0's
    /// stream) and the memory stayed allocated. Only the stack that holds the pointer decides.
    #[test]
    fn under_async_a_free_is_decided_by_the_device_that_owns_the_pointer() {
        let state = State::new(Config::parse("device=sim,strategy=async,sim_capacity=4GiB").unwrap());
        let sim0 = state.stack(0).unwrap().sim.clone().unwrap();
        let s0 = sim0.create_stream().unwrap();
        let handle = state.sim_streams().insert(0, s0);
        let sim1 = state.stack(1).unwrap().sim.clone().unwrap();
        let filter_sim = sim1.clone();
        let filter: StreamFilter =
            Arc::new(move |x| filter_sim.capture_status(x).is_ok_and(|c| c != CaptureStatus::None));
        state.pool_begin(1, (0, 7), filter).unwrap();
        // With and without the device as torch gives it, and by the C API (no owner).
        for (device, owner) in [(Some(0), handle), (None, handle), (None, 0), (Some(1), handle)] {
            let p = state.allocate(4 << 20, 0, handle).unwrap();
            state.free(p, device, owner).unwrap_or_else(|e| panic!("{device:?}: {e}"));
            assert_eq!(state.stats(0).unwrap().allocated, 0, "{device:?}: freed");
            let again = state.free(p, device, owner).expect_err("a double free");
            assert!(again.to_string().contains("not a live"), "{again}");
        }
        state.pool_end(1, (0, 7)).unwrap();
        state.pool_release(1, (0, 7)).unwrap();
    }

    /// Issue 33: a huge range on mapped memory made the simulator walk it granule by granule
    /// under its lock (2^42 granules for 2^63 bytes: hours).
    #[test]
    fn a_huge_range_is_not_walked_granule_by_granule() {
        let conf = "device=sim,strategy=stream_safe,sim_capacity=1GiB";
        let state = State::new(Config::parse(conf).unwrap());
        let sim = state.stack(0).unwrap().sim.clone().unwrap();
        let s = sim.create_stream().unwrap();
        let handle = state.sim_streams().insert(0, s);
        let p = state.allocate(4 << 20, 0, handle).unwrap();
        assert!(p >= 1 << 50, "stream_safe maps memory into reservations: {p:#x}");
        let start = Instant::now();
        let huge = (1usize << 62) - 4096;
        let result = sim.use_range(p, huge, s, 1_000);
        assert!(start.elapsed() < Duration::from_secs(5), "{:?} for {result:?}", start.elapsed());
        let start = Instant::now();
        assert_eq!(sim.check_handout(p, 4 << 20, Stream::DEFAULT), 0, "the kernel on {s:?} ended");
        assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
        sim.synchronize_stream(s).unwrap();
        state.free(p, Some(0), handle).unwrap();
    }
}
