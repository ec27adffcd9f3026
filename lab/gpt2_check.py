#!/usr/bin/env python3
"""Compares gpt2_train.py results: the losses of every run must equal the first run's
(the reference, normally native) bit for bit. Prints a markdown table; exits 1 on any
mismatch or missing run.

    python3 lab/gpt2_check.py native.json plain.json stream_safe.json ...
"""

import argparse
import json
import sys

MIB = 1 << 20


def main(paths):
    runs, missing = [], []
    for path in paths:
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, ValueError) as e:
            missing.append(f"{path}: {e}")
    if not runs:
        print("no results")
        return 1
    ref = runs[0]
    print(f"GPT-2 small, {ref['steps']} steps, batch {ref['batch']} x {ref['seq']}, seed {ref['seed']}, "
          f"torch {ref['torch']}, {ref['gpu']}; reference: {ref['allocator']}\n")
    print("| allocator | losses equal to reference | median step ms | peak device used MiB "
          "| over baseline MiB | final loss |")
    print("| --- | --- | --- | --- | --- | --- |")
    ok = not missing
    for r in runs:
        same = r["losses_hex"] == ref["losses_hex"]
        if not same:
            ok = False
            first = next((i for i, (a, b) in enumerate(zip(r["losses_hex"], ref["losses_hex"])) if a != b),
                         min(len(r["losses_hex"]), len(ref["losses_hex"])))
            verdict = f"NO (first differs at step {first})"
        else:
            verdict = "yes (bitwise)"
        final = float.fromhex(r["losses_hex"][-1]) if r["losses_hex"] else float("nan")
        print(f"| {r['allocator']} | {verdict} | {r['median_step_ms']:.2f} | {r['peak_used'] / MIB:.0f} "
              f"| {r['peak_used_over_baseline'] / MIB:.0f} | {final:.6f} |")
    for r in runs:
        for op in r.get("nondeterministic_ops", []):
            print(f"\nwarning: {r['allocator']}: nondeterministic op: {op}")
    for m in missing:
        print(f"\nmissing run: {m}")
    print("\nALL LOSSES BITWISE EQUAL" if ok else "\nMISMATCH OR MISSING RUN")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", metavar="RESULT.json", help="the reference run first")
    sys.exit(main(parser.parse_args().results))
