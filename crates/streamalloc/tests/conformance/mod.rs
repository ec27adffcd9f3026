//! The conformance suite every allocator and adaptor joins.
//!
//! Each check is a function over a [`Subject`]: a device plus a factory of the allocator
//! under test. `conformance_tests!` turns a list of subjects into `#[test]` functions, on
//! the simulator in CI and, with `#[ignore]`, on a CUDA GPU (scripts/gpu-test.sh).
#![allow(dead_code)] // Each test binary uses a different part of the harness.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;
use proptest::prelude::*;
use streamalloc::adaptors::Pointers;
use streamalloc::allocators::{
    AsyncPool, AsyncPoolConfig, BackingKind, BestFit, BestFitConfig, Plain, StreamSafe, StreamSafeConfig,
};
use streamalloc::device::cuda::CudaDevice;
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::device::Streams;
use streamalloc::facade::{Config, Facade, PoolChoice, Strategy as Registered};
use streamalloc::{
    Allocation, Allocator, AnyAllocator, Block, BlockOwner, Device, Error, Stats, Stream, StreamAllocator,
    ALIGNMENT,
};

/// An allocator by pointer ([`Pointers`]) under the suite: its allocations are handles whose
/// drop frees by pointer (after recording on it the streams recorded on the handle), so every
/// check runs through `allocate_ptr`, `record_stream_ptr` and `free_ptr`.
pub struct ByPointer {
    pub pointers: Arc<Pointers<Arc<dyn StreamAllocator>>>,
}

impl ByPointer {
    /// `base` by pointer.
    pub fn new(base: Arc<dyn StreamAllocator>, device: Arc<dyn Device>) -> Self {
        Self { pointers: Arc::new(Pointers::new(base, device, std::time::Duration::from_secs(10))) }
    }

    /// `base` under the suite by pointer.
    pub fn made(base: Arc<dyn StreamAllocator>, device: Arc<dyn Device>) -> AnyAllocator {
        AnyAllocator::Streams(Arc::new(Self::new(base, device)))
    }
}

struct FreeByPointer(Arc<Pointers<Arc<dyn StreamAllocator>>>);

impl BlockOwner for FreeByPointer {
    fn free(&self, block: Block) {
        for &s in &block.recorded {
            let recorded = self.0.record_stream_ptr(block.ptr, s).expect("a live stream");
            assert!(recorded, "{:#x} not live at record_stream_ptr", block.ptr);
        }
        assert!(self.0.free_ptr(block.ptr, block.stream), "{:#x} not live at free_ptr", block.ptr);
    }
}

impl Allocator for ByPointer {
    fn allocate(&self, size: usize) -> streamalloc::Result<Allocation> {
        self.allocate_on(size, self.pointers.default_stream())
    }
    fn release(&self) -> streamalloc::Result<usize> {
        self.pointers.release()
    }
    fn stats(&self) -> Stats {
        self.pointers.stats()
    }
    fn reset_peak_stats(&self) {
        self.pointers.reset_peak_stats()
    }
    fn device(&self) -> usize {
        self.pointers.device()
    }
    fn segments(&self, out: &mut Vec<streamalloc::Segment>) -> streamalloc::Result<()> {
        self.pointers.segments(out)
    }
}

impl StreamAllocator for ByPointer {
    fn allocate_on(&self, size: usize, stream: Stream) -> streamalloc::Result<Allocation> {
        let device = self.pointers.device();
        let ptr = self.pointers.allocate_ptr(size, stream)?;
        if ptr == 0 {
            assert_eq!(size, 0, "a null pointer for {size} bytes");
            return Ok(Allocation::empty(device, stream));
        }
        let block = Block { ptr, size, stream, device, ..Block::default() };
        Ok(Allocation::new(block, Arc::new(FreeByPointer(self.pointers.clone()))))
    }
    fn default_stream(&self) -> Stream {
        self.pointers.default_stream()
    }
    fn set_default_stream(&self, stream: Stream) {
        self.pointers.set_default_stream(stream)
    }
    fn retire_stream(&self, stream: Stream) -> streamalloc::Result<()> {
        self.pointers.retire_stream(stream)
    }
}

/// Makes the allocator under test on a device.
pub type Factory<'a> = &'a dyn Fn(Arc<dyn Device>) -> AnyAllocator;

/// A device for the suite: the simulator (with its checker) or a CUDA GPU.
pub struct TestDevice {
    pub device: Arc<dyn Device>,
    pub sim: Option<Arc<SimDevice>>,
}

/// A simulated device of 4 GiB.
pub fn sim_device() -> TestDevice {
    let sim = SimDevice::new(SimConfig::with_capacity(4 << 30));
    TestDevice { device: sim.clone(), sim: Some(sim) }
}

/// CUDA device 0. Fails (never skips) when there is none: GPU tests are `#[ignore]`d where
/// no GPU is expected, and must not pass without one.
pub fn cuda_device() -> TestDevice {
    let dev = CudaDevice::new(0).unwrap_or_else(|e| panic!("GPU test run without a usable CUDA device: {e}"));
    TestDevice { device: dev, sim: None }
}

fn overlaps(live: &BTreeMap<u64, usize>, ptr: u64, len: usize) -> bool {
    let end = ptr + len as u64;
    live.range(..end).next_back().is_some_and(|(p, n)| p + *n as u64 > ptr)
}

/// Live ranges are distinct and non-overlapping, and aligned to [`ALIGNMENT`].
pub fn distinct_aligned_ranges(dev: TestDevice, make: Factory<'_>) {
    let made = make(dev.device.clone());
    let a = made.allocator();
    let mut rng = 12345u64;
    let mut live: Vec<Allocation> = Vec::new();
    let mut ranges = BTreeMap::new();
    for i in 0..400 {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let size = 1 + (rng >> 33) as usize % (if i % 10 == 0 { 8 << 20 } else { 64 << 10 });
        let x = a.allocate(size).expect("allocation");
        assert_eq!(x.ptr() % ALIGNMENT as u64, 0, "pointer {:#x} not aligned", x.ptr());
        assert_eq!(x.size(), size);
        assert!(!overlaps(&ranges, x.ptr(), size), "{:#x}+{size} overlaps a live allocation", x.ptr());
        ranges.insert(x.ptr(), size);
        live.push(x);
        if i % 3 == 2 {
            let victim = live.swap_remove((rng >> 40) as usize % live.len());
            ranges.remove(&victim.ptr());
        }
    }
}

/// Size 0 gives a null pointer, costs nothing and frees for nothing.
pub fn size_zero(dev: TestDevice, make: Factory<'_>) {
    let made = make(dev.device.clone());
    let a = made.allocator();
    let before = a.stats();
    let z = a.allocate(0).expect("size 0 is defined");
    assert_eq!((z.ptr(), z.size()), (0, 0));
    drop(z);
    assert_eq!(a.stats(), before);
}

/// A request larger than the device is an out-of-memory error with figures, not a panic,
/// and the allocator still works afterwards.
pub fn out_of_memory_is_an_error(dev: TestDevice, make: Factory<'_>) {
    let made = make(dev.device.clone());
    let a = made.allocator();
    let keep = a.allocate(1 << 20).expect("small allocation");
    let total = dev.device.mem_info().expect("mem_info").total;
    let huge = total + (total / 2);
    match a.allocate(huge) {
        Err(Error::OutOfMemory(r)) => {
            assert_eq!(r.requested, huge);
            assert_eq!(r.device, dev.device.ordinal());
            assert!(r.allocated >= 1 << 20, "allocated figure missing: {r}");
            assert!(r.device_total > 0, "device figures missing: {r}");
        }
        Err(e) => panic!("expected out of memory, got {e}"),
        Ok(x) => panic!("allocated {} bytes on a device of {total}", x.size()),
    }
    assert!(a.stats().failures >= 1);
    drop(keep);
    a.allocate(1 << 20).expect("works after an OOM");
}

/// Byte and count statistics add up through a sequence of allocations and frees.
pub fn stats_add_up(dev: TestDevice, make: Factory<'_>) {
    let made = make(dev.device.clone());
    let a = made.allocator();
    let sizes = [1usize, 255, 256, 4097, 1 << 20, 3 << 20, 100, 77 << 20];
    let live: Vec<Allocation> = sizes.iter().map(|&n| a.allocate(n).expect("allocation")).collect();
    let s = a.stats();
    let total: usize = sizes.iter().sum();
    assert_eq!(s.allocated, total);
    assert_eq!(s.live_allocations, sizes.len() as u64);
    assert_eq!(s.total_allocations, sizes.len() as u64);
    assert!(s.reserved >= s.allocated, "reserved {} < allocated {}", s.reserved, s.allocated);
    assert!(s.allocated_peak >= s.allocated && s.reserved_peak >= s.reserved);
    assert!(s.device_allocs >= 1);
    drop(live);
    let s = a.stats();
    assert_eq!((s.allocated, s.live_allocations, s.total_frees), (0, 0, sizes.len() as u64));
    assert_eq!(s.allocated_peak, total);
    a.release().expect("release");
    let s = a.stats();
    assert_eq!(s.reserved, s.cached + s.pending_release, "after release, reserved is cache only: {s:?}");
}

/// Many threads allocating and freeing at once never get overlapping live ranges.
pub fn many_threads(dev: TestDevice, make: Factory<'_>) {
    let made = Arc::new(make(dev.device.clone()));
    let live = Arc::new(Mutex::new(BTreeMap::<u64, usize>::new()));
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let (made, live) = (made.clone(), live.clone());
            std::thread::spawn(move || {
                let mut mine = Vec::new();
                let mut rng = t + 1;
                for i in 0..300 {
                    rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let size = 1 + (rng >> 33) as usize % (256 << 10);
                    let x = made.allocator().allocate(size).expect("allocation");
                    {
                        let mut l = live.lock();
                        assert!(!overlaps(&l, x.ptr(), size), "thread {t} got an overlapping range");
                        l.insert(x.ptr(), size);
                    }
                    mine.push(x);
                    if i % 2 == 1 {
                        let v = mine.swap_remove((rng >> 40) as usize % mine.len());
                        live.lock().remove(&v.ptr());
                    }
                }
                for v in mine {
                    live.lock().remove(&v.ptr());
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("worker thread");
    }
    let s = made.allocator().stats();
    assert_eq!((s.allocated, s.live_allocations), (0, 0));
    assert_eq!(s.total_allocations, 8 * 300);
}

/// Dropping the allocator after its allocations returns every byte to the device.
pub fn nothing_leaked(dev: TestDevice, make: Factory<'_>) {
    dev.device.synchronize_stream(Stream::DEFAULT).expect("sync");
    let before = dev.device.mem_info().expect("mem_info").used();
    {
        let made = make(dev.device.clone());
        let a = made.allocator();
        let xs: Vec<Allocation> = (0..50).map(|i| a.allocate((i + 1) * 12345).expect("allocation")).collect();
        drop(xs);
        let _kept_past_release = a.allocate(3 << 20).expect("allocation");
    }
    dev.device.synchronize_stream(Stream::DEFAULT).expect("sync");
    let after = dev.device.mem_info().expect("mem_info").used();
    // The driver's own bookkeeping may move a little on a GPU; the simulator must be exact.
    let slack = if dev.sim.is_some() { 0 } else { 2 << 20 };
    assert!(
        after <= before + slack,
        "device use grew from {before} to {after} after the allocator was dropped"
    );
}

/// One step of a random multi-stream program.
#[derive(Debug, Clone)]
pub enum Action {
    /// Allocate `size` bytes on stream `stream`.
    Alloc { stream: usize, size: usize },
    /// Free the `idx`-th live allocation (modulo the count).
    Free { idx: usize },
    /// A kernel on `stream` uses the `idx`-th live allocation for `ns`; records the stream
    /// first, as a correct program must.
    Use { idx: usize, stream: usize, ns: u64 },
    /// Let host time pass.
    Advance { ns: u64 },
    /// Synchronize a stream.
    Sync { stream: usize },
    /// Return cached memory to the device.
    Release,
}

/// Random programs over four streams.
pub fn actions() -> impl Strategy<Value = Vec<Action>> {
    let action = prop_oneof![
        4 => (0..4usize, 1..(4usize << 20)).prop_map(|(stream, size)| Action::Alloc { stream, size }),
        3 => any::<usize>().prop_map(|idx| Action::Free { idx }),
        4 => (any::<usize>(), 0..4usize, 1..2_000_000u64).prop_map(|(idx, stream, ns)| Action::Use { idx, stream, ns }),
        1 => (1..500_000u64).prop_map(|ns| Action::Advance { ns }),
        1 => (0..4usize).prop_map(|stream| Action::Sync { stream }),
        1 => Just(Action::Release),
    ];
    proptest::collection::vec(action, 1..120)
}

/// Runs a program on the simulator, checking every handout; `record` says whether uses on
/// other streams are announced with `record_stream`. Returns the violations found.
pub fn run_program(make: Factory<'_>, program: &[Action], record: bool) -> usize {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let made = make(sim.clone());
    let streams: Vec<Stream> = (0..4).map(|_| sim.create_stream().expect("stream")).collect();
    let mut live: Vec<Allocation> = Vec::new();
    for action in program {
        match *action {
            Action::Alloc { stream, size } => {
                let Ok(x) = made.allocate_on(size, streams[stream]) else { continue };
                sim.check_handout(x.ptr(), x.size(), x.owning_stream());
                // The owner's own kernel writes it first.
                sim.use_range(x.ptr(), x.size(), x.owning_stream(), 1_000).expect("use");
                live.push(x);
            }
            Action::Free { idx } if !live.is_empty() => {
                let n = live.len();
                live.swap_remove(idx % n);
            }
            Action::Use { idx, stream, ns } if !live.is_empty() => {
                let n = live.len();
                let x = &mut live[idx % n];
                if record {
                    x.record_stream(streams[stream]);
                }
                sim.use_range(x.ptr(), x.size(), streams[stream], ns).expect("use");
            }
            Action::Advance { ns } => sim.advance(ns),
            Action::Sync { stream } => sim.synchronize_stream(streams[stream]).expect("sync"),
            Action::Release => {
                made.allocator().release().expect("release");
            }
            _ => {}
        }
    }
    drop(live);
    sim.violations().len()
}

/// The allocators both the simulator's and the GPU's suite run, as factories.
pub fn plain(device: Arc<dyn Device>) -> AnyAllocator {
    AnyAllocator::Single(Arc::new(Plain::new(device, Stream::DEFAULT)))
}

pub fn best_fit(device: Arc<dyn Device>) -> AnyAllocator {
    AnyAllocator::Single(Arc::new(BestFit::new(device, BestFitConfig::default()).expect("pool")))
}

pub fn stream_safe(device: Arc<dyn Device>) -> AnyAllocator {
    AnyAllocator::Streams(Arc::new(StreamSafe::new(device, StreamSafeConfig::default()).expect("allocator")))
}

/// BestFit's settings with `backing`.
fn backed(backing: BackingKind) -> BestFitConfig {
    BestFitConfig { backing, ..BestFitConfig::default() }
}

pub fn best_fit_segments(device: Arc<dyn Device>) -> AnyAllocator {
    AnyAllocator::Single(Arc::new(BestFit::new(device, backed(BackingKind::SEGMENTS)).expect("pool")))
}

pub fn stream_safe_segments(device: Arc<dyn Device>) -> AnyAllocator {
    let config = StreamSafeConfig { pool: backed(BackingKind::SEGMENTS), ..StreamSafeConfig::default() };
    AnyAllocator::Streams(Arc::new(StreamSafe::new(device, config).expect("allocator")))
}

pub fn best_fit_stitched(device: Arc<dyn Device>) -> AnyAllocator {
    AnyAllocator::Single(Arc::new(BestFit::new(device, backed(BackingKind::STITCHED)).expect("pool")))
}

pub fn stream_safe_stitched(device: Arc<dyn Device>) -> AnyAllocator {
    let config = StreamSafeConfig { pool: backed(BackingKind::STITCHED), ..StreamSafeConfig::default() };
    AnyAllocator::Streams(Arc::new(StreamSafe::new(device, config).expect("allocator")))
}

pub fn async_pool(device: Arc<dyn Device>) -> AnyAllocator {
    AnyAllocator::Streams(Arc::new(AsyncPool::new(device, AsyncPoolConfig::default())))
}

/// StreamSafe through its own pointer bookkeeping (the C ABI's path with `stream_safe`).
pub fn stream_safe_by_pointer(device: Arc<dyn Device>) -> AnyAllocator {
    let ss = Arc::new(StreamSafe::new(device.clone(), StreamSafeConfig::default()).expect("allocator"));
    ByPointer::made(ss, device)
}

/// AsyncPool by pointer (the C ABI's path with `async`).
pub fn async_pool_by_pointer(device: Arc<dyn Device>) -> AnyAllocator {
    let pool = Arc::new(AsyncPool::new(device.clone(), AsyncPoolConfig::default()));
    ByPointer::made(pool, device)
}

/// Every configuration of the registries: each strategy of
/// [`STRATEGIES`](streamalloc::facade::STRATEGIES), and a strategy that takes a backing once
/// over each of [`BACKINGS`](streamalloc::allocators::backing::BACKINGS). So a strategy or a
/// backing joins the suite with its registry entry, with no list to add it to. The driver's
/// pool is one of the allocator's own (`pool=owned`): the device's default pool, shared with
/// the rest of the process, keeps its memory past the allocator by design.
pub fn registered() -> Vec<Config> {
    let mut configs = Vec::new();
    for strategy in Registered::all() {
        let config = Config { strategy, pool: PoolChoice::Owned, ..Config::default() };
        match strategy.takes("backing") {
            true => configs.extend(BackingKind::all().map(|backing| Config { backing, ..config.clone() })),
            false => configs.push(config),
        }
    }
    configs
}

/// The stack the facade builds for `config` (the stack of the C ABI, by handle here).
pub fn facade_stack(config: Config) -> impl Fn(Arc<dyn Device>) -> AnyAllocator {
    move |device| AnyAllocator::Streams(Facade::build_stack(&config, device).expect("stack").allocator)
}

/// Every check on every configuration of the registries ([`registered`]), each on a fresh
/// `device()`.
pub fn every_registered_strategy(device: fn() -> TestDevice) {
    for config in registered() {
        eprintln!("{config}");
        let make = facade_stack(config);
        distinct_aligned_ranges(device(), &make);
        size_zero(device(), &make);
        out_of_memory_is_an_error(device(), &make);
        stats_add_up(device(), &make);
        many_threads(device(), &make);
        nothing_leaked(device(), &make);
    }
}

/// Generates the suite's `#[test]` functions for one allocator: `conformance_tests!(name,
/// factory)` on the simulator, `conformance_tests!(gpu name, factory)` on CUDA (ignored
/// unless run with `--ignored`).
#[macro_export]
macro_rules! conformance_tests {
    (gpu $name:ident, $factory:ident) => {
        mod $name {
            use super::conformance::*;
            #[test]
            #[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
            fn distinct_aligned_ranges() {
                super::conformance::distinct_aligned_ranges(cuda_device(), &super::$factory)
            }
            #[test]
            #[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
            fn size_zero() {
                super::conformance::size_zero(cuda_device(), &super::$factory)
            }
            #[test]
            #[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
            fn out_of_memory_is_an_error() {
                super::conformance::out_of_memory_is_an_error(cuda_device(), &super::$factory)
            }
            #[test]
            #[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
            fn stats_add_up() {
                super::conformance::stats_add_up(cuda_device(), &super::$factory)
            }
            #[test]
            #[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
            fn many_threads() {
                super::conformance::many_threads(cuda_device(), &super::$factory)
            }
            #[test]
            #[ignore = "needs a CUDA GPU: run by scripts/gpu-test.sh"]
            fn nothing_leaked() {
                super::conformance::nothing_leaked(cuda_device(), &super::$factory)
            }
        }
    };
    ($name:ident, $factory:ident) => {
        mod $name {
            use super::conformance::*;
            use proptest::prelude::*;
            #[test]
            fn distinct_aligned_ranges() {
                super::conformance::distinct_aligned_ranges(sim_device(), &super::$factory)
            }
            #[test]
            fn size_zero() {
                super::conformance::size_zero(sim_device(), &super::$factory)
            }
            #[test]
            fn out_of_memory_is_an_error() {
                super::conformance::out_of_memory_is_an_error(sim_device(), &super::$factory)
            }
            #[test]
            fn stats_add_up() {
                super::conformance::stats_add_up(sim_device(), &super::$factory)
            }
            #[test]
            fn many_threads() {
                super::conformance::many_threads(sim_device(), &super::$factory)
            }
            #[test]
            fn nothing_leaked() {
                super::conformance::nothing_leaked(sim_device(), &super::$factory)
            }
            proptest! {
                #![proptest_config(ProptestConfig::with_cases(64))]
                #[test]
                fn ordering_checker_finds_no_violation(program in actions()) {
                    prop_assert_eq!(run_program(&super::$factory, &program, true), 0);
                }
            }
        }
    };
}
