//! Compiles `tests/c/smoke.c` against `include/streamalloc.h` and the built
//! `libstreamalloc.so`, and runs it on the simulator under every strategy.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

#[test]
fn c_smoke_on_the_simulator() {
    let exe = common::compile("tests/c/smoke.c", "streamalloc-smoke");
    let mut ran = Vec::new();
    for strategy in ["plain", "best_fit", "stream_safe", "async"] {
        let conf = format!("device=sim,strategy={strategy},sim_capacity=64GiB");
        let out = common::run(&exe, &conf, &[]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.code() == Some(77) && strategy != "plain" {
            eprintln!("{strategy}: {stdout}");
            continue;
        }
        assert!(out.status.success(), "{conf}: smoke failed\nstdout:\n{stdout}\nstderr:\n{stderr}");
        assert!(stdout.contains(", 0 failed"), "{conf}:\n{stdout}");
        // The framework ABIs report their errors (which the smoke test provokes) on stderr.
        assert!(
            stderr.contains("streamalloc: streamalloc_malloc: invalid argument: negative size -5"),
            "{stderr}"
        );
        eprintln!("{strategy}: {stdout}");
        ran.push(strategy);
    }
    assert!(ran.contains(&"plain"));
}
