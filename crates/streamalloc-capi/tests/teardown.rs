//! Compiles `tests/cpp/teardown.cpp` against the header and `libstreamalloc.so` and runs it:
//! failing calls from a C++ `thread_local` destructor and from a global destructor after
//! `main` returns must not abort the process (the header's promise).

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

#[test]
fn failing_calls_at_thread_and_process_teardown_do_not_abort() {
    let exe = common::compile("tests/cpp/teardown.cpp", "streamalloc-teardown");
    for strategy in ["plain", "stream_safe"] {
        let conf = format!("device=sim,strategy={strategy},sim_capacity=1GiB");
        let out = common::run(&exe, &conf, &[]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{conf}: exit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
            out.status
        );
        for stage in ["thread body", "thread_local destructor", "main", "global destructor"] {
            assert!(stdout.contains(&format!("{stage}: done")), "{conf}: {stage} not reached\n{stdout}");
        }
        assert!(!stdout.contains("NULL") && !stdout.contains("not an error"), "{conf}:\n{stdout}");
    }
}
