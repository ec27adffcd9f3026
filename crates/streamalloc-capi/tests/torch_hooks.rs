//! Compiles `tests/cpp/torch_hooks.cpp` against `include/streamalloc.h` and the built
//! `libstreamalloc.so`, and runs it on the simulator under every strategy: every PyTorch hook
//! called through a pointer of the type torch uses, with torch's C++ argument types.

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn torch_hooks_through_torchs_types() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = common::library_dir();
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("streamalloc-torch-hooks");
    let output = Command::new("c++")
        .args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-O1", "-pthread", "-I"])
        .arg(crate_dir.join("include"))
        .arg(crate_dir.join("tests/cpp/torch_hooks.cpp"))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lstreamalloc")
        .output()
        .expect("run c++");
    assert!(
        output.status.success(),
        "c++ failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    for strategy in ["plain", "best_fit", "stream_safe", "stream_safe,expandable=true", "async"] {
        let conf = format!("device=sim,strategy={strategy},sim_capacity=64GiB");
        let out = Command::new(&exe).env("STREAMALLOC_CONF", &conf).output().expect("run torch_hooks");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{conf}:\nstdout:\n{stdout}\nstderr:\n{stderr}");
        assert!(stdout.contains(" passed, 0 failed"), "{conf}:\n{stdout}");
    }
}
