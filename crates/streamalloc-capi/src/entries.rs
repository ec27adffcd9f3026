//! What the library's pointer table keeps per allocation for a front end: its own word (a
//! pointer to its records, an index), set at the allocation and handed back at the free, with
//! the allocation's size, owning stream and private pool. A front end (the torch backend)
//! then keeps no table of allocations of its own, and no lock of its own on the hot path.

use std::os::raw::{c_int, c_void};

use core_alloc::facade::private_pools::PoolId;
use core_alloc::facade::Freed;
use core_alloc::{DevicePtr, Error, Result};

use crate::state::{ordinal, State};
use crate::status::{self, StreamallocStatus};
use crate::CudaStream;

/// What the library keeps for one allocation.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct StreamallocEntry {
    /// Its size, as asked for.
    pub size: usize,
    /// Its device.
    pub device: c_int,
    /// Its owning stream (with `device=sim`, its handle).
    pub stream: CudaStream,
    /// The front end's word given at [`streamalloc_allocate_word`] (0 for other allocations).
    pub word: u64,
    /// Whether a stream was recorded on it (`streamalloc_record_stream`).
    pub recorded: bool,
    /// Whether a private pool ([`crate::streamalloc_pool_begin`]) holds it, and which.
    pub in_pool: bool,
    /// The private pool's id, first half (0 outside a pool).
    pub pool_hi: u64,
    /// The private pool's id, second half (0 outside a pool).
    pub pool_lo: u64,
}

impl StreamallocEntry {
    fn of(state: &State, t: &Freed) -> Self {
        let (pool_hi, pool_lo) = t.pool.unwrap_or_default();
        Self {
            size: t.entry.size,
            device: t.device as c_int,
            stream: state.handle(t.device, t.entry.stream) as CudaStream,
            word: t.entry.word,
            recorded: t.entry.recorded,
            in_pool: t.pool.is_some(),
            pool_hi,
            pool_lo,
        }
    }
}

/// `streamalloc_allocate`, keeping `word` with the allocation; where it went (its private
/// pool, if one took it) is written to `*entry` unless NULL.
///
/// # Safety
/// `out` is null (an error) or valid for writing a pointer; `entry` is null or valid for
/// writing a `streamalloc_entry_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_allocate_word(
    size: usize,
    device: c_int,
    stream: CudaStream,
    word: u64,
    out: *mut *mut c_void,
    entry: *mut StreamallocEntry,
) -> StreamallocStatus {
    status::status(|| {
        if out.is_null() {
            return Err(Error::InvalidArgument("out is null".into()));
        }
        let result = State::get().and_then(|s| s.allocate_with(size, device, stream as u64, word));
        // SAFETY: `out` is non-null and, by the caller's contract, valid for writes.
        unsafe { out.write(result.as_ref().map_or(std::ptr::null_mut(), |(p, _)| *p as *mut c_void)) };
        let (ptr, pool) = result?;
        if !entry.is_null() && ptr != 0 {
            let (pool_hi, pool_lo) = pool.unwrap_or_default();
            let made = StreamallocEntry {
                size,
                device,
                stream,
                word,
                recorded: false,
                in_pool: pool.is_some(),
                pool_hi,
                pool_lo,
            };
            // SAFETY: non-null, and valid for writes by the caller's contract.
            unsafe { entry.write(made) };
        }
        Ok(())
    })
}

/// Frees the allocation at `ptr` as [`crate::streamalloc_free`] does (`device` and `stream`
/// where it was made, looked at first) and writes what the library kept for it to `*entry`
/// (unless NULL): its word among it. An unknown pointer is `STREAMALLOC_INVALID_ARGUMENT`,
/// nothing written; so is NULL.
///
/// # Safety
/// `entry` is null or valid for writing a `streamalloc_entry_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_free_word(
    ptr: *mut c_void,
    device: c_int,
    stream: CudaStream,
    entry: *mut StreamallocEntry,
) -> StreamallocStatus {
    status::status(|| {
        let state = State::get()?;
        let taken = state
            .take(ptr as DevicePtr, Some(device), stream as u64)?
            .ok_or_else(|| Error::InvalidArgument("ptr is null".into()))?;
        if !entry.is_null() {
            // SAFETY: non-null, and valid for writes by the caller's contract.
            unsafe { entry.write(StreamallocEntry::of(state, &taken)) };
        }
        Ok(())
    })
}

/// Writes what the library keeps for the live allocation at `ptr` to `*entry`;
/// `STREAMALLOC_INVALID_ARGUMENT` for a pointer that is none.
///
/// # Safety
/// `entry` is null (an error) or valid for writing a `streamalloc_entry_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_entry(
    ptr: *mut c_void,
    entry: *mut StreamallocEntry,
) -> StreamallocStatus {
    status::status(|| {
        if entry.is_null() {
            return Err(Error::InvalidArgument("entry is null".into()));
        }
        let state = State::get()?;
        let taken = state.entry(ptr as DevicePtr)?;
        // SAFETY: non-null, and valid for writes by the caller's contract.
        unsafe { entry.write(StreamallocEntry::of(state, &taken)) };
        Ok(())
    })
}

/// Hands `[ptr, ptr + size)` of private pool `(id_hi, id_lo)` of `device` out again, as an
/// allocation of `size` bytes on `stream` kept with `word` ([`streamalloc_allocate_word`]'s),
/// where the pool's free memory holds that range: PyTorch's cudagraph trees restore a
/// checkpoint of a pool so (`setCheckpointPoolState`), at the addresses its recorded graphs
/// use. Frees of the pool pending on recorded streams are waited for first (bounded by
/// `wait_timeout`). `STREAMALLOC_INVALID_ARGUMENT`, nothing handed out, when the pool does not
/// exist or does not hold the range free.
#[no_mangle]
pub extern "C" fn streamalloc_pool_allocate_at(
    device: c_int,
    id_hi: u64,
    id_lo: u64,
    ptr: *mut c_void,
    size: usize,
    stream: CudaStream,
    word: u64,
) -> StreamallocStatus {
    status::status(|| {
        let state = State::get()?;
        let ordinal = ordinal(device)?;
        let stream = state.stream(stream as u64, Some(ordinal))?;
        let stack = state.facade().stack(ordinal)?;
        let ptr = ptr as DevicePtr;
        stack.private.allocate_at((id_hi, id_lo), ptr, size, stream, word)?;
        if let Some(sim) = &stack.sim {
            let owner = stack.private.entry(ptr).map_or(stream, |(_, e)| e.stream);
            sim.check_handout(ptr, size, owner);
        }
        Ok(())
    })
}

/// Lists the live allocations of private pool `(id_hi, id_lo)` of `device`: up to `max` to
/// `ptrs` and `entries` (each may be NULL), with their count written to `*n`. With too little
/// room nothing is written to the arrays and the status is `STREAMALLOC_INVALID_ARGUMENT`
/// (call again with the count). A pool that does not exist has none.
///
/// # Safety
/// `ptrs` and `entries` are NULL or valid for writing `max` elements; `n` is NULL (an error)
/// or valid for writing a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_pool_live(
    device: c_int,
    id_hi: u64,
    id_lo: u64,
    ptrs: *mut *mut c_void,
    entries: *mut StreamallocEntry,
    max: usize,
    n: *mut usize,
) -> StreamallocStatus {
    status::status(|| {
        if n.is_null() {
            return Err(Error::InvalidArgument("n is null".into()));
        }
        let state = State::get()?;
        let live = pool_live(state, device, (id_hi, id_lo))?;
        // SAFETY: non-null, and valid for writes by the caller's contract.
        unsafe { n.write(live.len()) };
        if live.len() > max {
            return Err(Error::InvalidArgument(format!(
                "room for {max} allocations; the pool has {}",
                live.len()
            )));
        }
        for (i, (ptr, entry)) in live.iter().enumerate() {
            // SAFETY: `i < live.len() <= max`, within the arrays by the caller's contract.
            unsafe {
                if !ptrs.is_null() {
                    ptrs.add(i).write(*ptr as *mut c_void);
                }
                if !entries.is_null() {
                    entries.add(i).write(*entry);
                }
            }
        }
        Ok(())
    })
}

fn pool_live(state: &State, device: c_int, id: PoolId) -> Result<Vec<(DevicePtr, StreamallocEntry)>> {
    let ordinal = ordinal(device)?;
    let Some(stack) = state.facade().built(ordinal) else { return Ok(Vec::new()) };
    Ok(stack
        .private
        .live(id)
        .into_iter()
        .map(|(ptr, entry)| {
            (ptr, StreamallocEntry::of(state, &Freed { device: ordinal, entry, pool: Some(id) }))
        })
        .collect())
}
