"""Compiling the torch backend (`_torch_backend/*.cpp`) into a plain shared library.

One compiler command serves both places that build it: the wheel's build, which compiles it
against the headers of each torch release it ships a backend for (`scripts/build_torch_backends.py`,
without importing that torch), and `streamalloc.torch`, which compiles it on first use for a torch
with no prebuilt backend in the wheel. Only a C++ compiler is needed, with torch's headers and
the CUDA runtime's (`cuda_runtime_api.h` and the `crt/` headers it includes): no ninja, no CUDA
toolkit. The library links torch's own libraries by name (libc10, libtorch_cuda, ...), which
are already loaded when torch is imported, so it carries no path to them.

Prebuilt libraries are named for what they fit: `libstreamalloc_torch-<torch version>-cu<CUDA
major>-abi<0|1>.so` (torch's version without its local part, torch's CUDA major version, and
the C++ string ABI, `torch._C._GLIBCXX_USE_CXX11_ABI`).
"""

import hashlib
import os
import pathlib
import shutil
import subprocess

SOURCES = ("backend.cpp", "host.cpp")
"""The backend's C++ sources, in `_torch_backend/`."""
HEADERS = ("lib.h",)
"""The headers the sources share, in `_torch_backend/`."""
TORCH_LIBRARIES = ("c10", "c10_cuda", "torch_cpu", "torch_cuda")
"""torch's libraries the backend calls into."""
COMPILE_TIMEOUT_S = 900
"""The longest one compiler run may take (about 10 s on an idle 2-core machine)."""


class BuildError(RuntimeError):
    """The backend could not be compiled; the message says what is missing or what failed."""


def source_dir():
    """The folder of the backend's C++ sources."""
    return pathlib.Path(__file__).resolve().parent / "_torch_backend"


def prebuilt_dir():
    """The folder of the backends compiled when the wheel was built."""
    return source_dir() / "prebuilt"


def release(version):
    """torch's version without its local part: '2.11.0+cu130' -> '2.11.0'."""
    return version.split("+", 1)[0]


def prebuilt_name(torch_version, cuda_version, cxx11_abi):
    """The file name of a backend built for this torch release, CUDA major version and ABI."""
    major = str(cuda_version).split(".", 1)[0]
    return f"libstreamalloc_torch-{release(torch_version)}-cu{major}-abi{int(bool(cxx11_abi))}.so"


def cuda_headers(roots):
    """(include folder, runtime library folder or None) of the CUDA runtime headers found under
    `roots` (CUDA_HOME or site-packages folders), checking that the `crt/` headers
    `cuda_runtime.h` includes are there too. Raises BuildError naming what is missing."""
    partial = None
    for root in roots:
        for sub in ("include", "nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cu12/include"):
            include = pathlib.Path(root) / sub
            if not (include / "cuda_runtime_api.h").is_file():
                continue
            if not (include / "crt" / "host_config.h").is_file():
                partial = include
                continue
            lib = include.parent / "lib"
            return include, (lib if any(lib.glob("libcudart.so*")) else None)
    if partial is not None:
        raise BuildError(f"the CUDA runtime headers in {partial} lack crt/host_config.h, which the "
                         "nvidia-cuda-crt package supplies: pip install 'streamalloc[torch-build]'")
    raise BuildError("the CUDA runtime headers (cuda_runtime_api.h: no CUDA_HOME, no nvidia-cuda-runtime package)")


def compile_backend(out, torch_dir, includes, cuda_lib=None, cxx11_abi=None, compiler=None):
    """Compiles the backend into `out` against the torch package at `torch_dir` (its include/
    and lib/), with `includes` (the CUDA runtime headers' folder, and the folder of the
    library's generated streamalloc.h). `cxx11_abi` None tries the new string ABI, then the old:
    only the one torch was built with links (every symbol is resolved at link time). Returns
    the ABI it was built with. Raises BuildError."""
    compiler = compiler or os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise BuildError(f"a C++ compiler ({compiler} not found; set CXX)")
    torch_dir = pathlib.Path(torch_dir)
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    base = [compiler, "-shared", "-fPIC", "-O2", "-std=c++17", "-Wno-interference-size",
            f"-I{torch_dir / 'include'}", f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            *(f"-I{folder}" for folder in includes), *(str(source_dir() / s) for s in SOURCES),
            f"-L{torch_dir / 'lib'}", *(f"-l{name}" for name in TORCH_LIBRARIES)]
    if cuda_lib is not None:
        cudart = sorted(p.name for p in pathlib.Path(cuda_lib).glob("libcudart.so*"))
        base += [f"-L{cuda_lib}", f"-l:{cudart[-1]}"]
    # The shared libstdc++ first: a compiler that links it statically by default (as some
    # images' wrappers do) gives the library a copy of its own whose uninitialised locale
    # crashes formatting a number. See DESIGN.md, Note [the backend links the shared libstdc++].
    base += ["-l:libstdc++.so.6", "-ldl", "-Wl,--no-undefined"]
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    failures = []
    for abi in ([cxx11_abi] if cxx11_abi is not None else [True, False]):
        command = base + [f"-D_GLIBCXX_USE_CXX11_ABI={int(bool(abi))}", "-o", str(tmp)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            tmp.unlink(missing_ok=True)
            raise BuildError(f"compiling {source_dir()} took over {COMPILE_TIMEOUT_S} s ({compiler})") from None
        if done.returncode == 0:
            os.replace(tmp, out)
            return bool(abi)
        lines = [line for line in done.stderr.splitlines() if "error" in line or "undefined" in line]
        failures.append(f"with _GLIBCXX_USE_CXX11_ABI={int(bool(abi))}: " + " | ".join(lines[:4] or done.stderr.splitlines()[-4:]))
    tmp.unlink(missing_ok=True)
    raise BuildError(f"compiling {source_dir()} against {torch_dir} failed " + "; ".join(failures))


def source_hash(library_header):
    """A hash of the sources, their headers and the library's header (bytes), naming a build
    of them in the cache."""
    digest = hashlib.sha256(library_header)
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((source_dir() / name).read_bytes())
    return digest.hexdigest()[:16]
