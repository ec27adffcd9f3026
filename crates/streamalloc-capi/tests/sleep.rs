//! Issue 36: tags, sleep and wake through the C API. Runs `tests/c/sleep.c` on the simulator:
//! under the default configuration (`stream_safe` over stitched ranges) and `best_fit`, the
//! tagged memory goes back and comes back, with each misuse answered; under configurations
//! that cannot sleep, sleep and wake say so and tagged allocations are served all the same.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::run_ok as run;

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
