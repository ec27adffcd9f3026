//! `PointerMap`: the [`PointerAllocator`] of any [`StreamAllocator`], keeping its handles in a
//! map by pointer.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use crate::allocation::{Allocation, PointerAllocator, StreamAllocator};
use crate::allocators::insert_roomy;
use crate::device::{DevicePtr, Stream};
use crate::error::Result;

/// Gives any [`StreamAllocator`] (an adaptor stack, an allocator without pointer bookkeeping of
/// its own) the [`PointerAllocator`] interface by keeping each allocation's handle in a map
/// by pointer until it is freed. The map has one shard per allocating thread, so threads
/// that free what they allocate share no lock.
pub struct PointerMap<A> {
    inner: A,
    live: LiveMap,
}

impl<A: StreamAllocator> PointerMap<A> {
    /// Keeps `inner`'s allocations by pointer.
    pub fn new(inner: A) -> Self {
        Self { inner, live: LiveMap::new() }
    }
}

impl<A: StreamAllocator> PointerAllocator for PointerMap<A> {
    fn allocate_ptr(&self, size: usize, stream: Stream) -> Result<DevicePtr> {
        let a = self.inner.allocate_on(size, stream)?;
        let ptr = a.ptr();
        if ptr != 0 {
            self.live.insert(a);
        }
        Ok(ptr)
    }

    fn free_ptr(&self, ptr: DevicePtr, _owner: Stream) -> bool {
        // The handle is dropped (and the memory freed) outside the map's lock.
        self.live.remove(ptr).is_some()
    }

    fn record_stream_ptr(&self, ptr: DevicePtr, stream: Stream) -> bool {
        self.live.with(ptr, |a| a.record_stream(stream)).is_some()
    }
}

/// One thread's share of the map, on its own cache lines.
#[repr(align(128))]
struct Shard(Mutex<FxHashMap<DevicePtr, Allocation>>);

/// Live allocations by device pointer, one shard per thread that allocates: a thread records
/// its allocations in its own shard, and a free made on the same thread (the common case:
/// frameworks free where they allocate) locks only that shard, whose lock and lines no other
/// thread touches, so threads scale. A free from another thread finds the pointer by looking
/// through every shard. Shards outlive their threads (allocations can outlive the thread
/// that made them).
struct LiveMap {
    id: usize,
    shards: Mutex<Vec<Arc<Shard>>>,
}

thread_local! {
    /// This thread's shard of each map, by map id.
    static LOCAL: RefCell<Vec<(usize, Arc<Shard>)>> = const { RefCell::new(Vec::new()) };
}

impl LiveMap {
    /// An empty map.
    fn new() -> Self {
        static NEXT_ID: AtomicUsize = AtomicUsize::new(0);
        Self { id: NEXT_ID.fetch_add(1, Ordering::Relaxed), shards: Mutex::new(Vec::new()) }
    }

    /// Runs `f` on this thread's shard, made and registered on the thread's first use.
    /// `None` while the thread is being torn down (its thread-locals are gone).
    fn local<R>(&self, f: impl FnOnce(&Shard) -> R) -> Option<R> {
        LOCAL
            .try_with(|local| {
                let mut local = local.borrow_mut();
                if let Some((_, shard)) = local.iter().find(|(id, _)| *id == self.id) {
                    return f(shard);
                }
                let shard = Arc::new(Shard(Mutex::new(FxHashMap::default())));
                self.shards.lock().push(shard.clone());
                local.push((self.id, shard.clone()));
                f(&shard)
            })
            .ok()
    }

    /// Keeps `a` (not zero-size) until [`LiveMap::remove`].
    fn insert(&self, a: Allocation) {
        let mut a = Some(a);
        let inserted = self.local(|shard| put(shard, a.take()));
        if inserted.is_none() {
            // A thread being torn down: any shard will do.
            let shards = self.shards.lock();
            match shards.first() {
                Some(shard) => put(shard, a.take()),
                None => {
                    let shard = Arc::new(Shard(Mutex::new(FxHashMap::default())));
                    put(&shard, a.take());
                    drop(shards);
                    self.shards.lock().push(shard);
                }
            }
        }
    }

    /// Takes the allocation at `ptr` out of the map; it is dropped by the caller, outside the
    /// shard's lock.
    fn remove(&self, ptr: DevicePtr) -> Option<Allocation> {
        if let Some(Some(a)) = self.local(|shard| shard.0.lock().remove(&ptr)) {
            return Some(a);
        }
        let shards = self.shards.lock().clone();
        shards.iter().find_map(|shard| shard.0.lock().remove(&ptr))
    }

    /// Runs `f` on the allocation at `ptr`, under its shard's lock.
    fn with<R>(&self, ptr: DevicePtr, f: impl FnOnce(&mut Allocation) -> R) -> Option<R> {
        let mut f = Some(f);
        let mut apply = |shard: &Shard| -> Option<R> {
            let mut map = shard.0.lock();
            let a = map.get_mut(&ptr)?;
            f.take().map(|g| g(a))
        };
        if let Some(Some(r)) = self.local(&mut apply) {
            return Some(r);
        }
        let shards = self.shards.lock().clone();
        shards.iter().find_map(|shard| apply(shard))
    }
}

/// Inserts `a` into `shard`. A pointer already live in it means the allocator handed it out
/// twice (a bug in it): dropping the old handle would free memory the new one owns, so it
/// is leaked instead.
fn put(shard: &Shard, a: Option<Allocation>) {
    if let Some(a) = a {
        if let Some(old) = insert_roomy(&mut shard.0.lock(), a.ptr(), a) {
            std::mem::forget(old);
        }
    }
}
