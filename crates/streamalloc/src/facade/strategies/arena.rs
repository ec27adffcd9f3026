//! DESIGN.md's worked example of adding a strategy, registered in the crate's unit tests only
//! ("Adding a strategy or a backing"): its allocator and its entry, as the document writes
//! them, and tests that the configuration, the presets and the facade take it from the
//! registry.

use std::sync::Arc;

use parking_lot::Mutex;

use super::{SingleStream, StrategySpec};
use crate::allocation::{align_up, Allocation, Allocator, Block, BlockOwner, Segment, Stats};
use crate::device::{Device, DevicePtr, Stream};
use crate::error::{Error, Result};

/// One device allocation of `size` bytes, made at the first allocation, bump-allocated and
/// given back when everything in it is freed.
struct Arena {
    inner: Arc<Inner>,
}

struct Inner {
    device: Arc<dyn Device>,
    size: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The device allocation and the offset of its next block.
    base: Option<DevicePtr>,
    next: usize,
    stats: Stats,
}

impl Arena {
    fn new(device: Arc<dyn Device>, size: usize) -> Self {
        Self { inner: Arc::new(Inner { device, size, state: Mutex::new(State::default()) }) }
    }
}

impl Allocator for Arena {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        let device = self.inner.device.ordinal();
        if size == 0 {
            return Ok(Allocation::empty(device, Stream::DEFAULT));
        }
        let rounded =
            align_up(size).ok_or_else(|| Error::InvalidArgument(format!("size {size} overflows")))?;
        let mut state = self.inner.state.lock();
        if state.next + rounded > self.inner.size {
            return Err(Error::LimitExceeded {
                device,
                requested: size,
                in_use: state.next,
                limit: self.inner.size,
            });
        }
        let base = match state.base {
            Some(base) => base,
            None => {
                let base = self.inner.device.alloc(self.inner.size)?;
                state.stats.on_reserve(self.inner.size);
                *state.base.insert(base)
            }
        };
        let ptr = base + state.next as u64;
        state.next += rounded;
        state.stats.on_allocate(size);
        let block =
            Block { ptr, size, stream: Stream::DEFAULT, device, token: 0, recorded: Default::default() };
        Ok(Allocation::new(block, self.inner.clone()))
    }

    fn release(&self) -> Result<usize> {
        Ok(0)
    }

    fn stats(&self) -> Stats {
        self.inner.state.lock().stats
    }

    fn reset_peak_stats(&self) {
        self.inner.state.lock().stats.reset_peaks();
    }

    fn device(&self) -> usize {
        self.inner.device.ordinal()
    }

    fn segments(&self, _: &mut Vec<Segment>) -> Result<()> {
        Ok(())
    }
}

impl BlockOwner for Inner {
    fn free(&self, block: Block) {
        let mut state = self.state.lock();
        state.stats.on_free(block.size);
        if state.stats.live_allocations == 0 {
            if let Some(base) = state.base.take() {
                state.next = 0;
                state.stats.on_unreserve(self.size);
                // A free the device refuses leaves the arena's memory to the device: nothing to
                // report it to in this test-only allocator.
                let _ = self.device.free(base);
            }
        }
    }
}

/// [`Arena`]: one bump-allocated device allocation, on any stream through [`SingleStream`].
pub static ARENA: StrategySpec = StrategySpec {
    name: "arena",
    keys: &["growth"], // the size of its device allocation: `growth` now applies to it too
    no_sleep: Some("strategy=arena holds one device allocation, which cannot sleep in parts"),
    driver_pool: false,
    build: |config, device, _| {
        let arena = Arena::new(device.clone(), config.growth);
        Ok(Arc::new(SingleStream::new(arena, device.clone(), Stream::DEFAULT)))
    },
};

#[cfg(test)]
mod tests {
    use crate::facade::{Config, Facade, Strategy};
    use crate::{Allocator, Stream};

    /// DESIGN.md: "From then on `STREAMALLOC_CONF=strategy=arena` builds it under the stack's
    /// layers, ... `strategy=arena,throttle=0.5` is refused naming `async`", and its
    /// configuration prints back what parses (issue 51: printing hard-coded the caching
    /// pools' keys, so `backing` was printed for it and refused when read back).
    #[test]
    fn the_worked_example_of_design_md_is_a_strategy() {
        let config =
            Config::parse("strategy=arena,device=sim,growth=64MiB,wait_timeout=1s,stats=true").unwrap();
        assert_eq!(config.strategy.name(), "arena");
        assert_eq!(Config::parse(&config.to_string()).unwrap(), config, "{config}");
        assert!(!config.to_string().contains("backing"), "{config}");
        let e = Config::parse("strategy=arena,throttle=0.5").unwrap_err().to_string();
        assert!(e.contains("`throttle` does not apply to strategy=arena; it is taken by async"), "{e}");
        let e = Config::parse("strategy=arena,backing=chunks").unwrap_err().to_string();
        assert!(e.contains("taken by best_fit, stream_safe"), "{e}");
        let e = Config::parse("strategy=async,growth=64MiB").unwrap_err().to_string();
        assert!(e.contains("taken by best_fit, stream_safe, arena"), "{e}");
        assert!(Config::presets().iter().any(|p| p.name == "arena"));
        assert!(Strategy::all().any(|s| s.name() == "arena"));

        let facade = Facade::new(config);
        let stack = facade.stack(0).unwrap();
        let a = facade.allocate(1 << 20, 0, Stream::DEFAULT).unwrap();
        let b = facade.allocate(1 << 20, 0, Stream::DEFAULT).unwrap();
        assert_eq!(b.ptr() - a.ptr(), 1 << 20, "bump-allocated");
        assert_eq!(stack.allocator.stats().reserved, 64 << 20);
        drop((a, b));
        assert_eq!(stack.allocator.stats().reserved, 0, "given back when all is freed");
        assert!(stack.tags.is_err(), "it says it cannot sleep");
    }
}
