//! The live allocations, keyed by pointer: the hot path of every free.

use core_alloc::{Allocation, DevicePtr};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;

/// Shards of the map; a power of two.
const SHARDS: usize = 64;

/// One shard, on its own cache lines so that threads locking neighbours do not contend.
#[repr(align(128))]
struct Shard(Mutex<FxHashMap<DevicePtr, Allocation>>);

/// Live allocations by device pointer, in [`SHARDS`] independently locked shards: no global
/// lock, and no heap allocation per operation beyond the map's own growth.
pub(crate) struct LiveMap {
    shards: Box<[Shard]>,
}

impl LiveMap {
    /// An empty map.
    pub(crate) fn new() -> Self {
        Self { shards: (0..SHARDS).map(|_| Shard(Mutex::new(FxHashMap::default()))).collect() }
    }

    fn shard(&self, ptr: DevicePtr) -> &Mutex<FxHashMap<DevicePtr, Allocation>> {
        // Pointers are 256-byte aligned and often aligned far more (segment starts): drop the
        // zero bits, then take the top bits of a Fibonacci hash, which depend on all the others.
        let h = (ptr >> 8).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SHARDS.trailing_zeros());
        &self.shards[h as usize].0
    }

    /// Keeps `a` (not zero-size) until [`LiveMap::remove`].
    pub(crate) fn insert(&self, a: Allocation) {
        let ptr = a.ptr();
        if let Some(old) = self.shard(ptr).lock().insert(ptr, a) {
            // The allocator handed out a live pointer twice (a bug in it). Dropping the old
            // handle would free memory the new one now owns, so it is leaked instead.
            std::mem::forget(old);
        }
    }

    /// Takes the allocation at `ptr` out of the map; it is dropped by the caller, outside the
    /// shard's lock.
    pub(crate) fn remove(&self, ptr: DevicePtr) -> Option<Allocation> {
        self.shard(ptr).lock().remove(&ptr)
    }

    /// Runs `f` on the allocation at `ptr`, under its shard's lock.
    pub(crate) fn with<R>(&self, ptr: DevicePtr, f: impl FnOnce(&mut Allocation) -> R) -> Option<R> {
        self.shard(ptr).lock().get_mut(&ptr).map(f)
    }
}
