//! `PinnedHost`: a caching pool of page-locked host memory, reused in stream order.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use crate::allocation::Stats;
use crate::device::{CaptureStatus, Device, Event, EventPool, HostPtr, Stream};
use crate::error::{Error, HeldErrors, OutOfMemory, Result};

/// Settings of a [`PinnedHost`] pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedHostConfig {
    /// The smallest block, in bytes (a power of two): smaller requests get a block this size.
    /// Default 4096, a page, the least the driver pins.
    pub min_block: usize,
    /// How long dropping the pool waits, in all, for the streams' work on blocks freed after
    /// use; a block whose work outlasts it is left allocated rather than freed under a copy.
    /// Default 2 s.
    pub wait_timeout: Duration,
}

impl Default for PinnedHostConfig {
    fn default() -> Self {
        Self { min_block: 4096, wait_timeout: Duration::from_secs(2) }
    }
}

/// A caching pool of page-locked (pinned) host memory, the staging memory of fast
/// asynchronous copies between the host and devices (PyTorch's `CachingHostAllocator`).
///
/// * **Blocks.** Each block is one
///   [`HostMemory::host_alloc`](crate::device::HostMemory::host_alloc) of a power of two bytes
///   (at least [`PinnedHostConfig::min_block`]); a request takes a free block of its own size
///   class, never a piece of a larger one.
/// * **Stream order.** A block that streams used ([`PinnedHost::record_stream_ptr`],
///   [`PinnedBuffer::record_stream`]) returns to its class only once an event recorded on each
///   of them at the free has completed; allocations query those events and never wait.
/// * **Graphs.** A block used by a capturing stream is never handed out again (it counts as
///   pending release). See DESIGN.md, Note [pinned blocks used by captures].
/// * **Devices.** The pool pins through one device's context and serves every device; each
///   recorded stream's event is made on that stream's device.
/// * **Release.** [`PinnedHost::release`] gives the free blocks back; so does an allocation
///   that runs out of memory, before it tries once more.
/// * **Statistics** ([`Stats`]): `reserved` is the bytes pinned, `device_allocs` and
///   `device_frees` the pinned allocations and frees; the rest as the device allocators'.
///
/// Handles ([`PinnedHost::allocate`]) and pointers ([`PinnedHost::allocate_ptr`],
/// [`PinnedHost::free_ptr`]) share one table. Dropping the pool frees what it holds, blocks
/// handed out by pointer included (their pointers must not be used after that); handles keep
/// it alive.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use streamalloc::allocators::{PinnedHost, PinnedHostConfig};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::device::Device;
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let device: Arc<dyn Device> = sim.clone();
/// let pool = PinnedHost::new(device.clone(), PinnedHostConfig::default())?;
/// let copies = device.create_stream()?;
/// let mut staging = pool.allocate(3 << 20)?; // a block of 4 MiB
/// sim.use_host(staging.ptr(), staging.size(), copies, 1_000_000)?; // a copy from it on `copies`
/// staging.record_stream(&device, copies)?;
/// let first = staging.ptr();
/// drop(staging); // reused once the copy has completed
/// assert_ne!(pool.allocate(3 << 20)?.ptr(), first);
/// device.synchronize_stream(copies)?;
/// assert_eq!(pool.allocate(3 << 20)?.ptr(), first);
/// assert_eq!(pool.stats().reserved, 8 << 20);
/// assert_eq!(pool.release()?, 8 << 20);
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct PinnedHost {
    inner: Arc<Inner>,
}

/// Page-locked host memory from a [`PinnedHost`] pool, freed (in stream order) when dropped.
/// A zero-size buffer has a null pointer and frees nothing.
pub struct PinnedBuffer {
    pool: Arc<Inner>,
    ptr: HostPtr,
    size: usize,
}

struct Inner {
    /// The device whose context pins the memory.
    host: Arc<dyn Device>,
    /// log2 of [`PinnedHostConfig::min_block`].
    min_class: u32,
    wait: Duration,
    state: Mutex<State>,
    /// The events of each device whose streams were recorded.
    devices: Mutex<Vec<Arc<DeviceEvents>>>,
}

/// A device and the events the pool records on its streams.
struct DeviceEvents {
    device: Arc<dyn Device>,
    events: EventPool,
}

#[derive(Default)]
struct State {
    /// Every block the pool holds, by address.
    blocks: FxHashMap<HostPtr, Block>,
    /// Free blocks by class (log2 of their bytes), the latest freed last.
    free: Vec<Vec<HostPtr>>,
    /// Blocks freed after use whose events have not all completed, oldest first.
    pending: VecDeque<Pending>,
    stats: Stats,
    /// Bytes of the blocks in `free`.
    cached: usize,
    /// Bytes of the blocks in `pending`.
    pending_bytes: usize,
    /// Bytes of blocks never handed out again (see [`PinnedHost`]'s graphs), and of the
    /// blocks of `orphans`.
    stuck_bytes: usize,
    /// Blocks freed with a recorded stream no event could be recorded on (destroyed before
    /// the free), with the devices of all their recorded streams: free again once those
    /// devices have synchronized.
    orphans: Vec<(HostPtr, usize, Vec<Arc<DeviceEvents>>)>,
    /// Errors met where they could not be returned, reported by the next release.
    held: HeldErrors,
}

struct Block {
    /// log2 of the block's bytes.
    class: u32,
    /// The size asked for, while the block is handed out.
    live: Option<usize>,
    /// The streams that used it while handed out, with their devices.
    users: Vec<(Arc<DeviceEvents>, Stream)>,
    /// Whether a stream used it while capturing a graph.
    captured: bool,
}

/// A block freed after use, and the events recorded on its users at the free that have not
/// completed yet.
struct Pending {
    ptr: HostPtr,
    bytes: usize,
    events: Vec<(Arc<DeviceEvents>, Event)>,
}

/// The size class of a request of `size` bytes (not 0): log2 of its block's bytes, the next
/// power of two and at least `2^min_class`. `None` past `isize::MAX` bytes.
fn class_of(size: usize, min_class: u32) -> Option<u32> {
    if size > isize::MAX as usize {
        return None;
    }
    Some(size.checked_next_power_of_two()?.trailing_zeros().max(min_class))
}

impl PinnedHost {
    /// A pool that pins memory through `host` (any device: the memory serves them all).
    /// [`Error::InvalidArgument`] unless [`PinnedHostConfig::min_block`] is a power of two.
    pub fn new(host: Arc<dyn Device>, config: PinnedHostConfig) -> Result<Self> {
        if !config.min_block.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "PinnedHost: min_block {} is not a power of two",
                config.min_block
            )));
        }
        let inner = Inner {
            host,
            min_class: config.min_block.trailing_zeros(),
            wait: config.wait_timeout,
            state: Mutex::new(State::default()),
            devices: Mutex::new(Vec::new()),
        };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// A buffer of `size` bytes, freed when dropped.
    pub fn allocate(&self, size: usize) -> Result<PinnedBuffer> {
        let ptr = self.allocate_ptr(size)?;
        Ok(PinnedBuffer { pool: self.inner.clone(), ptr, size })
    }

    /// Allocates `size` bytes and keeps the block until [`PinnedHost::free_ptr`]; the
    /// address. Size 0 gives the null pointer and keeps nothing.
    pub fn allocate_ptr(&self, size: usize) -> Result<HostPtr> {
        if size == 0 {
            return Ok(0);
        }
        let inner = &self.inner;
        let Some(class) = class_of(size, inner.min_class) else {
            inner.state.lock().stats.failures += 1;
            return Err(Error::InvalidArgument(format!(
                "pinned allocation of {size} bytes: larger than any can be"
            )));
        };
        inner.poll(false);
        if let Some(ptr) = inner.state.lock().take_free(class, size) {
            return Ok(ptr);
        }
        if inner.poll(true) {
            if let Some(ptr) = inner.state.lock().take_free(class, size) {
                return Ok(ptr);
            }
        }
        inner.grow(class, size)
    }

    /// Frees the block at `ptr`: at once if no stream used it, else once the work its
    /// streams have enqueued so far has completed. The size it was asked with, or `None` if
    /// the pool handed out no block at `ptr` (or it was freed already).
    pub fn free_ptr(&self, ptr: HostPtr) -> Option<usize> {
        self.inner.free(ptr)
    }

    /// Says that work enqueued on `stream`, a stream of `device`, until the block at `ptr` is
    /// freed uses it (a copy from or to it): the block is not handed out again before that
    /// work has completed. Recording a stream twice does nothing more. `Ok(false)` if the pool
    /// handed out no block at `ptr`; an error, recording nothing, when `stream` is not a live
    /// stream of `device`.
    pub fn record_stream_ptr(&self, ptr: HostPtr, device: &Arc<dyn Device>, stream: Stream) -> Result<bool> {
        self.inner.record(ptr, device, stream)
    }

    /// Whether the pool handed out the block at `ptr` and it is not freed yet.
    pub fn is_live(&self, ptr: HostPtr) -> bool {
        self.inner.state.lock().blocks.get(&ptr).is_some_and(|b| b.live.is_some())
    }

    /// Gives the free blocks back (`cuMemFreeHost`), after moving those whose streams' work
    /// has completed to the free lists; the bytes given back. Then reports the errors that
    /// frees met since the last release, if any. Waits for nothing, except after a free whose
    /// recorded stream was destroyed first: that block's device is synchronized (all its
    /// work, the destroyed stream's included, as `cuMemFree` waits), and the block is free
    /// again.
    pub fn release(&self) -> Result<usize> {
        self.inner.adopt_orphans();
        self.inner.poll(true);
        let released = self.inner.release_free();
        self.inner.state.lock().held.take()?;
        Ok(released)
    }

    /// A snapshot of the pool's statistics.
    pub fn stats(&self) -> Stats {
        let st = self.inner.state.lock();
        let largest = st.free.iter().enumerate().rev().find(|(_, list)| !list.is_empty());
        Stats {
            cached: st.cached,
            largest_free_block: largest.map_or(0, |(class, _)| 1 << class),
            pending_release: st.pending_bytes + st.stuck_bytes,
            ..st.stats
        }
    }

    /// Restarts `allocated_peak` and `reserved_peak` from the current figures.
    pub fn reset_peak_stats(&self) {
        self.inner.state.lock().stats.reset_peaks();
    }
}

impl PinnedBuffer {
    /// The host address (null for a zero-size buffer).
    pub fn ptr(&self) -> HostPtr {
        self.ptr
    }

    /// The address as a raw pointer, for the host to write and read through (`size` bytes).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr as usize as *mut u8
    }

    /// The size asked for, in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// [`PinnedHost::record_stream_ptr`] for this buffer: work enqueued on `stream`, a stream
    /// of `device`, until the buffer is dropped uses it.
    pub fn record_stream(&mut self, device: &Arc<dyn Device>, stream: Stream) -> Result<()> {
        if self.ptr != 0 {
            self.pool.record(self.ptr, device, stream)?;
        }
        Ok(())
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.ptr != 0 {
            self.pool.free(self.ptr);
        }
    }
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("size", &self.size)
            .finish()
    }
}

impl State {
    /// Hands out a free block of `class` for a request of `size` bytes, if there is one.
    fn take_free(&mut self, class: u32, size: usize) -> Option<HostPtr> {
        let ptr = self.free.get_mut(class as usize)?.pop()?;
        self.cached -= 1 << class;
        if let Some(block) = self.blocks.get_mut(&ptr) {
            block.live = Some(size);
        }
        self.stats.on_allocate(size);
        Some(ptr)
    }

    /// Puts the block at `ptr`, of `class`, in the free lists.
    fn put_free(&mut self, ptr: HostPtr, class: u32) {
        let class = class as usize;
        if self.free.len() <= class {
            self.free.resize_with(class + 1, Vec::new);
        }
        self.free[class].push(ptr);
        self.cached += 1 << class;
    }
}

impl Inner {
    /// The events of `device`, kept from its first recorded stream on.
    fn events_of(&self, device: &Arc<dyn Device>) -> Arc<DeviceEvents> {
        let mut devices = self.devices.lock();
        if let Some(known) = devices.iter().find(|d| Arc::ptr_eq(&d.device, device)) {
            return known.clone();
        }
        let made = Arc::new(DeviceEvents { device: device.clone(), events: EventPool::new(device.clone()) });
        devices.push(made.clone());
        made
    }

    fn record(&self, ptr: HostPtr, device: &Arc<dyn Device>, stream: Stream) -> Result<bool> {
        device.check_stream(stream)?;
        let capturing = device.capture_status(stream)? != CaptureStatus::None;
        let events = self.events_of(device);
        let mut st = self.state.lock();
        let Some(block) = st.blocks.get_mut(&ptr).filter(|b| b.live.is_some()) else { return Ok(false) };
        block.captured |= capturing;
        if !block.users.iter().any(|(d, s)| Arc::ptr_eq(d, &events) && *s == stream) {
            block.users.push((events, stream));
        }
        Ok(true)
    }

    fn free(&self, ptr: HostPtr) -> Option<usize> {
        let (size, class, users, captured) = {
            let mut guard = self.state.lock();
            let st = &mut *guard;
            let block = st.blocks.get_mut(&ptr)?;
            let size = block.live.take()?;
            let (class, users, captured) =
                (block.class, std::mem::take(&mut block.users), std::mem::take(&mut block.captured));
            st.stats.on_free(size);
            if users.is_empty() && !captured {
                st.put_free(ptr, class);
                return Some(size);
            }
            (size, class, users, captured)
        };
        self.free_used(ptr, 1 << class, users, captured);
        Some(size)
    }

    /// The slow part of a free: an event recorded on each user, and the block pending on
    /// them; or, when a user captures a graph (or did), the block kept out of use for good,
    /// and when an event cannot be recorded (a destroyed stream), until a release has
    /// synchronized the stream's device.
    fn free_used(&self, ptr: HostPtr, bytes: usize, users: Vec<(Arc<DeviceEvents>, Stream)>, captured: bool) {
        let mut events = Vec::with_capacity(users.len());
        let mut stuck = captured;
        let mut failed = None;
        let mut orphaned = false;
        let devices: Vec<Arc<DeviceEvents>> = users.iter().map(|(user, _)| user.clone()).collect();
        for (user, stream) in users {
            if stuck || failed.is_some() {
                break;
            }
            let recorded = user.device.capture_status(stream).and_then(|status| {
                if status != CaptureStatus::None {
                    return Ok(false);
                }
                let event = user.events.get()?;
                events.push((user.clone(), event));
                user.device.record_event(event, stream).map(|()| true)
            });
            match recorded {
                Ok(recorded) => stuck = !recorded,
                // Issue 52, #12: say which block, which stream and what follows.
                Err(Error::InvalidArgument(m)) => {
                    orphaned = true;
                    failed = Some(Error::InvalidArgument(format!(
                        "the pinned block at {ptr:#x} was freed with stream {:#x} recorded on it, which cannot \
                         be waited for ({m}; destroyed before the free?): the block is kept out of use until \
                         a release has waited for its device; free pinned buffers before destroying the \
                         streams recorded on them",
                        stream.raw()
                    )))
                }
                Err(e) => failed = Some(e),
            }
        }
        let mut st = self.state.lock();
        if !stuck && failed.is_none() {
            st.pending_bytes += bytes;
            st.pending.push_back(Pending { ptr, bytes, events });
            return;
        }
        st.stuck_bytes += bytes;
        if let Some(e) = failed {
            st.held.hold(e);
        }
        if orphaned && !stuck {
            st.orphans.push((ptr, bytes, devices));
        }
        drop(st);
        for (user, event) in events {
            user.events.put(event);
        }
    }

    /// Puts the blocks freed with a destroyed recorded stream back in the free lists once the
    /// devices of their recorded streams have synchronized (a block one of whose devices
    /// fails to stays out of use; the error is held).
    fn adopt_orphans(&self) {
        let orphans = std::mem::take(&mut self.state.lock().orphans);
        if orphans.is_empty() {
            return;
        }
        // Each device synchronized once: (the device's address, whether it succeeded).
        let mut synced: Vec<(*const (), bool)> = Vec::new();
        let mut failures = Vec::new();
        let mut kept = Vec::new();
        for (ptr, bytes, devices) in orphans {
            let mut all = true;
            for user in &devices {
                let key = Arc::as_ptr(&user.device).cast::<()>();
                let ok = match synced.iter().find(|(k, _)| *k == key) {
                    Some(&(_, ok)) => ok,
                    None => {
                        let result = user.device.synchronize();
                        let ok = result.is_ok();
                        failures.extend(result.err());
                        synced.push((key, ok));
                        ok
                    }
                };
                all &= ok;
            }
            if !all {
                kept.push((ptr, bytes, devices));
                continue;
            }
            let mut st = self.state.lock();
            st.stuck_bytes -= bytes;
            if let Some(class) = st.blocks.get(&ptr).map(|b| b.class) {
                st.put_free(ptr, class);
            }
        }
        let mut st = self.state.lock();
        for e in failures {
            st.held.hold(e);
        }
        st.orphans.extend(kept);
    }

    /// Moves pending blocks whose events have all completed to the free lists, querying the
    /// events outside the lock; never waits. With `all`, every pending block is looked at;
    /// else the oldest, until one is still busy. Whether any block became free.
    fn poll(&self, all: bool) -> bool {
        if all {
            let mut batch = std::mem::take(&mut self.state.lock().pending);
            let before = batch.len();
            batch.retain_mut(|p| !self.query(p));
            let freed = batch.len() < before;
            let mut st = self.state.lock();
            batch.append(&mut st.pending);
            st.pending = batch;
            return freed;
        }
        let mut freed = false;
        loop {
            let Some(mut p) = self.state.lock().pending.pop_front() else { return freed };
            if !self.query(&mut p) {
                self.state.lock().pending.push_front(p);
                return freed;
            }
            freed = true;
        }
    }

    /// Drops the completed events of `p` and, when none is left, puts its block in the free
    /// lists; whether it did. A failing query keeps its event (held as an error).
    fn query(&self, p: &mut Pending) -> bool {
        let mut failed = None;
        p.events.retain(|(user, event)| match user.device.query_event(*event) {
            Ok(true) => {
                user.events.put(*event);
                false
            }
            Ok(false) => true,
            Err(e) => {
                failed.get_or_insert(e);
                true
            }
        });
        let mut st = self.state.lock();
        if let Some(e) = failed {
            st.held.hold(e);
        }
        if !p.events.is_empty() {
            return false;
        }
        st.pending_bytes -= p.bytes;
        if let Some(class) = st.blocks.get(&p.ptr).map(|b| b.class) {
            st.put_free(p.ptr, class);
        }
        true
    }

    /// Pins a new block of `class` for a request of `size` bytes. Out of memory, gives the
    /// free blocks back and tries once more.
    fn grow(&self, class: u32, size: usize) -> Result<HostPtr> {
        let bytes = 1usize << class;
        let mut made = self.host.host_alloc(bytes);
        let mut retried = false;
        if matches!(made, Err(Error::OutOfMemory(_))) && self.release_free() > 0 {
            retried = true;
            made = self.host.host_alloc(bytes);
        }
        let mut st = self.state.lock();
        match made {
            Ok(ptr) => {
                st.blocks.insert(ptr, Block { class, live: Some(size), users: Vec::new(), captured: false });
                st.stats.on_reserve(bytes);
                st.stats.on_allocate(size);
                st.stats.retries += u64::from(retried);
                Ok(ptr)
            }
            Err(e) => {
                st.stats.failures += 1;
                let Error::OutOfMemory(device_report) = e else { return Err(e) };
                Err(Error::oom(OutOfMemory {
                    device: device_report.device,
                    host: true,
                    requested: size,
                    allocated: st.stats.allocated,
                    cached: st.cached,
                    pending_release: st.pending_bytes + st.stuck_bytes,
                    reserved: st.stats.reserved,
                    detail: vec![format!(
                        "a pinned host block of {bytes} bytes could not be page-locked: {}",
                        device_report.hint
                    )],
                    hint:
                        "the pinned pool gave its free blocks back and tried once more; free pinned buffers"
                            .into(),
                    ..OutOfMemory::default()
                }))
            }
        }
    }

    /// Gives every free block back; the bytes given back. A block the driver refuses to
    /// free stays in the free lists, its error held.
    fn release_free(&self) -> usize {
        let taken: Vec<(HostPtr, u32)> = {
            let mut st = self.state.lock();
            let st = &mut *st;
            st.cached = 0;
            let taken: Vec<(HostPtr, u32)> = (0u32..)
                .zip(st.free.iter_mut())
                .flat_map(|(class, list)| list.drain(..).map(move |ptr| (ptr, class)))
                .collect();
            for (ptr, _) in &taken {
                st.blocks.remove(ptr);
            }
            taken
        };
        let freed: Vec<(HostPtr, u32, Result<()>)> =
            taken.into_iter().map(|(ptr, class)| (ptr, class, self.host.host_free(ptr))).collect();
        let mut st = self.state.lock();
        let mut released = 0;
        for (ptr, class, result) in freed {
            match result {
                Ok(()) => {
                    st.stats.on_unreserve(1 << class);
                    released += 1 << class;
                }
                Err(e) => {
                    st.held.hold(e);
                    st.blocks.insert(ptr, Block { class, live: None, users: Vec::new(), captured: false });
                    st.put_free(ptr, class);
                }
            }
        }
        released
    }
}

impl Drop for Inner {
    /// Frees every block but those kept out of use for good and those whose streams' work
    /// outlasts [`PinnedHostConfig::wait_timeout`] (left allocated: a copy may still use them).
    fn drop(&mut self) {
        let start = Instant::now();
        let st = self.state.get_mut();
        let mut done: Vec<HostPtr> = st.free.iter().flatten().copied().collect();
        done.extend(st.blocks.iter().filter(|(_, b)| b.live.is_some()).map(|(ptr, _)| *ptr));
        for p in st.pending.drain(..) {
            let mut completed = true;
            for (user, event) in p.events {
                let left = self.wait.saturating_sub(start.elapsed());
                completed &= user.device.wait_event(event, left).unwrap_or(false);
                user.events.put(event);
            }
            if completed {
                done.push(p.ptr);
            }
        }
        for ptr in done {
            // Nothing to report to at teardown: a failing free only leaks the block.
            let _ = self.host.host_free(ptr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_powers_of_two_from_the_smallest_block() {
        assert_eq!(class_of(1, 12), Some(12));
        assert_eq!(class_of(4096, 12), Some(12));
        assert_eq!(class_of(4097, 12), Some(13));
        assert_eq!(class_of(3 << 20, 12), Some(22));
        assert_eq!(class_of(1 << 30, 0), Some(30));
        assert_eq!(class_of(isize::MAX as usize, 0), Some(63));
        assert_eq!(class_of(isize::MAX as usize + 1, 0), None);
        assert_eq!(class_of(usize::MAX, 0), None);
    }
}
