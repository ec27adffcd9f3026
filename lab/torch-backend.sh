#!/usr/bin/env bash
# The GPU tests of streamalloc's torch backend (issue 34), on the GPU machine, from the repo
# root: builds the backend against the installed torch, then runs
#   1. python/tests/gpu/test_torch_backend.py with the backend (STREAMALLOC_TORCH_BACKEND=backend:
#      a backend that cannot be built is an error, never a silent fallback);
#   2. the same tests with the fallback forced (STREAMALLOC_TORCH_BACKEND=pluggable): every test
#      must FAIL there (torch refuses the operation), the evidence that each tests the backend;
#   3. unless REGRESSION=0, the existing python/tests/gpu/test_torch_guarantees.py under the
#      backend (record_stream, graphs, empty_cache, fraction, ... now through the backend);
# and prints a summary: each new test's outcome on both paths, "ok" where the backend passed
# and the fallback failed.
#
# The package: python/streamalloc/ of this tree (the backend's source included) with
# libstreamalloc.so from LIB, else the first of python/streamalloc/libstreamalloc.so,
# the wheel dist/streamalloc-*x86_64.whl (WHEEL overrides), .anchors/libstreamalloc.so,
# target/release/libstreamalloc.so; assembled into /tmp/sa-site (PYTHONPATH). Needs torch,
# pytest, pytest-timeout, pytest-xdist, a C++ compiler, ninja and CUDA headers (CUDA_HOME or the
# nvidia-cuda-runtime wheel). Results in $OUT (default /tmp/streamalloc-gpu):
# torch-backend-build.log, torch-backend.log, torch-backend-pluggable.log,
# torch-backend-regression.log, torch-backend-summary.txt. NEW=0 skips runs 1 and 2,
# REGRESSION=0 run 3 (each run takes minutes: split them under a time limit). Extra arguments go to pytest
# (e.g. -k "stats or oom"). Exits non-zero unless every new test passed with the backend and
# failed with the fallback, and the regression run passed.
set -uo pipefail
case ${1:-} in -h | --help) sed -n '2,/^set -/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/streamalloc-gpu}
mkdir -p "$OUT"
site=/tmp/sa-site
export STREAMALLOC_CACHE=${STREAMALLOC_CACHE:-/tmp/streamalloc-cache}

# --- the package ------------------------------------------------------------------------------
lib=${LIB:-}
if [ -z "$lib" ]; then
  for candidate in python/streamalloc/libstreamalloc.so; do [ -f "$candidate" ] && lib=$candidate; done
fi
if [ -z "$lib" ]; then
  wheel=$(ls ${WHEEL:-dist/streamalloc-*x86_64.whl} 2>/dev/null | head -1)
  if [ -n "$wheel" ]; then
    rm -rf /tmp/sa-wheel && mkdir -p /tmp/sa-wheel &&
      python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('streamalloc/libstreamalloc.so', '/tmp/sa-wheel')" "$wheel" &&
      lib=/tmp/sa-wheel/streamalloc/libstreamalloc.so
  fi
fi
if [ -z "$lib" ]; then
  for candidate in .anchors/libstreamalloc.so target/release/libstreamalloc.so; do
    [ -z "$lib" ] && [ -f "$candidate" ] && lib=$candidate
  done
fi
[ -n "$lib" ] || { echo "torch-backend.sh: no libstreamalloc.so (set LIB=PATH)"; exit 2; }
rm -rf "$site" && mkdir -p "$site" && cp -r python/streamalloc "$site/" &&
  rm -rf "$site/streamalloc/__pycache__" && cp "$lib" "$site/streamalloc/libstreamalloc.so" || exit 2
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
echo "package: $site/streamalloc (library from $lib)"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null

# --- the backend ------------------------------------------------------------------------------
start=$(date +%s)
if STREAMALLOC_TORCH_BACKEND=backend python3 -c \
  "import streamalloc.torch as t; print('backend built:', t.build_backend())" \
  > "$OUT/torch-backend-build.log" 2>&1; then
  build_ok=1
  echo "backend built in $(( $(date +%s) - start )) s: $(tail -n 1 "$OUT/torch-backend-build.log")"
else
  build_ok=0
  echo "BACKEND BUILD FAILED ($OUT/torch-backend-build.log):"; tail -n 30 "$OUT/torch-backend-build.log"
fi

jobs=$(( $(nproc) > 8 ? 8 : $(nproc) ))
run() { # run LOG PATH TESTFILE [pytest args]
  local log=$1 path=$2 file=$3; shift 3
  STREAMALLOC_TORCH_BACKEND=$path python3 -m pytest -q -rA -p no:cacheprovider --durations=10 \
    -n "$jobs" "$file" "$@" > "$log" 2>&1
}

backend_rc=0
if [ "${NEW:-1}" != 0 ]; then
  run "$OUT/torch-backend.log" backend python/tests/gpu/test_torch_backend.py "$@"; backend_rc=$?
  run "$OUT/torch-backend-pluggable.log" pluggable python/tests/gpu/test_torch_backend.py "$@"
fi
regression_rc=0
if [ "${REGRESSION:-1}" != 0 ]; then
  # Parallel, then the cases that measure device-wide memory alone (as lab/run torch).
  run "$OUT/torch-backend-regression.log" backend python/tests/gpu/test_torch_guarantees.py -m "not serial"
  regression_rc=$?
  STREAMALLOC_TORCH_BACKEND=backend python3 -m pytest -q -rA -p no:cacheprovider -m serial \
    python/tests/gpu/test_torch_guarantees.py >> "$OUT/torch-backend-regression.log" 2>&1 || regression_rc=1
fi

# --- summary ----------------------------------------------------------------------------------
python3 - "$OUT" "$build_ok" "$backend_rc" "$regression_rc" "${REGRESSION:-1}" "${NEW:-1}" <<'PY' | tee "$OUT/torch-backend-summary.txt"
import re, sys
out, build_ok, backend_rc, regression_rc, regression, new = sys.argv[1:]

def outcomes(path):
    found = {}
    try:
        text = open(path).read()
    except OSError:
        return found
    for m in re.finditer(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) (\S+)(?: - (.*))?$", text, re.M):
        found[m.group(2).split("::", 1)[-1]] = (m.group(1), (m.group(3) or "")[:150])
    return found

backend = outcomes(f"{out}/torch-backend.log")
pluggable = outcomes(f"{out}/torch-backend-pluggable.log")
print(f"backend build: {'ok' if build_ok == '1' else 'FAILED'}")
print(f"{'test':<62} {'backend':<8} {'pluggable':<9} verdict")
bad = 0
for test in sorted(set(backend) | set(pluggable)):
    b = backend.get(test, ("-", ""))[0]
    p = pluggable.get(test, ("-", ""))[0]
    verdict = "ok" if b == "PASSED" and p in ("FAILED", "ERROR") else (
        "known failure (xfail)" if b == "XFAIL" else
        "BACKEND " + b if b != "PASSED" else "PASSES ON THE FALLBACK (tests nothing)")
    bad += verdict not in ("ok", "known failure (xfail)")
    print(f"{test:<62} {b:<8} {p:<9} {verdict}")
    if b != "PASSED" and backend.get(test, ("", ""))[1]:
        print(f"    backend: {backend[test][1]}")
if new != "0" and not backend:
    print("no results from the backend run: see torch-backend.log"); bad += 1
bad += build_ok != "1"
if regression != "0":
    reg = outcomes(f"{out}/torch-backend-regression.log")
    failed = [t for t, (o, _) in reg.items() if o not in ("PASSED", "XFAIL")]
    print(f"regression (test_torch_guarantees.py under the backend): {len(reg) - len(failed)} of {len(reg)} passed")
    for t in failed:
        print(f"    {reg[t][0]} {t}: {reg[t][1]}")
    bad += bool(failed) or regression_rc != "0" and not reg
print("RESULT: " + ("all good" if bad == 0 else f"{bad} problem(s)"))
sys.exit(1 if bad else 0)
PY
