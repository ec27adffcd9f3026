//! Allocation traces in RMM's logging CSV format: reading them into the operations a replay
//! runs.
//!
//! The format (see `DESIGN.md`, `traces/README.md` and `streamalloc::trace`, which gives
//! each column's meaning per action) is a header line `Thread,Time,Action,Pointer,Size,Stream`
//! followed by one row per event, `Action` being RMM's `allocate`, `free` or
//! `allocate failure`, or one of the stream rows: `record_stream` (Pointer: a live
//! allocation; Stream: the stream recorded on it), `use` (Stream runs work that uses the
//! allocation at Pointer from Time for Size nanoseconds) and `wait` (Stream waits for the
//! work enqueued so far on the stream whose handle is Pointer). [`Trace::parse`] turns such a
//! file into a list of [`Op`]s in which recorded pointers become dense *slot* indices and
//! recorded stream values (of the Stream column, and of a `wait` row's Pointer) become dense
//! *stream* indices (in order of first appearance), so a replay needs only vectors, no maps.
//! Each operation keeps its row's time ([`Trace::times_us`]). `streamalloc::trace::TraceWriter`
//! writes the format.
//!
//! Parsing is strict by default: a malformed row, an allocation of a pointer that is still
//! live, and a free, `record_stream` or `use` of a pointer that is not live are errors
//! ([`Error::Trace`]) naming the line and quoting an [`excerpt`] of it (at most [`EXCERPT`]
//! bytes, control characters escaped). A line longer than [`MAX_LINE`] bytes is an error
//! after reading at most that much of it. A last line that has no newline at its end and is
//! not a whole row was cut short (the program writing the trace was killed mid-row): an
//! error that says so. [`ParseOptions::lenient`] turns frees, `record_stream` and `use` rows
//! of pointers that are not live (traces whose recording started mid-run) and a last row cut
//! short into counts ([`Trace::skipped_frees`], [`Trace::skipped_stream_rows`],
//! [`Trace::skipped_truncated_rows`]). A `Time` that is not an integer is no error (RMM's
//! own logs write clock times there): the trace then has no times to replay
//! ([`Trace::untimed_line`]).

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};

use streamalloc::trace::{Action, HEADER};
use streamalloc::{Error, Result};

/// The longest line the parser reads, in bytes (a row of six 64-bit numbers is under 130).
pub const MAX_LINE: usize = 4096;

pub use streamalloc::text::{excerpt, excerpt_within, EXCERPT};

/// How the reason of the error for a last row cut short begins (see [`Trace::parse_with`]).
pub const CUT_SHORT: &str = "the last row is cut short";

/// How the reason of the error for a file that starts as a pickle begins (a PyTorch memory
/// snapshot, which `streamalloc import` converts; see [`Trace::parse_with`]).
pub const PICKLE: &str = "this looks like a PyTorch memory snapshot (a pickle)";

/// How the reason of the error for a file whose first line is not text begins (see
/// [`Trace::parse_with`]).
pub const NOT_TEXT: &str = "the file is not text";

/// One operation of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Allocate `size` bytes into `slot`, on stream index `stream`.
    Allocate {
        /// Dense index of the allocation (one per `allocate` row).
        slot: usize,
        /// Bytes asked for.
        size: usize,
        /// Dense index of the recorded stream.
        stream: usize,
        /// Dense index of the recorded thread.
        thread: usize,
    },
    /// Free what `slot` holds, on stream index `stream`.
    Free {
        /// Slot of the allocation freed.
        slot: usize,
        /// Dense index of the recorded stream of the `free` row.
        stream: usize,
        /// Dense index of the recorded thread of the `free` row.
        thread: usize,
    },
    /// Record stream index `stream` on what `slot` holds (a `record_stream` row).
    RecordStream {
        /// Slot of the allocation.
        slot: usize,
        /// Dense index of the stream recorded.
        stream: usize,
        /// Dense index of the recorded thread of the row.
        thread: usize,
    },
    /// Work on stream index `stream` uses what `slot` holds for `duration_ns` (a `use` row).
    Use {
        /// Slot of the allocation used.
        slot: usize,
        /// Dense index of the stream running the work.
        stream: usize,
        /// How long the work lasts, in nanoseconds.
        duration_ns: u64,
        /// Dense index of the recorded thread of the row.
        thread: usize,
    },
    /// Stream index `stream` waits for the work enqueued so far on stream index `other` (a
    /// `wait` row).
    Wait {
        /// Dense index of the stream that waits.
        stream: usize,
        /// Dense index of the stream waited for.
        other: usize,
        /// Dense index of the recorded thread of the row.
        thread: usize,
    },
}

impl Op {
    /// The slot the operation names (`None` for a [`Op::Wait`]).
    pub fn slot(&self) -> Option<usize> {
        match *self {
            Op::Allocate { slot, .. }
            | Op::Free { slot, .. }
            | Op::RecordStream { slot, .. }
            | Op::Use { slot, .. } => Some(slot),
            Op::Wait { .. } => None,
        }
    }

    /// The dense index of the recorded thread of the operation's row.
    pub fn thread(&self) -> usize {
        match *self {
            Op::Allocate { thread, .. }
            | Op::Free { thread, .. }
            | Op::RecordStream { thread, .. }
            | Op::Use { thread, .. }
            | Op::Wait { thread, .. } => thread,
        }
    }
}

/// Options of [`Trace::parse_with`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ParseOptions {
    /// Count and skip frees of pointers that are not live instead of failing (for traces
    /// whose recording began after some allocations were made).
    pub skip_unknown_frees: bool,
    /// Count and skip `record_stream` and `use` rows of pointers that are not live instead
    /// of failing (as [`ParseOptions::skip_unknown_frees`] for frees).
    pub skip_unknown_stream_rows: bool,
    /// Count and skip a last line that has no newline at its end and is not a whole row
    /// instead of failing (for traces whose writer was killed mid-row).
    pub skip_truncated_last_row: bool,
}

impl ParseOptions {
    /// Every skip on: what `streamalloc replay --lenient` and `streamalloc record` read with.
    pub const fn lenient() -> Self {
        Self { skip_unknown_frees: true, skip_unknown_stream_rows: true, skip_truncated_last_row: true }
    }
}

/// A parsed trace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trace {
    /// Name of the trace (the file name when parsed from a path).
    pub name: String,
    /// The operations, in recorded order.
    pub ops: Vec<Op>,
    /// Number of slots: allocations, or in a [`TraceFile::summary`] the most allocations live
    /// at once.
    pub slots: usize,
    /// Size of each slot's allocation, indexed by slot.
    pub slot_sizes: Vec<usize>,
    /// Recorded stream values, indexed by stream index.
    pub streams: Vec<u64>,
    /// Recorded thread values, indexed by thread index.
    pub threads: Vec<u64>,
    /// Most bytes allocated and not yet freed at any point: the floor of any allocator's
    /// footprint on this trace.
    pub peak_live: usize,
    /// `allocate` rows.
    pub allocations: usize,
    /// `free` rows replayed.
    pub frees: usize,
    /// `record_stream` rows replayed.
    pub record_streams: usize,
    /// `use` rows replayed.
    pub uses: usize,
    /// `wait` rows replayed.
    pub waits: usize,
    /// Each operation's time, indexed like [`Trace::ops`]: its row's `Time` minus the first
    /// row's, in microseconds (0 for a row recorded before the first, as threads may be).
    /// Empty when a row's `Time` is not an integer ([`Trace::untimed_line`]).
    pub times_us: Vec<u64>,
    /// The first line whose `Time` is not an integer of microseconds, if any: the trace's
    /// time cannot be replayed.
    pub untimed_line: Option<usize>,
    /// `allocate failure` rows (counted, not replayed).
    pub recorded_failures: usize,
    /// `free` rows of unknown pointers skipped under [`ParseOptions::skip_unknown_frees`].
    pub skipped_frees: usize,
    /// `record_stream` and `use` rows of unknown pointers skipped under
    /// [`ParseOptions::skip_unknown_stream_rows`].
    pub skipped_stream_rows: usize,
    /// Last rows cut short (0 or 1) skipped under [`ParseOptions::skip_truncated_last_row`].
    pub skipped_truncated_rows: usize,
}

impl Trace {
    /// Parses the file at `path` strictly; the trace is named after the file.
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_path_with(path, ParseOptions::default())
    }

    /// Parses the file at `path` with `options`, decompressed when it is gzip or xz (see
    /// [`crate::compressed`]); the trace is named after the file (without a `.gz` or `.xz`).
    pub fn from_path_with(path: impl AsRef<Path>, options: ParseOptions) -> Result<Self> {
        let path = path.as_ref();
        let (file, name) = open_named(path)?;
        Self::parse_with(file, &name, options).map_err(|e| in_file(e, path))
    }

    /// Parses a trace strictly from `reader`, naming it `name`.
    pub fn parse(reader: impl BufRead, name: &str) -> Result<Self> {
        Self::parse_with(reader, name, ParseOptions::default())
    }

    /// Parses a trace from `reader` with `options`, naming it `name`.
    ///
    /// A last line without a newline at its end is read as a row when it is a whole one;
    /// when it is not (a field missing or cut, so that the row cannot be read), it was cut
    /// short: an error whose reason begins with [`CUT_SHORT`], or under
    /// [`ParseOptions::skip_truncated_last_row`] a row skipped and counted.
    ///
    /// A file whose first line is not text (not UTF-8, or with control characters other
    /// than tabs and line ends) is refused at line 1 without quoting it: the reason begins
    /// with [`PICKLE`] when it starts as a pickle of protocol 2 or later does (a PyTorch
    /// memory snapshot), else with [`NOT_TEXT`]; the content is its first bytes in hex.
    pub fn parse_with(reader: impl BufRead, name: &str, options: ParseOptions) -> Result<Self> {
        let mut ops = Vec::new();
        let mut times_us = Vec::new();
        let mut trace = scan(reader, name, options, Slots::OnePerAllocation, &mut |op, time_us| {
            ops.push(op);
            times_us.push(time_us);
            Ok(())
        })?;
        trace.ops = ops;
        if trace.untimed_line.is_none() {
            trace.times_us = times_us;
        }
        Ok(trace)
    }

    /// Whether the trace has `use` or `wait` rows: work on streams whose time a replay can
    /// run (what `streamalloc replay` replays time for by default).
    pub fn has_stream_work(&self) -> bool {
        self.uses + self.waits > 0
    }

    /// Whether the trace has any `record_stream`, `use` or `wait` row.
    pub fn has_stream_rows(&self) -> bool {
        self.record_streams + self.uses + self.waits > 0
    }

    /// Number of operations.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether the trace has no operations.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
}

/// Opens the trace file at `path`, decompressed when it is gzip or xz, and names it after
/// the file (without a `.gz` or `.xz`).
fn open_named(path: &Path) -> Result<(Box<dyn BufRead + Send>, String)> {
    let file = crate::compressed::open(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    let name =
        path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
    // A compressed trace is named as the file it holds (`t.csv.xz` holds `t.csv`).
    let name = match crate::compressed::Compression::of_name(path) {
        crate::compressed::Compression::None => name,
        _ => path.file_stem().map_or(name, |stem| stem.to_string_lossy().into_owned()),
    };
    Ok((file, name))
}

/// `e`, an I/O error naming the file at `path`.
fn in_file(e: Error, path: &Path) -> Error {
    match e {
        Error::Io(msg) => Error::Io(format!("{}: {msg}", path.display())),
        other => other,
    }
}

/// A trace read from its file again for each pass of a replay, so that what a replay holds is
/// bounded by the allocations live at once, not by the trace's length (`streamalloc replay`
/// replays through it; see `DESIGN.md`, Note [a trace replayed from its file]).
///
/// [`TraceFile::open_with`] reads the file once for the trace's figures ([`TraceFile::summary`]);
/// [`TraceFile::for_each_op`] reads it again, decompressing it again when it is compressed.
/// Its slots are reused: a slot freed is the next allocation's, so there are as many as
/// allocations live at once ([`Trace::slots`] of the summary), and an operation's slot is not
/// the one [`Trace::parse`] gives it.
#[derive(Debug, Clone)]
pub struct TraceFile {
    path: PathBuf,
    options: ParseOptions,
    summary: Trace,
    ops: usize,
}

impl TraceFile {
    /// Reads the file at `path` with `options` (as [`Trace::from_path_with`] does, with the same
    /// errors) and keeps its figures, not its operations.
    pub fn open_with(path: impl AsRef<Path>, options: ParseOptions) -> Result<Self> {
        let path = path.as_ref();
        let (file, name) = open_named(path)?;
        let mut ops = 0usize;
        let summary = scan(file, &name, options, Slots::Reused, &mut |_, _| {
            ops += 1;
            Ok(())
        })
        .map_err(|e| in_file(e, path))?;
        Ok(Self { path: path.to_owned(), options, summary, ops })
    }

    /// The trace's name and figures, without its operations: its [`Trace::ops`],
    /// [`Trace::times_us`] and [`Trace::slot_sizes`] are empty, and its [`Trace::slots`] is
    /// the most allocations live at once.
    pub fn summary(&self) -> &Trace {
        &self.summary
    }

    /// Number of operations.
    pub fn len(&self) -> usize {
        self.ops
    }

    /// Whether the trace has no operations.
    pub fn is_empty(&self) -> bool {
        self.ops == 0
    }

    /// Reads the file again and calls `each` with every operation and its time (as in
    /// [`Trace::times_us`]; 0 for an untimed trace), in order, holding one row at a time.
    ///
    /// Errors are those of `each`, the file's (it cannot be read, or a row can no longer be
    /// parsed), and one when the file no longer holds the trace read at first (its operations
    /// or figures differ: it was changed since).
    pub fn for_each_op(&self, mut each: impl FnMut(Op, u64) -> Result<()>) -> Result<()> {
        let (file, _) = open_named(&self.path)?;
        let mut ops = 0usize;
        // An error of `each` or of a file found changed stops the scan and is returned as is.
        let mut stopped = None;
        let again = scan(file, &self.summary.name, self.options, Slots::Reused, &mut |op, time_us| {
            ops += 1;
            let result = if ops > self.ops { Err(self.changed()) } else { each(op, time_us) };
            result.map_err(|e| {
                stopped = Some(e);
                Error::InvalidArgument(String::new())
            })
        });
        if let Some(e) = stopped {
            return Err(e);
        }
        let again = again.map_err(|e| in_file(e, &self.path))?;
        if ops != self.ops || again != self.summary {
            return Err(self.changed());
        }
        Ok(())
    }

    /// Reads the whole trace into memory, its slots one per allocation (what a replay on
    /// threads needs: each thread's rows, in any order).
    pub fn load(&self) -> Result<Trace> {
        Trace::from_path_with(&self.path, self.options)
    }

    fn changed(&self) -> Error {
        Error::Io(format!(
            "{}: the file changed while it was replayed (it no longer holds the trace read at first)",
            self.path.display()
        ))
    }
}

/// How a parse numbers slots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Slots {
    /// A new slot for each allocation (a whole [`Trace`]: slot `i` is the `i`th allocation).
    #[default]
    OnePerAllocation,
    /// A slot free again if any (a [`TraceFile`]: as many slots as allocations live at once).
    Reused,
}

/// Reads a trace from `reader` with `options`, calling `each` with every operation and its
/// time (microseconds from the first row's; 0 once the trace is found untimed), in order, and
/// returns the trace's figures without its operations, times or slot sizes. Errors are those
/// of [`Trace::parse_with`] and those of `each`.
fn scan(
    mut reader: impl BufRead,
    name: &str,
    options: ParseOptions,
    slots: Slots,
    each: &mut dyn FnMut(Op, u64) -> Result<()>,
) -> Result<Trace> {
    let mut state =
        State { trace: Trace { name: name.to_owned(), ..Trace::default() }, slots, ..State::default() };
    let mut line = Vec::new();
    let mut number = 0usize;
    loop {
        line.clear();
        let read = (&mut reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| Error::Io(format!("reading line {}: {e}", number + 1)))?;
        if read == 0 {
            break;
        }
        number += 1;
        if number == 1 {
            if let Some(reason) = not_text(&line) {
                return Err(Error::Trace { line: 1, content: hex_start(&line), reason });
            }
        }
        let ended = line.last() == Some(&b'\n');
        if line.len() > MAX_LINE && !ended {
            return Err(Error::Trace {
                line: number,
                content: excerpt(&String::from_utf8_lossy(&line)),
                reason: format!("the line is longer than {MAX_LINE} bytes (not a trace row)"),
            });
        }
        // Under the length bound, only the last line can lack its newline.
        let cut = |reason: String| {
            if ended {
                reason
            } else {
                format!(
                    "{CUT_SHORT} (no newline at its end, as when the program writing the trace is \
                     killed): {reason}"
                )
            }
        };
        let (text, utf8) = match std::str::from_utf8(&line) {
            Ok(text) => (Cow::Borrowed(text), true),
            Err(_) => (String::from_utf8_lossy(&line), false),
        };
        let text = text.trim_end_matches(['\n', '\r']);
        let fail = |reason: String| Error::Trace { line: number, content: excerpt(text), reason };
        if !utf8 {
            if !ended && number > 1 && options.skip_truncated_last_row {
                state.trace.skipped_truncated_rows += 1;
                continue;
            }
            return Err(fail(cut("the line is not UTF-8 text".into())));
        }
        if number == 1 {
            // A byte order mark (as editors on Windows save CSV) is no part of the header.
            if text.trim_start_matches('\u{feff}').trim() != HEADER {
                return Err(fail(format!("expected the header `{HEADER}`")));
            }
            continue;
        }
        if text.trim().is_empty() {
            continue;
        }
        // Read whole before anything is changed, so that a row cut short changes nothing.
        match Row::split(text).and_then(|row| Ok((row.event()?, row.time))) {
            Ok((event, time)) => {
                let op = state.apply(event, options).map_err(fail)?;
                let time_us = state.note_time(time, number).map_err(fail)?;
                if let Some(op) = op {
                    each(op, time_us)?;
                }
            }
            Err(_) if !ended && options.skip_truncated_last_row => state.trace.skipped_truncated_rows += 1,
            Err(reason) => return Err(fail(cut(reason))),
        }
    }
    if number == 0 {
        return Err(Error::Trace {
            line: 1,
            content: String::new(),
            reason: format!("empty file: expected the header `{HEADER}`"),
        });
    }
    Ok(state.trace)
}

/// A trace being built: the trace, and the maps from recorded values to dense indices.
#[derive(Default)]
struct State {
    trace: Trace,
    /// How slots are numbered.
    slots: Slots,
    /// Recorded pointer -> its live slot and size.
    live: HashMap<u64, (usize, usize)>,
    /// Slots free again, the one freed last at the end (with [`Slots::Reused`]).
    free_slots: Vec<usize>,
    /// Recorded stream value -> stream index.
    stream_index: HashMap<u64, usize>,
    /// Recorded thread value -> thread index.
    thread_index: HashMap<u64, usize>,
    /// Bytes live now.
    current: usize,
    /// The first row's time, in microseconds.
    origin: Option<u64>,
}

impl State {
    /// Counts one row and returns its operation, if it has one; an error is the reason the
    /// row cannot be replayed.
    fn apply(&mut self, event: Event<'_>, options: ParseOptions) -> std::result::Result<Option<Op>, String> {
        let trace = &mut self.trace;
        Ok(match event {
            Event::Allocate { ptr, size, stream, thread } => {
                if self.live.contains_key(&ptr) {
                    return Err(format!("pointer {ptr:#x} is allocated again while still live"));
                }
                let stream = intern(&mut self.stream_index, &mut trace.streams, stream);
                let thread = intern(&mut self.thread_index, &mut trace.threads, thread);
                let slot = match self.slots {
                    Slots::OnePerAllocation => {
                        trace.slot_sizes.push(size);
                        None
                    }
                    Slots::Reused => self.free_slots.pop(),
                }
                .unwrap_or_else(|| {
                    trace.slots += 1;
                    trace.slots - 1
                });
                self.live.insert(ptr, (slot, size));
                trace.allocations += 1;
                self.current = self.current.saturating_add(size);
                trace.peak_live = trace.peak_live.max(self.current);
                Some(Op::Allocate { slot, size, stream, thread })
            }
            Event::Free { ptr, written, stream, thread } => {
                let stream = intern(&mut self.stream_index, &mut trace.streams, stream);
                let thread = intern(&mut self.thread_index, &mut trace.threads, thread);
                match self.live.remove(&ptr) {
                    Some((slot, size)) => {
                        self.current = self.current.saturating_sub(size);
                        trace.frees += 1;
                        if self.slots == Slots::Reused {
                            self.free_slots.push(slot);
                        }
                        Some(Op::Free { slot, stream, thread })
                    }
                    None if options.skip_unknown_frees => {
                        trace.skipped_frees += 1;
                        None
                    }
                    None => {
                        return Err(format!(
                            "free of pointer {} that is not live (never allocated in this trace, or already \
                             freed)",
                            excerpt(written)
                        ))
                    }
                }
            }
            Event::RecordStream { ptr, written, stream, thread } => {
                let stream = intern(&mut self.stream_index, &mut trace.streams, stream);
                let thread = intern(&mut self.thread_index, &mut trace.threads, thread);
                let slot = self.live_slot(ptr, written, "record_stream", options)?;
                self.trace.record_streams += usize::from(slot.is_some());
                slot.map(|slot| Op::RecordStream { slot, stream, thread })
            }
            Event::Use { ptr, written, duration_ns, stream, thread } => {
                let stream = intern(&mut self.stream_index, &mut trace.streams, stream);
                let thread = intern(&mut self.thread_index, &mut trace.threads, thread);
                let slot = self.live_slot(ptr, written, "use", options)?;
                self.trace.uses += usize::from(slot.is_some());
                slot.map(|slot| Op::Use { slot, stream, duration_ns, thread })
            }
            Event::Wait { stream, other, thread } => {
                let stream = intern(&mut self.stream_index, &mut trace.streams, stream);
                let other = intern(&mut self.stream_index, &mut trace.streams, other);
                let thread = intern(&mut self.thread_index, &mut trace.threads, thread);
                trace.waits += 1;
                Some(Op::Wait { stream, other, thread })
            }
            Event::Failure => {
                trace.recorded_failures += 1;
                None
            }
        })
    }

    /// The live slot of `ptr` (written `written`) that a row of `action` names; `None` when it
    /// is not live and such rows are skipped (counted), an error when it is not live.
    fn live_slot(
        &mut self,
        ptr: u64,
        written: &str,
        action: &str,
        options: ParseOptions,
    ) -> std::result::Result<Option<usize>, String> {
        match self.live.get(&ptr) {
            Some(&(slot, _)) => Ok(Some(slot)),
            None if options.skip_unknown_stream_rows => {
                self.trace.skipped_stream_rows += 1;
                Ok(None)
            }
            None => Err(format!(
                "`{action}` of pointer {} that is not live (never allocated in this trace, or already freed)",
                excerpt(written)
            )),
        }
    }

    /// Notes the time `written` of the row at `line` and returns it in microseconds from the
    /// first row's (0 once the trace is untimed); a negative integer is an error (no clock time
    /// either, and no count of microseconds).
    fn note_time(&mut self, written: &str, line: usize) -> std::result::Result<u64, String> {
        if written.strip_prefix('-').is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())) {
            return Err(format!("negative Time `{}` (expected microseconds from 0)", excerpt(written)));
        }
        if self.trace.untimed_line.is_some() {
            return Ok(0);
        }
        let Ok(time) = written.parse::<u64>() else {
            self.trace.untimed_line = Some(line);
            return Ok(0);
        };
        let origin = *self.origin.get_or_insert(time);
        Ok(time.saturating_sub(origin))
    }
}

/// What one data row records, read whole.
enum Event<'a> {
    Allocate { ptr: u64, size: usize, stream: u64, thread: u64 },
    Free { ptr: u64, written: &'a str, stream: u64, thread: u64 },
    RecordStream { ptr: u64, written: &'a str, stream: u64, thread: u64 },
    Use { ptr: u64, written: &'a str, duration_ns: u64, stream: u64, thread: u64 },
    Wait { stream: u64, other: u64, thread: u64 },
    Failure,
}

/// The fields of one data row (Time is read apart, by [`State::note_time`]).
struct Row<'a> {
    thread: &'a str,
    time: &'a str,
    action: &'a str,
    pointer: &'a str,
    size: &'a str,
    stream: &'a str,
}

impl<'a> Row<'a> {
    fn split(text: &'a str) -> std::result::Result<Self, String> {
        let mut fields = text.split(',');
        let mut next = |what: &str| {
            fields
                .next()
                .map(str::trim)
                .ok_or_else(|| format!("missing field {what} (expected 6 fields: {HEADER})"))
        };
        let row = Row {
            thread: next("Thread")?,
            time: next("Time")?,
            action: next("Action")?,
            pointer: next("Pointer")?,
            size: next("Size")?,
            stream: next("Stream")?,
        };
        if fields.next().is_some() {
            return Err(format!("too many fields (expected 6: {HEADER})"));
        }
        Ok(row)
    }

    /// The row's values; an error names the field that cannot be read.
    fn event(&self) -> std::result::Result<Event<'a>, String> {
        let ids = || Ok::<_, String>((parse_id("stream", self.stream)?, parse_id("thread", self.thread)?));
        let action = Action::from_word(self.action).ok_or_else(|| {
            format!(
                "unknown action `{}` (expected allocate, free, allocate failure, record_stream, use or wait)",
                excerpt(self.action)
            )
        })?;
        let written = self.pointer;
        Ok(match action {
            Action::Allocate => {
                let (ptr, size) = (parse_pointer(self.pointer)?, parse_size(self.size)?);
                let (stream, thread) = ids()?;
                Event::Allocate { ptr, size, stream, thread }
            }
            Action::Free => {
                let ptr = parse_pointer(self.pointer)?;
                let (stream, thread) = ids()?;
                Event::Free { ptr, written, stream, thread }
            }
            Action::AllocateFailure => Event::Failure,
            Action::RecordStream => {
                let ptr = parse_pointer(self.pointer)?;
                parse_size(self.size)?;
                let (stream, thread) = ids()?;
                Event::RecordStream { ptr, written, stream, thread }
            }
            Action::Use => {
                let ptr = parse_pointer(self.pointer)?;
                let duration_ns = self.size.parse().map_err(|_| {
                    format!("bad duration `{}` (expected a decimal count of nanoseconds)", excerpt(self.size))
                })?;
                let (stream, thread) = ids()?;
                Event::Use { ptr, written, duration_ns, stream, thread }
            }
            Action::Wait => {
                let other = parse_id("stream handle", self.pointer)?;
                parse_size(self.size)?;
                let (stream, thread) = ids()?;
                Event::Wait { stream, other, thread }
            }
        })
    }
}

/// Why `first`, the first line of a file (at most [`MAX_LINE`] + 1 bytes of it), shows the
/// file is not a text trace, if it does: a pickle's start (the `PROTO` opcode, 0x80, and a
/// protocol from 2 to 5), bytes that are not UTF-8, or control characters other than tabs
/// and line ends.
fn not_text(first: &[u8]) -> Option<String> {
    if let [0x80, 2..=5, ..] = first {
        return Some(format!("{PICKLE}, not a trace (RMM's logging CSV)"));
    }
    let text = match std::str::from_utf8(first) {
        Ok(text) => text,
        // Cut inside a character by the length bound: the text before it.
        Err(e) if e.error_len().is_none() && first.len() > MAX_LINE => {
            std::str::from_utf8(&first[..e.valid_up_to()]).unwrap_or_default()
        }
        Err(_) => return Some(format!("{NOT_TEXT} (its first line is not UTF-8), not a trace")),
    };
    text.chars()
        .any(|c| c.is_control() && !matches!(c, '\t' | '\r' | '\n'))
        .then(|| format!("{NOT_TEXT} (its first line has control characters), not a trace"))
}

/// The first bytes of `line` in hex, for an error about a file that is not text.
fn hex_start(line: &[u8]) -> String {
    const SHOWN: usize = 8;
    let mut text: Vec<String> = line.iter().take(SHOWN).map(|b| format!("{b:02x}")).collect();
    if line.len() > SHOWN {
        text.push("...".into());
    }
    format!("first bytes {}", text.join(" "))
}

/// Parses a hexadecimal (`0x...`) or decimal integer.
fn parse_int(text: &str) -> Option<u64> {
    match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

fn parse_pointer(text: &str) -> std::result::Result<u64, String> {
    parse_int(text)
        .ok_or_else(|| format!("bad pointer `{}` (expected hexadecimal 0x... or decimal)", excerpt(text)))
}

fn parse_size(text: &str) -> std::result::Result<usize, String> {
    text.parse().map_err(|_| format!("bad size `{}` (expected a decimal byte count)", excerpt(text)))
}

/// The value of the `what` (stream or thread) written `text`.
fn parse_id(what: &str, text: &str) -> std::result::Result<u64, String> {
    parse_int(text)
        .ok_or_else(|| format!("bad {what} `{}` (expected an integer or 0x... handle)", excerpt(text)))
}

/// The dense index of `value`, added to `values` at its first appearance.
fn intern(index: &mut HashMap<u64, usize>, values: &mut Vec<u64>, value: u64) -> usize {
    *index.entry(value).or_insert_with(|| {
        values.push(value);
        values.len() - 1
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use streamalloc::trace::{Action, Record, TraceWriter};

    fn parse(text: &str) -> Result<Trace> {
        Trace::parse(text.as_bytes(), "test")
    }

    #[test]
    fn parses_ops_slots_streams_and_peak() {
        let trace = parse(
            "Thread,Time,Action,Pointer,Size,Stream\r\n\
             0,1,allocate,0x100,10,0\r\n\
             0,2,allocate,0x200,20,7\n\
             0,3,allocate failure,0x0,999,0\n\
             0,4,free,0x100,10,0\n\
             0,5,allocate,0x100,5,7\n\
             \n\
             0,6,free,0x200,20,7\n",
        )
        .unwrap();
        assert_eq!(
            trace.ops,
            vec![
                Op::Allocate { slot: 0, size: 10, stream: 0, thread: 0 },
                Op::Allocate { slot: 1, size: 20, stream: 1, thread: 0 },
                Op::Free { slot: 0, stream: 0, thread: 0 },
                Op::Allocate { slot: 2, size: 5, stream: 1, thread: 0 },
                Op::Free { slot: 1, stream: 1, thread: 0 },
            ]
        );
        assert_eq!(trace.streams, vec![0, 7]);
        assert_eq!(trace.slots, 3);
        assert_eq!(trace.peak_live, 30);
        assert_eq!((trace.allocations, trace.frees, trace.recorded_failures), (3, 2, 1));
    }

    /// Left from issue 52's previous round: a header after a byte order mark (as editors on
    /// Windows save CSV) was refused by an error whose echo looked like a good header; the
    /// mark is read as nothing.
    #[test]
    fn a_byte_order_mark_before_the_header_is_accepted() {
        let trace = parse(&format!("\u{feff}{HEADER}\n0,1,allocate,0x100,10,0\n")).unwrap();
        assert_eq!((trace.len(), trace.peak_live), (1, 10));
    }

    #[test]
    fn malformed_rows_name_line_and_content() {
        let cases = [
            ("Thread,Time\n", 1, "header"),
            ("", 1, "empty"),
            (&format!("{HEADER}\n0,1,allocate,0x100,ten,0\n"), 2, "bad size"),
            (&format!("{HEADER}\n0,1,allocate,0x100,10\n"), 2, "missing field Stream"),
            (&format!("{HEADER}\n0,1,allocate,0x100,10,0,9\n"), 2, "too many"),
            (&format!("{HEADER}\n0,1,allocate,zz,10,0\n"), 2, "bad pointer"),
            (&format!("{HEADER}\n0,1,reserve,0x1,10,0\n"), 2, "unknown action"),
            (&format!("{HEADER}\n0,1,allocate,0x1,1,0\n0,1,allocate,0x1,1,0\n"), 3, "still live"),
            (&format!("{HEADER}\n0,1,allocate,0x1,1,0\n0,2,free,0xdead,1,0\n"), 3, "0xdead"),
        ];
        for (text, want_line, want_reason) in cases {
            match parse(text) {
                Err(Error::Trace { line, content, reason }) => {
                    assert_eq!(line, want_line, "{text:?}");
                    assert_eq!(content, text.lines().nth(line - 1).unwrap_or(""));
                    assert!(reason.contains(want_reason), "{reason} lacks {want_reason}");
                }
                other => panic!("{text:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn unknown_frees_can_be_skipped() {
        let text = format!("{HEADER}\n0,1,free,0x10,4,0\n0,2,allocate,0x10,4,0\n");
        let options = ParseOptions { skip_unknown_frees: true, ..ParseOptions::default() };
        let trace = Trace::parse_with(text.as_bytes(), "t", options).unwrap();
        assert_eq!(trace.skipped_frees, 1);
        assert_eq!(trace.ops, vec![Op::Allocate { slot: 0, size: 4, stream: 0, thread: 0 }]);
    }

    /// Issue 37: stream rows become operations on dense slots and streams; a `wait` row's
    /// Pointer is a stream handle, numbered with the Stream column's values.
    #[test]
    fn stream_rows_parse_into_operations_with_their_times() {
        let trace = parse(&format!(
            "{HEADER}\n0,1000,allocate,0x100,64,0\n0,1001,record_stream,0x100,0,0x7f55\n\
             1,1003,use,0x100,2500,140050\n0,1004,wait,0x7f55,0,0\n0,1004,wait,0x0,0,0x7f55\n\
             0,990,free,0x100,64,0\n"
        ))
        .unwrap();
        assert_eq!(
            trace.ops,
            vec![
                Op::Allocate { slot: 0, size: 64, stream: 0, thread: 0 },
                Op::RecordStream { slot: 0, stream: 1, thread: 0 },
                Op::Use { slot: 0, stream: 2, duration_ns: 2500, thread: 1 },
                Op::Wait { stream: 0, other: 1, thread: 0 },
                Op::Wait { stream: 1, other: 0, thread: 0 },
                Op::Free { slot: 0, stream: 0, thread: 0 },
            ]
        );
        assert_eq!(trace.streams, vec![0, 0x7f55, 140050]);
        assert_eq!((trace.record_streams, trace.uses, trace.waits), (1, 1, 2));
        assert_eq!(trace.times_us, vec![0, 1, 3, 4, 4, 0], "from the first row, never below it");
        assert_eq!((trace.peak_live, trace.untimed_line), (64, None));
        assert!(trace.has_stream_rows() && trace.has_stream_work());
    }

    #[test]
    fn stream_rows_of_pointers_not_live_are_errors_or_skipped() {
        let cases = [
            (
                format!("{HEADER}\n0,1,record_stream,0x100,0,7\n"),
                2,
                "`record_stream` of pointer 0x100 that is not live",
            ),
            (
                format!("{HEADER}\n0,1,allocate,0x100,8,0\n0,2,free,0x100,8,0\n0,3,use,0x100,50,7\n"),
                4,
                "`use` of pointer 0x100 that is not live",
            ),
        ];
        for (text, want_line, want_reason) in &cases {
            match parse(text) {
                Err(Error::Trace { line, reason, .. }) => {
                    assert_eq!(line, *want_line, "{text:?}");
                    assert!(reason.contains(want_reason), "{reason}");
                }
                other => panic!("{text:?} gave {other:?}"),
            }
            let options = ParseOptions { skip_unknown_stream_rows: true, ..ParseOptions::default() };
            let trace = Trace::parse_with(text.as_bytes(), "t", options).unwrap();
            assert_eq!((trace.skipped_stream_rows, trace.record_streams, trace.uses), (1, 0, 0));
            assert!(!trace.ops.iter().any(|op| matches!(op, Op::RecordStream { .. } | Op::Use { .. })));
            assert_eq!(Trace::parse_with(text.as_bytes(), "t", ParseOptions::lenient()).unwrap(), trace);
        }
        // Malformed stream rows are errors, lenient or not.
        for (row, want) in [
            ("0,1,use,0x100,1.5ms,0", "bad duration `1.5ms`"),
            ("0,1,wait,stream7,0,0", "bad stream handle `stream7`"),
            ("0,1,record_stream,0x100,x,0", "bad size `x`"),
        ] {
            let text = format!("{HEADER}\n0,0,allocate,0x100,8,0\n{row}\n");
            match Trace::parse_with(text.as_bytes(), "t", ParseOptions::lenient()) {
                Err(Error::Trace { line: 3, reason, .. }) => assert!(reason.contains(want), "{reason}"),
                other => panic!("{row}: {other:?}"),
            }
        }
    }

    /// RMM's own logs write clock times (`HH:MM:SS.ffffff`): read as before, without times.
    #[test]
    fn a_time_that_is_not_an_integer_leaves_the_trace_untimed() {
        let trace =
            parse(&format!("{HEADER}\n0,5,allocate,0x10,64,0\n0,10:23:45.123456,free,0x10,64,0\n")).unwrap();
        assert_eq!((trace.len(), trace.untimed_line), (2, Some(3)));
        assert!(trace.times_us.is_empty() && !trace.has_stream_rows());
    }

    #[test]
    fn missing_file_is_an_io_error_naming_it() {
        match Trace::from_path("/nonexistent/trace.csv") {
            Err(Error::Io(msg)) => assert!(msg.contains("/nonexistent/trace.csv")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn writer_round_trips() {
        let records = [
            Record { thread: 1, time_us: 10, action: Action::Allocate, ptr: 0x7f00, size: 512, stream: 0 },
            Record {
                thread: 1,
                time_us: 11,
                action: Action::AllocateFailure,
                ptr: 0,
                size: 1 << 40,
                stream: 3,
            },
            Record { thread: 2, time_us: 12, action: Action::Allocate, ptr: 0x8f00, size: 256, stream: 3 },
            Record { thread: 1, time_us: 13, action: Action::Free, ptr: 0x7f00, size: 512, stream: 0 },
        ];
        let mut writer = TraceWriter::new(Vec::new()).unwrap();
        for r in &records {
            writer.write(r).unwrap();
        }
        let bytes = writer.finish().unwrap();
        let text = String::from_utf8(bytes).unwrap();
        assert_eq!(text.lines().nth(1), Some("1,10,allocate,0x7f00,512,0"));
        let trace = parse(&text).unwrap();
        assert_eq!(
            trace.ops,
            vec![
                Op::Allocate { slot: 0, size: 512, stream: 0, thread: 0 },
                Op::Allocate { slot: 1, size: 256, stream: 1, thread: 1 },
                Op::Free { slot: 0, stream: 0, thread: 0 },
            ]
        );
        assert_eq!(trace.recorded_failures, 1);
        assert_eq!(trace.streams, vec![0, 3]);
        assert_eq!(trace.threads, vec![1, 2]);
    }

    /// Issue 18: a 1 MiB line used to be read whole and quoted whole in the error.
    #[test]
    fn long_lines_are_refused_after_a_bounded_read_with_a_bounded_excerpt() {
        let long = format!("{HEADER}\n0,1,allocate,0x10,{},0\n", "9".repeat(1 << 20));
        let mut reader = std::io::Cursor::new(long.as_bytes());
        match Trace::parse(&mut reader, "t") {
            Err(Error::Trace { line: 2, content, reason }) => {
                assert!(reason.contains("longer than 4096 bytes"), "{reason}");
                assert!(content.len() < EXCERPT + 40, "{} bytes quoted", content.len());
            }
            other => panic!("{other:?}"),
        }
        assert!(reader.position() < 2 * MAX_LINE as u64, "read {} bytes", reader.position());
        // A long bad row (under the bound) is quoted in part too.
        let bad = format!("{HEADER}\n0,1,allocate,0x10,{},0\n", "x".repeat(3000));
        match parse(&bad) {
            Err(Error::Trace { content, .. }) => {
                assert!(content.len() < EXCERPT + 40 && content.ends_with("in all)"))
            }
            other => panic!("{other:?}"),
        }
    }

    /// Issue 33: a trace whose writer was killed mid-row ends in a row cut short: an error
    /// naming its line, or skipped and counted under `skip_truncated_last_row`; nothing of
    /// the cut row is kept.
    #[test]
    fn a_last_row_cut_short_is_named_or_skipped() {
        let lenient = ParseOptions::lenient();
        for cut in
            ["0,3,allocate,0x30,1", "0,3,allocate,0x3", "0,3,allo", "0,3,free,0x10,64,0x", "0,3,free,0x10"]
        {
            let text = format!("{HEADER}\n0,1,allocate,0x10,64,5\n0,2,allocate,0x20,32,5\n{cut}");
            match parse(&text) {
                Err(Error::Trace { line: 4, content, reason }) => {
                    assert!(reason.starts_with(CUT_SHORT), "{cut}: {reason}");
                    assert_eq!(content, text.lines().nth(3).unwrap());
                }
                other => panic!("{cut}: {other:?}"),
            }
            let trace = Trace::parse_with(text.as_bytes(), "t", lenient).unwrap();
            assert_eq!(trace.skipped_truncated_rows, 1, "{cut}");
            assert_eq!((trace.len(), trace.streams.len(), trace.peak_live), (2, 1, 96), "{cut}");
        }
        // Not UTF-8 (a character cut in two), the same.
        let mut bytes = format!("{HEADER}\n0,1,allocate,0x10,64,0\n0,2,allocate,0x20,").into_bytes();
        bytes.push(0xe2);
        assert!(
            matches!(Trace::parse(&bytes[..], "t"), Err(Error::Trace { line: 3, reason, .. }) if reason.starts_with(CUT_SHORT))
        );
        assert_eq!(Trace::parse_with(&bytes[..], "t", lenient).unwrap().skipped_truncated_rows, 1);
        // Only the last line: a bad row before it is an error, lenient or not.
        let text = format!("{HEADER}\n0,1,allo\n0,2,allocate,0x10,64,0");
        match Trace::parse_with(text.as_bytes(), "t", lenient) {
            Err(Error::Trace { line: 2, reason, .. }) => {
                assert!(reason.contains("missing field"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    /// A last row that is whole reads as usual, newline or not.
    #[test]
    fn a_whole_last_row_without_a_newline_is_read() {
        let trace = parse(&format!("{HEADER}\n0,1,allocate,0x10,64,0\n0,2,free,0x10,64,0")).unwrap();
        assert_eq!((trace.len(), trace.skipped_truncated_rows), (2, 0));
        assert_eq!(parse(HEADER).unwrap().len(), 0);
    }

    /// Issue 33: control characters of a trace (terminal escape sequences) were quoted raw.
    #[test]
    fn errors_quote_control_characters_escaped() {
        let text = format!("{HEADER}\n0,1,alloc\x1b[2J\u{202e},0x10,64\x07,0\n");
        match parse(&text) {
            Err(Error::Trace { line: 2, content, reason }) => {
                assert_eq!(content, "0,1,alloc\\x1b[2J\\u{202e},0x10,64\\x07,0");
                assert!(reason.contains("unknown action `alloc\\x1b[2J\\u{202e}`"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        let text = format!("{HEADER}\n0,1,allocate,0x10,6\t4,0\n");
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("bad size `6\\x094`") && !err.contains('\t'), "{err}");
    }

    #[test]
    fn excerpts_are_bounded_escaped_and_say_how_long_the_text_was() {
        assert_eq!(excerpt("plain text, é"), "plain text, é");
        assert_eq!(excerpt("\x1b]0;title\x07\r\n\u{7f}\u{85}"), "\\x1b]0;title\\x07\\x0d\\x0a\\x7f\\u{85}");
        let long = "é".repeat(1000);
        let shown = excerpt(&long);
        assert!(shown.starts_with("éé") && shown.ends_with("... (2000 bytes in all)"), "{shown}");
        assert!(shown.len() <= EXCERPT + 30, "{} bytes", shown.len());
        // An escape is not cut in two.
        let shown = excerpt_within("ab\x1b", 5);
        assert_eq!(shown, "ab... (3 bytes in all)");
        assert_eq!(excerpt_within("", 0), "");
    }

    /// Issue 37: a PyTorch snapshot (a pickle) or another binary file was quoted, bytes and
    /// all, as a line that is not UTF-8: it is named as what it is, its first bytes in hex.
    #[test]
    fn binary_files_are_named_and_not_quoted() {
        let mut pickle = vec![0x80, 0x04, 0x95, 0x10, 0, 0, 0, 0, 0, 0, 0, b'}', 0x94, b'\n', 0x1b];
        pickle.extend([0xffu8; 5000]);
        let clean = |content: &str| content.is_ascii() && !content.chars().any(|c| c.is_control());
        match Trace::parse(&pickle[..], "t") {
            Err(Error::Trace { line: 1, content, reason }) => {
                assert!(
                    reason.starts_with("this looks like a PyTorch memory snapshot (a pickle)"),
                    "{reason}"
                );
                assert!(clean(&content) && content.starts_with("first bytes 80 04 95 10"), "{content:?}");
            }
            other => panic!("{other:?}"),
        }
        let long_binary = [0xfeu8; 2 * MAX_LINE];
        for binary in
            [&b"PK\x03\x04\x14\x00\n"[..], b"\xff\xfeT\x00h\x00", b"Thread\x00,Time\n", &long_binary]
        {
            match Trace::parse(binary, "t") {
                Err(Error::Trace { line: 1, content, reason }) => {
                    assert!(reason.starts_with("the file is not text"), "{binary:?}: {reason}");
                    assert!(clean(&content) && content.len() < 64, "{content:?}");
                }
                other => panic!("{binary:?}: {other:?}"),
            }
        }
        // A header of text cut inside a character by the length bound is text.
        let mut long_text = "é".repeat(MAX_LINE);
        long_text.push('\n');
        match Trace::parse(long_text.as_bytes(), "t") {
            Err(Error::Trace { line: 1, reason, .. }) => assert!(reason.contains("longer than"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    /// A trace file's slots are reused, its ops read again at each call, and a file changed
    /// since it was opened is an error, not another trace replayed.
    #[test]
    fn a_trace_file_reuses_slots_and_notices_a_change() {
        let path = std::env::temp_dir().join(format!("streamalloc-tracefile-{}.csv", std::process::id()));
        let text = format!(
            "{HEADER}\n0,1,allocate,0x10,64,0\n0,2,allocate,0x20,32,0\n0,3,free,0x10,0,0\n\
             0,4,allocate,0x30,8,0\n0,5,free,0x20,0,0\n0,6,free,0x30,0,0\n"
        );
        std::fs::write(&path, &text).unwrap();
        let file = TraceFile::open_with(&path, ParseOptions::default()).unwrap();
        let whole = Trace::parse(text.as_bytes(), "t").unwrap();
        assert_eq!((file.len(), file.summary().slots, whole.slots), (6, 2, 3));
        assert_eq!(
            (file.summary().peak_live, file.summary().name.as_str()),
            (96, path.file_name().unwrap().to_str().unwrap())
        );
        let mut ops = Vec::new();
        file.for_each_op(|op, time_us| {
            ops.push((op, time_us));
            Ok(())
        })
        .unwrap();
        let slots: Vec<_> = ops.iter().map(|(op, _)| op.slot().unwrap()).collect();
        assert_eq!(slots, [0, 1, 0, 0, 1, 0], "the third allocation takes the first's slot");
        assert_eq!(ops.iter().map(|&(_, t)| t).collect::<Vec<_>>(), whole.times_us);
        std::fs::write(&path, text.replace("0,6,free,0x30,0,0\n", "")).unwrap();
        let err = file.for_each_op(|_, _| Ok(())).unwrap_err();
        let _ = std::fs::remove_file(&path);
        assert!(err.to_string().contains("the file changed while it was replayed"), "{err}");
    }

    #[test]
    fn parses_the_sample_traces() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces");
        for (file, ops, peak) in
            [("gpt2_train.csv", 11_911, 7_701_353_160), ("resnet50_train.csv", 6_620, 3_192_592_912)]
        {
            let trace = Trace::from_path(dir.join(format!("{file}.xz"))).unwrap();
            assert_eq!(trace.name, file, "named as the file the .xz holds");
            assert_eq!(trace.allocations + trace.frees + trace.recorded_failures, ops);
            assert_eq!(trace.peak_live, peak);
        }
    }
}
