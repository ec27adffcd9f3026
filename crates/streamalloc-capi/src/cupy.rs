//! CuPy's `CFunctionAllocator` ABI: [`streamalloc_cupy_malloc`] and [`streamalloc_cupy_free`],
//! with the two ways `streamalloc.cupy.enable()` tells them about CuPy's streams: where to
//! learn the current stream ([`streamalloc_cupy_set_stream_source`]) and whom to tell while a
//! stream holds live allocations ([`streamalloc_cupy_set_stream_keeper`]).
//!
//! CuPy destroys a `cupy.cuda.Stream` when its last reference goes, which may be before the
//! arrays made on it are freed (a function's locals are dropped in the order they were first
//! assigned, so the stream made first goes first). Freeing such memory in the order of its
//! stream would then call the driver with a destroyed stream (`cuMemFreeAsync` under `async`,
//! an event record under `best_fit`), which is undefined and crashes. The keeper lets the
//! Python side hold a reference to each stream while it owns live allocations, so that a
//! stream outlives its memory.

use std::collections::HashMap;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};

use core_alloc::Stream;
use parking_lot::Mutex;

use crate::state::State;
use crate::status;

/// Where the CuPy functions learn CuPy's current stream (see
/// [`streamalloc_cupy_set_stream_source`]): a function pointer, 0 for none.
static STREAM_SOURCE: AtomicUsize = AtomicUsize::new(0);

/// Whom the CuPy functions tell while a stream owns live allocations (see
/// [`streamalloc_cupy_set_stream_keeper`]): a function pointer, 0 for none.
static STREAM_KEEPER: AtomicUsize = AtomicUsize::new(0);

/// The streams of live CuPy allocations, while a keeper is installed.
static KEPT: Mutex<Option<Owners>> = Mutex::new(None);

/// A function that returns CuPy's current stream (`cudaStream_t`), such as the
/// `get_current_stream_ptr` CuPy exports from `cupy_backends.cuda.stream`.
pub type CupyStreamSource = Option<unsafe extern "C" fn() -> isize>;

/// A function told `(stream, 1)` when the CuPy functions make the first live allocation on
/// `stream`, and `(stream, -1)` after its last one was freed (the free enqueued on it): while
/// it holds a stream between the two calls, the stream cannot be destroyed before its memory
/// is freed. Not called for the legacy and per-thread default streams (handles 0, 1 and 2),
/// which are never destroyed.
pub type CupyStreamKeeper = Option<unsafe extern "C" fn(stream: isize, delta: c_int)>;

/// Makes [`streamalloc_cupy_malloc`] allocate on the stream `source` returns (CuPy's current
/// stream), as `cupy.cuda.MemoryPool` does; NULL goes back to the legacy default stream.
/// `streamalloc.cupy.enable()` installs CuPy's own function.
///
/// # Safety
/// `source`, if not NULL, must be callable from every thread that calls the CuPy functions,
/// in the state CuPy calls its allocator in (CuPy's function reads a Python thread-local, and
/// CuPy allocates and frees with the GIL held).
#[no_mangle]
pub unsafe extern "C" fn streamalloc_cupy_set_stream_source(source: CupyStreamSource) {
    STREAM_SOURCE.store(source.map_or(0, |f| f as usize), Ordering::Release);
}

/// Installs `keeper` (see [`CupyStreamKeeper`]), or with NULL removes it; either way the
/// allocations counted so far are forgotten (the old keeper is not told about them).
/// `streamalloc.cupy.enable()` installs one that holds the `cupy.cuda.Stream` object. In a
/// child forked after the library came into use it does nothing.
///
/// # Safety
/// `keeper`, if not NULL, must be callable from every thread that calls the CuPy functions,
/// in the state CuPy calls its allocator in, and must not call [`streamalloc_cupy_malloc`].
#[no_mangle]
pub unsafe extern "C" fn streamalloc_cupy_set_stream_keeper(keeper: CupyStreamKeeper) {
    // In a forked child the lock may have been held by a thread of the parent.
    if crate::fork::forked() {
        return;
    }
    let mut kept = KEPT.lock();
    STREAM_KEEPER.store(keeper.map_or(0, |f| f as usize), Ordering::Release);
    *kept = keeper.map(|_| Owners::default());
}

/// CuPy's current stream, if a source is installed.
fn current_stream() -> Option<Stream> {
    match STREAM_SOURCE.load(Ordering::Acquire) {
        0 => None,
        f => {
            // SAFETY: a non-zero value is a function of type `CupyStreamSource` stored by
            // streamalloc_cupy_set_stream_source, whose contract makes it callable here.
            let source: unsafe extern "C" fn() -> isize = unsafe { std::mem::transmute(f) };
            // SAFETY: as above; what it returns is CuPy's current stream, a live `cudaStream_t`
            // of the current device (the source's contract), or 0 for the legacy default one.
            Some(unsafe { Stream::from_raw(source() as u64) })
        }
    }
}

/// Tells the installed keeper, if any, that `stream` gained (`delta` 1) or lost (-1) its
/// last live allocation. Called with no lock held: the keeper runs Python code, which may
/// free memory.
fn tell_keeper(stream: u64, delta: c_int) {
    match STREAM_KEEPER.load(Ordering::Acquire) {
        0 => {}
        f => {
            // SAFETY: a non-zero value is a function of type `CupyStreamKeeper` stored by
            // streamalloc_cupy_set_stream_keeper, whose contract makes it callable here.
            let keeper: unsafe extern "C" fn(isize, c_int) = unsafe { std::mem::transmute(f) };
            // SAFETY: as above.
            unsafe { keeper(stream as isize, delta) }
        }
    }
}

/// The stream of each live CuPy allocation on a stream that can be destroyed, and how many
/// each such stream owns.
#[derive(Default)]
struct Owners {
    stream_of: HashMap<u64, u64>,
    live: HashMap<u64, usize>,
}

/// Whether `stream` is one that a program can destroy (not a default stream's handle).
fn destroyable(stream: Stream) -> bool {
    stream.raw() > 2
}

/// Counts the allocation at `ptr` on `stream`; tells the keeper when it is the stream's first.
fn kept_allocation(ptr: u64, stream: Stream) {
    if !destroyable(stream) || STREAM_KEEPER.load(Ordering::Relaxed) == 0 {
        return;
    }
    let first = match KEPT.lock().as_mut() {
        Some(o) => {
            o.stream_of.insert(ptr, stream.raw());
            let live = o.live.entry(stream.raw()).or_default();
            *live += 1;
            *live == 1
        }
        None => false,
    };
    if first {
        tell_keeper(stream.raw(), 1);
    }
}

/// Forgets the allocation at `ptr` (freed); tells the keeper when it was its stream's last.
fn kept_free(ptr: u64) {
    if STREAM_KEEPER.load(Ordering::Relaxed) == 0 {
        return;
    }
    let last = {
        let mut kept = KEPT.lock();
        let Some(o) = kept.as_mut() else { return };
        let Some(stream) = o.stream_of.remove(&ptr) else { return };
        let Some(live) = o.live.get_mut(&stream) else { return };
        *live -= 1;
        (*live == 0).then(|| {
            o.live.remove(&stream);
            stream
        })
    };
    if let Some(stream) = last {
        tell_keeper(stream, -1);
    }
}

/// CuPy `CFunctionAllocator` allocation: `size` bytes on `device`, owned by CuPy's current
/// stream when [`streamalloc_cupy_set_stream_source`] installed a way to learn it (so the
/// memory is reused on that stream at once and elsewhere only after its work, as with
/// `cupy.cuda.MemoryPool`), else by the legacy default stream (see [`streamalloc_cupy_free`]).
/// `param` is unused. Returns NULL on failure, which CuPy does not check: the reason goes to
/// stderr and the last error (`streamalloc.cupy.enable(checked=True)` raises instead).
#[no_mangle]
pub extern "C" fn streamalloc_cupy_malloc(param: *mut c_void, size: usize, device: c_int) -> *mut c_void {
    let _ = param;
    status::abi("streamalloc_cupy_malloc", ptr::null_mut(), || {
        let stream = current_stream().unwrap_or(Stream::DEFAULT);
        let ptr = State::get()?.allocate(size, device, stream.raw())?;
        if ptr != 0 {
            kept_allocation(ptr, stream);
        }
        Ok(ptr as *mut c_void)
    })
}

/// CuPy `CFunctionAllocator` free, in the order of the stream the memory was allocated on.
/// Without a stream source, allocations are on the legacy default stream and an event is
/// recorded there first: that orders the free after all work enqueued so far on every
/// *blocking* stream (CuPy's null stream and `cupy.cuda.Stream()`'s default) and all later
/// work on those streams after it, so the next user of the memory cannot overlap its last
/// one. The stream keeper, if any, is told after the free.
#[no_mangle]
pub extern "C" fn streamalloc_cupy_free(param: *mut c_void, ptr: *mut c_void, device: c_int) {
    let _ = param;
    status::abi("streamalloc_cupy_free", (), || {
        let state = State::get()?;
        let freed = match STREAM_SOURCE.load(Ordering::Relaxed) {
            0 => state.free_legacy(ptr as u64, device),
            _ => state.free(ptr as u64, Some(device), 0),
        };
        kept_free(ptr as u64);
        freed
    });
}
