"""Wheel build (setuptools, configured in pyproject.toml) with two things pyproject cannot say.

- The version is the Cargo workspace's (`[workspace.package] version` in ../Cargo.toml), the one
  source of truth; `streamalloc.__version__` reads it back from the installed metadata.
- The wheel is tagged `py3-none-<platform>` and installs into platlib: the Python code runs on
  any Python 3, but the bundled libstreamalloc.so is machine code for one platform. The platform
  tag is given with `--plat-name` (scripts/build-python.sh passes the manylinux tag it derives
  from the library's glibc symbol versions).
- `streamalloc-autoload.pth` goes to the root of site-packages, beside the package, where
  Python runs it at start-up (`STREAMALLOC_TORCH=1`, see streamalloc/_autoload.py).
"""

import pathlib
import re

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

AUTOLOAD_PTH = "streamalloc-autoload.pth"


def cargo_version():
    """The version in the workspace Cargo.toml's `[workspace.package]` section."""
    cargo_toml = pathlib.Path(__file__).resolve().parent.parent / "Cargo.toml"
    section = cargo_toml.read_text().split("[workspace.package]", 1)[1].split("\n[", 1)[0]
    found = re.search(r'^version\s*=\s*"([^"]+)"', section, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"no version in [workspace.package] of {cargo_toml}")
    return found.group(1)


class NativeDistribution(Distribution):
    """The package carries a native library, so it installs into platlib, not purelib."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """Tags the wheel py3-none-<the --plat-name given>: any Python 3, one platform."""

    def get_tag(self):
        if not self.plat_name_supplied:
            raise RuntimeError("pass --plat-name (scripts/build-python.sh does): the library's platform")
        return "py3", "none", super().get_tag()[2]


class BuildWithAutoload(build_py):
    """Builds the package and puts the start-up hook at the root of what is installed."""

    def run(self):
        super().run()
        here = pathlib.Path(__file__).resolve().parent
        self.copy_file(str(here / AUTOLOAD_PTH), str(pathlib.Path(self.build_lib) / AUTOLOAD_PTH))


setup(
    version=cargo_version(),
    distclass=NativeDistribution,
    cmdclass={"bdist_wheel": PlatformWheel, "build_py": BuildWithAutoload},
)
