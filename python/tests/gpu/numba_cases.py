#!/usr/bin/env python3
"""Numba's device arrays under one memory manager, in one process.

    python3 python/tests/gpu/numba_cases.py CASE CONF

test_clients.py runs it. CONF is a streamalloc configuration, made Numba's memory manager
with streamalloc.numba.enable(CONF), or "numba_own" (Numba's own manager, the control);
"unplugged:CONF" configures streamalloc without making it Numba's manager, so its count of
allocations must fail the case (the negative control of that check).
Numba's kernels do not compile on the GPU machine (its NumPy), so CuPy runs the kernels, on
Numba's arrays (`cupy.asarray`), and Numba allocates and copies.

CASE nonblocking: s1 and s2 are non-blocking streams (CuPy's, seen by Numba through
`cuda.external_stream`). x, allocated by Numba inside streamalloc.numba.stream(s1), is filled
on s1, s1 is kept busy (a clock64 spin, about a second) and then reads x into y; x is freed.
An array of x's size is allocated inside stream(s2) and filled at once. s1 must still be busy
then (unless the allocator's frees wait for the device), and once both are done y must be
2 * x. Under streamalloc every array must have gone through it (its count of allocations
rose by the arrays made).

CASE workload: a fixed sequence of host arrays of varying sizes copied to the device
(`cuda.to_device(..., stream=s)`), copied on the device (`copy_to_device`), transformed by
kernels into arrays from `cuda.device_array(..., stream=s)` and copied back, in turn on a
non-blocking stream (external to Numba), Numba's default stream and a stream Numba made, with
a rolling set of live arrays; every
result is hashed (`digest`, to compare with Numba's own manager), and the peak of device
memory in use (cudaMemGetInfo after each step, over the start: `peak_used_mib`) is reported,
with streamalloc's own peak (`reserved_peak_mib`).

Output and exit status: see casekit.py.
"""

import contextlib
import gc
import hashlib
import os
import sys

os.environ["CUPY_CUDA_ARRAY_INTERFACE_SYNC"] = "0"  # CuPy must not wait on the arrays' streams

from casekit import MIB, Report, frees_synchronize  # noqa: E402
from cupy_cases import SPIN, intact, spin_cycles  # noqa: E402

CONTROL = "numba_own"
UNPLUGGED = "unplugged:"


def setup(conf):
    """Makes CONF Numba's memory manager (before Numba's first use of the GPU); whether the
    case checks streamalloc's counts (also for "unplugged:CONF", the negative control:
    streamalloc configured with CONF but not made Numba's manager, so the counts must catch
    it)."""
    if conf == CONTROL:
        return False
    import streamalloc.numba

    if conf.startswith(UNPLUGGED):
        streamalloc.configure(conf[len(UNPLUGGED):])
    else:
        streamalloc.numba.enable(conf)
    return True


def owned_by(ours, stream):
    """streamalloc.numba.stream(stream) under streamalloc, else nothing."""
    if not ours:
        return contextlib.nullcontext()
    import streamalloc.numba

    return streamalloc.numba.stream(stream)


def allocations():
    """streamalloc's count of allocations on device 0."""
    import streamalloc

    return streamalloc.stats(0)["total_allocations"]


def case_nonblocking(report, conf):
    import cupy
    import numpy
    from numba import cuda

    ours = setup(conf)
    spin = cupy.RawKernel(SPIN, "spin")
    n = 64 * MIB // 4
    c1, c2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    s1, s2 = cuda.external_stream(c1.ptr), cuda.external_stream(c2.ptr)
    # Compile and load every kernel used below before the busy window.
    warm = cupy.full(16, 3, dtype=cupy.float32)
    cupy.multiply(warm, 2, out=warm)
    spin((1,), (1,), (numpy.int64(1000),))
    cycles = spin_cycles(spin, 1.0)
    cupy.cuda.Device().synchronize()
    before = allocations() if ours else 0
    with owned_by(ours, s1):
        x = cuda.device_array(n, dtype=numpy.float32, stream=s1)
        y = cuda.device_array(n, dtype=numpy.float32, stream=s1)
    x_ptr = x.device_ctypes_pointer.value
    with c1:
        xa, ya = cupy.asarray(x), cupy.asarray(y)
        xa.fill(3)
        spin((1,), (1,), (numpy.int64(cycles),))
        cupy.multiply(xa, 2, out=ya)
    del xa, x  # freed while s1 still has to read it
    gc.collect()
    with owned_by(ours, s2):
        z = cuda.device_array(n, dtype=numpy.float32, stream=s2)
    with c2:
        za = cupy.asarray(z)
        za.fill(-1)
    s1_busy = not c1.done
    c1.synchronize()
    c2.synchronize()
    report.info.update(s1_busy_at_reuse=s1_busy, same_address=z.device_ctypes_pointer.value == x_ptr)
    report.expect(s1_busy or frees_synchronize(conf),
                  "s1 was idle when s2 allocated: the case proves nothing (spin longer)")
    report.expect(intact(ya, 6.0),
                  "s1 read wrong data: x's memory went to s2 and was overwritten while s1 still read it")
    report.expect(intact(za, -1.0), "the array made on s2 does not hold what was written to it")
    if ours:
        made = allocations() - before
        report.info["streamalloc_allocations"] = made
        report.expect(made == 3,
                      f"streamalloc made {made} allocations for the 3 arrays: Numba did not allocate through it")
    # The streams go before the arrays made on them, and a release after the arrays are
    # freed must not name them.
    del ya, za, s1, s2
    del y, z
    gc.collect()
    cupy.cuda.Device().synchronize()
    if ours:
        import streamalloc

        report.info["released"] = streamalloc.release(0)


def case_workload(report, conf, iterations=200):
    import cupy
    import numpy
    from numba import cuda

    ours = setup(conf)
    side = cupy.cuda.Stream(non_blocking=True)
    own = cuda.stream()  # made by Numba: held by streamalloc.numba, not retired between bursts
    streams = [(cuda.external_stream(side.ptr), side), (cuda.default_stream(), cupy.cuda.Stream.null),
               (own, cupy.cuda.ExternalStream(int(own)))]
    rng = numpy.random.default_rng(7)
    digest = hashlib.sha256()
    sizes = [4, 100, 4096, 65536, 1 << 20, 3 << 20, 16 << 20, 64 << 20]
    free0, _ = cupy.cuda.runtime.memGetInfo()
    peak = 0
    made = 0
    before = allocations() if ours else 0
    live = []
    for i in range(iterations):
        stream, cs = streams[i % 3]
        n = sizes[(i * 5) % len(sizes)] // 4
        host = rng.standard_normal(n, dtype=numpy.float32)
        with owned_by(ours, stream):
            src = cuda.to_device(host, stream=stream)
            copy = cuda.device_array(n, dtype=numpy.float32, stream=stream)
            out = cuda.device_array(n, dtype=numpy.float32, stream=stream)
        made += 3
        copy.copy_to_device(src, stream=stream)
        with cs:
            a, b = cupy.asarray(copy), cupy.asarray(out)
            cupy.multiply(a, a, out=b)
            cupy.add(b, a, out=b)
            del a, b
        result = out.copy_to_host(stream=stream)
        stream.synchronize()
        digest.update(result.tobytes())
        live.append(out)
        if len(live) > 8:
            live.pop(0)
        del src, copy
        free, _ = cupy.cuda.runtime.memGetInfo()
        peak = max(peak, free0 - free)
    live.clear()
    gc.collect()
    cupy.cuda.Device().synchronize()
    report.info.update(digest=digest.hexdigest(), arrays=made, peak_used_mib=round(peak / MIB, 1))
    if ours:
        import streamalloc

        stats = streamalloc.stats(0)
        report.info["reserved_peak_mib"] = round(stats["reserved_peak"] / MIB, 1)
        report.expect(stats["total_allocations"] - before == made,
                      f"streamalloc made {stats['total_allocations'] - before} allocations for {made} arrays")


CASES = {"nonblocking": case_nonblocking, "workload": case_workload}


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in CASES:
        sys.exit(f"usage: {sys.argv[0]} CASE CONF  (CASE: {', '.join(CASES)}; CONF: a streamalloc "
                 f"configuration or {CONTROL})")
    case, conf = sys.argv[1], sys.argv[2]
    Report(case=case, conf=conf).run(CASES[case], conf)


if __name__ == "__main__":
    main()
