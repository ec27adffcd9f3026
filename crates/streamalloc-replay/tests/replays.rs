//! Replays of whole traces through the library: the stitched backing's footprint on traces
//! whose shapes vary, and a trace written by the facade's Trace layer replaying to identical
//! statistics.

use std::sync::Arc;

use streamalloc::allocators::{BackingKind, BestFitConfig, StreamSafe, StreamSafeConfig};
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::facade::{Config, Facade};
use streamalloc::{Allocator, Stream, StreamAllocator};
use streamalloc_replay::replay::{replay, ReplayOptions, ReplayTarget};
use streamalloc_replay::trace::Trace;

const MIB: usize = 1 << 20;

/// A facade on a simulated device of 1 GiB.
fn sim(conf: &str) -> Facade {
    Facade::new(Config::parse(&format!("device=sim,sim_capacity=1GiB,{conf}")).unwrap())
}

/// Footprint of StreamSafe over `backing` on a trace of `traces/`.
fn footprint(trace: &str, backing: BackingKind) -> f64 {
    let path = format!("{}/../../traces/{trace}", env!("CARGO_MANIFEST_DIR"));
    let trace = Trace::from_path(path).expect("trace");
    let sim = SimDevice::new(SimConfig::h200());
    let pool = BestFitConfig { backing, ..Default::default() };
    let alloc =
        StreamSafe::new(sim.clone(), StreamSafeConfig { pool, ..Default::default() }).expect("allocator");
    let target = ReplayTarget::Streams(Arc::new(alloc));
    let r =
        replay(&trace, "stitched", &target, sim.as_ref(), &ReplayOptions { passes: 1, ..Default::default() })
            .expect("replay");
    assert_eq!(r.failures, 0, "{:?}", r.first_failure);
    r.footprint_ratio
}

#[test]
fn footprint_stays_within_5_percent_when_shapes_change_every_step() {
    // Expandable segments held 1.454 and 1.169 of the peak live bytes here; chunks 1.463 and 1.235.
    for trace in ["synthetic/bert_varlen_infer.csv", "synthetic/multiscale_train.csv"] {
        let f = footprint(trace, BackingKind::Stitched);
        assert!(f <= 1.05, "{trace}: footprint {f:.3}");
    }
}

#[test]
fn a_written_trace_replays_to_identical_statistics() {
    let path = std::env::temp_dir().join(format!("streamalloc-facade-{}.csv", std::process::id()));
    let f = sim(&format!("strategy=stream_safe,trace={}", path.display()));
    let a = f.allocator(0).unwrap().clone();
    let mut live = Vec::new();
    for i in 0..200usize {
        live.push(a.allocate_on((i * 7919) % (3 * MIB) + 1, Stream::DEFAULT).unwrap());
        if i % 3 == 0 {
            live.swap_remove(i % live.len());
        }
    }
    drop(live);
    let original = a.stats();
    drop(a);
    drop(f); // flushes the trace
    let trace = Trace::from_path(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(trace.len(), 400);
    let g = sim("strategy=stream_safe");
    let stack = g.stack(0).unwrap();
    let target = ReplayTarget::Streams(stack.allocator.clone());
    let result = replay(
        &trace,
        "stream_safe",
        &target,
        stack.device.as_ref(),
        &ReplayOptions { passes: 1, ..Default::default() },
    )
    .unwrap();
    let replayed = stack.allocator.stats();
    assert_eq!(result.failures, 0);
    // Two passes (measuring and timed) of the same operations.
    assert_eq!(replayed.total_allocations, 2 * original.total_allocations);
    assert_eq!(replayed.allocated_peak, original.allocated_peak);
    assert_eq!(replayed.reserved_peak, original.reserved_peak);
    assert_eq!(result.peak_live, original.allocated_peak);
}
