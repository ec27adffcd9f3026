//! Runs `python/tests/test_streamalloc.py` against the package in `python/`, with the
//! `libstreamalloc.so` of this build copied into it, on the simulator.

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn python_package_on_the_simulator() {
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
    let out = Command::new("python3")
        .arg(root.join("python/tests/test_streamalloc.py"))
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
