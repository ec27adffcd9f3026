//! What the parts of an allocation by pointer cost one thread on this machine, each alone: a
//! lock taken and released (each pool and each shard of the `Pointers` table has one), a
//! reference count taken and dropped (each handle holds its owner), a handle made and dropped
//! through its owner, and a map's insert and remove of a handle (the `Pointers` table) against
//! those of a 24-byte entry (the table each pool kept before). `bench/results/cpu-cost.md`
//! reads the one allocation path's cost from them. Run: `cargo bench -p streamalloc-bench
//! --bench path_parts`.

// A benchmark: a failed unwrap or expect stops it, as it should.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use streamalloc::{Allocation, Block, BlockOwner, Stream};

/// An owner whose free takes a lock, as a pool's does.
struct Owner(Mutex<u64>);

impl BlockOwner for Owner {
    fn free(&self, block: Block) {
        *self.0.lock() += block.size as u64;
    }
}

/// Live entries the maps hold while measured (a trace's live allocations are of this order).
const LIVE: u64 = 2_000;

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("path_parts");
    let lock = Mutex::new(0u64);
    group.bench_function("lock_and_release", |b| b.iter(|| *lock.lock() += 1));
    let owner = Arc::new(Owner(Mutex::new(0)));
    group.bench_function("reference_count_take_and_drop", |b| b.iter(|| drop(black_box(owner.clone()))));
    let block = |ptr: u64| Block { ptr, size: 256, stream: Stream::forged(1), ..Block::default() };
    group.bench_function("handle_make_and_drop", |b| {
        b.iter(|| drop(black_box(Allocation::new(block(1 << 40), owner.clone()))))
    });
    let mut handles: FxHashMap<u64, Allocation> =
        (0..LIVE).map(|k| (k << 12, Allocation::empty(0, Stream::forged(1)))).collect();
    handles.reserve(4 * LIVE as usize);
    let mut i = 0u64;
    group.bench_function("map_insert_and_remove_handle", |b| {
        b.iter(|| {
            i = (i + 1) % 1_000;
            let k = (1 << 41) + (i << 8);
            handles.insert(k, Allocation::empty(0, Stream::forged(1)));
            black_box(handles.remove(&k))
        })
    });
    let mut small: FxHashMap<u64, (u64, usize)> = (0..LIVE).map(|k| (k << 12, (k, 256))).collect();
    small.reserve(4 * LIVE as usize);
    group.bench_function("map_insert_and_remove_24_bytes", |b| {
        b.iter(|| {
            i = (i + 1) % 1_000;
            let k = (1 << 41) + (i << 8);
            small.insert(k, (k, 256));
            black_box(small.remove(&k))
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
