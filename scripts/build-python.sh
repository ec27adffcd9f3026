#!/usr/bin/env bash
# Builds the Python wheel dist/streamalloc-<version>-py3-none-any.whl: the release
# libstreamalloc.so (x86-64 Linux; it loads libcuda at run time) bundled into the pure-Python
# package in python/. The wheel is built here (pip fetches setuptools for the build) and
# installs on any x86-64 Linux Python >= 3.8 without a registry:
#   python3 -m pip install --no-index --no-deps dist/streamalloc-*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p streamalloc-capi
# Debug info stays in target/release; the wheel keeps the symbols only.
strip --strip-debug -o python/streamalloc/libstreamalloc.so target/release/libstreamalloc.so
rm -rf python/build python/streamalloc.egg-info
python3 -m pip wheel --no-deps -w dist python/
rm -rf python/build python/streamalloc.egg-info
ls -l dist/streamalloc-*.whl
