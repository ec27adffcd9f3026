//! The committed header matches what cbindgen generates from the crate (CI's drift check).
//! `STREAMALLOC_BLESS=1 cargo test -p streamalloc-capi --test header` rewrites the header.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

#[test]
fn header_is_up_to_date() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen could not generate the header")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("the header is UTF-8");
    let path = dir.join("include/streamalloc.h");
    if std::env::var_os("STREAMALLOC_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write include/streamalloc.h");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/streamalloc.h is out of date; regenerate it with \
         `STREAMALLOC_BLESS=1 cargo test -p streamalloc-capi --test header`"
    );
}
