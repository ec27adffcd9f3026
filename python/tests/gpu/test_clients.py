"""RMM and Numba through streamalloc (streamalloc.rmm, streamalloc.numba) under every
streamalloc strategy, against the clients' own allocators: stream order on non-blocking
streams, every allocation through streamalloc, and a workload's results equal to those under
the client's own allocator (peak device memory in each RESULT line). Each run is its own
process: see rmm_cases.py and numba_cases.py. Needs a GPU, cupy, rmm (wheels from
scripts/fetch-client-wheels.sh), numba-cuda, streamalloc importable.

    python3 -m pytest -q -rA python/tests/gpu/test_clients.py
"""

import json
import subprocess
import sys

import pytest

from casekit import RESULT_PREFIX
from conftest import HERE, WORKER_TIMEOUT

pytestmark = pytest.mark.timeout(300)

_controls = {}
"""The control runs of the workloads, made once per worker and control."""


def control(run_case, worker, name):
    """The workload's RESULT under the client's own allocator `name`."""
    if (worker, name) not in _controls:
        _controls[(worker, name)] = run_case(worker, "workload", name)
    return _controls[(worker, name)]


@pytest.mark.parametrize("conf", ["strategy=stream_safe", "strategy=async", "strategy=best_fit", "strategy=plain",
                                  "rmm_default", "rmm_async"],
                         ids=["stream_safe", "async", "best_fit", "plain", "rmm_default", "rmm_async"])
def test_rmm_nonblocking_streams(run_case, conf):
    run_case("rmm_cases.py", "nonblocking", conf)


@pytest.mark.serial  # its peak is of the whole device's memory
def test_rmm_workload_matches_rmm(run_case, strategy):
    own = control(run_case, "rmm_cases.py", "rmm_default")
    ours = run_case("rmm_cases.py", "workload", strategy)
    assert ours["digest"] == own["digest"], f"results differ from RMM's own resource's: {ours} vs {own}"


@pytest.mark.parametrize("conf", ["strategy=stream_safe", "strategy=async", "strategy=best_fit", "strategy=plain",
                                  "numba_own"],
                         ids=["stream_safe", "async", "best_fit", "plain", "numba_own"])
def test_numba_nonblocking_streams(run_case, conf):
    run_case("numba_cases.py", "nonblocking", conf)


@pytest.mark.serial  # its peak is of the whole device's memory
def test_numba_workload_matches_numba(run_case, strategy):
    own = control(run_case, "numba_cases.py", "numba_own")
    ours = run_case("numba_cases.py", "workload", strategy)
    assert ours["digest"] == own["digest"], f"results differ from Numba's own manager's: {ours} vs {own}"


@pytest.mark.parametrize("worker", ["rmm_cases.py", "numba_cases.py"])
def test_counts_catch_an_unplugged_client(worker):
    """The negative control of the cases' check that every allocation went through streamalloc:
    streamalloc configured but not plugged into the client, the case must fail on that check
    alone."""
    done = subprocess.run([sys.executable, str(HERE / worker), "nonblocking", "unplugged:strategy=stream_safe"],
                          capture_output=True, text=True, timeout=WORKER_TIMEOUT)
    print(done.stdout, done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert lines, f"{worker}: no RESULT line (exit status {done.returncode})"
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    assert done.returncode == 1 and len(result["failures"]) == 1, result
    assert "did not allocate through it" in result["failures"][0], result
