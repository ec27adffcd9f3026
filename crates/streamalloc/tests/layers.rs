//! The import graph of the core crate and of the C ABI crate (issue 51): the core crate's
//! layers point down only (base < device < policy < the allocation interface < allocators <
//! adaptors < facade), and neither crate's modules import each other in a cycle. Read from
//! the sources' `crate::` and `super::` paths, outside comments and `#[cfg(test)]` modules.
//! Run with `--nocapture` for the figures.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The layers of the core crate, lowest first, each the top-level modules it holds.
const LAYERS: &[(&str, &[&str])] = &[
    ("base", &["error", "text"]),
    ("device", &["device"]),
    ("policy", &["policy"]),
    ("interface", &["allocation", "stream_table", "tags", "trace"]),
    ("allocators", &["allocators"]),
    ("adaptors", &["adaptors"]),
    ("facade", &["facade"]),
];

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of `file` under `src` (`allocators/backing/chunks.rs` ->
/// `["allocators", "backing", "chunks"]`; `mod.rs` and `lib.rs` name their folder).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// The code of `text` that a build without tests compiles: comments dropped, and everything
/// from a `#[cfg(test)]` module on (test modules come last in a file), or nothing where the
/// file is one (its `mod` line in the parent says so: `tests_files`).
fn production_code(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < lines.len() {
        let t = lines[i].trim_start();
        if t.starts_with("#[cfg(test)]") {
            let mut next = i + 1;
            while lines.get(next).is_some_and(|l| l.trim_start().starts_with("#[")) {
                next += 1;
            }
            match lines.get(next).map(|l| l.trim()) {
                Some(m) if m.contains("mod ") && m.ends_with('{') => break,
                Some(m) if m.contains("mod ") => {
                    i = next + 1;
                    continue;
                }
                _ => {}
            }
        }
        if !t.starts_with("//") {
            out.push_str(lines[i]);
            out.push('\n');
        }
        i += 1;
    }
    out
}

/// The top-level modules `code` of module `me` names: `crate::NAME`, `crate::{NAME, ...}`,
/// and `super::NAME` resolved against `me`; `reexports` maps names the crate root re-exports
/// to their module.
fn imports(code: &str, me: &[String], reexports: &BTreeMap<String, String>) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut add = |first: &str| {
        let first = first.trim();
        if let Some(module) = reexports.get(first) {
            found.insert(module.clone());
        } else if first.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
            found.insert(first.to_string());
        }
    };
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                add(item.split("::").next().unwrap_or(""));
            }
        } else {
            add(rest.split(|c: char| !(c.is_alphanumeric() || c == '_')).next().unwrap_or(""));
        }
    }
    // `super::NAME` from a top-level module names the crate root's NAME; deeper, it stays in
    // the same top-level module.
    if me.len() == 1 {
        for (at, _) in code.match_indices("super::") {
            let rest = &code[at + "super::".len()..];
            add(rest.split(|c: char| !(c.is_alphanumeric() || c == '_')).next().unwrap_or(""));
        }
    }
    found
}

/// The names `lib.rs` re-exports at the crate root, with their module.
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    for stmt in lib.split(';') {
        let Some(rest) = stmt.trim().strip_prefix("pub use ") else { continue };
        let Some((module, names)) = rest.split_once("::") else { continue };
        for name in names.trim_matches(|c| c == '{' || c == '}' || char::is_whitespace(c)).split(',') {
            let name = name.trim();
            if !name.is_empty() {
                map.insert(name.to_string(), module.trim().to_string());
            }
        }
    }
    map
}

/// The graph between the top-level modules of the crate at `src`: module -> modules it
/// imports, and the number of files per top-level module. Files of test modules
/// (`#[cfg(test)] mod NAME;`) are left out.
type Graph = BTreeMap<String, BTreeSet<String>>;

fn graph(src: &Path) -> (Graph, BTreeMap<String, usize>) {
    let mut files = Vec::new();
    sources(src, &mut files);
    let lib = fs::read_to_string(src.join("lib.rs")).unwrap();
    let reexports = root_reexports(&production_code(&lib));
    let mut test_files = BTreeSet::new();
    for file in &files {
        let text = fs::read_to_string(file).unwrap();
        let mut lines = text.lines();
        while let Some(line) = lines.next() {
            if line.trim_start().starts_with("#[cfg(test)]") {
                let declared = lines.find(|l| !l.trim_start().starts_with("#["));
                if let Some(name) = declared.and_then(|l| l.trim().strip_prefix("mod ")?.strip_suffix(';')) {
                    let dir = if file.ends_with("mod.rs") || file.ends_with("lib.rs") {
                        file.parent().unwrap().to_path_buf()
                    } else {
                        file.with_extension("")
                    };
                    test_files.insert(dir.join(format!("{name}.rs")));
                    test_files.insert(dir.join(name).join("mod.rs"));
                }
            }
        }
    }
    let mut edges: Graph = BTreeMap::new();
    let mut counts = BTreeMap::new();
    for file in files.iter().filter(|f| !test_files.contains(*f)) {
        let me = module_of(src, file);
        let top = me.first().cloned().unwrap_or_else(|| "lib".to_string());
        *counts.entry(top.clone()).or_insert(0) += 1;
        let code = production_code(&fs::read_to_string(file).unwrap());
        let targets = imports(&code, &me, &reexports);
        let entry = edges.entry(top.clone()).or_default();
        entry.extend(targets.into_iter().filter(|t| *t != top));
    }
    // The crate root re-exports: not an arrow of the layers.
    edges.remove("lib");
    (edges, counts)
}

/// The cycles of `g`: each strongly connected set of more than one module.
fn cycles(g: &Graph) -> Vec<BTreeSet<String>> {
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(m) = todo.pop() {
            for next in g.get(&m).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let mut found: Vec<BTreeSet<String>> = Vec::new();
    for m in g.keys() {
        let mut set: BTreeSet<String> = reach(m).into_iter().filter(|n| reach(n).contains(m)).collect();
        if !set.is_empty() {
            set.insert(m.clone());
            if !found.contains(&set) {
                found.push(set);
            }
        }
    }
    found
}

fn crate_src(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(name).join("src")
}

#[test]
fn layers_point_down_and_modules_import_no_cycle() {
    let (core, counts) = graph(&crate_src("streamalloc"));
    let layer = |module: &str| LAYERS.iter().position(|(_, modules)| modules.contains(&module));
    for module in core.keys() {
        assert!(layer(module).is_some(), "module `{module}` is in no layer of LAYERS");
    }
    let mut up = Vec::new();
    for (from, targets) in &core {
        for to in targets {
            if layer(to) > layer(from) {
                up.push(format!("{from} -> {to}"));
            }
        }
    }
    let core_cycles = cycles(&core);
    let (capi, capi_counts) = graph(&crate_src("streamalloc-capi"));
    let capi_cycles = cycles(&capi);
    for (name, modules) in LAYERS {
        let files: usize = modules.iter().map(|m| counts.get(*m).copied().unwrap_or(0)).sum();
        println!("layer {name}: {files} files ({})", modules.join(", "));
    }
    println!("core crate: arrows up {}, cycles {}", up.len(), core_cycles.len());
    println!(
        "C ABI crate: {} modules, {} files, cycles {}",
        capi.len(),
        capi_counts.values().sum::<usize>(),
        capi_cycles.len()
    );
    assert!(up.is_empty(), "imports that point up the layers: {up:?}");
    assert!(core_cycles.is_empty(), "import cycles in the core crate: {core_cycles:?}");
    assert!(capi_cycles.is_empty(), "import cycles in the C ABI crate: {capi_cycles:?}");
}

/// The checker sees an arrow up and a cycle when there is one (so that its zeros mean
/// something).
#[test]
fn the_checker_finds_arrows_up_and_cycles() {
    let me = vec!["device".to_string()];
    let code =
        "use crate::allocators::Plain;\n// use crate::facade::Config;\nuse crate::{Error, policy::X};\n";
    let reexports = BTreeMap::from([("Error".to_string(), "error".to_string())]);
    let found = imports(&production_code(code), &me, &reexports);
    assert_eq!(found, BTreeSet::from(["allocators".into(), "error".into(), "policy".into()]));
    let g: Graph = BTreeMap::from([
        ("a".into(), BTreeSet::from(["b".into()])),
        ("b".into(), BTreeSet::from(["c".into()])),
        ("c".into(), BTreeSet::from(["a".into()])),
        ("d".into(), BTreeSet::from(["a".into()])),
    ]);
    assert_eq!(cycles(&g), vec![BTreeSet::from(["a".into(), "b".into(), "c".into()])]);
}
