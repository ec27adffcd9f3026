//! Findings of the adversarial run (issue 16) on the simulator: errors at the call that caused
//! them, bounded waits on the allocation path, failures counted once.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use streamalloc::adaptors::{Limit, Retry, SingleStream};
use streamalloc::allocators::{BackingKind, BestFit, BestFitConfig, Plain, StreamSafe, StreamSafeConfig};
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::device::{DeviceMemory, DriverPools, Streams};
use streamalloc::facade::{Config, Facade};
use streamalloc::{Allocator, Error, Stream, StreamAllocator};

const MIB: usize = 1 << 20;

fn sim(capacity: usize) -> Arc<SimDevice> {
    SimDevice::new(SimConfig::with_capacity(capacity))
}

/// A free whose recorded stream is gone cannot record its event: the error is held back, and
/// the next, unrelated allocation does not fail with it. `release` reports it, once.
#[test]
fn an_error_held_back_by_a_free_does_not_fail_a_later_allocation() {
    let sim = sim(1 << 30);
    let pool = BestFit::new(sim.clone(), BestFitConfig::default()).unwrap();
    let side = sim.create_stream().unwrap();
    let mut a = pool.allocate(4096).unwrap();
    a.record_stream(side);
    sim.destroy_stream(side).unwrap();
    drop(a);
    pool.allocate(4096).expect("an unrelated allocation succeeds");
    let e = pool.release().expect_err("release reports the held-back error");
    assert!(e.to_string().contains("unknown or destroyed stream"), "{e}");
    pool.release().expect("reported once");
}

/// Another stream's out-of-memory releases every pool's free chunks; that must not swallow
/// the error a pool holds back.
#[test]
fn an_out_of_memory_on_another_stream_does_not_drop_a_held_back_error() {
    let sim = sim(256 * MIB);
    let ss = StreamSafe::new(sim.clone(), StreamSafeConfig::default()).unwrap();
    let (a, b, side) =
        (sim.create_stream().unwrap(), sim.create_stream().unwrap(), sim.create_stream().unwrap());
    let mut x = ss.allocate_on(4096, a).unwrap();
    x.record_stream(side);
    sim.destroy_stream(side).unwrap();
    drop(x);
    assert!(ss.allocate_on(1 << 40, b).unwrap_err().is_out_of_memory());
    let e = ss.release().expect_err("the held-back error is still reported");
    assert!(e.to_string().contains("unknown or destroyed stream"), "{e}");
}

/// An out-of-memory on stream `a` while a 10-second kernel on stream `b` still uses memory
/// `b`'s pool holds returns within the wait bound, saying what it waited for.
#[test]
fn an_out_of_memory_does_not_wait_for_a_long_kernel_on_another_stream() {
    let sim = sim(256 * MIB);
    let ss = StreamSafe::new(sim.clone(), StreamSafeConfig::default()).unwrap();
    let (a, b) = (sim.create_stream().unwrap(), sim.create_stream().unwrap());
    let x = ss.allocate_on(200 * MIB, b).unwrap();
    sim.use_range(x.ptr(), x.size(), b, 10_000_000_000).unwrap();
    drop(x);
    let start = sim.now();
    let result = ss.allocate_on(200 * MIB, a);
    let waited = Duration::from_nanos(sim.now() - start);
    assert!(waited <= Duration::from_millis(2100), "the allocation waited {waited:?} (virtual)");
    let e = result.expect_err("the memory is still in use on stream b");
    eprintln!("{e}");
    assert!(e.is_out_of_memory(), "{e}");
    assert!(e.to_string().contains("waited"), "{e}");
    assert!(sim.violations().is_empty());
}

/// Each failed allocation counts once in `failures`, whatever the stack.
#[test]
fn failures_are_counted_once_per_failed_allocation() {
    let dev = sim(256 * MIB);
    let ss = StreamSafe::new(dev.clone(), StreamSafeConfig::default()).unwrap();
    ss.allocate(1 << 40).unwrap_err();
    assert_eq!(ss.stats().failures, 1, "stream_safe");

    let limited = Limit::new(StreamSafe::new(dev.clone(), StreamSafeConfig::default()).unwrap(), MIB);
    limited.allocate(2 * MIB).unwrap_err();
    assert_eq!(limited.stats().failures, 1, "a refusal under limit");

    let retried =
        Retry::new(BestFit::new(dev.clone(), BestFitConfig::default()).unwrap(), Duration::from_millis(20));
    retried.allocate(1 << 40).unwrap_err();
    assert_eq!(retried.stats().failures, 1, "retry");

    let single = SingleStream::new(Plain::new(dev.clone(), Stream::DEFAULT), dev.clone(), Stream::DEFAULT);
    let gone = dev.create_stream().unwrap();
    dev.destroy_stream(gone).unwrap();
    single.allocate_on(4096, gone).unwrap_err();
    assert_eq!(single.stats().failures, 1, "plain, failing in the wrapping step");
    assert_eq!(single.stats().allocated, 0);

    for strategy in ["plain", "best_fit", "stream_safe", "async"] {
        for layers in ["", ",retry_timeout=5ms", ",stats=true", ",limit=128MiB", ",trace=/dev/null"] {
            let conf = format!("device=sim,sim_capacity=256MiB,strategy={strategy}{layers}");
            let f = Facade::new(Config::parse(&conf).unwrap());
            f.allocate(300 * MIB, 0, Stream::DEFAULT).unwrap_err();
            assert_eq!(f.stats(0).failures, 1, "{conf}");
            let pointers = &f.stack(0).unwrap().allocator;
            pointers.allocate_ptr(300 * MIB, Stream::DEFAULT).unwrap_err();
            assert_eq!(f.stats(0).failures, 2, "{conf}, by pointer");
        }
    }
    // Tried again, in its tag's pool or the strategy's, after the others gave memory back.
    let f = Facade::new(Config::parse("device=sim,sim_capacity=256MiB").unwrap());
    {
        let _kv = streamalloc::tags::scope("kv").unwrap();
        f.allocate(300 * MIB, 0, Stream::DEFAULT).unwrap_err();
    }
    assert_eq!(f.stats(0).failures, 1, "a tagged allocation");
    f.allocate(300 * MIB, 0, Stream::DEFAULT).unwrap_err();
    assert_eq!(f.stats(0).failures, 2, "an untagged allocation beside a tag");
}

/// Dropping a stack frees what it still keeps by pointer, whatever its layers: the simulated
/// device's memory is all back.
#[test]
fn dropping_any_stack_frees_what_it_keeps_by_pointer() {
    for strategy in ["plain", "best_fit", "stream_safe", "async"] {
        for layers in ["", ",backing=chunks", ",retry_timeout=5ms,stats=true,limit=0.5,trace=/dev/null"] {
            if (strategy == "plain" || strategy == "async") && layers.contains("backing") {
                continue;
            }
            let conf = format!("device=sim,sim_capacity=1GiB,strategy={strategy}{layers}");
            let f = Facade::new(Config::parse(&conf).unwrap());
            let stack = f.stack(0).unwrap();
            let sim = stack.sim.clone().expect("a simulated device");
            let side = sim.create_stream().unwrap();
            for (i, size) in [4096, 3 * MIB, 40 * MIB].into_iter().enumerate() {
                let p =
                    stack.allocator.allocate_ptr(size, if i == 1 { side } else { Stream::DEFAULT }).unwrap();
                assert!(stack.allocator.record_stream_ptr(p, side).unwrap(), "{conf}");
            }
            assert_eq!(f.stats(0).live_allocations, 3, "{conf}");
            drop(f);
            sim.synchronize_stream(side).unwrap();
            sim.trim_pool(sim.default_pool().unwrap(), 0).unwrap();
            assert_eq!(sim.mem_info().unwrap().used(), 0, "{conf}: memory left after the stack was dropped");
        }
    }
}

/// `retries` counts the allocations that succeeded only after the allocator gave memory back
/// and tried again, once each, and such an allocation is no failure.
#[test]
fn retries_are_counted_once() {
    let dev = sim(64 * MIB);
    let pool =
        BestFit::new(dev.clone(), BestFitConfig { growth: 20 * MIB, ..BestFitConfig::default() }).unwrap();
    drop(pool.allocate(30 * MIB).unwrap());
    let _big = pool.allocate(40 * MIB).expect("fits once the free chunk went back");
    let s = pool.stats();
    assert_eq!((s.retries, s.failures), (1, 0), "best_fit");

    let dev = sim(64 * MIB);
    let ss = StreamSafe::new(dev.clone(), StreamSafeConfig::default()).unwrap();
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    drop(ss.allocate_on(30 * MIB, a).unwrap());
    let _big = ss.allocate_on(40 * MIB, b).expect("fits once stream a's pool gave its chunk back");
    let s = ss.stats();
    assert_eq!((s.retries, s.failures), (1, 0), "stream_safe");

    let f = Arc::new(Facade::new(
        Config::parse("device=sim,sim_capacity=64MiB,strategy=plain,retry_timeout=2s").unwrap(),
    ));
    let held = f.allocate(40 * MIB, 0, Stream::DEFAULT).unwrap();
    let freer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        drop(held);
    });
    let got = f.allocate(40 * MIB, 0, Stream::DEFAULT);
    freer.join().unwrap();
    assert!(got.is_ok(), "{got:?}");
    let s = f.stats(0);
    assert_eq!((s.retries, s.failures), (1, 0), "plain under retry");
}

/// `reset_peak_stats` restarts both peaks from the current figures, on every stack.
#[test]
fn peaks_reset_on_every_stack() {
    for strategy in ["plain", "best_fit", "stream_safe", "async"] {
        for layers in ["", ",backing=chunks", ",retry_timeout=5ms,stats=true,limit=0.9,trace=/dev/null"] {
            if layers.contains("backing") && !["best_fit", "stream_safe"].contains(&strategy) {
                continue; // a key only the caching pools take
            }
            let conf = format!("device=sim,sim_capacity=1GiB,strategy={strategy}{layers}");
            let f = Facade::new(Config::parse(&conf).unwrap());
            let keep = f.allocate(MIB, 0, Stream::DEFAULT).unwrap();
            drop(f.allocate(100 * MIB, 0, Stream::DEFAULT).unwrap());
            f.release_all().unwrap();
            let s = f.stats(0);
            assert!(s.allocated_peak > s.allocated && s.reserved_peak > s.reserved, "{conf}: {s:?}");
            f.allocator(0).unwrap().reset_peak_stats();
            let s = f.stats(0);
            assert_eq!((s.allocated_peak, s.reserved_peak), (s.allocated, s.reserved), "{conf}");
            if let Some(stats) = &f.stack(0).unwrap().stats {
                assert_eq!(stats.totals().peak, MIB, "{conf}: the stats layer's peak too");
            }
            drop(keep);
        }
    }
}

const BACKINGS: [BackingKind; 3] = [BackingKind::CHUNKS, BackingKind::SEGMENTS, BackingKind::STITCHED];

/// A pool over `backing` on a stream of its own of `sim`, waiting at most 100 ms.
fn pool_on_own_stream(sim: &Arc<SimDevice>, backing: BackingKind) -> (BestFit, Stream) {
    let stream = sim.create_stream().unwrap();
    let config = BestFitConfig {
        growth: 20 * MIB,
        stream,
        backing,
        wait_timeout: Duration::from_millis(100),
        ..BestFitConfig::default()
    };
    (BestFit::new(sim.clone(), config).unwrap(), stream)
}

/// Virtual time that passes on `sim` during `f`.
fn timed<T>(sim: &SimDevice, f: impl FnOnce() -> T) -> (T, Duration) {
    let start = sim.now();
    let out = f();
    (out, Duration::from_nanos(sim.now() - start))
}

/// Every backing's release waits for the pool's stream at most `wait_timeout`: past it,
/// nothing goes back and the error says what was waited for; once the work is done, the
/// memory goes back.
#[test]
fn a_release_waits_with_a_bound_on_every_backing() {
    for backing in BACKINGS {
        let sim = sim(1 << 30);
        let (pool, s) = pool_on_own_stream(&sim, backing);
        let a = pool.allocate(6 * MIB).unwrap();
        sim.use_range(a.ptr(), a.size(), s, 10_000_000_000).unwrap();
        drop(a);
        let free = sim.mem_info().unwrap().free;
        let (released, waited) = timed(&sim, || pool.release());
        assert!(waited <= Duration::from_millis(100), "{backing:?}: the release waited {waited:?}");
        let e = released.expect_err("the pool's stream still uses the memory");
        assert!(matches!(e, Error::Timeout { .. }), "{backing:?}: {e}");
        assert!(e.to_string().contains(&format!("{:#x}", s.raw())), "{backing:?}: {e}");
        assert_eq!(sim.mem_info().unwrap().free, free, "{backing:?}: nothing went back");
        sim.advance(10_000_000_000);
        assert!(pool.release().unwrap() > 0, "{backing:?}");
        assert!(sim.mem_info().unwrap().free > free, "{backing:?}");
        assert!(sim.violations().is_empty(), "{backing:?}");
    }
}

/// On every backing, an out-of-memory while the pool's stream still uses its free memory
/// returns within a few wait bounds (not after the kernel), saying what it waited for.
#[test]
fn an_out_of_memory_waits_with_a_bound_on_every_backing() {
    for backing in BACKINGS {
        let sim = sim(256 * MIB);
        let (pool, s) = pool_on_own_stream(&sim, backing);
        let x = pool.allocate(200 * MIB).unwrap();
        let _y = pool.allocate(4 * MIB).unwrap();
        sim.use_range(x.ptr(), x.size(), s, 10_000_000_000).unwrap();
        drop(x);
        // More than the device has beside `_y`, even with `x`'s memory stitched in (which
        // the stream orders, without a wait).
        let (made, waited) = timed(&sim, || pool.allocate(254 * MIB));
        assert!(waited < Duration::from_secs(1), "{backing:?}: the allocation waited {waited:?}");
        let e = made.expect_err("the memory is still in use on the pool's stream");
        assert!(e.is_out_of_memory(), "{backing:?}: {e}");
        assert!(e.to_string().contains("waited"), "{backing:?}: {e}");
        assert_eq!(pool.stats().failures, 1, "{backing:?}");
        assert!(sim.violations().is_empty(), "{backing:?}");
    }
}

/// A stitched pool pays for a growth with free granules its stream still uses, without
/// waiting: their memory is mapped again, and the stream orders the next use after the last.
#[test]
fn stitching_does_not_wait_for_the_stream() {
    let sim = sim(1 << 30);
    let (pool, s) = pool_on_own_stream(&sim, BackingKind::STITCHED);
    let a = pool.allocate(64 * MIB).unwrap();
    let _b = pool.allocate(4 * MIB).unwrap();
    sim.use_range(a.ptr(), a.size(), s, 10_000_000_000).unwrap();
    drop(a);
    let (d, waited) = timed(&sim, || pool.allocate(100 * MIB));
    assert!(waited <= Duration::from_millis(1), "the growth waited {waited:?}");
    let _d = d.expect("the growth stitches `a`'s granules");
    assert_eq!(pool.stats().reserved, 104 * MIB, "`a`'s 64 MiB paid for the growth");
    assert!(sim.violations().is_empty());
}

/// Issue 52 (left from round 3): best fit reported out of memory with 700 MiB pending behind
/// a kernel of 1 us on a recorded stream; it now waits (bounded by `wait_timeout`) for the
/// pending frees before failing, and serves the request from them.
#[test]
fn best_fit_waits_for_pending_frees_before_failing() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let pool = BestFit::new(sim.clone(), BestFitConfig::default()).expect("pool");
    let other = sim.create_stream().expect("stream");
    let mut a = pool.allocate(700 << 20).expect("a");
    a.record_stream(other);
    sim.use_range(a.ptr(), a.size(), other, 1_000).expect("kernel");
    let ptr = a.ptr();
    drop(a);
    assert_eq!(pool.stats().pending_release, 700 << 20);
    let b = pool.allocate(700 << 20).expect("the pending block, once its kernel is done");
    assert_eq!(b.ptr(), ptr);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}
