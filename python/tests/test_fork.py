"""fork() while another thread is inside the library, on the simulator, in a process of its own
(the library is configured once per process). Run as test_streamalloc.py is:
`python3 python/tests/test_fork.py`, or with pytest.

Issue 33: threads hammering allocate/free while the main thread forked hung most children
(10 to 17 of 20): the child inherits the library's locks as the parent's other thread held
them, and nothing in the child ever unlocks them. CUDA cannot be used in a forked child
anyway; the library refuses every call there at once, touching no lock, and its exit-time
cleanup (the trace's flush) does nothing.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import streamalloc

from test_streamalloc import main

CONF = "device=sim,strategy=stream_safe,sim_capacity=1GiB,trace=/dev/null"
CHILDREN = 20
THREADS = 4
"""Threads hammering the library while the main thread forks."""
BOUND_S = 10.0
"""How long a child may take to exit before it counts as hung."""


def hammer(stop, errors):
    """Allocates, uses, frees, reads statistics and releases until `stop` is set."""
    try:
        sim = streamalloc.sim
        s = sim.create_stream()
        n = 0
        while not stop.is_set():
            n += 1
            p = streamalloc.allocate(4096 * (1 + n % 7), 0, s)
            sim.use(p, 4096, s, 1_000)
            streamalloc.record_stream(p, None)
            streamalloc.deallocate(p)
            streamalloc.stats(0)
            if n % 16 == 0:
                sim.synchronize(s)
                streamalloc.release(0)
    except Exception as e:  # reported by the test
        errors.append(e)


def child():
    """In the forked child: every call is refused with the fork named; then a normal exit
    (the library's atexit handler runs). Exit status 0 when all went as expected."""
    status = 0
    for name, call in [
        ("allocate", lambda: streamalloc.allocate(4096)),
        ("stats", lambda: streamalloc.stats(0)),
        ("release", lambda: streamalloc.release(0)),
        ("deallocate", lambda: streamalloc.deallocate(0x7F00_0000_0000)),
        ("sim.advance", lambda: streamalloc.sim.advance(1)),
        ("configure", lambda: streamalloc.configure(CONF)),
    ]:
        try:
            call()
            print(f"child: {name} was not refused", flush=True)
            status = 1
        except streamalloc.StreamallocError as e:
            if "fork" not in str(e):
                print(f"child: {name}: {e}", flush=True)
                status = 1
    # The framework hooks have no error channel: they must return too.
    lib = streamalloc.load()
    lib.streamalloc_cupy_free(None, None, 0)
    lib.streamalloc_cupy_set_stream_keeper(None)
    sys.exit(status)


def wait_bounded(pid, bound_s):
    """The exit status of child `pid`, or None if it had not exited within `bound_s` (it is
    then killed)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def test_fork_while_another_thread_is_inside_the_library():
    streamalloc.configure(CONF)
    stop, errors = threading.Event(), []
    threads = [threading.Thread(target=hammer, args=(stop, errors)) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    hung, failed = 0, 0
    try:
        for _ in range(CHILDREN):
            time.sleep(0.005)  # let the thread get back into the library
            pid = os.fork()
            if pid == 0:
                try:
                    child()  # leaves by SystemExit, through the interpreter's normal exit
                except Exception:
                    os._exit(3)
            status = wait_bounded(pid, BOUND_S)
            if status is None:
                hung += 1
            elif not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
                failed += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not errors, errors
    assert (hung, failed) == (0, 0), f"of {CHILDREN} children, {hung} hung and {failed} failed"
    # The parent goes on.
    p = streamalloc.allocate(4096)
    streamalloc.deallocate(p)


def test_a_child_forked_before_any_use_may_use_the_library():
    """A process that forks before the library is in use (a multiprocessing worker of a parent
    that only imported the package) is not refused: the parent held nothing."""
    code = (
        "import os, sys, streamalloc\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    streamalloc.configure('device=sim,strategy=plain')\n"
        "    streamalloc.deallocate(streamalloc.allocate(4096))\n"
        "    os._exit(0)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "sys.exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 9)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)


if __name__ == "__main__":
    sys.exit(main(globals()))
