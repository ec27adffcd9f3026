"""Reads the `speed` part's JSON lines (a {"round": N} line before each round's results) and
prints, per round and trace, the floor's warm ns/op (`replay_core floor`: the harness's own loop
and call frame, measured in the same round), every allocator's ns/op above it, and each of our
configurations' cost above the floor as a fraction of the fastest reference's above the floor
(the goal: at most a third); then the same with each allocator's best round and with the median
of the rounds, which read through the machine's noise (the same binary, run back to back on one
machine, ranges over 2x), and how many traces met the goal in each round.

    python3 lab/speed_table.py < speed_rounds.jsonl

`read_rounds`, `per_trace` and `fastest_anchor` also serve lab/goal_table.py."""
import argparse
import json
import statistics
import sys
from collections import defaultdict

# The name the harness gives its floor.
FLOOR = "floor"
# Our cost above the floor, at most this fraction of the fastest reference's (issue 49).
GOAL = 1 / 3


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
    """(name, ns/op) of the fastest reference allocator (neither streamalloc nor the floor);
    None without one."""
    anchors = {k: v for k, v in figures.items() if not k.startswith("streamalloc") and k != FLOOR}
    if not anchors:
        return None
    return min(anchors.items(), key=lambda kv: kv[1])


def above_floor(figures):
    """(floor ns/op, fastest reference's name, its ns/op above the floor, allocator -> ns/op above
    the floor) for one trace's figures; None without a floor or a reference."""
    anchor = fastest_anchor(figures)
    if FLOOR not in figures or not anchor:
        return None
    floor = figures[FLOOR]
    above = {k: v - floor for k, v in figures.items() if k != FLOOR}
    return floor, anchor[0], above[anchor[0]], above


def fraction(ours, reference):
    """`ours` over `reference` (both above the floor); NaN where the reference is not above it."""
    return ours / reference if reference > 0 else float("nan")


def main():
    rounds = read_rounds(sys.stdin)
    names = {name for traces in rounds.values() for figures in traces.values() for name in figures}
    ours = sorted(n for n in names if n.startswith("streamalloc"))
    refs = sorted(n for n in names if not n.startswith("streamalloc") and n != FLOOR)
    if FLOOR not in names:
        sys.exit("no floor in the input (replay_core floor TRACE in each round): nothing to measure above")

    def row(label, trace, figures):
        """One table row: the floor, every allocator above it, ours as a fraction of the fastest
        reference's; None without a floor or a reference."""
        if not (f := above_floor(figures)):
            return None
        floor, fast, fast_above, above = f
        cells = [f"{above[r]:.0f}" if r in above else "-" for r in refs]
        cells += [f"{above[o]:.0f} (**{fraction(above[o], fast_above):.2f}**)" if o in above else "-" for o in ours]
        return f"| {label}{trace} | {floor:.0f} | {fast} | " + " | ".join(cells) + " |"

    def header(first):
        cols = [f"{r} above" for r in refs] + [f"{o.removeprefix('streamalloc:')} above (fraction)" for o in ours]
        print(f"| {first}trace | floor ns/op | fastest reference | " + " | ".join(cols) + " |")
        print("---|" * first.count("|") + "|---|---:|---|" + "---:|" * len(cols))

    print("ns per operation above the floor, measured in the same round; (fraction): our cost above the")
    print(f"floor over the fastest reference's above the floor (goal: at most {GOAL:.2f})\n")
    header("round | ")
    for n, traces in sorted(rounds.items()):
        for trace, figures in sorted(traces.items()):
            if line := row(f"{n} | ", trace, figures):
                print(line)

    all_rounds = per_trace(rounds)

    def summary(label, pick):
        """The table of each allocator's rounds (the floor's too) reduced by `pick` (min, median),
        and the traces where each configuration of ours meets the goal so reduced."""
        reduced = {t: {name: pick(v) for name, v in figures.items()} for t, figures in all_rounds.items()}
        print(f"\n{label}:\n")
        header("")
        met = defaultdict(int)
        for trace, figures in sorted(reduced.items()):
            if not (line := row("", trace, figures)):
                continue
            print(line)
            _, _, fast_above, above = above_floor(figures)
            for o in ours:
                met[o] += o in above and above[o] <= GOAL * fast_above
        print()
        for o in ours:
            print(f"{o}: at most {GOAL:.2f} of the fastest reference above the floor ({label}) on "
                  f"{met[o]} of {len(reduced)} traces")

    summary("best round", min)
    summary("median round", statistics.median)
    print()
    for o in ours:
        counts = []
        for _, traces in sorted(rounds.items()):
            fs = [above_floor(f) for f in traces.values() if o in f]
            counts.append(sum(1 for f in fs if f and f[3][o] <= GOAL * f[2]))
        print(f"{o}: traces meeting the goal, round by round: {counts}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()  # reads standard input
    main()
