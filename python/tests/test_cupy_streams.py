"""The CuPy front end's streams on the simulator, under a pool per stream (`stream_safe`, over
stitched ranges: the default), in a process of its own (the library is configured once per
process; test_streamalloc.py configures `strategy=plain`). Run as test_streamalloc.py is:
`python3 python/tests/test_cupy_streams.py`, or with pytest.
"""

import sys

import streamalloc
import streamalloc.cupy

from test_streamalloc import fake_cupy, main, remove_fake_cupy

CONF = "device=sim,strategy=stream_safe,sim_capacity=8GiB"


def test_cupy_streams_outlive_their_memory():
    """CuPy destroys a stream when its last reference goes, maybe before the arrays made on it
    are freed: under both paths the stream is held until its memory was freed, and the
    library forgets it before it goes, so that a later release names no destroyed stream."""
    modules, calls = fake_cupy()
    sys.modules.update(modules)
    destroyed = []

    class Stream:
        """cupy.cuda.Stream: destroyed (here a simulated stream) when the last reference goes."""

        def __init__(self):
            self.ptr = streamalloc.sim.create_stream(0)

        def __del__(self):
            streamalloc.sim.destroy_stream(self.ptr, 0)
            destroyed.append(self.ptr)

    try:
        for checked in (False, True):
            streamalloc.cupy.enable(CONF, checked=checked)
            stream = Stream()
            handle = stream.ptr
            calls["stream"] = stream
            first, free_first = calls["malloc"](4096)
            second, free_second = calls["malloc"](8192)
            del calls["stream"], stream  # the program drops the stream before its arrays
            assert handle not in destroyed, f"checked={checked}: the stream was destroyed with memory live on it"
            free_first()
            assert handle not in destroyed, f"checked={checked}: destroyed before its last allocation was freed"
            free_second()
            assert handle in destroyed, f"checked={checked}: the stream was kept after its memory was freed"
            # A release (or a retry on out-of-memory) after that names no destroyed stream: on
            # the simulator that is an error, on a GPU a crash.
            streamalloc.release(0)
            # A stream the program still holds when its memory is freed stays kept until the
            # program lets go of it; the next count lets it go.
            stream = Stream()
            handle = stream.ptr
            calls["stream"] = stream
            _, free_third = calls["malloc"](4096)
            del calls["stream"]
            free_third()
            assert handle not in destroyed, f"checked={checked}: destroyed while the program held it"
            del stream
            assert handle not in destroyed, f"checked={checked}: let go before the library forgot it"
            calls["stream"] = Stream()
            _, free_fourth = calls["malloc"](4096)
            free_fourth()
            del calls["stream"]
            assert handle in destroyed, f"checked={checked}: a stream nothing held was kept"
            streamalloc.release(0)
    finally:
        remove_fake_cupy(modules)


if __name__ == "__main__":
    sys.exit(main(globals()))
