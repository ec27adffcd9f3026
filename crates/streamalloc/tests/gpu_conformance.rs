//! The conformance suite on a CUDA GPU. Every test here is `#[ignore]`d: CI has no GPU;
//! scripts/gpu-test.sh runs them with `--ignored` on the GPU machine.

mod conformance;

use std::sync::Arc;

use conformance::{ByPointer, Made};
use streamalloc::allocators::{BestFit, BestFitConfig, Plain, StreamSafe, StreamSafeConfig};
use streamalloc::{Device, Stream};

fn plain(device: Arc<dyn Device>) -> Made {
    Made::Plain(Arc::new(Plain::new(device, Stream::DEFAULT)))
}

conformance_tests!(gpu plain_on_gpu, plain);

fn best_fit(device: Arc<dyn Device>) -> Made {
    Made::Plain(Arc::new(BestFit::new(device, BestFitConfig::default()).expect("pool")))
}

fn stream_safe(device: Arc<dyn Device>) -> Made {
    Made::Streams(Arc::new(StreamSafe::new(device, StreamSafeConfig::default()).expect("allocator")))
}

conformance_tests!(gpu best_fit_on_gpu, best_fit);
conformance_tests!(gpu stream_safe_on_gpu, stream_safe);

/// BestFit and StreamSafe with expandable segments.
fn expandable() -> BestFitConfig {
    BestFitConfig { expandable: true, ..BestFitConfig::default() }
}

fn best_fit_expandable(device: Arc<dyn Device>) -> Made {
    Made::Plain(Arc::new(BestFit::new(device, expandable()).expect("pool")))
}

fn stream_safe_expandable(device: Arc<dyn Device>) -> Made {
    let config = StreamSafeConfig { pool: expandable(), ..StreamSafeConfig::default() };
    Made::Streams(Arc::new(StreamSafe::new(device, config).expect("allocator")))
}

conformance_tests!(gpu best_fit_expandable_on_gpu, best_fit_expandable);
conformance_tests!(gpu stream_safe_expandable_on_gpu, stream_safe_expandable);

fn async_pool(device: Arc<dyn Device>) -> Made {
    use streamalloc::allocators::{AsyncPool, AsyncPoolConfig};
    Made::Streams(Arc::new(AsyncPool::new(device, AsyncPoolConfig::default())))
}

conformance_tests!(gpu async_pool_on_gpu, async_pool);

/// StreamSafe through its own pointer bookkeeping (the C ABI's path with `stream_safe`).
fn stream_safe_by_pointer(device: Arc<dyn Device>) -> Made {
    let ss = Arc::new(StreamSafe::new(device, StreamSafeConfig::default()).expect("allocator"));
    Made::Streams(Arc::new(ByPointer { pointers: ss.clone(), base: ss }))
}

conformance_tests!(gpu stream_safe_by_pointer_on_gpu, stream_safe_by_pointer);

/// AsyncPool through its own pointer bookkeeping (the C ABI's path with `async`).
fn async_pool_by_pointer(device: Arc<dyn Device>) -> Made {
    use streamalloc::allocators::{AsyncPool, AsyncPoolConfig};
    let pool = Arc::new(AsyncPool::new(device, AsyncPoolConfig::default()));
    Made::Streams(Arc::new(ByPointer { pointers: pool.clone(), base: pool }))
}

conformance_tests!(gpu async_pool_by_pointer_on_gpu, async_pool_by_pointer);
