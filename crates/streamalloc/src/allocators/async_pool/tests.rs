//! `AsyncPool` on the simulator: recorded-stream frees under the ordering checker, the
//! throttle, lazy initialization and the four capture cases.

use std::sync::Arc;

use super::*;
use crate::device::sim::{SimConfig, SimDevice};
use crate::device::{DeviceTestExt, DriverPools, Events, Graphs, Streams};

const MIB: usize = 1 << 20;

fn sim(capacity: usize) -> Arc<SimDevice> {
    SimDevice::new(SimConfig::with_capacity(capacity))
}

fn used(sim: &SimDevice, pool: &AsyncPool) -> u64 {
    sim.pool_attr(pool.pool().unwrap(), PoolAttr::UsedMemCurrent).unwrap()
}

/// Stream `b` uses a block of stream `a` for 1 ms, the block is freed and `a` asks for the
/// same size again; returns the violations the checker saw.
fn reuse_after_use_on_other_stream(record: bool) -> usize {
    let d = sim(1 << 30);
    let pool = AsyncPool::new(d.clone(), AsyncPoolConfig::default());
    let (a, b) = (d.create_stream().unwrap(), d.create_stream().unwrap());
    // A whole 2 MiB granule, so that the reuse can only be this block.
    let mut x = pool.allocate_on(2 * MIB, a).unwrap();
    d.use_range(x.ptr(), x.size(), b, 1_000_000).unwrap();
    if record {
        x.record_stream(b);
    }
    let first = x.ptr();
    drop(x);
    let y = pool.allocate_on(2 * MIB, a).unwrap();
    assert_eq!(y.ptr(), first, "the pool reuses the block");
    d.check_handout(y.ptr(), y.size(), a);
    d.violations().len()
}

#[test]
fn recorded_stream_orders_the_reuse_and_omitting_it_is_caught() {
    assert_eq!(reuse_after_use_on_other_stream(true), 0);
    assert_eq!(reuse_after_use_on_other_stream(false), 1, "the deliberately wrong program is caught");
}

#[test]
fn recorded_stream_free_counts_as_pending() {
    let d = sim(1 << 30);
    let pool = AsyncPool::new(d.clone(), AsyncPoolConfig::default());
    let (a, b) = (d.create_stream().unwrap(), d.create_stream().unwrap());
    let mut x = pool.allocate_on(3 * MIB, a).unwrap();
    x.record_stream(b);
    d.use_range(x.ptr(), x.size(), b, 1_000_000).unwrap();
    drop(x);
    let s = pool.stats();
    assert_eq!((s.allocated, s.pending_release, s.device_frees), (0, 3 * MIB, 1));
    assert_eq!(s.reserved, s.cached + s.pending_release);
}

fn throttled(ratio: f64) -> (u64, u64) {
    let d = sim(64 * MIB);
    let reuse = ReuseFlags { internal_dependencies: false, ..ReuseFlags::default() };
    let mode = PoolMode::Owned { release_threshold: usize::MAX, reuse, max_size: 0, exportable: false };
    let pool =
        AsyncPool::new(d.clone(), AsyncPoolConfig { mode, throttle_ratio: ratio, ..Default::default() });
    let (a, b) = (d.create_stream().unwrap(), d.create_stream().unwrap());
    let mut x = pool.allocate_on(40 * MIB, a).unwrap();
    x.record_stream(b);
    d.use_range(x.ptr(), x.size(), b, 5_000_000).unwrap();
    let b_done = d.stream_ready_at(b).unwrap();
    drop(x);
    assert_eq!(pool.stats().pending_release, 40 * MIB);
    let _y = pool.allocate_on(MIB, a).unwrap();
    assert!(d.violations().is_empty());
    (d.stream_ready_at(a).unwrap(), b_done)
}

#[test]
fn throttle_makes_the_next_allocation_wait_on_the_free_stream() {
    // 40 MiB pending of 64 MiB is over 0.5: stream a waits for b's work (through the free
    // stream) and the pending count restarts.
    let (a_ready, b_done) = throttled(0.5);
    assert!(a_ready >= b_done, "a ready at {a_ready}, b done at {b_done}");
    // Off: a does not wait (the pool may not insert waits, so it grows instead).
    let (a_ready, b_done) = throttled(f64::INFINITY);
    assert!(a_ready < b_done);
}

#[test]
fn constructor_and_idle_calls_make_no_device_call() {
    let d = sim(1 << 30);
    let before = d.now();
    let pool = AsyncPool::new(d.clone(), AsyncPoolConfig::default());
    pool.set_default_stream(Stream::forged(12345));
    assert_eq!(pool.release().unwrap(), 0);
    assert_eq!(pool.stats(), Stats::default());
    drop(pool);
    assert_eq!(d.now(), before, "every simulated device call advances the clock");
}

#[test]
fn the_free_stream_is_made_only_by_a_free_with_recorded_streams() {
    let d = sim(1 << 30);
    let pool = AsyncPool::new(d.clone(), AsyncPoolConfig { throttle_ratio: 0.0, ..Default::default() });
    let s = d.create_stream().unwrap();
    // Allocations, frees on their own stream and throttled allocations need no stream.
    for _ in 0..4 {
        drop(pool.allocate_on(3 * MIB, s).unwrap());
    }
    assert_eq!(d.live_streams(), 1, "the pool made a stream nothing used");
    let mut x = pool.allocate_on(3 * MIB, s).unwrap();
    x.record_stream(Stream::DEFAULT);
    drop(x);
    assert_eq!(d.live_streams(), 2);
    drop(pool);
    assert_eq!(d.live_streams(), 1, "the pool's free stream outlived it");
}

#[test]
fn first_use_from_many_threads_sets_up_once() {
    let d = sim(1 << 30);
    let mode = PoolMode::Owned {
        release_threshold: 0,
        reuse: ReuseFlags::default(),
        max_size: 0,
        exportable: false,
    };
    let pool = Arc::new(AsyncPool::new(d.clone(), AsyncPoolConfig { mode, ..Default::default() }));
    let pools: Vec<Pool> = (0..8)
        .map(|_| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let _x = pool.allocate(MIB).unwrap();
                pool.pool().unwrap()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    assert!(pools.iter().all(|p| *p == pools[0]), "one pool: {pools:?}");
    assert_ne!(pools[0], d.default_pool().unwrap());
}

#[test]
fn owned_pool_with_max_size_reports_oom_with_figures() {
    let d = sim(1 << 30);
    let mode = PoolMode::Owned {
        release_threshold: 0,
        reuse: ReuseFlags::default(),
        max_size: 8 * MIB,
        exportable: false,
    };
    let pool = AsyncPool::new(d.clone(), AsyncPoolConfig { mode, ..Default::default() });
    let _x = pool.allocate(6 * MIB).unwrap();
    match pool.allocate(4 * MIB) {
        Err(Error::OutOfMemory(r)) => {
            assert_eq!((r.requested, r.allocated, r.reserved), (4 * MIB, 6 * MIB, 6 * MIB));
            assert!(r.hint.contains("max_size"), "{r}");
            assert!(r.device_total > 0);
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    assert_eq!(pool.stats().failures, 1);
}

/// A request beyond the device's memory is not retried (no stream is ordered after the
/// pending frees), says why, and leaves the pool trimmed to its floor.
#[test]
fn a_request_beyond_the_device_is_not_retried() {
    let d = sim(1 << 30);
    let pool = AsyncPool::new(d.clone(), AsyncPoolConfig::default());
    let s = d.create_stream().unwrap();
    drop(pool.allocate_on(64 * MIB, s).unwrap());
    let calls = d.calls();
    match pool.allocate_on(2 << 30, s) {
        Err(Error::OutOfMemory(r)) => {
            assert!(r.exceeds_device() && r.hint.contains("more than the device's"), "{r}");
            assert_eq!(r.requested, 2 << 30);
        }
        other => panic!("expected out of memory, got {:?}", other.map(|a| a.size())),
    }
    // The failed allocation, the trim after it, and the figures' queries: no second attempt.
    let made = d.calls() - calls;
    assert_eq!(pool.stats().retries, 0);
    assert_eq!(pool.stats().reserved, 0, "the pool kept its cache after the failure");
    assert!(made <= 6, "{made} device calls");
}

#[test]
fn view_pool_is_never_destroyed() {
    let d = sim(1 << 30);
    let theirs = d.create_pool(PoolProps::default()).unwrap();
    let pool =
        AsyncPool::new(d.clone(), AsyncPoolConfig { mode: PoolMode::View(theirs), ..Default::default() });
    drop(pool.allocate(MIB).unwrap());
    drop(pool);
    d.destroy_pool(theirs).expect("still alive after the view is dropped");
}

/// Makes `waiter` wait for the work enqueued so far on `stream` (in a capture: forks or joins
/// `waiter` into it).
fn order_after(d: &SimDevice, waiter: Stream, stream: Stream) {
    let event = d.create_event().unwrap();
    d.record_event(event, stream).unwrap();
    d.stream_wait_event(waiter, event).unwrap();
}

fn capture_setup() -> (Arc<SimDevice>, AsyncPool, Stream) {
    let d = sim(1 << 30);
    let pool = AsyncPool::new(d.clone(), AsyncPoolConfig::default());
    let s = d.create_stream().unwrap();
    (d, pool, s)
}

#[test]
fn capture_case1_allocated_and_freed_inside() {
    let (d, pool, s) = capture_setup();
    let cap = pool.begin_capture(s).unwrap();
    let x = pool.allocate_on(4 * MIB, s).unwrap();
    d.memset_async(x.ptr(), 1, x.size(), s).unwrap();
    drop(x);
    let g = cap.end().unwrap();
    let before = d.stream_ready_at(s).unwrap();
    g.launch(s).unwrap();
    g.launch(s).unwrap();
    assert!(d.stream_ready_at(s).unwrap() > before, "the graph's memset ran");
    g.destroy().unwrap();
    assert_eq!(used(&d, &pool), 0, "the graph's memory is back in the pool");
    assert_eq!(pool.stats().allocated, 0);
    pool.allocate_on(MIB, s).expect("no error was kept");
}

#[test]
fn capture_case1_recorded_stream_in_the_capture_is_joined_back() {
    let (d, pool, s) = capture_setup();
    let t = d.create_stream().unwrap();
    let cap = pool.begin_capture(s).unwrap();
    let mut x = pool.allocate_on(MIB, s).unwrap();
    // Fork t into the capture, let it use x, and free x with t recorded: the free goes to the
    // capture's own free stream, which `end` must join back (the simulator fails an unjoined
    // capture, as the driver does).
    order_after(&d, t, s);
    d.memset_async(x.ptr(), 2, x.size(), t).unwrap();
    x.record_stream(t);
    drop(x);
    order_after(&d, s, t);
    let g = cap.end().expect("capture ends joined");
    g.launch(s).unwrap();
    g.destroy().unwrap();
    assert_eq!(used(&d, &pool), 0);
    pool.allocate_on(MIB, s).expect("no error was kept");
}

#[test]
fn capture_case2_allocated_inside_freed_outside() {
    let (d, pool, s) = capture_setup();
    let cap = pool.begin_capture(s).unwrap();
    let x = pool.allocate_on(4 * MIB, s).unwrap();
    d.memset_async(x.ptr(), 3, x.size(), s).unwrap();
    let g = cap.end().unwrap();
    // Dropped outside the capture: the graph owns it (the simulator rejects a free of graph
    // memory before a launch, as the driver does).
    drop(x);
    assert_eq!(used(&d, &pool), 4 * MIB as u64);
    g.launch(s).unwrap();
    g.launch(s).expect("auto-free-on-launch allows relaunching");
    g.destroy().unwrap();
    assert_eq!(used(&d, &pool), 0);
    pool.allocate_on(MIB, s).expect("no error was kept");

    // Never launched: nothing to free.
    let cap = pool.begin_capture(s).unwrap();
    let x = pool.allocate_on(4 * MIB, s).unwrap();
    let g = cap.end().unwrap();
    drop(x);
    drop(g);
    assert_eq!(used(&d, &pool), 0);

    // Still alive when the graph is destroyed: stays valid, freed after the launch on drop.
    let cap = pool.begin_capture(s).unwrap();
    let x = pool.allocate_on(4 * MIB, s).unwrap();
    let g = cap.end().unwrap();
    g.launch(s).unwrap();
    g.destroy().unwrap();
    assert_eq!(used(&d, &pool), 4 * MIB as u64);
    drop(x);
    assert_eq!(used(&d, &pool), 0);
    pool.allocate_on(MIB, s).expect("no error was kept");
    assert!(d.violations().is_empty());
}

#[test]
fn capture_case3_allocated_outside_freed_inside_is_deferred() {
    let (d, pool, s) = capture_setup();
    let x = pool.allocate_on(4 * MIB, s).unwrap();
    let cap = pool.begin_capture(s).unwrap();
    d.memset_async(x.ptr(), 4, x.size(), s).unwrap();
    drop(x);
    assert_eq!(used(&d, &pool), 4 * MIB as u64, "not freed during the capture");
    let g = cap.end().unwrap();
    assert_eq!(used(&d, &pool), 0, "freed when the capture ended");
    g.launch(s).unwrap();
    g.launch(s).expect("no free node in the graph");
    g.destroy().unwrap();
    pool.allocate_on(MIB, s).expect("no error was kept");
}

#[test]
fn capture_case4_both_outside_and_dropped_capture() {
    let (d, pool, s) = capture_setup();
    let x = pool.allocate_on(MIB, s).unwrap();
    drop(x);
    // A capture dropped without `end` is ended and thrown away.
    let cap = pool.begin_capture(s).unwrap();
    let y = pool.allocate_on(MIB, s).unwrap();
    drop(cap);
    drop(y);
    assert_eq!(d.capture_status(s).unwrap(), CaptureStatus::None);
    assert_eq!(used(&d, &pool), 0);
    pool.allocate_on(MIB, s).expect("no error was kept");
}

#[test]
fn capture_begun_elsewhere_is_refused_while_the_pool_captures() {
    let (d, pool, s) = capture_setup();
    pool.allocate_on(MIB, s).unwrap();
    let own = pool.begin_capture(d.create_stream().unwrap()).unwrap();
    d.begin_capture(s).unwrap();
    assert!(matches!(pool.allocate_on(MIB, s), Err(Error::Unsupported(_))));
    d.end_capture(s).unwrap();
    drop(own);
}

#[test]
fn capture_begun_elsewhere_gets_the_drivers_captured_nodes_otherwise() {
    let (d, pool, s) = capture_setup();
    d.begin_capture(s).unwrap();
    // Not asked about: a captured allocation and a captured free, as the driver makes them.
    let x = pool.allocate_on(4 * MIB, s).unwrap();
    d.memset_async(x.ptr(), 1, x.size(), s).unwrap();
    drop(x);
    let graph = d.end_capture(s).unwrap();
    let exec = d.instantiate_graph(graph).unwrap();
    d.launch_graph(exec, s).unwrap();
    d.synchronize_stream(s).unwrap();
    d.destroy_graph_exec(exec).unwrap();
    d.destroy_graph(graph).unwrap();
    assert_eq!(used(&d, &pool), 0, "the graph freed what it allocated");
    assert!(d.violations().is_empty());
    let s2 = pool.stats();
    assert_eq!((s2.allocated, s2.live_allocations), (0, 0));
    pool.allocate_on(MIB, s).expect("no error was kept");
}

#[test]
fn capture_begun_elsewhere_a_recorded_free_inside_keeps_the_capture_joined() {
    // torch.cuda.graph over the C ABI: the capture is not this allocator's. A tensor made in
    // it is used by a side stream of the capture, recorded, and freed: the free must not pull
    // the pool's free stream into the capture (ending it would fail: unjoined work).
    let (d, pool, s) = capture_setup();
    let t = d.create_stream().unwrap();
    drop(pool.allocate_on(MIB, s).unwrap());
    d.begin_capture(s).unwrap();
    order_after(&d, t, s);
    let mut x = pool.allocate_on(4 * MIB, s).unwrap();
    d.memset_async(x.ptr(), 2, x.size(), t).unwrap();
    x.record_stream(t);
    drop(x);
    order_after(&d, s, t);
    let graph = d.end_capture(s).expect("capture ends joined");
    let exec = d.instantiate_graph(graph).unwrap();
    d.launch_graph(exec, s).unwrap();
    d.launch_graph(exec, s).unwrap();
    d.synchronize_stream(s).unwrap();
    d.destroy_graph_exec(exec).unwrap();
    d.destroy_graph(graph).unwrap();
    assert_eq!(used(&d, &pool), 0, "the graph freed what it allocated");
    assert!(d.violations().is_empty(), "{:?}", d.violations());
    pool.allocate_on(MIB, s).expect("no error was kept");
}

#[test]
fn no_trim_or_throttle_during_capture() {
    let (_d, pool, s) = capture_setup();
    drop(pool.allocate_on(MIB, s).unwrap());
    let cap = pool.begin_capture(s).unwrap();
    assert_eq!(pool.release().unwrap(), 0);
    drop(cap);
}
