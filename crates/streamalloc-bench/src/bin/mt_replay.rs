//! Multi-thread scaling of StreamSafe without the C ABI: for 1, 2, 4 and 8 threads, each
//! thread replays a trace on a stream of its own (one warm-up pass, then three timed passes,
//! all threads starting each pass together), and prints the aggregate million operations per
//! second (as the anchors harness computes it: from the slowest thread's best pass) and the
//! device allocations made during the timed passes. On the simulator the device costs nothing
//! and no call takes a driver lock, which separates the allocator's own scaling from the
//! driver's. A measurement to read, not a test:
//! `cargo run --release -p streamalloc-bench --bin mt_replay -- traces/resnet50_train.csv [sim|cuda]`
//! (on the GPU machine, packed by scripts/gpu-test.sh: scripts/gpu/device-run.sh mtx).

use std::sync::{Arc, Barrier};
use std::time::Instant;

use streamalloc::allocators::{StreamSafe, StreamSafeConfig};
use streamalloc::device::cuda::CudaDevice;
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::{Allocation, Allocator, Device, Result, StreamAllocator};
use streamalloc_replay::trace::{Op, Trace};

const PASSES: usize = 4;

/// The slowest thread's best timed pass, in seconds, and the device allocations made during
/// the timed passes.
fn run(device: &Arc<dyn Device>, trace: &Arc<Trace>, threads: usize) -> Result<(f64, u64)> {
    let allocator = Arc::new(StreamSafe::new(device.clone(), StreamSafeConfig::default())?);
    let barrier = Arc::new(Barrier::new(threads + 1));
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let (allocator, trace, barrier) = (allocator.clone(), trace.clone(), barrier.clone());
            let stream = device.create_stream();
            std::thread::spawn(move || -> Result<f64> {
                let stream = stream?;
                let mut live: Vec<Option<Allocation>> = (0..trace.slots).map(|_| None).collect();
                let mut best = f64::MAX;
                for pass in 0..PASSES {
                    barrier.wait();
                    let start = Instant::now();
                    for op in &trace.ops {
                        match *op {
                            Op::Allocate { slot, size, .. } => {
                                live[slot] = Some(allocator.allocate_on(size, stream)?)
                            }
                            Op::Free { slot, .. } => live[slot] = None,
                        }
                    }
                    live.iter_mut().for_each(|a| *a = None);
                    if pass > 0 {
                        best = best.min(start.elapsed().as_secs_f64());
                    }
                    barrier.wait();
                }
                Ok(best)
            })
        })
        .collect();
    let mut device_allocs_after_warm_up = 0;
    for pass in 0..PASSES {
        barrier.wait();
        barrier.wait();
        if pass == 0 {
            device_allocs_after_warm_up = allocator.stats().device_allocs;
        }
    }
    let mut slowest: f64 = 0.0;
    for w in workers {
        slowest = slowest.max(w.join().expect("a replay thread panicked")?);
    }
    Ok((slowest, allocator.stats().device_allocs - device_allocs_after_warm_up))
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: mt_replay TRACE [sim|cuda]");
    let (kind, device): (&str, Arc<dyn Device>) = match args.next().as_deref() {
        Some("cuda") => ("cuda", CudaDevice::new(0)?),
        _ => ("sim", SimDevice::new(SimConfig::h200())),
    };
    let trace = Arc::new(Trace::from_path(&path)?);
    let mut one = 0.0;
    for threads in [1, 2, 4, 8] {
        let (seconds, device_allocs) = run(&device, &trace, threads)?;
        let mops = (threads * trace.len()) as f64 / seconds / 1e6;
        if threads == 1 {
            one = mops;
        }
        println!(
            "MT_REPLAY device={kind} trace={} threads={threads} mops_per_s={mops:.2} scaling={:.2} \
             device_allocs_in_timed_passes={device_allocs}",
            trace.name,
            mops / one
        );
    }
    Ok(())
}
