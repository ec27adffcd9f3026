"""Pinned host memory under streamalloc's torch backend (issue 36): torch's pinned tensors
come from the library's pinned pool, and a pinned tensor freed while a non_blocking copy still
uses it is not handed out again before the copy is done (see pinned_cases.py for what each
case does and checks). Each case in its own process. Needs a GPU, torch with a C++ compiler
and ninja (the backend is built on first use), streamalloc importable, pytest-timeout.

    python3 -m pytest -q -rA python/tests/gpu/test_pinned.py
"""

import pytest

pytestmark = pytest.mark.timeout(300)

WORKER = "pinned_cases.py"

CONFS = {"stream_safe": "strategy=stream_safe", "async": "strategy=async"}
"""streamalloc configurations (the pinned pool is the same under each; the device strategy
beside it differs)."""


def confs(table):
    return pytest.mark.parametrize("conf", list(table.values()), ids=list(table))


@confs(CONFS)
def test_pinned_tensors_come_from_the_pool(run_case, conf):
    run_case(WORKER, "routed", conf)


@confs({**CONFS, "native": "native"})
def test_a_pinned_source_freed_under_its_copy_is_not_reused(run_case, conf):
    run_case(WORKER, "h2d", conf)


@confs({**CONFS, "native": "native"})
def test_a_pinned_target_freed_under_its_copy_is_not_reused(run_case, conf):
    run_case(WORKER, "d2h", conf)


@confs(CONFS)
def test_a_block_a_graph_copies_from_is_kept(run_case, conf):
    run_case(WORKER, "graph", conf)
