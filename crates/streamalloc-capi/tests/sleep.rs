//! Issue 36: tags, sleep and wake through the C API. Runs `tests/c/sleep.c` on the simulator:
//! under the default configuration (`stream_safe` over stitched ranges) and `best_fit`, the
//! tagged memory goes back and comes back, with each misuse answered; under configurations
//! that cannot sleep, sleep and wake say so and tagged allocations are served all the same.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;

fn run(exe: &std::path::Path, conf: &str, args: &[&str]) {
    let out = Command::new(exe).args(args).env("STREAMALLOC_CONF", conf).output().expect("run sleep");
    assert!(
        out.status.success(),
        "{conf}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn tags_sleep_and_wake_through_the_c_api() {
    let exe = common::compile("tests/c/sleep.c", "streamalloc-sleep");
    for conf in ["device=sim,sim_capacity=1GiB", "device=sim,sim_capacity=1GiB,strategy=best_fit"] {
        run(&exe, conf, &[]);
    }
    for conf in [
        "device=sim,sim_capacity=1GiB,strategy=async",
        "device=sim,sim_capacity=1GiB,backing=chunks",
        "device=sim,sim_capacity=1GiB,sim_virtual_memory=false",
    ] {
        run(&exe, conf, &["unsupported"]);
    }
}
