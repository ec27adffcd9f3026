//! `AsyncPool` on a CUDA GPU: cross-stream safety with `record_stream` (and the control that
//! shows the test can fail), the four graph-capture cases with data checks, and graphs
//! sharing one pool. Every test is `#[ignore]`d: scripts/gpu-test.sh runs them with
//! `--ignored`. Waits are bounded: a stream blocked by a host function is released after at
//! most [`BLOCK_LIMIT`].

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod conformance;
mod gpu_common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use conformance::ByPointer;
use gpu_common::{all, block_stream, gpu};
use streamalloc::adaptors::Pointers;
use streamalloc::allocators::{AsyncPool, AsyncPoolConfig, PoolMode, ReuseFlags};
use streamalloc::device::DeviceTestExt;
use streamalloc::{Allocator, DevicePtr, Stream, StreamAllocator};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// An owned pool that keeps its memory, so that reuse is visible by address.
fn owned_pool(device: &Arc<dyn DeviceTestExt>) -> AsyncPool {
    let mode = PoolMode::Owned {
        release_threshold: usize::MAX,
        reuse: ReuseFlags::default(),
        max_size: 0,
        exportable: false,
    };
    AsyncPool::new(device.clone(), AsyncPoolConfig { mode, ..AsyncPoolConfig::default() })
}

fn read(device: &Arc<dyn DeviceTestExt>, ptr: DevicePtr, len: usize, stream: Stream) -> Vec<u8> {
    let mut host = vec![0u8; len];
    device.copy_to_host(&mut host, ptr, stream).expect("copy to host");
    host
}

/// Stream B is blocked; B's pending work (a write of 0xBB, enqueued before the free) uses a
/// buffer of stream A, which is then freed; A allocates the same size and writes 0xCC, and B
/// is released. Returns (whether A got the same address, the new buffer's bytes). With
/// `by_pointer`, through the pool's pointer bookkeeping (the C ABI's path).
fn delayed_user_then_reuse(record: bool, by_pointer: bool) -> (bool, Vec<u8>) {
    let device = gpu();
    let owned = Arc::new(owned_pool(&device));
    let wrapped = ByPointer::new(owned.clone(), device.clone());
    let pool: &dyn StreamAllocator = if by_pointer { &wrapped } else { owned.as_ref() };
    let (a, b) = (device.create_stream().unwrap(), device.create_stream().unwrap());
    const N: usize = 64 * MIB;
    let mut x = pool.allocate_on(N, a).unwrap();
    device.memset_async(x.ptr(), 0xAA, N, a).unwrap();
    device.synchronize_stream(a).unwrap();
    let go = block_stream(&device, b);
    device.memset_async(x.ptr(), 0xBB, N, b).unwrap();
    if record {
        x.record_stream(b);
    }
    let first = x.ptr();
    drop(x);
    let y = pool.allocate_on(N, a).unwrap();
    device.memset_async(y.ptr(), 0xCC, N, a).unwrap();
    // Give A's write time to run if nothing holds it back (bounded), then release B.
    let done = device.create_event().unwrap();
    device.record_event(done, a).unwrap();
    let start = Instant::now();
    while !device.query_event(done).unwrap() && start.elapsed() < Duration::from_millis(500) {
        std::thread::sleep(Duration::from_millis(1));
    }
    go.store(true, Ordering::Release);
    device.synchronize_stream(b).unwrap();
    let bytes = read(&device, y.ptr(), N, a);
    let same = y.ptr() == first;
    drop(y);
    device.synchronize_stream(a).unwrap();
    device.destroy_event(done).unwrap();
    drop((wrapped, owned));
    device.destroy_stream(a).unwrap();
    device.destroy_stream(b).unwrap();
    (same, bytes)
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn record_stream_prevents_early_reuse() {
    for by_pointer in [false, true] {
        let (same, bytes) = delayed_user_then_reuse(true, by_pointer);
        assert!(
            all(&bytes, 0xCC),
            "B's delayed write landed in A's new allocation (same address: {same}, by pointer: {by_pointer})"
        );
    }
}

/// The control: without `record_stream`, the pool hands the memory to A at once, B's delayed
/// write lands in A's new allocation, and the check above would fail.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn without_record_stream_memory_is_reused_early() {
    for by_pointer in [false, true] {
        let (same, bytes) = delayed_user_then_reuse(false, by_pointer);
        assert!(same, "the pool did not reuse the block at once (by pointer: {by_pointer})");
        assert!(
            all(&bytes, 0xBB),
            "expected B's late write to show the early reuse (by pointer: {by_pointer})"
        );
    }
}

fn graph_setup() -> (Arc<dyn DeviceTestExt>, AsyncPool, Stream) {
    let device = gpu();
    let pool = owned_pool(&device);
    let s = device.create_stream().unwrap();
    (device, pool, s)
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn graph_case1_allocated_and_freed_inside() {
    let (device, pool, s) = graph_setup();
    let out = pool.allocate_on(MIB, s).unwrap();
    device.memset_async(out.ptr(), 0, MIB, s).unwrap();
    let cap = pool.begin_capture(s).unwrap();
    let tmp = pool.allocate_on(16 * MIB, s).unwrap();
    device.memset_async(tmp.ptr(), 0x11, 16 * MIB, s).unwrap();
    device.memset_async(out.ptr(), 0x22, MIB, s).unwrap();
    drop(tmp);
    let g = cap.end().unwrap();
    for _ in 0..3 {
        g.launch(s).unwrap();
    }
    assert!(all(&read(&device, out.ptr(), MIB, s), 0x22));
    g.destroy().unwrap();
    drop(out);
    pool.allocate_on(MIB, s).expect("no error kept");
    device.synchronize_stream(s).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn graph_case2_allocated_inside_freed_outside() {
    let (device, pool, s) = graph_setup();
    let cap = pool.begin_capture(s).unwrap();
    let x = pool.allocate_on(16 * MIB, s).unwrap();
    device.memset_async(x.ptr(), 0x33, 16 * MIB, s).unwrap();
    let g = cap.end().unwrap();
    g.launch(s).unwrap();
    assert!(all(&read(&device, x.ptr(), 16 * MIB, s), 0x33), "graph memory holds the launch's data");
    // Dropped outside: the graph owns it until destroyed; relaunching is allowed.
    let ptr = x.ptr();
    drop(x);
    g.launch(s).expect("auto-free-on-launch allows a relaunch");
    assert!(all(&read(&device, ptr, 16 * MIB, s), 0x33));
    g.destroy().unwrap();
    // A graph never launched: its memory never existed and nothing is freed.
    let cap = pool.begin_capture(s).unwrap();
    let y = pool.allocate_on(16 * MIB, s).unwrap();
    let g = cap.end().unwrap();
    drop(y);
    g.destroy().unwrap();
    pool.allocate_on(MIB, s).expect("no error kept");
    device.synchronize_stream(s).unwrap();
}

/// Case 2 by pointer: graph memory kept by pointer and freed outside the capture belongs to
/// the graph as a handle's does.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn graph_case2_by_pointer() {
    let (device, async_pool, s) = graph_setup();
    let async_pool = Arc::new(async_pool);
    let pool = Pointers::new(async_pool.clone(), device.clone(), Duration::from_secs(10));
    let cap = async_pool.begin_capture(s).unwrap();
    let x = pool.allocate_ptr(16 * MIB, s).unwrap();
    device.memset_async(x, 0x44, 16 * MIB, s).unwrap();
    let g = cap.end().unwrap();
    g.launch(s).unwrap();
    assert!(all(&read(&device, x, 16 * MIB, s), 0x44), "graph memory holds the launch's data");
    assert!(pool.free_ptr(x, s));
    g.launch(s).expect("auto-free-on-launch allows a relaunch");
    assert!(all(&read(&device, x, 16 * MIB, s), 0x44));
    g.destroy().unwrap();
    assert_eq!(pool.stats().live_allocations, 0);
    pool.allocate_ptr(MIB, s).expect("no error kept");
    device.synchronize_stream(s).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn graph_case3_allocated_outside_freed_inside() {
    let (device, pool, s) = graph_setup();
    let out = pool.allocate_on(MIB, s).unwrap();
    let x = pool.allocate_on(16 * MIB, s).unwrap();
    device.memset_async(x.ptr(), 0x44, 16 * MIB, s).unwrap();
    assert!(all(&read(&device, x.ptr(), 16 * MIB, s), 0x44));
    let ptr = x.ptr();
    let cap = pool.begin_capture(s).unwrap();
    device.memset_async(out.ptr(), 0x55, MIB, s).unwrap();
    drop(x); // deferred to the end of the capture
    let g = cap.end().unwrap();
    g.launch(s).unwrap();
    g.launch(s).expect("the graph holds no free node for x");
    assert!(all(&read(&device, out.ptr(), MIB, s), 0x55));
    // x was freed on its stream when the capture ended: the pool hands the block back.
    let again = pool.allocate_on(16 * MIB, s).unwrap();
    assert_eq!(again.ptr(), ptr, "the deferred free happened");
    device.memset_async(again.ptr(), 0x66, 16 * MIB, s).unwrap();
    assert!(all(&read(&device, again.ptr(), 16 * MIB, s), 0x66));
    g.destroy().unwrap();
    pool.allocate_on(MIB, s).expect("no error kept");
    device.synchronize_stream(s).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn graph_case4_both_outside() {
    let (device, pool, s) = graph_setup();
    let x = pool.allocate_on(16 * MIB, s).unwrap();
    let cap = pool.begin_capture(s).unwrap();
    device.memset_async(x.ptr(), 0x77, 16 * MIB, s).unwrap();
    let g = cap.end().unwrap();
    device.memset_async(x.ptr(), 0, 16 * MIB, s).unwrap();
    g.launch(s).unwrap();
    assert!(all(&read(&device, x.ptr(), 16 * MIB, s), 0x77));
    g.destroy().unwrap();
    drop(x);
    pool.allocate_on(MIB, s).expect("no error kept");
    device.synchronize_stream(s).unwrap();
}

/// Eight graphs, each with 1 GiB of temporaries, launched one after another: with one
/// stream-ordered pool the driver shares their memory; with a private 1 GiB buffer per graph
/// it cannot. Prints `GRAPHS_SHARED_POOL ...`.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn graphs_share_one_pool() {
    let device = gpu();
    let s = device.create_stream().unwrap();
    let used = |d: &Arc<dyn DeviceTestExt>| {
        d.synchronize_stream(s).unwrap();
        d.mem_info().unwrap().used()
    };

    // One private 1 GiB reservation per graph.
    let base = used(&device);
    let buffers: Vec<DevicePtr> = (0..8).map(|_| device.alloc(GIB).unwrap()).collect();
    let mut graphs = Vec::new();
    for &b in &buffers {
        device.begin_capture(s).unwrap();
        device.memset_async(b, 1, GIB, s).unwrap();
        let g = device.end_capture(s).unwrap();
        graphs.push((g, device.instantiate_graph(g).unwrap()));
    }
    for &(_, x) in &graphs {
        device.launch_graph(x, s).unwrap();
    }
    let private_used = used(&device) - base;
    for (g, x) in graphs {
        device.destroy_graph_exec(x).unwrap();
        device.destroy_graph(g).unwrap();
    }
    for b in buffers {
        device.free(b).unwrap();
    }

    // One AsyncPool: each graph allocates and frees its temporaries.
    let base = used(&device);
    let pool = AsyncPool::new(device.clone(), AsyncPoolConfig::default());
    let mut graphs = Vec::new();
    for i in 0..8u8 {
        let cap = pool.begin_capture(s).unwrap();
        let tmp = pool.allocate_on(GIB, s).unwrap();
        device.memset_async(tmp.ptr(), i, GIB, s).unwrap();
        drop(tmp);
        graphs.push(cap.end().unwrap());
    }
    for g in &graphs {
        g.launch(s).unwrap();
    }
    let pool_used = used(&device) - base;
    for g in graphs {
        g.destroy().unwrap();
    }
    let ratio = pool_used as f64 / private_used as f64;
    println!(
        "GRAPHS_SHARED_POOL async_pool_used={:.2}GiB private_pools_used={:.2}GiB ratio={ratio:.3}",
        pool_used as f64 / GIB as f64,
        private_used as f64 / GIB as f64
    );
    assert!(private_used >= 8 * GIB, "private pools used {private_used}");
    assert!(ratio < 0.5, "graphs did not share memory: ratio {ratio:.3}");
    assert_eq!(pool.stats().allocated, 0);
    device.destroy_stream(s).unwrap();
}

/// A request the device cannot hold fails with out-of-memory and leaves the pool holding no
/// more than before: the driver's pool may grow while it tries, and is trimmed after.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn a_failed_request_leaves_the_pool_as_it_was() {
    let device = gpu();
    let s = device.create_stream().unwrap();
    let pool = AsyncPool::new(device.clone(), AsyncPoolConfig::default());
    let kept = pool.allocate_on(64 * MIB, s).unwrap();
    let total = device.mem_info().unwrap().total;
    let before = (pool.stats().reserved, device.mem_info().unwrap().free);
    let huge = pool.allocate_on(2 * total, s);
    assert!(
        matches!(&huge, Err(streamalloc::Error::OutOfMemory(_))),
        "expected out-of-memory, got {:?}",
        huge.map(|a| a.size())
    );
    let after = (pool.stats().reserved, device.mem_info().unwrap().free);
    assert!(after.0 <= before.0, "the pool holds {} bytes after the failure, {} before", after.0, before.0);
    assert!(
        after.1 + 64 * MIB >= before.1,
        "the device's free memory fell from {} to {} bytes with the failure",
        before.1,
        after.1
    );
    drop(kept);
    device.synchronize_stream(s).unwrap();
    device.destroy_stream(s).unwrap();
}
