#!/usr/bin/env python3
"""Host-to-device copies from pinned memory, per source of the pinned memory (issue 36).

    python3 lab/pinned_bench.py --out DIR [--quick]
    python3 lab/pinned_bench.py --one SUBJECT --result FILE [--quick]   # one process

For each size (64 KiB, 256 KiB, 1 MiB, 4 MiB, 16 MiB, 64 MiB, 256 MiB), a loop of copies: get
a pinned buffer of the size, enqueue its copy into a device buffer on a side stream
(`dst.copy_(src, non_blocking=True)`, the same torch call for every subject), give the buffer
back, next. Subjects, each in a process of its own, one after the other in one run:

  cudaHostAlloc     cudaHostAlloc before each copy, cudaFreeHost after it (which waits for
                    the copy): what a program without a pinned cache does (CuPy's runtime
                    module, cupy.cuda.runtime.hostAlloc / freeHost)
  torch             PyTorch's own pinned allocator (CachingHostAllocator), in a process without
                    streamalloc: torch.empty(size, pin_memory=True), freed with `del`
  streamalloc_torch the same torch code under streamalloc's torch backend
                    (streamalloc.torch.enable(backend="backend"): the library's pinned pool is
                    torch's host allocator)
  streamalloc_capi  the library's pinned pool through its C ABI, by ctypes
                    (streamalloc_host_alloc, _host_record_stream on the copy's stream,
                    _host_free), the buffer wrapped as a tensor for the copy

Each size is warmed up (a pool fills its cache), then timed: ITERS copies (2 GiB in all,
between 10 and 2,000 copies; --quick: a tenth), GB/s = bytes copied / the loop's time up to
the stream's last copy done. "alloc us" is the mean time of the allocating call, "free us" of
the call that gives the buffer back (for cudaHostAlloc it includes the wait for the copy,
which must be done before cudaFreeHost). The pools' figures (pinned allocations made by the driver during
the timed loop) go with them. Prints one JSON line per (subject, size), then a markdown table,
written to DIR/pinned_bench.md (lines in DIR/pinned_bench.jsonl, logs beside them). Exits 1 if
a subject's process failed. The backend is built once first into STREAMALLOC_CACHE (default
/tmp/streamalloc-cache here).
"""

import argparse
import ctypes
import json
import os
import sys
import time
import traceback

from torch_runs import child_env, prebuild_backend, run_child, tail, write_results

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
HERE = os.path.abspath(__file__)
SIZES = (64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)
SUBJECTS = ("cudaHostAlloc", "torch", "streamalloc_torch", "streamalloc_capi")
TIMEOUT_S = 600


def iterations(size, quick):
    n = min(max((2 * GIB) // size, 10), 2000)
    return max(n // 10, 3) if quick else n


class CudaHostAlloc:
    """cudaHostAlloc / cudaFreeHost per buffer, through CuPy's runtime module. Each source's
    `alloc` returns (what its `free` takes, the tensor to copy from)."""

    def __init__(self, torch):
        import cupy

        self.torch, self.runtime = torch, cupy.cuda.runtime

    def alloc(self, size, stream):
        ptr = self.runtime.hostAlloc(size, 0)
        return ptr, wrap(self.torch, ptr, size)

    def free(self, ptr, stream):
        stream.synchronize()  # the copy must be done before the memory goes
        self.runtime.freeHost(ptr)

    def host_allocs(self):
        return None


class TorchPinned:
    """torch.empty(size, pin_memory=True): torch's host allocator, whichever is installed."""

    def __init__(self, torch, streamalloc=None):
        self.torch, self.sa = torch, streamalloc

    def alloc(self, size, stream):
        t = self.torch.empty(size, dtype=self.torch.uint8, pin_memory=True)
        return [t], t

    def free(self, handle, stream):
        handle.clear()  # drops the tensor: its deleter gives the block back

    def host_allocs(self):
        if self.sa is not None:
            return self.sa.host_stats()["device_allocs"]
        stats = getattr(self.torch.cuda, "host_memory_stats", lambda: {})()
        return stats.get("num_host_alloc")


class CapiPinned:
    """streamalloc_host_alloc / _record_stream / _free through ctypes."""

    def __init__(self, torch, streamalloc):
        self.torch, self.sa, self.lib = torch, streamalloc, streamalloc.load()

    def alloc(self, size, stream):
        out = ctypes.c_void_p()
        streamalloc_check(self.sa, self.lib.streamalloc_host_alloc(size, 0, ctypes.byref(out)))
        return out.value, wrap(self.torch, out.value, size)

    def free(self, ptr, stream):
        streamalloc_check(self.sa, self.lib.streamalloc_host_record_stream(ptr, 0, stream.cuda_stream))
        streamalloc_check(self.sa, self.lib.streamalloc_host_free(ptr))

    def host_allocs(self):
        return self.sa.host_stats()["device_allocs"]


def streamalloc_check(sa, status):
    if status != 0:
        sa.check(status)


def wrap(torch, ptr, size):
    """A CPU tensor over SIZE bytes at PTR (no copy; torch sees the memory is pinned)."""
    return torch.frombuffer((ctypes.c_ubyte * size).from_address(ptr), dtype=torch.uint8)


def measure(torch, source, size, iters, stream, dst):
    """The loop of copies for one size: (GB/s, mean alloc us, mean free us)."""
    alloc_s = free_s = 0.0
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        t0 = time.perf_counter()
        handle, src = source.alloc(size, stream)
        t1 = time.perf_counter()
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        del src
        t2 = time.perf_counter()
        source.free(handle, stream)
        t3 = time.perf_counter()
        alloc_s += t1 - t0
        free_s += t3 - t2
    stream.synchronize()
    seconds = time.perf_counter() - start
    return size * iters / seconds / 1e9, alloc_s / iters * 1e6, free_s / iters * 1e6


def one(subject, result_path, quick):
    """Runs SUBJECT in this process; writes its JSON lines to RESULT_PATH."""
    import torch

    sa = None
    if subject.startswith("streamalloc"):
        import streamalloc
        import streamalloc.torch

        sa = streamalloc
        if subject == "streamalloc_torch":
            streamalloc.torch.enable(backend="backend")
    torch.cuda.init()
    source = {
        "cudaHostAlloc": lambda: CudaHostAlloc(torch),
        "torch": lambda: TorchPinned(torch),
        "streamalloc_torch": lambda: TorchPinned(torch, sa),
        "streamalloc_capi": lambda: CapiPinned(torch, sa),
    }[subject]()
    stream = torch.cuda.Stream()
    rows = []
    for size in SIZES:
        dst = torch.empty(size, dtype=torch.uint8, device="cuda")
        measure(torch, source, size, max(iterations(size, quick) // 10, 3), stream, dst)  # warm-up
        before = source.host_allocs()
        gbps, alloc_us, free_us = measure(torch, source, size, iterations(size, quick), stream, dst)
        after = source.host_allocs()
        row = {"subject": subject, "size": size, "iters": iterations(size, quick), "gbps": gbps,
               "alloc_us": alloc_us, "free_us": free_us,
               "pinned_allocs_in_loop": None if before is None else after - before}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del dst
    with open(result_path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def human(size):
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def table(rows):
    by = {(r["subject"], r["size"]): r for r in rows}
    head = "| size | " + " | ".join(f"{s} GB/s | {s} alloc us (free us)" for s in SUBJECTS) + " |"
    lines = [head, "|" + " --- |" * (1 + 2 * len(SUBJECTS))]
    for size in SIZES:
        cells = [human(size)]
        for s in SUBJECTS:
            r = by.get((s, size))
            if r is None:
                cells += ["failed", "failed"]
                continue
            made = "" if r["pinned_allocs_in_loop"] is None else f", {r['pinned_allocs_in_loop']} pinned"
            cells += [f"{r['gbps']:.1f}", f"{r['alloc_us']:.1f} ({r['free_us']:.1f}{made})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/pinned-bench")
    p.add_argument("--one", choices=SUBJECTS)
    p.add_argument("--result")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.one:
        try:
            one(args.one, args.result, args.quick)
        except Exception:
            traceback.print_exc()
            sys.exit(2)
        return
    os.makedirs(args.out, exist_ok=True)
    env = child_env({"PYTORCH_CUDA_ALLOC_CONF": None, "STREAMALLOC_TORCH_BACKEND": None})
    problem = prebuild_backend(env, os.path.join(args.out, "build.log"), TIMEOUT_S)
    rows, failed = [], []
    for subject in SUBJECTS:
        if problem and subject == "streamalloc_torch":
            failed.append(subject)
            continue
        result = os.path.join(args.out, f"{subject}.jsonl")
        log = os.path.join(args.out, f"{subject}.log")
        cmd = [sys.executable, HERE, "--one", subject, "--result", result] + (["--quick"] if args.quick else [])
        rc, secs = run_child(cmd, env, log, TIMEOUT_S)
        print(f"{subject}: exit {rc} in {secs:.0f} s ({tail(log, 2)})", flush=True)
        if rc != 0:
            failed.append(subject)
            continue
        with open(result) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    write_results(args.out, "pinned_bench", rows, table(rows))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
