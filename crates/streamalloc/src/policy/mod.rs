//! Pure allocation policy: free lists, splitting, coalescing, size classes and stream
//! bookkeeping, on integer addresses. No `unsafe` and no driver calls.

pub mod best_fit;

/// Alignment of every pointer handed out, and the unit of every block size, in bytes.
pub const ALIGNMENT: usize = 256;

/// A range of addresses: the `len` bytes from `addr`, `[addr, addr + len)` (a chunk, a mapped
/// run, a stitched range or its home). Plain integers, as the policy works on; it does not check
/// that `addr + len` stays below 2^64 (ranges of device memory do). Ordered by address, then
/// length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct AddrRange {
    /// The first address.
    pub addr: u64,
    /// Bytes in the range.
    pub len: u64,
}

impl AddrRange {
    /// The `len` bytes from `addr`.
    pub const fn new(addr: u64, len: u64) -> Self {
        Self { addr, len }
    }

    /// The address just past the range: `addr + len`.
    pub const fn end(self) -> u64 {
        self.addr + self.len
    }

    /// Whether each range starts before the other ends: they share a byte, or one is empty
    /// and starts inside the other.
    pub const fn overlaps(self, other: AddrRange) -> bool {
        self.addr < other.end() && other.addr < self.end()
    }
}

#[cfg(test)]
mod tests {
    use super::AddrRange;

    #[test]
    fn an_addr_range_ends_past_its_last_byte_and_sorts_as_its_tuple_did() {
        let r = AddrRange::new(0x1000, 0x200);
        assert_eq!(r.end(), 0x1200);
        assert!(r.overlaps(AddrRange::new(0x11ff, 1)) && r.overlaps(AddrRange::new(0, 0x1001)));
        assert!(!r.overlaps(AddrRange::new(0x1200, 8)) && !r.overlaps(AddrRange::new(0, 0x1000)));
        assert!(r.overlaps(AddrRange::new(0x1100, 0)) && !r.overlaps(AddrRange::new(0x1000, 0)));
        // By address, then length: as the `(addr, len)` tuples it replaces were sorted.
        let mut v = [(3, 1), (1, 5), (1, 2), (2, 0)];
        let mut ranges = v.map(|(addr, len)| AddrRange::new(addr, len));
        v.sort_unstable();
        ranges.sort_unstable();
        assert_eq!(ranges, v.map(|(addr, len)| AddrRange::new(addr, len)));
    }
}
