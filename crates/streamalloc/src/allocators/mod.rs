//! The allocators: each implements [`Allocator`](crate::Allocator), and the stream-aware
//! ones [`StreamAllocator`](crate::StreamAllocator).

mod best_fit;
mod chunk_source;
mod plain;

pub use best_fit::{BestFit, BestFitConfig};
pub use chunk_source::{ChunkSource, DeviceChunks};
pub use plain::Plain;
