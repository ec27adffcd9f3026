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
    let config = BestFitConfig { backing: BackingKind::STITCHED, stream, ..Default::default() };
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

/// Leaves free two whole granules and, apart from them, the first half of a granule whose
/// other half a live block holds, then asks for two granules and a quarter: the growth
/// stitches the two granules and ends with that half granule, mapping no new memory. Checks
/// that the new block holds the freed bytes in that order, and that writing all of it leaves
/// the live block in the shared granule (mapped a second time, whole, by the stitched range)
/// as it was.
pub fn stitched_head_keeps_its_neighbour(device: Arc<dyn DeviceTestExt>, stream: Stream) {
    let d = device.as_ref();
    let g = device.map_granularity().expect("granularity");
    let config = BestFitConfig { backing: BackingKind::STITCHED, stream, ..Default::default() };
    let pool = BestFit::new(device.clone(), config).expect("pool");
    let two = pool.allocate(2 * g).expect("two granules");
    let between = pool.allocate(g).expect("a granule between");
    let head = pool.allocate(g / 2).expect("a granule's first half");
    let neighbour = pool.allocate(g / 2).expect("its second half");
    let [d_two, d_between, d_head, d_neighbour] =
        [(&two, 1), (&between, 2), (&head, 3), (&neighbour, 4)].map(|(x, seed)| write(d, x, seed, stream));
    assert_eq!(pool.stats().reserved, 4 * g);
    drop((two, head));
    let big = pool.allocate(2 * g + g / 4).expect("stitched allocation");
    assert_eq!(pool.stats().reserved, 4 * g, "the stitch mapped new memory for its last quarter");
    let held = read(d, &big, stream);
    assert!(held[..2 * g] == d_two[..], "the stitched range does not begin with the free granules");
    assert!(held[2 * g..] == d_head[..g / 4], "the stitched range does not end with the free head");
    let fresh = write(d, &big, 0x5A, stream);
    assert!(read(d, &big, stream) == fresh, "a stitched range lost data across granules");
    assert!(read(d, &neighbour, stream) == d_neighbour, "the block sharing the head's granule changed");
    assert!(read(d, &between, stream) == d_between, "a live block changed");
    // Idle, the range is taken again for the same request without a new mapping.
    drop(big);
    let again = pool.allocate(2 * g + g / 4).expect("again");
    assert!(read(d, &again, stream) == fresh, "the idle range was not taken again");
    assert_eq!(pool.stats().reserved, 4 * g);
    drop((again, between, neighbour));
    assert_eq!(pool.release().expect("release"), 4 * g);
}
