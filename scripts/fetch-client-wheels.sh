#!/usr/bin/env bash
# Downloads the wheels that RMM's GPU tests need (python/tests/gpu/test_clients.py) into the
# git-ignored folder .client-wheels/, for a GPU machine without network: RMM for CUDA 13
# (rmm-cu13, librmm-cu13) and rapids-logger, which librmm loads. The GPU machine's image
# already has what else they need (cuda-bindings >= 13.0.1, numpy >= 2), and Numba
# (numba, numba-cuda). lab/run installs them beside the streamalloc wheel.
#   bash scripts/fetch-client-wheels.sh            # RMM 26.10, for CPython 3.12 on x86-64
#   RMM_VERSION=26.08 PYTHON_VERSION=3.11 bash scripts/fetch-client-wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rmm=${RMM_VERSION:-26.10}
rm -rf .client-wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .client-wheels "rmm-cu13==$rmm.*" "librmm-cu13==$rmm.*" "rapids-logger==0.3.*"
ls -l .client-wheels
du -ch .client-wheels/*.whl | tail -n 1
