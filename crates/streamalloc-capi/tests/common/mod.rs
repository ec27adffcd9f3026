//! Helpers shared by the integration tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The directory of the `libstreamalloc.so` cargo built for this test run.
pub fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // The test runs from target/<profile>/deps; the library is there and one level up.
    exe.ancestors()
        .skip(1)
        .take(2)
        .find(|d| d.join("libstreamalloc.so").is_file())
        .unwrap_or_else(|| panic!("no libstreamalloc.so next to {}", exe.display()))
        .to_path_buf()
}

/// Compiles `source` (a path under the crate, C or C++ by its extension) against
/// `include/streamalloc.h` and the built `libstreamalloc.so` into `CARGO_TARGET_TMPDIR/name`;
/// the executable's path. Fails the test with the compiler's output if it does not compile.
#[allow(dead_code)] // each test crate includes this module; not every one compiles C
pub fn compile(source: &str, name: &str) -> PathBuf {
    let crate_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = library_dir();
    let exe = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let (compiler, standard) =
        if source.ends_with(".c") { ("cc", "-std=c11") } else { ("c++", "-std=c++17") };
    let output = std::process::Command::new(compiler)
        .args([standard, "-Wall", "-Wextra", "-Werror", "-O1", "-pthread", "-I"])
        .arg(crate_dir.join("include"))
        .arg(crate_dir.join(source))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lstreamalloc")
        .output()
        .unwrap_or_else(|e| panic!("run {compiler}: {e}"));
    assert!(
        output.status.success(),
        "{compiler} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    exe
}

/// Runs `exe` with `args` under `STREAMALLOC_CONF=conf`; its output, whatever its exit status.
#[allow(dead_code)] // each test crate includes this module; not every one runs a program
pub fn run(exe: &Path, conf: &str, args: &[&str]) -> Output {
    Command::new(exe)
        .args(args)
        .env("STREAMALLOC_CONF", conf)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", exe.display()))
}

/// Runs `exe` as [`run`] does and fails the test, with the configuration and the program's
/// output, unless it exits with 0; its standard output.
#[allow(dead_code)] // each test crate includes this module; not every one runs a program
pub fn run_ok(exe: &Path, conf: &str, args: &[&str]) -> String {
    let out = run(exe, conf, args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{conf}: exit {:?}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}
