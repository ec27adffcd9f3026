//! A map kept as a vector sorted by key, for the policy's chunks and stitched chunks: tens to
//! about a thousand entries, looked up and changed when a chunk is added, carved or joined
//! (a stitched chunk's round trip through the pool makes about twenty such lookups and
//! changes). A binary search and a short move of contiguous entries cost less there than a
//! `BTreeMap`'s node walks and allocations, as for the free lists' bins in `best_fit.rs`. See
//! DESIGN.md, Note [sorted vectors for the books].

use std::ops::{Range, RangeInclusive};

/// Entries `(key, value)` in a vector sorted by key, no two with the same key.
#[derive(Debug)]
pub(super) struct Sorted<K, V>(pub(super) Vec<(K, V)>);

impl<K, V> Default for Sorted<K, V> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

impl<K: Ord + Copy, V> Sorted<K, V> {
    /// Inserts `value` at `key`, replacing the value there: the value replaced, if any.
    pub(super) fn insert(&mut self, key: K, value: V) -> Option<V> {
        match self.0.binary_search_by(|e| e.0.cmp(&key)) {
            Ok(i) => self.0.get_mut(i).map(|e| std::mem::replace(&mut e.1, value)),
            Err(i) => {
                self.0.insert(i, (key, value));
                None
            }
        }
    }

    /// Where the entry at `key` is in the vector: valid until an entry is inserted or removed.
    pub(super) fn position(&self, key: &K) -> Option<usize> {
        self.0.binary_search_by(|e| e.0.cmp(key)).ok()
    }

    /// The value at `key`.
    pub(super) fn get(&self, key: &K) -> Option<&V> {
        self.0.get(self.position(key)?).map(|e| &e.1)
    }

    /// The value at `key`, to change it.
    pub(super) fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        let i = self.position(key)?;
        self.0.get_mut(i).map(|e| &mut e.1)
    }

    /// Removes the entry at `key`; its value.
    pub(super) fn remove(&mut self, key: &K) -> Option<V> {
        let i = self.position(key)?;
        Some(self.0.remove(i).1)
    }

    /// Where the entries whose keys lie in `keys` are in the vector.
    pub(super) fn bounds(&self, keys: &RangeInclusive<K>) -> Range<usize> {
        let lo = self.0.partition_point(|e| e.0 < *keys.start());
        lo..self.0.partition_point(|e| e.0 <= *keys.end()).max(lo)
    }

    /// The entries whose keys lie in `keys`.
    pub(super) fn range(&self, keys: RangeInclusive<K>) -> &[(K, V)] {
        self.0.get(self.bounds(&keys)).unwrap_or_default()
    }

    /// The entry with the greatest key below `key`.
    pub(super) fn before(&self, key: K) -> Option<&(K, V)> {
        let i = self.0.partition_point(|e| e.0 < key);
        self.0.get(i.checked_sub(1)?)
    }

    /// The entry with the smallest key at or above `key`.
    pub(super) fn from(&self, key: K) -> Option<&(K, V)> {
        self.0.get(self.0.partition_point(|e| e.0 < key))
    }

    /// The entry with the greatest key at or below `key`.
    pub(super) fn at_or_below(&self, key: K) -> Option<&(K, V)> {
        let i = self.0.partition_point(|e| e.0 <= key);
        self.0.get(i.checked_sub(1)?)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn lookups_find_the_neighbouring_keys() {
        let mut m = Sorted::default();
        for k in [30u64, 10, 20] {
            m.insert(k, k * 2);
        }
        m.insert(20, 41);
        assert_eq!(m.0, [(10, 20), (20, 41), (30, 60)]);
        assert_eq!((m.get(&20), m.get(&25)), (Some(&41), None));
        assert_eq!(m.before(20), Some(&(10, 20)));
        assert_eq!(m.before(10), None);
        assert_eq!(m.at_or_below(20), Some(&(20, 41)));
        assert_eq!(m.at_or_below(29), Some(&(20, 41)));
        assert_eq!(m.at_or_below(9), None);
        assert_eq!(m.from(11), Some(&(20, 41)));
        assert_eq!(m.from(31), None);
        assert_eq!(m.range(15..=30), [(20, 41), (30, 60)]);
        assert_eq!(m.bounds(&(15..=30)), 1..3);
        let (hi, lo) = (30, 20);
        assert!(m.range(31..=40).is_empty() && m.range(hi..=lo).is_empty());
        *m.get_mut(&30).unwrap() += 1;
        let at = m.position(&10).unwrap();
        m.0[at].1 = 0;
        assert_eq!(m.remove(&20), Some(41));
        assert_eq!(m.remove(&20), None);
        assert_eq!(m.0, [(10, 0), (30, 61)]);
    }
}
