//! Tags, sleep and wake (issue 36) on the simulator: a tag's memory goes back to the device
//! and comes back at the same addresses, its contents with it where offloaded; the sleep waits
//! for the streams that use the memory and for no other; every misuse has its answer; the
//! ordering checker sees no early reuse and no unmap under a kernel, with threads at work.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use streamalloc::device::sim::{SimConfig, SimDevice, ViolationKind};
use streamalloc::device::{DeviceMemory, DeviceTestExt, Streams};
use streamalloc::facade::{Config, Facade};
use streamalloc::{tags, Allocation, Allocator, Error, Stream, StreamAllocator};

const MIB: usize = 1 << 20;
const GRANULE: usize = 2 * MIB;

/// A facade on a simulated device (of 1 GiB unless `conf` says) configured by `conf`; its
/// simulator.
fn facade(conf: &str) -> (Facade, Arc<SimDevice>) {
    let capacity = if conf.contains("sim_capacity") { "" } else { ",sim_capacity=1GiB" };
    let f = Facade::new(Config::parse(&format!("device=sim{capacity},{conf}")).expect("config"));
    let sim = f.stack(0).expect("stack").sim.clone().expect("simulator");
    (f, sim)
}

/// Allocates `size` bytes on `stream` under `tag` (untagged for `None`).
fn alloc(f: &Facade, tag: Option<&str>, size: usize, stream: Stream) -> streamalloc::Result<Allocation> {
    let _scope = tag.map(|t| tags::scope(t).expect("tag"));
    f.allocate(size, 0, stream)
}

/// Bytes that differ from one allocation to the next.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
}

fn read(sim: &SimDevice, a: &Allocation, stream: Stream) -> Vec<u8> {
    let mut out = vec![0; a.size()];
    sim.copy_to_host(&mut out, a.ptr(), stream).expect("read");
    out
}

fn used(sim: &SimDevice) -> usize {
    sim.mem_info().expect("mem_info").used()
}

/// Blocks of a stitched range and of the home area of a tag: small blocks, two of 6 MiB of
/// which the first and the small ones are freed, and a block of 12 MiB that the freed memory
/// pays for, mapped a second time (a stitched range).
fn stitched_blocks(f: &Facade, sim: &SimDevice, tag: &str, s: Stream) -> (Allocation, Allocation) {
    let small: Vec<Allocation> = (0..8).map(|_| alloc(f, Some(tag), 256 << 10, s).expect("small")).collect();
    let a = alloc(f, Some(tag), 6 * MIB, s).expect("a");
    let b = alloc(f, Some(tag), 6 * MIB, s).expect("b");
    drop(a);
    drop(small);
    let aliases = sim.aliases();
    let c = alloc(f, Some(tag), 12 * MIB, s).expect("c");
    assert_eq!(sim.aliases(), aliases + 1, "c is a stitched range");
    (b, c)
}

#[test]
fn an_offloaded_sleep_gives_the_memory_back_and_the_wake_restores_it_at_the_same_addresses() {
    let (f, sim) = facade("");
    let s = sim.create_stream().unwrap();
    let (b, c) = stitched_blocks(&f, &sim, "kv_cache", s);
    let weights = alloc(&f, Some("weights"), 40 * MIB, s).unwrap();
    let plain = alloc(&f, None, 20 * MIB, s).unwrap();
    let data: Vec<Vec<u8>> =
        [&b, &c, &weights, &plain].iter().enumerate().map(|(i, a)| pattern(a.size(), i as u8)).collect();
    for (a, d) in [&b, &c, &weights, &plain].iter().zip(&data) {
        sim.copy_from_host(a.ptr(), d, s).unwrap();
    }
    let (used_before, reserved_before) = (used(&sim), f.stats(0).reserved);
    let slept = f.sleep(0, &["kv_cache", "weights"], true).unwrap();
    // Every home granule of the two tags held data: what went back is what they reserved.
    assert!(slept >= b.size() + c.size() + weights.size(), "slept {slept}");
    assert_eq!(used(&sim), used_before - slept, "the device's memory dropped by the bytes slept");
    let reserved = f.stats(0).reserved;
    assert!(
        reserved_before - reserved >= slept && reserved_before - reserved - slept < GRANULE,
        "{reserved_before} -> {reserved}, slept {slept}"
    );
    let kv = f.tag_stats(0, "kv_cache").unwrap();
    assert!(kv.asleep && kv.offloaded && kv.slept > 0 && kv.stats.reserved == 0, "{kv:?}");
    assert_eq!(kv.stats.live_allocations, 2);
    assert_eq!(f.tag_stats(0, "weights").unwrap().slept + kv.slept, slept);
    // Untagged memory stays.
    assert_eq!(read(&sim, &plain, s), data[3]);

    assert_eq!(f.wake(0, &["weights", "kv_cache"]).unwrap(), slept);
    assert_eq!(used(&sim), used_before, "a stitched range and its homes share memory again");
    assert_eq!(f.stats(0).reserved, reserved_before);
    for (a, d) in [&b, &c, &weights, &plain].iter().zip(&data) {
        assert!(read(&sim, a, s) == *d, "the contents at {:#x} came back", a.ptr());
    }
    assert!(!f.tag_stats(0, "kv_cache").unwrap().asleep);
    // The memory is the tags' again: written through the stitched range, read back.
    sim.memset_async(c.ptr(), 7, c.size(), s).unwrap();
    assert!(read(&sim, &c, s).iter().all(|&x| x == 7));
    drop((b, c, weights, plain));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn without_offload_the_memory_comes_back_fresh_at_the_same_addresses() {
    let (f, sim) = facade("");
    let s = sim.create_stream().unwrap();
    let a = alloc(&f, Some("activations"), 10 * MIB, s).unwrap();
    sim.memset_async(a.ptr(), 9, a.size(), s).unwrap();
    let slept = f.sleep(0, &["activations"], false).unwrap();
    assert_eq!(slept, 10 * MIB);
    assert!(!f.tag_stats(0, "activations").unwrap().offloaded);
    assert_eq!(f.wake(0, &["activations"]).unwrap(), 10 * MIB);
    assert!(read(&sim, &a, s).iter().all(|&x| x == 0), "fresh memory (the simulator's reads as 0)");
    sim.memset_async(a.ptr(), 3, a.size(), s).unwrap();
    assert!(read(&sim, &a, s).iter().all(|&x| x == 3));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// The page-locked memory an offload copies into stays cached across a device's release
/// (PyTorch's `empty_cache`, which phases that alternate call between them, leaves pinned
/// memory alone too), so the next sleep pins nothing; the offload memory's own release gives it
/// back, and its figures say so.
#[test]
fn offload_memory_outlives_the_device_release_and_the_next_sleep_pins_nothing() {
    let (f, sim) = facade("");
    let s = sim.create_stream().unwrap();
    let kv = alloc(&f, Some("kv_cache"), 24 * MIB, s).unwrap();
    sim.memset_async(kv.ptr(), 5, kv.size(), s).unwrap();
    assert_eq!(f.offload_stats().reserved, 0, "nothing pinned before a sleep with offload");
    let mut first = None;
    for round in 0..3 {
        f.sleep(0, &["kv_cache"], true).unwrap();
        let pinned = f.offload_stats();
        assert!(pinned.reserved >= kv.size() && pinned.allocated >= kv.size(), "round {round}: {pinned:?}");
        let first = *first.get_or_insert(pinned);
        assert_eq!(
            (pinned.reserved, pinned.device_allocs),
            (first.reserved, first.device_allocs),
            "round {round}: the sleep reused the pinned blocks of the first"
        );
        f.wake(0, &["kv_cache"]).unwrap();
        assert!(read(&sim, &kv, s).iter().all(|&x| x == 5), "round {round}: contents back");
        assert_eq!(f.offload_stats().allocated, 0, "round {round}: the wake hands the blocks back");
        f.release_all().unwrap();
        assert_eq!(
            f.offload_stats().reserved,
            first.reserved,
            "round {round}: the device's release keeps it"
        );
    }
    f.sleep(0, &["kv_cache"], true).unwrap();
    // Held by the sleeping tag: not given back.
    assert_eq!(f.release_offload_memory().unwrap(), 0);
    f.wake(0, &["kv_cache"]).unwrap();
    assert_eq!(f.release_offload_memory().unwrap(), first.unwrap().reserved);
    assert_eq!(f.offload_stats().reserved, 0);
    drop(kv);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// The sleep waits for the owning stream's kernel, for a stream recorded on an allocation kept
/// by pointer and for a free pending on a recorded stream (each the longest in one round), and
/// not for a busy stream that never used the tag's memory. Had it not waited for one, the
/// simulator would have refused the unmap under its kernel and recorded a violation.
#[test]
fn the_sleep_waits_for_the_streams_that_use_the_memory_and_for_no_other() {
    for longest in 0..3 {
        let (f, sim) = facade("wait_timeout=1s");
        let [owner, recorded, pending, busy] = [0; 4].map(|_| sim.create_stream().unwrap());
        let a = alloc(&f, Some("kv"), 8 * MIB, owner).unwrap();
        let allocator = f.allocator(0).unwrap();
        let kept = {
            let _t = tags::scope("kv").unwrap();
            allocator.allocate_ptr(4 * MIB, owner).unwrap()
        };
        assert!(allocator.record_stream_ptr(kept, recorded).unwrap());
        let mut freed = alloc(&f, Some("kv"), 4 * MIB, owner).unwrap();
        freed.record_stream(pending);
        let other = alloc(&f, None, 8 * MIB, busy).unwrap();
        let t0 = sim.now();
        let ns = |i: usize| if i == longest { 3_000_000 } else { 1_000_000 };
        sim.use_range(a.ptr(), a.size(), owner, ns(0)).unwrap();
        sim.use_range(kept, 4 * MIB, recorded, ns(1)).unwrap();
        sim.use_range(freed.ptr(), freed.size(), pending, ns(2)).unwrap();
        sim.use_range(other.ptr(), other.size(), busy, 500_000_000).unwrap();
        drop(freed); // pending on an event of `pending`
        let waits = sim.host_waits();
        f.sleep(0, &["kv"], true).unwrap_or_else(|e| panic!("round {longest}: {e}"));
        let now = sim.now();
        assert!(
            now >= t0 + 3_000_000,
            "round {longest}: the sleep returned at {now}, before the kernels ended"
        );
        assert!(now < t0 + 100_000_000, "round {longest}: the sleep waited for the busy stream: {now}");
        assert_eq!(sim.host_waits(), waits + 1, "one host wait, for the internal stream");
        assert!(sim.violations().is_empty(), "round {longest}: {:?}", sim.violations());
        f.wake(0, &["kv"]).unwrap();
        assert!(allocator.free_ptr(kept, owner));
        drop((a, other));
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    }
}

/// Issue 52, #1 (the race the threaded fuzz found): a free by pointer of an allocation that
/// recorded a stream, caught between leaving the table of pointers and reaching its pool's
/// pending frees (stopped here where it records its event on the recorded stream), while a
/// sleep of its tag runs on another thread. The sleep must still wait for the recorded
/// stream's kernel on the memory, which it then unmaps: the free is under way, so the stream
/// is in neither the allocations kept nor the frees pending.
#[test]
fn a_sleep_waits_for_the_streams_of_a_free_under_way() {
    let (f, sim) = facade("wait_timeout=1s");
    let [owner, user] = [0; 2].map(|_| sim.create_stream().unwrap());
    let allocator = f.allocator(0).unwrap();
    let ptr = {
        let _t = tags::scope("kv").unwrap();
        allocator.allocate_ptr(6 * MIB, owner).unwrap()
    };
    assert!(allocator.record_stream_ptr(ptr, user).unwrap());
    let t0 = sim.now();
    sim.use_range(ptr, 6 * MIB, user, 5_000_000).unwrap();
    // The first event recorded on `user` (the free's) waits until the sleep has returned.
    let (entered, release) = hold_first_record_on(&sim, user);
    thread::scope(|scope| {
        let freeing = scope.spawn(|| assert!(allocator.free_ptr(ptr, owner)));
        entered.recv_timeout(Duration::from_secs(30)).expect("the free records its event");
        let slept = f.sleep(0, &["kv"], false);
        release.send(()).unwrap();
        freeing.join().unwrap();
        assert!(slept.expect("sleep") >= 6 * MIB);
    });
    sim.set_record_hook(None);
    assert!(sim.now() >= t0 + 5_000_000, "the sleep returned at {}, before the kernel ended", sim.now());
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    f.wake(0, &["kv"]).unwrap();
    assert_eq!(f.stats(0).live_allocations, 0);
}

/// Stops the first event recorded on `user` (a free's) until the returned sender sends, or
/// 30 s pass (bounded: a call that blocks on the free under way fails the test, not hangs
/// it); the returned receiver gets a message once that record has begun.
fn hold_first_record_on(sim: &SimDevice, user: Stream) -> (mpsc::Receiver<()>, mpsc::Sender<()>) {
    let (entered_tx, entered) = mpsc::channel();
    let (release, released) = mpsc::channel::<()>();
    let released = std::sync::Mutex::new(released);
    let first = AtomicBool::new(true);
    sim.set_record_hook(Some(Arc::new(move |stream| {
        if stream == user && first.swap(false, Ordering::AcqRel) {
            entered_tx.send(()).unwrap();
            let _ = released.lock().unwrap().recv_timeout(Duration::from_secs(30));
        }
    })));
    (entered, release)
}

#[test]
fn a_free_under_way_in_its_streams_pool_keeps_its_recorded_streams_listed() {
    // Untagged, the allocation is kept in its stream's pool (no handle): while its free
    // records the event on `user`, the stack still lists `user` (or has the block pending).
    let (f, sim) = facade("wait_timeout=1s");
    let [owner, user] = [0; 2].map(|_| sim.create_stream().unwrap());
    let allocator = f.allocator(0).unwrap();
    let ptr = allocator.allocate_ptr(6 * MIB, owner).unwrap();
    assert!(allocator.record_stream_ptr(ptr, user).unwrap());
    let (entered, release) = hold_first_record_on(&sim, user);
    thread::scope(|scope| {
        let freeing = scope.spawn(|| assert!(allocator.free_ptr(ptr, owner)));
        entered.recv_timeout(Duration::from_secs(30)).expect("the free records its event");
        let listed = allocator.recorded_streams();
        release.send(()).unwrap();
        freeing.join().unwrap();
        assert_eq!(listed, vec![user], "a free under way hid its recorded stream");
    });
    sim.set_record_hook(None);
    assert_eq!((allocator.recorded_streams(), f.stats(0).live_allocations), (vec![], 0));
    assert_eq!(f.stats(0).pending_release, 6 * MIB);
}

#[test]
fn a_sleep_whose_streams_outlast_the_bound_names_them_and_leaves_the_tag_awake() {
    let (f, sim) = facade("wait_timeout=10ms");
    let s = sim.create_stream().unwrap();
    let a = alloc(&f, Some("kv"), 8 * MIB, s).unwrap();
    sim.use_range(a.ptr(), a.size(), s, 1_000_000_000).unwrap();
    let used_before = used(&sim);
    match f.sleep(0, &["kv"], true) {
        Err(Error::Timeout { waited_for, .. }) => {
            assert!(
                waited_for.contains(&format!("{:#x}", s.raw())) && waited_for.contains("`kv`"),
                "{waited_for}"
            )
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert_eq!(used(&sim), used_before, "nothing was given back");
    assert!(!f.tag_stats(0, "kv").unwrap().asleep);
    let more = alloc(&f, Some("kv"), MIB, s).expect("the tag is awake");
    sim.synchronize_stream(s).unwrap();
    assert!(f.sleep(0, &["kv"], false).unwrap() > 0);
    drop((a, more));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn each_misuse_has_its_answer_and_other_tags_go_on() {
    let (f, sim) = facade("");
    let s = sim.create_stream().unwrap();
    let a = alloc(&f, Some("kv"), 8 * MIB, s).unwrap();
    let b = alloc(&f, Some("kv"), 2 * MIB, s).unwrap();
    let slept = f.sleep(0, &["kv"], true).unwrap();
    // Sleeping what sleeps: nothing, no device call.
    let calls = sim.calls();
    assert_eq!(f.sleep(0, &["kv"], true).unwrap(), 0);
    assert_eq!(sim.calls(), calls);
    // Allocating in a sleeping tag: an error naming it.
    match alloc(&f, Some("kv"), MIB, s) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("`kv`") && m.contains("sleeps"), "{m}"),
        other => panic!("expected an error, got {other:?}"),
    }
    // Other tags and untagged allocations go on.
    let other = alloc(&f, Some("weights"), 4 * MIB, s).unwrap();
    let plain = alloc(&f, None, 4 * MIB, s).unwrap();
    // Freeing a sleeping tag's allocation: back to its books.
    drop(b);
    assert_eq!(f.tag_stats(0, "kv").unwrap().stats.live_allocations, 1);
    // A release leaves the sleeping tag alone.
    f.release_all().unwrap();
    assert!(f.tag_stats(0, "kv").unwrap().asleep);
    // A tag that never allocated sleeps and wakes for nothing.
    assert_eq!(f.sleep(0, &["never"], true).unwrap(), 0);
    assert!(f.tag_stats(0, "never").unwrap().asleep);
    assert_eq!(f.wake(0, &["never", "kv"]).unwrap(), slept);
    // Waking what is awake: nothing.
    let calls = sim.calls();
    assert_eq!(f.wake(0, &["kv"]).unwrap(), 0);
    assert_eq!(sim.calls(), calls);
    let c = alloc(&f, Some("kv"), MIB, s).expect("awake again");
    // Bad names.
    assert!(matches!(f.sleep(0, &[""], false), Err(Error::InvalidArgument(_))));
    assert!(matches!(tags::scope("a\u{1b}b"), Err(Error::InvalidArgument(_))));
    drop((a, c, other, plain));
    f.release_all().unwrap();
    assert_eq!(f.stats(0).reserved, 0);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn memory_that_cannot_sleep_says_so_and_tags_are_served_untagged() {
    for (conf, named) in [
        ("strategy=async", "strategy=async"),
        ("strategy=plain", "strategy=plain"),
        ("backing=chunks", "backing=chunks"),
        ("backing=segments", "backing=segments"),
        ("strategy=best_fit,backing=chunks", "backing=chunks"),
        ("sim_virtual_memory=false", "virtual memory management"),
    ] {
        let (f, sim) = facade(conf);
        let s = sim.create_stream().unwrap();
        let a = alloc(&f, Some("kv"), 4 * MIB, s).expect(conf);
        for result in [f.sleep(0, &["kv"], true), f.wake(0, &["kv"])] {
            match result {
                Err(Error::Unsupported(m)) => assert!(m.contains(named), "{conf}: {m}"),
                other => panic!("{conf}: expected unsupported, got {other:?}"),
            }
        }
        assert!(f.tag_stats(0, "kv").is_err());
        drop(a);
    }
    // Best fit over stitched ranges sleeps.
    let (f, sim) = facade("strategy=best_fit");
    let s = sim.create_stream().unwrap();
    let a = alloc(&f, Some("kv"), 4 * MIB, s).unwrap();
    assert_eq!(f.sleep(0, &["kv"], false).unwrap(), 4 * MIB);
    f.wake(0, &["kv"]).unwrap();
    drop(a);
}

/// A wake that finds the device full of untagged memory cached by the main stack makes it give
/// that back and maps; one that finds it full of live memory fails, and the tag sleeps on with
/// its contents until the memory is freed.
#[test]
fn a_wake_takes_back_cached_memory_or_fails_and_the_tag_sleeps_on() {
    let (f, sim) = facade("sim_capacity=256MiB");
    let s = sim.create_stream().unwrap();
    let a = alloc(&f, Some("kv"), 128 * MIB, s).unwrap();
    let data = pattern(a.size(), 5);
    sim.copy_from_host(a.ptr(), &data, s).unwrap();
    f.sleep(0, &["kv"], true).unwrap();
    drop(alloc(&f, None, 200 * MIB, s).unwrap()); // cached by the main stack
    assert_eq!(f.wake(0, &["kv"]).unwrap(), 128 * MIB);
    assert!(read(&sim, &a, s) == data);
    f.sleep(0, &["kv"], true).unwrap();
    let live = alloc(&f, None, 200 * MIB, s).unwrap();
    assert!(matches!(f.wake(0, &["kv"]), Err(Error::OutOfMemory(_))));
    assert!(f.tag_stats(0, "kv").unwrap().asleep);
    drop(live);
    assert_eq!(f.wake(0, &["kv"]).unwrap(), 128 * MIB);
    assert!(read(&sim, &a, s) == data, "the contents survived the failed wake");
    // A tagged allocation that finds the device full of the main stack's cache takes it back.
    drop(alloc(&f, None, 100 * MIB, s).unwrap());
    let b = alloc(&f, Some("kv"), 100 * MIB, s).expect("the cache went back");
    assert_eq!(f.stats(0).failures, 0, "recovered, counted as a retry");
    // And an untagged one that finds it full of a tag's cache takes that back.
    drop(b);
    let c = alloc(&f, None, 100 * MIB, s).expect("the tag's cache went back");
    assert_eq!(f.stats(0).failures, 0, "recovered, counted as a retry");
    drop((a, c));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// Threads allocate, use (simulated kernels), record and free tagged and untagged memory on
/// streams of their own while another puts tags to sleep and wakes them, offloaded or not, and
/// checks a sentinel of each offloaded tag, and another releases the cache (a sleep begins
/// only between releases of a pool); the ordering checker must see nothing. A tagged
/// allocation is checked only when no sleep or wake ran while it was made and checked: a
/// sleep that begins just after the hand-out copies the new block out on the layer's stream
/// (its contents are the tag's), and a check made after that would take the copy for a use
/// before the hand-out.
#[test]
fn threads_at_work_while_tags_sleep_and_wake() {
    const TAGS: [&str; 3] = ["weights", "kv_cache", "activations"];
    let seed = std::env::var("STREAMALLOC_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(36);
    let ops: u64 =
        std::env::var("STREAMALLOC_FUZZ_THREAD_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let sim = SimDevice::new(SimConfig { seed, ..SimConfig::with_capacity(1 << 30) });
    let config = Config::parse("device=sim,wait_timeout=10s").unwrap();
    let stack = Arc::new(Facade::build_stack(&config, sim.clone()).unwrap());
    let layer = stack.tags.as_ref().unwrap().clone();
    // Odd while the sleeper puts a tag to sleep or wakes it (a sequence lock's count).
    let moving = Arc::new(AtomicU64::new(0));
    // The early reuses found at tagged hand-outs checked so.
    let early = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut workers = Vec::new();
    for w in 0..3u64 {
        let (sim, stack, moving, early) = (sim.clone(), stack.clone(), moving.clone(), early.clone());
        workers.push(thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(seed * 7 + w);
            let stream = sim.create_stream().unwrap();
            let side = sim.create_stream().unwrap();
            let mut live: Vec<(Allocation, bool)> = Vec::new();
            let mut refused = 0u64;
            for _ in 0..ops {
                // At most 24 live allocations of up to 6 MiB per thread: the device never fills.
                let op = if live.len() >= 24 { 9 } else { rng.gen_range(0..10) };
                match op {
                    0..=4 => {
                        let tag = TAGS.get(rng.gen_range(0..4)).copied();
                        let size = rng.gen_range(1..(6 * MIB));
                        let _scope = tag.map(|t| tags::scope(t).unwrap());
                        let before = moving.load(Ordering::SeqCst);
                        match stack.allocator.allocate_on(size, stream) {
                            Ok(a) => {
                                if tag.is_none() {
                                    sim.check_handout(a.ptr(), a.size(), stream);
                                } else if before % 2 == 0 {
                                    let found = sim.early_reuses(a.ptr(), a.size(), stream);
                                    if moving.load(Ordering::SeqCst) == before {
                                        early.lock().unwrap().extend(found);
                                    }
                                }
                                live.push((a, tag.is_some()));
                            }
                            Err(Error::InvalidArgument(m)) if m.contains("sleeps") => refused += 1,
                            Err(e) => panic!("allocate: {e}"),
                        }
                    }
                    5..=7 if !live.is_empty() => {
                        let i = rng.gen_range(0..live.len());
                        let (a, _) = &mut live[i];
                        let on = if rng.gen_bool(0.3) {
                            a.record_stream(side);
                            side
                        } else {
                            stream
                        };
                        // A kernel on memory of a tag that may be asleep would be the
                        // program's error: only untagged memory is used here at will.
                        if !live[i].1 {
                            sim.use_range(
                                live[i].0.ptr(),
                                live[i].0.size(),
                                on,
                                rng.gen_range(1_000..200_000),
                            )
                            .unwrap();
                        }
                    }
                    _ if !live.is_empty() => {
                        let i = rng.gen_range(0..live.len());
                        drop(live.swap_remove(i));
                    }
                    _ => {}
                }
            }
            drop(live);
            refused
        }));
    }
    let done = Arc::new(AtomicBool::new(false));
    let releaser = {
        let (stack, done) = (stack.clone(), done.clone());
        thread::spawn(move || {
            let mut releases = 0u64;
            while !done.load(Ordering::Relaxed) {
                match stack.allocator.release() {
                    Ok(_) | Err(Error::Timeout { .. }) => releases += 1,
                    Err(e) => panic!("release: {e}"),
                }
                thread::sleep(Duration::from_micros(200));
            }
            releases
        })
    };
    // The sleeper: sentinels written before each offloaded sleep are read back after the wake.
    let s = sim.create_stream().unwrap();
    let sentinels: Vec<Allocation> = TAGS
        .iter()
        .map(|t| {
            let _scope = tags::scope(t).unwrap();
            stack.allocator.allocate_on(3 * MIB, s).unwrap()
        })
        .collect();
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut cycles = 0;
    while !workers.iter().all(|w| w.is_finished()) || cycles < 20 {
        let i = rng.gen_range(0..TAGS.len());
        let data = pattern(3 * MIB, cycles as u8);
        sim.copy_from_host(sentinels[i].ptr(), &data, s).unwrap();
        let offload = rng.gen_bool(0.7);
        moving.fetch_add(1, Ordering::SeqCst);
        let slept = layer.sleep(&[tags::Tag::new(TAGS[i]).unwrap()], offload, &[]);
        moving.fetch_add(1, Ordering::SeqCst);
        match slept {
            Ok(_) | Err(Error::Timeout { .. }) => {}
            Err(e) => panic!("sleep: {e}"),
        }
        thread::sleep(Duration::from_micros(rng.gen_range(0..500)));
        moving.fetch_add(1, Ordering::SeqCst);
        layer.wake(&[tags::Tag::new(TAGS[i]).unwrap()]).unwrap();
        moving.fetch_add(1, Ordering::SeqCst);
        if offload {
            assert!(
                read(&sim, &sentinels[i], s) == data,
                "cycle {cycles}: the sentinel of {} came back",
                TAGS[i]
            );
        }
        cycles += 1;
    }
    let refused: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    done.store(true, Ordering::Relaxed);
    let releases = releaser.join().unwrap();
    drop(sentinels);
    stack.allocator.release().unwrap();
    let early = early.lock().unwrap();
    assert!(early.is_empty(), "{} early reuses of tagged memory, the first {:?}", early.len(), early.first());
    assert!(
        sim.violations().is_empty(),
        "{} violations, the first {:?}",
        sim.violations().len(),
        sim.violations().first()
    );
    assert!(
        refused > 0 && cycles >= 20 && releases > 0,
        "the threads met sleeping tags ({refused} refusals, {cycles} cycles, {releases} releases)"
    );
}

/// Untagged memory allocated while tags sleep may reuse the device memory they gave back;
/// freed and released, it goes back to the device, and the wake takes the tags' bytes again:
/// the device's memory in use ends where it was before the sleep (PyTorch's `test_sleep`
/// contents case, whose tensors' sizes these are).
#[test]
fn memory_used_while_tags_sleep_goes_back_and_the_wake_ends_where_the_sleep_began() {
    let (f, sim) = facade("");
    let s = sim.create_stream().unwrap();
    let untagged = alloc(&f, None, 512, s).unwrap();
    let tagged =
        [("weights", 5_457_408), ("weights", 77 * MIB + 512), ("kv_cache", 16 * MIB), ("kv_cache", 98_816)]
            .map(|(tag, size)| alloc(&f, Some(tag), size, s).unwrap());
    f.release_all().unwrap();
    let before = used(&sim);
    let slept = f.sleep(0, &["weights", "kv_cache"], true).unwrap();
    assert_eq!(used(&sim), before - slept);
    let scratch = alloc(&f, None, slept, s).unwrap();
    assert_eq!(used(&sim), before, "the scratch took the memory the tags gave back");
    drop(scratch);
    f.release_all().unwrap();
    assert_eq!(used(&sim), before - slept, "the release gave the scratch's memory back");
    f.wake(0, &["weights", "kv_cache"]).unwrap();
    assert_eq!(used(&sim), before);
    drop((untagged, tagged));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// Issue 52, #1: a kernel enqueued on a sleeping tag's memory (which a racing program does
/// when its allocation and its kernel straddle a sleep) made the simulator refuse the unmap
/// that undid a wake failing for lack of memory; the wake ignored that refusal and recorded
/// the tag asleep with memory still mapped, and every later wake failed with "already
/// mapped". Now the kernel is refused (the checker records it), the failed wake leaves the
/// tag asleep with nothing mapped, and once memory is free it wakes, its contents back.
#[test]
fn a_wake_that_failed_for_lack_of_memory_leaves_the_tag_able_to_wake() {
    let (f, sim) = facade("sim_capacity=256MiB");
    let s = sim.create_stream().expect("stream");
    // Two live blocks with a freed one between: the sleep leaves two home ranges.
    let a = alloc(&f, Some("racy"), 8 * MIB, s).expect("a");
    let gap = alloc(&f, Some("racy"), 8 * MIB, s).expect("gap");
    let b = alloc(&f, Some("racy"), 8 * MIB, s).expect("b");
    sim.copy_from_host(a.ptr(), &pattern(8 * MIB, 1), s).expect("write a");
    sim.copy_from_host(b.ptr(), &pattern(8 * MIB, 2), s).expect("write b");
    drop(gap);
    assert!(f.sleep(0, &["racy"], true).expect("sleep") >= 16 * MIB);
    // A kernel on the sleeping memory: refused, and seen by the checker.
    assert!(sim.use_range(a.ptr(), 8 * MIB, s, 3_600_000_000_000).is_err());
    f.release_all().expect("release");
    // Leave room for one home range but not both.
    let free = sim.mem_info().expect("mem_info").free;
    let filler = sim.alloc(free - 12 * MIB).expect("filler");
    let err = f.wake(0, &["racy"]).expect_err("the wake needs 16 MiB, 12 are free");
    assert!(err.is_out_of_memory(), "{err}");
    assert!(f.tag_stats(0, "racy").expect("stats").asleep);
    sim.free(filler).expect("free the filler");
    f.wake(0, &["racy"]).expect("the tag wakes once memory is free");
    assert_eq!(read(&sim, &a, s), pattern(8 * MIB, 1));
    assert_eq!(read(&sim, &b, s), pattern(8 * MIB, 2));
    drop((a, b));
    sim.synchronize().expect("sync");
    f.release_all().expect("release");
    let stats = f.stats(0);
    assert_eq!((stats.reserved, stats.pending_release), (0, 0));
    let unmapped = sim.violations().iter().filter(|v| v.kind == ViolationKind::UnmappedUse).count();
    assert_eq!(unmapped, 1, "{:?}", sim.violations());
}

/// Issue 52, #7: a dropped tag costs nothing: its reservation and cached memory go back (the
/// simulator's reservations and mapped memory return to what they were), a tag with live
/// allocations is refused with a clear error, a sleeping tag can be dropped, and the name
/// serves again afterwards. Many tags made and dropped leave nothing behind.
#[test]
fn a_dropped_tag_costs_nothing() {
    let (f, sim) = facade("");
    let s = sim.create_stream().expect("stream");
    let base = used(&sim);
    let a = alloc(&f, Some("scratch"), 3 * MIB, s).expect("a");
    let err = f.drop_tag(0, "scratch").expect_err("a live allocation");
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("1 allocations (3145728 bytes) of it are live"), "{err}");
    // A free pending on a recorded stream is waited for.
    let mut a = a;
    a.record_stream(sim.create_stream().expect("stream"));
    drop(a);
    assert!(f.drop_tag(0, "scratch").expect("drop") >= 3 * MIB);
    assert_eq!(used(&sim), base, "the tag's memory went back");
    assert_eq!(f.tag_stats(0, "scratch").expect("stats"), Default::default());
    // Asleep, with offloaded contents: dropped too, the pinned buffers back in the pool.
    let b = alloc(&f, Some("slept"), 5 * MIB, s).expect("b");
    drop(b);
    let c = alloc(&f, Some("slept"), MIB, s).expect("c");
    f.sleep(0, &["slept"], true).expect("sleep");
    assert!(f.drop_tag(0, "slept").is_err(), "c is live");
    drop(c);
    f.drop_tag(0, "slept").expect("drop a sleeping tag");
    assert_eq!(f.offload_stats().allocated, 0);
    // The name serves again, in a new pool.
    let d = alloc(&f, Some("slept"), MIB, s).expect("d");
    drop(d);
    // Many tags made and dropped: nothing is left reserved, on the device or in addresses.
    for i in 0..200 {
        let name = format!("t{i}");
        drop(alloc(&f, Some(&name), 64 << 10, s).expect("alloc"));
        f.drop_tag(0, &name).expect("drop");
    }
    f.drop_tag(0, "slept").expect("drop");
    sim.synchronize().expect("sync");
    f.release_all().expect("release");
    assert_eq!(used(&sim), base);
    assert_eq!(f.stats(0).reserved, 0);
    assert_eq!(f.drop_tag(0, "never-used").expect("a tag that allocated nothing"), 0);
}

/// Issue 52, #12: a stream destroyed (without `retire_stream`) while recorded on a live
/// allocation: the sleep is refused with a message that names the stream and says why and
/// what to do; retired before destruction, the stream no longer stands in the way.
#[test]
fn a_destroyed_recorded_stream_is_named_and_retiring_it_lets_the_sleep_go_on() {
    let (f, sim) = facade("");
    let stack = f.stack(0).expect("stack");
    let s = sim.create_stream().expect("stream");
    let gone = sim.create_stream().expect("stream");
    let ptr = {
        let _scope = tags::scope("kv").expect("tag");
        stack.allocator.allocate_ptr(MIB, s).expect("alloc")
    };
    assert!(stack.allocator.record_stream_ptr(ptr, gone).expect("record"));
    sim.destroy_stream(gone).expect("destroy");
    let err = f.sleep(0, &["kv"], false).expect_err("a destroyed stream is recorded").to_string();
    assert!(err.contains(&format!("stream {:#x}, recorded (record_stream)", gone.raw())), "{err}");
    assert!(err.contains("retire streams before destroying them"), "{err}");
    assert!(!f.tag_stats(0, "kv").expect("stats").asleep);
    // The contract: retire first, then destroy.
    let other = sim.create_stream().expect("stream");
    let q = {
        let _scope = tags::scope("kv").expect("tag");
        stack.allocator.allocate_ptr(MIB, s).expect("alloc")
    };
    assert!(stack.allocator.free_ptr(ptr, s));
    assert!(stack.allocator.record_stream_ptr(q, other).expect("record"));
    f.retire_stream(0, other).expect("retire");
    sim.destroy_stream(other).expect("destroy");
    f.sleep(0, &["kv"], false).expect("a retired stream does not stand in the way");
    f.wake(0, &["kv"]).expect("wake");
    assert!(stack.allocator.free_ptr(q, s));
}
