#!/usr/bin/env python3
"""Tags, sleep and wake under streamalloc's torch backend (issue 36), one case under one
configuration per process, through torch's own APIs.

    python3 python/tests/gpu/sleep_cases.py CASE CONF

CONF is a streamalloc configuration (e.g. "strategy=stream_safe", the default's strategy over
stitched ranges), installed with streamalloc.torch.enable(CONF, backend="backend") before the
first CUDA allocation, or "pluggable:CONF" for torch's CUDAPluggableAllocator path.

Cases (each checks real results, data read back):

  graph     a model's weights (tag "weights") and a static input and KV-like buffer (tag
            "kv_cache") are captured in a CUDA graph (torch.cuda.graph); both tags sleep with
            offload, a training step of another (untagged) model runs and takes the memory
            they gave back (the driver's free memory shows it), the tags wake, and replays of
            the graph give the outputs captured before the sleep, and new ones for new inputs
  contents  tensors of several dtypes and sizes under two tags, offloaded: equal after the wake
            at the same data_ptr()s; slept without offload: same addresses, usable again; the
            driver's free memory grows by the bytes slept (within a granule) and shrinks back
  misuse    allocating under a sleeping tag raises naming the tag; sleeping what sleeps and
            waking what is awake do nothing; freeing a sleeping tag's tensors and
            torch.cuda.empty_cache() while it sleeps are allowed; other tags and untagged
            tensors go on

Output and exit status: see casekit.py.
"""

import sys

from casekit import MIB, run_worker

GRANULE = 2 * MIB
"""The mapping granularity of NVIDIA GPUs (cuMemGetAllocationGranularity): figures compared
with the driver's are within one."""


def setup(conf):
    """Imports torch with streamalloc (CONF) installed; returns torch and streamalloc."""
    import torch

    import streamalloc
    import streamalloc.torch

    if conf.startswith("pluggable:"):
        streamalloc.torch.enable(conf[len("pluggable:"):], backend="pluggable")
    else:
        streamalloc.torch.enable(conf, backend="backend")
    torch.cuda.init()
    return torch, streamalloc


def free_bytes(torch):
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def settled_free_bytes(torch):
    """The driver's free memory once every pool gave back its free memory (empty_cache), so
    that what a sleep gives back beyond that is what it slept."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return free_bytes(torch)


def case_graph(report, conf):
    torch, sa = setup(conf)
    torch.manual_seed(0)
    with sa.torch.tag("weights"):
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    with sa.torch.tag("kv_cache"):
        static_x = torch.randn(256, 1024, device="cuda")
        kv = torch.randn(64, 1024, 1024, device="cuda")  # 256 MiB that the graph reads
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y = model(static_x) + kv[:, :256, :].sum(0)[: static_x.shape[0]]
    graph.replay()
    expected = static_y.clone()
    x2 = torch.randn(256, 1024, device="cuda")
    with torch.no_grad():
        expected2 = model(x2) + kv[:, :256, :].sum(0)
    addresses = [p.data_ptr() for p in model.parameters()] + [static_x.data_ptr(), kv.data_ptr()]
    before = settled_free_bytes(torch)
    sa.torch.sleep(["weights", "kv_cache"], offload=True)
    asleep = free_bytes(torch)
    slept = sa.tag_stats("weights")["slept"] + sa.tag_stats("kv_cache")["slept"]
    report.info.update(slept=slept, freed=asleep - before)
    report.expect(abs((asleep - before) - slept) <= GRANULE,
                  f"the driver's free memory grew by {asleep - before} bytes, not the {slept} slept")
    # A training step of another model takes the memory given back.
    other = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).cuda()
    opt = torch.optim.AdamW(other.parameters())
    big = torch.empty(slept // 2, dtype=torch.uint8, device="cuda").fill_(0xAB)
    loss = other(torch.randn(512, 4096, device="cuda")).square().mean()
    loss.backward()
    opt.step()
    del big, other, opt, loss
    torch.cuda.synchronize()
    sa.torch.wake(["weights", "kv_cache"])
    report.expect([p.data_ptr() for p in model.parameters()] + [static_x.data_ptr(), kv.data_ptr()] == addresses,
                  "a tensor moved")
    static_y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    report.expect(torch.equal(static_y, expected), "a replay after the wake gave other outputs than before the sleep")
    static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    report.expect(torch.allclose(static_y, expected2, rtol=1e-4, atol=1e-3),
                  "a replay for a new input gave outputs other than the eager model's")


def case_contents(report, conf):
    torch, sa = setup(conf)
    torch.manual_seed(1)
    with sa.torch.tag("weights"):
        tensors = [torch.randn(4097, 333, device="cuda"), torch.randint(0, 255, (77 * MIB + 5,), dtype=torch.uint8,
                                                                        device="cuda")]
    with sa.torch.tag("kv_cache"):
        tensors += [torch.randn(8, 1 << 20, device="cuda", dtype=torch.float16), torch.arange(12345, device="cuda")]
    copies = [t.cpu() for t in tensors]
    ptrs = [t.data_ptr() for t in tensors]
    # The scratch tensor below is filled by a kernel not run yet; its first launch loads its
    # module, which takes device memory of its own (CUDA's lazy loading): loaded here, before
    # the figures the allocator is judged by.
    unloaded = settled_free_bytes(torch)
    torch.full((1,), 7, dtype=torch.int32, device="cuda")
    before = settled_free_bytes(torch)
    report.info["module_load"] = unloaded - before
    sa.torch.sleep(["weights", "kv_cache"], offload=True)
    asleep = free_bytes(torch)
    slept = sa.tag_stats("weights")["slept"] + sa.tag_stats("kv_cache")["slept"]
    report.info.update(slept=slept, freed=asleep - before)
    report.expect(slept >= sum(t.numel() * t.element_size() for t in tensors), f"only {slept} bytes slept")
    report.expect(abs((asleep - before) - slept) <= GRANULE,
                  f"the driver's free memory grew by {asleep - before} bytes, not the {slept} slept")
    scratch = torch.full((slept // 4,), 7, dtype=torch.int32, device="cuda")  # reuses the physical memory
    del scratch
    torch.cuda.empty_cache()  # the scratch's memory, cached by the untagged pools, goes back
    emptied = free_bytes(torch)
    report.info["free_after_scratch"] = emptied
    report.expect(abs(emptied - asleep) <= GRANULE,
                  f"after the scratch tensor and empty_cache the driver's free memory is {emptied} bytes, "
                  f"not the {asleep} of the sleep")
    sa.torch.wake(["weights", "kv_cache"])
    after = settled_free_bytes(torch)
    report.info["free_after_wake"] = after
    report.expect(abs(after - before) <= GRANULE,
                  f"after the wake the driver's free memory is {after} bytes, not the {before} of before the sleep")
    report.expect([t.data_ptr() for t in tensors] == ptrs, "a tensor moved")
    report.expect(all(torch.equal(t.cpu(), c) for t, c in zip(tensors, copies)), "contents differ after the wake")
    sa.torch.sleep(["kv_cache"])  # no offload: same addresses, contents undefined, usable again
    sa.torch.wake(["kv_cache"])
    tensors[2].fill_(3)
    report.expect(float(tensors[2].float().mean()) == 3.0, "a tensor woken without offload is not usable")


def case_misuse(report, conf):
    torch, sa = setup(conf)
    with sa.torch.tag("kv_cache"):
        kv = torch.ones(16 * MIB, device="cuda")
        gone = torch.ones(MIB, device="cuda")
    sa.torch.sleep(["kv_cache"], offload=True)
    sa.torch.sleep(["kv_cache"], offload=True)
    try:
        with sa.torch.tag("kv_cache"):
            torch.empty(MIB, device="cuda")
        report.expect(False, "allocating under a sleeping tag succeeded")
    except RuntimeError as e:
        report.expect("kv_cache" in str(e) and "sleeps" in str(e), f"the error does not name the tag: {e}")
    with sa.torch.tag("weights"):
        w = torch.ones(MIB, device="cuda")
    plain = torch.ones(MIB, device="cuda")
    del gone
    torch.cuda.empty_cache()
    report.expect(sa.tag_stats("kv_cache")["asleep"], "empty_cache woke the tag")
    sa.torch.wake(["kv_cache"])
    sa.torch.wake(["kv_cache"])
    report.expect(bool((kv == 1).all()) and bool((w == 1).all()) and bool((plain == 1).all()), "contents are wrong")
    with sa.torch.tag("kv_cache"):
        again = torch.zeros(MIB, device="cuda")
    report.expect(float(again.sum()) == 0.0, "the woken tag does not allocate")


CASES = {name[len("case_"):]: f for name, f in globals().items() if name.startswith("case_")}


if __name__ == "__main__":
    run_worker(sys.argv, CASES)
