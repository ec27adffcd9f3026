#!/usr/bin/env bash
# The C ABI's cost per operation: builds libstreamalloc.so (here) and scripts/capi_replay.c
# against it, then replays traces through streamalloc_malloc / streamalloc_free, once per
# configuration: the best and the mean of PASSES timed passes.
#   CONFS   space-separated STREAMALLOC_CONF strings
#           (default: "device=sim,strategy=stream_safe device=sim,strategy=stream_safe,expandable=true")
#   PASSES  timed passes (default 10)
#   LIB     a folder holding a libstreamalloc.so to use instead of building one (on a GPU
#           machine: .anchors, which scripts/gpu-bench.sh fills; CONFS without device=sim)
# Usage: scripts/capi-replay.sh TRACE...   (default: every trace of traces/)
set -euo pipefail
cd "$(dirname "$0")/.."
lib=${LIB:-}
if [ -z "$lib" ]; then
  cargo build --release --quiet -p streamalloc-capi
  lib=target/release
fi
lib=$(cd "$lib" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cc -O2 -o "$out/capi_replay" scripts/capi_replay.c -L"$lib" -lstreamalloc -Wl,-rpath,"$lib"
[ $# -gt 0 ] || set -- traces/*.csv traces/recorded/*.csv traces/synthetic/*.csv
for conf in ${CONFS:-device=sim,strategy=stream_safe device=sim,strategy=stream_safe,expandable=true}; do
  echo "== $conf"
  # One process per trace: the library's stacks live as long as the process, and a trace
  # replayed after another would start from the pool that one left.
  for trace in "$@"; do
    STREAMALLOC_CONF=$conf "$out/capi_replay" "${PASSES:-10}" "$trace"
  done
done
