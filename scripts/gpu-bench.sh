#!/usr/bin/env bash
# Prepares everything the GPU machine needs (it has no Rust toolchain and no registry), here:
#   .gpu/      the test executables (scripts/gpu-test.sh) and the recorded_free_cost,
#              async_overhead and mt_replay examples
#   .anchors/  the anchors harness, traces, RMM wheels and libstreamalloc.so
#   dist/      the Python wheel bundling libstreamalloc.so (scripts/build-python.sh)
# then prints the device-tool calls. On the GPU machine, scripts/gpu/device-run.sh runs the
# parts (tests, anchors, gpt2, cupy) and writes results under $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${SHARED:-../shared}
bash scripts/gpu-test.sh >/dev/null
cargo build --release -p streamalloc --example recorded_free_cost --example async_overhead --example mt_replay
for e in recorded_free_cost async_overhead mt_replay; do strip --strip-debug -o .gpu/$e target/release/examples/$e; done
bash scripts/build-python.sh >/dev/null
rm -rf .anchors && mkdir -p .anchors
cp -r "$shared/anchors/." .anchors/ && cp -r "$shared/traces" .anchors/traces && chmod -R u+w .anchors
bash .anchors/fetch-wheels.sh .anchors/wheels >/dev/null
strip --strip-debug -o .anchors/libstreamalloc.so target/release/libstreamalloc.so
du -sh .gpu .anchors dist | tr '\n' ' '; echo
echo 'run(command="bash scripts/gpu/device-run.sh tests cupy gpt2", carry=[".gpu", ".anchors", "dist"], timeout_s=600)'
echo 'run(command="bash scripts/gpu/device-run.sh anchors", carry=[".gpu", ".anchors", "dist"], timeout_s=600)'
