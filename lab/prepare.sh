#!/usr/bin/env bash
# Prepares everything the GPU machine needs (it has no Rust toolchain and no registry), here:
#   .gpu/      the test executables and the measurement programs of crates/streamalloc-bench
#              (scripts/gpu-test.sh packs both)
#   .anchors/  the comparison harness and its wheels, and libstreamalloc.so (lab/run
#              links every trace of traces/ into .anchors/traces/ there)
#   dist/      the Python wheel bundling libstreamalloc.so (scripts/build-python.sh)
# then prints what to run there. On the GPU machine, lab/run runs the
# parts (tests, anchors, gpt2, cupy) and writes results under $OUT.
#
# Usage: lab/run prepare HARNESS (or HARNESS=... lab/run prepare). HARNESS is an
# external harness, not part of this repository, that replays traces through reference
# allocators (cudaMalloc, cudaMallocAsync, PyTorch's and RMM's pools) and through
# libstreamalloc.so: a folder holding anchors/ (build.sh, run.sh, run_mt.sh, table.py,
# fetch-wheels.sh). The GPU tests alone need only scripts/gpu-test.sh.
set -euo pipefail
case ${1:-} in -h | --help) sed -n '2,/^set -/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
harness=${1:-${HARNESS:-}}
if [ -z "$harness" ] || [ ! -d "$harness/anchors" ]; then
  echo "usage: $0 HARNESS: the folder of an external comparison harness, with anchors/" >&2
  exit 2
fi
bash scripts/gpu-test.sh >/dev/null
bash scripts/build-python.sh >/dev/null
rm -rf .anchors && mkdir -p .anchors
cp -r "$harness/anchors/." .anchors/ && chmod -R u+w .anchors
bash .anchors/fetch-wheels.sh .anchors/wheels >/dev/null
strip --strip-debug -o .anchors/libstreamalloc.so target/release/libstreamalloc.so
du -sh .gpu .anchors dist | tr '\n' ' '; echo
echo 'Copy this repository with .gpu/, .anchors/ and dist/ to the CUDA machine and run there, e.g.:'
echo '  bash lab/run tests cupy gpt2'
echo '  bash lab/run anchors bench'
