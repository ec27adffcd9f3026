#!/usr/bin/env python3
"""Writes a PyTorch memory snapshot (the pickle `torch.cuda.memory._dump_snapshot` writes) of a
made-up workload, without torch or a GPU, for the tests of `streamalloc import`.

The structure is the one torch writes: a dict with 'segments' (the caching allocator's
segments at the time of the dump, each with its 'blocks') and 'device_traces' (one list per
device of trace entries: 'action', 'addr', 'size', 'stream', 'time_us', 'frames', ...).
The workload: "steps" of a training loop on two streams (the default stream 0 and a side
stream), with what a real recording has at its edges:

  * frees of blocks allocated before recording began (the ring buffer of
    `_record_memory_history(max_entries=...)` dropped their allocations),
  * blocks still live at the dump (weights, optimizer state),
  * frees whose completion waits on another stream ('free_requested' then, later,
    'free_completed'), segment_alloc / segment_free entries, and with --no-time, entries
    without 'time_us' (older torch versions).

By default the snapshot is built in memory and written by Python's pickle, each entry with one
frame. With --streaming (or --target-size, which runs steps until the file has that many
bytes) the pickle (protocol 4, as torch writes it) is written entry by entry by this script
itself, in constant memory and fast: the same entries (so the same trace), each with --frames
new frame dicts and as many references to frames of the entry before (torch shares frames
between entries), the bulk of a real snapshot's bytes.

Prints a JSON summary to stdout: the file's bytes, the entries of device 0, the most bytes
allocated at once (each 'alloc' adds its size, each 'free_requested' of a block allocated in
the trace takes it away: torch's allocated_bytes) and the frees completed later.

Usage: fabricate_snapshot.py OUT.pickle [--steps N] [--no-time] [--protocol P]
                             [--streaming] [--frames K] [--target-size BYTES[K|M|G]]
"""

import argparse
import itertools
import json
import os
import pickle
import struct

SIDE_STREAM = 94_000_000_000_000  # a cudaStream_t value as torch writes it (an int)
BASE = 0x7F00_0000_0000
BATCH = 1000  # items per APPENDS / SETITEMS, as Python's pickler writes them


def frames(name):
    return [{"filename": "train.py", "line": 42, "name": name}]


class Recorder:
    """Records the workload's entries, handing each (action, addr, size, stream, time_us or
    None) to `sink`."""

    def __init__(self, with_time, sink):
        self.sink = sink
        self.clock = 1_796_198_205_242_056
        self.with_time = with_time
        self.next_addr = BASE
        self.free_addrs = {}  # size -> [addr] released blocks for reuse, like a caching allocator
        self.entries = 0
        self.allocated = 0
        self.peak = 0
        self.deferred = 0

    def entry(self, action, addr, size, stream):
        self.clock += 7
        self.entries += 1
        self.sink(action, addr, size, stream, self.clock if self.with_time else None)

    def alloc(self, size, stream=0):
        reuse = self.free_addrs.get(size)
        if reuse:
            addr = reuse.pop()
        else:
            addr = self.next_addr
            self.next_addr += (size + 511) // 512 * 512
            self.entry("segment_alloc", addr, (size + 511) // 512 * 512, stream)
        self.entry("alloc", addr, size, stream)
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        return addr

    def free(self, addr, size, stream=0, completes_later=False):
        self.entry("free_requested", addr, size, stream)
        self.allocated -= size
        if completes_later:
            self.deferred += 1
        else:
            self.entry("free_completed", addr, size, stream)
            self.free_addrs.setdefault(size, []).append(addr)

    def complete(self, addr, size, stream=0):
        self.entry("free_completed", addr, size, stream)
        self.free_addrs.setdefault(size, []).append(addr)


def workload(r, steps, done):
    """Runs the workload on `r` for `steps` steps (or, when None, until `done()`); returns the
    blocks live at the end."""
    # Frees of activations allocated before recording began (not in this trace).
    for i in range(3):
        r.entry("free_requested", BASE - 0x10_0000 * (i + 1), 4096 << i, 0)
        r.entry("free_completed", BASE - 0x10_0000 * (i + 1), 4096 << i, 0)
    weights = [r.alloc(1 << 20) for _ in range(4)]
    optimizer_state = []
    for step in itertools.count():
        if (steps is not None and step >= steps) or (steps is None and done()):
            break
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
    return weights + optimizer_state


def segments(live):
    return [
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


SETTINGS = {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False}


def snapshot(steps, with_time):
    """The snapshot, built in memory, and its recorder."""
    entries = []

    def sink(action, addr, size, stream, time_us):
        e = {"action": action, "addr": addr, "size": size, "stream": stream, "frames": frames(action)}
        if time_us is not None:
            e["time_us"] = time_us
        e["compile_context"] = "N/A"
        e["user_metadata"] = ""
        entries.append(e)

    r = Recorder(with_time, sink)
    live = workload(r, steps, None)
    return {
        "segments": segments(live),
        "device_traces": [entries, []],  # two devices, the second idle
        "allocator_settings": SETTINGS,
        "external_annotations": [],
    }, r


class StreamingPickle:
    """Writes a protocol 4 pickle by hand, as Python's pickler would (every string, dict,
    list and tuple stored in the memo, a string written again as a reference to it), without
    holding what it wrote."""

    def __init__(self, out, frames_per_entry):
        self.out = out
        self.size = 0
        self.memo = 0  # the number of objects stored in the memo so far
        self.strings = {}  # string -> its memo id
        self.frames = frames_per_entry
        self.frame_blob = None  # the bytes of an entry's new frames, once all their strings are stored
        self.last_frames = []  # memo ids of the entry before's new frames

    def write(self, data):
        self.out.write(data)
        self.size += len(data)

    def stored(self):
        """MEMOIZE: stores the object just written; its id."""
        self.memo += 1
        return self.memo - 1

    @staticmethod
    def get(ident):
        return b"h" + bytes([ident]) if ident < 256 else b"j" + struct.pack("<I", ident)

    def value(self, v):
        """The bytes of `v` (None, bool, int, str, tuple, list, dict)."""
        if v is None:
            return b"N"
        if v is True or v is False:
            return b"\x88" if v else b"\x89"
        if isinstance(v, int):
            if 0 <= v < 256:
                return b"K" + bytes([v])
            if 0 <= v < 65536:
                return b"M" + struct.pack("<H", v)
            if -(2**31) <= v < 2**31:
                return b"J" + struct.pack("<i", v)
            data = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            return b"\x8a" + bytes([len(data)]) + data
        if isinstance(v, str):
            if v in self.strings:
                return self.get(self.strings[v])
            data = v.encode()
            self.strings[v] = self.stored()
            head = b"\x8c" + bytes([len(data)]) if len(data) < 256 else b"X" + struct.pack("<I", len(data))
            return head + data + b"\x94"
        if isinstance(v, tuple):
            parts = [self.value(x) for x in v]  # at most 3 items here
            self.stored()
            return b"".join(parts) + bytes([0x84 + len(v)]) + b"\x94"
        if isinstance(v, list):
            self.stored()
            return b"]\x94" + self.batches([self.value(x) for x in v], b"e")
        if isinstance(v, dict):
            self.stored()
            items = [self.value(k) + self.value(x) for k, x in v.items()]
            return b"}\x94" + self.batches(items, b"u")
        raise TypeError(type(v))

    @staticmethod
    def batches(items, op):
        return b"".join(b"(" + b"".join(items[i : i + BATCH]) + op for i in range(0, len(items), BATCH))

    def new_frames(self):
        """The entry's new frame dicts: their bytes and memo ids."""
        if self.frame_blob is not None:
            first = self.memo
            self.memo += self.frames
            return self.frame_blob, range(first, self.memo)
        before = len(self.strings)
        parts, ids = [], []
        for k in range(self.frames):
            ids.append(self.memo)
            frame = {"filename": f"model/layer{k % 4}.py", "line": 40 + k, "name": f"forward_{k}"}
            parts.append(self.value(frame))
        blob = b"".join(parts)
        if len(self.strings) == before:
            self.frame_blob = blob
        return blob, ids

    def entry(self, action, addr, size, stream, time_us):
        """The bytes of a trace entry (its dict), as torch's snapshot holds it."""
        v = self.value
        self.stored()
        fields = v("action") + v(action) + v("addr") + v(addr) + v("size") + v(size) + v("stream") + v(stream)
        key = v("frames")
        self.stored()
        blob, ids = self.new_frames()
        shared = b"".join(self.get(i) for i in self.last_frames)
        self.last_frames = ids
        frames_list = key + b"]\x94" + (b"(" + blob + shared + b"e" if blob or shared else b"")
        timed = v("time_us") + v(time_us) if time_us is not None else b""
        rest = v("compile_context") + v("N/A") + v("user_metadata") + v("")
        return b"}\x94(" + fields + frames_list + timed + rest + b"u"


def write_streaming(path, steps, with_time, frames_per_entry, target_size):
    """Writes the snapshot entry by entry; returns its recorder."""
    with open(path, "wb") as out:
        p = StreamingPickle(out, frames_per_entry)
        p.write(b"\x80\x04")
        p.stored()
        p.write(b"}\x94(" + p.value("device_traces"))
        p.stored()
        p.stored()
        p.write(b"]\x94(]\x94")  # the devices; device 0's entries
        in_batch = 0

        def sink(action, addr, size, stream, time_us):
            nonlocal in_batch
            p.write((b"(" if in_batch == 0 else b"") + p.entry(action, addr, size, stream, time_us))
            in_batch += 1
            if in_batch == BATCH:
                p.write(b"e")
                in_batch = 0

        r = Recorder(with_time, sink)
        live = workload(r, steps, lambda: p.size >= target_size)
        p.write((b"e" if in_batch else b"") + p.value([]) + b"e")  # device 1, idle
        rest = {"segments": segments(live), "allocator_settings": SETTINGS, "external_annotations": []}
        p.write(b"".join(p.value(k) + p.value(x) for k, x in rest.items()) + b"u.")
    return r


def size_arg(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1:].upper() in units:
        return int(float(text[:-1]) * units[text[-1:].upper()])
    return int(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=None, help="steps of the workload (default 3)")
    parser.add_argument("--no-time", action="store_true", help="leave 'time_us' out, as older torch does")
    parser.add_argument("--protocol", type=int, default=pickle.DEFAULT_PROTOCOL)
    parser.add_argument("--streaming", action="store_true", help="write entry by entry (protocol 4)")
    parser.add_argument("--frames", type=int, default=16, choices=range(0, 501), metavar="K",
                        help="new frames per entry with --streaming (0 to 500, default 16)")
    parser.add_argument("--target-size", type=size_arg, help="run steps until the file has this many bytes")
    args = parser.parse_args()
    if args.target_size is not None and args.steps is not None:
        parser.error("--steps and --target-size exclude each other")
    if args.streaming or args.target_size is not None:
        steps = None if args.target_size is not None else 3 if args.steps is None else args.steps
        r = write_streaming(args.out, steps, not args.no_time, args.frames, args.target_size or 0)
    else:
        snap, r = snapshot(3 if args.steps is None else args.steps, not args.no_time)
        with open(args.out, "wb") as f:
            pickle.dump(snap, f, protocol=args.protocol)
    summary = {"bytes": os.path.getsize(args.out), "entries": r.entries, "peak_allocated_bytes": r.peak,
               "deferred_frees": r.deferred}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
