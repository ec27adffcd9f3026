#!/usr/bin/env bash
# The C ABI's cost per operation: builds libstreamalloc.so (here) and lab/capi_replay.c
# against it, then replays traces through streamalloc_malloc / streamalloc_free, once per
# configuration: the best and the mean of PASSES timed passes.
#   CONFS   space-separated STREAMALLOC_CONF strings
#           (default: "device=sim,strategy=stream_safe,backing=stitched device=sim,strategy=stream_safe,backing=chunks")
#   PASSES  timed passes (default 10)
#   LIB     a folder holding a libstreamalloc.so to use instead of building one (on a GPU
#           machine: .anchors, which lab/run prepare fills; CONFS without device=sim)
#   PROCS   processes per trace and configuration (default 1); with more, a line after them
#           gives the least, the median and the most of their best passes (on the H200 host
#           one process runs the same work at one of two speeds: bench/results/speed.md)
# Usage: lab/capi-replay.sh TRACE...   (default: every trace of traces/)
set -euo pipefail
case ${1:-} in -h | --help) sed -n '2,/^set -/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
lib=${LIB:-}
if [ -z "$lib" ]; then
  cargo build --release --quiet -p streamalloc-capi
  lib=target/release
fi
lib=$(cd "$lib" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cc -O2 -o "$out/capi_replay" lab/capi_replay.c -L"$lib" -lstreamalloc -Wl,-rpath,"$lib"
[ $# -gt 0 ] || set -- traces/*.csv.xz traces/recorded/*.csv.xz traces/synthetic/*.csv.xz
# capi_replay reads plain CSV: compressed traces are decompressed into $out first.
plain=()
for trace in "$@"; do
  case "$trace" in
    *.xz) xz -dc "$trace" > "$out/$(basename "$trace" .xz)" && plain+=("$out/$(basename "$trace" .xz)") ;;
    *.gz) gzip -dc "$trace" > "$out/$(basename "$trace" .gz)" && plain+=("$out/$(basename "$trace" .gz)") ;;
    *) plain+=("$trace") ;;
  esac
done
set -- "${plain[@]}"
for conf in ${CONFS:-device=sim,strategy=stream_safe,backing=stitched device=sim,strategy=stream_safe,backing=chunks}; do
  echo "== $conf"
  # One process per trace: the library's stacks live as long as the process, and a trace
  # replayed after another would start from the pool that one left.
  for trace in "$@"; do
    for _ in $(seq "${PROCS:-1}"); do
      STREAMALLOC_CONF=$conf "$out/capi_replay" "${PASSES:-10}" "$trace"
    done | tee "$out/runs"
    if [ "${PROCS:-1}" -gt 1 ]; then
      awk '/ns\/op best/ { print $4 }' "$out/runs" | sort -g | awk -v t="$(basename "$trace")" \
        '{ v[NR] = $1 } END { printf "%-28s best pass over %d processes: least %.1f, median %.1f, most %.1f ns/op\n", t, NR, v[1], (v[int((NR + 1) / 2)] + v[int(NR / 2) + 1]) / 2, v[NR] }'
    fi
  done
done
