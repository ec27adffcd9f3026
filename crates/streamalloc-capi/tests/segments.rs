//! Issue 48: `streamalloc_segments` lists exactly what the library holds. Runs
//! `tests/c/segments.c` on the simulator under each strategy and backing that can list its
//! memory (and `async`, whose live allocations are listed one segment each).

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::run_ok as run;

#[test]
fn segments_and_blocks_are_listed_exactly() {
    let exe = common::compile("tests/c/segments.c", "streamalloc-segments");
    for conf in [
        "device=sim,sim_capacity=1GiB",
        "device=sim,sim_capacity=1GiB,backing=chunks",
        "device=sim,sim_capacity=1GiB,backing=segments",
    ] {
        run(&exe, conf, &[]);
    }
    run(&exe, "device=sim,sim_capacity=1GiB,strategy=best_fit", &["one-pool"]);
    run(&exe, "device=sim,sim_capacity=1GiB,strategy=plain", &["plain"]);
    run(&exe, "device=sim,sim_capacity=1GiB,strategy=async", &["driver-pool"]);
}
