//! The allocators: each implements [`Allocator`](crate::Allocator), and the stream-aware
//! ones [`StreamAllocator`](crate::StreamAllocator).

pub mod async_pool;
mod best_fit;
mod chunk_source;
mod plain;
mod stream_safe;

pub use async_pool::{AsyncPool, AsyncPoolConfig, Capture, CapturedGraph, PoolMode, ReuseFlags};
pub use best_fit::{BestFit, BestFitConfig, FreeChunk};
pub use chunk_source::{ChunkSource, DeviceChunks};
pub use plain::Plain;
pub use stream_safe::{StreamSafe, StreamSafeConfig};
