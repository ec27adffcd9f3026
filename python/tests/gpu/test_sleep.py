"""Tags, sleep and wake under PyTorch (issue 36): a CUDA graph captured over tagged tensors
replays after the sleep and the wake with right outputs, contents come back at the same
addresses, the driver sees the memory go and come, and each misuse has its answer (see
sleep_cases.py for what each case does and checks). Each case in its own process. Needs a
GPU, torch with a C++ compiler and ninja (the backend is built on first use), streamalloc
importable, pytest-timeout.

    python3 -m pytest -q -rA python/tests/gpu/test_sleep.py
"""

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.serial]

WORKER = "sleep_cases.py"

CONFS = {
    "stream_safe": "strategy=stream_safe",
    "best_fit": "strategy=best_fit",
    "pluggable": "pluggable:strategy=stream_safe",
}
"""Configurations whose tags sleep (over stitched ranges, the default backing), through the
backend, and through torch's CUDAPluggableAllocator."""


@pytest.mark.parametrize("conf", list(CONFS.values()), ids=list(CONFS))
@pytest.mark.parametrize("case", ["graph", "contents", "misuse"])
def test_sleep(run_case, case, conf):
    run_case(WORKER, case, conf)
