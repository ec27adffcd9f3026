//! A check of the stitched backing shared by the simulator's tests and the GPU tests: data
//! across granule boundaries of a growth stitched from the granules of freed blocks.

use std::sync::Arc;

use streamalloc::allocators::{BackingKind, BestFit, BestFitConfig};
use streamalloc::device::DeviceTestExt;
use streamalloc::{Allocation, Allocator, Stream};

/// A byte pattern that differs in every 4 KiB page and by `seed`.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31) ^ ((i >> 12) as u8) ^ seed).collect()
}

fn write(device: &dyn DeviceTestExt, x: &Allocation, seed: u8, stream: Stream) -> Vec<u8> {
    let data = pattern(x.size(), seed);
    device.copy_from_host(x.ptr(), &data, stream).expect("copy to device");
    data
}

fn read(device: &dyn DeviceTestExt, x: &Allocation, stream: Stream) -> Vec<u8> {
    let mut back = vec![0; x.size()];
    device.copy_to_host(&mut back, x.ptr(), stream).expect("copy to host");
    back
}

/// Writes patterns to eight blocks of three granules of a stitched pool used on `stream`,
/// frees every other one, and asks for a block larger than any free one: the growth stitches
/// the freed blocks' granules. Checks that every granule of the new block holds the bytes of
/// a freed granule (its memory was mapped again, not replaced), that a pattern written across
/// all its granules reads back, that the live blocks kept their bytes, and that blocks
/// straddling granule boundaries after it do too.
pub fn stitched_growth_keeps_data(device: Arc<dyn DeviceTestExt>, stream: Stream) {
    let d = device.as_ref();
    let g = device.map_granularity().expect("granularity");
    let config = BestFitConfig { backing: BackingKind::Stitched, stream, ..Default::default() };
    let pool = BestFit::new(device.clone(), config).expect("pool");
    let blocks: Vec<Allocation> = (0..8).map(|_| pool.allocate(3 * g).expect("block")).collect();
    let data: Vec<Vec<u8>> = blocks.iter().enumerate().map(|(i, x)| write(d, x, i as u8, stream)).collect();
    let mut freed_granules: Vec<&[u8]> = Vec::new();
    let mut live = Vec::new();
    for (i, (x, bytes)) in blocks.into_iter().zip(&data).enumerate() {
        if i % 2 == 0 {
            live.push((x, bytes));
        } else {
            freed_granules.extend(bytes.chunks(g));
        }
    }
    // Larger than any free block: the last freed block and granules of the other holes.
    let big = pool.allocate(10 * g + g / 2).expect("stitched allocation");
    let held = read(d, &big, stream);
    for (k, granule) in held.chunks_exact(g).enumerate() {
        assert!(
            freed_granules.contains(&granule),
            "granule {k} of the stitched block does not hold the bytes of a freed granule"
        );
    }
    let fresh = write(d, &big, 0xA5, stream);
    assert!(read(d, &big, stream) == fresh, "a stitched range lost data across granules");
    for (x, bytes) in &live {
        assert!(read(d, x, stream) == **bytes, "a live block changed while holes were stitched");
    }
    // Freed and served again at an offset that straddles granule boundaries.
    drop(big);
    let a = pool.allocate(g + g / 2).expect("a");
    let b = pool.allocate(3 * g).expect("b");
    let (da, db) = (write(d, &a, 1, stream), write(d, &b, 2, stream));
    assert!(read(d, &a, stream) == da && read(d, &b, stream) == db);
    for (x, bytes) in &live {
        assert!(read(d, x, stream) == **bytes, "a live block changed");
    }
    drop((a, b, live));
    assert!(pool.release().expect("release") > 0);
}
