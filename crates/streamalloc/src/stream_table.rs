//! `StreamSlots`: the one table of per-stream slots, found by a hash of the stream's handle
//! and a short linear probe, that both [`Pointers`](crate::adaptors::Pointers) (a shard of its
//! table claimed per stream) and [`StreamSafe`](crate::allocators::StreamSafe) (its pools,
//! found without a lock) use.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::device::Stream;

/// The handle of no stream: a slot nobody holds. A stream with this handle finds no slot.
pub(crate) const NO_STREAM: u64 = u64::MAX;

/// Slots held by streams: slot `i` holds a stream's handle or [`NO_STREAM`]. A stream looks at
/// `probe` slots from its home on (a Fibonacci hash of its handle); what a slot stands for (a
/// shard, a pool) is the caller's, in arrays of the same length. Reads are lock-free; the
/// writers say who may take a slot ([`StreamSlots::claim`], [`StreamSlots::vacant`]).
pub(crate) struct StreamSlots {
    /// The holders, in an allocation apart from what they stand for (read at every lookup,
    /// written only when a stream takes or leaves a slot).
    holders: Box<[AtomicU64]>,
    /// log2 of the number of slots.
    bits: u32,
    /// Slots a stream looks at, from its home on.
    probe: usize,
}

impl StreamSlots {
    /// `slots` slots (a power of two, at most 2^32), each stream looking at `probe` of them
    /// (at most `slots`).
    pub(crate) fn new(slots: usize, probe: usize) -> Self {
        assert!(slots.is_power_of_two() && slots <= 1 << 32 && (1..=slots).contains(&probe));
        let holders = (0..slots).map(|_| AtomicU64::new(NO_STREAM)).collect();
        Self { holders, bits: slots.trailing_zeros(), probe }
    }

    /// The number of slots.
    pub(crate) fn len(&self) -> usize {
        self.holders.len()
    }

    /// Where `stream` starts looking: Fibonacci hashing, as stream handles are pointers
    /// (aligned) or small integers.
    #[inline]
    pub(crate) fn home(&self, stream: Stream) -> usize {
        if self.bits == 0 {
            return 0;
        }
        (stream.raw().wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (u64::BITS - self.bits)) as usize
    }

    /// The slots `stream` looks at, its home first.
    #[inline]
    pub(crate) fn probe(&self, stream: Stream) -> impl Iterator<Item = usize> + '_ {
        let (home, mask) = (self.home(stream), self.len() - 1);
        (0..self.probe).map(move |k| (home + k) & mask)
    }

    /// The stream holding slot `i` ([`NO_STREAM`] if none), read with acquire ordering (what
    /// the holder wrote before [`StreamSlots::hold`] is seen).
    #[inline]
    pub(crate) fn holder(&self, i: usize) -> u64 {
        self.holders[i].load(Ordering::Acquire)
    }

    /// The first slot `stream` holds among those it looks at: at its home, where it mostly is,
    /// or past it.
    #[inline]
    pub(crate) fn find(&self, stream: Stream) -> Option<usize> {
        let home = self.home(stream);
        if stream.raw() != NO_STREAM && self.holder(home) == stream.raw() {
            return Some(home);
        }
        self.find_past_home(stream)
    }

    /// [`StreamSlots::find`] past the home slot.
    #[inline(never)]
    fn find_past_home(&self, stream: Stream) -> Option<usize> {
        if stream.raw() == NO_STREAM {
            return None;
        }
        self.probe(stream).skip(1).find(|&i| self.holder(i) == stream.raw())
    }

    /// Every slot `stream` holds among those it looks at.
    pub(crate) fn held_by(&self, stream: Stream) -> impl Iterator<Item = usize> + '_ {
        self.probe(stream).filter(move |&i| stream.raw() != NO_STREAM && self.holder(i) == stream.raw())
    }

    /// Takes the first slot `stream` looks at that nobody holds or whose holder `may_take`
    /// gives up (given the slot and its holder), by compare-and-swap, so that claims racing
    /// on one slot take it once; `None` if none could be taken.
    pub(crate) fn claim(
        &self,
        stream: Stream,
        mut may_take: impl FnMut(usize, u64) -> bool,
    ) -> Option<usize> {
        if stream.raw() == NO_STREAM {
            return None;
        }
        self.probe(stream).find(|&i| {
            let holder = self.holders[i].load(Ordering::Relaxed);
            (holder == NO_STREAM || may_take(i, holder))
                && self.holders[i]
                    .compare_exchange(holder, stream.raw(), Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
        })
    }

    /// The first slot `stream` looks at that nobody holds, for a caller that serializes the
    /// writes of the table itself (then [`StreamSlots::hold`]).
    pub(crate) fn vacant(&self, stream: Stream) -> Option<usize> {
        if stream.raw() == NO_STREAM {
            return None;
        }
        self.probe(stream).find(|&i| self.holder(i) == NO_STREAM)
    }

    /// Makes `stream` the holder of slot `i` (release ordering: what the caller wrote for the
    /// slot before is seen by a lookup that finds `stream` there).
    pub(crate) fn hold(&self, i: usize, stream: Stream) {
        self.holders[i].store(stream.raw(), Ordering::Release);
    }

    /// Empties slot `i`.
    pub(crate) fn leave(&self, i: usize) {
        self.holders[i].store(NO_STREAM, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_of_one_home_take_the_slots_after_it_and_find_them_again() {
        let slots = StreamSlots::new(256, 8);
        let first = Stream::forged(3);
        let home = slots.home(first);
        let alike: Vec<Stream> = std::iter::once(first)
            .chain((4..).map(Stream::forged).filter(|&s| slots.home(s) == home))
            .take(9)
            .collect();
        for (k, &s) in alike[..8].iter().enumerate() {
            assert_eq!(slots.find(s), None);
            assert_eq!(slots.claim(s, |_, _| false), Some((home + k) % 256));
            assert_eq!(slots.find(s), Some((home + k) % 256));
        }
        // The ninth finds every slot it looks at held, unless a holder gives one up.
        assert_eq!(slots.claim(alike[8], |_, _| false), None);
        assert_eq!(slots.claim(alike[8], |_, holder| holder == alike[2].raw()), Some((home + 2) % 256));
        assert_eq!((slots.find(alike[2]), slots.find(alike[8])), (None, Some((home + 2) % 256)));
        slots.leave((home + 2) % 256);
        assert_eq!(slots.vacant(alike[2]), Some((home + 2) % 256));
        slots.hold((home + 2) % 256, alike[2]);
        assert_eq!(slots.held_by(alike[2]).collect::<Vec<_>>(), vec![(home + 2) % 256]);
        assert_eq!(
            (slots.find(Stream::forged(NO_STREAM)), slots.claim(Stream::forged(NO_STREAM), |_, _| true)),
            (None, None)
        );
    }

    #[test]
    fn the_hash_is_the_one_both_tables_used() {
        // Pointers' shards and StreamSafe's slots (256 each) had `hash >> 56`.
        let slots = StreamSlots::new(256, 8);
        for s in [0u64, 1, 7, 0x7f00_dead_beef, u64::MAX - 1] {
            assert_eq!(slots.home(Stream::forged(s)), (s.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize);
        }
    }
}
