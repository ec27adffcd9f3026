#!/usr/bin/env bash
# Tests the wheels scripts/build-python.sh built (CI runs it after that script): each wheel's
# platform tag is the one auditwheel derives from its library (auditwheel is fetched from PyPI
# into a scratch environment); pip takes this machine's wheel for its own platform and refuses
# it for an older glibc and for another architecture; installed into a fresh virtual
# environment, it has the version of Cargo.toml, its library loads and allocates on the
# simulator, and its `streamalloc` command (the bundled CLI) replays, imports and plots.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0
ok() { passed=$((passed + 1)); echo "ok: $*"; }
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
shopt -s nullglob
wheels=(dist/streamalloc-*.whl)
native=(dist/streamalloc-"$version"-py3-none-manylinux_2_*_"$(uname -m)".whl)
[ "${#native[@]}" = 1 ] || { echo "want one wheel of version $version for $(uname -m) in dist/, found: ${wheels[*]}" >&2; exit 1; }
wheel=${native[0]}

python3 -m venv "$tmp/audit"
"$tmp/audit/bin/pip" install -q --disable-pip-version-check auditwheel
# The torch backends the x86-64 wheel carries load only into a process that imported torch, whose
# libraries (libc10, libtorch_cuda, libcudart of torch's CUDA) they link by name: auditwheel judges
# the wheel without them, and each is checked on its own: torch's libraries and the system's
# alone, and no newer glibc than the wheel's tag.
for w in "${wheels[@]}"; do
  tag=${w##*-}; tag=${tag%.whl}
  audited=$tmp/audited/$(basename "$w")
  mkdir -p "$tmp/audited" "$tmp/backends"
  python3 - "$w" "$audited" "$tmp/backends" <<'PY'
import sys, zipfile
src, dst, backends = sys.argv[1:]
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        data = zin.read(item)
        if "/_torch_backend/prebuilt/" in item.filename:
            zin.extract(item, backends)
            continue
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True) if b"/_torch_backend/prebuilt/" not in line)
        zout.writestr(item, data)
PY
  shown=$("$tmp/audit/bin/auditwheel" show "$audited" | tr -s "\n " "  ") # joins its wrapped lines
  grep -q "consistent with the following platform tag: \"$tag\"" <<<"$shown" \
    || { echo "$w: auditwheel disagrees with its tag $tag:" >&2; echo "$shown" >&2; exit 1; }
  ok "$w: auditwheel confirms $tag (the torch backends apart)"
done
glibc_of_tag=$(cut -d_ -f3 <<<"${tag}")
for backend in $(find "$tmp/backends" -name '*.so'); do
  needed=$(readelf -d "$backend" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
  for lib in $needed; do
    case "$lib" in
      libc10.so|libc10_cuda.so|libtorch_cpu.so|libtorch_cuda.so|libcudart.so.*) ;;
      libstdc++.so.6|libgcc_s.so.1|libc.so.6|libm.so.6|ld-linux-*) ;;
      *) echo "$(basename "$backend") needs $lib, neither torch's nor the system's" >&2; exit 1 ;;
    esac
  done
  newest=$(readelf -V --wide "$backend" | grep -o 'GLIBC_2\.[0-9]*' | cut -d. -f2 | sort -n | tail -1)
  [ "$newest" -le "$glibc_of_tag" ] || { echo "$(basename "$backend") needs glibc 2.$newest, the wheel says 2.$glibc_of_tag" >&2; exit 1; }
  ok "$(basename "$backend"): links torch's libraries and the system's only, glibc 2.$newest"
done

# pip's own platform check, offline: the wheel's tag and nothing older or foreign.
tag=${wheel##*-}; tag=${tag%.whl}
glibc=$(cut -d_ -f3 <<<"$tag")
pick() { python3 -m pip download -q --disable-pip-version-check --no-index --find-links dist \
  --only-binary=:all: --python-version 3.8 --platform "$1" -d "$tmp/pick-$1" streamalloc >/dev/null 2>&1; }
pick "$tag" || { echo "pip does not pick $wheel for $tag" >&2; exit 1; }
! pick "manylinux_2_$((glibc - 1))_$(uname -m)" || { echo "pip picks $wheel for glibc 2.$((glibc - 1))" >&2; exit 1; }
! pick "manylinux_2_${glibc}_riscv64" || { echo "pip picks $wheel for riscv64" >&2; exit 1; }
ok "pip picks $wheel for $tag only (not glibc 2.$((glibc - 1)), not another architecture)"

# The licenses travel in the wheel (pyproject.toml's license-files).
licenses=$(python3 -m zipfile -l "$wheel" | grep -o 'dist-info/licenses/LICENSE-[A-Z]*' | sort | tr '\n' ' ')
[ "$licenses" = "dist-info/licenses/LICENSE-APACHE dist-info/licenses/LICENSE-MIT " ] \
  || { echo "$wheel carries the licenses: ${licenses:-none} (want LICENSE-APACHE and LICENSE-MIT)" >&2; exit 1; }
ok "$wheel carries LICENSE-APACHE and LICENSE-MIT"

python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q --disable-pip-version-check --no-index --no-deps "$wheel"
cd "$tmp" # away from python/, so the import finds the installed package only
STREAMALLOC_CONF= "$tmp/venv/bin/python" - "$version" "$tmp/venv" <<'PY'
import ctypes, pathlib, sys
import streamalloc

version, venv = sys.argv[1], pathlib.Path(sys.argv[2]).resolve()
assert streamalloc.__version__ == version, (streamalloc.__version__, version)
assert venv in streamalloc.library_path().resolve().parents, streamalloc.library_path()
print(f"ok: installed streamalloc {streamalloc.__version__} at {streamalloc.library_path().parent}")
streamalloc.configure("device=sim,strategy=stream_safe,sim_capacity=1GiB")
lib, ptr = streamalloc.load(), ctypes.c_void_p()
streamalloc.check(lib.streamalloc_allocate(1 << 20, 0, None, ctypes.byref(ptr)))
stats = streamalloc.stats(0)
assert stats["allocated"] == 1 << 20 and stats["live_allocations"] == 1, stats
streamalloc.check(lib.streamalloc_deallocate(ptr))
assert streamalloc.stats(0)["allocated"] == 0
print("ok: its libstreamalloc.so allocates and frees on the simulator")
PY
passed=$((passed + 2))

# The `streamalloc` command of the wheel (a console script running the bundled CLI), with no
# Rust toolchain on the PATH: replay (an xz trace), import (a snapshot), plot (replay's JSON).
cli() { PATH="$tmp/venv/bin:/usr/bin:/bin" STREAMALLOC_CONF= streamalloc "$@"; }
[ "$(PATH="$tmp/venv/bin:/usr/bin:/bin" command -v streamalloc)" = "$tmp/venv/bin/streamalloc" ] \
  || { echo "the wheel installs no streamalloc command" >&2; exit 1; }
cli replay "$repo/traces/resnet50_train.csv.xz" --device sim -a stream_safe --passes 1 --json >"$tmp/r.json"
grep -q '"trace": "resnet50_train.csv"' "$tmp/r.json" || { echo "replay: $(head -c 300 "$tmp/r.json")" >&2; exit 1; }
ok "streamalloc replay (the wheel's command) replays traces/resnet50_train.csv.xz"
cli import "$repo/traces/snapshots/mlp_train_side_stream.pickle" -o "$tmp/mlp.csv.xz"
cli replay "$tmp/mlp.csv.xz" --device sim -a plain --passes 1 >/dev/null
ok "streamalloc import writes a trace (xz) that streamalloc replay reads"
cli plot "$tmp/r.json" -o "$tmp/r.svg"
grep -q '<svg' "$tmp/r.svg" || { echo "plot wrote no SVG" >&2; exit 1; }
ok "streamalloc plot draws replay's JSON"

# STREAMALLOC_TORCH=1 enables streamalloc as torch is imported (the wheel's .pth start-up hook),
# in the process and in the processes it starts. A stand-in for torch (no torch here) records
# what enable() makes current through its pluggable path.
mkdir -p "$tmp/fake/torch/cuda"
cat > "$tmp/fake/torch/__init__.py" <<'FAKE'
from . import cuda
FAKE
cat > "$tmp/fake/torch/cuda/__init__.py" <<'FAKE'
from . import memory
FAKE
cat > "$tmp/fake/torch/cuda/memory.py" <<'FAKE'
current = None
class _Hooks:
    def __getattr__(self, setter):
        return lambda function: None
class CUDAPluggableAllocator:
    def __init__(self, path, malloc, free):
        self.path, self.malloc, self.free = path, malloc, free
    def allocator(self):
        return _Hooks()
def change_current_allocator(allocator):
    global current
    current = allocator
FAKE
probe='import sys, subprocess, torch, streamalloc.torch as t
print(t.active(), getattr(torch.cuda.memory.current, "malloc", None))
if len(sys.argv) > 1:
    subprocess.run([sys.executable, "-c", "import torch, streamalloc.torch as t; print(\"child\", t.active())"], check=True)'
run_probe() { PYTHONPATH="$tmp/fake" STREAMALLOC_TORCH_BACKEND=pluggable "$tmp/venv/bin/python" -W ignore -c "$probe" "$@"; }
got=$(STREAMALLOC_TORCH=1 run_probe spawn)
[ "$got" = $'pluggable streamalloc_torch_malloc\nchild pluggable' ] || { echo "STREAMALLOC_TORCH=1: got: $got" >&2; exit 1; }
got=$(STREAMALLOC_TORCH= run_probe)
[ "$got" = "None None" ] || { echo "without STREAMALLOC_TORCH: got: $got" >&2; exit 1; }
got=$(STREAMALLOC_TORCH=0 run_probe)
[ "$got" = "None None" ] || { echo "STREAMALLOC_TORCH=0: got: $got" >&2; exit 1; }
ok "STREAMALLOC_TORCH=1 makes streamalloc torch's allocator at the import of torch, in child processes too; unset or 0, it does not"
echo "wheel: $passed passed, 0 failed"
