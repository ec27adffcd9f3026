#!/usr/bin/env python3
"""Where a compiled training loop's device memory goes, per allocator: the main pool and each
private (CUDA graph) pool, reserved and handed out, after chosen steps.

    python3 lab/graph_pool_memory.py ALLOCATOR [--steps 40]   # ALLOCATOR: native | expandable | backend

Runs torch_loops.py's `compiled` loop (a transformer under torch.compile(mode="reduce-overhead")
with AdamW) in this process under ALLOCATOR and prints one JSON line after steps 0-3, 5, 10 and
the last: device memory used since the start and its peak (the driver's figures, as
torch_loops.py reports them), torch's reserved and allocated bytes, and per pool (None: the main
pool; otherwise the private pool's id) the segments, their MiB and the MiB handed out (and, under
streamalloc's backend, pending: freed, waiting for recorded streams) — from torch's memory
snapshot under torch's allocators, from `streamalloc.segments()` under the backend. It answers
why one allocator's peak is above another's (issue 48: the backend's peak on this loop).
"""
import argparse
import json
import os
import sys

MIB = 2**20


def pools_of(alloc, torch):
    pools = {}
    if alloc == "backend":
        import streamalloc

        for s in streamalloc.segments(0):
            p = pools.setdefault(str(s["pool"]), {"segments": 0, "mib": 0.0, "handed_out_mib": 0.0, "pending_mib": 0.0})
            p["segments"] += 1
            p["mib"] += s["size"] / MIB
            for b in s["blocks"]:
                if b["state"] == "allocated":
                    p["handed_out_mib"] += b["size"] / MIB
                elif b["state"] == "pending":
                    p["pending_mib"] += b["size"] / MIB
    else:
        for s in torch.cuda.memory_snapshot():
            p = pools.setdefault(str(s.get("segment_pool_id")), {"segments": 0, "mib": 0.0, "handed_out_mib": 0.0})
            p["segments"] += 1
            p["mib"] += s["total_size"] / MIB
            p["handed_out_mib"] += s["allocated_size"] / MIB
    return pools


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("allocator", choices=("native", "expandable", "backend"))
    parser.add_argument("--steps", type=int, default=40, help="steps to run (default 40)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch_loops as loops

    torch, _ = loops.setup_allocator(args.allocator, "cuda")
    dev = torch.device("cuda", 0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    base, peak = total - free, [0]

    def sample():
        f, t = torch.cuda.mem_get_info()
        peak[0] = max(peak[0], t - f - base)

    step = loops.build_compiled(torch, dev, loops.SIZES["compiled"][0], 0, args.steps)
    for i in range(args.steps):
        step(i, sample)
        if i in (0, 1, 2, 3, 5, 10, args.steps - 1):
            torch.cuda.synchronize()
            sample()
            f, t = torch.cuda.mem_get_info()
            print(json.dumps({"allocator": args.allocator, "after_step": i, "used_mib": round((t - f - base) / MIB, 1),
                              "peak_mib": round(peak[0] / MIB, 1),
                              "torch_reserved_mib": round(torch.cuda.memory_reserved() / MIB, 1),
                              "torch_allocated_mib": round(torch.cuda.memory_allocated() / MIB, 1),
                              "pools": pools_of(args.allocator, torch)}), flush=True)


if __name__ == "__main__":
    main()
