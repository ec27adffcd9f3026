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
//!   [`Counted`](adaptors::Counted), [`Traced`](adaptors::Traced) and
//!   [`SingleStream`](adaptors::SingleStream), over any allocator.
//! * [`facade`]: per-device stacks built from a typed [`Config`](facade::Config), the one
//!   place that reads `STREAMALLOC_CONF`.
//! * [`tags`]: the calling thread's tag, which puts allocations in pools that sleep and wake
//!   ([`Tagged`](allocators::Tagged)).
//! * [`trace`]: the trace format (RMM's logging CSV) the Trace layer writes; reading and
//!   replaying traces is the `streamalloc-replay` crate's part.
//!
//! The ordering contract every allocator follows is written once, in [`allocation`].
//!
//! # Quick start
//!
//! An allocator over a device: the GPU when the CUDA driver finds one, else the simulator
//! (which runs the same code on the CPU, with an ordering checker). [`facade::Facade`] builds
//! the same from a configuration string, as `libstreamalloc.so` does.
//!
//! ```
//! use std::sync::Arc;
//! use streamalloc::allocators::{StreamSafe, StreamSafeConfig};
//! use streamalloc::device::cuda::CudaDevice;
//! use streamalloc::device::sim::{SimConfig, SimDevice};
//! use streamalloc::{Allocator, Device, StreamAllocator};
//!
//! let device: Arc<dyn Device> = match CudaDevice::new(0) {
//!     Ok(gpu) => gpu,
//!     Err(_) => SimDevice::new(SimConfig::with_capacity(1 << 30)),
//! };
//! let alloc = StreamSafe::new(device.clone(), StreamSafeConfig::default())?;
//! let stream = device.create_stream()?;
//! let mut a = alloc.allocate_on(64 << 20, stream)?; // belongs to `stream`
//! a.record_stream(device.create_stream()?); // another stream uses it too
//! assert_eq!(alloc.stats().allocated, 64 << 20);
//! drop(a); // reused only after both streams' work
//! alloc.release()?; // the cache goes back to the device
//! # Ok::<(), streamalloc::Error>(())
//! ```

#![warn(missing_docs)]

pub mod adaptors;
pub mod allocation;
pub mod allocators;
pub mod device;
pub mod error;
pub mod facade;
pub mod policy;
pub(crate) mod stream_table;
pub mod tags;
pub mod text;
pub mod trace;

pub use allocation::{
    Allocation, Allocator, AnyAllocator, Block, BlockOwner, BlockState, Kept, KeptBlock, PointerEntry,
    ReservedGauge, Segment, SegmentBlock, Stats, StreamAllocator, ALIGNMENT,
};
pub use device::{Device, DevicePtr, Stream, Streams};
pub use error::{Error, HeldErrors, OutOfMemory, Result};

/// The README's examples, compiled and run as doctests.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
