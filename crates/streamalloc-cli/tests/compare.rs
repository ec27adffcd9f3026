//! Issue 50: `compare` pairs rows by trace against a chosen base configuration
//! (`--base`, `--with`), across one or more result files, and shows the spread of the timed
//! passes (median, min and max), so that a ratio of timings says whether it is a difference.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{stderr, stdout, streamalloc, workload, TempFile};

/// `replay --json` of `workload` through plain, stream_safe and async, 5 passes.
fn results(name: &str) -> TempFile {
    let trace = TempFile::new(&format!("{name}.csv"), workload(20, 4096));
    let out = streamalloc(&[
        "replay",
        trace.path(),
        "-a",
        "plain",
        "-a",
        "stream_safe",
        "-a",
        "async",
        "--device",
        "sim",
        "--json",
        "--passes",
        "5",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    TempFile::new(&format!("{name}.json"), stdout(&out))
}

#[test]
fn compare_pairs_configurations_of_a_trace_against_a_base_with_spread() {
    let saved = results("base");
    let out = streamalloc(&["compare", saved.path(), "--base", "plain"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("median [min, max]"), "{text}");
    let rows: Vec<&str> =
        text.lines().filter(|l| l.starts_with("stream_safe") || l.starts_with("async")).collect();
    assert_eq!(rows.len(), 2, "{text}");
    for row in &rows {
        assert!(row.contains("base.csv") && row.contains(" plain ") && row.contains('['), "{row}");
    }
    assert!(!text.lines().any(|l| l.starts_with("plain ")), "the base is not compared with itself: {text}");

    let out = streamalloc(&["compare", saved.path(), "--base", "plain", "--with", "async"]);
    let text = stdout(&out);
    assert_eq!(
        text.lines().filter(|l| l.starts_with("async") || l.starts_with("stream_safe")).count(),
        1,
        "{text}"
    );

    let out = streamalloc(&["compare", saved.path(), "--base", "nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("no result of configuration nope"), "{}", stderr(&out));
}
