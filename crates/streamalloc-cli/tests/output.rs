//! What the command tells its user (issue 37's rough edges). A simulator replay records the
//! configuration it ran (`device=sim`); `info` fails on an invalid `STREAMALLOC_CONF`; a
//! pickle given to `replay` is named and `import` suggested; `async`'s out-of-memory hint
//! names its key; side-by-side plots share one y-scale per row and their peak labels do not
//! overlap; `record` formats bytes as `replay` does; rows keep the command line's order; the
//! simulator's ns/op are said to be the library's CPU cost.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{json_rows, stderr, stdout, streamalloc, workload, TempFile, HEADER};

/// Issue 37, 1: rows replayed on the simulator said `device=cuda` in `config`; the
/// configuration recorded is the one replayed, the simulator's keys included, whatever
/// `device` the configuration given named.
#[test]
fn a_simulator_replay_records_device_sim() {
    let t = TempFile::new("sim-config.csv", workload(2, 1 << 20));
    let out = streamalloc(&[
        "replay",
        t.path(),
        "-a",
        "plain",
        "-c",
        "strategy=best_fit,device=cuda",
        "--device",
        "sim",
        "--json",
    ]);
    let rows = json_rows(&out);
    assert_eq!(rows.len(), 2);
    let sim = streamalloc::device::sim::SimConfig::h200();
    for row in &rows {
        let config = row["config"].as_str().unwrap();
        assert!(row["device"].as_str().unwrap().starts_with("simulator"), "{row}");
        assert!(config.contains("device=sim,") && !config.contains("device=cuda"), "{config}");
        assert!(config.contains(&format!("sim_capacity={},", sim.capacity)), "{config}");
        assert!(config.contains(&format!("sim_virtual_memory={}", sim.virtual_memory)), "{config}");
        let parsed = streamalloc::facade::Config::parse(config).expect("the recorded config parses");
        assert_eq!(parsed.device, streamalloc::facade::DeviceKind::Sim);
    }
}

/// Issue 37, 2: `info` with an invalid `STREAMALLOC_CONF` printed the error and exited 0;
/// it exits 1, after printing what it can.
#[test]
fn info_fails_on_an_invalid_streamalloc_conf() {
    let out = Command::new(env!("CARGO_BIN_EXE_streamalloc"))
        .arg("info")
        .env("STREAMALLOC_CONF", "colour=blue")
        .output()
        .unwrap();
    let (text, err) = (stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(1), "stdout: {text}\nstderr: {err}");
    assert!(text.contains("presets (replay --allocator NAME): plain"), "the rest is printed: {text}");
    assert!(text.contains("simulator") || text.contains("CUDA devices"), "{text}");
    assert!(err.starts_with("error: ") && err.contains("unknown key `colour`"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Asserts that `out` failed naming `path` as a pickle to convert with `import`, in plain
/// ASCII (no byte of the file reaches the terminal).
fn assert_suggests_import(out: &Output, path: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(out.stderr.iter().all(|b| b.is_ascii() && (*b >= 0x20 || *b == b'\n')), "raw bytes: {err:?}");
    assert!(err.contains("streamalloc import"), "{err}");
    assert!(err.contains(&format!("streamalloc import {path} -o TRACE.csv")), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Issue 37, 3: a PyTorch pickle given to `replay` printed its bytes and did not suggest
/// `import`; it is named a snapshot, and any binary file has `import` suggested, with no
/// byte of the file in the message.
#[test]
fn a_pickle_given_to_replay_suggests_import() {
    let real =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces/snapshots/mlp_train_side_stream.pickle");
    let real = real.to_str().unwrap();
    let mut fake = vec![0x80, 0x05, 0x95, 0x1b, 0x00, 0x00, 0x00, 0x07, b'}', 0x94, 0x0a, 0xff];
    fake.extend(std::iter::repeat_n(0x9b, 5000));
    let fake = TempFile::new("fake.pickle", fake);
    for path in [real, fake.path()] {
        let out = streamalloc(&["replay", path, "-a", "plain", "--device", "sim"]);
        assert_suggests_import(&out, path);
        assert!(stderr(&out).contains("looks like a PyTorch memory snapshot (a pickle)"), "{}", stderr(&out));
    }
    // Any other binary file (here a zip, as torch.save writes): not text, import suggested.
    let zip = TempFile::new("model.pt", b"PK\x03\x04\x14\x00\x00\x00\x08\x00\x1b\x9f\n\x00\xff\xfe rest");
    let out = streamalloc(&["replay", zip.path(), "-a", "plain", "--device", "sim"]);
    assert_suggests_import(&out, zip.path());
    assert!(stderr(&out).contains("not text"), "{}", stderr(&out));
}

/// Issue 37, 4: `async`'s out-of-memory hint named `throttle_ratio`; the key is `throttle`.
#[test]
fn the_async_out_of_memory_hint_names_the_throttle_key() {
    let trace = TempFile::new(
        "async-oom.csv",
        format!(
            "{HEADER}\n0,1,allocate,0x10,{big},0\n0,2,allocate,0x20,{big},0\n0,3,free,0x10,{big},0\n",
            big = 100usize << 30
        ),
    );
    let out = streamalloc(&[
        "replay",
        trace.path(),
        "-a",
        "async",
        "--device",
        "sim",
        "--json",
        "--passes",
        "1",
        "--expect-failures",
    ]);
    let rows = json_rows(&out);
    assert!(rows[0]["failures"].as_u64().unwrap() > 0, "{}", rows[0]);
    let failure = rows[0]["first_failure"].as_str().unwrap();
    assert!(failure.contains("throttle="), "{failure}");
    assert!(!failure.contains("throttle_ratio"), "{failure}");
}

/// One `<text>` element of an SVG plotters wrote.
#[derive(Debug)]
struct SvgText {
    x: f64,
    y: f64,
    size: f64,
    anchor: String,
    dy: String,
    text: String,
}

impl SvgText {
    /// An estimate of the box the text covers: 0.6 em per character (wider than the mean
    /// of a sans-serif font's digits and letters), one em high.
    fn bounds(&self) -> (f64, f64, f64, f64) {
        let width = self.text.chars().count() as f64 * 0.6 * self.size;
        let left = match self.anchor.as_str() {
            "end" => self.x - width,
            "middle" => self.x - width / 2.0,
            _ => self.x,
        };
        // `dy="0.76em"` puts the top of the text at y; otherwise y is about the baseline.
        let top = if self.dy == "0.76em" { self.y } else { self.y - 0.76 * self.size };
        (left, top, left + width, top + self.size)
    }
}

fn attribute(tag: &str, name: &str) -> Option<String> {
    let start = tag.find(&format!(" {name}=\""))? + name.len() + 3;
    let end = start + tag[start..].find('"')?;
    Some(tag[start..end].to_owned())
}

/// The `<text>` elements of `svg`, not rotated.
fn svg_texts(svg: &str) -> Vec<SvgText> {
    let mut texts = Vec::new();
    let mut rest = svg;
    while let Some(start) = rest.find("<text ") {
        rest = &rest[start..];
        let tag_end = rest.find('>').unwrap();
        let tag = &rest[..tag_end];
        let close = rest.find("</text>").unwrap();
        let text = rest[tag_end + 1..close].trim().to_owned();
        rest = &rest[close..];
        if tag.contains("transform=") {
            continue;
        }
        let number = |name| attribute(tag, name).and_then(|v| v.parse::<f64>().ok()).unwrap();
        texts.push(SvgText {
            x: number("x"),
            y: number("y"),
            size: number("font-size"),
            anchor: attribute(tag, "text-anchor").unwrap_or_default(),
            dy: attribute(tag, "dy").unwrap_or_default(),
            text,
        });
    }
    texts
}

/// Asserts that no two peak labels of `svg` overlap.
fn assert_peak_labels_apart(svg: &str) {
    let labels: Vec<SvgText> = svg_texts(svg).into_iter().filter(|t| t.text.starts_with("peak ")).collect();
    assert!(labels.len() >= 2, "{labels:?}");
    for (i, a) in labels.iter().enumerate() {
        for b in &labels[i + 1..] {
            let (a0, a1) = (a.bounds(), b.bounds());
            let apart = a0.2 <= a1.0 || a1.2 <= a0.0 || a0.3 <= a1.1 || a1.3 <= a0.1;
            assert!(apart, "peak labels overlap: {a:?} and {b:?}");
        }
    }
}

/// Issue 37, 5: side by side, each column had its own y-scale, and peak labels overlapped.
/// Every column of a row has the same y-axis (its top label and unit), and no two peak
/// labels' boxes intersect, in `plot` and in `replay --plot`.
#[test]
fn side_by_side_plots_share_a_y_scale_and_labels_do_not_overlap() {
    // The same trace name, twice the bytes the second time.
    let mut saved = Vec::new();
    for (name, scale) in [("small", 1usize << 20), ("large", 2 << 20)] {
        let t = TempFile::new("scaled.csv", workload(30, scale));
        let svg = TempFile::new(&format!("{name}-replay.svg"), "");
        let out = streamalloc(&[
            "replay",
            t.path(),
            "-a",
            "plain",
            "-a",
            "best_fit",
            "-a",
            "stream_safe",
            "--device",
            "sim",
            "--json",
            "--passes",
            "1",
            "--plot",
            svg.path(),
        ]);
        json_rows(&out);
        assert_peak_labels_apart(&std::fs::read_to_string(&svg.0).unwrap());
        saved.push(TempFile::new(&format!("{name}.json"), &out.stdout));
    }
    let side = TempFile::new("side.svg", "");
    let out = streamalloc(&["plot", saved[0].path(), saved[1].path(), "-o", side.path()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let svg = std::fs::read_to_string(&side.0).unwrap();
    assert_peak_labels_apart(&svg);

    // The y-axis labels are right-aligned numbers left of each chart; the panels are
    // 900 pixels wide.
    let texts = svg_texts(&svg);
    let top_label = |column: usize| {
        texts
            .iter()
            .filter(|t| t.anchor == "end" && (t.x / 900.0) as usize == column)
            .filter_map(|t| t.text.parse::<f64>().ok().map(|v| (v, t.text.clone())))
            .fold((f64::MIN, String::new()), |best, v| if v.0 > best.0 { v } else { best })
            .1
    };
    let (left, right) = (top_label(0), top_label(1));
    assert!(!left.is_empty(), "no y-axis labels found");
    assert_eq!(left, right, "each column of the row has its own y-scale");
    let units: Vec<&str> = svg.matches("bytes (").collect();
    assert_eq!(units.len(), 2);
    let unit_texts: Vec<&str> =
        svg.split("bytes (").skip(1).map(|rest| rest.split(')').next().unwrap()).collect();
    assert_eq!(unit_texts[0], unit_texts[1], "one unit per row");
}

/// The value of the `peak live` column of `table` in the row starting with `label`.
fn table_cell(table: &str, label: &str, column: &str) -> String {
    let mut lines = table.lines().skip_while(|l| !l.starts_with("configuration"));
    let header = lines.next().unwrap();
    let start = header.find(column).unwrap();
    let row = lines.find(|l| l.starts_with(label)).unwrap();
    // Right-aligned under the header: the cell ends where the header's name ends.
    let end = start + column.len();
    row[..end].rsplit("  ").next().unwrap().trim().to_owned()
}

/// Issue 37, 6: `record` printed raw byte counts where `replay` prints binary units; both
/// format bytes the same way.
#[test]
fn record_formats_bytes_as_replay_does() {
    let lib = Path::new(env!("CARGO_BIN_EXE_streamalloc")).with_file_name("libstreamalloc.so");
    assert!(lib.is_file(), "{} missing: run `cargo build -p streamalloc-capi` first", lib.display());
    let out_path = TempFile::new("record.csv", "");
    let script = format!(
        "import ctypes\nl = ctypes.CDLL({lib:?})\nl.streamalloc_malloc.restype = ctypes.c_void_p\n\
         ps = [l.streamalloc_malloc(ctypes.c_ssize_t(3 << (18 + i)), 0, None) for i in range(5)]\n\
         [l.streamalloc_free(ctypes.c_void_p(p), ctypes.c_ssize_t(0), 0, None) for p in ps]\n"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_streamalloc"))
        .args(["record", "-o", out_path.path(), "--", "python3", "-c", &script])
        .env("STREAMALLOC_CONF", "device=sim,strategy=stream_safe")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let recorded = stdout(&out);
    let replayed =
        streamalloc(&["replay", out_path.path(), "-a", "plain", "--device", "sim", "--passes", "1"]);
    assert!(replayed.status.success(), "{}", stderr(&replayed));
    let peak = table_cell(&stdout(&replayed), "plain", "peak live");
    assert_eq!(peak, "23.25 MiB", "{}", stdout(&replayed));
    assert!(recorded.contains(&format!("peak live {peak},")), "{recorded}");
}

/// Issue 37, 7: rows of `-a` came before rows of `--conf` whatever the order typed; they
/// keep the command line's order.
#[test]
fn rows_keep_the_command_line_order() {
    let t = TempFile::new("order.csv", workload(2, 1 << 20));
    let labels = |args: &[&str]| -> Vec<String> {
        let mut all = vec!["replay", t.path(), "--device", "sim", "--json", "--passes", "1"];
        all.extend_from_slice(args);
        json_rows(&streamalloc(&all)).iter().map(|r| r["allocator"].as_str().unwrap().to_owned()).collect()
    };
    assert_eq!(labels(&["-c", "strategy=best_fit", "-a", "plain"]), ["strategy=best_fit", "plain"]);
    assert_eq!(
        labels(&["-a", "async", "--conf", "strategy=plain", "--allocator", "best_fit", "-c=strategy=async"]),
        ["async", "strategy=plain", "best_fit", "strategy=async"]
    );
}

/// The note the simulator's rows carry.
const SIM_NOTE: &str = "ns/op on the simulator measure the library's CPU cost, not a GPU's";

/// Issue 37, 8: nothing said that the simulator's ns/op are not GPU figures; the table has
/// a line under it and each JSON row a field.
#[test]
fn simulator_timings_are_said_to_be_cpu_cost() {
    let t = TempFile::new("note.csv", workload(2, 1 << 20));
    let out = streamalloc(&["replay", t.path(), "-a", "plain", "--device", "sim", "--passes", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let table_end = text.lines().position(|l| l.starts_with("plain")).unwrap();
    assert!(text.lines().skip(table_end + 1).any(|l| l == SIM_NOTE), "{text}");

    let out = streamalloc(&["replay", t.path(), "-a", "plain", "--device", "sim", "--json", "--passes", "1"]);
    let rows = json_rows(&out);
    assert_eq!(rows[0]["ns_per_op_note"], SIM_NOTE, "{}", rows[0]);
}
