//! The threaded fuzz of tags that sleep and wake (issue 52, #1): eight threads on a simulated
//! device of 512 MiB. Workers allocate into tags (and untagged), have kernels use the memory,
//! `record_stream` it on other workers' streams, and free it; two threads put random tags to
//! sleep (with and without offload) and wake them, racing the allocations; one releases the
//! cache and retires streams it allocated on in tags; the sleepers also drop tags now and
//! then (refused while a tag has live allocations). Some wakes meet a device filled with
//! untagged blocks and fail for lack of memory; every tag must still wake once the
//! workers are done, and nothing may stay reserved or pending once all is freed. The
//! simulator's ordering checker counts every early reuse, unmap under a kernel and kernel on
//! memory that is not mapped: there must be none.
//!
//! A correct program enqueues kernels on a tag's memory only while the tag is awake: here a
//! worker holds the tag's guard (read) while it checks that the tag is awake and enqueues the
//! kernel, and a sleep holds it (write). The negative control leaves the guard out, and the
//! checker sees kernels on memory a sleep unmapped.
//!
//! `STREAMALLOC_FUZZ_SLEEP_OPS` sets the operations per worker (default 20,000),
//! `STREAMALLOC_FUZZ_SEED` the seed.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;

use parking_lot::RwLock;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::device::Streams;
use streamalloc::facade::{Config, DeviceStack, Facade};
use streamalloc::{tags, Allocator, Error, Stream, StreamAllocator};

const MIB: usize = 1 << 20;
const WORKERS: usize = 5;
const TAGS: [&str; 4] = ["weights", "kv", "activations", "optimizer"];

fn ops() -> u64 {
    std::env::var("STREAMALLOC_FUZZ_SLEEP_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000)
}

fn seed() -> u64 {
    std::env::var("STREAMALLOC_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(52)
}

fn size(rng: &mut SmallRng) -> usize {
    match rng.gen_range(0..100u32) {
        0..=39 => rng.gen_range(1..256 << 10),
        40..=69 => rng.gen_range(256 << 10..4 * MIB),
        _ => rng.gen_range(4 * MIB..32 * MIB),
    }
}

/// What the threads counted.
#[derive(Default)]
struct Counts {
    ops: AtomicU64,
    sleeps: AtomicU64,
    wakes: AtomicU64,
    failed_wakes: AtomicU64,
    refused_allocations: AtomicU64,
    failed_allocations: AtomicU64,
    retired: AtomicU64,
    drops: AtomicU64,
    /// Early reuses the workers' checks found.
    early: AtomicU64,
    /// Errors no correct program should meet (a wake refused for any reason but out of
    /// memory, a sleep that failed other than by a bounded wait).
    wrong: AtomicU64,
}

struct Fuzz {
    sim: Arc<SimDevice>,
    stack: DeviceStack,
    /// Per tag: held (read) by a worker that enqueues a kernel on the tag's memory, (write)
    /// by a sleep.
    guards: Vec<RwLock<()>>,
    /// Per tag: the sleeps begun and ended, counted under the guard.
    slept: Vec<AtomicU64>,
    counts: Counts,
    /// Whether workers take the guards (false: the negative control).
    guarded: bool,
}

impl Fuzz {
    fn new(guarded: bool) -> Self {
        let config = Config::parse("device=sim,sim_capacity=512MiB,wait_timeout=5s").expect("config");
        let sim = SimDevice::new(SimConfig { seed: seed(), ..SimConfig::with_capacity(512 * MIB) });
        let stack = Facade::build_stack(&config, sim.clone()).expect("stack");
        let guards = TAGS.iter().map(|_| RwLock::new(())).collect();
        let slept = TAGS.iter().map(|_| AtomicU64::new(0)).collect();
        Self { sim, stack, guards, slept, counts: Counts::default(), guarded }
    }

    fn asleep(&self, tag: usize) -> bool {
        let layer = self.stack.tags.as_ref().expect("tags");
        layer.tag_stats(tags::Tag::new(TAGS[tag]).expect("tag")).asleep
    }

    /// Enqueues a kernel over `ptr` on `stream` unless its tag sleeps (with the guard), or
    /// whatever the tag does (without).
    fn kernel(&self, tag: Option<usize>, ptr: u64, n: usize, stream: Stream, ns: u64) {
        let Some(t) = tag else {
            self.sim.use_range(ptr, n, stream, ns).expect("use of untagged memory");
            return;
        };
        if !self.guarded {
            // The negative control: a refused kernel is what the checker reports.
            let _ = self.sim.use_range(ptr, n, stream, ns);
            return;
        }
        let _guard = self.guards[t].read();
        if !self.asleep(t) {
            self.sim.use_range(ptr, n, stream, ns).expect("use of an awake tag's memory");
        }
    }

    /// Checks the hand-out of `ptr` to `owner` as the allocation made it, counting early
    /// reuses, unless a sleep of its tag began since `slept` was read (its copies came after
    /// the hand-out).
    fn check_handout(&self, tag: Option<usize>, slept: Option<u64>, ptr: u64, n: usize, owner: Stream) {
        let found = match (tag, slept) {
            (Some(t), Some(before)) => {
                let _guard = self.guards[t].read();
                let found = self.sim.early_reuses(ptr, n, owner);
                if self.slept[t].load(Ordering::Acquire) != before {
                    return;
                }
                found
            }
            _ => self.sim.early_reuses(ptr, n, owner),
        };
        for v in found.iter().take(3) {
            eprintln!("early reuse: {v:?}");
        }
        self.counts.early.fetch_add(found.len() as u64, Ordering::Relaxed);
    }

    fn worker(&self, own: Stream, others: &[Stream], seed: u64, ops: u64) {
        let (a, sim) = (&self.stack.allocator, &self.sim);
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut live: Vec<(u64, usize, Stream, Option<usize>)> = Vec::new();
        for _ in 0..ops {
            self.counts.ops.fetch_add(1, Ordering::Relaxed);
            let r = rng.gen_range(0..100u32);
            if (r < 35 && live.len() < 96) || live.is_empty() {
                let n = size(&mut rng);
                let tag = rng.gen_range(0..TAGS.len() + 1);
                let tag = (tag < TAGS.len()).then_some(tag);
                // The tag's sleeps so far: a sleep between the hand-out and its check enqueues
                // copies the check would mistake for earlier uses.
                let slept = tag.map(|t| self.slept[t].load(Ordering::Acquire));
                let made = match tag {
                    Some(t) => {
                        let _scope = tags::scope(TAGS[t]).expect("scope");
                        a.allocate_ptr(n, own)
                    }
                    None => a.allocate_ptr(n, own),
                };
                let ptr = match made {
                    Ok(ptr) => ptr,
                    Err(e) if e.is_out_of_memory() => {
                        self.counts.failed_allocations.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    Err(Error::InvalidArgument(m)) if m.contains("which sleeps") => {
                        self.counts.refused_allocations.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    Err(e) => panic!("allocation of {n} bytes: {e}"),
                };
                let owner = a.owner_of(ptr, own).expect("live");
                self.check_handout(tag, slept, ptr, n, owner);
                self.kernel(tag, ptr, n, owner, rng.gen_range(1..5_000));
                live.push((ptr, n, owner, tag));
            } else if r < 65 {
                let (ptr, _, owner, _) = live.swap_remove(rng.gen_range(0..live.len()));
                assert!(a.free_ptr(ptr, owner), "{ptr:#x} not live");
            } else if r < 85 {
                let (ptr, n, _, tag) = live[rng.gen_range(0..live.len())];
                let user = others[rng.gen_range(0..others.len())];
                assert!(a.record_stream_ptr(ptr, user).expect("a live stream"));
                self.kernel(tag, ptr, n, user, rng.gen_range(1..50_000));
            } else if r < 90 {
                match a.release() {
                    Ok(_) | Err(Error::Timeout { .. }) => {}
                    Err(e) => panic!("release: {e}"),
                }
            } else {
                sim.advance(rng.gen_range(1..20_000));
            }
        }
        for (ptr, _, owner, _) in live {
            assert!(a.free_ptr(ptr, owner), "{ptr:#x} not live");
        }
    }

    /// Wakes tag `t`, counting the outcome.
    fn wake(&self, t: usize) {
        match self.stack.tags.as_ref().expect("tags").wake(&[tags::Tag::new(TAGS[t]).expect("tag")]) {
            Ok(_) => self.counts.wakes.fetch_add(1, Ordering::Relaxed),
            Err(e) if e.is_out_of_memory() => self.counts.failed_wakes.fetch_add(1, Ordering::Relaxed),
            Err(e) => {
                eprintln!("wake of {}: {e}", TAGS[t]);
                self.counts.wrong.fetch_add(1, Ordering::Relaxed)
            }
        };
    }

    /// Fills the device with untagged blocks of 32 MiB on `stream`, wakes tag `t` (which then
    /// fails for lack of memory, if it holds any), frees them and wakes it again.
    fn wake_under_pressure(&self, t: usize, stream: Stream) {
        let a = &self.stack.allocator;
        let mut hogs = Vec::new();
        while let Ok(ptr) = a.allocate_ptr(32 * MIB, stream) {
            hogs.push(ptr);
        }
        self.wake(t);
        for ptr in hogs {
            assert!(a.free_ptr(ptr, stream));
        }
        self.wake(t);
    }

    /// Puts random tags to sleep and wakes them until `done`, some wakes with the device full.
    fn sleeper(&self, seed: u64, done: &AtomicBool) {
        let mut rng = SmallRng::seed_from_u64(seed);
        let stream = self.sim.create_stream().expect("stream");
        while !done.load(Ordering::Relaxed) {
            let t = rng.gen_range(0..TAGS.len());
            if rng.gen_bool(0.5) {
                let _guard = self.guards[t].write();
                // Counted before and after: a check that sees the same count saw no sleep of
                // the tag begin or end since its allocation.
                self.slept[t].fetch_add(1, Ordering::Release);
                let slept = self.stack.sleep(&[tags::Tag::new(TAGS[t]).expect("tag")], rng.gen_bool(0.5));
                self.slept[t].fetch_add(1, Ordering::Release);
                match slept {
                    Ok(_) => self.counts.sleeps.fetch_add(1, Ordering::Relaxed),
                    Err(Error::Timeout { .. }) => 0,
                    Err(e) if e.is_out_of_memory() => 0,
                    Err(e) => {
                        eprintln!("sleep of {}: {e}", TAGS[t]);
                        self.counts.wrong.fetch_add(1, Ordering::Relaxed)
                    }
                };
            } else if rng.gen_bool(0.05) {
                // Dropped while allocations race it: refused while it has live ones.
                match self.stack.tags.as_ref().expect("tags").drop_tag(tags::Tag::new(TAGS[t]).expect("tag"))
                {
                    Ok(_) => self.counts.drops.fetch_add(1, Ordering::Relaxed),
                    Err(Error::InvalidArgument(m)) if m.contains("are live") => 0,
                    Err(Error::Timeout { .. }) => 0,
                    Err(e) => {
                        eprintln!("drop of {}: {e}", TAGS[t]);
                        self.counts.wrong.fetch_add(1, Ordering::Relaxed)
                    }
                };
            } else if rng.gen_bool(0.2) {
                self.wake_under_pressure(t, stream);
            } else {
                self.wake(t);
            }
            self.sim.advance(rng.gen_range(1..10_000));
        }
    }

    /// Releases beside the others until `done`: the whole cache, and by retiring a stream it
    /// made and allocated on in a tag (its pool leaves the tag's allocator).
    fn releaser(&self, seed: u64, done: &AtomicBool) {
        let (a, sim) = (&self.stack.allocator, &self.sim);
        let mut rng = SmallRng::seed_from_u64(seed);
        while !done.load(Ordering::Relaxed) {
            if rng.gen_bool(0.7) {
                match a.release() {
                    Ok(_) | Err(Error::Timeout { .. }) => {}
                    Err(e) => panic!("release: {e}"),
                }
                continue;
            }
            let s = sim.create_stream().expect("stream");
            let t = rng.gen_range(0..TAGS.len());
            let slept = self.slept[t].load(Ordering::Acquire);
            let n = size(&mut rng);
            let made = {
                let _scope = tags::scope(TAGS[t]).expect("scope");
                a.allocate_ptr(n, s)
            };
            if let Ok(ptr) = made {
                self.check_handout(Some(t), Some(slept), ptr, n, s);
                self.kernel(Some(t), ptr, n, s, 2_000);
                assert!(a.free_ptr(ptr, s));
            }
            a.retire_stream(s).expect("retire");
            sim.destroy_stream(s).expect("destroy");
            self.counts.retired.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Runs the eight threads; then every tag must wake, and once all is freed nothing stays
    /// reserved or pending. The checker's violations.
    fn run(&self, ops: u64) -> usize {
        let streams: Vec<Stream> = (0..WORKERS).map(|_| self.sim.create_stream().expect("stream")).collect();
        let done = AtomicBool::new(false);
        let base = seed();
        thread::scope(|scope| {
            let workers: Vec<_> = (0..WORKERS)
                .map(|i| {
                    let streams = &streams;
                    scope.spawn(move || self.worker(streams[i], streams, base + i as u64, ops))
                })
                .collect();
            let done = &done;
            scope.spawn(move || self.sleeper(base + 100, done));
            scope.spawn(move || self.sleeper(base + 200, done));
            scope.spawn(move || self.releaser(base + 300, done));
            for w in workers {
                w.join().expect("worker");
            }
            done.store(true, Ordering::Relaxed);
        });
        let layer = self.stack.tags.as_ref().expect("tags");
        let all: Vec<tags::Tag> = TAGS.iter().map(|t| tags::Tag::new(t).expect("tag")).collect();
        layer.wake(&all).expect("every tag wakes once the workers freed their memory");
        self.sim.synchronize().expect("synchronize");
        self.stack.allocator.release().expect("release");
        let stats = self.stack.allocator.stats();
        assert_eq!((stats.allocated, stats.live_allocations), (0, 0));
        assert_eq!(
            (stats.reserved, stats.pending_release),
            (0, 0),
            "memory stays reserved or pending once every block is freed, the streams synchronized and \
             the cache released"
        );
        let violations = self.sim.violations();
        for v in violations.iter().take(3) {
            eprintln!("violation: {v:?}");
        }
        violations.len() + self.counts.early.load(Ordering::Relaxed) as usize
    }
}

#[test]
fn tags_sleep_and_wake_while_threads_allocate_free_and_release() {
    let fuzz = Fuzz::new(true);
    let violations = fuzz.run(ops());
    let c = &fuzz.counts;
    let load = |n: &AtomicU64| n.load(Ordering::Relaxed);
    eprintln!(
        "sleep fuzz: {} operations, {} sleeps, {} wakes, {} wakes failed for lack of memory, {} allocations \
         refused in sleeping tags, {} failed for lack of memory, {} streams retired, {} tags dropped, {} wrong errors, {violations} violations",
        load(&c.ops),
        load(&c.sleeps),
        load(&c.wakes),
        load(&c.failed_wakes),
        load(&c.refused_allocations),
        load(&c.failed_allocations),
        load(&c.retired),
        load(&c.drops),
        load(&c.wrong)
    );
    assert!(load(&c.sleeps) > 0 && load(&c.wakes) > 0, "no sleep or no wake ran");
    assert!(load(&c.failed_wakes) > 0, "no wake met a full device");
    assert_eq!(load(&c.wrong), 0, "sleeps or wakes failed for a reason other than memory or a bound");
    assert_eq!(violations, 0, "the checker found memory used early, after an unmap or while unmapped");
}

/// The negative control: workers that enqueue kernels on a tag's memory without the guard
/// use memory a sleep unmapped, and the checker reports it.
#[test]
fn the_sleep_fuzz_catches_kernels_on_a_sleeping_tag() {
    let fuzz = Fuzz::new(false);
    let violations = fuzz.run(3_000);
    eprintln!("sleep fuzz without the guard: {violations} violations");
    assert!(violations > 0, "kernels on sleeping memory went unnoticed");
}
