//! GPU tests of the stitched backing: data written through ranges stitched from granules
//! of freed blocks, checked across granule boundaries, live data kept in place while free
//! memory around it is stitched, and a stitch made while the pool's stream is busy.
//! `#[ignore]`d: CI has no GPU; `scripts/gpu-test.sh` runs them on a GPU machine, where they
//! fail, never pass, without a usable device.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod gpu_common;
mod stitch_data;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use gpu_common::gpu;
use streamalloc::allocators::{BackingKind, BestFit, BestFitConfig};
use streamalloc::{Allocator, Stream};

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn stitched_ranges_hold_data_across_granule_boundaries() {
    let device = gpu();
    let s = device.create_stream().expect("stream");
    stitch_data::stitched_growth_keeps_data(device.clone(), Stream::DEFAULT);
    stitch_data::stitched_growth_keeps_data(device.clone(), s);
    stitch_data::stitched_head_keeps_its_neighbour(device.clone(), Stream::DEFAULT);
    stitch_data::stitched_head_keeps_its_neighbour(device.clone(), s);
    device.destroy_stream(s).expect("destroy stream");
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn stitching_does_not_wait_for_the_pools_stream() {
    let device = gpu();
    let g = device.map_granularity().expect("granularity");
    let s = device.create_stream().expect("stream");
    let config = BestFitConfig { backing: BackingKind::STITCHED, stream: s, ..Default::default() };
    let pool = BestFit::new(device.clone(), config).expect("pool");
    let a = pool.allocate(4 * g).expect("a");
    let keep = pool.allocate(4 * g).expect("keep");
    device.memset_async(keep.ptr(), 5, keep.size(), s).expect("memset");
    // Work queued on the pool's stream behind a blocked host function uses `a` when it is freed.
    let go = gpu_common::block_stream(&device, s);
    device.memset_async(a.ptr(), 7, a.size(), s).expect("memset");
    drop(a);
    // The growth maps `a`'s memory again inside its range, while the stream is still blocked.
    let start = Instant::now();
    let big = pool.allocate(6 * g).expect("stitched allocation");
    let took = start.elapsed();
    // Ordered after the memset of 7 by the stream alone.
    device.memset_async(big.ptr(), 3, big.size(), s).expect("memset");
    go.store(true, Ordering::Release);
    assert!(took < Duration::from_millis(500), "the stitched growth took {took:?}: it waited for the stream");
    let mut back = vec![0; big.size()];
    device.copy_to_host(&mut back, big.ptr(), s).expect("the stream's work completed without a fault");
    assert!(gpu_common::all(&back, 3), "the stitched block holds bytes of an earlier use");
    let mut kept = vec![0; keep.size()];
    device.copy_to_host(&mut kept, keep.ptr(), s).expect("copy");
    assert!(gpu_common::all(&kept, 5), "the live block changed");
    drop((big, keep));
    assert!(pool.release().expect("release") >= 6 * g);
    drop(pool);
    device.destroy_stream(s).expect("destroy stream");
}

/// A request the device cannot hold (twice its memory; its free memory and a GiB) fails with
/// out-of-memory without taking the device's free memory while it fails: other processes and
/// pools keep theirs.
#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn a_request_beyond_free_memory_fails_without_taking_it() {
    let device = gpu();
    let config = BestFitConfig { backing: BackingKind::STITCHED, ..Default::default() };
    let pool = BestFit::new(device.clone(), config).expect("pool");
    let info = device.mem_info().expect("mem_info");
    for size in [2 * info.total, info.free + (1 << 30)] {
        let before = device.mem_info().expect("mem_info").free;
        let (result, least) = gpu_common::least_free_during(&device, || pool.allocate(size));
        assert!(
            matches!(&result, Err(streamalloc::Error::OutOfMemory(_))),
            "{size} bytes: expected out-of-memory, got {:?}",
            result.map(|a| a.size())
        );
        assert!(
            least >= before / 2,
            "while {size} bytes failed, the device's free memory fell from {before} to {least} bytes"
        );
    }
    assert_eq!(pool.stats().reserved, 0, "the failed requests left memory in the pool");
}
