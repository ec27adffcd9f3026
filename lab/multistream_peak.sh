#!/usr/bin/env bash
# Issue 37: does a replay that knows streams and time predict a multi-stream program's peak?
# On the GPU machine, from the repository root: for each strategy, runs
# lab/multistream_peak.py (a side stream with record_stream, a copy/compute overlap)
# under streamalloc's torch backend with the library's trace and a torch memory snapshot
# recorded, then replays on the simulator, with and without time, both the trace and the
# snapshot converted by `streamalloc import`, and prints a table: the peak reserved on the GPU
# (torch.cuda.max_memory_reserved() under the backend), the replays' peak reserved, and their
# difference from the GPU's in %.
#
# Needs: the wheel (dist/streamalloc-*x86_64.whl; WHEEL overrides) with torch, a C++ compiler,
# ninja and CUDA headers for the backend (built once into STREAMALLOC_CACHE, default
# /tmp/streamalloc-cache); the CLI binary: STREAMALLOC_BIN, else .gpu/bin/streamalloc (from
# scripts/gpu-test.sh; .gpu.tar.xz is unpacked if .gpu/ is missing), else
# target/release/streamalloc. STRATEGIES (default "stream_safe best_fit async"), STEPS
# (default 24) and PROGRAM_ARGS (more arguments to the program) override. Everything goes to
# $OUT (default /tmp/streamalloc-gpu)/multistream/: per strategy the trace, snapshot, imported
# trace, program JSON and replay JSONs, logs; the table in $OUT/multistream_peak.md.
# Exits non-zero if any step failed (the table shows what was measured).
set -uo pipefail
case ${1:-} in -h | --help) sed -n '2,/^set -/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/streamalloc-gpu}
dir=$OUT/multistream
rm -rf "$dir" && mkdir -p "$dir"
export STREAMALLOC_CACHE=${STREAMALLOC_CACHE:-/tmp/streamalloc-cache}
limit=${STEP_TIMEOUT:-500} # seconds per program run or replay

# --- the CLI and the package --------------------------------------------------------------
[ -d .gpu ] || { [ -f .gpu.tar.xz ] && tar xJf .gpu.tar.xz; }
bin=${STREAMALLOC_BIN:-}
for candidate in .gpu/bin/streamalloc target/release/streamalloc; do
  [ -z "$bin" ] && [ -x "$candidate" ] && bin=$candidate
done
[ -n "$bin" ] || { echo "no streamalloc binary: run scripts/gpu-test.sh first (.gpu/bin/streamalloc) or set STREAMALLOC_BIN"; exit 1; }
wheel=$(ls ${WHEEL:-dist/streamalloc-*x86_64.whl} 2>/dev/null | head -1)
[ -n "$wheel" ] || { echo "no wheel in dist/ (scripts/build-python.sh) and no WHEEL"; exit 1; }
site=/tmp/sa-site
rm -rf "$site" && python3 -m pip install -q --no-index --no-deps --target "$site" "$wheel" || exit 1
echo "CLI: $bin; wheel: $wheel"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# --- runs and replays -----------------------------------------------------------------------
failed=()
# replay NAME CSV STRATEGY TIME_FLAG: the replay's --json output into $dir/NAME.json.
replay() {
  timeout "$limit" "$bin" replay "$2" -c "strategy=$3" --device sim --passes 1 --json "$4" \
    > "$dir/$1.json" 2> "$dir/$1.log" || { echo "  replay $1 failed: $(tail -n 3 "$dir/$1.log")"; failed+=("$1"); }
}
for strategy in ${STRATEGIES:-stream_safe best_fit async}; do
  echo "===== $strategy"
  run=$dir/$strategy
  # The library writes the trace at exit; the program writes its JSON before.
  if ! PYTHONPATH=$site timeout "$limit" python3 lab/multistream_peak.py \
      --conf "strategy=$strategy,trace=$run.csv" --snapshot "$run.pickle" --json "$run.gpu.json" \
      --steps "${STEPS:-24}" ${PROGRAM_ARGS:-} > "$run.program.log" 2>&1; then
    echo "  the program failed: $(tail -n 5 "$run.program.log")"; failed+=("$strategy program"); continue
  fi
  tail -n 1 "$run.program.log"
  echo "  trace: $(grep -c ',use,' "$run.csv") use, $(grep -c ',wait,' "$run.csv") wait, $(grep -c ',record_stream,' "$run.csv") record_stream rows of $(($(wc -l < "$run.csv") - 1))"
  if timeout "$limit" "$bin" import "$run.pickle" -o "$run.snapshot.csv" > "$run.import.log" 2>&1; then
    cat "$run.import.log"
  else
    echo "  import failed: $(tail -n 3 "$run.import.log")"; failed+=("$strategy import")
  fi
  # The trace again, each use row lasting what CUDA events measured for that work in this run
  # (the program wrote them with durations measured in calibration steps, as it enqueued them).
  python3 - "$run.csv" "$run.gpu.json" "$run.measured.csv" <<'PY' || failed+=("$strategy measured")
import csv, json, sys
source, program, out = sys.argv[1:]
by_stream = {int(k): list(v) for k, v in json.load(open(program))["measured_ns_by_stream"].items()}
with open(source, newline="") as f, open(out, "w", newline="") as g:
    rows, writer = csv.reader(f), csv.writer(g, lineterminator="\n")
    writer.writerow(next(rows))
    for row in rows:
        # Thread,Time,Action,Pointer,Size,Stream: a use row that ran work (Size > 0) takes the next
        # measured duration of its stream.
        if row[2] == "use" and int(row[4]) > 0 and by_stream.get(int(row[5])):
            row[4] = str(by_stream[int(row[5])].pop(0))
        writer.writerow(row)
left = sum(len(v) for v in by_stream.values())
if left:
    sys.exit(f"{left} measured durations matched no use row")
PY
  for source in trace measured snapshot; do
    csv=$run.csv; [ $source = snapshot ] && csv=$run.snapshot.csv; [ $source = measured ] && csv=$run.measured.csv
    [ -f "$csv" ] || continue
    replay "$strategy.$source.time" "$csv" "$strategy" --time
    replay "$strategy.$source.notime" "$csv" "$strategy" --no-time
  done
done

# --- the table ------------------------------------------------------------------------------
python3 - "$dir" ${STRATEGIES:-stream_safe best_fit async} <<'PY' | tee "$OUT/multistream_peak.md"
import json, os, sys

folder, strategies = sys.argv[1], sys.argv[2:]


def load(name):
    try:
        with open(os.path.join(folder, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def mib(n):
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def diff(replayed, gpu):
    return "-" if replayed is None or not gpu else f"{100 * (replayed - gpu) / gpu:+.1f}%"


print("| strategy | replayed | GPU peak reserved | GPU peak allocated | replay with time | "
      "replay without time | with time vs GPU | without time vs GPU | violations (time) |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for strategy in strategies:
    gpu = load(f"{strategy}.gpu.json") or {}
    reserved = gpu.get("max_memory_reserved")
    for source in ("trace", "measured", "snapshot"):
        rows = {}
        for mode in ("time", "notime"):
            result = load(f"{strategy}.{source}.{mode}.json")
            rows[mode] = result[0] if result else {}
        timed, untimed = rows["time"].get("reserved_peak"), rows["notime"].get("reserved_peak")
        if rows["time"] and not rows["time"].get("time"):
            timed = None  # not replayed with time: no figure to show for it
        print(f"| {strategy} | {source} | {mib(reserved)} | {mib(gpu.get('max_memory_allocated'))} | "
              f"{mib(timed)} | {mib(untimed)} | {diff(timed, reserved)} | {diff(untimed, reserved)} | "
              f"{rows['time'].get('violations', '-')} |")
print()
print("GPU peaks: torch.cuda.max_memory_reserved()/max_memory_allocated() under streamalloc's torch "
      "backend (the library's figures); replayed: the library's trace (use rows lasting what calibration "
      "steps measured), the same with each use row lasting what this run measured, the torch snapshot "
      "imported; replays: peak reserved on the simulator (`streamalloc replay "
      "--device sim -c strategy=S`), with time (--time: the clock follows the rows' Time, use rows run "
      "as kernels) and without (--no-time).")
PY
echo "===== done; failed: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
