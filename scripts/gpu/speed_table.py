"""Reads the `speed` part's JSON lines (a {"round": N} line before each round's results) and
prints, per round and trace, StreamSafe's warm ns/op through the C ABI over the fastest anchor
of that round (the #3 bar: at most 0.5)."""
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
print("| round | trace | fastest anchor | ns/op | stream_safe ns/op | ratio |")
print("|---|---|---|---|---|---|")
for n, traces in sorted(rounds.items()):
    for trace, figures in sorted(traces.items()):
        anchors = {k: v for k, v in figures.items() if not k.startswith("streamalloc")}
        if not anchors or ours not in figures:
            continue
        name, best = min(anchors.items(), key=lambda kv: kv[1])
        print(f"| {n} | {trace} | {name} | {best:.0f} | {figures[ours]:.0f} | {figures[ours] / best:.2f} |")
