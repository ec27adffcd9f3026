//! `streamalloc import`: a PyTorch memory snapshot into a trace `replay` takes.
//!
//! `torch.cuda.memory._dump_snapshot(path)` pickles a dict whose `device_traces` holds, per
//! device, the entries `torch.cuda.memory._record_memory_history()` recorded, oldest first:
//! dicts with `action` (`alloc`, `free_requested`, `free_completed`, `segment_alloc`,
//! `segment_free`, `segment_map`, `segment_unmap`, `oom`, `snapshot`), `addr`, `size`,
//! `stream` and, in recent versions, `time_us`. Every other field (`frames`, `segments`,
//! ...) is ignored.
//!
//! `alloc` becomes an `allocate` row; `free_requested` (the moment the program released the
//! tensor) becomes a `free` row, or `free_completed` when no request was recorded for a
//! live block. A free of a block allocated before recording began (the history's ring
//! buffer dropped its allocation) is skipped and counted; blocks still allocated at the
//! dump stay live in the trace. Streams keep their values; the thread is 0 (snapshots do
//! not record threads); without `time_us` the time is the entry's index.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use serde::Deserialize;
use streamalloc::trace::{Action, Record, TraceWriter};

/// The parts of a snapshot the import reads.
#[derive(Deserialize)]
struct Snapshot {
    #[serde(default)]
    device_traces: Option<Vec<Vec<Entry>>>,
}

/// One trace entry; absent fields are `None`.
#[derive(Deserialize)]
struct Entry {
    action: String,
    #[serde(default)]
    addr: Option<i64>,
    #[serde(default)]
    size: Option<i64>,
    #[serde(default)]
    stream: Option<i64>,
    #[serde(default)]
    time_us: Option<i64>,
}

/// What an import wrote and skipped.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// The snapshot's device whose entries were converted.
    pub device: usize,
    /// `allocate` rows.
    pub allocations: usize,
    /// `free` rows.
    pub frees: usize,
    /// Distinct streams.
    pub streams: usize,
    /// Allocations not freed by the end of the recording.
    pub live_at_end: usize,
    /// Frees of blocks allocated before recording began, skipped.
    pub unknown_frees: usize,
    /// Allocations at the address of a block still live: the block's free was not recorded,
    /// so one is written first.
    pub missed_frees: usize,
    /// Entries without `time_us`.
    pub untimed: usize,
}

/// Converts the snapshot at `input` into a trace at `output`; `device` picks the snapshot's
/// device (default: the only one with entries).
pub fn import(input: &Path, output: &Path, device: Option<usize>) -> Result<Summary, String> {
    let file = File::open(input).map_err(|e| format!("{}: {e}", input.display()))?;
    // Real snapshots (torch 2.11) refer back to objects still being built through the pickle
    // memo, which serde-pickle refuses by default; those references (none in the fields read
    // here) become None.
    let options = serde_pickle::DeOptions::new().replace_unresolved_globals().replace_recursive_structures();
    let snapshot: Snapshot = serde_pickle::from_reader(BufReader::new(file), options).map_err(|e| {
        format!(
            "{}: not a PyTorch memory snapshot (the pickle torch.cuda.memory._dump_snapshot writes): {e}",
            input.display()
        )
    })?;
    let traces = snapshot.device_traces.ok_or_else(|| {
        format!(
            "{}: the snapshot has no `device_traces`: record with \
             torch.cuda.memory._record_memory_history() before the workload runs",
            input.display()
        )
    })?;
    let used: Vec<usize> =
        (0..traces.len()).filter(|d| traces[*d].iter().any(|e| e.action == "alloc")).collect();
    let device = match (device, used.as_slice()) {
        (Some(d), _) if d < traces.len() => d,
        (Some(d), _) => {
            return Err(format!("{}: --gpu {d}: the snapshot has {} devices", input.display(), traces.len()))
        }
        (None, [d]) => *d,
        (None, []) => return Err(format!("{}: the snapshot recorded no allocation", input.display())),
        (None, _) => {
            let list: Vec<String> = used.iter().map(ToString::to_string).collect();
            return Err(format!(
                "{}: the snapshot has allocations on devices {}: choose one with --gpu",
                input.display(),
                list.join(", ")
            ));
        }
    };
    let mut writer = TraceWriter::create(output).map_err(|e| e.to_string())?;
    let summary = convert(&traces[device], device, |r| writer.write(r).map_err(|e| e.to_string()))?;
    writer.finish().map_err(|e| e.to_string())?;
    Ok(summary)
}

/// Converts `entries` (one device's), passing each row to `write`.
fn convert(
    entries: &[Entry],
    device: usize,
    mut write: impl FnMut(&Record) -> Result<(), String>,
) -> Result<Summary, String> {
    let mut summary = Summary { device, ..Summary::default() };
    // Live block address -> (size, whether its free was requested).
    let mut live: HashMap<u64, (usize, bool)> = HashMap::new();
    let mut streams: Vec<u64> = Vec::new();
    for (index, e) in entries.iter().enumerate() {
        let action = match e.action.as_str() {
            "alloc" => Action::Allocate,
            "free_requested" | "free_completed" => Action::Free,
            _ => continue,
        };
        let field = |value: Option<i64>, name: &str| {
            value.ok_or_else(|| format!("entry {index} (`{}`) has no `{name}`", e.action))
        };
        let ptr = field(e.addr, "addr")? as u64;
        let stream = e.stream.unwrap_or(0) as u64;
        let time_us = match e.time_us {
            Some(t) => t as u64,
            None => {
                summary.untimed += 1;
                index as u64
            }
        };
        let mut record = Record { thread: 0, time_us, action, ptr, size: 0, stream };
        match action {
            Action::Allocate => {
                let size = usize::try_from(field(e.size, "size")?)
                    .map_err(|_| format!("entry {index} (`alloc`) has a negative size"))?;
                if let Some((old, _)) = live.remove(&ptr) {
                    summary.missed_frees += 1;
                    summary.frees += 1;
                    write(&Record { action: Action::Free, size: old, ..record })?;
                }
                live.insert(ptr, (size, false));
                if !streams.contains(&stream) {
                    streams.push(stream);
                }
                summary.allocations += 1;
                record.size = size;
                write(&record)?;
            }
            _ => match live.get_mut(&ptr) {
                // A request, or a completion with no request recorded: the free.
                Some((size, requested)) if !*requested => {
                    record.size = *size;
                    if e.action == "free_requested" {
                        *requested = true;
                    } else {
                        live.remove(&ptr);
                    }
                    summary.frees += 1;
                    write(&record)?;
                }
                // The completion of a recorded request.
                Some(_) => {
                    live.remove(&ptr);
                }
                None if e.action == "free_requested" => summary.unknown_frees += 1,
                None => {}
            },
        }
    }
    summary.streams = streams.len();
    summary.live_at_end = live.values().filter(|(_, requested)| !requested).count();
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(action: &str, addr: i64, size: i64) -> Entry {
        Entry { action: action.into(), addr: Some(addr), size: Some(size), stream: Some(0), time_us: None }
    }

    fn rows(entries: &[Entry]) -> (Summary, Vec<Record>) {
        let mut out = Vec::new();
        let summary = convert(entries, 0, |r| {
            out.push(*r);
            Ok(())
        })
        .unwrap();
        (summary, out)
    }

    #[test]
    fn requests_are_the_frees_and_completions_only_close_them() {
        let (s, out) = rows(&[
            entry("free_requested", 0x10, 4), // allocated before recording began
            entry("free_completed", 0x10, 4),
            entry("segment_alloc", 0x100, 1024),
            entry("alloc", 0x100, 8),
            entry("free_requested", 0x100, 8),
            entry("alloc", 0x200, 16),
            entry("free_completed", 0x100, 8),
            entry("alloc", 0x100, 32),
            entry("free_completed", 0x200, 16), // completion without a recorded request
            entry("alloc", 0x300, 64),          // live at the end
            entry("alloc", 0x300, 64),          // its free was not recorded
        ]);
        let actions: Vec<(Action, u64, usize)> = out.iter().map(|r| (r.action, r.ptr, r.size)).collect();
        assert_eq!(
            actions,
            [
                (Action::Allocate, 0x100, 8),
                (Action::Free, 0x100, 8),
                (Action::Allocate, 0x200, 16),
                (Action::Allocate, 0x100, 32),
                (Action::Free, 0x200, 16),
                (Action::Allocate, 0x300, 64),
                (Action::Free, 0x300, 64),
                (Action::Allocate, 0x300, 64),
            ]
        );
        assert_eq!((s.allocations, s.frees, s.unknown_frees, s.missed_frees), (5, 3, 1, 1));
        assert_eq!((s.live_at_end, s.untimed, s.streams), (2, 10, 1), "the segment entry is not counted");
        assert_eq!(out[0].time_us, 3, "untimed entries are timed by their index");
    }

    #[test]
    fn an_alloc_without_an_address_is_an_error_naming_the_entry() {
        let mut e = entry("alloc", 0, 8);
        e.addr = None;
        let err = convert(&[entry("snapshot", 0, 0), e], 0, |_| Ok(())).unwrap_err();
        assert_eq!(err, "entry 1 (`alloc`) has no `addr`");
    }
}
