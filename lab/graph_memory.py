#!/usr/bin/env python3
"""Device memory held by captured CUDA graphs with large temporaries, per allocator and pool mode.

    python3 lab/graph_memory.py [--graphs 8] [--gib 1] [NAME...]   # every row (or NAME's)
    python3 lab/graph_memory.py --one CONF MODE [--graphs 8] [--gib 1]   # one row

Allocators (NAME): streamalloc's strategies through streamalloc.torch.enable (plain,
best_fit, stream_safe, stream_safe_chunks, async), PyTorch's native caching allocator
(native) and its backend:cudaMallocAsync (cudaMallocAsync). Pool modes: `private` (each
graph gets its own torch.cuda.graph_pool_handle()), `shared` (one handle for all graphs) and,
for async and cudaMallocAsync, `none` (no pool argument: torch's own id per graph). Each row
runs in its own process (the allocator is fixed per process), one after another.

Each graph allocates GIB GiB of temporaries (8 tensors live together, derived from a small
static input), frees them inside the capture and keeps a small static output. "Held" is the
device memory in use (total - free of torch.cuda.mem_get_info, after a synchronize) minus
the figure before the first capture: after all captures, after one replay of every graph
(the driver maps graph memory nodes at launch), and after torch.cuda.empty_cache().
"Reserved" is the allocator's own figure after the replays (streamalloc.stats' reserved;
torch.cuda.memory_reserved for PyTorch's). Every graph's output is checked after its replay.

Prints one JSON line per row as it completes, then a markdown table; exits 1 if a row failed.
"""

import argparse
import json
import os
import subprocess
import sys

# The graph cases of python/tests/gpu/torch_cases.py and this measurement share the allocator
# setup, the temporaries and the memory figures: the test's tree holds them.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests", "gpu"))
from torch_cases import CONTROLS, device_used, factor, pattern, reserved, setup, temporaries  # noqa: E402
from casekit import GIB, MIB  # noqa: E402

ALLOCATORS = {
    "plain": "strategy=plain",
    "best_fit": "strategy=best_fit",
    "stream_safe": "strategy=stream_safe",
    "stream_safe_chunks": "strategy=stream_safe,backing=chunks",
    "async": "strategy=async",
    "native": "native",
    "cudaMallocAsync": "cudaMallocAsync",
}
NO_HANDLE = ("async", "cudaMallocAsync")
"""Allocators also measured without a pool handle."""


def held(torch, base):
    """Device memory in use beyond `base`, after a synchronize."""
    return device_used(torch) - base


def one_row(conf, mode, graphs, gib):
    """Captures, replays and measures in this process; returns the row."""
    torch = setup(conf)
    n, chunks = 4096, 8
    chunk = gib * GIB // chunks
    expected = pattern(torch, n, 2)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        static_in = expected.cuda()
        temporaries(static_in, 1, MIB)  # loads the kernels outside the captures
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = held(torch, 0)
    shared = torch.cuda.graph_pool_handle() if mode == "shared" else None
    captured, outputs = [], []
    with torch.cuda.stream(s):
        for _ in range(graphs):
            pool = torch.cuda.graph_pool_handle() if mode == "private" else shared
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=s):
                outputs.append(temporaries(static_in, chunks, chunk))
            captured.append(g)
    row = {"conf": conf, "mode": mode, "graphs": graphs, "gib_each": gib, "held_capture": held(torch, base)}
    ours = conf not in CONTROLS
    if ours:  # the library's own figures beside the device's, to tell where memory went
        import streamalloc

        row["stats_capture"] = streamalloc.stats(0)
    with torch.cuda.stream(s):
        for g in captured:
            g.replay()
    row["held_replay"] = held(torch, base)
    if ours:
        row["stats_replay"] = streamalloc.stats(0)
    row["reserved"] = reserved(torch, conf)
    want = expected * factor(chunks)
    row["replay_ok"] = all(torch.equal(out.cpu(), want) for out in outputs)
    torch.cuda.empty_cache()
    row["held_empty_cache"] = held(torch, base)
    return row


def gib(value):
    return "-" if value is None else f"{value / GIB:.2f}"


def drive(names, graphs, gib_each):
    """Runs every row in its own process; prints JSON lines, then the table; the exit status."""
    rows = [(name, mode) for name in names for mode in ("private", "shared")]
    rows += [(name, "none") for name in names if name in NO_HANDLE]
    table, failed = [], 0
    for name, mode in rows:
        cmd = [sys.executable, __file__, "--one", ALLOCATORS[name], mode, "--graphs", str(graphs),
               "--gib", str(gib_each)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            row = json.loads(lines[-1]) if done.returncode == 0 and lines else None
            error = None if row else (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        except subprocess.TimeoutExpired:
            row, error = None, "hung (300 s)"
        row = {"name": name, **(row or {"mode": mode, "error": error})}
        print(json.dumps(row), flush=True)
        failed += bool(error) or not row.get("replay_ok")
        table.append(row)
    print(f"\n{graphs} graphs x {gib_each} GiB of temporaries each; GiB held beyond the baseline\n")
    print("| allocator | pools | after capture | after replay | after empty_cache | reserved | outputs |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for r in table:
        outcome = r.get("error") or ("right" if r["replay_ok"] else "WRONG")
        print(f"| {r['name']} | {r['mode']} | {gib(r.get('held_capture'))} | {gib(r.get('held_replay'))} | "
              f"{gib(r.get('held_empty_cache'))} | {gib(r.get('reserved'))} | {outcome} |")
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"allocators to measure (default all: {', '.join(ALLOCATORS)})")
    parser.add_argument("--one", nargs=2, metavar=("CONF", "MODE"), help="measure one row in this process")
    parser.add_argument("--graphs", type=int, default=8)
    parser.add_argument("--gib", type=int, default=1, help="GiB of temporaries per graph")
    args = parser.parse_args()
    unknown = [name for name in args.names if name not in ALLOCATORS]
    if unknown:
        parser.error(f"unknown allocators {unknown}")
    if args.one:
        if args.one[1] not in ("private", "shared", "none"):
            parser.error("MODE is private, shared or none")
        row = one_row(*args.one, args.graphs, args.gib)
        print(json.dumps(row), flush=True)
        sys.exit(0 if row["replay_ok"] else 1)
    sys.exit(drive(args.names or list(ALLOCATORS), args.graphs, args.gib))


if __name__ == "__main__":
    main()
