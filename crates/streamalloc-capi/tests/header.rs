//! The committed header matches what cbindgen generates from the crate (CI's drift check), and
//! the torch backend's mirror of it matches the header.
//! `STREAMALLOC_BLESS=1 cargo test -p streamalloc-capi --test header` rewrites the header.

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

/// The body of the first `{ ... }` after `start` in `text`.
fn body<'a>(text: &'a str, start: &str) -> &'a str {
    let from = text.find(start).unwrap_or_else(|| panic!("`{start}` not found"));
    let open = from + text[from..].find('{').expect("an opening brace");
    let close = open + text[open..].find('}').expect("a closing brace");
    &text[open + 1..close]
}

/// The statements of a C body, comments left out and whitespace collapsed.
fn statements(body: &str) -> Vec<String> {
    body.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join(" ")
        .split([';', ','])
        .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|s| !s.is_empty())
        .collect()
}

/// The torch backend reaches the library through dlsym and mirrors the header's statistics
/// struct and status values in `python/streamalloc/_torch_backend/lib.h`: they must stay what
/// the header says, field for field and value for value.
#[test]
fn the_torch_backends_mirror_matches_the_header() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let header = std::fs::read_to_string(dir.join("include/streamalloc.h")).expect("the header");
    let mirror = std::fs::read_to_string(dir.join("../../python/streamalloc/_torch_backend/lib.h"))
        .expect("the torch backend's lib.h");
    assert_eq!(
        statements(body(&mirror, "struct LibStats")),
        statements(body(&header, "typedef struct streamalloc_stats_t")),
        "lib.h's LibStats is not streamalloc_stats_t field for field"
    );
    let values = statements(body(&header, "typedef enum streamalloc_status_t"));
    let mirrored = statements(body(&mirror, "enum Status"));
    assert!(!mirrored.is_empty());
    for value in mirrored {
        let ours = format!("STREAMALLOC_{value}");
        assert!(values.contains(&ours), "lib.h's status `{value}` is not the header's ({values:?})");
    }
}
