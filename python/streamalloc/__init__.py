"""streamalloc: stream-ordered GPU memory allocators, through the bundled libstreamalloc.so.

`stats`, `reset_peak_stats` and `release` work whichever framework allocates;
`streamalloc.torch.enable` and `streamalloc.cupy.enable` plug the library into PyTorch and
CuPy. `allocate`, `deallocate` and `record_stream` are the C API itself, and `streamalloc.sim`
drives the simulator (`device=sim`) and its ordering checker through it. `host_empty` hands out
page-locked (pinned) host memory from the library's pinned pool, reused in stream order;
`host_stats`, `host_release` and `host_reset_peak_stats` are the pool's. `with tag(name):`
puts the allocations the calling thread makes inside the block in a pool of the tag's own,
which `sleep` gives back to the device (its addresses kept, its contents offloaded to pinned
host memory if asked) and `wake` maps again at the same addresses; `tag_stats` has its figures.

Every integer handed to the library is checked against its C type first (ctypes would wrap
it silently: a size of 2**64 + 4096 would be 4096): a value out of range raises
`OverflowError`, one that is not an integer `TypeError`, each naming the argument. A stream is
None (the legacy default stream), an int (a `cudaStream_t`'s value, or a handle from
`sim.create_stream`), a `torch.cuda.Stream` or `cupy.cuda.Stream` (their `cuda_stream` or
`ptr`), or an object of the CUDA stream protocol (`__cuda_stream__`, version 0: RMM's,
numba-cuda's and cuda.core's streams); nothing else.
"""

import ctypes
import importlib.metadata
import operator
import os
import pathlib
import re
import threading

__all__ = ["__version__", "StreamallocError", "library_path", "load", "configure", "stats", "release",
           "reset_peak_stats", "allocate", "deallocate", "record_stream", "segments", "sim", "HostBuffer", "host_empty",
           "host_alloc", "host_free", "host_record_stream", "host_stats", "host_release", "host_reset_peak_stats",
           "tag", "sleep", "wake", "tag_stats", "drop_tag"]

try:
    __version__ = importlib.metadata.version(__name__)
    """The installed distribution's version, which the wheel build takes from Cargo.toml."""
except importlib.metadata.PackageNotFoundError:  # imported from a source checkout
    __version__ = "0+unknown"

STATUS_NAMES = (
    "OK",
    "OUT_OF_MEMORY",
    "INVALID_ARGUMENT",
    "DRIVER_ERROR",
    "NO_DRIVER",
    "LIMIT_EXCEEDED",
    "TIMEOUT",
    "UNSUPPORTED",
    "CONFIG_ERROR",
    "IO_ERROR",
    "INTERNAL",
)
"""Names of the C API's status codes (`streamalloc_status_t`), by value."""

OUT_OF_MEMORY = STATUS_NAMES.index("OUT_OF_MEMORY")
"""The status code of an out-of-memory failure."""


class StreamallocError(RuntimeError):
    """A C API call failed; `status` is its status name, the message the library's."""

    def __init__(self, status, message):
        self.status = STATUS_NAMES[status] if 0 <= status < len(STATUS_NAMES) else str(status)
        super().__init__(f"{self.status}: {message}")


_C_TYPES = {"size_t": ctypes.c_size_t, "uint64_t": ctypes.c_uint64, "bool": ctypes.c_bool, "int": ctypes.c_int,
            "cudaStream_t": ctypes.c_void_p}


def _struct(header, name, known):
    """A ctypes Structure of C struct `name` as `header` (the library's streamalloc.h) defines it;
    `known` maps the structs it may hold by their C names."""
    found = re.search(r"typedef struct %s \{(.*?)\} %s;" % (name, name), header, re.S)
    if found is None:
        raise RuntimeError(f"the library's header defines no {name}")
    fields = []
    for line in found.group(1).splitlines():
        line = line.split("//")[0].strip()
        if not line:
            continue
        member = re.fullmatch(r"(struct |enum )?(\w+) (\w+);", line)
        enum = member and member.group(1) == "enum "
        kind = member and (ctypes.c_int if enum else _C_TYPES.get(member.group(2)) or known.get(member.group(2)))
        if kind is None:
            raise RuntimeError(f"{name} in the library's header has a member this module cannot read: {line!r}")
        fields.append((member.group(3), kind))
    return type(name, (ctypes.Structure,), {"_fields_": fields, "__doc__": f"`{name}`, from the library's header."})


def _structs(lib):
    """`streamalloc_stats_t`, `streamalloc_tag_stats_t`, `streamalloc_segment_t` and
    `streamalloc_block_t`, built from the header the library carries (`streamalloc_header()`,
    generated from its Rust structs): no copy kept here."""
    lib.streamalloc_header.argtypes = []
    lib.streamalloc_header.restype = ctypes.c_char_p
    header = lib.streamalloc_header().decode()
    stats = _struct(header, "streamalloc_stats_t", {})
    tag_stats = _struct(header, "streamalloc_tag_stats_t", {"streamalloc_stats_t": stats})
    return stats, tag_stats, _struct(header, "streamalloc_segment_t", {}), _struct(header, "streamalloc_block_t", {})


def __getattr__(name):
    """`Stats`, `TagStats`, `Segment`, `Block`: the library's structs (`_structs`), once it is
    loaded."""
    if name in ("Stats", "TagStats", "Segment", "Block"):
        load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_lock = threading.Lock()
_lib = None


def _new_lock():
    """A forked child gets a fresh `_lock`: the parent's may have been held by another thread."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock)

_INT_BITS = ctypes.sizeof(ctypes.c_int) * 8
_SIZE_BITS = ctypes.sizeof(ctypes.c_size_t) * 8
_POINTER_BITS = ctypes.sizeof(ctypes.c_void_p) * 8


def _integer(value, name):
    """`value` as an int (anything with `__index__` but a bool), else TypeError naming `name`."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(value).__name__}") from None


def _unsigned(value, name, bits):
    """`value` as an int in 0..2**bits - 1, else OverflowError (TypeError if not an int)."""
    value = _integer(value, name)
    if not 0 <= value < 1 << bits:
        raise OverflowError(f"{name} {value} is out of range: it must be in 0..2**{bits}-1")
    return value


def _size(value, name="size"):
    """A `size_t` argument, checked."""
    return _unsigned(value, name, _SIZE_BITS)


def _uint64(value, name):
    """A `uint64_t` argument, checked."""
    return _unsigned(value, name, 64)


def _device(value, name="device"):
    """An `int` (device ordinal) argument, checked against the C type's range (the library
    itself rejects a negative or unknown ordinal with INVALID_ARGUMENT)."""
    value = _integer(value, name)
    low, high = -(1 << (_INT_BITS - 1)), (1 << (_INT_BITS - 1)) - 1
    if not low <= value <= high:
        raise OverflowError(f"{name} {value} is out of range: it must be in {low}..{high} (a C int)")
    return value


def _pointer(value, name="ptr"):
    """A device pointer argument (an int, or None for NULL), checked."""
    return None if value is None else _unsigned(value, name, _POINTER_BITS)


def _stream(value, name="stream"):
    """A stream argument: None (the legacy default stream), an int (a `cudaStream_t`'s value or
    a handle from `sim.create_stream`), a `torch.cuda.Stream` (its `cuda_stream`) or
    `cupy.cuda.Stream` (its `ptr`), or an object of the CUDA stream protocol (its
    `__cuda_stream__()`, version 0); anything else is a TypeError, never an object's address."""
    if value is None:
        return None
    if not isinstance(value, bool) and hasattr(type(value), "__index__"):
        return _unsigned(value, name, _POINTER_BITS)
    protocol = getattr(value, "__cuda_stream__", None)
    if protocol is not None:
        version, handle = protocol()
        if version != 0:
            raise TypeError(f"{name}.__cuda_stream__() is of version {version}; version 0 is the one known")
        return _unsigned(handle, f"{name}.__cuda_stream__()", _POINTER_BITS)
    for attribute in ("cuda_stream", "ptr"):
        handle = getattr(value, attribute, None)
        if handle is not None:
            return _unsigned(handle, f"{name}.{attribute}", _POINTER_BITS)
    raise TypeError(f"{name} must be None, an int, a torch.cuda.Stream, a cupy.cuda.Stream or an object "
                    f"with __cuda_stream__, not {type(value).__name__}")


def library_path():
    """The path of the bundled libstreamalloc.so."""
    return pathlib.Path(__file__).with_name("libstreamalloc.so")


def load():
    """The loaded library (loaded once; the frameworks load the same file, so they share it)."""
    global _lib
    lib = _lib
    if lib is not None:  # no lock once loaded
        return lib
    with _lock:
        if _lib is None:
            path = library_path()
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: build the package with scripts/build-python.sh")
            lib = ctypes.CDLL(str(path))
            global Stats, TagStats, Segment, Block
            Stats, TagStats, Segment, Block = _structs(lib)
            status = ctypes.c_int
            lib.streamalloc_allocate.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                                                 ctypes.POINTER(ctypes.c_void_p)]
            lib.streamalloc_allocate.restype = status
            lib.streamalloc_deallocate.argtypes = [ctypes.c_void_p]
            lib.streamalloc_deallocate.restype = status
            lib.streamalloc_release.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]
            lib.streamalloc_release.restype = status
            lib.streamalloc_stats.argtypes = [ctypes.c_int, ctypes.POINTER(Stats)]
            lib.streamalloc_stats.restype = status
            size_p = ctypes.POINTER(ctypes.c_size_t)
            lib.streamalloc_segments.argtypes = [ctypes.c_int, ctypes.POINTER(Segment), ctypes.c_size_t,
                                                 ctypes.POINTER(Block), ctypes.c_size_t, size_p, size_p]
            lib.streamalloc_segments.restype = status
            lib.streamalloc_configure.argtypes = [ctypes.c_char_p]
            lib.streamalloc_configure.restype = status
            lib.streamalloc_check_configuration.argtypes = []
            lib.streamalloc_check_configuration.restype = status
            lib.streamalloc_last_error.argtypes = []
            lib.streamalloc_last_error.restype = ctypes.c_char_p
            lib.streamalloc_cupy_free.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
            lib.streamalloc_cupy_free.restype = None
            lib.streamalloc_cupy_set_stream_source.argtypes = [ctypes.c_void_p]
            lib.streamalloc_cupy_set_stream_source.restype = None
            lib.streamalloc_cupy_set_stream_keeper.argtypes = [ctypes.c_void_p]
            lib.streamalloc_cupy_set_stream_keeper.restype = None
            lib.streamalloc_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            lib.streamalloc_record_stream.restype = status
            lib.streamalloc_retire_stream.argtypes = [ctypes.c_int, ctypes.c_void_p]
            lib.streamalloc_retire_stream.restype = status
            lib.streamalloc_reset_peak_stats.argtypes = [ctypes.c_int]
            lib.streamalloc_reset_peak_stats.restype = status
            lib.streamalloc_sim_create_stream.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
            lib.streamalloc_sim_destroy_stream.argtypes = [ctypes.c_int, ctypes.c_void_p]
            lib.streamalloc_sim_use.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                                ctypes.c_uint64]
            lib.streamalloc_sim_synchronize.argtypes = [ctypes.c_int, ctypes.c_void_p]
            lib.streamalloc_sim_advance.argtypes = [ctypes.c_int, ctypes.c_uint64]
            lib.streamalloc_sim_violations.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
            for name in ("create_stream", "destroy_stream", "use", "synchronize", "advance", "violations"):
                getattr(lib, f"streamalloc_sim_{name}").restype = status
            lib.streamalloc_host_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
            lib.streamalloc_host_free.argtypes = [ctypes.c_void_p]
            lib.streamalloc_host_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            lib.streamalloc_host_release.argtypes = [ctypes.POINTER(ctypes.c_size_t)]
            lib.streamalloc_host_stats.argtypes = [ctypes.POINTER(Stats)]
            lib.streamalloc_host_reset_peak_stats.argtypes = []
            lib.streamalloc_sim_use_host.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                                     ctypes.c_uint64]
            for name in ("host_alloc", "host_free", "host_record_stream", "host_release", "host_stats",
                         "host_reset_peak_stats", "sim_use_host"):
                getattr(lib, f"streamalloc_{name}").restype = status
            lib.streamalloc_tag_push.argtypes = [ctypes.c_char_p]
            lib.streamalloc_tag_pop.argtypes = []
            lib.streamalloc_sleep.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t,
                                              ctypes.c_int]
            lib.streamalloc_wake.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t]
            lib.streamalloc_tag_stats.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(TagStats)]
            lib.streamalloc_tag_drop.argtypes = [ctypes.c_int, ctypes.c_char_p]
            for name in ("tag_push", "tag_pop", "sleep", "wake", "tag_stats", "tag_drop"):
                getattr(lib, f"streamalloc_{name}").restype = status
            _lib = lib
        return _lib


def check(status):
    """Raises `StreamallocError` with the thread's last error unless `status` is OK."""
    if status != 0:
        raise StreamallocError(status, load().streamalloc_last_error().decode(errors="replace"))


def configure(conf):
    """Configures the library with a `STREAMALLOC_CONF`-style string. Must come before its
    first use in the process; afterwards only the same configuration is accepted."""
    if not isinstance(conf, str):
        raise TypeError(f"conf must be a str, not {type(conf).__name__}")
    if "\0" in conf:
        raise ValueError("conf contains a NUL character, which would end it there")
    check(load().streamalloc_configure(conf.encode()))


def check_configuration():
    """Fixes the library's configuration now (`configure`'s, else `STREAMALLOC_CONF`) and raises
    `StreamallocError` at once if it is bad, rather than at the first allocation."""
    check(load().streamalloc_check_configuration())


def stats(device=0):
    """The statistics of `device`'s allocator, as a dict (zeros for a device not used yet)."""
    lib = load()
    out = Stats()
    check(lib.streamalloc_stats(_device(device), ctypes.byref(out)))
    return {name: getattr(out, name) for name, _ in Stats._fields_}


BLOCK_STATES = ("free", "allocated", "pending")
"""Names of `streamalloc_block_state_t`'s values, by value."""


def segments(device=0):
    """The segments `device`'s allocators and private pools hold from the device, in address
    order (`streamalloc_segments`), as dicts: `address`, `size`, `stream` (an int, 0 for
    none), `pool` (a private pool's id, or None) and `blocks`, which tile it: dicts of
    `address`, `size` and `state` ("free", "allocated" or "pending": freed, its reuse waiting
    for recorded streams)."""
    lib = load()
    device = _device(device)
    segs, blocks = (Segment * 0)(), (Block * 0)()
    while True:
        ns, nb = ctypes.c_size_t(0), ctypes.c_size_t(0)
        status = lib.streamalloc_segments(device, segs, len(segs), blocks, len(blocks), ctypes.byref(ns),
                                          ctypes.byref(nb))
        if status == 0:
            break
        if status != STATUS_NAMES.index("INVALID_ARGUMENT") or (ns.value <= len(segs) and nb.value <= len(blocks)):
            check(status)
        segs, blocks = (Segment * (ns.value + 4))(), (Block * (nb.value + 4))()
    out = []
    for s in segs[:ns.value]:
        listed = blocks[s.first_block:s.first_block + s.blocks]
        out.append({"address": s.addr, "size": s.size, "stream": s.stream or 0,
                    "pool": (s.pool_hi, s.pool_lo) if s.in_pool else None,
                    "blocks": [{"address": b.addr, "size": b.size, "state": BLOCK_STATES[b.state]} for b in listed]})
    return out


def release(device=0):
    """Returns `device`'s cached memory that no allocation uses to the driver; the bytes."""
    released = ctypes.c_size_t(0)
    check(load().streamalloc_release(_device(device), ctypes.byref(released)))
    return released.value


def reset_peak_stats(device=0):
    """Restarts `device`'s peak figures (allocated_peak, reserved_peak) from the current ones."""
    check(load().streamalloc_reset_peak_stats(_device(device)))


def allocate(size, device=0, stream=None):
    """Allocates `size` bytes on `device`, owned by `stream` (None: the legacy default stream);
    the pointer as an int (0 for size 0). For `stream`, see the module's documentation."""
    size, device, stream = _size(size), _device(device), _stream(stream)
    out = ctypes.c_void_p()
    check(load().streamalloc_allocate(size, device, stream, ctypes.byref(out)))
    return out.value or 0


def deallocate(ptr):
    """Frees an allocation made by any of the library's allocation functions."""
    check(load().streamalloc_deallocate(_pointer(ptr)))


def record_stream(ptr, stream):
    """Marks `stream` as a user of the allocation at `ptr` until it is freed."""
    check(load().streamalloc_record_stream(_pointer(ptr), _stream(stream)))


def retire_stream(stream, device=0):
    """Tells `device`'s allocators that `stream` (a handle) is about to be destroyed, once no
    allocation made on it is live: no later call of the library names it."""
    check(load().streamalloc_retire_stream(_device(device), _stream(stream)))


def host_alloc(size, device=0):
    """Allocates `size` bytes of pinned host memory from the library's pinned pool; the address
    as an int (0 for size 0). The first call makes the pool: `device`'s context pins its memory
    (it serves every device). Prefer `host_empty`, which frees by itself."""
    size, device = _size(size), _device(device)
    out = ctypes.c_void_p()
    check(load().streamalloc_host_alloc(size, device, ctypes.byref(out)))
    return out.value or 0


def host_free(ptr):
    """Frees pinned memory from `host_alloc`: reused once the work of the streams recorded on
    it (`host_record_stream`) has completed."""
    check(load().streamalloc_host_free(_pointer(ptr)))


def host_record_stream(ptr, stream, device=0):
    """Marks `stream`, a stream of `device`, as a user (a copy from or to it) of the pinned
    memory at `ptr` until it is freed."""
    check(load().streamalloc_host_record_stream(_pointer(ptr), _device(device), _stream(stream)))


def host_stats():
    """The statistics of the pinned memory, as a dict with `stats()`'s keys (`reserved`: the bytes
    pinned; zeros before its first allocation): the pool's, and that which `sleep` with
    `offload` keeps for the next sleep."""
    lib = load()
    out = Stats()
    check(lib.streamalloc_host_stats(ctypes.byref(out)))
    return {name: getattr(out, name) for name, _ in Stats._fields_}


def host_release():
    """Gives the pinned memory no buffer uses (and no stream's work still reads) back, that kept
    for offloads too but for a sleeping tag's contents (`empty_cache` leaves it); the bytes."""
    released = ctypes.c_size_t(0)
    check(load().streamalloc_host_release(ctypes.byref(released)))
    return released.value


def host_reset_peak_stats():
    """Restarts the pinned pool's peak figures from the current ones."""
    check(load().streamalloc_host_reset_peak_stats())


def _tag_name(name, what="tag"):
    """A tag's name as the library takes it: a str without NUL, else TypeError or ValueError."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, not {type(name).__name__}")
    if "\0" in name:
        raise ValueError(f"{what} {name!r} contains a NUL character, which would end it there")
    return name.encode()


def _tag_names(tags):
    """`tags` (a str, or an iterable of str) as a C array of names and its length."""
    names = [tags] if isinstance(tags, str) else list(tags)
    encoded = [_tag_name(n, "each tag") for n in names]
    return (ctypes.c_char_p * len(encoded))(*encoded), len(encoded)


class tag:
    """`with streamalloc.tag("kv_cache"): ...`: the allocations the calling thread makes inside
    the block (through any face of the library: PyTorch's, CuPy's, `allocate`) come from a pool
    of the tag's own, which `sleep` and `wake` act on. Blocks nest; the tag is the thread's
    own. Where the configuration cannot sleep (strategy=plain or async, a backing other than
    stitched, a device without virtual memory management) tags are not looked at."""

    def __init__(self, name):
        self.name = name
        self._encoded = _tag_name(name)

    def __enter__(self):
        check(load().streamalloc_tag_push(self._encoded))
        return self

    def __exit__(self, *exc):
        check(load().streamalloc_tag_pop())

    def __repr__(self):
        return f"streamalloc.tag({self.name!r})"


def sleep(tags, offload=False, device=0):
    """Puts `tags` (a name or names) to sleep on `device`: once the work already queued on the
    streams that use their memory is done (waited for through events, the host waiting at most
    the configuration's wait_timeout), their device memory goes back to the driver and their
    addresses stay reserved; with `offload`, their contents are first copied to pinned host
    memory, and `wake` copies them back. Allocating in a sleeping tag raises (INVALID_ARGUMENT,
    naming it); freeing its tensors is allowed. A tag asleep already is left as it is."""
    names, n = _tag_names(tags)
    check(load().streamalloc_sleep(_device(device), names, n, 1 if offload else 0))


def wake(tags, device=0):
    """Wakes `tags` on `device`: fresh memory at the addresses they slept, their offloaded
    contents copied back before this returns (CUDA graphs captured over them replay as
    before). All their memory is mapped or none (OUT_OF_MEMORY: they sleep on, contents kept).
    An awake tag is left as it is."""
    names, n = _tag_names(tags)
    check(load().streamalloc_wake(_device(device), names, n))


def tag_stats(name, device=0):
    """The figures of tag `name` on `device`, as a dict: `asleep`, `offloaded` (bools),
    `slept` (bytes given back at their addresses while it sleeps), and `stats()`'s keys for
    the tag's pool (while it sleeps, `reserved` and `cached` count nothing)."""
    lib = load()
    out = TagStats()
    check(lib.streamalloc_tag_stats(_device(device), _tag_name(name), ctypes.byref(out)))
    figures = {name: getattr(out.stats, name) for name, _ in Stats._fields_}
    return {"asleep": bool(out.asleep), "offloaded": bool(out.offloaded), "slept": out.slept, **figures}


def drop_tag(name, device=0):
    """Drops tag `name` on `device`: its pool's memory and address reservations go back to the
    device, so a tag no longer used costs nothing (a later allocation under the name starts
    afresh). Raises (INVALID_ARGUMENT, nothing dropped) while tensors of the tag are alive."""
    check(load().streamalloc_tag_drop(_device(device), _tag_name(name)))


class _PinnedBlock:
    """One block of the pinned pool, freed when the last reference goes (the `HostBuffer` and
    every view of it each hold one)."""

    def __init__(self, ptr):
        self.ptr = ptr

    def __del__(self):
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            try:
                host_free(ptr)
            except Exception:  # at interpreter exit the module may be half gone: leak rather than raise
                pass


class HostBuffer:
    """`nbytes` of pinned host memory from the library's pinned pool (`host_empty`).

    `ptr` is the address; `view()` a writable memoryview of its bytes (format "B"), and
    `__array_interface__` lets numpy wrap it (`numpy.asarray(buf)`, uint8). The memory goes back
    to the pool when the buffer and every view of it are gone (or after `close()`, once the
    views are gone), and is reused only after the work of the streams recorded on it
    (`record_stream`) has completed. An array made through `__array_interface__` holds the
    buffer itself (numpy keeps it as the array's base): once one was made, `close()` leaves
    the memory to the buffer, which gives it back when it is gone.
    """

    def __init__(self, nbytes, device=0):
        self.nbytes = _size(nbytes, "nbytes")
        self._block = _PinnedBlock(host_alloc(self.nbytes, device))
        # The block kept for the arrays made through __array_interface__ (they hold self).
        self._exported = None

    @property
    def ptr(self):
        """The address (0 for an empty buffer; a closed buffer raises ValueError)."""
        if self._block is None:
            raise ValueError("the HostBuffer is closed")
        return self._block.ptr

    def view(self):
        """A writable memoryview of the buffer's bytes; it keeps the memory alive."""
        array = (ctypes.c_ubyte * self.nbytes).from_address(self.ptr) if self.nbytes else (ctypes.c_ubyte * 0)()
        array._streamalloc_block = self._block  # the view holds the block
        return memoryview(array).cast("B")

    @property
    def __array_interface__(self):
        ptr = self.ptr
        self._exported = self._block  # the array made from it holds self, which holds the block
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}

    def record_stream(self, stream, device=0):
        """Marks `stream`, a stream of `device`, as a user of the buffer (a copy from or to it)
        until it is freed; for `stream`, see the module's documentation."""
        if self.nbytes:
            host_record_stream(self.ptr, stream, device)

    def close(self):
        """Closes the buffer (`ptr` raises then): the memory goes back to the pool now, or when
        the last view of it goes, or, when an array was made through `__array_interface__`,
        when the buffer (the base of such arrays) is gone."""
        self._block = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __len__(self):
        return self.nbytes


def host_empty(nbytes, device=0):
    """`nbytes` of pinned host memory from the library's pinned pool, as a `HostBuffer`. The
    first call makes the pool: `device`'s context pins its memory (it serves every device)."""
    return HostBuffer(nbytes, device)


class _Sim:
    """The simulator behind `device=sim`: streams, simulated kernels and the ordering checker,
    which sees every allocation the library hands out."""

    def create_stream(self, device=0):
        """A new simulated stream of `device`: an opaque handle for the `stream` arguments."""
        out = ctypes.c_void_p()
        check(load().streamalloc_sim_create_stream(_device(device), ctypes.byref(out)))
        return out.value

    def destroy_stream(self, stream, device=0):
        """Destroys a stream made by `create_stream`."""
        check(load().streamalloc_sim_destroy_stream(_device(device), _stream(stream)))

    def use(self, ptr, size, stream, ns, device=0):
        """Enqueues a simulated kernel on `stream` that uses `size` bytes at `ptr` for `ns`."""
        ptr, size, stream, ns = _pointer(ptr), _size(size), _stream(stream), _uint64(ns, "ns")
        check(load().streamalloc_sim_use(_device(device), ptr, size, stream, ns))

    def use_host(self, ptr, size, stream, ns, device=0):
        """Enqueues a simulated copy on `stream` that uses `size` bytes of pinned memory at `ptr`
        for `ns`; `device` is the one whose context pins the pinned pool's memory."""
        ptr, size, stream, ns = _pointer(ptr), _size(size), _stream(stream), _uint64(ns, "ns")
        check(load().streamalloc_sim_use_host(_device(device), ptr, size, stream, ns))

    def synchronize(self, stream=None, device=0):
        """Waits (in virtual time) for the work enqueued on `stream`."""
        check(load().streamalloc_sim_synchronize(_device(device), _stream(stream)))

    def advance(self, ns, device=0):
        """Lets `ns` of virtual host time pass."""
        check(load().streamalloc_sim_advance(_device(device), _uint64(ns, "ns")))

    def violations(self, device=0):
        """How many early reuses the ordering checker has found on `device`."""
        out = ctypes.c_uint64()
        check(load().streamalloc_sim_violations(_device(device), ctypes.byref(out)))
        return out.value


sim = _Sim()
"""The simulator helpers (`device=sim` only; other devices raise UNSUPPORTED)."""
