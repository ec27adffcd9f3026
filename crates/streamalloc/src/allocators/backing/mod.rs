//! What a [`BestFit`](super::BestFit) pool backs its blocks with. The pool keeps the blocks
//! (a [`BestFitPolicy`]); a [`Backing`] obtains the memory under them and gives it back,
//! through the pool's [`Ledger`]. Three backings:
//!
//! * [`Chunks`]: chunks from a [`ChunkSource`] (plain device allocations by default), each
//!   given back whole.
//! * [`Segments`]: PyTorch's expandable segments: one address reservation per size class,
//!   mapped from its start as the pool grows.
//! * [`Stitched`]: GMLake's stitching on one address reservation: mapped ranges are placed
//!   next to free blocks so they merge, and the memory of free granules is mapped a second
//!   time, side by side, into a range that serves a request which would otherwise raise the
//!   pool's peak; such ranges are kept and reused without a device call.

mod chunks;
mod segments;
mod stitched;

pub use chunks::{ChunkSource, Chunks, DeviceChunks};
pub use segments::Segments;
pub use stitched::Stitched;

use std::sync::Arc;

use crate::device::Device;
use crate::error::Result;
use crate::policy::best_fit::{BestFitPolicy, Class, Classes, Grant};

/// Which [`Backing`] a pool built from a [`BestFitConfig`](super::BestFitConfig) gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackingKind {
    /// [`Chunks`] of plain device allocations.
    #[default]
    Chunks,
    /// [`Segments`]: expandable segments.
    Segments,
    /// [`Stitched`]: stitched virtual-memory ranges.
    Stitched,
}

/// A request the pool found no free block for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Want {
    /// The request's class.
    pub class: Class,
    /// The request rounded up to [`ALIGNMENT`](crate::ALIGNMENT): the block it needs.
    pub rounded: u64,
    /// The chunk a chunked pool grows by for it
    /// ([`BestFitPolicy::growth_for`](crate::policy::best_fit::BestFitPolicy::growth_for)).
    pub chunk: u64,
    /// Whether that chunk is the request's own (it is larger than the pool's growth size).
    pub own: bool,
}

/// The pool's books as a backing sees them.
pub trait Ledger {
    /// Runs `f` on the pool's policy under the pool's lock (blocks parked for exact reuse are
    /// given back to the policy first). The pool's reserved bytes follow the policy's.
    fn update(&self, f: &mut dyn FnMut(&mut BestFitPolicy) -> Result<()>) -> Result<()>;
    /// [`Ledger::update`], then, under the same lock, serves the request being grown for if a
    /// free block fits it (`None` when none does, or when no request is being grown for). The
    /// grant is an allocation: the caller hands it on (dropping it would leak the block).
    fn update_and_serve(&self, f: &mut dyn FnMut(&mut BestFitPolicy) -> Result<()>) -> Result<Option<Grant>>;
}

/// Where a [`BestFit`](super::BestFit) pool's memory comes from and goes back to.
///
/// A backing adds memory to the pool and takes it away only through the [`Ledger`] the
/// pool passes in, and makes its device calls outside the pool's lock. Memory in a free
/// block was last used in the order of the pool's stream (blocks freed with recorded
/// streams become free only once those streams' events completed), so free memory may be
/// given back only after the pool's stream's work enqueued before it was taken out of the
/// pool: a release takes it out first, then waits ([`Backing::release`]). A backing that
/// reuses free memory while growing does so in the order of the pool's stream, without
/// unmapping it ([`Stitched`] maps it a second time). No backing waits without a bound (but
/// at teardown).
pub trait Backing: Send + Sync {
    /// The device the memory lives on.
    fn device(&self) -> &Arc<dyn Device>;
    /// Adds memory to the pool so that `want` fits, and serves it
    /// ([`Ledger::update_and_serve`]).
    /// `Ok(None)` when other threads took the memory added meanwhile: the pool asks again.
    /// Out-of-memory errors are the device's; the pool releases and retries once.
    fn grow(&self, ledger: &dyn Ledger, want: &Want) -> Result<Option<Grant>>;
    /// Gives the pool's free memory back to the device: the bytes given back, or the first
    /// error met after trying everything.
    ///
    /// What goes back is first taken out of the pool's books, so that no thread can allocate
    /// it, use it on the pool's stream and free it again; then `wait` waits (with a bound)
    /// for the work enqueued on the pool's stream until then, which holds every use of what
    /// was taken; only then is it unmapped or freed. (Waiting first and taking what is free
    /// afterwards would unmap blocks allocated, used and freed during the wait.) When `wait`
    /// fails, what was taken goes back to the pool, but chunks whose `cuMemFree` orders
    /// itself after the device's work when the error is not a [`Timeout`](crate::Error::Timeout) (a stream
    /// that cannot be waited for), and the error is returned.
    fn release(&self, ledger: &dyn Ledger, wait: &dyn Fn() -> Result<()>) -> Result<usize>;
    /// The size classes of a pool over this backing, from those its configuration asks for
    /// (unchanged by default).
    fn classes(&self, configured: Classes) -> Classes {
        configured
    }
    /// Gives back every chunk the pool holds and what its stitched chunks left out of them
    /// ([`BestFitPolicy::take_stitches`]), as `(addr, size)`, when the pool is dropped.
    /// Errors only leak memory: nothing is left to report them to.
    fn teardown(&mut self, chunks: Vec<(u64, u64)>);
}
