//! `AsyncPool`: the driver's stream-ordered pool (`cuMemAllocFromPoolAsync` /
//! `cuMemFreeAsync`) with every stream-ordered decision left to the driver, as in Paddle's
//! `CUDAMallocAsyncAllocator`. It follows the
//! [stream-ordering contract](crate::allocation#the-stream-ordering-contract).
//!
//! # Frees
//! * No recorded streams: `cuMemFreeAsync` on the owning stream. The driver lets later work
//!   on that stream reuse the memory at once, and other streams once they are ordered after
//!   the free.
//! * Recorded streams: an event is recorded on the owning stream and on each recorded stream,
//!   a dedicated *free stream* waits on them, and the memory is freed on the free stream.
//!   The host never polls an event and the allocator keeps no list of unfreed allocations;
//!   events go back to an [`EventPool`] at once, since a wait
//!   captures the event's state when it is enqueued. See DESIGN.md, Note [a free stream for
//!   recorded frees].
//!
//! # Throttle
//! Memory freed on the free stream may stay unusable for a while. When the bytes allocated
//! plus the bytes freed on the free stream since the last throttle exceed
//! [`AsyncPoolConfig::throttle_ratio`] of the device's memory, the next allocating stream
//! waits on the free stream (one event, no host wait) and the pending count restarts from 0.
//! With nothing pending there is nothing to wait for, so no wait is made.
//!
//! # Lazy initialization
//! [`AsyncPool::new`] makes no driver call, so a process may create allocators and then
//! fork before CUDA initializes. The pool and the device's size are set up at first use, once,
//! under a lock; the free stream at the first free with recorded streams.
//!
//! # CUDA graph capture
//! Captures that allocate from an `AsyncPool` are begun with [`AsyncPool::begin_capture`].
//! While one is active, the allocator asks the driver whether the stream of each allocation and
//! free is capturing, and refuses an allocation on a stream that captures a graph begun
//! elsewhere (it could not know which graph owns it). While none is, it asks only before a
//! throttle wait and at a free with recorded streams (see DESIGN.md, Note [capture queries only
//! while a capture is active]). A capture begun elsewhere then
//! (`torch.cuda.graph` over the C ABI, a bare `cuStreamBeginCapture`) gets the driver's captured
//! allocation and free nodes under the driver's rules (memory allocated in a graph and not
//! freed in it exists once the graph has been launched), as with RMM's cudaMallocAsync
//! allocator; under PyTorch the facade's private-pool hooks also defer frees of memory from
//! outside the capture, as PyTorch's own cudaMallocAsync backend does
//! ([`PrivatePools::defer_free`](crate::facade::private_pools::PrivatePools::defer_free)).
//! No trim, throttle wait or synchronization happens during a capture of this allocator's.
//! The four cases:
//! 1. *Allocated and freed inside the capture*: ordinary captured allocation and free nodes.
//!    A free with recorded streams that take part in the capture goes through a free stream
//!    of the capture's own (so the shared free stream is never pulled into a graph), which
//!    [`Capture::end`] joins back into the capturing stream before ending the capture.
//!    Recorded streams outside the capture are ignored: graph memory does not exist outside
//!    the graph's launches. In a capture begun elsewhere, such a free is captured on the
//!    block's stream after the recorded streams of the capture (the shared free stream stays
//!    out of the graph; the block's stream then waits for them in the graph).
//! 2. *Allocated inside, freed outside*: the memory belongs to the graph. The driver creates
//!    it at each launch, so it only exists once the graph has been launched; freeing it
//!    before then is invalid. Dropping the [`Allocation`] therefore hands it to the
//!    [`CapturedGraph`], which frees it (ordered after the last launch) when it is destroyed,
//!    and only if it was ever launched. Graphs are instantiated with auto-free-on-launch
//!    ([`Graphs::instantiate_graph_auto_free`](crate::device::Graphs::instantiate_graph_auto_free)), so a graph whose memory outlives a launch
//!    can be launched again: each launch frees what the previous one left and allocates it
//!    anew at the same address. An `Allocation` still alive when its graph is destroyed stays
//!    valid and is freed, after the last launch, when dropped.
//! 3. *Allocated outside, freed inside*: a captured free would free the memory at every
//!    launch, so the free is deferred to the end of the capture and done then on the owning
//!    stream. As in PyTorch and Paddle, a graph must not use memory freed during its capture
//!    when it is launched later: keep alive what a graph reads.
//! 4. *Both outside*: ordinary.

mod graph;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;

pub use graph::{Capture, CapturedGraph};
use graph::{CaptureOwner, GraphShared};

use super::retry;
use crate::allocation::{
    align_up, Allocation, Allocator, Block, BlockOwner, Segment, Stats, StreamAllocator,
};
use crate::device::{
    AtomicStream, CaptureStatus, Device, DevicePtr, EventPool, Pool, PoolAttr, PoolProps, Stream,
};
use crate::error::{Error, HeldErrors, OutOfMemory, Result};

/// Which stream-ordered pool an [`AsyncPool`] allocates from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PoolMode {
    /// The device's default pool, shared with every library in the process (CuPy's
    /// `MemoryAsyncPool`, PyTorch's cudaMallocAsync backend); its statistics include other
    /// libraries' memory.
    DefaultPool {
        /// `Some`: set the pool's release threshold at first use, as PyTorch's cudaMallocAsync
        /// backend does (the driver's default, 0, returns all free memory at every
        /// synchronization, which makes the next allocations map it again). `None`: leave
        /// the pool's attributes as other libraries set them.
        release_threshold: Option<usize>,
    },
    /// A pool the allocator creates at first use and destroys when it is dropped.
    Owned {
        /// Bytes the pool keeps reserved at synchronizations instead of releasing them.
        release_threshold: usize,
        /// Which kinds of cross-stream reuse the driver may make.
        reuse: ReuseFlags,
        /// Largest size the pool may reserve, in bytes; 0 means no limit. Honoured where the
        /// driver offers it (CUDA 12.2 and later).
        max_size: usize,
        /// Whether other processes can import its memory
        /// ([`Ipc::export_pool_pointer`](crate::device::Ipc::export_pool_pointer)); CUDA graphs cannot capture allocations of such a
        /// pool.
        exportable: bool,
    },
    /// A pool made by someone else; the allocator never changes or destroys it.
    View(Pool),
}

/// The driver's reuse attributes of an owned pool (all on by default, as in the driver).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReuseFlags {
    /// Reuse memory freed on another stream once an event orders the two.
    pub follow_event_dependencies: bool,
    /// Reuse memory whose free is known to have completed.
    pub opportunistic: bool,
    /// Let the driver insert stream waits to reuse memory freed on another stream.
    pub internal_dependencies: bool,
}

impl Default for ReuseFlags {
    fn default() -> Self {
        Self { follow_event_dependencies: true, opportunistic: true, internal_dependencies: true }
    }
}

/// Settings of an [`AsyncPool`].
///
/// # Examples
///
/// ```
/// use streamalloc::allocators::{AsyncPool, AsyncPoolConfig, PoolMode, ReuseFlags};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::Allocator;
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// // A pool of its own that keeps up to 256 MiB reserved at synchronizations.
/// let mode = PoolMode::Owned {
///     release_threshold: 256 << 20,
///     reuse: ReuseFlags::default(),
///     max_size: 0,
///     exportable: false,
/// };
/// let pool = AsyncPool::new(sim, AsyncPoolConfig { mode, throttle_ratio: 0.9, ..Default::default() });
/// let a = pool.allocate(8 << 20)?;
/// assert_eq!(pool.stats().allocated, 8 << 20);
/// # drop(a);
/// # Ok::<(), streamalloc::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AsyncPoolConfig {
    /// The pool to allocate from (default: the device's default pool).
    pub mode: PoolMode,
    /// Share of device memory that allocated plus pending-release bytes may reach before the
    /// next allocation waits on the free stream (default 0.8; `f64::INFINITY` turns the
    /// throttle off).
    pub throttle_ratio: f64,
    /// Bytes [`Allocator::release`] leaves reserved in the pool (default 0).
    pub trim_floor: usize,
    /// The stream [`Allocator::allocate`] uses until changed (default: the legacy default
    /// stream).
    pub default_stream: Stream,
}

impl Default for AsyncPoolConfig {
    fn default() -> Self {
        Self {
            mode: PoolMode::DefaultPool { release_threshold: None },
            throttle_ratio: 0.8,
            trim_floor: 0,
            default_stream: Stream::DEFAULT,
        }
    }
}

/// The driver's stream-ordered pool as a [`StreamAllocator`]; see the [module docs](self).
///
/// # Examples
///
/// ```
/// use streamalloc::allocators::{AsyncPool, AsyncPoolConfig};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::{Allocator, Streams, StreamAllocator};
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let pool = AsyncPool::new(sim.clone(), AsyncPoolConfig::default()); // the device's default pool
/// let stream = sim.create_stream()?;
/// let a = pool.allocate_on(8 << 20, stream)?; // ordered on `stream`, like cudaMallocAsync
/// assert_eq!(pool.stats().allocated, 8 << 20);
/// drop(a); // freed on `stream`, like cudaFreeAsync
/// assert_eq!(pool.stats().allocated, 0);
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct AsyncPool {
    inner: Arc<Inner>,
}

/// What is set up at first use.
struct Ready {
    pool: Pool,
    /// Made at the first free with recorded streams: a stream is driver state (and, on the
    /// H200, device memory) that most users of the pool never need.
    free_stream: OnceLock<Stream>,
}

struct Counters {
    stats: Stats,
    /// Bytes freed on the free stream since the last throttle wait.
    pending: usize,
    /// Allocated plus pending bytes past which the throttle applies (set at first use).
    throttle_limit: usize,
    /// Errors frees met, reported by the next [`Allocator::release`].
    held: HeldErrors,
}

impl Default for Counters {
    fn default() -> Self {
        Self { stats: Stats::default(), pending: 0, throttle_limit: usize::MAX, held: HeldErrors::default() }
    }
}

impl Counters {
    /// Whether the next allocation waits on the free stream (see the [module docs](self#throttle)).
    fn throttled(&self) -> bool {
        self.pending > 0 && self.stats.allocated.saturating_add(self.pending) > self.throttle_limit
    }

    fn count_allocation(&mut self, size: usize) {
        self.stats.on_allocate(size);
        self.stats.device_allocs += 1;
    }
}

/// Who takes an allocation back: the pool, or the capture it was made in.
enum Owner {
    Pool,
    Capture(Arc<GraphShared>),
}

struct Inner {
    device: Arc<dyn Device>,
    /// `device.ordinal()`, read on every allocation.
    ordinal: usize,
    config: AsyncPoolConfig,
    default_stream: AtomicStream,
    ready: OnceLock<Ready>,
    init_lock: Mutex<()>,
    events: EventPool,
    counters: Mutex<Counters>,
    /// Mirrors [`Counters::throttled`], read without the lock.
    throttled: AtomicBool,
    /// Captures begun through this allocator, by capturing stream.
    captures: Mutex<HashMap<Stream, Arc<GraphShared>>>,
    /// Mirrors `captures.len()`, read without the lock: while it is 0 no stream is asked
    /// whether it captures (see the [module docs](self#cuda-graph-capture)).
    capturing: AtomicUsize,
}

impl AsyncPool {
    /// An allocator on `device`. Makes no driver call: the pool and the free stream are set
    /// up at first use.
    pub fn new(device: Arc<dyn Device>, config: AsyncPoolConfig) -> Self {
        let inner = Inner {
            events: EventPool::new(device.clone()),
            ordinal: device.ordinal(),
            device,
            default_stream: AtomicStream::new(config.default_stream),
            config,
            ready: OnceLock::new(),
            init_lock: Mutex::new(()),
            counters: Mutex::new(Counters::default()),
            throttled: AtomicBool::new(false),
            captures: Mutex::new(HashMap::new()),
            capturing: AtomicUsize::new(0),
        };
        Self { inner: Arc::new(inner) }
    }

    /// The pool allocations come from (sets the allocator up if this is its first use).
    pub fn pool(&self) -> Result<Pool> {
        Ok(self.inner.ready()?.pool)
    }

    /// Lets device `peer` read and write this allocator's pool memory (`cuMemPoolSetAccess`),
    /// e.g. as the source of a peer copy (`cuMemcpyPeerAsync`) or in its kernels; sets the
    /// allocator up if this is its first use. Allowed in every [`PoolMode`]: on the default
    /// pool or a [`PoolMode::View`], the access is a property of that pool and so holds for
    /// every user of it in the process, not just this allocator.
    pub fn grant_peer_access(&self, peer: usize) -> Result<()> {
        self.inner.device.set_pool_access(self.inner.ready()?.pool, peer, true)
    }

    /// Takes back what [`AsyncPool::grant_peer_access`] gave device `peer` (process-wide on a
    /// shared pool, as there). The pool's own device always keeps access.
    pub fn revoke_peer_access(&self, peer: usize) -> Result<()> {
        self.inner.device.set_pool_access(self.inner.ready()?.pool, peer, false)
    }

    /// Starts capturing the work of `stream` into a CUDA graph (relaxed mode); see the
    /// [module docs](self#cuda-graph-capture) for what happens to allocations made or freed
    /// during the capture.
    pub fn begin_capture(&self, stream: Stream) -> Result<Capture> {
        self.inner.ready()?;
        let shared = Arc::new(GraphShared::default());
        {
            let mut captures = self.inner.captures.lock();
            if captures.contains_key(&stream) {
                return Err(Error::InvalidArgument(format!(
                    "stream {:#x} is already capturing",
                    stream.raw()
                )));
            }
            // Counted first, so that no allocation on `stream` skips the question once it
            // captures.
            self.inner.capturing.store(captures.len() + 1, Ordering::SeqCst);
            if let Err(e) = self.inner.device.begin_capture(stream) {
                self.inner.capturing.store(captures.len(), Ordering::SeqCst);
                return Err(e);
            }
            captures.insert(stream, shared.clone());
        }
        Ok(Capture::new(self.inner.clone(), shared, stream))
    }

    /// Counts `made` once: a failure, or nothing (a retry is counted where it happens).
    fn count<T>(&self, made: Result<T>) -> Result<T> {
        made.inspect_err(|_| self.inner.counted(|c| c.stats.failures += 1))
    }

    /// The device side of an allocation of `size` bytes (not zero) on `stream`, not yet
    /// counted: the pointer and who takes it back.
    fn allocate_uncounted(&self, size: usize, stream: Stream) -> Result<(DevicePtr, Owner)> {
        let inner = &self.inner;
        let rounded = align_up(size)
            .ok_or_else(|| Error::InvalidArgument(format!("allocation size {size} overflows")))?;
        let ready = inner.ready()?;
        let throttled = inner.throttled.load(Ordering::Relaxed);
        inner.allocate_device(ready, size, rounded, stream, throttled)
    }
}

impl AsyncPool {
    /// Trims the pool to [`AsyncPoolConfig::trim_floor`]; the bytes returned. Nothing while a
    /// capture of this allocator's is active.
    fn trim(&self) -> Result<usize> {
        let Some(ready) = self.inner.ready.get() else { return Ok(0) };
        if !self.inner.captures.lock().is_empty() {
            return Ok(0);
        }
        let reserved = || self.inner.device.pool_attr(ready.pool, PoolAttr::ReservedMemCurrent);
        let before = reserved()?;
        self.inner.device.trim_pool(ready.pool, self.inner.config.trim_floor)?;
        Ok(before.saturating_sub(reserved()?) as usize)
    }
}

impl Allocator for AsyncPool {
    fn allocate(&self, size: usize) -> Result<Allocation> {
        self.allocate_on(size, self.default_stream())
    }

    /// Trims the pool to the configured floor; then reports the errors frees held back.
    fn release(&self) -> Result<usize> {
        let released = self.trim();
        self.inner.counted(|c| c.held.take())?;
        released
    }

    fn stats(&self) -> Stats {
        let (mut stats, pending) = {
            let c = self.inner.counters.lock();
            (c.stats, c.pending)
        };
        if let Some(ready) = self.inner.ready.get() {
            let attr = |a| self.inner.device.pool_attr(ready.pool, a).unwrap_or(0) as usize;
            stats.reserved = attr(PoolAttr::ReservedMemCurrent);
            stats.reserved_peak = attr(PoolAttr::ReservedMemHigh);
            let unused = stats.reserved.saturating_sub(attr(PoolAttr::UsedMemCurrent));
            // Pending frees may have completed and been trimmed since: count at most what
            // the pool holds unused.
            stats.pending_release = pending.min(unused);
            stats.cached = unused - stats.pending_release;
        }
        stats
    }

    /// Restarts the allocator's peak and the pool's high-water marks (on the device's default
    /// pool, for every user of it, as PyTorch's cudaMallocAsync backend does).
    fn reset_peak_stats(&self) {
        self.inner.counted(|c| c.stats.reset_peaks());
        if let Some(ready) = self.inner.ready.get() {
            for attr in [PoolAttr::ReservedMemHigh, PoolAttr::UsedMemHigh] {
                // A pool whose marks cannot be reset keeps its old peaks: nothing to report to.
                let _ = self.inner.device.set_pool_attr(ready.pool, attr, 0);
            }
        }
    }

    fn device(&self) -> usize {
        self.inner.ordinal
    }

    /// The driver's pool places its memory itself and does not say where.
    fn segments(&self, _out: &mut Vec<Segment>) -> Result<()> {
        Err(Error::Unsupported(
            "strategy=async: the driver's pool does not list its segments and blocks".into(),
        ))
    }
}

impl StreamAllocator for AsyncPool {
    fn allocate_on(&self, size: usize, stream: Stream) -> Result<Allocation> {
        let inner = &self.inner;
        let device = inner.ordinal;
        if size == 0 {
            return Ok(Allocation::empty(device, stream));
        }
        let (ptr, owner) = self.count(self.allocate_uncounted(size, stream))?;
        inner.counted(|c| c.count_allocation(size));
        let owner: Arc<dyn BlockOwner> = match owner {
            Owner::Pool => inner.clone(),
            Owner::Capture(shared) => Arc::new(CaptureOwner::new(inner.clone(), shared)),
        };
        let block = Block { ptr, size, stream, device, token: 0, recorded: Default::default() };
        Ok(Allocation::new(block, owner))
    }

    fn default_stream(&self) -> Stream {
        self.inner.default_stream.load()
    }

    /// Nothing to forget: the driver's pool orders each free on its stream at the free.
    fn retire_stream(&self, _stream: Stream) -> Result<()> {
        Ok(())
    }

    fn set_default_stream(&self, stream: Stream) {
        self.inner.default_stream.store(stream);
    }
}

impl Inner {
    /// Runs `f` on the counters, then refreshes what is read of them without the lock.
    fn counted<R>(&self, f: impl FnOnce(&mut Counters) -> R) -> R {
        let mut c = self.counters.lock();
        let r = f(&mut c);
        self.throttled.store(c.throttled(), Ordering::Relaxed);
        r
    }

    /// The device side of an allocation: the pointer and who takes it back.
    fn allocate_device(
        &self,
        ready: &Ready,
        size: usize,
        rounded: usize,
        stream: Stream,
        throttled: bool,
    ) -> Result<(DevicePtr, Owner)> {
        // Outside this allocator's captures the only capture possible is one begun elsewhere,
        // which is not asked about (module docs) unless a throttle wait would go into it.
        let status = if throttled || self.capturing.load(Ordering::SeqCst) > 0 {
            self.device.capture_status(stream)?
        } else {
            CaptureStatus::None
        };
        Ok(match status {
            CaptureStatus::None => {
                self.throttle(ready, stream, throttled)?;
                (self.alloc_with_retry(ready, size, rounded, stream)?, Owner::Pool)
            }
            CaptureStatus::Active => {
                let Some(shared) = self.captures.lock().get(&stream).cloned() else {
                    return Err(Error::Unsupported(format!(
                        "allocation on stream {:#x}, which is capturing a graph not begun with \
                         AsyncPool::begin_capture",
                        stream.raw()
                    )));
                };
                let ptr = self.device.alloc_async(rounded, ready.pool, stream)?;
                (ptr, Owner::Capture(shared))
            }
            CaptureStatus::Invalidated => {
                return Err(Error::InvalidArgument(format!(
                    "allocation on stream {:#x}, whose capture was invalidated",
                    stream.raw()
                )))
            }
        })
    }

    /// The pool and free stream, set up at the first call.
    fn ready(&self) -> Result<&Ready> {
        if let Some(r) = self.ready.get() {
            return Ok(r);
        }
        let _once = self.init_lock.lock();
        if let Some(r) = self.ready.get() {
            return Ok(r);
        }
        let device_total = self.device.mem_info()?.total;
        // Saturates: an infinite ratio never throttles.
        let limit = (self.config.throttle_ratio * device_total as f64) as usize;
        self.counted(|c| c.throttle_limit = limit);
        let pool = match self.config.mode {
            PoolMode::DefaultPool { release_threshold } => {
                let pool = self.device.default_pool()?;
                if let Some(t) = release_threshold {
                    self.device.set_pool_attr(pool, PoolAttr::ReleaseThreshold, t as u64)?;
                }
                pool
            }
            PoolMode::View(pool) => pool,
            PoolMode::Owned { release_threshold, reuse, max_size, exportable } => {
                let pool = self.device.create_pool(PoolProps { max_size, exportable })?;
                let attrs = [
                    (PoolAttr::ReleaseThreshold, release_threshold as u64),
                    (PoolAttr::ReuseFollowEventDependencies, reuse.follow_event_dependencies as u64),
                    (PoolAttr::ReuseAllowOpportunistic, reuse.opportunistic as u64),
                    (PoolAttr::ReuseAllowInternalDependencies, reuse.internal_dependencies as u64),
                ];
                if let Err(e) = attrs.iter().try_for_each(|&(a, v)| self.device.set_pool_attr(pool, a, v)) {
                    // Already failing: the pool is unused, so a failed destroy only leaks it.
                    let _ = self.device.destroy_pool(pool);
                    return Err(e);
                }
                pool
            }
        };
        Ok(self.ready.get_or_init(|| Ready { pool, free_stream: OnceLock::new() }))
    }

    /// The free stream, made at its first use.
    fn free_stream(&self, ready: &Ready) -> Result<Stream> {
        if let Some(&s) = ready.free_stream.get() {
            return Ok(s);
        }
        let made = self.device.create_stream()?;
        if let Err(made) = ready.free_stream.set(made) {
            // Another thread made one meanwhile.
            let _ = self.device.destroy_stream(made);
        }
        ready.free_stream.get().copied().ok_or_else(|| Error::Internal("the free stream was not kept".into()))
    }

    /// Makes later work on `waiter` wait for the work enqueued so far on each of `streams`.
    fn order_after(&self, waiter: Stream, streams: impl IntoIterator<Item = Stream>) -> Result<()> {
        streams.into_iter().try_for_each(|s| self.events.order_after(waiter, s))
    }

    /// When `over` (allocated plus pending-release bytes past the throttle ratio), makes
    /// `stream` wait for the pending frees.
    fn throttle(&self, ready: &Ready, stream: Stream, over: bool) -> Result<()> {
        if over {
            // No free stream yet: nothing was freed on it.
            self.order_after(stream, ready.free_stream.get().copied())?;
            self.counted(|c| c.pending = 0);
        }
        Ok(())
    }

    /// One allocation from the pool; on out-of-memory, once (the shared loop with a zero
    /// timeout): `stream` is ordered after the pending frees, the pool trimmed, and the
    /// allocation tried again. If the ordering or the trim fails, the allocation is still
    /// tried again (the driver's pool orders its own reuse), and an out-of-memory error
    /// names that failure. After a final failure the pool is trimmed to
    /// [`AsyncPoolConfig::trim_floor`]: what it grew by while the driver tried goes back.
    fn alloc_with_retry(
        &self,
        ready: &Ready,
        size: usize,
        rounded: usize,
        stream: Stream,
    ) -> Result<DevicePtr> {
        let release = || {
            let pending = self.counters.lock().pending > 0;
            if pending {
                self.order_after(stream, ready.free_stream.get().copied())?;
            }
            self.device.trim_pool(ready.pool, 0)?;
            Ok(None)
        };
        let retried = retry::on_out_of_memory(
            Duration::ZERO,
            || self.device.alloc_async(rounded, ready.pool, stream),
            release,
            |_| (),
        );
        if retried.retried() {
            self.counted(|c| c.stats.retries += 1);
        }
        let release_error = retried.release_error;
        retried.result.map_err(|e| {
            // The driver's own answer, which decided that no retry was made.
            let Error::OutOfMemory(device_report) = &e else { return e };
            let beyond = device_report.exceeds_device();
            // The driver's pool may have grown while it tried (seen: 24 GiB kept after a request
            // of twice the device's memory); what the failed request left goes back.
            let trimmed = self.device.trim_pool(ready.pool, self.config.trim_floor);
            let c = self.counters.lock();
            let attr = |a| self.device.pool_attr(ready.pool, a).unwrap_or(0) as usize;
            let reserved = attr(PoolAttr::ReservedMemCurrent);
            let info = self.device.mem_info().unwrap_or_default();
            let mut report = OutOfMemory {
                device: self.device.ordinal(),
                requested: size,
                allocated: c.stats.allocated,
                cached: reserved.saturating_sub(attr(PoolAttr::UsedMemCurrent)),
                pending_release: c.pending,
                reserved,
                device_free: info.free,
                device_total: info.total,
                detail: release_error
                    .iter()
                    .chain(trimmed.err().as_ref())
                    .map(super::release_failed)
                    .collect(),
                hint: String::new(),
                host: false,
            };
            report.hint = match self.config.mode {
                _ if beyond => report.beyond_device_hint(),
                PoolMode::Owned { max_size, .. } if max_size != 0 => {
                    format!("the pool's maximum size is {max_size} bytes: raise max_size or free allocations")
                }
                _ => "free allocations or memory held outside this pool (other pools, libraries or \
                      processes); a lower `throttle=` (a key of STREAMALLOC_CONF, e.g. throttle=0.6) \
                      makes allocations wait for pending frees sooner"
                    .into(),
            };
            Error::oom(report)
        })
    }

    /// Frees a block allocated outside any capture, or a graph's memory after its launch.
    fn release_block(&self, block: Block) -> Result<()> {
        if self.release_uncounted(block)? {
            self.counters.lock().stats.device_frees += 1;
        }
        Ok(())
    }

    /// [`Inner::release_block`] without counting the device free; whether one was made now
    /// (not deferred to the end of a capture).
    fn release_uncounted(&self, block: Block) -> Result<bool> {
        if self.capturing.load(Ordering::SeqCst) > 0 {
            if self.device.capture_status(block.stream)? != CaptureStatus::None {
                return self.defer_to_capture(block.stream, block).map(|()| false);
            }
            for &s in &block.recorded {
                if self.device.capture_status(s)? != CaptureStatus::None {
                    return self.defer_to_capture(s, block).map(|()| false);
                }
            }
        }
        if block.recorded.is_empty() {
            self.device.free_async(block.ptr, block.stream)?;
            return Ok(true);
        }
        // A capture begun elsewhere (`torch.cuda.graph`) may include the block's streams; the
        // free stream must not be pulled into it (its end would fail, unjoined).
        let mut capturing = Vec::new();
        let mut outside = Vec::new();
        for &s in &block.recorded {
            match self.device.capture_status(s)? {
                CaptureStatus::None => outside.push(s),
                _ => capturing.push(s),
            }
        }
        if self.device.capture_status(block.stream)? != CaptureStatus::None {
            // A captured free, after the recorded streams of the capture (case 1 of the module
            // docs; those outside it are ignored).
            self.order_after(block.stream, capturing)?;
            self.device.free_async(block.ptr, block.stream)?;
            return Ok(true);
        }
        // Recorded streams that capture are ignored: a graph must not use memory freed during
        // its capture (case 3).
        let free_stream = self.free_stream(self.ready()?)?;
        self.order_after(free_stream, std::iter::once(block.stream).chain(outside))?;
        self.device.free_async(block.ptr, free_stream)?;
        self.counted(|c| c.pending += block.size);
        Ok(true)
    }

    /// Case 3: memory from outside a capture, freed while `stream` captures; freed when the
    /// capture ends.
    fn defer_to_capture(&self, stream: Stream, block: Block) -> Result<()> {
        let Some(shared) = self.captures.lock().get(&stream).cloned() else {
            return Err(Error::Unsupported(format!(
                "free of {:#x} while stream {:#x} captures a graph not begun with \
                 AsyncPool::begin_capture: the memory is leaked",
                block.ptr,
                stream.raw()
            )));
        };
        match shared.defer(block) {
            // The capture ended meanwhile: free as usual.
            Some(block) => self.release_block(block),
            None => Ok(()),
        }
    }

    fn keep_error(&self, result: Result<()>) {
        if let Err(e) = result {
            self.counted(|c| {
                c.held.hold(e);
            });
        }
    }
}

impl BlockOwner for Inner {
    fn free(&self, block: Block) {
        let size = block.size;
        let result = self.release_uncounted(block);
        // One look at the counters.
        self.counted(|c| {
            c.stats.on_free(size);
            match result {
                Ok(true) => c.stats.device_frees += 1,
                Ok(false) => {}
                Err(e) => {
                    c.held.hold(e);
                }
            }
        });
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(ready) = self.ready.get() {
            // Nothing to report to: work already enqueued on the stream still completes, and
            // a pool with outstanding frees is released by the driver once they complete.
            if let Some(&s) = ready.free_stream.get() {
                let _ = self.device.destroy_stream(s);
            }
            if matches!(self.config.mode, PoolMode::Owned { .. }) {
                let _ = self.device.destroy_pool(ready.pool);
            }
        }
    }
}
