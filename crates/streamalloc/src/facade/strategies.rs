//! The strategies the facade builds: one entry each in [`STRATEGIES`]. The configuration
//! (`strategy=NAME`, and which keys each strategy takes), the presets, the CLI's comparisons
//! and the conformance suite's facade tests take every strategy from there, so adding one is
//! its allocator's file and its entry here (DESIGN.md, "Adding a strategy or a backing").

use std::sync::Arc;

use super::{Config, DynAllocator, PoolChoice};
use crate::adaptors::SingleStream;
use crate::allocators::{
    AsyncPool, AsyncPoolConfig, BestFit, BestFitConfig, Plain, PoolMode, ReuseFlags, StreamSafe,
    StreamSafeConfig,
};
use crate::device::{Device, Stream};
use crate::error::Result;

/// What the facade knows of a strategy.
#[derive(Debug)]
pub struct StrategySpec {
    /// The name `strategy=` takes.
    pub name: &'static str,
    /// The configuration keys it takes that not every strategy takes: its key groups
    /// ([`CACHING_POOL_KEYS`], [`DRIVER_POOL_KEYS`]) or keys of its own. A key that no strategy
    /// lists applies to all. Parsing refuses, and printing leaves out, a key the chosen
    /// strategy does not list.
    pub keys: &'static [&'static str],
    /// Why tags cannot sleep under it whatever the backing; `None` for a caching pool, whose
    /// tags sleep over stitched ranges.
    pub no_sleep: Option<&'static str>,
    /// Whether it allocates from the driver's stream-ordered pool: an allocation on a
    /// capturing stream stays on the main stack, where the driver keeps it as the graph's
    /// memory, and its memory is not the library's to share with another process.
    pub driver_pool: bool,
    /// Builds it on `device`, under `config`; `pool` holds the caching pools' settings, their
    /// backing chosen for the device.
    pub build: fn(config: &Config, device: &Arc<dyn Device>, pool: BestFitConfig) -> Result<DynAllocator>,
}

/// The keys of the caching pools: how they grow and what backs them.
pub const CACHING_POOL_KEYS: &[&str] = &["growth", "backing"];

/// The keys of the driver's stream-ordered pool.
pub const DRIVER_POOL_KEYS: &[&str] = &["pool", "release_threshold", "throttle", "trim_floor"];

/// [`Plain`]: no caching, on any stream through [`SingleStream`].
pub static PLAIN: StrategySpec = StrategySpec {
    name: "plain",
    keys: &[],
    no_sleep: Some("strategy=plain allocates each block from the device, with no pool to put to sleep"),
    driver_pool: false,
    build: |_, device, _| {
        let plain = Plain::new(device.clone(), Stream::DEFAULT);
        Ok(Arc::new(SingleStream::new(plain, device.clone(), Stream::DEFAULT)))
    },
};

/// [`BestFit`]: one caching pool, on any stream through [`SingleStream`].
pub static BEST_FIT: StrategySpec = StrategySpec {
    name: "best_fit",
    keys: CACHING_POOL_KEYS,
    no_sleep: None,
    driver_pool: false,
    build: |_, device, pool| {
        let best_fit = BestFit::new(device.clone(), pool)?;
        Ok(Arc::new(SingleStream::new(best_fit, device.clone(), Stream::DEFAULT)))
    },
};

/// [`StreamSafe`]: a caching pool per stream (the default).
pub static STREAM_SAFE: StrategySpec = StrategySpec {
    name: "stream_safe",
    keys: CACHING_POOL_KEYS,
    no_sleep: None,
    driver_pool: false,
    build: |_, device, pool| {
        Ok(Arc::new(StreamSafe::new(device.clone(), StreamSafeConfig { pool, ..Default::default() })?))
    },
};

/// [`AsyncPool`]: the driver's stream-ordered pool.
pub static ASYNC: StrategySpec = StrategySpec {
    name: "async",
    keys: DRIVER_POOL_KEYS,
    no_sleep: Some(
        "strategy=async allocates from the driver's pool, whose memory cannot be given back at its addresses",
    ),
    driver_pool: true,
    build: |config, device, _| {
        let mode = match config.pool {
            PoolChoice::Default => PoolMode::DefaultPool {
                release_threshold: Some(usize::try_from(config.release_threshold).unwrap_or(usize::MAX)),
            },
            PoolChoice::Owned | PoolChoice::Ipc => PoolMode::Owned {
                release_threshold: usize::try_from(config.release_threshold).unwrap_or(usize::MAX),
                reuse: ReuseFlags::default(),
                max_size: 0,
                exportable: config.pool == PoolChoice::Ipc,
            },
        };
        let async_config = AsyncPoolConfig {
            mode,
            throttle_ratio: config.throttle,
            trim_floor: config.trim_floor,
            ..Default::default()
        };
        Ok(Arc::new(AsyncPool::new(device.clone(), async_config)))
    },
};

/// Every strategy, in the order presets and comparisons list them.
#[cfg(not(test))]
pub static STRATEGIES: &[&StrategySpec] = &[&PLAIN, &BEST_FIT, &STREAM_SAFE, &ASYNC];

/// The crate's own unit tests register DESIGN.md's worked example, `arena`, as the document
/// says a new strategy is registered: so that the registry's readers are tested with a
/// strategy that takes a key group of its own.
#[cfg(test)]
pub static STRATEGIES: &[&StrategySpec] = &[&PLAIN, &BEST_FIT, &STREAM_SAFE, &ASYNC, &arena::ARENA];

#[cfg(test)]
mod arena;
