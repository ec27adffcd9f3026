//! Compiles `tests/cpp/torch_hooks.cpp` against `include/streamalloc.h` and the built
//! `libstreamalloc.so`, and runs it on the simulator under every strategy: every PyTorch hook
//! called through a pointer of the type torch uses, with torch's C++ argument types.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

#[test]
fn torch_hooks_through_torchs_types() {
    let exe = common::compile("tests/cpp/torch_hooks.cpp", "streamalloc-torch-hooks");
    for strategy in ["plain", "best_fit", "stream_safe", "stream_safe,backing=chunks", "async"] {
        let conf = format!("device=sim,strategy={strategy},sim_capacity=64GiB");
        let stdout = common::run_ok(&exe, &conf, &[]);
        assert!(stdout.contains(" passed, 0 failed"), "{conf}:\n{stdout}");
    }
}
