"""CuPy: route CuPy's device allocations through streamalloc."""

import ctypes
import sys

import streamalloc


def enable(conf=None, checked=False):
    """Makes streamalloc CuPy's allocator (`cupy.cuda.set_allocator`).

    `conf` is a `STREAMALLOC_CONF`-style string; without it the environment variable, or the
    defaults, apply.

    Memory is allocated on CuPy's current stream, as `cupy.cuda.MemoryPool` does: freed, it
    is reused at once by later work on that stream, and by other streams (blocking or not)
    only after the work queued on it before the free. Memory used on another stream than the
    one it was allocated on needs that stream to wait, as under CuPy's own pool.

    By default CuPy calls the C functions directly (`CFunctionAllocator`), which learn the
    current stream from CuPy's own C function (`cupy_backends.cuda.stream`); a failed
    allocation hands CuPy a null pointer (the reason is printed). `checked=True` goes through
    Python instead and raises `cupy.cuda.memory.OutOfMemoryError` (or
    `streamalloc.StreamallocError`) on failure, at the cost of a Python call per allocation
    and free.

    A `cupy.cuda.Stream` is kept alive while memory allocated on it is live (CuPy would
    otherwise destroy it when its last reference goes, possibly before arrays made on it are
    freed, and their free is enqueued on it), and until the library has forgotten it
    (`streamalloc.retire_stream`) once nothing else holds it: no later release or retry on
    out-of-memory then names a destroyed stream.

    Returns the allocator object CuPy holds.
    """
    import cupy

    lib = streamalloc.load()
    if conf is not None:
        streamalloc.configure(conf)
    lib.streamalloc_cupy_set_stream_source(_current_stream_source())
    lib.streamalloc_cupy_set_stream_keeper(ctypes.cast(_KEEPER, ctypes.c_void_p))
    if checked:
        allocator = cupy.cuda.memory.PythonFunctionAllocator(_checked_malloc, _checked_free)
    else:
        malloc = ctypes.cast(lib.streamalloc_cupy_malloc, ctypes.c_void_p).value
        free = ctypes.cast(lib.streamalloc_cupy_free, ctypes.c_void_p).value
        allocator = cupy.cuda.memory.CFunctionAllocator(0, malloc, free, lib)
    cupy.cuda.set_allocator(allocator.malloc)
    return allocator


def _current_stream_source():
    """The address of CuPy's C function returning the current stream (`intptr_t (void)`),
    exported by `cupy_backends.cuda.stream` in its Cython C-API table."""
    from cupy_backends.cuda import stream

    capsule = stream.__pyx_capi__["get_current_stream_ptr"]
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    name = get_name(capsule)
    if not (name.split(b"(")[0].strip().endswith(b"intptr_t") and name.replace(b" ", b"").endswith(b"(void)")):
        raise RuntimeError(f"cupy_backends.cuda.stream.get_current_stream_ptr has type {name!r}, not intptr_t (void)")
    return get_pointer(capsule, name)


_kept = {}
"""Every stream that owned a CuPy allocation made through streamalloc: handle ->
[cupy.cuda.Stream, live allocations, device, retired]. It is held (so CuPy cannot destroy it)
while it owns live allocations and while anything else holds it; once neither, the library
forgets it (`streamalloc.retire_stream`: its pool under `stream_safe` gives its memory back)
and it is let go. CuPy then destroys it, and no later call of the library (a release, a
retry on out-of-memory) names the destroyed stream, which the driver does not survive. See
DESIGN.md, Note [CuPy streams held until retired]."""

_HELD_BY_US_ALONE = 2
"""`sys.getrefcount` of a kept stream that only `_kept` holds: its list's slot and the
argument of the call."""


def _keep(stream, delta):
    """`stream` (a handle) gained a live allocation (`delta` 1, its first through the C
    functions) or lost one (-1, its last through them): see `_kept`."""
    try:
        _count(stream & ((1 << 64) - 1), delta, None)  # the handle unsigned, as CuPy's `ptr`
    except Exception:  # a ctypes callback must not raise (e.g. at interpreter exit)
        pass


def _count(handle, delta, stream):
    """Counts a live allocation of `handle` gained or lost; `stream` is its
    `cupy.cuda.Stream` when the caller has it (else CuPy's current stream, if it is that
    one). Then lets go of the streams no one else holds that own nothing."""
    import cupy

    entry = _kept.get(handle)
    if delta > 0:
        if entry is not None:
            entry[1] += 1
        else:
            stream = stream if stream is not None else cupy.cuda.get_current_stream()
            if stream.ptr == handle:
                _kept[handle] = [stream, 1, cupy.cuda.Device().id, False]
    elif entry is not None:
        entry[1] -= 1
    _let_go()


def _let_go():
    """Retires, then lets go of, every kept stream that owns no live allocation and that
    nothing but `_kept` holds. One whose retirement fails (its work outlasted the library's
    bounded wait) stays held: its pool may still name it."""
    for handle, entry in list(_kept.items()):
        if entry[1] > 0 or entry[3] or sys.getrefcount(entry[0]) > _HELD_BY_US_ALONE:
            continue
        try:
            streamalloc.retire_stream(handle, entry[2])
        except streamalloc.StreamallocError:
            entry[3] = True
            continue
        del _kept[handle]


_KEEPER = ctypes.CFUNCTYPE(None, ctypes.c_ssize_t, ctypes.c_int)(_keep)
"""`_keep` as the C function `streamalloc_cupy_set_stream_keeper` takes (alive as long as the
module)."""


def _checked_malloc(size, device_id):
    import cupy

    # Range-checked as the C types take them (ctypes would wrap them silently).
    size, device_id = streamalloc._size(size), streamalloc._device(device_id, "device_id")
    lib = streamalloc.load()
    out = ctypes.c_void_p()
    current = cupy.cuda.get_current_stream()
    handle = streamalloc._stream(current) or 0
    status = lib.streamalloc_allocate(size, device_id, handle, ctypes.byref(out))
    if status == streamalloc.OUT_OF_MEMORY:
        total = streamalloc.stats(device_id)["allocated"]
        raise cupy.cuda.memory.OutOfMemoryError(size, total)
    streamalloc.check(status)
    if out.value and handle > 2:  # the default streams' handles are never destroyed
        _checked_owner[out.value] = handle
        _count(handle, 1, current)
    return out.value or 0


_checked_owner = {}
"""The stream handle of each live allocation of the checked path on a stream that can be
destroyed (counted in `_kept` until the allocation is freed)."""


def _checked_free(ptr, device_id):
    ptr, device_id = streamalloc._pointer(ptr), streamalloc._device(device_id, "device_id")
    streamalloc.load().streamalloc_cupy_free(None, ptr, device_id)
    handle = _checked_owner.pop(ptr, None)
    if handle is not None:
        _count(handle, -1, None)
