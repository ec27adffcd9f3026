//! Stream-ordered GPU memory allocators.
//!
//! Layers, arrows pointing down (see `DESIGN.md`):
//! * [`device`]: the only code that talks to a driver: CUDA (loaded at run time) or the
//!   simulator.
//! * [`policy`]: pure bookkeeping on integer addresses (no `unsafe`, no driver calls).
//! * [`allocators`]: [`Plain`](allocators::Plain) and the caching and stream-ordered
//!   allocators, each implementing [`Allocator`] and, where stream-aware,
//!   [`StreamAllocator`].
//!
//! The ordering contract every allocator follows is written once, in [`allocation`].

pub mod adaptors;
pub mod allocation;
pub mod allocators;
pub mod device;
pub mod error;
pub mod facade;
pub mod policy;
pub mod replay;
pub mod trace;

pub use allocation::{Allocation, Allocator, Block, BlockOwner, Stats, StreamAllocator, ALIGNMENT};
pub use device::{Device, DevicePtr, Stream};
pub use error::{Error, OutOfMemory, Result};

/// The README's examples, compiled and run as doctests.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
