//! Helpers shared by the integration tests.

use std::path::PathBuf;

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
