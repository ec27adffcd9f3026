#!/usr/bin/env python3
"""Real PyTorch training loops under torch's allocators and streamalloc's, step times with
their spread across processes (several interleaved processes per allocator: see DESIGN.md,
Note [step times under cudnn.benchmark]).

    python3 lab/torch_loops.py --out DIR [--quick] [--rounds N] [--loops L,..] [--allocators A,..]
    python3 lab/torch_loops.py --one LOOPS ALLOCATOR --result FILE [--quick]   # one process

Loops (each logs torch.cuda.max_memory_allocated() after every step):

  resnet    torchvision ResNet-50 training (SGD with momentum, batch 32 of random 224x224
            images and labels, fp32), fixed shapes, torch.backends.cudnn.benchmark = True
  amp_cnn   torchvision EfficientNet-B0 training under mixed precision (torch.autocast
            float16, GradScaler; SGD; batch 64 of 224x224), cudnn.benchmark = True
  compiled  a causal transformer LM (4 pre-norm blocks, d=512, 8 heads, vocabulary 8192, batch
            16 x 256 tokens) with its loss under torch.compile(mode="reduce-overhead") (CUDA
            graph trees) and an AdamW step; compile time is in the warm-up steps
  varying   a causal transformer LM (nn.TransformerEncoder, 4 layers, d=512, 8 heads,
            vocabulary 8192, AdamW) whose batch (4-32) and sequence length (16-512) change
            every step, drawn from random.Random(seed): the same shapes in every run

Allocators, each in processes of its own (the allocator is fixed per process; a process runs
every loop, one after another from an emptied cache, or one loop with --apart):

  native      torch's caching allocator
  expandable  the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  pluggable   streamalloc through torch's CUDAPluggableAllocator, the fallback
              (STREAMALLOC_TORCH_BACKEND=pluggable, streamalloc.torch.enable())
  backend     streamalloc's torch backend (STREAMALLOC_TORCH_BACKEND=backend: enable()
              installs it or fails, never a silent fallback)
  backend_chunks  the same over chunks of plain device allocations (STREAMALLOC_CONF=
              backing=chunks) instead of mapped ranges: whether a gap is the mapping's

With cudnn.benchmark every process times cudnn's algorithms anew and may pick others, so one
process per allocator says little: --rounds N (default 5) runs N processes of each (loop,
allocator), interleaved (round 1: every allocator once, round 2: again, ...), and each
process records which kernels one step after the timed ones launches (torch.profiler: the
names and counts of its CUDA kernels, hashed), so rows are compared over processes that ran
the same algorithms; the same profile gives each operator's own host time (`host_ops` in
the JSON lines; the log line shows aten::empty and aten::empty_strided per call, which hold
the allocator's call). streamalloc's configuration is the default unless STREAMALLOC_CONF is
set.

For each (loop, allocator), printed as a markdown table and written to DIR/torch_loops.md:

* step ms: the median over processes of each process's median step (over --steps timed
  steps, default 30, after --warmup warm-up steps, default 10; a step is timed from a
  synchronize to a synchronize), with the range over processes;
* host ms: the median over processes of the host's part of a step (from its start until its
  last launch returned, before the synchronize): near the step's whole, the loop is bound by
  the host, allocator calls included;
* vs fastest torch: that median over the fastest of native's and expandable's;
* beyond native's spread: "slower" when every process of the row is slower than every native
  process, "faster" when faster than every one, else "within";
* pairs slower: in how many rounds the row's process was slower than native's of the same round;
* kernel sets: how many distinct kernel fingerprints the row's processes had, and the
  comparison over processes whose fingerprint native's processes share, where any do;
* peak device MiB (driver): device memory in use as the driver reports it beyond the
  process's baseline (cudaMemGetInfo after each forward, backward and step, and NVML every 2
  ms when pynvml is importable), warm-up included, median over processes;
* max_memory_allocated MiB (torch), or "refused" when torch raised (under the pluggable
  fallback);
* losses equal native: every step's loss against the first native process's, bitwise, in
  how many processes (seeds fixed, deterministic algorithms where torch has them; with
  cudnn.benchmark another algorithm may give other bits).

A loop that torch refuses under an allocator shows "refused" and the error in the notes; that
is a result, not a crash. Each run writes its log to DIR/torch_loops-logs/LOOPS-ALLOCATOR-rN.log
and its results as JSON lines to DIR/torch_loops.jsonl. Exits 1 if a run of native,
expandable or backend did not complete.

--quick: small models, 3 warm-up and 5 timed steps, 2 rounds (a smoke run).
--device cpu: a smoke test of this script's own logic on a machine without a GPU (tiny
models, no allocator applied, no memory figures): its numbers mean nothing.
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
import traceback

from torch_runs import (NvmlSampler, allocator_env, apply_env, child_env, enable_streamalloc, finish_run,
                        prebuild_backend, run_child, tail)

MIB = 1 << 20
HERE = os.path.abspath(__file__)

LOOPS = ("resnet", "amp_cnn", "compiled", "varying")
ALLOCATORS = ("native", "expandable", "pluggable", "backend", "backend_chunks")
MUST_COMPLETE = ("native", "expandable", "backend", "backend_chunks")
"""Allocators whose runs must complete: the pluggable fallback is expected to be refused."""

ENV = {
    "native": allocator_env(),
    "expandable": allocator_env("expandable_segments:True"),
    "pluggable": allocator_env(backend="pluggable"),
    "backend": allocator_env(backend="backend"),
    "backend_chunks": {**allocator_env(backend="backend"), "STREAMALLOC_CONF": "backing=chunks"},
}
"""The environment of each allocator's process (None: removed)."""

SIZES = {
    # loop: (full, quick) parameters
    "resnet": ({"arch": "resnet50", "batch": 32, "image": 224}, {"arch": "resnet18", "batch": 8, "image": 64}),
    "amp_cnn": ({"arch": "efficientnet_b0", "batch": 64, "image": 224},
                {"arch": "efficientnet_b0", "batch": 4, "image": 64}),
    "compiled": ({"dim": 512, "heads": 8, "blocks": 4, "vocab": 8192, "batch": 16, "tokens": 256},
                 {"dim": 64, "heads": 4, "blocks": 1, "vocab": 256, "batch": 4, "tokens": 16}),
    "varying": ({"dim": 512, "heads": 8, "layers": 4, "ff": 2048, "vocab": 8192, "batch": (4, 32), "seq": (16, 512)},
                {"dim": 64, "heads": 4, "layers": 1, "ff": 128, "vocab": 512, "batch": (2, 8), "seq": (8, 64)}),
}


# ---------------------------------------------------------------------------------------------
# One run (child process)
# ---------------------------------------------------------------------------------------------

def setup_allocator(allocator, device_kind):
    """Imports torch with ALLOCATOR current (before any CUDA allocation); returns (torch, info)."""
    apply_env(os.environ, ENV[allocator])  # the parent set these; a hand-run --one too
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS initialises
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "STREAMALLOC_CONF": os.environ.get("STREAMALLOC_CONF")}
    if device_kind == "cpu":
        info["note"] = "cpu dry run: no allocator applied"
        return torch, info
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available to torch (use --device cpu for a dry run of the script)")
    if allocator in ("pluggable", "backend", "backend_chunks"):
        enable_streamalloc(allocator.split("_")[0], info)
    torch.cuda.init()
    info["allocator_backend"] = torch.cuda.get_allocator_backend()
    info["gpu"] = torch.cuda.get_device_name()
    return torch, info


def build_resnet(torch, dev, p, seed, steps):
    import torchvision

    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = True  # benchmark still runs, over deterministic algorithms
    torch.manual_seed(seed)
    model = getattr(torchvision.models, p["arch"])(num_classes=1000).to(dev)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    b, hw = p["batch"], p["image"]

    def step(i, sample):
        x = torch.randn(b, 3, hw, hw, device=dev, generator=gen)
        y = torch.randint(0, 1000, (b,), device=dev, generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        sample()
        loss.backward()
        sample()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def build_amp_cnn(torch, dev, p, seed, steps):
    import torchvision

    torch.backends.cudnn.benchmark = True
    torch.manual_seed(seed)
    model = getattr(torchvision.models, p["arch"])(num_classes=1000).to(dev)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    cuda = dev.type == "cuda"
    scaler = torch.amp.GradScaler("cuda", enabled=cuda)
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    b, hw = p["batch"], p["image"]

    def step(i, sample):
        x = torch.randn(b, 3, hw, hw, device=dev, generator=gen)
        y = torch.randint(0, 1000, (b,), device=dev, generator=gen)
        with torch.autocast(dev.type, dtype=torch.float16 if cuda else torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        sample()
        scaler.scale(loss).backward()
        sample()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach().float()

    return step


def build_compiled(torch, dev, p, seed, steps):
    nn, F = torch.nn, torch.nn.functional
    d, heads, vocab, t = p["dim"], p["heads"], p["vocab"], p["tokens"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(t, d)
            self.blocks = nn.Sequential(*[Block() for _ in range(p["blocks"])], nn.LayerNorm(d))
            self.head = nn.Linear(d, vocab)

        def forward(self, tokens, targets):
            x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
            logits = self.head(self.blocks(x))
            return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

    torch.manual_seed(seed)
    model = LM().to(dev)
    model.train()
    compiled = torch.compile(model, mode="reduce-overhead")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    cuda = dev.type == "cuda"

    def step(i, sample):
        if cuda:
            torch.compiler.cudagraph_mark_step_begin()
        tokens = torch.randint(0, vocab, (p["batch"], t + 1), device=dev, generator=gen)
        loss = compiled(tokens[:, :-1], tokens[:, 1:])
        sample()
        loss.backward()
        sample()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def varying_shapes(p, seed, n):
    """The (batch, sequence length) of each step: the same in every run."""
    rng = random.Random(seed + 2)
    return [(rng.randint(*p["batch"]), rng.randint(*p["seq"])) for _ in range(n)]


def build_varying(torch, dev, p, seed, steps):
    nn, F = torch.nn, torch.nn.functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    d, vocab, max_seq = p["dim"], p["vocab"], p["seq"][1]

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_seq, d)
            layer = nn.TransformerEncoderLayer(d, p["heads"], p["ff"], dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, p["layers"], enable_nested_tensor=False)
            self.head = nn.Linear(d, vocab)

        def forward(self, tokens):
            t = tokens.shape[1]
            x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
            mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
            return self.head(self.enc(x, mask=mask, is_causal=True))

    torch.manual_seed(seed)
    model = LM().to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    shapes = varying_shapes(p, seed, steps)

    def step(i, sample):
        b, t = shapes[i]
        tokens = torch.randint(0, vocab, (b, t + 1), device=dev, generator=gen)
        with sdpa_kernel(SDPBackend.MATH):  # deterministic attention, forward and backward
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            sample()
            loss.backward()
        sample()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


BUILDERS = {"resnet": build_resnet, "amp_cnn": build_amp_cnn, "compiled": build_compiled,
            "varying": build_varying}


def short(e):
    """An exception's type and first line (torch's messages run long)."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


def kernel_fingerprint(torch, step, i, sample):
    """What one more step (the last one again: the same shapes) does on the device, from torch.profiler: {"kernels": {name: count},
    "kernel_fp": a hash of them (processes with the same hash ran the same algorithms),
    "api_calls": {CUDA runtime or driver function: [calls, total us]}} (the allocator's device
    calls, cuMemMap and the like, among them), and "host_ops": {operator: [calls, self CPU us]}
    for the 12 operators with the most host time of their own and for the tensor-making ones
    (aten::empty and aten::empty_strided, whose own time holds the allocator's call: compare it
    per call across allocators; the profiler's overhead is the same under each)."""
    import hashlib

    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(i, sample)
            torch.cuda.synchronize()
        kernels, api, ops = {}, {}, {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name] = kernels.get(event.name, 0) + 1
            elif event.name.startswith("cu") and not event.name.startswith("cudnn"):
                calls = api.setdefault(event.name, [0, 0.0])
                calls[0] += 1
                calls[1] += round(event.cpu_time_total, 1)
            else:
                calls = ops.setdefault(event.name, [0, 0.0])
                calls[0] += 1
                calls[1] += event.self_cpu_time_total
    except Exception as e:  # the figure is lost, not the run
        return {"kernel_fp": None, "kernel_fp_error": short(e)}
    top = sorted(ops, key=lambda name: -ops[name][1])[:12]
    host_ops = {name: [ops[name][0], round(ops[name][1], 1)]
                for name in top + [n for n in ("aten::empty", "aten::empty_strided") if n in ops]}
    text = "\n".join(f"{name} {count}" for name, count in sorted(kernels.items()))
    return {"kernels": kernels, "kernel_fp": hashlib.sha1(text.encode()).hexdigest()[:10], "api_calls": api,
            "host_ops": host_ops}


SETUP = {}
"""This process's torch and its allocator's description, set up by its first run."""


def one_run(loop, allocator, args):
    """Runs LOOP under ALLOCATOR in this process; returns the result (never raises). A process
    may run several loops one after another (`--one L1,L2 ALLOCATOR`): each starts from an
    emptied cache (`forget`)."""
    import warnings

    started = time.perf_counter()
    params = SIZES[loop][1 if args.quick or args.device == "cpu" else 0]
    r = {"loop": loop, "allocator": allocator, "params": {k: list(v) if isinstance(v, tuple) else v
                                                          for k, v in params.items()},
         "warmup": args.warmup, "steps": args.steps, "seed": args.seed, "device": args.device,
         "completed": False, "error": None, "error_step": None}
    total = args.warmup + args.steps
    if loop == "varying":
        r["shapes"] = varying_shapes(params, args.seed, total)
    try:
        if "torch" not in SETUP:  # once per process: the allocator is fixed at the first CUDA allocation
            SETUP["torch"], SETUP["info"] = setup_allocator(allocator, args.device)
        torch, info = SETUP["torch"], SETUP["info"]
    except Exception as e:
        r.update(error=short(e), error_phase="setup", traceback=traceback.format_exc()[-3000:])
        return r
    r.update(info)
    cuda = args.device == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:  # deterministic mode fills new tensors with NaN by default: not the workload measured
        torch.utils.deterministic.fill_uninitialized_memory = False
    except AttributeError:
        pass

    def used():
        free, total_bytes = torch.cuda.mem_get_info(dev)
        return total_bytes - free

    if cuda:
        torch.cuda.synchronize(dev)
        baseline = used()
        sampler = NvmlSampler(dev.index) if args.nvml else None
    else:
        baseline, sampler = None, None
    peak = {"all": baseline or 0, "timed": baseline or 0}
    timed = [False]

    def sample():
        if cuda:
            u = used()
            peak["all"] = max(peak["all"], u)
            if timed[0]:
                peak["timed"] = max(peak["timed"], u)

    step_ms, host_ms, losses, used_after, mma, mma_error = [], [], [], [], [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            step = BUILDERS[loop](torch, dev, params, args.seed, total)
        except Exception as e:
            r.update(error=short(e), error_phase="build", traceback=traceback.format_exc()[-3000:])
            step = None
        if sampler is not None:
            sampler.start()
        allocations, library = {}, {}
        for i in range(total if step else 0):
            timed[0] = i >= args.warmup
            if cuda and i in (args.warmup, total - 1) and mma_error is None:
                try:  # torch's count of its allocations: how many a step makes
                    allocations[i] = torch.cuda.memory_stats(dev).get("allocation.all.allocated")
                except Exception:
                    pass
            if cuda and allocator.startswith("backend") and i in (args.warmup, total - 1):
                import streamalloc  # the library's own count of its device calls

                library[i] = streamalloc.stats(dev.index)
            try:
                if cuda:
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                loss = step(i, sample)
                host_ms.append((time.perf_counter() - t0) * 1e3)
                if cuda:
                    torch.cuda.synchronize(dev)
                ms = (time.perf_counter() - t0) * 1e3
                value = loss.item()
            except Exception as e:
                r.update(error=short(e), error_phase="step", error_step=i,
                         traceback=traceback.format_exc()[-3000:])
                break
            sample()
            step_ms.append(ms)
            losses.append(float(value).hex())
            if cuda:
                used_after.append(used())
                if mma_error is None:
                    try:
                        mma.append(torch.cuda.max_memory_allocated(dev))
                    except Exception as e:  # refused under the pluggable fallback
                        mma_error = short(e)
            if args.verbose or i in (0, args.warmup - 1, total - 1):
                print(f"step {i:3d} loss {value:.6f} {ms:9.2f} ms"
                      + (f" used {(used_after[-1] - baseline) / MIB:9.1f} MiB over baseline" if cuda else ""),
                      flush=True)
        if sampler is not None:
            sampler.stop()
        if cuda and step is not None and r["error"] is None and len(step_ms) == total:
            r.update(kernel_fingerprint(torch, step, total - 1, sample))
        if cuda and not mma and mma_error is None:  # the loop stopped before its first step ended
            try:
                mma.append(torch.cuda.max_memory_allocated(dev))
            except Exception as e:
                mma_error = short(e)
    messages = sorted({str(w.message).splitlines()[0][:300] for w in caught})
    for m in messages:
        print(f"warning: {m}", file=sys.stderr)
    r["nondeterministic_ops"] = [m for m in messages if "determinis" in m]
    r["completed"] = r["error"] is None and len(step_ms) == total
    if len(allocations) == 2 and None not in allocations.values() and total - 1 > args.warmup:
        r["allocations_per_step"] = (allocations[total - 1] - allocations[args.warmup]) / (total - 1 - args.warmup)
    if len(library) == 2 and total - 1 > args.warmup:
        before, after = library[args.warmup], library[total - 1]
        r["device_calls_per_step"] = {key: (after[key] - before[key]) / (total - 1 - args.warmup)
                                      for key in ("device_allocs", "device_frees") if key in after}
    timed_ms = step_ms[args.warmup:]
    r.update(step_ms=step_ms, losses_hex=losses, steps_done=len(step_ms),
             median_step_ms=statistics.median(timed_ms) if r["completed"] and timed_ms else None,
             # The host's part: from the step's start until its last launch returned (a step
             # whose host part nears its whole is bound by the host, allocator calls included).
             median_host_ms=statistics.median(host_ms[args.warmup:]) if r["completed"] and timed_ms else None,
             warmup_ms_total=sum(step_ms[:args.warmup]))
    if cuda:
        r.update(baseline_used=baseline, used_after_step=used_after,
                 peak_used_meminfo=peak["all"], peak_used_meminfo_timed=peak["timed"],
                 max_memory_allocated=mma or None, max_memory_allocated_error=mma_error)
        over = [peak["all"] - baseline]
        if sampler is not None and sampler.available:
            r.update(nvml_baseline=sampler.baseline, nvml_peak=sampler.peak)
            over.append(sampler.peak - sampler.baseline)
        elif sampler is not None:
            r["nvml_error"] = sampler.error
        r["peak_over_baseline"] = max(over)
        if not mma_error:
            try:
                r["max_memory_reserved"] = torch.cuda.max_memory_reserved(dev)
            except Exception as e:
                r["max_memory_reserved_error"] = short(e)
        if loop == "compiled":
            try:
                from torch._inductor import cudagraph_trees

                manager = cudagraph_trees.get_container(dev.index).tree_manager
                r["cudagraphs"] = manager is not None and len(list(manager.get_roots())) > 0
            except Exception as e:
                r["cudagraphs"] = f"unknown ({short(e)})"
    r["wall_s"] = time.perf_counter() - started
    return r


# ---------------------------------------------------------------------------------------------
# The driver (parent process)
# ---------------------------------------------------------------------------------------------

def forget(torch):
    """Frees what the previous loop of this process left: its objects, compiled graphs and their
    CUDA graph pools, and the allocator's cache."""
    import gc

    try:
        torch._dynamo.reset()
    except Exception:
        pass
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # max_memory_allocated is the next loop's own


def child_env_of(allocator):
    """The environment of ALLOCATOR's child (cuBLAS made deterministic before it starts)."""
    return child_env(ENV[allocator], CUBLAS_WORKSPACE_CONFIG=":4096:8")


def mib(v):
    return "—" if v is None else f"{v / MIB:,.0f}"


def losses_equal(run, reference):
    """Whether RUN's losses equal REFERENCE's bitwise (None when either has none)."""
    mine, ref = run.get("losses_hex") or [], (reference or {}).get("losses_hex") or []
    if not mine or not ref or run is reference:
        return None
    return mine == ref


def row_cells(loop, allocator, runs, fastest, natives):
    """The table's cells for one (loop, allocator) over its processes."""
    done = [r for r in runs if r["completed"]]
    refusal = "refused" if allocator == "pluggable" else "ERROR"
    if not done:
        return [loop, allocator, f"{refusal} ({len(runs)} of {len(runs)})"] + ["—"] * 8
    medians = [r["median_step_ms"] for r in done]
    mid = statistics.median(medians)
    step = f"{mid:.2f} ({min(medians):.2f}-{max(medians):.2f}, {len(done)}" + \
        (f" of {len(runs)})" if len(done) < len(runs) else ")")
    ratio = f"{mid / fastest:.3f}" if fastest else "—"
    native_done = [r for r in natives if r["completed"]]
    if allocator == "native" or not native_done:
        spread = pairs = "—"
    else:
        lo, hi = min(r["median_step_ms"] for r in native_done), max(r["median_step_ms"] for r in native_done)
        spread = "slower" if min(medians) > hi else "faster" if max(medians) < lo else "within"
        by_round = {r["round"]: r["median_step_ms"] for r in native_done}
        paired = [(r["median_step_ms"], by_round[r["round"]]) for r in done if r["round"] in by_round]
        pairs = f"{sum(a > b for a, b in paired)} of {len(paired)}"
    fps = [r.get("kernel_fp") for r in done]
    native_fps = {r.get("kernel_fp") for r in native_done} - {None}
    shared = [r["median_step_ms"] for r in done if r.get("kernel_fp") in native_fps]
    kernels = f"{len(set(fps) - {None})}"
    if allocator != "native" and native_fps:
        same_native = [r["median_step_ms"] for r in native_done if r.get("kernel_fp") in set(fps)]
        kernels += (f"; {len(shared)} share native's: {statistics.median(shared):.2f} vs native "
                    f"{statistics.median(same_native):.2f}" if shared else "; none shares native's")
    peak = statistics.median([r["peak_over_baseline"] for r in done if r.get("peak_over_baseline") is not None]
                             or [None]) if any(r.get("peak_over_baseline") for r in done) else None
    if any(r.get("max_memory_allocated_error") for r in done):
        mma = "refused"
    else:
        values = [r["max_memory_allocated"][-1] for r in done if r.get("max_memory_allocated")]
        mma = mib(statistics.median(values)) if values else "—"
    reference = next((r for r in natives if r.get("losses_hex")), None)
    equal = [losses_equal(r, reference) for r in done]
    compared = [e for e in equal if e is not None]
    losses = "(reference)" if allocator == "native" and not compared else \
        (f"{sum(compared)} of {len(compared)}" if compared else "—")
    host = f"{statistics.median(r['median_host_ms'] for r in done):.2f}" if all(r.get("median_host_ms") is not None
                                                                            for r in done) else "—"
    return [loop, allocator, step, host, ratio, spread, pairs, kernels, mib(peak), mma, losses]


def table(runs, args, header):
    out = [header, "",
           "| loop | allocator | step ms: median (range, processes) | host ms | vs fastest torch | beyond native's spread "
           "| pairs slower than native | kernel sets | peak device MiB (driver) | max_memory_allocated MiB (torch) "
           "| losses equal native's |",
           "| --- | --- | --- | ---: | ---: | --- | --- | --- | ---: | ---: | --- |"]
    notes = []
    for loop in dict.fromkeys(r["loop"] for r in runs):
        of_loop = [r for r in runs if r["loop"] == loop]
        natives = [r for r in of_loop if r["allocator"] == "native"]
        torch_rows = [statistics.median(r["median_step_ms"] for r in of_loop if r["allocator"] == a and r["completed"])
                      for a in ("native", "expandable")
                      if any(r["allocator"] == a and r["completed"] for r in of_loop)]
        fastest = min(torch_rows) if torch_rows else None
        for allocator in dict.fromkeys(r["allocator"] for r in of_loop):
            mine = [r for r in of_loop if r["allocator"] == allocator]
            out.append("| " + " | ".join(row_cells(loop, allocator, mine, fastest, natives)) + " |")
            for run in mine:
                if run.get("error"):
                    where = f" at step {run['error_step']}" if run.get("error_step") is not None else \
                        f" in {run.get('error_phase', 'the run')}"
                    kind = "refused" if allocator == "pluggable" else "ERROR"
                    notes.append(f"- {loop}/{allocator} round {run['round']}: {kind}{where}: {run['error']}")
                if run.get("max_memory_allocated_error") and run["round"] == 1:
                    notes.append(f"- {loop}/{allocator}: torch.cuda.max_memory_allocated() raised: "
                                 f"{run['max_memory_allocated_error']}")
                if loop == "compiled" and run.get("cudagraphs") is False and run["completed"]:
                    notes.append(f"- compiled/{allocator} round {run['round']}: no CUDA graphs were used")
    out += ["", f"Each process: the median of {args.steps} timed steps after {args.warmup} warm-up steps; "
            f"{args.rounds} rounds, allocators interleaved within each round. Peak device memory beyond the "
            "process's baseline (cudaMemGetInfo after each forward, backward and step"
            + (", NVML every 2 ms" if any(r.get("nvml_peak") for r in runs) else ", no NVML")
            + "; warm-up included)."]
    warm = [f"{r['allocator']} {r['warmup_ms_total'] / 1e3:.1f} s" for r in runs
            if r["loop"] == "compiled" and r["round"] == 1 and r.get("warmup_ms_total") is not None and r.get("steps_done")]
    if warm:
        out.append(f"compiled, round 1: the warm-up steps (compilation, CUDA graph recording) took {', '.join(warm)}.")
    if notes:
        out += ["", "Notes:", *notes]
    return "\n".join(out)


def report(run, n, secs):
    """One line for a finished run."""
    allocator, median = run["allocator"], run.get("median_step_ms")
    state = ("ok" if run["completed"] else
             ("refused" if allocator == "pluggable" else "FAILED") + f": {run.get('error')}")
    api = sorted((run.get("api_calls") or {}).items(), key=lambda kv: -kv[1][1])[:4]
    print(f"{run['loop']:>9} / {allocator:<10} r{n} {run.get('wall_s', secs):6.1f} s  "
          + (f"median {median:8.2f} ms (host {run['median_host_ms']:.2f})  " if median is not None else "")
          + (f"kernels {run.get('kernel_fp')}  " if run.get("kernel_fp") else "")
          + (f"{run['allocations_per_step']:.0f} allocations/step  " if run.get("allocations_per_step") else "")
          + (f"device calls/step {run['device_calls_per_step']}  " if run.get("device_calls_per_step") else "")
          + (f"api {api}  " if api else "")
          + "".join(f"{name} {us / calls:.1f} us/call  " for name, (calls, us) in (run.get("host_ops") or {}).items()
                    if name in ("aten::empty", "aten::empty_strided") and calls)
          + (f"peak {mib(run.get('peak_over_baseline'))} MiB  " if run.get("peak_over_baseline") else "")
          + state, flush=True)


def drive(args):
    os.makedirs(args.out, exist_ok=True)
    logs = os.path.join(args.out, "torch_loops-logs")
    os.makedirs(logs, exist_ok=True)
    jsonl_path = os.path.join(args.out, "torch_loops.jsonl")
    md_path = os.path.join(args.out, "torch_loops.md")
    loops = args.loops.split(",")
    allocators = args.allocators.split(",")
    build_problem = None
    if args.device == "cuda" and any(a.startswith("backend") for a in allocators):
        build_problem = prebuild_backend(child_env_of("backend"), os.path.join(logs, "backend-build.log"),
                                         args.build_timeout)
    # Each process runs one loop (--apart) or every loop, one after another (the default: a
    # process's start, torch's import and CUDA's initialisation paid once).
    groups = [[loop] for loop in loops] if args.apart else [loops]
    runs = []
    with open(jsonl_path, "w") as jsonl:
        for group in groups:
            for n in range(args.first_round, args.first_round + args.rounds):
                for allocator in allocators:
                    name = f"{'+'.join(group)}-{allocator}-r{n}"
                    result_path = os.path.join(logs, f"{name}.json")
                    log_path = os.path.join(logs, f"{name}.log")
                    if os.path.exists(result_path):
                        os.remove(result_path)
                    cmd = [sys.executable, HERE, "--one", ",".join(group), allocator, "--result", result_path,
                           "--warmup", str(args.warmup), "--steps", str(args.steps), "--seed", str(args.seed),
                           "--device", args.device] + (["--quick"] if args.quick else []) + \
                          ([] if args.nvml else ["--no-nvml"])
                    rc, secs = run_child(cmd, child_env_of(allocator), log_path, args.timeout * len(group))
                    try:
                        with open(result_path) as f:
                            done = json.load(f)["runs"]
                    except (OSError, ValueError, KeyError):
                        done = []
                    for loop in group:
                        run = next((r for r in done if r["loop"] == loop), None)
                        if run is None:
                            why = (f"timed out after {args.timeout * len(group)} s" if rc is None
                                   else f"exited {rc} without a result")
                            run = {"loop": loop, "allocator": allocator, "completed": False,
                                   "error": f"{why}: {tail(log_path)}", "error_phase": "process", "error_step": None}
                            if allocator.startswith("backend") and build_problem:
                                run["error"] += f" [{build_problem}]"
                        run["process_s"], run["round"] = secs, n
                        if n > 1:
                            run.pop("kernels", None)  # the names once per row are enough
                        runs.append(run)
                        jsonl.write(json.dumps(run) + "\n")
                        jsonl.flush()
                        report(run, n, secs)
    first = next((r for r in runs if r.get("torch")), {})
    header = (f"## Training loops under each allocator ({'quick' if args.quick else 'full'} run"
              f"{', CPU DRY RUN: figures meaningless' if args.device == 'cpu' else ''})\n\n"
              f"torch {first.get('torch', '?')} (CUDA {first.get('cuda', '?')}), {first.get('gpu', args.device)}, "
              f"STREAMALLOC_CONF={os.environ.get('STREAMALLOC_CONF') or '(default)'}")
    text = table(runs, args, header)
    print("\n" + text)
    with open(md_path, "w") as f:
        f.write(text + "\n")
    print(f"\nwritten: {md_path}, {jsonl_path}, logs in {logs}")
    failed = sorted({f"{r['loop']}/{r['allocator']}" for r in runs
                     if r["allocator"] in MUST_COMPLETE and not r["completed"]})
    if failed:
        print(f"runs that did not complete: {', '.join(failed)}")
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/streamalloc-gpu", help="folder for torch_loops.md/.jsonl and logs")
    parser.add_argument("--quick", action="store_true", help="small models, 3 warm-up and 5 timed steps")
    parser.add_argument("--loops", default=",".join(LOOPS), help=f"comma-separated, of {', '.join(LOOPS)}")
    parser.add_argument("--allocators", default="native,expandable,backend",
                        help=f"comma-separated, of {', '.join(ALLOCATORS)} (run in this order in each round)")
    parser.add_argument("--rounds", type=int, help="processes per (loop, allocator), interleaved (default 5, quick 2)")
    parser.add_argument("--first-round", type=int, default=1,
                        help="the number of the first round (rounds of one table run in several leases)")
    parser.add_argument("--table", nargs="+", metavar="JSONL",
                        help="print the table of the runs in these torch_loops.jsonl files, or .jsonl.xz (no run)")
    parser.add_argument("--warmup", type=int, help="warm-up steps (default 10, quick 3)")
    parser.add_argument("--steps", type=int, help="timed steps (default 30, quick 5)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per run (default 300)")
    parser.add_argument("--build-timeout", type=int, default=600, help="seconds for building the backend")
    parser.add_argument("--no-nvml", dest="nvml", action="store_false", help="no NVML sampling thread")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a dry run of this script's logic only (no allocator, meaningless figures)")
    parser.add_argument("--verbose", action="store_true", help="print every step")
    parser.add_argument("--one", nargs=2, metavar=("LOOPS", "ALLOCATOR"),
                        help="run LOOPS (comma-separated, one after another) in this process")
    parser.add_argument("--apart", action="store_true",
                        help="one process per loop (default: a process runs every loop, one after another)")
    parser.add_argument("--result", help="with --one: write the result (JSON) here")
    args = parser.parse_args()
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 10)
    args.steps = args.steps if args.steps is not None else (5 if args.quick else 30)
    args.rounds = args.rounds if args.rounds is not None else (2 if args.quick else 5)
    if args.rounds < 1:
        parser.error("--rounds >= 1")
    if args.warmup < 0 or args.steps < 1:
        parser.error("--warmup >= 0 and --steps >= 1")
    for name in args.loops.split(","):
        if name not in LOOPS:
            parser.error(f"unknown loop {name!r} (of {', '.join(LOOPS)})")
    for name in args.allocators.split(","):
        if name not in ALLOCATORS:
            parser.error(f"unknown allocator {name!r} (of {', '.join(ALLOCATORS)})")
    if args.table:
        import lzma

        runs = [json.loads(line) for path in args.table
                for line in (lzma.open(path, "rt") if path.endswith(".xz") else open(path)) if line.strip()]
        runs.sort(key=lambda r: (LOOPS.index(r["loop"]), ALLOCATORS.index(r["allocator"]), r["round"]))
        args.rounds = len({r["round"] for r in runs})
        first = next((r for r in runs if r.get("torch")), {})
        print(table(runs, args, f"## Training loops under each allocator\n\ntorch {first.get('torch', '?')} "
                                f"(CUDA {first.get('cuda', '?')}), {first.get('gpu', '?')}"))
        sys.exit(0)
    if args.one:
        group, allocator = args.one[0].split(","), args.one[1]
        if any(loop not in LOOPS for loop in group) or allocator not in ALLOCATORS:
            parser.error(f"--one LOOPS ALLOCATOR: LOOPS of {', '.join(LOOPS)} (comma-separated), "
                         f"ALLOCATOR of {', '.join(ALLOCATORS)}")
        done = []
        for loop in group:
            if done:
                forget(SETUP["torch"]) if "torch" in SETUP else None
            done.append(one_run(loop, allocator, args))
        finish_run({"runs": done, "traceback": next((r.get("traceback") for r in done if r.get("traceback")), None)},
                   args.result, all(r["completed"] for r in done))
    sys.exit(drive(args))


if __name__ == "__main__":
    main()
