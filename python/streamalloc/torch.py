"""PyTorch: route torch's CUDA allocations through streamalloc."""

import streamalloc

MALLOC = "streamalloc_malloc"
"""The allocation function of the CUDAPluggableAllocator ABI."""
FREE = "streamalloc_free"
"""The free function of the CUDAPluggableAllocator ABI."""


def enable(conf=None):
    """Makes streamalloc PyTorch's CUDA allocator; call before any CUDA allocation.

    `conf` is a `STREAMALLOC_CONF`-style string (e.g. "strategy=async"); without it the
    environment variable, or the defaults, apply. Returns the torch allocator object.
    """
    import torch

    streamalloc.load()
    if conf is not None:
        streamalloc.configure(conf)
    allocator = torch.cuda.memory.CUDAPluggableAllocator(str(streamalloc.library_path()), MALLOC, FREE)
    torch.cuda.memory.change_current_allocator(allocator)
    return allocator
