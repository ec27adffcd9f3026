#!/usr/bin/env bash
# The randomized multi-stream fuzz against the simulator's ordering checker, longer than CI's
# million operations per stack: OPS operations per strategy and adaptor stack (default 100
# million), from SEED (default 16), optimized.
#   OPS=20000000 SEED=3 bash lab/fuzz-long.sh
set -euo pipefail
case ${1:-} in -h | --help) sed -n '2,/^set -/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
export STREAMALLOC_FUZZ_OPS="${OPS:-100000000}" STREAMALLOC_FUZZ_SEED="${SEED:-16}"
cargo test --release -p streamalloc --test fuzz_million -- --nocapture
