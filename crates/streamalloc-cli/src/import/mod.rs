//! `streamalloc import`: a PyTorch memory snapshot into a trace `replay` takes.
//!
//! `torch.cuda.memory._dump_snapshot(path)` pickles a dict whose `device_traces` holds, per
//! device, the entries `torch.cuda.memory._record_memory_history()` recorded, oldest first:
//! dicts with `action` (`alloc`, `free_requested`, `free_completed`, `segment_alloc`,
//! `segment_free`, `segment_map`, `segment_unmap`, `oom`, `snapshot`), `addr`, `size`,
//! `stream` and, in recent versions, `time_us`. Every other field (`frames`, `segments`,
//! ...) is passed over: the pickle is read as a stream ([`pickle`]), keeping of each entry
//! its action and those four integers, so that a snapshot of a gigabyte is read in a small
//! part of that memory.
//!
//! `alloc` becomes an `allocate` row; `free_requested` (the moment the program released the
//! tensor) becomes a `free` row, or `free_completed` when no request was recorded for a
//! live block. A free of a block allocated before recording began (the history's ring
//! buffer dropped its allocation) is skipped and counted; blocks still allocated at the
//! dump stay live in the trace. Streams keep their values; the thread is 0 (snapshots do
//! not record threads); without `time_us` the time is the entry's index.
//!
//! A request whose completion is recorded later, not as the next entry, is a free that
//! waited for work on other streams (the block was `record_stream`ed there): at the
//! request's time, a `record_stream` of the block on [`OTHER_STREAMS`] and a `use` on it
//! lasting until the completion's time come before the `free`. A snapshot does not say which
//! streams used the block (torch records the stream of the free only), hence the one stream
//! that stands for them all. A request whose completion was not recorded (pending at the
//! dump: the program had freed the block, the allocator still held it for another stream's
//! work) is written so too, its `use` lasting until the last entry's time, the latest moment
//! the snapshot knows the block was held (a replay that freed it at the request would reuse
//! memory the GPU could not). Without `time_us`, the free is written alone.

mod pickle;

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet};
use std::fs::File;
use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use streamalloc::trace::{Action, Record, TraceWriter};
use streamalloc_replay::compressed::{Compression, Writer};

use pickle::{Entry, Word};

/// The stream of the `record_stream` and `use` rows of a free that waited for work on other
/// streams: it stands for those streams, which a snapshot does not name. Its value (written
/// 18446744073709551615; -1 as torch's signed integers) is no stream handle; a snapshot
/// that records it as a stream is refused when such a free is to be written. The waits of
/// frees that overlap in time take the values below it, one each (`OTHER_STREAMS - 1`, ...),
/// as many as overlap at most: on one stream, their `use` rows would run one after another
/// and hold the blocks longer than the snapshot says.
pub const OTHER_STREAMS: u64 = u64::MAX;

/// What an import wrote and skipped.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// The snapshot's device whose entries were converted.
    pub device: usize,
    /// `allocate` rows.
    pub allocations: usize,
    /// `free` rows.
    pub frees: usize,
    /// Distinct streams of the allocations.
    pub streams: usize,
    /// Allocations not freed by the end of the recording.
    pub live_at_end: usize,
    /// Frees of blocks allocated before recording began, skipped.
    pub unknown_frees: usize,
    /// Allocations at the address of a block still live: the block's free was not recorded,
    /// so one is written first.
    pub missed_frees: usize,
    /// Frees that waited for work on other streams: each has a `record_stream` and a `use`
    /// row on [`OTHER_STREAMS`] before it.
    pub deferred_frees: usize,
    /// Entries without `time_us`.
    pub untimed: usize,
}

/// Converts the snapshot at `input` into a trace at `output`; `device` picks the snapshot's
/// device (default: the only one with allocations). With `progress`, a bar on stderr shows
/// the bytes read. The output is written once the whole snapshot has been read (compressed
/// when its name ends in `.gz` or `.xz`), into a new
/// file that replaces `output` when the import succeeds: a failed import leaves it as it was.
pub fn import(input: &Path, output: &Path, device: Option<usize>, progress: bool) -> Result<Summary, String> {
    let compression = Compression::of_name(output);
    crate::output::write_whole(output, "the trace", |path| {
        import_into(input, path, compression, device, progress)
    })
}

/// [`import`], into the new file at `output`, written with `compression`.
fn import_into(
    input: &Path,
    output: &Path,
    compression: Compression,
    device: Option<usize>,
    progress: bool,
) -> Result<Summary, String> {
    let file = File::open(input).map_err(|e| format!("{}: {e}", input.display()))?;
    let bar = if progress {
        let size = file.metadata().map_err(|e| format!("{}: {e}", input.display()))?.len();
        ProgressBar::new(size)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("reading {msg} [{bar:40}] {bytes}/{total_bytes} {eta}")
            .map_err(|e| e.to_string())?
            .progress_chars("=> "),
    );
    bar.set_message(input.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default());
    let read = pickle::read_snapshot(file, &mut |n| bar.inc(n));
    bar.finish_and_clear();
    let snapshot = read.map_err(|e| {
        format!(
            "{}: not a PyTorch memory snapshot (the pickle torch.cuda.memory._dump_snapshot writes): {e}",
            input.display()
        )
    })?;
    let snapshot = snapshot.ok_or_else(|| {
        format!(
            "{}: the snapshot has no `device_traces`: record with \
             torch.cuda.memory._record_memory_history() before the workload runs",
            input.display()
        )
    })?;
    let devices = snapshot.devices();
    let used: Vec<usize> = snapshot.allocating().collect();
    let device = match (device, used.as_slice()) {
        (Some(d), _) if d < devices => d,
        (Some(d), _) => {
            return Err(format!("{}: --gpu {d}: the snapshot has {devices} devices", input.display()))
        }
        (None, [d]) => *d,
        (None, []) => return Err(format!("{}: the snapshot recorded no allocation", input.display())),
        (None, _) => {
            const SHOWN: usize = 8;
            let mut list: Vec<String> = used.iter().take(SHOWN).map(ToString::to_string).collect();
            if used.len() > SHOWN {
                list.push(format!("... ({} in all)", used.len()));
            }
            return Err(format!(
                "{}: the snapshot has allocations on devices {}: choose one with --gpu",
                input.display(),
                list.join(", ")
            ));
        }
    };
    let written = |e: std::io::Error| format!("writing the trace: {e}");
    let file = Writer::create(output, compression).map_err(written)?;
    let mut writer = TraceWriter::new(file).map_err(|e| e.to_string())?;
    let summary = convert(snapshot.entries(device), device, |r| writer.write(r).map_err(|e| e.to_string()))?;
    writer.finish().map_err(|e| e.to_string())?.finish().map_err(written)?;
    Ok(summary)
}

/// The free requests (by index) whose completion is recorded later, not as the next entry,
/// with the completion's time; only those where both have a time. A request still pending
/// at the dump completes, as far as the snapshot knows, no sooner than its last entry: it
/// gets that entry's time (when that is later than its own).
fn deferred_completions(entries: impl Iterator<Item = Entry>) -> Result<HashMap<usize, i64>, String> {
    let mut requests: HashMap<i64, (usize, Option<i64>)> = HashMap::new();
    let mut completions = HashMap::new();
    let mut last = None;
    for (index, e) in entries.enumerate() {
        if let Some(t) = e.time_us {
            checked_time(t, index, e.action)?;
        }
        last = e.time_us.or(last);
        let Some(addr) = e.addr else { continue };
        match e.action {
            Word::FreeRequested => {
                requests.insert(addr, (index, e.time_us));
            }
            Word::FreeCompleted => {
                if let (Some((request, Some(_))), Some(done)) = (requests.remove(&addr), e.time_us) {
                    if index > request + 1 {
                        completions.insert(request, done);
                    }
                }
            }
            _ => {}
        }
    }
    if let Some(last) = last {
        let pending = requests.into_values().filter_map(|(request, time)| Some((request, time?)));
        completions.extend(pending.filter(|&(_, time)| time < last).map(|(request, _)| (request, last)));
    }
    Ok(completions)
}

/// The latest `time_us` an import writes: its nanoseconds (the durations of `use` rows, a
/// replay's clock) fit an `i64`.
pub const MAX_TIME_US: u64 = i64::MAX as u64 / 1000;

/// `time_us` of entry `index` (of `action`), checked: from 0 to [`MAX_TIME_US`].
fn checked_time(time_us: i64, index: usize, action: Word) -> Result<u64, String> {
    let name = action.text();
    match u64::try_from(time_us) {
        Err(_) => Err(format!("entry {index} (`{name}`) has a negative `time_us` ({time_us})")),
        Ok(t) if t > MAX_TIME_US => Err(format!(
            "entry {index} (`{name}`): `time_us` {t} is beyond {MAX_TIME_US} (microseconds, about 292 years)"
        )),
        Ok(t) => Ok(t),
    }
}

/// The stand-in streams of the other streams (lane `k` is stream `OTHER_STREAMS - k`): which
/// are busy with a wait, until when, and which are idle.
#[derive(Default)]
struct Lanes {
    /// (end of its wait, lane) of each busy lane, soonest first.
    busy: BinaryHeap<Reverse<(u64, usize)>>,
    /// Lanes whose wait has ended.
    idle: BTreeSet<usize>,
    count: usize,
}

impl Lanes {
    /// The lowest lane idle at `now` (a new one if none is), busy until `until` from then.
    fn take(&mut self, now: u64, until: u64) -> usize {
        while let Some(&Reverse((end, lane))) = self.busy.peek() {
            if end > now {
                break;
            }
            self.busy.pop();
            self.idle.insert(lane);
        }
        let lane = self.idle.pop_first().unwrap_or_else(|| {
            self.count += 1;
            self.count - 1
        });
        self.busy.push(Reverse((until, lane)));
        lane
    }
}

/// Converts `entries` (one device's), passing each row to `write`.
fn convert(
    entries: impl Iterator<Item = Entry> + Clone,
    device: usize,
    mut write: impl FnMut(&Record) -> Result<(), String>,
) -> Result<Summary, String> {
    let completions = deferred_completions(entries.clone())?;
    let mut summary = Summary { device, ..Summary::default() };
    // Live block address -> (size, whether its free was requested).
    let mut live: HashMap<u64, (usize, bool)> = HashMap::new();
    let mut streams: HashSet<u64> = HashSet::new();
    let mut lanes = Lanes::default();
    for (index, e) in entries.enumerate() {
        let action = match e.action {
            Word::Alloc => Action::Allocate,
            Word::FreeRequested | Word::FreeCompleted => Action::Free,
            _ => continue,
        };
        let name = e.action.text();
        let field = |value: Option<i64>, field: &str| {
            value.ok_or_else(|| format!("entry {index} (`{name}`) has no `{field}`"))
        };
        let ptr = field(e.addr, "addr")? as u64;
        let stream = e.stream.unwrap_or(0) as u64;
        if stream > OTHER_STREAMS - completions.len() as u64 && !completions.is_empty() {
            return Err(format!(
                "entry {index} (`{name}`) is on stream {}, one of those the import writes for the other \
                 streams a free waited for",
                stream as i64
            ));
        }
        let time_us = match e.time_us {
            Some(t) => checked_time(t, index, e.action)?,
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
                // A block whose free was requested (and written) may be reused before its
                // completion is recorded; one whose free was not recorded is freed first.
                if let Some((old, false)) = live.remove(&ptr) {
                    summary.missed_frees += 1;
                    summary.frees += 1;
                    write(&Record { action: Action::Free, size: old, ..record })?;
                }
                live.insert(ptr, (size, false));
                streams.insert(stream);
                summary.allocations += 1;
                record.size = size;
                write(&record)?;
            }
            _ => match live.get_mut(&ptr) {
                // A request, or a completion with no request recorded: the free.
                Some((size, requested)) if !*requested => {
                    record.size = *size;
                    if e.action == Word::FreeRequested {
                        *requested = true;
                        if let Some(&done) = completions.get(&index) {
                            let done = done as u64;
                            let lane = lanes.take(time_us, done);
                            let other = Record { stream: OTHER_STREAMS - lane as u64, size: 0, ..record };
                            write(&Record { action: Action::RecordStream, ..other })?;
                            let ns = done.saturating_sub(time_us).saturating_mul(1000);
                            let ns = usize::try_from(ns).unwrap_or(usize::MAX);
                            write(&Record { action: Action::Use, size: ns, ..other })?;
                            summary.deferred_frees += 1;
                        }
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
                None if e.action == Word::FreeRequested => summary.unknown_frees += 1,
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

    fn entry(action: Word, addr: i64, size: i64) -> Entry {
        Entry { action, addr: Some(addr), size: Some(size), stream: Some(0), time_us: None }
    }

    fn timed(action: Word, addr: i64, size: i64, stream: i64, time_us: i64) -> Entry {
        Entry { action, addr: Some(addr), size: Some(size), stream: Some(stream), time_us: Some(time_us) }
    }

    fn rows(entries: &[Entry]) -> (Summary, Vec<Record>) {
        let mut out = Vec::new();
        let summary = convert(entries.iter().copied(), 0, |r| {
            out.push(*r);
            Ok(())
        })
        .unwrap();
        (summary, out)
    }

    use Word::{Alloc, FreeCompleted, FreeRequested};

    #[test]
    fn requests_are_the_frees_and_completions_only_close_them() {
        let (s, out) = rows(&[
            entry(FreeRequested, 0x10, 4), // allocated before recording began
            entry(FreeCompleted, 0x10, 4),
            entry(Word::Other, 0x100, 1024), // segment_alloc
            entry(Alloc, 0x100, 8),
            entry(FreeRequested, 0x100, 8),
            entry(Alloc, 0x200, 16),
            entry(FreeCompleted, 0x100, 8),
            entry(Alloc, 0x100, 32),
            entry(FreeCompleted, 0x200, 16), // completion without a recorded request
            entry(Alloc, 0x300, 64),         // live at the end
            entry(Alloc, 0x300, 64),         // its free was not recorded
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
        assert_eq!(s.deferred_frees, 0, "untimed: no stream rows");
    }

    #[test]
    fn an_alloc_without_an_address_is_an_error_naming_the_entry() {
        let mut e = entry(Alloc, 0, 8);
        e.addr = None;
        let err = convert([entry(Word::Other, 0, 0), e].into_iter(), 0, |_| Ok(())).unwrap_err();
        assert_eq!(err, "entry 1 (`alloc`) has no `addr`");
    }

    /// A block whose free was requested (and written) and whose address an allocation
    /// reuses before the completion is recorded: its free is not written twice.
    #[test]
    fn a_requested_free_is_not_written_again_when_the_address_is_reused() {
        let (s, out) =
            rows(&[entry(Alloc, 0x100, 8), entry(FreeRequested, 0x100, 8), entry(Alloc, 0x100, 8)]);
        let actions: Vec<Action> = out.iter().map(|r| r.action).collect();
        assert_eq!(actions, [Action::Allocate, Action::Free, Action::Allocate]);
        assert_eq!((s.frees, s.missed_frees), (1, 0));
    }

    /// Issue 37: a free whose completion comes later (it waited for another stream's work)
    /// is a `record_stream` on the other streams' stand-in and a `use` there until the
    /// completion, then the free on its own stream; a completion that is the next entry is a
    /// plain free, and so is a request never completed.
    #[test]
    fn a_free_that_waited_for_other_streams_is_record_stream_use_then_free() {
        let side = 7;
        let (s, out) = rows(&[
            timed(Alloc, 0x100, 8, side, 10),
            timed(Alloc, 0x200, 16, 0, 11),
            timed(FreeRequested, 0x100, 8, side, 12),
            timed(FreeRequested, 0x200, 16, 0, 13),
            timed(FreeCompleted, 0x200, 16, 0, 13),
            timed(Alloc, 0x300, 32, 0, 20),
            timed(FreeCompleted, 0x100, 8, side, 45),
            timed(FreeRequested, 0x300, 32, 0, 50), // pending at the dump
        ]);
        let written: Vec<(u64, Action, u64, usize, u64)> =
            out.iter().map(|r| (r.time_us, r.action, r.ptr, r.size, r.stream)).collect();
        assert_eq!(
            written,
            [
                (10, Action::Allocate, 0x100, 8, side as u64),
                (11, Action::Allocate, 0x200, 16, 0),
                (12, Action::RecordStream, 0x100, 0, OTHER_STREAMS),
                (12, Action::Use, 0x100, 33_000, OTHER_STREAMS),
                (12, Action::Free, 0x100, 8, side as u64),
                (13, Action::Free, 0x200, 16, 0),
                (20, Action::Allocate, 0x300, 32, 0),
                (50, Action::Free, 0x300, 32, 0),
            ]
        );
        assert_eq!((s.allocations, s.frees, s.deferred_frees, s.streams), (3, 3, 1, 2));

        // Untimed: today's rows.
        let untimed: Vec<Entry> = [
            entry(Alloc, 0x100, 8),
            entry(FreeRequested, 0x100, 8),
            entry(Alloc, 0x200, 8),
            entry(FreeCompleted, 0x100, 8),
        ]
        .into();
        let (s, out) = rows(&untimed);
        assert_eq!(
            out.iter().map(|r| r.action).collect::<Vec<_>>(),
            [Action::Allocate, Action::Free, Action::Allocate]
        );
        assert_eq!(s.deferred_frees, 0);

        // A snapshot on stream -1 cannot have it stand for the other streams.
        let clash = [
            timed(Alloc, 0x100, 8, -1, 1),
            timed(FreeRequested, 0x100, 8, -1, 2),
            timed(Alloc, 0x200, 8, -1, 3),
            timed(FreeCompleted, 0x100, 8, -1, 4),
        ];
        let err = convert(clash.into_iter(), 0, |_| Ok(())).unwrap_err();
        assert!(err.contains("entry 0 (`alloc`) is on stream -1, one of those the import writes"), "{err}");
    }

    /// A free still pending at the dump (requested, never completed) held its block, as far
    /// as the snapshot knows, until the last entry: its wait lasts until then. Written as a
    /// plain free, a replay would hand the block out again while the GPU still held it.
    #[test]
    fn a_free_pending_at_the_dump_waits_until_the_last_entry() {
        let (s, out) = rows(&[
            timed(Alloc, 0x100, 8, 0, 10),
            timed(FreeRequested, 0x100, 8, 0, 12),
            timed(Alloc, 0x200, 16, 0, 30),
        ]);
        let written: Vec<(u64, Action, u64, usize, u64)> =
            out.iter().map(|r| (r.time_us, r.action, r.ptr, r.size, r.stream)).collect();
        assert_eq!(
            written,
            [
                (10, Action::Allocate, 0x100, 8, 0),
                (12, Action::RecordStream, 0x100, 0, OTHER_STREAMS),
                (12, Action::Use, 0x100, 18_000, OTHER_STREAMS),
                (12, Action::Free, 0x100, 8, 0),
                (30, Action::Allocate, 0x200, 16, 0),
            ]
        );
        assert_eq!((s.frees, s.deferred_frees, s.live_at_end), (1, 1, 1));
    }

    /// Waits that overlap in time go on stand-ins of their own (on one stream the second
    /// would start when the first ends, and hold its block longer than the snapshot says); a
    /// stand-in whose wait has ended is used again.
    #[test]
    fn overlapping_waits_take_a_stand_in_each() {
        let (_, out) = rows(&[
            timed(Alloc, 0x100, 8, 0, 1),
            timed(Alloc, 0x200, 8, 0, 2),
            timed(Alloc, 0x300, 8, 0, 3),
            timed(FreeRequested, 0x100, 8, 0, 10),
            timed(FreeRequested, 0x200, 8, 0, 11),
            timed(FreeCompleted, 0x100, 8, 0, 20),
            timed(FreeRequested, 0x300, 8, 0, 21),
            timed(FreeCompleted, 0x200, 8, 0, 30),
            timed(FreeCompleted, 0x300, 8, 0, 40),
        ]);
        let waits: Vec<(u64, u64, usize, u64)> = out
            .iter()
            .filter(|r| r.action == Action::Use)
            .map(|r| (r.time_us, r.ptr, r.size, r.stream))
            .collect();
        assert_eq!(
            waits,
            [
                (10, 0x100, 10_000, OTHER_STREAMS),
                (11, 0x200, 19_000, OTHER_STREAMS - 1),
                (21, 0x300, 19_000, OTHER_STREAMS),
            ]
        );
    }

    /// Issue 52 #17: the import was quadratic in frees whose waits overlap (each looked for
    /// a free stand-in among all) and in distinct streams (each looked up among all): 100k
    /// took 1.6 s in a release build. 200k of each, in a debug build, take well under 10 s.
    #[test]
    fn overlapping_waits_and_distinct_streams_are_not_quadratic() {
        let n = 200_000i64;
        let waits = (0..n)
            .map(|i| timed(Alloc, 0x1000 * (i + 1), 8, 0, i))
            .chain((0..n).map(|i| timed(FreeRequested, 0x1000 * (i + 1), 8, 0, n + i)))
            .chain((0..n).map(|i| timed(FreeCompleted, 0x1000 * (i + 1), 8, 0, 3 * n + i)));
        let streams = (0..n).map(|i| timed(Alloc, 0x1000 * (i + 1), 8, i + 1, i));
        for (what, entries) in [("waits", waits.collect::<Vec<_>>()), ("streams", streams.collect())] {
            let start = std::time::Instant::now();
            let mut rows = 0;
            let s = convert(entries.into_iter(), 0, |_| {
                rows += 1;
                Ok(())
            })
            .unwrap();
            let took = start.elapsed();
            assert!(rows >= n as usize && s.allocations == n as usize, "{what}: {rows} rows");
            assert!(took.as_secs() < 10, "{what}: {took:?} for {n}");
        }
    }
}
