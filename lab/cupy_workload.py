#!/usr/bin/env python3
"""A CuPy workload under CuPy's default memory pool and under streamalloc: same results?

FFTs, matmuls, elementwise kernels and reductions over varying sizes, from a fixed seed, with
a rolling set of live arrays (so memory is reused in changing patterns) and part of the work
on a second, blocking CuPy stream (the case the C path's legacy-stream event orders). Every
result is hashed (SHA-256 of its bytes, in order); the same seed must give the same hash under
every allocator.

    python3 lab/cupy_workload.py                        # driver: every allocator, compare
    python3 lab/cupy_workload.py --allocator default    # one run
    python3 lab/cupy_workload.py --allocator streamalloc:strategy=async
    python3 lab/cupy_workload.py --allocator streamalloc:strategy=async --checked

The driver runs each allocator in its own process (the allocator is fixed at a process's
first allocation), prints a markdown table and exits 1 if any hash differs from the default
pool's or a run failed. `streamalloc` must be importable (the wheel from
scripts/build-python.sh, or python/ on PYTHONPATH with libstreamalloc.so copied in).
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

STRATEGIES = ("plain", "best_fit", "stream_safe", "async")
MIB = 1 << 20


def workload(seed, iterations):
    import cupy

    rng = cupy.random.default_rng(seed)
    side = cupy.cuda.Stream(non_blocking=False)
    digest = hashlib.sha256()
    live = []
    peak = 0

    def record(x):
        digest.update(str((x.dtype.str, x.shape)).encode())
        digest.update(cupy.asnumpy(x).tobytes())

    sizes = [2, 3, 64, 255, 256, 1000, 1024, 4097, 65536, 1 << 20, 3 << 20]
    sides = [16, 100, 256, 513, 1024, 2048]
    for i in range(iterations):
        n = sizes[i % len(sizes)]
        m = sides[(i * 7) % len(sides)]
        # FFT of a complex signal, and the inverse of a real one.
        x = rng.standard_normal(n, dtype=cupy.float32) + 1j * rng.standard_normal(n, dtype=cupy.float32)
        f = cupy.fft.fft(x.astype(cupy.complex64))
        record(f)
        record(cupy.fft.irfft(cupy.fft.rfft(x.real), n=n))
        # Matmuls, on the side stream every third iteration.
        a = rng.standard_normal((m, m), dtype=cupy.float32)
        b = rng.standard_normal((m, m), dtype=cupy.float32)
        if i % 3 == 0:
            with side:
                c = a @ b
                d = cupy.tanh(c) * 0.5 + cupy.exp(-cupy.abs(c))
            side.synchronize()
        else:
            c = a @ b
            d = cupy.tanh(c) * 0.5 + cupy.exp(-cupy.abs(c))
        record(d)
        # Elementwise and reductions.
        e = cupy.where(d > 0, cupy.sin(d), cupy.sqrt(cupy.abs(d)))
        record(e.sum(axis=0))
        record(cupy.cumsum(e.ravel()[: 4096]))
        record(cupy.sort(e.ravel()[: 10000]))
        # A rolling set of live arrays of changing sizes.
        live.append(cupy.full(n * ((i % 5) + 1), i, dtype=cupy.float64))
        if len(live) > 12:
            dropped = live.pop((i * 5) % len(live))
            record(dropped[:8])
        del x, f, a, b, c, d, e
        free, total = cupy.cuda.runtime.memGetInfo()
        peak = max(peak, total - free)
    for arr in live:
        record(arr.sum())
    cupy.cuda.Device().synchronize()
    return digest.hexdigest(), peak


def one_run(args):
    import cupy

    if args.allocator.startswith("streamalloc:"):
        import streamalloc
        import streamalloc.cupy

        streamalloc.cupy.enable(args.allocator[len("streamalloc:"):], checked=args.checked)
    elif args.allocator != "default":
        sys.exit(f"--allocator {args.allocator}: expected default or streamalloc:<conf>")
    cupy.cuda.Device(0).use()
    t0 = time.perf_counter()
    digest, peak = workload(args.seed, args.iterations)
    seconds = time.perf_counter() - t0
    result = {"allocator": args.allocator, "checked": args.checked, "sha256": digest,
              "seconds": seconds, "peak_used": peak, "cupy": cupy.__version__}
    if args.allocator.startswith("streamalloc:"):
        import streamalloc

        result["streamalloc_stats"] = streamalloc.stats(0)
    print(json.dumps(result))


def driver(args):
    runs = [("default", False)]
    for s in STRATEGIES:
        runs += [(f"streamalloc:strategy={s}", False), (f"streamalloc:strategy={s}", True)]
    results, ok = [], True
    for allocator, checked in runs:
        cmd = [sys.executable, __file__, "--allocator", allocator, "--seed", str(args.seed),
               "--iterations", str(args.iterations)] + (["--checked"] if checked else [])
        p = subprocess.run(cmd, capture_output=True, text=True)
        line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
        if p.returncode != 0 or not line.startswith("{"):
            ok = False
            tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
            results.append({"allocator": allocator, "checked": checked, "error": f"exit {p.returncode}: {tail}"})
        else:
            results.append(json.loads(line))
        sys.stderr.write(p.stderr)
    ref = results[0].get("sha256")
    print(f"CuPy workload, seed {args.seed}, {args.iterations} iterations\n")
    print("| allocator | path | same results as the default pool | seconds | peak device used MiB |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        path = "checked (Python)" if r["checked"] else "C functions"
        if r["allocator"] == "default":
            path = "CuPy MemoryPool"
        if "error" in r:
            print(f"| {r['allocator']} | {path} | FAILED: {r['error']} | | |")
            continue
        same = r["sha256"] == ref
        ok &= same
        print(f"| {r['allocator']} | {path} | {'yes' if same else 'NO'} ({r['sha256'][:12]}) "
              f"| {r['seconds']:.2f} | {r['peak_used'] / MIB:.0f} |")
    print("\nALL RESULTS EQUAL" if ok else "\nMISMATCH OR FAILED RUN")
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--allocator", help="default | streamalloc:<conf>; without it, run them all and compare")
    p.add_argument("--checked", action="store_true", help="streamalloc.cupy.enable(checked=True)")
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--iterations", type=int, default=60)
    args = p.parse_args()
    if args.allocator is None:
        sys.exit(driver(args))
    one_run(args)


if __name__ == "__main__":
    main()
