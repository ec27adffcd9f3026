//! Issue 50: traces compressed with gzip or xz are read and written transparently: replay
//! reads `.csv.gz` and `.csv.xz` (by their first bytes, whatever their names), and import and
//! record write them compressed when the output's name ends in `.gz` or `.xz`.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::process::Command;

use common::{json_rows, stderr, stdout, streamalloc, workload, TempFile};

/// gzip's and xz's first bytes.
const GZIP: &[u8] = &[0x1f, 0x8b];
const XZ: &[u8] = &[0xfd, b'7', b'z', b'X', b'Z', 0];

/// `text` compressed by Python's gzip or lzma module (`module`).
fn compressed(module: &str, text: &str) -> Vec<u8> {
    let script =
        format!("import sys, {module}; sys.stdout.buffer.write({module}.compress(sys.stdin.buffer.read()))");
    let mut child = Command::new("python3")
        .args(["-c", &script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    child.wait_with_output().unwrap().stdout
}

/// The operations, peak and failures of `replay --json` of `path`.
fn replayed(path: &str) -> (u64, u64) {
    let rows = json_rows(&streamalloc(&[
        "replay", path, "-a", "plain", "--device", "sim", "--json", "--passes", "1",
    ]));
    (rows[0]["ops"].as_u64().unwrap(), rows[0]["peak_live"].as_u64().unwrap())
}

#[test]
fn replay_reads_gzip_and_xz_traces() {
    let text = workload(10, 4096);
    let plain = TempFile::new("w.csv", &text);
    let gz = TempFile::new("w.csv.gz", compressed("gzip", &text));
    let xz = TempFile::new("w.csv.xz", compressed("lzma", &text));
    assert!(std::fs::read(&gz.0).unwrap().starts_with(GZIP) && std::fs::read(&xz.0).unwrap().starts_with(XZ));
    let want = replayed(plain.path());
    assert_eq!(replayed(gz.path()), want);
    assert_eq!(replayed(xz.path()), want);
}

#[test]
fn import_and_record_write_compressed_traces_by_name() {
    let snapshot =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces/snapshots/mlp_train_side_stream.pickle");
    let plain = TempFile::new("imported.csv", "");
    let out = streamalloc(&["import", snapshot.to_str().unwrap(), "-o", plain.path()]);
    assert!(out.status.success(), "{}", stderr(&out));
    for (name, magic) in [("imported.csv.gz", GZIP), ("imported.csv.xz", XZ)] {
        let file = TempFile::new(name, "");
        let out = streamalloc(&["import", snapshot.to_str().unwrap(), "-o", file.path()]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(std::fs::read(&file.0).unwrap().starts_with(magic), "{name}");
        assert_eq!(replayed(file.path()), replayed(plain.path()), "{name}");
    }

    let bin = Path::new(env!("CARGO_BIN_EXE_streamalloc"));
    let lib = bin.with_file_name("libstreamalloc.so");
    assert!(lib.is_file(), "{} missing: run `cargo build --workspace` first", lib.display());
    let script = format!(
        "import ctypes\nl = ctypes.CDLL({lib:?})\nl.streamalloc_malloc.restype = ctypes.c_void_p\n\
         ps = [l.streamalloc_malloc(ctypes.c_ssize_t(1 << (10 + i)), 0, None) for i in range(5)]\n\
         [l.streamalloc_free(ctypes.c_void_p(p), ctypes.c_ssize_t(0), 0, None) for p in ps]\n"
    );
    let file = TempFile::new("recorded.csv.xz", "");
    let out = Command::new(bin)
        .args(["record", "-o", file.path(), "--", "python3", "-c", &script])
        .env("STREAMALLOC_CONF", "device=sim,strategy=stream_safe")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("10 operations, peak live 31.00 KiB"), "{}", stdout(&out));
    assert!(std::fs::read(&file.0).unwrap().starts_with(XZ));
}
