"""Fuzzes the C path against the simulator's ordering checker.

`python3 python/tests/sim_fuzz.py CONF OPS SEED [--no-record]` configures the library with
CONF (which must say device=sim), runs OPS random operations over four simulated streams
through the C API (allocate, free, a kernel on another stream using an allocation, time
passing, synchronizations, release) and prints `violations N`. Every allocation is checked as
it is handed out. With --no-record the kernels on other streams are not announced with
record_stream: a correct program must announce them, so the checker should then find early
reuses (the negative control); a release that refuses to unmap memory such a kernel still
uses (the simulator's check of virtual-memory backings) is counted as `refused`, not raised.
"""

import random
import sys

import streamalloc


def main():
    conf, ops, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    record = "--no-record" not in sys.argv
    streamalloc.configure(conf)
    sim = streamalloc.sim
    rng = random.Random(seed)
    streams = [sim.create_stream() for _ in range(4)]
    live = []  # (ptr, size, owning stream)
    failed = 0
    refused = 0
    for _ in range(ops):
        r = rng.random()
        if r < 0.33 or not live:
            size = rng.choice([rng.randrange(1, 4096), rng.randrange(4096, 1 << 20), rng.randrange(1 << 20, 8 << 20)])
            stream = rng.choice(streams)
            try:
                ptr = streamalloc.allocate(size, 0, stream)
            except streamalloc.StreamallocError:
                failed += 1
                continue
            sim.use(ptr, size, stream, 1_000)  # the owner writes it first
            live.append((ptr, size, stream))
        elif r < 0.65:
            ptr, _, _ = live.pop(rng.randrange(len(live)))
            streamalloc.deallocate(ptr)
        elif r < 0.90:
            ptr, size, owner = live[rng.randrange(len(live))]
            user = rng.choice(streams)
            if record and user != owner:
                streamalloc.record_stream(ptr, user)
            sim.use(ptr, size, user, rng.randrange(1, 2_000_000))
        elif r < 0.96:
            sim.advance(rng.randrange(1, 500_000))
        elif r < 0.99:
            sim.synchronize(rng.choice(streams))
        else:
            try:
                streamalloc.release(0)
            except streamalloc.StreamallocError as e:
                if record or "while stream" not in str(e):
                    raise
                refused += 1
    for ptr, _, _ in live:
        streamalloc.deallocate(ptr)
    stats = streamalloc.stats(0)
    assert stats["live_allocations"] == 0, stats
    print(f"violations {sim.violations()} failed {failed} refused {refused}")


if __name__ == "__main__":
    main()
