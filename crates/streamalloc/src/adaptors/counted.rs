//! `Counted`: byte and count statistics per stream, with resettable peaks and scopes.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::{FreeHook, Owners};
use crate::allocation::{Allocation, Allocator, Block, BlockOwner, Stats, StreamAllocator};
use crate::device::Stream;
use crate::error::Result;

/// Figures for one stream, for all streams, or for one scope.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Bytes allocated and not yet freed (in a scope: beyond what was live when it opened).
    pub current: usize,
    /// Peak of `current` since creation, the last [`Counted::reset_peaks`], or the
    /// scope's opening.
    pub peak: usize,
    /// Bytes allocated in all.
    pub total: usize,
    /// Allocations made.
    pub allocations: u64,
    /// Frees made.
    pub frees: u64,
}

impl StreamStats {
    fn on_allocate(&mut self, size: usize) {
        self.current += size;
        self.peak = self.peak.max(self.current);
        self.total += size;
        self.allocations += 1;
    }

    fn on_free(&mut self, size: usize) {
        self.current = self.current.saturating_sub(size);
        self.frees += 1;
    }
}

/// Counts bytes and operations per owning stream and in all, on top of the wrapped
/// allocator's own [`Stats`] (which [`Allocator::stats`] still returns).
///
/// # Examples
///
/// ```
/// use streamalloc::adaptors::Counted;
/// use streamalloc::allocators::{StreamSafe, StreamSafeConfig};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::{Streams, StreamAllocator};
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let stats = Counted::new(StreamSafe::new(sim.clone(), StreamSafeConfig::default())?);
/// let (s1, s2) = (sim.create_stream()?, sim.create_stream()?);
/// let a = stats.allocate_on(1 << 20, s1)?;
/// drop(stats.allocate_on(2 << 20, s2)?);
/// assert_eq!(stats.totals().current, 1 << 20);
/// assert_eq!(stats.totals().peak, 3 << 20);
/// assert_eq!(stats.per_stream().len(), 2); // s1 and s2, each with its own figures
/// # drop(a);
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct Counted<A> {
    inner: A,
    shared: Arc<Shared>,
    owners: Owners<Shared>,
}

struct Shared {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    all: StreamStats,
    per_stream: HashMap<Stream, StreamStats>,
    /// Open scopes: id -> figures since the scope opened.
    scopes: Vec<(u64, StreamStats)>,
    next_scope: u64,
}

/// An open measurement scope (see [`Counted::scope`]); closes when dropped.
pub struct Scope {
    shared: Arc<Shared>,
    id: u64,
}

impl Scope {
    /// Figures since the scope opened.
    pub fn stats(&self) -> StreamStats {
        let state = self.shared.state.lock();
        state.scopes.iter().find(|(id, _)| *id == self.id).map(|(_, s)| *s).unwrap_or_default()
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        self.shared.state.lock().scopes.retain(|(id, _)| *id != self.id);
    }
}

impl<A: Allocator> Counted<A> {
    /// Wraps `inner`.
    pub fn new(inner: A) -> Self {
        Self { inner, shared: Arc::new(Shared { state: Mutex::default() }), owners: Owners::new() }
    }

    /// Figures over all streams.
    pub fn totals(&self) -> StreamStats {
        self.shared.state.lock().all
    }

    /// Figures per owning stream, sorted by stream.
    pub fn per_stream(&self) -> Vec<(Stream, StreamStats)> {
        let mut v: Vec<_> = self.shared.state.lock().per_stream.iter().map(|(s, f)| (*s, *f)).collect();
        v.sort_by_key(|(s, _)| *s);
        v
    }

    /// Sets every peak to the current figure.
    pub fn reset_peaks(&self) {
        let mut state = self.shared.state.lock();
        state.all.peak = state.all.current;
        for s in state.per_stream.values_mut() {
            s.peak = s.current;
        }
    }

    /// Opens a scope that measures from now until it is dropped. Scopes nest freely.
    pub fn scope(&self) -> Scope {
        let mut state = self.shared.state.lock();
        state.next_scope += 1;
        let id = state.next_scope;
        state.scopes.push((id, StreamStats::default()));
        Scope { shared: self.shared.clone(), id }
    }

    fn adopt(&self, a: Allocation) -> Allocation {
        self.owners.adopt(&self.shared, a, |block| self.shared.on_allocate(block.size, block.stream))
    }
}

impl Shared {
    fn on_allocate(&self, size: usize, stream: Stream) {
        let mut state = self.state.lock();
        state.all.on_allocate(size);
        state.per_stream.entry(stream).or_default().on_allocate(size);
        for (_, s) in &mut state.scopes {
            s.on_allocate(size);
        }
    }

    fn on_free(&self, size: usize, stream: Stream) {
        let mut state = self.state.lock();
        state.all.on_free(size);
        if let Some(s) = state.per_stream.get_mut(&stream) {
            s.on_free(size);
        }
        for (_, s) in &mut state.scopes {
            s.on_free(size);
        }
    }
}

impl FreeHook for Shared {
    fn free(&self, block: Block, inner: &dyn BlockOwner) {
        self.on_free(block.size, block.stream);
        inner.free(block);
    }
}

impl<A: Allocator> Allocator for Counted<A> {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        Ok(self.adopt(self.inner.allocate(size)?))
    }
    fn release(&self) -> Result<usize> {
        self.inner.release()
    }
    fn stats(&self) -> Stats {
        self.inner.stats()
    }
    /// The wrapped allocator's peaks, and this adaptor's ([`Counted::reset_peaks`]).
    fn reset_peak_stats(&self) {
        self.inner.reset_peak_stats();
        self.reset_peaks();
    }
    fn device(&self) -> usize {
        self.inner.device()
    }
    fn segments(&self, out: &mut Vec<crate::allocation::Segment>) -> Result<()> {
        self.inner.segments(out)
    }
}

impl<A: StreamAllocator> StreamAllocator for Counted<A> {
    fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation> {
        Ok(self.adopt(self.inner.allocate_on(size, stream)?))
    }
    pass_through_default_stream!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocators::Plain;
    use crate::device::sim::{SimConfig, SimDevice};

    #[test]
    fn peaks_reset_and_scopes_nest() {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        let s = Counted::new(Plain::new(sim, Stream::DEFAULT));
        let a = s.allocate(1000).unwrap();
        let b = s.allocate(3000).unwrap();
        drop(b);
        assert_eq!((s.totals().current, s.totals().peak, s.totals().total), (1000, 4000, 4000));
        s.reset_peaks();
        assert_eq!(s.totals().peak, 1000);
        let outer = s.scope();
        let c = s.allocate(500).unwrap();
        {
            let inner = s.scope();
            let d = s.allocate(200).unwrap();
            drop(d);
            assert_eq!((inner.stats().allocations, inner.stats().frees, inner.stats().peak), (1, 1, 200));
        }
        drop(c);
        let o = outer.stats();
        assert_eq!((o.allocations, o.frees, o.peak, o.current), (2, 2, 700, 0));
        assert_eq!(s.per_stream(), vec![(Stream::DEFAULT, s.totals())]);
        drop(a);
        assert_eq!(s.totals().current, 0);
    }
}
