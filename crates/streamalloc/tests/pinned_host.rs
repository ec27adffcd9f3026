//! The pinned host pool (issue 36) on the simulator: real host memory, reuse in stream order
//! through events without host waits, graphs, release, statistics, and a multi-threaded fuzz
//! whose uses of pinned memory the simulator's checker watches (none early; the negative
//! control, which drops `record_stream`, is caught).
//!
//! `STREAMALLOC_FUZZ_THREAD_OPS` sets the operations per worker thread of the fuzz (default
//! 20,000), `STREAMALLOC_FUZZ_SEED` the seed.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::thread;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use streamalloc::allocators::{PinnedHost, PinnedHostConfig};
use streamalloc::device::sim::{SimConfig, SimDevice, ViolationKind};
use streamalloc::device::Streams;
use streamalloc::{Device, Error, Stream};

const MIB: usize = 1 << 20;

fn sim() -> (Arc<SimDevice>, Arc<dyn Device>) {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let device: Arc<dyn Device> = sim.clone();
    (sim, device)
}

fn pool(device: &Arc<dyn Device>) -> PinnedHost {
    PinnedHost::new(device.clone(), PinnedHostConfig::default()).expect("pool")
}

#[test]
fn blocks_are_real_host_memory() {
    let (sim, device) = sim();
    let pool = pool(&device);
    let buffer = pool.allocate(100_000).unwrap();
    assert_eq!(buffer.ptr() % 4096, 0);
    // SAFETY: the buffer is 100,000 bytes of host memory that the pool handed out and that
    // nothing else uses; the slice lives no longer than the buffer.
    #[allow(unsafe_code)] // host memory seen as bytes: what a test of pinned memory checks
    let bytes = unsafe { std::slice::from_raw_parts_mut(buffer.as_mut_ptr(), buffer.size()) };
    bytes.iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8);
    assert!(bytes.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
    assert_eq!(sim.host_bytes(), 128 << 10, "one block of the next power of two");
}

#[test]
fn unused_blocks_come_back_at_once_by_class() {
    let (sim, device) = sim();
    let pool = pool(&device);
    let a = pool.allocate_ptr(5000).unwrap();
    let b = pool.allocate_ptr(1).unwrap();
    assert_eq!(pool.free_ptr(a), Some(5000));
    assert_eq!(pool.free_ptr(a), None, "freed twice");
    assert_eq!(pool.free_ptr(0xdead_0000), None, "never allocated");
    assert_eq!(pool.allocate_ptr(8192).unwrap(), a, "the same class, at once");
    let c = pool.allocate_ptr(8193).unwrap();
    assert_ne!(c, a, "another class");
    assert_eq!(pool.allocate_ptr(0).unwrap(), 0);
    assert_eq!(sim.host_calls(), (3, 0));
    let stats = pool.stats();
    assert_eq!((stats.allocated, stats.reserved), (8192 + 1 + 8193, 8192 + 4096 + 16384));
    assert_eq!((stats.live_allocations, stats.total_allocations, stats.total_frees), (3, 4, 1));
    assert_eq!((stats.device_allocs, stats.cached), (3, 0));
    for p in [a, b, c] {
        pool.free_ptr(p).unwrap();
    }
    assert_eq!((pool.stats().cached, pool.stats().largest_free_block), (8192 + 4096 + 16384, 16384));
}

#[test]
fn a_block_used_on_streams_waits_for_their_work_without_a_host_wait() {
    let (sim, device) = sim();
    let pool = pool(&device);
    let (s, t) = (device.create_stream().unwrap(), device.create_stream().unwrap());
    let mut a = pool.allocate(MIB).unwrap();
    let first = a.ptr();
    sim.use_host(first, MIB, s, 1_000_000).unwrap(); // a copy from it on `s`
    sim.use_host(first, MIB, t, 3_000_000).unwrap(); // and a longer one on `t`
    a.record_stream(&device, s).unwrap();
    a.record_stream(&device, t).unwrap();
    a.record_stream(&device, s).unwrap(); // twice: once
    drop(a);
    assert_eq!(pool.stats().pending_release, MIB);
    let waits = sim.host_waits();
    let b = pool.allocate(MIB).unwrap();
    assert_ne!(b.ptr(), first, "the copies still read the first block");
    assert_eq!(sim.check_host_handout(b.ptr(), MIB), 0);
    drop(b);
    device.synchronize_stream(s).unwrap();
    let c = pool.allocate(MIB).unwrap();
    assert_ne!(c.ptr(), first, "`t`'s copy still reads it");
    device.synchronize_stream(t).unwrap();
    let d = pool.allocate(MIB).unwrap();
    assert_eq!(d.ptr(), first, "both copies are done");
    assert_eq!(sim.check_host_handout(d.ptr(), MIB), 0);
    assert_eq!(sim.host_waits(), waits + 2, "only the test's own synchronizations waited");
    assert_eq!((pool.stats().pending_release, pool.stats().device_allocs), (0, 2));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn recording_checks_the_stream_and_the_pointer() {
    let (sim, device) = sim();
    let pool = pool(&device);
    let p = pool.allocate_ptr(4096).unwrap();
    assert!(
        pool.record_stream_ptr(p, &device, Stream::forged(0xbad0)).is_err(),
        "not a stream of the device"
    );
    assert!(!pool.record_stream_ptr(p + 64, &device, Stream::DEFAULT).unwrap(), "not a block");
    assert!(pool.record_stream_ptr(p, &device, Stream::DEFAULT).unwrap());
    pool.free_ptr(p).unwrap();
    assert!(!pool.record_stream_ptr(p, &device, Stream::DEFAULT).unwrap(), "freed");
    assert!(sim.violations().is_empty());
}

#[test]
fn each_device_records_on_its_own_streams() {
    let (sim0, dev0) = sim();
    let sim1 = SimDevice::new(SimConfig { ordinal: 1, ..SimConfig::with_capacity(1 << 30) });
    let dev1: Arc<dyn Device> = sim1.clone();
    let pool = pool(&dev0);
    let (s0, s1) = (dev0.create_stream().unwrap(), dev1.create_stream().unwrap());
    let mut a = pool.allocate(4096).unwrap();
    sim0.use_host(a.ptr(), 4096, s0, 1_000_000).unwrap();
    // Device 1's stream is busy for 5 ms of its own clock (the copy itself is device 0's to
    // check: the simulator sees host memory on the device that allocated it).
    let busy = dev1.alloc(4096).unwrap();
    sim1.use_range(busy, 4096, s1, 5_000_000).unwrap();
    a.record_stream(&dev0, s0).unwrap();
    a.record_stream(&dev1, s1).unwrap();
    let first = a.ptr();
    drop(a);
    dev0.synchronize_stream(s0).unwrap();
    let b = pool.allocate_ptr(4096).unwrap();
    assert_ne!(b, first, "device 1's stream is still at work");
    dev1.synchronize_stream(s1).unwrap();
    assert_eq!(pool.allocate_ptr(4096).unwrap(), first, "both events have completed");
    assert!(sim0.violations().is_empty() && sim1.violations().is_empty());
}

#[test]
fn a_block_used_by_a_capture_is_never_handed_out_again() {
    let (sim, device) = sim();
    let pool = pool(&device);
    let (s, capturing) = (device.create_stream().unwrap(), device.create_stream().unwrap());
    // Used while its stream captures a graph: a replay may copy from it at any time.
    let mut a = pool.allocate(4096).unwrap();
    device.begin_capture(capturing).unwrap();
    a.record_stream(&device, capturing).unwrap();
    let graph = device.end_capture(capturing).unwrap();
    let captured = a.ptr();
    drop(a);
    // Recorded before a capture began on its stream, freed during it: no event can say when.
    let mut b = pool.allocate(4096).unwrap();
    b.record_stream(&device, s).unwrap();
    device.begin_capture(s).unwrap();
    let during = b.ptr();
    drop(b);
    device.end_capture(s).map(|g| device.destroy_graph(g)).unwrap().unwrap();
    device.synchronize().unwrap();
    let stats = pool.stats();
    assert_eq!((stats.pending_release, stats.cached), (8192, 0));
    let c = pool.allocate_ptr(4096).unwrap();
    assert!(c != captured && c != during);
    assert_eq!(pool.release().unwrap(), 0, "nothing is free");
    device.destroy_graph(graph).unwrap();
    assert!(sim.violations().is_empty());
}

#[test]
fn release_gives_back_free_blocks_only() {
    let (sim, device) = sim();
    let pool = pool(&device);
    let s = device.create_stream().unwrap();
    let kept = pool.allocate(MIB).unwrap();
    let free = pool.allocate(2 * MIB).unwrap();
    let mut busy = pool.allocate(4 * MIB).unwrap();
    sim.use_host(busy.ptr(), 4 * MIB, s, 1_000_000).unwrap();
    busy.record_stream(&device, s).unwrap();
    drop((free, busy));
    assert_eq!(pool.release().unwrap(), 2 * MIB, "the busy block is pending");
    assert_eq!(sim.host_bytes(), 5 * MIB);
    device.synchronize_stream(s).unwrap();
    assert_eq!(pool.release().unwrap(), 4 * MIB, "its copy is done");
    let stats = pool.stats();
    assert_eq!((stats.reserved, stats.reserved_peak, stats.device_frees), (MIB, 7 * MIB, 2));
    pool.reset_peak_stats();
    assert_eq!((pool.stats().reserved_peak, pool.stats().allocated_peak), (MIB, MIB));
    drop(kept);
    assert!(sim.violations().is_empty());
}

#[test]
fn out_of_memory_gives_the_cache_back_and_reports_the_pool() {
    let (sim, device) = sim();
    let pool = pool(&device);
    pool.free_ptr(pool.allocate_ptr(MIB).unwrap()).unwrap();
    assert_eq!(pool.stats().cached, MIB);
    match pool.allocate_ptr(1 << 60) {
        Err(Error::OutOfMemory(report)) => {
            assert_eq!((report.requested, report.reserved, report.cached), (1 << 60, 0, 0));
            assert!(report.hint.contains("pinned pool"), "{}", report.hint);
            // Issue 52, #16: the message names the host, not the device's free memory.
            let text = Error::OutOfMemory(report).to_string();
            assert!(text.starts_with("out of page-locked host memory"), "{text}");
            assert!(!text.contains("device free"), "{text}");
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    assert!(matches!(pool.allocate_ptr(usize::MAX), Err(Error::InvalidArgument(_))));
    let stats = pool.stats();
    assert_eq!((stats.failures, stats.device_frees, stats.retries), (2, 1, 0));
    assert_eq!(sim.host_bytes(), 0);
}

#[test]
fn dropping_the_pool_frees_its_memory_but_what_a_graph_may_use() {
    let (sim, device) = sim();
    let s = device.create_stream().unwrap();
    {
        let pool = pool(&device);
        let _free = pool.allocate(4096).unwrap();
        let kept_by_pointer = pool.allocate_ptr(8192).unwrap();
        let mut pending = pool.allocate(16384).unwrap();
        sim.use_host(pending.ptr(), 16384, s, 1_000_000).unwrap();
        pending.record_stream(&device, s).unwrap();
        drop(pending);
        let mut captured = pool.allocate(32768).unwrap();
        device.begin_capture(s).unwrap();
        captured.record_stream(&device, s).unwrap();
        drop(captured);
        device.end_capture(s).map(|g| device.destroy_graph(g)).unwrap().unwrap();
        assert_ne!(kept_by_pointer, 0);
    }
    assert_eq!(sim.host_bytes(), 32768, "the captured block stays");
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn min_block_must_be_a_power_of_two() {
    let (_, device) = sim();
    let config = PinnedHostConfig { min_block: 3000, ..PinnedHostConfig::default() };
    assert!(matches!(PinnedHost::new(device, config), Err(Error::InvalidArgument(_))));
}

fn ops() -> u64 {
    std::env::var("STREAMALLOC_FUZZ_THREAD_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000)
}

fn seed() -> u64 {
    std::env::var("STREAMALLOC_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(36)
}

/// Threads allocate pinned blocks, hand each to the checker as the host takes it, copy from
/// them on streams of their own (and each other's), record those streams (unless `record`
/// is false) and free, while one thread releases the cache now and then. The violations the
/// checker found.
fn fuzz(record: bool, ops: u64) -> Vec<streamalloc::device::sim::Violation> {
    const WORKERS: u64 = 4;
    let (sim, device) = sim();
    let pool = Arc::new(pool(&device));
    let streams: Vec<Stream> = (0..WORKERS).map(|_| device.create_stream().unwrap()).collect();
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let (sim, device, pool, streams) = (sim.clone(), device.clone(), pool.clone(), streams.clone());
            thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(seed() * 100 + w);
                let mut held: Vec<(u64, usize)> = Vec::new();
                for _ in 0..ops {
                    match rng.gen_range(0..10) {
                        0..=3 => {
                            let size = 1 << rng.gen_range(8..18);
                            let ptr = pool.allocate_ptr(size).unwrap();
                            sim.check_host_handout(ptr, size);
                            held.push((ptr, size));
                        }
                        4..=6 if !held.is_empty() => {
                            let (ptr, size) = held[rng.gen_range(0..held.len())];
                            let stream = streams[rng.gen_range(0..streams.len())];
                            sim.use_host(ptr, size, stream, rng.gen_range(1_000..200_000)).unwrap();
                            if record {
                                assert!(pool.record_stream_ptr(ptr, &device, stream).unwrap());
                            }
                        }
                        7..=8 if !held.is_empty() => {
                            let (ptr, _) = held.swap_remove(rng.gen_range(0..held.len()));
                            pool.free_ptr(ptr).unwrap();
                        }
                        9 if w == 0 => {
                            // Without record_stream the pool frees blocks under copies, which
                            // the simulator refuses (and counts).
                            let released = pool.release();
                            assert!(released.is_ok() || !record, "{released:?}");
                        }
                        _ => sim.advance(rng.gen_range(0..20_000)),
                    }
                }
                for (ptr, _) in held {
                    pool.free_ptr(ptr).unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    device.synchronize().unwrap();
    let released = pool.release();
    if !record {
        return sim.violations();
    }
    released.unwrap();
    let stats = pool.stats();
    assert_eq!((stats.allocated, stats.live_allocations, stats.pending_release), (0, 0, 0));
    assert_eq!((stats.reserved, sim.host_bytes()), (0, 0), "everything went back");
    assert_eq!(stats.device_allocs, stats.device_frees);
    sim.violations()
}

#[test]
fn fuzz_threads_reuse_nothing_early() {
    let violations = fuzz(true, ops());
    assert!(violations.is_empty(), "{} early reuses, the first {:?}", violations.len(), violations.first());
}

#[test]
fn fuzz_negative_control_without_record_stream_is_caught() {
    // A tenth of the operations: the early reuses it makes pile up in the simulator's
    // books, which made the full run take 20 times the positive one (past 60 s on a GPU host).
    let violations = fuzz(false, ops() / 10);
    assert!(violations.iter().any(|v| v.kind == ViolationKind::HostReuse), "the checker saw nothing");
}

/// Issue 52, #12 (the 4,096 B block pending for ever): a pinned block freed with a destroyed
/// stream recorded on it is kept out of use (its last use cannot be waited for by an event);
/// the next release says which block, which stream and why, waits for the stream's device and
/// frees the block.
#[test]
fn a_block_recorded_on_a_destroyed_stream_is_named_at_the_release() {
    let (sim, device) = sim();
    let pool = pool(&device);
    let s = sim.create_stream().expect("stream");
    let ptr = pool.allocate_ptr(4096).expect("block");
    assert!(pool.record_stream_ptr(ptr, &device, s).expect("record"));
    sim.destroy_stream(s).expect("destroy");
    pool.free_ptr(ptr).expect("free");
    assert_eq!(pool.stats().pending_release, 4096);
    let err = pool.release().expect_err("the held error").to_string();
    assert!(err.contains(&format!("pinned block at {ptr:#x}")), "{err}");
    assert!(err.contains(&format!("stream {:#x} recorded on it", s.raw())), "{err}");
    assert!(err.contains("kept out of use until a release has waited for its device"), "{err}");
    // That release synchronized the device: the block was free again, and went back with the
    // other free blocks; nothing is left pending or pinned.
    let stats = pool.stats();
    assert_eq!((stats.pending_release, stats.reserved), (0, 0), "{stats:?}");
    pool.release().expect("nothing held any more");
}
