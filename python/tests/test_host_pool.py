"""The pinned host pool from Python (issue 36), on the simulator, in a process of its own (the
library is configured once per process). Run as test_streamalloc.py is:
`python3 python/tests/test_host_pool.py`, or with pytest.

The simulator hands out real host memory, so the buffers are written and read here; its
ordering checker sees every block handed out and the simulated copies (`sim.use_host`) that
read them.
"""

import ctypes
import sys

import streamalloc

from test_streamalloc import main, raises

CONF = "device=sim,strategy=plain,sim_capacity=1GiB"
MIB = 1 << 20


def setup():
    streamalloc.configure(CONF)
    return streamalloc.sim


def test_a_buffer_is_host_memory_to_write_and_read():
    setup()
    buf = streamalloc.host_empty(3 * MIB)
    assert buf.ptr % 4096 == 0 and len(buf) == 3 * MIB
    view = buf.view()
    assert view.format == "B" and view.nbytes == 3 * MIB and not view.readonly
    view[:4] = b"\x01\x02\x03\x04"
    view[-1] = 255
    assert bytes(view[:4]) == b"\x01\x02\x03\x04" and view[-1] == 255
    assert ctypes.string_at(buf.ptr, 4) == b"\x01\x02\x03\x04", "the view is the memory at ptr"
    interface = buf.__array_interface__
    assert interface["data"] == (buf.ptr, False) and interface["shape"] == (3 * MIB,)
    assert streamalloc.host_stats()["allocated"] >= 3 * MIB


def test_the_memory_lives_while_a_view_does():
    setup()
    before = streamalloc.host_stats()
    buf = streamalloc.host_empty(MIB)
    view = buf.view()
    buf.close()
    raises(ValueError, lambda: buf.ptr, "closed")
    assert streamalloc.host_stats()["live_allocations"] == before["live_allocations"] + 1, "the view holds it"
    view[0] = 7
    del view
    assert streamalloc.host_stats()["live_allocations"] == before["live_allocations"]
    with streamalloc.host_empty(MIB) as other:
        other.view()[0] = 1
    assert streamalloc.host_stats()["live_allocations"] == before["live_allocations"]
    assert streamalloc.host_empty(0).view().nbytes == 0


def test_an_exported_array_keeps_the_memory_after_close():
    """Issue 52 #4: `__array_interface__` handed numpy the address without a hold on the block:
    after `close()` the block went back to the pool while the array (whose base is the buffer)
    still pointed at it, and the next `host_empty()` returned the same memory. The buffer an
    array was made from keeps the memory until it is gone (numpy holds it as the array's
    base), closed or not."""
    setup()
    before = streamalloc.host_stats()["live_allocations"]
    buf = streamalloc.host_empty(MIB)
    address = buf.__array_interface__["data"][0]  # what numpy.asarray(buf) reads; it keeps buf
    ctypes.memset(address, 7, 16)
    buf.close()
    raises(ValueError, lambda: buf.ptr, "closed")
    raises(ValueError, lambda: buf.__array_interface__, "closed")
    with streamalloc.host_empty(MIB) as other:
        assert other.ptr != address, "the exported memory was handed out again"
        ctypes.memset(other.ptr, 1, 16)
    assert ctypes.string_at(address, 16) == b"\x07" * 16
    assert streamalloc.host_stats()["live_allocations"] == before + 1, "the exported block stays"
    del buf  # the last array made from it gone
    assert streamalloc.host_stats()["live_allocations"] == before
    try:
        import numpy
    except ImportError:
        return
    buf = streamalloc.host_empty(MIB)
    array = numpy.asarray(buf)
    array[:] = 9
    buf.close()
    del buf
    with streamalloc.host_empty(MIB) as other:
        assert other.ptr != array.ctypes.data
        ctypes.memset(other.ptr, 1, MIB)
    assert int(array.min()) == 9 and int(array.max()) == 9
    del array
    assert streamalloc.host_stats()["live_allocations"] == before


def test_reuse_waits_for_the_recorded_copy():
    sim = setup()
    s = sim.create_stream()
    buf = streamalloc.host_empty(2 * MIB)
    first = buf.ptr
    sim.use_host(first, 2 * MIB, s, 1_000_000)  # a copy from it on `s`
    buf.record_stream(s)
    del buf
    stats = streamalloc.host_stats()
    assert stats["pending_release"] >= 2 * MIB, stats
    other = streamalloc.host_empty(2 * MIB)
    assert other.ptr != first, "the copy still reads the first block"
    sim.synchronize(s)
    again = streamalloc.host_empty(2 * MIB)
    assert again.ptr == first, "the copy is done"
    assert sim.violations() == 0
    del other, again
    sim.destroy_stream(s)


def test_the_checker_catches_a_copy_nobody_recorded():
    sim = setup()
    s = sim.create_stream()
    before = sim.violations()
    buf = streamalloc.host_empty(4 * MIB)
    first = buf.ptr
    sim.use_host(first, 4 * MIB, s, 1_000_000)
    del buf  # no record_stream: the pool hands the block out at once
    again = streamalloc.host_empty(4 * MIB)
    assert again.ptr == first
    assert sim.violations() == before + 1
    sim.synchronize(s)
    del again
    sim.destroy_stream(s)


def test_release_and_statistics():
    sim = setup()
    s = sim.create_stream()
    streamalloc.host_release()
    streamalloc.host_reset_peak_stats()
    kept = streamalloc.host_empty(MIB)
    busy = streamalloc.host_empty(8 * MIB)
    sim.use_host(busy.ptr, 8 * MIB, s, 1_000_000)
    busy.record_stream(s)
    del busy
    free = streamalloc.host_empty(16 * MIB)
    del free
    assert streamalloc.host_release() == 16 * MIB, "the busy block waits for its copy"
    sim.synchronize(s)
    assert streamalloc.host_release() == 8 * MIB
    stats = streamalloc.host_stats()
    assert stats["reserved"] == MIB and stats["reserved_peak"] >= 25 * MIB, stats
    streamalloc.host_reset_peak_stats()
    assert streamalloc.host_stats()["reserved_peak"] == MIB
    assert set(stats) == set(streamalloc.stats(0)), "the device pools' keys"
    del kept
    sim.destroy_stream(s)


def test_the_low_level_functions_check_their_arguments():
    setup()
    p = streamalloc.host_alloc(4096)
    raises(streamalloc.StreamallocError, lambda: streamalloc.host_record_stream(p + 64, None),
           "INVALID_ARGUMENT", "not a live pinned allocation")
    streamalloc.host_record_stream(p, None)
    streamalloc.host_free(p)
    raises(streamalloc.StreamallocError, lambda: streamalloc.host_free(p), "INVALID_ARGUMENT")
    raises(OverflowError, lambda: streamalloc.host_alloc(2**64), "size")
    raises(OverflowError, lambda: streamalloc.host_empty(-1), "nbytes")
    raises(TypeError, lambda: streamalloc.host_empty(1.5), "nbytes")
    raises(streamalloc.StreamallocError, lambda: streamalloc.host_alloc(4096, device=-1), "device -1")
    assert streamalloc.host_alloc(0) == 0
    streamalloc.host_free(None)


if __name__ == "__main__":
    sys.exit(main(globals()))
