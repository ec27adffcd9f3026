//! Runs `python/tests/test_streamalloc.py` against the package in `python/`, with the
//! `libstreamalloc.so` of this build copied into it, on the simulator; and
//! `python/tests/sim_fuzz.py`, the C path fuzzed against the simulator's ordering checker.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The package folder, with the `libstreamalloc.so` of this build, made once per test run.
fn package() -> PathBuf {
    static PKG: OnceLock<PathBuf> = OnceLock::new();
    PKG.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let pkg = Path::new(env!("CARGO_TARGET_TMPDIR")).join("python-pkg/streamalloc");
        std::fs::create_dir_all(&pkg).expect("create the package folder");
        for entry in std::fs::read_dir(root.join("python/streamalloc")).expect("python/streamalloc") {
            let path = entry.expect("directory entry").path();
            if path.extension().is_some_and(|e| e == "py") {
                std::fs::copy(&path, pkg.join(path.file_name().unwrap())).expect("copy a module");
            }
        }
        std::fs::copy(common::library_dir().join("libstreamalloc.so"), pkg.join("libstreamalloc.so"))
            .expect("copy libstreamalloc.so");
        pkg
    })
    .clone()
}

#[test]
fn python_package_on_the_simulator() {
    python_tests("test_streamalloc.py");
}

/// The CuPy front end's streams under a pool per stream, in a process of its own (the library
/// is configured once per process).
#[test]
fn cupy_streams_on_the_simulator() {
    python_tests("test_cupy_streams.py");
}

/// The RMM front end (a stand-in for rmm calling its resource as RMM does) under a pool per
/// stream, in a process of its own.
#[test]
fn rmm_on_the_simulator() {
    python_tests("test_rmm.py");
}

/// The Numba front end (a stand-in for numba.cuda driving its memory manager as Numba does)
/// under a pool per stream, in a process of its own.
#[test]
fn numba_on_the_simulator() {
    python_tests("test_numba.py");
}

/// fork() while another thread is inside the library: every child exits at once (issue 33),
/// in a process of its own.
#[test]
fn fork_on_the_simulator() {
    python_tests("test_fork.py");
}

/// The pinned host pool from Python (issue 36), in a process of its own.
#[test]
fn pinned_host_on_the_simulator() {
    python_tests("test_host_pool.py");
}

/// Tags, sleep and wake from Python (issue 36), in a process of its own.
#[test]
fn sleep_on_the_simulator() {
    python_tests("test_sleep.py");
}

/// Runs `python/tests/SCRIPT` against the package; it must report no failure.
fn python_tests(script: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let pkg = package();
    let out = Command::new("python3")
        .arg(root.join("python/tests").join(script))
        .env("PYTHONPATH", pkg.parent().unwrap())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("STREAMALLOC_CONF")
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "python tests failed\nstdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
}

/// Runs `python/tests/sim_fuzz.py` (the C path fuzzed against the simulator's ordering checker)
/// with `conf`; the violations it reports.
fn fuzz(conf: &str, ops: u32, record: bool) -> u64 {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let pkg = package();
    let mut cmd = Command::new("python3");
    cmd.arg(root.join("python/tests/sim_fuzz.py")).arg(conf).arg(ops.to_string()).arg("7");
    if !record {
        cmd.arg("--no-record");
    }
    let out = cmd
        .env("PYTHONPATH", pkg.parent().unwrap())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("STREAMALLOC_CONF")
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{conf}: the fuzz failed\nstdout:\n{stdout}\nstderr:\n{stderr}");
    eprintln!("{conf}: {}", stdout.trim());
    stdout
        .split_whitespace()
        .skip_while(|w| *w != "violations")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{conf}: no violation count in {stdout}"))
}

#[test]
fn the_c_path_fuzzed_against_the_ordering_checker() {
    for stack in [
        "strategy=plain",
        "strategy=best_fit",
        "strategy=stream_safe",
        "strategy=async",
        "strategy=best_fit,backing=chunks",
        "strategy=stream_safe,backing=chunks",
        "strategy=plain,stats=true",
        "strategy=stream_safe,limit=0.9,retry_timeout=5ms,stats=true,trace=/dev/null",
        "strategy=best_fit,limit=0.9,retry_timeout=5ms,stats=true",
    ] {
        assert_eq!(fuzz(&format!("device=sim,sim_capacity=1GiB,{stack}"), 10_000, true), 0, "{stack}");
    }
    // The negative control: kernels on other streams not announced with record_stream make
    // early reuses, and the checker sees them through the C path, over either backing.
    for stack in ["strategy=stream_safe", "strategy=stream_safe,backing=chunks", "strategy=best_fit"] {
        let found = fuzz(&format!("device=sim,sim_capacity=1GiB,{stack}"), 10_000, false);
        assert!(found > 0, "{stack}: a program without record_stream went unnoticed");
    }
}
