#!/usr/bin/env python3
"""Records allocation traces (RMM's logging CSV) of PyTorch workloads whose shapes vary.

    python3 lab/record_workloads.py --out DIR [--rows 36000] [--seed 0] [WORKLOAD...]
    python3 lab/record_workloads.py --one WORKLOAD --trace PATH [--rows 36000] [--seed 0]

The first form records every workload (or those named), each in its own process, into
DIR/WORKLOAD.csv, then prints one JSON line per trace and a markdown table (rows, peak live
bytes, file size). `--seed` draws other weights and shapes (the traces of traces/recorded/
are seed 0; other seeds give workloads of the same kinds to check a change against: those
of bench/check-traces/ are seed 1). `bash lab/run record` runs it on the
GPU machine and packs DIR into $OUT/recorded.tar.gz.

How the traces were recorded (for traces/README.md):

    Recorded on one NVIDIA H200 with PyTorch 2.11 through streamalloc's trace adaptor:
    `streamalloc.torch.enable("strategy=stream_safe,trace=PATH")` before the first CUDA
    allocation (the file is written at process exit), by lab/record_workloads.py.
    Models are built from torch.nn with random weights (seed 0); shapes come from
    random.Random(0). Each workload stops starting new steps (and a decode stops early)
    once the trace holds ROWS rows (36,000 by default, under 2 MB). `Size` is the bytes
    PyTorch asked for and `Stream` the CUDA stream's handle (one stream per trace).

    llm_decode.csv     variable-length LLM inference with a growing KV cache: a GPT-like
                       decoder (2 layers, d=1024, 16 heads, vocabulary 16384, bf16,
                       inference mode); batches of 1-8 prompts padded to the longest of
                       32-512 tokens, a prefill, then 64-256 new tokens decoded one at a
                       time, each layer's keys and values grown by torch.cat
    cnn_multiscale.csv multi-scale image training: a 7-layer CNN (conv-batchnorm-relu,
                       32-256 channels, 100 classes) trained with SGD and momentum under
                       bf16 autocast, the input resolution drawn each step from 160-320
                       (steps of 32) and the batch from 8-64
    moe_train.csv      training steps of a mixture-of-experts layer: 8 expert MLPs
                       (1024 -> 2048 -> 1024, fp32), top-2 routing on noisy router logits
                       (so the tokens per expert vary each step), 1024-8192 tokens per
                       step, AdamW
    bert_infer.csv     variable-length BERT-like encoder inference: nn.TransformerEncoder
                       (6 layers, d=768, 12 heads, fp16, eval, inference mode, nested-tensor
                       fast path) over batches of 1-32 sequences of 16-512 tokens with a key
                       padding mask
"""

import argparse
import json
import os
import random
import subprocess
import sys


def llm_decode(torch, rng, more):
    nn, F = torch.nn, torch.nn.functional
    d, heads, layers, vocab = 1024, 16, 2, 16384

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x, cache):
            b, t, _ = x.shape
            q, k, v = (u.view(b, t, heads, d // heads).transpose(1, 2)
                       for u in self.qkv(self.ln1(x)).split(d, dim=-1))
            if cache is not None:
                k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)))), (k, v)

    emb = nn.Embedding(vocab, d).cuda().bfloat16()
    blocks = nn.ModuleList(Block() for _ in range(layers)).cuda().bfloat16()
    head = nn.Linear(d, vocab, bias=False).cuda().bfloat16()
    batches = 0
    with torch.inference_mode():
        while more():
            b = rng.randint(1, 8)
            t = max(rng.randint(32, 512) for _ in range(b))
            x = emb(torch.randint(0, vocab, (b, t), device="cuda"))
            caches = [None] * layers
            for i, block in enumerate(blocks):
                x, caches[i] = block(x, None)
            for _ in range(rng.randint(64, 256)):
                x = emb(head(x[:, -1:]).argmax(-1))
                for i, block in enumerate(blocks):
                    x, caches[i] = block(x, caches[i])
                if not more():
                    break
            batches += 1
    return batches


def cnn_multiscale(torch, rng, more):
    nn = torch.nn

    def block(cin, cout, stride):
        return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    net = nn.Sequential(*block(3, 32, 2), *block(32, 64, 2), *block(64, 64, 1), *block(64, 128, 2),
                        *block(128, 128, 1), *block(128, 256, 2), *block(256, 256, 1),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 100)).cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    steps = 0
    while more():
        res, batch = rng.choice((160, 192, 224, 256, 288, 320)), rng.randint(8, 64)
        x = torch.randn(batch, 3, res, res, device="cuda")
        y = torch.randint(0, 100, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
    return steps


def moe_train(torch, rng, more):
    nn = torch.nn
    d, ffn, experts = 1024, 2048, 8
    router = nn.Linear(d, experts).cuda()
    mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, ffn), nn.GELU(), nn.Linear(ffn, d))
                         for _ in range(experts)).cuda()
    opt = torch.optim.AdamW([*router.parameters(), *mlps.parameters()], lr=1e-4)
    steps = 0
    while more():
        tokens = rng.randint(1024, 8192)
        x = torch.randn(tokens, d, device="cuda")
        logits = router(x) + 2.0 * torch.randn(tokens, experts, device="cuda")
        weight, chosen = logits.softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e in range(experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, mlps[e](x[rows]) * weight[rows, slot, None])
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
    return steps


def bert_infer(torch, rng, more):
    nn = torch.nn
    d, vocab = 768, 30522
    layer = nn.TransformerEncoderLayer(d, 12, 4 * d, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 6, enable_nested_tensor=True).cuda().half().eval()
    emb = nn.Embedding(vocab, d).cuda().half()
    batches = 0
    with torch.inference_mode():
        while more():
            b = rng.randint(1, 32)
            lengths = torch.tensor([rng.randint(16, 512) for _ in range(b)], device="cuda")
            t = int(lengths.max())
            pad = torch.arange(t, device="cuda")[None, :] >= lengths[:, None]
            out = encoder(emb(torch.randint(0, vocab, (b, t), device="cuda")), src_key_padding_mask=pad)
            out[:, 0].float().sum().item()
            batches += 1
    return batches


WORKLOADS = {f.__name__: f for f in (llm_decode, cnn_multiscale, moe_train, bert_infer)}


def record_one(name, trace, rows, seed):
    """Runs workload `name` in this process with streamalloc tracing into `trace`, weights and
    shapes drawn from `seed`."""
    import streamalloc
    import streamalloc.torch

    streamalloc.torch.enable(f"strategy=stream_safe,trace={trace}")
    import torch

    torch.manual_seed(seed)

    def more():
        s = streamalloc.stats(0)
        return s["total_allocations"] + s["total_frees"] + s["failures"] < rows

    steps = WORKLOADS[name](torch, random.Random(seed), more)
    torch.cuda.synchronize()
    print(json.dumps({"workload": name, "steps": steps}), flush=True)


def trace_figures(path):
    """Rows and peak live bytes (most allocated and not yet freed at any point) of a trace."""
    rows, live, now, peak = 0, {}, 0, 0
    with open(path) as f:
        for line in f:
            fields = line.rstrip("\n").split(",")
            if fields[0] == "Thread":
                continue
            rows += 1
            action, ptr, size = fields[2], fields[3], int(fields[4])
            if action == "allocate":
                live[ptr] = size
                now += size
                peak = max(peak, now)
            elif action == "free":
                now -= live.pop(ptr, 0)
    return rows, peak


def drive(names, out, rows, seed):
    """Records each workload in its own process; prints JSON lines and a table; the exit status."""
    os.makedirs(out, exist_ok=True)
    table, failed = [], 0
    for name in names:
        trace = os.path.join(os.path.abspath(out), f"{name}.csv")
        cmd = [sys.executable, __file__, "--one", name, "--trace", trace, "--rows", str(rows),
               "--seed", str(seed)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            error = None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]
            steps = json.loads(done.stdout.strip().splitlines()[-1])["steps"] if error is None else None
        except subprocess.TimeoutExpired:
            error, steps = "hung (300 s)", None
        row = {"workload": name, "steps": steps, "error": error}
        if os.path.exists(trace):
            row["rows"], row["peak_live_bytes"] = trace_figures(trace)
            row["file_bytes"] = os.path.getsize(trace)
        print(json.dumps(row), flush=True)
        failed += error is not None
        table.append(row)
    print("\n| trace | steps | rows | peak live bytes | file bytes | error |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for r in table:
        figures = " | ".join(f"{r[k]:,}" if r.get(k) is not None else "-"
                             for k in ("steps", "rows", "peak_live_bytes", "file_bytes"))
        print(f"| {r['workload']}.csv | {figures} | {r['error'] or ''} |")
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                        help=f"workloads to record (default all: {', '.join(WORKLOADS)})")
    parser.add_argument("--out", help="folder for the traces (records every workload named)")
    parser.add_argument("--one", metavar="WORKLOAD", help="record one workload in this process")
    parser.add_argument("--trace", help="with --one: the trace file")
    parser.add_argument("--rows", type=int, default=36000, help="rows after which a workload stops")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the shapes")
    args = parser.parse_args()
    unknown = [w for w in [*args.workloads, *([args.one] if args.one else [])] if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}")
    if args.one:
        if not args.trace:
            parser.error("--one needs --trace")
        record_one(args.one, args.trace, args.rows, args.seed)
    elif args.out:
        sys.exit(drive(args.workloads or list(WORKLOADS), args.out, args.rows, args.seed))
    else:
        parser.error("give --out DIR (or --one WORKLOAD --trace PATH)")


if __name__ == "__main__":
    main()
