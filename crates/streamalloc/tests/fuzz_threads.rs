//! The multi-threaded fuzz (issue 33): on every strategy and backing, threads allocate, use,
//! `record_stream` and free on streams of their own while others release the cache in a
//! loop (`empty_cache`), allocate and release while holding the allocation (the memory
//! fraction's path), run private pools (CUDA graphs' and `MemPool`'s, checkpoints restored
//! at their addresses) and make, use and retire streams. The simulator's ordering checker
//! counts every early reuse and every device call on memory in use (an unmap under a running
//! kernel): there must be none. The negative control drops `record_stream` and is caught.
//!
//! `STREAMALLOC_FUZZ_THREAD_OPS` sets the operations per worker thread (default 200,000),
//! `STREAMALLOC_FUZZ_SEED` the seed.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use streamalloc::adaptors::Pointers;
use streamalloc::adaptors::SingleStream;
use streamalloc::allocators::{BackingKind, BestFit, BestFitConfig, StreamSafe, StreamSafeConfig};
use streamalloc::device::sim::{SimConfig, SimDevice, ViolationKind};
use streamalloc::device::Streams;
use streamalloc::facade::private_pools::{PrivatePools, Routed, StreamFilter};
use streamalloc::facade::{Config, DynAllocator, Facade};
use streamalloc::{Allocator, Device, Error, Stream, StreamAllocator};

const MIB: usize = 1 << 20;
const WORKERS: usize = 3;

fn ops() -> u64 {
    std::env::var("STREAMALLOC_FUZZ_THREAD_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(200_000)
}

fn seed() -> u64 {
    std::env::var("STREAMALLOC_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(33)
}

/// A stack under test: its allocator, and the private pools beside it when the facade built
/// it.
struct Stack {
    sim: Arc<SimDevice>,
    allocator: Arc<streamalloc::facade::Stack>,
    private: Option<PrivatePools>,
}

/// The stack the facade builds for `conf` (as `libstreamalloc.so` does) on a simulated
/// device of 512 MiB, with its private pools.
fn facade(conf: &str) -> Stack {
    let config = Config::parse(&format!("{conf},device=sim,sim_capacity=512MiB")).expect("config");
    let sim = SimDevice::new(SimConfig { seed: seed(), ..SimConfig::with_capacity(512 * MIB) });
    let stack = Facade::build_stack(&config, sim.clone()).expect("stack");
    Stack { sim, allocator: stack.allocator, private: Some(stack.private) }
}

/// Expandable segments, which no configuration chooses: a pool, or a stream-safe allocator
/// over such pools, built directly.
fn segments(stream_safe: bool) -> Stack {
    let sim = SimDevice::new(SimConfig { seed: seed(), ..SimConfig::with_capacity(512 * MIB) });
    let pool = BestFitConfig { backing: BackingKind::SEGMENTS, growth: 8 * MIB, ..Default::default() };
    let allocator: DynAllocator = if stream_safe {
        Arc::new(
            StreamSafe::new(sim.clone(), StreamSafeConfig { pool, ..Default::default() }).expect("alloc"),
        )
    } else {
        let d: Arc<dyn Device> = sim.clone();
        Arc::new(SingleStream::new(BestFit::new(d.clone(), pool).expect("pool"), d, Stream::DEFAULT))
    };
    let allocator = Arc::new(Pointers::new(allocator, sim.clone(), Duration::from_secs(10)));
    Stack { sim, allocator, private: None }
}

/// A release, which may meet only a bounded wait that ran out; but for `strict` false (the
/// negative control, whose kernels use memory nobody announced), where the simulator refuses
/// unmaps under them.
fn release(a: &streamalloc::facade::Stack, strict: bool) {
    match a.release() {
        Ok(_) | Err(Error::Timeout { .. }) => {}
        Err(e) => assert!(!strict, "release: {e}"),
    }
}

fn size(rng: &mut SmallRng) -> usize {
    match rng.gen_range(0..100u32) {
        0..=69 => rng.gen_range(1..64 << 10),
        70..=94 => rng.gen_range(64 << 10..2 * MIB),
        _ => rng.gen_range(2 * MIB..12 * MIB),
    }
}

/// One worker: allocates on `own` (by pointer, as the C ABI does), has its kernels use the
/// memory there and on the other workers' streams (announced with `record_stream` when
/// `record`), and frees.
fn worker(stack: &Stack, own: Stream, others: &[Stream], seed: u64, ops: u64, record: bool) -> u64 {
    let (a, sim) = (&stack.allocator, &stack.sim);
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut live: Vec<(u64, usize, Stream)> = Vec::new();
    let mut failed = 0;
    for _ in 0..ops {
        let r = rng.gen_range(0..100u32);
        if r < 35 || live.is_empty() {
            let n = size(&mut rng);
            let Ok(ptr) = a.allocate_ptr(n, own) else {
                failed += 1;
                continue;
            };
            let owner = a.owner_of(ptr, own).expect("live");
            sim.check_handout(ptr, n, owner);
            sim.use_range(ptr, n, owner, rng.gen_range(1..5_000)).expect("use");
            live.push((ptr, n, owner));
        } else if r < 70 {
            let (ptr, _, owner) = live.swap_remove(rng.gen_range(0..live.len()));
            assert!(a.free_ptr(ptr, owner), "{ptr:#x} not live");
        } else if r < 95 {
            let (ptr, n, _) = live[rng.gen_range(0..live.len())];
            let user = others[rng.gen_range(0..others.len())];
            if record {
                assert!(a.record_stream_ptr(ptr, user).expect("a live stream"));
            }
            sim.use_range(ptr, n, user, rng.gen_range(1..50_000)).expect("use");
        } else {
            sim.advance(rng.gen_range(1..20_000));
        }
    }
    for (ptr, _, owner) in live {
        assert!(a.free_ptr(ptr, owner), "{ptr:#x} not live");
    }
    failed
}

/// Releases beside the workers until `done`, in the three ways a program releases: the whole
/// cache (`empty_cache`), after an allocation it holds meanwhile (the memory fraction's
/// path), and by retiring a stream it made, used and freed on.
fn releaser(stack: &Stack, stream: Stream, seed: u64, strict: bool, done: &AtomicBool, releases: &AtomicU64) {
    let (a, sim) = (&stack.allocator, &stack.sim);
    let mut rng = SmallRng::seed_from_u64(seed);
    while !done.load(Ordering::Relaxed) {
        match rng.gen_range(0..10u32) {
            0..=5 => release(a, strict),
            6..=7 => {
                let n = size(&mut rng);
                if let Ok(ptr) = a.allocate_ptr(n, stream) {
                    let owner = a.owner_of(ptr, stream).expect("live");
                    sim.check_handout(ptr, n, owner);
                    sim.use_range(ptr, n, owner, 1_000).expect("use");
                    release(a, strict);
                    assert!(a.free_ptr(ptr, owner));
                }
            }
            _ => {
                let s = sim.create_stream().expect("stream");
                let n = size(&mut rng);
                if let Ok(ptr) = a.allocate_ptr(n, s) {
                    let owner = a.owner_of(ptr, s).expect("live");
                    sim.check_handout(ptr, n, owner);
                    sim.use_range(ptr, n, owner, 2_000).expect("use");
                    assert!(a.free_ptr(ptr, owner));
                }
                a.retire_stream(s).expect("retire");
                if let Some(p) = &stack.private {
                    p.retire_stream(s).expect("retire");
                }
                sim.destroy_stream(s).expect("destroy");
            }
        }
        releases.fetch_add(1, Ordering::Relaxed);
    }
}

/// Runs private pools on `stream` until `done`: a pool begins for the stream, serves a few
/// allocations that kernels use, ends, and is released, as a CUDA graph's pool is.
fn private_pools(stack: &Stack, stream: Stream, seed: u64, strict: bool, done: &AtomicBool) {
    let (Some(p), sim) = (&stack.private, &stack.sim) else { return };
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut id = 0;
    while !done.load(Ordering::Relaxed) {
        id += 1;
        let filter: StreamFilter = Arc::new(move |s| s == stream);
        p.begin((1, id), filter).expect("begin");
        let mut made = Vec::new();
        for _ in 0..rng.gen_range(1..6) {
            let n = size(&mut rng);
            if let Ok(Routed::Pool(ptr)) = p.allocate(n, stream) {
                sim.check_handout(ptr, n, stream);
                sim.use_range(ptr, n, stream, 3_000).expect("use");
                made.push((ptr, n));
            }
        }
        p.end((1, id));
        // Half the time a checkpoint is restored, as cudagraph trees do: the allocations are
        // freed, then handed out again at their addresses, while releases run beside.
        if rng.gen_bool(0.5) {
            for &(ptr, _) in &made {
                assert!(p.free(ptr, stream));
            }
            made.shuffle(&mut rng);
            for &(ptr, n) in &made {
                p.allocate_at((1, id), ptr, n, stream, 0).expect("a checkpointed range is free again");
                sim.check_handout(ptr, n, stream);
                sim.use_range(ptr, n, stream, 3_000).expect("use");
            }
        }
        for (ptr, _) in made {
            assert!(p.free(ptr, stream));
        }
        p.release((1, id));
        release(&stack.allocator, strict);
    }
}

/// Runs the workers and the threads beside them on `stack`; the checker's violations (early
/// reuses, and unmaps of memory in use) and the releases made.
fn run(stack: Stack, ops: u64, record: bool) -> (usize, usize, u64) {
    let sim = &stack.sim;
    let streams: Vec<Stream> = (0..WORKERS + 2).map(|_| sim.create_stream().expect("stream")).collect();
    let (done, releases) = (AtomicBool::new(false), AtomicU64::new(0));
    let base = seed();
    let (own, beside) = streams.split_at(WORKERS);
    let (stack_ref, done_ref, releases_ref) = (&stack, &done, &releases);
    thread::scope(|scope| {
        let workers: Vec<_> = (0..WORKERS)
            .map(|i| scope.spawn(move || worker(stack_ref, own[i], own, base + i as u64, ops, record)))
            .collect();
        scope.spawn(move || releaser(stack_ref, beside[0], base + 100, record, done_ref, releases_ref));
        scope.spawn(move || private_pools(stack_ref, beside[1], base + 200, record, done_ref));
        for w in workers {
            w.join().expect("worker");
        }
        done_ref.store(true, Ordering::Relaxed);
    });
    sim.synchronize().expect("synchronize");
    release(&stack.allocator, record);
    let stats = stack.allocator.stats();
    assert_eq!((stats.allocated, stats.live_allocations), (0, 0));
    let violations = sim.violations();
    let unmaps = violations.iter().filter(|v| v.kind == ViolationKind::UnmapInUse).count();
    (violations.len(), unmaps, releases.load(Ordering::Relaxed))
}

fn check(name: &str, stack: Stack) {
    let ops = ops();
    let (violations, unmaps, releases) = run(stack, ops, true);
    eprintln!(
        "{name}: {WORKERS} workers x {ops} ops, {releases} releases beside them, {violations} violations \
         ({unmaps} unmaps of memory in use)"
    );
    assert!(releases > 0, "{name}: no release ran beside the workers");
    assert_eq!(violations, 0, "{name}: the checker found memory used after it was handed on or unmapped");
}

#[test]
fn stream_safe_stitched_threads() {
    check("stream_safe (stitched)", facade("strategy=stream_safe,backing=stitched"));
}
#[test]
fn stream_safe_chunks_threads() {
    check("stream_safe (chunks)", facade("strategy=stream_safe,backing=chunks"));
}
#[test]
fn stream_safe_segments_threads() {
    check("stream_safe (segments)", segments(true));
}
#[test]
fn best_fit_stitched_threads() {
    check("best_fit (stitched)", facade("strategy=best_fit,backing=stitched"));
}
#[test]
fn best_fit_chunks_threads() {
    check("best_fit (chunks)", facade("strategy=best_fit,backing=chunks"));
}
#[test]
fn best_fit_segments_threads() {
    check("best_fit (segments)", segments(false));
}
#[test]
fn async_threads() {
    check("async", facade("strategy=async"));
}
#[test]
fn plain_threads() {
    check("plain", facade("strategy=plain"));
}
#[test]
fn limited_stack_threads() {
    check("stream_safe + limit + retry + stats", facade("limit=0.9,retry_timeout=10ms,stats=true"));
}

/// The negative control: the same threads without `record_stream` hand out memory other
/// streams' kernels still use, and the checker reports it.
#[test]
fn the_threaded_checker_catches_a_missing_record_stream() {
    for (name, stack) in
        [("stream_safe", facade("strategy=stream_safe")), ("best_fit", facade("strategy=best_fit"))]
    {
        let (violations, _, _) = run(stack, 5_000, false);
        eprintln!("{name} without record_stream: {violations} violations");
        assert!(violations > 0, "{name}: a program without record_stream went unnoticed");
    }
}
