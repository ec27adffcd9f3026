//! Issue 49: a workload replayed again and again through the default configuration makes no
//! device call from its second pass on, on every trace of `traces/` and `bench/check-traces/`,
//! and keeps its footprint.

use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::facade::{Config, Facade};
use streamalloc::Streams;
use streamalloc::{Allocator, Stream};
use streamalloc_replay::trace::{Op, Trace};

/// Passes of each trace.
const PASSES: usize = 5;

/// Replays `trace` [`PASSES`] times through `Config::default()`'s stack on a simulated H200
/// by pointer, as the C ABI calls it, each recorded stream on a stream of its own; what a pass
/// left live is freed at its end. The device calls of each pass, and the footprint:
/// `reserved_peak` over the trace's peak live bytes.
fn calls_per_pass(trace: &Trace) -> (Vec<u64>, f64) {
    let sim = SimDevice::new(SimConfig::h200());
    let stack = Facade::build_stack(&Config::default(), sim.clone()).expect("stack");
    let a = &stack.allocator;
    let streams: Vec<Stream> = trace.streams.iter().map(|_| sim.create_stream().expect("stream")).collect();
    let mut live: Vec<Option<(u64, Stream)>> = vec![None; trace.slots];
    let mut calls = Vec::with_capacity(PASSES);
    for _ in 0..PASSES {
        let before = sim.calls();
        for op in &trace.ops {
            match *op {
                Op::Allocate { slot, size, stream, .. } => {
                    let s = streams[stream];
                    let ptr = a.allocate_ptr(size, s).unwrap_or_else(|e| panic!("{}: {e}", trace.name));
                    live[slot] = Some((ptr, s));
                }
                Op::Free { slot, .. } => {
                    if let Some((ptr, s)) = live[slot].take() {
                        assert!(ptr == 0 || a.free_ptr(ptr, s), "{}: free of {ptr:#x}", trace.name);
                    }
                }
                _ => {}
            }
        }
        for (ptr, s) in live.iter_mut().filter_map(Option::take) {
            assert!(ptr == 0 || a.free_ptr(ptr, s));
        }
        calls.push(sim.calls() - before);
    }
    let footprint = a.stats().reserved_peak as f64 / trace.peak_live as f64;
    (calls, footprint)
}

/// Every trace of the repository: those of `traces/` (and its folders) and the check set.
fn every_trace() -> Vec<std::path::PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut paths = Vec::new();
    for dir in ["traces", "traces/recorded", "traces/synthetic", "bench/check-traces"] {
        for entry in std::fs::read_dir(root.join(dir)).expect("trace folder") {
            let path = entry.expect("entry").path();
            let name = path.to_string_lossy();
            if name.ends_with(".csv") || name.ends_with(".csv.xz") || name.ends_with(".csv.gz") {
                paths.push(path);
            }
        }
    }
    paths.sort();
    paths
}

/// Each trace's footprint before issue 49's change (reserved_peak over peak live bytes under
/// `Config::default()` at 93a8269, `bench/results/threads.md`).
const FOOTPRINTS_BEFORE: &[(&str, f64)] = &[
    ("gpt2_generate.csv", 1.01576),
    ("gpt2_train.csv", 1.00836),
    ("bert_infer.csv", 1.04327),
    ("cnn_multiscale.csv", 1.00766),
    ("llm_decode.csv", 1.02230),
    ("moe_train.csv", 1.02757),
    ("resnet50_train.csv", 1.00371),
    ("bert_varlen_infer.csv", 1.00351),
    ("llm_decode_kvcache.csv", 1.00794),
    ("moe_routing.csv", 1.00257),
    ("multiscale_train.csv", 1.00123),
    ("bert_infer_seed1.csv", 1.05361),
    ("bert_infer_seed2.csv", 1.04526),
    ("bert_infer_seed4.csv", 1.04161),
    ("cnn_multiscale_seed1.csv", 1.01142),
    ("cnn_multiscale_seed2.csv", 1.01177),
    ("llm_decode_seed1.csv", 1.03593),
    ("llm_decode_seed2.csv", 1.02313),
    ("llm_decode_seed7.csv", 1.02936),
    ("moe_train_seed1.csv", 1.01427),
    ("moe_train_seed2.csv", 1.01490),
];

/// A granule of the simulated H200, the unit memory is mapped in.
const GRANULE: f64 = (2 << 20) as f64;

#[test]
fn a_repeated_workload_makes_no_device_call_after_its_first_pass() {
    let paths = every_trace();
    assert_eq!(paths.len(), FOOTPRINTS_BEFORE.len(), "traces found: {paths:?}");
    let mut failed = Vec::new();
    for path in &paths {
        let trace = Trace::from_path(path).expect("trace");
        let (calls, footprint) = calls_per_pass(&trace);
        println!("{}: calls per pass {calls:?}, footprint {footprint:.5}", trace.name);
        if calls[1..].iter().any(|&c| c != 0) {
            failed.push(format!("{}: device calls per pass {calls:?}", trace.name));
        }
        // Within 0.5% of what it was, or one granule more (0.65% of the smallest traces).
        let before = FOOTPRINTS_BEFORE.iter().find(|(name, _)| *name == trace.name).expect("known trace").1;
        let bound = before + (0.005 * before).max(GRANULE / trace.peak_live as f64);
        if footprint > bound {
            failed.push(format!("{}: footprint {footprint:.5}, before {before:.5}", trace.name));
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}
