"""PyTorch: route torch's CUDA allocations through streamalloc.

`enable()` makes streamalloc torch's CUDA allocator, with every hook of
`torch.cuda.memory.CUDAPluggableAllocator` wired, so that torch's own guarantees hold:

* `tensor.record_stream(s)`: the memory is not reused before the work queued on `s` is done.
* CUDA graphs (`torch.cuda.graph`, `torch.cuda.CUDAGraph`): what a capture allocates lives in
  a private pool of that graph (or of the `pool=` handle, shared by the graphs given it) and
  is never handed to work outside it until torch releases the pool; under `strategy=async`
  captures allocate the driver's graph memory nodes instead.
* `torch.cuda.empty_cache()` returns the cached memory to the driver.
* `torch.cuda.set_per_process_memory_fraction(f)` limits the device memory held.
* An allocation that fails raises `RuntimeError` ("CUDA out of memory (streamalloc): ...").

`allocator()` gives the same allocator without making it current, for
`torch.cuda.MemPool(streamalloc.torch.allocator().allocator())` under PyTorch's own allocator.
torch's statistics functions (`torch.cuda.memory_stats` and the rest) raise under a pluggable
allocator; `memory_stats()`, `memory_summary()` and `reset_peak_memory_stats()` here give the
library's figures under torch's key names.
"""

import streamalloc

MALLOC = "streamalloc_torch_malloc"
"""The allocation function of the CUDAPluggableAllocator ABI (throws on failure)."""
FREE = "streamalloc_free"
"""The free function of the CUDAPluggableAllocator ABI."""

_HOOKS = (
    ("set_record_stream_fn", "streamalloc_torch_record_stream"),
    ("set_begin_allocate_to_pool", "streamalloc_torch_begin_allocate_to_pool"),
    ("set_end_allocate_to_pool_fn", "streamalloc_torch_end_allocate_to_pool"),
    ("set_release_pool", "streamalloc_torch_release_pool"),
    ("set_base_alloc_fn", "streamalloc_torch_base_allocation"),
    ("set_reset_fn", "streamalloc_torch_empty_cache"),
    ("set_memory_fraction_fn", "streamalloc_torch_set_memory_fraction"),
    ("set_init_fn", "streamalloc_torch_init"),
)
"""Each setter of torch's allocator object, and the library function it is given."""


def allocator(conf=None):
    """A `torch.cuda.memory.CUDAPluggableAllocator` over streamalloc with every hook wired,
    not made current.

    `conf` is a `STREAMALLOC_CONF`-style string (e.g. "strategy=async"); without it the
    environment variable, or the defaults, apply.
    """
    import ctypes

    import torch

    lib = streamalloc.load()
    if conf is not None:
        streamalloc.configure(conf)
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(str(streamalloc.library_path()), MALLOC, FREE)
    hooks = pluggable.allocator()
    for setter, function in _HOOKS:
        getattr(hooks, setter)(ctypes.cast(getattr(lib, function), ctypes.c_void_p).value)
    return pluggable


def enable(conf=None):
    """Makes streamalloc PyTorch's CUDA allocator; call before any CUDA allocation.

    `conf` is as for `allocator()`. Returns the torch allocator object.
    """
    import torch

    pluggable = allocator(conf)
    torch.cuda.memory.change_current_allocator(pluggable)
    return pluggable


def memory_stats(device=0):
    """The library's statistics of `device` under `torch.cuda.memory_stats()`'s key names
    (the "all" pool; private pools of CUDA graphs included)."""
    s = streamalloc.stats(device)
    stats = {
        "allocated_bytes.all.current": s["allocated"],
        "allocated_bytes.all.peak": s["allocated_peak"],
        "reserved_bytes.all.current": s["reserved"],
        "reserved_bytes.all.peak": s["reserved_peak"],
        "active_bytes.all.current": s["allocated"],
        "active_bytes.all.peak": s["allocated_peak"],
        "inactive_split_bytes.all.current": s["cached"],
        "active.all.current": s["live_allocations"],
        "allocation.all.current": s["live_allocations"],
        "allocation.all.allocated": s["total_allocations"],
        "allocation.all.freed": s["total_frees"],
        "num_device_alloc": s["device_allocs"],
        "num_device_free": s["device_frees"],
        "num_ooms": s["failures"],
        "num_alloc_retries": s.get("retries", 0),
        "pending_release_bytes.all.current": s["pending_release"],
        "largest_free_block_bytes": s["largest_free_block"],
    }
    return stats


def memory_summary(device=0):
    """A short text report of `memory_stats(device)`, like `torch.cuda.memory_summary()`."""
    stats = memory_stats(device)
    width = max(len(k) for k in stats)
    lines = [f"streamalloc memory summary, device {device}"]
    for key, value in stats.items():
        shown = _bytes(value) if "bytes" in key else str(value)
        lines.append(f"  {key:<{width}}  {shown}")
    return "\n".join(lines)


def reset_peak_memory_stats(device=0):
    """Restarts the peaks of `memory_stats(device)` from the current figures."""
    streamalloc.reset_peak_stats(device)


def _bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
