#!/usr/bin/env python3
"""PyTorch's allocator guarantees, one case under one allocator per process.

    python3 python/tests/gpu/torch_cases.py CASE CONF

test_torch_guarantees.py runs every case this way (the allocator is fixed per process, and a
failed capture or a crash must not take the other cases with it). CONF is a streamalloc
configuration ("strategy=stream_safe,backing=chunks"), made PyTorch's allocator with
streamalloc.torch.enable before the first CUDA allocation, or a control: "native" (PyTorch's
caching allocator) or "cudaMallocAsync" (its backend:cudaMallocAsync). The mempool case
keeps PyTorch's allocator current whatever CONF says and takes streamalloc with CONF as the
pool's allocator. Cases (each checks data read back, not only addresses):

  record_stream      x read by a busy side stream, x.record_stream(side), del x; a same-size
                     tensor made and filled on the current stream while the side stream is
                     still busy (checked) must not change what the side stream read
  graph_vs_eager     a graph captures 1 GiB of temporaries (allocated and freed inside the
                     capture); eager tensors made afterwards on the capture stream must
                     survive replays, and the replays' output must be right
  graphs_shared_pool two graphs capture into one torch.cuda.graph_pool_handle(), the second
                     consuming the first's output; replayed in order with changing inputs
  graph_other_stream a graph replayed on another stream while the current stream allocates
                     and writes eager tensors (the replay stream checked busy meanwhile)
  mempool            torch.cuda.MemPool(streamalloc allocator) under PyTorch's own allocator
                     and use_mem_pool: memory from streamalloc, data right, all of it given
                     back once the tensors and the pool are gone and empty_cache ran
  mempool_enabled    torch.cuda.MemPool() with streamalloc current: works (as above), or
                     raises a RuntimeError naming the pool operation; "outcome" says which
  ipc                a tensor shared with a spawned process (torch.multiprocessing) which
                     sends back its sum: right, or a RuntimeError naming IPC/sharing
  empty_cache        ~4 GiB allocated in pieces and freed; torch.cuda.empty_cache() must give
                     it back (device memory in use and the allocator's reserved bytes)
  memory_fraction    set_per_process_memory_fraction(0.05): 2% of the device fits, 10% raises
                     torch.cuda.OutOfMemoryError, small allocations work afterwards
  stats              streamalloc.torch.memory_stats() has torch's keys and right figures,
                     reset_peak_memory_stats resets the peaks, memory_summary is text

Output and exit status: see casekit.py. lab/graph_memory.py measures with this file's setup,
temporaries and memory figures (imported): keep their signatures.
"""

import gc
import os
import sys

from casekit import GIB, MIB, Report, frees_synchronize

CONTROLS = ("native", "cudaMallocAsync")
"""CONF values that keep one of PyTorch's own allocators."""


def setup(conf):
    """Imports torch with CONF's allocator current and CUDA initialised; returns torch."""
    if conf == "cudaMallocAsync":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    elif conf == "native":
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    import torch

    if conf not in CONTROLS:
        import streamalloc.torch

        streamalloc.torch.enable(conf)
    torch.cuda.init()
    return torch


def streamalloc_allocator(torch, conf):
    """streamalloc.torch.allocator(conf); for a library without it (before issue 15), the
    CUDAPluggableAllocator that streamalloc.torch.enable builds (malloc and free only)."""
    import streamalloc
    import streamalloc.torch

    if hasattr(streamalloc.torch, "allocator"):
        return streamalloc.torch.allocator(conf)
    streamalloc.configure(conf)
    return torch.cuda.memory.CUDAPluggableAllocator(
        str(streamalloc.library_path()), "streamalloc_malloc", "streamalloc_free")


def sleep_cycles(torch, seconds):
    """The torch.cuda._sleep argument that keeps a stream busy for about `seconds`: from the
    shortest of three timed probes: other processes' kernels sharing the GPU (the cases run in
    parallel) stretch a probe, and a sleep computed from a stretched one ends early."""
    probe = 20_000_000
    torch.cuda._sleep(probe)  # loads the kernel
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return int(probe * seconds * 1000.0 / max(min(times), 1e-3))


def pattern(torch, n, seed):
    """A CPU float32 tensor of small integers (1..97) that depends on `seed`."""
    return ((torch.arange(n) * (seed + 3)) % 97 + 1).float()


def temporaries(x, chunks, chunk_bytes):
    """Makes `chunks` temporaries of `chunk_bytes` each from `x` (live together), frees them
    and returns x * factor(chunks), exactly (x holds small integers)."""
    n = x.numel()
    temps = [x.repeat(chunk_bytes // (4 * n)) * (k + 1) for k in range(chunks)]
    out = x.clone()
    for t in temps:
        out += t[:n] + t[-n:]
    return out


def factor(chunks):
    """What `temporaries` multiplies its input by."""
    return 1 + chunks * (chunks + 1)


def intact(t, value):
    """Whether every element of `t` equals `value` (read back through the current stream)."""
    return float(t.min()) == value and float(t.max()) == value


def device_used(torch):
    """Bytes of device memory in use (all processes), after a synchronize."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def reserved(torch, conf):
    """The allocator's reserved bytes: streamalloc's figure, or PyTorch's."""
    if conf not in CONTROLS:
        import streamalloc

        return streamalloc.stats(0)["reserved"]
    return torch.cuda.memory_reserved()


def case_record_stream(report, conf):
    torch = setup(conf)
    n = 64 * MIB // 4
    side = torch.cuda.Stream()
    cycles = sleep_cycles(torch, 1.0)
    warm = torch.empty(1024, device="cuda")
    warm.fill_(1.0)
    intact(warm * 2, 2.0)  # loads every kernel used below
    del warm
    x = torch.full((n,), 3.0, device="cuda")
    x_ptr = x.data_ptr()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
        y = x * 2
    x.record_stream(side)
    del x
    z = torch.empty(n, device="cuda")
    z.fill_(-1.0)
    side_busy = not side.query()
    torch.cuda.synchronize()
    report.info.update(side_busy_at_reuse=side_busy, same_address=z.data_ptr() == x_ptr)
    report.expect(side_busy or frees_synchronize(conf), "the side stream was idle when the new tensor was "
                  "made: the case proves nothing (make the side stream busy for longer)")
    report.expect(intact(y, 6.0), "the side stream read wrong data: x's memory went to the new tensor "
                  "and was overwritten while the side stream (recorded with record_stream) still used it")
    report.expect(intact(z, -1.0), "the new tensor does not hold what was written to it")


def case_graph_vs_eager(report, conf):
    torch = setup(conf)
    n, chunks, chunk = 4096, 8, 128 * MIB
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        static_in = pattern(torch, n, 0).cuda()
        temporaries(static_in, 1, MIB)  # loads the kernels outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            static_out = temporaries(static_in, chunks, chunk)
        eager = [torch.full((chunk // 4,), -7.0, device="cuda") for _ in range(chunks)]
        for rep in range(3):
            static_in.copy_(pattern(torch, n, rep))
            g.replay()
            report.expect(torch.equal(static_out.cpu(), pattern(torch, n, rep) * factor(chunks)),
                          f"replay {rep}: the graph's output is wrong")
        hit = [i for i, t in enumerate(eager) if not intact(t, -7.0)]
    report.info["eager_overwritten"] = hit
    report.expect(not hit, f"replays overwrote {len(hit)} of {chunks} eager tensors made after the "
                  "capture: the graph's temporaries went back to the allocator at capture end")


def case_graphs_shared_pool(report, conf):
    torch = setup(conf)
    n, chunks, chunk = 4096, 4, 64 * MIB
    f = factor(chunks)
    s = torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    with torch.cuda.stream(s):
        static_in = pattern(torch, n, 0).cuda()
        temporaries(static_in, 1, MIB)
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1, pool=pool, stream=s):
            mid = temporaries(static_in, chunks, chunk)
        with torch.cuda.graph(g2, pool=pool, stream=s):
            out = temporaries(mid, chunks, chunk)
        eager = [torch.full((chunk // 4,), -7.0, device="cuda") for _ in range(2 * chunks)]
        for rep in range(5):
            p = pattern(torch, n, rep)
            static_in.copy_(p)
            g1.replay()
            g2.replay()
            report.expect(torch.equal(mid.cpu(), p * f), f"replay {rep}: the first graph's output is wrong")
            report.expect(torch.equal(out.cpu(), p * f * f), f"replay {rep}: the second graph's output is wrong")
        hit = [i for i, t in enumerate(eager) if not intact(t, -7.0)]
    report.info["eager_overwritten"] = hit
    report.expect(not hit, f"replays overwrote {len(hit)} of {len(eager)} eager tensors made after the captures")


def case_graph_other_stream(report, conf):
    torch = setup(conf)
    n, chunks, chunk, reps = 4096, 8, 128 * MIB, 3
    # Long enough for the first replay's eager tensors, which map fresh memory (under
    # backing=stitched, 512 granules; 0.3 s ran out with the other cases on the GPU, run 28).
    cycles = sleep_cycles(torch, 1.0)
    s, r = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s):
        static_in = pattern(torch, n, 0).cuda()
        temporaries(static_in, 1, MIB)
        intact(torch.full((16,), -1.0, device="cuda"), -1.0)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            torch.cuda._sleep(cycles)
            static_out = temporaries(static_in, chunks, chunk)
    inputs = [pattern(torch, n, rep).cuda() for rep in range(reps)]
    torch.cuda.synchronize()
    outputs, eager, busy = [], [], []
    for rep in range(reps):
        with torch.cuda.stream(r):
            static_in.copy_(inputs[rep])
            g.replay()
            outputs.append(static_out.clone())
        # On the current stream, while the replay runs on r: allocate and write.
        eager.append([torch.full((chunk // 4,), -1.0 - rep, device="cuda") for _ in range(chunks)])
        busy.append(not r.query())
    torch.cuda.synchronize()
    report.info["replay_stream_busy"] = busy
    report.expect(all(busy), "the replay stream was idle while eager work ran: the case proves nothing")
    for rep in range(reps):
        report.expect(torch.equal(outputs[rep].cpu(), pattern(torch, n, rep) * factor(chunks)),
                      f"replay {rep} on the other stream gave a wrong output")
        hit = [i for i, t in enumerate(eager[rep]) if not intact(t, -1.0 - rep)]
        report.expect(not hit, f"replay {rep} overwrote {len(hit)} eager tensors written during it")


def case_graph_record_stream(report, conf):
    torch = setup(conf)
    n, reps = 1 << 20, 3
    s, side = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s):
        static_in = pattern(torch, n, 0).cuda()
        intact((static_in * 2 + 1) * 3, 0.0)  # loads the kernels outside the capture
        g = torch.cuda.CUDAGraph()
        # Inside the capture, a side stream of the capture reads a temporary that is then
        # recorded on it and freed: the free must stay inside the graph, joined.
        with torch.cuda.graph(g, stream=s):
            x = static_in * 2
            side.wait_stream(s)
            with torch.cuda.stream(side):
                y = x + 1
            x.record_stream(side)
            del x
            s.wait_stream(side)
            out = y * 3
        for rep in range(reps):
            p = pattern(torch, n, rep)
            static_in.copy_(p)
            g.replay()
            report.expect(torch.equal(out.cpu(), (p * 2 + 1) * 3), f"replay {rep}: the graph's output is wrong")


def case_graph_frees_warmup_output(report, conf):
    torch = setup(conf)
    n, reps = 1 << 20, 3
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        static_in = pattern(torch, n, 0).cuda()
        out = static_in * 2  # the warm-up's output, made on the capture stream
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            out = static_in * 2  # reassigned: the warm-up's output is freed inside the capture
        eager = []
        for rep in range(reps):
            p = pattern(torch, n, rep)
            static_in.copy_(p)
            g.replay()
            report.expect(torch.equal(out.cpu(), p * 2), f"replay {rep}: the graph's output is wrong")
            # A value of its own each: a replay that freed memory again lets two share it.
            eager.append(torch.full((n,), -5.0 - rep, device="cuda"))
    torch.cuda.synchronize()
    hit = [i for i, t in enumerate(eager) if not intact(t, -5.0 - i)]
    report.expect(not hit, f"replays overwrote {len(hit)} eager tensors made between them")


def pool_tensors(torch):
    """Tensors of several sizes (1 KiB to 64 MiB) holding 1.0, 2.0, ...; and their bytes."""
    counts = [256, 70_000, 3 * MIB // 4, 64 * MIB // 4]
    return [torch.full((k,), float(i + 1), device="cuda") for i, k in enumerate(counts)], 4 * sum(counts)


def case_mempool(report, conf):
    torch = setup("native")
    import streamalloc

    allocator = streamalloc_allocator(torch, conf)
    pool = torch.cuda.MemPool(allocator.allocator())
    with torch.cuda.use_mem_pool(pool):
        inside, nbytes = pool_tensors(torch)
    outside = torch.full((MIB,), 9.0, device="cuda")
    held = streamalloc.stats(0)["allocated"]
    report.info["streamalloc_allocated_in_use"] = held
    report.expect(held >= nbytes, f"streamalloc holds {held} bytes while the pool's tensors take {nbytes}: "
                  "the pool's memory did not come from streamalloc")
    report.expect(all(intact(t, i + 1.0) for i, t in enumerate(inside)), "a tensor in the pool holds wrong data")
    report.expect(intact(outside, 9.0), "a tensor outside the pool holds wrong data")
    del inside
    torch.cuda.synchronize()
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    left = streamalloc.stats(0)["allocated"]
    report.info["streamalloc_allocated_after"] = left
    report.expect(left == 0, f"streamalloc still has {left} bytes allocated after the pool and its tensors "
                  "are gone and empty_cache ran")


def case_mempool_enabled(report, conf):
    torch = setup(conf)
    import streamalloc

    base = streamalloc.stats(0)["allocated"]
    try:
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            inside, nbytes = pool_tensors(torch)
    except RuntimeError as e:
        message = str(e).splitlines()[0]
        report.info.update(outcome="unsupported", error=message)
        report.expect("pool" in message.lower(), f"MemPool failed with an error that does not name the pool "
                      f"operation: {message}")
        after = torch.full((MIB,), 4.0, device="cuda")
        report.expect(intact(after, 4.0), "allocations after the MemPool error hold wrong data")
        return
    report.info["outcome"] = "works"
    held = streamalloc.stats(0)["allocated"] - base
    report.expect(held >= nbytes, f"streamalloc's allocated grew by {held} bytes for {nbytes} bytes of tensors")
    report.expect(all(intact(t, i + 1.0) for i, t in enumerate(inside)), "a tensor in the pool holds wrong data")
    del inside
    torch.cuda.synchronize()
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    left = streamalloc.stats(0)["allocated"] - base
    report.expect(left == 0, f"{left} bytes stay allocated after the pool and its tensors are gone")


def ipc_child(conn):
    """In the spawned process: receives a CUDA tensor (or None), sends back its sum."""
    import torch

    try:
        x = conn.recv()
        if x is None:
            return
        total = int(x.sum().item())
        del x
        torch.cuda.synchronize()
        conn.send(("sum", total))
    except Exception as e:  # reported to the parent, which fails the case
        conn.send(("error", f"{type(e).__name__}: {e}"))


def case_ipc(report, conf):
    torch = setup(conf)
    import torch.multiprocessing as mp

    n = 4 * MIB
    # Earlier allocations, so that x need not start a device allocation of its own.
    pads = [torch.ones(k, device="cuda") for k in (1000, 300_000, 5 * MIB)]
    x = torch.arange(n, dtype=torch.int64, device="cuda") * 7 + 3
    expected = 7 * n * (n - 1) // 2 + 3 * n
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=ipc_child, args=(child,))
    proc.start()
    try:
        try:
            parent.send(x)
        except RuntimeError as e:
            message = str(e).splitlines()[0]
            report.info.update(outcome="unsupported", error=message)
            report.expect(any(w in message.lower() for w in ("ipc", "shar")),
                          f"sharing failed with an error that does not name IPC or sharing: {message}")
            parent.send(None)
            return
        report.info["outcome"] = "shared"
        if not report.expect(parent.poll(120), "the child sent nothing back within 120 s"):
            return
        kind, value = parent.recv()
        report.info["child_" + kind] = value
        report.expect(kind == "sum" and value == expected,
                      f"the child read wrong data: {kind} {value}, expected sum {expected}")
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            report.failures.append("the child process did not exit within 60 s")
        report.info["child_exitcode"] = proc.exitcode
        report.expect(proc.exitcode == 0, f"the child process exited with {proc.exitcode}")
        del pads  # held until the child is done with x


def case_empty_cache(report, conf):
    torch = setup(conf)
    floor = 256 * MIB
    used0 = device_used(torch)
    sizes, i = [], 0
    while sum(sizes) < 4 * GIB:
        sizes.append((1 + (i * 37) % 120) * MIB + (i % 5) * 4096)
        i += 1
    sizes += [(1 + j) * 4096 for j in range(128)]
    xs = [torch.empty(size, dtype=torch.uint8, device="cuda").fill_(1) for size in sizes]
    report.info["live_used"] = device_used(torch) - used0
    del xs
    report.info.update(cached_used=device_used(torch) - used0, cached_reserved=reserved(torch, conf))
    torch.cuda.empty_cache()
    used = device_used(torch) - used0
    held = reserved(torch, conf)
    report.info.update(after_used=used, after_reserved=held)
    report.expect(used <= floor, f"after empty_cache the process still uses {used / MIB:.0f} MiB more device "
                  f"memory than before its {sum(sizes) / GIB:.1f} GiB of allocations")
    report.expect(held <= floor, f"after empty_cache the allocator still reserves {held / MIB:.0f} MiB")


def case_memory_fraction(report, conf):
    torch = setup(conf)
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(0.05)
    within = torch.empty(int(0.02 * total), dtype=torch.uint8, device="cuda")
    within.fill_(3)
    report.expect(intact(within, 3.0), "an allocation within the fraction holds wrong data")
    del within
    try:
        beyond = torch.empty(int(0.1 * total), dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError as e:
        report.info.update(outcome="OutOfMemoryError", error=str(e).splitlines()[0])
    except RuntimeError as e:
        message = str(e).splitlines()[0]
        report.info.update(outcome="RuntimeError", error=message)
        report.expect("memory" in message.lower(), f"the refusal does not mention memory: {message}")
    else:
        report.failures.append(f"an allocation of 10% of device memory succeeded under a fraction of 5% "
                               f"(data_ptr {beyond.data_ptr():#x})")
        del beyond  # not touched: a null data pointer would fault the context
    after = torch.full((MIB,), 2.0, device="cuda")
    report.expect(intact(after, 2.0), "a small allocation after the refusal holds wrong data")


STAT_KEYS = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
             "reserved_bytes.all.peak", "active.all.current", "num_ooms", "num_alloc_retries",
             "num_device_alloc", "num_device_free")
"""Keys of torch.cuda.memory_stats() that streamalloc.torch.memory_stats() must have."""


def case_stats(report, conf):
    torch = setup(conf)
    import streamalloc
    import streamalloc.torch

    def stats():
        s = streamalloc.torch.memory_stats(0)
        missing = [k for k in STAT_KEYS if not isinstance(s.get(k), int)]
        report.expect(not missing, f"memory_stats() has no integer value for {missing}")
        return s

    alloc, alloc_peak = "allocated_bytes.all.current", "allocated_bytes.all.peak"
    res, res_peak = "reserved_bytes.all.current", "reserved_bytes.all.peak"
    intact(torch.ones(1, device="cuda"), 1.0)
    s0 = stats()
    if report.failures:
        return
    sizes = [2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB]
    xs = [torch.empty(size, dtype=torch.uint8, device="cuda") for size in sizes]
    s1 = stats()
    report.info["after_allocations"] = {k: s1[k] for k in STAT_KEYS}
    grew = s1[alloc] - s0[alloc]
    report.expect(grew == sum(sizes), f"{alloc} grew by {grew} for {sum(sizes)} bytes of tensors")
    live = s1["active.all.current"] - s0["active.all.current"]
    report.expect(live == len(sizes), f"active.all.current grew by {live} for {len(sizes)} tensors")
    report.expect(s1[alloc] == streamalloc.stats(0)["allocated"], f"{alloc} differs from streamalloc.stats")
    report.expect(s1[res] >= s1[alloc], f"{res} ({s1[res]}) is below {alloc} ({s1[alloc]})")
    report.expect(s1[alloc_peak] >= s1[alloc], f"{alloc_peak} is below {alloc}")
    temp = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    del temp
    s2 = stats()
    report.expect(s2[alloc] == s1[alloc], f"{alloc} did not return after a free")
    report.expect(s2[alloc_peak] >= s1[alloc] + 64 * MIB, f"{alloc_peak} missed a 64 MiB allocation")
    streamalloc.torch.reset_peak_memory_stats(0)
    s3 = stats()
    report.expect(s3[alloc_peak] == s3[alloc], f"after reset_peak_memory_stats {alloc_peak} is {s3[alloc_peak]}, "
                  f"not the current {s3[alloc]}")
    report.expect(s3[res_peak] == s3[res], f"after reset_peak_memory_stats {res_peak} is {s3[res_peak]}, "
                  f"not the current {s3[res]}")
    summary = streamalloc.torch.memory_summary(0)
    report.expect(isinstance(summary, str) and summary.strip(), "memory_summary() returned no text")
    del xs


CASES = {name[len("case_"):]: f for name, f in globals().items() if name.startswith("case_")}


def main(argv):
    if len(argv) != 3 or argv[1] not in CASES:
        sys.exit(f"usage: {argv[0]} CASE CONF  (CASE: {', '.join(CASES)})")
    case, conf = argv[1], argv[2]
    Report(case=case, conf=conf).run(CASES[case], conf)


if __name__ == "__main__":
    main(sys.argv)
