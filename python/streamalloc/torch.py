"""PyTorch: route torch's CUDA allocations through streamalloc.

`enable()` makes streamalloc torch's CUDA allocator. By default it installs streamalloc's own
torch backend: a C++ class implementing torch's whole allocator interface
(`c10::cuda::CUDACachingAllocator::CUDAAllocator`, as torch's native and cudaMallocAsync
backends do) over libstreamalloc's C ABI (`_torch_backend/backend.cpp`). The wheel carries it
compiled for the torch releases it was built against (README lists them); for any other torch it
is compiled on first use against the installed torch's headers (a C++ compiler and the CUDA
runtime headers: `pip install 'streamalloc[torch-build]'` adds the headers torch's own
dependencies lack; no ninja, no CUDA toolkit), cached per torch version under
`~/.cache/streamalloc/` (`STREAMALLOC_CACHE` overrides), or taken from
`STREAMALLOC_TORCH_BACKEND_SO`. `enable()` checks the configuration (`conf`, else
`STREAMALLOC_CONF`) at once: a bad one raises there. With it, torch's own functions work as
under torch's allocators:

* `torch.cuda.memory_stats()` and everything built on it (`memory_allocated`,
  `max_memory_allocated`, `memory_reserved`, `memory_summary`), `reset_peak_memory_stats`,
  `reset_accumulated_memory_stats`, from the library's figures under torch's key names;
* `torch.backends.cudnn.benchmark = True` (cudnn asks for the largest cached block);
* out of memory raises `torch.cuda.OutOfMemoryError` with streamalloc's diagnostic, after
  torch's out-of-memory observers ran;
* CUDA graphs, `torch.cuda.MemPool()` and `use_mem_pool`, `torch.compile(mode=
  "reduce-overhead")` (cudagraph trees: pool use counts, live-allocation checks, checkpoints)
  on the library's private pools;
* `tensor.record_stream(s)`, `torch.cuda.empty_cache()`,
  `torch.cuda.set_per_process_memory_fraction(f)`;
* CUDA tensors shared with other processes (`torch.multiprocessing`): mapped memory (the
  default) through exported file descriptors that a receiver under streamalloc maps, memory of
  cuMemAlloc chunks (`backing=chunks`, `strategy=plain`) in torch's own handle format; the
  library's own driver pool (`strategy=async,pool=ipc`) per allocation, to a receiver under
  streamalloc only (torch's own allocator refuses the handle as one of a later version); the
  device's default pool (`strategy=async`) cannot be shared, and sharing raises saying so.

Where the backend cannot be had (no prebuilt one for this torch, and no compiler or no CUDA
headers), `enable()` warns once, naming what is missing and what will not work, and falls back to torch's
`CUDAPluggableAllocator` with every hook wired (the path of earlier versions): under it torch
refuses its statistics functions, `cacheInfo` (cudnn.benchmark), `MemPool()`, cudagraph
trees and IPC, and out of memory is a plain `RuntimeError`; `memory_stats()`,
`memory_summary()` and `reset_peak_memory_stats()` here give the library's figures under
either path. `STREAMALLOC_TORCH_BACKEND` chooses: `auto` (the default: backend, else the
fallback), `backend` (the backend or an error) or `pluggable` (the fallback, always).

`allocator()` gives the pluggable allocator without making it current, for
`torch.cuda.MemPool(streamalloc.torch.allocator().allocator())` under PyTorch's own allocator.

Tags: tensors created under `with streamalloc.torch.tag("kv_cache"):` (torch allocates on the
calling thread, so the thread's tag applies) live in a pool of the tag's own;
`streamalloc.torch.sleep(["kv_cache"], offload=True)` gives that memory back to the driver,
keeping the tensors' addresses (and their contents in pinned host memory, with offload), and
`streamalloc.torch.wake(["kv_cache"])` maps it again at the same addresses, so CUDA graphs
captured over those tensors replay as before. A sleeping tag's tensors must not be used (their
memory is gone: a kernel on them faults) but may be freed.

An unmodified script runs under streamalloc with

    python -m streamalloc.torch [--conf STREAMALLOC_CONF] train.py ARGS...
    python -m streamalloc.torch [--conf ...] -m package.module ARGS...

or, with no command changed at all, `STREAMALLOC_TORCH=1` in the environment: the wheel's
start-up hook (`streamalloc-autoload.pth`, see `streamalloc._autoload`) calls `enable()` as
torch is imported, in every Python process that inherits the environment. The runner sets
it (and `STREAMALLOC_CONF` from `--conf`) for the processes the script starts, so workers
that `torch.multiprocessing` spawns run under streamalloc too; so does `enable()` itself (a
worker under torch's own allocator could not open the mapped memory this process shares).
"""

import ctypes
import os
import sys
import threading
import warnings

import streamalloc
from streamalloc import _torch_build

MALLOC = "streamalloc_torch_malloc"
"""The allocation function of the CUDAPluggableAllocator ABI (throws on failure)."""
FREE = "streamalloc_free"
"""The free function of the CUDAPluggableAllocator ABI."""

BACKEND_ENV = "STREAMALLOC_TORCH_BACKEND"
"""Environment variable choosing the path of `enable()`: auto, backend or pluggable."""
PREBUILT_ENV = "STREAMALLOC_TORCH_BACKEND_SO"
"""Environment variable naming a prebuilt backend library (skips the build)."""
AUTOLOAD_ENV = "STREAMALLOC_TORCH"
"""Environment variable that enables streamalloc as torch is imported, any value but 0
(`streamalloc._autoload`); `enable()` sets it for the processes this one starts."""

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

FALLBACK_LIMITS = (
    "torch.cuda.memory_stats() and what is built on it (memory_allocated, max_memory_allocated, "
    "memory_reserved, memory_summary), reset_peak_memory_stats, cudnn.benchmark convolutions "
    "(cacheInfo), torch.compile(mode='reduce-overhead'), torch.cuda.MemPool() and use_mem_pool, "
    "and sharing CUDA tensors with other processes raise in torch; out of memory raises a plain "
    "RuntimeError instead of torch.cuda.OutOfMemoryError"
)
"""What does not work under the fallback (torch's CUDAPluggableAllocator)."""

_lock = threading.Lock()
_active = None
_warned = False


class BackendUnavailable(RuntimeError):
    """The C++ backend cannot be built or loaded here; the message says what is missing."""


def backend_source():
    """The path of the backend's C++ source."""
    return str(_torch_build.source_dir() / "backend.cpp")


def _cache_dir(torch):
    root = os.environ.get("STREAMALLOC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "streamalloc")
    tag = f"torch-{torch.__version__}-cuda-{torch.version.cuda}"
    return os.path.join(root, "torch-backend", tag.replace("+", "_"))


def _prebuilt(torch):
    """The backend the wheel carries for this torch (release, CUDA major version, C++ ABI), or
    None."""
    name = _torch_build.prebuilt_name(torch.__version__, torch.version.cuda, torch._C._GLIBCXX_USE_CXX11_ABI)
    path = _torch_build.prebuilt_dir() / name
    return str(path) if path.is_file() else None


def build_backend(shipped=True):
    """The backend library for the installed torch, as a path: `STREAMALLOC_TORCH_BACKEND_SO`,
    else the one the wheel carries for this torch (unless `shipped` is false), else one compiled
    for it on first use (and cached: see the module's doc). Raises BackendUnavailable naming
    what is missing."""
    prebuilt = os.environ.get(PREBUILT_ENV)
    if prebuilt:
        if not os.path.exists(prebuilt):
            raise BackendUnavailable(f"{PREBUILT_ENV}={prebuilt} does not exist")
        return prebuilt
    import torch

    if not getattr(getattr(torch, "version", None), "cuda", None):
        raise BackendUnavailable(f"a CUDA build of torch (this torch, {getattr(torch, '__version__', '?')}, has none)")
    prebuilt = _prebuilt(torch) if shipped else None
    if prebuilt is not None:
        return prebuilt
    abi = bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    # The library's own header (its types, generated from its Rust structs) beside the build.
    lib = streamalloc.load()
    lib.streamalloc_header.restype = ctypes.c_char_p
    library_header = lib.streamalloc_header()
    build = _torch_build.source_hash(library_header)
    out = os.path.join(_cache_dir(torch), f"libstreamalloc_torch-{build}-abi{int(abi)}.so")
    if os.path.isfile(out):
        return out
    header_dir = os.path.join(_cache_dir(torch), f"include-{build}")
    os.makedirs(header_dir, exist_ok=True)
    with open(os.path.join(header_dir, "streamalloc.h"), "wb") as f:
        f.write(library_header)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    try:
        from torch.utils import cpp_extension

        cuda_home = [cpp_extension.CUDA_HOME] if cpp_extension.CUDA_HOME else []
    except Exception:  # a torch without its extension helpers: the packages alone
        cuda_home = []
    try:
        include, cudart = _torch_build.cuda_headers(cuda_home + [p for p in sys.path if p and os.path.isdir(p)])
        _torch_build.compile_backend(out, torch_dir, [include, header_dir], cudart, cxx11_abi=abi)
    except _torch_build.BuildError as e:
        raise BackendUnavailable(str(e)) from e
    return out


def _install_backend():
    """Builds and installs the backend as torch's allocator. BackendUnavailable when it cannot
    be built or loaded; RuntimeError when torch refuses it (an allocator already in use)."""
    import torch

    path = build_backend()
    try:
        lib = ctypes.CDLL(path)
        install = lib.streamalloc_torch_backend_install
    except (OSError, AttributeError) as e:
        if path != _prebuilt(torch):
            raise BackendUnavailable(f"loading {path} failed: {e}") from e
        # The wheel's backend does not load here (an older libstdc++ than it was built with,
        # say): the one compiled for this machine.
        path = build_backend(shipped=False)
        try:
            lib = ctypes.CDLL(path)
            install = lib.streamalloc_torch_backend_install
        except (OSError, AttributeError) as again:
            raise BackendUnavailable(f"loading {path} failed: {again} (and the wheel's: {e})") from again
    install.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    install.restype = ctypes.c_int
    err = ctypes.create_string_buffer(4096)
    if install(str(streamalloc.library_path()).encode(), err, len(err)) != 0:
        raise RuntimeError(f"streamalloc: installing the torch backend failed: {err.value.decode(errors='replace')}")


def allocator(conf=None):
    """A `torch.cuda.memory.CUDAPluggableAllocator` over streamalloc with every hook wired,
    not made current.

    `conf` is a `STREAMALLOC_CONF`-style string (e.g. "strategy=async"); without it the
    environment variable, or the defaults, apply.
    """
    import torch

    lib = streamalloc.load()
    if conf is not None:
        streamalloc.configure(conf)
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(str(streamalloc.library_path()), MALLOC, FREE)
    hooks = pluggable.allocator()
    for setter, function in _HOOKS:
        getattr(hooks, setter)(ctypes.cast(getattr(lib, function), ctypes.c_void_p).value)
    return pluggable


def enable(conf=None, backend=None):
    """Makes streamalloc PyTorch's CUDA allocator; call before any CUDA allocation.

    `conf` is as for `allocator()`. `backend` (default: `$STREAMALLOC_TORCH_BACKEND`, else
    "auto") picks the path: "backend" (streamalloc's torch backend, or an error), "pluggable"
    (torch's CUDAPluggableAllocator) or "auto" (the backend where it can be built, else the
    pluggable path with a warning). Returns torch's allocator object (`_CUDAAllocator`).

    The Python processes this one starts enable streamalloc too, as `STREAMALLOC_TORCH=1`
    would (unless the environment sets that variable already): `enable()` puts it, `conf`
    (as `STREAMALLOC_CONF`) and `backend` into `os.environ`, so that workers which
    `torch.multiprocessing` spawns can open the CUDA tensors this process shares with them.
    """
    import torch

    mode = (backend or os.environ.get(BACKEND_ENV) or "auto").strip().lower()
    if mode not in ("auto", "backend", "pluggable"):
        raise ValueError(f"{BACKEND_ENV}/backend must be auto, backend or pluggable, not {mode!r}")
    with _lock:
        streamalloc.load()
        if conf is not None:
            streamalloc.configure(conf)
        streamalloc.check_configuration()
        current = _install(torch, mode)
        # Once enabled: a child told to enable what failed here would fail at its import of torch.
        _export(conf, backend)
        return current


def _install(torch, mode):
    """Makes streamalloc torch's allocator along the path `mode` picks (under `_lock`); torch's
    allocator object."""
    global _active, _warned
    if _active is not None:
        return torch.cuda.memory._get_current_allocator()
    if mode != "pluggable":
        try:
            _install_backend()
            _active = "backend"
            return torch.cuda.memory._get_current_allocator()
        except BackendUnavailable as e:
            if mode == "backend":
                raise
            if not _warned:
                _warned = True
                warnings.warn(f"streamalloc.torch: the torch backend is unavailable: {e}. Falling back to "
                              f"torch's CUDAPluggableAllocator, under which {FALLBACK_LIMITS}.",
                              RuntimeWarning, stacklevel=3)
    pluggable = allocator()
    torch.cuda.memory.change_current_allocator(pluggable)
    _active = "pluggable"
    return pluggable


def _export(conf, backend):
    """Makes the processes this one starts enable streamalloc as this one did (their memory then
    behaves as this one's; IPC works either way, see DESIGN.md "IPC")."""
    os.environ.setdefault(AUTOLOAD_ENV, "1")
    if conf is not None:
        os.environ["STREAMALLOC_CONF"] = conf
    if backend is not None:
        os.environ[BACKEND_ENV] = backend


def active():
    """Which path `enable()` installed in this process: "backend", "pluggable" or None."""
    return _active


tag = streamalloc.tag
"""`with streamalloc.torch.tag(name):` the tensors this thread creates inside the block live in
the tag's pool (`streamalloc.tag`)."""


def _device_index(device):
    """`device` (None: torch's current CUDA device; an int, a str or a torch.device) as an
    ordinal."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    import torch

    if device is None:
        return torch.cuda.current_device()
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def sleep(tags, offload=False, device=None):
    """`streamalloc.sleep` on `device` (torch's current CUDA device by default): the tags'
    memory goes back to the driver once the work queued on the streams that use it is done,
    their tensors keeping their addresses; with `offload` their contents wait in pinned host
    memory for `wake`."""
    streamalloc.sleep(tags, offload, _device_index(device))


def wake(tags, device=None):
    """`streamalloc.wake` on `device` (torch's current CUDA device by default): the tags'
    tensors have memory again, at the same addresses, their offloaded contents copied back
    before this returns."""
    streamalloc.wake(tags, _device_index(device))


def memory_stats(device=0):
    """The library's statistics of `device` under `torch.cuda.memory_stats()`'s key names
    (the "all" pool; private pools of CUDA graphs included). Under the backend,
    `torch.cuda.memory_stats()` itself works and has every key."""
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


USAGE = """usage: python -m streamalloc.torch [--conf STREAMALLOC_CONF] [--backend auto|backend|pluggable]
                                   (SCRIPT | -m MODULE) [ARGS...]
Runs SCRIPT (or MODULE) as __main__ with streamalloc as PyTorch's CUDA allocator."""


def main(argv=None):
    """`python -m streamalloc.torch`: runs a script or module under streamalloc."""
    import runpy

    args = list(sys.argv[1:] if argv is None else argv)
    conf = backend = module = None
    while args and args[0].startswith("-"):
        flag = args.pop(0)
        if flag in ("-h", "--help"):
            print(USAGE)
            return 0
        if flag == "--conf" and args:
            conf = args.pop(0)
        elif flag.startswith("--conf="):
            conf = flag.split("=", 1)[1]
        elif flag == "--backend" and args:
            backend = args.pop(0)
        elif flag.startswith("--backend="):
            backend = flag.split("=", 1)[1]
        elif flag == "-m" and args:
            module = args.pop(0)
            break
        elif flag == "--":
            break
        else:
            print(f"unknown option {flag}\n{USAGE}", file=sys.stderr)
            return 2
    if module is None and not args:
        print(USAGE, file=sys.stderr)
        return 2
    # The processes the script starts (spawned workers, torchrun's) enable it as they import
    # torch: enable() puts the settings into the environment, and the runner asks for
    # streamalloc even where the environment said 0.
    enable(conf, backend)
    os.environ[AUTOLOAD_ENV] = "1"
    if module is not None:
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = args[0]
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    # Run as `python -m streamalloc.torch`: this file is __main__, a module apart from
    # streamalloc.torch, whose state (the path installed) the script may ask for.
    from streamalloc import torch as _streamalloc_torch

    sys.exit(_streamalloc_torch.main())
