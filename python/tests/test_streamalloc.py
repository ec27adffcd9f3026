"""Tests of the streamalloc Python package on the simulator, without torch or cupy.

Run as a script (`python3 python/tests/test_streamalloc.py`) or with pytest, with the package
(and libstreamalloc.so in it) importable and STREAMALLOC_CONF unset: the tests configure
device=sim themselves. Stand-ins for torch and cupy call the C functions the way the real
frameworks do (through ctypes, by name or by address), so the ABI wiring is exercised too.
"""

import ctypes
import os
import pathlib
import re
import subprocess
import sys
import types
from unittest import mock

import streamalloc
import streamalloc.cupy
import streamalloc.torch

CONF = "device=sim,strategy=plain,sim_capacity=8GiB"
HEADER = pathlib.Path(__file__).resolve().parents[2] / "crates/streamalloc-capi/include/streamalloc.h"


def fake_torch():
    """A stand-in for torch.cuda.memory that loads the library and calls it as torch does."""
    calls = {}

    class Hooks:
        """torch._C._cuda_CUDAAllocator: each setter takes a function's address."""

        def __getattr__(self, setter):
            if not setter.startswith("set_"):
                raise AttributeError(setter)
            return lambda address: calls.setdefault("hooks", {}).__setitem__(setter, address)

    class CUDAPluggableAllocator:
        def __init__(self, path, alloc_fn_name, free_fn_name):
            lib = ctypes.CDLL(path)
            self.alloc = getattr(lib, alloc_fn_name)
            self.alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
            self.alloc.restype = ctypes.c_void_p
            self.free = getattr(lib, free_fn_name)
            self.free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
            self.free.restype = None
            self._hooks = Hooks()

        def allocator(self):
            return self._hooks

    def change_current_allocator(allocator):
        calls["current"] = allocator

    memory = types.SimpleNamespace(CUDAPluggableAllocator=CUDAPluggableAllocator,
                                   change_current_allocator=change_current_allocator)
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(memory=memory)
    return torch, calls


def fake_cupy():
    """A stand-in for cupy.cuda that calls the allocator as CuPy's Cython code does."""
    calls = {}
    default_stream = types.SimpleNamespace(ptr=0)
    malloc_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    free_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)

    class OutOfMemoryError(MemoryError):
        def __init__(self, size, total, limit=0):
            super().__init__(f"out of memory allocating {size} bytes (allocated so far: {total})")

    class CFunctionAllocator:
        def __init__(self, param, malloc_func, free_func, owner):
            self.param, self.owner = param, owner
            self._malloc, self._free = malloc_t(malloc_func), free_t(free_func)

        def malloc(self, size):
            ptr = self._malloc(self.param, size, 0) or 0
            return ptr, lambda: self._free(self.param, ptr, 0)

    class PythonFunctionAllocator:
        def __init__(self, malloc_func, free_func):
            self._malloc, self._free = malloc_func, free_func

        def malloc(self, size):
            ptr = self._malloc(size, 0)
            return ptr, lambda: self._free(ptr, 0)

    def set_allocator(malloc):
        calls["malloc"] = malloc

    memory = types.SimpleNamespace(CFunctionAllocator=CFunctionAllocator,
                                   PythonFunctionAllocator=PythonFunctionAllocator,
                                   OutOfMemoryError=OutOfMemoryError)
    cuda = types.SimpleNamespace(memory=memory, set_allocator=set_allocator,
                                 get_current_stream=lambda: calls.get("stream", default_stream),
                                 Device=lambda: types.SimpleNamespace(id=0))
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    # cupy_backends.cuda.stream exports get_current_stream_ptr in its Cython C-API table.
    source_t = ctypes.CFUNCTYPE(ctypes.c_ssize_t)

    @source_t
    def current_stream():
        calls["stream_queries"] = calls.get("stream_queries", 0) + 1
        return calls.get("stream", default_stream).ptr

    name = b"intptr_t (void)"
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = new_capsule(ctypes.cast(current_stream, ctypes.c_void_p), name, None)
    calls["keep"] = (current_stream, name)
    stream = types.ModuleType("cupy_backends.cuda.stream")
    stream.__pyx_capi__ = {"get_current_stream_ptr": capsule}
    backends = types.ModuleType("cupy_backends")
    backends.cuda = types.ModuleType("cupy_backends.cuda")
    backends.cuda.stream = stream
    modules = {"cupy": cupy, "cupy_backends": backends, "cupy_backends.cuda": backends.cuda,
               "cupy_backends.cuda.stream": stream}
    return modules, calls


def remove_fake_cupy(modules):
    """Undoes `fake_cupy` and `streamalloc.cupy.enable`: the stand-in's modules go, and the
    library forgets CuPy's stream source and keeper."""
    for name in modules:
        del sys.modules[name]
    streamalloc.load().streamalloc_cupy_set_stream_source(None)
    streamalloc.load().streamalloc_cupy_set_stream_keeper(None)


def test_configure_stats_release():
    streamalloc.configure(CONF)
    streamalloc.configure(CONF)  # the same configuration again is fine
    try:
        streamalloc.configure("device=sim,strategy=plain,stats=true")
        raise AssertionError("a different configuration was accepted")
    except streamalloc.StreamallocError as e:
        assert e.status == "CONFIG_ERROR" and "already configured" in str(e), e
    s = streamalloc.stats(0)
    assert set(s) == {name for name, _ in streamalloc.Stats._fields_}
    assert streamalloc.release(2) == 0
    assert isinstance(streamalloc.release(0), int)
    for bad in (-1, 64):
        try:
            streamalloc.stats(bad)
            raise AssertionError(f"stats({bad}) succeeded")
        except streamalloc.StreamallocError as e:
            assert e.status == "INVALID_ARGUMENT" and f"device {bad}" in str(e), e


def test_torch_enable():
    torch, calls = fake_torch()
    sys.modules["torch"] = torch
    names = ("STREAMALLOC_TORCH", "STREAMALLOC_CONF")
    try:
        with mock.patch.dict(os.environ):  # the environment as it was, afterwards
            for name in names:
                os.environ.pop(name, None)
            allocator = streamalloc.torch.enable(CONF)
            # Processes this one starts (torch.multiprocessing's spawned workers, which open the
            # CUDA tensors it shares) enable streamalloc too, with the same configuration.
            exported = {name: os.environ.get(name) for name in names}
    finally:
        del sys.modules["torch"]
    assert exported == {"STREAMALLOC_TORCH": "1", "STREAMALLOC_CONF": CONF}, exported
    assert calls["current"] is allocator
    lib = streamalloc.load()
    address = {name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for _, name in streamalloc.torch._HOOKS}
    assert calls["hooks"] == {setter: address[name] for setter, name in streamalloc.torch._HOOKS}, calls["hooks"]
    before = streamalloc.stats(0)
    p = allocator.alloc(1 << 20, 0, None)
    assert p and p % 256 == 0
    assert streamalloc.stats(0)["allocated"] == before["allocated"] + (1 << 20)
    record = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(address["streamalloc_torch_record_stream"])
    record(p, None)
    base_alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t))(
        address["streamalloc_torch_base_allocation"])
    size = ctypes.c_size_t(0)
    base = base_alloc(p, ctypes.byref(size))
    assert base <= p and p + (1 << 20) <= base + size.value, (base, size.value, p)
    assert streamalloc.torch.memory_stats(0)["allocated_bytes.all.current"] == before["allocated"] + (1 << 20)
    assert "allocated_bytes.all.current" in streamalloc.torch.memory_summary(0)
    allocator.free(p, 1 << 20, 0, None)
    assert streamalloc.stats(0)["allocated"] == before["allocated"]
    assert allocator.alloc(0, 0, None) is None
    ctypes.CFUNCTYPE(None)(address["streamalloc_torch_empty_cache"])()
    assert streamalloc.stats(0)["reserved"] == 0


def test_torch_enable_refuses_a_bad_configuration_at_once():
    # In a process of its own: the library's configuration is fixed once per process.
    script = (
        "import sys, types, streamalloc, streamalloc.torch as t\n"
        "sys.modules['torch'] = types.ModuleType('torch')\n"
        "try:\n"
        "    t.enable(backend='pluggable')\n"
        "except streamalloc.StreamallocError as e:\n"
        "    print('refused:', e)\n"
        "else:\n"
        "    print('enabled')\n")
    env = dict(os.environ, STREAMALLOC_CONF="device=sim,strategy=warp")
    env.pop("STREAMALLOC_TORCH", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused:") and "warp" in done.stdout, (done.stdout, done.stderr)


def test_cupy_enable():
    modules, calls = fake_cupy()
    sys.modules.update(modules)
    cupy = modules["cupy"]
    try:
        for checked in (False, True):
            streamalloc.cupy.enable(CONF, checked=checked)
            before = streamalloc.stats(0)
            ptr, free = calls["malloc"](4096)
            assert ptr and ptr % 256 == 0
            assert streamalloc.stats(0)["allocated"] == before["allocated"] + 4096
            free()
            after = streamalloc.stats(0)
            assert after["allocated"] == before["allocated"]
            assert after["total_frees"] == before["total_frees"] + 1
        assert calls.get("stream_queries", 0) == 1, "the C path asks CuPy for its current stream"
        try:
            calls["malloc"](1 << 40)  # more than the simulated 8 GiB
            raise AssertionError("an impossible allocation succeeded")
        except cupy.cuda.memory.OutOfMemoryError:
            pass
    finally:
        remove_fake_cupy(modules)


def test_structs_come_from_the_librarys_header():
    # The library carries the header it was built with; the ctypes structs are read from it.
    lib = streamalloc.load()
    assert lib.streamalloc_header().decode() == HEADER.read_text()
    body = re.search(r"typedef struct streamalloc_stats_t \{(.*?)\}", HEADER.read_text(), re.S).group(1)
    names = re.findall(r"^\s*\w+ (\w+);", body, re.M)
    assert [n for n, _ in streamalloc.Stats._fields_] == names, names
    assert [n for n, _ in streamalloc.TagStats._fields_] == ["asleep", "offloaded", "slept", "stats"]


def test_segments_tile_the_reserved_memory():
    # The library's own list of its segments (what the torch backend's snapshot is drawn from):
    # each live allocation an allocated block, the blocks tiling their segments, the segments
    # adding up to the reserved bytes.
    streamalloc.configure(CONF)
    s = streamalloc.sim.create_stream(0)
    ptrs = [streamalloc.allocate(size, 0, s) for size in (1 << 20, 3 << 20, 5 << 10)]
    listed = streamalloc.segments(0)
    assert sum(seg["size"] for seg in listed) == streamalloc.stats(0)["reserved"], listed
    allocated = set()
    for seg in listed:
        at = seg["address"]
        for block in seg["blocks"]:
            assert block["address"] == at, seg
            at += block["size"]
            if block["state"] == "allocated":
                allocated.add(block["address"])
        assert at == seg["address"] + seg["size"], seg
    assert set(ptrs) <= allocated, (ptrs, listed)
    for p in ptrs:
        streamalloc.deallocate(p)
    assert not set(ptrs) & {b["address"] for seg in streamalloc.segments(0) for b in seg["blocks"]
                            if b["state"] == "allocated"}


def test_reset_peak_stats_and_retries():
    streamalloc.configure(CONF)
    p = streamalloc.allocate(3 << 20, 4)
    streamalloc.deallocate(p)
    s = streamalloc.stats(4)
    assert (s["allocated"], s["allocated_peak"], s["retries"]) == (0, 3 << 20, 0), s
    streamalloc.reset_peak_stats(4)
    s = streamalloc.stats(4)
    assert (s["allocated_peak"], s["reserved_peak"]) == (s["allocated"], s["reserved"]), s


def test_sim_streams():
    streamalloc.configure(CONF)
    sim = streamalloc.sim
    s = sim.create_stream(5)
    p = streamalloc.allocate(4096, 5, s)
    sim.use(p, 4096, None, 1_000_000, device=5)
    streamalloc.record_stream(p, None)
    streamalloc.deallocate(p)
    sim.advance(10, device=5)
    sim.synchronize(s, device=5)
    assert sim.violations(5) == 0
    sim.destroy_stream(s, device=5)
    try:
        streamalloc.allocate(4096, 5, s)
        raise AssertionError("a destroyed stream's handle was accepted")
    except streamalloc.StreamallocError as e:
        assert e.status == "INVALID_ARGUMENT", e


def raises(exception, call, *words):
    """Checks that `call()` raises `exception` with each of `words` in its message."""
    try:
        call()
    except exception as e:
        assert all(w in str(e) for w in words), f"{type(e).__name__}: {e} (expected {words})"
        return
    raise AssertionError(f"no {exception.__name__}: {words}")


def test_integers_are_range_checked():
    """Issue 33: ctypes wrapped integers silently: allocate(2**64 + 4096) made a 4 KiB block,
    device 2**32 was device 0, deallocate(p + 2**64) freed p, and a str passed as a stream
    became the address of the Python object, handed to the library as a stream."""
    streamalloc.configure(CONF)
    sim = streamalloc.sim
    device = 6
    before = streamalloc.stats(device)
    raises(OverflowError, lambda: streamalloc.allocate(2**64 + 4096, device), "size")
    raises(OverflowError, lambda: streamalloc.allocate(-4096, device), "size")
    raises(OverflowError, lambda: streamalloc.allocate(4096, 2**32 + device), "device")
    raises(OverflowError, lambda: streamalloc.allocate(4096, -2**31 - 1), "device")
    raises(TypeError, lambda: streamalloc.allocate(4096.0, device), "size")
    raises(TypeError, lambda: streamalloc.allocate("4096", device), "size")
    raises(TypeError, lambda: streamalloc.allocate(4096, device, "a stream"), "stream")
    raises(TypeError, lambda: streamalloc.allocate(4096, device, b"a stream"), "stream")
    raises(TypeError, lambda: streamalloc.allocate(4096, device, object()), "stream")
    raises(OverflowError, lambda: streamalloc.allocate(4096, device, 2**64), "stream")
    raises(OverflowError, lambda: streamalloc.allocate(4096, device, -1), "stream")
    assert streamalloc.stats(device)["total_allocations"] == before["total_allocations"], "nothing was allocated"
    raises(OverflowError, lambda: streamalloc.stats(2**32), "device")
    raises(OverflowError, lambda: streamalloc.release(2**32), "device")
    raises(OverflowError, lambda: streamalloc.reset_peak_stats(2**32), "device")
    raises(TypeError, lambda: streamalloc.stats("0"), "device")
    p = streamalloc.allocate(4096, device)
    raises(OverflowError, lambda: streamalloc.deallocate(p + 2**64), "ptr")
    raises(OverflowError, lambda: streamalloc.deallocate(p - 2**64), "ptr")
    raises(TypeError, lambda: streamalloc.deallocate(str(p)), "ptr")
    raises(OverflowError, lambda: streamalloc.record_stream(p + 2**64, None), "ptr")
    raises(TypeError, lambda: streamalloc.record_stream(p, "a stream"), "stream")
    raises(OverflowError, lambda: streamalloc.retire_stream(2**64, device), "stream")
    raises(OverflowError, lambda: streamalloc.retire_stream(None, 2**32), "device")
    s = sim.create_stream(device)
    raises(OverflowError, lambda: sim.create_stream(2**32), "device")
    raises(OverflowError, lambda: sim.use(p, 2**64 + 4096, s, 1, device), "size")
    raises(OverflowError, lambda: sim.use(p, 4096, s, 2**64 + 1, device), "ns")
    raises(OverflowError, lambda: sim.use(p, 4096, s, -1, device), "ns")
    raises(OverflowError, lambda: sim.use(p + 2**64, 4096, s, 1, device), "ptr")
    raises(TypeError, lambda: sim.use(p, 4096, "a stream", 1, device), "stream")
    raises(OverflowError, lambda: sim.advance(2**64 + 1, device), "ns")
    raises(OverflowError, lambda: sim.advance(1, 2**32 + device), "device")
    raises(TypeError, lambda: sim.synchronize("a stream", device), "stream")
    raises(OverflowError, lambda: sim.violations(2**32), "device")
    raises(OverflowError, lambda: sim.destroy_stream(s + 2**64, device), "stream")
    assert streamalloc.stats(device)["live_allocations"] == before["live_allocations"] + 1, "p is still live"
    # What is in range still works, with the documented stream objects too.
    sim.use(p, 4096, s, 1_000, device)
    streamalloc.record_stream(p, types.SimpleNamespace(ptr=s))  # a cupy.cuda.Stream
    streamalloc.record_stream(p, types.SimpleNamespace(cuda_stream=s))  # a torch.cuda.Stream

    class ProtocolStream:
        """A stream of the CUDA stream protocol (`__cuda_stream__`: rmm, numba-cuda, cuda.core)."""

        def __init__(self, handle, version=0):
            self.handle, self.version = handle, version

        def __cuda_stream__(self):
            return self.version, self.handle

    streamalloc.record_stream(p, ProtocolStream(s))
    raises(OverflowError, lambda: streamalloc.record_stream(p, ProtocolStream(2**64)), "stream")
    raises(TypeError, lambda: streamalloc.record_stream(p, ProtocolStream("0")), "stream")
    raises(TypeError, lambda: streamalloc.record_stream(p, ProtocolStream(s, version=1)), "version 1")
    raises(OverflowError, lambda: streamalloc.record_stream(p, types.SimpleNamespace(ptr=2**64)), "stream")
    raises(TypeError, lambda: streamalloc.record_stream(p, types.SimpleNamespace(ptr="0")), "stream")
    streamalloc.deallocate(p)
    sim.synchronize(s, device)
    sim.destroy_stream(s, device)
    assert streamalloc.stats(device)["live_allocations"] == before["live_allocations"]
    raises(TypeError, lambda: streamalloc.configure(b"device=sim"), "conf")
    raises(ValueError, lambda: streamalloc.configure(CONF + "\0,strategy=async"), "conf")


def test_cupy_checked_path_range_checks_its_integers():
    """Issue 33: the checked CuPy path passed CuPy's integers to ctypes unchecked too."""
    modules, calls = fake_cupy()
    sys.modules.update(modules)
    try:
        streamalloc.cupy.enable(CONF, checked=True)
        before = streamalloc.stats(0)
        raises(OverflowError, lambda: calls["malloc"](2**64 + 4096), "size")
        raises(OverflowError, lambda: streamalloc.cupy._checked_malloc(4096, 2**32), "device")
        calls["stream"] = types.SimpleNamespace(ptr="not a stream")
        raises(TypeError, lambda: calls["malloc"](4096), "stream")
        del calls["stream"]
        assert streamalloc.stats(0)["total_allocations"] == before["total_allocations"], "nothing was allocated"
        ptr, free = calls["malloc"](4096)
        raises(OverflowError, lambda: streamalloc.cupy._checked_free(ptr + 2**64, 0), "ptr")
        raises(OverflowError, lambda: streamalloc.cupy._checked_free(ptr, 2**32), "device")
        assert streamalloc.stats(0)["live_allocations"] == before["live_allocations"] + 1
        free()
        assert streamalloc.stats(0)["live_allocations"] == before["live_allocations"]
    finally:
        remove_fake_cupy(modules)


def main(namespace=None):
    """Runs every `test_` function of `namespace` (this module's by default), reports each
    and the totals; the exit status."""
    tests = [(name, f) for name, f in sorted((namespace or globals()).items()) if name.startswith("test_")]
    failed = 0
    for name, f in tests:
        try:
            f()
            print(f"{name} ... ok")
        except Exception as e:  # report every failure, then fail
            failed += 1
            print(f"{name} ... FAILED: {type(e).__name__}: {e}")
    print(f"{len(tests) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
