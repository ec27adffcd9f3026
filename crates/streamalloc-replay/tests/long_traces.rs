//! Issue 52, defect #17's last part: a replay held the whole trace in memory (10M rows took
//! 868 MB). Replayed from its file, what a replay holds is bounded by the allocations live
//! at once, not by the trace's length.

// A test: a failed unwrap or expect is the test failing (clippy.toml allows them in
// `#[test]` functions only, and this file's helpers are not).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use streamalloc::allocators::{Plain, StreamSafe, StreamSafeConfig};
use streamalloc::device::sim::{SimConfig, SimDevice};
use streamalloc::device::Stream;
use streamalloc::trace::HEADER;
use streamalloc_replay::compressed::{compress_file, Compression};
use streamalloc_replay::replay::{replay, replay_file, ReplayOptions, ReplayResult, ReplayTarget, CHUNK};
use streamalloc_replay::trace::{ParseOptions, Trace, TraceFile};

/// Allocations live between rows in [`write_trace`]'s traces (one more just after each
/// allocation).
const LIVE: u64 = 8;

/// Writes a trace of `rows` rows (allocations and frees, at most [`LIVE`] + 1 live at once, on
/// two streams, timed) into a new file, and returns its path.
fn write_trace(rows: u64, name: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("streamalloc-{}-{name}", std::process::id()));
    let mut out = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    writeln!(out, "{HEADER}").unwrap();
    let allocations = rows / 2;
    let mut written = 0;
    for i in 0..allocations + LIVE {
        if i < allocations {
            let size = 256 * (1 + i % 7);
            writeln!(out, "0,{i},allocate,{:#x},{size},{}", 0x1000 * (1 + i % (2 * LIVE)), i % 2).unwrap();
            written += 1;
        }
        if i >= LIVE && i - LIVE < allocations {
            let j = i - LIVE;
            writeln!(out, "0,{i},free,{:#x},0,{}", 0x1000 * (1 + j % (2 * LIVE)), j % 2).unwrap();
            written += 1;
        }
    }
    assert_eq!(written, 2 * allocations);
    out.flush().unwrap();
    path
}

/// A million rows replay holding at most one chunk of them and as many slots as allocations
/// live at once, where the whole trace used to be held (and a slot for each allocation).
#[test]
fn a_long_trace_replays_holding_what_is_live_not_the_whole_trace() {
    let rows = 1_000_000u64;
    let path = write_trace(rows, "long.csv");
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    let target = ReplayTarget::Single(Arc::new(Plain::new(sim.clone(), Stream::DEFAULT)));
    let options = ReplayOptions { passes: 1, ..Default::default() };
    let file = TraceFile::open_with(&path, ParseOptions::default()).unwrap();
    let r = replay_file(&file, "plain", &target, sim.as_ref(), &options).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!((r.ops, r.failures), (rows as usize, 0));
    assert!(r.ops_held <= CHUNK, "{} ops held at once", r.ops_held);
    assert_eq!(r.slots_held, LIVE as usize + 1, "slots held: those live at once");
    assert_eq!(file.summary().slots, LIVE as usize + 1);
    assert!(file.summary().ops.is_empty() && file.summary().times_us.is_empty());
}

/// The figures of `r` that do not depend on timing.
fn figures(r: &ReplayResult) -> ReplayResult {
    ReplayResult {
        ns_per_op_warm: 0.0,
        ns_per_op_passes: Vec::new(),
        ops_held: 0,
        slots_held: 0,
        ..r.clone()
    }
}

/// Replayed from its file, compressed or not, a trace gives the results of its replay in
/// memory: footprint, series, device calls and the first failure (slots reused or not).
#[test]
fn a_trace_replayed_from_its_file_gives_the_results_of_the_whole_trace() {
    let plain = write_trace(40_000, "same.csv");
    for (suffix, compression) in
        [("", Compression::None), (".gz", Compression::Gzip), (".xz", Compression::Xz)]
    {
        let path = PathBuf::from(format!("{}{suffix}", plain.display()));
        if compression != Compression::None {
            compress_file(&plain, &path, compression).unwrap();
        }
        // Small enough that some allocations fail: the first failure is the same op.
        for capacity in [1 << 30, 8 << 10] {
            let run = |whole: bool| {
                let sim = SimDevice::new(SimConfig::with_capacity(capacity));
                let target = ReplayTarget::Single(Arc::new(Plain::new(sim.clone(), Stream::DEFAULT)));
                let options = ReplayOptions { passes: 2, series_points: 64, ..Default::default() };
                if whole {
                    replay(&Trace::from_path(&path).unwrap(), "plain", &target, sim.as_ref(), &options)
                } else {
                    let file = TraceFile::open_with(&path, ParseOptions::default()).unwrap();
                    replay_file(&file, "plain", &target, sim.as_ref(), &options)
                }
                .unwrap()
            };
            let (whole, file) = (run(true), run(false));
            assert_eq!(figures(&file), figures(&whole), "{suffix} on {capacity} bytes");
            assert_eq!(whole.failures > 0, capacity < 1 << 20, "{suffix} on {capacity} bytes");
            assert_eq!((whole.slots_held, file.slots_held), (20_000, LIVE as usize + 1));
        }
        if compression != Compression::None {
            let _ = std::fs::remove_file(&path);
        }
    }
    let _ = std::fs::remove_file(&plain);
}

/// With stream rows and the trace's time replayed on the simulator, a trace replayed from its
/// file gives the results of the whole trace too (violations included), slots reused.
#[test]
fn stream_rows_and_time_replay_from_the_file_as_from_memory() {
    let path = std::env::temp_dir().join(format!("streamalloc-{}-streams.csv", std::process::id()));
    let mut out = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    writeln!(out, "{HEADER}").unwrap();
    // Each step allocates on stream 0, a side stream 7 uses and records it, stream 0 waits for
    // the side stream every 4th step, and the allocation of 3 steps before is freed.
    for i in 0..3000u64 {
        let (t, ptr) = (10 * i, 0x10_0000 * (1 + i % 8));
        writeln!(out, "0,{t},allocate,{ptr:#x},{},0", 1 << (12 + i % 5)).unwrap();
        writeln!(out, "0,{},use,{ptr:#x},{},7", t + 1, 5000 + 1000 * (i % 7)).unwrap();
        writeln!(out, "0,{},record_stream,{ptr:#x},0,7", t + 2).unwrap();
        if i % 4 == 0 {
            writeln!(out, "0,{},wait,0x7,0,0", t + 3).unwrap();
        }
        if i >= 3 {
            writeln!(out, "0,{},free,{:#x},0,0", t + 4, 0x10_0000 * (1 + (i - 3) % 8)).unwrap();
        }
    }
    out.flush().unwrap();
    drop(out);
    let run = |whole: bool| {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let target = ReplayTarget::Streams(Arc::new(
            StreamSafe::new(sim.clone(), StreamSafeConfig::default()).unwrap(),
        ));
        let options = ReplayOptions { passes: 2, time: Some(sim.as_ref()), ..Default::default() };
        if whole {
            replay(&Trace::from_path(&path).unwrap(), "stream_safe", &target, sim.as_ref(), &options)
        } else {
            let file = TraceFile::open_with(&path, ParseOptions::default()).unwrap();
            assert!(file.summary().has_stream_work());
            replay_file(&file, "stream_safe", &target, sim.as_ref(), &options)
        }
        .unwrap()
    };
    let (whole, file) = (run(true), run(false));
    let _ = std::fs::remove_file(&path);
    assert!(whole.time && whole.failures == 0);
    assert_eq!(figures(&file), figures(&whole));
    assert_eq!((whole.slots_held, file.slots_held), (3000, 4));
}
