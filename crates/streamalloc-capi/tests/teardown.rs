//! Compiles `tests/cpp/teardown.cpp` against the header and `libstreamalloc.so` and runs it:
//! failing calls from a C++ `thread_local` destructor and from a global destructor after
//! `main` returns must not abort the process (the header's promise).

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn failing_calls_at_thread_and_process_teardown_do_not_abort() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = common::library_dir();
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("streamalloc-teardown");
    let output = Command::new("c++")
        .args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-O1", "-pthread", "-I"])
        .arg(crate_dir.join("include"))
        .arg(crate_dir.join("tests/cpp/teardown.cpp"))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lstreamalloc")
        .output()
        .expect("run c++");
    assert!(output.status.success(), "c++ failed:\n{}", String::from_utf8_lossy(&output.stderr));
    for strategy in ["plain", "stream_safe"] {
        let conf = format!("device=sim,strategy={strategy},sim_capacity=1GiB");
        let out = Command::new(&exe).env("STREAMALLOC_CONF", &conf).output().expect("run the program");
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
