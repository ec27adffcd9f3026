//! A stream-safe pool shared by two streams: an allocation used on another stream is kept
//! from reuse until that stream's work is done (`record_stream`), statistics per allocator,
//! and the same allocator on streams a cudarc program already has.
//!
//! Run: `cargo run -p streamalloc --example streams` (on the simulator, whose ordering
//! checker confirms no early reuse), or `cargo run -p streamalloc --example streams -- cuda`
//! on GPU 0 with streams made by cudarc.

use std::sync::Arc;

use streamalloc::allocators::{StreamSafe, StreamSafeConfig};
use streamalloc::device::cuda::CudaDevice;
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::device::Streams;
use streamalloc::{Allocator, Device, Error, Result, StreamAllocator};

const MIB: usize = 1 << 20;

/// On the simulator: a simulated kernel on a copy stream uses a buffer of the compute stream.
fn on_the_simulator() -> Result<()> {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let pool = StreamSafe::new(sim.clone(), StreamSafeConfig::default())?;
    let (compute, copy) = (sim.create_stream()?, sim.create_stream()?);
    for step in 0..4 {
        let mut activations = pool.allocate_on(64 * MIB, compute)?;
        sim.use_range(activations.ptr(), activations.size(), compute, 200_000)?;
        // The copy stream reads the buffer for 1 ms of simulated time.
        sim.use_range(activations.ptr(), activations.size(), copy, 1_000_000)?;
        activations.record_stream(copy);
        drop(activations); // freed now, reusable once the copy stream's work is done
        let next = pool.allocate_on(64 * MIB, compute)?;
        let early = sim.check_handout(next.ptr(), next.size(), compute);
        println!("step {step}: {:#x}, early reuses seen by the checker: {early}", next.ptr());
        assert_eq!(early, 0);
    }
    print_stats(&pool);
    Ok(())
}

/// On GPU 0: the pool hands out memory on streams a cudarc program made.
fn on_cuda_streams() -> Result<()> {
    let driver_error = |e: cudarc::driver::DriverError| Error::Io(format!("cudarc: {e}"));
    let ctx = cudarc::driver::CudaContext::new(0).map_err(driver_error)?;
    let (compute, copy) = (ctx.new_stream().map_err(driver_error)?, ctx.new_stream().map_err(driver_error)?);
    // A `Stream` is the driver's stream handle; cudarc's streams live in the device's primary
    // context, the one streamalloc uses.
    let (s1, s2) =
        (streamalloc::device::cuda::stream_of(&compute), streamalloc::device::cuda::stream_of(&copy));
    let device: Arc<dyn Device> = CudaDevice::new(0)?;
    let pool = StreamSafe::new(device, StreamSafeConfig::default())?;
    let mut a = pool.allocate_on(64 * MIB, s1)?;
    a.record_stream(s2);
    drop(a);
    let b = pool.allocate_on(64 * MIB, s2)?;
    println!("allocated {} bytes at {:#x} on a cudarc stream", b.size(), b.ptr());
    drop(b);
    compute.synchronize().map_err(driver_error)?;
    copy.synchronize().map_err(driver_error)?;
    print_stats(&pool);
    Ok(())
}

fn print_stats(pool: &StreamSafe) {
    let s = pool.stats();
    println!(
        "allocated {} bytes (peak {}), reserved {} bytes, {} device allocations",
        s.allocated, s.allocated_peak, s.reserved, s.device_allocs
    );
}

fn main() -> Result<()> {
    match std::env::args().nth(1).as_deref() {
        Some("cuda") => on_cuda_streams(),
        _ => on_the_simulator(),
    }
}
