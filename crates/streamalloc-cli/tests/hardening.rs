//! Issue 33: `record` never deletes or replaces its output when nothing was recorded and
//! refuses what is not a file; `record` of a killed program names the signal and keeps
//! the rows written; `import` reads shared objects and deep nesting without overflowing its
//! stack; user text echoed in errors is bounded and its control characters escaped.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{stderr, stdout, HEADER};

fn streamalloc(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_streamalloc"));
    command.args(args);
    command
}

/// Runs `command` to its end, killing it after `limit` (then the test fails, saying so).
fn run(command: &mut Command, limit: Duration) -> Output {
    let mut child =
        command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let drain = |mut pipe: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "still running after {limit:?}; stderr: {}",
                String::from_utf8_lossy(&err.join().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output { status, stdout: out.join().unwrap(), stderr: err.join().unwrap() }
}

fn output(command: &mut Command) -> Output {
    run(command, Duration::from_secs(120))
}

/// Asserts a clean failure: exit status 1, an `error:` line containing every `needle`.
fn assert_fails_with(out: &Output, needles: &[&str]) {
    let mut err = stderr(out);
    if err.len() > 3000 {
        // Quoted in part below: what matters is that it is too long.
        let end = (0..=3000).rev().find(|i| err.is_char_boundary(*i)).unwrap_or(0);
        err = format!("{}... ({} bytes of stderr)", &err[..end], err.len());
    }
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(err.starts_with("error: "), "stderr: {err}");
    for needle in needles {
        assert!(err.contains(needle), "stderr lacks {needle:?}: {err}");
    }
}

/// A directory named after the test in the system's temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!("streamalloc-hardening-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// The names in the directory, sorted.
    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn text(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// libstreamalloc.so, built beside the CLI (`cargo build -p streamalloc-capi`).
fn library() -> PathBuf {
    let lib = Path::new(env!("CARGO_BIN_EXE_streamalloc")).with_file_name("libstreamalloc.so");
    assert!(lib.is_file(), "{} missing: run `cargo build -p streamalloc-capi` first", lib.display());
    lib
}

/// `record -o OUT -- python3 -c SCRIPT` on the simulator, where the script loads the library
/// as `l` and then runs `body`.
fn record_python(out: &Path, body: &str) -> Output {
    let script = format!(
        "import ctypes, os, signal\nl = ctypes.CDLL({:?})\nl.streamalloc_malloc.restype = ctypes.c_void_p\n{body}",
        library()
    );
    output(
        streamalloc(&["record", "-o", out.to_str().unwrap(), "--", "python3", "-c", &script])
            .env("STREAMALLOC_CONF", "device=sim,strategy=stream_safe"),
    )
}

/// Four allocations and their frees: 9 lines of trace with the header.
const ALLOCATE_AND_FREE: &str =
    "ps = [l.streamalloc_malloc(ctypes.c_ssize_t(4096 << i), 0, None) for i in range(4)]\n\
     [l.streamalloc_free(ctypes.c_void_p(p), ctypes.c_ssize_t(0), 0, None) for p in ps]\n";

/// Issue 33: `record -o FILE` removed FILE before running the program, so a program that
/// recorded nothing (or failed) lost the user's file.
#[test]
fn record_keeps_an_existing_file_when_nothing_is_recorded() {
    let dir = TempDir::new("keep");
    let file = dir.join("precious.csv");
    std::fs::write(&file, "precious").unwrap();
    for program in ["true", "false"] {
        let out = output(&mut streamalloc(&["record", "-o", file.to_str().unwrap(), "--", program]));
        assert_fails_with(&out, &["wrote no trace"]);
        assert_eq!(text(&file), "precious", "`{program}` recorded nothing: the file is kept");
        assert_eq!(dir.names(), ["precious.csv"], "no temporary file is left");
    }
    let out =
        output(&mut streamalloc(&["record", "-o", file.to_str().unwrap(), "--", "/nonexistent/program"]));
    assert_fails_with(&out, &["cannot run `/nonexistent/program`"]);
    assert_eq!(text(&file), "precious");
    assert_eq!(dir.names(), ["precious.csv"]);

    // A trace recorded replaces the file, keeping its permissions.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
    let out = record_python(&file, ALLOCATE_AND_FREE);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(text(&file).lines().count(), 9, "{}", text(&file));
    assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o640);
    assert_eq!(dir.names(), ["precious.csv"]);
}

/// Issue 33: `record -o LINK` truncated the link's target and removed the link. A link is
/// followed: the trace replaces the file it points to, and the link stays.
#[test]
fn record_through_a_symbolic_link_writes_its_target_and_keeps_the_link() {
    let dir = TempDir::new("link");
    let (target, link) = (dir.join("target.csv"), dir.join("link.csv"));
    std::fs::write(&target, "old").unwrap();
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let out = output(&mut streamalloc(&["record", "-o", link.to_str().unwrap(), "--", "true"]));
    assert_fails_with(&out, &["wrote no trace"]);
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link is kept");
    assert_eq!(text(&target), "old", "the target is untouched");

    let out = record_python(&link, ALLOCATE_AND_FREE);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link is kept");
    assert_eq!(text(&target).lines().count(), 9, "the target holds the trace");
    assert_eq!(dir.names(), ["link.csv", "target.csv"]);

    // A link to nothing is refused, and left as it is.
    let dangling = dir.join("dangling.csv");
    std::os::unix::fs::symlink(dir.join("missing.csv"), &dangling).unwrap();
    let out = output(&mut streamalloc(&["record", "-o", dangling.to_str().unwrap(), "--", "true"]));
    assert_fails_with(&out, &["dangling.csv", "symbolic link"]);
    assert!(std::fs::symlink_metadata(&dangling).is_ok());
    assert_eq!(dir.names(), ["dangling.csv", "link.csv", "target.csv"]);
}

/// Issue 33: run as root, `record -o /dev/full` replaced the device node with a regular
/// file. What is not a regular file (a device, a FIFO, a directory) is refused before the
/// program runs, and left as it is. The device here is one the test makes (when it may).
#[test]
fn record_refuses_what_is_not_a_regular_file() {
    let dir = TempDir::new("special");
    let fifo = dir.join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let out = run(
        &mut streamalloc(&["record", "-o", fifo.to_str().unwrap(), "--", "true"]),
        Duration::from_secs(20),
    );
    assert_fails_with(&out, &["fifo", "not a regular file"]);
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(), "the FIFO is kept");

    let out = output(&mut streamalloc(&["record", "-o", dir.0.to_str().unwrap(), "--", "true"]));
    assert_fails_with(&out, &["not a regular file", "directory"]);

    let device = dir.join("null");
    if Command::new("mknod").arg(&device).args(["c", "1", "3"]).status().is_ok_and(|s| s.success()) {
        let out = output(&mut streamalloc(&["record", "-o", device.to_str().unwrap(), "--", "true"]));
        assert_fails_with(&out, &["not a regular file", "device"]);
        let kind = std::fs::symlink_metadata(&device).unwrap().file_type();
        assert!(kind.is_char_device(), "the device node is kept");
    } else {
        eprintln!("note: mknod is not allowed here; the device case is not tested");
    }
    let mut names = dir.names();
    names.retain(|n| n != "null");
    assert_eq!(names, ["fifo"], "no temporary file is left");
}

/// Issue 33: `record` of a program killed by a signal reported a trace parse error (its
/// last row was cut short); it names the signal and keeps and summarizes the rows written.
#[test]
fn record_of_a_killed_program_names_the_signal_and_keeps_the_rows() {
    let dir = TempDir::new("killed");
    let file = dir.join("t.csv");
    // Enough rows that the library's 64 KiB buffer was written out before the kill.
    let out = record_python(
        &file,
        "ps = [l.streamalloc_malloc(ctypes.c_ssize_t(256 * (1 + i % 8)), 0, None) for i in range(4000)]\n\
         os.kill(os.getpid(), signal.SIGKILL)\n",
    );
    assert_fails_with(&out, &["killed by signal 9 (SIGKILL)", "kept"]);
    assert!(!stderr(&out).contains("trace line"), "{}", stderr(&out));
    let trace = text(&file);
    assert!(trace.starts_with(HEADER) && trace.lines().count() > 1000, "{} lines", trace.lines().count());
    // Whole rows: those that end in a newline, and a last one that has all six fields.
    let last = trace.rsplit('\n').next().unwrap_or("");
    let whole_last = last.split(',').count() == 6 && !last.ends_with(',');
    let rows = trace.matches('\n').count() - 1 + usize::from(whole_last);
    assert!(stdout(&out).contains(&format!("{rows} operations")), "{}", stdout(&out));
    assert_eq!(dir.names(), ["t.csv"]);
}

/// Issue 33: a trace whose last row was cut short (the program writing it was killed) is
/// an error naming that line, and under --lenient that row is skipped and counted.
#[test]
fn a_cut_last_row_is_skipped_under_lenient_and_named_without() {
    let dir = TempDir::new("cut");
    let file = dir.join("cut.csv");
    std::fs::write(&file, format!("{HEADER}\n0,1,allocate,0x10,64,0\n0,2,free,0x10,64,0\n0,3,allocate,0x2"))
        .unwrap();
    let path = file.to_str().unwrap();
    let out = output(&mut streamalloc(&["replay", path, "-a", "plain", "--device", "sim"]));
    assert_fails_with(&out, &["line 4", "0,3,allocate,0x2", "cut short", "--lenient"]);

    let out = output(&mut streamalloc(&["replay", path, "-a", "plain", "--device", "sim", "--lenient"]));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("last row, cut short, skipped"), "{}", stdout(&out));
    // A last row that is whole but has no newline is read as usual.
    std::fs::write(&file, format!("{HEADER}\n0,1,allocate,0x10,64,0\n0,2,free,0x10,64,0")).unwrap();
    let out = output(&mut streamalloc(&["replay", path, "-a", "plain", "--device", "sim", "--json"]));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("\"ops\": 2"), "{}", stdout(&out));
}

/// A pickle (protocol 2) written by hand: `BINUNICODE` strings, `BININT` integers, and the
/// container opcodes, so a test can nest deeper than Python's pickler can.
#[derive(Default)]
struct Pickle(Vec<u8>);

impl Pickle {
    fn new() -> Self {
        Pickle(vec![0x80, 2])
    }
    fn op(mut self, bytes: &[u8]) -> Self {
        self.0.extend_from_slice(bytes);
        self
    }
    fn str(self, s: &str) -> Self {
        let len = (s.len() as u32).to_le_bytes();
        self.op(b"X").op(&len).op(s.as_bytes())
    }
    fn int(self, v: i32) -> Self {
        self.op(b"J").op(&v.to_le_bytes())
    }
    /// `LONG1` of 8 bytes: any `i64`.
    fn long(self, v: i64) -> Self {
        self.op(&[0x8a, 8]).op(&v.to_le_bytes())
    }
    /// Like [`Pickle::entry`], with a `time_us`.
    fn timed(self, action: &str, addr: i32, size: i32, time_us: i64, memo: u8) -> Self {
        self.op(b"}q")
            .op(&[memo])
            .op(b"(")
            .str("action")
            .str(action)
            .str("addr")
            .int(addr)
            .str("size")
            .int(size)
            .str("stream")
            .int(0)
            .str("time_us")
            .long(time_us)
            .op(b"u")
    }
    /// A snapshot of one device whose entries `entries` writes.
    fn snapshot(entries: impl FnOnce(Self) -> Self) -> Vec<u8> {
        entries(Pickle::new().op(b"}(").str("device_traces").op(b"](](")).op(b"ee").op(b"u.").0
    }
    /// `{'action': action, 'addr': addr, 'size': size, 'stream': 0}`, memoized as `memo`.
    fn entry(self, action: &str, addr: i32, size: i32, memo: u8) -> Self {
        self.op(b"}q")
            .op(&[memo])
            .op(b"(")
            .str("action")
            .str(action)
            .str("addr")
            .int(addr)
            .str("size")
            .int(size)
            .str("stream")
            .int(0)
            .op(b"u")
    }
}

fn write_pickle(dir: &TempDir, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn import(snapshot: &Path, dir: &TempDir) -> Output {
    let csv = dir.join("out.csv");
    output(&mut streamalloc(&["import", snapshot.to_str().unwrap(), "-o", csv.to_str().unwrap()]))
}

/// Issue 33: 20,000 nested lists (40 KB) overflowed `import`'s stack (SIGABRT). Nesting
/// costs no stack: the snapshot imports, or is refused with a clear error.
#[test]
fn import_of_deeply_nested_lists_does_not_overflow() {
    let dir = TempDir::new("nested");
    let depth = 20_000;
    let nested = |p: Pickle| p.op(&vec![b'('; depth]).op(&vec![b'l'; depth]);
    let bare = write_pickle(&dir, "bare.pickle", &nested(Pickle::new()).op(b".").0);
    let out = import(&bare, &dir);
    assert_fails_with(&out, &["bare.pickle", "not a PyTorch memory snapshot"]);
    assert!(!stderr(&out).contains("overflow"), "{}", stderr(&out));

    // Beside the entries, and in place of an entry's frames.
    let snapshot = nested(
        nested(Pickle::new().op(b"}(").str("junk"))
            .str("device_traces")
            .op(b"](](")
            .entry("alloc", 0x1000, 512, 1)
            .entry("free_requested", 0x1000, 512, 2)
            .op(b"}(")
            .str("action")
            .str("alloc")
            .str("addr")
            .int(0x2000)
            .str("size")
            .int(64)
            .str("frames"),
    )
    .op(b"u") // the third entry
    .op(b"ee") // the device's entries, the devices
    .op(b"u.") // the snapshot
    .0;
    let path = write_pickle(&dir, "deep.pickle", &snapshot);
    let out = import(&path, &dir);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("2 allocations, 1 frees, 1 streams"), "{}", stdout(&out));
}

/// Issue 33: an object the pickle refers to twice (its memo: `BINGET` of an object already
/// built) was refused as "not a PyTorch memory snapshot" when the first reference was in a
/// field the import skips.
#[test]
fn import_reads_objects_the_pickle_refers_to_twice() {
    let dir = TempDir::new("shared");
    let script = r#"
import pickle, sys
e = {'action': 'alloc', 'addr': 4096, 'size': 512, 'stream': 0, 'time_us': 1}
f = {'action': 'free_requested', 'addr': 4096, 'size': 512, 'stream': 0, 'time_us': 2}
t = [e, f]
shapes = [{'first': e, 'device_traces': [[e, f], []]}, {'again': t, 'device_traces': [t]},
          {'device_traces': [t, t]}, {'device_traces': [[e, f, e, f]]}]
for i, s in enumerate(shapes):
    for protocol in (0, 2, 4):
        with open(f'{sys.argv[1]}/s{i}-p{protocol}.pickle', 'wb') as out:
            pickle.dump(s, out, protocol=protocol)
"#;
    let made = Command::new("python3").args(["-c", script, dir.0.to_str().unwrap()]).output().unwrap();
    assert!(made.status.success(), "{}", stderr(&made));
    for name in dir.names() {
        let out = import(&dir.join(&name), &dir);
        if name.starts_with("s2") {
            // The same entries on two devices: --gpu picks one.
            assert_fails_with(&out, &["devices 0, 1", "--gpu"]);
            continue;
        }
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        let want = if name.starts_with("s3") {
            "2 allocations, 2 frees, 1 streams" // the same alloc twice: a missed free between
        } else {
            "1 allocations, 1 frees, 1 streams"
        };
        assert!(stdout(&out).contains(want), "{name}: {}", stdout(&out));
    }
}

/// Issue 33: a trace's control characters (terminal escape sequences) reached the terminal
/// raw; they are escaped.
#[test]
fn control_characters_from_a_trace_are_escaped() {
    let dir = TempDir::new("escape");
    let file = dir.join("esc.csv");
    std::fs::write(&file, format!("{HEADER}\n0,1,alloc\x1b[2J\x07ate,0x10,64,0\n")).unwrap();
    let out = output(&mut streamalloc(&["replay", file.to_str().unwrap(), "--device", "sim"]));
    assert_fails_with(&out, &["line 2", "alloc\\x1b[2J\\x07ate"]);
    assert!(!stderr(&out).contains('\x1b') && !stderr(&out).contains('\x07'), "{:?}", stderr(&out));
}

/// Issue 33: a configuration error echoed a long value whole (twice), and its control
/// characters raw; what is echoed is at most 120 bytes of it, escaped, with its length.
#[test]
fn configuration_errors_echo_a_bounded_escaped_excerpt() {
    // As long as one argument may be (128 KiB on Linux).
    let huge = format!("limit={}", "9".repeat(100_000));
    let out = output(&mut streamalloc(&["replay", "x.csv", "--conf", &huge, "--device", "sim"]));
    assert_fails_with(&out, &["--conf 'limit=999", "bytes in all"]);
    assert!(stderr(&out).len() < 1500, "{} bytes of stderr", stderr(&out).len());

    let out =
        output(&mut streamalloc(&["replay", "x.csv", "--conf", "strategy=\x1b[31mred", "--device", "sim"]));
    assert_fails_with(&out, &["strategy=\\x1b[31mred"]);
    assert!(!stderr(&out).contains('\x1b'), "{:?}", stderr(&out));

    for args in [vec!["info"], vec!["record", "--", "true"], vec!["replay", "x.csv", "--device", "sim"]] {
        let out = output(streamalloc(&args).env("STREAMALLOC_CONF", format!("limit=\x1b]0;{huge}")));
        let all = stdout(&out) + &stderr(&out);
        assert!(all.contains("\\x1b]0;limit=999"), "{args:?}: {all:.300}");
        assert!(!all.contains('\x1b'), "{args:?}: {:.300}", all);
        assert!(all.len() < 1500, "{args:?}: {} bytes", all.len());
    }
}

/// Issue 52 #8: an import that failed after opening `-o FILE` (here for a negative size)
/// truncated an existing FILE to the header line; it is left as it was, and nothing is left
/// beside it.
#[test]
fn a_failed_import_leaves_an_existing_output_as_it_was() {
    let dir = TempDir::new("import-keeps");
    let csv = dir.join("out.csv");
    std::fs::write(&csv, "precious\n").unwrap();
    let bad = Pickle::snapshot(|p| p.entry("alloc", 0x1000, 512, 1).entry("alloc", 0x2000, -5, 2));
    let path = write_pickle(&dir, "bad.pickle", &bad);
    assert_fails_with(&import(&path, &dir), &["negative size"]);
    assert_eq!(text(&csv), "precious\n");
    assert_eq!(dir.names(), ["bad.pickle", "out.csv"]);

    let good = Pickle::snapshot(|p| p.entry("alloc", 0x1000, 512, 1));
    let path = write_pickle(&dir, "good.pickle", &good);
    let out = import(&path, &dir);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(text(&csv).starts_with(HEADER), "{}", text(&csv));
    assert_eq!(dir.names(), ["bad.pickle", "good.pickle", "out.csv"]);
}

/// Issue 52 #13: negative and huge `time_us` were written wrapped to u64 (and `use` rows of
/// u64::MAX ns); they are refused, naming the entry. A trace with a negative Time replayed
/// as garbage with exit status 0; it is refused.
#[test]
fn import_and_replay_refuse_negative_and_huge_times() {
    let dir = TempDir::new("times");
    for (time, needle) in [(-7, "negative `time_us` (-7)"), (i64::MAX, "`time_us` 9223372036854775807 is")] {
        let bad = Pickle::snapshot(|p| {
            p.timed("alloc", 0x1000, 512, 10, 1).timed("free_requested", 0x1000, 512, time, 2)
        });
        let path = write_pickle(&dir, "time.pickle", &bad);
        assert_fails_with(&import(&path, &dir), &["entry 1 (`free_requested`)", needle]);
    }
    // A pending free whose wait would last u64::MAX ns.
    let bad = Pickle::snapshot(|p| {
        p.timed("alloc", 0x1000, 512, 10, 1).timed("free_requested", 0x1000, 512, 11, 2).timed(
            "alloc",
            0x2000,
            8,
            i64::MAX,
            3,
        )
    });
    let path = write_pickle(&dir, "use.pickle", &bad);
    assert_fails_with(&import(&path, &dir), &["entry 2 (`alloc`)", "`time_us`"]);

    let trace = dir.join("negative.csv");
    std::fs::write(&trace, format!("{HEADER}\n0,5,allocate,0x10,64,0\n0,-3,free,0x10,64,0\n")).unwrap();
    let out =
        output(&mut streamalloc(&["replay", trace.to_str().unwrap(), "--device", "sim", "-a", "plain"]));
    assert_fails_with(&out, &["line 3", "negative Time `-3`"]);
}

/// Issue 52 #14: `import -o FIFO`, `plot -o FIFO` and `replay --plot FIFO` blocked until a
/// reader came; what is not a regular file is refused at once.
#[test]
fn outputs_that_are_not_regular_files_are_refused_at_once() {
    let dir = TempDir::new("fifo");
    let fifo = dir.join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    let fifo = fifo.to_str().unwrap();
    let trace = dir.join("t.csv");
    std::fs::write(&trace, format!("{HEADER}\n0,1,allocate,0x10,64,0\n0,2,free,0x10,64,0\n")).unwrap();
    let trace = trace.to_str().unwrap();
    let json = dir.join("r.json");
    let out = output(&mut streamalloc(&["replay", trace, "--device", "sim", "-a", "plain", "--json"]));
    assert!(out.status.success(), "{}", stderr(&out));
    std::fs::write(&json, &out.stdout).unwrap();
    let snapshot = write_pickle(&dir, "s.pickle", &Pickle::snapshot(|p| p.entry("alloc", 0x1000, 512, 1)));

    let limit = Duration::from_secs(30);
    let out = run(&mut streamalloc(&["import", snapshot.to_str().unwrap(), "-o", fifo]), limit);
    assert_fails_with(&out, &["fifo", "not a regular file but a FIFO"]);
    let out = run(&mut streamalloc(&["plot", json.to_str().unwrap(), "-o", fifo]), limit);
    assert_fails_with(&out, &["fifo", "not a regular file but a FIFO"]);
    let out =
        run(&mut streamalloc(&["replay", trace, "--device", "sim", "-a", "plain", "--plot", fifo]), limit);
    assert_fails_with(&out, &["fifo", "not a regular file but a FIFO"]);
    let out = run(&mut streamalloc(&["plot", json.to_str().unwrap(), "-o", "/dev/full"]), limit);
    assert_fails_with(&out, &["/dev/full", "not a regular file but a device"]);
}

/// Runs `import SNAPSHOT -o DIR/out.csv ARGS` with its address space limited to 2 GB, under
/// GNU time: the output and its peak resident set, in KiB.
fn import_bounded(snapshot: &Path, dir: &TempDir, args: &[&str]) -> (Output, u64) {
    let report = dir.join("time.txt");
    let command = format!(
        "ulimit -v 2000000 && exec /usr/bin/time -v -o '{}' '{}' import '{}' -o '{}' {}",
        report.display(),
        env!("CARGO_BIN_EXE_streamalloc"),
        snapshot.display(),
        dir.join("out.csv").display(),
        args.join(" ")
    );
    let out = output(Command::new("bash").args(["-c", &command]));
    let report = text(&report);
    let rss = report
        .lines()
        .find_map(|l| l.trim().strip_prefix("Maximum resident set size (kbytes): "))
        .unwrap_or_else(|| panic!("no maximum resident set size in {report}"));
    (out, rss.parse().unwrap())
}

/// Issue 52 #5: a "billion laughs" pickle of 400 KB (a list of 100,000 references to one
/// entry, referred to 100,000 times as `device_traces`) needed about 80 GB (a copy of the list
/// per reference); lists referred to again are shared, and the import of one device writes
/// its 100,000 rows in a few MB.
#[test]
fn import_of_shared_references_is_bounded_by_its_output() {
    let dir = TempDir::new("laughs");
    let k = 100_000;
    let entry = Pickle::new().op(b"}(").str("device_traces").op(b"]").entry("alloc", 0x1000, 512, 1);
    // In batches of 1,000 between a mark and APPENDS, as Python's pickler writes lists.
    let batches = |reference: &[u8]| [b"(", &reference.repeat(1000)[..], b"e"].concat().repeat(k / 1000);
    let list = entry.op(b"0]").op(&batches(b"h\x01")).op(b"q\x02"); // the entry k times
    let bomb = list.op(b"0").op(&batches(b"h\x02")).op(b"u.").0; // the list k times
    assert!(bomb.len() < 420_000, "{} bytes", bomb.len());
    let path = write_pickle(&dir, "laughs.pickle", &bomb);
    let (out, rss_kib) = import_bounded(&path, &dir, &["--gpu", "7"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // The same entry 100,000 times: an allocation, then a missed free before each other.
    assert!(stdout(&out).contains("100000 allocations, 99999 frees"), "{}", stdout(&out));
    assert!(rss_kib < 64 * 1024, "{rss_kib} KiB");
    let (out, _) = import_bounded(&path, &dir, &[]);
    assert_fails_with(&out, &["the snapshot has allocations on devices 0, 1, 2", "--gpu"]);
}

/// Issue 52 #5: 20 MB of `EMPTY_DICT` opcodes took 2.5 GB (every dict kept on the pickle's
/// stack); a stack deeper than any snapshot's is refused, in a few MB.
#[test]
fn a_pickle_stack_deeper_than_any_snapshot_is_refused() {
    let dir = TempDir::new("dicts");
    for (name, op) in [("dicts", b'}'), ("marks", b'(')] {
        let bytes = Pickle::new().op(&vec![op; 20_000_000]).op(b".").0;
        let path = write_pickle(&dir, &format!("{name}.pickle"), &bytes);
        let (out, rss_kib) = import_bounded(&path, &dir, &[]);
        assert_fails_with(&out, &["not a PyTorch memory snapshot", "values at once on its stack"]);
        assert!(rss_kib < 64 * 1024, "{name}: {rss_kib} KiB");
    }
}

/// Left from issue 52's previous round: `--conf trace=/dev/full` exited 0 though no row of the
/// trace was written; a trace that cannot be written fails the replay.
#[test]
fn a_trace_that_cannot_be_written_fails_the_replay() {
    let dir = TempDir::new("full");
    let trace = dir.join("t.csv");
    std::fs::write(&trace, format!("{HEADER}\n0,1,allocate,0x10,64,0\n0,2,free,0x10,64,0\n")).unwrap();
    let conf = "strategy=plain,trace=/dev/full";
    let out =
        output(&mut streamalloc(&["replay", trace.to_str().unwrap(), "--conf", conf, "--device", "sim"]));
    assert_fails_with(&out, &["writing the trace /dev/full", "No space left on device"]);
}
