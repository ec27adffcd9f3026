#!/usr/bin/env python3
"""The cost of one allocation and its free through torch, per allocator (issue 34).

    python3 lab/torch_alloc_overhead.py --out DIR [--quick] [--rounds 3]
    python3 lab/torch_alloc_overhead.py --one ALLOCATOR --result FILE [--quick]   # one process

Times `t = torch.empty(size, dtype=torch.uint8, device=dev); del t` in a loop, for sizes
0 (the floor: Python, argument parsing, dispatch and tensor objects; torch's caching allocator
and streamalloc's backend return a null pointer for 0 bytes without allocating), 512 B,
64 KiB, 1 MiB, 16 MiB and 256 MiB, on 1 thread and on 8
threads at once, each thread on a torch.cuda.Stream of its own (`with torch.cuda.stream(s)`),
under

  native     torch's caching allocator
  backend    streamalloc's torch backend (STREAMALLOC_TORCH_BACKEND=backend,
             streamalloc.torch.enable(); streamalloc's default configuration unless
             STREAMALLOC_CONF is set)
  pluggable  streamalloc through torch's CUDAPluggableAllocator, the fallback, for reference
             (STREAMALLOC_TORCH_BACKEND=pluggable)

each in its own process (the allocator is fixed per process); --rounds rounds (default 3) of
one process per allocator, the order rotated each round. In a process, each (size, threads)
is warmed up, then timed 5 times (--reps): each thread does --iters pairs (default 20000 on
1 thread, 4000 per thread on 8), and a repetition's time runs from the first thread's start
to the last thread's end. ns per pair is that time over the pairs one thread did (what one
pair costs each thread with the others running); pairs/s is all threads' pairs over that
time. A process reports the median of its repetitions, the table the median over rounds.

What is included, and the same for every allocator: Python's loop, torch.empty's argument
parsing, tensor creation and destruction, and, with 8 threads, contention for the GIL (torch
releases it around its C++ call in torch.empty; the free at `del t` runs with it held). The
0-byte row measures that floor; "minus floor" columns subtract each allocator's own floor.

Prints one line per process, then a markdown table: size | threads | native ns | backend ns |
pluggable ns | backend/native | ..., written to DIR/torch_alloc_overhead.md, and every
process's figures (each repetition) to DIR/torch_alloc_overhead.jsonl. Exits 1 if a native
or backend process failed. The backend is built once before the runs into STREAMALLOC_CACHE
(default /tmp/streamalloc-cache here).

--quick: 1 round, 3 repetitions, fewer iterations and sizes (a smoke run).
--device cpu: a smoke test of this script's own logic without a GPU (no allocator applied,
meaningless figures).
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time
import traceback

from torch_runs import (allocator_env, apply_env, child_env, enable_streamalloc, finish_run, prebuild_backend,
                        run_child, tail)

KIB, MIB = 1 << 10, 1 << 20
HERE = os.path.abspath(__file__)
ALLOCATORS = ("native", "backend", "pluggable")
MUST_COMPLETE = ("native", "backend")

ENV = {"native": allocator_env(), "backend": allocator_env(backend="backend"),
       "pluggable": allocator_env(backend="pluggable")}
"""The environment of each allocator's process (None: removed)."""
SIZES = (0, 512, 64 * KIB, MIB, 16 * MIB, 256 * MIB)
QUICK_SIZES = (0, 512, MIB, 256 * MIB)


def size_name(n):
    if n == 0:
        return "0 (floor)"
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------------------------

def setup(allocator, device_kind):
    apply_env(os.environ, ENV[allocator])
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "STREAMALLOC_CONF": os.environ.get("STREAMALLOC_CONF")}
    if device_kind == "cpu":
        info["note"] = "cpu dry run: no allocator applied"
        return torch, info
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available to torch (use --device cpu for a dry run of the script)")
    if allocator != "native":
        enable_streamalloc(allocator, info)
    torch.cuda.init()
    info["allocator_backend"] = torch.cuda.get_allocator_backend()
    info["gpu"] = torch.cuda.get_device_name()
    return torch, info


def timed(torch, dev, streams, size, threads, iters):
    """One repetition: THREADS threads each do ITERS pairs on its own stream, started together.
    Returns the time from the first start to the last end, in ns."""
    barrier = threading.Barrier(threads)
    starts, ends, errors = [0] * threads, [0] * threads, []
    u8 = torch.uint8

    def work(k):
        try:
            empty, perf = torch.empty, time.perf_counter_ns
            ctx = torch.cuda.stream(streams[k]) if streams else _Null()
            with ctx:
                barrier.wait()
                t0 = perf()
                for _ in range(iters):
                    t = empty(size, dtype=u8, device=dev)
                    del t
                ends[k] = perf()
                starts[k] = t0
        except Exception as e:  # reported, not swallowed
            errors.append(f"{type(e).__name__}: {e}")
            barrier.abort()

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise RuntimeError(errors[0])
    return max(ends) - min(starts)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def one_process(allocator, args):
    started = time.perf_counter()
    r = {"allocator": allocator, "device": args.device, "ok": False, "error": None, "rows": []}
    try:
        torch, info = setup(allocator, args.device)
        r.update(info)
        cuda = args.device == "cuda"
        dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        streams = [torch.cuda.Stream(dev) for _ in range(max(args.threads))] if cuda else None
        import gc

        gc.collect()
        gc.disable()  # a collection in a timed loop would land on one allocator or another
        for size in args.sizes:
            for threads in args.threads:
                iters = args.iters1 if threads == 1 else args.iters_n
                timed(torch, dev, streams, size, threads, max(iters // 5, 100))  # warm-up
                walls = [timed(torch, dev, streams, size, threads, iters) for _ in range(args.reps)]
                ns = [w / iters for w in walls]
                rate = [threads * iters / (w / 1e9) for w in walls]
                row = {"size": size, "threads": threads, "iters_per_thread": iters, "wall_ns": walls,
                       "ns_per_pair": ns, "pairs_per_s": rate,
                       "median_ns_per_pair": statistics.median(ns), "median_pairs_per_s": statistics.median(rate)}
                r["rows"].append(row)
                print(f"{allocator:>9} {size_name(size):>10} x{threads}: {row['median_ns_per_pair']:9.1f} ns/pair, "
                      f"{row['median_pairs_per_s'] / 1e6:7.3f} M pairs/s", flush=True)
        gc.enable()
        if cuda:
            torch.cuda.synchronize(dev)
        r["ok"] = True
    except Exception as e:
        r["error"] = f"{type(e).__name__}: {e}"[:600]
        r["traceback"] = traceback.format_exc()[-3000:]
    r["wall_s"] = time.perf_counter() - started
    return r


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------

def fmt(v, digits=0):
    return "—" if v is None else f"{v:,.{digits}f}"


def drive(args):
    os.makedirs(args.out, exist_ok=True)
    logs = os.path.join(args.out, "torch_alloc_overhead-logs")
    os.makedirs(logs, exist_ok=True)
    jsonl_path = os.path.join(args.out, "torch_alloc_overhead.jsonl")
    md_path = os.path.join(args.out, "torch_alloc_overhead.md")
    allocators = args.allocators.split(",")
    build_problem = None
    if args.device == "cuda" and set(allocators) & {"backend"}:
        build_problem = prebuild_backend(child_env(ENV["backend"]), os.path.join(logs, "backend-build.log"),
                                         args.build_timeout)
    processes = []
    with open(jsonl_path, "w") as jsonl:
        for rnd in range(args.rounds):
            order = allocators[rnd % len(allocators):] + allocators[:rnd % len(allocators)]
            for allocator in order:
                result_path = os.path.join(logs, f"{allocator}-{rnd}.json")
                log_path = os.path.join(logs, f"{allocator}-{rnd}.log")
                if os.path.exists(result_path):
                    os.remove(result_path)
                cmd = [sys.executable, HERE, "--one", allocator, "--result", result_path, "--device", args.device,
                       "--sizes", ",".join(map(str, args.sizes)), "--threads", ",".join(map(str, args.threads)),
                       "--iters1", str(args.iters1), "--iters-n", str(args.iters_n), "--reps", str(args.reps)]
                rc, secs = run_child(cmd, child_env(ENV[allocator]), log_path, args.timeout)
                try:
                    with open(result_path) as f:
                        r = json.load(f)
                except (OSError, ValueError):
                    why = f"timed out after {args.timeout} s" if rc is None else f"exited {rc} without a result"
                    r = {"allocator": allocator, "ok": False, "error": f"{why}: {tail(log_path)}", "rows": []}
                    if allocator == "backend" and build_problem:
                        r["error"] += f" [{build_problem}]"
                r.update(round=rnd, process_s=secs)
                processes.append(r)
                jsonl.write(json.dumps(r) + "\n")
                jsonl.flush()
                print(f"round {rnd} {allocator:>9}: {'ok' if r['ok'] else 'FAILED: ' + str(r['error'])} ({secs:.1f} s)",
                      flush=True)

    def median_of(allocator, size, threads, key):
        values = [row[key] for p in processes if p["allocator"] == allocator and p["ok"]
                  for row in p["rows"] if row["size"] == size and row["threads"] == threads]
        return statistics.median(values) if values else None

    first = next((p for p in processes if p.get("torch")), {})
    lines = [f"## Allocation + free through torch ({'quick' if args.quick else 'full'} run"
             f"{', CPU DRY RUN: figures meaningless' if args.device == 'cpu' else ''})", "",
             f"torch {first.get('torch', '?')} (CUDA {first.get('cuda', '?')}), {first.get('gpu', args.device)}, "
             f"STREAMALLOC_CONF={os.environ.get('STREAMALLOC_CONF') or '(default)'}; "
             f"`t = torch.empty(size, dtype=torch.uint8, device=dev); del t`; median over {args.rounds} round(s) "
             f"of each process's median of {args.reps} repetitions", "",
             "| size | threads | native ns | backend ns | pluggable ns | backend/native | native − floor ns "
             "| backend − floor ns | native M pairs/s | backend M pairs/s | pluggable M pairs/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    at_or_below, compared = 0, 0
    for size in args.sizes:
        for threads in args.threads:
            ns = {a: median_of(a, size, threads, "median_ns_per_pair") for a in ALLOCATORS}
            rate = {a: median_of(a, size, threads, "median_pairs_per_s") for a in ALLOCATORS}
            floor = {a: median_of(a, 0, threads, "median_ns_per_pair") for a in ALLOCATORS}
            ratio = ns["backend"] / ns["native"] if ns["backend"] and ns["native"] else None
            if ratio is not None and size:
                compared += 1
                at_or_below += ratio <= 1.0
            over = {a: (ns[a] - floor[a]) if size and ns[a] is not None and floor[a] is not None else None
                    for a in ALLOCATORS}
            lines.append(f"| {size_name(size)} | {threads} | {fmt(ns['native'])} | {fmt(ns['backend'])} | "
                         f"{fmt(ns['pluggable'])} | {fmt(ratio, 3)} | {fmt(over['native'])} | {fmt(over['backend'])} | "
                         + " | ".join(fmt(rate[a] / 1e6 if rate[a] else None, 3) for a in ALLOCATORS) + " |")
    lines += ["", f"backend at or below native on {at_or_below} of {compared} rows (sizes above 0).", "",
              "ns per pair: per thread (a repetition's wall time over one thread's pairs); M pairs/s: all threads "
              "together. Python overhead (the loop, torch.empty's argument parsing, tensor objects, and with more "
              "threads than one contention for the GIL, which torch.empty releases around its C++ call and the free at "
              "`del` holds) is included and identical across allocators; the 0-byte row (no memory allocated) "
              "measures it and the \"− floor\" columns subtract it."]
    failed = [f"{p['allocator']} (round {p['round']}): {p['error']}" for p in processes if not p["ok"]]
    if failed:
        lines += ["", "Processes that failed:", *[f"- {f}" for f in failed]]
    text = "\n".join(lines)
    print("\n" + text)
    with open(md_path, "w") as f:
        f.write(text + "\n")
    print(f"\nwritten: {md_path}, {jsonl_path}, logs in {logs}")
    bad = [p for p in processes if p["allocator"] in MUST_COMPLETE and not p["ok"]]
    return 1 if bad else 0


def int_list(text):
    return [int(x) for x in text.split(",") if x.strip()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/streamalloc-gpu", help="folder for torch_alloc_overhead.md/.jsonl, logs")
    parser.add_argument("--quick", action="store_true", help="1 round, 3 repetitions, fewer iterations and sizes")
    parser.add_argument("--allocators", default=",".join(ALLOCATORS),
                        help=f"comma-separated, of {', '.join(ALLOCATORS)}")
    parser.add_argument("--rounds", type=int, help="processes per allocator (default 3, quick 1)")
    parser.add_argument("--reps", type=int, help="timed repetitions per process (default 5, quick 3)")
    parser.add_argument("--sizes", type=int_list, help="bytes, comma-separated (default 0,512,64Ki,1Mi,16Mi,256Mi)")
    parser.add_argument("--threads", type=int_list, default=[1, 8], help="thread counts (default 1,8)")
    parser.add_argument("--iters1", type=int, help="pairs per repetition on 1 thread (default 20000, quick 2000)")
    parser.add_argument("--iters-n", type=int, help="pairs per thread and repetition on more (default 4000, quick 500)")
    parser.add_argument("--timeout", type=int, default=180, help="seconds per process (default 180)")
    parser.add_argument("--build-timeout", type=int, default=600, help="seconds for building the backend")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a dry run of this script's logic only (no allocator, meaningless figures)")
    parser.add_argument("--one", metavar="ALLOCATOR", help="measure one allocator in this process")
    parser.add_argument("--result", help="with --one: write the result (JSON) here")
    args = parser.parse_args()
    q = args.quick
    args.rounds = args.rounds or (1 if q else 3)
    args.reps = args.reps or (3 if q else 5)
    args.sizes = args.sizes if args.sizes is not None else list(QUICK_SIZES if q else SIZES)
    args.iters1 = args.iters1 or (2000 if q else 20000)
    args.iters_n = args.iters_n or (500 if q else 4000)
    if not args.threads or min(args.threads) < 1 or min(args.sizes, default=0) < 0:
        parser.error("--threads: positive counts; --sizes: bytes >= 0")
    for name in ([args.one] if args.one else args.allocators.split(",")):
        if name not in ALLOCATORS:
            parser.error(f"unknown allocator {name!r} (of {', '.join(ALLOCATORS)})")
    if args.one:
        r = one_process(args.one, args)
        finish_run(r, args.result, r["ok"])
    sys.exit(drive(args))


if __name__ == "__main__":
    main()
