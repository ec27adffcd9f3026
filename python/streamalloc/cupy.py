"""CuPy: route CuPy's device allocations through streamalloc."""

import ctypes

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
    freed, and their free is enqueued on it).

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
"""The streams that own live allocations: handle -> [cupy.cuda.Stream, live allocations]."""


def _keep(stream, delta):
    """`stream` (a handle) gained its first live allocation (`delta` 1) or lost its last (-1):
    holds its `cupy.cuda.Stream` (CuPy's current stream at the first allocation) in between."""
    stream &= (1 << 64) - 1  # the handle as an unsigned pointer, as CuPy's `ptr`
    try:
        entry = _kept.get(stream)
        if delta > 0:
            if entry is not None:
                entry[1] += 1
            else:
                import cupy

                current = cupy.cuda.get_current_stream()
                if current.ptr == stream:
                    _kept[stream] = [current, 1]
        elif entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del _kept[stream]  # the stream may be destroyed now, after the frees it owned
    except Exception:  # a ctypes callback must not raise (e.g. at interpreter exit)
        pass


_KEEPER = ctypes.CFUNCTYPE(None, ctypes.c_ssize_t, ctypes.c_int)(_keep)
"""`_keep` as the C function `streamalloc_cupy_set_stream_keeper` takes (alive as long as the
module)."""


def _checked_malloc(size, device_id):
    import cupy

    lib = streamalloc.load()
    out = ctypes.c_void_p()
    current = cupy.cuda.get_current_stream()
    status = lib.streamalloc_allocate(size, device_id, current.ptr, ctypes.byref(out))
    if status == streamalloc.OUT_OF_MEMORY:
        total = streamalloc.stats(device_id)["allocated"]
        raise cupy.cuda.memory.OutOfMemoryError(size, total)
    streamalloc.check(status)
    if out.value and current.ptr > 2:  # the default streams' handles are never destroyed
        _checked_streams[out.value] = current
    return out.value or 0


_checked_streams = {}
"""The stream of each live allocation of the checked path on a stream that can be destroyed,
held until the allocation is freed."""


def _checked_free(ptr, device_id):
    streamalloc.load().streamalloc_cupy_free(None, ptr, device_id)
    _checked_streams.pop(ptr, None)
