"""`STREAMALLOC_TORCH=1`: streamalloc becomes PyTorch's CUDA allocator as torch is imported.

The wheel installs `streamalloc-autoload.pth` into site-packages. Python runs it at start-up;
when `STREAMALLOC_TORCH` is set (and not `0`), it imports this module, which puts a finder
in front of `sys.meta_path` that waits for the import of `torch` and calls
`streamalloc.torch.enable()` as soon as torch's own module has run: before the script can
allocate CUDA memory, with no line of the script or its launcher changed. Every Python
process that inherits the environment does the same, so workers that
`torch.multiprocessing` spawns (or that torchrun starts) run under streamalloc too.
`STREAMALLOC_CONF` configures the library and `STREAMALLOC_TORCH_BACKEND` picks the path, as
for `enable()`. When enabling fails, the import of torch fails with the reason: the
environment asked for streamalloc, and a silent fallback would measure something else.
"""

import importlib.abc
import importlib.util
import os
import sys

from streamalloc.torch import AUTOLOAD_ENV as ENV


def requested():
    """Whether the environment asks for streamalloc under PyTorch."""
    return os.environ.get(ENV, "").strip() not in ("", "0")


def _enable_after(exec_module):
    """torch's own `exec_module`, then `enable()`."""

    def exec_then_enable(module):
        exec_module(module)
        from streamalloc import torch as streamalloc_torch

        try:
            streamalloc_torch.enable()
        except Exception as e:
            raise RuntimeError(f"streamalloc: {ENV}={os.environ.get(ENV)} asked for streamalloc as PyTorch's "
                               f"CUDA allocator at the import of torch, and enabling it failed: {e}") from e

    return exec_then_enable


class _TorchFinder(importlib.abc.MetaPathFinder):
    """Finds torch through the other finders and has its loader enable streamalloc after
    running torch's module; once."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module = _enable_after(spec.loader.exec_module)
        return spec


def install():
    """Enables streamalloc now if torch is already imported, else when it is."""
    if "torch" in sys.modules:
        from streamalloc import torch as streamalloc_torch

        streamalloc_torch.enable()
    elif not any(isinstance(f, _TorchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchFinder())


if requested():
    install()
