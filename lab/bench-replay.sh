#!/usr/bin/env bash
# Times `streamalloc replay` of the largest sample trace (gpt2_generate.csv.xz, 161k operations)
# through every allocator on the simulator, end to end (parse, pass 0 with a memory sample
# after every operation, 3 timed passes), and the parse alone (criterion).
#
# Usage: lab/bench-replay.sh [--no-criterion]
set -euo pipefail
case ${1:-} in -h | --help) sed -n '2,/^set -/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
cargo build --release --quiet -p streamalloc-cli
echo "== streamalloc replay traces/gpt2_generate.csv.xz --device sim (wall clock)"
time target/release/streamalloc replay traces/gpt2_generate.csv.xz --device sim
if [[ "${1:-}" != "--no-criterion" ]]; then
    echo "== parse (criterion)"
    cargo bench --quiet -p streamalloc-cli --bench parse
fi
