//! Measures, on CUDA device 0, what AsyncPool adds to the driver's own stream-ordered
//! allocation: an allocate + free pair of 1 MiB on one stream made with the bare device calls
//! (`cuMemAllocFromPoolAsync` + `cuMemFreeAsync` on the default pool), next to the same pair
//! through AsyncPool on the same pool, and the cost of the capture-status query AsyncPool makes
//! on each call. The subjects alternate for five rounds so that both see the same machine.
//! A measurement to read, not a test: `cargo run --release --example async_overhead`
//! (on the GPU machine, the packed binary: scripts/gpu/device-run.sh bench).

use std::sync::Arc;
use std::time::Instant;

use streamalloc::allocators::{AsyncPool, AsyncPoolConfig, PoolMode};
use streamalloc::device::cuda::CudaDevice;
use streamalloc::device::PoolAttr;
use streamalloc::{Device, Result, StreamAllocator};

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

fn main() -> Result<()> {
    let device: Arc<dyn Device> = CudaDevice::new(0)?;
    let s = device.create_stream()?;
    let pool = device.default_pool()?;
    device.set_pool_attr(pool, PoolAttr::ReleaseThreshold, u64::MAX)?;
    let mode = PoolMode::DefaultPool { release_threshold: Some(usize::MAX) };
    let async_pool = AsyncPool::new(device.clone(), AsyncPoolConfig { mode, ..Default::default() });
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
