//! The `streamalloc` command, run as a process: output that parses, and clear errors (never
//! a panic) on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

fn streamalloc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_streamalloc")).args(args).output().expect("the binary runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A file named after the test in the system's temporary directory, removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str, text: &str) -> Self {
        let path = std::env::temp_dir().join(format!("streamalloc-cli-{}-{name}", std::process::id()));
        std::fs::write(&path, text).expect("temp dir is writable");
        TempFile(path)
    }

    fn path(&self) -> &str {
        self.0.to_str().expect("temp paths are UTF-8")
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

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
    let out = streamalloc(&["replay", &sample("resnet50_train.csv"), "--device", "sim", "--passes", "1"]);
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
        &format!("{HEADER}\n0,1,allocate,0x10,1000,0\n0,2,allocate,0x20,300,0\n0,3,free,0x10,1000,0\n"),
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

    let saved = TempFile::new("a.json", &stdout(&out));
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
        &format!("{HEADER}\n0,1,allocate,0x10,1000,0\n0,2,allocate,0x20,lots,0\n"),
    );
    let out = streamalloc(&["replay", trace.path(), "--device", "sim"]);
    assert_fails_with(&out, &["line 3", "0,2,allocate,0x20,lots,0", "bad size"]);
}

#[test]
fn free_of_unknown_pointer_is_an_error_unless_lenient() {
    let trace = TempFile::new(
        "unknown-free.csv",
        &format!("{HEADER}\n0,1,allocate,0x10,64,0\n0,2,free,0xbad,64,0\n"),
    );
    let out = streamalloc(&["replay", trace.path(), "--device", "sim"]);
    assert_fails_with(&out, &["line 3", "0xbad", "not live"]);

    let out = streamalloc(&["replay", trace.path(), "--device", "sim", "--lenient"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("1 frees of unknown pointers skipped"));
}

#[test]
fn unknown_allocator_lists_the_known_ones() {
    let out = streamalloc(&["replay", &sample("resnet50_train.csv"), "--allocator", "nonesuch"]);
    assert_fails_with(&out, &["nonesuch", "known allocators: plain, best_fit"]);
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
    assert!(stdout(&out).contains("10 operations, peak live 31744 bytes"), "{}", stdout(&out));
    assert_eq!(text.lines().count(), 11, "{text}");
}

#[test]
fn record_says_when_the_program_did_not_use_the_library() {
    let out = streamalloc(&["record", "-o", "/tmp/streamalloc-no-trace.csv", "--", "true"]);
    assert_fails_with(&out, &["wrote no trace", "libstreamalloc.so"]);
}

#[test]
fn info_describes_the_device() {
    let out = streamalloc(&["info"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("simulator") || text.contains("CUDA devices"), "{text}");
    assert!(text.contains("allocators: plain, best_fit"));
    assert!(text.contains("STREAMALLOC_CONF in force: strategy="), "{text}");
    let bad = Command::new(env!("CARGO_BIN_EXE_streamalloc"))
        .arg("info")
        .env("STREAMALLOC_CONF", "colour=blue")
        .output()
        .unwrap();
    assert!(stdout(&bad).contains("unknown key `colour`"), "{}", stdout(&bad));
}
