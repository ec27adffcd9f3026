//! The device boundary: everything an allocator needs from a GPU driver, and nothing more.
//!
//! [`Device`] is implemented by [`cuda::CudaDevice`] (the CUDA driver API, loaded at run time)
//! and by [`sim::SimDevice`] (a deterministic simulator with an ordering checker). All FFI and
//! all `unsafe` of the crate live in this layer: the driver calls under `device::cuda`, and the
//! system calls of [`ipc`] (`memfd_create` for the export registry, `pidfd_open` and
//! `pidfd_getfd` to copy file descriptors out of another process). What only tests and measurement
//! programs need (memsets, host and peer copies, host functions) is the `DeviceTestExt` trait,
//! which both implement under the crate's `test-util` feature.
//!
//! Handles ([`Stream`], [`Event`], [`Pool`], [`Graph`], [`GraphExec`]) wrap integers that only
//! this layer makes: on CUDA they are the driver's handle values (a [`Stream`] is a
//! `CUstream`, which is also a `cudaStream_t`), on the simulator they are ids. Outside this
//! layer a handle comes from a device (`create_stream`, `create_event`, ...), from
//! [`Stream::DEFAULT`], or, for a stream another library made (the C ABI's callers: PyTorch,
//! CuPy), from the `unsafe` [`Stream::from_raw`], whose caller vouches for it: the driver does
//! not reliably refuse a bad handle. Tests forge handles with `Stream::forged` (the crate's
//! `test-util` feature).
//!
//! [`Device`] is the union of traits of a few methods each, split by what their users need:
//! [`DeviceMemory`] (what the device is; memory outside stream order), [`Streams`],
//! [`Events`], [`HostMemory`] (page-locked host memory and its copies), [`DriverPools`] (the
//! driver's stream-ordered pools), [`Graphs`] (captures), [`VirtualMemory`] (reserve, map,
//! unmap) and [`Ipc`] (sharing memory with other processes). Every device implements all of
//! them; `Device` is implemented for whatever does.

// The driver's FFI: the crate's `unsafe` (denied elsewhere by the workspace lints), each
// block with its `// SAFETY:` comment.
#[allow(unsafe_code)]
pub mod cuda;
mod event_pool;
// The system calls that copy descriptors between processes.
#[allow(unsafe_code)]
pub mod ipc;
pub mod sim;

pub use event_pool::EventPool;

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[cfg(feature = "test-util")]
use crate::error::Error;
use crate::error::Result;

/// A device address.
pub type DevicePtr = u64;

/// A host address: page-locked host memory from [`HostMemory::host_alloc`].
pub type HostPtr = u64;

/// The stream an allocation belongs to: a stream handle (`CUstream` / `cudaStream_t` on CUDA).
/// A stream comes from the device ([`Streams::create_stream`]), or is a handle another library
/// made (cudarc's streams through [`cuda::stream_of`]; PyTorch's `torch.cuda.Stream.cuda_stream`
/// and CuPy's `Stream.ptr` through the C ABI, which wraps them with [`Stream::from_raw`]).
/// [`Stream::DEFAULT`] is the legacy default stream. Not constructible from a bare integer
/// otherwise: a handle the driver never made is undefined behaviour in its calls.
///
/// # Examples
///
/// ```
/// use streamalloc::allocators::{StreamSafe, StreamSafeConfig};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::{Allocator, Streams, Stream, StreamAllocator};
///
/// let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let alloc = StreamSafe::new(sim.clone(), StreamSafeConfig::default())?;
/// let side: Stream = sim.create_stream()?;
/// assert_ne!(side, Stream::DEFAULT);
/// let a = alloc.allocate_on(1 << 20, side)?; // owned by `side`
/// let b = alloc.allocate(1 << 20)?; // on the default stream, until `set_default_stream`
/// assert_eq!((a.owning_stream(), b.owning_stream()), (side, Stream::DEFAULT));
/// # Ok::<(), streamalloc::Error>(())
/// ```
///
/// Outside this layer a stream is not made from a bare integer:
///
/// ```compile_fail,E0423
/// let forged = streamalloc::Stream(0xdead);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Stream(u64);

impl Stream {
    /// The legacy default stream (handle 0).
    pub const DEFAULT: Stream = Stream(0);

    /// The stream of the driver's handle `handle` (a `CUstream` / `cudaStream_t`), as another
    /// library hands it over (the C ABI's callers: PyTorch, CuPy).
    ///
    /// # Safety
    ///
    /// `handle` is 0 (the legacy default stream), or a stream the driver made in the primary
    /// context of the device it is used with, not destroyed before its last use: the device's
    /// calls pass it to the driver as it is, and the driver does not reliably refuse a bad
    /// handle (a destroyed stream's handle crashed the process on an H200). With the
    /// simulator, a handle it did not make is refused as an
    /// [`InvalidArgument`](crate::Error::InvalidArgument).
    #[allow(unsafe_code)] // the one way in for a handle this layer did not make
    pub const unsafe fn from_raw(handle: u64) -> Stream {
        Stream(handle)
    }

    /// A stream of any handle, for tests of what a device or an allocator does with a stream
    /// it did not make (the simulator refuses it; so may the driver, or not: see
    /// [`Stream::from_raw`]). Only with the crate's `test-util` feature.
    #[cfg(feature = "test-util")]
    pub const fn forged(handle: u64) -> Stream {
        Stream(handle)
    }

    /// The handle as an integer: what the driver takes, a trace writes, or the C ABI hands out.
    pub const fn raw(self) -> u64 {
        self.0
    }
}

/// A [`Stream`] that threads read and replace without a lock (an allocator's default stream).
#[derive(Debug, Default)]
pub struct AtomicStream(AtomicU64);

impl AtomicStream {
    /// Holds `stream`.
    pub const fn new(stream: Stream) -> Self {
        Self(AtomicU64::new(stream.0))
    }

    /// The stream held, as last stored by any thread (no ordering with other memory).
    pub fn load(&self) -> Stream {
        Stream(self.0.load(Ordering::Relaxed))
    }

    /// Holds `stream` from now on.
    pub fn store(&self, stream: Stream) {
        self.0.store(stream.0, Ordering::Relaxed);
    }
}

/// An event handle (`CUevent` on CUDA), made by [`Events::create_event`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Event(u64);

impl Event {
    /// The handle as an integer.
    pub const fn raw(self) -> u64 {
        self.0
    }
}

/// A stream-ordered memory pool handle (`CUmemoryPool` on CUDA), made by
/// [`DriverPools::default_pool`] or [`DriverPools::create_pool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pool(u64);

impl Pool {
    /// The handle as an integer.
    pub const fn raw(self) -> u64 {
        self.0
    }
}

/// A captured, not yet instantiated graph (`CUgraph` on CUDA), made by [`Graphs::end_capture`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Graph(u64);

impl Graph {
    /// The handle as an integer.
    pub const fn raw(self) -> u64 {
        self.0
    }
}

/// An instantiated graph (`CUgraphExec` on CUDA), made by
/// [`Graphs::instantiate_graph_auto_free`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphExec(u64);

impl GraphExec {
    /// The handle as an integer.
    pub const fn raw(self) -> u64 {
        self.0
    }
}

/// Free and total device memory, as the driver reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemInfo {
    /// Bytes free on the device.
    pub free: usize,
    /// Bytes on the device in all.
    pub total: usize,
}

impl MemInfo {
    /// Bytes in use on the device (by anyone in any process).
    pub fn used(&self) -> usize {
        self.total.saturating_sub(self.free)
    }
}

/// Whether a stream is capturing work into a CUDA graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureStatus {
    /// Not capturing: work runs.
    None,
    /// Capturing: work is recorded into a graph, nothing runs.
    Active,
    /// The capture was invalidated by an error; it must be ended.
    Invalidated,
}

/// Attributes of a stream-ordered memory pool that can be read or written
/// (the driver's `CUmemPool_attribute`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolAttr {
    /// Bytes the pool keeps reserved at a synchronization point before releasing to the OS.
    ReleaseThreshold,
    /// Whether an allocation may reuse memory freed on another stream once an event
    /// dependency orders them.
    ReuseFollowEventDependencies,
    /// Whether an allocation may reuse memory whose free is known to have completed.
    ReuseAllowOpportunistic,
    /// Whether the driver may insert stream waits to reuse memory freed on another stream.
    ReuseAllowInternalDependencies,
    /// Bytes currently reserved by the pool from the device.
    ReservedMemCurrent,
    /// High-water mark of reserved bytes since the last reset.
    ReservedMemHigh,
    /// Bytes currently handed out from the pool.
    UsedMemCurrent,
    /// High-water mark of used bytes since the last reset.
    UsedMemHigh,
}

/// Properties of a pool created with [`DriverPools::create_pool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolProps {
    /// Largest size the pool may reserve, in bytes; 0 means no limit. Honoured where the
    /// driver offers it (CUDA 12.2 and later).
    pub max_size: usize,
    /// Whether the pool's memory can be shared with other processes
    /// (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, [`Ipc::export_pool_pointer`]).
    pub exportable: bool,
}

/// What an allocator stack needs from a GPU: every part below, which each device implements
/// ([`cuda::CudaDevice`], [`sim::SimDevice`]). Object-safe: stacks hold an `Arc<dyn Device>`,
/// whose methods are those of its parts. Implemented for every type that implements them all.
/// What only tests call is `DeviceTestExt`, under the `test-util` feature.
pub trait Device:
    DeviceMemory + Streams + Events + HostMemory + DriverPools + Graphs + VirtualMemory + Ipc
{
}

impl<T> Device for T where
    T: DeviceMemory + Streams + Events + HostMemory + DriverPools + Graphs + VirtualMemory + Ipc + ?Sized
{
}

/// What the device is, and its memory outside any stream order: what every allocator needs.
///
/// Every method may be called from any thread; implementations make whatever driver context
/// the call needs current themselves.
pub trait DeviceMemory: Send + Sync {
    /// The device's ordinal.
    fn ordinal(&self) -> usize;
    /// Free and total memory of the device.
    fn mem_info(&self) -> Result<MemInfo>;
    /// Allocates `size` bytes outside any stream order (`cuMemAlloc`).
    fn alloc(&self, size: usize) -> Result<DevicePtr>;
    /// Frees memory from [`DeviceMemory::alloc`] (`cuMemFree`; synchronizes the device).
    fn free(&self, ptr: DevicePtr) -> Result<()>;
    /// The base and size of the device allocation (a `cuMemAlloc` chunk, a pool allocation, a
    /// mapping) that contains `ptr` (`cuMemGetAddressRange`).
    fn address_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)>;
}

/// Page-locked host memory and the stream-ordered copies between it and the device (what a
/// sleeping tag offloads).
///
/// Every method may be called from any thread; implementations make whatever driver context
/// the call needs current themselves.
pub trait HostMemory: Send + Sync {
    /// Allocates `size` bytes of page-locked (pinned) host memory, page-aligned, that the
    /// copies of every device may use (`cuMemHostAlloc`, portable: under unified addressing
    /// it is pinned for every context, whichever made it).
    fn host_alloc(&self, size: usize) -> Result<HostPtr>;
    /// Frees memory from [`HostMemory::host_alloc`] (`cuMemFreeHost`); no work may use it any
    /// more. A pointer that `host_alloc` did not hand out is refused.
    fn host_free(&self, ptr: HostPtr) -> Result<()>;
    /// Copies `len` bytes of device memory at `src` into page-locked host memory at `dst`,
    /// which lies in one live [`HostMemory::host_alloc`] allocation of this device, in the order
    /// of `stream` (`cuMemcpyDtoHAsync`), and returns at once (what a sleeping tag offloads).
    /// The host memory stays allocated, and the host leaves it alone, until the copy has
    /// completed (an event recorded on `stream` after it). Refused on a capturing stream,
    /// where the copy would run at each replay of the graph instead.
    fn copy_to_pinned(&self, dst: HostPtr, src: DevicePtr, len: usize, stream: Stream) -> Result<()>;
    /// Copies `len` bytes of page-locked host memory at `src`, in one live
    /// [`HostMemory::host_alloc`] allocation of this device, to device memory at `dst` in the
    /// order of `stream` (`cuMemcpyHtoDAsync`), and returns at once (what a waking tag
    /// restores). As [`HostMemory::copy_to_pinned`], the host memory stays allocated and unwritten
    /// until the copy has completed; refused on a capturing stream.
    fn copy_from_pinned(&self, dst: DevicePtr, src: HostPtr, len: usize, stream: Stream) -> Result<()>;
}

/// The driver's stream-ordered pools (`AsyncPool`): the pools, their attributes, and allocating
/// and freeing from them in a stream's order.
///
/// Every method may be called from any thread; implementations make whatever driver context
/// the call needs current themselves.
pub trait DriverPools: Send + Sync {
    /// The device's default stream-ordered pool, shared with every library in the process.
    fn default_pool(&self) -> Result<Pool>;
    /// Creates a pool owned by the caller.
    fn create_pool(&self, props: PoolProps) -> Result<Pool>;
    /// Destroys a pool made by [`DriverPools::create_pool`].
    fn destroy_pool(&self, pool: Pool) -> Result<()>;
    /// Reads a pool attribute (booleans read as 0 or 1).
    fn pool_attr(&self, pool: Pool, attr: PoolAttr) -> Result<u64>;
    /// Writes a pool attribute. The `*Current` attributes are read-only; the `*High`
    /// attributes accept only 0 (a reset).
    fn set_pool_attr(&self, pool: Pool, attr: PoolAttr, value: u64) -> Result<()>;
    /// Grants (`enabled`) or revokes read-write access to the memory of `pool` for device
    /// `peer` (`cuMemPoolSetAccess`). The pool's own device always has access. Pool memory does
    /// not follow context-level peer access: without this, a peer may not use it.
    fn set_pool_access(&self, pool: Pool, peer: usize, enabled: bool) -> Result<()>;
    /// Releases unused pool memory until at most `keep` bytes stay reserved.
    fn trim_pool(&self, pool: Pool, keep: usize) -> Result<()>;
    /// Allocates from `pool` in the order of `stream` (`cuMemAllocFromPoolAsync`).
    fn alloc_async(&self, size: usize, pool: Pool, stream: Stream) -> Result<DevicePtr>;
    /// Frees stream-ordered memory in the order of `stream` (`cuMemFreeAsync`).
    fn free_async(&self, ptr: DevicePtr, stream: Stream) -> Result<()>;
}

/// Virtual memory management (the mapped backings): address reservations, and mapping and
/// unmapping device memory in them.
///
/// Every method may be called from any thread; implementations make whatever driver context
/// the call needs current themselves.
pub trait VirtualMemory: Send + Sync {
    /// Whether the device supports virtual memory management: address reservations and
    /// [`VirtualMemory::map`] (`CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`).
    fn supports_virtual_memory(&self) -> Result<bool>;
    /// Granularity of virtual-memory mappings, in bytes: [`VirtualMemory::map`] and
    /// [`VirtualMemory::unmap`] take addresses and sizes that are multiples of it.
    fn map_granularity(&self) -> Result<usize>;
    /// Reserves `size` bytes (a multiple of [`VirtualMemory::map_granularity`]) of device address
    /// space, backed by nothing (`cuMemAddressReserve`).
    fn reserve_address(&self, size: usize) -> Result<DevicePtr>;
    /// Frees a reservation of [`VirtualMemory::reserve_address`]; nothing in it may be mapped.
    fn free_address(&self, addr: DevicePtr, size: usize) -> Result<()>;
    /// Backs `[addr, addr + size)`, inside a reservation and unmapped, with new device memory
    /// that this device may read and write (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`),
    /// created exportable to other processes ([`Ipc::export_mapped`]) where the device
    /// allows it. A failure maps nothing; a large size (256 MiB or more on CUDA) beyond the
    /// device's free memory fails with [`Error::OutOfMemory`](crate::Error::OutOfMemory)
    /// before any memory is created.
    fn map(&self, addr: DevicePtr, size: usize) -> Result<()>;
    /// Maps the memory mapped at each range `(addr, size)` of `from` a second time, side by
    /// side from `to`, inside a reservation and unmapped (`cuMemRetainAllocationHandle` and
    /// `cuMemMap` per granule, one `cuMemSetAccess`), with the same access: bytes written
    /// through either address are read through the other, and the memory is counted once.
    /// Both stay mapped until each is unmapped. A failure maps nothing.
    fn map_alias(&self, from: &[(DevicePtr, usize)], to: DevicePtr) -> Result<()>;
    /// Grants device `peer` read-write access to every range this device has mapped
    /// ([`VirtualMemory::map`], [`VirtualMemory::map_alias`]) and will map, for as long as the device lives
    /// (`cuMemSetAccess`). Mapped memory does not follow context-level peer access: without
    /// this, a peer may not use it. Granting the device itself, or a peer twice, does nothing.
    fn grant_mapped_access(&self, peer: usize) -> Result<()>;
    /// Unmaps `[addr, addr + size)`, all of it mapped (`cuMemUnmap`); memory whose last mapping
    /// this was goes back to the device. No work may use the range any more: unlike
    /// `cuMemFree`, this does not wait for the device. Work that uses the same memory through
    /// another of its mappings may go on.
    fn unmap(&self, addr: DevicePtr, size: usize) -> Result<()>;
}

/// Sharing device memory with other processes: mapped memory and pool allocations, exported and
/// imported through POSIX file descriptors.
///
/// Every method may be called from any thread; implementations make whatever driver context
/// the call needs current themselves.
pub trait Ipc: Send + Sync {
    /// Exports the memory mapped at `[addr, addr + size)` (whole granules, all mapped by
    /// [`VirtualMemory::map`] or [`VirtualMemory::map_alias`]) for another process: its physical
    /// allocations in address order, each with a POSIX file descriptor that stands for it
    /// (`cuMemRetainAllocationHandle`, `cuMemExportToShareableHandle`). An allocation is
    /// exported once: its descriptor is kept, handed out again by later exports (through any
    /// of its mappings), and closed when its last mapping in this process is unmapped. Memory
    /// not mapped (unmapped, or never mapped: plain or pool memory) is an
    /// [`InvalidArgument`](crate::Error::InvalidArgument); memory the device could not create
    /// exportable is [`Unsupported`](crate::Error::Unsupported).
    fn export_mapped(&self, addr: DevicePtr, size: usize) -> Result<Vec<ipc::SharedPiece>>;
    /// Whether any granule of `[addr, addr + size)` (granule-aligned) maps memory this device
    /// exported ([`Ipc::export_mapped`]) and has not closed the export of: memory another
    /// process may map. Unmapped granules are not.
    fn exports_any(&self, addr: DevicePtr, size: usize) -> Result<bool>;
    /// Exports the live allocation of at least `len` bytes at `ptr` of an exportable pool
    /// ([`PoolProps::exportable`]) for another process: a POSIX file descriptor that stands for
    /// the pool (`cuMemPoolExportToShareableHandle`, once per pool), open in this process and
    /// noted in the export registry with `len` ([`ipc::note_export`]) until the allocation is
    /// freed, and the driver's data for the pointer (`cuMemPoolExportPointer`). Exporting it
    /// again hands out the same. Memory of no exportable pool is an
    /// [`InvalidArgument`](crate::Error::InvalidArgument). The driver requires the allocation
    /// to stay allocated until every process that imported it has freed its import.
    fn export_pool_pointer(&self, ptr: DevicePtr, len: usize) -> Result<ipc::PoolPointer>;
    /// Imports, in this process, a pool allocation another process exported
    /// ([`Ipc::export_pool_pointer`]): `fd` is a copy of the exporter's descriptor, `data`
    /// the driver's data for the pointer. The pool is imported once per pool
    /// (`cuMemPoolImportFromShareableHandle`), the pointer at each call
    /// (`cuMemPoolImportPointer`); free it with [`Ipc::free_imported`].
    fn import_pool_pointer(
        &self,
        fd: BorrowedFd<'_>,
        data: &[u8; ipc::POOL_POINTER_DATA],
    ) -> Result<DevicePtr>;
    /// Frees a pointer [`Ipc::import_pool_pointer`] imported (`cuMemFree`, which waits for
    /// the device's work on it).
    fn free_imported(&self, ptr: DevicePtr) -> Result<()>;
    /// Maps at `[addr, addr + len)`, inside a reservation and unmapped, `len` bytes from
    /// `offset` of the physical allocation that `fd` stands for (a descriptor of an
    /// [`ipc::SharedPiece`], possibly of another process, copied here by [`ipc::fetch_fds`]),
    /// with the access of this device's own mappings (`cuMemImportFromShareableHandle`,
    /// `cuMemMap`, `cuMemSetAccess`). An allocation is mapped whole, in one granule (what
    /// [`Ipc::export_mapped`] exports): `offset` 0 and `len` one granule; more is past its
    /// end. The mapping keeps the memory alive, whatever its exporter does, until
    /// [`VirtualMemory::unmap`]; `fd` may be closed once this returns.
    fn map_shared(&self, addr: DevicePtr, fd: BorrowedFd<'_>, offset: usize, len: usize) -> Result<()>;
}

/// Streams: making them, waiting for them, ordering them after events, and their capture state.
///
/// Every method may be called from any thread; implementations make whatever driver context
/// the call needs current themselves.
pub trait Streams: Send + Sync {
    /// Creates a non-blocking stream.
    fn create_stream(&self) -> Result<Stream>;
    /// Destroys a stream; work already enqueued on it still completes.
    fn destroy_stream(&self, stream: Stream) -> Result<()>;
    /// Blocks the host until all work on `stream` has completed.
    fn synchronize_stream(&self, stream: Stream) -> Result<()>;
    /// Blocks the host until all work on the device has completed (`cuCtxSynchronize`): what
    /// a `cuMemFree` waits for, naming no stream (one may have been destroyed).
    fn synchronize(&self) -> Result<()>;
    /// Makes all later work on `stream` wait until `event` has completed.
    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()>;
    /// Whether `stream` is capturing into a graph.
    fn capture_status(&self, stream: Stream) -> Result<CaptureStatus>;
    /// Fails with [`InvalidArgument`](crate::Error::InvalidArgument) naming `stream` unless it
    /// is a live stream of this device (the legacy default stream always is). Makes no change
    /// to the stream and is allowed while it captures a graph. The simulator knows every
    /// stream it made; the CUDA driver refuses a stream of another device or context, but the
    /// handle of a *destroyed* stream is undefined behaviour there, as in every driver call
    /// (on an H200 it crashed the process): a stream must not be used after it is destroyed.
    fn check_stream(&self, stream: Stream) -> Result<()>;
}

/// Events: recorded on a stream, queried and waited for by the host.
///
/// Every method may be called from any thread; implementations make whatever driver context
/// the call needs current themselves.
pub trait Events: Send + Sync {
    /// Creates an event with timing disabled.
    fn create_event(&self) -> Result<Event>;
    /// Destroys an event.
    fn destroy_event(&self, event: Event) -> Result<()>;
    /// Records `event` at the current end of `stream`.
    fn record_event(&self, event: Event, stream: Stream) -> Result<()>;
    /// Whether all work captured by `event` has completed (never blocks).
    fn query_event(&self, event: Event) -> Result<bool>;
    /// Blocks the host until `event` has completed.
    fn synchronize_event(&self, event: Event) -> Result<()>;
    /// Waits at most `timeout` for `event` to complete; whether it did. Polls
    /// [`Events::query_event`], sleeping between looks (from 20 us, doubling up to 1 ms).
    fn wait_event(&self, event: Event, timeout: Duration) -> Result<bool> {
        let deadline = Instant::now().checked_add(timeout);
        let mut pause = Duration::from_micros(20);
        loop {
            if self.query_event(event)? {
                return Ok(true);
            }
            let now = Instant::now();
            let left = deadline.map_or(pause, |d| d.saturating_duration_since(now));
            if left.is_zero() {
                return Ok(false);
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

/// CUDA graphs (`AsyncPool`'s captures): capturing a stream's work, instantiating, launching
/// and destroying the graph.
///
/// Every method may be called from any thread; implementations make whatever driver context
/// the call needs current themselves.
pub trait Graphs: Send + Sync {
    /// Starts capturing the work enqueued on `stream` into a graph (relaxed mode).
    fn begin_capture(&self, stream: Stream) -> Result<()>;
    /// Ends the capture on `stream` and returns the graph.
    fn end_capture(&self, stream: Stream) -> Result<Graph>;
    /// Launches an instantiated graph on `stream`.
    fn launch_graph(&self, exec: GraphExec, stream: Stream) -> Result<()>;
    /// Destroys an instantiated graph.
    fn destroy_graph_exec(&self, exec: GraphExec) -> Result<()>;
    /// Destroys a captured graph.
    fn destroy_graph(&self, graph: Graph) -> Result<()>;
    /// Instantiates a captured graph so that each launch first frees the memory the previous
    /// launch allocated and left allocated (`CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`);
    /// without it, such a graph cannot be launched again until that memory is freed.
    fn instantiate_graph_auto_free(&self, graph: Graph) -> Result<GraphExec>;
}

/// A host function enqueued on a stream with [`DeviceTestExt::launch_host_func`].
#[cfg(feature = "test-util")]
pub type HostFn = Box<dyn FnOnce() + Send + 'static>;

/// What tests and measurement programs need from a GPU beyond what allocators call: writing,
/// reading and copying memory, host functions, plain graph instantiation and pool access
/// queries. Only with the crate's `test-util` feature; the allocators see [`Device`] alone.
/// Object-safe: `Arc<dyn DeviceTestExt>` coerces to the `Arc<dyn Device>` allocators take.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use streamalloc::allocators::{StreamSafe, StreamSafeConfig};
/// use streamalloc::device::sim::{SimConfig, SimDevice};
/// use streamalloc::device::DeviceTestExt;
/// use streamalloc::{Allocator, StreamAllocator};
///
/// let device: Arc<dyn DeviceTestExt> = SimDevice::new(SimConfig::with_capacity(1 << 30));
/// let alloc = StreamSafe::new(device.clone(), StreamSafeConfig::default())?;
/// let stream = device.create_stream()?;
/// let a = alloc.allocate_on(1 << 20, stream)?;
/// device.memset_async(a.ptr(), 0xab, a.size(), stream)?; // a use of the memory on `stream`
/// # Ok::<(), streamalloc::Error>(())
/// ```
#[cfg(feature = "test-util")]
pub trait DeviceTestExt: Device {
    /// Whether device `peer` has read-write access to the memory of `pool`
    /// (`cuMemPoolGetAccess`).
    fn pool_access(&self, pool: Pool, peer: usize) -> Result<bool>;
    /// Enqueues a host function on `stream`; the stream waits until it returns.
    fn launch_host_func(&self, stream: Stream, f: HostFn) -> Result<()>;
    /// Fills `len` bytes at `ptr` with `value`, in the order of `stream` (a real use of the
    /// memory).
    fn memset_async(&self, ptr: DevicePtr, value: u8, len: usize, stream: Stream) -> Result<()>;
    /// Copies `len` bytes from `src` on this device to `dst` on device `dst_device`, in the order
    /// of `stream` (a stream of this device; `cuMemcpyPeerAsync`). Fails with
    /// [`Error::InvalidArgument`] when `src` is pool memory whose
    /// pool does not grant `dst_device` access ([`DriverPools::set_pool_access`]), or mapped memory
    /// to which `dst_device` was not granted access ([`VirtualMemory::grant_mapped_access`]).
    fn copy_peer(
        &self,
        dst: DevicePtr,
        dst_device: usize,
        src: DevicePtr,
        len: usize,
        stream: Stream,
    ) -> Result<()>;
    /// Copies `dst.len()` bytes from the device to the host in the order of `stream`, and
    /// waits for the copy.
    fn copy_to_host(&self, dst: &mut [u8], src: DevicePtr, stream: Stream) -> Result<()>;
    /// Copies `src` to the device in the order of `stream` (the source must stay alive, so
    /// this waits for the copy).
    fn copy_from_host(&self, dst: DevicePtr, src: &[u8], stream: Stream) -> Result<()>;
    /// Instantiates a captured graph (without
    /// [`Graphs::instantiate_graph_auto_free`]'s flag: a launch fails while memory the
    /// previous launch allocated is still allocated).
    fn instantiate_graph(&self, graph: Graph) -> Result<GraphExec>;
}

/// The error of a [`DeviceTestExt::copy_peer`] whose source is mapped memory of device `from`
/// to which device `to` was not granted access.
#[cfg(feature = "test-util")]
fn no_mapped_access(src: DevicePtr, from: usize, to: usize) -> Error {
    Error::InvalidArgument(format!(
        "peer copy of {src:#x} from device {from} to device {to}: its mapped memory does not grant \
         device {to} access (Device::grant_mapped_access, streamalloc_enable_peer_access)"
    ))
}

/// The error of a [`DeviceTestExt::copy_peer`] whose source is memory of `pool` (on device
/// `from`) and whose pool does not grant device `to` access.
#[cfg(feature = "test-util")]
fn no_peer_access(src: DevicePtr, from: usize, to: usize, pool: Pool) -> Error {
    Error::InvalidArgument(format!(
        "peer copy of {src:#x} from device {from} to device {to}: its pool {:#x} does not grant \
         device {to} access (Device::set_pool_access, AsyncPool::grant_peer_access)",
        pool.0
    ))
}
