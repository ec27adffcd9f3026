//! Allocation traces in RMM's logging CSV format: what the Trace layer
//! ([`Traced`](crate::adaptors::Traced)) writes.
//!
//! The format (see `DESIGN.md` and `traces/README.md`) is a header line
//! `Thread,Time,Action,Pointer,Size,Stream` followed by one row per event. `Time` is in
//! microseconds from any fixed origin; the columns of each [`Action`]:
//!
//! | Action | Pointer | Size | Stream |
//! | --- | --- | --- | --- |
//! | `allocate` | the address returned | bytes asked for | the allocation's stream |
//! | `free` | the address freed | bytes of the allocation | the stream of the free |
//! | `allocate failure` | 0 | bytes asked for | the stream asked on |
//! | `record_stream` | the allocation's address | 0 | the stream recorded on it |
//! | `use` | the allocation's address | nanoseconds the work lasts, from `Time` | the stream running it |
//! | `wait` | the handle of the stream waited for | 0 | the stream that waits |
//!
//! The first three are RMM's own; RMM's reader (its replay benchmark) refuses rows of any
//! other action, so a trace with the last three is read by RMM's tools only with those rows
//! filtered out. [`TraceWriter`] writes the format; reading and replaying traces is the
//! `streamalloc-replay` crate's part.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::error::{Error, Result};

/// The header line of the format.
pub const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

/// What a trace row records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// An allocation succeeded.
    Allocate,
    /// An allocation was freed.
    Free,
    /// An allocation failed.
    AllocateFailure,
    /// A stream was recorded on a live allocation (`record_stream`): once freed, its memory
    /// is not reused before the work enqueued on that stream up to the free is done.
    RecordStream,
    /// Work on the row's stream used the allocation at the row's pointer, from the row's time
    /// for `size` nanoseconds.
    Use,
    /// The row's stream waited for the work enqueued so far on the stream whose handle is
    /// the row's pointer.
    Wait,
}

impl Action {
    /// The word the format uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Allocate => "allocate",
            Action::Free => "free",
            Action::AllocateFailure => "allocate failure",
            Action::RecordStream => "record_stream",
            Action::Use => "use",
            Action::Wait => "wait",
        }
    }

    /// The action a word of the format names, if any.
    pub fn from_word(word: &str) -> Option<Self> {
        Some(match word {
            "allocate" => Action::Allocate,
            "free" => Action::Free,
            "allocate failure" => Action::AllocateFailure,
            "record_stream" => Action::RecordStream,
            "use" => Action::Use,
            "wait" => Action::Wait,
            _ => return None,
        })
    }
}

/// One row of the format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// Recording thread (any integer that tells threads apart).
    pub thread: u64,
    /// Time of the event, in microseconds from any fixed origin.
    pub time_us: u64,
    /// What happened.
    pub action: Action,
    /// The device address (0 for a failure; for a [`Action::Wait`], the handle of the
    /// stream waited for).
    pub ptr: u64,
    /// Bytes asked for (for a free, the size of the allocation freed; for a
    /// [`Action::Use`], the duration in nanoseconds; 0 for the other new actions).
    pub size: usize,
    /// The stream value (e.g. the stream handle).
    pub stream: u64,
}

/// Writes records in the format, buffered; the header is written on creation.
///
/// Call [`TraceWriter::finish`] to flush and see write errors; dropping the writer flushes
/// too but ignores errors.
pub struct TraceWriter<W: Write> {
    out: BufWriter<W>,
}

impl TraceWriter<File> {
    /// Creates (or truncates) the file at `path` and writes the header.
    pub fn create(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = File::create(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        Self::new(file)
    }
}

impl<W: Write> TraceWriter<W> {
    /// Wraps `out` and writes the header.
    pub fn new(out: W) -> Result<Self> {
        let mut out = BufWriter::with_capacity(1 << 16, out);
        writeln!(out, "{HEADER}").map_err(io_error)?;
        Ok(Self { out })
    }

    /// Writes one record.
    pub fn write(&mut self, record: &Record) -> Result<()> {
        writeln!(
            self.out,
            "{},{},{},{:#x},{},{}",
            record.thread,
            record.time_us,
            record.action.as_str(),
            record.ptr,
            record.size,
            record.stream
        )
        .map_err(io_error)
    }

    /// Writes out what is buffered.
    pub fn flush(&mut self) -> Result<()> {
        self.out.flush().map_err(io_error)
    }

    /// Flushes and returns the underlying writer.
    pub fn finish(self) -> Result<W> {
        self.out.into_inner().map_err(|e| Error::Io(format!("flushing trace: {}", e.error())))
    }
}

fn io_error(e: std::io::Error) -> Error {
    Error::Io(format!("writing trace: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writer_writes_the_header_and_one_line_per_record() {
        let mut writer = TraceWriter::new(Vec::new()).unwrap();
        writer
            .write(&Record {
                thread: 1,
                time_us: 10,
                action: Action::Allocate,
                ptr: 0x7f00,
                size: 512,
                stream: 0,
            })
            .unwrap();
        writer
            .write(&Record {
                thread: 1,
                time_us: 11,
                action: Action::AllocateFailure,
                ptr: 0,
                size: 8,
                stream: 3,
            })
            .unwrap();
        let text = String::from_utf8(writer.finish().unwrap()).unwrap();
        assert_eq!(text, format!("{HEADER}\n1,10,allocate,0x7f00,512,0\n1,11,allocate failure,0x0,8,3\n"));
    }

    #[test]
    fn stream_rows_are_written_with_their_words() {
        let mut writer = TraceWriter::new(Vec::new()).unwrap();
        let row = |action, ptr, size, stream| Record { thread: 0, time_us: 5, action, ptr, size, stream };
        writer.write(&row(Action::RecordStream, 0x7f00, 0, 9)).unwrap();
        writer.write(&row(Action::Use, 0x7f00, 1500, 9)).unwrap();
        writer.write(&row(Action::Wait, 9, 0, 0)).unwrap();
        let text = String::from_utf8(writer.finish().unwrap()).unwrap();
        assert_eq!(
            text,
            format!("{HEADER}\n0,5,record_stream,0x7f00,0,9\n0,5,use,0x7f00,1500,9\n0,5,wait,0x9,0,0\n")
        );
        for action in [
            Action::Allocate,
            Action::Free,
            Action::AllocateFailure,
            Action::RecordStream,
            Action::Use,
            Action::Wait,
        ] {
            assert_eq!(Action::from_word(action.as_str()), Some(action));
        }
        assert_eq!(Action::from_word("reserve"), None);
    }
}
