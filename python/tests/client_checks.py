"""Checks that test_rmm.py and test_numba.py make of their front end alike, on the simulator."""

import gc

import streamalloc

MIB = 1 << 20
sim = streamalloc.sim


def ordered_on_their_streams(allocate, s1, s2):
    """Three rounds of: memory allocated on stream `s1` and freed while a kernel on `s1` still
    reads it (5 ms), memory of its size on `s2`, and a small piece on the default stream. `s2`
    must not get the first's memory before that kernel ends (a front end that ignored the
    client's stream would hand it out at once: the ordering checker counts an early reuse),
    and all nine allocations go through streamalloc (its counters move, nothing stays live).

    `allocate(size, stream)` allocates as the client does, on `s1`, `s2` or None (the default
    stream), and returns (the client's object that frees when it goes, its pointer); `s1` and
    `s2` are simulator stream handles."""
    before = streamalloc.stats(0)
    for _ in range(3):
        for stream, size, ns in ((s1, 64 * MIB, 5_000_000), (s2, 64 * MIB, 1_000), (None, MIB, 1_000)):
            held, ptr = allocate(size, stream)
            sim.use(ptr, size, stream, ns)
            del held  # freed while its kernel may still run
    gc.collect()
    sim.synchronize(s1)
    sim.synchronize(s2)
    violations = sim.violations(0)
    assert violations == 0, f"{violations} early reuses: memory was not ordered on its stream"
    after = streamalloc.stats(0)
    assert after["total_allocations"] - before["total_allocations"] == 9, (before, after)
    assert after["live_allocations"] == before["live_allocations"], (before, after)
