//! The hooks of PyTorch's `CUDAPluggableAllocator` and the private-pool C API behind them.
//!
//! `python/streamalloc/torch.py` hands torch each hook by address (`set_record_stream_fn`,
//! `set_begin_allocate_to_pool`, ...). Each function here has the exact type torch calls it
//! with (`torch/csrc/cuda/CUDAPluggableAllocator.h`; torch casts the address to that type):
//!
//! | hook | torch's type | function |
//! | --- | --- | --- |
//! | alloc | `void*(size_t, int, cudaStream_t)` | [`streamalloc_torch_malloc`] |
//! | free | `void(void*, size_t, int, cudaStream_t)` | [`crate::streamalloc_free`] |
//! | record_stream | `void(void*, cudaStream_t)` | [`streamalloc_torch_record_stream`] |
//! | begin_allocate_to_pool | `void(int, MempoolId_t, std::function<bool(cudaStream_t)>)` | [`streamalloc_torch_begin_allocate_to_pool`] |
//! | end_allocate_to_pool | `void(int, MempoolId_t)` | [`streamalloc_torch_end_allocate_to_pool`] |
//! | release_pool | `void(int, MempoolId_t)` | [`streamalloc_torch_release_pool`] |
//! | base_alloc | `void*(void*, size_t*)` | [`streamalloc_torch_base_allocation`] |
//! | reset (`empty_cache`) | `void()` | [`streamalloc_torch_empty_cache`] |
//! | memory_fraction | `void(double, int)` | [`streamalloc_torch_set_memory_fraction`] |
//! | init | `void(int)` | [`streamalloc_torch_init`] |
//!
//! `MempoolId_t` is `std::pair<unsigned long long, unsigned long long>`, passed in two integer
//! registers like two `u64` arguments (x86-64 System V and AArch64 both pass a 16-byte
//! aggregate of two integers so). The filter, a `std::function`, has a non-trivial destructor,
//! so the Itanium C++ ABI passes it by the address of a temporary the caller owns; the C++
//! shim (`shim/torch.cpp`) moves it to the heap, calls it and destroys it. A failed allocation
//! throws a C++ exception from the shim, through [`streamalloc_torch_malloc`] (declared
//! `C-unwind`, it holds nothing to drop when the exception passes), to torch, which raises it
//! in Python; a null pointer would become a tensor without memory.
//!
//! The other hooks have no error channel: an error is written to stderr and kept as the
//! thread's last error. `tests/cpp/torch_hooks.cpp` calls every hook through a pointer of
//! torch's type, on the simulator.

use std::os::raw::{c_char, c_int, c_void};
use std::ptr;
use std::sync::Arc;

use core_alloc::facade::private_pools::PoolId;
use core_alloc::{Error, Stream};
use libc::ssize_t;

use crate::state::State;
use crate::status::{self, StreamallocStatus};
use crate::CudaStream;

extern "C" {
    fn streamalloc_shim_take_filter(by_value: *mut c_void) -> *mut c_void;
    fn streamalloc_shim_call_filter(filter: *mut c_void, stream: CudaStream) -> bool;
    fn streamalloc_shim_drop_filter(filter: *mut c_void);
}

extern "C-unwind" {
    fn streamalloc_shim_throw(out_of_memory: bool, message: *const c_char) -> !;
}

/// Decides whether an allocation on a stream goes to a private pool (see
/// [`streamalloc_pool_begin`]).
pub type StreamallocFilterFn = Option<extern "C" fn(context: *mut c_void, stream: CudaStream) -> bool>;

/// Destroys a filter's context (see [`streamalloc_pool_begin`]).
pub type StreamallocDropFn = Option<extern "C" fn(context: *mut c_void)>;

/// A filter from C: a function, its context and what destroys the context.
struct CFilter {
    call: Option<unsafe extern "C" fn(*mut c_void, CudaStream) -> bool>,
    context: *mut c_void,
    drop: Option<unsafe extern "C" fn(*mut c_void)>,
}

// SAFETY: the C API's contract (streamalloc_pool_begin) is that the filter may be called and
// dropped from any thread; torch's filters (a capture-status query, a thread id comparison)
// are.
unsafe impl Send for CFilter {}
// SAFETY: as for Send; the filter is only ever called through a shared reference.
unsafe impl Sync for CFilter {}

impl CFilter {
    fn matches(&self, s: Stream) -> bool {
        match self.call {
            // SAFETY: `call` and `context` were given together to streamalloc_pool_begin, whose
            // contract keeps them valid until `drop`.
            Some(call) => unsafe { call(self.context, s.raw() as CudaStream) },
            None => true,
        }
    }
}

impl Drop for CFilter {
    fn drop(&mut self) {
        if let Some(drop) = self.drop {
            // SAFETY: called once, with the context it was given for.
            unsafe { drop(self.context) };
        }
    }
}

fn pool_id(id_hi: u64, id_lo: u64) -> PoolId {
    (id_hi, id_lo)
}

fn begin(device: c_int, id: PoolId, filter: CFilter) -> core_alloc::Result<()> {
    let filter = Arc::new(filter);
    State::get()?.pool_begin(device, id, Arc::new(move |s| filter.matches(s)))
}

/// From now on, allocations on `device` go to private pool `(id_hi, id_lo)` if `filter`
/// returns true for the stream they are made on (every allocation if `filter` is NULL), until
/// [`streamalloc_pool_end`]. The pool is made at its first begin; its memory serves nothing
/// else, and frees of its allocations return to it. Several begins of one id share the pool
/// (CUDA graphs given one pool handle). The library owns `context` from this call on, failure
/// included, and calls `drop(context)` (unless `drop` is NULL) once the filter is no longer
/// needed; `filter` may be called from any thread meanwhile.
///
/// # Safety
/// `filter`, if not NULL, may be called with `context` from any thread until `drop` is called.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_pool_begin(
    device: c_int,
    id_hi: u64,
    id_lo: u64,
    filter: StreamallocFilterFn,
    context: *mut c_void,
    drop: StreamallocDropFn,
) -> StreamallocStatus {
    // Made first, so that the context is dropped whatever happens.
    let filter = CFilter { call: filter.map(|f| f as _), context, drop: drop.map(|f| f as _) };
    status::status(|| begin(device, pool_id(id_hi, id_lo), filter))
}

/// Allocations on `device` stop going to private pool `(id_hi, id_lo)` (its newest begin is
/// undone). A pool released while a pool was active is freed here once none is.
#[no_mangle]
pub extern "C" fn streamalloc_pool_end(device: c_int, id_hi: u64, id_lo: u64) -> StreamallocStatus {
    status::status(|| State::get()?.pool_end(device, pool_id(id_hi, id_lo)))
}

/// Private pool `(id_hi, id_lo)` of `device` loses a use (one per begin); with none left, its
/// memory returns to the device as its allocations are freed, once no pool is active.
#[no_mangle]
pub extern "C" fn streamalloc_pool_release(device: c_int, id_hi: u64, id_lo: u64) -> StreamallocStatus {
    status::status(|| State::get()?.pool_release(device, pool_id(id_hi, id_lo)))
}

/// Limits `device` to `fraction` (0 < fraction <= 1) of its memory: an allocation that would
/// take the allocated bytes, or the memory held after the cache is released, over the limit
/// fails with `STREAMALLOC_LIMIT_EXCEEDED`.
#[no_mangle]
pub extern "C" fn streamalloc_set_memory_fraction(device: c_int, fraction: f64) -> StreamallocStatus {
    status::status(|| State::get()?.set_memory_fraction(device, fraction))
}

/// PyTorch's alloc hook: [`crate::streamalloc_malloc`], except that a failure throws a C++
/// `std::runtime_error` (torch raises it in Python as a `RuntimeError` whose message begins
/// "CUDA out of memory" when memory ran out) instead of returning NULL.
#[no_mangle]
pub extern "C-unwind" fn streamalloc_torch_malloc(
    size: ssize_t,
    device: c_int,
    stream: CudaStream,
) -> *mut c_void {
    let mut p = ptr::null_mut();
    let status = status::status(|| {
        p = crate::malloc(size, device, stream)?;
        Ok(())
    });
    if status == StreamallocStatus::STREAMALLOC_OK {
        return p;
    }
    let oom = matches!(
        status,
        StreamallocStatus::STREAMALLOC_OUT_OF_MEMORY | StreamallocStatus::STREAMALLOC_LIMIT_EXCEEDED
    );
    // SAFETY: the last error is a NUL-terminated string that lives until the next failing call
    // on this thread, and the shim copies it before throwing. Torch calls this hook from C++
    // frames that expect exceptions, and this frame holds nothing to drop.
    unsafe { streamalloc_shim_throw(oom, status::last_error()) }
}

/// PyTorch's record_stream hook: [`crate::streamalloc_record_stream`]; an error goes to stderr.
#[no_mangle]
pub extern "C" fn streamalloc_torch_record_stream(ptr: *mut c_void, s: CudaStream) {
    status::abi("record_stream", (), || State::get()?.record_stream(ptr as u64, s as u64));
}

/// PyTorch's begin_allocate_to_pool hook, of type `void(int, MempoolId_t,
/// std::function<bool(cudaStream_t)>)`: [`streamalloc_pool_begin`] with torch's filter.
///
/// # Safety
/// Only for torch (or C++ callers) through a pointer of that type: `filter` is the address of
/// a `std::function<bool(cudaStream_t)>` that the caller destroys after the call.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_torch_begin_allocate_to_pool(
    device: c_int,
    id_hi: u64,
    id_lo: u64,
    filter: *mut c_void,
) {
    status::abi("begin_allocate_to_pool", (), || {
        // SAFETY: `filter` is a live std::function the caller passed by value (see above).
        let context = unsafe { streamalloc_shim_take_filter(filter) };
        if context.is_null() {
            return Err(Error::InvalidArgument("out of host memory for a pool filter".into()));
        }
        let filter = CFilter {
            call: Some(streamalloc_shim_call_filter),
            context,
            drop: Some(streamalloc_shim_drop_filter),
        };
        begin(device, pool_id(id_hi, id_lo), filter)
    });
}

/// PyTorch's end_allocate_to_pool hook, of type `void(int, MempoolId_t)`.
#[no_mangle]
pub extern "C" fn streamalloc_torch_end_allocate_to_pool(device: c_int, id_hi: u64, id_lo: u64) {
    status::abi("end_allocate_to_pool", (), || State::get()?.pool_end(device, pool_id(id_hi, id_lo)));
}

/// PyTorch's release_pool hook, of type `void(int, MempoolId_t)`.
#[no_mangle]
pub extern "C" fn streamalloc_torch_release_pool(device: c_int, id_hi: u64, id_lo: u64) {
    status::abi("release_pool", (), || State::get()?.pool_release(device, pool_id(id_hi, id_lo)));
}

/// PyTorch's base_alloc hook: the base of the device allocation holding `ptr`, with its size
/// written to `*size` (unless NULL); `ptr` itself, size 0, if that cannot be found.
///
/// # Safety
/// `size` is NULL or valid for writing a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_torch_base_allocation(
    ptr: *mut c_void,
    size: *mut usize,
) -> *mut c_void {
    let (base, len) =
        status::abi("base_alloc", (ptr as u64, 0), || State::get()?.base_allocation(ptr as u64));
    if !size.is_null() {
        // SAFETY: non-null, and valid for writes by the caller's contract.
        unsafe { size.write(len) };
    }
    base as *mut c_void
}

/// PyTorch's reset hook (`torch.cuda.empty_cache()`): returns the cached memory of every
/// device in use to the driver (not while a graph capture may be under way).
#[no_mangle]
pub extern "C" fn streamalloc_torch_empty_cache() {
    status::abi("empty_cache", (), || State::get()?.empty_cache().map(drop));
}

/// PyTorch's memory_fraction hook (`torch.cuda.set_per_process_memory_fraction`):
/// [`streamalloc_set_memory_fraction`] with torch's argument order.
#[no_mangle]
pub extern "C" fn streamalloc_torch_set_memory_fraction(fraction: f64, device: c_int) {
    status::abi("set_memory_fraction", (), || State::get()?.set_memory_fraction(device, fraction));
}

/// PyTorch's init hook: builds the library's state (reporting a bad configuration now rather
/// than at the first allocation).
#[no_mangle]
pub extern "C" fn streamalloc_torch_init(device_count: c_int) {
    let _ = device_count;
    status::abi("init", (), || State::get().map(drop));
}
