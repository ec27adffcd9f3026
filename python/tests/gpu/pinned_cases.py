#!/usr/bin/env python3
"""Pinned host memory under streamalloc's torch backend (issue 36), one case under one
configuration per process, through torch's own APIs.

    python3 python/tests/gpu/pinned_cases.py CASE CONF

CONF is a streamalloc configuration, installed with streamalloc.torch.enable(CONF,
backend="backend") before the first CUDA allocation (the backend makes the library's pinned
pool torch's CUDA host allocator), or "native": PyTorch's own allocators, a control that must
pass the cases that check data (h2d, d2h).

Cases (each checks real results, data read back):

  routed  torch.empty(..., pin_memory=True), tensor.pin_memory() and a DataLoader's pinning
          come from the library's pinned pool: streamalloc.host_stats() counts each (live
          allocations, bytes asked for), is_pinned() holds, the contents are intact,
          torch.cuda.host_memory_stats() reports the pool's figures, and the freed blocks go
          back (streamalloc.host_release gives them to the driver)
  h2d     a non_blocking copy from a pinned tensor to the device, queued on a side stream
          behind torch.cuda._sleep; the tensor is freed at once and a new pinned tensor of the
          same size is filled with other bytes while the copy still waits: the device gets the
          first contents; once the copy is done the pool hands the first block out again
  d2h     the same for a non_blocking copy from the device into a pinned tensor freed at once:
          the new pinned tensor keeps its own bytes
  graph   torch.cuda.graph captures a copy from a pinned tensor (torch asks the host allocator
          to begin and end allocating to the graph's pool); the tensor freed after the capture
          is never handed out again, so every replay copies its contents

Output and exit status: see casekit.py.
"""

import sys

from casekit import MIB, run_worker

SIZE = 64 * MIB
SLEEP_CYCLES = 400_000_000
"""torch.cuda._sleep's cycles: about 0.2 s on an H200, ahead of a copy of SIZE (a few ms)."""


def setup(conf):
    """Imports torch with streamalloc (CONF) installed, or PyTorch's own allocators; returns
    torch and the streamalloc module (None for "native")."""
    import torch

    if conf == "native":
        torch.cuda.init()
        return torch, None
    import streamalloc
    import streamalloc.torch

    streamalloc.torch.enable(conf, backend="backend")
    torch.cuda.init()
    return torch, streamalloc


def intact(t, value):
    return float(t.min()) == value and float(t.max()) == value


def case_routed(report, conf):
    torch, sa = setup(conf)
    if not report.expect(sa is not None, "the routed case needs a streamalloc configuration"):
        return
    before = sa.host_stats()
    a = torch.empty(3 * MIB, dtype=torch.uint8, pin_memory=True)
    a.fill_(3)
    b = torch.arange(1000, dtype=torch.float32).pin_memory()
    dataset = torch.utils.data.TensorDataset(torch.arange(4096, dtype=torch.float32).reshape(64, 64))
    batch = next(iter(torch.utils.data.DataLoader(dataset, batch_size=16, pin_memory=True)))[0]
    held = sa.host_stats()
    report.info["host_stats"] = {"before": before, "held": held}
    report.expect(a.is_pinned() and b.is_pinned() and batch.is_pinned(), "a tensor is not pinned")
    report.expect(intact(a, 3) and float(b[999]) == 999.0 and float(batch[15, 63]) == 1023.0,
                  "a pinned tensor's contents are wrong")
    report.expect(held["live_allocations"] == before["live_allocations"] + 3,
                  f"the pool holds {held['live_allocations'] - before['live_allocations']} new allocations, not 3 "
                  "(empty(pin_memory=True), pin_memory(), the DataLoader's batch)")
    asked = 3 * MIB + 1000 * 4 + 16 * 64 * 4
    report.expect(held["allocated"] - before["allocated"] == asked,
                  f"the pool's allocated bytes grew by {held['allocated'] - before['allocated']}, not {asked}")
    theirs = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    report.info["torch_host_memory_stats"] = {k: v for k, v in theirs.items() if k.endswith(".current")}
    if "allocated_bytes.current" in theirs:  # torch's HostStats, flattened, from get_stats()
        report.expect(theirs["allocated_bytes.current"] == held["reserved"],
                      f"torch.cuda.host_memory_stats()['allocated_bytes.current'] is "
                      f"{theirs['allocated_bytes.current']}, not the pool's {held['reserved']} bytes pinned")
    del a, b, batch
    after = sa.host_stats()
    report.expect(after["live_allocations"] == before["live_allocations"], "freed pinned tensors are still live")
    released = sa.host_release()
    report.info["released"] = released
    report.expect(released >= 4 * MIB, f"host_release gave back {released} bytes, not the freed blocks")


def copy_behind_sleep(torch, direction):
    """Queues on a side stream a sleep, then a non_blocking copy of SIZE bytes between a pinned
    tensor (filled with 7, or receiving the device's 7s) and the device, and frees the pinned
    tensor at once. Returns (side stream, device tensor, the freed block's address)."""
    side = torch.cuda.Stream()
    device = torch.full((SIZE,), 7 if direction == "d2h" else 0, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    pinned = torch.empty(SIZE, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(7 if direction == "h2d" else 0)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        if direction == "h2d":
            device.copy_(pinned, non_blocking=True)
        else:
            pinned.copy_(device, non_blocking=True)
    first = pinned.data_ptr()
    del pinned
    return side, device, first


def case_copy(report, conf, direction):
    torch, sa = setup(conf)
    side, device, first = copy_behind_sleep(torch, direction)
    if sa is not None:
        pending = sa.host_stats()["pending_release"]
        report.info["pending_release"] = pending
        report.expect(pending >= SIZE, f"the freed block is not pending on the copy ({pending} bytes pending)")
    other = torch.empty(SIZE, dtype=torch.uint8, pin_memory=True)
    other.fill_(9)
    busy = not side.query()
    report.info["busy_at_overwrite"] = busy
    report.expect(busy, "the copy was done before the new tensor was written: the case proves nothing")
    report.info["reused_while_busy"] = other.data_ptr() == first
    side.synchronize()
    if direction == "h2d":
        report.expect(intact(device, 7), "the device got the new tensor's bytes: the pinned block was reused "
                      "under the copy")
    else:
        report.expect(intact(other, 9), "the copy wrote into the new pinned tensor: the block was reused under it")
    report.expect(other.data_ptr() != first, "the block was handed out while the copy still used it")
    again = torch.empty(SIZE, dtype=torch.uint8, pin_memory=True)
    report.info["reused_after_copy"] = again.data_ptr() == first
    if sa is not None:
        report.expect(again.data_ptr() == first, "the pool did not hand the block out again once the copy was done")


def case_h2d(report, conf):
    case_copy(report, conf, "h2d")


def case_d2h(report, conf):
    case_copy(report, conf, "d2h")


def case_graph(report, conf):
    torch, sa = setup(conf)
    if not report.expect(sa is not None, "the graph case needs a streamalloc configuration"):
        return
    src = torch.full((SIZE,), 7, dtype=torch.uint8).pin_memory()
    dst = torch.zeros(SIZE, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph wants
        dst.copy_(src, non_blocking=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dst.copy_(src, non_blocking=True)
    captured = src.data_ptr()
    del src
    torch.cuda.synchronize()
    others = [torch.empty(SIZE, dtype=torch.uint8, pin_memory=True) for _ in range(3)]
    for o in others:
        o.fill_(9)
    report.expect(all(o.data_ptr() != captured for o in others), "the captured block was handed out again")
    dst.zero_()
    graph.replay()
    torch.cuda.synchronize()
    report.expect(intact(dst, 7), "a replay copied other bytes than the captured tensor's")
    report.info["host_stats"] = sa.host_stats()
    report.expect(sa.host_stats()["pending_release"] >= SIZE, "the captured block is not held for the graph")


CASES = {name[len("case_"):]: f for name, f in globals().items() if name.startswith("case_") and name != "case_copy"}


if __name__ == "__main__":
    run_worker(sys.argv, CASES)
