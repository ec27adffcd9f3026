//! Measures, on CUDA device 0, what AsyncPool adds to the driver's own stream-ordered
//! allocation: an allocate + free pair of 1 MiB on one stream made with the bare device calls
//! (`cuMemAllocFromPoolAsync` + `cuMemFreeAsync` on the default pool), next to the same pair
//! through AsyncPool on the same pool, and the cost of the capture-status query AsyncPool makes
//! on each call. The subjects alternate for five rounds so that both see the same machine.
//!
//! Given trace files, it then replays each, alternating passes in this one process so that
//! every subject sees the same pool and the same moment of the machine: the bare calls with
//! the trace's sizes (what the anchors' raw cudaMallocAsync does), AsyncPool by handle, and
//! AsyncPool by pointer (through the `Pointers` table: the C ABI's path for `strategy=async`); the
//! median pass of each, in ns per operation.
//!
//! A measurement to read, not a test: `cargo run --release -p streamalloc-bench --bin async_overhead [TRACE...]`
//! (on the GPU machine, packed by scripts/gpu-test.sh: lab/run bench).

use std::sync::Arc;
use std::time::{Duration, Instant};

use streamalloc::adaptors::Pointers;
use streamalloc::allocators::{AsyncPool, AsyncPoolConfig, PoolMode};
use streamalloc::device::cuda::CudaDevice;
use streamalloc::device::{Pool, PoolAttr, Stream};
use streamalloc::{Allocation, Device, Error, Result, StreamAllocator};
use streamalloc_replay::trace::{Op, Trace};

const N: u32 = 20_000;

/// ns per call of `f`, best of three runs of `N` calls.
fn ns_per(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut best = f64::MAX;
    for _ in 0..3 {
        let start = Instant::now();
        for _ in 0..N {
            f()?;
        }
        best = best.min(start.elapsed().as_nanos() as f64 / f64::from(N));
    }
    Ok(best)
}

/// Passes per subject and trace.
const PASSES: usize = 9;

/// ns per operation of one pass of `trace`, `alloc` and `free` called per operation, the
/// stream synchronized at the end (as the anchors harness does).
fn pass<T: Default>(
    trace: &Trace,
    live: &mut [T],
    mut alloc: impl FnMut(usize) -> Result<T>,
    mut free: impl FnMut(T) -> Result<()>,
    sync: impl FnOnce() -> Result<()>,
) -> Result<f64> {
    let start = Instant::now();
    for op in &trace.ops {
        match *op {
            Op::Allocate { slot, size, .. } => live[slot] = alloc(size)?,
            Op::Free { slot, .. } => free(std::mem::take(&mut live[slot]))?,
            // Stream rows (issue 37) time nothing here: allocations and frees are measured.
            Op::RecordStream { .. } | Op::Use { .. } | Op::Wait { .. } => {}
        }
    }
    for x in live.iter_mut() {
        free(std::mem::take(x))?;
    }
    sync()?;
    Ok(start.elapsed().as_nanos() as f64 / trace.len() as f64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Replays `trace` through the three subjects, alternating, and prints their median passes.
fn replay(
    device: &Arc<dyn Device>,
    pool: Pool,
    s: Stream,
    async_pool: &Arc<AsyncPool>,
    trace: &Trace,
) -> Result<()> {
    let by_pointer = Pointers::new(async_pool.clone(), device.clone(), Duration::from_secs(10));
    let (mut raw, mut handles, mut pointers) = (Vec::new(), Vec::new(), Vec::new());
    let mut ptrs = vec![0u64; trace.slots];
    let mut allocations: Vec<Option<Allocation>> = (0..trace.slots).map(|_| None).collect();
    let sync = || device.synchronize_stream(s);
    for _ in 0..PASSES {
        raw.push(pass(
            trace,
            &mut ptrs,
            |n| device.alloc_async(n, pool, s),
            |p| if p == 0 { Ok(()) } else { device.free_async(p, s) },
            sync,
        )?);
        handles.push(pass(
            trace,
            &mut allocations,
            |n| async_pool.allocate_on(n, s).map(Some),
            |a| {
                drop(a);
                Ok(())
            },
            sync,
        )?);
        pointers.push(pass(
            trace,
            &mut ptrs,
            |n| by_pointer.allocate_ptr(n, s),
            |p| match p == 0 || by_pointer.free_ptr(p, s) {
                true => Ok(()),
                false => Err(Error::InvalidArgument(format!("{p:#x} not live"))),
            },
            sync,
        )?);
    }
    let (raw, handles, pointers) = (median(raw), median(handles), median(pointers));
    println!(
        "ASYNC_TRACE trace={} raw_ns={raw:.0} async_pool_ns={handles:.0} ratio={:.3} by_pointer_ns={pointers:.0} ratio={:.3}",
        trace.name,
        handles / raw,
        pointers / raw
    );
    Ok(())
}

fn main() -> Result<()> {
    let device: Arc<dyn Device> = CudaDevice::new(0)?;
    let s = device.create_stream()?;
    let pool = device.default_pool()?;
    device.set_pool_attr(pool, PoolAttr::ReleaseThreshold, u64::MAX)?;
    let mode = PoolMode::DefaultPool { release_threshold: Some(usize::MAX) };
    let async_pool = Arc::new(AsyncPool::new(device.clone(), AsyncPoolConfig { mode, ..Default::default() }));
    for path in std::env::args().skip(1) {
        replay(&device, pool, s, &async_pool, &Trace::from_path(&path)?)?;
    }
    for round in 1..=5 {
        let raw = ns_per(|| device.free_async(device.alloc_async(1 << 20, pool, s)?, s))?;
        let ours = ns_per(|| async_pool.allocate_on(1 << 20, s).map(drop))?;
        let query = ns_per(|| device.capture_status(s).map(drop))?;
        println!(
            "ASYNC_OVERHEAD round={round} raw_pair_ns={raw:.0} async_pool_pair_ns={ours:.0} ratio={:.3} \
             capture_status_ns={query:.0}",
            ours / raw
        );
    }
    device.synchronize_stream(s)
}
