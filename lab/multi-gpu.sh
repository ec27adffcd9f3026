#!/usr/bin/env bash
# Runs the two-GPU tests (crates/streamalloc/tests/gpu_multi.rs) on a machine with two CUDA
# GPUs: per-device facade stacks and statistics, AsyncPool peer copies refused before
# grant_peer_access and byte-exact after, GPU 1 writing GPU 0's pool memory, and frees from a
# thread whose current context is the other GPU, for every strategy. Each test runs in its own
# process, so a fault in one cannot poison the context of the next. Output (with the
# per-device statistics the tests print) goes to $OUT/multi-gpu.log, a summary to
# $OUT/multi-gpu-summary.txt; exits non-zero if any test failed or fewer than two GPUs exist
# (the tests fail, never skip, then).
#
# Pack the tests first (on any x86-64 machine with Rust): `bash scripts/gpu-test.sh`, then,
# in this repository with .gpu/ on a machine with two GPUs: `bash lab/multi-gpu.sh`.
set -uo pipefail
case ${1:-} in -h | --help) sed -n '2,/^set -/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/streamalloc-multi-gpu}
mkdir -p "$OUT"
log=$OUT/multi-gpu.log
summary=$OUT/multi-gpu-summary.txt
: > "$log"
: > "$summary"

row=$(awk -F'\t' '$3 == "streamalloc.test.gpu_multi"' .gpu/tests.tsv 2>/dev/null | head -n 1)
if [ -z "$row" ]; then
  echo "no gpu_multi test executable in .gpu/tests.tsv: run scripts/gpu-test.sh here first" | tee "$summary"
  exit 1
fi
IFS=$'\t' read -r file pkg _ <<< "$row"
exe=$PWD/.gpu/bin/$file
{ nvidia-smi -L; nvidia-smi topo -m; } >> "$log" 2>&1

mapfile -t tests < <("$exe" --list --ignored 2>/dev/null | sed -n 's/: test$//p')
[ ${#tests[@]} -gt 0 ] || { echo "$exe lists no ignored tests" | tee "$summary"; exit 1; }
failed=0
for t in "${tests[@]}"; do
  echo "===== $t" >> "$log"
  (cd "$pkg" && CARGO_MANIFEST_DIR="$PWD" RUST_BACKTRACE=1 \
    timeout 300 "$exe" --ignored --nocapture --test-threads=1 --exact "$t") >> "$log" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] && status=ok || { status="FAILED (exit $rc)"; failed=$((failed + 1)); }
  printf '%-48s %s\n' "$t" "$status" | tee -a "$summary"
done
echo "TOTAL: $((${#tests[@]} - failed)) passed, $failed failed of ${#tests[@]}; log in $log" | tee -a "$summary"
[ "$failed" -eq 0 ]
