#!/usr/bin/env python3
"""A release racing frees through PyTorch (issue 33), one allocator per process.

    python3 python/tests/gpu/race_cases.py release_race CONF [SECONDS]

One thread gives the cache back in a loop (`streamalloc.release(0)` and
`torch.cuda.empty_cache()`, or only the latter under PyTorch's own allocators) while the
main thread allocates matrices of changing sizes, multiplies them and frees them, for
SECONDS (default 20). Memory given back while a kernel still uses it is an illegal address
on the GPU (the process's CUDA context is lost) or wrong products; every product is checked
against its exact value. CONF is as in torch_cases.py ("native" and "cudaMallocAsync" are
PyTorch's own allocators, the controls).

Output and exit status: see casekit.py.
"""

import random
import sys
import threading
import time

from casekit import Report
from torch_cases import CONTROLS, setup


def case_release_race(report, conf, seconds="20"):
    torch = setup(conf)
    release = None
    if conf not in CONTROLS:
        import streamalloc

        release = streamalloc.release
    stop = threading.Event()
    releases, errors = [0], []

    def releaser():
        while not stop.is_set():
            try:
                if release is not None:
                    release(0)
                torch.cuda.empty_cache()
                releases[0] += 1
            except Exception as e:  # reported as the case's failure
                errors.append(f"release raised {type(e).__name__}: {e}")
                stop.set()

    thread = threading.Thread(target=releaser, daemon=True)
    thread.start()
    rng = random.Random(33)
    deadline = time.monotonic() + float(seconds)
    iterations, wrong, pending = 0, 0, []
    try:
        while time.monotonic() < deadline and not stop.is_set():
            n = rng.choice((128, 384, 640, 1024, 1536, 2048))
            value = float(rng.randint(1, 7))
            a = torch.full((n, n), value, device="cuda")
            b = torch.ones((n, n), device="cuda")
            # Each element is value * n, exact in float32; temporaries of other sizes come and
            # go between the product and its check.
            c = a @ b
            del a, b
            scratch = torch.empty(rng.randint(1, 64) << 20, dtype=torch.uint8, device="cuda").fill_(1)
            del scratch
            pending.append((c[:: max(1, n // 7), :: max(1, n // 5)], value * n))
            del c
            iterations += 1
            if len(pending) == 16:
                for sample, expected in pending:
                    wrong += int(not bool((sample == expected).all().item()))
                pending.clear()
        torch.cuda.synchronize()
    finally:
        stop.set()
        thread.join(timeout=30)
    report.info.update(iterations=iterations, releases=releases[0], seconds=float(seconds))
    report.expect(not thread.is_alive(), "the releasing thread did not end within 30 s")
    report.expect(not errors, "; ".join(errors))
    report.expect(wrong == 0, f"{wrong} products of {iterations} were wrong")
    report.expect(iterations > 0 and releases[0] > 0, "nothing ran")


CASES = {"release_race": case_release_race}


def main(argv):
    if len(argv) not in (3, 4) or argv[1] not in CASES:
        sys.exit(f"usage: {argv[0]} CASE CONF [SECONDS]  (CASE: {', '.join(CASES)})")
    Report(case=argv[1], conf=argv[2]).run(CASES[argv[1]], *argv[2:])


if __name__ == "__main__":
    main(sys.argv)
