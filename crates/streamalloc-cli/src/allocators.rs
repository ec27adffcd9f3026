//! The allocators the command knows, by name. Adding one is one line in [`ALLOCATORS`].

use std::sync::Arc;

use streamalloc::allocators::{
    AsyncPool, AsyncPoolConfig, BackingKind, BestFit, BestFitConfig, Plain, PoolMode, StreamSafe,
    StreamSafeConfig,
};
use streamalloc::replay::ReplayTarget;
use streamalloc::{Device, Result, Stream};

/// Builds a fresh allocator on a device.
type Make = fn(Arc<dyn Device>) -> Result<ReplayTarget>;

/// Every allocator the command can replay through, in the order of the default run.
const ALLOCATORS: &[(&str, Make)] = &[
    ("plain", |device| Ok(ReplayTarget::Single(Arc::new(Plain::new(device, Stream::DEFAULT))))),
    ("best_fit", |device| {
        Ok(ReplayTarget::Single(Arc::new(BestFit::new(device, BestFitConfig::default())?)))
    }),
    ("stream_safe", |device| {
        Ok(ReplayTarget::Streams(Arc::new(StreamSafe::new(device, StreamSafeConfig::default())?)))
    }),
    ("stream_safe_expandable", |device| {
        let pool = BestFitConfig { backing: BackingKind::Segments, ..Default::default() };
        Ok(ReplayTarget::Streams(Arc::new(StreamSafe::new(
            device,
            StreamSafeConfig { pool, ..Default::default() },
        )?)))
    }),
    ("async", |device| {
        // The default pool keeps its memory, as the anchors' raw cudaMallocAsync run does.
        let mode = PoolMode::DefaultPool { release_threshold: Some(usize::MAX) };
        Ok(ReplayTarget::Streams(Arc::new(AsyncPool::new(
            device,
            AsyncPoolConfig { mode, ..Default::default() },
        ))))
    }),
];

/// The names of all known allocators.
pub fn names() -> Vec<&'static str> {
    ALLOCATORS.iter().map(|(name, _)| *name).collect()
}

/// The constructor of the allocator called `name`, or an error listing the known names.
pub fn lookup(name: &str) -> std::result::Result<Make, String> {
    ALLOCATORS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, make)| *make)
        .ok_or_else(|| format!("unknown allocator `{name}`; known allocators: {}", names().join(", ")))
}
