#!/usr/bin/env python3
"""CuPy on non-blocking streams under one allocator, in one process.

    python3 python/tests/gpu/cupy_cases.py CONF [--checked]

test_cupy_guarantees.py runs it once per allocator. CONF is a streamalloc configuration,
made CuPy's allocator with streamalloc.cupy.enable(CONF, checked=...), or "cupy_pool"
(CuPy's own cupy.cuda.MemoryPool, the control).

The case: s1 and s2 are non-blocking streams. Under s1, x is allocated and filled, s1 is
kept busy (a clock64 spin kernel, about a second) and then reads x into y; x is freed. Under
s2 an array of x's size is allocated and filled at once. s1 must still be busy at that
moment (checked, or the case proves nothing), and once both streams are done y must be
2 * x: the allocator must not hand x's memory to s2 while s1 still reads it, as
cupy.cuda.MemoryPool (whose pools are per stream) does not. Then the streams are dropped
before the arrays made on them, which are freed last, and the library's cache is released:
that must not crash.

Output and exit status: see casekit.py.
"""

import argparse

from casekit import MIB, Report, frees_synchronize

SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
"""


def intact(a, value):
    """Whether every element of `a` equals `value`."""
    return float(a.min()) == value and float(a.max()) == value


def spin_cycles(spin, seconds):
    """The spin kernel's argument that keeps a stream busy for about `seconds`."""
    import cupy
    import numpy

    probe = 20_000_000
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    spin((1,), (1,), (numpy.int64(probe),))
    end.record()
    end.synchronize()
    return int(probe * seconds * 1000.0 / max(cupy.cuda.get_elapsed_time(start, end), 1e-3))


def case_nonblocking(report, conf, checked):
    import cupy
    import numpy

    if conf == "cupy_pool":
        cupy.cuda.set_allocator(cupy.cuda.MemoryPool().malloc)
    else:
        import streamalloc.cupy

        streamalloc.cupy.enable(conf, checked=checked)
    spin = cupy.RawKernel(SPIN, "spin")
    n = 64 * MIB // 4
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    # Compile and load every kernel used below before the busy window.
    warm = cupy.full(16, 3, dtype=cupy.float32)
    warm.fill(-1)
    intact(warm * 2, -2.0)
    spin((1,), (1,), (numpy.int64(1000),))
    cycles = spin_cycles(spin, 1.0)
    with s1:
        x = cupy.full(n, 3, dtype=cupy.float32)
        x_ptr = x.data.ptr
        spin((1,), (1,), (numpy.int64(cycles),))
        y = x * 2
        del x
    with s2:
        z = cupy.empty(n, dtype=cupy.float32)
        z.fill(-1)
    s1_busy = not s1.done
    s1.synchronize()
    s2.synchronize()
    report.info.update(s1_busy_at_reuse=s1_busy, same_address=z.data.ptr == x_ptr)
    report.expect(s1_busy or frees_synchronize(conf), "s1 was idle when s2 allocated: the case proves nothing (spin longer)")
    report.expect(intact(y, 6.0), "s1 read wrong data: x's memory went to s2 and was overwritten while "
                  "s1 still read it")
    report.expect(intact(z, -1.0), "the array made on s2 does not hold what was written to it")
    # CuPy destroys a stream when its last reference goes, here before the arrays made on it
    # are freed: those frees must not use a destroyed stream (under async and best_fit they
    # are enqueued on it; before streamalloc kept such streams alive, the process crashed).
    del s1, s2
    del y, z
    cupy.cuda.Device().synchronize()
    report.info["freed_after_streams_dropped"] = True
    if conf != "cupy_pool":
        # A release (as a retry on out-of-memory makes) after that must not name them either:
        # under stream_safe their pools did, and the process crashed.
        import streamalloc

        report.info["released_after_streams_dropped"] = streamalloc.release(0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("conf", help='a streamalloc configuration, or "cupy_pool"')
    parser.add_argument("--checked", action="store_true", help="streamalloc.cupy.enable(checked=True)")
    args = parser.parse_args()
    Report(case="nonblocking", conf=args.conf, checked=args.checked).run(case_nonblocking, args.conf,
                                                                           args.checked)


if __name__ == "__main__":
    main()
