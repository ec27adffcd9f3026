"""PyTorch's allocator guarantees under every streamalloc strategy (and, as controls, under
PyTorch's own allocators), each case in its own process: see torch_cases.py for what each
case does and checks. Needs a GPU, torch, streamalloc importable, pytest-timeout.

    python3 -m pytest -q -rA python/tests/gpu/test_torch_guarantees.py
    python3 -m pytest -q python/tests/gpu -k "record_stream and async"
"""

import pytest

pytestmark = pytest.mark.timeout(300)

WORKER = "torch_cases.py"


def test_record_stream(run_case, allocator):
    run_case(WORKER, "record_stream", allocator)


def test_graph_vs_eager(run_case, allocator):
    run_case(WORKER, "graph_vs_eager", allocator)


def test_graphs_shared_pool(run_case, allocator):
    run_case(WORKER, "graphs_shared_pool", allocator)


def test_graph_replayed_on_other_stream(run_case, allocator):
    run_case(WORKER, "graph_other_stream", allocator)


def test_graph_record_stream_inside_capture(run_case, allocator, request):
    if allocator == "cudaMallocAsync":
        # Seen on an H200 with torch 2.11: the process aborts at capture_end (native passes).
        request.applymarker(pytest.mark.xfail(strict=True, reason="PyTorch's own backend:cudaMallocAsync aborts"))
    run_case(WORKER, "graph_record_stream", allocator)


def test_graph_frees_warmup_output(run_case, allocator):
    run_case(WORKER, "graph_frees_warmup_output", allocator)


def test_mempool_with_streamalloc_allocator(run_case, strategy):
    run_case(WORKER, "mempool", strategy)


def test_mempool_while_enabled(run_case, strategy):
    run_case(WORKER, "mempool_enabled", strategy)


def test_ipc_share_with_child(run_case, allocator):
    run_case(WORKER, "ipc", allocator)


@pytest.mark.serial
def test_empty_cache_releases(run_case, allocator):
    run_case(WORKER, "empty_cache", allocator)


def test_memory_fraction_enforced(run_case, allocator):
    run_case(WORKER, "memory_fraction", allocator)


def test_memory_stats(run_case, strategy):
    run_case(WORKER, "stats", strategy)
