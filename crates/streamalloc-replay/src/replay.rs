//! Replays a [`Trace`] through an allocator and measures footprint and speed.
//!
//! The method is the one of the external comparison harness the README's measurements used
//! (`lab/run prepare`), so figures compare with its figures:
//!
//! * **Pass 0** (untimed) runs every operation and samples the device's memory use
//!   ([`DeviceMemory::mem_info`](streamalloc::device::DeviceMemory::mem_info)) after each one. Its peak, minus the use measured just before
//!   the pass, is [`ReplayResult::peak_device_used`]; divided by the trace's peak live bytes
//!   it is the [`ReplayResult::footprint_ratio`] (1.0 is a perfect allocator, which no
//!   real one reaches). The samples, downsampled, are [`ReplayResult::series`].
//! * **Passes 1..=N** (timed, [`ReplayOptions::passes`], default 3) run the trace again on
//!   the same allocator, so caches are warm; the best pass gives
//!   [`ReplayResult::ns_per_op_warm`].
//!
//! Each pass ends by freeing what is still live and synchronizing the streams the replay
//! uses; both are inside the timing. A failed allocation is counted, not fatal: its slot
//! stays empty and the later free of it is skipped. The recorded stream 0 (PyTorch's and
//! CuPy's default stream) is replayed on [`Stream::DEFAULT`], every other recorded stream on
//! a stream the replay creates.
//!
//! Replays that are compared must start from the same state: [`settle`] returns what a
//! device's default stream-ordered pool keeps (it outlives the allocators that used it) and
//! says how much memory is then in use, and [`check_start`] refuses a start with more.
//!
//! # Threads
//!
//! With [`ReplayOptions::threads`], each recorded thread (the trace's `Thread` column) is
//! replayed on a thread of its own, as RMM's replay benchmark does, all starting together.
//! Each thread runs its own rows in recorded order. The one dependency between threads is a
//! free of an allocation made on another thread: that free waits (spinning, for at most
//! [`WAIT_BOUND`]) until the allocation is done in the same pass. A thread only ever waits
//! for a row recorded *before* the one it is at, so the earliest row not yet run can always
//! run and the replay cannot deadlock; unlike RMM's benchmark, which runs the rows of all
//! threads one at a time in recorded order, unrelated rows of different threads run
//! concurrently, so the allocator meets real contention. Memory figures then depend on the
//! interleaving and may differ from run to run.
//!
//! # Streams and time
//!
//! A `record_stream` row records the replay's stream of its index on the live allocation
//! ([`Allocation::record_stream`]), and a `wait` row makes one replay stream wait for the
//! work enqueued so far on another (an event recorded on the one, waited for by the other),
//! on every device. With [`ReplayOptions::time`], the replay also runs the trace's time on
//! the simulator: before each row it moves the simulator's clock to the row's `Time` (counted
//! from the first row, from where the clock stood when the pass began; it never goes back),
//! a `use` row enqueues a simulated kernel on the replay's stream of its index that touches
//! the allocation's range for the row's duration, and every allocation handed out is shown
//! to the ordering checker ([`SimDevice::check_handout`]), whose violations the result counts
//! ([`ReplayResult::violations`]). So memory that a busy stream still uses is not reused
//! before that stream is done, under every allocator, as on a GPU. Without it (and on a GPU,
//! where nothing runs the recorded work) `use` rows are skipped and the rows run back to
//! back, as in a trace without stream rows, whose replay is the same either way. On threads,
//! a `record_stream` or `use` row of an allocation made on another thread waits for it as a
//! free does; a `wait` row waits for nothing, so it orders only the work of the other stream
//! enqueued by then.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::trace::{Op, Trace};
use streamalloc::device::sim::SimDevice;
use streamalloc::device::{Device, Event, PoolAttr, Stream};
use streamalloc::{Allocation, Error, Result};

/// The allocator under replay: without a stream API ([`Single`](streamalloc::AnyAllocator::Single)) every
/// operation runs on the allocator's own stream and the trace's stream indices are ignored; a
/// stream-aware one ([`Streams`](streamalloc::AnyAllocator::Streams)) allocates on the stream of each operation's
/// recorded stream (the default stream for the recorded stream 0, else one the replay
/// creates).
pub use streamalloc::AnyAllocator as ReplayTarget;

/// How to replay.
#[derive(Clone, Copy)]
pub struct ReplayOptions<'a> {
    /// Timed passes after the measuring pass (at least 1).
    pub passes: usize,
    /// Called now and then (from the replaying threads) with the number of operations run
    /// since the last call; the whole replay runs `trace.len() * (passes + 1)` operations.
    pub progress: Option<&'a (dyn Fn(u64) + Sync)>,
    /// Called after each pass, all its work done, with the pass's number (0: the measuring
    /// pass), e.g. to read the device's counters pass by pass.
    pub pass_done: Option<&'a (dyn Fn(usize) + Sync)>,
    /// Replay each recorded thread on a thread of its own (see [Threads](self#threads)).
    pub threads: bool,
    /// The most points of [`ReplayResult::series`] (at least 1).
    pub series_points: usize,
    /// Replay the trace's time on this simulator, the device replayed on (see [Streams and
    /// time](self#streams-and-time)); `None`: the rows run back to back.
    pub time: Option<&'a SimDevice>,
}

impl Default for ReplayOptions<'_> {
    fn default() -> Self {
        Self { passes: 3, progress: None, pass_done: None, threads: false, series_points: 512, time: None }
    }
}

/// Memory over a replay's measuring pass, downsampled: point `i` covers operations
/// `i * ops_per_point ..` and holds the most seen among them, so peaks survive.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Series {
    /// Trace operations each point covers.
    pub ops_per_point: usize,
    /// Bytes allocated by the replay and not yet freed.
    pub live: Vec<u64>,
    /// Device memory used by the replay (above the use before it): what the allocator
    /// reserved from the device.
    pub reserved: Vec<u64>,
}

impl Series {
    /// Whether the series has no points.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }
}

/// What a replay measured. Serializes to the comparison harness's JSON field names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayResult {
    /// Name of the allocator, as the caller gave it.
    pub allocator: String,
    /// Name of the trace.
    pub trace: String,
    /// Operations in the trace (allocations, frees and stream rows).
    pub ops: usize,
    /// The trace's peak live bytes.
    pub peak_live: usize,
    /// Peak device memory used during pass 0, minus the use before it.
    pub peak_device_used: usize,
    /// `peak_device_used / peak_live` (0 for a trace with no live bytes).
    pub footprint_ratio: f64,
    /// The allocator's peak reserved bytes ([`Stats::reserved_peak`](streamalloc::Stats)) after
    /// all passes.
    pub reserved_peak: usize,
    /// Device allocations plus device frees made during pass 0.
    pub device_calls: u64,
    /// Best timed pass, in nanoseconds per operation.
    pub ns_per_op_warm: f64,
    /// Each timed pass, in nanoseconds per operation, in the order run (their spread says
    /// how much a ratio of two `ns_per_op_warm` means).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ns_per_op_passes: Vec<f64>,
    /// Most failed allocations in any one pass.
    pub failures: u64,
    /// Timed passes run.
    pub passes: usize,
    /// Threads the operations ran on.
    #[serde(default = "one")]
    pub threads: usize,
    /// Whether the trace's time was replayed on the simulator ([`ReplayOptions::time`]).
    #[serde(default)]
    pub time: bool,
    /// Most early reuses the simulator's ordering checker found in any one pass (memory
    /// handed to a stream while another stream's work could still use it); checked only when
    /// time is replayed.
    #[serde(default)]
    pub violations: u64,
    /// The first allocation error met, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_failure: Option<String>,
    /// The operation (from 1, in the trace's order) whose allocation failed first, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_failure_op: Option<usize>,
    /// For a first failure out of memory, the bytes the device lacked at least: those asked
    /// for beyond the device's free bytes, or those handed out plus those asked for beyond its
    /// total, whichever is more (0: the device had them free, the allocator's own limits or
    /// fragmentation refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_failure_short: Option<usize>,
    /// Memory over pass 0.
    #[serde(default, skip_serializing_if = "Series::is_empty")]
    pub series: Series,
}

fn one() -> usize {
    1
}

/// The first allocation that failed in a replay.
struct Failure {
    /// The operation's index.
    op: usize,
    message: String,
    /// See [`ReplayResult::first_failure_short`].
    short: Option<usize>,
}

/// Streams (and the event of `wait` rows) created for a replay, destroyed on drop (errors
/// ignored: nothing to do then).
struct Streams<'a> {
    device: &'a dyn Device,
    /// The stream of each recorded stream index.
    streams: Vec<Stream>,
    /// Recorded on the stream waited for and waited for at each `wait` row.
    event: Option<Event>,
}

impl Drop for Streams<'_> {
    fn drop(&mut self) {
        for &s in self.streams.iter().filter(|s| **s != Stream::DEFAULT) {
            let _ = self.device.synchronize_stream(s);
            let _ = self.device.destroy_stream(s);
        }
        if let Some(event) = self.event {
            let _ = self.device.destroy_event(event);
        }
    }
}

/// The simulator whose clock replays a trace's time.
struct Clock<'a> {
    sim: &'a SimDevice,
    /// The clock's time when the pass began, in ns.
    start: AtomicU64,
    /// Held while the clock is read and moved, so that threads do not move it twice.
    moving: Mutex<()>,
    /// Violations the checker had recorded when the pass began.
    violations_before: AtomicUsize,
}

/// How often (in operations) progress is reported.
const PROGRESS_EVERY: usize = 4096;

/// The longest a thread waits for another thread's allocation before the replay fails.
pub const WAIT_BOUND: Duration = Duration::from_secs(60);

/// Returns to the driver what `device`'s default stream-ordered pool keeps (memory that
/// outlives the allocator that used the pool), resets the pool's high-water marks, and
/// returns the bytes then in use on the device. Devices without pools are only measured.
pub fn settle(device: &dyn Device) -> Result<usize> {
    device.synchronize_stream(Stream::DEFAULT)?;
    match device.default_pool() {
        Ok(pool) => {
            device.trim_pool(pool, 0)?;
            device.set_pool_attr(pool, PoolAttr::ReservedMemHigh, 0)?;
            device.set_pool_attr(pool, PoolAttr::UsedMemHigh, 0)?;
        }
        Err(Error::Unsupported(_)) => {}
        Err(e) => return Err(e),
    }
    Ok(device.mem_info()?.used())
}

/// [`settle`]s `device` and refuses (naming `what` is about to start) when more than
/// `idle + slack` bytes are then in use: memory an earlier replay still holds (or another
/// process took) would be reused and make the replay look better than it is.
pub fn check_start(device: &dyn Device, idle: usize, slack: usize, what: &str) -> Result<()> {
    let used = settle(device)?;
    if used > idle.saturating_add(slack) {
        return Err(Error::InvalidArgument(format!(
            "{} bytes of device memory are in use before {what}, {} more than when the device was \
             opened: something (an earlier replay, or another process) holds memory the replay \
             could reuse, so its figures would be wrong",
            used,
            used - idle
        )));
    }
    Ok(())
}

/// What every pass shares.
struct Shared<'a> {
    trace: &'a Trace,
    target: &'a ReplayTarget,
    device: &'a dyn Device,
    options: &'a ReplayOptions<'a>,
    streams: &'a [Stream],
    /// The event of `wait` rows, and the lock under which it is recorded and waited for.
    wait_event: Option<(Event, Mutex<()>)>,
    /// With [`ReplayOptions::time`].
    clock: Option<Clock<'a>>,
    /// Device use before the replay.
    base: usize,
    live: AtomicUsize,
    ops_per_point: usize,
    live_points: Vec<AtomicU64>,
    reserved_points: Vec<AtomicU64>,
    failures: AtomicU64,
    first_failure: Mutex<Option<Failure>>,
}

impl Shared<'_> {
    fn stream(&self, index: usize) -> Stream {
        self.streams.get(index).copied().unwrap_or(Stream::DEFAULT)
    }

    /// Allocates `size` bytes on recorded stream `stream` for operation `op` (from 0),
    /// counting them live when `sample`; the allocation, or `None` after counting the failure.
    /// With time, the ordering checker sees the handout.
    fn allocate(&self, size: usize, stream: usize, sample: bool, op: usize) -> Option<Allocation> {
        match self.target.allocate_on(size, self.stream(stream)) {
            Ok(a) => {
                if sample {
                    self.live.fetch_add(size, Ordering::Relaxed);
                }
                if let Some(clock) = self.clock.as_ref().filter(|_| a.size() > 0) {
                    clock.sim.check_handout(a.ptr(), a.size(), a.owning_stream());
                }
                Some(a)
            }
            Err(e) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                let short = match &e {
                    Error::OutOfMemory(r) => Some(
                        (r.allocated.saturating_add(r.requested).saturating_sub(r.device_total))
                            .max(r.requested.saturating_sub(r.device_free)),
                    ),
                    _ => None,
                };
                let mut first = self.first_failure.lock();
                // On threads, the earliest operation of those that failed.
                if first.as_ref().is_none_or(|f| f.op > op) {
                    *first = Some(Failure { op, message: e.to_string(), short });
                }
                None
            }
        }
    }

    /// Frees `a` (if the allocation succeeded), counting `size` bytes no longer live when
    /// `sample`.
    fn freed(&self, a: Option<Allocation>, size: usize, sample: bool) {
        if a.is_some() {
            drop(a);
            if sample {
                self.live.fetch_sub(size, Ordering::Relaxed);
            }
        }
    }

    /// Records recorded stream `stream` on `a` (if the allocation succeeded).
    fn record(&self, a: Option<&mut Allocation>, stream: usize) {
        if let Some(a) = a {
            a.record_stream(self.stream(stream));
        }
    }

    /// With time, enqueues on recorded stream `stream` a kernel that uses `a` (if the
    /// allocation succeeded) for `duration_ns`.
    fn run_use(&self, a: Option<&Allocation>, stream: usize, duration_ns: u64) -> Result<()> {
        match (&self.clock, a) {
            (Some(clock), Some(a)) if a.size() > 0 => {
                clock.sim.use_range(a.ptr(), a.size(), self.stream(stream), duration_ns)
            }
            _ => Ok(()),
        }
    }

    /// Makes recorded stream `stream` wait for the work enqueued so far on recorded stream
    /// `other`.
    fn wait(&self, stream: usize, other: usize) -> Result<()> {
        let Some((event, lock)) = &self.wait_event else {
            return Err(Error::InvalidArgument(format!(
                "trace {}: a wait operation, but the trace counts no `wait` rows",
                self.trace.name
            )));
        };
        let _held = lock.lock();
        self.device.record_event(*event, self.stream(other))?;
        self.device.stream_wait_event(self.stream(stream), *event)
    }

    /// With time, moves the simulator's clock to the time of op `index` (never back).
    fn keep_time(&self, index: usize) -> Result<()> {
        let Some(clock) = &self.clock else { return Ok(()) };
        let offset = self.trace.times_us[index].saturating_mul(1000);
        let at = clock.start.load(Ordering::Relaxed).saturating_add(offset);
        let _moving = clock.moving.lock();
        match at.checked_sub(clock.sim.now()) {
            Some(ahead) if ahead > 0 => clock.sim.try_advance(ahead),
            _ => Ok(()),
        }
    }

    /// With time, notes where the clock and the checker stand as a pass begins.
    fn begin_pass(&self) {
        if let Some(clock) = &self.clock {
            clock.start.store(clock.sim.now(), Ordering::Relaxed);
            clock.violations_before.store(clock.sim.violations().len(), Ordering::Relaxed);
        }
    }

    /// The violations the checker recorded since the pass began (0 without time).
    fn pass_violations(&self) -> u64 {
        self.clock.as_ref().map_or(0, |clock| {
            clock.sim.violations().len().saturating_sub(clock.violations_before.load(Ordering::Relaxed))
                as u64
        })
    }

    /// Records memory after op `index` (pass 0).
    fn sample(&self, index: usize) -> Result<()> {
        let used = self.device.mem_info()?.used().saturating_sub(self.base) as u64;
        let point = index / self.ops_per_point;
        self.reserved_points[point].fetch_max(used, Ordering::Relaxed);
        self.live_points[point].fetch_max(self.live.load(Ordering::Relaxed) as u64, Ordering::Relaxed);
        Ok(())
    }

    fn progress(&self, done: usize) {
        if let Some(progress) = self.options.progress {
            if done % PROGRESS_EVERY == 0 {
                progress(PROGRESS_EVERY as u64);
            }
        }
    }

    fn progress_rest(&self, done: usize) {
        if let Some(progress) = self.options.progress {
            progress((done % PROGRESS_EVERY) as u64);
        }
    }

    fn synchronize(&self) -> Result<()> {
        self.device.synchronize_stream(Stream::DEFAULT)?;
        self.streams.iter().try_for_each(|&s| self.device.synchronize_stream(s))
    }

    /// One pass on this thread; returns its duration.
    fn pass(&self, sample: bool) -> Result<Duration> {
        let mut slots: Vec<Option<Allocation>> = Vec::new();
        slots.resize_with(self.trace.slots, || None);
        let start = Instant::now();
        for (i, op) in self.trace.ops.iter().enumerate() {
            self.keep_time(i)?;
            match *op {
                Op::Allocate { slot, size, stream, .. } => {
                    slots[slot] = self.allocate(size, stream, sample, i)
                }
                Op::Free { slot, .. } => self.freed(slots[slot].take(), self.trace.slot_sizes[slot], sample),
                Op::RecordStream { slot, stream, .. } => self.record(slots[slot].as_mut(), stream),
                Op::Use { slot, stream, duration_ns, .. } => {
                    self.run_use(slots[slot].as_ref(), stream, duration_ns)?
                }
                Op::Wait { stream, other, .. } => self.wait(stream, other)?,
            }
            if sample {
                self.sample(i)?;
            }
            self.progress(i + 1);
        }
        slots.clear();
        self.live.store(0, Ordering::Relaxed);
        self.synchronize()?;
        let elapsed = start.elapsed();
        self.progress_rest(self.trace.ops.len());
        Ok(elapsed)
    }

    /// One pass with each recorded thread on a thread of its own; returns its duration.
    fn threaded_pass(&self, plan: &ThreadPlan, pass: u32, sample: bool) -> Result<Duration> {
        let barrier = Barrier::new(plan.ops.len() + 1);
        let abort = AtomicBool::new(false);
        let (start, results) = std::thread::scope(|scope| {
            let workers: Vec<_> = plan
                .ops
                .iter()
                .map(|ops| {
                    let (barrier, abort) = (&barrier, &abort);
                    scope.spawn(move || {
                        barrier.wait();
                        let result = self.thread_ops(plan, ops, pass, sample, abort);
                        if result.is_err() {
                            abort.store(true, Ordering::SeqCst);
                        }
                        result
                    })
                })
                .collect();
            barrier.wait();
            let start = Instant::now();
            let results: Vec<Result<()>> = workers
                .into_iter()
                .map(|w| {
                    w.join()
                        .unwrap_or_else(|_| Err(Error::InvalidArgument("a replay thread panicked".into())))
                })
                .collect();
            (start, results)
        });
        results.into_iter().collect::<Result<Vec<()>>>()?;
        // A free that ran before its allocation would have left the allocation behind.
        if let Some(slot) = (0..plan.slots.len()).find(|&s| plan.freed[s] && plan.slots[s].lock().is_some()) {
            return Err(Error::InvalidArgument(format!(
                "a bug in the threaded replay: the free of slot {slot} ran before its allocation"
            )));
        }
        plan.slots.iter().for_each(|s| drop(s.lock().take()));
        self.live.store(0, Ordering::Relaxed);
        self.synchronize()?;
        Ok(start.elapsed())
    }

    /// The rows of one recorded thread, in order, in pass `pass`.
    fn thread_ops(
        &self,
        plan: &ThreadPlan,
        ops: &[usize],
        pass: u32,
        sample: bool,
        abort: &AtomicBool,
    ) -> Result<()> {
        for (done, &i) in ops.iter().enumerate() {
            let op = self.trace.ops[i];
            // A row about an allocation made on another thread waits for it.
            if let (Some(slot), false) = (op.slot(), matches!(op, Op::Allocate { .. })) {
                if plan.allocated_on[slot] != op.thread() {
                    wait_for(&plan.done[slot], pass + 1, abort, || {
                        format!("the allocation of slot {slot} (operation {i} names it) on another thread")
                    })?;
                }
            }
            self.keep_time(i)?;
            match op {
                Op::Allocate { slot, size, stream, .. } => {
                    *plan.slots[slot].lock() = self.allocate(size, stream, sample, i);
                    plan.done[slot].store(pass + 1, Ordering::Release);
                }
                Op::Free { slot, .. } => {
                    let a = plan.slots[slot].lock().take();
                    self.freed(a, self.trace.slot_sizes[slot], sample);
                }
                Op::RecordStream { slot, stream, .. } => {
                    self.record(plan.slots[slot].lock().as_mut(), stream)
                }
                Op::Use { slot, stream, duration_ns, .. } => {
                    self.run_use(plan.slots[slot].lock().as_ref(), stream, duration_ns)?
                }
                Op::Wait { stream, other, .. } => self.wait(stream, other)?,
            }
            if sample {
                self.sample(i)?;
            }
            self.progress(done + 1);
        }
        self.progress_rest(ops.len());
        Ok(())
    }
}

/// How a trace's rows divide among threads.
struct ThreadPlan {
    /// Per recorded thread, its op indices in order.
    ops: Vec<Vec<usize>>,
    /// The recorded thread of each slot's allocation.
    allocated_on: Vec<usize>,
    /// Whether the trace frees each slot.
    freed: Vec<bool>,
    /// Each slot's allocation, shared between threads.
    slots: Vec<Mutex<Option<Allocation>>>,
    /// Per slot, 1 + the last pass in which its allocation was done.
    done: Vec<AtomicU32>,
}

/// The most threads a replay starts.
pub const MAX_THREADS: usize = 256;

impl ThreadPlan {
    fn new(trace: &Trace) -> Result<Self> {
        let count = trace.threads.len().max(1);
        if count > MAX_THREADS {
            return Err(Error::InvalidArgument(format!(
                "trace {} has {count} threads; a replay on threads runs at most {MAX_THREADS}",
                trace.name
            )));
        }
        let mut ops = vec![Vec::new(); count];
        let mut allocated_on = vec![0; trace.slots];
        let mut freed = vec![false; trace.slots];
        for (i, op) in trace.ops.iter().enumerate() {
            let thread = op.thread();
            match *op {
                Op::Allocate { slot, .. } => allocated_on[slot] = thread,
                Op::Free { slot, .. } => freed[slot] = true,
                Op::RecordStream { .. } | Op::Use { .. } | Op::Wait { .. } => {}
            }
            ops.get_mut(thread)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "trace {}: {op:?} names a thread beyond its {count}",
                        trace.name
                    ))
                })?
                .push(i);
        }
        Ok(Self {
            ops,
            allocated_on,
            freed,
            slots: (0..trace.slots).map(|_| Mutex::new(None)).collect(),
            done: (0..trace.slots).map(|_| AtomicU32::new(0)).collect(),
        })
    }
}

/// Waits until `flag` reaches `value`, for at most [`WAIT_BOUND`], or until `abort` is set.
fn wait_for(flag: &AtomicU32, value: u32, abort: &AtomicBool, what: impl Fn() -> String) -> Result<()> {
    let start = Instant::now();
    let mut spins = 0u32;
    while flag.load(Ordering::Acquire) < value {
        if abort.load(Ordering::Relaxed) {
            return Err(Error::InvalidArgument(format!(
                "stopped waiting for {}: another thread failed",
                what()
            )));
        }
        spins = spins.wrapping_add(1);
        if spins % 1024 == 0 && start.elapsed() > WAIT_BOUND {
            return Err(Error::Timeout { waited_for: what(), after: WAIT_BOUND });
        }
        std::thread::yield_now();
    }
    Ok(())
}

/// Replays `trace` through `target`, whose memory comes from `device`, and names the
/// result after `allocator`. See the [module docs](self) for the method.
///
/// Errors are those of the device (creating or synchronizing streams, reading memory
/// info, the simulator's refusal of a time past its maximum), a `passes` of 0, a hand-built
/// trace whose ops name slots or threads it lacks or whose times do not match its ops, time
/// asked for on a trace without times ([`Trace::untimed_line`]), and on threads a wait that
/// ran out; allocation failures are counted in the result instead.
pub fn replay(
    trace: &Trace,
    allocator: &str,
    target: &ReplayTarget,
    device: &dyn Device,
    options: &ReplayOptions<'_>,
) -> Result<ReplayResult> {
    if options.passes == 0 {
        return Err(Error::InvalidArgument("replay needs at least one timed pass".into()));
    }
    if let Some(op) = trace.ops.iter().find(|op| op.slot().is_some_and(|slot| slot >= trace.slots)) {
        return Err(Error::InvalidArgument(format!(
            "trace {}: {op:?} names a slot beyond its {} slots",
            trace.name, trace.slots
        )));
    }
    if options.time.is_some() {
        if let Some(line) = trace.untimed_line {
            return Err(Error::InvalidArgument(format!(
                "trace {}: the Time of line {line} is not an integer of microseconds: the trace's time \
                 cannot be replayed",
                trace.name
            )));
        }
        if trace.times_us.len() != trace.ops.len() {
            return Err(Error::InvalidArgument(format!(
                "trace {}: {} times for {} operations",
                trace.name,
                trace.times_us.len(),
                trace.ops.len()
            )));
        }
    }
    let plan = if options.threads { Some(ThreadPlan::new(trace)?) } else { None };
    let mut streams = Streams { device, streams: Vec::new(), event: None };
    // Stream rows run on the replay's streams whatever the target.
    if matches!(target, ReplayTarget::Streams(_)) || trace.has_stream_rows() {
        for &recorded in &trace.streams {
            streams.streams.push(if recorded == 0 { Stream::DEFAULT } else { device.create_stream()? });
        }
    }
    if trace.waits > 0 {
        streams.event = Some(device.create_event()?);
    }
    let ops_per_point = trace.ops.len().div_ceil(options.series_points.max(1)).max(1);
    let points = trace.ops.len().div_ceil(ops_per_point);
    let shared = Shared {
        trace,
        target,
        device,
        options,
        streams: &streams.streams,
        wait_event: streams.event.map(|e| (e, Mutex::new(()))),
        clock: options.time.map(|sim| Clock {
            sim,
            start: AtomicU64::new(0),
            moving: Mutex::new(()),
            violations_before: AtomicUsize::new(0),
        }),
        base: 0,
        live: AtomicUsize::new(0),
        ops_per_point,
        live_points: (0..points).map(|_| AtomicU64::new(0)).collect(),
        reserved_points: (0..points).map(|_| AtomicU64::new(0)).collect(),
        failures: AtomicU64::new(0),
        first_failure: Mutex::new(None),
    };
    shared.synchronize()?;
    let shared = Shared { base: device.mem_info()?.used(), ..shared };
    let calls_before = target.allocator().stats();

    let mut pass_ns = Vec::with_capacity(options.passes);
    let mut device_calls = 0;
    let mut failures = 0;
    let mut violations = 0;
    for pass in 0..=options.passes {
        let sample = pass == 0;
        shared.begin_pass();
        let elapsed = match &plan {
            Some(plan) => shared.threaded_pass(plan, pass as u32, sample)?,
            None => shared.pass(sample)?,
        };
        failures = failures.max(shared.failures.swap(0, Ordering::Relaxed));
        violations = violations.max(shared.pass_violations());
        if let Some(done) = options.pass_done {
            done(pass);
        }
        if sample {
            let after = target.allocator().stats();
            device_calls = (after.device_allocs + after.device_frees)
                .saturating_sub(calls_before.device_allocs + calls_before.device_frees);
        } else {
            pass_ns.push(elapsed.as_nanos() as f64 / trace.ops.len().max(1) as f64);
        }
    }

    let series = Series {
        ops_per_point,
        live: shared.live_points.iter().map(|p| p.load(Ordering::Relaxed)).collect(),
        reserved: shared.reserved_points.iter().map(|p| p.load(Ordering::Relaxed)).collect(),
    };
    let peak_device_used = series.reserved.iter().copied().max().unwrap_or(0) as usize;
    let first = shared.first_failure.into_inner();
    Ok(ReplayResult {
        allocator: allocator.to_owned(),
        trace: trace.name.clone(),
        ops: trace.ops.len(),
        peak_live: trace.peak_live,
        peak_device_used,
        footprint_ratio: if trace.peak_live == 0 {
            0.0
        } else {
            peak_device_used as f64 / trace.peak_live as f64
        },
        reserved_peak: target.allocator().stats().reserved_peak,
        device_calls,
        ns_per_op_warm: pass_ns.iter().copied().fold(f64::INFINITY, f64::min),
        ns_per_op_passes: pass_ns,
        failures,
        passes: options.passes,
        threads: plan.as_ref().map_or(1, |p| p.ops.len()),
        time: options.time.is_some(),
        violations,
        first_failure_op: first.as_ref().map(|f| f.op + 1),
        first_failure_short: first.as_ref().and_then(|f| f.short),
        first_failure: first.map(|f| f.message),
        series,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use streamalloc::allocators::Plain;
    use streamalloc::device::sim::{SimConfig, SimDevice};
    use streamalloc::device::{DeviceMemory as _, DriverPools as _, Streams as _};
    use streamalloc::Allocator;

    fn trace(text: &str) -> Trace {
        Trace::parse(format!("{}\n{text}", streamalloc::trace::HEADER).as_bytes(), "t").unwrap()
    }

    #[test]
    fn plain_on_the_simulator_measures_footprint_and_calls() {
        let device = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let plain = ReplayTarget::Single(Arc::new(Plain::new(device.clone(), Stream::DEFAULT)));
        // 1000 + 3000 live at the peak; 512-byte granules make it 1024 + 3072.
        let t = trace(
            "0,1,allocate,0x1,1000,0\n0,2,allocate,0x2,3000,0\n0,3,free,0x1,0,0\n0,4,allocate,0x3,10,0\n",
        );
        let r = replay(&t, "plain", &plain, device.as_ref(), &ReplayOptions::default()).unwrap();
        assert_eq!((r.allocator.as_str(), r.trace.as_str(), r.ops, r.peak_live), ("plain", "t", 4, 4000));
        assert_eq!(r.peak_device_used, 4096);
        assert!((r.footprint_ratio - 1.024).abs() < 1e-9);
        // Three device allocations, one free in the trace and two frees of what was left.
        assert_eq!(r.device_calls, 6);
        assert_eq!(r.failures, 0);
        assert!(r.ns_per_op_warm.is_finite() && r.ns_per_op_warm > 0.0);
        assert_eq!(device.mem_info().unwrap().used(), 0, "everything freed at the end");
    }

    #[test]
    fn failures_are_counted_and_their_frees_skipped() {
        let device = SimDevice::new(SimConfig::with_capacity(1 << 20));
        let plain = ReplayTarget::Single(Arc::new(Plain::new(device.clone(), Stream::DEFAULT)));
        let t = trace(
            "0,1,allocate,0x1,4096,0\n0,2,allocate,0x2,2000000,0\n0,3,free,0x2,0,0\n0,4,free,0x1,0,0\n",
        );
        let r = replay(&t, "plain", &plain, device.as_ref(), &ReplayOptions::default()).unwrap();
        assert_eq!(r.failures, 1);
        assert!(r.first_failure.unwrap().contains("out of memory"));
        assert_eq!(r.peak_device_used, 4096);
        // Issue 50: which operation failed first, and by how much at least.
        assert_eq!(r.first_failure_op, Some(2));
        let short = r.first_failure_short.unwrap();
        assert!((2_000_000 - (1 << 20)..=2_000_000 + 8192 - (1 << 20)).contains(&short), "{short}");
        assert_eq!(r.ns_per_op_passes.len(), r.passes);
        assert_eq!(r.ns_per_op_passes.iter().copied().fold(f64::INFINITY, f64::min), r.ns_per_op_warm);
    }

    #[test]
    fn progress_and_pass_ends_add_up_and_zero_passes_is_refused() {
        let device = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let plain = ReplayTarget::Single(Arc::new(Plain::new(device.clone(), Stream::DEFAULT)));
        let rows: String =
            (0..5000).map(|i| format!("{},{i},allocate,{:#x},256,0\n", i % 3, i + 1)).collect();
        let t = trace(&rows);
        for threads in [false, true] {
            let done = AtomicU64::new(0);
            let count = |n: u64| {
                done.fetch_add(n, Ordering::Relaxed);
            };
            let options = ReplayOptions { passes: 2, progress: Some(&count), threads, ..Default::default() };
            replay(&t, "plain", &plain, device.as_ref(), &options).unwrap();
            assert_eq!(done.load(Ordering::Relaxed), 5000 * 3, "threads: {threads}");
        }
        let seen = Mutex::new(Vec::new());
        let note = |pass: usize| seen.lock().push(pass);
        let options = ReplayOptions { passes: 2, pass_done: Some(&note), ..Default::default() };
        replay(&t, "plain", &plain, device.as_ref(), &options).unwrap();
        assert_eq!(*seen.lock(), [0, 1, 2], "each pass, in order, the measuring one first");
        let zero = ReplayOptions { passes: 0, ..Default::default() };
        assert!(matches!(
            replay(&t, "plain", &plain, device.as_ref(), &zero),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn the_series_is_bounded_and_keeps_the_peaks() {
        let device = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let plain = ReplayTarget::Single(Arc::new(Plain::new(device.clone(), Stream::DEFAULT)));
        // A saw tooth: 10 allocations of 1 KiB then 10 frees, 50 times, then one 1 MiB peak.
        let mut rows = String::new();
        for round in 0..50u64 {
            for k in 0..10u64 {
                rows.push_str(&format!("0,0,allocate,{:#x},1024,0\n", 0x1000 * (round * 10 + k + 1)));
            }
            for k in 0..10u64 {
                rows.push_str(&format!("0,0,free,{:#x},1024,0\n", 0x1000 * (round * 10 + k + 1)));
            }
        }
        rows.push_str("0,0,allocate,0x1,1048576,0\n");
        let t = trace(&rows);
        let options = ReplayOptions { passes: 1, series_points: 64, ..Default::default() };
        let r = replay(&t, "plain", &plain, device.as_ref(), &options).unwrap();
        assert_eq!(r.series.live.len(), 1001usize.div_ceil(r.series.ops_per_point));
        assert!(r.series.live.len() <= 64 && r.series.reserved.len() == r.series.live.len());
        assert_eq!(*r.series.live.iter().max().unwrap(), t.peak_live as u64);
        assert_eq!(*r.series.live.last().unwrap(), 1 << 20, "the last point holds the final peak");
        assert_eq!(*r.series.reserved.iter().max().unwrap(), r.peak_device_used as u64);
        assert_eq!(r.series.live[0], 10 * 1024, "one point covers a whole tooth or more");
    }

    /// Issue 18: `replay` left the default pool holding what `async` reserved, and the next
    /// replay measured against it; `settle` returns it and `check_start` refuses memory that
    /// cannot be returned.
    #[test]
    fn settle_returns_the_default_pools_memory_and_check_start_refuses_what_is_held() {
        let device = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let idle = settle(device.as_ref()).unwrap();
        assert_eq!(idle, 0);
        let pool = device.default_pool().unwrap();
        device.set_pool_attr(pool, PoolAttr::ReleaseThreshold, u64::MAX).unwrap();
        let p = device.alloc_async(64 << 20, pool, Stream::DEFAULT).unwrap();
        device.free_async(p, Stream::DEFAULT).unwrap();
        device.synchronize_stream(Stream::DEFAULT).unwrap();
        assert_eq!(device.mem_info().unwrap().used(), 64 << 20, "the pool keeps it");
        check_start(device.as_ref(), idle, 0, "the next replay").unwrap();
        assert_eq!(device.mem_info().unwrap().used(), 0);
        assert_eq!(device.pool_attr(pool, PoolAttr::ReservedMemHigh).unwrap(), 0, "high mark reset");

        let held = device.alloc(32 << 20).unwrap();
        let err = check_start(device.as_ref(), idle, 1 << 20, "replaying t through x").unwrap_err();
        assert!(
            err.to_string()
                .contains("33554432 bytes of device memory are in use before replaying t through x"),
            "{err}"
        );
        device.free(held).unwrap();
    }

    /// Allocates through `inner`, noting the threads that call it.
    struct ThreadNoter {
        inner: Plain,
        seen: Mutex<std::collections::HashSet<std::thread::ThreadId>>,
    }

    impl Allocator for ThreadNoter {
        fn allocate(&self, size: usize) -> Result<Allocation> {
            self.seen.lock().insert(std::thread::current().id());
            self.inner.allocate(size)
        }
        fn release(&self) -> Result<usize> {
            self.inner.release()
        }
        fn stats(&self) -> streamalloc::Stats {
            self.inner.stats()
        }
        fn reset_peak_stats(&self) {
            self.inner.reset_peak_stats();
        }
        fn device(&self) -> usize {
            self.inner.device()
        }
        fn segments(&self, out: &mut Vec<streamalloc::Segment>) -> Result<()> {
            self.inner.segments(out)
        }
    }

    /// Issue 18: the Thread column was ignored. On threads, each recorded thread allocates
    /// on a thread of its own, and a free waits for the allocation made on another thread
    /// (were it run early it would find its slot empty and leave the allocation behind,
    /// which the pass reports as an error).
    #[test]
    fn threads_replay_on_threads_of_their_own_in_dependency_order() {
        let device = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let noter = Arc::new(ThreadNoter {
            inner: Plain::new(device.clone(), Stream::DEFAULT),
            seen: Mutex::default(),
        });
        let target = ReplayTarget::Single(noter.clone());
        // Thread i % 4 allocates, thread (i + 1) % 4 frees two rows later.
        let mut rows = String::new();
        for i in 0..2000u64 {
            rows.push_str(&format!(
                "{},{i},allocate,{:#x},{},0\n",
                i % 4,
                0x1000 * (i + 1),
                512 * (1 + i % 5)
            ));
            if i >= 2 {
                let j = i - 2;
                rows.push_str(&format!("{},{i},free,{:#x},0,0\n", (i + 1) % 4, 0x1000 * (j + 1)));
            }
        }
        let t = trace(&rows);
        assert_eq!(t.threads, vec![0, 1, 2, 3]);
        let options = ReplayOptions { passes: 2, threads: true, ..Default::default() };
        let r = replay(&t, "plain", &target, device.as_ref(), &options).unwrap();
        assert_eq!((r.threads, r.failures), (4, 0));
        assert_eq!(noter.seen.lock().len(), 4 * 3, "four threads allocated in each of the 3 passes");
        assert_eq!(device.mem_info().unwrap().used(), 0, "everything freed at the end");
        let single = replay(&t, "plain", &target, device.as_ref(), &ReplayOptions::default()).unwrap();
        assert_eq!(single.threads, 1);
    }

    #[test]
    fn result_round_trips_through_json() {
        let r = ReplayResult {
            allocator: "plain".into(),
            trace: "t.csv".into(),
            ops: 4,
            peak_live: 10,
            peak_device_used: 20,
            footprint_ratio: 2.0,
            reserved_peak: 20,
            device_calls: 4,
            ns_per_op_warm: 12.5,
            failures: 0,
            passes: 3,
            threads: 1,
            time: true,
            violations: 2,
            first_failure: None,
            first_failure_op: None,
            first_failure_short: None,
            ns_per_op_passes: vec![12.5, 13.0],
            series: Series { ops_per_point: 2, live: vec![10, 5], reserved: vec![20, 20] },
        };
        let text = serde_json::to_string(&r).unwrap();
        assert!(!text.contains("first_failure"));
        assert_eq!(serde_json::from_str::<ReplayResult>(&text).unwrap(), r);
        // Results saved before the series, threads, time and violations existed still read.
        let old = text
            .replace(",\"threads\":1", "")
            .replace(",\"time\":true,\"violations\":2", "")
            .split(",\"series\"")
            .next()
            .unwrap()
            .to_owned()
            + "}";
        assert!(!old.contains("time"), "{old}");
        let read: ReplayResult = serde_json::from_str(&old).unwrap();
        assert_eq!((read.threads, read.series.is_empty(), read.time, read.violations), (1, true, false, 0));
    }
}
