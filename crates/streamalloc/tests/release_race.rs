//! A release racing frees (issue 33): memory allocated, used and freed while a release waits
//! for the pool's stream is never unmapped under that use. Deterministic on the simulator: a
//! host function on the pool's stream, which runs during the release's wait, takes a cached
//! block, enqueues a kernel on it and frees it; an unmap of that block while the kernel runs
//! is a violation of the ordering checker.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use streamalloc::allocators::{BackingKind, BestFit, BestFitConfig, StreamSafe, StreamSafeConfig};
use streamalloc::device::sim::{SimConfig, SimDevice, ViolationKind};
use streamalloc::device::{DeviceMemory, DeviceTestExt, Streams, VirtualMemory};
use streamalloc::{Allocator, Stream, StreamAllocator};

const MIB: usize = 1 << 20;
const BACKINGS: [BackingKind; 3] = [BackingKind::CHUNKS, BackingKind::SEGMENTS, BackingKind::STITCHED];

fn config(backing: BackingKind, stream: Stream) -> BestFitConfig {
    BestFitConfig {
        growth: 20 * MIB,
        stream,
        backing,
        wait_timeout: Duration::from_millis(100),
        ..Default::default()
    }
}

/// Queues on `s`, behind a short kernel (so that it runs when a wait for an event recorded
/// now on `s` completes), a host function that allocates `size` bytes with `allocate`, uses
/// them on `s` for a long time and frees them.
fn reuse_during_the_wait(
    sim: &Arc<SimDevice>,
    s: Stream,
    size: usize,
    allocate: impl FnOnce(usize) -> streamalloc::Allocation + Send + 'static,
) {
    let scratch = sim.alloc(4096).unwrap();
    sim.use_range(scratch, 4096, s, 1_000).unwrap();
    let d = sim.clone();
    sim.launch_host_func(
        s,
        Box::new(move || {
            let block = allocate(size);
            d.use_range(block.ptr(), block.size(), s, 1_000_000_000).unwrap();
        }),
    )
    .unwrap();
}

/// What the checker found beyond early handouts: device calls on memory in use.
fn unmaps_in_use(sim: &SimDevice) -> usize {
    sim.violations().iter().filter(|v| v.kind == ViolationKind::UnmapInUse).count()
}

#[test]
fn a_release_never_unmaps_a_block_allocated_used_and_freed_during_its_wait() {
    for backing in BACKINGS {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let s = sim.create_stream().unwrap();
        let pool = Arc::new(BestFit::new(sim.clone(), config(backing, s)).unwrap());
        drop(pool.allocate(6 * MIB).unwrap());
        let p = pool.clone();
        reuse_during_the_wait(&sim, s, 6 * MIB, move |size| p.allocate(size).unwrap());
        let released = pool.release();
        assert_eq!(unmaps_in_use(&sim), 0, "{backing:?}: {:?} ({released:?})", sim.violations());
        assert!(released.is_ok(), "{backing:?}: {released:?}");
        // Once the kernel is done, what it used goes back too.
        sim.synchronize().unwrap();
        pool.release().unwrap();
        assert_eq!(pool.stats().reserved, 0, "{backing:?}");
        assert!(sim.violations().is_empty(), "{backing:?}: {:?}", sim.violations());
    }
}

#[test]
fn a_stream_safe_release_never_unmaps_a_block_allocated_used_and_freed_during_its_wait() {
    for backing in BACKINGS {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let s = sim.create_stream().unwrap();
        let config = StreamSafeConfig { pool: config(backing, Stream::DEFAULT), ..Default::default() };
        let alloc = Arc::new(StreamSafe::new(sim.clone(), config).unwrap());
        drop(alloc.allocate_on(6 * MIB, s).unwrap());
        let a = alloc.clone();
        reuse_during_the_wait(&sim, s, 6 * MIB, move |size| a.allocate_on(size, s).unwrap());
        let released = alloc.release();
        assert_eq!(unmaps_in_use(&sim), 0, "{backing:?}: {:?} ({released:?})", sim.violations());
        assert!(released.is_ok(), "{backing:?}: {released:?}");
        sim.synchronize().unwrap();
        alloc.release().unwrap();
        assert_eq!(alloc.stats().reserved, 0, "{backing:?}");
        assert!(sim.violations().is_empty(), "{backing:?}: {:?}", sim.violations());
    }
}

/// The checker's own control: an unmap under a running kernel is refused and counted.
#[test]
fn the_simulator_counts_an_unmap_of_memory_in_use() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let g = sim.map_granularity().unwrap();
    let base = sim.reserve_address(4 * g).unwrap();
    sim.map(base, g).unwrap();
    sim.use_range(base, 4096, Stream::DEFAULT, 1_000_000).unwrap();
    assert!(sim.unmap(base, g).is_err(), "the unmap is refused");
    assert_eq!(unmaps_in_use(&sim), 1);
    sim.synchronize().unwrap();
    sim.unmap(base, g).unwrap();
    assert_eq!(unmaps_in_use(&sim), 1);
}

/// Two releases of an expandable-segments pool at once: the one that took a class's segment
/// keeps it out of the pool until its own wait is over, whatever the other does (growths of
/// that class meanwhile get chunks of their own). The inner release runs in a host function
/// during the outer one's wait.
#[test]
fn a_release_during_another_keeps_the_others_segment_out() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let s = sim.create_stream().unwrap();
    let pool = Arc::new(BestFit::new(sim.clone(), config(BackingKind::SEGMENTS, s)).unwrap());
    drop(pool.allocate(4096).unwrap());
    drop(pool.allocate(6 * MIB).unwrap());
    let scratch = sim.alloc(4096).unwrap();
    sim.use_range(scratch, 4096, s, 1_000).unwrap();
    let (p, inner) = (pool.clone(), Arc::new(parking_lot::Mutex::new(None)));
    let seen = inner.clone();
    sim.launch_host_func(
        s,
        Box::new(move || {
            // Both segments are out for the outer release: this takes a chunk of its own,
            // which the inner release gives back; then a small request grows again.
            drop(p.allocate(6 * MIB).unwrap());
            let released = p.release();
            *seen.lock() = Some((released, p.allocate(4096).map(drop)));
        }),
    )
    .unwrap();
    pool.release().unwrap();
    let (released, small) = inner.lock().take().expect("the host function ran during the release");
    assert!(released.is_ok(), "{released:?}");
    assert!(small.is_ok(), "a small request during the outer release: {small:?}");
    sim.synchronize().unwrap();
    pool.release().unwrap();
    assert_eq!(pool.stats().reserved, 0);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}
