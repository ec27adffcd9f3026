//! The stitched backing on the simulator: stitching of free granules without host waits, data
//! across stitched granules, and random programs against the ordering checker (its footprint
//! on traces: streamalloc-replay's tests).

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod stitch_data;

use std::sync::Arc;

use proptest::prelude::*;
use streamalloc::allocators::{BackingKind, BestFit, BestFitConfig, StreamSafe, StreamSafeConfig};
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::device::{DeviceMemory, DeviceTestExt, Streams};
use streamalloc::{Allocation, Allocator, Error, Stream, StreamAllocator};

const MIB: usize = 1 << 20;

fn stitched() -> BestFitConfig {
    BestFitConfig { backing: BackingKind::STITCHED, ..Default::default() }
}

fn used(sim: &SimDevice) -> usize {
    sim.mem_info().expect("mem info").used()
}

/// Six blocks of `size` that `stream` uses for `ns`, every other one freed at once: the
/// three kept.
fn every_other_in_use(
    pool: &BestFit,
    sim: &SimDevice,
    stream: Stream,
    size: usize,
    ns: u64,
) -> Vec<Allocation> {
    let blocks: Vec<Allocation> = (0..6).map(|_| pool.allocate(size).unwrap()).collect();
    for x in &blocks {
        sim.use_range(x.ptr(), x.size(), stream, ns).unwrap();
    }
    blocks.into_iter().enumerate().filter(|(i, _)| i % 2 == 0).map(|(_, x)| x).collect()
}

#[test]
fn stitching_pays_for_a_growth_with_free_granules_of_both_classes() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let s = sim.create_stream().unwrap();
    let pool = BestFit::new(sim.clone(), BestFitConfig { stream: s, ..stitched() }).unwrap();
    let start = used(&sim);
    // Small blocks fill a granule; a large block takes 6 MiB after it.
    let small: Vec<Allocation> = (0..8).map(|_| pool.allocate(256 << 10).unwrap()).collect();
    let a = pool.allocate(6 * MIB).unwrap();
    let b = pool.allocate(6 * MIB).unwrap();
    assert_eq!(used(&sim) - start, 14 * MIB);
    // The stream still uses `a` when it is freed.
    sim.use_range(a.ptr(), a.size(), s, 1_000_000).unwrap();
    drop(a);
    drop(small);
    // 12 MiB fits no free block; the memory of the 8 MiB free (6 of `a`, 2 of the small
    // blocks) is mapped again inside the 12 MiB range, and 4 MiB of new memory after it: 4 MiB
    // more than the peak, not 12.
    let waits = sim.host_waits();
    let c = pool.allocate(12 * MIB).unwrap();
    assert_eq!(sim.host_waits(), waits, "the stitch waited for the stream");
    assert!(sim.now() < 1_000_000);
    assert_eq!(used(&sim) - start, 18 * MIB);
    assert_eq!(pool.stats().reserved, 18 * MIB);
    // `c` holds the memory the stream still uses through `a`'s old address: ordered on the
    // stream, a handout to another stream now would be an early reuse (the checker sees it).
    assert_eq!(sim.check_handout(c.ptr(), c.size(), s), 0);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    let other = sim.create_stream().unwrap();
    assert!(sim.check_handout(c.ptr(), c.size(), other) > 0, "the checker missed the alias");
    drop((b, c));
    assert_eq!(pool.release().unwrap(), 18 * MIB, "release unmaps every free granule");
    assert_eq!(used(&sim), start);
}

#[test]
fn stitching_growths_make_no_host_wait() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let s = sim.create_stream().unwrap();
    let pool = BestFit::new(sim.clone(), BestFitConfig { stream: s, ..stitched() }).unwrap();
    let (waits, aliases) = (sim.host_waits(), sim.aliases());
    for round in 0..24 {
        // Blocks the stream uses, every other one freed at once, then a block larger than any
        // free one: the free granules pay for it while the stream still runs.
        let size = (3 + round % 5) * MIB;
        let kept = every_other_in_use(&pool, &sim, s, size, 500_000);
        let big = pool.allocate(4 * size).unwrap();
        sim.use_range(big.ptr(), big.size(), s, 500_000).unwrap();
        drop((kept, big));
    }
    assert_eq!(sim.host_waits(), waits, "stitching growths waited for the device");
    // A stitch for each of the five sizes at least (later rounds may take their ranges back).
    assert!(sim.aliases() >= aliases + 5, "only {} stitches", sim.aliases() - aliases);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    // The old ranges of stitched granules went back to the reservation as the stream ran on.
    sim.synchronize_stream(s).unwrap();
    pool.release().unwrap();
    assert_eq!(pool.stats().reserved, 0);
}

#[test]
fn a_repeated_workload_reuses_its_stitched_ranges_without_mapping() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let s = sim.create_stream().unwrap();
    let pool = BestFit::new(sim.clone(), BestFitConfig { stream: s, ..stitched() }).unwrap();
    // One step of a training loop: activations of three sizes, every other one freed, then
    // a block larger than any free one (stitched from their granules), and small blocks.
    let step = || {
        let before = sim.mapping_calls();
        for size in [3 * MIB, 5 * MIB, 7 * MIB] {
            let kept = every_other_in_use(&pool, &sim, s, size, 200_000);
            let big = pool.allocate(4 * size).unwrap();
            let small: Vec<Allocation> = (0..4).map(|_| pool.allocate(300 << 10).unwrap()).collect();
            sim.use_range(big.ptr(), big.size(), s, 200_000).unwrap();
            drop((kept, big, small));
        }
        sim.mapping_calls() - before
    };
    let first = step();
    let later: Vec<u64> = (0..6).map(|_| step()).collect();
    assert!(first > 0 && sim.aliases() > 0, "the first step stitched nothing");
    assert_eq!(later[2..], [0; 4], "steps after the first few still map: {first} then {later:?}");
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    let peak = pool.stats().reserved;
    sim.synchronize_stream(s).unwrap();
    assert_eq!(pool.release().unwrap(), peak, "release unmaps the idle ranges and every granule");
}

#[test]
fn a_repeated_workload_on_stream_safe_makes_no_device_call_once_warm() {
    // The facade's stitched configuration: StreamSafe over a stitched pool, as a user gets it.
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let s = sim.create_stream().unwrap();
    let config = StreamSafeConfig { pool: stitched(), ..Default::default() };
    let alloc = StreamSafe::new(sim.clone(), config).unwrap();
    // A step: blocks of three sizes, every other one freed, then a block larger than any free
    // one (stitched from their granules, idle once freed, taken back at the next step).
    let step = || {
        let before = sim.calls();
        for size in [3 * MIB, 5 * MIB, 7 * MIB] {
            let blocks: Vec<Allocation> = (0..6).map(|_| alloc.allocate_on(size, s).unwrap()).collect();
            let kept: Vec<Allocation> = blocks.into_iter().step_by(2).collect();
            let big = alloc.allocate_on(4 * size, s).unwrap();
            drop((kept, big));
        }
        sim.calls() - before
    };
    let first = step();
    let later: Vec<u64> = (0..6).map(|_| step()).collect();
    assert!(first > 0 && sim.aliases() > 0, "the first step stitched nothing");
    // Each stitched range is taken back from the pool's books: no capture query, no memory
    // query, no mapping.
    assert_eq!(later[2..], [0; 4], "device calls per step: {first} then {later:?}");
}

#[test]
fn a_request_over_128_kib_leaves_the_rest_of_a_large_block_to_large_requests() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let pool = BestFit::new(sim.clone(), stitched()).unwrap();
    drop(pool.allocate(8 * MIB).unwrap());
    // 256 KiB is large on a stitched pool: carved out of the free 8 MiB block, not out of a
    // granule given to the small class, so the rest of the block serves the next request.
    let medium = pool.allocate(256 << 10).unwrap();
    let calls = sim.mapping_calls();
    let rest = pool.allocate(8 * MIB - (256 << 10)).unwrap();
    assert_eq!(sim.mapping_calls(), calls, "the rest of the block did not serve the request");
    assert_eq!(pool.stats().reserved, 8 * MIB);
    drop((medium, rest));
}

#[test]
fn a_stitch_takes_the_largest_free_blocks_which_best_fit_hands_out_last() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let pool = BestFit::new(sim.clone(), stitched()).unwrap();
    // Free blocks of 4, 8 and 8 MiB between blocks kept.
    let mut blocks: Vec<Option<Allocation>> =
        [4, 2, 8, 2, 8, 2].map(|n| Some(pool.allocate(n * MIB).unwrap())).into_iter().collect();
    for i in [0, 2, 4] {
        blocks[i] = None;
    }
    // 12 MiB fits none: stitched from the two 8 MiB blocks, not from the 4 MiB one and an 8.
    let aliases = sim.aliases();
    drop(pool.allocate(12 * MIB).unwrap());
    assert_eq!(sim.aliases() - aliases, 1, "the miss did not stitch");
    // A 4 MiB block takes the smallest free block that fits: none of the idle range's homes,
    // which serves the same miss again without mapping.
    let four = pool.allocate(4 * MIB).unwrap();
    let calls = sim.mapping_calls();
    let again = pool.allocate(12 * MIB).unwrap();
    assert_eq!(sim.mapping_calls(), calls, "the idle range's homes were handed out");
    drop((four, again, blocks));
}

#[test]
fn small_blocks_lie_apart_from_the_memory_large_blocks_freed() {
    // A small request that found no small block took a whole granule of a free large block
    // at its address; the granule then stayed small (parked small blocks keep it), and a
    // repeated workload's next pass found it where its first pass had put a large block.
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let pool = BestFit::new(sim.clone(), stitched()).unwrap();
    let a = pool.allocate(8 * MIB).unwrap();
    let b = pool.allocate(8 * MIB).unwrap();
    let freed = a.ptr();
    drop(a);
    let small = pool.allocate(4096).unwrap();
    assert!(small.ptr() >= b.ptr() + 8 * MIB as u64, "a small block at {:#x}, in large memory", small.ptr());
    let calls = sim.mapping_calls();
    let again = pool.allocate(8 * MIB).unwrap();
    assert_eq!(again.ptr(), freed, "the large block's memory went to the small class");
    assert_eq!(sim.mapping_calls(), calls);
    drop((small, b, again));
}

#[test]
fn a_stitched_growth_keeps_data_across_granules() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let start = used(&sim);
    stitch_data::stitched_growth_keeps_data(sim.clone(), Stream::DEFAULT);
    assert_eq!(used(&sim), start);
}

#[test]
fn a_stitch_ends_with_the_free_head_of_a_granule_and_keeps_its_neighbour() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let start = used(&sim);
    stitch_data::stitched_head_keeps_its_neighbour(sim.clone(), Stream::DEFAULT);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(used(&sim), start);
}

#[test]
fn a_growth_into_an_unmapped_run_merges_with_the_free_blocks_on_both_sides() {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let pool = BestFit::new(sim.clone(), stitched()).unwrap();
    let start = used(&sim);
    let a = pool.allocate(4 * MIB).unwrap();
    let b = pool.allocate(4 * MIB).unwrap();
    let c = pool.allocate(4 * MIB).unwrap();
    drop(b);
    // Release unmaps the hole `b` left: the run between `a` and `c` is unmapped now.
    assert_eq!(pool.release().unwrap(), 4 * MIB);
    drop((a, c));
    // 12 MiB: the free 4 MiB on each side of the run and the run itself, mapped again.
    let d = pool.allocate(12 * MIB).unwrap();
    assert_eq!(used(&sim) - start, 12 * MIB);
    drop(d);
    drop(pool);
    assert_eq!(used(&sim), start, "dropping the pool unmaps everything");
}

#[test]
fn out_of_memory_stitches_every_free_granule_then_reports() {
    let sim = SimDevice::new(SimConfig::with_capacity(64 * MIB));
    let pool = BestFit::new(sim.clone(), stitched()).unwrap();
    let xs: Vec<Allocation> = (0..6).map(|_| pool.allocate(8 * MIB).unwrap()).collect();
    // Free every other block: 24 MiB free in three holes of 8 MiB, 16 MiB of the device left.
    let kept: Vec<Allocation> =
        xs.into_iter().enumerate().filter(|(i, _)| i % 2 == 0).map(|(_, x)| x).collect();
    let big = pool.allocate(40 * MIB).unwrap();
    assert_eq!(pool.stats().allocated, 64 * MIB);
    let err = pool.allocate(4 * MIB).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory(_)), "{err}");
    drop((kept, big));
}

/// What a random program does.
#[derive(Debug, Clone)]
enum Action {
    Alloc { stream: usize, size: usize },
    Free { idx: usize },
    Use { idx: usize, stream: usize, ns: u64 },
    Advance { ns: u64 },
    Sync { stream: usize },
    Release,
}

fn actions() -> impl Strategy<Value = Vec<Action>> {
    let size = prop_oneof![1..(MIB + 1), (MIB + 1)..(24 * MIB)];
    let action = prop_oneof![
        5 => (0..3usize, size).prop_map(|(stream, size)| Action::Alloc { stream, size }),
        4 => any::<usize>().prop_map(|idx| Action::Free { idx }),
        3 => (any::<usize>(), 0..3usize, 1..3_000_000u64).prop_map(|(idx, stream, ns)| Action::Use { idx, stream, ns }),
        1 => (1..2_000_000u64).prop_map(|ns| Action::Advance { ns }),
        1 => (0..3usize).prop_map(|stream| Action::Sync { stream }),
        1 => Just(Action::Release),
    ];
    proptest::collection::vec(action, 1..150)
}

/// Runs `program` on a 192 MiB simulated device (so that stitching and out-of-memory
/// releases happen) against StreamSafe over stitched ranges, or BestFit over them for
/// `on_one_pool`. Every handout is checked; the only error an allocation may meet is
/// out-of-memory. Returns the ordering checker's violations.
fn run(program: &[Action], on_one_pool: bool) -> usize {
    let sim = SimDevice::new(SimConfig::with_capacity(192 * MIB));
    let start = used(&sim);
    let streams: Vec<Stream> = (0..3).map(|_| sim.create_stream().unwrap()).collect();
    let alloc: Arc<dyn StreamAllocator> = match on_one_pool {
        true => Arc::new(streamalloc::adaptors::SingleStream::new(
            BestFit::new(sim.clone(), BestFitConfig { stream: streams[0], ..stitched() }).unwrap(),
            sim.clone(),
            streams[0],
        )),
        false => Arc::new(
            StreamSafe::new(sim.clone(), StreamSafeConfig { pool: stitched(), ..Default::default() })
                .unwrap(),
        ),
    };
    let mut live: Vec<(Allocation, u8)> = Vec::new();
    let mut next_value = 0u8;
    // Every live block still holds the byte its owner wrote into it.
    let check_data = |live: &[(Allocation, u8)]| {
        for (x, value) in live {
            let mut back = vec![0; x.size()];
            sim.copy_to_host(&mut back, x.ptr(), x.owning_stream()).unwrap();
            assert!(back == vec![*value; x.size()], "a live block of {} bytes lost its data", x.size());
        }
    };
    for action in program {
        match *action {
            Action::Alloc { stream, size } => match alloc.allocate_on(size, streams[stream]) {
                Ok(x) => {
                    assert_eq!(sim.check_handout(x.ptr(), x.size(), x.owning_stream()), 0);
                    next_value = next_value.wrapping_add(1);
                    sim.memset_async(x.ptr(), next_value, x.size(), x.owning_stream()).unwrap();
                    live.push((x, next_value));
                }
                Err(Error::OutOfMemory(_)) => {}
                Err(e) => panic!("allocation of {size} bytes: {e}"),
            },
            Action::Free { idx } if !live.is_empty() => {
                let n = live.len();
                live.swap_remove(idx % n);
            }
            Action::Use { idx, stream, ns } if !live.is_empty() => {
                let n = live.len();
                let x = &mut live[idx % n].0;
                x.record_stream(streams[stream]);
                sim.use_range(x.ptr(), x.size(), streams[stream], ns).unwrap();
            }
            Action::Advance { ns } => sim.advance(ns),
            Action::Sync { stream } => sim.synchronize_stream(streams[stream]).unwrap(),
            Action::Release => {
                check_data(&live);
                alloc.release().unwrap();
            }
            _ => {}
        }
    }
    check_data(&live);
    drop(live);
    drop(alloc);
    assert_eq!(used(&sim), start, "everything goes back when the allocator is dropped");
    sim.violations().len()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    #[test]
    fn random_programs_on_stream_safe_break_no_ordering(program in actions()) {
        prop_assert_eq!(run(&program, false), 0);
    }

    #[test]
    fn random_programs_on_one_pool_break_no_ordering(program in actions()) {
        prop_assert_eq!(run(&program, true), 0);
    }
}

/// A program may destroy a stream once its allocations are freed, without retiring the
/// stream's pool (the CLI's replay did): dropping the pools then names no stream, as a chunk's
/// `cuMemFree` names none (on an H200 the stitched pool's wait for its destroyed stream
/// crashed the process), and every mapping goes back.
#[test]
fn dropping_pools_names_no_destroyed_stream() {
    for backing in [BackingKind::CHUNKS, BackingKind::SEGMENTS, BackingKind::STITCHED] {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let pool = BestFitConfig { backing, ..Default::default() };
        let alloc = StreamSafe::new(sim.clone(), StreamSafeConfig { pool, ..Default::default() }).unwrap();
        let s = sim.create_stream().unwrap();
        for size in [40 * MIB, 3 * MIB, 4096] {
            let a = alloc.allocate_on(size, s).unwrap();
            sim.use_range(a.ptr(), a.size(), s, 1_000).unwrap();
        }
        // Destroyed with its work still running: the teardown waits for it all the same.
        sim.destroy_stream(s).unwrap();
        drop(alloc);
        assert_eq!(sim.unknown_stream_calls(), 0, "{backing:?}");
        assert_eq!(used(&sim), 0, "{backing:?}");
    }
}
