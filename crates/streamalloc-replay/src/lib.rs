//! Reading allocation traces (RMM's logging CSV) and replaying them through streamalloc's
//! allocators to measure footprint and speed: what the `streamalloc` command's `replay`
//! runs, kept apart from the allocator crate (which only writes traces, through its Trace
//! layer).
//!
//! * [`trace`]: [`Trace::parse`](trace::Trace::parse) turns a trace into dense operations;
//!   [`TraceFile`](trace::TraceFile) reads them from the file again whenever asked.
//! * [`replay`]: [`replay()`](replay::replay) runs them through an allocator on a device;
//!   [`replay_file`](replay::replay_file) runs a trace file's, holding only what is live.
//! * [`compressed`]: trace files compressed with gzip or xz, read and written transparently.
//!
//! ```
//! use std::sync::Arc;
//! use streamalloc::allocators::{StreamSafe, StreamSafeConfig};
//! use streamalloc::device::sim::{SimConfig, SimDevice};
//! use streamalloc_replay::replay::{replay, ReplayOptions, ReplayTarget};
//! use streamalloc_replay::trace::Trace;
//!
//! let csv = "Thread,Time,Action,Pointer,Size,Stream\n\
//!            0,1,allocate,0x1000,1048576,0\n\
//!            0,2,free,0x1000,1048576,0\n";
//! let trace = Trace::parse(csv.as_bytes(), "tiny.csv")?;
//! let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
//! let target = ReplayTarget::Streams(Arc::new(StreamSafe::new(sim.clone(), StreamSafeConfig::default())?));
//! let result = replay(&trace, "stream_safe", &target, sim.as_ref(), &ReplayOptions::default())?;
//! assert_eq!((result.ops, result.failures), (2, 0));
//! # Ok::<(), streamalloc::Error>(())
//! ```

#![warn(missing_docs)]

pub mod compressed;
pub mod replay;
pub mod trace;
