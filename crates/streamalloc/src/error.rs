//! The crate's one error type.

use std::fmt;
use std::time::Duration;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in streamalloc.
///
/// # Examples
///
/// Out-of-memory carries the figures needed to see why, and a hint:
///
/// ```
/// use streamalloc::allocators::{BestFit, BestFitConfig};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::{Allocator, Error};
///
/// let sim = SimDevice::new(SimConfig::with_capacity(64 << 20));
/// let pool = BestFit::new(sim, BestFitConfig::default())?;
/// let kept = pool.allocate(48 << 20)?;
/// match pool.allocate(48 << 20) {
///     Err(Error::OutOfMemory(report)) => {
///         assert_eq!((report.requested, report.allocated), (48 << 20, 48 << 20));
///         assert_eq!(report.device_total, 64 << 20);
///         assert!(!report.hint.is_empty()); // what to do about it
///     }
///     other => panic!("expected out of memory, got {other:?}"),
/// }
/// # drop(kept);
/// # Ok::<(), streamalloc::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The device (or a pool on it) could not satisfy a request, even after the allocator
    /// released what it could. Carries the figures needed to understand why.
    #[error("{0}")]
    OutOfMemory(Box<OutOfMemory>),
    /// A CUDA driver call failed.
    #[error("CUDA driver error {name} ({code}) in {call}")]
    Driver {
        /// The raw `CUresult` value.
        code: i32,
        /// The driver's name for it, e.g. `CUDA_ERROR_INVALID_VALUE`.
        name: String,
        /// The driver entry point that returned it.
        call: &'static str,
    },
    /// The CUDA driver library could not be loaded or initialised.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// A caller passed something the allocator cannot accept.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// One of streamalloc's own invariants is broken (e.g. the policy asked to free a block
    /// that its allocator never got from it): a bug in streamalloc, not in the caller.
    #[error("internal error (a bug in streamalloc): {0}")]
    Internal(String),
    /// The device or mode in use does not offer this operation.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A configured byte limit would be exceeded.
    #[error(
        "limit exceeded on device {device}: requested {requested} bytes with {in_use} in use, limit {limit}"
    )]
    LimitExceeded {
        /// Device ordinal.
        device: usize,
        /// Bytes requested.
        requested: usize,
        /// Bytes already in use under the limit.
        in_use: usize,
        /// The limit in bytes.
        limit: usize,
    },
    /// A bounded wait ran out.
    #[error("timed out after {after:?} waiting for {waited_for}")]
    Timeout {
        /// What the caller was waiting for.
        waited_for: String,
        /// How long it waited.
        after: Duration,
    },
    /// A configuration key or value was not understood.
    #[error("configuration: {0}")]
    Config(String),
    /// A trace file (RMM logging CSV) has a row that cannot be read or replayed.
    #[error("trace line {line}: {reason}: `{content}`")]
    Trace {
        /// 1-based line number in the file.
        line: usize,
        /// The line's text.
        content: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Reading or writing a file failed (the message names the file).
    #[error("I/O error: {0}")]
    Io(String),
    /// Errors met where they could not be returned (in frees, which return nothing), held back
    /// and reported once by the next [`Allocator::release`](crate::Allocator::release).
    #[error("{count} error(s) met by earlier frees, held back until this release; the first: {first}")]
    HeldBack {
        /// How many errors were met.
        count: u64,
        /// The first of them.
        first: Box<Error>,
    },
}

/// Errors held back by an allocator: met where they could not be returned (a free), kept
/// until the next [`Allocator::release`](crate::Allocator::release) reports them as one
/// [`Error::HeldBack`]. Allocations never report them: they were not caused by the
/// allocation.
#[derive(Debug, Default)]
pub struct HeldErrors {
    first: Option<Error>,
    count: u64,
}

/// Calls `f` on every item, going on after a failure (a release, a teardown or a flush must
/// reach every device, pool or chunk); the first error, once all were tried.
pub fn try_each<T>(items: impl IntoIterator<Item = T>, mut f: impl FnMut(T) -> Result<()>) -> Result<()> {
    let mut first = None;
    for item in items {
        if let Err(e) = f(item) {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

impl HeldErrors {
    /// Holds `error` back; the errors of an [`Error::HeldBack`] (another allocator's, met by
    /// an adaptor's release) join these.
    pub fn hold(&mut self, error: Error) {
        let (count, error) = match error {
            Error::HeldBack { count, first } => (count, *first),
            other => (1, other),
        };
        self.count += count;
        self.first.get_or_insert(error);
    }

    /// Reports the errors held back (once: they are cleared).
    pub fn take(&mut self) -> Result<()> {
        let count = std::mem::take(&mut self.count);
        match self.first.take() {
            Some(first) => Err(Error::HeldBack { count, first: Box::new(first) }),
            None => Ok(()),
        }
    }

    /// Whether any error is held back.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

/// Figures attached to an out-of-memory error.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutOfMemory {
    /// Device ordinal.
    pub device: usize,
    /// Whether the memory short is page-locked host memory (kept for `device`): the message
    /// names the host and leaves the device's free and total figures out.
    pub host: bool,
    /// Bytes the caller asked for.
    pub requested: usize,
    /// Bytes handed out to callers and not yet freed.
    pub allocated: usize,
    /// Bytes the allocator holds from the device but has not handed out.
    pub cached: usize,
    /// Bytes freed by callers whose release is still pending on a stream.
    pub pending_release: usize,
    /// Bytes the allocator has reserved from the device in all.
    pub reserved: usize,
    /// Free bytes on the device, as the driver reports them.
    pub device_free: usize,
    /// Total bytes on the device.
    pub device_total: usize,
    /// Extra lines, e.g. one for each of the streams whose pools hold the most. The message
    /// shows the first 16 and counts the rest.
    pub detail: Vec<String>,
    /// What the caller could do about it.
    pub hint: String,
}

impl OutOfMemory {
    /// Whether more device memory was requested than the device has in all: no release or
    /// wait can serve such a request, so none is made.
    pub fn exceeds_device(&self) -> bool {
        !self.host && self.device_total != 0 && self.requested > self.device_total
    }

    /// The hint of a request that [`OutOfMemory::exceeds_device`].
    pub(crate) fn beyond_device_hint(&self) -> String {
        format!(
            "{} bytes is more than the device's {} bytes of memory, which no release or wait could \
             serve (so none was made): allocate less, or split the data across devices",
            self.requested, self.device_total
        )
    }
}

/// Lines of [`OutOfMemory::detail`] an out-of-memory message shows. See DESIGN.md, Note
/// [bounded error messages].
const DETAIL_SHOWN: usize = 16;

impl fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host {
            write!(
                f,
                "out of page-locked host memory (pinned for device {}): requested {} bytes; allocated {}, \
                 cached {}, pending release {}, reserved {}",
                self.device, self.requested, self.allocated, self.cached, self.pending_release, self.reserved
            )?;
        } else {
            write!(
                f,
                "out of memory on device {}: requested {} bytes; allocated {}, cached {}, pending release {}, \
                 reserved {}, device free {} of {}",
                self.device,
                self.requested,
                self.allocated,
                self.cached,
                self.pending_release,
                self.reserved,
                self.device_free,
                self.device_total
            )?;
        }
        for line in self.detail.iter().take(DETAIL_SHOWN) {
            write!(f, "; {line}")?;
        }
        if self.detail.len() > DETAIL_SHOWN {
            write!(f, "; and {} more lines", self.detail.len() - DETAIL_SHOWN)?;
        }
        if !self.hint.is_empty() {
            write!(f, ". {}", self.hint)?;
        }
        Ok(())
    }
}

impl Error {
    /// Whether this error is an out-of-memory condition (the device's or an allocator's).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::OutOfMemory(_))
    }

    /// Builds an [`Error::OutOfMemory`] from its figures.
    pub fn oom(report: OutOfMemory) -> Self {
        Error::OutOfMemory(Box::new(report))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_out_of_memory_message_shows_a_bounded_detail() {
        let report = OutOfMemory {
            requested: 1 << 20,
            detail: (0..10_000).map(|i| format!("stream {i:#x}: allocated {i}")).collect(),
            hint: "free memory".into(),
            ..OutOfMemory::default()
        };
        let text = report.to_string();
        assert!(text.len() < 1024, "{} bytes", text.len());
        assert!(text.contains("stream 0xf: allocated 15; and 9984 more lines. free memory"), "{text}");
        assert!(!text.contains("stream 0x10:"), "{text}");
    }
}
