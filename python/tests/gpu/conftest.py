"""Fixtures of the GPU tests of the Python front ends, and their guard against a run without a GPU.

The tests here drive real PyTorch and CuPy on a CUDA GPU, each case in its own process (the
allocator is fixed per process) through the workers beside this file (torch_cases.py,
cupy_cases.py). CI (.ci/run) does not run pytest: it runs python/tests/test_streamalloc.py
through cargo test. Should pytest collect this folder on a machine without an NVIDIA GPU,
every test here ERRORs (the session fixture below fails), so such a run never counts them as
passing. On the GPU machine: `bash lab/run torch` (streamalloc importable,
pytest and pytest-timeout installed).
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from casekit import RESULT_PREFIX

HERE = Path(__file__).resolve().parent

WORKER_TIMEOUT = 240
"""Seconds a worker may run before it counts as hung (pytest-timeout allows 300 per test)."""

STRATEGIES = {
    "plain": "strategy=plain",
    "best_fit": "strategy=best_fit",
    "stream_safe": "strategy=stream_safe",
    "stream_safe_chunks": "strategy=stream_safe,backing=chunks",
    "async": "strategy=async",
}
"""streamalloc configurations every guarantee is tested under, by test id."""

CONTROLS = {"native": "native", "cudaMallocAsync": "cudaMallocAsync"}
"""PyTorch's own allocators (caching, and backend:cudaMallocAsync): they must pass too, or
the test is wrong."""


def pytest_configure(config):
    config.addinivalue_line("markers", "serial: measures or takes device-wide memory, so must not run "
                            "beside other cases (deselect it under pytest-xdist: -m 'not serial')")


@pytest.fixture(scope="session", autouse=True)
def gpu():
    """Fails (not skips) every test here unless nvidia-smi lists a GPU."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.fail(f"these tests need an NVIDIA GPU: nvidia-smi -L failed ({e})", pytrace=False)
    if listed.returncode != 0 or "GPU" not in listed.stdout:
        pytest.fail(f"these tests need an NVIDIA GPU: nvidia-smi -L listed none ({listed.stderr.strip()})",
                    pytrace=False)


@pytest.fixture(params=list(STRATEGIES.values()), ids=list(STRATEGIES))
def strategy(request):
    """Each streamalloc configuration."""
    return request.param


@pytest.fixture(params=[*STRATEGIES.values(), *CONTROLS.values()], ids=[*STRATEGIES, *CONTROLS])
def allocator(request):
    """Each streamalloc configuration, then PyTorch's own allocators as controls."""
    return request.param


@pytest.fixture
def run_case():
    """Runs a worker in a new process and fails the test unless its guarantees held."""
    return _run_case


def _run_case(worker, *args, python=sys.executable):
    """Runs `python -X faulthandler HERE/worker *args` (a crash prints each thread's Python stack) (its whole process group killed after WORKER_TIMEOUT);
    fails the test unless it exits 0 with a RESULT line whose `ok` is true. Returns the result."""
    what = " ".join([worker, *args])
    proc = subprocess.Popen([python, "-X", "faulthandler", str(HERE / worker), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=WORKER_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        print(output)
        pytest.fail(f"{what}: hung (no exit within {WORKER_TIMEOUT} s)", pytrace=False)
    print(output)  # in the report of a failure, and of a pass with -rA
    lines = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    result = json.loads(lines[-1][len(RESULT_PREFIX):]) if lines else None
    if proc.returncode != 0 or result is None or not result["ok"]:
        why = "; ".join(result["failures"]) if result else "no RESULT line (crashed?)"
        pytest.fail(f"{what}: exit status {proc.returncode}: {why}", pytrace=False)
    return result
