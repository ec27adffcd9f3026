#!/usr/bin/env python3
"""Peak device memory of a PyTorch program with a side stream, record_stream and a copy/compute
overlap, under streamalloc's torch backend, with the library's trace and a torch memory
snapshot recorded, for lab/multistream_peak.sh to compare with replays of both.

Each step copies the next batch from pinned host memory on a copy stream while the default
stream computes on the current one (copy/compute overlap: the default stream waits for the
copy and the batch is recorded on it), then a side stream reads the step's activations (a
statistics pass several times longer than the step's compute) after the default stream made
them; the activations are recorded on the side stream and freed on the default stream while
the side stream still reads them, so a stream-ordered allocator must hold their memory back.

The library's trace (`trace=PATH` in --conf) gets, besides allocations, frees and the
`record_stream` rows the backend's record_stream writes, `use` rows for each kind of work (the
copy, the compute, the side pass; written through `streamalloc_trace_use` as the work is
enqueued, lasting what CUDA events measured for that kind in calibration steps run first) and
`wait` rows for each `wait_stream` (`streamalloc_trace_wait`). A use row of a group of tensors
is written for the first with the group's duration, then for the others with 0 ns, so that all
are in use until the group ends.

Prints, and writes as JSON to --json, the peaks torch reports under the backend (the library's
figures): torch.cuda.max_memory_reserved() and max_memory_allocated().

Usage (on the GPU machine, the wheel on PYTHONPATH):
  python3 lab/multistream_peak.py --conf strategy=stream_safe,trace=/tmp/t.csv \\
      --snapshot /tmp/s.pickle --json /tmp/r.json [--steps 24] [--calibration 3]
"""

import argparse
import ctypes
import json
import statistics
import sys

# Imported by main(): --help answers without torch or the package.
torch = streamalloc = None


def trace_functions():
    """The C ABI's `use` and `wait` row writers, typed."""
    lib = streamalloc.load()
    try:
        use, wait = lib.streamalloc_trace_use, lib.streamalloc_trace_wait
    except AttributeError as e:
        sys.exit(f"multistream_peak: {streamalloc.library_path()} lacks the trace functions "
                 f"(a wheel older than issue 37's): {e}")
    use.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
    use.restype = ctypes.c_int
    wait.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    wait.restype = ctypes.c_int
    return use, wait


class Rows:
    """Writes `use` and `wait` rows for device `device` (or nothing, when `enabled` is false)."""

    def __init__(self, device, enabled):
        self.device, self.enabled = device, enabled
        self._use, self._wait = trace_functions()

    def use(self, stream, duration_ns, *tensors):
        """`tensors` are used on `stream` for `duration_ns` from now (the first for the
        duration, the others until it ends)."""
        if not self.enabled:
            return
        for i, t in enumerate(tensors):
            ns = int(duration_ns) if i == 0 else 0
            streamalloc.check(self._use(self.device, t.data_ptr(), stream.cuda_stream, ns))

    def wait(self, stream, other):
        """`stream` waits for the work enqueued so far on `other` (and the row says so)."""
        stream.wait_stream(other)
        if self.enabled:
            streamalloc.check(self._wait(self.device, stream.cuda_stream, other.cuda_stream))


def main():
    global torch, streamalloc
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conf", required=True, help="STREAMALLOC_CONF string, with trace=PATH")
    parser.add_argument("--snapshot", required=True, help="where to dump torch's memory snapshot")
    parser.add_argument("--json", required=True, help="where to write the measured peaks")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--calibration", type=int, default=3, help="steps that measure durations first")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--side-passes", type=int, default=6, help="matmuls of the side stream's pass")
    parser.add_argument("--max-entries", type=int, default=200000)
    args = parser.parse_args()
    import torch

    import streamalloc
    import streamalloc.torch

    if "trace=" not in args.conf:
        sys.exit("multistream_peak: --conf needs trace=PATH (the trace the replays read)")

    # The backend or nothing: under the fallback torch's statistics functions refuse.
    streamalloc.torch.enable(args.conf, backend="backend")
    device = torch.device("cuda", torch.cuda.current_device())
    ordinal = device.index
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.memory._record_memory_history(max_entries=args.max_entries)

    b, d = args.batch, args.width
    w1 = torch.randn(d, d, device=device) / d ** 0.5
    w2 = torch.randn(d, d, device=device) / d ** 0.5
    w_side = torch.randn(d, d, device=device) / d ** 0.5
    hosts = [torch.randn(b, d).pin_memory() for _ in range(2)]
    main_stream = torch.cuda.current_stream()
    copy_stream, side_stream = torch.cuda.Stream(), torch.cuda.Stream()

    durations = {"copy": [], "compute": [], "side": []}
    calibrated = {}

    def timed(kind, stream, work):
        """Runs `work()` enqueued on `stream` between two events; the events."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            result = work()
            end.record(stream)
        pending.append((kind, start, end))
        return result

    def step(i, current, rows):
        """One step on `current` (the batch on the device); the next batch."""
        # The next batch, copied on the copy stream while the default stream computes.
        rows.wait(copy_stream, main_stream)
        nxt = timed("copy", copy_stream, lambda: hosts[(i + 1) % 2].to(device, non_blocking=True))
        rows.use(copy_stream, calibrated.get("copy", 0), nxt)
        # The compute on the current batch.
        def compute():
            h = current @ w1
            act = torch.nn.functional.gelu(h)
            out = act @ w2
            return h, act, out, out.square().mean()

        h, act, out, loss = timed("compute", main_stream, compute)
        rows.use(main_stream, calibrated.get("compute", 0), current, h, act, out)
        # The side stream's statistics pass over the activations, longer than the compute.
        rows.wait(side_stream, main_stream)

        def side_pass():
            s = act
            for _ in range(args.side_passes):
                s = torch.tanh(s @ w_side)
            return s.sum()

        stat = timed("side", side_stream, side_pass)
        rows.use(side_stream, calibrated.get("side", 0), act)
        act.record_stream(side_stream)
        # The default stream waits for the copy before the next step reads the batch.
        rows.wait(main_stream, copy_stream)
        nxt.record_stream(main_stream)
        del h, act, out
        return nxt, loss, stat

    pending = []
    current = hosts[0].to(device)
    # Calibration: each kind of work measured with CUDA events, no rows written.
    quiet = Rows(ordinal, enabled=False)
    for i in range(args.calibration):
        current, loss, stat = step(i, current, quiet)
        torch.cuda.synchronize()
    for kind, start, end in pending:
        durations[kind].append(start.elapsed_time(end) * 1e6)
    calibrated = {kind: statistics.median(ns) for kind, ns in durations.items() if ns}
    # The traced steps: rows written with the calibrated durations, actual ones measured.
    pending = []
    rows = Rows(ordinal, enabled=True)
    losses = []
    for i in range(args.steps):
        current, loss, stat = step(args.calibration + i, current, rows)
        losses.append(loss)
    del current
    torch.cuda.synchronize()
    measured = {kind: [] for kind in durations}
    for kind, start, end in pending:
        measured[kind].append(start.elapsed_time(end) * 1e6)
    # Each traced use row's work as CUDA events measured it, by stream, in row order (the rows
    # were written with the calibrated durations as the work was enqueued; the driver script
    # also replays the trace with these).
    stream_of = {"copy": copy_stream, "compute": main_stream, "side": side_stream}
    measured_by_stream = {str(stream_of[kind].cuda_stream): [round(ns) for ns in measured[kind]]
                          for kind in measured}

    torch.cuda.memory._dump_snapshot(args.snapshot)
    torch.cuda.memory._record_memory_history(enabled=None)
    result = {
        "conf": args.conf,
        "backend": streamalloc.torch.active(),
        "steps": args.steps,
        "max_memory_reserved": torch.cuda.max_memory_reserved(device),
        "max_memory_allocated": torch.cuda.max_memory_allocated(device),
        "library_reserved_peak": streamalloc.stats(ordinal)["reserved_peak"],
        "calibrated_ns": {k: round(v) for k, v in calibrated.items()},
        "measured_median_ns": {k: round(statistics.median(v)) for k, v in measured.items() if v},
        "measured_ns_by_stream": measured_by_stream,
        "loss": float(torch.stack(losses).mean()),
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
