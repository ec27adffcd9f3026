//! Issue 50: capacity as a question. `replay --capacity SIZE` sizes the simulator (and a
//! configuration's `sim_capacity` is honoured, or refused when it conflicts), says per
//! configuration whether the trace fits, the first operation that failed and by how much,
//! and the headroom; a replay with failed allocations exits nonzero unless
//! `--expect-failures`; `fit` names the configuration that fits with the most headroom.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{json_rows, stderr, stdout, streamalloc, TempFile, HEADER};

/// Three blocks of 100 MiB live at once, then freed: 300 MiB at the peak.
/// `name` tells the tests' files apart.
fn three_blocks(name: &str) -> TempFile {
    let mb = 100usize << 20;
    TempFile::new(
        &format!("{name}-three.csv"),
        format!(
            "{HEADER}\n0,1,allocate,0x10,{mb},0\n0,2,allocate,0x20,{mb},0\n0,3,allocate,0x30,{mb},0\n\
             0,4,free,0x10,{mb},0\n0,5,free,0x20,{mb},0\n0,6,free,0x30,{mb},0\n"
        ),
    )
}

#[test]
fn replay_with_a_capacity_says_whether_the_trace_fits() {
    let trace = three_blocks("t1");
    let args = |capacity: &'static str| {
        vec![
            "replay",
            trace.path(),
            "-a",
            "stream_safe",
            "--device",
            "sim",
            "--passes",
            "1",
            "--capacity",
            capacity,
        ]
    };
    let out = streamalloc(&args("256MiB"));
    assert_eq!(out.status.code(), Some(1), "{}{}", stdout(&out), stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("256.00 MiB"), "{text}");
    assert!(text.contains("three.csv: does not fit in 256.00 MiB: operation 3 failed first"), "{text}");
    assert!(text.contains("short"), "{text}");
    assert!(stderr(&out).contains("--expect-failures"), "{}", stderr(&out));

    let mut expected = args("256MiB");
    expected.push("--expect-failures");
    let out = streamalloc(&expected);
    assert!(out.status.success(), "{}", stderr(&out));

    let out = streamalloc(&args("1GiB"));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("three.csv: fits in 1.00 GiB, headroom "), "{}", stdout(&out));
}

#[test]
fn failed_allocations_exit_nonzero_unless_expected() {
    let trace = TempFile::new("huge.csv", format!("{HEADER}\n0,1,allocate,0x10,{},0\n", 1usize << 50));
    let out = streamalloc(&["replay", trace.path(), "-a", "plain", "--device", "sim", "--passes", "1"]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(stderr(&out).contains("1 of 1 replays had failed allocations"), "{}", stderr(&out));
    let out = streamalloc(&["replay", trace.path(), "-a", "plain", "--device", "sim", "--expect-failures"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let help = stdout(&streamalloc(&["replay", "--help"]));
    assert!(help.contains("--expect-failures") && help.contains("exit status"), "{help}");
}

#[test]
fn a_configurations_sim_capacity_is_honoured_or_refused() {
    let trace = three_blocks("t2");
    let conf = "strategy=stream_safe,sim_capacity=256MiB";
    let out = streamalloc(&[
        "replay",
        trace.path(),
        "--conf",
        conf,
        "--device",
        "sim",
        "--json",
        "--expect-failures",
    ]);
    let rows = json_rows(&out);
    assert!(rows[0]["config"].as_str().unwrap().contains("sim_capacity=268435456"), "{}", rows[0]);
    assert_eq!(rows[0]["first_failure_op"], 3, "{}", rows[0]);

    let out = streamalloc(&["replay", trace.path(), "--conf", conf, "--capacity", "1GiB", "--device", "sim"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("sim_capacity") && stderr(&out).contains("--capacity"), "{}", stderr(&out));

    let out = streamalloc(&["replay", trace.path(), "--capacity", "1GiB", "--device", "cuda"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("--capacity") && stderr(&out).contains("simulator"), "{}", stderr(&out));
}

#[test]
fn fit_names_the_configuration_with_the_most_headroom() {
    let trace = three_blocks("t3");
    let out = streamalloc(&["fit", trace.path(), "--capacity", "1GiB"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("three.csv fits in 1.00 GiB"), "{text}");
    assert!(text.contains("most headroom: "), "{text}");
    for preset in ["plain", "stream_safe", "async"] {
        assert!(text.contains(preset), "{preset}: {text}");
    }

    let out = streamalloc(&["fit", trace.path(), "--capacity", "256MiB", "-a", "plain", "-a", "stream_safe"]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("three.csv fits in 256.00 MiB under none of the 2 configurations"),
        "{}",
        stdout(&out)
    );
}
