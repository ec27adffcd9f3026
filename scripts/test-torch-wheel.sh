#!/usr/bin/env bash
# What a PyTorch user gets from `pip install torch` and the wheel, with no CUDA toolkit and no
# ninja (CI runs it after scripts/build-python.sh; no GPU needed: installing torch's allocator
# touches no device). For each torch release of python/torch-versions.txt, in a fresh virtual
# environment holding only torch from PyPI (its own dependencies) and the wheel:
#   1. enable() installs the backend the wheel carries (active() == "backend"), compiling
#      nothing (the build cache stays empty), and says how long the first enable() took;
#   2. a bad STREAMALLOC_CONF is an error at enable();
#   3. for a torch the wheel carries no backend for (its prebuilt file hidden), enable() falls
#      back with a warning that names the missing headers and `streamalloc[torch-build]`, and
#      with that extra installed compiles the backend on first use, without ninja, and says how
#      long that took.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
shopt -s nullglob
wheels=(dist/streamalloc-*-py3-none-manylinux_2_*_"$(uname -m)".whl)
[ "${#wheels[@]}" = 1 ] || { echo "want one $(uname -m) wheel in dist/ (scripts/build-python.sh), found: ${wheels[*]}" >&2; exit 1; }
wheel=$(realpath "${wheels[0]}")
passed=0
ok() { passed=$((passed + 1)); echo "ok: $*"; }
for version in $(grep -v '^#' python/torch-versions.txt); do
  venv=$tmp/venv-$version
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "torch==$version"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps "$wheel"
  # What the user has: no CUDA toolkit, no ninja on PATH or in the environment.
  for tool in nvcc ninja; do
    ! PATH="$venv/bin:/usr/bin:/bin" command -v "$tool" >/dev/null || { echo "$tool is installed: not a user's machine" >&2; exit 1; }
  done
  probe() { # probe CACHE [VAR=VALUE...]: enable() in the fresh environment
    local cache=$1; shift
    (cd "$tmp" && env -u CUDA_HOME -u CUDA_PATH -u STREAMALLOC_TORCH -u STREAMALLOC_CONF PATH="$venv/bin:/usr/bin:/bin" \
      STREAMALLOC_CACHE="$cache" "$@" "$venv/bin/python" -W always -c '
import time, warnings
import torch
import streamalloc.torch as t
start = time.perf_counter()
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    try:
        t.enable()
    except Exception as e:
        print("error:", type(e).__name__, e)
print("active:", t.active(), f"{time.perf_counter() - start:.2f} s", torch.__version__)
for w in seen:
    print("warning:", w.message)
' 2>&1)
  }
  got=$(probe "$tmp/cache-prebuilt")
  echo "$got" | sed 's/^/  /'
  grep -q "^active: backend .* $version" <<<"$got" || { echo "torch $version: enable() did not install the wheel's backend" >&2; exit 1; }
  [ -z "$(ls -A "$tmp/cache-prebuilt" 2>/dev/null)" ] || { echo "torch $version: enable() compiled something" >&2; exit 1; }
  ok "torch $version from PyPI, no toolkit, no ninja: enable() installs the wheel's backend ($(grep -o '[0-9.]* s' <<<"$got"))"

  got=$(probe "$tmp/cache-bad" STREAMALLOC_CONF=strategy=warp)
  grep -q "^error: StreamallocError.*warp" <<<"$got" || { echo "torch $version: a bad STREAMALLOC_CONF passed enable(): $got" >&2; exit 1; }
  ok "torch $version: a bad STREAMALLOC_CONF is an error at enable()"

  # A torch with no backend in the wheel: the prebuilt file hidden.
  prebuilt=$("$venv/bin/python" -c 'from streamalloc import _torch_build as b; print(b.prebuilt_dir())')
  mv "$prebuilt" "$prebuilt.hidden"
  got=$(probe "$tmp/cache-none")
  grep -q "^active: pluggable" <<<"$got" && grep -q "^warning:.*crt/host_config.h.*streamalloc\[torch-build\]" <<<"$got" \
    || { echo "torch $version without a prebuilt backend and without crt headers: $got" >&2; exit 1; }
  ok "torch $version, no backend in the wheel, no crt headers: the fallback's warning names what to install"
  "$venv/bin/pip" install -q --disable-pip-version-check "$wheel[torch-build]"
  got=$(probe "$tmp/cache-built")
  echo "$got" | sed 's/^/  /'
  grep -q "^active: backend" <<<"$got" || { echo "torch $version: the backend was not compiled on first use: $got" >&2; exit 1; }
  ok "torch $version, no backend in the wheel, with streamalloc[torch-build]: compiled on first use without ninja ($(grep -o '[0-9.]* s' <<<"$got"))"
  mv "$prebuilt.hidden" "$prebuilt"
done
echo "torch wheel: $passed passed, 0 failed"
