#!/usr/bin/env bash
# Packs the workspace's tests for a GPU machine that has libcuda but no Rust toolchain.
#
# Here (no GPU needed): builds every release test executable of the workspace, copies them into
# the git-ignored folder .gpu/ with a runner, .gpu/run.sh, and prints how to run them.
# There: .gpu/run.sh runs each executable with --include-ignored --test-threads=1 (the normal
# tests plus the #[ignore]d GPU tests), prints one line per executable and a total, keeps logs in
# .gpu/logs (copied to $OUT when set), and exits non-zero on any failure. New tests/gpu_*.rs
# files (or any test target) are picked up automatically.
set -euo pipefail
cd "$(dirname "$0")/.."

rm -rf .gpu
mkdir -p .gpu/bin

# One line per file: test|bin|lib, path, package dir (test) or path in the tree (bin), label.
# (cargo build first: `cargo test` does not build cdylibs, which C and Python tests load.)
{ cargo build --release --workspace --message-format=json &&
  cargo test --release --workspace --no-run --message-format=json; } | python3 -c '
import json, os, sys
cdylibs, seen = {}, set()
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact":
        continue
    if "cdylib" in m["target"]["kind"] and not m["profile"]["test"]:
        cdylibs[m["package_id"]] = m
    if not m.get("executable") or m["executable"] in seen:
        continue
    seen.add(m["executable"])
    pkg = os.path.relpath(os.path.dirname(m["manifest_path"]))
    t = m["target"]
    if m["profile"]["test"]:
        label = os.path.basename(pkg) + "." + t["kind"][0] + "." + t["name"]
        print("test", m["executable"], pkg, label, sep="\t")
    elif t["kind"] == ["bin"]:  # tests run it (env!("CARGO_BIN_EXE_<name>")), or a measurement
                                # program (crates/streamalloc-bench), run as .gpu/bin/<name>
        print("bin", m["executable"], os.path.relpath(m["executable"]), "-", sep="\t")
for m in cdylibs.values():  # shared libraries that tests load from next to themselves
    for f in m["filenames"]:
        if f.endswith((".so", ".dylib")):
            print("lib", f, "-", "-", sep="\t")
' > .gpu/found.tsv

: > .gpu/tests.tsv
: > .gpu/bins.tsv
: > .gpu/libs.tsv
[ -n "${GPU_TEST_DEBUG:-}" ] && strip=--compress-debug-sections=zlib || strip=--strip-debug
pwd > .gpu/built-at   # tests find files through paths compiled in under this root
while IFS=$'\t' read -r kind exe where label; do
  # Keep .gpu/ small enough to copy: drop debug info (panic messages still name file:line), or with
  # GPU_TEST_DEBUG=1 keep it compressed (line numbers in backtraces, about 3x the size).
  objcopy "$strip" "$exe" ".gpu/bin/$(basename "$exe")" 2>/dev/null || cp "$exe" .gpu/bin/
  printf '%s\t%s\t%s\n' "$(basename "$exe")" "$where" "$label" >> ".gpu/${kind}s.tsv"
done < .gpu/found.tsv
rm .gpu/found.tsv

cat > .gpu/run.sh <<'RUNNER'
#!/usr/bin/env bash
# Runs every packed test executable, GPU tests included (GPU_TESTS_ONLY=REGEX: only those whose
# label matches, e.g. 'gpu_'); extra arguments (e.g. --skip NAME) go to every executable.
# Logs: .gpu/logs/, and with $OUT set, $OUT/summary.txt + $OUT/gpu-tests.log.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
logs=$here/logs
rm -rf "$logs" && mkdir -p "$logs"
# Paths compiled into the tests (env!("CARGO_MANIFEST_DIR"), env!("CARGO_BIN_EXE_..")) name
# the build machine's tree: make that path lead here, and put the binaries where they were.
built_at=$(cat "$here/built-at")
[ -e "$built_at" ] || { mkdir -p "$(dirname "$built_at")" && ln -s "$root" "$built_at"; }
while IFS=$'\t' read -r file rel _; do
  mkdir -p "$root/$(dirname "$rel")" && ln -sf "$here/bin/$file" "$root/$rel"
done < "$here/bins.tsv"
mkdir -p "$root/target/tmp"   # env!("CARGO_TARGET_TMPDIR") of integration tests
limit=${GPU_TEST_TIMEOUT:-300}   # seconds per executable
only=${GPU_TESTS_ONLY:-}          # an extended regex: only the executables whose label matches
command -v nvidia-smi >/dev/null && nvidia-smi -L
while IFS=$'\t' read -r file pkg label; do
  [ -n "$only" ] && ! [[ $label =~ $only ]] && continue
  log="$logs/$label.log"
  (cd "$root/$pkg" && CARGO_MANIFEST_DIR="$root/$pkg" RUST_BACKTRACE=1 \
    timeout "$limit" "$here/bin/$file" --include-ignored --test-threads=1 "$@") > "$log" 2>&1
  rc=$?
  read -r p f < <(awk '/^test result:/ { for (i = 2; i <= NF; i++) {
      if ($i ~ /^passed/) p += $(i-1); if ($i ~ /^failed/) f += $(i-1) } }
    END { print p + 0, f + 0 }' "$log")
  status=ok
  if [ "$rc" -ne 0 ]; then
    status="FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ", timed out after ${limit}s"))"
    grep -E '^test .* FAILED$|panicked at' "$log" | head -20 | sed 's/^/    /'
  fi
  printf '%-48s %4d passed %4d failed  %s\n' "$label" "$p" "$f" "$status"
done < "$here/tests.tsv" | tee "$logs/summary.txt"
read -r total_pass total_fail bad < <(awk '/ passed .* failed / { p += $2; f += $4; if (!/ ok$/) b++ }
  END { print p + 0, f + 0, b + 0 }' "$logs/summary.txt")
echo "TOTAL: $total_pass passed, $total_fail failed, $bad of $(grep -c " passed .* failed " "$logs/summary.txt") executables failed; logs in $logs" \
  | tee -a "$logs/summary.txt"
if [ -n "${OUT:-}" ]; then
  cp "$logs/summary.txt" "$OUT/"
  for f in "$logs"/*.log; do echo "===== $(basename "$f" .log)"; cat "$f"; done > "$OUT/gpu-tests.log"
fi
[ "$bad" -eq 0 ] && [ "$total_fail" -eq 0 ]
RUNNER
chmod +x .gpu/run.sh

# The same, compressed (about a quarter of the size), for copying to the GPU machine.
tar cf - .gpu | xz -T0 > .gpu.tar.xz
echo "Packed $(wc -l < .gpu/tests.tsv) test executables ($(du -sh .gpu | cut -f1)) into .gpu/, and" \
  "into .gpu.tar.xz ($(du -sh .gpu.tar.xz | cut -f1))."
echo 'Run them on a CUDA machine, in this repository with .gpu/ (or .gpu.tar.xz unpacked with'
echo '`tar xJf .gpu.tar.xz`; README: GPU tests):'
echo '  bash .gpu/run.sh'
