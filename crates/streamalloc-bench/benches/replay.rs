//! CPU cost per operation of the caching policy and allocators, replaying every trace of
//! `traces/` (its subfolders included) on the simulator: the policy alone (no device at
//! all), BestFit, StreamSafe on one stream (its overhead over BestFit is what the stream-safe
//! layer costs), and StreamSafe by pointer (the C ABI's path: handles kept in the `Pointers`
//! table), and StreamSafe over stitched virtual-memory ranges both ways.
//!
//! Each iteration is one warm pass over a trace (everything freed at its end); throughput is
//! in trace operations. Run: `cargo bench -p streamalloc-bench --bench replay`.

// A benchmark: a failed unwrap or expect stops it, as it should.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use streamalloc::adaptors::Pointers;
use streamalloc::allocators::{BackingKind, BestFit, BestFitConfig, StreamSafe, StreamSafeConfig};
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::device::Streams;
use streamalloc::policy::best_fit::{BestFitPolicy, Classes};
use streamalloc::{Allocation, Allocator, Stream, StreamAllocator};
use streamalloc_replay::trace::{Op, Trace};

fn traces() -> Vec<Trace> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../traces");
    // Every trace: the sample ones, those recorded from PyTorch runs and the synthetic ones
    // whose shapes change every step.
    let mut paths: Vec<_> = ["", "/recorded", "/synthetic"]
        .iter()
        .flat_map(|sub| std::fs::read_dir(format!("{dir}{sub}")).expect("traces folder"))
        .map(|e| e.expect("folder entry").path())
        .filter(|p| p.to_string_lossy().ends_with(".csv.xz"))
        .collect();
    paths.sort();
    paths.iter().map(|p| Trace::from_path(p).expect("trace")).collect()
}

/// One pass of `trace` through the bare policy; chunks come from a bump counter.
fn policy_pass(policy: &mut BestFitPolicy, next_chunk: &mut u64, trace: &Trace, live: &mut [(u64, u64)]) {
    for op in &trace.ops {
        match *op {
            Op::Allocate { slot, size, .. } => {
                let size = size as u64;
                let grant = match policy.allocate(size) {
                    Some(g) => g,
                    None => {
                        let growth = policy.growth_for(size).expect("growth");
                        policy.add_chunk(growth.class, *next_chunk, growth.size).expect("chunk");
                        *next_chunk += growth.size;
                        policy.allocate(size).expect("fits a new chunk")
                    }
                };
                live[slot] = (grant.token, grant.addr);
            }
            Op::Free { slot, .. } => {
                let (token, addr) = std::mem::take(&mut live[slot]);
                policy.free(token, addr).expect("free");
            }
            // Stream rows (issue 37) time nothing here: allocations and frees are measured.
            Op::RecordStream { .. } | Op::Use { .. } | Op::Wait { .. } => {}
        }
    }
    for (token, addr) in live.iter_mut().map(std::mem::take).filter(|(_, a)| *a != 0) {
        policy.free(token, addr).expect("free");
    }
}

/// One pass of `trace` through an allocation function.
fn allocator_pass(trace: &Trace, live: &mut [Option<Allocation>], alloc: &dyn Fn(usize) -> Allocation) {
    for op in &trace.ops {
        match *op {
            Op::Allocate { slot, size, .. } => live[slot] = Some(alloc(size)),
            Op::Free { slot, .. } => live[slot] = None,
            // Stream rows (issue 37) time nothing here: allocations and frees are measured.
            Op::RecordStream { .. } | Op::Use { .. } | Op::Wait { .. } => {}
        }
    }
    live.iter_mut().for_each(|x| *x = None);
}

/// One pass of `trace` by pointer ([`Pointers`]) on `stream`.
fn pointer_pass<A: StreamAllocator>(trace: &Trace, live: &mut [u64], a: &Pointers<A>, stream: Stream) {
    for op in &trace.ops {
        match *op {
            Op::Allocate { slot, size, .. } => live[slot] = a.allocate_ptr(size, stream).expect("allocation"),
            Op::Free { slot, .. } => assert!(a.free_ptr(std::mem::take(&mut live[slot]), stream)),
            // Stream rows (issue 37) time nothing here: allocations and frees are measured.
            Op::RecordStream { .. } | Op::Use { .. } | Op::Wait { .. } => {}
        }
    }
    for p in live.iter_mut().map(std::mem::take).filter(|&p| p != 0) {
        assert!(a.free_ptr(p, stream));
    }
}

fn bench(c: &mut Criterion) {
    for trace in traces() {
        let mut group = c.benchmark_group(trace.name.trim_end_matches(".csv").to_string());
        group.throughput(Throughput::Elements(trace.len() as u64));
        group.sample_size(20);

        let mut policy = BestFitPolicy::new(Classes { growth: 32 << 20, ..Classes::default() });
        let mut next = 1u64 << 40;
        let mut slots = vec![(0, 0); trace.slots];
        group
            .bench_function("policy", |b| b.iter(|| policy_pass(&mut policy, &mut next, &trace, &mut slots)));

        let sim = SimDevice::new(SimConfig::h200());
        let mut live: Vec<Option<Allocation>> = (0..trace.slots).map(|_| None).collect();
        let best_fit = BestFit::new(sim.clone(), BestFitConfig::default()).expect("pool");
        group.bench_function("best_fit", |b| {
            b.iter(|| allocator_pass(&trace, &mut live, &|n| best_fit.allocate(n).expect("allocation")))
        });

        let stream_safe =
            Arc::new(StreamSafe::new(sim.clone(), StreamSafeConfig::default()).expect("allocator"));
        let s = sim.create_stream().expect("stream");
        group.bench_function("stream_safe", |b| {
            b.iter(|| {
                allocator_pass(&trace, &mut live, &|n| stream_safe.allocate_on(n, s).expect("allocation"))
            })
        });
        let mut ptrs = vec![0; trace.slots];
        let wait = Duration::from_secs(10);
        let by_pointer = Pointers::new(stream_safe.clone(), sim.clone(), wait);
        group.bench_function("stream_safe_by_pointer", |b| {
            b.iter(|| pointer_pass(&trace, &mut ptrs, &by_pointer, s))
        });
        // The same on stitched virtual-memory ranges (`backing=stitched` in the facade).
        let pool = BestFitConfig { backing: BackingKind::STITCHED, ..Default::default() };
        let stitched = Arc::new(
            StreamSafe::new(sim.clone(), StreamSafeConfig { pool, ..Default::default() }).expect("allocator"),
        );
        group.bench_function("stream_safe_stitched", |b| {
            b.iter(|| allocator_pass(&trace, &mut live, &|n| stitched.allocate_on(n, s).expect("allocation")))
        });
        let by_pointer = Pointers::new(stitched.clone(), sim.clone(), wait);
        group.bench_function("stream_safe_stitched_by_pointer", |b| {
            b.iter(|| pointer_pass(&trace, &mut ptrs, &by_pointer, s))
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
