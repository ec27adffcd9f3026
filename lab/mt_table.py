#!/usr/bin/env python3
"""Reads the `mt` part's JSON lines (lab/run mt: the anchors harness's
replay_core through libstreamalloc.so, its floor and the references, THREADS 1, 2, 4 and 8, each
replay a process of its own, MT_ROUNDS rounds) and prints, per trace, each allocator's median
million operations per second at each thread count, 8 threads over 1 of the medians and round by
round; then a thread's ns per operation at 1 and 8 threads (from the medians), above the floor's
(`replay_core floor`: the harness's own loop and frame, measured in the same rounds), and our
cost above the floor as a fraction of the fastest reference's above the floor.

    python3 lab/mt_table.py < mt_rounds.jsonl
"""
import argparse
import json
import statistics
import sys
from collections import defaultdict

FLOOR = "floor"
def main():
    runs = defaultdict(list)  # (trace, allocator, threads) -> mops_per_s, round by round
    for line in sys.stdin:
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if "mops_per_s" in r:
            runs[(r["trace"].removesuffix(".csv"), r["allocator"], r["threads"])].append(r["mops_per_s"])
    traces = sorted({t for t, _, _ in runs})
    COUNTS = sorted({n for _, _, n in runs})  # the thread counts run (MT_THREADS), 1 and 8 among them
    names = sorted({a for _, a, _ in runs}, key=lambda a: (a != FLOOR, a.startswith("streamalloc"), a))
    complete = {(t, a) for t in traces for a in names if all(runs[(t, a, n)] for n in COUNTS)}
    median = {(t, a, n): statistics.median(runs[(t, a, n)]) for (t, a) in complete for n in COUNTS}

    print("Million operations per second, medians of the rounds:\n")
    print("| trace | allocator | " + " | ".join(f"{n} thread{'s' if n > 1 else ''}" for n in COUNTS)
          + " | 8 / 1 (medians) | 8 / 1 round by round |")
    print("| --- | --- | " + "---: | " * len(COUNTS) + "---: | --- |")
    for t in traces:
        for a in names:
            if (t, a) not in complete:
                continue
            rounds = [round(b / x, 2) for x, b in zip(runs[(t, a, 1)], runs[(t, a, 8)])]
            cells = " | ".join(f"{median[(t, a, n)]:.2f}" for n in COUNTS)
            print(f"| {t} | {a} | {cells} | {median[(t, a, 8)] / median[(t, a, 1)]:.2f} | {rounds} |")

    # A thread's ns per operation: threads * 1e3 / aggregate million operations per second.
    ns = {k: k[2] * 1e3 / v for k, v in median.items()}
    print("\nA thread's ns per operation above the floor (medians), at 1 and 8 threads; (fraction): our")
    print("cost above the floor over the fastest reference's above the floor:\n")
    print("| trace | floor 1 / 8 | allocator | above the floor, 1 thread | 8 threads |")
    print("| --- | ---: | --- | ---: | ---: |")
    for t in traces:
        if (t, FLOOR) not in complete:
            continue
        floor = {n: ns[(t, FLOOR, n)] for n in (1, 8)}
        above = {(a, n): ns[(t, a, n)] - floor[n] for a in names if a != FLOOR and (t, a) in complete for n in (1, 8)}
        refs = [a for a in names if a != FLOOR and not a.startswith("streamalloc") and (t, a) in complete]
        fastest = {n: min((above[(a, n)] for a in refs), default=None) for n in (1, 8)}
        for a in names:
            if a == FLOOR or (t, a) not in complete:
                continue
            cells = []
            for n in (1, 8):
                cell = f"{above[(a, n)]:.0f}"
                if a.startswith("streamalloc") and fastest[n] and fastest[n] > 0:
                    cell += f" (**{above[(a, n)] / fastest[n]:.2f}**)"
                cells.append(cell)
            print(f"| {t} | {floor[1]:.0f} / {floor[8]:.0f} | {a} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()  # reads standard input
    main()
