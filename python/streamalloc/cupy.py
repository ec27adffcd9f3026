"""CuPy: route CuPy's device allocations through streamalloc."""

import ctypes

import streamalloc


def enable(conf=None, checked=False):
    """Makes streamalloc CuPy's allocator (`cupy.cuda.set_allocator`).

    `conf` is a `STREAMALLOC_CONF`-style string; without it the environment variable, or the
    defaults, apply.

    By default CuPy calls the C functions directly (`CFunctionAllocator`), without a stream:
    memory is allocated on the legacy default stream, and its free records an event there,
    which orders its reuse after all work on CuPy's *blocking* streams (its null stream and
    `cupy.cuda.Stream()`'s default). Work on non-blocking streams is not covered, and a
    failed allocation hands CuPy a null pointer (the reason is printed).

    `checked=True` allocates on CuPy's current stream instead, and raises
    `cupy.cuda.memory.OutOfMemoryError` (or `streamalloc.StreamallocError`) on failure, at
    the cost of a Python call per allocation and free.

    Returns the allocator object CuPy holds.
    """
    import cupy

    lib = streamalloc.load()
    if conf is not None:
        streamalloc.configure(conf)
    if checked:
        allocator = cupy.cuda.memory.PythonFunctionAllocator(_checked_malloc, _checked_free)
    else:
        malloc = ctypes.cast(lib.streamalloc_cupy_malloc, ctypes.c_void_p).value
        free = ctypes.cast(lib.streamalloc_cupy_free, ctypes.c_void_p).value
        allocator = cupy.cuda.memory.CFunctionAllocator(0, malloc, free, lib)
    cupy.cuda.set_allocator(allocator.malloc)
    return allocator


def _checked_malloc(size, device_id):
    import cupy

    lib = streamalloc.load()
    out = ctypes.c_void_p()
    stream = cupy.cuda.get_current_stream().ptr
    status = lib.streamalloc_allocate(size, device_id, stream, ctypes.byref(out))
    if status == streamalloc.OUT_OF_MEMORY:
        total = streamalloc.stats(device_id)["allocated"]
        raise cupy.cuda.memory.OutOfMemoryError(size, total)
    streamalloc.check(status)
    return out.value or 0


def _checked_free(ptr, device_id):
    # The legacy-stream event of the C path also covers memory used on blocking streams.
    streamalloc.load().streamalloc_cupy_free(None, ptr, device_id)
