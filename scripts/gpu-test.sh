#!/usr/bin/env bash
# Packs the workspace's tests for a GPU machine that has libcuda but no Rust toolchain.
#
# Here (no GPU needed): builds every release test executable of the workspace, copies them into
# the git-ignored folder .gpu/ with a runner, .gpu/run.sh, and prints the device-tool command.
# There: .gpu/run.sh runs each executable with --include-ignored --test-threads=1 (the normal
# tests plus the #[ignore]d GPU tests), prints one line per executable and a total, writes logs
# to $OUT (or .gpu/logs), and exits non-zero on any failure. New tests/gpu_*.rs files (or any
# test target) are picked up automatically.
set -euo pipefail
cd "$(dirname "$0")/.."

rm -rf .gpu
mkdir -p .gpu/bin

# One line per test executable: path, package dir (relative), label.
cargo test --release --workspace --no-run --message-format=json | python3 -c '
import json, os, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
        continue
    pkg = os.path.relpath(os.path.dirname(m["manifest_path"]))
    t = m["target"]
    label = os.path.basename(pkg) + "." + t["kind"][0] + "." + t["name"]
    print(m["executable"], pkg, label, sep="\t")
' > .gpu/found.tsv

: > .gpu/tests.tsv
while IFS=$'\t' read -r exe pkg label; do
  # Compressed debug info keeps backtraces' line numbers at a third of the size (carry limit).
  objcopy --compress-debug-sections=zlib "$exe" ".gpu/bin/$(basename "$exe")" 2>/dev/null \
    || cp "$exe" .gpu/bin/
  printf '%s\t%s\t%s\n' "$(basename "$exe")" "$pkg" "$label" >> .gpu/tests.tsv
done < .gpu/found.tsv
rm .gpu/found.tsv

cat > .gpu/run.sh <<'RUNNER'
#!/usr/bin/env bash
# Runs every packed test executable, GPU tests included. Logs go to $OUT (or .gpu/logs).
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
logs=${OUT:-$here/logs}
mkdir -p "$logs"
limit=${GPU_TEST_TIMEOUT:-300}   # seconds per executable
command -v nvidia-smi >/dev/null && nvidia-smi -L
total_pass=0 total_fail=0 bad=0
while IFS=$'\t' read -r file pkg label; do
  log="$logs/$label.log"
  (cd "$root/$pkg" && CARGO_MANIFEST_DIR="$root/$pkg" RUST_BACKTRACE=1 \
    timeout "$limit" "$here/bin/$file" --include-ignored --test-threads=1) > "$log" 2>&1
  rc=$?
  read -r p f < <(awk '/^test result:/ { for (i = 2; i <= NF; i++) {
      if ($i ~ /^passed/) p += $(i-1); if ($i ~ /^failed/) f += $(i-1) } }
    END { print p + 0, f + 0 }' "$log")
  status=ok
  if [ "$rc" -ne 0 ]; then
    status="FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ", timed out after ${limit}s"))"
    bad=$((bad + 1))
    grep -E '^test .* FAILED$|panicked at' "$log" | head -20 | sed 's/^/    /'
  fi
  printf '%-48s %4d passed %4d failed  %s\n' "$label" "$p" "$f" "$status"
  total_pass=$((total_pass + p)) total_fail=$((total_fail + f))
done < "$here/tests.tsv"
echo "TOTAL: $total_pass passed, $total_fail failed, $bad of $(wc -l < "$here/tests.tsv") executables failed; logs in $logs"
[ "$bad" -eq 0 ] && [ "$total_fail" -eq 0 ]
RUNNER
chmod +x .gpu/run.sh

echo "Packed $(wc -l < .gpu/tests.tsv) test executables ($(du -sh .gpu | cut -f1)) into .gpu/."
[ "$(du -sm .gpu | cut -f1)" -lt 64 ] || echo "WARNING: .gpu/ is over the device tool's 64 MiB carry limit"
echo 'Run them on the GPU machine with the device tool:'
echo '  run(command="bash .gpu/run.sh", carry=[".gpu"], kind="nvidia-h200", timeout_s=600)'
