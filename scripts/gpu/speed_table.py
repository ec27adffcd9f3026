"""Reads the `speed` part's JSON lines (a {"round": N} line before each round's results) and
prints, per round and trace, each of our configurations' warm ns/op through the C ABI over the
fastest anchor of that round (the bar: at most 0.5); then each configuration's best round
against the best round of the fastest anchor, which reads through the machine's noise (the
same binary, run back to back on the H200 machine, ranges over 2x); then the same with the
median of the rounds, and how many traces met the bar in each round.

    python3 scripts/gpu/speed_table.py < speed_rounds.jsonl

`read_rounds`, `per_trace` and `fastest_anchor` also serve scripts/gpu/goal_table.py."""
import json
import statistics
import sys
from collections import defaultdict


def read_rounds(lines):
    """round -> trace (without .csv) -> allocator -> warm ns/op, from the speed part's lines."""
    rounds = defaultdict(lambda: defaultdict(dict))
    current = 0
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if "round" in r:
            current = r["round"]
            continue
        if "ns_per_op_warm" in r:
            rounds[current][r["trace"].removesuffix(".csv")][r["allocator"]] = r["ns_per_op_warm"]
    return rounds


def per_trace(rounds):
    """trace -> allocator -> its ns/op in each round, in round order."""
    out = defaultdict(lambda: defaultdict(list))
    for _, traces in sorted(rounds.items()):
        for trace, figures in traces.items():
            for name, ns in figures.items():
                out[trace][name].append(ns)
    return out


def fastest_anchor(figures):
    """(name, ns/op) of the fastest allocator that is not streamalloc; None without one."""
    anchors = {k: v for k, v in figures.items() if not k.startswith("streamalloc")}
    if not anchors:
        return None
    return min(anchors.items(), key=lambda kv: kv[1])


def main():
    rounds = read_rounds(sys.stdin)
    ours = sorted({name for traces in rounds.values() for figures in traces.values() for name in figures
                   if name.startswith("streamalloc")})

    def cells(figures, best):
        """Our configurations' ns/op and ratio to `best`, as table cells ('-' where absent)."""
        return " | ".join(f"{figures[o]:.0f} ({figures[o] / best:.2f})" if o in figures else "-" for o in ours)

    header = " | ".join(f"{o.removeprefix('streamalloc:')} ns/op (ratio)" for o in ours)
    print(f"| round | trace | fastest anchor | ns/op | {header} |")
    print("|---|---|---|---|" + "---|" * len(ours))
    for n, traces in sorted(rounds.items()):
        for trace, figures in sorted(traces.items()):
            if not (anchor := fastest_anchor(figures)):
                continue
            name, best = anchor
            print(f"| {n} | {trace} | {name} | {best:.0f} | {cells(figures, best)} |")

    all_rounds = per_trace(rounds)

    def summary(label, pick):
        """The table of each allocator's rounds reduced by `pick` (min, median), and the count of
        traces where each configuration of ours is at most half the fastest anchor so reduced."""
        reduced = {t: {name: pick(v) for name, v in figures.items()} for t, figures in all_rounds.items()}
        print()
        print(f"| trace | fastest anchor, {label} | ns/op | {header.replace('ns/op', label)} |")
        print("|---|---|---|" + "---|" * len(ours))
        met = defaultdict(int)
        for trace, figures in sorted(reduced.items()):
            if not (anchor := fastest_anchor(figures)):
                continue
            name, ns = anchor
            for o in ours:
                met[o] += o in figures and figures[o] <= ns / 2
            print(f"| {trace} | {name} | {ns:.0f} | {cells(figures, ns)} |")
        print()
        for o in ours:
            print(f"{o}: at most half the fastest anchor ({label}s) on {met[o]} of {len(reduced)} traces")

    summary("best round", min)
    summary("median round", statistics.median)
    print()
    for o in ours:
        counts = []
        for _, traces in sorted(rounds.items()):
            fast = {t: fastest_anchor(f) for t, f in traces.items()}
            counts.append(sum(1 for t, f in traces.items() if o in f and fast[t] and f[o] <= fast[t][1] / 2))
        print(f"{o}: traces at most half the fastest anchor, round by round: {counts}")


if __name__ == "__main__":
    main()
