//! StreamSafe on the simulator: per-stream reuse, record_stream, stealing, retry on
//! out-of-memory, destroyed and retired streams, graph capture.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod conformance;

use std::sync::Arc;

use conformance::{run_program, Action};
use streamalloc::adaptors::Pointers;
use streamalloc::allocators::{BackingKind, BestFitConfig, StreamSafe, StreamSafeConfig};
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::device::{DeviceMemory, Graphs, Streams};
use streamalloc::{Allocator, AnyAllocator, Device, Error, Stream, StreamAllocator};

const MIB: usize = 1 << 20;

/// A StreamSafe allocator, by pointer too ([`Pointers`], the C ABI's path).
fn by_pointer(sim: &Arc<SimDevice>, config: StreamSafeConfig) -> Pointers<StreamSafe> {
    let a = StreamSafe::new(sim.clone(), config).unwrap();
    Pointers::new(a, sim.clone(), config.pool.wait_timeout)
}

fn setup(capacity: usize) -> (Arc<SimDevice>, Pointers<StreamSafe>, Stream, Stream) {
    let sim = SimDevice::new(SimConfig::with_capacity(capacity));
    let a = by_pointer(&sim, StreamSafeConfig::default());
    let (s1, s2) = (sim.create_stream().unwrap(), sim.create_stream().unwrap());
    (sim, a, s1, s2)
}

fn stream_safe(device: Arc<dyn Device>) -> AnyAllocator {
    AnyAllocator::Streams(Arc::new(StreamSafe::new(device, StreamSafeConfig::default()).unwrap()))
}

#[test]
fn same_stream_reuses_at_once() {
    let (sim, a, s1, _) = setup(1 << 30);
    let x = a.allocate_on(3 * MIB, s1).unwrap();
    let p = x.ptr();
    sim.use_range(p, 3 * MIB, s1, 5_000_000).unwrap();
    drop(x);
    let y = a.allocate_on(3 * MIB, s1).unwrap();
    assert_eq!(y.ptr(), p);
    assert_eq!(y.owning_stream(), s1);
    assert_eq!(sim.check_handout(y.ptr(), y.size(), s1), 0);
}

#[test]
fn recorded_stream_defers_reuse_until_its_work_is_done() {
    let (sim, a, s1, s2) = setup(1 << 30);
    let mut x = a.allocate_on(3 * MIB, s1).unwrap();
    let p = x.ptr();
    sim.use_range(p, 3 * MIB, s2, 5_000_000).unwrap();
    x.record_stream(s2);
    drop(x);
    assert_eq!(a.stats().pending_release, 3 * MIB);
    let y = a.allocate_on(3 * MIB, s1).unwrap();
    assert_ne!(y.ptr(), p, "reused while stream 2 still used it");
    assert_eq!(sim.check_handout(y.ptr(), y.size(), s1), 0);
    sim.synchronize_stream(s2).unwrap();
    let z = a.allocate_on(3 * MIB, s1).unwrap();
    assert_eq!(z.ptr(), p, "reused once the event completed");
    assert_eq!(sim.check_handout(z.ptr(), z.size(), s1), 0);
    assert_eq!(a.stats().pending_release, 0);
    assert!(sim.violations().is_empty());
}

/// The planted test: a program that uses memory on another stream without record_stream is
/// caught by the checker; the same program with record_stream is clean.
#[test]
fn omitting_record_stream_is_caught() {
    let program = [
        Action::Alloc { stream: 0, size: 3 * MIB },
        Action::Use { idx: 0, stream: 1, ns: 5_000_000 },
        Action::Free { idx: 0 },
        Action::Alloc { stream: 0, size: 3 * MIB },
    ];
    assert_eq!(run_program(&stream_safe, &program, true), 0);
    assert_eq!(run_program(&stream_safe, &program, false), 1);
}

#[test]
fn busy_streams_keep_their_memory() {
    // Two streams taking turns with 40 MiB each. The second stream's first look at the first
    // does not take its chunk, and every later look finds it busy: each stream keeps a chunk
    // of its own from the start, instead of one chunk ping-ponging between them with a
    // cross-stream wait per move.
    let (sim, a, s1, s2) = setup(1 << 30);
    let mut got = Vec::new();
    for _ in 0..10 {
        for s in [s1, s2] {
            let x = a.allocate_on(40 * MIB, s).unwrap();
            assert_eq!(sim.check_handout(x.ptr(), x.size(), s), 0);
            sim.use_range(x.ptr(), 40 * MIB, s, 1_000).unwrap();
            got.push(x.ptr());
        }
    }
    assert_eq!(a.stats().reserved, 80 * MIB);
    let (first, second) = (got[0], got[1]);
    assert_ne!(first, second);
    assert!(got.chunks(2).all(|turn| turn == [first, second]), "{got:x?}");
    assert!(sim.violations().is_empty());
}

#[test]
fn with_memory_to_spare_a_miss_grows() {
    // The default takes chunks only when free device memory is under 10% of the total.
    let (_sim, a, s1, s2) = setup(1 << 30);
    let p = a.allocate_on(40 * MIB, s1).unwrap().ptr();
    let mut held = Vec::new();
    for _ in 0..3 {
        let x = a.allocate_on(40 * MIB, s2).unwrap();
        assert_ne!(x.ptr(), p, "stream 1's idle chunk was taken with memory to spare");
        held.push(x);
    }
    assert_eq!(a.stats().reserved, 160 * MIB);
}

#[test]
fn a_miss_steals_from_an_idle_stream_instead_of_growing() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let config = StreamSafeConfig { steal_below_free_percent: 100, ..Default::default() };
    let a = StreamSafe::new(sim.clone(), config).unwrap();
    let (s1, s2) = (sim.create_stream().unwrap(), sim.create_stream().unwrap());
    let x = a.allocate_on(40 * MIB, s1).unwrap();
    let p = x.ptr();
    sim.use_range(p, 40 * MIB, s1, 5_000_000).unwrap();
    drop(x);
    // Stream 2's first miss only looks at stream 1's pool (it might be busy) and grows.
    let first = a.allocate_on(40 * MIB, s2).unwrap();
    assert_ne!(first.ptr(), p);
    let reserved = a.stats().reserved;
    // Its next miss finds stream 1 idle since that look, and takes its chunk.
    let y = a.allocate_on(40 * MIB, s2).unwrap();
    assert_eq!(y.ptr(), p, "took stream 1's free chunk");
    assert_eq!(y.owning_stream(), s2, "the chunk now belongs to stream 2's pool");
    assert_eq!(a.stats().reserved, reserved, "footprint did not grow");
    // Stream 2 now waits for stream 1's kernel, so the reuse is ordered.
    assert_eq!(sim.check_handout(y.ptr(), y.size(), s2), 0);
    sim.use_range(p, 40 * MIB, s2, 5_000_000).unwrap();
    drop(y);
    // Stream 2 reuses it at once.
    let again = a.allocate_on(40 * MIB, s2).unwrap();
    assert_eq!((again.ptr(), sim.check_handout(again.ptr(), again.size(), s2)), (p, 0));
    drop((first, again));
    assert_eq!(a.stats().reserved, reserved);
    assert!(sim.violations().is_empty());
}

#[test]
fn out_of_memory_releases_other_streams_caches_then_reports_every_pool() {
    let (_sim, a, s1, s2) = setup(64 * MIB);
    drop(a.allocate_on(40 * MIB, s1).unwrap());
    assert_eq!(a.stats().cached, 40 * MIB);
    // 50 MiB fits neither stream 1's cached block nor the device beside it: stream 1's pool
    // must give its chunk back.
    let y = a.allocate_on(50 * MIB, s2).unwrap();
    assert_eq!(a.stats().reserved, 50 * MIB);
    let err = a.allocate_on(30 * MIB, s1).unwrap_err();
    let Error::OutOfMemory(report) = &err else { panic!("expected out of memory, got {err}") };
    assert_eq!((report.requested, report.allocated, report.reserved), (30 * MIB, 50 * MIB, 50 * MIB));
    let text = err.to_string();
    assert!(
        text.contains(&format!("stream {:#x}", s1.raw()))
            && text.contains(&format!("stream {:#x}", s2.raw())),
        "{text}"
    );
    drop(y);
    a.allocate_on(30 * MIB, s1).unwrap();
}

#[test]
fn freeing_memory_of_a_destroyed_stream_does_not_crash() {
    let (sim, a, s1, s2) = setup(1 << 30);
    let owned = a.allocate_on(MIB, s2).unwrap();
    let _keeps_stream_1s_chunk_busy = a.allocate_on(MIB, s1).unwrap();
    let mut recorded = a.allocate_on(MIB, s1).unwrap();
    recorded.record_stream(s2);
    sim.destroy_stream(s2).unwrap();
    drop(owned);
    drop(recorded);
    // The failed event record does not fail the next, unrelated allocation...
    let x = a.allocate_on(MIB, s1).unwrap();
    assert_eq!(sim.check_handout(x.ptr(), x.size(), s1), 0);
    // ...and is reported once, by the next release.
    let held = a.release().expect_err("the held-back error");
    assert!(matches!(held, Error::HeldBack { count: 1, .. }), "{held:?}");
    a.release().unwrap();
}

#[test]
fn retire_stream_forgets_its_pool_and_returns_memory() {
    let (sim, a, s1, s2) = setup(1 << 30);
    let kept = a.allocate_on(MIB, s1).unwrap();
    drop(a.allocate_on(40 * MIB, s2).unwrap());
    let before = sim.mem_info().unwrap().used();
    a.retire_stream(s2).unwrap();
    assert_eq!(sim.mem_info().unwrap().used(), before - 40 * MIB);
    sim.destroy_stream(s2).unwrap();
    assert_eq!(a.stats().reserved, 2 * MIB, "only stream 1's small chunk is left");
    drop(kept);
}

#[test]
fn allocation_during_capture_and_release_waits_for_its_end() {
    let (sim, a, s1, s2) = setup(1 << 30);
    let mut x = a.allocate_on(MIB, s1).unwrap();
    x.record_stream(s2);
    drop(x);
    sim.begin_capture(s1).unwrap();
    // A pending free exists, but no event is queried: a new block is carved instead.
    let y = a.allocate_on(MIB, s1).unwrap();
    assert_eq!(a.release().unwrap(), 0, "nothing is released during a capture");
    let g = sim.end_capture(s1).unwrap();
    sim.destroy_graph(g).unwrap();
    drop(y);
    sim.synchronize_stream(s2).unwrap();
    assert!(a.release().unwrap() > 0);
}

#[test]
fn many_streams_overflow_the_slots() {
    let sim = SimDevice::new(SimConfig::with_capacity(4 << 30));
    let config = StreamSafeConfig { pool: BestFitConfig::default(), ..Default::default() };
    let a = StreamSafe::new(sim.clone(), config).unwrap();
    let streams: Vec<Stream> = (0..300).map(|_| sim.create_stream().unwrap()).collect();
    let live: Vec<_> = streams.iter().map(|&s| a.allocate_on(4096, s).unwrap()).collect();
    for (x, s) in live.iter().zip(&streams) {
        assert_eq!(x.owning_stream(), *s);
    }
    assert_eq!(a.stats().live_allocations, 300);
}

/// By pointer: a free with the owning stream as hint, with a wrong hint, and of a pointer
/// that is not live; each reuses like a handle's free.
#[test]
fn frees_by_pointer_find_the_pool_with_any_hint() {
    let (sim, a, s1, s2) = setup(1 << 30);
    let p = a.allocate_ptr(3 * MIB, s1).unwrap();
    let q = a.allocate_ptr(3 * MIB, s2).unwrap();
    assert_eq!(a.stats().live_allocations, 2);
    assert!(a.free_ptr(p, s1));
    assert!(a.free_ptr(q, s1), "a wrong hint still finds the allocation");
    assert!(!a.free_ptr(q, s2), "freed twice");
    assert!(!a.free_ptr(0xdead_0000, s1));
    assert!(!a.record_stream_ptr(p, s2).unwrap(), "record_stream on a freed pointer");
    assert_eq!(a.stats().live_allocations, 0);
    assert_eq!(a.allocate_ptr(3 * MIB, s2).unwrap(), q, "stream 2's block went back to stream 2");
    assert_eq!(a.allocate_ptr(0, s1).unwrap(), 0);
    assert!(sim.violations().is_empty());
}

/// By pointer, a recorded stream delays reuse as it does for a handle.
#[test]
fn record_stream_by_pointer_defers_reuse() {
    let (sim, a, s1, s2) = setup(1 << 30);
    let p = a.allocate_ptr(3 * MIB, s1).unwrap();
    sim.use_range(p, 3 * MIB, s2, 5_000_000).unwrap();
    assert!(a.record_stream_ptr(p, s2).unwrap());
    assert!(a.free_ptr(p, s1));
    assert_eq!(a.stats().pending_release, 3 * MIB);
    let q = a.allocate_ptr(3 * MIB, s1).unwrap();
    assert_ne!(q, p, "reused while stream 2 still used it");
    sim.synchronize_stream(s2).unwrap();
    assert_eq!(a.allocate_ptr(3 * MIB, s1).unwrap(), p, "reused once the event completed");
    assert!(sim.violations().is_empty());
}

/// A pointer kept by a retired stream's pool is still found and freed, and the pool's
/// memory returns at the next release.
#[test]
fn pointers_of_a_retired_stream_are_freed() {
    let (sim, a, _, s2) = setup(1 << 30);
    let p = a.allocate_ptr(40 * MIB, s2).unwrap();
    a.retire_stream(s2).unwrap();
    sim.destroy_stream(s2).unwrap();
    assert!(a.free_ptr(p, s2));
    a.release().unwrap();
    assert_eq!(a.stats().reserved, 0);
}

/// Allocations that miss the cache and grow the pool are kept by pointer too,
/// and threads freeing each other's pointers find them.
#[test]
fn pointers_cross_threads_and_growth() {
    let (_sim, a, s1, s2) = setup(1 << 30);
    let a = Arc::new(a);
    let ptrs: Vec<u64> = (0..64)
        .map(|i| a.allocate_ptr((i % 7 + 1) * MIB, if i % 2 == 0 { s1 } else { s2 }).unwrap())
        .collect();
    let b = a.clone();
    std::thread::spawn(move || {
        for p in ptrs {
            assert!(b.free_ptr(p, Stream::DEFAULT));
        }
    })
    .join()
    .unwrap();
    assert_eq!(a.stats().live_allocations, 0);
}

/// Issue 33: streams made, used, retired and destroyed in a loop (as CuPy programs make
/// them) leave no pool behind: the pools held stay as many as the streams alive, by handle
/// and by pointer, so memory and the cost of every call that visits the pools stay flat.
#[test]
fn streams_that_come_and_go_leave_no_pool_behind() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let a = by_pointer(&sim, StreamSafeConfig::default());
    let side = sim.create_stream().unwrap();
    let kept = a.allocate_on(4096, side).unwrap();
    for i in 0..20_000 {
        let s = sim.create_stream().unwrap();
        let x = a.allocate_on(4096, s).unwrap();
        let p = a.allocate_ptr(MIB + 4096, s).unwrap();
        if i % 2 == 0 {
            assert!(a.record_stream_ptr(p, side).unwrap());
        }
        drop(x);
        assert!(a.free_ptr(p, s));
        a.retire_stream(s).unwrap();
        sim.destroy_stream(s).unwrap();
        if i % 5_000 == 0 {
            assert!(a.inner().pool_count() <= 2, "after {i} streams: {} pools held", a.inner().pool_count());
        }
    }
    sim.synchronize_stream(side).unwrap();
    a.release().unwrap();
    assert_eq!(a.inner().pool_count(), 1, "only the side stream's pool is left");
    let s = a.stats();
    assert_eq!((s.allocated, s.live_allocations, s.pending_release), (4096, 1, 0));
    assert_eq!((s.total_allocations, s.total_frees), (40_001, 40_000), "counts of forgotten pools stay");
    assert_eq!(s.reserved, 2 * MIB, "the side stream's small chunk");
    assert_eq!(sim.unknown_stream_calls(), 0, "a destroyed stream was named");
    drop(kept);
}

/// Issue 33: a stream recorded on an allocation kept by pointer, retired and destroyed
/// before the free, is not waited for again: retiring waited for its work, and the free
/// records no event on it (which would fail, leaving the block out of use for good).
#[test]
fn a_retired_recorded_stream_needs_no_event_at_the_free() {
    let (sim, a, s1, s2) = setup(1 << 30);
    let p = a.allocate_ptr(4096, s1).unwrap();
    sim.use_range(p, 4096, s2, 1_000_000).unwrap();
    assert!(a.record_stream_ptr(p, s2).unwrap());
    a.retire_stream(s2).unwrap(); // waits for the kernel on s2
    sim.destroy_stream(s2).unwrap();
    assert!(a.free_ptr(p, s1));
    assert_eq!(a.stats().pending_release, 0, "the block waits for a destroyed stream");
    let q = a.allocate_ptr(4096, s1).unwrap();
    assert_eq!(q, p, "the block is reused at once");
    assert_eq!(sim.check_handout(q, 4096, s1), 0);
    a.release().unwrap();
    assert_eq!(sim.unknown_stream_calls(), 0, "a destroyed stream was named");
    assert!(sim.violations().is_empty());
}

/// A stream recorded by pointer and retired while its kernel outlasts the wait stays
/// recorded: the free still orders the block after that kernel, and nothing is reused early.
#[test]
fn a_retirement_that_times_out_keeps_the_stream_recorded() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let pool = BestFitConfig { wait_timeout: std::time::Duration::from_millis(1), ..Default::default() };
    let a = by_pointer(&sim, StreamSafeConfig { pool, ..Default::default() });
    let (s1, s2) = (sim.create_stream().unwrap(), sim.create_stream().unwrap());
    let p = a.allocate_ptr(4096, s1).unwrap();
    sim.use_range(p, 4096, s2, 1_000_000_000).unwrap(); // 1 s, past the 1 ms wait
    assert!(a.record_stream_ptr(p, s2).unwrap());
    let err = a.retire_stream(s2).unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(a.free_ptr(p, s1));
    assert_eq!(a.stats().pending_release, 4096, "the free waits for the kernel on s2");
    let q = a.allocate_ptr(4096, s1).unwrap();
    assert_ne!(q, p);
    sim.synchronize_stream(s2).unwrap();
    a.retire_stream(s2).unwrap();
    sim.destroy_stream(s2).unwrap();
    assert_eq!(a.allocate_ptr(4096, s1).unwrap(), p, "reused once the kernel is done");
    assert!(sim.violations().is_empty());
    assert_eq!(sim.unknown_stream_calls(), 0);
}

/// A handle's recorded stream destroyed without `erase_stream` leaves the block out of use
/// (never handed out while a kernel may use it, no event being possible on that stream); the
/// next release reports the failure once, waits for the device (the destroyed stream's work
/// included, as `cuMemFree` does) and frees the block, whose chunk then goes back with the
/// rest of the cache (issue 52, #12: it stayed pending for ever before).
#[test]
fn a_block_stuck_on_a_destroyed_stream_is_freed_by_the_next_release() {
    let (sim, a, s1, s2) = setup(1 << 30);
    let mut x = a.allocate_on(4096, s1).unwrap();
    sim.use_range(x.ptr(), 4096, s2, 1_000_000).unwrap();
    x.record_stream(s2);
    sim.destroy_stream(s2).unwrap();
    drop(x);
    assert_eq!(a.stats().pending_release, 4096);
    assert!(matches!(a.release(), Err(Error::HeldBack { count: 1, .. })));
    assert_eq!(sim.mem_info().unwrap().used(), 0, "the stuck block's chunk went back");
    let s = a.stats();
    assert_eq!((s.reserved, s.pending_release, s.allocated), (0, 0, 0));
    a.release().expect("the error was reported once");
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// Issue 33: the out-of-memory error of an allocator with 10,000 streams names the few
/// streams holding the most and sums up the rest, in a message of bounded length.
#[test]
fn out_of_memory_with_many_streams_names_the_largest_holders_briefly() {
    let sim = SimDevice::new(SimConfig::with_capacity(24 << 30));
    let a = StreamSafe::new(sim.clone(), StreamSafeConfig::default()).unwrap();
    let streams: Vec<Stream> = (0..10_000).map(|_| sim.create_stream().unwrap()).collect();
    let mut live: Vec<_> = streams.iter().map(|&s| a.allocate_on(4096, s).unwrap()).collect();
    let big = [(streams[17], 600 * MIB), (streams[4_242], 500 * MIB), (streams[9_999], 400 * MIB)];
    for &(s, n) in &big {
        live.push(a.allocate_on(n, s).unwrap());
    }
    let err = a.allocate_on(8 << 30, streams[0]).unwrap_err();
    let text = err.to_string();
    assert!(err.is_out_of_memory(), "{text}");
    assert!(text.len() < 4096, "{} bytes: {}...", text.len(), &text[..300]);
    for (s, _) in big {
        assert!(text.contains(&format!("stream {:#x}:", s.raw())), "{s:?} not named: {text}");
    }
    assert!(text.contains("and 9992 more streams holding"), "{text}");
    drop(live);
}

/// The pools of streams named often are promoted (found without writing anything, and kept
/// until the allocator is dropped); retired, they give their memory back and leave the pools
/// held all the same, and streams beyond the 32 promotions are served as before.
#[test]
fn promoted_pools_of_retired_streams_give_their_memory_back() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let a = by_pointer(&sim, StreamSafeConfig::default());
    let side = sim.create_stream().unwrap();
    for _ in 0..40 {
        let s = sim.create_stream().unwrap();
        for i in 0..1_500 {
            drop(a.allocate_on(4096 + i % 3 * 256, s).unwrap());
            let p = a.allocate_ptr(3 * MIB, s).unwrap();
            sim.use_range(p, 3 * MIB, side, 1_000).unwrap();
            assert!(a.record_stream_ptr(p, side).unwrap());
            assert!(a.free_ptr(p, s));
        }
        let q = a.allocate_ptr(3 * MIB, s).unwrap();
        assert_eq!(sim.check_handout(q, 3 * MIB, s), 0);
        assert!(a.free_ptr(q, s));
        a.retire_stream(s).unwrap();
        sim.destroy_stream(s).unwrap();
        sim.synchronize_stream(side).unwrap();
        a.release().unwrap();
        assert_eq!(a.inner().pool_count(), 0);
        assert_eq!(sim.mem_info().unwrap().used(), 0, "the retired stream's memory went back");
    }
    let s = a.stats();
    assert_eq!((s.total_allocations, s.total_frees), (40 * 3_001, 40 * 3_001));
    assert_eq!((s.reserved, s.allocated, s.pending_release), (0, 0, 0));
    assert_eq!(sim.unknown_stream_calls(), 0);
    assert!(sim.violations().is_empty());
}

#[test]
fn the_reserved_peak_is_that_of_all_pools_together_not_the_sum_of_their_peaks() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let alloc = StreamSafe::new(sim.clone(), StreamSafeConfig::default()).unwrap();
    let (s1, s2) = (sim.create_stream().unwrap(), sim.create_stream().unwrap());
    let a = alloc.allocate_on(64 << 20, s1).unwrap();
    let first = alloc.stats().reserved;
    drop(a);
    assert!(alloc.release().unwrap() > 0);
    assert_eq!(alloc.stats().reserved, 0);
    let b = alloc.allocate_on(64 << 20, s2).unwrap();
    let second = alloc.stats().reserved;
    // Each pool peaked at its own 64 MiB, one after the other.
    assert_eq!(alloc.stats().reserved_peak, first.max(second));
    drop(b);
    alloc.release().unwrap();
    alloc.reset_peak_stats();
    assert_eq!(alloc.stats().reserved_peak, 0);
    // A retired stream's pool takes its memory out of the count when it goes.
    let c = alloc.allocate_on(8 << 20, s1).unwrap();
    drop(c);
    alloc.retire_stream(s1).unwrap();
    alloc.reset_peak_stats();
    assert_eq!(alloc.stats().reserved_peak, alloc.stats().reserved);
}

/// Issue 52, #2: each stream's pool over stitched ranges reserves three times the device's
/// memory of virtual addresses (and a granule), a few hundred pools on an H200. Thousands of
/// streams that each allocated and freed once all get their memory: a reservation that fails
/// is out of memory, on which the pools give back their free memory, and a pool left with
/// nothing mapped gives back its reservation too. Streams holding memory at once past what
/// the address space holds get an out-of-memory error that names the reservation, and a
/// stream whose memory is freed makes room for another.
#[test]
fn thousands_of_streams_share_the_address_space() {
    // A pool reserves 48 GiB and 2 MiB: the simulator's window of 64 TiB holds 1365.
    let capacity = 16usize << 30;
    let reservation = 3 * capacity + 2 * MIB;
    let sim = SimDevice::new(SimConfig::with_capacity(capacity));
    let stitched = BackingKind::named("stitched").unwrap();
    let config = StreamSafeConfig {
        pool: BestFitConfig { backing: stitched, ..Default::default() },
        ..Default::default()
    };
    let a = StreamSafe::new(sim.clone(), config).unwrap();
    let streams: Vec<Stream> = (0..3000).map(|_| sim.create_stream().unwrap()).collect();
    for (i, &s) in streams.iter().enumerate() {
        let x = a.allocate_on(MIB, s).unwrap_or_else(|e| panic!("stream {i} of {}: {e}", streams.len()));
        drop(x);
    }
    assert_eq!(a.pool_count(), streams.len());
    assert!(a.stats().retries >= 2, "the reservations ran out and were given back: {:?}", a.stats());
    let mut held = Vec::new();
    let failure = loop {
        let Some(&s) = streams.get(held.len()) else { panic!("{} streams held memory at once", held.len()) };
        match a.allocate_on(MIB, s) {
            Ok(x) => held.push(x),
            Err(e) => break e,
        }
    };
    let message = failure.to_string();
    assert!(matches!(failure, Error::OutOfMemory(_)), "{message}");
    assert!(
        message.contains("virtual addresses") && message.contains(&reservation.to_string()),
        "the error names the reservation: {message}"
    );
    assert!((1000..=1365).contains(&held.len()), "{} streams held memory at once", held.len());
    let next = streams[held.len()];
    held.pop();
    a.allocate_on(MIB, next).expect("the freed pool's reservation serves another stream");
    drop(held);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// Issue 51: `StreamSafe::new` checks its pools' sizes without building a pool to throw
/// away: bad sizes are refused up front with the error a pool gives for them.
#[test]
fn bad_pool_sizes_are_refused_up_front_as_a_pool_refuses_them() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let bad = [
        BestFitConfig { growth: 1 << 20, ..BestFitConfig::default() },
        BestFitConfig { small_chunk_size: 1000, ..BestFitConfig::default() },
    ];
    for pool in bad {
        let e = StreamSafe::new(sim.clone(), StreamSafeConfig { pool, ..StreamSafeConfig::default() })
            .err()
            .unwrap();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        let by_pool = streamalloc::allocators::BestFit::new(sim.clone(), pool).err().unwrap();
        assert_eq!(e.to_string(), by_pool.to_string());
    }
}

/// A request larger than the device's whole memory can never be served: it fails at once,
/// without giving back what the pools cache (the next allocations would map it again) or
/// waiting for other streams' work, and its error says so.
#[test]
fn a_request_beyond_the_device_keeps_the_cache() {
    let (sim, a, s1, s2) = setup(1 << 30);
    drop(a.allocate_on(64 * MIB, s1).unwrap());
    drop(a.allocate_on(64 * MIB, s2).unwrap());
    let before = (a.stats(), sim.host_waits());
    let e = a.allocate_on(2 << 30, s1).map(|x| x.size()).unwrap_err();
    let Error::OutOfMemory(report) = &e else { panic!("expected out-of-memory, got {e}") };
    assert!(report.exceeds_device(), "{e}");
    assert!(e.to_string().contains("more than the device's"), "{e}");
    let after = (a.stats(), sim.host_waits());
    assert_eq!(after.0.cached, before.0.cached, "the pools gave their cache back");
    assert_eq!(after.0.device_frees, before.0.device_frees, "device memory was freed");
    assert_eq!(after.1, before.1, "the host waited for the streams' work");
    // Within the device's memory, the cache still goes back for a request it cannot serve.
    assert!(a.allocate_on((1 << 30) - 4 * MIB, s1).is_ok());
}
