//! The segments and blocks a device's allocators hold ([`streamalloc_segments`]): what a
//! front end draws a memory snapshot from (the torch backend's `torch.cuda.memory._snapshot`).

use std::os::raw::c_int;

use core_alloc::{BlockState, Error, Result};

use crate::state::{ordinal, State};
use crate::status::{self, StreamallocStatus};
use crate::CudaStream;

/// What a block is now.
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamallocBlockState {
    /// Free for reuse.
    STREAMALLOC_BLOCK_FREE = 0,
    /// Handed out and not freed.
    STREAMALLOC_BLOCK_ALLOCATED = 1,
    /// Freed; its reuse waits for the work of streams recorded on it.
    STREAMALLOC_BLOCK_PENDING = 2,
}

/// A range of device memory the library holds (a device allocation, or a mapped range).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct StreamallocSegment {
    /// Its first byte.
    pub addr: usize,
    /// Its bytes.
    pub size: usize,
    /// The stream whose pool holds it (with `device=sim`, its handle; NULL for one without).
    pub stream: CudaStream,
    /// Whether a private pool ([`crate::streamalloc_pool_begin`]) holds it, and which.
    pub in_pool: bool,
    /// The private pool's id, first half (0 outside a pool).
    pub pool_hi: u64,
    /// The private pool's id, second half (0 outside a pool).
    pub pool_lo: u64,
    /// Index of its first block in the blocks written by the same call.
    pub first_block: usize,
    /// Its blocks, which tile it in address order.
    pub blocks: usize,
}

/// One block of a [`StreamallocSegment`].
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct StreamallocBlock {
    /// Its first byte.
    pub addr: usize,
    /// Its bytes (as the allocator rounded the request).
    pub size: usize,
    /// What it is now.
    pub state: StreamallocBlockState,
}

/// Lists the segments that `device`'s allocators and private pools hold from the device, in
/// address order, and their blocks: up to `max_segments` segments to `segments` and up to
/// `max_blocks` blocks to `blocks`, with the counts there are written to `*n_segments` and
/// `*n_blocks`. With too little room (NULL and 0 ask for the counts only) nothing is written
/// to the arrays and the status is `STREAMALLOC_INVALID_ARGUMENT`: call again with the counts
/// (they may have grown meanwhile). A device not used yet has none. Under `strategy=async`
/// (the driver's pool, which does not say where its memory is) each live allocation is a
/// segment of one block, its size as asked for, and the driver's cache is not listed. Taken
/// pool by pool: allocations on other threads meanwhile may show in some pools and not others.
///
/// # Safety
/// `segments` is valid for writing `max_segments` segments, `blocks` for `max_blocks` blocks
/// (either may be NULL with 0); `n_segments` and `n_blocks` are NULL (an error) or valid for
/// writing a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_segments(
    device: c_int,
    segments: *mut StreamallocSegment,
    max_segments: usize,
    blocks: *mut StreamallocBlock,
    max_blocks: usize,
    n_segments: *mut usize,
    n_blocks: *mut usize,
) -> StreamallocStatus {
    status::status(|| {
        if n_segments.is_null() || n_blocks.is_null() {
            return Err(Error::InvalidArgument("n_segments or n_blocks is null".into()));
        }
        let (listed, blocks_listed) = list(device)?;
        // SAFETY: non-null, and valid for writes by the caller's contract.
        unsafe {
            n_segments.write(listed.len());
            n_blocks.write(blocks_listed.len());
        }
        if listed.len() > max_segments || blocks_listed.len() > max_blocks {
            return Err(Error::InvalidArgument(format!(
                "room for {max_segments} segments and {max_blocks} blocks; device {device} has {} and {}",
                listed.len(),
                blocks_listed.len()
            )));
        }
        if !listed.is_empty() && segments.is_null() || !blocks_listed.is_empty() && blocks.is_null() {
            return Err(Error::InvalidArgument("segments or blocks is null".into()));
        }
        // SAFETY: the arrays hold at least this many elements (checked above against the
        // capacities the caller vouches for), and the sources are our own vectors.
        unsafe {
            if !listed.is_empty() {
                segments.copy_from_nonoverlapping(listed.as_ptr(), listed.len());
            }
            if !blocks_listed.is_empty() {
                blocks.copy_from_nonoverlapping(blocks_listed.as_ptr(), blocks_listed.len());
            }
        }
        Ok(())
    })
}

/// The segments and blocks of `device`, as C lays them out.
fn list(device: c_int) -> Result<(Vec<StreamallocSegment>, Vec<StreamallocBlock>)> {
    let state = State::get()?;
    let ordinal = ordinal(device)?;
    let Some(stack) = state.facade().built(ordinal) else { return Ok((Vec::new(), Vec::new())) };
    let mut segments = Vec::new();
    let mut blocks = Vec::new();
    for (pool, s) in stack.segments()? {
        let (pool_hi, pool_lo) = pool.unwrap_or_default();
        segments.push(StreamallocSegment {
            addr: s.addr as usize,
            size: s.size,
            stream: state.handle(ordinal, s.stream) as CudaStream,
            in_pool: pool.is_some(),
            pool_hi,
            pool_lo,
            first_block: blocks.len(),
            blocks: s.blocks.len(),
        });
        blocks.extend(s.blocks.iter().map(|b| StreamallocBlock {
            addr: b.addr as usize,
            size: b.size,
            state: match b.state {
                BlockState::Free => StreamallocBlockState::STREAMALLOC_BLOCK_FREE,
                BlockState::Allocated => StreamallocBlockState::STREAMALLOC_BLOCK_ALLOCATED,
                BlockState::Pending => StreamallocBlockState::STREAMALLOC_BLOCK_PENDING,
            },
        }));
    }
    Ok((segments, blocks))
}
