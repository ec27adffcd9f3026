#!/usr/bin/env bash
# Trains GPT-2 small (lab/gpt2_train.py) under PyTorch's native allocator and under
# streamalloc with each strategy, each in its own process, then checks that every run's losses
# equal the native run's bit for bit and prints a markdown table (lab/gpt2_check.py).
#
# Usage: lab/gpt2_compare.sh [STRATEGY...]   (default: plain best_fit stream_safe async)
# Extra settings for every streamalloc run: STREAMALLOC_EXTRA (e.g. "stats=true").
# Results: $OUT (or /tmp/gpt2_compare): one .log and one .json per run, and table.md.
#
# streamalloc comes from the wheel in dist/ (scripts/build-python.sh; installed into a
# scratch folder, without a registry) or else from python/ with libstreamalloc.so copied in.
set -uo pipefail
case ${1:-} in -h | --help) sed -n '2,/^set -/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpt2_compare}
mkdir -p "$out"

wheel=$(ls dist/streamalloc-*x86_64.whl 2>/dev/null | tail -n 1 || true)
if [ -n "$wheel" ]; then
  site=$(mktemp -d)
  python3 -m pip install --quiet --no-index --no-deps --target "$site" "$wheel" || exit 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
elif [ -f python/streamalloc/libstreamalloc.so ]; then
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no dist/streamalloc-*.whl and no python/streamalloc/libstreamalloc.so: run scripts/build-python.sh" >&2
  exit 1
fi

strategies=("$@")
[ ${#strategies[@]} -gt 0 ] || strategies=(plain best_fit stream_safe async)

run() {  # name allocator
  echo "== $1 ($2)"
  rm -f "$out/$1.json"
  python3 lab/gpt2_train.py --allocator "$2" --json "$out/$1.json" 2>&1 | tee "$out/$1.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || echo "== $1 failed with exit code $rc (see $out/$1.log)"
}

run native native
jsons=("$out/native.json")
for s in "${strategies[@]}"; do
  run "$s" "streamalloc:strategy=$s${STREAMALLOC_EXTRA:+,$STREAMALLOC_EXTRA}"
  jsons+=("$out/$s.json")
done
python3 lab/gpt2_check.py "${jsons[@]}" | tee "$out/table.md"
exit "${PIPESTATUS[0]}"
