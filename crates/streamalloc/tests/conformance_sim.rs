//! The conformance suite on the simulator, for every allocator; and the proof that the
//! ordering checker catches a planted early reuse.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod conformance;

use std::sync::Arc;

use conformance::{
    async_pool, async_pool_by_pointer, best_fit, best_fit_segments, best_fit_stitched, plain, run_program,
    stream_safe, stream_safe_by_pointer, stream_safe_segments, stream_safe_stitched, ByPointer,
};
use parking_lot::Mutex;
use std::time::Duration;

use streamalloc::adaptors::{Counted, Limit, Retry, SingleStream, Traced};
use streamalloc::allocators::{BestFit, BestFitConfig, Plain, StreamSafe, StreamSafeConfig};
use streamalloc::trace::TraceWriter;
use streamalloc::{
    Allocation, Allocator, AnyAllocator, Block, BlockOwner, Device, Error, Stats, Stream, StreamAllocator,
};

conformance_tests!(plain_on_sim, plain);

/// A deliberately wrong allocator: it hands a freed block to the next request of the same
/// size on any stream at once, ignoring recorded streams.
struct ReuseAtOnce {
    device: Arc<dyn Device>,
    free: Arc<Mutex<Vec<(u64, usize)>>>,
}

struct ReuseOwner(Arc<Mutex<Vec<(u64, usize)>>>);

impl BlockOwner for ReuseOwner {
    fn free(&self, block: Block) {
        self.0.lock().push((block.ptr, block.size));
    }
}

impl Allocator for ReuseAtOnce {
    fn allocate(&self, size: usize) -> streamalloc::Result<Allocation> {
        self.allocate_on(size, Stream::DEFAULT)
    }
    fn release(&self) -> streamalloc::Result<usize> {
        Ok(0)
    }
    fn stats(&self) -> Stats {
        Stats::default()
    }
    fn reset_peak_stats(&self) {}
    fn device(&self) -> usize {
        0
    }
    fn segments(&self, _out: &mut Vec<streamalloc::Segment>) -> streamalloc::Result<()> {
        Err(streamalloc::Error::Unsupported("a test double".into()))
    }
}

impl StreamAllocator for ReuseAtOnce {
    fn allocate_on(&self, size: usize, stream: Stream) -> streamalloc::Result<Allocation> {
        let hit = {
            let mut free = self.free.lock();
            free.iter().position(|&(_, n)| n == size).map(|i| free.swap_remove(i).0)
        };
        let ptr = match hit {
            Some(p) => p,
            None => self.device.alloc(size).map_err(|e| Error::InvalidArgument(e.to_string()))?,
        };
        let block = Block { ptr, size, stream, ..Block::default() };
        Ok(Allocation::new(block, Arc::new(ReuseOwner(self.free.clone()))))
    }
    fn default_stream(&self) -> Stream {
        Stream::DEFAULT
    }
    fn set_default_stream(&self, _: Stream) {}
    fn retire_stream(&self, _: Stream) -> streamalloc::Result<()> {
        Ok(())
    }
}

fn reuse_at_once(device: Arc<dyn Device>) -> AnyAllocator {
    AnyAllocator::Streams(Arc::new(ReuseAtOnce { device, free: Arc::default() }))
}

/// The checker is not vacuous: a program where stream 1 uses a block, the block is freed and
/// stream 0 gets it back at once is reported.
#[test]
fn checker_catches_planted_early_reuse() {
    use conformance::Action::*;
    let program = [
        Alloc { stream: 0, size: 4096 },
        Use { idx: 0, stream: 1, ns: 1_000_000 },
        Free { idx: 0 },
        Alloc { stream: 0, size: 4096 },
    ];
    assert_eq!(run_program(&reuse_at_once, &program, true), 1);
    // Plain synchronizes the device on free, so the same program is clean.
    assert_eq!(run_program(&plain, &program, true), 0);
}

fn best_fit_any_stream(device: Arc<dyn Device>) -> AnyAllocator {
    let pool = BestFit::new(device.clone(), BestFitConfig::default()).expect("pool");
    AnyAllocator::Streams(Arc::new(SingleStream::new(pool, device, Stream::DEFAULT)))
}

/// Every adaptor stacked over StreamSafe, the facade's order.
fn adaptor_stack(device: Arc<dyn Device>) -> AnyAllocator {
    let inner = StreamSafe::new(device, StreamSafeConfig::default()).expect("allocator");
    let traced = Traced::new(inner, TraceWriter::new(std::io::sink()).expect("writer"));
    let limited = Limit::new(Retry::new(Counted::new(traced), Duration::from_millis(10)), usize::MAX);
    AnyAllocator::Streams(Arc::new(limited))
}

conformance_tests!(best_fit_on_sim, best_fit);
conformance_tests!(stream_safe_on_sim, stream_safe);
conformance_tests!(best_fit_segments_on_sim, best_fit_segments);
conformance_tests!(stream_safe_segments_on_sim, stream_safe_segments);
conformance_tests!(best_fit_stitched_on_sim, best_fit_stitched);
conformance_tests!(stream_safe_stitched_on_sim, stream_safe_stitched);
conformance_tests!(single_stream_best_fit_on_sim, best_fit_any_stream);
conformance_tests!(adaptor_stack_on_sim, adaptor_stack);

fn stream_safe_inner(device: Arc<dyn Device>) -> StreamSafe {
    StreamSafe::new(device, StreamSafeConfig::default()).expect("allocator")
}

fn limit(device: Arc<dyn Device>) -> AnyAllocator {
    AnyAllocator::Streams(Arc::new(Limit::new(stream_safe_inner(device), usize::MAX)))
}

fn retry(device: Arc<dyn Device>) -> AnyAllocator {
    AnyAllocator::Streams(Arc::new(Retry::new(stream_safe_inner(device), Duration::from_millis(10))))
}

fn stats(device: Arc<dyn Device>) -> AnyAllocator {
    AnyAllocator::Streams(Arc::new(Counted::new(stream_safe_inner(device))))
}

fn traced(device: Arc<dyn Device>) -> AnyAllocator {
    let writer = TraceWriter::new(std::io::sink()).expect("writer");
    AnyAllocator::Streams(Arc::new(Traced::new(stream_safe_inner(device), writer)))
}

// Each adaptor on its own too (over StreamSafe, whose allocations have one owner per stream).
conformance_tests!(limit_on_sim, limit);
conformance_tests!(retry_on_sim, retry);
conformance_tests!(stats_on_sim, stats);
conformance_tests!(trace_on_sim, traced);

conformance_tests!(async_pool_on_sim, async_pool);

/// The adaptor stack by pointer (the C ABI's path when adaptors are configured).
fn stack_by_pointer(device: Arc<dyn Device>) -> AnyAllocator {
    let inner = StreamSafe::new(device.clone(), StreamSafeConfig::default()).expect("allocator");
    let traced = Traced::new(inner, TraceWriter::new(std::io::sink()).expect("writer"));
    let stack = Arc::new(Limit::new(Retry::new(Counted::new(traced), Duration::from_millis(10)), usize::MAX));
    ByPointer::made(stack, device)
}

/// Plain by pointer on any stream (the C ABI's path with `strategy=plain,stats=true`).
fn plain_by_pointer(device: Arc<dyn Device>) -> AnyAllocator {
    let plain = Plain::new(device.clone(), Stream::DEFAULT);
    let stack = Arc::new(Counted::new(SingleStream::new(plain, device.clone(), Stream::DEFAULT)));
    ByPointer::made(stack, device)
}

/// BestFit by pointer on any stream (the C ABI's path with `strategy=best_fit`).
fn best_fit_by_pointer(device: Arc<dyn Device>) -> AnyAllocator {
    let pool = BestFit::new(device.clone(), BestFitConfig::default()).expect("pool");
    let stack = Arc::new(SingleStream::new(pool, device.clone(), Stream::DEFAULT));
    ByPointer::made(stack, device)
}

conformance_tests!(stream_safe_by_pointer_on_sim, stream_safe_by_pointer);
conformance_tests!(stack_by_pointer_on_sim, stack_by_pointer);
conformance_tests!(plain_by_pointer_on_sim, plain_by_pointer);
conformance_tests!(best_fit_by_pointer_on_sim, best_fit_by_pointer);

conformance_tests!(async_pool_by_pointer_on_sim, async_pool_by_pointer);

#[test]
fn every_registered_strategy_conforms() {
    conformance::every_registered_strategy(conformance::sim_device);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(16))]
    /// Random programs against the ordering checker, through every configuration of the
    /// registries.
    #[test]
    fn every_registered_strategy_keeps_stream_order(program in conformance::actions()) {
        for config in conformance::registered() {
            let name = config.to_string();
            proptest::prop_assert_eq!(run_program(&conformance::facade_stack(config), &program, true), 0, "{}", name);
        }
    }
}
