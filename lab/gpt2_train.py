#!/usr/bin/env python3
"""GPT-2 small training, deterministic, under PyTorch's allocator or streamalloc.

Trains a randomly initialised GPT-2 small (transformers' GPT2Config(), fixed seed, nothing
downloaded) for a few steps on random tokens with AdamW, with deterministic algorithms, and
prints per-step losses as exact hex floats, step times and device memory in use.

    python3 lab/gpt2_train.py --allocator native
    python3 lab/gpt2_train.py --allocator streamalloc:strategy=stream_safe --json out.json

`streamalloc:<conf>` routes every CUDA allocation through libstreamalloc.so
(`streamalloc.torch.enable(conf)`); the `streamalloc` package must be importable (installed
from the wheel scripts/build-python.sh builds, or python/ on PYTHONPATH with the library
copied in).

Device memory: torch.cuda.max_memory_reserved means nothing under a pluggable allocator, so
this samples the device's used memory (total - free, as the driver reports it; every process
on the GPU counts) with torch.cuda.mem_get_info after the forward pass, the backward pass and
the optimizer step of every step, and, when pynvml is installed, with NVML every 2 ms from a
thread. `peak_used` is the largest sample; `baseline_used` is the device's use after CUDA
initialisation and before the model exists.
"""

import argparse
import json
import os
import time
import warnings

# cuBLAS needs this before it initialises to be deterministic.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from torch_runs import NvmlSampler  # noqa: E402

torch = None  # imported by main(): --help answers without torch

MIB = 1 << 20


def device_used():
    free, total = torch.cuda.mem_get_info()
    return total - free


def main():
    global torch
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--allocator", default="native", help="native | streamalloc:<conf>")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", help="also write the results as JSON to this file")
    args = p.parse_args()
    import torch


    if args.allocator.startswith("streamalloc:"):
        import streamalloc
        import streamalloc.torch

        streamalloc.torch.enable(args.allocator[len("streamalloc:"):])
    elif args.allocator != "native":
        p.error(f"--allocator {args.allocator}: expected native or streamalloc:<conf>")

    from transformers import AutoModelForCausalLM, GPT2Config

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(args.seed)
    torch.cuda.init()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    baseline = device_used()
    sampler = NvmlSampler(device.index)
    sampler.start()

    # Every nondeterministic op that has no deterministic version is caught and reported (a
    # loss mismatch between allocators would then not be the allocator's fault).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = GPT2Config()
        # Eager attention: plain matmuls and softmax, deterministic under the settings above.
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        model = model.to(device)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
        tokens = torch.randint(0, config.vocab_size, (args.steps, args.batch, args.seq),
                               generator=torch.Generator().manual_seed(args.seed + 1))

        losses, step_ms, peak = [], [], 0
        for step in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            batch = tokens[step].to(device, non_blocking=False)
            loss = model(input_ids=batch, labels=batch).loss
            peak = max(peak, device_used())
            loss.backward()
            peak = max(peak, device_used())
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            peak = max(peak, device_used())
            value = loss.item()
            losses.append(value.hex())
            step_ms.append(ms)
            print(f"step {step:2d} loss {value.hex()} ({value:.6f}) {ms:8.2f} ms "
                  f"used {device_used() / MIB:9.1f} MiB", flush=True)
    sampler.stop()
    peak = max(peak, sampler.peak)
    nondeterministic = sorted({str(w.message).splitlines()[0] for w in caught
                               if "deterministic" in str(w.message)})
    for w in nondeterministic:
        print(f"nondeterministic op: {w}")

    result = {
        "allocator": args.allocator,
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "seed": args.seed,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device),
        "losses_hex": losses,
        "step_ms": step_ms,
        # The first steps include warm-up (allocator growth, cuBLAS handles): report the median
        # of the rest.
        "median_step_ms": sorted(step_ms[2:] or step_ms)[len(step_ms[2:] or step_ms) // 2],
        "baseline_used": baseline,
        "peak_used": peak,
        "peak_used_over_baseline": peak - baseline,
        "nvml_sampled": sampler.available,
        "nondeterministic_ops": nondeterministic,
    }
    if args.allocator.startswith("streamalloc:"):
        import streamalloc

        result["streamalloc_stats"] = streamalloc.stats(device.index)
    else:
        result["torch_max_memory_reserved"] = torch.cuda.max_memory_reserved(device)
    print(f"median step {result['median_step_ms']:.2f} ms, peak device used {peak / MIB:.1f} MiB "
          f"({(peak - baseline) / MIB:.1f} MiB over the baseline)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
