"""The RMM front end (streamalloc.rmm) on the simulator, with a stand-in for rmm that calls the
resource's callbacks as RMM's `CallbackMemoryResource` does: allocate(size, stream) and
deallocate(ptr, size, stream), each stream a fresh `rmm.pylibrmm.stream.Stream` wrapping the
handle (CUDA stream protocol), and a `DeviceBuffer` that frees on the stream it allocated on.
Under a pool per stream (`stream_safe`) and the ordering checker, in a process of its own.
Run as test_streamalloc.py is: `python3 python/tests/test_rmm.py`, or with pytest.
"""

import random
import sys
import threading
import types

import streamalloc
from client_checks import ordered_on_their_streams
from test_streamalloc import main, raises

CONF = "device=sim,strategy=stream_safe,sim_capacity=8GiB"
MIB = 1 << 20
sim = streamalloc.sim


def fake_rmm(version="26.10.00", protocol=True):
    """A stand-in for the parts of rmm that streamalloc.rmm and these tests use; `protocol`:
    whether its streams have `__cuda_stream__` (RMM 25.12 and later)."""
    calls = {}

    class Stream:
        """rmm.pylibrmm.stream.Stream around a handle, as RMM hands one to the callbacks."""

        def __init__(self, handle):
            self._handle = handle

    if protocol:
        Stream.__cuda_stream__ = lambda self: (0, self._handle)

    class CallbackMemoryResource:
        def __init__(self, allocate_func, deallocate_func):
            self.allocate_func, self.deallocate_func = allocate_func, deallocate_func

    class DeviceBuffer:
        """rmm.DeviceBuffer(size=, stream=, mr=): allocates on `stream` (a handle here) and
        frees there when it goes, through a fresh Stream as rmm's C++ callbacks do."""

        def __init__(self, size, stream=0, mr=None):
            self.mr = mr or calls["per_device"][0]
            self.size, self.stream = size, stream
            self.ptr = self.mr.allocate_func(size, Stream(stream))

        def __del__(self):
            self.mr.deallocate_func(self.ptr, self.size, Stream(self.stream))

    def set_per_device_resource(device, mr):
        calls["per_device"] = {device: mr}

    rmm = types.ModuleType("rmm")
    rmm.__version__ = version
    rmm.DeviceBuffer = DeviceBuffer
    rmm.mr = types.ModuleType("rmm.mr")
    rmm.mr.CallbackMemoryResource = CallbackMemoryResource
    rmm.mr.set_per_device_resource = set_per_device_resource
    rmm.pylibrmm = types.ModuleType("rmm.pylibrmm")
    rmm.pylibrmm.stream = types.ModuleType("rmm.pylibrmm.stream")
    rmm.pylibrmm.stream.Stream = Stream
    modules = {"rmm": rmm, "rmm.mr": rmm.mr, "rmm.pylibrmm": rmm.pylibrmm, "rmm.pylibrmm.stream": rmm.pylibrmm.stream}
    return modules, calls


def with_rmm(test, **kwargs):
    """Runs `test(rmm, calls)` with the stand-in in sys.modules, then removes it."""
    modules, calls = fake_rmm(**kwargs)
    sys.modules.update(modules)
    try:
        return test(modules["rmm"], calls)
    finally:
        for name in modules:
            del sys.modules[name]


def test_buffers_are_ordered_on_their_streams():
    """A DeviceBuffer freed while its stream still uses it, then one of its size on another
    stream: the second must not get the first's memory before that use ends (a resource that
    ignored RMM's stream would hand it out at once: the checker counts an early reuse); and
    the allocations go through streamalloc (its counters move)."""

    def test(rmm, calls):
        import streamalloc.rmm

        mr = streamalloc.rmm.enable(CONF)
        assert calls["per_device"] == {0: mr}, "enable() did not make the resource device 0's"
        s1, s2 = sim.create_stream(), sim.create_stream()

        def allocate(size, stream):
            buffer = rmm.DeviceBuffer(size=size, stream=stream or 0)
            return buffer, buffer.ptr

        ordered_on_their_streams(allocate, s1, s2)
        for s in (s1, s2):
            sim.destroy_stream(s)

    with_rmm(test)


def test_streams_are_retired_before_rmm_destroys_them():
    """RMM destroys a stream without telling the allocator, once the buffers made on it are
    freed: the free of a stream's last buffer retires it, so that a later release (as a retry
    on out-of-memory makes) names no destroyed stream (on the simulator an error, on a GPU a
    crash)."""

    def test(rmm, calls):
        import streamalloc.rmm

        streamalloc.rmm.enable(CONF)
        s = sim.create_stream()
        a = rmm.DeviceBuffer(size=MIB, stream=s)
        b = rmm.DeviceBuffer(size=2 * MIB, stream=s)
        sim.use(a.ptr, a.size, s, 1_000)
        del a
        del b
        sim.destroy_stream(s)  # as rmm.pylibrmm.stream.Stream's owner does when it goes
        streamalloc.release(0)

    with_rmm(test)


def test_threads_share_streams():
    """Threads allocating and freeing DeviceBuffers on shared streams (so that a stream's last
    free, which retires it, races allocations on it), each buffer used by a kernel on its
    stream: no early reuse, nothing left live, and a release afterwards names no retired
    stream."""

    def test(rmm, calls):
        import streamalloc.rmm

        streamalloc.rmm.enable(CONF)
        before = streamalloc.stats(0)
        streams = [sim.create_stream() for _ in range(3)]
        errors = []

        def worker(seed):
            rng = random.Random(seed)
            live = []
            try:
                for _ in range(300):
                    if live and rng.random() < 0.5:
                        live.pop(rng.randrange(len(live)))
                    else:
                        stream = rng.choice(streams)
                        buf = rmm.DeviceBuffer(size=rng.choice([512, 4096, 3 * MIB]), stream=stream)
                        sim.use(buf.ptr, buf.size, stream, rng.randrange(1, 20_000))
                        live.append(buf)
                live.clear()
            except Exception as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for s in streams:
            sim.synchronize(s)
        assert sim.violations(0) == 0, f"{sim.violations(0)} early reuses"
        assert streamalloc.stats(0)["live_allocations"] == before["live_allocations"]
        streamalloc.release(0)

    with_rmm(test)


def test_rmm_without_the_stream_protocol_is_refused():
    """RMM before 25.12 hands the callbacks streams whose handle Python cannot read (and before
    24.04 no stream at all): enable() refuses it, naming the version needed, rather than
    allocating on a stream other than RMM's."""

    def test(rmm, calls):
        import streamalloc.rmm

        raises(RuntimeError, lambda: streamalloc.rmm.enable(CONF), "25.10.00", "25.12")
        assert "per_device" not in calls

    with_rmm(test, version="25.10.00", protocol=False)


if __name__ == "__main__":
    sys.exit(main(globals()))
