"""CUDA tensors shared between processes under every pair of allocators (issue 54), each cell
in its own process (see ipc_cases.py for what each case does and checks). Needs a GPU, torch,
streamalloc importable (its torch backend built), pidfd_getfd allowed from a child to its
parent (kernel.yama.ptrace_scope 0, or root), pytest-timeout.

    python3 -m pytest -q -rA python/tests/gpu/test_ipc.py
"""

import pytest

pytestmark = pytest.mark.timeout(600)

WORKER = "ipc_cases.py"

SENDERS = ["native", "expandable", "default", "chunks", "async"]
RECEIVERS = ["native", "streamalloc"]


@pytest.mark.parametrize("receiver", RECEIVERS)
@pytest.mark.parametrize("sender", SENDERS)
def test_ipc_matrix(run_case, sender, receiver):
    """Opens with the right sum and sees the other side's write, or (sender async, receiver
    native: torch's allocator cannot import a pool's memory) torch's own error for a handle of
    a later version in the receiver, never an internal assert."""
    run_case(WORKER, "matrix", sender, receiver)


def test_ipc_large_expandable_segments_refused_by_streamalloc_receiver(run_case):
    run_case(WORKER, "large", "expandable", "streamalloc")


@pytest.mark.serial
@pytest.mark.parametrize("receiver", RECEIVERS)
@pytest.mark.parametrize("sender", ["native", "expandable", "default", "chunks"])
def test_ipc_thousand_cycles_leave_nothing_behind(run_case, sender, receiver):
    run_case(WORKER, "cycles", sender, receiver)


@pytest.mark.serial
def test_ipc_thousand_cycles_of_the_driver_pool_leave_nothing_behind(run_case):
    """strategy=async,pool=ipc to a receiver under streamalloc: the pool is imported once,
    each allocation's import freed with its last tensor."""
    run_case(WORKER, "cycles", "async", "streamalloc")


@pytest.mark.parametrize("receiver", RECEIVERS)
@pytest.mark.parametrize("sender", ["native", "expandable", "default", "chunks"])
def test_ipc_receivers_view_outlives_the_sender(run_case, sender, receiver):
    run_case(WORKER, "sender_exits", sender, receiver)
