//! The `streamalloc` command, run as a process: output that parses, and clear errors (never
//! a panic) on bad input.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{fabricated_snapshot, json_rows, stderr, stdout, streamalloc, workload, TempFile, HEADER};

fn sample(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces").join(name).display().to_string()
}

/// Asserts a clean failure: non-zero exit, an `error:` line containing every `needle`, no panic.
fn assert_fails_with(out: &Output, needles: &[&str]) {
    let err = stderr(out);
    assert!(!out.status.success(), "expected failure, got success; stderr: {err}");
    assert!(err.starts_with("error: "), "stderr: {err}");
    assert!(!err.contains("panicked"), "stderr: {err}");
    for needle in needles {
        assert!(err.contains(needle), "stderr lacks {needle:?}: {err}");
    }
}

#[test]
fn replay_prints_the_device_then_a_table() {
    let out = streamalloc(&["replay", &sample("resnet50_train.csv.xz"), "--device", "sim", "--passes", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let mut lines = text.lines();
    assert!(lines.next().unwrap().starts_with("device: simulator"));
    assert!(lines.next().unwrap().contains("footprint"));
    let row = lines.next().unwrap();
    assert!(row.starts_with("plain") && row.contains("resnet50_train.csv") && row.contains("6620"), "{row}");
}

#[test]
fn replay_json_parses_and_compare_reads_it() {
    let trace = TempFile::new(
        "small.csv",
        format!("{HEADER}\n0,1,allocate,0x10,1000,0\n0,2,allocate,0x20,300,0\n0,3,free,0x10,1000,0\n"),
    );
    let out = streamalloc(&["replay", trace.path(), "-a", "plain", "--device", "sim", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).expect("--json output parses");
    let rows = value.as_array().expect("an array of results");
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["allocator"], "plain");
    assert_eq!(rows[0]["ops"], 3);
    assert_eq!(rows[0]["peak_live"], 1300);
    assert_eq!(rows[0]["failures"], 0);
    assert!(rows[0]["device"].as_str().unwrap().starts_with("simulator"));
    assert!(rows[0]["ns_per_op_warm"].as_f64().unwrap() > 0.0);

    let saved = TempFile::new("a.json", stdout(&out));
    let out = streamalloc(&["compare", saved.path(), saved.path()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let row = text.lines().find(|l| l.starts_with("plain")).expect("a row per pair");
    assert!(row.contains("1.000"), "same file: ratios of 1: {row}");
}

#[test]
fn missing_file_is_a_clear_error() {
    let out = streamalloc(&["replay", "/nonexistent/trace.csv", "--device", "sim"]);
    assert_fails_with(&out, &["/nonexistent/trace.csv", "No such file"]);
}

#[test]
fn malformed_row_names_line_and_content() {
    let trace = TempFile::new(
        "bad-row.csv",
        format!("{HEADER}\n0,1,allocate,0x10,1000,0\n0,2,allocate,0x20,lots,0\n"),
    );
    let out = streamalloc(&["replay", trace.path(), "--device", "sim"]);
    assert_fails_with(&out, &["line 3", "0,2,allocate,0x20,lots,0", "bad size"]);
}

#[test]
fn free_of_unknown_pointer_is_an_error_unless_lenient() {
    let trace =
        TempFile::new("unknown-free.csv", format!("{HEADER}\n0,1,allocate,0x10,64,0\n0,2,free,0xbad,64,0\n"));
    let out = streamalloc(&["replay", trace.path(), "--device", "sim"]);
    assert_fails_with(&out, &["line 3", "0xbad", "not live"]);

    let out = streamalloc(&["replay", trace.path(), "--device", "sim", "--lenient"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("1 frees of unknown pointers skipped"));
}

#[test]
fn unknown_allocator_lists_the_known_ones() {
    let out = streamalloc(&["replay", &sample("resnet50_train.csv.xz"), "--allocator", "nonesuch"]);
    assert_fails_with(&out, &["unknown preset `nonesuch`; presets: plain, best_fit"]);
}

#[test]
fn compare_of_a_non_result_file_is_a_clear_error() {
    let junk = TempFile::new("junk.json", "{\"not\": \"results\"}");
    let out = streamalloc(&["compare", junk.path(), junk.path()]);
    assert_fails_with(&out, &["not a `streamalloc replay --json` output"]);
}

/// Records a small Python program that allocates through libstreamalloc.so (built beside
/// the CLI by `cargo build --workspace`) on the simulator.
#[test]
fn record_writes_the_trace_of_a_program_using_the_library() {
    let bin = Path::new(env!("CARGO_BIN_EXE_streamalloc"));
    let lib = bin.with_file_name("libstreamalloc.so");
    assert!(lib.is_file(), "{} missing: run `cargo build --workspace` first", lib.display());
    let out_path = std::env::temp_dir().join(format!("streamalloc-record-{}.csv", std::process::id()));
    let script = format!(
        "import ctypes\nl = ctypes.CDLL({lib:?})\nl.streamalloc_malloc.restype = ctypes.c_void_p\n\
         ps = [l.streamalloc_malloc(ctypes.c_ssize_t(1 << (10 + i)), 0, None) for i in range(5)]\n\
         [l.streamalloc_free(ctypes.c_void_p(p), ctypes.c_ssize_t(0), 0, None) for p in ps]\n"
    );
    let out = Command::new(bin)
        .args(["record", "-o", out_path.to_str().unwrap(), "--", "python3", "-c", &script])
        .env("STREAMALLOC_CONF", "device=sim,strategy=stream_safe")
        .output()
        .unwrap();
    let text = std::fs::read_to_string(&out_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("10 operations, peak live 31.00 KiB"), "{}", stdout(&out));
    assert_eq!(text.lines().count(), 11, "{text}");
}

#[test]
fn record_says_when_the_program_did_not_use_the_library() {
    let out = streamalloc(&["record", "-o", "/tmp/streamalloc-no-trace.csv", "--", "true"]);
    assert_fails_with(&out, &["wrote no trace", "libstreamalloc.so"]);
}

/// The CLI keeps no table of its own: `--allocator` takes, and its help lists, the library's
/// presets.
#[test]
fn the_allocator_flag_lists_the_library_presets() {
    let out = streamalloc(&["replay", "--help"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let names: Vec<&str> = streamalloc::facade::Config::presets().iter().map(|p| p.name).collect();
    let help = stdout(&out);
    assert!(help.contains(&format!("(repeatable): {}\n", names.join(", "))), "{help}");
}

#[test]
fn info_describes_the_device() {
    let out = streamalloc(&["info"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("simulator") || text.contains("CUDA devices"), "{text}");
    assert!(text.contains("presets (replay --allocator NAME): plain, best_fit"), "{text}");
    let bad = Command::new(env!("CARGO_BIN_EXE_streamalloc"))
        .arg("info")
        .env("STREAMALLOC_CONF", "colour=blue")
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1), "an invalid STREAMALLOC_CONF is an error");
    assert!(stderr(&bad).contains("unknown key `colour`"), "{}", stderr(&bad));
    assert!(stdout(&bad).contains("STREAMALLOC_CONF=colour=blue is not valid"), "{}", stdout(&bad));
}

/// A trace of `rounds` rounds on two streams: activations grow and shrink, a few large
/// blocks stay live, so caching pools split, grow and reuse.
/// Issue 18: every (trace, configuration) starts from the same state, so a trace replayed
/// twice measures the same figures through every allocator, and no footprint on the
/// simulator is below 1 (before: `async` measured 0.000 the second time, its predecessor's
/// pool memory counted as already in use).
#[test]
fn repeated_replays_start_from_the_same_state() {
    let a = TempFile::new("same-a.csv", workload(6, 3 << 20));
    let b = TempFile::new("same-b.csv", workload(4, 5 << 20));
    let out =
        streamalloc(&["replay", a.path(), b.path(), a.path(), "--device", "sim", "--json", "--passes", "1"]);
    let rows = json_rows(&out);
    let names: Vec<&str> = rows.iter().map(|r| r["allocator"].as_str().unwrap()).collect();
    for preset in ["plain", "best_fit", "stream_safe", "stream_safe_chunks", "async"] {
        let runs: Vec<&serde_json::Value> = rows.iter().filter(|r| r["allocator"] == preset).collect();
        assert_eq!(runs.len(), 3, "{preset} in {names:?}");
        for r in &runs {
            let footprint = r["footprint_ratio"].as_f64().unwrap();
            assert!(footprint >= 1.0, "{preset} on {}: footprint {footprint}", r["trace"]);
        }
        for field in ["footprint_ratio", "peak_device_used", "reserved_peak", "device_calls"] {
            assert_eq!(runs[0][field], runs[2][field], "{preset}: {field} of the same trace differs");
        }
    }
}

/// Issue 18: any configuration replays through the facade, each row labelled by its string.
#[test]
fn conf_rows_are_labelled_by_their_string() {
    let t = TempFile::new("conf.csv", workload(3, 2 << 20));
    let conf = "strategy=stream_safe,backing=stitched,growth=16MiB";
    let out = streamalloc(&[
        "replay",
        t.path(),
        "--conf",
        conf,
        "--conf",
        "strategy=plain",
        "--device",
        "sim",
        "--json",
    ]);
    let rows = json_rows(&out);
    let labels: Vec<&str> = rows.iter().map(|r| r["allocator"].as_str().unwrap()).collect();
    assert_eq!(labels, [conf, "strategy=plain"]);
    assert!(rows[0]["config"].as_str().unwrap().contains("growth=16777216"), "{}", rows[0]);

    let out = streamalloc(&["replay", t.path(), "--conf", "strategy=fast", "--device", "sim"]);
    assert_fails_with(&out, &["strategy=fast", "plain, best_fit, stream_safe, async"]);
}

/// Issue 18: `STREAMALLOC_CONF` is the configuration `replay` runs when none is given, and
/// `info` says so (before, it was ignored while `info` called it "in force").
#[test]
fn streamalloc_conf_is_the_default_configuration() {
    let t = TempFile::new("env.csv", workload(2, 1 << 20));
    let out = Command::new(env!("CARGO_BIN_EXE_streamalloc"))
        .args(["replay", t.path(), "--device", "sim", "--json"])
        .env("STREAMALLOC_CONF", "strategy=best_fit,growth=8MiB")
        .output()
        .unwrap();
    let rows = json_rows(&out);
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["allocator"], "strategy=best_fit,growth=8MiB");
    // Its trace key is the program's: the replay does not write (over) it.
    let out = Command::new(env!("CARGO_BIN_EXE_streamalloc"))
        .args(["replay", t.path(), "--device", "sim", "--json"])
        .env("STREAMALLOC_CONF", format!("strategy=plain,trace={}", t.path()))
        .output()
        .unwrap();
    assert_eq!(json_rows(&out).len(), 1);
    assert_eq!(std::fs::read_to_string(&t.0).unwrap(), workload(2, 1 << 20), "the trace is untouched");

    let info = Command::new(env!("CARGO_BIN_EXE_streamalloc"))
        .arg("info")
        .env("STREAMALLOC_CONF", "strategy=best_fit")
        .output()
        .unwrap();
    let text = stdout(&info);
    assert!(text.contains("STREAMALLOC_CONF=strategy=best_fit: replay runs it"), "{text}");
    let unset =
        Command::new(env!("CARGO_BIN_EXE_streamalloc")).arg("info").env_remove("STREAMALLOC_CONF").output();
    let text = stdout(&unset.unwrap());
    assert!(text.contains("STREAMALLOC_CONF is not set"), "{text}");
    assert!(!text.contains("in force"), "{text}");
}

/// Issue 18: one bad trace is reported, the others still replay, and the exit status says
/// that something failed.
#[test]
fn a_bad_trace_is_reported_and_the_others_replay() {
    let good = TempFile::new("good.csv", workload(2, 1 << 20));
    let bad = TempFile::new("bad.csv", format!("{HEADER}\n0,1,allocate,0x10,lots,0\n"));
    let out = streamalloc(&[
        "replay",
        bad.path(),
        "/nonexistent/trace.csv",
        good.path(),
        "--conf",
        "strategy=plain",
        "--device",
        "sim",
    ]);
    assert!(!out.status.success());
    let (text, err) = (stdout(&out), stderr(&out));
    assert!(text.lines().any(|l| l.starts_with("strategy=plain") && l.contains("good.csv")), "{text}");
    assert!(err.contains("bad.csv") && err.contains("bad size"), "{err}");
    assert!(err.contains("/nonexistent/trace.csv"), "{err}");
    assert!(err.contains("2 of 3 traces failed"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Issue 18: a huge line is refused after a bounded read, and the error quotes a bounded
/// excerpt (before: the whole line was read into memory and echoed).
#[test]
fn a_long_line_is_refused_with_a_short_excerpt() {
    let t = TempFile::new("long.csv", format!("{HEADER}\n0,1,allocate,0x10,{},0\n", "9".repeat(1 << 20)));
    let out = streamalloc(&["replay", t.path(), "--device", "sim"]);
    assert_fails_with(&out, &["line 2", "longer than"]);
    assert!(stderr(&out).len() < 1000, "{} bytes of stderr", stderr(&out).len());
}

/// Issue 18: `... --json | head -1` ends quietly: a closed stdout is no panic.
#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    let t = TempFile::new("pipe.csv", workload(2, 1 << 20));
    for args in
        [vec!["replay", t.path(), "--device", "sim", "--json"], vec!["replay", t.path(), "--device", "sim"]]
    {
        let mut child = Command::new(env!("CARGO_BIN_EXE_streamalloc"))
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // the reader is gone before the first write
        let out = child.wait_with_output().unwrap();
        let err = stderr(&out);
        assert!(!err.contains("panicked"), "{err}");
        assert_ne!(out.status.code(), Some(101), "{err}");
    }
}

/// Issue 18: a PyTorch snapshot becomes a trace that `replay` takes, streams kept; frees of
/// blocks allocated before recording began are skipped and counted; blocks live at the
/// dump stay live; fields absent in older versions ('time_us') are not needed. Issue 37:
/// with 'time_us', each of the 3 frees that waited for the side stream's work adds a
/// record_stream and a use row.
#[test]
fn import_converts_a_pytorch_snapshot() {
    let cases = [("snap.pickle", vec![], 6), ("snap-old.pickle", vec!["--no-time", "--protocol", "2"], 0)];
    for (name, args, stream_rows) in cases {
        let (snapshot, _) = fabricated_snapshot(name, &args);
        let csv = TempFile::new(&format!("{name}.csv"), "");
        let out = streamalloc(&["import", snapshot.path(), "-o", csv.path()]);
        assert!(out.status.success(), "{}", stderr(&out));
        let (text, err) = (stdout(&out), stderr(&out));
        assert!(text.contains("41 allocations, 33 frees, 2 streams"), "{text}");
        assert!(text.contains("8 allocations still live at the end"), "{text}");
        assert!(
            err.contains("warning: 3 frees of blocks allocated before recording began were skipped"),
            "{err}"
        );
        let trace = std::fs::read_to_string(&csv.0).unwrap();
        assert_eq!(trace.lines().next(), Some(HEADER));
        assert_eq!(trace.lines().count(), 1 + 41 + 33 + stream_rows, "{trace}");
        assert!(trace.lines().any(|l| l.ends_with(",94000000000000")), "the side stream is kept");

        let out = streamalloc(&[
            "replay",
            csv.path(),
            "--conf",
            "strategy=stream_safe",
            "--device",
            "sim",
            "--json",
        ]);
        let rows = json_rows(&out);
        assert_eq!(rows[0]["ops"], 41 + 33 + stream_rows);
        assert_eq!(rows[0]["failures"], 0);
    }
    let junk = TempFile::new("junk.pickle", "not a pickle");
    let csv = TempFile::new("junk.csv", "");
    assert_fails_with(
        &streamalloc(&["import", junk.path(), "-o", csv.path()]),
        &["junk.pickle", "not a PyTorch memory snapshot"],
    );
}

/// Issue 18: `--plot` draws bytes live and reserved per configuration, labelled, with the
/// peaks marked; `--json` carries the series; `plot` draws saved results side by side.
#[test]
fn replay_plots_and_plot_draws_saved_results() {
    let t = TempFile::new("plot.csv", workload(40, 1 << 20));
    let svg = TempFile::new("plot.svg", "");
    let out = streamalloc(&[
        "replay",
        t.path(),
        "--conf",
        "strategy=plain",
        "--conf",
        "strategy=stream_safe",
        "--device",
        "sim",
        "--json",
        "--plot",
        svg.path(),
    ]);
    let rows = json_rows(&out);
    for r in &rows {
        let points = r["series"]["reserved"].as_array().unwrap();
        assert!(!points.is_empty() && points.len() <= 512, "{} points", points.len());
        let peak = points.iter().map(|p| p.as_u64().unwrap()).max().unwrap();
        assert_eq!(peak, r["peak_device_used"].as_u64().unwrap(), "the series keeps the peak");
    }
    let picture = std::fs::read_to_string(&svg.0).unwrap();
    assert!(picture.starts_with("<svg"), "{}", &picture[..100.min(picture.len())]);
    for needle in ["strategy=plain", "strategy=stream_safe", "live", "reserved", "peak"] {
        assert!(picture.contains(needle), "the picture lacks {needle}");
    }

    let saved = TempFile::new("plot.json", stdout(&out));
    let side = TempFile::new("side.svg", "");
    let out = streamalloc(&["plot", saved.path(), saved.path(), "-o", side.path()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let picture = std::fs::read_to_string(&side.0).unwrap();
    assert!(picture.contains("strategy=stream_safe") && picture.contains("plot.json"), "labels");
}

/// Issue 18: `--threads` replays each recorded thread on a thread of its own; a pointer
/// freed on another thread than the one that allocated it is freed after the allocation.
#[test]
fn threads_replays_the_thread_column() {
    let mut text = format!("{HEADER}\n");
    for i in 0..200u64 {
        let (owner, freer) = (i % 3, (i + 1) % 3);
        text.push_str(&format!("{owner},{i},allocate,{:#x},{},0\n", 0x1000 * (i + 1), 4096 * (1 + i % 7)));
        if i >= 2 {
            let j = i - 2;
            text.push_str(&format!("{freer},{i},free,{:#x},{},0\n", 0x1000 * (j + 1), 4096 * (1 + j % 7)));
        }
    }
    let t = TempFile::new("threads.csv", &text);
    let out = streamalloc(&[
        "replay",
        t.path(),
        "--threads",
        "--conf",
        "strategy=stream_safe",
        "--device",
        "sim",
        "--json",
    ]);
    let rows = json_rows(&out);
    assert_eq!(rows[0]["threads"], 3);
    assert_eq!(rows[0]["failures"], 0);
    assert_eq!(rows[0]["ops"], 200 + 198);
}

/// Issue 18: `record` keeps the trace when the program configures the library itself (as
/// `streamalloc.torch.enable(conf)` does).
#[test]
fn record_keeps_the_trace_when_the_program_configures_the_library() {
    let bin = Path::new(env!("CARGO_BIN_EXE_streamalloc"));
    let lib = bin.with_file_name("libstreamalloc.so");
    assert!(lib.is_file(), "{} missing: run `cargo build --workspace` first", lib.display());
    let out_path = std::env::temp_dir().join(format!("streamalloc-record-conf-{}.csv", std::process::id()));
    let script = format!(
        "import ctypes\nl = ctypes.CDLL({lib:?})\nassert l.streamalloc_configure(b'device=sim,strategy=plain') == 0\n\
         l.streamalloc_malloc.restype = ctypes.c_void_p\n\
         p = l.streamalloc_malloc(ctypes.c_ssize_t(4096), 0, None)\n\
         l.streamalloc_free(ctypes.c_void_p(p), ctypes.c_ssize_t(0), 0, None)\n"
    );
    let out = Command::new(bin)
        .args(["record", "-o", out_path.to_str().unwrap(), "--", "python3", "-c", &script])
        .env_remove("STREAMALLOC_CONF")
        .output()
        .unwrap();
    let text = std::fs::read_to_string(&out_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(text.lines().count(), 3, "{text}");
}

/// `record` names the cause when the program fails before writing a trace.
#[test]
fn record_names_a_failing_program() {
    let out = streamalloc(&["record", "-o", "/tmp/streamalloc-no-trace-2.csv", "--", "false"]);
    assert_fails_with(&out, &["`false` failed", "exit status: 1", "wrote no trace"]);
}

/// GPU: replays on the GPU start from the same state too (the default pool `async` uses is
/// the device's, shared by every replay in the process). Fails without a GPU.
#[test]
#[ignore = "needs a GPU"]
fn gpu_repeated_replays_start_from_the_same_state() {
    let a = TempFile::new("gpu-same-a.csv", workload(6, 3 << 20));
    let out = streamalloc(&[
        "replay",
        a.path(),
        a.path(),
        "-a",
        "async",
        "-a",
        "stream_safe",
        "--device",
        "cuda",
        "--json",
        "--passes",
        "1",
    ]);
    let rows = json_rows(&out);
    assert_eq!(rows.len(), 4);
    for (first, second) in [(0, 2), (1, 3)] {
        assert_eq!(rows[first]["allocator"], rows[second]["allocator"]);
        assert!(rows[first]["footprint_ratio"].as_f64().unwrap() >= 1.0, "{}", rows[first]);
        let (x, y) = (
            rows[first]["footprint_ratio"].as_f64().unwrap(),
            rows[second]["footprint_ratio"].as_f64().unwrap(),
        );
        assert!((x - y).abs() < 0.01 * x, "{} then {}", rows[first], rows[second]);
    }
}

/// `record` says when the trace cannot be written, before running the program (it would
/// fail inside the library instead, or write nothing).
#[test]
fn record_names_an_unwritable_trace_path() {
    let out = streamalloc(&["record", "-o", "/nonexistent/dir/t.csv", "--", "true"]);
    assert_fails_with(&out, &["cannot write the trace to /nonexistent/dir/t.csv", "No such file"]);
}

/// Real snapshots (lab/record_snapshot.py on a GPU, committed under
/// traces/snapshots/) import, keeping their two streams, and replay with no failure.
#[test]
fn real_snapshots_import_and_replay() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces/snapshots");
    let snapshots: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|entries| entries.filter_map(|e| e.ok()).map(|e| e.path()).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .filter(|p: &PathBuf| p.extension().is_some_and(|x| x == "pickle"))
        .collect();
    assert!(!snapshots.is_empty(), "no *.pickle in {}", dir.display());
    for snapshot in snapshots {
        let csv = TempFile::new("real.csv", "");
        let out = streamalloc(&["import", snapshot.to_str().unwrap(), "-o", csv.path()]);
        assert!(out.status.success(), "{}: {}", snapshot.display(), stderr(&out));
        assert!(stdout(&out).contains(" 2 streams"), "{}", stdout(&out));
        let out = streamalloc(&[
            "replay",
            csv.path(),
            "-a",
            "stream_safe",
            "--device",
            "sim",
            "--json",
            "--passes",
            "1",
        ]);
        let rows = json_rows(&out);
        assert_eq!(rows[0]["failures"], 0, "{}", rows[0]);
        assert!(rows[0]["footprint_ratio"].as_f64().unwrap() >= 1.0, "{}", rows[0]);
    }
}

/// A trace whose side stream (7) reads a 64 MiB block for 5 ms past its free at 2 us; the
/// next 64 MiB block is asked for at 3 us.
fn side_stream_trace(name: &str) -> TempFile {
    let size = 64 << 20;
    TempFile::new(
        name,
        format!(
            "{HEADER}\n0,100,allocate,0x1000,{size},0\n0,101,record_stream,0x1000,0,7\n\
             0,101,use,0x1000,5000000,7\n0,102,free,0x1000,{size},0\n0,103,allocate,0x2000,{size},0\n\
             0,104,free,0x2000,{size},0\n"
        ),
    )
}

/// Issue 37: a trace with stream rows replays its time on the simulator by default, and the
/// output says so; --no-time runs the rows back to back, reusing the block at once.
#[test]
fn replay_runs_a_traces_time_by_default_and_says_so() {
    let trace = side_stream_trace("side.csv");
    let run = |extra: &[&str]| {
        let mut args = vec!["replay", trace.path(), "-a", "stream_safe", "--device", "sim", "--passes", "1"];
        args.extend_from_slice(extra);
        streamalloc(&args)
    };
    let rows = json_rows(&run(&["--json"]));
    assert_eq!(
        (rows[0]["time"].as_bool(), rows[0]["violations"].as_u64()),
        (Some(true), Some(0)),
        "{}",
        rows[0]
    );
    assert_eq!(rows[0]["reserved_peak"], 128 << 20, "{}", rows[0]);
    let rows = json_rows(&run(&["--json", "--no-time"]));
    assert_eq!((rows[0]["time"].as_bool(), rows[0]["reserved_peak"].as_u64()), (Some(false), Some(64 << 20)));

    let out = run(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains(
            "side.csv: time replayed on the simulator's clock (1 use, 0 wait, 1 record_stream rows"
        ),
        "{text}"
    );
    let text = stdout(&run(&["--no-time"]));
    assert!(text.contains("side.csv: time not replayed (--no-time)"), "{text}");
    // A trace without stream rows says nothing of time, unless asked.
    let plain = TempFile::new("no-stream-rows.csv", format!("{HEADER}\n0,1,allocate,0x10,64,0\n"));
    let out = streamalloc(&["replay", plain.path(), "-a", "plain", "--device", "sim", "--passes", "1"]);
    assert!(!stdout(&out).contains("time"), "{}", stdout(&out));
    let rows = json_rows(&streamalloc(&["replay", plain.path(), "-a", "plain", "--device", "sim", "--json"]));
    assert_eq!(rows[0]["time"], false);
}

/// A trace whose Time is not microseconds cannot have its time replayed: by default it runs
/// back to back and says why; --time is an error for it.
#[test]
fn replay_of_time_needs_times() {
    let trace = TempFile::new(
        "clock-times.csv",
        format!("{HEADER}\n0,10:00:00.000001,allocate,0x10,64,0\n0,10:00:00.000002,use,0x10,50,7\n"),
    );
    let args = ["replay", trace.path(), "-a", "plain", "--device", "sim", "--passes", "1"];
    let out = streamalloc(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("time not replayed (the Time of line 2 is not an integer of microseconds)"),
        "{}",
        stdout(&out)
    );
    let out = streamalloc(&[&args[..], &["--time"]].concat());
    assert_fails_with(&out, &["the Time of line 2 is not an integer of microseconds"]);
    let out = streamalloc(&[&args[..], &["--time", "--no-time"]].concat());
    assert!(!out.status.success() && stderr(&out).contains("cannot be used with"), "{}", stderr(&out));
}

/// Stream rows of pointers not live are errors, skipped and counted with --lenient.
#[test]
fn stream_rows_of_unknown_pointers_are_errors_unless_lenient() {
    let trace =
        TempFile::new("unknown-use.csv", format!("{HEADER}\n0,1,allocate,0x10,64,0\n0,2,use,0xbad,50,7\n"));
    let out = streamalloc(&["replay", trace.path(), "--device", "sim"]);
    assert_fails_with(&out, &["line 3", "`use` of pointer 0xbad that is not live"]);
    let out = streamalloc(&["replay", trace.path(), "-a", "plain", "--device", "sim", "--lenient"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("1 record_stream and use rows of unknown pointers skipped"),
        "{}",
        stdout(&out)
    );
}

/// GPU: a trace with stream rows replays on a GPU with its record_stream and wait rows (events
/// on the real streams) and without its time, which the output says; --time is refused
/// there. Fails without a GPU.
#[test]
#[ignore = "needs a GPU"]
fn gpu_stream_rows_replay_without_time() {
    let trace = side_stream_trace("gpu-side.csv");
    let mut with_wait = std::fs::read_to_string(&trace.0).unwrap();
    with_wait.push_str("0,105,wait,0x7,0,0\n");
    let trace = TempFile::new("gpu-side-wait.csv", with_wait);
    let args =
        ["replay", trace.path(), "-a", "stream_safe", "-a", "async", "--device", "cuda", "--passes", "1"];
    let rows = json_rows(&streamalloc(&[&args[..], &["--json"]].concat()));
    for row in &rows {
        assert_eq!((row["failures"].as_u64(), row["time"].as_bool()), (Some(0), Some(false)), "{row}");
    }
    let out = streamalloc(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("time not replayed (on a GPU nothing runs the recorded work)"),
        "{}",
        stdout(&out)
    );
    let out = streamalloc(&[&args[..], &["--time"]].concat());
    assert_fails_with(&out, &["--time replays a trace's time on the simulator only"]);
}
