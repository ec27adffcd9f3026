"""Tags, sleep and wake from Python (issue 36), on the simulator, in a process of its own (the
library is configured once per process). Run as test_streamalloc.py is:
`python3 python/tests/test_sleep.py`, or with pytest.

The simulator's ordering checker sees every allocation handed out and refuses (and counts) an
unmap under a simulated kernel, so a sleep that did not wait for the streams using the memory
shows as a violation.
"""

import os
import subprocess
import sys
import threading

import streamalloc
import streamalloc.torch

from test_streamalloc import main, raises

CONF = "device=sim,sim_capacity=1GiB"
MIB = 1 << 20


def setup():
    streamalloc.configure(CONF)
    return streamalloc.sim


def test_tagged_memory_sleeps_and_wakes_at_its_addresses():
    sim = setup()
    s, busy = sim.create_stream(), sim.create_stream()
    with streamalloc.tag("kv_cache"):
        kv = streamalloc.allocate(8 * MIB, 0, s)
        with streamalloc.tag("weights"):
            w = streamalloc.allocate(4 * MIB, 0, s)
    plain = streamalloc.allocate(8 * MIB, 0, busy)
    sim.use(kv, 8 * MIB, s, 1_000_000)
    sim.use(plain, 8 * MIB, busy, 10**9)
    before = streamalloc.stats()
    streamalloc.sleep(["kv_cache", "weights"], offload=True)
    kv_stats = streamalloc.tag_stats("kv_cache")
    assert kv_stats["asleep"] and kv_stats["offloaded"] and kv_stats["slept"] >= 8 * MIB, kv_stats
    assert kv_stats["reserved"] == 0 and kv_stats["live_allocations"] == 1, kv_stats
    slept = kv_stats["slept"] + streamalloc.tag_stats("weights")["slept"]
    assert before["reserved"] - streamalloc.stats()["reserved"] == slept, (before, streamalloc.stats())
    streamalloc.wake("kv_cache")
    assert not streamalloc.tag_stats("kv_cache")["asleep"]
    assert streamalloc.tag_stats("weights")["asleep"], "only the tags named wake"
    streamalloc.wake(["weights"])
    assert streamalloc.stats()["reserved"] == before["reserved"]
    for p in (kv, w, plain):
        streamalloc.deallocate(p)
    assert sim.violations() == 0


def test_each_misuse_has_its_answer():
    sim = setup()
    s = sim.create_stream()
    with streamalloc.tag("activations"):
        a = streamalloc.allocate(4 * MIB, 0, s)
    streamalloc.sleep("activations")
    streamalloc.sleep("activations", offload=True)  # sleeps already: nothing
    with streamalloc.tag("activations"):
        raises(streamalloc.StreamallocError, lambda: streamalloc.allocate(MIB, 0, s), "INVALID_ARGUMENT",
               "`activations`", "sleeps")
    with streamalloc.tag("other"):
        streamalloc.deallocate(streamalloc.allocate(MIB, 0, s))
    streamalloc.deallocate(a)  # freeing a sleeping tag's allocation is allowed
    assert streamalloc.tag_stats("activations")["live_allocations"] == 0
    streamalloc.release()
    streamalloc.wake("activations")
    streamalloc.wake("activations")  # awake already: nothing
    raises(TypeError, lambda: streamalloc.tag(3), "tag must be a str")
    raises(ValueError, lambda: streamalloc.sleep(["a\0b"]), "NUL")
    raises(TypeError, lambda: streamalloc.wake([None]), "each tag")
    raises(streamalloc.StreamallocError, lambda: streamalloc.tag("").__enter__(), "INVALID_ARGUMENT")
    assert streamalloc.tag_stats("never used") == {**streamalloc.tag_stats("never used"), "asleep": False}
    assert sim.violations() == 0


def test_the_tag_is_the_threads_own():
    sim = setup()
    s = sim.create_stream()
    seen = []
    with streamalloc.tag("mine"):
        worker = threading.Thread(target=lambda: seen.append(streamalloc.allocate(MIB, 0, s)))
        worker.start()
        worker.join()
        p = streamalloc.allocate(MIB, 0, s)
    assert streamalloc.tag_stats("mine")["live_allocations"] == 1, "the other thread's allocation is untagged"
    streamalloc.deallocate(p)
    streamalloc.deallocate(seen[0])


def test_under_torch_the_same_functions_take_a_device():
    sim = setup()
    s = sim.create_stream()
    assert streamalloc.torch.tag is streamalloc.tag
    with streamalloc.torch.tag("torch_kv"):
        p = streamalloc.allocate(2 * MIB, 0, s)
    streamalloc.torch.sleep(["torch_kv"], offload=True, device=0)
    assert streamalloc.tag_stats("torch_kv")["asleep"]
    streamalloc.torch.wake(["torch_kv"], device=0)
    streamalloc.deallocate(p)
    assert sim.violations() == 0


def test_a_configuration_that_cannot_sleep_says_so():
    code = ("import streamalloc\n"
            "with streamalloc.tag('kv'):\n"
            "    p = streamalloc.allocate(1 << 20)\n"
            "try:\n"
            "    streamalloc.sleep(['kv'])\n"
            "except streamalloc.StreamallocError as e:\n"
            "    print(e)\n"
            "streamalloc.deallocate(p)\n")
    env = dict(os.environ, STREAMALLOC_CONF="device=sim,sim_capacity=1GiB,strategy=async")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "UNSUPPORTED" in out.stdout and "strategy=async" in out.stdout, out.stdout + out.stderr


def test_a_dropped_tag_gives_its_memory_back():
    """Issue 52, #7: drop_tag forgets a tag: refused while its tensors are alive, then its
    pool's memory goes back (the process's reserved figure falls to what it was), and the
    name serves again."""
    sim = setup()
    s = sim.create_stream()
    before = streamalloc.stats()["reserved"]
    with streamalloc.tag("scratch"):
        p = streamalloc.allocate(6 * MIB, 0, s)
    raises(streamalloc.StreamallocError, lambda: streamalloc.drop_tag("scratch"), "INVALID_ARGUMENT", "live")
    streamalloc.deallocate(p)
    assert streamalloc.tag_stats("scratch")["reserved"] > 0
    streamalloc.drop_tag("scratch")
    assert streamalloc.tag_stats("scratch")["reserved"] == 0
    assert streamalloc.stats()["reserved"] == before, (before, streamalloc.stats())
    with streamalloc.tag("scratch"):
        p = streamalloc.allocate(MIB, 0, s)
    streamalloc.deallocate(p)
    streamalloc.drop_tag("scratch")
    assert sim.violations() == 0


def test_a_wake_keeps_to_the_memory_fraction():
    """Issue 52, #15: a 32 MiB tag woke under a limit of 51 MiB with 32 MiB untagged live.
    Now the wake is refused (the tag sleeps on) until the memory fits, then it wakes. In a
    process of its own: the limit stays for the process."""
    code = ("import ctypes, streamalloc\n"
            "MIB = 1 << 20\n"
            "with streamalloc.tag('kv'):\n"
            "    t = streamalloc.allocate(32 * MIB)\n"
            "streamalloc.sleep(['kv'])\n"
            "u = streamalloc.allocate(32 * MIB)\n"
            "lib = streamalloc.load()\n"
            "lib.streamalloc_set_memory_fraction.argtypes = [ctypes.c_int, ctypes.c_double]\n"
            "streamalloc.check(lib.streamalloc_set_memory_fraction(0, 0.2))\n"
            "try:\n"
            "    streamalloc.wake('kv')\n"
            "    print('woke')\n"
            "except streamalloc.StreamallocError as e:\n"
            "    print('refused:', e)\n"
            "print('asleep:', streamalloc.tag_stats('kv')['asleep'])\n"
            "streamalloc.deallocate(u)\n"
            "streamalloc.wake('kv')\n"
            "print('then asleep:', streamalloc.tag_stats('kv')['asleep'])\n"
            "streamalloc.deallocate(t)\n")
    env = dict(os.environ, STREAMALLOC_CONF="device=sim,sim_capacity=256MiB")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "refused:" in out.stdout and "limit" in out.stdout, text
    assert "asleep: True" in out.stdout and "then asleep: False" in out.stdout, text


if __name__ == "__main__":
    sys.exit(main(globals()))
