//! The documentation's relative links (README.md, CHANGELOG.md, DESIGN.md, docs/*.md,
//! lab/README.md) point at files that exist, and their `#anchors` at headings of the file they
//! name; every `Note [name]` the sources cite is a note of DESIGN.md, and every note is cited;
//! no doc comment of the libraries cites a measurement.

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
    let mut files = vec![
        root.join("README.md"),
        root.join("CHANGELOG.md"),
        root.join("DESIGN.md"),
        root.join("lab/README.md"),
    ];
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

/// The files of `dir` (recursively) whose names end with one of `exts`, outside `target`
/// folders and hidden ones.
fn files_under(dir: &Path, exts: &[&str], out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name.starts_with('.') || name == "target" || name == "__pycache__" {
            continue;
        }
        if path.is_dir() {
            files_under(&path, exts, out);
        } else if exts.iter().any(|e| name.ends_with(e)) {
            out.push(path);
        }
    }
}

/// The names of the `Note [name]` citations in `text`, a citation broken over lines of a
/// comment included (comment markers and line breaks read as one space).
fn cited_notes(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("Note [") {
        let after = &rest[at + "Note [".len()..];
        let Some(end) = after.find(']') else { break };
        let words: Vec<&str> = after[..end]
            .split_whitespace()
            .filter(|w| !matches!(*w, "//" | "///" | "//!" | "#" | "*"))
            .collect();
        names.push(words.join(" "));
        rest = &after[end..];
    }
    names
}

/// The notes a source file defines for itself, PyTorch's way: a comment line that begins
/// `Note [name]:`.
fn local_notes(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            l.trim_start().trim_start_matches(['/', '#', '!', '*']).trim_start().strip_prefix("Note [")
        })
        .filter_map(|l| l.split_once("]:").map(|(name, _)| name.to_owned()))
        .collect()
}

/// The notes DESIGN.md defines: its `### Note [name]` headings.
fn design_notes(design: &str) -> Vec<String> {
    design
        .lines()
        .filter_map(|l| l.strip_prefix("### Note ["))
        .map(|l| l.trim_end().trim_end_matches(']').to_owned())
        .collect()
}

#[test]
fn every_cited_note_is_in_design_md_and_every_note_is_cited() {
    let root = repo_root();
    let design = fs::read_to_string(root.join("DESIGN.md")).expect("DESIGN.md");
    let notes = design_notes(&design);
    assert!(notes.len() >= 10, "DESIGN.md has {} notes", notes.len());
    let mut duplicates = notes.clone();
    duplicates.sort();
    duplicates.dedup();
    assert_eq!(duplicates.len(), notes.len(), "a note is defined twice: {notes:?}");
    let mut sources = Vec::new();
    for dir in ["crates", "python", "lab", "docs"] {
        files_under(&root.join(dir), &[".rs", ".py", ".cpp", ".c", ".h", ".sh", ".md"], &mut sources);
    }
    let mut unknown = Vec::new();
    let mut cited: Vec<String> = Vec::new();
    for file in sources.iter().filter(|f| !f.ends_with("tests/doc_links.rs")) {
        let text = fs::read_to_string(file).unwrap_or_default();
        let local = local_notes(&text);
        for name in cited_notes(&text) {
            if local.contains(&name) {
                continue;
            }
            if !notes.contains(&name) {
                unknown.push(format!("{}: Note [{name}]", file.display()));
            }
            cited.push(name);
        }
    }
    // DESIGN.md's own text cites notes too; a heading does not cite itself.
    let body: String =
        prose(&design).lines().filter(|l| !l.starts_with("### Note [")).collect::<Vec<_>>().join("\n");
    for name in cited_notes(&body) {
        if !notes.contains(&name) {
            unknown.push(format!("DESIGN.md: Note [{name}]"));
        }
        cited.push(name);
    }
    assert!(unknown.is_empty(), "cited notes DESIGN.md does not have:\n{}", unknown.join("\n"));
    let uncited: Vec<&String> = notes.iter().filter(|n| !cited.contains(n)).collect();
    assert!(uncited.is_empty(), "notes nothing cites: {uncited:?}");
}

#[test]
fn a_citation_over_two_comment_lines_reads_as_one_name() {
    let text = "// See Note [the small\n    // class] and Note [one] here.\n/// Note [two\n/// words]";
    assert_eq!(cited_notes(text), ["the small class", "one", "two words"]);
}

#[test]
fn no_doc_comment_of_the_libraries_cites_a_measurement() {
    let root = repo_root();
    let mut sources = Vec::new();
    for krate in ["streamalloc", "streamalloc-replay", "streamalloc-cli", "streamalloc-capi"] {
        files_under(&root.join("crates").join(krate).join("src"), &[".rs"], &mut sources);
    }
    assert!(!sources.is_empty());
    let mut citing = Vec::new();
    for file in &sources {
        let text = fs::read_to_string(file).expect("a source file");
        for (n, line) in text.lines().enumerate() {
            let t = line.trim_start();
            if (t.starts_with("///") || t.starts_with("//!")) && t.contains("bench/results") {
                citing.push(format!("{}:{}: {}", file.display(), n + 1, t));
            }
        }
    }
    assert!(
        citing.is_empty(),
        "doc comments that cite measurements (cite a DESIGN.md note instead):\n{}",
        citing.join("\n")
    );
}
