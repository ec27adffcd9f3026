//! The facade on the simulator: every strategy, the stack's layers, per-device statistics,
//! (a trace the Trace layer writes replays to identical statistics: streamalloc-replay's tests).

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use streamalloc::device::{DeviceMemory, Streams};
use streamalloc::facade::{Config, Facade, Strategy};
use streamalloc::{Error, Stream};

const MIB: usize = 1 << 20;

/// A facade on a simulated device of 1 GiB unless `conf` gives the capacity (a key is given
/// once).
fn sim(conf: &str) -> Facade {
    let capacity = if conf.contains("sim_capacity") { "" } else { "sim_capacity=1GiB," };
    Facade::new(Config::parse(&format!("device=sim,{capacity}{conf}")).unwrap())
}

#[test]
fn every_strategy_allocates_on_any_stream() {
    for strategy in ["plain", "best_fit", "stream_safe", "async"] {
        let f = sim(&format!("strategy={strategy}"));
        let dev = f.stack(0).unwrap().device.clone();
        let s = dev.create_stream().unwrap();
        let a = f.allocate(3 * MIB, 0, s).unwrap();
        let b = f.allocate(5000, 0, Stream::DEFAULT).unwrap();
        assert_ne!(a.ptr(), b.ptr());
        assert_eq!(f.stats(0).allocated, 3 * MIB + 5000, "{strategy}");
        drop((a, b));
        dev.synchronize_stream(s).unwrap();
        f.release_all().unwrap();
        assert_eq!(f.stats(0).allocated, 0, "{strategy}");
    }
}

/// The caching strategies back their pools with stitched virtual-memory ranges by default,
/// with chunks of plain allocations on a device without virtual memory management (where
/// every reservation fails) or with `backing=chunks`.
#[test]
fn caching_pools_map_ranges_where_the_device_can_and_fall_back_to_chunks() {
    for strategy in ["best_fit", "stream_safe"] {
        for (keys, maps) in [
            ("", true),
            (",sim_virtual_memory=false", false),
            (",backing=chunks", false),
            (",backing=stitched,sim_virtual_memory=false", false),
        ] {
            let f = sim(&format!("strategy={strategy}{keys}"));
            let large = f.allocate(40 * MIB, 0, Stream::DEFAULT).unwrap();
            let small = f.allocate(5000, 0, Stream::DEFAULT).unwrap();
            let sim = f.stack(0).unwrap().sim.clone().unwrap();
            assert_eq!(sim.mapping_calls() > 0, maps, "strategy={strategy}{keys}");
            assert_eq!(f.stats(0).allocated, 40 * MIB + 5000);
            drop((large, small));
            f.release_all().unwrap();
            assert_eq!(sim.mem_info().unwrap().used(), 0, "strategy={strategy}{keys}");
        }
    }
}

/// A stream retired before it is destroyed is named by no later call of any stack (a
/// release, as a retry on out-of-memory makes, included); without retiring it, the pools of
/// `stream_safe` still name it (undefined in the driver: a crash on an H200).
#[test]
fn retired_streams_are_named_by_no_later_call() {
    for strategy in ["plain", "best_fit", "stream_safe", "stream_safe,backing=chunks", "async"] {
        for retire in [true, false] {
            let f = sim(&format!("strategy={strategy}"));
            let sim = f.stack(0).unwrap().sim.clone().unwrap();
            let s = sim.create_stream().unwrap();
            drop(f.allocate(40 * MIB, 0, s).unwrap());
            drop(f.allocate(4096, 0, s).unwrap());
            sim.synchronize_stream(s).unwrap();
            if retire {
                f.retire_stream(0, s).unwrap();
            }
            sim.destroy_stream(s).unwrap();
            let _ = f.release_all();
            drop(f.allocate(MIB, 0, Stream::DEFAULT).unwrap());
            let named = sim.unknown_stream_calls();
            if retire {
                assert_eq!(named, 0, "strategy={strategy}: a retired stream was named");
            } else if strategy.starts_with("stream_safe") {
                assert!(
                    named > 0,
                    "strategy={strategy}: the pools no longer name their stream: retiring is moot"
                );
            }
        }
    }
}

#[test]
fn devices_are_separate_and_stats_are_per_device() {
    let f = sim("strategy=stream_safe");
    let a = f.allocate(MIB, 0, Stream::DEFAULT).unwrap();
    let b = f.allocate(2 * MIB, 1, Stream::DEFAULT).unwrap();
    assert_eq!((a.device(), b.device()), (0, 1));
    assert_eq!(f.stats(0).allocated, MIB);
    assert_eq!(f.stats(1).allocated, 2 * MIB);
    assert_eq!(f.global_stats().allocated, 3 * MIB);
    assert_eq!(f.devices_in_use(), vec![0, 1]);
    assert!(matches!(f.allocate(1, 64, Stream::DEFAULT), Err(Error::InvalidArgument(_))));
}

#[test]
fn limit_layer_names_the_limit() {
    let f = sim("strategy=stream_safe,limit=8MiB");
    let _a = f.allocate(6 * MIB, 0, Stream::DEFAULT).unwrap();
    match f.allocate(3 * MIB, 0, Stream::DEFAULT) {
        Err(Error::LimitExceeded { limit, in_use, requested, .. }) => {
            assert_eq!((limit, in_use, requested), (8 * MIB, 6 * MIB, 3 * MIB));
        }
        other => panic!("expected the limit, got {other:?}"),
    }
    let f = sim("strategy=plain,limit=0.5");
    assert!(f.allocate(600 * MIB, 0, Stream::DEFAULT).is_err(), "half of 1 GiB");
}

#[test]
fn retry_layer_waits_for_a_free_from_another_thread() {
    let f = Arc::new(sim("strategy=plain,retry_timeout=2s,sim_capacity=64MiB"));
    let held = f.allocate(40 * MIB, 0, Stream::DEFAULT).unwrap();
    let freer = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        drop(held);
    });
    let got = f.allocate(40 * MIB, 0, Stream::DEFAULT);
    freer.join().unwrap();
    assert!(got.is_ok(), "{got:?}");
    // Without a free, it gives up after the timeout with the figures and says so.
    let f = sim("strategy=plain,retry_timeout=30ms,sim_capacity=64MiB");
    let _held = f.allocate(40 * MIB, 0, Stream::DEFAULT).unwrap();
    let err = f.allocate(40 * MIB, 0, Stream::DEFAULT).unwrap_err();
    assert!(err.is_out_of_memory() && err.to_string().contains("waited"), "{err}");
}

#[test]
fn stats_layer_counts_per_stream() {
    let f = sim("strategy=stream_safe,stats=true");
    let dev = f.stack(0).unwrap().device.clone();
    let s = dev.create_stream().unwrap();
    let a = f.allocate(MIB, 0, s).unwrap();
    let b = f.allocate(2 * MIB, 0, Stream::DEFAULT).unwrap();
    drop(b);
    let per = f.stream_stats(0).unwrap();
    let find = |st: Stream| per.iter().find(|(x, _)| *x == st).map(|(_, v)| *v).unwrap();
    assert_eq!((find(s).current, find(s).allocations), (MIB, 1));
    assert_eq!((find(Stream::DEFAULT).current, find(Stream::DEFAULT).peak), (0, 2 * MIB));
    drop(a);
    assert!(sim("strategy=stream_safe").stream_stats(0).is_none());
}

#[test]
fn the_same_stack_from_code_and_from_a_string() {
    let from_string =
        Config::parse("strategy=async,pool=owned,release_threshold=1GiB,throttle=0.8,limit=40GiB").unwrap();
    let from_code = Config {
        strategy: Strategy::ASYNC,
        pool: streamalloc::facade::PoolChoice::Owned,
        release_threshold: 1 << 30,
        throttle: 0.8,
        limit: Some(streamalloc::facade::LimitSpec::Bytes(40 << 30)),
        ..Config::default()
    };
    assert_eq!(from_string, from_code);
}

/// Every stack frees by pointer, through the one table at its top, and the layers below see
/// the pointer traffic.
#[test]
fn every_stack_allocates_and_frees_by_pointer() {
    for conf in
        ["strategy=stream_safe", "strategy=stream_safe,stats=true", "strategy=plain", "strategy=async"]
    {
        let f = sim(conf);
        let stack = f.stack(0).unwrap();
        let s = stack.device.create_stream().unwrap();
        let p = stack.allocator.allocate_ptr(3 * MIB, s).unwrap();
        assert_eq!(f.stats(0).allocated, 3 * MIB, "{conf}");
        assert!(stack.allocator.record_stream_ptr(p, Stream::DEFAULT).unwrap(), "{conf}");
        assert!(stack.allocator.free_ptr(p, Stream::DEFAULT), "{conf}: a wrong hint still finds it");
        assert!(!stack.allocator.free_ptr(p, s), "{conf}: freed twice");
        assert_eq!(f.stats(0).allocated, 0, "{conf}");
        assert_eq!(stack.allocator.allocate_ptr(0, s).unwrap(), 0);
    }
    let f = sim("strategy=stream_safe,stats=true");
    let stack = f.stack(0).unwrap();
    let p = stack.allocator.allocate_ptr(MIB, Stream::DEFAULT).unwrap();
    let per_stream = f.stream_stats(0).unwrap();
    assert_eq!(per_stream.len(), 1, "the stats layer saw the allocation made by pointer");
    assert!(stack.allocator.free_ptr(p, Stream::DEFAULT));
    assert_eq!(f.stream_stats(0).unwrap()[0].1.current, 0, "and its free");
}

/// Issue 52 (left from round 3): plain said "the device itself is full" of an empty device
/// asked for more than it has; now it says the real reason.
#[test]
fn plain_says_why_the_device_refused() {
    let f = Facade::new(Config::parse("device=sim,sim_capacity=256MiB,strategy=plain").unwrap());
    let text = f.allocate(300 << 20, 0, Stream::DEFAULT).unwrap_err().to_string();
    assert!(text.contains("larger than the device's memory (268435456 bytes)"), "{text}");
    assert!(!text.contains("itself is full"), "{text}");
    let held = f.allocate(200 << 20, 0, Stream::DEFAULT).unwrap();
    let text = f.allocate(100 << 20, 0, Stream::DEFAULT).unwrap_err().to_string();
    assert!(text.contains("its live allocations and memory held elsewhere leave"), "{text}");
    drop(held);
}
