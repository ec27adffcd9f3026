#!/usr/bin/env python3
"""RMM's DeviceBuffers under one allocator, in one process.

    python3 python/tests/gpu/rmm_cases.py CASE CONF

test_clients.py runs it. CONF is a streamalloc configuration, made RMM's resource with
streamalloc.rmm.enable(CONF), or one of RMM's own resources as controls: "rmm_default"
(RMM's default, cudaMalloc and cudaFree) or "rmm_async" (CudaAsyncMemoryResource, stream
ordered); "unplugged:CONF" configures streamalloc without making it RMM's resource, so its
count of allocations must fail the case (the negative control of that check). CuPy runs the
kernels, on views of the buffers (it allocates nothing itself).

CASE nonblocking: s1 and s2 are non-blocking RMM streams. x, a DeviceBuffer on s1, is
filled, s1 is kept busy (a clock64 spin, about a second) and then reads x into y; x is freed.
A DeviceBuffer of x's size is made on s2 and filled at once. s1 must still be busy then
(unless the allocator's frees wait for the device), and once both are done y must be 2 * x:
RMM's stream was honoured. Under streamalloc every buffer must have gone through it (its
count of allocations rose by the buffers made).

CASE workload: a fixed sequence of DeviceBuffers of varying sizes copied from the host,
transformed by kernels into other DeviceBuffers and copied back, alternately on a
non-blocking stream and the default stream, with a rolling set of live buffers; every result
is hashed (`digest`, to compare with RMM's own allocator), and the peak of device memory in
use (cudaMemGetInfo after each step, over the start: `peak_used_mib`) is reported, with
streamalloc's own peak (`reserved_peak_mib`).

Output and exit status: see casekit.py.
"""

import hashlib
import os
import sys

os.environ["CUPY_CUDA_ARRAY_INTERFACE_SYNC"] = "0"  # CuPy must not wait on the buffers' streams

from casekit import MIB, Report, frees_synchronize  # noqa: E402
from cupy_cases import SPIN, intact, spin_cycles  # noqa: E402

CONTROLS = ("rmm_default", "rmm_async")
UNPLUGGED = "unplugged:"


def setup(conf):
    """Makes CONF RMM's resource on device 0; whether the case checks streamalloc's counts
    (also for "unplugged:CONF", the negative control: streamalloc configured with CONF but
    not made RMM's resource, so the counts must catch it)."""
    import rmm

    if conf == "rmm_default":
        return False
    if conf == "rmm_async":
        rmm.mr.set_current_device_resource(rmm.mr.CudaAsyncMemoryResource())
        return False
    import streamalloc.rmm

    if conf.startswith(UNPLUGGED):
        streamalloc.configure(conf[len(UNPLUGGED):])
    else:
        streamalloc.rmm.enable(conf)
    return True


def view(buf, dtype):
    """A CuPy array over a DeviceBuffer's memory (it holds the buffer)."""
    import cupy

    memory = cupy.cuda.UnownedMemory(buf.ptr, buf.size, buf)
    return cupy.ndarray((buf.size // cupy.dtype(dtype).itemsize,), dtype, cupy.cuda.MemoryPointer(memory, 0))


def cupy_stream(stream):
    """CuPy's handle on an RMM stream."""
    import cupy

    return cupy.cuda.ExternalStream(stream.__cuda_stream__()[1])


def allocations():
    """streamalloc's count of allocations on device 0."""
    import streamalloc

    return streamalloc.stats(0)["total_allocations"]


def case_nonblocking(report, conf):
    import cupy
    import numpy
    import rmm
    from rmm.pylibrmm.stream import CudaStreamFlags, Stream

    ours = setup(conf)
    spin = cupy.RawKernel(SPIN, "spin")
    n = 64 * MIB // 4
    s1, s2 = Stream(flags=CudaStreamFlags.NON_BLOCKING), Stream(flags=CudaStreamFlags.NON_BLOCKING)
    c1, c2 = cupy_stream(s1), cupy_stream(s2)
    # Compile and load every kernel used below before the busy window.
    warm = cupy.full(16, 3, dtype=cupy.float32)
    cupy.multiply(warm, 2, out=warm)
    spin((1,), (1,), (numpy.int64(1000),))
    cycles = spin_cycles(spin, 1.0)
    cupy.cuda.Device().synchronize()
    before = allocations() if ours else 0
    x = rmm.DeviceBuffer(size=n * 4, stream=s1)
    y = rmm.DeviceBuffer(size=n * 4, stream=s1)
    x_ptr = x.ptr
    with c1:
        xa, ya = view(x, cupy.float32), view(y, cupy.float32)
        xa.fill(3)
        spin((1,), (1,), (numpy.int64(cycles),))
        cupy.multiply(xa, 2, out=ya)
    del xa, x  # freed on s1 while s1 still has to read it
    z = rmm.DeviceBuffer(size=n * 4, stream=s2)
    with c2:
        za = view(z, cupy.float32)
        za.fill(-1)
    s1_busy = not c1.done
    s1.synchronize()
    s2.synchronize()
    report.info.update(s1_busy_at_reuse=s1_busy, same_address=z.ptr == x_ptr)
    report.expect(s1_busy or frees_synchronize(conf) or conf == "rmm_default"
                  or conf.startswith(UNPLUGGED),
                  "s1 was idle when s2 allocated: the case proves nothing (spin longer)")
    report.expect(intact(ya, 6.0),
                  "s1 read wrong data: x's memory went to s2 and was overwritten while s1 still read it")
    report.expect(intact(za, -1.0), "the buffer made on s2 does not hold what was written to it")
    if ours:
        made = allocations() - before
        report.info["streamalloc_allocations"] = made
        report.expect(made == 3,
                      f"streamalloc made {made} allocations for the 3 DeviceBuffers: RMM did not allocate through it")
    # The streams go before the buffers made on them (each buffer holds its own), and a
    # release after the buffers are freed must not name them.
    del ya, za, s1, s2, c1, c2
    del y, z
    cupy.cuda.Device().synchronize()
    if ours:
        import streamalloc

        report.info["released"] = streamalloc.release(0)


def case_workload(report, conf, iterations=200):
    import cupy
    import numpy
    import rmm
    from rmm.pylibrmm.stream import DEFAULT_STREAM, CudaStreamFlags, Stream

    ours = setup(conf)
    side = Stream(flags=CudaStreamFlags.NON_BLOCKING)
    streams = [(side, cupy_stream(side)), (DEFAULT_STREAM, cupy.cuda.Stream.null)]
    rng = numpy.random.default_rng(7)
    digest = hashlib.sha256()
    sizes = [4, 100, 4096, 65536, 1 << 20, 3 << 20, 16 << 20, 64 << 20]
    free0, total = cupy.cuda.runtime.memGetInfo()
    peak = 0
    made = 0
    before = allocations() if ours else 0
    live = []
    for i in range(iterations):
        stream, cs = streams[i % 2]
        n = sizes[(i * 5) % len(sizes)] // 4
        host = rng.standard_normal(n, dtype=numpy.float32)
        src = rmm.DeviceBuffer.to_device(host.view(numpy.uint8), stream=stream)
        out = rmm.DeviceBuffer(size=n * 4, stream=stream)
        made += 2
        with cs:
            a, b = view(src, cupy.float32), view(out, cupy.float32)
            cupy.multiply(a, a, out=b)
            cupy.add(b, a, out=b)
            del a, b
        result = out.copy_to_host(stream=stream)
        stream.synchronize()
        digest.update(result.tobytes())
        live.append(out)
        if len(live) > 8:
            live.pop(0)
        del src
        free, _ = cupy.cuda.runtime.memGetInfo()
        peak = max(peak, free0 - free)
    live.clear()
    cupy.cuda.Device().synchronize()
    report.info.update(digest=digest.hexdigest(), buffers=made, peak_used_mib=round(peak / MIB, 1))
    if ours:
        import streamalloc

        stats = streamalloc.stats(0)
        report.info["reserved_peak_mib"] = round(stats["reserved_peak"] / MIB, 1)
        report.expect(stats["total_allocations"] - before == made,
                      f"streamalloc made {stats['total_allocations'] - before} allocations for {made} DeviceBuffers")


CASES = {"nonblocking": case_nonblocking, "workload": case_workload}


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in CASES:
        sys.exit(f"usage: {sys.argv[0]} CASE CONF  (CASE: {', '.join(CASES)}; CONF: a streamalloc "
                 f"configuration or {' / '.join(CONTROLS)})")
    case, conf = sys.argv[1], sys.argv[2]
    Report(case=case, conf=conf).run(CASES[case], conf)


if __name__ == "__main__":
    main()
