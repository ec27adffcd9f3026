#!/usr/bin/env python3
"""Writes synthetic allocation traces with shapes that vary, in RMM's logging CSV
(`Thread,Time,Action,Pointer,Size,Stream`), to traces/synthetic/. Deterministic (fixed seeds):
`python3 lab/gen_traces.py` rewrites the same files. Each workload follows the tensors a
PyTorch program of that kind allocates and frees (bf16 activations, sizes rounded to 512
bytes as PyTorch's allocator does); traces/synthetic/README.md says what each models.
"""
import argparse
import lzma
import os
import random

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "traces", "synthetic")


class Trace:
    """Allocations and frees in program order; pointers are unique among live tensors."""

    def __init__(self):
        self.rows = []
        self.next_ptr = 0x7F0000000000
        self.t = 0

    def alloc(self, size):
        size = max(512, (int(size) + 511) // 512 * 512)
        ptr = self.next_ptr
        self.next_ptr += size
        self.t += 1
        self.rows.append(f"0,{self.t},allocate,{ptr:#x},{size},0")
        return (ptr, size)

    def free(self, tensor):
        self.t += 1
        self.rows.append(f"0,{self.t},free,{tensor[0]:#x},{tensor[1]},0")

    def write(self, name):
        with lzma.open(os.path.join(OUT, name), "wt", preset=9) as f:
            f.write("Thread,Time,Action,Pointer,Size,Stream\n")
            f.write("\n".join(self.rows) + "\n")


def bert_varlen_infer(seed=1, batches=60):
    """BERT-base inference (12 layers, hidden 768): batches of 1-32 sequences of 16-512 tokens."""
    rnd, tr, h, heads = random.Random(seed), Trace(), 768, 12
    weights = [tr.alloc(n) for n in [30522 * h * 2, 512 * h * 2] + [4 * h * h * 2, 8 * h * h * 2] * 12]
    for _ in range(batches):
        b, n = rnd.randint(1, 32), rnd.choice([16, 32, 64, 96, 128, 192, 256, 384, 512])
        ids = tr.alloc(b * n * 8)
        x = tr.alloc(b * n * h * 2)
        for _ in range(12):
            qkv = tr.alloc(3 * b * n * h * 2)
            scores = tr.alloc(b * heads * n * n * 2)
            probs = tr.alloc(b * heads * n * n * 2)
            tr.free(scores)
            ctx = tr.alloc(b * n * h * 2)
            tr.free(probs)
            tr.free(qkv)
            attn = tr.alloc(b * n * h * 2)
            tr.free(ctx)
            ff1 = tr.alloc(b * n * 4 * h * 2)
            ff2 = tr.alloc(b * n * 4 * h * 2)
            tr.free(ff1)
            y = tr.alloc(b * n * h * 2)
            tr.free(ff2)
            tr.free(attn)
            tr.free(x)
            x = y
        logits = tr.alloc(b * 2 * 4)
        tr.free(x)
        tr.free(ids)
        tr.free(logits)
    for w in weights:
        tr.free(w)
    return tr


def multiscale_train(seed=2, steps=40):
    """A 16-stage CNN trained at a resolution drawn each step from 160-480 px, batch 16."""
    rnd, tr = random.Random(seed), Trace()
    chans = [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 1024, 1024, 1024, 2048, 2048]
    params = [tr.alloc(c * c * 9 * 2) for c in chans]
    moments = [tr.alloc(p[1] * 2) for p in params] + [tr.alloc(p[1] * 2) for p in params]
    for _ in range(steps):
        px, b = rnd.choice(range(160, 481, 32)), 16
        inp = tr.alloc(b * 3 * px * px * 2)
        saved, side = [], px
        for i, c in enumerate(chans):
            if i in (2, 4, 7, 11, 14):
                side = (side + 1) // 2
            saved.append(tr.alloc(b * c * side * side * 2))  # conv output, kept for backward
            saved.append(tr.alloc(b * c * side * side * 2))  # bn/relu output, kept
            tmp = tr.alloc(c * 8 * 4)  # batch-norm statistics
            tr.free(tmp)
        loss = tr.alloc(512)
        grad = tr.alloc(saved[-1][1])
        grads = []
        for i in reversed(range(len(chans))):
            gw = tr.alloc(params[i][1])
            grads.append(gw)
            ws = tr.alloc(rnd.choice([8, 16, 32]) << 20)  # cuDNN workspace, size varies
            g_in = tr.alloc(saved[2 * i][1])
            tr.free(ws)
            tr.free(saved.pop())
            tr.free(saved.pop())
            tr.free(grad)
            grad = g_in
        tr.free(grad)
        tr.free(loss)
        tr.free(inp)
        for g in grads:
            tr.free(g)
    for t in params + moments:
        tr.free(t)
    return tr


def llm_decode_kvcache(seed=3, requests=10):
    """A 12-layer decoder (hidden 2048): each request's batch (1-8) and prompt (32-1024 tokens)
    vary; every decode step grows each layer's K and V cache by one token, as `torch.cat`
    does (a new tensor, the old one freed), for 8-40 new tokens."""
    rnd, tr, h, layers = random.Random(seed), Trace(), 2048, 12
    weights = [tr.alloc(n) for n in [50304 * h * 2] + [12 * h * h * 2] * layers]
    for _ in range(requests):
        b, n, new = rnd.randint(1, 8), rnd.randint(32, 1024), rnd.randint(8, 40)
        kv = [[tr.alloc(b * n * h * 2), tr.alloc(b * n * h * 2)] for _ in range(layers)]
        for step in range(new):
            length = n + step + 1
            x = tr.alloc(b * h * 2)
            for layer in kv:
                qkv = tr.alloc(b * 3 * h * 2)
                for j in range(2):
                    grown = tr.alloc(b * length * h * 2)
                    tr.free(layer[j])
                    layer[j] = grown
                scores = tr.alloc(b * 16 * length * 4)
                tr.free(scores)
                tr.free(qkv)
                mlp = tr.alloc(b * 4 * h * 2)
                tr.free(mlp)
            logits = tr.alloc(b * 50304 * 4)
            tr.free(logits)
            tr.free(x)
        for layer in kv:
            tr.free(layer[0])
            tr.free(layer[1])
    for w in weights:
        tr.free(w)
    return tr


def moe_routing(seed=4, steps=40):
    """A mixture-of-experts layer stack (8 layers, 16 experts, hidden 1024, top-2) under
    training-free inference: 4096 tokens per step routed at random with a skew drawn each
    step, so each expert's buffers change size every step."""
    rnd, tr, h, experts, tokens = random.Random(seed), Trace(), 1024, 16, 4096
    weights = [tr.alloc(8 * h * h * 2) for _ in range(8 * experts)]
    for _ in range(steps):
        x = tr.alloc(tokens * h * 2)
        for _ in range(8):
            router = tr.alloc(tokens * experts * 4)
            skew = [rnd.random() ** rnd.choice([1, 2, 4]) for _ in range(experts)]
            counts = [0] * experts
            for _ in range(2 * tokens // 16):  # 16-token groups keep the generator fast
                counts[rnd.choices(range(experts), skew)[0]] += 16
            outs = []
            for c in counts:
                if c == 0:
                    continue
                inp = tr.alloc(c * h * 2)
                up = tr.alloc(c * 4 * h * 2)
                tr.free(inp)
                down = tr.alloc(c * h * 2)
                tr.free(up)
                outs.append(down)
            y = tr.alloc(tokens * h * 2)
            for o in outs:
                tr.free(o)
            tr.free(router)
            tr.free(x)
            x = y
        tr.free(x)
    for w in weights:
        tr.free(w)
    return tr


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    os.makedirs(OUT, exist_ok=True)
    for name, make in [
        ("bert_varlen_infer.csv.xz", bert_varlen_infer),
        ("multiscale_train.csv.xz", multiscale_train),
        ("llm_decode_kvcache.csv.xz", llm_decode_kvcache),
        ("moe_routing.csv.xz", moe_routing),
    ]:
        tr = make()
        tr.write(name)
        print(f"{name}: {len(tr.rows)} ops")
