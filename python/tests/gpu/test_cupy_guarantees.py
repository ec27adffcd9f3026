"""CuPy on non-blocking streams: memory read by a busy stream, freed, and allocated on another
stream must not be handed out until the first is done; under every streamalloc strategy,
through both paths of streamalloc.cupy.enable, and under CuPy's own MemoryPool (the control).
Each run is its own process: see cupy_cases.py. Needs a GPU, cupy, streamalloc importable.

    python3 -m pytest -q -rA python/tests/gpu/test_cupy_guarantees.py
"""

import pytest

pytestmark = pytest.mark.timeout(300)

WORKER = "cupy_cases.py"


@pytest.mark.parametrize("checked", [False, True], ids=["fast", "checked"])
def test_nonblocking_streams(run_case, strategy, checked):
    run_case(WORKER, strategy, *(["--checked"] if checked else []))


def test_nonblocking_streams_cupy_pool(run_case):
    run_case(WORKER, "cupy_pool")
