//! Issue 48: the pointer table keeps the front end's word (the torch backend's table of its
//! own goes). Runs `tests/c/entries.c` on the simulator: words, sizes, streams and private
//! pools handed back exactly, from 8 threads on 8 streams.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

#[test]
fn the_pointer_table_keeps_the_front_ends_word() {
    let exe = common::compile("tests/c/entries.c", "streamalloc-entries");
    for (conf, args) in [
        ("device=sim,sim_capacity=4GiB", &[][..]),
        ("device=sim,sim_capacity=4GiB,strategy=best_fit", &["one-pool"]),
    ] {
        common::run_ok(&exe, conf, args);
    }
}
