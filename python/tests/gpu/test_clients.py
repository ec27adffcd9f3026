"""RMM and Numba through streamalloc (streamalloc.rmm, streamalloc.numba) under every
streamalloc strategy, against the clients' own allocators: stream order on non-blocking
streams, every allocation through streamalloc, and a workload's results equal to those under
the client's own allocator (peak device memory in each RESULT line). Each run is its own
process: see rmm_cases.py and numba_cases.py. Needs a GPU, cupy, rmm (wheels from
scripts/fetch-client-wheels.sh), numba-cuda, streamalloc importable.

    python3 -m pytest -q -rA python/tests/gpu/test_clients.py
"""

import pytest

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


def test_rmm_workload_matches_rmm(run_case, strategy):
    own = control(run_case, "rmm_cases.py", "rmm_default")
    ours = run_case("rmm_cases.py", "workload", strategy)
    assert ours["digest"] == own["digest"], f"results differ from RMM's own resource's: {ours} vs {own}"


@pytest.mark.parametrize("conf", ["strategy=stream_safe", "strategy=async", "strategy=best_fit", "strategy=plain",
                                  "numba_own"],
                         ids=["stream_safe", "async", "best_fit", "plain", "numba_own"])
def test_numba_nonblocking_streams(run_case, conf):
    run_case("numba_cases.py", "nonblocking", conf)


def test_numba_workload_matches_numba(run_case, strategy):
    own = control(run_case, "numba_cases.py", "numba_own")
    ours = run_case("numba_cases.py", "workload", strategy)
    assert ours["digest"] == own["digest"], f"results differ from Numba's own manager's: {ours} vs {own}"
