"""The streams of front ends that destroy their streams without telling the allocator (RMM,
Numba): each is retired once its last allocation is freed."""

import threading

import streamalloc

_DEFAULT_STREAMS = 3
"""Handles below this are the default streams (0 and 1 the legacy one, 2 the per-thread one),
which are never destroyed."""


class StreamOwners:
    """Allocates and frees through the library, counting the live allocations of each stream
    that can be destroyed; the free of a stream's last one retires the stream
    (`streamalloc.retire_stream`) before it returns, so that a later call of the library (a
    release, a retry on out-of-memory) never names it once the front end has destroyed it.
    Retiring waits (bounded) for the stream's work, and under `stream_safe` gives its pool's
    free memory back. `holder` (the stream's object) is held while the stream owns live
    allocations, so that it outlives the enqueued frees."""

    def __init__(self):
        self._lock = threading.Lock()
        self._live = {}
        """(device, handle) -> [live allocations, holder]."""
        self._owner = {}
        """Pointer -> (device, handle), for the allocations counted in `_live`."""

    def allocate(self, size, device, stream, holder=None):
        """`streamalloc.allocate(size, device, stream)`, counted against `stream`."""
        handle = streamalloc._stream(stream)
        if handle is None or handle < _DEFAULT_STREAMS:
            return streamalloc.allocate(size, device, handle)
        # Under the lock: a free of the stream's last allocation must not retire the stream
        # while this allocation is made on it.
        with self._lock:
            ptr = streamalloc.allocate(size, device, handle)
            if ptr:
                key = (device, handle)
                self._owner[ptr] = key
                self._live.setdefault(key, [0, holder])[0] += 1
        return ptr

    def deallocate(self, ptr):
        """`streamalloc.deallocate(ptr)`; retires the allocation's stream if it owned the stream's
        last live allocation (a StreamallocError if its work outlasted the library's wait: the
        memory is freed, the stream's holder is kept, and the stream must not be destroyed
        yet)."""
        with self._lock:
            streamalloc.deallocate(ptr)
            key = self._owner.pop(ptr, None)
            if key is None:
                return
            entry = self._live[key]
            entry[0] -= 1
            if entry[0] == 0:
                # A stream whose retirement fails stays in `_live` (its holder held), and its
                # next last free tries again.
                streamalloc.retire_stream(key[1], key[0])
                del self._live[key]
