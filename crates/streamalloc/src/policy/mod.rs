//! Pure allocation policy: free lists, splitting, coalescing, size classes and stream
//! bookkeeping, on integer addresses. No `unsafe` and no driver calls.
#![deny(unsafe_code)]
pub mod best_fit;
