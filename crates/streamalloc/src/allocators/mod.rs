//! The allocators: each implements [`Allocator`](crate::Allocator), and the stream-aware
//! ones [`StreamAllocator`](crate::StreamAllocator).

mod plain;

pub use plain::Plain;
