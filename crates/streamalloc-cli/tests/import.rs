//! Issue 37: `streamalloc import` reads the pickle as a stream, in a small part of its size in
//! memory, with a progress bar on a terminal only; the rows it wrote before stay the same,
//! and a free that waited for another stream's work gets `record_stream` and `use` rows.
//!
//! tests/data/ holds what the import wrote before issue 37 (commit d184c7f) for
//! crates/streamalloc-cli/tests/fabricate_snapshot.py's snapshot (with and without `time_us`) and for
//! traces/snapshots/mlp_train_side_stream.pickle.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{fabricated_snapshot, json_rows, stderr, stdout, streamalloc, TempFile, HEADER};

/// The first stream the rows of the other streams' work are written on
/// (`import::OTHER_STREAMS`); waits that overlap take the values below it.
const OTHER_STREAMS: u64 = u64::MAX;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(path)
}

fn fixture(name: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)).unwrap()
}

/// Imports `snapshot` into a new trace; the command's output and the trace.
fn import(snapshot: &str, name: &str) -> (Output, String) {
    let csv = TempFile::new(name, "");
    let out = streamalloc(&["import", snapshot, "-o", csv.path()]);
    assert!(out.status.success(), "{snapshot}: {}", stderr(&out));
    let trace = std::fs::read_to_string(&csv.0).unwrap();
    assert!(trace.starts_with(HEADER), "{trace:.200}");
    (out, trace)
}

/// `trace` without its `record_stream` and `use` rows.
fn without_stream_rows(trace: &str) -> String {
    trace
        .lines()
        .filter(|l| !l.contains(",record_stream,") && !l.contains(",use,"))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// What Python reads in the snapshot at `path` (device 0): the most bytes allocated at once
/// (torch's allocated_bytes: an `alloc` adds its size, a `free_requested` of a block
/// allocated in the trace takes it away) and the frees whose completion is recorded later
/// than the next entry, as [address, stream, request time, completion time].
fn python_reading(path: &str) -> serde_json::Value {
    let script = r#"
import json, pickle, sys
entries = pickle.load(open(sys.argv[1], 'rb'))['device_traces'][0]
live, allocated, peak, requested, deferred, last = {}, 0, 0, {}, [], None
for i, e in enumerate(entries):
    a = e['action']
    last = e.get('time_us', last)
    if a == 'alloc':
        live[e['addr']] = e['size']
        allocated += e['size']
        peak = max(peak, allocated)
    elif a == 'free_requested' and e['addr'] in live:
        allocated -= live.pop(e['addr'])
        requested[e['addr']] = (i, e)
    elif a == 'free_completed' and e['addr'] in requested:
        j, r = requested.pop(e['addr'])
        if i > j + 1 and 'time_us' in r and 'time_us' in e:
            deferred.append([r['addr'], r['stream'], r['time_us'], e['time_us']])
# Pending at the dump: held until the last entry, as far as the snapshot knows.
for j, r in requested.values():
    if 'time_us' in r and last is not None and last > r['time_us']:
        deferred.append([r['addr'], r['stream'], r['time_us'], last])
print(json.dumps({'peak': peak, 'deferred': deferred}))
"#;
    let out = Command::new("python3").args(["-c", script, path]).output().expect("python3 runs");
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The most bytes live at once in `trace` (allocate rows add, free rows take away).
fn peak_live(trace: &str) -> u64 {
    let (mut live, mut peak) = (std::collections::HashMap::new(), 0u64);
    let mut now = 0u64;
    for row in trace.lines().skip(1) {
        let f: Vec<&str> = row.split(',').collect();
        let size: u64 = f[4].parse().unwrap();
        match f[2] {
            "allocate" => {
                live.insert(f[3].to_string(), size);
                now += size;
                peak = peak.max(now);
            }
            "free" => now -= live.remove(f[3]).expect("a free of a live pointer"),
            _ => {}
        }
    }
    peak
}

/// The rows the import wrote before issue 37 stay the same: the fabricated snapshot (as
/// Python's pickle writes it, and as the script writes it entry by entry, with 16 frames an
/// entry), without `time_us` (then no stream rows either), and a real snapshot.
#[test]
fn import_writes_the_rows_it_wrote_before() {
    let cases: [(&str, &[&str], &str); 3] = [
        ("before.pickle", &[], "fabricated.csv"),
        ("before-streaming.pickle", &["--streaming"], "fabricated.csv"),
        ("before-untimed.pickle", &["--no-time", "--protocol", "2"], "fabricated-untimed.csv"),
    ];
    for (name, args, want) in cases {
        let (snapshot, _) = fabricated_snapshot(name, args);
        let (_, trace) = import(snapshot.path(), &format!("{name}.csv"));
        assert_eq!(without_stream_rows(&trace), fixture(want), "{name}");
        if want.contains("untimed") {
            assert_eq!(trace, fixture(want), "untimed: no stream rows");
        }
    }
    let real = repo("traces/snapshots/mlp_train_side_stream.pickle");
    let (_, trace) = import(real.to_str().unwrap(), "before-real.csv");
    assert_eq!(without_stream_rows(&trace), fixture("mlp_train_side_stream.csv"));
}

/// Each free whose completion came later (it waited for another stream's work), or never
/// (pending at the dump: until the last entry), is, at the request's time, a `record_stream`
/// of the block on a stand-in of the other streams, a `use` there until the completion's
/// time, then the free on its own stream; the output counts them. A trace of such rows
/// replays with no failure, and its peak live bytes are the snapshot's.
#[test]
fn frees_that_waited_for_other_streams_get_record_stream_and_use_rows() {
    let (fabricated, summary) = fabricated_snapshot("deferred.pickle", &["--steps", "5"]);
    let real = repo("traces/snapshots/mlp_train_side_stream.pickle");
    for (snapshot, frees) in [(fabricated.path(), 5), (real.to_str().unwrap(), 4)] {
        let python = python_reading(snapshot);
        let deferred = python["deferred"].as_array().unwrap();
        assert_eq!(deferred.len(), frees, "{snapshot}: {python}");
        let (out, trace) = import(snapshot, "deferred.csv");
        assert!(
            stdout(&out).contains(&format!(
                "{frees} frees waited for work on other streams: a record_stream and a use row on a stand-in \
                 of them (stream {OTHER_STREAMS}, or one below for a wait overlapping others) come before each"
            )),
            "{}",
            stdout(&out)
        );
        let rows: Vec<&str> = trace.lines().collect();
        assert_eq!(rows.iter().filter(|r| r.contains(",record_stream,")).count(), frees);
        assert_eq!(rows.iter().filter(|r| r.contains(",use,")).count(), frees);
        for d in deferred {
            let (addr, stream) = (d[0].as_u64().unwrap(), d[1].as_u64().unwrap());
            let (requested, completed) = (d[2].as_u64().unwrap(), d[3].as_u64().unwrap());
            let record = format!("0,{requested},record_stream,{addr:#x},0,");
            let at =
                rows.iter().position(|r| r.starts_with(&record)).unwrap_or_else(|| panic!("no {record}"));
            let other: u64 = rows[at][record.len()..].parse().unwrap();
            assert!(other > OTHER_STREAMS - frees as u64, "{}", rows[at]);
            let ns = (completed - requested) * 1000;
            assert_eq!(rows[at + 1], format!("0,{requested},use,{addr:#x},{ns},{other}"));
            let free = format!("0,{requested},free,{addr:#x},");
            assert!(
                rows[at + 2].starts_with(&free) && rows[at + 2].ends_with(&format!(",{stream}")),
                "{}",
                rows[at + 2]
            );
        }

        let peak = python["peak"].as_u64().unwrap();
        assert_eq!(peak_live(&trace), peak, "{snapshot}");
        let csv = TempFile::new("deferred-replay.csv", &trace);
        let rows = json_rows(&streamalloc(&[
            "replay",
            csv.path(),
            "-a",
            "stream_safe",
            "--device",
            "sim",
            "--json",
        ]));
        assert_eq!(
            (rows[0]["failures"].as_u64(), rows[0]["peak_live"].as_u64()),
            (Some(0), Some(peak)),
            "{}",
            rows[0]
        );
    }
    assert_eq!(summary["peak_allocated_bytes"], python_reading(fabricated.path())["peak"]);
    assert_eq!(summary["deferred_frees"], 5);
}

/// Runs `import` of `snapshot` under GNU time: the output and its peak resident set, in KiB.
fn import_under_time(snapshot: &str) -> (Output, u64) {
    let csv = TempFile::new("rss.csv", "");
    let report = TempFile::new("rss.time", "");
    let out = Command::new("/usr/bin/time")
        .args([
            "-v",
            "-o",
            report.path(),
            env!("CARGO_BIN_EXE_streamalloc"),
            "import",
            snapshot,
            "-o",
            csv.path(),
        ])
        .output()
        .expect("the test needs GNU time at /usr/bin/time");
    let report = std::fs::read_to_string(&report.0).unwrap();
    let rss = report
        .lines()
        .find_map(|l| l.trim().strip_prefix("Maximum resident set size (kbytes): "))
        .unwrap_or_else(|| panic!("no maximum resident set size in {report}"));
    (out, rss.parse().unwrap())
}

/// Asserts that the import of a snapshot of `size` bytes (16 frames an entry) peaks at less
/// than `1 / fraction` of it in memory.
fn assert_import_memory_below(size: &str, fraction: u64) {
    let (snapshot, summary) = fabricated_snapshot("big.pickle", &["--target-size", size]);
    let bytes = summary["bytes"].as_u64().unwrap();
    let (out, rss_kib) = import_under_time(snapshot.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let entries = summary["entries"].as_u64().unwrap();
    assert!(stdout(&out).contains("2 streams"), "{}", stdout(&out));
    assert!(
        rss_kib * 1024 < bytes / fraction,
        "{rss_kib} KiB at most to import {bytes} bytes ({entries} entries): over 1/{fraction} of it"
    );
}

/// The import holds a small part of the pickle (it held 20 times its size): 40 MB read in
/// less than 20 MB.
#[test]
fn import_reads_a_snapshot_in_a_part_of_its_size() {
    assert_import_memory_below("40M", 2);
}

/// As above, 200 MB in less than 50 MB. Ignored: over 20 s in a debug build (about 3 s in a
/// release one: `cargo test --release -p streamalloc-cli --test import -- --ignored`).
#[test]
#[ignore]
fn import_reads_a_200_mb_snapshot_in_a_quarter_of_its_size() {
    assert_import_memory_below("200M", 4);
}

/// The progress bar (bytes read) shows when stderr is a terminal, and not in a pipe.
#[test]
fn the_progress_bar_shows_on_a_terminal_only() {
    let (snapshot, _) = fabricated_snapshot("bar.pickle", &["--target-size", "20M"]);
    let csv = TempFile::new("bar.csv", "");
    let out = streamalloc(&["import", snapshot.path(), "-o", csv.path()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("reading"), "no bar in a pipe: {}", stderr(&out));

    // `script` runs the command on a pseudo-terminal and copies what it shows.
    let command =
        format!("'{}' import '{}' -o '{}'", env!("CARGO_BIN_EXE_streamalloc"), snapshot.path(), csv.path());
    let shown =
        Command::new("script").args(["-qec", &command, "/dev/null"]).output().expect("the test needs script");
    let text = stdout(&shown);
    assert!(shown.status.success(), "{text}{}", stderr(&shown));
    assert!(text.contains("reading ") && text.contains("bar.pickle ["), "{text:?}");
    assert!(text.contains("MiB/"), "the bar counts bytes: {text:?}");
    assert!(text.contains("allocations"), "the summary follows: {text:?}");
}
