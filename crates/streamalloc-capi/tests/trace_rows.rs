//! Issue 37: the trace knows streams. Runs `tests/c/trace_rows.c` on the simulator with
//! `trace=PATH`: `streamalloc_record_stream` writes a `record_stream` row (just before the
//! row of the free, where the allocation hands its recorded streams over), and
//! `streamalloc_trace_use` / `streamalloc_trace_wait` write `use` and `wait` rows, with the
//! stream values the allocation rows use; without `trace=` they succeed and write nothing.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

#[test]
fn stream_rows_reach_the_trace_through_the_c_api() {
    let exe = common::compile("tests/c/trace_rows.c", "streamalloc-trace-rows");
    let path = std::env::temp_dir().join(format!("streamalloc-trace-rows-{}.csv", std::process::id()));
    for strategy in ["stream_safe", "best_fit", "async"] {
        let conf = format!("device=sim,strategy={strategy},sim_capacity=1GiB,trace={}", path.display());
        let stdout = common::run_ok(&exe, &conf, &[]);
        let text = std::fs::read_to_string(&path).expect("the trace");
        let _ = std::fs::remove_file(&path);
        // The Thread and Time columns left out.
        let rows: Vec<&str> = text.lines().skip(1).map(|l| l.splitn(3, ',').nth(2).unwrap()).collect();
        let p = stdout.split_whitespace().next().unwrap();
        assert_eq!(rows.len(), 5, "{strategy}: {text}");
        let side = rows[3].rsplit(',').next().unwrap();
        assert_ne!(side, "0", "{strategy}: {text}");
        assert_eq!(rows[0], format!("allocate,{p},1048576,0"), "{strategy}: {text}");
        assert_eq!(rows[1], format!("use,{p},5000000,{side}"), "{strategy}: {text}");
        assert_eq!(rows[3], format!("record_stream,{p},0,{side}"), "{strategy}: {text}");
        let side: u64 = side.parse().unwrap();
        assert_eq!(rows[2], format!("wait,{side:#x},0,0"), "{strategy}: {text}");
        assert_eq!(rows[4], format!("free,{p},1048576,0"), "{strategy}: {text}");
    }
    common::run_ok(&exe, "device=sim,strategy=stream_safe", &[]); // without a trace
}
