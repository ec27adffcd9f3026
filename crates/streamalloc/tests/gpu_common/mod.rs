//! Helpers of the GPU tests: the CUDA device and a stream blocked by a host function.
#![allow(dead_code)] // Each test binary uses a different part.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use streamalloc::device::cuda::CudaDevice;
use streamalloc::device::DeviceTestExt;
use streamalloc::Stream;

/// Longest a host function keeps its stream blocked.
pub const BLOCK_LIMIT: Duration = Duration::from_secs(5);

/// CUDA device 0. Fails (never skips) when there is none: GPU tests are `#[ignore]`d where no
/// GPU is expected, and must not pass without one.
pub fn gpu() -> Arc<dyn DeviceTestExt> {
    CudaDevice::new(0).unwrap_or_else(|e| panic!("GPU test run without a usable CUDA device: {e}"))
}

/// Blocks `stream` with a host function until the returned flag is set (or [`BLOCK_LIMIT`]).
pub fn block_stream(device: &Arc<dyn DeviceTestExt>, stream: Stream) -> Arc<AtomicBool> {
    let go = Arc::new(AtomicBool::new(false));
    let flag = go.clone();
    device
        .launch_host_func(
            stream,
            Box::new(move || {
                let start = Instant::now();
                while !flag.load(Ordering::Acquire) && start.elapsed() < BLOCK_LIMIT {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }),
        )
        .expect("host function");
    go
}

/// Runs `f` while another thread samples the device's free memory (every 100 us); what `f`
/// returned and the least free memory seen while it ran.
pub fn least_free_during<T>(device: &Arc<dyn DeviceTestExt>, f: impl FnOnce() -> T) -> (T, usize) {
    let done = Arc::new(AtomicBool::new(false));
    let (d, stop) = (device.clone(), done.clone());
    let sampler = std::thread::spawn(move || {
        let mut least = usize::MAX;
        loop {
            least = least.min(d.mem_info().expect("mem_info").free);
            if stop.load(Ordering::Acquire) {
                return least;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    });
    let result = f();
    done.store(true, Ordering::Release);
    (result, sampler.join().expect("the sampling thread failed"))
}

/// Whether every byte is `value`.
pub fn all(bytes: &[u8], value: u8) -> bool {
    bytes.iter().all(|b| *b == value)
}
