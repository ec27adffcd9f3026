//! Adaptors: decorators over any allocator (RMM's `*_resource_adaptor`s, Paddle's Retry and
//! Stat allocators). Each wraps an [`Allocator`](crate::Allocator) and is a
//! [`StreamAllocator`](crate::StreamAllocator) exactly when what it wraps is one, so the
//! stream methods pass through without downcasts.
//!
//! * [`Limit`]: a hard byte limit.
//! * [`Retry`]: on out-of-memory, release caches and wait (bounded) for frees, then retry.
//! * [`StatsAdaptor`]: current / peak / total bytes and counts, per stream, resettable peaks
//!   and nested scopes.
//! * [`TraceAdaptor`]: writes every allocation and free as RMM's logging CSV.
//! * [`SingleStream`]: makes an allocator without stream methods usable on any stream.

mod limit;
mod retry;
mod single_stream;
mod stats;
mod trace;

pub use limit::Limit;
pub use retry::Retry;
pub use single_stream::SingleStream;
pub use stats::{Scope, StatsAdaptor, StreamStats};
pub use trace::TraceAdaptor;

use std::sync::{Arc, OnceLock};

use crate::allocation::{Allocation, Block, BlockOwner};
use crate::error::{Error, Result};

/// The inner allocator's block owner, learned from its first allocation. Every allocator
/// hands out all its allocations with one owner (see [`BlockOwner`]), so an adaptor can
/// forward frees without storing anything per allocation.
#[derive(Default)]
struct InnerOwner(OnceLock<Arc<dyn BlockOwner>>);

impl InnerOwner {
    /// Takes an inner allocation apart; `Ok(None)` for a zero-size one, which the adaptor
    /// passes on untouched.
    fn adopt(&self, allocation: Allocation) -> Result<Result<Block, Allocation>> {
        if allocation.size() == 0 {
            return Ok(Err(allocation));
        }
        let (block, owner) = allocation.into_parts().expect("non-empty allocations have an owner");
        let known = self.0.get_or_init(|| owner.clone());
        if !Arc::ptr_eq(known, &owner) {
            owner.free(block);
            return Err(Error::InvalidArgument(
                "the wrapped allocator handed out allocations with two different owners; \
                 this is a bug in that allocator"
                    .into(),
            ));
        }
        Ok(Ok(block))
    }

    /// Hands a block back to the inner allocator.
    fn free(&self, block: Block) {
        if let Some(owner) = self.0.get() {
            owner.free(block);
        }
    }
}
