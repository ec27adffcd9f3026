#!/usr/bin/env python3
"""Alternating phases in one process, as reinforcement-learning post-training runs them
(issue 36): a generation phase (a model's weights, tag "weights", and a KV cache, tag
"kv_cache") and a training step of another model (its parameters and optimizer state, tag
"trainer"), under streamalloc's torch backend.

    python3 lab/sleep_phases.py --out DIR [--quick] [--conf STREAMALLOC_CONF]
    python3 lab/sleep_phases.py --one MODE --result FILE [--quick] [--conf ...]   # one process

Modes, each in a process of its own, one after the other:

  resident      nothing sleeps: both phases' memory stays on the device throughout
  offload       the idle phase sleeps with its contents offloaded to pinned host memory
                (streamalloc.torch.sleep(tags, offload=True)) and wakes before its next turn
  discard_kv    as offload, but the KV cache sleeps without offload (its contents are not
                needed by the next generation phase; only the weights are copied out and back)

Each round: the generation phase (the tags woken first when they slept) runs its decoding
steps, writing the KV cache, and checks that its output for a fixed input is the one of the
first round (the weights came back intact); then its tags sleep; then the trainer (woken)
runs a step (forward, backward, AdamW) and sleeps. `torch.cuda.empty_cache()` ends each phase
in every mode, so that what the modes hold apart is what sleeps.

Figures per mode: the peak of the device's used memory as the driver reports it (NVML, sampled
every 2 ms from a thread, minus the process's baseline), the sleep and wake times of the
generation phase's tags (median of the rounds after the first, whose sleep also pins the host
memory), their bytes, and the host-device copy bandwidth measured in the same process
(1 GiB between a pinned tensor and the device, each way): a sleep's or wake's GB/s against it.
Prints one JSON line per mode, then a markdown table, written to DIR/sleep_phases.md (lines in
DIR/sleep_phases.jsonl, logs beside them). Exits 1 if a mode's process failed or a check
failed. The backend is built once first into STREAMALLOC_CACHE (default /tmp/streamalloc-cache).
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback

from torch_runs import NvmlSampler, child_env, prebuild_backend, run_child, tail, write_results

GIB = 1 << 30
HERE = os.path.abspath(__file__)
MODES = ("resident", "offload", "discard_kv")
TIMEOUT_S = 900
GEN_TAGS = ["weights", "kv_cache"]


def sizes(quick):
    """(generation weights, KV cache, trainer parameters) in bytes, and rounds."""
    if quick:
        return 2 * GIB, 4 * GIB, 1 * GIB, 3
    return 8 * GIB, 24 * GIB, 4 * GIB, 5


def bandwidth(torch, nbytes=GIB):
    """(host-to-device, device-to-host) GB/s of copies of NBYTES between a pinned tensor and
    the device, timed with CUDA events (best of three)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = []
    for copy in (lambda: dev.copy_(host, non_blocking=True), lambda: host.copy_(dev, non_blocking=True)):
        best = float("inf")
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        out.append(nbytes / best / 1e9)
    return tuple(out)


def timed(torch, f):
    """Seconds `f()` takes, the device synchronized before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    f()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def one(mode, quick, conf):
    """Runs MODE in this process; returns its figures."""
    import torch

    import streamalloc
    import streamalloc.torch as sat

    sat.enable(conf, backend="backend")
    torch.cuda.init()
    device = torch.cuda.current_device()
    sampler = NvmlSampler(device)
    gen_bytes, kv_bytes, train_bytes, rounds = sizes(quick)
    info = {"mode": mode, "conf": conf, "quick": quick, "rounds": rounds, "gen_weights_bytes": gen_bytes,
            "kv_bytes": kv_bytes, "trainer_param_bytes": train_bytes, "failures": []}
    h2d, d2h = bandwidth(torch)
    info.update(h2d_gbps=h2d, d2h_gbps=d2h)
    torch.cuda.empty_cache()
    sampler.start()
    torch.manual_seed(0)
    width = 8192
    layers = max(1, gen_bytes // (width * width * 2))
    with sat.tag("weights"):
        weights = [torch.randn(width, width, device="cuda", dtype=torch.bfloat16) / width**0.5 for _ in range(layers)]
    with sat.tag("kv_cache"):
        kv = torch.empty(kv_bytes // 2, device="cuda", dtype=torch.bfloat16).view(-1, width)
    hidden = 4096
    depth = max(1, train_bytes // (hidden * hidden * 4))
    with sat.tag("trainer"):
        trainer = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(depth)]).cuda()
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
    x0 = torch.randn(64, width, device="cuda", dtype=torch.bfloat16)
    first = None
    gen_sleep, gen_wake, slept = [], [], []

    def generate(steps=32):
        x = x0
        for step in range(steps):
            for w in weights:
                x = torch.tanh(x @ w)
            row = (step * x.shape[0]) % (kv.shape[0] - x.shape[0])
            kv[row:row + x.shape[0]].copy_(x)
        return x.float()

    def train_step():
        batch = torch.randn(1024, hidden, device="cuda")
        loss = trainer(batch).square().mean()
        loss.backward()
        with sat.tag("trainer"):  # the optimizer's state, made at its first step
            opt.step()
        opt.zero_grad(set_to_none=True)

    for r in range(rounds):
        if mode != "resident" and r > 0:
            gen_wake.append(timed(torch, lambda: sat.wake(GEN_TAGS)))
        out = generate()
        if first is None:
            first = out.clone()
        elif not torch.allclose(out, first, rtol=1e-2, atol=1e-2):
            info["failures"].append(f"round {r}: the generation's output changed (weights not restored)")
        del out
        torch.cuda.empty_cache()
        if mode == "offload":
            gen_sleep.append(timed(torch, lambda: sat.sleep(GEN_TAGS, offload=True)))
        elif mode == "discard_kv":
            gen_sleep.append(timed(torch, lambda: (sat.sleep(["weights"], offload=True), sat.sleep(["kv_cache"]))))
        if mode != "resident":
            slept.append(sum(streamalloc.tag_stats(t, device)["slept"] for t in GEN_TAGS))
            if r > 0:
                sat.wake(["trainer"])
        train_step()
        torch.cuda.empty_cache()
        if mode != "resident":
            sat.sleep(["trainer"], offload=True)
    torch.cuda.synchronize()
    sampler.stop()
    info["peak_used_bytes"] = sampler.peak - sampler.baseline if sampler.available else None
    info["nvml_error"] = sampler.error
    info["torch_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    if gen_sleep:
        warm = lambda xs: statistics.median(xs[1:]) if len(xs) > 1 else xs[0]  # noqa: E731
        info.update(slept_bytes=slept[-1], sleep_first_s=gen_sleep[0], sleep_s=warm(gen_sleep),
                    wake_s=statistics.median(gen_wake) if gen_wake else None)
    return info


def table(rows):
    head = ("| mode | peak used (driver) | torch peak reserved | slept | sleep (warm) | sleep s/GiB | sleep GB/s "
            "| wake | wake s/GiB | wake GB/s | D2H GB/s | H2D GB/s | first sleep |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    g = lambda b: "-" if b is None else f"{b / GIB:.2f} GiB"  # noqa: E731
    s = lambda t: "-" if t is None else f"{t:.3f} s"  # noqa: E731
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | failed: {r['error']} |" + " |" * 11)
            continue
        slept = r.get("slept_bytes")
        per = lambda t: "-" if not slept or t is None else f"{t / (slept / GIB):.3f}"  # noqa: E731
        rate = lambda t: "-" if not slept or not t else f"{slept / t / 1e9:.1f}"  # noqa: E731
        lines.append(
            f"| {r['mode']} | {g(r.get('peak_used_bytes'))} | {g(r.get('torch_peak_reserved_bytes'))} | {g(slept)} "
            f"| {s(r.get('sleep_s'))} | {per(r.get('sleep_s'))} | {rate(r.get('sleep_s'))} | {s(r.get('wake_s'))} "
            f"| {per(r.get('wake_s'))} | {rate(r.get('wake_s'))} | {r['d2h_gbps']:.1f} | {r['h2d_gbps']:.1f} "
            f"| {s(r.get('sleep_first_s'))} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="sleep-phases-out")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--conf", default="strategy=stream_safe")
    p.add_argument("--one", choices=MODES)
    p.add_argument("--result")
    args = p.parse_args()
    if args.one:
        try:
            result = one(args.one, args.quick, args.conf)
        except Exception:
            traceback.print_exc()
            sys.exit(2)
        with open(args.result, "w") as f:
            json.dump(result, f)
        sys.exit(1 if result["failures"] else 0)
    os.makedirs(args.out, exist_ok=True)
    env = child_env({"STREAMALLOC_TORCH_BACKEND": "backend"})
    problem = prebuild_backend(env, os.path.join(args.out, "build.log"), TIMEOUT_S)
    if problem:
        sys.exit(problem)
    rows, failed = [], False
    for mode in MODES:
        result_path = os.path.join(args.out, f"{mode}.json")
        log = os.path.join(args.out, f"{mode}.log")
        cmd = [sys.executable, HERE, "--one", mode, "--result", result_path, "--conf", args.conf]
        rc, secs = run_child(cmd + (["--quick"] if args.quick else []), env, log, TIMEOUT_S)
        try:
            with open(result_path) as f:
                row = json.load(f)
        except (OSError, ValueError):
            row = {"mode": mode, "error": f"exit {rc} after {secs:.0f} s: {tail(log)}"}
        failed |= rc != 0 or bool(row.get("failures"))
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_results(args.out, "sleep_phases", rows, table(rows))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
