"""Reads the `speed` part's JSON lines (a {"round": N} line before each round's results) and
prints, per round and trace, StreamSafe's warm ns/op through the C ABI over the fastest anchor
of that round (the #3 bar: at most 0.5); then each allocator's best round against the best
round of the fastest anchor, which reads through the machine's noise (the same binary, run
back to back on the H200 machine, ranges over 2x)."""
import json
import sys
from collections import defaultdict

rounds = defaultdict(lambda: defaultdict(dict))
current = 0
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    if "round" in r:
        current = r["round"]
        continue
    if "ns_per_op_warm" in r:
        rounds[current][r["trace"].removesuffix(".csv")][r["allocator"]] = r["ns_per_op_warm"]

ours = "streamalloc:strategy=stream_safe"


def fastest_anchor(figures):
    """(name, ns/op) of the fastest allocator that is not streamalloc; None without one or
    without our own figure."""
    anchors = {k: v for k, v in figures.items() if not k.startswith("streamalloc")}
    if not anchors or ours not in figures:
        return None
    return min(anchors.items(), key=lambda kv: kv[1])


print("| round | trace | fastest anchor | ns/op | stream_safe ns/op | ratio |")
print("|---|---|---|---|---|---|")
for n, traces in sorted(rounds.items()):
    for trace, figures in sorted(traces.items()):
        if not (anchor := fastest_anchor(figures)):
            continue
        name, best = anchor
        print(f"| {n} | {trace} | {name} | {best:.0f} | {figures[ours]:.0f} | {figures[ours] / best:.2f} |")

best = defaultdict(dict)
for traces in rounds.values():
    for trace, figures in traces.items():
        for name, ns in figures.items():
            best[trace][name] = min(ns, best[trace].get(name, ns))
print()
print("| trace | fastest anchor, best round | ns/op | stream_safe, best round | ratio |")
print("|---|---|---|---|---|")
for trace, figures in sorted(best.items()):
    if not (anchor := fastest_anchor(figures)):
        continue
    name, ns = anchor
    print(f"| {trace} | {name} | {ns:.0f} | {figures[ours]:.0f} | {figures[ours] / ns:.2f} |")
