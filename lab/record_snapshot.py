#!/usr/bin/env python3
"""Records a real PyTorch memory snapshot on a GPU, for `streamalloc import`.

Trains a tiny model for a few steps with PyTorch's own allocator while
`torch.cuda.memory._record_memory_history` records every allocation, with a copy on a side
stream (so the snapshot has two streams and a `record_stream`), then writes the snapshot
with `torch.cuda.memory._dump_snapshot`. The result is small (a few hundred KiB with
`--max-entries 20000`) and meant to be committed as a test input.

Usage (on the GPU machine):
  python3 lab/record_snapshot.py OUT.pickle [--steps 4] [--max-entries 20000]
then, anywhere:
  streamalloc import OUT.pickle -o trace.csv && streamalloc replay trace.csv --plot out.svg
"""

import argparse


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max-entries", type=int, default=20000)
    args = parser.parse_args()
    import torch  # here: --help answers without torch


    device = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048), torch.nn.GELU(),
        torch.nn.Linear(2048, 10),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    side = torch.cuda.Stream()

    torch.cuda.memory._record_memory_history(max_entries=args.max_entries)
    for step in range(args.steps):
        x = torch.randn(256, 512, device=device)
        y = torch.randint(0, 10, (256,), device=device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # A staging buffer filled on the side stream and read on the default stream.
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            staged = torch.empty(1 << 18, device=device).fill_(step)
        torch.cuda.current_stream().wait_stream(side)
        staged.record_stream(torch.cuda.current_stream())
        total = staged.sum()
        del staged, x, y, loss
        print(f"step {step}: {total.item():.0f}")
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(args.out)
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
