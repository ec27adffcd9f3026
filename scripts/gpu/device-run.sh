#!/usr/bin/env bash
# Runs on the GPU machine, over what scripts/gpu-bench.sh prepared. Parts, in the order given:
#   tests    every test executable, GPU tests included (.gpu/run.sh)
#   cupy     CuPy and AsyncPool sharing the device's default pool; a CuPy workload under
#            CuPy's pool and under streamalloc, results compared
#   gpt2     GPT-2 small training under PyTorch's allocator and each strategy, losses compared
#   anchors  the anchors harness (footprint and ns/op tables) and its multi-thread scaling
#   bench    the cost of a free with a recorded stream (crates/streamalloc-bench/src/bin/recorded_free_cost.rs) and
#            what AsyncPool adds to the bare driver calls, per pair and on each trace with
#            alternating passes in one process (crates/streamalloc-bench/src/bin/async_overhead.rs)
#   async    AsyncPool against raw cudaMallocAsync in the anchors harness, alternating, five
#            rounds
#   mt       StreamSafe's multi-thread scaling in the anchors harness (1-8 threads, each on
#            its own stream), MT_ROUNDS rounds (default 3, each replay a process of its own) on
#            the traces MT_TRACES names (default "resnet50_train gpt2_train"; any trace of
#            traces/, by file name without .csv), beside the harness's floor and (unless
#            MT_REFS=0) PyTorch native and RMM pool and binning in the same rounds; the tables
#            (scaling, and ns per operation above the floor) by scripts/gpu/mt_table.py
#   mtx      the same scaling without the C ABI (crates/streamalloc-bench/src/bin/mt_replay.rs), on the simulator and
#            on the GPU, with the device allocations made in the timed passes and each subject's
#            ns per operation above mt_replay's own floor
#   samerun  AsyncPool through the C ABI against raw cudaMallocAsync and the driver calls it
#            makes, in one process, passes alternating, 31 rounds per trace
#            (scripts/gpu/async_same_run.cpp; ROUNDS, SUBJECTS and EXTRA override)
#   speed    StreamSafe through the C ABI against the fast anchors (PyTorch native and
#            expandable, RMM pool and binning) and the harness's floor, SPEED_ROUNDS rounds
#            (default 3; each replay its own process) into $OUT/speed_rounds.jsonl, tables of
#            ns per operation above the floor (scripts/gpu/speed_table.py);
#            SPEED_CONFS (space-separated STREAMALLOC_CONF strings) replaces strategy=stream_safe
#            (the default configuration: stitched ranges)
#            (WHEEL overrides the wheel the Python parts install, default dist/streamalloc-*x86_64.whl)
#   capi     the C ABI's cost per operation without a harness around it: scripts/capi-replay.sh
#            over every trace with .anchors/libstreamalloc.so (CAPI_CONFS, default stream_safe
#            with backing=stitched, the default, and false), best and mean of 3 passes, into $OUT/capi.txt
#            (PROCS: processes per trace, summarised when more than one)
#   torch    the Python front ends' GPU tests (python/tests/gpu: PyTorch's record_stream,
#            CUDA graphs, MemPool, IPC, empty_cache, memory fraction and stats, CuPy on
#            non-blocking streams, RMM and Numba through streamalloc against their own allocators
#            (RMM's wheels carried in .client-wheels/: scripts/fetch-client-wheels.sh); every
#            strategy, each case in its own process) with pytest
#            (pytest-xdist), the cases marked serial after the others, alone;
#            $OUT/torch-tests.log, and $OUT/torch-summary.txt (outcomes and each case's
#            RESULT line). PYTEST_ARGS (shell words) replaces both runs with one: e.g.
#            PYTEST_ARGS='python/tests/gpu -k "record_stream or graph"'
#   race     a release racing frees through PyTorch (python/tests/gpu/race_cases.py): every
#            streamalloc configuration and PyTorch's own allocators, all at once, RACE_SECONDS
#            each (default 60), into $OUT/race.txt (one RESULT line each)
#   graphmem device memory held by 8 captured graphs of 1 GiB temporaries each, per strategy
#            and pool mode, against PyTorch native and backend:cudaMallocAsync
#            (scripts/gpu/graph_memory.py) into $OUT/graph_memory.md
#   sleep    sleep and wake in a program that alternates a generation phase with a training
#            step (scripts/gpu/sleep_phases.py: peak device memory with and without sleeping,
#            sleep and wake per GiB against the copy bandwidth of the same run) and the pinned
#            host pool against cudaHostAlloc and torch's pinned allocator
#            (scripts/gpu/pinned_bench.py), into $OUT/sleep_phases.md and $OUT/pinned_bench.md
#            (JSON lines and logs beside them); SLEEP_ARGS (e.g. --quick) go to both
#   snapshot a small real PyTorch memory snapshot (scripts/gpu/record_snapshot.py), the input
#            of `streamalloc import`, into $OUT/snapshot.pickle
#   record   RMM-format traces of four PyTorch workloads with varying shapes
#            (scripts/gpu/record_workloads.py, shapes from RECORD_SEED, default 0: those of
#            traces/recorded/), packed into $OUT/recorded.tar.gz, the table into $OUT/record.md
#   torchbench three training loops (ResNet-50 with cudnn.benchmark, an MLP under
#            torch.compile(mode="reduce-overhead"), a transformer whose shapes vary) under
#            PyTorch's allocator, its expandable segments, the pluggable fallback and streamalloc's
#            torch backend (scripts/gpu/torch_loops.py), and torch.empty + free per allocation,
#            1 and 8 threads (scripts/gpu/torch_alloc_overhead.py), into $OUT/torch_loops.md and
#            $OUT/torch_alloc_overhead.md (JSON lines and logs beside them); TORCHBENCH_ARGS
#            (e.g. --quick) go to both
# Results go to $OUT (or /tmp/streamalloc-gpu). Exits non-zero if any part failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/streamalloc-gpu}
mkdir -p "$OUT"
# scripts/gpu-test.sh leaves .gpu/ and the same compressed; copy either.
[ -d .gpu ] || { [ -f .gpu.tar.xz ] && tar xJf .gpu.tar.xz; }
# The harness replays every trace of traces/ (subfolders included) from one folder, as plain
# CSV: the repository keeps them xz-compressed, so they are decompressed there.
if [ -d .anchors ] && [ ! -d .anchors/traces ]; then
  mkdir .anchors/traces && for f in $(find traces -name '*.csv.xz'); do
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$f" ".anchors/traces/$(basename "$f" .xz)"
  done
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket)' | tee "$OUT/cpu.txt"
# The anchors harness's replayers, built once per machine.
build_anchors() {
  [ -x /tmp/anchor-bin/replay_core ] || bash .anchors/build.sh .anchors/wheels
}
# The wheel from dist/ installed afresh into /tmp/sa-site (use with PYTHONPATH=/tmp/sa-site),
# with RMM's wheels from .client-wheels/ (scripts/fetch-client-wheels.sh) where carried.
install_wheel() {
  rm -rf /tmp/sa-site && python3 -m pip install -q --no-index --no-deps --target /tmp/sa-site ${WHEEL:-dist/streamalloc-*x86_64.whl} &&
    { [ ! -d .client-wheels ] || python3 -m pip install -q --no-index --no-deps --target /tmp/sa-site .client-wheels/*.whl; } &&
    # A --target folder on PYTHONPATH is not a site folder: its .pth files (the wheel's autoload,
    # which spawned children such as the IPC case's receiver rely on) are read only so.
    printf 'import site\nsite.addsitedir("/tmp/sa-site")\n' > /tmp/sa-site/sitecustomize.py
}
failed=()
for part in "$@"; do
  echo "===== $part"
  case $part in
    # The header drift check needs cargo; the record test needs the library beside the CLI
    # (both run in CI); the two-GPU tests run on a two-GPU machine (scripts/gpu/multi-gpu.sh).
    tests) bash .gpu/run.sh --skip header_is_up_to_date --skip record_writes_the_trace \
      --skip record_keeps_the_trace_when_the_program_configures_the_library \
      --skip record_keeps_an_existing_file_when_nothing_is_recorded \
      --skip record_of_a_killed_program_names_the_signal_and_keeps_the_rows \
      --skip record_through_a_symbolic_link_writes_its_target_and_keeps_the_link \
      --skip record_formats_bytes_as_replay_does \
      --skip mapped_memory_is_usable_by_a_peer_once_peer_access_is_enabled \
      --skip the_facade_keeps_a_stack_per_gpu --skip peer_copy_of_pool_memory_needs_access \
      --skip frees_from_a_thread_on_the_other_gpu ;;
    cupy)
      python3 scripts/gpu/cupy_pool_sharing.py .anchors/libstreamalloc.so && install_wheel &&
        PYTHONPATH=/tmp/sa-site python3 scripts/gpu/cupy_workload.py | tee "$OUT/cupy.md" ;;
    gpt2) bash scripts/gpu/gpt2_compare.sh > "$OUT/gpt2.log" 2>&1; rc=$?; tail -n 30 "$OUT/gpt2.log"; (exit $rc) ;;
    anchors)
      build_anchors &&
        CONFS="strategy=stream_safe,backing=stitched strategy=stream_safe,backing=chunks strategy=async strategy=async,pool=owned" \
          bash .anchors/run.sh .anchors/traces .anchors/libstreamalloc.so > "$OUT/anchors.jsonl" &&
        python3 .anchors/table.py < "$OUT/anchors.jsonl" | tee "$OUT/anchors.md" &&
        CONFS="strategy=stream_safe strategy=async" \
          bash .anchors/run_mt.sh .anchors/traces/resnet50_train.csv .anchors/libstreamalloc.so \
          | tee "$OUT/anchors_mt.jsonl" ;;
    bench) .gpu/bin/recorded_free_cost | tee "$OUT/recorded_free_cost.txt" &&
      .gpu/bin/async_overhead .anchors/traces/*.csv | tee "$OUT/async_overhead.txt" ;;
    async)
      build_anchors && for round in 1 2 3 4 5; do for tr in .anchors/traces/*.csv; do
        /tmp/anchor-bin/replay_core async "$tr" &&
          STREAMALLOC_CONF=strategy=async /tmp/anchor-bin/replay_core \
            "so:$PWD/.anchors/libstreamalloc.so:streamalloc_malloc:streamalloc_free" "$tr"
      done; done | tee "$OUT/async_rounds.jsonl" ;;
    mtx)
      for dev in sim cuda; do for tr in resnet50_train gpt2_train; do
        .gpu/bin/mt_replay ".anchors/traces/$tr.csv" $dev
      done; done | tee "$OUT/mt_replay.txt" ;;
    samerun)
      mkdir -p /tmp/anchor-bin &&
        nvcc -O2 -std=c++17 -I.anchors -o /tmp/anchor-bin/async_same_run scripts/gpu/async_same_run.cpp -lcuda -ldl &&
        (for tr in .anchors/traces/*.csv; do
          STREAMALLOC_CONF=strategy=async /tmp/anchor-bin/async_same_run "$tr" ${ROUNDS:-31} \
            ${SUBJECTS:-async pool pool_ctx pool_ctx_query} "so:$PWD/.anchors/libstreamalloc.so" ${EXTRA:-} || exit 1
        done) > "$OUT/samerun.jsonl" && grep -E 'summary|probe' "$OUT/samerun.jsonl" ;;
    speed)
      build_anchors && for round in $(seq "${SPEED_ROUNDS:-3}"); do echo "{\"round\":$round}"; for tr in .anchors/traces/*.csv; do
        /tmp/anchor-bin/replay_core floor "$tr"
        /tmp/anchor-bin/replay_torch "$tr"
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True /tmp/anchor-bin/replay_torch "$tr"
        /tmp/anchor-bin/replay_rmm pool "$tr" && /tmp/anchor-bin/replay_rmm binning "$tr"
        for conf in ${SPEED_CONFS:-strategy=stream_safe}; do
          STREAMALLOC_CONF=$conf /tmp/anchor-bin/replay_core \
            "so:$PWD/.anchors/libstreamalloc.so:streamalloc_malloc:streamalloc_free" "$tr"
        done
      done; done > "$OUT/speed_rounds.jsonl" && python3 scripts/gpu/speed_table.py < "$OUT/speed_rounds.jsonl" \
        | tee "$OUT/speed.md" ;;
    capi)
      LIB=.anchors PASSES=3 CONFS="${CAPI_CONFS:-strategy=stream_safe,backing=stitched strategy=stream_safe,backing=chunks}" \
        bash scripts/capi-replay.sh | tee "$OUT/capi.txt" ;;
    mt)
      build_anchors && for round in $(seq "${MT_ROUNDS:-3}"); do for tr in ${MT_TRACES:-resnet50_train gpt2_train}; do for n in 1 2 4 8; do
        t=".anchors/traces/$tr.csv"
        THREADS=$n /tmp/anchor-bin/replay_core floor "$t"
        if [ "${MT_REFS:-1}" != 0 ]; then
          THREADS=$n /tmp/anchor-bin/replay_torch "$t"
          for r in pool binning; do THREADS=$n /tmp/anchor-bin/replay_rmm $r "$t"; done
        fi
        THREADS=$n STREAMALLOC_CONF=strategy=stream_safe /tmp/anchor-bin/replay_core \
          "so:$PWD/.anchors/libstreamalloc.so:streamalloc_malloc:streamalloc_free" "$t"
      done; done; done | tee "$OUT/mt_rounds.jsonl" && python3 scripts/gpu/mt_table.py < "$OUT/mt_rounds.jsonl" ;;
    torch)
      install_wheel && {
        if [ -n "${PYTEST_ARGS:-}" ]; then
          eval "pytest_args=($PYTEST_ARGS)"
          PYTHONPATH=/tmp/sa-site python3 -m pytest -q -rA -p no:cacheprovider --durations=10 \
            "${pytest_args[@]}" > "$OUT/torch-tests.log" 2>&1
        else # cases in parallel, then those that measure device-wide memory alone
          PYTHONPATH=/tmp/sa-site python3 -m pytest -q -rA -p no:cacheprovider --durations=10 \
            -n "$(( $(nproc) > 12 ? 12 : $(nproc) ))" -m "not serial" python/tests/gpu > "$OUT/torch-tests.log" 2>&1
          parallel_rc=$?
          PYTHONPATH=/tmp/sa-site python3 -m pytest -q -rA -p no:cacheprovider \
            -m serial python/tests/gpu >> "$OUT/torch-tests.log" 2>&1 && (exit $parallel_rc)
        fi
        rc=$?
        grep -E '^(PASSED|FAILED|ERROR|RESULT) | in [0-9.]+s( |$)' "$OUT/torch-tests.log" \
          | tee "$OUT/torch-summary.txt" | grep -vE '^(PASSED|RESULT) '
        (exit $rc)
      } ;;
    race)
      install_wheel && {
        for conf in strategy=stream_safe strategy=stream_safe,backing=chunks strategy=stream_safe,backing=segments \
          strategy=best_fit strategy=best_fit,backing=chunks strategy=async strategy=plain native cudaMallocAsync; do
          (cd python/tests/gpu && PYTHONPATH=/tmp/sa-site timeout $(( ${RACE_SECONDS:-60} + 120 )) \
            python3 race_cases.py release_race "$conf" "${RACE_SECONDS:-60}" 2>&1 | tail -n 3) &
        done; wait
      } > "$OUT/race.txt"; cat "$OUT/race.txt"; ! grep -q '"ok": false' "$OUT/race.txt" &&
        [ "$(grep -c '"ok": true' "$OUT/race.txt")" -eq 9 ] ;;
    graphmem) install_wheel && PYTHONPATH=/tmp/sa-site python3 scripts/gpu/graph_memory.py | tee "$OUT/graph_memory.md" ;;
    record)
      install_wheel && rm -rf /tmp/traces &&
        PYTHONPATH=/tmp/sa-site python3 scripts/gpu/record_workloads.py --out /tmp/traces \
          --seed "${RECORD_SEED:-0}" | tee "$OUT/record.md" &&
        tar czf "$OUT/recorded.tar.gz" -C /tmp traces ;;
    torchbench) # the backend is built once into STREAMALLOC_CACHE, which every run reuses
      install_wheel && {
        STREAMALLOC_CACHE=${STREAMALLOC_CACHE:-/tmp/streamalloc-cache} PYTHONPATH=/tmp/sa-site \
          python3 scripts/gpu/torch_loops.py --out "$OUT" ${TORCHBENCH_ARGS:-} 2>&1 | tee "$OUT/torch_loops.log"
        rc=$?
        STREAMALLOC_CACHE=${STREAMALLOC_CACHE:-/tmp/streamalloc-cache} PYTHONPATH=/tmp/sa-site \
          python3 scripts/gpu/torch_alloc_overhead.py --out "$OUT" ${TORCHBENCH_ARGS:-} 2>&1 \
          | tee "$OUT/torch_alloc_overhead.log" && (exit $rc)
      } ;;
    sleep) # the figures issue 36 asks for; the backend built once into STREAMALLOC_CACHE
      install_wheel && {
        export STREAMALLOC_CACHE=${STREAMALLOC_CACHE:-/tmp/streamalloc-cache}
        PYTHONPATH=/tmp/sa-site python3 scripts/gpu/sleep_phases.py --out "$OUT" ${SLEEP_ARGS:-} 2>&1 \
          | tee "$OUT/sleep_phases.log"
        rc=${PIPESTATUS[0]}
        PYTHONPATH=/tmp/sa-site python3 scripts/gpu/pinned_bench.py --out "$OUT" ${SLEEP_ARGS:-} 2>&1 \
          | tee "$OUT/pinned_bench.log" && (exit $rc)
      } ;;
    snapshot) python3 scripts/gpu/record_snapshot.py "$OUT/snapshot.pickle" --steps 4 --max-entries 20000 &&
      ls -l "$OUT/snapshot.pickle" ;;
    *) echo "unknown part $part"; false ;;
  esac || failed+=("$part")
done
echo "===== done; failed parts: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
