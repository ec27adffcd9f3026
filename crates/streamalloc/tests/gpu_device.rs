//! GPU tests of the CUDA device layer. They are `#[ignore]`d so that CI without a GPU skips
//! them; `scripts/gpu-test.sh` runs them with `--include-ignored` on a GPU machine, where a
//! missing GPU makes every one of them fail (never pass silently).
//!
//! Every wait is bounded: host functions that block a stream give up after [`HOLD_LIMIT`], and
//! polls give up after [`POLL_LIMIT`].

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use streamalloc::device::cuda::{cuda_available, CudaDevice};
use streamalloc::device::{
    CaptureStatus, DeviceMemory, DeviceTestExt, DriverPools, Event, Events, Graphs, PoolAttr, PoolProps,
    Stream, Streams, VirtualMemory,
};
use streamalloc::Error;

/// Longest a test host function keeps its stream blocked.
const HOLD_LIMIT: Duration = Duration::from_secs(10);
/// Longest a test polls for an event.
const POLL_LIMIT: Duration = Duration::from_secs(5);
const MIB: usize = 1 << 20;

fn device() -> Arc<CudaDevice> {
    match CudaDevice::new(0) {
        Ok(d) => d,
        Err(e) => panic!("this test needs a CUDA GPU (device 0): {e}"),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// A gate that blocks a stream: enqueue [`Gate::hold`] on it, then [`Gate::open`].
#[derive(Clone, Default)]
struct Gate {
    open: Arc<AtomicBool>,
    entered: Arc<AtomicBool>,
}

impl Gate {
    /// Enqueues a host function on `s` that returns once the gate opens (or after
    /// [`HOLD_LIMIT`], so a failing test cannot hang).
    fn hold(&self, dev: &CudaDevice, s: Stream) {
        let g = self.clone();
        dev.launch_host_func(
            s,
            Box::new(move || {
                g.entered.store(true, Ordering::SeqCst);
                let start = Instant::now();
                while !g.open.load(Ordering::SeqCst) && start.elapsed() < HOLD_LIMIT {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }),
        )
        .expect("launch_host_func");
    }

    fn open(&self) {
        self.open.store(true, Ordering::SeqCst);
    }

    /// Waits (bounded) until the host function has started running.
    fn wait_entered(&self) {
        let start = Instant::now();
        while !self.entered.load(Ordering::SeqCst) {
            assert!(start.elapsed() < POLL_LIMIT, "host function did not start within {POLL_LIMIT:?}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Polls `e` until it completes; fails the test after [`POLL_LIMIT`].
fn wait_event(dev: &CudaDevice, e: Event) {
    let start = Instant::now();
    while !dev.query_event(e).expect("query_event") {
        assert!(start.elapsed() < POLL_LIMIT, "event did not complete within {POLL_LIMIT:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

// Runs everywhere: without a driver `new` must fail cleanly, not panic.
#[test]
fn new_fails_cleanly_without_a_driver_or_device() {
    if cuda_available() {
        let too_far = CudaDevice::new(1 << 20);
        assert!(matches!(too_far, Err(Error::InvalidArgument(_))), "{too_far:?}");
    } else {
        assert!(matches!(CudaDevice::new(0), Err(Error::NoDriver(_))));
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn mem_info_is_sane() {
    let dev = device();
    assert!(cuda_available());
    let info = dev.mem_info().unwrap();
    assert!(info.total > 0 && info.free > 0 && info.free <= info.total, "{info:?}");
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn plain_alloc_copy_round_trip() {
    let dev = device();
    let s = dev.create_stream().unwrap();
    let len = 3 * MIB + 17;
    let p = dev.alloc(len).unwrap();
    assert_ne!(p, 0);
    let data = pattern(len, 7);
    dev.copy_from_host(p, &data, s).unwrap();
    let mut back = vec![0u8; len];
    dev.copy_to_host(&mut back, p, s).unwrap();
    assert!(back == data, "round trip differs");

    dev.memset_async(p + 1000, 0xEE, 24, s).unwrap();
    dev.copy_to_host(&mut back, p, s).unwrap();
    assert!(back[1000..1024].iter().all(|&b| b == 0xEE));
    assert_eq!(back[..1000], data[..1000]);
    assert_eq!(back[1024..], data[1024..]);

    dev.free(p).unwrap();
    dev.destroy_stream(s).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn calls_work_from_a_thread_without_a_context() {
    let dev = device();
    let d = Arc::clone(&dev);
    std::thread::spawn(move || {
        let p = d.alloc(MIB).unwrap();
        d.memset_async(p, 3, MIB, Stream::DEFAULT).unwrap();
        let mut back = vec![0u8; MIB];
        d.copy_to_host(&mut back, p, Stream::DEFAULT).unwrap();
        assert!(back.iter().all(|&b| b == 3));
        d.free(p).unwrap();
    })
    .join()
    .expect("worker thread failed");
}

/// The calls of the allocation path on an ordinary stream, which bind no context, work as the
/// first calls of a thread with none current, and the memory is usable from another thread.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn stream_calls_work_as_the_first_calls_of_a_thread() {
    let dev = device();
    let s = dev.create_stream().unwrap();
    let pool = dev.default_pool().unwrap();
    let d = Arc::clone(&dev);
    let p = std::thread::spawn(move || {
        assert_eq!(d.capture_status(s).unwrap(), CaptureStatus::None);
        let p = d.alloc_async(MIB, pool, s).unwrap();
        let q = d.alloc_async(MIB, pool, s).unwrap();
        d.free_async(q, s).unwrap();
        p
    })
    .join()
    .expect("worker thread failed");
    let data = pattern(MIB, 5);
    dev.copy_from_host(p, &data, s).unwrap();
    let mut back = vec![0u8; MIB];
    dev.copy_to_host(&mut back, p, s).unwrap();
    assert_eq!(back, data);
    dev.free_async(p, s).unwrap();
    dev.synchronize_stream(s).unwrap();
    dev.destroy_stream(s).unwrap();
}

/// A reservation mapped in two calls holds data across the boundary, takes device memory while
/// mapped and gives it back when unmapped.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn mapped_reservation_round_trip() {
    let dev = device();
    // The facade backs its caching pools with stitched ranges only where this is true.
    assert!(
        dev.supports_virtual_memory().unwrap(),
        "the GPU supports virtual memory management (every GPU since Pascal does on Linux)"
    );
    let s = dev.create_stream().unwrap();
    let g = dev.map_granularity().unwrap();
    assert!(g > 0 && g.is_power_of_two(), "granularity {g}");
    let r = dev.reserve_address(16 * g).unwrap();
    let before = dev.mem_info().unwrap().free;
    dev.map(r, g).unwrap();
    dev.map(r + g as u64, 2 * g).unwrap();
    let used = before - dev.mem_info().unwrap().free;
    assert!(used >= 3 * g, "mapping 3 granules took {used} bytes");
    let data = pattern(2 * g, 9);
    let at = r + (g / 2) as u64;
    dev.copy_from_host(at, &data, s).unwrap();
    let mut back = vec![0u8; 2 * g];
    dev.copy_to_host(&mut back, at, s).unwrap();
    assert_eq!(back, data);
    dev.synchronize_stream(s).unwrap();
    dev.unmap(r, 3 * g).unwrap();
    assert!(dev.mem_info().unwrap().free >= before - g, "unmapping gave the memory back");
    dev.free_address(r, 16 * g).unwrap();
    dev.destroy_stream(s).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn out_of_memory_carries_figures() {
    let dev = device();
    let total = dev.mem_info().unwrap().total;
    let huge = total * 2;
    match dev.alloc(huge) {
        Err(Error::OutOfMemory(oom)) => {
            assert_eq!(oom.requested, huge);
            assert_eq!(oom.device, 0);
            assert_eq!(oom.device_total, total);
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    let s = dev.create_stream().unwrap();
    let pool = dev.default_pool().unwrap();
    assert!(matches!(dev.alloc_async(huge, pool, s), Err(Error::OutOfMemory(_))));
    dev.destroy_stream(s).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn driver_errors_carry_name_and_call() {
    let dev = device();
    let pool = dev.default_pool().unwrap();
    match dev.set_pool_attr(pool, PoolAttr::ReservedMemCurrent, 1) {
        Err(Error::Driver { name, call, code }) => {
            assert_eq!(call, "cuMemPoolSetAttribute");
            assert!(name.starts_with("CUDA_ERROR_"), "{name}");
            assert_ne!(code, 0);
        }
        other => panic!("expected a driver error, got {other:?}"),
    }
}

fn pool_round_trip(dev: &CudaDevice, pool: streamalloc::device::Pool, s: Stream) {
    let len = 5 * MIB + 3;
    let p = dev.alloc_async(len, pool, s).unwrap();
    assert!(dev.pool_attr(pool, PoolAttr::UsedMemCurrent).unwrap() >= len as u64);
    assert!(dev.pool_attr(pool, PoolAttr::ReservedMemCurrent).unwrap() >= len as u64);
    dev.memset_async(p, 0x42, len, s).unwrap();
    dev.memset_async(p + 10, 0x43, 5, s).unwrap();
    let mut back = vec![0u8; len];
    dev.copy_to_host(&mut back, p, s).unwrap();
    assert!(back[..10].iter().all(|&b| b == 0x42));
    assert!(back[10..15].iter().all(|&b| b == 0x43));
    assert!(back[15..].iter().all(|&b| b == 0x42));
    let data = pattern(len, 99);
    dev.copy_from_host(p, &data, s).unwrap();
    dev.copy_to_host(&mut back, p, s).unwrap();
    assert!(back == data, "pool round trip differs");
    dev.free_async(p, s).unwrap();
    dev.synchronize_stream(s).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn async_pool_round_trip() {
    let dev = device();
    let s = dev.create_stream().unwrap();

    let default = dev.default_pool().unwrap();
    assert_eq!(dev.default_pool().unwrap(), default);
    pool_round_trip(&dev, default, s);

    let pool = dev.create_pool(PoolProps { max_size: 64 * MIB, exportable: false }).unwrap();
    assert_ne!(pool, default);
    for attr in [
        PoolAttr::ReleaseThreshold,
        PoolAttr::ReuseFollowEventDependencies,
        PoolAttr::ReuseAllowOpportunistic,
        PoolAttr::ReuseAllowInternalDependencies,
        PoolAttr::ReservedMemCurrent,
        PoolAttr::ReservedMemHigh,
        PoolAttr::UsedMemCurrent,
        PoolAttr::UsedMemHigh,
    ] {
        let v = dev.pool_attr(pool, attr).unwrap();
        if matches!(
            attr,
            PoolAttr::ReuseFollowEventDependencies
                | PoolAttr::ReuseAllowOpportunistic
                | PoolAttr::ReuseAllowInternalDependencies
        ) {
            assert!(v <= 1, "{attr:?} = {v}");
        }
    }
    dev.set_pool_attr(pool, PoolAttr::ReleaseThreshold, 32 * MIB as u64).unwrap();
    assert_eq!(dev.pool_attr(pool, PoolAttr::ReleaseThreshold).unwrap(), 32 * MIB as u64);
    dev.set_pool_attr(pool, PoolAttr::ReuseAllowOpportunistic, 0).unwrap();
    assert_eq!(dev.pool_attr(pool, PoolAttr::ReuseAllowOpportunistic).unwrap(), 0);
    dev.set_pool_attr(pool, PoolAttr::ReuseAllowOpportunistic, 1).unwrap();
    assert_eq!(dev.pool_attr(pool, PoolAttr::ReuseAllowOpportunistic).unwrap(), 1);

    pool_round_trip(&dev, pool, s);
    assert!(dev.pool_attr(pool, PoolAttr::UsedMemHigh).unwrap() >= 5 * MIB as u64);
    assert_eq!(dev.pool_attr(pool, PoolAttr::UsedMemCurrent).unwrap(), 0);
    // The release threshold keeps the freed memory reserved; trimming gives it back.
    assert!(dev.pool_attr(pool, PoolAttr::ReservedMemCurrent).unwrap() > 0);
    dev.trim_pool(pool, 0).unwrap();
    assert_eq!(dev.pool_attr(pool, PoolAttr::ReservedMemCurrent).unwrap(), 0);
    dev.set_pool_attr(pool, PoolAttr::UsedMemHigh, 0).unwrap();

    // max_size bounds the pool: more than 64 MiB cannot come from it.
    assert!(matches!(dev.alloc_async(128 * MIB, pool, s), Err(Error::OutOfMemory(_))));

    dev.destroy_pool(pool).unwrap();
    dev.destroy_stream(s).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn host_function_blocks_its_stream() {
    let dev = device();
    let s = dev.create_stream().unwrap();
    let e = dev.create_event().unwrap();
    let gate = Gate::default();
    gate.hold(&dev, s);
    dev.record_event(e, s).unwrap();
    gate.wait_entered();
    for _ in 0..20 {
        assert!(!dev.query_event(e).unwrap(), "event completed while its stream was blocked");
        std::thread::sleep(Duration::from_millis(2));
    }
    gate.open();
    wait_event(&dev, e);
    dev.synchronize_event(e).unwrap();
    dev.synchronize_stream(s).unwrap();
    dev.destroy_event(e).unwrap();
    dev.destroy_stream(s).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn host_function_panic_does_not_unwind_into_the_driver() {
    let dev = device();
    let s = dev.create_stream().unwrap();
    dev.launch_host_func(s, Box::new(|| panic!("deliberate panic in a host function"))).unwrap();
    let ran = Arc::new(AtomicBool::new(false));
    let r = Arc::clone(&ran);
    dev.launch_host_func(s, Box::new(move || r.store(true, Ordering::SeqCst))).unwrap();
    dev.synchronize_stream(s).unwrap();
    assert!(ran.load(Ordering::SeqCst));
    dev.destroy_stream(s).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn event_ordering_across_streams() {
    let dev = device();
    let (a, b, c) =
        (dev.create_stream().unwrap(), dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let len = MIB;
    let buf = dev.alloc(len).unwrap();
    dev.memset_async(buf, 0, len, c).unwrap();
    dev.synchronize_stream(c).unwrap();

    // A is blocked; B waits on A's event, then writes the buffer.
    let gate = Gate::default();
    gate.hold(&dev, a);
    let on_a = dev.create_event().unwrap();
    dev.record_event(on_a, a).unwrap();
    dev.stream_wait_event(b, on_a).unwrap();
    dev.memset_async(buf, 0xAB, len, b).unwrap();
    let on_b = dev.create_event().unwrap();
    dev.record_event(on_b, b).unwrap();

    gate.wait_entered();
    std::thread::sleep(Duration::from_millis(20));
    assert!(!dev.query_event(on_a).unwrap());
    assert!(!dev.query_event(on_b).unwrap(), "B ran past its wait on blocked A");
    let mut back = vec![0xFFu8; len];
    dev.copy_to_host(&mut back, buf, c).unwrap();
    assert!(back.iter().all(|&x| x == 0), "B's memset ran before A was released");

    gate.open();
    wait_event(&dev, on_a);
    wait_event(&dev, on_b);
    dev.synchronize_event(on_b).unwrap();
    dev.copy_to_host(&mut back, buf, c).unwrap();
    assert!(back.iter().all(|&x| x == 0xAB), "B's memset missing after release");

    dev.free(buf).unwrap();
    for e in [on_a, on_b] {
        dev.destroy_event(e).unwrap();
    }
    for s in [a, b, c] {
        dev.destroy_stream(s).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn capture_status_is_active_during_capture() {
    let dev = device();
    let s = dev.create_stream().unwrap();
    assert_eq!(dev.capture_status(s).unwrap(), CaptureStatus::None);
    dev.begin_capture(s).unwrap();
    assert_eq!(dev.capture_status(s).unwrap(), CaptureStatus::Active);
    // Copies from or to host memory are refused while capturing, not captured.
    let mut host = [0u8; 4];
    assert!(matches!(dev.copy_to_host(&mut host, 0, s), Err(Error::Unsupported(_))));
    let graph = dev.end_capture(s).unwrap();
    assert_eq!(dev.capture_status(s).unwrap(), CaptureStatus::None);
    dev.destroy_graph(graph).unwrap();
    dev.destroy_stream(s).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn checking_a_capturing_stream_keeps_the_capture_valid() {
    // PyTorch's record_stream on a side stream of torch.cuda.graph: the side stream joined
    // the capture, and checking it (cuStreamGetFlags before) invalidated the capture.
    let dev = device();
    let (s, side) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let (fork, join) = (dev.create_event().unwrap(), dev.create_event().unwrap());
    let out = dev.alloc(MIB).unwrap();
    dev.begin_capture(s).unwrap();
    dev.record_event(fork, s).unwrap();
    dev.stream_wait_event(side, fork).unwrap();
    assert_eq!(dev.capture_status(side).unwrap(), CaptureStatus::Active);
    dev.check_stream(side).expect("a capturing stream is live");
    dev.check_stream(s).expect("the origin of a capture is live");
    dev.memset_async(out, 0x3C, MIB, side).unwrap();
    dev.record_event(join, side).unwrap();
    dev.stream_wait_event(s, join).unwrap();
    assert_eq!(dev.capture_status(s).unwrap(), CaptureStatus::Active, "the capture was invalidated");
    let graph = dev.end_capture(s).expect("the capture ends valid");
    let exec = dev.instantiate_graph(graph).unwrap();
    dev.launch_graph(exec, s).unwrap();
    let mut back = vec![0u8; MIB];
    dev.copy_to_host(&mut back, out, s).unwrap();
    assert!(back.iter().all(|&x| x == 0x3C), "the side stream's captured memset did not run");
    dev.destroy_graph_exec(exec).unwrap();
    dev.destroy_graph(graph).unwrap();
    dev.free(out).unwrap();
    for e in [fork, join] {
        dev.destroy_event(e).unwrap();
    }
    for x in [s, side] {
        dev.destroy_stream(x).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn graph_capture_of_memset_and_pool_alloc() {
    let dev = device();
    let s = dev.create_stream().unwrap();
    let pool = dev.default_pool().unwrap();
    let len = 2 * MIB;
    let out = dev.alloc(len).unwrap();
    dev.memset_async(out, 0, len, s).unwrap();
    dev.synchronize_stream(s).unwrap();

    dev.begin_capture(s).unwrap();
    assert_eq!(dev.capture_status(s).unwrap(), CaptureStatus::Active);
    let tmp = dev.alloc_async(len, pool, s).unwrap();
    dev.memset_async(tmp, 0x11, len, s).unwrap();
    dev.memset_async(out, 0x5A, len, s).unwrap();
    dev.free_async(tmp, s).unwrap();
    let graph = dev.end_capture(s).unwrap();
    assert_eq!(dev.capture_status(s).unwrap(), CaptureStatus::None);

    // Nothing ran during capture.
    let mut back = vec![0xFFu8; len];
    dev.copy_to_host(&mut back, out, s).unwrap();
    assert!(back.iter().all(|&x| x == 0), "captured work ran before launch");

    let exec = dev.instantiate_graph(graph).unwrap();
    for round in 0..2 {
        dev.memset_async(out, 0, len, s).unwrap();
        dev.launch_graph(exec, s).unwrap();
        let done = dev.create_event().unwrap();
        dev.record_event(done, s).unwrap();
        wait_event(&dev, done);
        dev.destroy_event(done).unwrap();
        dev.copy_to_host(&mut back, out, s).unwrap();
        assert!(back.iter().all(|&x| x == 0x5A), "graph launch {round} did not write");
    }
    dev.synchronize_stream(s).unwrap();
    dev.destroy_graph_exec(exec).unwrap();
    dev.destroy_graph(graph).unwrap();
    dev.free(out).unwrap();
    dev.destroy_stream(s).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn auto_free_graph_relaunches_with_memory_left_allocated() {
    let dev = device();
    let s = dev.create_stream().unwrap();
    let pool = dev.default_pool().unwrap();
    let len = MIB;
    dev.begin_capture(s).unwrap();
    let tmp = dev.alloc_async(len, pool, s).unwrap();
    dev.memset_async(tmp, 0x77, len, s).unwrap();
    let graph = dev.end_capture(s).unwrap();

    let exec = dev.instantiate_graph_auto_free(graph).unwrap();
    let mut back = vec![0u8; len];
    for round in 0..3 {
        dev.launch_graph(exec, s).unwrap();
        // The graph's allocation outlives the launch, at the address seen during capture.
        dev.copy_to_host(&mut back, tmp, s).unwrap();
        assert!(back.iter().all(|&x| x == 0x77), "launch {round} did not write");
    }
    dev.free_async(tmp, s).unwrap();
    dev.synchronize_stream(s).unwrap();
    dev.destroy_graph_exec(exec).unwrap();
    dev.destroy_graph(graph).unwrap();
    dev.destroy_stream(s).unwrap();
}

/// A stream held by a gate: a bounded wait for an event behind it gives up at its bound and
/// says so; once the gate opens the event is waited for. `check_stream` accepts live streams
/// and refuses a destroyed one.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn bounded_event_wait_and_stream_check() {
    let dev = device();
    let s = dev.create_stream().unwrap();
    let gate = Gate::default();
    gate.hold(&dev, s);
    gate.wait_entered();
    let e = dev.create_event().unwrap();
    dev.record_event(e, s).unwrap();
    let start = Instant::now();
    assert!(!dev.wait_event(e, Duration::from_millis(50)).unwrap(), "the gate still holds the stream");
    let waited = start.elapsed();
    assert!(waited >= Duration::from_millis(50) && waited < Duration::from_secs(2), "waited {waited:?}");
    gate.open();
    assert!(dev.wait_event(e, POLL_LIMIT).unwrap());
    dev.check_stream(s).expect("a live stream");
    dev.check_stream(Stream::DEFAULT).expect("the legacy default stream");
    dev.destroy_event(e).unwrap();
    dev.destroy_stream(s).unwrap();
    // A destroyed stream's handle is undefined behaviour in the driver (this check once
    // crashed the process here); the simulator's tests check that it is refused.
}

/// Issue 52, #18: `Events::wait_event`'s default body computed `Instant::now() + timeout`,
/// which panicked for a timeout past the clock (`wait_timeout=10000000000000000000s`); it
/// now waits without a deadline there, and a zero timeout on work still running says so.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn wait_event_takes_any_timeout() {
    let dev = device();
    let s = dev.create_stream().unwrap();
    let e = dev.create_event().unwrap();
    let gate = Gate::default();
    gate.hold(&dev, s);
    dev.record_event(e, s).unwrap();
    gate.wait_entered();
    assert!(!dev.wait_event(e, Duration::ZERO).unwrap(), "the stream is held");
    gate.open();
    assert!(dev.wait_event(e, Duration::MAX).unwrap());
    assert!(dev.wait_event(e, Duration::from_secs(u64::MAX)).unwrap());
    dev.destroy_event(e).unwrap();
    dev.destroy_stream(s).unwrap();
}
