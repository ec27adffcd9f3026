"""Worker of test_torch_autoload.py: run by a Python whose site-packages hold the streamalloc
wheel (its start-up hook, streamalloc-autoload.pth), with or without STREAMALLOC_TORCH=1, as an
unmodified script would be. Checks which allocator torch got, here and in a process that
torch.multiprocessing spawns, and that torch's allocations reach the library.

    python autoload_cases.py backend|none
"""

import sys

import torch  # the import the hook waits for: nothing of streamalloc is called before it
import torch.multiprocessing as mp

import streamalloc
import streamalloc.torch as streamalloc_torch
from casekit import MIB, Report


def library_allocated():
    """Bytes the library holds allocated on device 0 (0 when it was never loaded)."""
    return streamalloc.stats(0)["allocated"] if streamalloc_torch.active() else 0


def child(queue):
    x = torch.ones(4 * MIB, dtype=torch.uint8, device="cuda")
    queue.put((streamalloc_torch.active(), library_allocated() >= 4 * MIB, int(x.sum())))


def case(r, expect):
    want = None if expect == "none" else expect
    r.info["active"] = streamalloc_torch.active()
    r.expect(streamalloc_torch.active() == want, f"after `import torch`, streamalloc.torch.active() is "
             f"{streamalloc_torch.active()!r}, not {want!r}")
    x = torch.ones(8 * MIB, dtype=torch.uint8, device="cuda")
    r.info["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    r.expect(torch.cuda.max_memory_allocated() >= 8 * MIB, "torch.cuda.max_memory_allocated() misses the tensor")
    r.expect((library_allocated() >= 8 * MIB) == (want is not None),
             f"the library holds {library_allocated()} bytes allocated with an 8 MiB tensor live")
    del x
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=child, args=(queue,))
    p.start()
    active, through_library, total = queue.get(timeout=180)
    p.join(60)
    r.info["child_active"] = active
    r.expect(active == want, f"a spawned process has streamalloc.torch.active() {active!r}, not {want!r}")
    r.expect(through_library == (want is not None), "a spawned process's tensor is not where its allocator is")
    r.expect(total == 4 * MIB, "the spawned process's tensor holds wrong contents")


if __name__ == "__main__":
    Report(case="autoload", expect=sys.argv[1]).run(case, sys.argv[1])
