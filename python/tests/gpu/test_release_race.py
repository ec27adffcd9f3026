"""A release racing frees through PyTorch under every streamalloc strategy and PyTorch's own
allocators (issue 33): see race_cases.py. STREAMALLOC_RACE_SECONDS sets each case's length
(default 20; `bash lab/run race` runs a minute each, all at once).

    python3 -m pytest -q -rA python/tests/gpu/test_release_race.py
"""

import os

import pytest

pytestmark = pytest.mark.timeout(300)


def test_release_racing_frees(run_case, allocator):
    run_case("race_cases.py", "release_race", allocator, os.environ.get("STREAMALLOC_RACE_SECONDS", "20"))
