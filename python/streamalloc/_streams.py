"""The streams of front ends that destroy their streams without telling the allocator (RMM,
Numba): each is retired before it can be destroyed."""

import sys
import threading

import streamalloc

_DEFAULT_STREAMS = 3
"""Handles below this are the default streams (0 and 1 the legacy one, 2 the per-thread one),
which are never destroyed."""

_HELD_BY_US_ALONE = 2
"""`sys.getrefcount` of a holder that only its entry holds: the entry's slot and the argument
of the call."""


class StreamOwners:
    """Allocates and frees through the library, counting the live allocations of each stream
    that can be destroyed, and retires (`streamalloc.retire_stream`) each stream before the
    front end can destroy it, so that no later call of the library (a release, a retry on
    out-of-memory) names a destroyed stream. Retiring waits (bounded) for the stream's work, and
    under `stream_safe` gives its pool's free memory back.

    A stream given with a `holder` (its object) is held from its first allocation on; once it
    owns no live allocation and nothing else holds the holder, the next allocation or free
    retires it and lets the holder go. A stream given without one (RMM's callbacks see only a
    fresh wrapper of the handle) is retired at the free of its last live allocation, before
    that free returns."""

    def __init__(self):
        self._lock = threading.Lock()
        self._live = {}
        """(device, handle) -> [live allocations, holder]."""
        self._owner = {}
        """Pointer -> (device, handle), for the allocations counted in `_live`."""
        self._idle = set()
        """The keys of `_live` whose stream owns no live allocation (held, to be retired once
        nothing else holds it)."""

    def allocate(self, size, device, stream, holder=None):
        """`streamalloc.allocate(size, device, stream)`, counted against `stream`."""
        handle = streamalloc._stream(stream)
        if handle is None or handle < _DEFAULT_STREAMS:
            ptr = streamalloc.allocate(size, device, handle)
            if self._idle:
                with self._lock:
                    self._let_go()
            return ptr
        # Under the lock: a stream must not be retired while an allocation is made on it.
        with self._lock:
            ptr = streamalloc.allocate(size, device, handle)
            if ptr:
                key = (device, handle)
                self._owner[ptr] = key
                self._live.setdefault(key, [0, holder])[0] += 1
                self._idle.discard(key)
            self._let_go()
        return ptr

    def deallocate(self, ptr):
        """`streamalloc.deallocate(ptr)`, then retires the streams that may go (a
        StreamallocError if one's work outlasted the library's wait: the memory is freed, the
        stream is kept, and it is tried again at the next call)."""
        with self._lock:
            streamalloc.deallocate(ptr)
            key = self._owner.pop(ptr, None)
            if key is not None:
                entry = self._live[key]
                entry[0] -= 1
                if entry[0] == 0:
                    self._idle.add(key)
            self._let_go()

    def _let_go(self):
        """Retires and forgets each idle stream that nothing but its entry holds (or that has no
        holder); one whose retirement fails stays, and the first such error is raised after
        the others were tried."""
        first = None
        for key in list(self._idle):
            holder = self._live[key][1]
            if holder is not None and sys.getrefcount(holder) > _HELD_BY_US_ALONE + 1:  # + `holder` here
                continue
            try:
                streamalloc.retire_stream(key[1], key[0])
            except streamalloc.StreamallocError as e:
                first = first or e
                continue
            self._idle.discard(key)
            del self._live[key]
        if first is not None:
            raise first
