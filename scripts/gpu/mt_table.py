#!/usr/bin/env python3
"""Reads the `mt` part's JSON lines (scripts/gpu/device-run.sh mt: the anchors harness's
replay_core through libstreamalloc.so, THREADS 1, 2, 4 and 8, each replay a process of its own,
MT_ROUNDS rounds) and prints, per trace, the median million operations per second at each
thread count, 8 threads over 1 of the medians, and 8 over 1 round by round.

    python3 scripts/gpu/mt_table.py < mt_rounds.jsonl
"""
import json
import statistics
import sys
from collections import defaultdict


def main():
    runs = defaultdict(list)  # (trace, threads) -> mops_per_s, round by round
    for line in sys.stdin:
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if "mops_per_s" in r:
            runs[(r["trace"].removesuffix(".csv"), r["threads"])].append(r["mops_per_s"])
    counts = (1, 2, 4, 8)
    print("| trace | 1 thread | 2 | 4 | 8 | 8 / 1 (medians) | 8 / 1 round by round |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for trace in sorted({t for t, _ in runs}):
        if not all(runs[(trace, n)] for n in counts):
            continue
        median = {n: statistics.median(runs[(trace, n)]) for n in counts}
        rounds = [round(b / a, 2) for a, b in zip(runs[(trace, 1)], runs[(trace, 8)])]
        cells = " | ".join(f"{median[n]:.2f}" for n in counts)
        print(f"| {trace} | {cells} | {median[8] / median[1]:.2f} | {rounds} |")


if __name__ == "__main__":
    main()
