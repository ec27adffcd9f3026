"""Numba: streamalloc as Numba's external memory manager (an EMM plugin), for Numba's device
arrays. `enable()` installs it; so does `NUMBA_CUDA_MEMORY_MANAGER=streamalloc.numba` in
the environment before Numba starts."""

import contextlib
import ctypes
import threading

from numba import cuda

import streamalloc
from streamalloc._streams import StreamOwners

_owners = StreamOwners()
"""The live allocations of the manager, by stream."""

_current = threading.local()
"""The calling thread's `stream()`, if any: its `stream` attribute, (the stream, its handle)."""


@contextlib.contextmanager
def stream(s):
    """`with streamalloc.numba.stream(s):` the device memory the calling thread allocates
    inside the block (`cuda.device_array(..., stream=s)`, `cuda.to_device(..., stream=s)`) is
    owned by `s` (a `numba.cuda` stream, or any stream `streamalloc.allocate` takes): freed,
    it is reused at once by later work on `s`, and by other streams only after the work queued
    on `s` before the free. Numba's memory manager interface passes no stream, so outside such
    a block memory is owned by the legacy default stream, which is right for work on blocking
    streams (`cuda.stream()`, the default streams) and not on non-blocking ones
    (`cuda.external_stream` of a non-blocking stream). Blocks nest. Numba's streams before
    numba-cuda 0.21 (no `__cuda_stream__`) are taken by their handle, `int(s)`.

    A stream Numba made (`cuda.stream()`) is held while memory allocated on it is live, and
    retired (`streamalloc.retire_stream`) once it is not and nothing else holds it, before it
    can be destroyed. Any other stream (`cuda.external_stream`, a handle) is retired at the
    free of its last allocation: its owner must not destroy it before that free."""
    previous = getattr(_current, "stream", None)
    # A stream Numba made (not external) lives as long as its object, which the manager can
    # hold; any other is retired at its last free.
    _current.stream = (s if getattr(s, "external", None) is False else None, _handle(s))
    try:
        yield s
    finally:
        _current.stream = previous


def _handle(s):
    """The handle of stream `s`, checked: `streamalloc.allocate`'s streams, and Numba's streams
    without the CUDA stream protocol (a `handle` attribute; `int()` gives its value)."""
    if hasattr(s, "handle") and not hasattr(s, "__cuda_stream__") and hasattr(type(s), "__int__"):
        return streamalloc._stream(int(s), "s")
    return streamalloc._stream(s, "s")


class StreamallocManager(cuda.HostOnlyCUDAMemoryManager):
    """Numba's device allocations through streamalloc (host allocations stay Numba's own).

    Each allocation is owned by the calling thread's `stream()` (the legacy default stream
    outside one; see `stream` for when a stream is retired) and freed, in that stream's order,
    when Numba lets go of it. A failed allocation raises `streamalloc.StreamallocError`.
    """

    def initialize(self):
        """Loads the library (a missing one fails here, not at the first allocation)."""
        streamalloc.load()

    def memalloc(self, size):
        """`size` bytes on the context's device, owned by the calling thread's `stream()`."""
        owner, handle = getattr(_current, "stream", None) or (None, None)
        ptr = _owners.allocate(size, self.context.device.id, handle, holder=owner)
        return cuda.MemoryPointer(self.context, ctypes.c_void_p(ptr), size, finalizer=_freer(ptr))

    def get_memory_info(self):
        """Not known to a pool (as RMM's plugin says): NotImplementedError, which Numba allows."""
        raise NotImplementedError("streamalloc.numba: a pool's free memory is not the device's; "
                                  "see streamalloc.stats()")

    def get_ipc_handle(self, memory):
        """CUDA IPC handles of streamalloc's memory cannot be made through Numba:
        NotImplementedError."""
        raise NotImplementedError("streamalloc.numba: Numba's IPC handles (cuIpcGetMemHandle) do not cover "
                                  "streamalloc's memory")

    @property
    def interface_version(self):
        """The EMM plugin interface implemented: 1."""
        return 1


def _freer(ptr):
    """The finalizer of the allocation at `ptr` (it must not hold the MemoryPointer)."""
    return lambda: _owners.deallocate(ptr)


_numba_memory_manager = StreamallocManager
"""What `NUMBA_CUDA_MEMORY_MANAGER=streamalloc.numba` installs."""


def enable(conf=None):
    """Makes `StreamallocManager` Numba's memory manager (`numba.cuda.set_memory_manager`);
    call it before Numba's first use of the GPU. `conf` is a `STREAMALLOC_CONF`-style string;
    without it the environment variable, or the defaults, apply."""
    streamalloc.load()
    if conf is not None:
        streamalloc.configure(conf)
    cuda.set_memory_manager(StreamallocManager)
