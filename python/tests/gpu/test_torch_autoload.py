"""STREAMALLOC_TORCH=1 makes streamalloc PyTorch's allocator as torch is imported, in the
script's process and in those torch.multiprocessing spawns, with nothing of the script changed
(the wheel's start-up hook, streamalloc-autoload.pth; streamalloc/_autoload.py). Without the
variable, torch keeps its own allocator.

The hook runs from site-packages only (a .pth on PYTHONPATH is not read), so the test installs
the wheel (WHEEL, default dist/streamalloc-*x86_64.whl) into a virtual environment that sees
the system's torch, and runs autoload_cases.py with its Python.
"""

import glob
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import HERE, _run_case

pytestmark = pytest.mark.timeout(600)

REPO = HERE.parents[2]


@pytest.fixture(scope="module")
def python_with_wheel(tmp_path_factory):
    """A Python whose site-packages hold the streamalloc wheel, and the system's torch."""
    pattern = os.environ.get("WHEEL") or str(REPO / "dist" / "streamalloc-*x86_64.whl")
    wheels = sorted(glob.glob(pattern))
    if not wheels:
        pytest.fail(f"no wheel matches {pattern}: build it with scripts/build-python.sh", pytrace=False)
    venv = tmp_path_factory.mktemp("autoload") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    # The wheel unpacked into the environment's site-packages, as pip would place it (pip may be
    # missing from an environment made by a Python that is itself a virtual environment's).
    with zipfile.ZipFile(wheels[-1]) as wheel:
        wheel.extractall(own)
    # torch may live in site directories of this Python that the new environment does not inherit
    # (this Python itself a virtual environment, or user site-packages): listed after its own.
    theirs = [p for p in sys.path if os.path.isdir(p) and os.path.basename(p) in ("site-packages", "dist-packages")]
    Path(own, "_tests_parent_site.pth").write_text("".join(p + "\n" for p in theirs))
    return python


@pytest.mark.parametrize("setting,expect", [("1", "backend"), ("", "none")], ids=["set", "unset"])
def test_environment_variable_enables_streamalloc_at_import(python_with_wheel, monkeypatch, setting, expect):
    monkeypatch.setenv("STREAMALLOC_TORCH", setting)
    monkeypatch.setenv("STREAMALLOC_TORCH_BACKEND", "backend")
    # Away from the source tree, so that the installed package is the one imported.
    monkeypatch.setenv("PYTHONPATH", str(HERE))
    _run_case("autoload_cases.py", expect, python=str(python_with_wheel))
