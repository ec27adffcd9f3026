//! Compiles `tests/c/fork.c` against the header and `libstreamalloc.so` and runs it on the
//! simulator: while threads are inside the library, the main thread forks 20 times, and every
//! child must exit at once (issue 33: most hung on the locks the parent's threads held), every
//! call it makes refused, the library's exit-time cleanup (a trace's flush) included.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

#[test]
fn children_forked_while_threads_are_inside_the_library_exit_at_once() {
    let exe = common::compile("tests/c/fork.c", "streamalloc-fork");
    let trace = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fork-trace.csv");
    for strategy in ["plain", "stream_safe", "async"] {
        let conf = format!("device=sim,strategy={strategy},sim_capacity=1GiB,trace={}", trace.display());
        let out = common::run(&exe, &conf, &[]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{conf}: exit {:?}\nstdout:\n{stdout}\nstderr:\n{}",
            out.status,
            stderr.lines().take(20).collect::<Vec<_>>().join("\n")
        );
        assert!(stdout.contains("hung 0 failed 0 of 20"), "{conf}:\n{stdout}");
    }
}
