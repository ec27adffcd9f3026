#!/usr/bin/env bash
# What CI checks of the lab (`bash lab/run check`), with neither a GPU nor torch, CuPy or the
# package installed: every file of lab/ is a kind this knows and is named in lab/README.md;
# every Python program compiles and every shell program parses; every program answers --help
# (exit 0, text on standard output); the C and C++ programs that need only the C ABI's header
# compile (syntax only, where a compiler is installed). async_same_run.cpp needs cuda.h and the
# external harness's header: it is compiled on the GPU machine by `lab/run samerun`.
# Python files without a __main__ block are modules the programs import (torch_runs.py).
set -uo pipefail
case ${1:-} in -h | --help) sed -n '2,/^set -/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
failed=()
fail() { failed+=("$1"); echo "FAILED: $1" >&2; }
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
for f in lab/*; do
  name=${f#lab/}
  [ "$name" = README.md ] && continue
  grep -qF "$name" lab/README.md || fail "$f: not named in lab/README.md"
  case $f in
    *.py)
      PYTHONPYCACHEPREFIX=$cache python3 -m py_compile "$f" || { fail "$f: does not compile"; continue; }
      if grep -q '^if __name__ == "__main__":' "$f"; then
        PYTHONPYCACHEPREFIX=$cache python3 "$f" --help < /dev/null > "$cache/help" 2>&1 && [ -s "$cache/help" ] ||
          fail "$f --help: $(tail -n 1 "$cache/help")"
      fi ;;
    *.sh | lab/run)
      bash -n "$f" || { fail "$f: does not parse"; continue; }
      bash "$f" --help < /dev/null > "$cache/help" 2>&1 && [ -s "$cache/help" ] ||
        fail "$f --help: $(tail -n 1 "$cache/help")" ;;
    *.c)
      if command -v cc > /dev/null; then cc -fsyntax-only "$f" || fail "$f: does not compile"; fi ;;
    *.cpp)
      if grep -q '#include <cuda.h>' "$f"; then
        : # needs the CUDA toolkit: compiled where it runs
      elif command -v c++ > /dev/null; then
        c++ -std=c++17 -fsyntax-only -Icrates/streamalloc-capi/include "$f" || fail "$f: does not compile"
      fi ;;
    *) fail "$f: a kind of file the check does not know" ;;
  esac
done
echo "lab check: $(ls lab | wc -l) files; failed: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
