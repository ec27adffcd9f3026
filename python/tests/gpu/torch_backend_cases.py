#!/usr/bin/env python3
"""What streamalloc's torch backend (issue 34) makes work that torch refuses under a
CUDAPluggableAllocator, one case under one configuration per process, through torch's own
APIs only (torch.cuda.memory_stats() etc., not streamalloc's replacements).

    python3 python/tests/gpu/torch_backend_cases.py CASE CONF [ARG]

CONF is a streamalloc configuration, made torch's allocator with streamalloc.torch.enable
before the first CUDA allocation; the path enable() takes follows STREAMALLOC_TORCH_BACKEND
(auto, backend, pluggable): run with STREAMALLOC_TORCH_BACKEND=pluggable every case must fail
(torch refuses the operation), which is the evidence that the case tests the backend.
Cases (each checks real results, data read back where there is data):

  active           enable() installed the backend (not the fallback)
  stats            torch.cuda.memory_allocated / max_memory_allocated / memory_reserved /
                   memory_stats / memory_summary / reset_peak_memory_stats /
                   reset_accumulated_memory_stats give exact figures for known allocations,
                   equal to streamalloc's own
  cudnn_benchmark  cudnn.benchmark=True convolution forward and backward (cudnn asks the
                   allocator's cacheInfo): right against the same convolution on the CPU
  oom              an allocation over the device's memory, and one over
                   set_per_process_memory_fraction, raise torch.cuda.OutOfMemoryError naming
                   streamalloc; torch's OOM observer is called with the device's figures;
                   num_ooms counts them; allocations work afterwards
  mempool          torch.cuda.MemPool() and use_mem_pool: use counts 1, 2 inside, 1 after (and
                   2 while a CUDA graph captured into it lives); the pool's tensors right; its
                   freed memory not handed to allocations outside it; its snapshot lists its
                   tensors; everything given back once pool and tensors are gone
  compile          torch.compile(mode="reduce-overhead") (cudagraph trees) forward and backward
                   against eager, with torch's slow-path pool asserts on (checkPoolLiveAllocations,
                   standard deleters); a new function run while graphs execute makes the trees
                   checkpoint the pool (getCheckpointState / setCheckpointPoolState), checked to
                   have happened, results right afterwards; then every block the library lists
                   as allocated is one of torch's live allocations (checkpointed memory torch
                   freed is free)
  ipc              ARG native|streamalloc (the child's allocator): a CUDA tensor sent through a
                   queue to a spawned process (torch.multiprocessing), which checks every
                   element and writes new values; the parent reads exactly what the child
                   wrote; once both dropped it (and torch.cuda.ipc_collect), the parent's
                   torch.cuda.memory_allocated and streamalloc's allocated bytes are back where
                   they were. cuMemAlloc chunks go as CUDA IPC handles, mapped memory
                   (backing=stitched, the default, or segments) in torch's expandable-segment
                   format: a child under torch's own allocator or streamalloc opens either
                   (ipc_cases.py runs every pair of allocators)
  ipc_refused      sharing memory that cannot be shared (the driver's pool) raises a
                   RuntimeError naming streamalloc and the configuration
  runner           `python -m streamalloc.torch SCRIPT ARGS` runs an unmodified script as
                   __main__ with its arguments, torch allocating through streamalloc and
                   torch.cuda.memory_stats() working in it
  history          torch.cuda.memory._record_memory_history(max_entries=1000), then tensors of
                   known sizes made and freed: _snapshot()'s device_traces hold their alloc,
                   free_requested and free_completed entries (exact addresses, sizes, stream,
                   times in Unix microseconds, torch's stack frames, the memory metadata), the
                   live tensor is an active block of its size (with frames) in a segment whose
                   blocks add up to it; _dump_snapshot's pickle goes through torch.cuda._memory_viz
                   (trace_plot, segment_plot, stats, trace, segments; `python -m
                   torch.cuda._memory_viz trace_plot` writes HTML) and, given a CLI
                   (STREAMALLOC_CLI, else `streamalloc` in PATH), `streamalloc import` makes it a
                   trace whose peak live bytes are what the case allocated; the ring keeps the
                   newest max_entries; context=None records no frames; disabling empties it

  snapshot_exact   _snapshot()'s segments and blocks are the library's list (streamalloc.segments)
                   exactly: addresses, sizes, streams, block sizes and states (a free waiting
                   for a recorded stream active_pending_free); live tensors active_allocated with
                   their requested sizes; no segment at address 0; the segments add up to the
                   library's reserved bytes (except under async, whose driver pool is not listed)

Output and exit status: see casekit.py.
"""

import csv
import gc
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time

from casekit import MIB, run_worker


def setup(conf):
    """Imports torch with streamalloc (CONF) current and CUDA initialised; returns torch."""
    import torch

    import streamalloc.torch

    streamalloc.torch.enable(conf)
    torch.cuda.init()
    return torch


def intact(t, value):
    return float(t.min()) == value and float(t.max()) == value


def case_active(report, conf):
    setup(conf)
    import streamalloc.torch

    report.info["active"] = streamalloc.torch.active()
    report.expect(streamalloc.torch.active() == "backend",
                  f"enable() installed {streamalloc.torch.active()!r}, not the backend")


def case_stats(report, conf):
    torch = setup(conf)
    import streamalloc

    intact(torch.ones(1, device="cuda"), 1.0)
    torch.cuda.synchronize()
    a0 = torch.cuda.memory_allocated()
    s0 = torch.cuda.memory_stats()
    sizes = [2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB]
    xs = [torch.full((size,), 7, dtype=torch.uint8, device="cuda") for size in sizes]
    a1 = torch.cuda.memory_allocated()
    s1 = torch.cuda.memory_stats()
    report.info.update(allocated_before=a0, allocated_after=a1)
    report.expect(a1 - a0 == sum(sizes), f"memory_allocated grew by {a1 - a0} for {sum(sizes)} bytes of tensors")
    report.expect(a1 == streamalloc.stats(0)["allocated"],
                  f"memory_allocated {a1} differs from streamalloc's allocated {streamalloc.stats(0)['allocated']}")
    grew = s1["allocation.all.current"] - s0["allocation.all.current"]
    report.expect(grew == len(sizes), f"allocation.all.current grew by {grew} for {len(sizes)} tensors")
    large = s1["allocated_bytes.large_pool.current"] - s0["allocated_bytes.large_pool.current"]
    report.expect(large == sum(sizes), f"allocated_bytes.large_pool.current grew by {large}")
    report.expect(torch.cuda.memory_reserved() >= a1, "memory_reserved is below memory_allocated")
    report.expect(torch.cuda.max_memory_allocated() >= a1, "max_memory_allocated is below memory_allocated")
    temp = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    del temp
    report.expect(torch.cuda.memory_allocated() == a1, "memory_allocated did not return after a free")
    report.expect(torch.cuda.max_memory_allocated() >= a1 + 64 * MIB, "max_memory_allocated missed a 64 MiB tensor")
    torch.cuda.reset_peak_memory_stats()
    report.expect(torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated(),
                  f"after reset_peak_memory_stats max_memory_allocated is {torch.cuda.max_memory_allocated()}, "
                  f"not {torch.cuda.memory_allocated()}")
    report.expect(torch.cuda.max_memory_reserved() == torch.cuda.memory_reserved(),
                  "after reset_peak_memory_stats max_memory_reserved is not memory_reserved")
    torch.cuda.reset_accumulated_memory_stats()
    s2 = torch.cuda.memory_stats()
    report.expect(s2["allocation.all.allocated"] == 0 and s2["allocation.all.freed"] == 0,
                  f"after reset_accumulated_memory_stats allocation.all.allocated/freed are "
                  f"{s2['allocation.all.allocated']}/{s2['allocation.all.freed']}")
    one = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")
    del one
    s3 = torch.cuda.memory_stats()
    report.expect(s3["allocation.all.allocated"] == 1 and s3["allocation.all.freed"] == 1,
                  f"one allocation and free counted as {s3['allocation.all.allocated']}/{s3['allocation.all.freed']}")
    report.expect(s3["allocated_bytes.all.allocated"] == 3 * MIB,
                  f"allocated_bytes.all.allocated is {s3['allocated_bytes.all.allocated']} after one 3 MiB tensor")
    # The peak of all streams together, not the sum of each stream's peak: 64 MiB on a side
    # stream, freed, then 64 MiB on another.
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(2):
        with torch.cuda.stream(torch.cuda.Stream()):
            t = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
            del t
    peak = torch.cuda.max_memory_allocated() - base
    report.info["two_streams_peak"] = peak
    report.expect(peak == 64 * MIB, f"max_memory_allocated rose by {peak} bytes for 64 MiB live at a time on two streams")
    summary = torch.cuda.memory_summary()
    report.expect("Allocated memory" in summary, "memory_summary() lacks torch's table")
    report.expect(all(intact(x, 7.0) for x in xs), "a tensor holds wrong data")
    del xs
    report.expect(torch.cuda.memory_allocated() == a0, "memory_allocated did not return to where it was")


def case_cudnn_benchmark(report, conf):
    torch = setup(conf)
    report.expect(torch.backends.cudnn.is_available(), "cudnn is not available: the case proves nothing")
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, 32, 32, generator=gen)
    conv = torch.nn.Conv2d(16, 32, 3, padding=1)
    xc = x.clone().requires_grad_(True)
    ref = conv(xc)
    ref.square().sum().backward()
    gpu_conv = torch.nn.Conv2d(16, 32, 3, padding=1).cuda()
    gpu_conv.load_state_dict(conv.state_dict())
    xg = x.cuda().requires_grad_(True)
    out = gpu_conv(xg)
    out.square().sum().backward()
    torch.cuda.synchronize()
    fwd = float((out.detach().cpu() - ref.detach()).abs().max())
    bwd = float((xg.grad.cpu() - xc.grad).abs().max())
    report.info.update(forward_max_diff=fwd, backward_max_diff=bwd)
    report.expect(fwd < 1e-3, f"the convolution's output differs from the CPU's by {fwd}")
    report.expect(bwd < 1e-2, f"the convolution's input gradient differs from the CPU's by {bwd}")


def case_oom(report, conf):
    torch = setup(conf)
    seen = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *args: seen.append(args))
    free, total = torch.cuda.mem_get_info()
    ooms0 = torch.cuda.memory_stats()["num_ooms"]
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        report.failures.append("an allocation of twice the device's memory succeeded")
    except torch.cuda.OutOfMemoryError as e:
        message = str(e)
        report.info["error"] = message.splitlines()[0]
        report.expect("streamalloc" in message, f"the OutOfMemoryError does not name streamalloc: {message[:200]}")
    except RuntimeError as e:
        report.failures.append(f"out of memory raised {type(e).__name__}, not torch.cuda.OutOfMemoryError: "
                               f"{str(e).splitlines()[0] if str(e) else ''}")
    report.info["observer_calls"] = [list(args) for args in seen]
    report.expect(len(seen) == 1, f"torch's OOM observer was called {len(seen)} times, not once")
    if seen:
        device, _allocated, device_total, _device_free = seen[0]
        report.expect(device == 0 and device_total == total,
                      f"the observer got device {device}, total {device_total}; expected 0, {total}")
    torch.cuda.set_per_process_memory_fraction(0.05)
    try:
        torch.empty(int(0.1 * total), dtype=torch.uint8, device="cuda")
        report.failures.append("an allocation of 10% of the device succeeded under a fraction of 5%")
    except torch.cuda.OutOfMemoryError:
        pass
    except RuntimeError as e:
        report.failures.append(f"the fraction's refusal raised {type(e).__name__}, not OutOfMemoryError")
    report.expect(torch.cuda.memory_stats()["num_ooms"] - ooms0 >= 2, "num_ooms did not count the refusals")
    after = torch.full((MIB,), 2.0, device="cuda")
    report.expect(intact(after, 2.0), "an allocation after the refusals holds wrong data")


def case_mempool(report, conf):
    torch = setup(conf)
    base = torch.cuda.memory_allocated()
    pool = torch.cuda.MemPool()
    counts = [pool.use_count()]
    with torch.cuda.use_mem_pool(pool):
        counts.append(pool.use_count())
        inside = [torch.full((k,), float(i + 1), device="cuda") for i, k in enumerate((256, 70_000, 16 * MIB))]
        freed = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    counts.append(pool.use_count())
    report.info["use_counts"] = counts
    report.expect(counts == [1, 2, 1], f"pool use counts {counts}, expected [1, 2, 1]")
    outside = torch.full((MIB,), 9.0, device="cuda")
    in_pool = {addr for addr, b, _ in blocks_of(pool.snapshot()) if b["state"] == "active_allocated"}
    report.expect(all(t.data_ptr() in in_pool for t in inside), "the pool's snapshot lacks a tensor made in it")
    report.expect(outside.data_ptr() not in in_pool, "the pool's snapshot lists a tensor made outside it")
    freed_ptr = freed.data_ptr()
    del freed  # its memory stays the pool's while the pool lives
    others = [torch.empty(64 * MIB, dtype=torch.uint8, device="cuda") for _ in range(4)]
    report.expect(all(o.data_ptr() != freed_ptr for o in others),
                  "memory freed in the pool went to an allocation outside it")
    del others
    # A graph captured into the pool holds a use while it lives.
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        static_in = torch.full((1024,), 3.0, device="cuda")
        (static_in * 2).sum()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool.id, stream=s):
            static_out = static_in * 2
        graph_count = pool.use_count()
        g.replay()
    torch.cuda.synchronize()
    report.expect(graph_count == 2, f"with a graph captured into it the pool's use count is {graph_count}, not 2")
    report.expect(intact(static_out, 6.0), "the graph's output is wrong")
    del g, static_out
    gc.collect()
    report.expect(pool.use_count() == 1, f"after the graph is gone the use count is {pool.use_count()}, not 1")
    report.expect(all(intact(t, i + 1.0) for i, t in enumerate(inside)), "a tensor in the pool holds wrong data")
    report.expect(intact(outside, 9.0), "a tensor outside the pool holds wrong data")
    del inside, outside, static_in
    torch.cuda.synchronize()
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated() - base
    report.expect(left == 0, f"{left} bytes stay allocated after the pool and its tensors are gone")


def case_compile(report, conf):
    torch = setup(conf)
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch._inductor import cudagraph_trees

    inductor_config.triton.slow_path_cudagraph_asserts = True
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).cuda()
    eager_model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).cuda()
    eager_model.load_state_dict(model.state_dict())

    def step(m, x):
        out = m(x)
        loss = out.square().mean()
        loss.backward()
        return out.detach(), loss.detach()

    compiled = torch.compile(model, mode="reduce-overhead")
    for it in range(6):
        torch.compiler.cudagraph_mark_step_begin()
        x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(it))
        out, loss = step(compiled, x)
        ref, ref_loss = step(eager_model, x)
        for p, q in zip(model.parameters(), eager_model.parameters()):
            report.expect(torch.allclose(p.grad, q.grad, rtol=1e-3, atol=1e-4), f"iteration {it}: gradients differ")
            p.grad = None
            q.grad = None
        report.expect(torch.allclose(out, ref, rtol=1e-3, atol=1e-4), f"iteration {it}: outputs differ from eager")
        report.expect(torch.allclose(loss, ref_loss, rtol=1e-3, atol=1e-5), f"iteration {it}: losses differ")
    manager = cudagraph_trees.get_container(0).tree_manager
    report.expect(manager is not None and len(list(manager.get_roots())) > 0,
                  "no cudagraph tree was recorded: the case proves nothing")

    # While graphs execute, a function not seen before is warmed up: the trees checkpoint the
    # pool's state (getCheckpointState at recording, setCheckpointPoolState now).
    @torch.compile(mode="reduce-overhead")
    def f(x):
        return (x * 2).relu() + 1

    @torch.compile(mode="reduce-overhead")
    def g(y):
        return y.sin() * 3

    @torch.compile(mode="reduce-overhead")
    def h(y):
        return y.cos() - 1

    with torch.no_grad():
        for it in range(4):
            x = torch.randn(4096, device="cuda", generator=torch.Generator("cuda").manual_seed(100 + it))
            y = f(x)
            z = g(y)
            expect_y = (x * 2).relu() + 1
            report.expect(torch.allclose(y, expect_y) and torch.allclose(z, expect_y.sin() * 3),
                          f"f/g iteration {it}: wrong result")
            if it == 3:
                w = h(y)  # new while f's graph output is live and graphs execute
                report.expect(torch.allclose(w, expect_y.cos() - 1), "h: wrong result")
                report.expect(torch.allclose(y, expect_y), "f's output changed after the checkpoint")
            del y, z
        manager = cudagraph_trees.get_container(0).tree_manager
        checkpoints = manager.debug_checkpointing_counter if manager is not None else 0
    report.info["checkpoints"] = checkpoints
    report.expect(checkpoints > 0, "the cudagraph trees never checkpointed the pool: the case proves nothing")
    for it in range(3):
        x = torch.randn(4096, device="cuda", generator=torch.Generator("cuda").manual_seed(200 + it))
        with torch.no_grad():
            w = h(g(f(x)))
        expect = (((x * 2).relu() + 1).sin() * 3).cos() - 1
        report.expect(torch.allclose(w, expect, atol=1e-5), f"after the checkpoint, iteration {it}: wrong result")
    # Memory torch freed is free in the library too, checkpointed or not: every block the
    # library lists as allocated is one of torch's live allocations (a checkpoint once kept
    # the memory of the allocations it lists until it went, for the life of the tree).
    del x, w
    gc.collect()
    torch.cuda.synchronize()
    if conf != "strategy=async":
        import streamalloc

        held = sum(1 for seg in streamalloc.segments(0) for b in seg["blocks"] if b["state"] == "allocated")
        live = torch.cuda.memory_stats()["allocation.all.current"]
        report.info.update(library_allocations=held, torch_allocations=live)
        report.expect(held == live, f"the library holds {held} allocations, torch {live}: memory torch freed "
                      "stays allocated")


def ipc_child(inbox, outbox, child_conf, n):
    """In the spawned process: receives a CUDA tensor, checks every element, writes new values,
    then drops it when the parent says so."""
    import torch

    try:
        if child_conf != "native":
            import streamalloc.torch

            streamalloc.torch.enable(child_conf)
        x = inbox.get()
        expected = torch.arange(n, dtype=torch.int64, device="cuda") * 7 + 3
        same = bool(torch.equal(x, expected))
        x.mul_(-1).sub_(5)  # the parent must see -(7i+3)-5
        torch.cuda.synchronize()
        outbox.put(("checked", same))
        inbox.get()  # the parent has read; x may go now
        del x, expected
        gc.collect()
        torch.cuda.synchronize()
        outbox.put(("dropped", True))
    except Exception as e:  # reported to the parent, which fails the case
        outbox.put(("error", f"{type(e).__name__}: {e}"))


def case_ipc(report, conf, child="native"):
    torch = setup(conf)
    import queue

    import streamalloc
    import torch.multiprocessing as mp

    n = 4 * MIB
    pads = [torch.ones(k, device="cuda") for k in (1000, 300_000)]
    torch.cuda.synchronize()
    before = (torch.cuda.memory_allocated(), streamalloc.stats(0)["allocated"])
    x = torch.arange(n, dtype=torch.int64, device="cuda") * 7 + 3
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    # The tensor goes through a queue whose put pickles it at once (a sharing refused raises
    # here); what the child answers through a queue read with a bound.
    inbox, outbox = ctx.SimpleQueue(), ctx.Queue()
    proc = ctx.Process(target=ipc_child, args=(inbox, outbox, conf if child == "streamalloc" else "native", n))
    # enable() made the processes this one starts enable streamalloc too: a native child opts out.
    saved = os.environ.get("STREAMALLOC_TORCH")
    if child == "native":
        os.environ["STREAMALLOC_TORCH"] = "0"
    try:
        proc.start()
    finally:
        if saved is None:
            os.environ.pop("STREAMALLOC_TORCH", None)
        else:
            os.environ["STREAMALLOC_TORCH"] = saved

    def answer(what):
        try:
            kind, value = outbox.get(timeout=120)
        except queue.Empty:
            report.failures.append(f"the child sent nothing back within 120 s ({what})")
            return None
        report.info["child_" + kind] = value
        report.expect(kind != "error", f"the child failed: {value}")
        return kind, value

    try:
        inbox.put(x)
        got = answer("after receiving the tensor")
        if got is None or not report.expect(got == ("checked", True), f"the child read wrong data: {got}"):
            return
        expected = -(torch.arange(n, dtype=torch.int64, device="cuda") * 7 + 3) - 5
        report.expect(torch.equal(x, expected), "the parent does not see what the child wrote")
        del expected
        inbox.put("done")
        if answer("after dropping the tensor") != ("dropped", True):
            return
        proc.join(60)
        del x
        gc.collect()
        torch.cuda.ipc_collect()  # torch keeps a sent tensor until the receiver let it go
        torch.cuda.synchronize()
        after = (torch.cuda.memory_allocated(), streamalloc.stats(0)["allocated"])
        report.info.update(allocated_before=before, allocated_after=after)
        report.expect(after == before, f"the shared tensor's memory was not freed once both dropped it: "
                                       f"(torch, streamalloc) allocated {before} before, {after} after")
    finally:
        failed = bool(report.failures) or sys.exc_info()[0] is not None
        if failed:  # the child may wait for what will not come
            proc.kill()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            report.failures.append("the child process did not exit within 60 s")
        elif not failed:
            report.expect(proc.exitcode == 0, f"the child process exited with {proc.exitcode}")
        del pads


def case_ipc_refused(report, conf):
    torch = setup(conf)
    import torch.multiprocessing as mp

    x = torch.ones(MIB, device="cuda")
    ctx = mp.get_context("spawn")
    parent, _child = ctx.Pipe()
    try:
        parent.send(x)
        report.failures.append(f"sharing memory of {conf} succeeded; this case expects the refusal")
    except RuntimeError as e:
        message = str(e)
        report.info["error"] = message.splitlines()[0]
        report.expect("streamalloc" in message and "strategy=async" in message,
                      f"the refusal does not name streamalloc and the configuration: {message[:300]}")
    report.expect(intact(x * 2, 2.0), "the tensor holds wrong data after the refusal")


RUNNER_SCRIPT = r'''
import json, sys
import torch
x = torch.full((1 << 20,), 5.0, device="cuda")
import streamalloc
print("SCRIPT " + json.dumps({"name": __name__, "argv": sys.argv[1:],
    "torch_allocated": torch.cuda.memory_allocated(), "streamalloc_allocated": streamalloc.stats(0)["allocated"],
    "value": float(x.sum())}))
'''


def case_runner(report, conf):
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as f:
            f.write(RUNNER_SCRIPT)
        proc = subprocess.run([sys.executable, "-m", "streamalloc.torch", "--conf", conf, script, "--lr", "0.1"],
                              capture_output=True, text=True, timeout=200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SCRIPT ")]
    report.info["exit"] = proc.returncode
    if not report.expect(proc.returncode == 0 and lines,
                         f"the runner exited {proc.returncode}: {proc.stderr.strip().splitlines()[-3:]}"):
        return
    out = json.loads(lines[-1][len("SCRIPT "):])
    report.info.update(out)
    report.expect(out["name"] == "__main__" and out["argv"] == ["--lr", "0.1"], f"the script ran as {out}")
    report.expect(out["streamalloc_allocated"] >= 4 * MIB, "the script's tensor was not allocated by streamalloc")
    report.expect(out["torch_allocated"] == out["streamalloc_allocated"],
                  "torch.cuda.memory_allocated() differs from streamalloc's figure in the script")
    report.expect(out["value"] == 5.0 * (1 << 20), "the script's tensor holds wrong data")


def blocks_of(segments):
    """(address, block, segment) of every block of a snapshot's segments, addressed as torch
    lays them out: the segment's address, then each block after the one before."""
    for seg in segments:
        addr = seg["address"]
        for b in seg["blocks"]:
            yield addr, b, seg
            addr += b["size"]


def peak_live(trace_csv):
    """Peak live bytes of an RMM logging CSV trace (allocate adds the size, free removes it)."""
    live = peak = 0
    with open(trace_csv, newline="") as f:
        for row in csv.DictReader(f):
            if row["Action"] == "allocate":
                live += int(row["Size"])
            elif row["Action"] == "free":
                live -= int(row["Size"])
            peak = max(peak, live)
    return peak


def case_history(report, conf):
    torch = setup(conf)
    from torch.cuda import _memory_viz

    here = os.path.basename(__file__)
    t0 = time.time()
    torch.cuda.memory._record_memory_history(max_entries=1000)  # every entry, with stacks
    torch.cuda.memory._set_memory_metadata("history-case")
    report.expect(torch.cuda.memory._get_memory_metadata() == "history-case", "the memory metadata does not read back")
    stream = torch.cuda.current_stream().cuda_stream
    sizes = {"kept": 3 * MIB, "temp": 5 * MIB + 512, "small": 700_000}
    kept = torch.empty(sizes["kept"], dtype=torch.uint8, device="cuda")
    temp = torch.empty(sizes["temp"], dtype=torch.uint8, device="cuda")
    small = torch.empty(sizes["small"], dtype=torch.uint8, device="cuda")
    addrs = {"kept": kept.data_ptr(), "temp": temp.data_ptr(), "small": small.data_ptr()}
    del temp, small
    torch.cuda.memory._set_memory_metadata("")
    snap = torch.cuda.memory._snapshot()
    t1 = time.time()

    # The trace: each tensor's entries, in order, with what torch records.
    traces = snap["device_traces"]
    report.info["trace_lengths"] = [len(t) for t in traces]
    entries = traces[0] if traces else []
    report.info["actions"] = [e["action"] for e in entries]
    for name, addr in addrs.items():
        mine = [(i, e) for i, e in enumerate(entries) if e.get("addr") == addr and e["action"] != "snapshot"]
        actions = [e["action"] for _, e in mine]
        want = ["alloc"] if name == "kept" else ["alloc", "free_requested", "free_completed"]
        report.expect(actions == want, f"{name} ({sizes[name]} bytes at {addr:#x}): trace entries {actions}, not {want}")
        for _, e in mine:
            report.expect(e["size"] == sizes[name], f"{name}: a {e['action']} entry has size {e['size']}, not {sizes[name]}")
            report.expect(e["stream"] == stream, f"{name}: a {e['action']} entry names stream {e['stream']}, not {stream}")
            report.expect(e.get("user_metadata") in (None, "history-case"),
                          f"{name}: a {e['action']} entry has user_metadata {e.get('user_metadata')!r}")
        alloc = next((e for _, e in mine if e["action"] == "alloc"), None)
        if alloc is not None:
            frames = alloc.get("frames") or []
            report.expect(any(f["filename"].endswith(here) for f in frames),
                          f"{name}: its alloc entry has no frame of {here} ({len(frames)} frames)")
            if name == "kept":
                report.info["kept_alloc_frames"] = len(frames)
    times = [e["time_us"] for e in entries]
    report.expect(times == sorted(times), "the entries' times go back")
    report.expect(all(t0 * 1e6 - 10e6 <= t <= t1 * 1e6 + 10e6 for t in times),
                  f"entry times {times[:1]}..{times[-1:]} are not Unix microseconds of the run ({t0 * 1e6:.0f})")

    # The segments: the live tensor an active block of its size, the freed ones not.
    segments = snap["segments"]
    report.info["segments"] = [(seg["address"], seg["total_size"], len(seg["blocks"]), seg.get("is_expandable"))
                               for seg in segments]
    for seg in segments:
        total = sum(b["size"] for b in seg["blocks"])
        report.expect(total == seg["total_size"],
                      f"segment at {seg['address']:#x}: blocks add up to {total}, not {seg['total_size']}")
        allocated = sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        report.expect(allocated == seg["allocated_size"],
                      f"segment at {seg['address']:#x}: allocated_size {seg['allocated_size']}, blocks {allocated}")
    found = {addr: b for addr, b, _ in blocks_of(segments) if b["state"] != "inactive"}
    block = found.get(addrs["kept"])
    if report.expect(block is not None, "the live tensor is no block of the snapshot"):
        # The library's block (its size as the allocator rounded it), of the tensor's request.
        report.expect(block["state"] == "active_allocated" and block["size"] >= sizes["kept"]
                      and block["requested_size"] == sizes["kept"], f"the live tensor's block is {block}")
        if "address" in block:
            report.expect(block["address"] == addrs["kept"], f"the block's address {block['address']:#x} is not the tensor's")
        report.expect(any(f["filename"].endswith(here) for f in block.get("frames") or []),
                      "the live tensor's block has no frame of this file")
    report.expect(addrs["temp"] not in found and addrs["small"] not in found,
                  "a freed tensor is still an active block of the snapshot")
    public = torch.cuda.memory_snapshot()
    report.expect(any(a == addrs["kept"] and b["state"] == "active_allocated" for a, b, _ in blocks_of(public)),
                  "torch.cuda.memory_snapshot() lacks the live tensor")

    # torch's viewers, on the dict and on _dump_snapshot's pickle.
    try:
        report.expect("TOTAL MEM" in _memory_viz.trace(snap), "_memory_viz.trace printed no total")
        _memory_viz.segsum(snap)  # raises on blocks that do not add up
        flame = _memory_viz.segments(snap, format_flamegraph=lambda lines: lines)
        report.expect("active_allocated" in flame, "_memory_viz.segments shows no active block")
        for plot in (_memory_viz.trace_plot, _memory_viz.segment_plot):
            html = plot(snap)
            report.expect(isinstance(html, str) and "<html>" in html, f"{plot.__name__} returned no HTML")
    except Exception as e:
        report.failures.append(f"torch.cuda._memory_viz failed on the snapshot: {type(e).__name__}: {e}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "snapshot.pickle")
        torch.cuda.memory._dump_snapshot(path)
        with open(path, "rb") as f:
            dumped = pickle.load(f)
        report.expect([e["addr"] for e in dumped["device_traces"][0] if e["action"] == "alloc"][:3]
                      == list(addrs.values()), "the dumped snapshot's alloc entries are not the tensors'")
        html = os.path.join(tmp, "trace.html")
        viz = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", path, "-o", html],
                             capture_output=True, text=True, timeout=120)
        wrote = os.path.exists(html) and os.path.getsize(html) > 0
        report.expect(viz.returncode == 0 and wrote,
                      f"python -m torch.cuda._memory_viz trace_plot failed ({viz.returncode}): {viz.stderr[-300:]}")
        stats = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", path],
                               capture_output=True, text=True, timeout=120)
        report.expect(stats.returncode == 0 and "total_allocated" in stats.stdout,
                      f"python -m torch.cuda._memory_viz stats failed ({stats.returncode}): {stats.stderr[-300:]}")
        cli = os.environ.get("STREAMALLOC_CLI") or shutil.which("streamalloc")
        if cli:
            out = os.path.join(tmp, "trace.csv")
            imported = subprocess.run([cli, "import", path, "-o", out], capture_output=True, text=True, timeout=120)
            report.info["import"] = (imported.stdout + imported.stderr).strip()[-400:]
            if report.expect(imported.returncode == 0, f"streamalloc import failed ({imported.returncode})"):
                peak = peak_live(out)
                report.info["imported_peak_live"] = peak
                report.expect(peak == sum(sizes.values()),
                              f"the imported trace's peak live bytes are {peak}, not {sum(sizes.values())}")
        else:
            report.info["import"] = "skipped: no streamalloc CLI (set STREAMALLOC_CLI=PATH)"

    # The ring keeps the newest max_entries; clear_history empties it.
    torch.cuda.memory._record_memory_history(max_entries=4, clear_history=True)
    ring_sizes = [4096, 8192, 12288]
    for n in ring_sizes:
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        del t
    ring = torch.cuda.memory._snapshot()["device_traces"][0]
    got = [(e["action"], e["size"]) for e in ring]
    want = [("free_completed", 8192), ("alloc", 12288), ("free_requested", 12288), ("free_completed", 12288)]
    report.expect(got == want, f"with max_entries=4 the trace is {got}, not {want}")

    # context=None: entries without frames, blocks without frames.
    torch.cuda.memory._record_memory_history(context=None, clear_history=True, max_entries=1000)
    plain = torch.empty(2 * MIB, dtype=torch.uint8, device="cuda")
    snap = torch.cuda.memory._snapshot()
    mine = [e for e in snap["device_traces"][0] if e.get("addr") == plain.data_ptr()]
    report.expect([e["action"] for e in mine] == ["alloc"], f"context=None: entries {mine}")
    report.expect(all(not e.get("frames") for e in mine), "context=None: an entry has frames")
    block = {a: b for a, b, _ in blocks_of(snap["segments"])}.get(plain.data_ptr())
    report.expect(block is not None and not block.get("frames"), f"context=None: the block is {block}")

    # Disabled: no history, the state still there.
    torch.cuda.memory._record_memory_history(enabled=None)
    snap = torch.cuda.memory._snapshot()
    report.expect(all(len(t) == 0 for t in snap["device_traces"]), "disabling left entries in the history")
    live = {a for a, b, _ in blocks_of(snap["segments"]) if b["state"] == "active_allocated"}
    report.expect(addrs["kept"] in live and plain.data_ptr() in live, "a live tensor left the snapshot")

    # Informational: memory used on another stream, freed while that stream is busy.
    side = torch.cuda.Stream()
    torch.cuda.memory._record_memory_history(max_entries=1000, clear_history=True)
    shared = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
    shared_ptr = shared.data_ptr()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        shared.record_stream(side)
    del shared
    pending = {a: b["state"] for a, b, _ in blocks_of(torch.cuda.memory._snapshot()["segments"])}.get(shared_ptr)
    torch.cuda.synchronize()
    again = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
    entries = torch.cuda.memory._snapshot()["device_traces"][0]
    report.info["record_stream"] = {"state_while_busy": pending,
                                    "entries": [e["action"] for e in entries if e.get("addr") == shared_ptr]}
    del again, kept, plain
    torch.cuda.memory._record_memory_history(enabled=None)


SNAPSHOT_STATES = {"allocated": "active_allocated", "pending": "active_pending_free", "free": "inactive"}
"""A library block's state as torch's snapshot names it."""


def case_snapshot_exact(report, conf):
    torch = setup(conf)
    import streamalloc

    keep = [torch.full((size,), 3, dtype=torch.uint8, device="cuda") for size in (512, 3 * MIB, 20 * MIB)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other = torch.full((6 * MIB,), 4, dtype=torch.uint8, device="cuda")
    gone = torch.empty(9 * MIB, dtype=torch.uint8, device="cuda")
    used = torch.empty(2 * MIB, dtype=torch.uint8, device="cuda")
    used.record_stream(side)  # freed while the side stream may still use it: pending
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
    del gone, used
    theirs = torch.cuda.memory._snapshot()["segments"]
    ours = streamalloc.segments(0)
    side.synchronize()
    report.info.update(segments=len(ours), blocks=sum(len(s["blocks"]) for s in ours))
    mine = [(s["address"], s["total_size"], s["stream"],
             [(b["size"], b["state"]) for b in s["blocks"]]) for s in theirs if s["device"] == 0]
    lib = [(s["address"], s["size"], s["stream"],
            [(b["size"], SNAPSHOT_STATES[b["state"]]) for b in s["blocks"]]) for s in ours]
    report.expect(sorted(mine) == sorted(lib),
                  f"_snapshot()'s segments differ from the library's: {sorted(mine)[:8]} vs {sorted(lib)[:8]}")
    report.expect(all(s["address"] != 0 for s in theirs), "a segment at address 0")
    active = {addr: b for addr, b, _ in blocks_of(theirs) if b["state"] == "active_allocated"}
    for t in keep + [other]:
        b = active.get(t.data_ptr())
        report.expect(b is not None and b["requested_size"] == t.numel(),
                      f"the live tensor at {t.data_ptr():#x} of {t.numel()} bytes is {b}")
    report.expect(sum(s["total_size"] for s in theirs) == streamalloc.stats(0)["reserved"]
                  or "async" in conf, "the snapshot's segments do not add up to the reserved bytes")
    report.expect(all(intact(t, 3.0) for t in keep) and intact(other, 4.0), "a tensor holds wrong data")


CASES = {name[len("case_"):]: f for name, f in globals().items() if name.startswith("case_")}


if __name__ == "__main__":
    run_worker(sys.argv, CASES)
