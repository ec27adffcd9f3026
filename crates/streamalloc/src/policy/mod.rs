//! Pure allocation policy: free lists, splitting, coalescing, size classes and stream
//! bookkeeping, on integer addresses. No `unsafe` and no driver calls.

pub mod best_fit;

/// Alignment of every pointer handed out, and the unit of every block size, in bytes.
pub const ALIGNMENT: usize = 256;
