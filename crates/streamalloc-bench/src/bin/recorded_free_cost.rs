//! Measures, on CUDA device 0, the host cost of an allocate + free pair on one stream, with
//! and without `record_stream` of a second (idle) stream, for AsyncPool and StreamSafe.
//! A measurement to read, not a test: `cargo run --release -p streamalloc-bench --bin recorded_free_cost`
//! (on the GPU machine, packed by scripts/gpu-test.sh: lab/run bench).

use std::sync::Arc;
use std::time::Instant;

use streamalloc::allocators::{
    AsyncPool, AsyncPoolConfig, PoolMode, ReuseFlags, StreamSafe, StreamSafeConfig,
};
use streamalloc::device::cuda::CudaDevice;
use streamalloc::{Device, Result, Stream, StreamAllocator};

const PAIRS: u32 = 20_000;

/// ns per allocate + free pair of 1 MiB on `a`, recording `b` when `record`.
fn pair_ns(alloc: &dyn StreamAllocator, a: Stream, b: Stream, record: bool) -> Result<f64> {
    let mut best = f64::MAX;
    for _ in 0..3 {
        let start = Instant::now();
        for _ in 0..PAIRS {
            let mut x = alloc.allocate_on(1 << 20, a)?;
            if record {
                x.record_stream(b);
            }
        }
        best = best.min(start.elapsed().as_nanos() as f64 / f64::from(PAIRS));
    }
    Ok(best)
}

fn main() -> Result<()> {
    let device: Arc<dyn Device> = CudaDevice::new(0)?;
    let (a, b) = (device.create_stream()?, device.create_stream()?);
    let mode = PoolMode::Owned {
        release_threshold: usize::MAX,
        reuse: ReuseFlags::default(),
        max_size: 0,
        exportable: false,
    };
    let async_pool = AsyncPool::new(device.clone(), AsyncPoolConfig { mode, ..Default::default() });
    let stream_safe = StreamSafe::new(device.clone(), StreamSafeConfig::default())?;
    let subjects: [(&str, &dyn StreamAllocator); 2] =
        [("async_pool", &async_pool), ("stream_safe", &stream_safe)];
    for (name, alloc) in subjects {
        let plain = pair_ns(alloc, a, b, false)?;
        let recorded = pair_ns(alloc, a, b, true)?;
        println!(
            "RECORDED_FREE_COST allocator={name} pair_ns={plain:.0} pair_with_recorded_stream_ns={recorded:.0} \
             extra_ns={:.0}",
            recorded - plain
        );
        device.synchronize_stream(a)?;
        device.synchronize_stream(b)?;
    }
    Ok(())
}
