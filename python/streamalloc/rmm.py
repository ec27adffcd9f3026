"""RMM: streamalloc as an RMM memory resource, for cuDF, cuML and whatever allocates through
RMM."""

import sys

import streamalloc
from streamalloc._streams import StreamOwners

_owners = StreamOwners()
"""The live allocations of every resource made here, by stream."""

_PROTOCOL_SINCE = "25.12"
"""The first RMM whose streams give Python their handle (`__cuda_stream__`)."""


def resource(conf=None, device=0):
    """An `rmm.mr.CallbackMemoryResource` allocating through streamalloc on `device`.

    `conf` is a `STREAMALLOC_CONF`-style string; without it the environment variable, or the
    defaults, apply. Each allocation is owned by the stream RMM passes (a `DeviceBuffer`'s),
    and its free is ordered there: memory freed on a stream is reused at once by later work on
    that stream, and by other streams only after the work queued before the free. Memory used
    on another stream than its own needs that stream to wait, as under RMM's own pools.

    RMM destroys its streams without telling the allocator, so the free of a stream's last live
    allocation retires the stream (`streamalloc.retire_stream`: a bounded wait for its work;
    under `stream_safe` its pool's free memory goes back to the device). The default streams
    are never retired.

    Needs RMM 25.12 or later (its callbacks' streams give their handle through
    `__cuda_stream__`); an older RMM raises RuntimeError. A failed allocation raises
    `streamalloc.StreamallocError` in RMM (as `MemoryError` when out of memory, with the
    library's figures); a failed free or retirement is printed, as RMM cannot take an error
    from a deallocation.
    """
    import rmm

    _check_version(rmm)
    device = streamalloc._device(device)
    streamalloc.load()
    if conf is not None:
        streamalloc.configure(conf)

    def allocate(size, stream):
        try:
            return _owners.allocate(size, device, stream)
        except streamalloc.StreamallocError as e:
            if e.status == "OUT_OF_MEMORY":
                raise MemoryError(str(e)) from e
            raise

    def deallocate(ptr, size, stream):
        try:
            _owners.deallocate(ptr)
        except Exception as e:  # RMM's deallocation cannot raise: report it
            print(f"streamalloc.rmm: freeing {ptr:#x} ({size} bytes): {e}", file=sys.stderr, flush=True)

    return rmm.mr.CallbackMemoryResource(allocate, deallocate)


def enable(conf=None, device=0):
    """Makes `resource(conf, device)` RMM's resource for `device`
    (`rmm.mr.set_per_device_resource`), and returns it. Call it while `device` is the current
    CUDA device, before RMM allocates there."""
    import rmm

    mr = resource(conf, device)
    rmm.mr.set_per_device_resource(device, mr)
    return mr


def _check_version(rmm):
    """Raises RuntimeError unless RMM's streams follow the CUDA stream protocol."""
    try:
        from rmm.pylibrmm.stream import Stream
    except ImportError:
        Stream = None
    if Stream is None or not hasattr(Stream, "__cuda_stream__"):
        raise RuntimeError(f"streamalloc.rmm needs RMM {_PROTOCOL_SINCE} or later, whose callbacks' streams "
                           f"give their handle (__cuda_stream__); this is RMM {getattr(rmm, '__version__', '?')}")
