#!/usr/bin/env python3
"""Compiles the torch backend for each torch release the wheel ships it for, into
python/streamalloc/_torch_backend/prebuilt/ (scripts/build-python.sh runs it before packing).

For each version in python/torch-versions.txt (or those given as arguments), it downloads that
torch's Linux wheel from PyPI (`pip download --no-deps`, cached by pip), and the CUDA runtime
headers its CUDA pin names (`cuda-toolkit[cudart,crt]==V`), unpacks the headers and the four
libraries the backend links, and compiles with the command streamalloc.torch uses on first use
(python/streamalloc/_torch_build.py). torch is never imported, so nothing of CUDA is needed here.

    python3 scripts/build_torch_backends.py            # the versions of python/torch-versions.txt
    python3 scripts/build_torch_backends.py 2.11.0     # these versions only
"""

import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
from streamalloc import _torch_build  # noqa: E402  (the package's own build code, from the tree)

VERSIONS = ROOT / "python" / "torch-versions.txt"
LIBRARY_HEADER = ROOT / "crates" / "streamalloc-capi" / "include" / "streamalloc.h"
"""The C ABI's generated header, the one the wheel's library is built with (a test keeps it current)."""
PLATFORMS = [f for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
             for f in ("--platform", tag)]
"""The platforms whose wheels pip may take (it takes no other tag than those named)."""


def pip_download(requirement, dest, deps=False):
    """Downloads `requirement`'s Linux x86-64 wheels into `dest`; their paths."""
    before = set(dest.glob("*.whl"))
    command = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--only-binary=:all:",
               *PLATFORMS, "--python-version", "3.11", "-d", str(dest), requirement]
    if not deps:
        command.insert(4, "--no-deps")
    subprocess.run(command, check=True)
    return sorted(set(dest.glob("*.whl")) - before) or sorted(dest.glob("*.whl"))


def cuda_requirement(torch_wheel):
    """The CUDA runtime headers' requirement for this torch wheel, from its pins."""
    with zipfile.ZipFile(torch_wheel) as wheel:
        meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        text = wheel.read(meta).decode()
    pin = re.search(r"^Requires-Dist: cuda-toolkit\[[^\]]*\]==([0-9.]+)", text, re.MULTILINE)
    if pin:
        return f"cuda-toolkit[cudart,crt]=={pin.group(1)}", pin.group(1)
    raise SystemExit(f"{torch_wheel.name}: no cuda-toolkit pin in its metadata: this script knows no other "
                     "way to find the CUDA headers it was built with")


def extract(wheel, dest, keep):
    """Unpacks the members of `wheel` for which `keep(name)` holds into `dest`."""
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if keep(name):
                archive.extract(name, dest)


def build(version, work):
    """Compiles the backend for torch `version`; the path of the library."""
    torch_wheel = next(w for w in pip_download(f"torch=={version}", work) if w.name.startswith("torch-"))
    libraries = {f"torch/lib/lib{name}.so" for name in _torch_build.TORCH_LIBRARIES}
    site = work / f"site-{version}"
    extract(torch_wheel, site, lambda n: n.startswith("torch/include/") or n in libraries)
    requirement, cuda = cuda_requirement(torch_wheel)
    for wheel in pip_download(requirement, work / f"cuda-{cuda}", deps=True):
        extract(wheel, site, lambda n: n.startswith("nvidia/") and ("/include/" in n or "/lib/libcudart.so" in n))
    include, lib = _torch_build.cuda_headers([site])
    out = _torch_build.prebuilt_dir() / "pending.so"
    abi = _torch_build.compile_backend(out, site / "torch", [include, LIBRARY_HEADER.parent], lib)
    final = out.with_name(_torch_build.prebuilt_name(version, cuda, abi))
    out.replace(final)
    return final


def main(argv):
    versions = argv or [v.strip() for v in VERSIONS.read_text().splitlines() if v.strip() and not v.startswith("#")]
    prebuilt = _torch_build.prebuilt_dir()
    prebuilt.mkdir(parents=True, exist_ok=True)
    for old in prebuilt.glob("*.so"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        for version in versions:
            path = build(version, pathlib.Path(tmp))
            print(f"torch {version}: {path.relative_to(ROOT)} ({path.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
