//! Adaptors: decorators over any allocator (RMM's `*_resource_adaptor`s, Paddle's Retry and
//! Stat allocators). Each wraps an [`Allocator`](crate::Allocator) and is a
//! [`StreamAllocator`](crate::StreamAllocator) exactly when what it wraps is one, so the
//! stream methods pass through without downcasts.
//!
//! * [`Limit`]: a hard byte limit.
//! * [`Retry`]: on out-of-memory, release caches and wait (bounded) for frees, then retry.
//! * [`Counted`]: current / peak / total bytes and counts, per stream, resettable peaks
//!   and nested scopes.
//! * [`Traced`]: writes every allocation and free as RMM's logging CSV.
//! * [`SingleStream`]: makes an allocator without stream methods usable on any stream.
//!
//! Each is named for what it adds to the allocator it wraps, without a suffix
//! (`Limit<BestFit>`, `Counted<StreamSafe>`); the figures [`Counted`] keeps are
//! [`StreamStats`], beside the [`Stats`](crate::Stats) every allocator reports.
//!
//! * [`Pointers`]: allocations by pointer for front ends that hand raw pointers to C, kept
//!   in one table at the top of a stack.
//!
//! An adaptor implements the allocation path once, by handle: a free by pointer
//! ([`Pointers::free_ptr`]) drops the handle kept, which reaches each layer below as any
//! handle's free does.

/// The [`Allocator`](crate::Allocator) methods an adaptor passes to the allocator it wraps
/// (`self.inner`) unchanged: the device, and the reset of the peaks.
macro_rules! pass_through_allocator {
    () => {
        fn reset_peak_stats(&self) {
            self.inner.reset_peak_stats()
        }
        fn device(&self) -> usize {
            self.inner.device()
        }
        fn segments(&self, out: &mut Vec<crate::allocation::Segment>) -> Result<()> {
            self.inner.segments(out)
        }
    };
}

/// The per-stream methods of [`StreamAllocator`](crate::StreamAllocator) (default stream,
/// retiring a stream) an adaptor passes to the allocator it wraps (`self.inner`).
macro_rules! pass_through_default_stream {
    () => {
        fn default_stream(&self) -> Stream {
            self.inner.default_stream()
        }
        fn set_default_stream(&self, stream: Stream) {
            self.inner.set_default_stream(stream)
        }
        fn retire_stream(&self, stream: Stream) -> Result<()> {
            self.inner.retire_stream(stream)
        }
    };
}

mod counted;
mod limit;
mod pointers;
mod retry;
mod single_stream;
mod trace;

pub use crate::allocation::PointerEntry;
pub use counted::{Counted, Scope, StreamStats};
pub use limit::{Limit, ReservedLimit};
pub use pointers::Pointers;
pub use retry::Retry;
pub use single_stream::SingleStream;
pub use trace::Traced;

use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use crate::allocation::{Allocation, Block, BlockOwner};

/// What an adaptor does when one of its allocations is freed: its own bookkeeping, and
/// handing the block on to `inner`, the owner that made it.
trait FreeHook: Send + Sync + 'static {
    /// Takes `block` back; must pass it on to `inner`.
    fn free(&self, block: Block, inner: &dyn BlockOwner);
}

/// The owner of an adaptor's allocations made from one inner owner.
struct Wrapped<H> {
    hook: Arc<H>,
    inner: Arc<dyn BlockOwner>,
}

impl<H: FreeHook> BlockOwner for Wrapped<H> {
    fn free(&self, block: Block) {
        self.hook.free(block, self.inner.as_ref());
    }
}

/// One [`Wrapped`] owner per owner of the inner allocator (an allocator may have several:
/// StreamSafe has one per stream), made once and found again without a lock, so an
/// adaptor stores nothing per allocation and threads on different streams share no
/// reference count.
struct Owners<H> {
    known: ArcSwap<Vec<Arc<Wrapped<H>>>>,
    adding: Mutex<()>,
}

impl<H: FreeHook> Owners<H> {
    fn new() -> Self {
        Self { known: ArcSwap::from_pointee(Vec::new()), adding: Mutex::new(()) }
    }

    /// Re-owns an inner allocation by `hook`, after `before` has seen its block; a zero-size
    /// allocation passes through untouched.
    fn adopt(&self, hook: &Arc<H>, allocation: Allocation, before: impl FnOnce(&Block)) -> Allocation {
        if allocation.size() == 0 {
            return allocation;
        }
        let (device, stream) = (allocation.device(), allocation.owning_stream());
        // Only zero-size allocations lack an owner.
        let Some((block, inner)) = allocation.into_parts() else { return Allocation::empty(device, stream) };
        before(&block);
        let wrapped = self.find(&inner).unwrap_or_else(|| {
            let _adding = self.adding.lock();
            self.find(&inner).unwrap_or_else(|| {
                let w = Arc::new(Wrapped { hook: hook.clone(), inner: inner.clone() });
                let mut all = Vec::clone(&self.known.load());
                all.push(w.clone());
                self.known.store(Arc::new(all));
                w
            })
        });
        Allocation::new(block, wrapped)
    }

    fn find(&self, inner: &Arc<dyn BlockOwner>) -> Option<Arc<Wrapped<H>>> {
        self.known.load().iter().find(|w| Arc::ptr_eq(&w.inner, inner)).cloned()
    }
}
