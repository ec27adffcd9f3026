//! Multi-thread scaling without the C ABI, and where it goes: for 1, 2, 4 and 8 threads, each
//! thread replays a trace on a stream of its own (one warm-up pass, then three timed passes,
//! all threads starting each pass together), and prints the aggregate million operations per
//! second (as the anchors harness computes it: from the slowest thread's best pass) and the
//! device allocations made during the timed passes. Subjects:
//!
//! - `default`: the library's default stack (`Config::default()`, what the C ABI builds) by
//!   pointer, the path of `streamalloc_malloc` / `streamalloc_free` less the ABI's own frame;
//! - `stream_safe`: a bare `StreamSafe` by handle;
//! - `baseline`: no allocator, a free list per size in each thread (nothing shared): the same
//!   loop over the same trace, so its scaling is what the machine gives a loop that shares
//!   nothing (clock drop with more busy cores, caches), the ceiling of any allocator's;
//! - `floor`: the anchors harness's floor (`replay_core floor`): a bump pointer per thread
//!   that never reuses, locks or calls the device, through the same loop and call frame. Its
//!   nanoseconds per operation are what this replayer itself costs.
//!
//! The floor always runs first, and each other subject's lines give its nanoseconds per
//! operation (a thread's, from the slowest thread's best pass) and those above the floor's at
//! the same thread count, measured in the same run: the allocator's own work, in the terms of
//! the anchors harness (its README, "The floor").
//!
//! Each run also prints its passes one by one (`PASSES`: the slowest thread's nanoseconds per
//! operation and, in brackets, the device allocations made during that pass and, on the
//! simulator, its device calls of every kind, warm-up first), which shows when the stack stops
//! calling the device and what a pass costs before and after.
//!
//! With `--profile`, the runs of 1 and of 8 threads make 6,000 timed passes, which are sampled
//! (pprof, all threads): a thread's wall time per operation is shared out among the functions
//! by their self samples (the sampled frame's own), and those taking at least 0.5 ns are
//! listed, the largest growth from 1 to 8 threads first: what costs more per operation with 8
//! threads is what stands in the way of scaling. The header gives each figure above the
//! floor's (measured without the profiler).
//!
//! On the simulator the device costs nothing and no call takes a driver lock, which separates
//! the allocator's own scaling from the driver's. A measurement to read, not a test:
//! `cargo run --release -p streamalloc-bench --bin mt_replay -- TRACE [sim|cuda] [SUBJECT...] [--profile]`
//! (on the GPU machine, packed by scripts/gpu-test.sh: lab/run mtx).

use std::collections::HashMap;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use streamalloc::device::cuda::CudaDevice;
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::facade::{Config, Facade, Stack};
use streamalloc::{Allocation, Allocator, Device, DevicePtr, Error, Result, Stream, StreamAllocator};
use streamalloc_replay::trace::{Op, Trace};

/// Passes per run: a warm-up pass, then timed ones.
const PASSES: usize = 4;
/// Passes per profiled run: enough timed passes for a second or more of samples.
const PROFILED_PASSES: usize = 6001;
const PROFILE_HZ: i32 = 2999;

/// What the threads replay through.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Subject {
    Default,
    StreamSafe,
    Baseline,
    Floor,
}

impl Subject {
    fn parse(name: &str) -> Option<Self> {
        match name {
            "default" => Some(Self::Default),
            "stream_safe" => Some(Self::StreamSafe),
            "baseline" => Some(Self::Baseline),
            "floor" => Some(Self::Floor),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::StreamSafe => "stream_safe",
            Self::Baseline => "baseline",
            Self::Floor => "floor",
        }
    }
}

/// One thread's replay state for a subject (the floor's: the next address of its bump pointer,
/// never reused, and what each slot holds).
enum Replayer {
    Pointer { alloc: Arc<Stack>, live: Vec<DevicePtr> },
    Handle { alloc: Arc<dyn StreamAllocator>, live: Vec<Option<Allocation>> },
    Baseline { free: HashMap<usize, Vec<DevicePtr>>, live: Vec<(usize, DevicePtr)>, next: DevicePtr },
    Floor { next: DevicePtr, live: Vec<DevicePtr> },
}

impl Replayer {
    fn op(&mut self, op: &Op, stream: Stream) -> Result<()> {
        match (self, *op) {
            (Self::Pointer { alloc, live }, Op::Allocate { slot, size, .. }) => {
                live[slot] = alloc.allocate_ptr(size, stream)?
            }
            (Self::Pointer { alloc, live }, Op::Free { slot, .. }) => {
                alloc.free_ptr(std::mem::take(&mut live[slot]), stream);
            }
            (Self::Handle { alloc, live }, Op::Allocate { slot, size, .. }) => {
                live[slot] = Some(alloc.allocate_on(size, stream)?)
            }
            (Self::Handle { live, .. }, Op::Free { slot, .. }) => live[slot] = None,
            (Self::Baseline { free, live, next }, Op::Allocate { slot, size, .. }) => {
                let ptr = free.entry(size).or_default().pop().unwrap_or_else(|| {
                    *next += size as DevicePtr;
                    *next
                });
                live[slot] = (size, ptr);
            }
            (Self::Baseline { free, live, .. }, Op::Free { slot, .. }) => {
                let (size, ptr) = live[slot];
                free.entry(size).or_default().push(ptr);
            }
            (Self::Floor { next, live }, Op::Allocate { slot, size, .. }) => {
                live[slot] = std::hint::black_box(*next);
                *next += (size as DevicePtr + 511) & !511;
            }
            (Self::Floor { live, .. }, Op::Free { slot, .. }) => {
                std::hint::black_box(std::mem::take(&mut live[slot]));
            }
            // Streams' use of memory and waits: not what this measures.
            _ => {}
        }
        Ok(())
    }

    /// Frees what the pass left live.
    fn clear(&mut self, stream: Stream) {
        match self {
            Self::Pointer { alloc, live } => live.iter_mut().filter(|p| **p != 0).for_each(|p| {
                alloc.free_ptr(std::mem::take(p), stream);
            }),
            Self::Handle { live, .. } => live.iter_mut().for_each(|a| *a = None),
            Self::Floor { live, .. } => live.iter_mut().for_each(|p| *p = 0),
            Self::Baseline { .. } => {}
        }
    }
}

/// The subject's allocator, shared by the threads, and its device-allocation counter.
struct Shared {
    pointer: Option<Arc<Stack>>,
    handle: Option<Arc<dyn StreamAllocator>>,
    device_allocs: Box<dyn Fn() -> u64 + Send + Sync>,
}

fn shared(subject: Subject, device: &Arc<dyn Device>) -> Result<Shared> {
    Ok(match subject {
        Subject::Default => {
            let stack = Facade::build_stack(&Config::default(), device.clone())?;
            let a = stack.allocator.clone();
            Shared {
                pointer: Some(stack.allocator),
                handle: None,
                device_allocs: Box::new(move || a.stats().device_allocs),
            }
        }
        Subject::StreamSafe => {
            let a = Arc::new(streamalloc::allocators::StreamSafe::new(device.clone(), Default::default())?);
            let counter = a.clone();
            Shared {
                pointer: None,
                handle: Some(a),
                device_allocs: Box::new(move || counter.stats().device_allocs),
            }
        }
        Subject::Baseline | Subject::Floor => {
            Shared { pointer: None, handle: None, device_allocs: Box::new(|| 0) }
        }
    })
}

/// Self samples per function of one profiled run.
type Profile = HashMap<String, u64>;

/// What one run measured.
struct Run {
    /// Each pass's seconds, the slowest thread's, the warm-up first.
    passes: Vec<f64>,
    /// The device allocations made during each pass, the warm-up first.
    device_allocs: Vec<u64>,
    /// The device calls of every kind made during each pass, where the device counts them
    /// (the simulator).
    device_calls: Option<Vec<u64>>,
    /// The profile of the timed passes, when asked for.
    profile: Option<Profile>,
}

impl Run {
    /// The best timed pass's seconds (the warm-up not counted).
    fn best(&self) -> f64 {
        self.passes[1..].iter().copied().fold(f64::MAX, f64::min)
    }
}

fn run(
    subject: Subject,
    device: &Arc<dyn Device>,
    sim: Option<&Arc<SimDevice>>,
    trace: &Arc<Trace>,
    threads: usize,
    profile: bool,
) -> Result<Run> {
    let shared = shared(subject, device)?;
    let passes = if profile { PROFILED_PASSES } else { PASSES };
    let barrier = Arc::new(Barrier::new(threads + 1));
    let workers: Vec<_> = (0..threads)
        .map(|thread| {
            let (trace, barrier) = (trace.clone(), barrier.clone());
            let mut replayer = match (&shared.pointer, &shared.handle) {
                (Some(alloc), _) => Replayer::Pointer { alloc: alloc.clone(), live: vec![0; trace.slots] },
                (_, Some(alloc)) => {
                    Replayer::Handle { alloc: alloc.clone(), live: (0..trace.slots).map(|_| None).collect() }
                }
                _ if subject == Subject::Floor => {
                    // Each thread's addresses a region of its own, as the harness's floor.
                    Replayer::Floor { next: (thread as DevicePtr + 1) << 40, live: vec![0; trace.slots] }
                }
                _ => Replayer::Baseline { free: HashMap::new(), live: vec![(0, 0); trace.slots], next: 0 },
            };
            let stream = device.create_stream();
            std::thread::spawn(move || -> Result<Vec<f64>> {
                let stream = stream?;
                let mut seconds = Vec::with_capacity(passes);
                for _ in 0..passes {
                    barrier.wait();
                    let start = Instant::now();
                    for op in &trace.ops {
                        replayer.op(op, stream)?;
                    }
                    replayer.clear(stream);
                    seconds.push(start.elapsed().as_secs_f64());
                    barrier.wait();
                }
                Ok(seconds)
            })
        })
        .collect();
    let mut device_allocs = Vec::with_capacity(passes);
    let mut device_calls = sim.map(|_| Vec::with_capacity(passes));
    let mut before = (shared.device_allocs)();
    let mut calls_before = sim.map_or(0, |s| s.calls());
    let mut guard = None;
    for pass in 0..passes {
        barrier.wait();
        barrier.wait();
        let after = (shared.device_allocs)();
        device_allocs.push(after - before);
        before = after;
        if let (Some(sim), Some(calls)) = (sim, device_calls.as_mut()) {
            let after = sim.calls();
            calls.push(after - calls_before);
            calls_before = after;
        }
        if pass == 0 && profile {
            guard = Some(
                pprof::ProfilerGuardBuilder::default()
                    .frequency(PROFILE_HZ)
                    .build()
                    .map_err(|e| streamalloc::Error::InvalidArgument(format!("profiler: {e}")))?,
            );
        }
    }
    let profile = guard.map(|g| self_samples(&g));
    let mut slowest = vec![0.0f64; passes];
    for w in workers {
        let times = w.join().map_err(|_| Error::Internal("a replay thread panicked".into()))??;
        for (s, t) in slowest.iter_mut().zip(times) {
            *s = s.max(t);
        }
    }
    Ok(Run { passes: slowest, device_allocs, device_calls, profile })
}

/// Self samples per function (the innermost frame's symbol) of what the guard sampled.
fn self_samples(guard: &pprof::ProfilerGuard<'_>) -> Profile {
    let mut by_function = Profile::new();
    if let Ok(report) = guard.report().build() {
        for (frames, count) in &report.data {
            let name = frames
                .frames
                .first()
                .and_then(|symbols| symbols.last())
                .map_or_else(|| "?".to_string(), |s| s.name());
            *by_function.entry(short(&name)).or_default() += *count as u64;
        }
    }
    by_function
}

/// A demangled name without its hash suffix and generic arguments' paths' noise.
fn short(name: &str) -> String {
    let name = name.rsplit_once("::h").filter(|(_, h)| h.len() == 16).map_or(name, |(n, _)| n);
    name.chars().take(110).collect()
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: mt_replay TRACE [sim|cuda] [default|stream_safe|baseline|floor ...] [--profile]";
    let path = args.first().ok_or_else(|| Error::InvalidArgument(usage.into()))?;
    let profile = args.iter().any(|a| a == "--profile");
    let kind = if args.iter().any(|a| a == "cuda") { "cuda" } else { "sim" };
    let sim = (kind == "sim").then(|| SimDevice::new(SimConfig::h200()));
    let device: Arc<dyn Device> = match &sim {
        Some(sim) => sim.clone(),
        None => CudaDevice::new(0)?,
    };
    let mut subjects: Vec<Subject> = args.iter().skip(1).filter_map(|a| Subject::parse(a)).collect();
    if subjects.is_empty() {
        subjects = vec![Subject::Default, Subject::StreamSafe, Subject::Baseline];
    }
    // The floor first, once: the others are measured above it.
    subjects.retain(|&s| s != Subject::Floor);
    subjects.insert(0, Subject::Floor);
    let trace = Arc::new(Trace::from_path(path)?);
    // The floor's ns per operation (a thread's) at 1, 2, 4 and 8 threads.
    let mut floor = [0.0f64; 4];
    for subject in subjects {
        let mut one = 0.0;
        let mut profiles = Vec::new();
        for (i, threads) in [1, 2, 4, 8].into_iter().enumerate() {
            let profiled = profile && subject != Subject::Floor && (threads == 1 || threads == 8);
            let measured = run(subject, &device, sim.as_ref(), &trace, threads, profiled)?;
            let mops = (threads * trace.len()) as f64 / measured.best() / 1e6;
            let ns = measured.best() * 1e9 / trace.len() as f64;
            let timed_allocs: u64 = measured.device_allocs[1..].iter().sum();
            if threads == 1 {
                one = mops;
            }
            let above = if subject == Subject::Floor {
                floor[i] = ns;
                String::new()
            } else {
                format!(" floor_ns_per_op={:.1} above_floor_ns_per_op={:.1}", floor[i], ns - floor[i])
            };
            println!(
                "MT_REPLAY device={kind} subject={} trace={} threads={threads} mops_per_s={mops:.2} scaling={:.2} \
                 ns_per_op={ns:.1}{above} device_allocs_in_timed_passes={timed_allocs}",
                subject.name(),
                trace.name,
                mops / one
            );
            if !profiled {
                let passes: Vec<String> = (0..measured.passes.len())
                    .map(|i| {
                        let ns = measured.passes[i] * 1e9 / trace.len() as f64;
                        match &measured.device_calls {
                            Some(calls) => format!("{ns:.0}({}/{})", measured.device_allocs[i], calls[i]),
                            None => format!("{ns:.0}({})", measured.device_allocs[i]),
                        }
                    })
                    .collect();
                let what = if sim.is_some() { "device_allocs/device_calls" } else { "device_allocs" };
                println!(
                    "PASSES subject={} trace={} threads={threads} ns_per_op({what}): {}",
                    subject.name(),
                    trace.name,
                    passes.join(" ")
                );
            }
            if let Some(samples) = measured.profile {
                // A thread's wall time per operation, shared out by the samples.
                profiles.push((samples, 1e3 * threads as f64 / mops));
            }
        }
        if let [(one, ns1), (eight, ns8)] = &profiles[..] {
            let ns = |p: &Profile, f: &str, per_op: f64| {
                p.get(f).copied().unwrap_or(0) as f64 / p.values().sum::<u64>().max(1) as f64 * per_op
            };
            let mut names: Vec<&String> = one.keys().chain(eight.keys()).collect();
            names.sort();
            names.dedup();
            let mut rows: Vec<(f64, f64, &String)> =
                names.into_iter().map(|f| (ns(one, f, *ns1), ns(eight, f, *ns8), f)).collect();
            rows.sort_by(|a, b| (b.1 - b.0).total_cmp(&(a.1 - a.0)));
            println!(
                "PROFILE subject={} trace={} ns per operation and thread: 1 thread {ns1:.1} ({:.1} above the floor's \
                 {:.1}), 8 threads {ns8:.1} ({:.1} above {:.1}), shared out by self samples ({} and {})",
                subject.name(),
                trace.name,
                ns1 - floor[0],
                floor[0],
                ns8 - floor[3],
                floor[3],
                one.values().sum::<u64>(),
                eight.values().sum::<u64>()
            );
            println!("PROFILE   1 thread  8 threads  growth  function");
            for (a, b, f) in rows.iter().filter(|r| r.0.max(r.1) >= 0.5) {
                println!("PROFILE {a:9.1} {b:10.1} {:7.1}  {f}", b - a);
            }
        }
    }
    Ok(())
}
