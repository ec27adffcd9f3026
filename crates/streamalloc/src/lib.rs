//! Stream-ordered GPU memory allocators.
//!
//! Layers, arrows pointing down (see `DESIGN.md`):
//! * [`device`]: the only code that talks to a driver: CUDA (loaded at run time) or the
//!   simulator.
//! * [`policy`]: pure bookkeeping on integer addresses (no `unsafe`, no driver calls).
//! * [`allocators`]: [`Plain`](allocators::Plain), [`BestFit`](allocators::BestFit),
//!   [`StreamSafe`](allocators::StreamSafe) and [`AsyncPool`](allocators::AsyncPool), each
//!   implementing [`Allocator`] and, where stream-aware, [`StreamAllocator`].
//! * [`adaptors`]: [`Limit`](adaptors::Limit), [`Retry`](adaptors::Retry),
//!   [`Counted`](adaptors::Counted), [`Trace`](adaptors::Trace) and
//!   [`SingleStream`](adaptors::SingleStream), over any allocator.
//! * [`facade`]: per-device stacks built from a typed [`Config`](facade::Config), the one
//!   place that reads `STREAMALLOC_CONF`.
//! * [`trace`]: the trace format (RMM's logging CSV) the Trace layer writes; reading and
//!   replaying traces is the `streamalloc-replay` crate's part.
//!
//! The ordering contract every allocator follows is written once, in [`allocation`].

#![warn(missing_docs)]

pub mod adaptors;
pub mod allocation;
pub mod allocators;
pub mod device;
pub mod error;
pub mod facade;
pub mod policy;
pub mod trace;

pub use allocation::{
    Allocation, Allocator, Block, BlockOwner, Freed, PointerAllocator, Stats, StreamAllocator, ALIGNMENT,
};
pub use device::{Device, DevicePtr, Stream};
pub use error::{Error, HeldErrors, OutOfMemory, Result};

/// The README's examples, compiled and run as doctests.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
