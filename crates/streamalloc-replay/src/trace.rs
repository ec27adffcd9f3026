//! Allocation traces in RMM's logging CSV format: reading them into the operations a replay
//! runs.
//!
//! The format (see `DESIGN.md` and `traces/README.md`) is a header line
//! `Thread,Time,Action,Pointer,Size,Stream` followed by one row per event, `Action` being
//! `allocate`, `free` or `allocate failure`. [`Trace::parse`] turns such a file into a list
//! of [`Op`]s in which recorded pointers become dense *slot* indices and recorded stream
//! values become dense *stream* indices (in order of first appearance), so a replay needs
//! only vectors, no maps. `streamalloc::trace::TraceWriter` writes the format.
//!
//! Parsing is strict by default: a malformed row, an allocation of a pointer that is still
//! live, and a free of a pointer that is not live are errors ([`Error::Trace`]) naming the
//! line and quoting at most [`EXCERPT`] bytes of it. A line longer than [`MAX_LINE`] bytes
//! is an error after reading at most that much of it. [`ParseOptions::skip_unknown_frees`] turns the last into a count
//! ([`Trace::skipped_frees`]) for traces whose recording started mid-run.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use streamalloc::trace::HEADER;
use streamalloc::{Error, Result};

/// The longest line the parser reads, in bytes (a row of six 64-bit numbers is under 130).
pub const MAX_LINE: usize = 4096;

/// The most bytes of a line an error quotes.
pub const EXCERPT: usize = 120;

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
}

/// Options of [`Trace::parse_with`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ParseOptions {
    /// Count and skip frees of pointers that are not live instead of failing (for traces
    /// whose recording began after some allocations were made).
    pub skip_unknown_frees: bool,
}

/// A parsed trace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trace {
    /// Name of the trace (the file name when parsed from a path).
    pub name: String,
    /// The operations, in recorded order.
    pub ops: Vec<Op>,
    /// Number of slots (= number of allocations).
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
    /// `allocate failure` rows (counted, not replayed).
    pub recorded_failures: usize,
    /// `free` rows of unknown pointers skipped under [`ParseOptions::skip_unknown_frees`].
    pub skipped_frees: usize,
}

impl Trace {
    /// Parses the file at `path` strictly; the trace is named after the file.
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_path_with(path, ParseOptions::default())
    }

    /// Parses the file at `path` with `options`; the trace is named after the file.
    pub fn from_path_with(path: impl AsRef<Path>, options: ParseOptions) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        let name =
            path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
        Self::parse_with(BufReader::with_capacity(1 << 16, file), &name, options).map_err(|e| match e {
            Error::Io(msg) => Error::Io(format!("{}: {msg}", path.display())),
            other => other,
        })
    }

    /// Parses a trace strictly from `reader`, naming it `name`.
    pub fn parse(reader: impl BufRead, name: &str) -> Result<Self> {
        Self::parse_with(reader, name, ParseOptions::default())
    }

    /// Parses a trace from `reader` with `options`, naming it `name`.
    pub fn parse_with(mut reader: impl BufRead, name: &str, options: ParseOptions) -> Result<Self> {
        let mut trace = Trace { name: name.to_owned(), ..Trace::default() };
        // Recorded pointer -> live slot; recorded stream value -> stream index.
        let mut live: HashMap<u64, usize> = HashMap::new();
        let mut stream_index: HashMap<u64, usize> = HashMap::new();
        let mut thread_index: HashMap<u64, usize> = HashMap::new();
        let mut current = 0usize;
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
            if line.len() > MAX_LINE && line.last() != Some(&b'\n') {
                return Err(Error::Trace {
                    line: number,
                    content: excerpt(&String::from_utf8_lossy(&line)),
                    reason: format!("the line is longer than {MAX_LINE} bytes (not a trace row)"),
                });
            }
            let Ok(text) = std::str::from_utf8(&line) else {
                return Err(Error::Trace {
                    line: number,
                    content: excerpt(&String::from_utf8_lossy(&line)),
                    reason: "the line is not UTF-8 text".into(),
                });
            };
            let text = text.trim_end_matches(['\n', '\r']);
            let fail = |reason: String| Error::Trace { line: number, content: excerpt(text), reason };
            if number == 1 {
                if text.trim() != HEADER {
                    return Err(fail(format!("expected the header `{HEADER}`")));
                }
                continue;
            }
            if text.trim().is_empty() {
                continue;
            }
            let row = Row::split(text).map_err(fail)?;
            match row.action {
                "allocate" => {
                    let ptr = parse_pointer(row.pointer).map_err(fail)?;
                    let size = parse_size(row.size).map_err(fail)?;
                    let stream =
                        intern(&mut stream_index, &mut trace.streams, "stream", row.stream).map_err(fail)?;
                    let thread =
                        intern(&mut thread_index, &mut trace.threads, "thread", row.thread).map_err(fail)?;
                    let slot = trace.slots;
                    if live.insert(ptr, slot).is_some() {
                        return Err(fail(format!("pointer {:#x} is allocated again while still live", ptr)));
                    }
                    trace.slots += 1;
                    trace.slot_sizes.push(size);
                    trace.allocations += 1;
                    trace.ops.push(Op::Allocate { slot, size, stream, thread });
                    current = current.saturating_add(size);
                    trace.peak_live = trace.peak_live.max(current);
                }
                "free" => {
                    let ptr = parse_pointer(row.pointer).map_err(fail)?;
                    let stream =
                        intern(&mut stream_index, &mut trace.streams, "stream", row.stream).map_err(fail)?;
                    let thread =
                        intern(&mut thread_index, &mut trace.threads, "thread", row.thread).map_err(fail)?;
                    match live.remove(&ptr) {
                        Some(slot) => {
                            current = current.saturating_sub(trace.slot_sizes[slot]);
                            trace.frees += 1;
                            trace.ops.push(Op::Free { slot, stream, thread });
                        }
                        None if options.skip_unknown_frees => trace.skipped_frees += 1,
                        None => {
                            return Err(fail(format!(
                                "free of pointer {} that is not live (never allocated in this trace, or \
                                 already freed)",
                                row.pointer
                            )))
                        }
                    }
                }
                "allocate failure" => trace.recorded_failures += 1,
                other => {
                    return Err(fail(format!(
                        "unknown action `{other}` (expected allocate, free or allocate failure)"
                    )))
                }
            }
        }
        if number == 0 {
            return Err(Error::Trace {
                line: 1,
                content: String::new(),
                reason: format!("empty file: expected the header `{HEADER}`"),
            });
        }
        Ok(trace)
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

/// The fields of one data row (Time is checked for presence only).
struct Row<'a> {
    thread: &'a str,
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
        let thread = next("Thread")?;
        let _time = next("Time")?;
        let row = Row {
            thread,
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
}

/// Parses a hexadecimal (`0x...`) or decimal integer.
fn parse_int(text: &str) -> Option<u64> {
    match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

fn parse_pointer(text: &str) -> std::result::Result<u64, String> {
    parse_int(text).ok_or_else(|| format!("bad pointer `{text}` (expected hexadecimal 0x... or decimal)"))
}

fn parse_size(text: &str) -> std::result::Result<usize, String> {
    text.parse().map_err(|_| format!("bad size `{text}` (expected a decimal byte count)"))
}

/// The dense index of the `what` (stream or thread) written `text`, added to `values` at
/// its first appearance.
fn intern(
    index: &mut HashMap<u64, usize>,
    values: &mut Vec<u64>,
    what: &str,
    text: &str,
) -> std::result::Result<usize, String> {
    let value = parse_int(text)
        .ok_or_else(|| format!("bad {what} `{text}` (expected an integer or 0x... handle)"))?;
    Ok(*index.entry(value).or_insert_with(|| {
        values.push(value);
        values.len() - 1
    }))
}

/// At most [`EXCERPT`] bytes of `text` (cut at a character boundary), with `...` when cut.
fn excerpt(text: &str) -> String {
    if text.len() <= EXCERPT {
        return text.to_owned();
    }
    let mut end = EXCERPT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes in all)", &text[..end], text.len())
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
        let options = ParseOptions { skip_unknown_frees: true };
        let trace = Trace::parse_with(text.as_bytes(), "t", options).unwrap();
        assert_eq!(trace.skipped_frees, 1);
        assert_eq!(trace.ops, vec![Op::Allocate { slot: 0, size: 4, stream: 0, thread: 0 }]);
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

    #[test]
    fn parses_the_sample_traces() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces");
        for (file, ops, peak) in
            [("gpt2_train.csv", 11_911, 7_701_353_160), ("resnet50_train.csv", 6_620, 3_192_592_912)]
        {
            let trace = Trace::from_path(dir.join(file)).unwrap();
            assert_eq!(trace.name, file);
            assert_eq!(trace.allocations + trace.frees + trace.recorded_failures, ops);
            assert_eq!(trace.peak_live, peak);
        }
    }
}
