//! What the tests of the `streamalloc` command share: running it, reading its output,
//! temporary files and a small workload.

// Each test binary uses some of these.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// The header row of a trace (RMM's logging CSV).
pub const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

/// Runs the command with `args`, without a `STREAMALLOC_CONF` of the environment's.
pub fn streamalloc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_streamalloc"))
        .args(args)
        .env_remove("STREAMALLOC_CONF")
        .output()
        .expect("the binary runs")
}

/// What `out` wrote to stdout.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What `out` wrote to stderr.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A file named after the test in the system's temporary directory, removed on drop.
pub struct TempFile(pub PathBuf);

impl TempFile {
    /// A file `name` holding `bytes`.
    pub fn new(name: &str, bytes: impl AsRef<[u8]>) -> Self {
        let path = std::env::temp_dir().join(format!("streamalloc-cli-test-{}-{name}", std::process::id()));
        std::fs::write(&path, bytes).expect("temp dir is writable");
        TempFile(path)
    }

    /// Its path, as the command takes it.
    pub fn path(&self) -> &str {
        self.0.to_str().expect("temp paths are UTF-8")
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A trace of `rounds` rounds on two streams whose blocks are `scale` bytes or so: every
/// configuration reaches its peaks at about the same operation.
pub fn workload(rounds: usize, scale: usize) -> String {
    let mut text = format!("{HEADER}\n");
    let mut ptr = 0x1000u64;
    let mut time = 0;
    let mut row = |action: &str, ptr: u64, size: usize, stream: u64| {
        time += 1;
        text.push_str(&format!("0,{time},{action},{ptr:#x},{size},{stream}\n"));
    };
    for round in 0..rounds {
        let acts: Vec<(u64, usize)> = (1..=6)
            .map(|k| {
                ptr += 0x1000;
                (ptr, k * scale * (1 + round % 3) + 4096 * k)
            })
            .collect();
        for &(p, s) in &acts {
            row("allocate", p, s, (p / 0x1000) % 2 * 7);
        }
        for &(p, s) in acts.iter().rev() {
            row("free", p, s, (p / 0x1000) % 2 * 7);
        }
        ptr += 0x1000;
        row("allocate", ptr, 3 * scale, 0);
    }
    text
}

/// Writes a snapshot fabricated like `torch.cuda.memory._dump_snapshot` (see
/// tests/fabricate_snapshot.py) with `args`, and the summary the script prints (JSON:
/// `bytes`, `entries`, `peak_allocated_bytes`, `deferred_frees`).
pub fn fabricated_snapshot(name: &str, args: &[&str]) -> (TempFile, serde_json::Value) {
    let file = TempFile::new(name, "");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fabricate_snapshot.py");
    let out =
        Command::new("python3").arg(&script).arg(file.path()).args(args).output().expect("python3 runs");
    assert!(out.status.success(), "{}", stderr(&out));
    let summary = serde_json::from_slice(&out.stdout).expect("the script prints its summary");
    (file, summary)
}

/// The rows of a successful `--json` output.
pub fn json_rows(out: &Output) -> Vec<serde_json::Value> {
    assert!(out.status.success(), "{}", stderr(out));
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).expect("--json output parses");
    value.as_array().expect("an array of results").clone()
}
