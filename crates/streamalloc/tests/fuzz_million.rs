//! A randomized multi-stream program of a million operations per strategy and per adaptor
//! stack, against the simulator's ordering checker (issue 16), and the negative control: the
//! same program without `record_stream` is caught.
//!
//! `STREAMALLOC_FUZZ_OPS` sets the operations per stack (default 1,000,000; `lab/fuzz-long.sh`
//! runs longer), `STREAMALLOC_FUZZ_SEED` the seed.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use streamalloc::adaptors::{Counted, Limit, Pointers, Retry, SingleStream, Traced};
use streamalloc::allocators::{
    AsyncPool, AsyncPoolConfig, BackingKind, BestFit, BestFitConfig, Plain, StreamSafe, StreamSafeConfig,
};
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::device::Streams;
use streamalloc::trace::TraceWriter;
use streamalloc::{Allocation, Allocator, DevicePtr, Stream, StreamAllocator};

const MIB: usize = 1 << 20;
const STREAMS: usize = 4;

fn ops() -> u64 {
    std::env::var("STREAMALLOC_FUZZ_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000)
}

fn seed() -> u64 {
    std::env::var("STREAMALLOC_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(16)
}

/// The stack under test: allocated from by handle, or by pointer.
type Make = fn(Arc<SimDevice>) -> Arc<dyn StreamAllocator>;

fn stream_safe(sim: Arc<SimDevice>) -> StreamSafe {
    StreamSafe::new(sim, StreamSafeConfig::default()).expect("allocator")
}

/// A pool over `backing` (expandable segments or stitched ranges) that grows by 8 MiB.
fn backed(backing: BackingKind) -> BestFitConfig {
    BestFitConfig { backing, growth: 8 * MIB, ..BestFitConfig::default() }
}

fn plain(sim: Arc<SimDevice>) -> Arc<dyn StreamAllocator> {
    Arc::new(SingleStream::new(Plain::new(sim.clone(), Stream::DEFAULT), sim, Stream::DEFAULT))
}
fn best_fit(sim: Arc<SimDevice>) -> Arc<dyn StreamAllocator> {
    let pool = BestFit::new(sim.clone(), BestFitConfig::default()).expect("pool");
    Arc::new(SingleStream::new(pool, sim, Stream::DEFAULT))
}
fn best_fit_segments(sim: Arc<SimDevice>) -> Arc<dyn StreamAllocator> {
    let pool = BestFit::new(sim.clone(), backed(BackingKind::SEGMENTS)).expect("pool");
    Arc::new(SingleStream::new(pool, sim, Stream::DEFAULT))
}
fn best_fit_stitched(sim: Arc<SimDevice>) -> Arc<dyn StreamAllocator> {
    let pool = BestFit::new(sim.clone(), backed(BackingKind::STITCHED)).expect("pool");
    Arc::new(SingleStream::new(pool, sim, Stream::DEFAULT))
}
fn stream_safe_plain(sim: Arc<SimDevice>) -> Arc<dyn StreamAllocator> {
    Arc::new(stream_safe(sim))
}
fn stream_safe_segments(sim: Arc<SimDevice>) -> Arc<dyn StreamAllocator> {
    let config = StreamSafeConfig { pool: backed(BackingKind::SEGMENTS), ..StreamSafeConfig::default() };
    Arc::new(StreamSafe::new(sim, config).expect("allocator"))
}
fn stream_safe_stitched(sim: Arc<SimDevice>) -> Arc<dyn StreamAllocator> {
    let config = StreamSafeConfig { pool: backed(BackingKind::STITCHED), ..StreamSafeConfig::default() };
    Arc::new(StreamSafe::new(sim, config).expect("allocator"))
}
fn async_pool(sim: Arc<SimDevice>) -> Arc<dyn StreamAllocator> {
    Arc::new(AsyncPool::new(sim, AsyncPoolConfig::default()))
}
fn limit(sim: Arc<SimDevice>) -> Arc<dyn StreamAllocator> {
    Arc::new(Limit::new(stream_safe(sim), 192 * MIB))
}
fn retry(sim: Arc<SimDevice>) -> Arc<dyn StreamAllocator> {
    Arc::new(Retry::new(stream_safe(sim), Duration::ZERO))
}
fn stats(sim: Arc<SimDevice>) -> Arc<dyn StreamAllocator> {
    Arc::new(Counted::new(stream_safe(sim)))
}
fn trace(sim: Arc<SimDevice>) -> Arc<dyn StreamAllocator> {
    Arc::new(Traced::new(stream_safe(sim), TraceWriter::new(std::io::sink()).expect("writer")))
}
/// The facade's full stack over BestFit, driven by pointer as the C ABI drives it.
fn full_stack(sim: Arc<SimDevice>) -> Arc<dyn StreamAllocator> {
    let pool = BestFit::new(sim.clone(), BestFitConfig::default()).expect("pool");
    let traced = Traced::new(
        SingleStream::new(pool, sim, Stream::DEFAULT),
        TraceWriter::new(std::io::sink()).expect("writer"),
    );
    Arc::new(Limit::new(Retry::new(Counted::new(traced), Duration::ZERO), 192 * MIB))
}

/// A live allocation of the program: a handle, or a pointer kept by the stack.
enum Live {
    Handle(Allocation),
    Pointer { ptr: DevicePtr, size: usize, owner: Stream },
}

impl Live {
    fn range(&self) -> (DevicePtr, usize, Stream) {
        match self {
            Live::Handle(a) => (a.ptr(), a.size(), a.owning_stream()),
            Live::Pointer { ptr, size, owner } => (*ptr, *size, *owner),
        }
    }
}

/// Runs `ops` random operations on four streams of a simulated device of 256 MiB, by
/// pointer or by handle, announcing other streams' kernels with `record_stream` when
/// `record`. Returns the checker's violations and the allocations that failed.
fn run(make: Make, ops: u64, seed: u64, by_pointer: bool, record: bool) -> (usize, u64) {
    let sim = SimDevice::new(SimConfig { seed, ..SimConfig::with_capacity(256 * MIB) });
    let a = Pointers::new(make(sim.clone()), sim.clone(), Duration::from_secs(10));
    let streams: Vec<Stream> = (0..STREAMS).map(|_| sim.create_stream().expect("stream")).collect();
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut live: Vec<Live> = Vec::new();
    let mut failed = 0;
    for _ in 0..ops {
        let r = rng.gen_range(0..1000u32);
        if r < 330 || live.is_empty() {
            let size = match rng.gen_range(0..100u32) {
                0..=79 => rng.gen_range(1..64 << 10),
                80..=97 => rng.gen_range(64 << 10..2 * MIB),
                _ => rng.gen_range(2 * MIB..24 * MIB),
            };
            let stream = streams[rng.gen_range(0..STREAMS)];
            let made = if by_pointer {
                a.allocate_ptr(size, stream).map(|ptr| Live::Pointer {
                    ptr,
                    size,
                    owner: a.owner_of(ptr, stream).expect("live"),
                })
            } else {
                a.allocate_on(size, stream).map(Live::Handle)
            };
            let Ok(x) = made else {
                failed += 1;
                continue;
            };
            let (ptr, size, owner) = x.range();
            sim.check_handout(ptr, size, owner);
            // The owner writes it first.
            sim.use_range(ptr, size, owner, 500).expect("use");
            live.push(x);
        } else if r < 660 {
            match live.swap_remove(rng.gen_range(0..live.len())) {
                Live::Handle(h) => drop(h),
                Live::Pointer { ptr, owner, .. } => {
                    assert!(a.free_ptr(ptr, owner), "{ptr:#x} not live")
                }
            }
        } else if r < 960 {
            let i = rng.gen_range(0..live.len());
            let user = streams[rng.gen_range(0..STREAMS)];
            if record {
                match &mut live[i] {
                    Live::Handle(h) => h.record_stream(user),
                    Live::Pointer { ptr, .. } => {
                        assert!(a.record_stream_ptr(*ptr, user).expect("a live stream"));
                    }
                }
            }
            let (ptr, size, _) = live[i].range();
            sim.use_range(ptr, size, user, rng.gen_range(1..200_000)).expect("use");
        } else if r < 990 {
            sim.advance(rng.gen_range(1..100_000));
        } else if r < 999 {
            sim.synchronize_stream(streams[rng.gen_range(0..STREAMS)]).expect("sync");
        } else {
            // A release may report errors frees held back; there must be none here.
            a.release().expect("release");
        }
    }
    for x in live {
        if let Live::Pointer { ptr, owner, .. } = x {
            assert!(a.free_ptr(ptr, owner), "{ptr:#x} not live");
        }
    }
    let stats = a.stats();
    assert_eq!((stats.allocated, stats.live_allocations), (0, 0));
    (sim.violations().len(), failed)
}

/// One stack, by handle and by pointer, half the operations each.
fn check(name: &str, make: Make) {
    let ops = ops();
    for (by_pointer, half) in [(false, 0), (true, 1)] {
        let (violations, failed) = run(make, ops / 2, seed() + half, by_pointer, true);
        eprintln!(
            "{name} ({}): {} ops, {failed} failed allocations, {violations} violations",
            if by_pointer { "by pointer" } else { "by handle" },
            ops / 2
        );
        assert_eq!(violations, 0, "{name}: the checker found early reuses");
    }
}

#[test]
fn plain_million() {
    check("plain", plain);
}
#[test]
fn best_fit_million() {
    check("best_fit", best_fit);
}
#[test]
fn best_fit_segments_million() {
    check("best_fit segments", best_fit_segments);
}
#[test]
fn best_fit_stitched_million() {
    check("best_fit stitched", best_fit_stitched);
}
#[test]
fn stream_safe_million() {
    check("stream_safe", stream_safe_plain);
}
#[test]
fn stream_safe_segments_million() {
    check("stream_safe segments", stream_safe_segments);
}
#[test]
fn stream_safe_stitched_million() {
    check("stream_safe stitched", stream_safe_stitched);
}
#[test]
fn async_million() {
    check("async", async_pool);
}
#[test]
fn limit_million() {
    check("limit", limit);
}
#[test]
fn retry_million() {
    check("retry", retry);
}
#[test]
fn stats_million() {
    check("stats", stats);
}
#[test]
fn trace_million() {
    check("trace", trace);
}
#[test]
fn full_stack_million() {
    check("limit+retry+stats+trace over best_fit", full_stack);
}

/// The negative control: the same programs without `record_stream` reuse memory that other
/// streams' kernels still use, and the checker reports it.
#[test]
fn the_checker_catches_a_missing_record_stream() {
    for (name, make) in [("stream_safe", stream_safe_plain as Make), ("best_fit", best_fit)] {
        for by_pointer in [false, true] {
            let (violations, _) = run(make, 20_000, seed(), by_pointer, false);
            assert!(violations > 0, "{name}: a program without record_stream went unnoticed");
        }
    }
}
