#!/usr/bin/env python3
"""Writes a PyTorch memory snapshot (the pickle `torch.cuda.memory._dump_snapshot` writes) of a
made-up workload, without torch or a GPU, for the tests of `streamalloc import`.

The structure is the one torch writes: a dict with 'segments' (the caching allocator's
segments at the time of the dump, each with its 'blocks') and 'device_traces' (one list per
device of trace entries: 'action', 'addr', 'size', 'stream', 'time_us', 'frames', ...).
The workload: a few "steps" of a training loop on two streams (the default stream 0 and a
side stream), with what a real recording has at its edges:

  * frees of blocks allocated before recording began (the ring buffer of
    `_record_memory_history(max_entries=...)` dropped their allocations),
  * blocks still live at the dump (weights, optimizer state),
  * frees whose completion waits on another stream ('free_requested' then, later,
    'free_completed'), segment_alloc / segment_free entries, and with --no-time, entries
    without 'time_us' (older torch versions).

Usage: fabricate_snapshot.py OUT.pickle [--steps N] [--no-time] [--protocol P]
"""

import argparse
import pickle

SIDE_STREAM = 94_000_000_000_000  # a cudaStream_t value as torch writes it (an int)
BASE = 0x7F00_0000_0000


def frames(name):
    return [{"filename": "train.py", "line": 42, "name": name}]


class Recorder:
    def __init__(self, with_time):
        self.entries = []
        self.clock = 1_796_198_205_242_056
        self.with_time = with_time
        self.next_addr = BASE
        self.free_addrs = {}  # size -> [addr] released blocks for reuse, like a caching allocator

    def entry(self, action, addr, size, stream):
        self.clock += 7
        e = {"action": action, "addr": addr, "size": size, "stream": stream, "frames": frames(action)}
        if self.with_time:
            e["time_us"] = self.clock
        e["compile_context"] = "N/A"
        e["user_metadata"] = ""
        self.entries.append(e)

    def alloc(self, size, stream=0):
        reuse = self.free_addrs.get(size)
        if reuse:
            addr = reuse.pop()
        else:
            addr = self.next_addr
            self.next_addr += (size + 511) // 512 * 512
            self.entry("segment_alloc", addr, (size + 511) // 512 * 512, stream)
        self.entry("alloc", addr, size, stream)
        return addr

    def free(self, addr, size, stream=0, completes_later=False):
        self.entry("free_requested", addr, size, stream)
        if not completes_later:
            self.entry("free_completed", addr, size, stream)
            self.free_addrs.setdefault(size, []).append(addr)

    def complete(self, addr, size, stream=0):
        self.entry("free_completed", addr, size, stream)
        self.free_addrs.setdefault(size, []).append(addr)


def snapshot(steps, with_time):
    r = Recorder(with_time)
    # Frees of activations allocated before recording began (not in this trace).
    for i in range(3):
        r.entry("free_requested", BASE - 0x10_0000 * (i + 1), 4096 << i, 0)
        r.entry("free_completed", BASE - 0x10_0000 * (i + 1), 4096 << i, 0)
    weights = [r.alloc(1 << 20) for _ in range(4)]
    optimizer_state = []
    for step in range(steps):
        acts = [r.alloc((64 << 10) * (k + 1)) for k in range(6)]
        staged = r.alloc(256 << 10, SIDE_STREAM)  # a copy on the side stream
        grads = [r.alloc(1 << 20) for _ in weights]
        for k, a in reversed(list(enumerate(acts))):
            r.free(a, (64 << 10) * (k + 1))
        # Used on the default stream too (record_stream): its free completes later.
        r.free(staged, 256 << 10, SIDE_STREAM, completes_later=True)
        if step == 0:
            optimizer_state = [r.alloc(2 << 20) for _ in weights]
        for g in grads:
            r.free(g, 1 << 20)
        r.complete(staged, 256 << 10, SIDE_STREAM)
    r.entry("snapshot", 0, 0, 0)
    live = weights + optimizer_state
    segments = [
        {
            "device": 0,
            "address": a,
            "total_size": 2 << 20,
            "allocated_size": 1 << 20,
            "active_size": 1 << 20,
            "requested_size": 1 << 20,
            "stream": 0,
            "segment_type": "large",
            "segment_pool_id": (0, 0),
            "is_expandable": False,
            "frames": frames("segment"),
            "blocks": [
                {"address": a, "size": 1 << 20, "requested_size": 1 << 20, "state": "active_allocated",
                 "frames": frames("block")},
            ],
        }
        for a in live
    ]
    return {
        "segments": segments,
        "device_traces": [r.entries, []],  # two devices, the second idle
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False},
        "external_annotations": [],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-time", action="store_true", help="leave 'time_us' out, as older torch does")
    parser.add_argument("--protocol", type=int, default=pickle.DEFAULT_PROTOCOL)
    args = parser.parse_args()
    with open(args.out, "wb") as f:
        pickle.dump(snapshot(args.steps, not args.no_time), f, protocol=args.protocol)


if __name__ == "__main__":
    main()
