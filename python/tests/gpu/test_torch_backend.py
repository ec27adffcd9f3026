"""streamalloc's torch backend (issue 34): what torch refuses under a CUDAPluggableAllocator
works under `streamalloc.torch.enable()`, through torch's own APIs, each case in its own
process (see torch_backend_cases.py for what each case does and checks). Needs a GPU, torch
with a C++ compiler and ninja (the backend is built on first use), streamalloc importable,
pytest-timeout.

    python3 -m pytest -q -rA python/tests/gpu/test_torch_backend.py

With STREAMALLOC_TORCH_BACKEND=pluggable (the fallback forced) every test here must fail:
lab/torch-backend.sh runs both and summarises.
"""

import pytest

pytestmark = pytest.mark.timeout(300)

WORKER = "torch_backend_cases.py"

CONFS = {
    "stream_safe": "strategy=stream_safe",
    "stream_safe_chunks": "strategy=stream_safe,backing=chunks",
    "async": "strategy=async",
}
"""The configurations most cases run under: mapped memory (the default), cuMemAlloc chunks,
the driver's pool."""

SHAREABLE = {"stream_safe_chunks": "strategy=stream_safe,backing=chunks", "plain": "strategy=plain"}
"""Configurations whose memory is shared with CUDA IPC handles (cuMemAlloc memory): a child
under torch's own allocator opens it too."""

MAPPED = {"default": "", "segments": "strategy=stream_safe,backing=segments", "best_fit": "strategy=best_fit"}
"""Configurations whose memory is mapped (the default: stream_safe over stitched ranges): shared
in torch's expandable-segment format, which a child under torch's own allocator or streamalloc
opens (issue 54)."""

UNSHAREABLE = {"async": "strategy=async"}
"""Configurations whose memory cannot be shared: the driver's pool."""


def confs(table):
    return pytest.mark.parametrize("conf", list(table.values()), ids=list(table))


@confs(CONFS)
def test_backend_is_active(run_case, conf):
    run_case(WORKER, "active", conf)


@confs(CONFS)
def test_memory_stats_through_torch(run_case, conf):
    run_case(WORKER, "stats", conf)


@pytest.mark.serial  # cudnn's benchmark may take all the device's free memory for a workspace
@confs(CONFS)
def test_cudnn_benchmark_convolution(run_case, conf):
    run_case(WORKER, "cudnn_benchmark", conf)


@confs(CONFS)
def test_out_of_memory_error_and_observer(run_case, conf):
    run_case(WORKER, "oom", conf)


@confs(CONFS)
def test_mempool_and_use_mem_pool(run_case, conf):
    run_case(WORKER, "mempool", conf)


@confs(CONFS)
def test_compile_reduce_overhead(run_case, conf, request):
    if conf == CONFS["async"]:
        # Seen on an H200 with torch 2.11: a replay of torch's CUDA-graph trees fails with
        # "CUDA driver error: invalid argument" when captures allocate the driver's graph
        # memory nodes (strategy=async); the other strategies' private pools pass.
        request.applymarker(pytest.mark.xfail(strict=True, reason="cudagraph trees over graph memory nodes"))
    run_case(WORKER, "compile", conf)


@confs(CONFS)
def test_memory_history_and_snapshot(run_case, conf):
    # With STREAMALLOC_CLI=PATH (or `streamalloc` in PATH) the dumped snapshot also goes
    # through `streamalloc import`; without, the case records that it skipped that check.
    run_case(WORKER, "history", conf)


@confs(CONFS)
def test_snapshot_is_the_librarys_list(run_case, conf):
    run_case(WORKER, "snapshot_exact", conf)


@confs(SHAREABLE)
@pytest.mark.parametrize("child", ["native", "streamalloc"])
def test_ipc_share_with_child(run_case, conf, child):
    run_case(WORKER, "ipc", conf, child)


@confs(MAPPED)
@pytest.mark.parametrize("child", ["native", "streamalloc"])
def test_ipc_of_mapped_memory_with_child(run_case, conf, child):
    run_case(WORKER, "ipc", conf, child)


@confs(UNSHAREABLE)
def test_ipc_refused_with_reason(run_case, conf):
    run_case(WORKER, "ipc_refused", conf)


@confs({"stream_safe": CONFS["stream_safe"]})
def test_runner_runs_unmodified_script(run_case, conf):
    run_case(WORKER, "runner", conf)
