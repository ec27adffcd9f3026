"""The Numba front end (streamalloc.numba) on the simulator, with a stand-in for numba.cuda
that drives the memory manager as Numba does: the class given to `set_memory_manager` made
with a context, `initialize()`, `memalloc(size)` returning a `MemoryPointer` whose finalizer
frees when the pointer goes. Under a pool per stream (`stream_safe`) and the ordering
checker, in a process of its own. Run as test_streamalloc.py is:
`python3 python/tests/test_numba.py`, or with pytest.
"""

import contextlib
import ctypes
import gc
import random
import sys
import threading
import types
import weakref

import streamalloc
from client_checks import ordered_on_their_streams
from test_streamalloc import main

CONF = "device=sim,strategy=stream_safe,sim_capacity=8GiB"
MIB = 1 << 20
sim = streamalloc.sim


def fake_numba():
    """A stand-in for the parts of numba.cuda that streamalloc.numba and these tests use."""
    calls = {}

    class HostOnlyCUDAMemoryManager:
        """numba.cuda.HostOnlyCUDAMemoryManager: made with `context=`, keeps host allocations."""

        def __init__(self, *args, **kwargs):
            self.context = kwargs.pop("context")
            self.allocations = {}

        def reset(self):
            self.allocations.clear()

        def defer_cleanup(self):
            return contextlib.nullcontext()

    class MemoryPointer:
        """numba.cuda.MemoryPointer: takes the address as a ctypes.c_void_p (or the binding's
        pointer type); the finalizer runs when the pointer is collected."""

        def __init__(self, context, pointer, size, owner=None, finalizer=None):
            if isinstance(pointer, ctypes.c_void_p):
                pointer = pointer.value or 0
            self.context, self.device_pointer, self.size = context, pointer, size
            if finalizer is not None:
                weakref.finalize(self, finalizer)

    class Stream:
        """numba.cuda's Stream over a simulated stream (CUDA stream protocol); the stand-in
        destroys the simulated stream when the object goes, as Numba destroys its streams."""

        external = False  # made by Numba (cuda.stream()), not cuda.external_stream

        def __init__(self):
            self.handle = sim.create_stream()
            weakref.finalize(self, sim.destroy_stream, self.handle)

        def __cuda_stream__(self):
            return 0, self.handle

    def set_memory_manager(manager):
        calls["manager"] = manager

    numba = types.ModuleType("numba")
    numba.cuda = types.ModuleType("numba.cuda")
    numba.cuda.HostOnlyCUDAMemoryManager = HostOnlyCUDAMemoryManager
    numba.cuda.MemoryPointer = MemoryPointer
    numba.cuda.set_memory_manager = set_memory_manager
    numba.cuda.stream = Stream
    return {"numba": numba, "numba.cuda": numba.cuda}, calls


MODULES, CALLS = fake_numba()
sys.modules.update(MODULES)  # for the whole process: streamalloc.numba binds numba.cuda once


def with_numba(test):
    """Runs `test(cuda, manager)` with streamalloc.numba enabled (`manager`: an instance of the
    class it gave Numba, initialized)."""
    import streamalloc.numba

    CALLS.pop("manager", None)
    streamalloc.numba.enable(CONF)
    manager = CALLS["manager"](context=types.SimpleNamespace(device=types.SimpleNamespace(id=0)))
    manager.initialize()
    assert manager.interface_version == 1
    return test(MODULES["numba.cuda"], manager)


def test_arrays_are_ordered_on_their_streams():
    """Memory allocated inside `streamalloc.numba.stream(s1)`, freed while s1 still uses it,
    then memory of its size inside `stream(s2)`: s2 must not get it before that use ends (a
    manager that allocated everything on one stream would hand it out at once: the checker
    counts an early reuse); and the allocations go through streamalloc (its counters move)."""

    def test(cuda, manager):
        import streamalloc.numba

        s1, s2 = cuda.stream(), cuda.stream()
        streams = {s1.handle: s1, s2.handle: s2}

        def allocate(size, stream):
            if stream is None:  # outside any stream(): the legacy default stream
                memory = manager.memalloc(size)
            else:
                with streamalloc.numba.stream(streams[stream]):
                    memory = manager.memalloc(size)
            return memory, memory.device_pointer

        ordered_on_their_streams(allocate, s1.handle, s2.handle)

    with_numba(test)


def test_streams_outlive_their_memory_and_are_retired():
    """Numba destroys a stream when its last reference goes, maybe before the arrays made on
    it are freed: the stream is held until its last allocation is freed, then retired before
    it goes, so that a later release (as a retry on out-of-memory makes) names no destroyed
    stream (on the simulator an error, on a GPU a crash)."""

    def test(cuda, manager):
        import streamalloc.numba

        s = cuda.stream()
        with streamalloc.numba.stream(s):
            a = manager.memalloc(MIB)
            b = manager.memalloc(2 * MIB)
        sim.use(a.device_pointer, a.size, s.handle, 1_000)
        gone = weakref.ref(s)
        del s  # the program drops the stream before its arrays
        assert gone() is not None, "the stream went while memory allocated on it was live"
        del a
        del b
        gc.collect()
        assert gone() is None, "the stream was kept after its memory was freed"
        streamalloc.release(0)

    with_numba(test)


def test_a_held_stream_keeps_its_cache():
    """A stream the program still holds is not retired when its last allocation is freed (a
    retirement waits for the stream's work and gives its pool's cache back, at every burst):
    its cache stays; once the program lets go of it, the next allocation or free retires it
    and lets it go."""

    def test(cuda, manager):
        import streamalloc.numba

        s = cuda.stream()
        with streamalloc.numba.stream(s):
            a = manager.memalloc(64 * MIB)
        sim.use(a.device_pointer, a.size, s.handle, 1_000)
        del a
        gc.collect()
        reserved = streamalloc.stats(0)["reserved"]
        assert reserved >= 64 * MIB, f"{reserved} bytes reserved after a free of 64 MiB on a held stream: retired"
        with streamalloc.numba.stream(s):
            again = manager.memalloc(64 * MIB)  # from the stream's cache
        assert streamalloc.stats(0)["reserved"] == reserved, "the second allocation did not come from the cache"
        del again
        gone = weakref.ref(s)
        del s
        gc.collect()
        other = manager.memalloc(4096)  # the next allocation lets the dropped stream go
        del other
        gc.collect()
        assert gone() is None, "the stream was kept after the program let go of it"
        assert streamalloc.stats(0)["reserved"] < reserved, "the dropped stream's cache was not given back"
        streamalloc.release(0)

    with_numba(test)


def test_threads_have_their_own_stream():
    """`stream()` is the calling thread's: threads allocating inside blocks of their own on
    shared streams (a stream's last free, which retires it, racing allocations on it), each
    allocation used by a kernel on its stream: no early reuse, nothing left live."""

    def test(cuda, manager):
        import streamalloc.numba

        before = streamalloc.stats(0)
        streams = [cuda.stream() for _ in range(3)]
        errors = []

        def worker(seed):
            rng = random.Random(seed)
            live = []
            try:
                for _ in range(300):
                    if live and rng.random() < 0.5:
                        live.pop(rng.randrange(len(live)))
                        continue
                    stream = rng.choice(streams)
                    with streamalloc.numba.stream(stream):
                        mem = manager.memalloc(rng.choice([512, 4096, 3 * MIB]))
                    sim.use(mem.device_pointer, mem.size, stream.handle, rng.randrange(1, 20_000))
                    live.append(mem)
                live.clear()
            except Exception as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        gc.collect()
        assert not errors, errors
        for s in streams:
            sim.synchronize(s.handle)
        assert sim.violations(0) == 0, f"{sim.violations(0)} early reuses"
        assert streamalloc.stats(0)["live_allocations"] == before["live_allocations"]

    with_numba(test)


def test_streams_of_numba_before_the_protocol():
    """numba-cuda before 0.21 (and Numba's own cuda before it) has streams without
    `__cuda_stream__`, whose handle `int()` gives: stream() takes them too, and orders on them."""

    def test(cuda, manager):
        import streamalloc.numba

        class OldStream:
            """numba.cuda's Stream before the CUDA stream protocol: `handle` and `__int__`."""

            def __init__(self, handle):
                self.handle = handle

            def __int__(self):
                return self.handle

        s1, s2 = OldStream(sim.create_stream()), OldStream(sim.create_stream())
        with streamalloc.numba.stream(s1):
            first = manager.memalloc(64 * MIB)
        sim.use(first.device_pointer, first.size, s1.handle, 5_000_000)
        del first
        with streamalloc.numba.stream(s2):
            second = manager.memalloc(64 * MIB)
        sim.use(second.device_pointer, second.size, s2.handle, 1_000)
        del second
        gc.collect()
        for s in (s1, s2):
            sim.synchronize(s.handle)
        assert sim.violations(0) == 0, f"{sim.violations(0)} early reuses"
        for s in (s1, s2):
            sim.destroy_stream(s.handle)
        streamalloc.release(0)

    with_numba(test)


def test_environment_variable_form():
    """NUMBA_CUDA_MEMORY_MANAGER=streamalloc.numba: Numba takes the module's
    `_numba_memory_manager`, which must be the manager enable() installs."""

    def test(cuda, manager):
        import streamalloc.numba

        assert streamalloc.numba._numba_memory_manager is type(manager)

    with_numba(test)


if __name__ == "__main__":
    sys.exit(main(globals()))
