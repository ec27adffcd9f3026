//! The user documentation's relative links (README.md, CHANGELOG.md, docs/*.md) point at files
//! that exist, and their `#anchors` at headings of the file they name.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("the repository root")
}

/// The markdown text outside fenced code blocks and inline code spans.
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut in_code = false;
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
            } else if !in_code {
                out.push(c);
            }
        }
        out.push('\n');
    }
    out
}

/// The targets of the inline links `[text](target)` of `text`.
fn link_targets(text: &str) -> Vec<String> {
    let prose = prose(text);
    let mut targets = Vec::new();
    let mut rest = prose.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        match after.find(')') {
            Some(end) => {
                targets.push(after[..end].trim().to_owned());
                rest = &after[end..];
            }
            None => break,
        }
    }
    targets
}

/// GitHub's anchors of the headings of a markdown text (lower case, punctuation dropped,
/// spaces as hyphens; a repeated heading gets `-1`, `-2`, ...).
fn anchors(text: &str) -> Vec<String> {
    let mut bases: Vec<String> = Vec::new();
    let mut found: Vec<String> = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let title = line.trim_start_matches('#').trim();
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let repeats = bases.iter().filter(|b| **b == slug).count();
        found.push(if repeats == 0 { slug.clone() } else { format!("{slug}-{repeats}") });
        bases.push(slug);
    }
    found
}

/// What is wrong with the relative links of the markdown file `file` (text `text`).
fn broken_links(file: &Path, text: &str) -> Vec<String> {
    let dir = file.parent().expect("a file's folder");
    let mut broken = Vec::new();
    for target in link_targets(text) {
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((path, anchor)) => (path, Some(anchor)),
            None => (target.as_str(), None),
        };
        let linked = if path.is_empty() { file.to_path_buf() } else { dir.join(path) };
        if !linked.exists() {
            broken.push(format!("{}: `{target}`: no such file", file.display()));
            continue;
        }
        if let Some(anchor) = anchor {
            if linked.extension().is_some_and(|e| e == "md") {
                let headings = if path.is_empty() {
                    anchors(text)
                } else {
                    anchors(&fs::read_to_string(&linked).expect("a linked markdown file"))
                };
                if !headings.iter().any(|h| h == anchor) {
                    broken.push(format!("{}: `{target}`: no heading #{anchor} in it", file.display()));
                }
            }
        }
    }
    broken
}

#[test]
fn the_user_documentation_links_to_files_and_headings_that_exist() {
    let root = repo_root();
    let mut files = vec![root.join("README.md"), root.join("CHANGELOG.md")];
    let mut docs: Vec<PathBuf> = fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("an entry of docs/").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    assert!(!docs.is_empty(), "docs/ holds no markdown page");
    files.extend(docs);
    let mut checked = 0;
    let mut broken = Vec::new();
    for file in &files {
        let text = fs::read_to_string(file).expect("a documentation file");
        checked += link_targets(&text).len();
        broken.extend(broken_links(file, &text));
    }
    assert!(checked > 0, "no link found in {files:?}");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn a_missing_file_and_a_missing_heading_are_reported() {
    let root = repo_root();
    let file = root.join("README.md");
    let text = "# Top\n\nSee [design](DESIGN.md), [gone](docs/no-such-page.md), [here](#top), \
                [nowhere](#no-such-heading), `[code](not-a-link.md)` and [web](https://example.com).\n\
                ```text\n[in a block](also-not-a-link.md)\n```\n";
    let broken = broken_links(&file, text);
    assert_eq!(broken.len(), 2, "{broken:?}");
    assert!(broken[0].contains("docs/no-such-page.md"), "{broken:?}");
    assert!(broken[1].contains("#no-such-heading"), "{broken:?}");
}
