"""PyTorch on streamalloc: a short training loop with a side stream and record_stream.

Run on a CUDA machine with the wheel installed (README: Install):
    STREAMALLOC_CONF=strategy=stream_safe python3 examples/pytorch_plugin.py
"""
import streamalloc.torch

# Before the first CUDA allocation of the process; the configuration string is the one of
# STREAMALLOC_CONF (None reads the variable).
streamalloc.torch.enable(None)

import torch  # noqa: E402 (imported after enable on purpose)

model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
side = torch.cuda.Stream()

for step in range(20):
    x = torch.randn(256, 1024, device="cuda")
    y = torch.randint(0, 10, (256,), device="cuda")
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    # A copy on another stream: record_stream keeps x's memory from being reused before the
    # side stream's work on it is done.
    with torch.cuda.stream(side):
        host = x.to("cpu", non_blocking=True)
    x.record_stream(side)
    del x

torch.cuda.synchronize()
stats = streamalloc.torch.memory_stats()
print(f"loss {loss.item():.3f}; allocated {stats['allocated_bytes.all.current']} bytes, "
      f"reserved {stats['reserved_bytes.all.current']} bytes, peak {stats['allocated_bytes.all.peak']}")
print(streamalloc.torch.memory_summary())
