//! Issue 37: traces that know streams and time. A side stream's work on a block, recorded
//! with `record_stream` and `use` rows, keeps the block from reuse until it is done when the
//! trace's time is replayed on the simulator, under every allocator, and the ordering checker
//! finds no early reuse.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicU64, Ordering};

use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::facade::{Config, Facade};
use streamalloc::trace::{Action, Record, TraceWriter, HEADER};
use streamalloc_replay::replay::{replay, ReplayOptions, ReplayResult, ReplayTarget};
use streamalloc_replay::trace::{Op, Trace};

const MIB: usize = 1 << 20;

/// A block of 64 MiB on the default stream that side stream 7 reads for `use_ns` from 1 us
/// (recorded on it when `record`); the block is freed at 2 us, and another of 64 MiB is
/// allocated at `next_us` and used on the default stream for 5 ms.
fn side_stream_trace(use_ns: u64, next_us: u64, record: bool) -> Trace {
    let size = 64 * MIB;
    let record = if record { "0,1,record_stream,0x1000,0,7\n" } else { "" };
    let text = format!(
        "{HEADER}\n0,0,allocate,0x1000,{size},0\n{record}0,1,use,0x1000,{use_ns},7\n0,2,free,0x1000,{size},0\n\
         0,{next_us},allocate,0x2000,{size},0\n0,{next_us},use,0x2000,5000000,0\n0,{},free,0x2000,{size},0\n",
        next_us + 1
    );
    Trace::parse(text.as_bytes(), "side_stream.csv").expect("trace")
}

/// Replays `trace` through a fresh stack of `strategy` on a fresh simulator, its time
/// replayed or not; the result, and the simulated time its measuring pass took, all its
/// streams' work done.
fn replayed(trace: &Trace, strategy: &str, time: bool) -> (ReplayResult, u64) {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let config = Config::parse(&format!("strategy={strategy}")).expect("config");
    let stack = Facade::build_stack(&config, sim.clone()).expect("stack");
    let start = sim.now();
    let first_pass = AtomicU64::new(0);
    let pass_done = |pass| {
        if pass == 0 {
            first_pass.store(sim.now() - start, Ordering::Relaxed);
        }
    };
    let options = ReplayOptions {
        passes: 1,
        pass_done: Some(&pass_done),
        time: time.then_some(sim.as_ref()),
        ..Default::default()
    };
    let r = replay(trace, strategy, &ReplayTarget::Streams(stack.allocator.clone()), sim.as_ref(), &options)
        .expect("replay");
    assert_eq!((r.failures, r.time), (0, time), "{strategy}: {:?}", r.first_failure);
    (r, first_pass.into_inner())
}

const STRATEGIES: [&str; 3] = ["stream_safe", "best_fit", "async"];

#[test]
fn a_block_a_side_stream_still_uses_is_not_reused_before_it_is_done() {
    let trace = side_stream_trace(5_000_000, 3, true);
    assert_eq!((trace.record_streams, trace.uses, trace.waits), (1, 2, 0));
    for strategy in STRATEGIES {
        let (timed, elapsed) = replayed(&trace, strategy, true);
        let (untimed, _) = replayed(&trace, strategy, false);
        assert_eq!((timed.violations, untimed.violations), (0, 0), "{strategy}");
        let (higher, serialized) = (timed.reserved_peak >= 128 * MIB, elapsed >= 10_000_000);
        if strategy == "async" {
            // The driver's pool reuses the block at once, making the default stream wait for
            // the side stream (internal dependencies): the same memory, the stream's work later.
            assert!(!higher && serialized, "{strategy}: peak {}, {elapsed} ns", timed.reserved_peak);
        } else {
            // The caching pools hold the block back and hand out another: more memory, no wait.
            assert!(higher && !serialized, "{strategy}: peak {}, {elapsed} ns", timed.reserved_peak);
        }
        assert_eq!(untimed.reserved_peak, 64 * MIB, "{strategy}: without time the block is reused");
        assert_eq!(timed.peak_device_used > untimed.peak_device_used, higher, "{strategy}");
    }
}

#[test]
fn a_block_whose_side_stream_is_done_is_reused_with_time_too() {
    // The side stream's 1 us of work ends long before the next allocation, at 3 ms.
    let trace = side_stream_trace(1_000, 3_000, true);
    for strategy in STRATEGIES {
        let (timed, elapsed) = replayed(&trace, strategy, true);
        let (untimed, _) = replayed(&trace, strategy, false);
        assert_eq!(timed.violations, 0, "{strategy}");
        assert_eq!(timed.reserved_peak, untimed.reserved_peak, "{strategy}");
        assert!(elapsed < 10_000_000, "{strategy}: {elapsed} ns");
    }
}

/// The checker is on: without its `record_stream` row, the side stream's use is unknown to
/// the allocator, which hands the block out again while it still runs.
#[test]
fn a_use_the_allocator_was_not_told_of_is_a_violation() {
    let trace = side_stream_trace(5_000_000, 3, false);
    for strategy in STRATEGIES {
        assert!(replayed(&trace, strategy, true).0.violations > 0, "{strategy}");
    }
}

/// A `wait` row orders the waiting stream's later work after the other's: a block that the
/// default stream frees after waiting for the side stream's use is reused without a record.
#[test]
fn a_wait_orders_the_waiting_stream_after_the_other() {
    let size = 64 * MIB;
    let text = format!(
        "{HEADER}\n0,0,allocate,0x1000,{size},0\n0,1,use,0x1000,5000000,7\n0,1,wait,0x7,0,0\n\
         0,2,free,0x1000,{size},0\n0,3,allocate,0x2000,{size},0\n"
    );
    let trace = Trace::parse(text.as_bytes(), "wait.csv").expect("trace");
    assert_eq!(trace.ops[2], Op::Wait { stream: 0, other: 1, thread: 0 });
    for strategy in STRATEGIES {
        let (r, _) = replayed(&trace, strategy, true);
        assert_eq!(r.violations, 0, "{strategy}");
        assert!(r.reserved_peak < 128 * MIB, "{strategy}: {}", r.reserved_peak);
    }
}

/// Rows written by `TraceWriter` parse back into the operations they stand for.
#[test]
fn stream_rows_round_trip_through_the_writer() {
    let row = |time_us, action, ptr, size, stream| Record { thread: 3, time_us, action, ptr, size, stream };
    let mut writer = TraceWriter::new(Vec::new()).expect("writer");
    for r in [
        row(100, Action::Allocate, 0x7f00, 4096, 0),
        row(101, Action::RecordStream, 0x7f00, 0, 0x5555),
        row(102, Action::Use, 0x7f00, 1500, 0x5555),
        row(103, Action::Wait, 0x5555, 0, 0),
        row(104, Action::Free, 0x7f00, 4096, 0),
    ] {
        writer.write(&r).expect("row");
    }
    let bytes = writer.finish().expect("flushed");
    let trace = Trace::parse(&bytes[..], "t").expect("trace");
    assert_eq!(
        trace.ops,
        [
            Op::Allocate { slot: 0, size: 4096, stream: 0, thread: 0 },
            Op::RecordStream { slot: 0, stream: 1, thread: 0 },
            Op::Use { slot: 0, stream: 1, duration_ns: 1500, thread: 0 },
            Op::Wait { stream: 0, other: 1, thread: 0 },
            Op::Free { slot: 0, stream: 0, thread: 0 },
        ]
    );
    assert_eq!(trace.streams, [0, 0x5555]);
    assert_eq!(trace.times_us, [0, 1, 2, 3, 4]);
    assert_eq!((trace.record_streams, trace.uses, trace.waits, trace.untimed_line), (1, 1, 1, None));
}

/// On threads, a stream row of an allocation made on another thread waits for it, and the
/// clock moves forward only.
#[test]
fn stream_rows_replay_on_threads() {
    let size = 64 * MIB;
    let text = format!(
        "{HEADER}\n0,0,allocate,0x1000,{size},0\n1,1,record_stream,0x1000,0,7\n1,1,use,0x1000,5000000,7\n\
         1,1,wait,0x7,0,9\n0,2,free,0x1000,{size},0\n0,3,allocate,0x2000,{size},0\n0,4,free,0x2000,{size},0\n"
    );
    let trace = Trace::parse(text.as_bytes(), "threads.csv").expect("trace");
    for strategy in STRATEGIES {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let stack = Facade::build_stack(
            &Config::parse(&format!("strategy={strategy}")).expect("config"),
            sim.clone(),
        )
        .expect("stack");
        let options =
            ReplayOptions { passes: 2, threads: true, time: Some(sim.as_ref()), ..Default::default() };
        let r =
            replay(&trace, strategy, &ReplayTarget::Streams(stack.allocator.clone()), sim.as_ref(), &options)
                .expect("replay");
        assert_eq!((r.threads, r.failures, r.violations, r.time), (2, 0, 0, true), "{strategy}");
    }
}
