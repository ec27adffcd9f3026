//! GPU tests of the stitched backing: data written through ranges stitched from granules
//! of holes, checked across granule boundaries, and live data kept in place while free
//! memory around it is stitched. `#[ignore]`d: CI has no GPU; `scripts/gpu-test.sh` runs
//! them on a GPU machine, where they fail, never pass, without a usable device.

mod gpu_common;

use gpu_common::gpu;
use streamalloc::allocators::{BackingKind, BestFit, BestFitConfig};
use streamalloc::{Allocation, Allocator, Device, Stream};

const MIB: usize = 1 << 20;

/// A byte pattern that differs in every 4 KiB page and by `seed`.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31) ^ ((i >> 12) as u8) ^ seed).collect()
}

fn write(device: &dyn Device, x: &Allocation, seed: u8) -> Vec<u8> {
    let data = pattern(x.size(), seed);
    device.copy_from_host(x.ptr(), &data, Stream::DEFAULT).expect("copy to device");
    data
}

fn read(device: &dyn Device, x: &Allocation) -> Vec<u8> {
    let mut back = vec![0; x.size()];
    device.copy_to_host(&mut back, x.ptr(), Stream::DEFAULT).expect("copy to host");
    back
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn stitched_ranges_hold_data_across_granule_boundaries() {
    let device = gpu();
    let g = device.map_granularity().expect("granularity");
    let config = BestFitConfig { backing: BackingKind::Stitched, ..Default::default() };
    let pool = BestFit::new(device.clone(), config).expect("pool");
    // Holes between live blocks: every other block of 3 granules is freed.
    let blocks: Vec<Allocation> = (0..8).map(|_| pool.allocate(3 * g).expect("block")).collect();
    let mut live = Vec::new();
    for (i, x) in blocks.into_iter().enumerate() {
        if i % 2 == 0 {
            let data = write(device.as_ref(), &x, i as u8);
            live.push((x, data));
        }
    }
    // A request larger than any hole: the holes' granules are unmapped and a range mapped
    // in their place, several granules long.
    let big = pool.allocate(10 * g + MIB).expect("stitched allocation");
    let data = write(device.as_ref(), &big, 0xA5);
    assert!(read(device.as_ref(), &big) == data, "a stitched range lost data across granules");
    for (x, data) in &live {
        assert!(read(device.as_ref(), x) == *data, "a live block changed while holes were stitched");
    }
    // Freed and served again at an offset that straddles granule boundaries.
    drop(big);
    let a = pool.allocate(g + g / 2).expect("a");
    let b = pool.allocate(3 * g).expect("b");
    let (da, db) = (write(device.as_ref(), &a, 1), write(device.as_ref(), &b, 2));
    assert!(read(device.as_ref(), &a) == da && read(device.as_ref(), &b) == db);
    drop((a, b, live));
    assert!(pool.release().expect("release") > 0);
}

#[test]
#[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
fn stitching_waits_for_the_pools_stream_before_unmapping() {
    let device = gpu();
    let s = device.create_stream().expect("stream");
    let config = BestFitConfig { backing: BackingKind::Stitched, stream: s, ..Default::default() };
    let pool = BestFit::new(device.clone(), config).expect("pool");
    let a = pool.allocate(8 * MIB).expect("a");
    let keep = pool.allocate(8 * MIB).expect("keep");
    // Work still queued on the pool's stream uses `a` when it is freed.
    let go = gpu_common::block_stream(&device, s);
    device.memset_async(a.ptr(), 7, a.size(), s).expect("memset");
    drop(a);
    let release = std::thread::spawn(move || go.store(true, std::sync::atomic::Ordering::Release));
    // The growth stitches `a`'s granules: it must wait for the memset, or the unmap faults it.
    let big = pool.allocate(12 * MIB).expect("stitched allocation");
    release.join().expect("thread");
    device.synchronize_stream(s).expect("the stream's work completed without a fault");
    let data = write(device.as_ref(), &big, 3);
    assert!(read(device.as_ref(), &big) == data);
    drop((big, keep, pool));
    device.destroy_stream(s).expect("destroy stream");
}
