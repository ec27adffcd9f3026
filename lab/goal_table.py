"""The goal of issue 17 from one GPU session's JSON lines: footprint from an anchors run
(`lab/run anchors`, the first pass), speed from the speed rounds (`lab/run
speed`, SPEED_CONFS with both configurations below), each configuration's best and median
round against the fastest reference's best and median round.

    python3 lab/goal_table.py ANCHORS.jsonl SPEED_ROUNDS.jsonl

Goal per trace: the stitched configuration's footprint at or below min(1.05, the most compact
reference), and its ns per operation at most half the fastest reference's."""
import argparse
import json
import statistics
from collections import defaultdict

from speed_table import FLOOR, fastest_anchor, per_trace, read_rounds

# Runs before the `expandable` key was retired (issue 51) wrote expandable=true|false.
STITCHEDS = ("streamalloc:strategy=stream_safe,backing=stitched", "streamalloc:strategy=stream_safe,expandable=true")
# Chunks: named explicitly since stitched ranges became the default; runs 1-35 wrote the
# default's name.
CHUNKS = ("streamalloc:strategy=stream_safe,backing=chunks", "streamalloc:strategy=stream_safe,expandable=false",
          "streamalloc:strategy=stream_safe")


def main(anchors, rounds):
    footprint = defaultdict(dict)
    with open(anchors) as f:
        for line in f:
            r = json.loads(line)
            if "footprint_ratio" in r and r.get("threads", 1) == 1:
                footprint[r["trace"].removesuffix(".csv")][r["allocator"]] = r["footprint_ratio"]
    with open(rounds) as f:
        speed = per_trace(read_rounds(f))
    print("| trace | best reference footprint | stitched | footprint goal | fastest reference, "
          "best / median round (ns/op) | stitched best / median | ratio best / median | "
          "chunks best / median | ratio best / median |")
    print("|---|---|---|---|---|---|---|---|---|")
    met = defaultdict(int)
    n = 0
    for trace in sorted(footprint):
        stitched = next((c for c in STITCHEDS if c in footprint[trace]), STITCHEDS[0])
        if stitched not in footprint[trace] or not speed[trace].get(stitched):
            continue
        n += 1
        # The floor maps nothing (footprint 0): not a reference.
        refs = {k: v for k, v in footprint[trace].items() if not k.startswith("streamalloc") and k != FLOOR}
        name, best = min(refs.items(), key=lambda kv: kv[1])
        ours = footprint[trace][stitched]
        goal = ours <= min(1.05, best)
        met["footprint"] += goal
        _, fast_best = fastest_anchor({k: min(v) for k, v in speed[trace].items()})
        _, fast_median = fastest_anchor({k: statistics.median(v) for k, v in speed[trace].items()})
        row = [trace, f"{best:.4f} ({name})", f"{ours:.4f}", "yes" if goal else "no",
               f"{fast_best:.0f} / {fast_median:.0f}"]
        chunks = next((c for c in CHUNKS if speed[trace].get(c)), CHUNKS[0])
        for conf, key in ((stitched, "stitched"), (chunks, "chunks")):
            ns = speed[trace].get(conf) or [float("nan")]
            b, m = min(ns), statistics.median(ns)
            met[key + " best"] += b <= fast_best / 2
            met[key + " median"] += m <= fast_median / 2
            if key == "stitched":
                met["both best"] += goal and b <= fast_best / 2
                met["both median"] += goal and m <= fast_median / 2
            row += [f"{b:.0f} / {m:.0f}", f"{b / fast_best:.2f} / {m / fast_median:.2f}"]
        print("| " + " | ".join(row) + " |")
    print(f"\nfootprint goal {met['footprint']}/{n}; speed bar, best rounds: stitched "
          f"{met['stitched best']}/{n}, chunks {met['chunks best']}/{n}; median rounds: stitched "
          f"{met['stitched median']}/{n}, chunks {met['chunks median']}/{n}; stitched meets both: "
          f"best rounds {met['both best']}/{n}, median rounds {met['both median']}/{n}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("anchors", metavar="ANCHORS.jsonl")
    parser.add_argument("speed_rounds", metavar="SPEED_ROUNDS.jsonl")
    args = parser.parse_args()
    main(args.anchors, args.speed_rounds)
