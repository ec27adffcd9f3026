//! A simulated device: deterministic, no GPU, with an ordering checker.
//!
//! # Model
//! * **Time.** A virtual host clock (`now`, in ns) advances by [`SimConfig::tick_ns`] at every
//!   device call, and jumps forward at synchronizations. Each stream is an in-order queue
//!   summarised by the time its last enqueued work completes (`ready`). Work enqueued on a
//!   stream starts at `max(now, ready)`. Neither passes [`MAX_TIME_NS`]:
//!   [`SimDevice::try_advance`] and [`SimDevice::use_range`] refuse what would, so no sum of
//!   times overflows (and [`SimDevice::advance`] stops the clock there).
//! * **Events** capture a stream's `ready` time when recorded and are complete once `now`
//!   reaches it. `stream_wait_event` moves the waiting stream's `ready` to the event's time.
//! * **Plain memory** (`alloc`/`free`) comes from one address space of
//!   [`SimConfig::capacity`] bytes; `free` synchronizes the device, as `cuMemFree` does.
//! * **Pools** model the driver's stream-ordered pools: a freed block is reusable at once by
//!   its own stream; by another stream once the free has completed (opportunistic reuse) or
//!   by inserting a wait on the free (internal dependencies), as the driver's default
//!   attributes allow. Pools reserve in 2 MiB granules and release free granules above the
//!   release threshold at synchronizations, or on `trim_pool`.
//! * **Pool IPC.** An allocation of a pool created exportable is exported with a real
//!   descriptor noted in the export registry ([`Ipc::export_pool_pointer`]) and imported
//!   at the exporter's own address (one address space stands for both processes), counted
//!   until [`Ipc::free_imported`]; freeing the allocation closes its export, and freeing
//!   it while an import is held is a [`ViolationKind::FreeOfImported`].
//! * **Address reservations** ([`VirtualMemory::reserve_address`]) take no memory; mapping a range
//!   of one takes 2 MiB granules from the same memory as plain allocations, and unmapping
//!   the last mapping of a granule gives it back. [`VirtualMemory::map_alias`] maps granules a
//!   second time, at no cost in memory: the checker sees a use through either address as a
//!   use of the one granule, and mapped granules hold bytes (written by `memset_async` and
//!   `copy_from_host`, read by `copy_to_host`, the `DeviceTestExt` methods of the `test-util`
//!   feature; unwritten bytes read as 0), shared by all their mappings. Unmapping a range that a stream's work may still use through that
//!   range is an error (on CUDA it would be a fault or silent corruption).
//! * **Peers.** Each pool keeps the set of other device ordinals granted access to it
//!   ([`DriverPools::set_pool_access`]); the owning device always has it; mapped memory has the set
//!   of [`VirtualMemory::grant_mapped_access`]. A simulated device knows no other device:
//!   `copy_peer` (`test-util`) checks that the source, if it is a pool allocation or mapped memory
//!   of this device, may be read by the destination device, and is otherwise a use of the
//!   source range on the stream, like a memset. Nothing is written anywhere.
//! * **Memory contents.** Only mapped granules hold bytes; plain and pool memory reads as 0.
//! * **Page-locked host memory** ([`HostMemory::host_alloc`]) is real host memory, page-aligned
//!   and zeroed, that callers may write and read; the device counts host allocations and frees
//!   and refuses to free a pointer it did not hand out. [`SimDevice::use_host`] enqueues a use
//!   of it on a stream (a copy to or from the device), and the checker's
//!   [`SimDevice::check_host_handout`] records a [`Violation`] for a range handed to the host
//!   again while such a use could still run; freeing it then is refused and recorded too.
//!   Host uses are checked against host uses only (a host address may equal a simulated
//!   device address), and only on the device that allocated the memory. A copy between it and
//!   device memory ([`HostMemory::copy_to_pinned`], [`HostMemory::copy_from_pinned`]) is a use of both
//!   ranges on its stream, and with the `test-util` feature moves the bytes.
//! * **Sharing with other processes.** [`Ipc::export_mapped`] gives each exported granule
//!   of memory a real file descriptor (one end of a socket pair, which another process can
//!   copy with `pidfd_getfd`), kept until the exporter's last mapping of the memory goes, as
//!   the CUDA device does; [`Ipc::map_shared`] maps the memory that a descriptor of one
//!   (or a copy of one) stands for, on the same simulated device (the receiving "process" is
//!   the same device in the same process). What `map_shared` maps keeps the memory alive and
//!   counted after its exporter unmapped it, until it is unmapped too. Exporting memory not
//!   mapped (or released), mapping a descriptor of no live export, and mapping past the end of
//!   an allocation are errors.
//! * **Host waits.** [`SimDevice::host_waits`] counts the calls that made the host wait for
//!   device work (stream and event synchronizations, bounded event waits, the device
//!   synchronization of a plain free, the waits of host copies).
//! * **Uses and the ordering checker.** [`SimDevice::use_range`] (and `memset_async`) enqueue
//!   a simulated kernel that touches an address range for a duration. Whoever hands memory
//!   out calls [`SimDevice::check_handout`]: if any earlier use of an overlapping range on
//!   *another* stream could still be running when work on the receiving stream can start,
//!   a [`Violation`] is recorded. A device call on memory a kernel may still use (an unmap
//!   of a range an unfinished use touches, which on a GPU is an illegal address for that
//!   kernel) is refused and recorded as a [`Violation`] too.
//! * **Host functions** (`launch_host_func`, `test-util`) run on the thread whose device call moves the clock past their
//!   place in the stream.
//! * **Graph capture** records memsets and peer copies (`test-util`), pool allocations and
//!   pool frees into a graph instead of running them; launching the graph enqueues the memsets
//!   and copies as uses.
//!   - A stream that waits on an event recorded in a capture joins that capture, as on CUDA;
//!     ending the capture fails (as `CUDA_ERROR_STREAM_CAPTURE_UNJOINED` does) if a joined
//!     stream has captured work the origin stream never waited for.
//!   - A captured pool allocation is reserved at capture time and belongs to the graph: a
//!     launch first waits for the memory's previous free. Freed in the same capture, it goes
//!     back to its pool when the graph is destroyed (after its last launch completes).
//!     Not freed in the capture, it is the graph's output: freeing it before the graph was
//!     launched is an error (the driver creates it at launch); once launched it outlives the
//!     graph until freed; a graph never launched gives it back when destroyed. Relaunching a
//!     graph whose output is still allocated fails unless it was instantiated with
//!     [`Graphs::instantiate_graph_auto_free`].
//!   - A captured free of memory allocated outside the capture runs at every launch (so a
//!     second launch frees unknown memory and fails, as on CUDA).
//!   - Graph memory is tied to the graph, not its executable graphs: destroy the executables
//!     first. Unlike the driver's graph memory pool, graphs never share physical memory here.
//!
//! The only randomness (the jitter of the durations of memsets and copies) comes from
//! [`SimConfig::seed`].

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
#[cfg(feature = "test-util")]
use rand::{rngs::SmallRng, SeedableRng};

use super::ipc::{PoolPointer, SharedPiece, POOL_POINTER_DATA};
use super::{
    CaptureStatus, DeviceMemory, DevicePtr, DriverPools, Event, Events, Graph, GraphExec, Graphs, HostMemory,
    HostPtr, Ipc, MemInfo, Pool, PoolAttr, PoolProps, Stream, Streams, VirtualMemory,
};
#[cfg(feature = "test-util")]
use super::{DeviceTestExt, HostFn};
use crate::error::{Error, OutOfMemory, Result};

/// Settings of a simulated device.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Device ordinal reported by [`DeviceMemory::ordinal`].
    pub ordinal: usize,
    /// Bytes of device memory.
    pub capacity: usize,
    /// Host time that passes at each device call, in ns.
    pub tick_ns: u64,
    /// Bytes per ns a memset or copy (`DeviceTestExt`, `test-util`) moves (4.0 TB/s on an H200
    /// is 4000).
    pub bandwidth_bytes_per_ns: u64,
    /// Fixed cost of a memset or copy (`DeviceTestExt`, `test-util`), in ns.
    pub launch_ns: u64,
    /// Seed of the kernel-duration jitter (up to +25%).
    pub seed: u64,
    /// Whether the device supports virtual memory management
    /// ([`VirtualMemory::supports_virtual_memory`]); without it, reservations fail as the driver's
    /// do (`CUDA_ERROR_NOT_SUPPORTED`).
    pub virtual_memory: bool,
}

impl SimConfig {
    /// A device sized like an NVIDIA H200 (143,771 MiB).
    pub fn h200() -> Self {
        Self {
            ordinal: 0,
            capacity: 143_771 << 20,
            tick_ns: 50,
            bandwidth_bytes_per_ns: 4000,
            launch_ns: 2_000,
            seed: 0,
            virtual_memory: true,
        }
    }

    /// An H200-like device with `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> Self {
        Self { capacity, ..Self::h200() }
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        Self::h200()
    }
}

/// What a [`Violation`] did to memory still in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViolationKind {
    /// The range was handed to a stream whose work could start before an earlier use on
    /// another stream ends ([`SimDevice::check_handout`]).
    EarlyReuse,
    /// The range was unmapped ([`VirtualMemory::unmap`]) while a kernel could still use it.
    UnmapInUse,
    /// Page-locked host memory was handed to the host again
    /// ([`SimDevice::check_host_handout`]) while a stream's use of it could still run.
    HostReuse,
    /// Page-locked host memory was freed ([`HostMemory::host_free`]) while a stream's use of it
    /// could still run.
    HostFreeInUse,
    /// A kernel, memset or copy was enqueued on addresses of a reservation that are not all
    /// mapped (a closed IPC range, a sleeping tag's memory, a freed reservation): refused,
    /// as a GPU would fault. `user_stream` is the stream it was enqueued on.
    UnmappedUse,
    /// A pool allocation was freed ([`DriverPools::free_async`]) while another process still held
    /// an import of it ([`Ipc::import_pool_pointer`]): the driver requires every importer
    /// to free its import first.
    FreeOfImported,
}

/// One early reuse, or one device call on memory in use, found by the ordering checker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// What was done to memory in use.
    pub kind: ViolationKind,
    /// Start of the range handed out (or unmapped).
    pub ptr: DevicePtr,
    /// Length of the range handed out (or unmapped).
    pub len: usize,
    /// The stream that received it ([`Stream::DEFAULT`] for an unmap and for host memory,
    /// which no stream receives).
    pub stream: Stream,
    /// The earliest time work on `stream` could touch it (for an unmap: the time of the
    /// call).
    pub usable_at: u64,
    /// The stream of the earlier use still running.
    pub user_stream: Stream,
    /// Start of the earlier use's range.
    pub user_ptr: DevicePtr,
    /// When the earlier use ends.
    pub use_ends_at: u64,
}

/// Plain allocations are rounded to this many bytes.
const PLAIN_GRANULE: usize = 512;
/// Pools reserve memory in granules of this many bytes.
const POOL_GRANULE: usize = 2 << 20;
/// Granularity of mappings into address reservations, as on NVIDIA GPUs.
const MAP_GRANULE: usize = 2 << 20;
/// Address reservations start here, apart from the device's memory.
const RESERVED_BASE: u64 = 1 << 50;
/// Distance between the reservations of successive device ordinals.
const RESERVED_STRIDE: u64 = 1 << 46;
/// Pool allocations are rounded to this many bytes.
const POOL_ALIGN: usize = 512;
/// Where the simulated address space starts.
const BASE_ADDRESS: u64 = 0x7f00_0000_0000;
/// Address space between two devices' bases (16 TiB, more than any simulated capacity), so
/// that simulated devices, like CUDA devices under unified addressing, never hand out the
/// same address.
const DEVICE_STRIDE: u64 = 1 << 44;

/// The latest virtual time, in ns, that the simulated clock and the streams' work reach
/// (2^62 ns, about 146 years): [`SimDevice::try_advance`] and [`SimDevice::use_range`] refuse
/// to move either past it.
pub const MAX_TIME_NS: u64 = 1 << 62;

/// The simulated device. Create with [`SimDevice::new`]; implements [`Device`](super::Device).
pub struct SimDevice {
    config: SimConfig,
    state: Mutex<State>,
    /// Run at the start of each [`Device::record_event`] ([`SimDevice::set_record_hook`]).
    #[cfg(feature = "test-util")]
    record_hook: Mutex<Option<RecordHook>>,
}

/// What [`SimDevice::set_record_hook`] runs: given the stream an event is about to be recorded on.
#[cfg(feature = "test-util")]
pub type RecordHook = Arc<dyn Fn(Stream) + Send + Sync>;

#[derive(Default)]
struct StreamState {
    ready: u64,
    /// The id of the capture this stream takes part in.
    capture: Option<u64>,
}

#[derive(Clone, Copy)]
enum Node {
    /// A use of a range: a memset of `value`, or a read (a peer copy's source) when `None`.
    #[cfg(feature = "test-util")]
    Memset {
        ptr: DevicePtr,
        len: usize,
        value: Option<u8>,
    },
    /// A pool allocation; launches wait until `after`, when its previous free completes.
    Alloc {
        ptr: DevicePtr,
        after: u64,
    },
    Free {
        ptr: DevicePtr,
    },
}

/// A capture in progress; its id becomes the graph's handle.
struct CaptureRec {
    origin: Stream,
    nodes: Vec<Node>,
    /// Joined streams: (nodes captured on it, of those, how many the origin waited for).
    sides: HashMap<Stream, (u64, u64)>,
}

struct GraphRec {
    nodes: Vec<Node>,
    /// When the work of the last launch completes; `None` if never launched.
    launched_until: Option<u64>,
}

struct ExecRec {
    graph: Graph,
    nodes: Vec<Node>,
    auto_free: bool,
}

struct Use {
    ptr: DevicePtr,
    len: usize,
    stream: Stream,
    end: u64,
    /// The memory behind the range: for mapped granules, where [`State::mapped`] says; for
    /// anything else, the range itself.
    memory: Vec<(u64, u64)>,
    /// Whether the range is page-locked host memory ([`SimDevice::use_host`]).
    host: bool,
}

/// The bytes of a mapped granule that has been written.
#[cfg(feature = "test-util")]
enum Bytes {
    /// Every byte holds this value.
    Fill(u8),
    /// The granule's bytes.
    Data(Box<[u8]>),
}

#[derive(Clone, Copy)]
struct FreeBlock {
    size: usize,
    /// When the free that made it completes.
    avail_at: u64,
    /// The stream it was freed on; `None` after merging blocks of different streams.
    stream: Option<Stream>,
}

struct PoolState {
    release_threshold: u64,
    follow_events: bool,
    opportunistic: bool,
    internal_deps: bool,
    max_size: usize,
    /// Other devices granted access to the pool's memory.
    peers: BTreeSet<usize>,
    /// Granule runs reserved from the address space: start -> size.
    chunks: BTreeMap<u64, usize>,
    /// Free blocks by address; never span two chunks.
    free: BTreeMap<u64, FreeBlock>,
    reserved: usize,
    reserved_high: usize,
    used: usize,
    used_high: usize,
}

impl PoolState {
    fn new(max_size: usize) -> Self {
        Self {
            release_threshold: 0,
            follow_events: true,
            opportunistic: true,
            internal_deps: true,
            max_size,
            peers: BTreeSet::new(),
            chunks: BTreeMap::new(),
            free: BTreeMap::new(),
            reserved: 0,
            reserved_high: 0,
            used: 0,
            used_high: 0,
        }
    }

    fn chunk_of(&self, addr: u64) -> Option<(u64, usize)> {
        self.chunks.range(..=addr).next_back().filter(|(s, n)| addr < **s + **n as u64).map(|(s, n)| (*s, *n))
    }
}

/// Best-fit free ranges of the address space.
#[derive(Default)]
struct AddressSpace {
    by_addr: BTreeMap<u64, usize>,
    by_size: BTreeSet<(usize, u64)>,
    used: usize,
}

impl AddressSpace {
    fn new(base: u64, capacity: usize) -> Self {
        let mut s = Self::default();
        s.insert(base, capacity);
        s
    }

    fn insert(&mut self, addr: u64, size: usize) {
        self.by_addr.insert(addr, size);
        self.by_size.insert((size, addr));
    }

    fn remove(&mut self, addr: u64, size: usize) {
        self.by_addr.remove(&addr);
        self.by_size.remove(&(size, addr));
    }

    fn take(&mut self, size: usize) -> Option<u64> {
        let &(have, addr) = self.by_size.range((size, 0)..).next()?;
        self.remove(addr, have);
        if have > size {
            self.insert(addr + size as u64, have - size);
        }
        self.used += size;
        Some(addr)
    }

    fn give(&mut self, mut addr: u64, mut size: usize) {
        self.used -= size;
        if let Some((&next, &n)) = self.by_addr.range(addr + size as u64..).next() {
            if next == addr + size as u64 {
                self.remove(next, n);
                size += n;
            }
        }
        if let Some((&prev, &p)) = self.by_addr.range(..addr).next_back() {
            if prev + p as u64 == addr {
                self.remove(prev, p);
                addr = prev;
                size += p;
            }
        }
        self.insert(addr, size);
    }
}

struct State {
    now: u64,
    /// Kernel-duration jitter.
    #[cfg(feature = "test-util")]
    rng: SmallRng,
    next_id: u64,
    space: AddressSpace,
    plain: HashMap<DevicePtr, usize>,
    streams: HashMap<Stream, StreamState>,
    /// The latest `ready` any stream has had (destroyed ones included: their work still runs),
    /// so that a device-wide synchronization looks at no stream.
    latest_ready: u64,
    /// Recorded events: the time they complete. Unrecorded events are absent (complete).
    events: HashMap<Event, Option<u64>>,
    pools: HashMap<Pool, PoolState>,
    default_pool: Pool,
    /// Live pool allocations: pointer -> (pool, rounded size).
    async_allocs: HashMap<DevicePtr, (Pool, usize)>,
    uses: Vec<Use>,
    violations: Vec<Violation>,
    /// Host functions waiting for the clock: (time, sequence) -> function.
    #[cfg(feature = "test-util")]
    host_fns: BTreeMap<(u64, u64), HostFn>,
    captures: HashMap<u64, CaptureRec>,
    /// Events last recorded in a capture: (capture, stream, nodes captured on that stream).
    capture_events: HashMap<Event, (u64, Stream, u64)>,
    graphs: HashMap<Graph, GraphRec>,
    execs: HashMap<GraphExec, ExecRec>,
    /// Live pool allocations made by a capture: pointer -> capture (and graph) id.
    graph_mem: HashMap<DevicePtr, u64>,
    /// Address reservations: start -> size.
    reservations: BTreeMap<u64, usize>,
    /// Freed reservations (start -> length), reused once the window has no fresh room, as a
    /// driver reuses freed address ranges.
    freed_reservations: BTreeMap<u64, u64>,
    /// Where the next reservation starts.
    next_reservation: u64,
    /// Mapped granules of reservations: address -> the memory behind it, taken from `space`.
    mapped: BTreeMap<u64, u64>,
    /// Mappings of each granule of memory in `mapped`; it goes back to `space` with its last.
    mappings: HashMap<u64, u32>,
    /// Memory exported to other processes, and mappings of it by [`Ipc::map_shared`].
    shared: Shared,
    /// Pool allocations exported to other processes and imports of them.
    pool_ipc: PoolIpc,
    /// The bytes of granules of memory in `mapped` that were written.
    #[cfg(feature = "test-util")]
    contents: HashMap<u64, Bytes>,
    /// Device calls so far.
    calls: u64,
    /// Calls that made the host wait for device work.
    host_waits: u64,
    /// Records (streams, kernels) looked at by calls that look at the whole device.
    device_wide_visits: u64,
    /// Calls that named a stream the device does not know (never made, or destroyed).
    unknown_stream_calls: u64,
    /// Successful calls of [`VirtualMemory::map_alias`].
    aliases: u64,
    /// Successful calls of [`VirtualMemory::map`], [`VirtualMemory::map_alias`] and [`VirtualMemory::unmap`].
    mapping_calls: u64,
    /// Granules those calls mapped or unmapped.
    mapped_granules: u64,
    /// Other devices granted access to mapped memory.
    mapped_peers: BTreeSet<usize>,
    /// Page-locked host memory handed out: address -> its pages.
    host: BTreeMap<HostPtr, Vec<HostPage>>,
    /// Successful calls of [`HostMemory::host_alloc`] and of [`HostMemory::host_free`].
    host_calls: (u64, u64),
}

/// Bytes of a page of simulated page-locked host memory.
const HOST_PAGE: usize = 4096;

/// One page of simulated page-locked host memory: its alignment makes host allocations
/// page-aligned, as the driver's are.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct HostPage([u8; HOST_PAGE]);

impl SimDevice {
    /// A new simulated device.
    pub fn new(config: SimConfig) -> Arc<Self> {
        let mut streams = HashMap::new();
        streams.insert(Stream::DEFAULT, StreamState::default());
        let default_pool = Pool(1);
        let mut pools = HashMap::new();
        pools.insert(default_pool, PoolState::new(0));
        let state = State {
            now: 0,
            #[cfg(feature = "test-util")]
            rng: SmallRng::seed_from_u64(config.seed),
            next_id: 2,
            space: AddressSpace::new(BASE_ADDRESS + config.ordinal as u64 * DEVICE_STRIDE, config.capacity),
            plain: HashMap::new(),
            streams,
            latest_ready: 0,
            events: HashMap::new(),
            pools,
            default_pool,
            async_allocs: HashMap::new(),
            uses: Vec::new(),
            violations: Vec::new(),
            #[cfg(feature = "test-util")]
            host_fns: BTreeMap::new(),
            captures: HashMap::new(),
            capture_events: HashMap::new(),
            graphs: HashMap::new(),
            execs: HashMap::new(),
            graph_mem: HashMap::new(),
            reservations: BTreeMap::new(),
            freed_reservations: BTreeMap::new(),
            next_reservation: RESERVED_BASE + config.ordinal as u64 * RESERVED_STRIDE,
            mapped: BTreeMap::new(),
            mappings: HashMap::new(),
            shared: Shared::default(),
            pool_ipc: PoolIpc::default(),
            #[cfg(feature = "test-util")]
            contents: HashMap::new(),
            calls: 0,
            host_waits: 0,
            device_wide_visits: 0,
            unknown_stream_calls: 0,
            aliases: 0,
            mapping_calls: 0,
            mapped_granules: 0,
            mapped_peers: BTreeSet::new(),
            host: BTreeMap::new(),
            host_calls: (0, 0),
        };
        Arc::new(Self {
            config,
            state: Mutex::new(state),
            #[cfg(feature = "test-util")]
            record_hook: Mutex::new(None),
        })
    }

    /// Runs `hook` at the start of every later [`Device::record_event`], on the calling thread,
    /// before the event is recorded and outside the device's lock (so it may block while other
    /// threads use the device), with the stream named; `None` removes it. For tests that stop a
    /// thread between two steps of a call that records an event (a free on recorded streams).
    #[cfg(feature = "test-util")]
    pub fn set_record_hook(&self, hook: Option<RecordHook>) {
        *self.record_hook.lock() = hook;
    }

    /// The virtual host clock, in ns.
    pub fn now(&self) -> u64 {
        self.state.lock().now
    }

    /// Moves the host clock forward by `ns`, running host functions that come due; the clock
    /// stops at [`MAX_TIME_NS`] ([`SimDevice::try_advance`] refuses to pass it instead).
    pub fn advance(&self, ns: u64) {
        let advanced: Result<()> = self.call(|st| {
            st.now = st.now.saturating_add(ns).min(MAX_TIME_NS);
            Ok(())
        });
        debug_assert!(advanced.is_ok());
    }

    /// Moves the host clock forward by `ns`, running host functions that come due; an error,
    /// the clock not moved by `ns`, if that would take it past [`MAX_TIME_NS`].
    pub fn try_advance(&self, ns: u64) -> Result<()> {
        self.call(|st| {
            st.now = st.now.checked_add(ns).filter(|t| *t <= MAX_TIME_NS).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "advancing the simulated clock by {ns} ns from {} ns would pass its maximum, {MAX_TIME_NS} ns",
                    st.now
                ))
            })?;
            Ok(())
        })
    }

    /// Enqueues a simulated kernel on `stream` that touches `len` bytes at `ptr` for
    /// `duration_ns`. During a capture the use is not run (and not recorded). An error,
    /// nothing enqueued, for a range that is not all in this device's addresses (its memory
    /// and its address reservations: another device's memory is that device's to use), and
    /// for a kernel that would end past [`MAX_TIME_NS`].
    pub fn use_range(&self, ptr: DevicePtr, len: usize, stream: Stream, duration_ns: u64) -> Result<()> {
        self.call(|st| {
            if !self.holds_range(st, ptr, len) {
                return Err(Error::InvalidArgument(format!(
                    "a kernel on device {} over {ptr:#x}+{len}: not memory of this simulated device \
                     (another device's, or no device's)",
                    self.config.ordinal
                )));
            }
            self.refuse_unmapped(st, ptr, len, stream, "a kernel")?;
            st.enqueue_use(ptr, len, stream, duration_ns, false)
        })
    }

    /// Refuses work (`what`) on `stream` over `[ptr, ptr + len)` when part of it lies in the
    /// address reservations' window but is not mapped (reserved only, or no longer reserved),
    /// recording an [`ViolationKind::UnmappedUse`]: the checker sees use after close, after
    /// sleep and after release.
    fn refuse_unmapped(
        &self,
        st: &mut State,
        ptr: DevicePtr,
        len: usize,
        stream: Stream,
        what: &str,
    ) -> Result<()> {
        let window = RESERVED_BASE + self.config.ordinal as u64 * RESERVED_STRIDE;
        let end = ptr.saturating_add(len as u64);
        if len == 0 || end <= window || ptr >= st.next_reservation {
            return Ok(());
        }
        let (from, to) = (ptr.max(window), end.min(st.next_reservation));
        let first = from - from % MAP_GRANULE as u64;
        let unmapped = (first..to).step_by(MAP_GRANULE).find(|g| !st.mapped.contains_key(g));
        let Some(granule) = unmapped else { return Ok(()) };
        let now = st.now;
        st.violations.push(Violation {
            kind: ViolationKind::UnmappedUse,
            ptr,
            len,
            stream,
            usable_at: now,
            user_stream: stream,
            user_ptr: ptr,
            use_ends_at: now,
        });
        Err(Error::InvalidArgument(format!(
            "{what} on stream {:#x} over {ptr:#x}+{len}: granule {granule:#x} is not mapped (reserved only, \
             or its reservation freed: memory closed, slept or released); refused, as a GPU would fault",
            stream.0
        )))
    }

    /// Tells the checker that `len` bytes at `ptr` were just handed to `stream`. Records a
    /// [`Violation`] for every earlier use on another stream that could still be running when
    /// work on `stream` can start ([`SimDevice::early_reuses`]). Returns how many it recorded.
    pub fn check_handout(&self, ptr: DevicePtr, len: usize, stream: Stream) -> usize {
        let found = self.early_reuses(ptr, len, stream);
        let n = found.len();
        self.state.lock().violations.extend(found);
        n
    }

    /// The early reuses [`SimDevice::check_handout`] would record for `len` bytes at `ptr`
    /// handed to `stream` now, without recording them: for a caller that can tell only
    /// afterwards whether the check ran at the hand-out (nothing else used the memory between).
    pub fn early_reuses(&self, ptr: DevicePtr, len: usize, stream: Stream) -> Vec<Violation> {
        let mut st = self.state.lock();
        let now = st.now;
        let usable_at = st.streams.get(&stream).map_or(now, |s| s.ready.max(now));
        st.uses.retain(|u| u.end > now);
        let memory = st.memory_of(ptr, len);
        let overlaps =
            |u: &Use| u.memory.iter().any(|&(a, n)| memory.iter().any(|&(b, m)| a < b + m && b < a + n));
        st.uses
            .iter()
            .filter(|u| !u.host && u.stream != stream && u.end > usable_at)
            .filter(|u| overlaps(u))
            .map(|u| Violation {
                kind: ViolationKind::EarlyReuse,
                ptr,
                len,
                stream,
                usable_at,
                user_stream: u.stream,
                user_ptr: u.ptr,
                use_ends_at: u.end,
            })
            .collect()
    }

    /// Every violation the checker has recorded.
    pub fn violations(&self) -> Vec<Violation> {
        self.state.lock().violations.clone()
    }

    /// How many device calls (of any kind, [`SimDevice::use_range`] included) were made so far.
    pub fn calls(&self) -> u64 {
        self.state.lock().calls
    }

    /// How many calls so far made the host wait for device work (see the [module docs](self)).
    pub fn host_waits(&self) -> u64 {
        self.state.lock().host_waits
    }

    /// How many stream and kernel records the calls that look at the whole device (a device
    /// synchronization, the end of a capture) have looked at so far: the simulator's work that
    /// grows with the streams and kernels it holds, counted so that tests can bound it.
    pub fn device_wide_visits(&self) -> u64 {
        self.state.lock().device_wide_visits
    }

    /// How many calls so far named a stream the device does not know: never made, or
    /// destroyed (undefined behaviour on a GPU, where the handle of a destroyed stream may
    /// crash the process).
    pub fn unknown_stream_calls(&self) -> u64 {
        self.state.lock().unknown_stream_calls
    }

    /// How many calls of [`VirtualMemory::map_alias`] so far mapped memory a second time.
    pub fn aliases(&self) -> u64 {
        self.state.lock().aliases
    }

    /// How many calls of [`VirtualMemory::map`], [`VirtualMemory::map_alias`] and [`VirtualMemory::unmap`] so far
    /// succeeded: the virtual-memory calls that cost microseconds each on a GPU.
    pub fn mapping_calls(&self) -> u64 {
        self.state.lock().mapping_calls
    }

    /// How many granules those calls mapped or unmapped so far (on a GPU a mapping's host time
    /// grows with its granules).
    pub fn mapped_granules(&self) -> u64 {
        self.state.lock().mapped_granules
    }

    /// Granules of memory exported to other processes ([`Ipc::export_mapped`]) whose
    /// descriptor is still open: the exporter still maps them.
    pub fn exported(&self) -> usize {
        self.state.lock().shared.exports.len()
    }

    /// Pool allocations exported ([`Ipc::export_pool_pointer`]) and not yet freed, and
    /// imports of them ([`Ipc::import_pool_pointer`]) not yet freed.
    pub fn pool_exports(&self) -> (usize, usize) {
        let st = self.state.lock();
        (st.pool_ipc.exports.len(), st.pool_ipc.imports.values().map(|&n| n as usize).sum())
    }

    /// Streams created and not yet destroyed (the default stream not counted).
    pub fn live_streams(&self) -> usize {
        self.state.lock().streams.len() - 1
    }

    /// When all work enqueued so far on `stream` completes (virtual ns).
    pub fn stream_ready_at(&self, stream: Stream) -> Option<u64> {
        self.state.lock().streams.get(&stream).map(|s| s.ready)
    }

    /// Whether `[ptr, ptr + len)` lies in this device's addresses: its memory, or the span
    /// its address reservations were made in.
    fn holds_range(&self, st: &State, ptr: DevicePtr, len: usize) -> bool {
        let ordinal = self.config.ordinal as u64;
        let within = |start: Option<u64>, end: u64| {
            start.is_some_and(|start| ptr >= start && ptr.checked_add(len as u64).is_some_and(|e| e <= end))
        };
        let memory = ordinal.checked_mul(DEVICE_STRIDE).and_then(|o| o.checked_add(BASE_ADDRESS));
        let reserved = ordinal.checked_mul(RESERVED_STRIDE).and_then(|o| o.checked_add(RESERVED_BASE));
        within(memory, memory.map_or(0, |m| m.saturating_add(self.config.capacity as u64)))
            || within(reserved, st.next_reservation)
    }

    /// Runs one device call: ticks the clock (never past [`MAX_TIME_NS`]), applies `f`, then
    /// runs due host functions outside the lock.
    fn call<T>(&self, f: impl FnOnce(&mut State) -> Result<T>) -> Result<T> {
        let mut st = self.state.lock();
        st.now = st.now.saturating_add(self.config.tick_ns).min(MAX_TIME_NS);
        st.calls += 1;
        let out = f(&mut st);
        #[cfg(feature = "test-util")]
        {
            let due = st.take_due_host_fns();
            drop(st);
            for h in due {
                h();
            }
        }
        out
    }

    fn oom(&self, st: &State, requested: usize) -> Error {
        Error::oom(OutOfMemory {
            device: self.config.ordinal,
            requested,
            device_free: self.config.capacity - st.space.used,
            device_total: self.config.capacity,
            hint: "the simulated device is full".into(),
            ..OutOfMemory::default()
        })
    }
}

/// Page-locked host memory (see the [module docs](self)).
impl SimDevice {
    /// Enqueues on `stream` a use of `len` bytes of page-locked host memory at `ptr` (a copy
    /// to or from the device) for `duration_ns`. During a capture the use is not run (and not
    /// recorded). An error, nothing enqueued, for a range that is not all in one live host
    /// allocation of this device, and for a use that would end past [`MAX_TIME_NS`].
    pub fn use_host(&self, ptr: HostPtr, len: usize, stream: Stream, duration_ns: u64) -> Result<()> {
        self.call(|st| {
            let held = st.host.range(..=ptr).next_back().is_some_and(|(&start, pages)| {
                ptr.checked_add(len as u64).is_some_and(|end| end <= start + (pages.len() * HOST_PAGE) as u64)
            });
            if !held {
                return Err(Error::InvalidArgument(format!(
                    "a copy on device {} over host memory {ptr:#x}+{len}: not page-locked host memory \
                     that this simulated device handed out",
                    self.config.ordinal
                )));
            }
            st.enqueue_use(ptr, len, stream, duration_ns, true)
        })
    }

    /// Tells the checker that `len` bytes of page-locked host memory at `ptr` were just handed
    /// to the host, which may write them at once. Records a [`Violation`] for every use of an
    /// overlapping range ([`SimDevice::use_host`]) that could still be running. Returns how
    /// many it recorded.
    pub fn check_host_handout(&self, ptr: HostPtr, len: usize) -> usize {
        let mut st = self.state.lock();
        let now = st.now;
        st.uses.retain(|u| u.end > now);
        let found: Vec<Violation> = st
            .uses
            .iter()
            .filter(|u| u.host && overlaps(u.ptr, u.len, ptr, len))
            .map(|u| host_violation(ViolationKind::HostReuse, ptr, len, now, u))
            .collect();
        let n = found.len();
        st.violations.extend(found);
        n
    }

    /// A copy of `len` bytes between device memory at `device` and page-locked host memory at
    /// `host` (to the host when `to_host`) on `stream` ([`HostMemory::copy_to_pinned`],
    /// [`HostMemory::copy_from_pinned`]): a use of both ranges for [`SimConfig::launch_ns`] and the
    /// bytes at [`SimConfig::bandwidth_bytes_per_ns`]; with the `test-util` feature the bytes
    /// move too, at once (the device's as mapped granules hold them). Refused for host memory
    /// this device did not hand out, for device memory not its own, for a range of an address
    /// reservation that is not all mapped (on a GPU, an illegal address), and on a capturing
    /// stream.
    fn copy_pinned(
        &self,
        device: DevicePtr,
        host: HostPtr,
        len: usize,
        stream: Stream,
        to_host: bool,
    ) -> Result<()> {
        let call = if to_host { "copy_to_pinned" } else { "copy_from_pinned" };
        self.call(|st| {
            let held = st.host.range(..=host).next_back().is_some_and(|(&start, pages)| {
                host.checked_add(len as u64).is_some_and(|end| end <= start + (pages.len() * HOST_PAGE) as u64)
            });
            if !held {
                return Err(Error::InvalidArgument(format!(
                    "{call} of {len} bytes at host address {host:#x}: not page-locked host memory that \
                     simulated device {} handed out",
                    self.config.ordinal
                )));
            }
            if !self.holds_range(st, device, len) || !st.mapped_where_reserved(device, len) {
                return Err(Error::InvalidArgument(format!(
                    "{call} of {len} bytes at {device:#x}: not memory of simulated device {} (or not all mapped)",
                    self.config.ordinal
                )));
            }
            if len == 0 {
                return Ok(());
            }
            if st.stream_mut(stream)?.capture.is_some() {
                return Err(Error::Unsupported(format!(
                    "{call} on stream {:#x} while it is capturing a graph",
                    stream.0
                )));
            }
            let ns = self.config.launch_ns + len as u64 / self.config.bandwidth_bytes_per_ns.max(1);
            #[cfg(feature = "test-util")]
            st.move_pinned(device, host, len, to_host);
            st.enqueue_use(device, len, stream, ns, false)?;
            // The same span of the stream's time on the host memory.
            let end = st.stream_mut(stream)?.ready;
            st.uses.push(Use { ptr: host, len, stream, end, memory: vec![(host, len as u64)], host: true });
            Ok(())
        })
    }

    /// How many calls of [`HostMemory::host_alloc`], and of [`HostMemory::host_free`], succeeded so
    /// far.
    pub fn host_calls(&self) -> (u64, u64) {
        self.state.lock().host_calls
    }

    /// Bytes of page-locked host memory handed out and not freed (whole pages).
    pub fn host_bytes(&self) -> usize {
        self.state.lock().host.values().map(|pages| pages.len() * HOST_PAGE).sum()
    }
}

/// Whether `[a, a + n)` and `[b, b + m)` overlap.
fn overlaps(a: u64, n: usize, b: u64, m: usize) -> bool {
    a < b.saturating_add(m as u64) && b < a.saturating_add(n as u64)
}

/// The violation of `kind` that `[ptr, ptr + len)`, page-locked host memory, meets at `now`:
/// the host takes it (or frees it) while `user` may still run.
fn host_violation(kind: ViolationKind, ptr: HostPtr, len: usize, now: u64, user: &Use) -> Violation {
    Violation {
        kind,
        ptr,
        len,
        stream: Stream::DEFAULT,
        usable_at: now,
        user_stream: user.stream,
        user_ptr: user.ptr,
        use_ends_at: user.end,
    }
}

impl State {
    /// Enqueues on `stream` a use of `[ptr, ptr + len)`, host memory or not, for
    /// `duration_ns` ([`SimDevice::use_range`], [`SimDevice::use_host`]); nothing during a
    /// capture.
    fn enqueue_use(
        &mut self,
        ptr: u64,
        len: usize,
        stream: Stream,
        duration_ns: u64,
        host: bool,
    ) -> Result<()> {
        let now = self.now;
        let s = self.stream_mut(stream)?;
        if s.capture.is_some() {
            return Ok(());
        }
        let start = s.ready.max(now);
        let end = start.checked_add(duration_ns).filter(|e| *e <= MAX_TIME_NS).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "a kernel of {duration_ns} ns from {start} ns would end past the simulated clock's \
                 maximum, {MAX_TIME_NS} ns"
            ))
        })?;
        s.ready = end;
        self.latest_ready = self.latest_ready.max(end);
        if self.uses.len() > 4096 {
            self.uses.retain(|u| u.end > now);
        }
        let memory = if host { vec![(ptr, len as u64)] } else { self.memory_of(ptr, len) };
        self.uses.push(Use { ptr, len, stream, end, memory, host });
        Ok(())
    }

    /// Whether every granule of `[ptr, ptr + len)` that lies in an address reservation is
    /// mapped (the rest of the range is plain or pool memory).
    fn mapped_where_reserved(&self, ptr: u64, len: usize) -> bool {
        let end = ptr.saturating_add(len as u64);
        let first = ptr - ptr % MAP_GRANULE as u64;
        (first..end).step_by(MAP_GRANULE).all(|g| {
            let reserved =
                self.reservations.range(..=g).next_back().is_some_and(|(&start, &n)| g < start + n as u64);
            !reserved || self.mapped.contains_key(&g)
        })
    }

    /// Checks that `[addr, addr + size)` is granule-aligned, not empty and inside one
    /// reservation.
    fn check_reserved(&self, addr: u64, size: usize) -> Result<()> {
        let inside = self
            .reservations
            .range(..=addr)
            .next_back()
            .is_some_and(|(&start, &len)| addr + size as u64 <= start + len as u64);
        if size == 0 || size % MAP_GRANULE != 0 || addr % MAP_GRANULE as u64 != 0 || !inside {
            return Err(Error::InvalidArgument(format!(
                "{addr:#x}+{size} is not a granule-aligned range of one reservation"
            )));
        }
        Ok(())
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn stream_mut(&mut self, stream: Stream) -> Result<&mut StreamState> {
        if !self.streams.contains_key(&stream) {
            self.unknown_stream_calls += 1;
        }
        self.streams
            .get_mut(&stream)
            .ok_or_else(|| Error::InvalidArgument(format!("unknown or destroyed stream {:#x}", stream.0)))
    }

    /// The memory behind `[ptr, ptr + len)`, in pieces: mapped granules of reservations
    /// translated to their memory, anything else as it is. Visits the mapped granules in the
    /// range only, not every granule of it (a huge range would take hours under the lock).
    fn memory_of(&self, ptr: u64, len: usize) -> Vec<(u64, u64)> {
        let end = ptr.saturating_add(len as u64);
        let first = ptr - ptr % MAP_GRANULE as u64;
        let mut mapped = self.mapped.range(first..end).peekable();
        if mapped.peek().is_none() {
            return vec![(ptr, len as u64)];
        }
        let mut pieces: Vec<(u64, u64)> = Vec::new();
        let mut push = |start: u64, n: u64| match pieces.last_mut() {
            _ if n == 0 => {}
            Some((s, m)) if *s + *m == start => *m += n,
            _ => pieces.push((start, n)),
        };
        let mut at = ptr;
        for (&granule, &memory) in mapped {
            // Unmapped addresses before the granule stand for themselves.
            push(at, granule.saturating_sub(at));
            let from = at.max(granule);
            let to = (granule + MAP_GRANULE as u64).min(end);
            push(memory + (from - granule), to - from);
            at = to;
        }
        push(at, end - at);
        pieces
    }

    /// Waits for every stream (as `cuCtxSynchronize` would) and applies release thresholds.
    fn sync_device(&mut self) {
        self.host_waits += 1;
        self.now = self.now.max(self.latest_ready);
        self.apply_thresholds();
    }

    fn apply_thresholds(&mut self) {
        let pools: Vec<Pool> = self.pools.keys().copied().collect();
        for p in pools {
            let keep = self.pools[&p].release_threshold as usize;
            self.trim(p, keep);
        }
    }

    /// Releases chunks that are wholly free (with completed frees) while more than `keep`
    /// bytes are reserved.
    fn trim(&mut self, pool: Pool, keep: usize) {
        let now = self.now;
        let Some(p) = self.pools.get_mut(&pool) else { return };
        let mut released = Vec::new();
        for (&start, &size) in &p.chunks {
            if p.reserved.saturating_sub(released.iter().map(|(_, n)| n).sum::<usize>()) <= keep {
                break;
            }
            if let Some(b) = p.free.get(&start) {
                if b.size == size && b.avail_at <= now {
                    released.push((start, size));
                }
            }
        }
        for (start, size) in released {
            p.chunks.remove(&start);
            p.free.remove(&start);
            p.reserved -= size;
            self.space.give(start, size);
        }
    }

    /// Adds `node` to the capture `stream` takes part in; `false` if it is not capturing.
    fn capture_node(&mut self, stream: Stream, node: Node) -> Result<bool> {
        let Some(c) = self.stream_mut(stream)?.capture else { return Ok(false) };
        let rec = self
            .captures
            .get_mut(&c)
            .ok_or_else(|| Error::Internal("simulator: capturing streams name a live capture".into()))?;
        rec.nodes.push(node);
        if stream != rec.origin {
            rec.sides.entry(stream).or_default().0 += 1;
        }
        Ok(true)
    }

    /// Returns a pool allocation to its pool, reusable from `avail_at` (at once by `stream`).
    fn pool_free(&mut self, ptr: DevicePtr, stream: Option<Stream>, avail_at: u64) -> Result<()> {
        let (pool, n) = self
            .async_allocs
            .remove(&ptr)
            .ok_or_else(|| Error::InvalidArgument(format!("free_async of unknown pointer {ptr:#x}")))?;
        self.graph_mem.remove(&ptr);
        if self.pool_ipc.imports.get(&ptr).is_some_and(|&n| n > 0) {
            let now = self.now;
            self.violations.push(Violation {
                kind: ViolationKind::FreeOfImported,
                ptr,
                len: n,
                stream: stream.unwrap_or(Stream::DEFAULT),
                usable_at: now,
                user_stream: Stream::DEFAULT,
                user_ptr: ptr,
                use_ends_at: now,
            });
        }
        self.pool_ipc.forget(ptr);
        let p = self
            .pools
            .get_mut(&pool)
            .ok_or_else(|| Error::Internal("simulator: allocations of destroyed pools are dropped".into()))?;
        p.used -= n;
        let (chunk, chunk_len) = p
            .chunk_of(ptr)
            .ok_or_else(|| Error::Internal("simulator: pool allocations lie in its chunks".into()))?;
        let chunk_end = chunk + chunk_len as u64;
        let mut addr = ptr;
        let mut block = FreeBlock { size: n, avail_at, stream };
        let merge = |a: FreeBlock, b: FreeBlock| FreeBlock {
            size: a.size + b.size,
            avail_at: a.avail_at.max(b.avail_at),
            stream: if a.stream == b.stream { a.stream } else { None },
        };
        let next = addr + n as u64;
        if next < chunk_end {
            if let Some(b) = p.free.remove(&next) {
                block = merge(block, b);
            }
        }
        if let Some((&prev, &b)) = p.free.range(chunk..addr).next_back() {
            if prev + b.size as u64 == addr {
                p.free.remove(&prev);
                addr = prev;
                block = merge(b, block);
            }
        }
        p.free.insert(addr, block);
        Ok(())
    }

    /// Gives back the memory of a graph's allocations that no longer exist: those freed in
    /// the graph, and all of them if it never ran. Outputs of a launched graph stay.
    fn release_graph_mem(&mut self, id: u64, nodes: &[Node], launched_until: Option<u64>) -> Result<()> {
        let freed: BTreeSet<DevicePtr> =
            nodes.iter().filter_map(|n| if let Node::Free { ptr } = n { Some(*ptr) } else { None }).collect();
        let avail_at = launched_until.unwrap_or(0).max(self.now);
        for node in nodes {
            let Node::Alloc { ptr, .. } = *node else { continue };
            if self.graph_mem.get(&ptr) != Some(&id) {
                continue;
            }
            if freed.contains(&ptr) || launched_until.is_none() {
                self.pool_free(ptr, None, avail_at)?;
            } else {
                self.graph_mem.remove(&ptr);
            }
        }
        Ok(())
    }

    fn instantiate(&mut self, graph: Graph, auto_free: bool) -> Result<GraphExec> {
        let nodes = self
            .graphs
            .get(&graph)
            .ok_or_else(|| Error::InvalidArgument(format!("unknown graph {:#x}", graph.0)))?
            .nodes
            .clone();
        let e = GraphExec(self.id());
        self.execs.insert(e, ExecRec { graph, nodes, auto_free });
        Ok(e)
    }
}

impl DeviceMemory for SimDevice {
    fn ordinal(&self) -> usize {
        self.config.ordinal
    }

    fn mem_info(&self) -> Result<MemInfo> {
        self.call(|st| {
            Ok(MemInfo { free: self.config.capacity - st.space.used, total: self.config.capacity })
        })
    }

    fn alloc(&self, size: usize) -> Result<DevicePtr> {
        self.call(|st| {
            if size == 0 {
                return Err(Error::InvalidArgument("device allocation of 0 bytes".into()));
            }
            let rounded = size.div_ceil(PLAIN_GRANULE) * PLAIN_GRANULE;
            let ptr = st.space.take(rounded).ok_or_else(|| self.oom(st, size))?;
            st.plain.insert(ptr, rounded);
            Ok(ptr)
        })
    }

    fn free(&self, ptr: DevicePtr) -> Result<()> {
        self.call(|st| {
            let size = st
                .plain
                .remove(&ptr)
                .ok_or_else(|| Error::InvalidArgument(format!("free of unknown pointer {ptr:#x}")))?;
            st.sync_device();
            st.space.give(ptr, size);
            Ok(())
        })
    }

    fn address_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
        self.call(|st| {
            let within = |(&base, &size): (&DevicePtr, &usize)| base <= ptr && ptr < base + size as u64;
            st.plain
                .iter()
                .find(|e| within(*e))
                .or_else(|| st.async_allocs.iter().map(|(a, (_, n))| (a, n)).find(|e| within(*e)))
                .or_else(|| st.reservations.range(..=ptr).next_back().filter(|e| within(*e)))
                .map(|(&base, &size)| (base, size))
                .ok_or_else(|| Error::InvalidArgument(format!("{ptr:#x} is in no device allocation")))
        })
    }
}

impl HostMemory for SimDevice {
    /// Real host memory, zeroed (see the [module docs](self)).
    fn host_alloc(&self, size: usize) -> Result<HostPtr> {
        self.call(|st| {
            if size == 0 {
                return Err(Error::InvalidArgument("page-locked host allocation of 0 bytes".into()));
            }
            let pages = size.div_ceil(HOST_PAGE);
            let mut memory = Vec::new();
            if memory.try_reserve_exact(pages).is_err() {
                return Err(Error::oom(OutOfMemory {
                    device: self.config.ordinal,
                    requested: size,
                    host: true,
                    hint: "the host has no memory for the simulated page-locked allocation".into(),
                    ..OutOfMemory::default()
                }));
            }
            memory.resize(pages, HostPage([0; HOST_PAGE]));
            let ptr = memory.as_mut_ptr() as usize as HostPtr;
            st.host.insert(ptr, memory);
            st.host_calls.0 += 1;
            Ok(ptr)
        })
    }

    /// Refused, and recorded as a [`Violation`], while a use of the memory
    /// ([`SimDevice::use_host`]) could still run.
    fn host_free(&self, ptr: HostPtr) -> Result<()> {
        self.call(|st| {
            let len = st.host.get(&ptr).map(|pages| pages.len() * HOST_PAGE).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "host_free of {ptr:#x}: not page-locked host memory that this simulated device handed out"
                ))
            })?;
            let now = st.now;
            if let Some(u) =
                st.uses.iter().find(|u| u.host && u.end > now && overlaps(u.ptr, u.len, ptr, len))
            {
                let refused = Error::InvalidArgument(format!(
                    "host_free of {ptr:#x} while stream {:#x} uses {:#x} until {} (now {now})",
                    u.stream.0, u.ptr, u.end
                ));
                let violation = host_violation(ViolationKind::HostFreeInUse, ptr, len, now, u);
                st.violations.push(violation);
                return Err(refused);
            }
            st.host.remove(&ptr);
            st.host_calls.1 += 1;
            Ok(())
        })
    }

    /// A use of the device range and of the host range on `stream` for the copy's time: the
    /// launch cost and the bytes at the configured bandwidth; with the `test-util` feature the
    /// bytes move too, at once (see the [module docs](self)).
    fn copy_to_pinned(&self, dst: HostPtr, src: DevicePtr, len: usize, stream: Stream) -> Result<()> {
        self.copy_pinned(src, dst, len, stream, true)
    }

    /// As [`HostMemory::copy_to_pinned`] here, the other way.
    fn copy_from_pinned(&self, dst: DevicePtr, src: HostPtr, len: usize, stream: Stream) -> Result<()> {
        self.copy_pinned(dst, src, len, stream, false)
    }
}

impl DriverPools for SimDevice {
    fn default_pool(&self) -> Result<Pool> {
        self.call(|st| Ok(st.default_pool))
    }

    fn create_pool(&self, props: PoolProps) -> Result<Pool> {
        self.call(|st| {
            let p = Pool(st.id());
            st.pools.insert(p, PoolState::new(props.max_size));
            if props.exportable {
                st.pool_ipc.exportable.insert(p);
            }
            Ok(p)
        })
    }

    fn destroy_pool(&self, pool: Pool) -> Result<()> {
        self.call(|st| {
            if pool == st.default_pool {
                return Err(Error::InvalidArgument("the default pool cannot be destroyed".into()));
            }
            let p = st.pools.remove(&pool).ok_or_else(|| unknown_pool(pool))?;
            st.async_allocs.retain(|_, (owner, _)| *owner != pool);
            let live = &st.async_allocs;
            st.graph_mem.retain(|ptr, _| live.contains_key(ptr));
            st.pool_ipc.exportable.remove(&pool);
            let gone: Vec<DevicePtr> =
                st.pool_ipc.exports.keys().filter(|p| !st.async_allocs.contains_key(p)).copied().collect();
            gone.into_iter().for_each(|p| st.pool_ipc.forget(p));
            for (start, size) in p.chunks {
                st.space.give(start, size);
            }
            Ok(())
        })
    }

    fn pool_attr(&self, pool: Pool, attr: PoolAttr) -> Result<u64> {
        self.call(|st| {
            let p = st.pools.get(&pool).ok_or_else(|| unknown_pool(pool))?;
            Ok(match attr {
                PoolAttr::ReleaseThreshold => p.release_threshold,
                PoolAttr::ReuseFollowEventDependencies => p.follow_events as u64,
                PoolAttr::ReuseAllowOpportunistic => p.opportunistic as u64,
                PoolAttr::ReuseAllowInternalDependencies => p.internal_deps as u64,
                PoolAttr::ReservedMemCurrent => p.reserved as u64,
                PoolAttr::ReservedMemHigh => p.reserved_high as u64,
                PoolAttr::UsedMemCurrent => p.used as u64,
                PoolAttr::UsedMemHigh => p.used_high as u64,
            })
        })
    }

    fn set_pool_attr(&self, pool: Pool, attr: PoolAttr, value: u64) -> Result<()> {
        self.call(|st| {
            let p = st.pools.get_mut(&pool).ok_or_else(|| unknown_pool(pool))?;
            match attr {
                PoolAttr::ReleaseThreshold => p.release_threshold = value,
                PoolAttr::ReuseFollowEventDependencies => p.follow_events = value != 0,
                PoolAttr::ReuseAllowOpportunistic => p.opportunistic = value != 0,
                PoolAttr::ReuseAllowInternalDependencies => p.internal_deps = value != 0,
                PoolAttr::ReservedMemHigh if value == 0 => p.reserved_high = p.reserved,
                PoolAttr::UsedMemHigh if value == 0 => p.used_high = p.used,
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "pool attribute {attr:?} cannot be set to {value}"
                    )))
                }
            }
            Ok(())
        })
    }

    fn set_pool_access(&self, pool: Pool, peer: usize, enabled: bool) -> Result<()> {
        let own = self.config.ordinal;
        self.call(|st| {
            let p = st.pools.get_mut(&pool).ok_or_else(|| unknown_pool(pool))?;
            match (peer == own, enabled) {
                (true, true) => {}
                (true, false) => {
                    return Err(Error::InvalidArgument(format!(
                        "pool {:#x} cannot revoke the access of its own device {own}",
                        pool.0
                    )))
                }
                (false, true) => {
                    p.peers.insert(peer);
                }
                (false, false) => {
                    p.peers.remove(&peer);
                }
            }
            Ok(())
        })
    }

    fn trim_pool(&self, pool: Pool, keep: usize) -> Result<()> {
        self.call(|st| {
            if !st.pools.contains_key(&pool) {
                return Err(unknown_pool(pool));
            }
            st.trim(pool, keep);
            Ok(())
        })
    }

    fn alloc_async(&self, size: usize, pool: Pool, stream: Stream) -> Result<DevicePtr> {
        self.call(|st| {
            if size == 0 {
                return Err(Error::InvalidArgument("pool allocation of 0 bytes".into()));
            }
            let n = size.div_ceil(POOL_ALIGN) * POOL_ALIGN;
            let now = st.now;
            let ready = st.stream_mut(stream)?.ready;
            let p = st.pools.get_mut(&pool).ok_or_else(|| unknown_pool(pool))?;
            // Best fit among blocks reusable without a wait, then among those that need one.
            let free_now = |b: &FreeBlock| {
                b.stream == Some(stream)
                    || (p.opportunistic && b.avail_at <= now)
                    || (p.follow_events && b.avail_at <= ready)
            };
            let pick = |pred: &dyn Fn(&FreeBlock) -> bool| {
                p.free
                    .iter()
                    .filter(|(_, b)| b.size >= n && pred(b))
                    .min_by_key(|(a, b)| (b.size, **a))
                    .map(|(a, b)| (*a, *b))
            };
            let mut chosen = pick(&free_now);
            if chosen.is_none() && p.internal_deps {
                chosen = pick(&|_| true);
            }
            let (addr, block) = match chosen {
                Some(c) => c,
                None => {
                    let grow = n.div_ceil(POOL_GRANULE) * POOL_GRANULE;
                    if p.max_size != 0 && p.reserved + grow > p.max_size {
                        return Err(Error::oom(OutOfMemory {
                            device: self.config.ordinal,
                            requested: size,
                            reserved: p.reserved,
                            device_free: self.config.capacity - st.space.used,
                            device_total: self.config.capacity,
                            hint: format!("the pool's maximum size is {} bytes", p.max_size),
                            ..OutOfMemory::default()
                        }));
                    }
                    let Some(start) = st.space.take(grow) else { return Err(self.oom(st, size)) };
                    let p = st
                        .pools
                        .get_mut(&pool)
                        .ok_or_else(|| Error::Internal("simulator: pool looked up above".into()))?;
                    p.chunks.insert(start, grow);
                    p.reserved += grow;
                    p.reserved_high = p.reserved_high.max(p.reserved);
                    let b = FreeBlock { size: grow, avail_at: 0, stream: None };
                    p.free.insert(start, b);
                    (start, b)
                }
            };
            let p = st
                .pools
                .get_mut(&pool)
                .ok_or_else(|| Error::Internal("simulator: pool looked up above".into()))?;
            p.free.remove(&addr);
            if block.size > n {
                p.free.insert(addr + n as u64, FreeBlock { size: block.size - n, ..block });
            }
            p.used += n;
            p.used_high = p.used_high.max(p.used);
            st.async_allocs.insert(addr, (pool, n));
            if let Some(c) = st.stream_mut(stream)?.capture {
                // Graph memory: the launch, not the capturing stream, waits for the free.
                st.graph_mem.insert(addr, c);
                st.capture_node(stream, Node::Alloc { ptr: addr, after: block.avail_at })?;
                return Ok(addr);
            }
            let s = st.stream_mut(stream)?;
            if block.stream != Some(stream) {
                // Opportunistic reuse has nothing to wait for; otherwise the driver inserts
                // the dependency on the free.
                s.ready = s.ready.max(block.avail_at);
                let ready = s.ready;
                st.latest_ready = st.latest_ready.max(ready);
            }
            Ok(addr)
        })
    }

    fn free_async(&self, ptr: DevicePtr, stream: Stream) -> Result<()> {
        self.call(|st| {
            if !st.async_allocs.contains_key(&ptr) {
                return Err(Error::InvalidArgument(format!("free_async of unknown pointer {ptr:#x}")));
            }
            if st.capture_node(stream, Node::Free { ptr })? {
                return Ok(());
            }
            if let Some(&g) = st.graph_mem.get(&ptr) {
                if st.graphs.get(&Graph(g)).is_none_or(|r| r.launched_until.is_none()) {
                    return Err(Error::InvalidArgument(format!(
                        "free_async of graph memory {ptr:#x} before its graph was launched"
                    )));
                }
            }
            let avail_at = st.stream_mut(stream)?.ready.max(st.now);
            st.pool_free(ptr, Some(stream), avail_at)
        })
    }
}

impl VirtualMemory for SimDevice {
    fn supports_virtual_memory(&self) -> Result<bool> {
        Ok(self.config.virtual_memory)
    }

    fn map_granularity(&self) -> Result<usize> {
        Ok(MAP_GRANULE)
    }

    fn reserve_address(&self, size: usize) -> Result<DevicePtr> {
        self.call(|st| {
            if !self.config.virtual_memory {
                return Err(Error::Unsupported("virtual memory management on this simulated device".into()));
            }
            if size == 0 || size % MAP_GRANULE != 0 {
                return Err(Error::InvalidArgument(format!("reservation of {size} bytes")));
            }
            let addr = st.next_reservation;
            let window_end = RESERVED_BASE + (self.config.ordinal as u64 + 1) * RESERVED_STRIDE;
            if (size as u64) > window_end - addr {
                // No fresh room: a freed range that fits (its rest stays free), else refused
                // (never the next device's addresses).
                let n = size as u64;
                let Some((at, len)) =
                    st.freed_reservations.iter().find(|&(_, &l)| l >= n).map(|(&a, &l)| (a, l))
                else {
                    return Err(Error::InvalidArgument(format!(
                        "reservation of {size} bytes: simulated device {}'s address window has {} bytes left \
                         (the next device's reservations begin at {window_end:#x})",
                        self.config.ordinal,
                        window_end - addr
                    )));
                };
                st.freed_reservations.remove(&at);
                if len > n {
                    st.freed_reservations.insert(at + n, len - n);
                }
                st.reservations.insert(at, size);
                return Ok(at);
            }
            st.next_reservation += size as u64;
            st.reservations.insert(addr, size);
            Ok(addr)
        })
    }

    fn free_address(&self, addr: DevicePtr, size: usize) -> Result<()> {
        self.call(|st| {
            if st.reservations.get(&addr) != Some(&size) {
                return Err(Error::InvalidArgument(format!("no reservation {addr:#x}+{size}")));
            }
            if st.mapped.range(addr..addr + size as u64).next().is_some() {
                return Err(Error::InvalidArgument(format!("reservation {addr:#x} is still mapped")));
            }
            st.reservations.remove(&addr);
            st.freed_reservations.insert(addr, size as u64);
            Ok(())
        })
    }

    fn map(&self, addr: DevicePtr, size: usize) -> Result<()> {
        self.call(|st| {
            st.check_reserved(addr, size)?;
            if st.mapped.range(addr..addr + size as u64).next().is_some() {
                return Err(Error::InvalidArgument(format!("{addr:#x}+{size} is already mapped")));
            }
            let mut taken = Vec::with_capacity(size / MAP_GRANULE);
            for _ in 0..size / MAP_GRANULE {
                match st.space.take(MAP_GRANULE) {
                    Some(memory) => taken.push(memory),
                    None => {
                        // A failed map maps nothing.
                        for memory in taken {
                            st.space.give(memory, MAP_GRANULE);
                        }
                        return Err(self.oom(st, size));
                    }
                }
            }
            st.mappings.extend(taken.iter().map(|&m| (m, 1)));
            st.mapped.extend((addr..).step_by(MAP_GRANULE).zip(taken));
            st.mapping_calls += 1;
            st.mapped_granules += (size / MAP_GRANULE) as u64;
            Ok(())
        })
    }

    fn map_alias(&self, from: &[(DevicePtr, usize)], to: DevicePtr) -> Result<()> {
        self.call(|st| {
            let size: usize = from.iter().map(|&(_, len)| len).sum();
            if size == 0 {
                return Err(Error::InvalidArgument("map_alias of nothing".into()));
            }
            st.check_reserved(to, size)?;
            let mut memory = Vec::with_capacity(size / MAP_GRANULE);
            for &(from, len) in from {
                st.check_reserved(from, len)?;
                let before = memory.len();
                memory.extend(st.mapped.range(from..from + len as u64).map(|(_, &m)| m));
                if memory.len() - before != len / MAP_GRANULE {
                    return Err(Error::InvalidArgument(format!("{from:#x}+{len} is not all mapped")));
                }
            }
            if st.mapped.range(to..to + size as u64).next().is_some() {
                return Err(Error::InvalidArgument(format!("{to:#x}+{size} is already mapped")));
            }
            for &m in &memory {
                *st.mappings.entry(m).or_default() += 1;
            }
            st.mapped_granules += memory.len() as u64;
            st.mapped.extend((to..).step_by(MAP_GRANULE).zip(memory));
            st.aliases += 1;
            st.mapping_calls += 1;
            Ok(())
        })
    }

    fn grant_mapped_access(&self, peer: usize) -> Result<()> {
        self.call(|st| {
            if peer != self.config.ordinal {
                st.mapped_peers.insert(peer);
            }
            Ok(())
        })
    }

    fn unmap(&self, addr: DevicePtr, size: usize) -> Result<()> {
        self.call(|st| {
            st.check_reserved(addr, size)?;
            let end = addr + size as u64;
            if st.mapped.range(addr..end).count() != size / MAP_GRANULE {
                return Err(Error::InvalidArgument(format!("{addr:#x}+{size} is not all mapped")));
            }
            let now = st.now;
            if let Some(u) =
                st.uses.iter().find(|u| !u.host && u.end > now && u.ptr < end && addr < u.ptr + u.len as u64)
            {
                let refused = Error::InvalidArgument(format!(
                    "unmap of {addr:#x}+{size} while stream {:#x} uses {:#x} until {} (now {now})",
                    u.stream.0, u.ptr, u.end
                ));
                let violation = Violation {
                    kind: ViolationKind::UnmapInUse,
                    ptr: addr,
                    len: size,
                    stream: Stream::DEFAULT,
                    usable_at: now,
                    user_stream: u.stream,
                    user_ptr: u.ptr,
                    use_ends_at: u.end,
                };
                st.violations.push(violation);
                return Err(refused);
            }
            let unmapped: Vec<(u64, u64)> = st.mapped.range(addr..end).map(|(&g, &m)| (g, m)).collect();
            for &(g, m) in &unmapped {
                let left = st.mappings.get_mut(&m).map(|n| {
                    *n -= 1;
                    *n
                });
                st.shared.unmapped(g, m, left.unwrap_or(0));
                if left == Some(0) {
                    st.mappings.remove(&m);
                    #[cfg(feature = "test-util")]
                    st.contents.remove(&m);
                    st.space.give(m, MAP_GRANULE);
                }
            }
            // Only the range's granules: a walk of every mapped granule made each unmap cost
            // the whole device's mappings (a replay of 100k streams' pools never finished).
            for (g, _) in &unmapped {
                st.mapped.remove(g);
            }
            st.mapping_calls += 1;
            st.mapped_granules += (size / MAP_GRANULE) as u64;
            Ok(())
        })
    }
}

impl Ipc for SimDevice {
    fn export_mapped(&self, addr: DevicePtr, size: usize) -> Result<Vec<SharedPiece>> {
        self.call(|st| {
            let end = addr.checked_add(size as u64).filter(|_| size > 0 && size % MAP_GRANULE == 0);
            let Some(end) = end.filter(|_| addr % MAP_GRANULE as u64 == 0) else {
                return Err(Error::InvalidArgument(format!(
                    "export_mapped of {addr:#x}+{size}: not a range of whole granules"
                )));
            };
            let granules: Vec<(u64, u64)> = st.mapped.range(addr..end).map(|(&g, &m)| (g, m)).collect();
            if granules.len() != size / MAP_GRANULE {
                return Err(Error::InvalidArgument(format!(
                    "{addr:#x}+{size} is not all memory simulated device {} maps (unmapped, released, or \
                     not mapped memory)",
                    self.config.ordinal
                )));
            }
            granules.into_iter().map(|(g, m)| st.shared.export(g, m)).collect()
        })
    }

    fn exports_any(&self, addr: DevicePtr, size: usize) -> Result<bool> {
        self.call(|st| {
            let end = addr.saturating_add(size as u64);
            Ok(st.mapped.range(addr..end).any(|(_, m)| st.shared.exports.contains_key(m)))
        })
    }

    /// The descriptor is one end of a socket pair (a real descriptor with a file of its own),
    /// the data the pointer and the export's serial.
    fn export_pool_pointer(&self, ptr: DevicePtr, len: usize) -> Result<PoolPointer> {
        self.call(|st| {
            let Some(&(pool, size)) = st.async_allocs.get(&ptr) else {
                return Err(Error::InvalidArgument(format!("{ptr:#x} is no live pool allocation")));
            };
            if !st.pool_ipc.exportable.contains(&pool) {
                return Err(Error::InvalidArgument(format!(
                    "{ptr:#x} is memory of a pool not created exportable"
                )));
            }
            if len == 0 || len > size {
                return Err(Error::InvalidArgument(format!("{len} bytes of the {size} of {ptr:#x}")));
            }
            if let Some((fd, _, serial)) = st.pool_ipc.exports.get(&ptr) {
                return Ok(PoolPointer {
                    fd: fd.as_raw_fd(),
                    serial: *serial,
                    data: pool_data(ptr, *serial),
                });
            }
            let io = |e: std::io::Error| Error::Io(format!("a descriptor for an exported pool: {e}"));
            let (end, _) = UnixStream::pair().map_err(io)?;
            let fd = OwnedFd::from(end);
            let file = file_of(fd.as_fd())?;
            let raw = fd.as_raw_fd();
            let serial = super::ipc::note_export(raw, len as u64)?;
            st.pool_ipc.by_file.insert(file, ptr);
            st.pool_ipc.exports.insert(ptr, (fd, file, serial));
            Ok(PoolPointer { fd: raw, serial, data: pool_data(ptr, serial) })
        })
    }

    /// The import is the exporter's own address (one address space stands for both
    /// processes), counted until [`Ipc::free_imported`].
    fn import_pool_pointer(&self, fd: BorrowedFd<'_>, data: &[u8; POOL_POINTER_DATA]) -> Result<DevicePtr> {
        let file = file_of(fd)?;
        self.call(|st| {
            let Some(&ptr) = st.pool_ipc.by_file.get(&file) else {
                return Err(Error::InvalidArgument(format!(
                    "descriptor {} stands for no pool simulated device {} exports",
                    fd.as_raw_fd(),
                    self.config.ordinal
                )));
            };
            let serial = st.pool_ipc.exports.get(&ptr).map_or(0, |e| e.2);
            if *data != pool_data(ptr, serial) {
                return Err(Error::InvalidArgument("the pointer's export data is not the pool's".into()));
            }
            *st.pool_ipc.imports.entry(ptr).or_default() += 1;
            Ok(ptr)
        })
    }

    fn free_imported(&self, ptr: DevicePtr) -> Result<()> {
        self.call(|st| {
            let Some(n) = st.pool_ipc.imports.get_mut(&ptr) else {
                return Err(Error::InvalidArgument(format!("{ptr:#x} is no imported pool pointer")));
            };
            *n -= 1;
            if *n == 0 {
                st.pool_ipc.imports.remove(&ptr);
            }
            st.sync_device();
            Ok(())
        })
    }

    fn map_shared(&self, addr: DevicePtr, fd: BorrowedFd<'_>, offset: usize, len: usize) -> Result<()> {
        let file = file_of(fd)?;
        self.call(|st| {
            if offset.checked_add(len).is_none_or(|end| end > MAP_GRANULE) {
                return Err(Error::InvalidArgument(format!(
                    "map_shared of {len} bytes from offset {offset}: past the end of the allocation's \
                     {MAP_GRANULE} bytes"
                )));
            }
            if offset != 0 || len != MAP_GRANULE {
                return Err(Error::InvalidArgument(format!(
                    "map_shared of {len} bytes from offset {offset}: an allocation is mapped whole"
                )));
            }
            st.check_reserved(addr, len)?;
            if st.mapped.contains_key(&addr) {
                return Err(Error::InvalidArgument(format!("{addr:#x}+{len} is already mapped")));
            }
            let Some(&memory) = st.shared.by_file.get(&file) else {
                return Err(Error::InvalidArgument(format!(
                    "descriptor {} stands for no memory simulated device {} exports (never exported, or \
                     released by its exporter)",
                    fd.as_raw_fd(),
                    self.config.ordinal
                )));
            };
            st.mapped.insert(addr, memory);
            *st.mappings.entry(memory).or_default() += 1;
            *st.shared.received.entry(memory).or_default() += 1;
            st.shared.at.insert(addr);
            st.mapping_calls += 1;
            st.mapped_granules += 1;
            Ok(())
        })
    }
}

impl Streams for SimDevice {
    fn create_stream(&self) -> Result<Stream> {
        self.call(|st| {
            let s = Stream(st.id());
            let ready = st.now;
            st.streams.insert(s, StreamState { ready, capture: None });
            Ok(s)
        })
    }

    fn destroy_stream(&self, stream: Stream) -> Result<()> {
        self.call(|st| {
            if stream == Stream::DEFAULT {
                return Err(Error::InvalidArgument("the default stream cannot be destroyed".into()));
            }
            st.streams
                .remove(&stream)
                .map(|_| ())
                .ok_or_else(|| Error::InvalidArgument(format!("unknown stream {:#x}", stream.0)))
        })
    }

    fn synchronize_stream(&self, stream: Stream) -> Result<()> {
        self.call(|st| {
            let ready = st.stream_mut(stream)?.ready;
            st.host_waits += 1;
            st.now = st.now.max(ready);
            st.apply_thresholds();
            Ok(())
        })
    }

    fn synchronize(&self) -> Result<()> {
        self.call(|st| {
            // Work enqueued on streams destroyed since still runs to its end, as on a GPU.
            let streams = st.streams.values().map(|s| s.ready);
            let ready = streams.chain(st.uses.iter().map(|u| u.end)).max().unwrap_or(0);
            st.device_wide_visits += (st.streams.len() + st.uses.len()) as u64;
            st.host_waits += 1;
            st.now = st.now.max(ready);
            st.apply_thresholds();
            Ok(())
        })
    }

    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.call(|st| {
            let at = *st
                .events
                .get(&event)
                .ok_or_else(|| Error::InvalidArgument(format!("unknown event {:#x}", event.0)))?;
            if let Some(&(c, src, seen)) = st.capture_events.get(&event) {
                // An event of a capture: the waiting stream joins it, or the origin joins the
                // recording stream's work back.
                let current = st.stream_mut(stream)?.capture;
                let Some(rec) = st.captures.get_mut(&c) else { return Ok(()) };
                match current {
                    None => {
                        rec.sides.entry(stream).or_default();
                        st.stream_mut(stream)?.capture = Some(c);
                    }
                    Some(x) if x == c => {
                        if stream == rec.origin && src != rec.origin {
                            let side = rec.sides.entry(src).or_default();
                            side.1 = side.1.max(seen);
                        }
                    }
                    Some(_) => {
                        return Err(Error::InvalidArgument(format!(
                            "stream {:#x} waits on an event of another capture",
                            stream.0
                        )))
                    }
                }
                return Ok(());
            }
            let s = st.stream_mut(stream)?;
            if let Some(t) = at {
                s.ready = s.ready.max(t);
                st.latest_ready = st.latest_ready.max(t);
            }
            Ok(())
        })
    }

    fn capture_status(&self, stream: Stream) -> Result<CaptureStatus> {
        self.call(|st| {
            Ok(if st.stream_mut(stream)?.capture.is_some() {
                CaptureStatus::Active
            } else {
                CaptureStatus::None
            })
        })
    }

    fn check_stream(&self, stream: Stream) -> Result<()> {
        self.call(|st| st.stream_mut(stream).map(|_| ()))
    }
}

impl Events for SimDevice {
    fn create_event(&self) -> Result<Event> {
        self.call(|st| {
            let e = Event(st.id());
            st.events.insert(e, None);
            Ok(e)
        })
    }

    fn destroy_event(&self, event: Event) -> Result<()> {
        self.call(|st| {
            st.events
                .remove(&event)
                .map(|_| ())
                .ok_or_else(|| Error::InvalidArgument(format!("unknown event {:#x}", event.0)))
        })
    }

    fn record_event(&self, event: Event, stream: Stream) -> Result<()> {
        #[cfg(feature = "test-util")]
        {
            // Run without the hook's lock: it may block while other threads record events.
            let hook = self.record_hook.lock().clone();
            if let Some(hook) = hook {
                hook(stream);
            }
        }
        self.call(|st| {
            let now = st.now;
            let s = st.stream_mut(stream)?;
            let (at, capture) = (s.ready.max(now), s.capture);
            if !st.events.contains_key(&event) {
                return Err(Error::InvalidArgument(format!("unknown event {:#x}", event.0)));
            }
            match capture {
                Some(c) => {
                    let seen = st.captures[&c].sides.get(&stream).map_or(0, |side| side.0);
                    st.capture_events.insert(event, (c, stream, seen));
                    st.events.insert(event, None);
                }
                None => {
                    st.capture_events.remove(&event);
                    st.events.insert(event, Some(at));
                }
            }
            Ok(())
        })
    }

    fn query_event(&self, event: Event) -> Result<bool> {
        self.call(|st| {
            let at = st
                .events
                .get(&event)
                .ok_or_else(|| Error::InvalidArgument(format!("unknown event {:#x}", event.0)))?;
            Ok(at.is_none_or(|t| t <= st.now))
        })
    }

    fn synchronize_event(&self, event: Event) -> Result<()> {
        self.call(|st| {
            let at = st
                .events
                .get(&event)
                .ok_or_else(|| Error::InvalidArgument(format!("unknown event {:#x}", event.0)))?;
            st.host_waits += 1;
            if let Some(t) = *at {
                st.now = st.now.max(t);
                st.apply_thresholds();
            }
            Ok(())
        })
    }

    /// In virtual time: the host clock moves to the event's completion if that comes within
    /// `timeout`, else by `timeout`.
    fn wait_event(&self, event: Event, timeout: Duration) -> Result<bool> {
        self.call(|st| {
            let at = st
                .events
                .get(&event)
                .ok_or_else(|| Error::InvalidArgument(format!("unknown event {:#x}", event.0)))?;
            st.host_waits += 1;
            let Some(t) = *at else { return Ok(true) };
            let deadline = st.now.saturating_add(u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX));
            let done = t <= deadline;
            st.now = if done { st.now.max(t) } else { deadline };
            st.apply_thresholds();
            Ok(done)
        })
    }
}

impl Graphs for SimDevice {
    fn begin_capture(&self, stream: Stream) -> Result<()> {
        self.call(|st| {
            let c = st.id();
            let s = st.stream_mut(stream)?;
            if s.capture.is_some() {
                return Err(Error::InvalidArgument(format!("stream {:#x} is already capturing", stream.0)));
            }
            s.capture = Some(c);
            st.captures.insert(c, CaptureRec { origin: stream, nodes: Vec::new(), sides: HashMap::new() });
            Ok(())
        })
    }

    fn end_capture(&self, stream: Stream) -> Result<Graph> {
        self.call(|st| {
            let not_origin =
                || Error::InvalidArgument(format!("stream {:#x} did not begin a capture", stream.0));
            let c = st.stream_mut(stream)?.capture.ok_or_else(not_origin)?;
            if st.captures[&c].origin != stream {
                return Err(not_origin());
            }
            let rec =
                st.captures.remove(&c).ok_or_else(|| Error::Internal("simulator: checked above".into()))?;
            st.device_wide_visits += st.streams.len() as u64;
            for s in st.streams.values_mut().filter(|s| s.capture == Some(c)) {
                s.capture = None;
            }
            if let Some((side, _)) = rec.sides.iter().find(|(_, (n, joined))| n > joined) {
                st.release_graph_mem(c, &rec.nodes, None)?;
                return Err(Error::InvalidArgument(format!(
                    "capture unjoined: stream {:#x} has captured work stream {:#x} never waited for",
                    side.0, stream.0
                )));
            }
            st.graphs.insert(Graph(c), GraphRec { nodes: rec.nodes, launched_until: None });
            Ok(Graph(c))
        })
    }

    fn launch_graph(&self, exec: GraphExec, stream: Stream) -> Result<()> {
        let (graph, nodes) = {
            let st = self.state.lock();
            let x = st
                .execs
                .get(&exec)
                .ok_or_else(|| Error::InvalidArgument(format!("unknown graph exec {:#x}", exec.0)))?;
            let freed_inside =
                |p: DevicePtr| x.nodes.iter().any(|n| matches!(n, Node::Free { ptr } if *ptr == p));
            let relaunch = st.graphs.get(&x.graph).is_some_and(|g| g.launched_until.is_some());
            let output_alive = x.nodes.iter().any(|n| {
                matches!(n, Node::Alloc { ptr, .. } if !freed_inside(*ptr) && st.graph_mem.contains_key(ptr))
            });
            if relaunch && output_alive && !x.auto_free {
                return Err(Error::InvalidArgument(format!(
                    "graph exec {:#x} relaunched while memory its last launch allocated is still allocated",
                    exec.0
                )));
            }
            (x.graph, x.nodes.clone())
        };
        let allocated_inside =
            |p: DevicePtr| nodes.iter().any(|n| matches!(n, Node::Alloc { ptr, .. } if *ptr == p));
        for node in &nodes {
            match *node {
                #[cfg(feature = "test-util")]
                Node::Memset { ptr, len, value: Some(value) } => {
                    self.memset_async(ptr, value, len, stream)?
                }
                #[cfg(feature = "test-util")]
                Node::Memset { ptr, len, value: None } => {
                    let ns = self.kernel_ns(&mut self.state.lock(), len);
                    self.use_range(ptr, len, stream, ns)?
                }
                Node::Alloc { after, .. } => self.call(|st| {
                    let s = st.stream_mut(stream)?;
                    s.ready = s.ready.max(after);
                    st.latest_ready = st.latest_ready.max(after);
                    Ok(())
                })?,
                Node::Free { ptr } if !allocated_inside(ptr) => self.free_async(ptr, stream)?,
                Node::Free { .. } => {}
            }
        }
        self.call(|st| {
            let end = st.stream_mut(stream)?.ready.max(st.now);
            if let Some(g) = st.graphs.get_mut(&graph) {
                g.launched_until = Some(end);
            }
            Ok(())
        })
    }

    fn destroy_graph_exec(&self, exec: GraphExec) -> Result<()> {
        self.call(|st| {
            st.execs
                .remove(&exec)
                .map(|_| ())
                .ok_or_else(|| Error::InvalidArgument(format!("unknown graph exec {:#x}", exec.0)))
        })
    }

    fn destroy_graph(&self, graph: Graph) -> Result<()> {
        self.call(|st| {
            let rec = st
                .graphs
                .remove(&graph)
                .ok_or_else(|| Error::InvalidArgument(format!("unknown graph {:#x}", graph.0)))?;
            st.release_graph_mem(graph.0, &rec.nodes, rec.launched_until)
        })
    }

    fn instantiate_graph_auto_free(&self, graph: Graph) -> Result<GraphExec> {
        self.call(|st| st.instantiate(graph, true))
    }
}

/// A file as the kernel knows it: its device and inode numbers.
type FileId = (u64, u64);

/// The file `fd` names (`fstat`).
fn file_of(fd: BorrowedFd<'_>) -> Result<FileId> {
    let meta = fd
        .try_clone_to_owned()
        .and_then(|own| std::fs::File::from(own).metadata())
        .map_err(|e| Error::InvalidArgument(format!("descriptor {}: {e}", fd.as_raw_fd())))?;
    Ok((meta.dev(), meta.ino()))
}

/// Memory a simulated device exported to other processes ([`Ipc::export_mapped`]), and
/// what [`Ipc::map_shared`] mapped of it.
#[derive(Default)]
struct Shared {
    /// Exported granules of memory: their descriptor, its file and the export's serial. Each
    /// is closed when the last mapping of its memory other than by `map_shared` goes.
    exports: HashMap<u64, (OwnedFd, FileId, u64)>,
    /// The memory each exported file stands for.
    by_file: HashMap<FileId, u64>,
    /// Mappings of each granule of memory made by `map_shared`.
    received: HashMap<u64, u32>,
    /// Addresses of the granules `map_shared` mapped.
    at: BTreeSet<u64>,
}

impl Shared {
    /// The piece of granule `at`, which maps `memory`, exported once.
    fn export(&mut self, at: u64, memory: u64) -> Result<SharedPiece> {
        if self.at.contains(&at) {
            return Err(Error::Unsupported(format!(
                "{at:#x} maps memory another process exported; it is not exported again"
            )));
        }
        let (fd, serial) = match self.exports.get(&memory) {
            Some((fd, _, serial)) => (fd.as_raw_fd(), *serial),
            None => {
                let io = |e: std::io::Error| Error::Io(format!("a descriptor for exported memory: {e}"));
                // One end of a socket pair: a real descriptor, with a file of its own.
                let (end, _) = UnixStream::pair().map_err(io)?;
                let fd = OwnedFd::from(end);
                let file = file_of(fd.as_fd())?;
                let raw = fd.as_raw_fd();
                let serial = super::ipc::note_export(raw, MAP_GRANULE as u64)?;
                self.by_file.insert(file, memory);
                self.exports.insert(memory, (fd, file, serial));
                (raw, serial)
            }
        };
        Ok(SharedPiece { fd, serial, offset: 0, len: MAP_GRANULE as u64 })
    }

    /// Notes that granule `at`, a mapping of `memory`, was unmapped, leaving `left` mappings
    /// of it: one fewer made by `map_shared` if it was one; the export is closed once only
    /// those are left.
    fn unmapped(&mut self, at: u64, memory: u64, left: u32) {
        if self.at.remove(&at) {
            if let Some(n) = self.received.get_mut(&memory) {
                *n -= 1;
                if *n == 0 {
                    self.received.remove(&memory);
                }
            }
        }
        if left == self.received.get(&memory).copied().unwrap_or(0) {
            if let Some((fd, file, _)) = self.exports.remove(&memory) {
                super::ipc::forget_export(fd.as_raw_fd());
                self.by_file.remove(&file);
            }
        }
    }
}

/// Pool allocations a simulated device exported ([`Ipc::export_pool_pointer`]) and
/// imports of them ([`Ipc::import_pool_pointer`]).
#[derive(Default)]
struct PoolIpc {
    /// Pools created exportable.
    exportable: HashSet<Pool>,
    /// Exported allocations: their descriptor, its file and the export's serial, closed when
    /// the allocation is freed.
    exports: HashMap<DevicePtr, (OwnedFd, FileId, u64)>,
    /// The allocation each exported file stands for.
    by_file: HashMap<FileId, DevicePtr>,
    /// Imports not yet freed, per allocation.
    imports: HashMap<DevicePtr, u32>,
}

impl PoolIpc {
    /// Closes the export of `ptr`, if any, forgotten by the registry first.
    fn forget(&mut self, ptr: DevicePtr) {
        if let Some((fd, file, _)) = self.exports.remove(&ptr) {
            super::ipc::forget_export(fd.as_raw_fd());
            self.by_file.remove(&file);
        }
    }
}

/// The simulator's export data of pool pointer `ptr`: the pointer and the export's serial.
fn pool_data(ptr: DevicePtr, serial: u64) -> [u8; POOL_POINTER_DATA] {
    let mut data = [0; POOL_POINTER_DATA];
    data[..8].copy_from_slice(&ptr.to_le_bytes());
    data[8..16].copy_from_slice(&serial.to_le_bytes());
    data
}

/// The error for a pool handle the simulator did not make (or has destroyed).
fn unknown_pool(pool: Pool) -> Error {
    Error::InvalidArgument(format!("unknown pool {:#x}", pool.0))
}

/// What only tests and measurement programs call ([`DeviceTestExt`]): memory contents, host
/// functions, kernel durations.
#[cfg(feature = "test-util")]
mod test_util {
    use rand::Rng;

    use super::super::{no_mapped_access, no_peer_access};
    use super::*;

    impl SimDevice {
        /// How long a memset or copy of `len` bytes runs: the launch cost, the bytes at the
        /// configured bandwidth, and up to 25% of jitter.
        pub(super) fn kernel_ns(&self, st: &mut State, len: usize) -> u64 {
            let base = self.config.launch_ns + len as u64 / self.config.bandwidth_bytes_per_ns.max(1);
            base + st.rng.gen_range(0..=base / 4)
        }
    }

    impl State {
        /// Takes out the host functions whose place in their stream the clock has reached.
        pub(super) fn take_due_host_fns(&mut self) -> Vec<HostFn> {
            let later = self.host_fns.split_off(&(self.now + 1, 0));
            std::mem::replace(&mut self.host_fns, later).into_values().collect()
        }

        /// Calls `f(bytes of the granule, offset in it, offset in the range)` for each mapped
        /// granule's part of `[ptr, ptr + len)` (unmapped parts are skipped).
        fn each_mapped_part(&self, ptr: u64, len: usize, mut f: impl FnMut(u64, usize, usize, usize)) {
            let end = ptr + len as u64;
            let mut at = ptr;
            while at < end {
                let granule = at - at % MAP_GRANULE as u64;
                let next = (granule + MAP_GRANULE as u64).min(end);
                if let Some(&memory) = self.mapped.get(&granule) {
                    f(memory, (at - granule) as usize, (at - ptr) as usize, (next - at) as usize);
                }
                at = next;
            }
        }

        /// Writes `value`, or the bytes of `data`, into the mapped granules of `[ptr, ptr + len)`.
        fn write(&mut self, ptr: u64, len: usize, value: u8, data: Option<&[u8]>) {
            let mut parts = Vec::new();
            self.each_mapped_part(ptr, len, |m, off, from, n| parts.push((m, off, from, n)));
            for (memory, off, from, n) in parts {
                if data.is_none() && n == MAP_GRANULE {
                    self.contents.insert(memory, Bytes::Fill(value));
                    continue;
                }
                let bytes = self.contents.entry(memory).or_insert(Bytes::Fill(0));
                if let Bytes::Fill(v) = *bytes {
                    *bytes = Bytes::Data(vec![v; MAP_GRANULE].into_boxed_slice());
                }
                let Bytes::Data(b) = bytes else { continue };
                match data {
                    Some(d) => b[off..off + n].copy_from_slice(&d[from..from + n]),
                    None => b[off..off + n].fill(value),
                }
            }
        }

        /// Moves `len` bytes between the mapped granules at `device` and the page-locked host
        /// memory at `host` (checked to be one allocation), to the host when `to_host`.
        pub(super) fn move_pinned(&mut self, device: u64, host: HostPtr, len: usize, to_host: bool) {
            let Some((&start, _)) = self.host.range(..=host).next_back() else { return };
            let mut bytes = vec![0; len];
            if to_host {
                self.read(device, &mut bytes);
            }
            let Some(pages) = self.host.get_mut(&start) else { return };
            let offset = (host - start) as usize;
            let mut done = 0;
            while done < len {
                let at = offset + done;
                let n = (HOST_PAGE - at % HOST_PAGE).min(len - done);
                let page = &mut pages[at / HOST_PAGE].0[at % HOST_PAGE..at % HOST_PAGE + n];
                match to_host {
                    true => page.copy_from_slice(&bytes[done..done + n]),
                    false => bytes[done..done + n].copy_from_slice(page),
                }
                done += n;
            }
            if !to_host {
                self.write(device, len, 0, Some(&bytes));
            }
        }

        /// Reads the mapped granules of `[ptr, ptr + dst.len())` into `dst` (0 elsewhere).
        fn read(&self, ptr: u64, dst: &mut [u8]) {
            dst.fill(0);
            self.each_mapped_part(ptr, dst.len(), |memory, off, from, n| match self.contents.get(&memory) {
                Some(Bytes::Fill(v)) => dst[from..from + n].fill(*v),
                Some(Bytes::Data(b)) => dst[from..from + n].copy_from_slice(&b[off..off + n]),
                None => {}
            });
        }
    }

    impl DeviceTestExt for SimDevice {
        fn pool_access(&self, pool: Pool, peer: usize) -> Result<bool> {
            let own = self.config.ordinal;
            self.call(|st| {
                let p = st.pools.get(&pool).ok_or_else(|| unknown_pool(pool))?;
                Ok(peer == own || p.peers.contains(&peer))
            })
        }

        fn launch_host_func(&self, stream: Stream, f: HostFn) -> Result<()> {
            self.call(|st| {
                let at = st.stream_mut(stream)?.ready.max(st.now);
                let seq = st.id();
                st.host_fns.insert((at, seq), f);
                Ok(())
            })
        }

        fn memset_async(&self, ptr: DevicePtr, value: u8, len: usize, stream: Stream) -> Result<()> {
            let mut st = self.state.lock();
            self.refuse_unmapped(&mut st, ptr, len, stream, "a memset")?;
            let ns = self.kernel_ns(&mut st, len);
            if st.capture_node(stream, Node::Memset { ptr, len, value: Some(value) })? {
                return Ok(());
            }
            st.write(ptr, len, value, None);
            drop(st);
            self.use_range(ptr, len, stream, ns)
        }

        fn copy_peer(
            &self,
            _dst: DevicePtr,
            dst_device: usize,
            src: DevicePtr,
            len: usize,
            stream: Stream,
        ) -> Result<()> {
            let own = self.config.ordinal;
            let mut st = self.state.lock();
            let source_pool = st
                .async_allocs
                .iter()
                .find(|(start, (_, n))| **start <= src && src < **start + *n as u64)
                .map(|(_, (pool, _))| *pool);
            if let Some(pool) = source_pool {
                if dst_device != own && !st.pools.get(&pool).is_some_and(|p| p.peers.contains(&dst_device)) {
                    return Err(no_peer_access(src, own, dst_device, pool));
                }
            }
            let mapped = st.mapped.contains_key(&(src - src % MAP_GRANULE as u64));
            if mapped && dst_device != own && !st.mapped_peers.contains(&dst_device) {
                return Err(no_mapped_access(src, own, dst_device));
            }
            let ns = self.kernel_ns(&mut st, len);
            // Captured, it is replayed at each launch as a use of the source range.
            if st.capture_node(stream, Node::Memset { ptr: src, len, value: None })? {
                return Ok(());
            }
            drop(st);
            self.use_range(src, len, stream, ns)
        }

        fn copy_to_host(&self, dst: &mut [u8], src: DevicePtr, stream: Stream) -> Result<()> {
            // The copy is a use of the range, then a wait for it.
            self.refuse_unmapped(&mut self.state.lock(), src, dst.len(), stream, "a copy to the host")?;
            self.state.lock().read(src, dst);
            let ns = self.kernel_ns(&mut self.state.lock(), dst.len());
            self.use_range(src, dst.len(), stream, ns)?;
            self.synchronize_stream(stream)
        }

        fn copy_from_host(&self, dst: DevicePtr, src: &[u8], stream: Stream) -> Result<()> {
            let ns = {
                let mut st = self.state.lock();
                self.refuse_unmapped(&mut st, dst, src.len(), stream, "a copy from the host")?;
                st.write(dst, src.len(), 0, Some(src));
                self.kernel_ns(&mut st, src.len())
            };
            self.use_range(dst, src.len(), stream, ns)?;
            self.synchronize_stream(stream)
        }

        fn instantiate_graph(&self, graph: Graph) -> Result<GraphExec> {
            self.call(|st| st.instantiate(graph, false))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn dev() -> Arc<SimDevice> {
        SimDevice::new(SimConfig::with_capacity(1 << 30))
    }

    /// Issue 52, #11: kernels, memsets and copies on reserved memory that is not mapped
    /// (never mapped, unmapped as a sleep or a closed IPC range leaves it, or a freed
    /// reservation) are refused, each a violation; on mapped memory they run.
    #[test]
    fn work_on_unmapped_reserved_memory_is_refused_and_recorded() {
        let d = dev();
        let s = d.create_stream().unwrap();
        let g = MAP_GRANULE;
        let base = d.reserve_address(4 * g).unwrap();
        assert!(d.use_range(base, 64, s, 10).is_err(), "never mapped");
        d.map(base, 2 * g).unwrap();
        d.use_range(base, 2 * g, s, 10).unwrap();
        d.memset_async(base + 5, 1, 100, s).unwrap();
        let err = d.use_range(base + g as u64, 2 * g, s, 10).unwrap_err().to_string();
        assert!(err.contains("not mapped"), "{err}");
        d.synchronize().unwrap();
        d.unmap(base, 2 * g).unwrap();
        assert!(d.use_range(base, 64, s, 10).is_err(), "unmapped (a sleep)");
        assert!(d.memset_async(base, 0, 64, s).is_err(), "memset after unmap");
        let mut out = [0u8; 16];
        assert!(d.copy_to_host(&mut out, base, s).is_err(), "copy after unmap");
        assert!(d.copy_from_host(base, &out, s).is_err(), "copy after unmap");
        d.free_address(base, 4 * g).unwrap();
        assert!(d.use_range(base, 64, s, 10).is_err(), "freed reservation");
        let unmapped = d.violations().iter().filter(|v| v.kind == ViolationKind::UnmappedUse).count();
        assert_eq!(unmapped, 7);
        // Plain memory is not in the reservations' window.
        let p = d.alloc(4096).unwrap();
        d.use_range(p, 4096, s, 10).unwrap();
    }

    #[test]
    fn checker_catches_planted_early_reuse() {
        let d = dev();
        let (a, b) = (d.create_stream().unwrap(), d.create_stream().unwrap());
        let p = d.alloc(4096).unwrap();
        d.use_range(p, 4096, b, 1_000_000).unwrap();
        // Handing the range to stream a while b's kernel runs is an early reuse.
        assert_eq!(d.check_handout(p, 4096, a), 1);
        // The same stream is ordered; a disjoint range is fine.
        assert_eq!(d.check_handout(p, 4096, b), 0);
        assert_eq!(d.check_handout(p + 4096, 4096, a), 0);
        let v = d.violations();
        assert_eq!(v.len(), 1);
        assert_eq!((v[0].stream, v[0].user_stream), (a, b));
    }

    #[test]
    fn reservations_map_device_memory_and_unmap_only_when_unused() {
        const G: usize = MAP_GRANULE;
        let d = dev();
        let s = d.create_stream().unwrap();
        assert_eq!(d.map_granularity().unwrap(), G);
        let r = d.reserve_address(64 * G).unwrap();
        let free = d.mem_info().unwrap().free;
        d.map(r, 3 * G).unwrap();
        assert_eq!(d.mem_info().unwrap().free, free - 3 * G);
        assert!(d.map(r + 2 * G as u64, 2 * G).is_err(), "partly mapped already");
        assert!(d.map(r + 62 * G as u64, 4 * G).is_err(), "past the reservation");
        assert!(d.map(r + 3 * G as u64, G + 512).is_err(), "not whole granules");
        // A map the device cannot back maps nothing.
        let big = d.reserve_address(1024 * G).unwrap();
        assert!(d.map(big, 1024 * G).unwrap_err().is_out_of_memory());
        assert_eq!(d.mem_info().unwrap().free, free - 3 * G);
        // Unmapping memory a stream still uses is refused; once the use is over it is not.
        d.use_range(r + G as u64, 4096, s, 1_000_000).unwrap();
        assert!(d.unmap(r, 2 * G).is_err());
        d.unmap(r + 2 * G as u64, G).unwrap();
        d.synchronize_stream(s).unwrap();
        assert!(d.unmap(r, 3 * G).is_err(), "a granule is unmapped already");
        assert!(d.free_address(r, 64 * G).is_err(), "still mapped");
        d.unmap(r, 2 * G).unwrap();
        assert_eq!(d.mem_info().unwrap().free, free);
        d.free_address(r, 64 * G).unwrap();
        d.free_address(big, 1024 * G).unwrap();
        assert!(d.map(r, G).is_err(), "no reservation any more");
    }

    #[test]
    fn aliases_share_bytes_memory_and_uses() {
        const G: usize = MAP_GRANULE;
        let d = dev();
        let (s, t) = (d.create_stream().unwrap(), d.create_stream().unwrap());
        let r = d.reserve_address(16 * G).unwrap();
        let (a, b) = (r, r + 8 * G as u64);
        let free = d.mem_info().unwrap().free;
        d.map(a, 2 * G).unwrap();
        let data: Vec<u8> = (0..2 * G).map(|i| (i % 251) as u8).collect();
        d.copy_from_host(a, &data, s).unwrap();
        assert!(d.map_alias(&[(a, 3 * G)], b).is_err(), "the source is not all mapped");
        assert!(d.map_alias(&[(a, G), (a + 2 * G as u64, G)], b).is_err(), "a source is not mapped");
        // Two sources side by side: the granules in order.
        d.map_alias(&[(a, G), (a + G as u64, G)], b).unwrap();
        assert!(d.map_alias(&[(a, 2 * G)], b).is_err(), "the target is mapped already");
        assert_eq!(d.mem_info().unwrap().free, free - 2 * G, "an alias takes no memory");
        // Bytes written through one mapping are read through the other, across the granules.
        let mut back = vec![0; 2 * G];
        d.copy_to_host(&mut back, b, s).unwrap();
        assert!(back == data);
        d.memset_async(b + G as u64 - 8, 7, 16, s).unwrap();
        let mut part = vec![0; 32];
        d.copy_to_host(&mut part, a + G as u64 - 16, s).unwrap();
        assert_eq!(&part[..8], &data[G - 16..G - 8]);
        assert!(part[8..24].iter().all(|&x| x == 7) && part[24..] == data[G + 8..G + 16]);
        // A use through one address is a use of the memory behind the other.
        d.use_range(a + G as u64, 4096, s, 1_000_000).unwrap();
        assert_eq!(d.check_handout(b + G as u64, 4096, t), 1);
        assert_eq!(d.check_handout(b, 4096, t), 0, "another granule");
        // The alias may go while the use through the other address runs; the memory stays.
        d.unmap(b, 2 * G).unwrap();
        assert_eq!(d.mem_info().unwrap().free, free - 2 * G);
        assert!(d.unmap(a, 2 * G).is_err(), "still used through `a`");
        d.synchronize_stream(s).unwrap();
        d.copy_to_host(&mut back, a, s).unwrap();
        assert!(back[..G - 8] == data[..G - 8]);
        d.unmap(a, 2 * G).unwrap();
        assert_eq!(d.mem_info().unwrap().free, free, "its last mapping gave it back");
        assert_eq!((d.aliases(), d.mapping_calls()), (1, 4), "map, alias, two unmaps; failures not counted");
        assert_eq!(d.mapped_granules(), 8, "two granules each");
        d.free_address(r, 16 * G).unwrap();
    }

    /// Export, then map in a "receiver" through copies of the descriptors (`pidfd_getfd` on
    /// this process): bytes are shared both ways, and the memory outlives its exporter's
    /// mappings and descriptors until the receiver unmaps it.
    #[test]
    fn shared_memory_outlives_its_exporter_until_the_receiver_unmaps_it() {
        const G: usize = MAP_GRANULE;
        let d = dev();
        let s = d.create_stream().unwrap();
        let r = d.reserve_address(16 * G).unwrap();
        let (home, alias) = (r, r + 8 * G as u64);
        let free = d.mem_info().unwrap().free;
        d.map(home, 2 * G).unwrap();
        d.map_alias(&[(home + G as u64, G)], alias).unwrap();
        let data: Vec<u8> = (0..2 * G).map(|i| (i % 253) as u8).collect();
        d.copy_from_host(home, &data, s).unwrap();
        let pieces = d.export_mapped(home, 2 * G).unwrap();
        assert_eq!(pieces.len(), 2);
        assert!(pieces.iter().all(|p| p.offset == 0 && p.len == G as u64));
        assert_ne!(pieces[0].fd, pieces[1].fd);
        assert_ne!(pieces[0].serial, pieces[1].serial);
        assert_eq!(d.export_mapped(home, 2 * G).unwrap(), pieces, "exported once, the same descriptors");
        assert_eq!(d.export_mapped(alias, G).unwrap(), pieces[1..], "through the alias: the same memory");
        assert_eq!(d.exported(), 2);
        // The receiver: copies of the descriptors, a reservation of its own.
        let fds = super::super::ipc::fetch_fds(std::process::id(), &[pieces[0].fd, pieces[1].fd]).unwrap();
        let got = d.reserve_address(2 * G).unwrap();
        for (i, fd) in fds.iter().enumerate() {
            d.map_shared(got + (i * G) as u64, fd.as_fd(), 0, G).unwrap();
        }
        drop(fds);
        assert_eq!(d.mem_info().unwrap().free, free - 2 * G, "the same memory, counted once");
        let mut back = vec![0; 2 * G];
        d.copy_to_host(&mut back, got, s).unwrap();
        assert!(back == data, "the receiver reads what the exporter wrote");
        d.memset_async(got + G as u64, 9, 64, s).unwrap();
        let mut part = vec![0; 64];
        d.copy_to_host(&mut part, alias, s).unwrap();
        assert!(part.iter().all(|&x| x == 9), "the exporter reads what the receiver wrote");
        // The exporter gives its memory back: its descriptors close, the memory stays.
        d.unmap(alias, G).unwrap();
        assert_eq!(d.exported(), 2, "the home mapping is left");
        d.unmap(home, 2 * G).unwrap();
        assert_eq!(d.exported(), 0, "no mapping of the exporter is left");
        assert_eq!(d.mem_info().unwrap().free, free - 2 * G, "mapped by the receiver: not freed");
        d.copy_to_host(&mut back, got, s).unwrap();
        assert!(back[..G] == data[..G], "still the exporter's bytes");
        assert!(d.export_mapped(home, G).is_err(), "exporting released memory");
        d.unmap(got, G).unwrap();
        assert_eq!(d.mem_info().unwrap().free, free - G);
        d.unmap(got + G as u64, G).unwrap();
        assert_eq!(d.mem_info().unwrap().free, free, "its last mapping gave it back");
        d.free_address(got, 2 * G).unwrap();
        d.free_address(r, 16 * G).unwrap();
    }

    #[test]
    fn sharing_refuses_what_the_driver_would() {
        const G: usize = MAP_GRANULE;
        let d = dev();
        let r = d.reserve_address(4 * G).unwrap();
        let e = d.export_mapped(r, G).unwrap_err();
        assert!(e.to_string().contains("is not all memory simulated device 0 maps"), "{e}");
        assert!(d.export_mapped(r + 1, G).is_err(), "not granule-aligned");
        let plain = d.alloc(G).unwrap();
        assert!(d.export_mapped(plain, G).is_err(), "plain memory is not mapped");
        d.map(r, G).unwrap();
        let piece = d.export_mapped(r, G).unwrap()[0];
        let fd = super::super::ipc::fetch_fds(std::process::id(), &[piece.fd]).unwrap().remove(0);
        let at = r + 2 * G as u64;
        let e = d.map_shared(at, fd.as_fd(), 0, 2 * G).unwrap_err();
        assert!(e.to_string().contains("past the end of the allocation"), "{e}");
        assert!(d.map_shared(at, fd.as_fd(), G, G).unwrap_err().to_string().contains("past the end"));
        assert!(d.map_shared(at, fd.as_fd(), 0, G / 2).is_err(), "part of an allocation");
        assert!(d.map_shared(r, fd.as_fd(), 0, G).is_err(), "mapped already");
        let (stranger, _) = UnixStream::pair().unwrap();
        let e = d.map_shared(at, stranger.as_fd(), 0, G).unwrap_err();
        assert!(e.to_string().contains("stands for no memory"), "{e}");
        d.map_shared(at, fd.as_fd(), 0, G).unwrap();
        assert!(d.export_mapped(at, G).is_err(), "received memory is not exported again");
        d.unmap(at, G).unwrap();
        d.unmap(r, G).unwrap();
        let e = d.map_shared(at, fd.as_fd(), 0, G).unwrap_err();
        assert!(e.to_string().contains("released by its exporter"), "{e}");
        assert_eq!(d.mem_info().unwrap().used(), G, "the plain allocation only");
        d.free(plain).unwrap();
        d.free_address(r, 4 * G).unwrap();
    }

    #[test]
    fn host_memory_is_page_aligned_counted_and_checked() {
        let d = dev();
        let s = d.create_stream().unwrap();
        let p = d.host_alloc(10_000).unwrap();
        assert_eq!(p % HOST_PAGE as u64, 0);
        assert_eq!((d.host_bytes(), d.host_calls()), (3 * HOST_PAGE, (1, 0)));
        assert!(d.host_alloc(0).is_err());
        // A copy from it runs on `s`: handing it to the host again meanwhile is an early reuse.
        d.use_host(p, 10_000, s, 1_000_000).unwrap();
        assert!(d.use_host(p + 9_000, HOST_PAGE, s, 1).is_err(), "past the allocation");
        assert!(d.use_host(0x1000, 16, s, 1).is_err(), "not host memory of this device");
        assert!(d.use_range(p, 16, s, 1).is_err(), "host memory is not device memory");
        assert_eq!(d.check_host_handout(p + 4096, 16), 1);
        assert_eq!(d.check_host_handout(p + 3 * HOST_PAGE as u64, 16), 0, "another range");
        assert!(d.host_free(p).is_err(), "freed under the copy");
        d.synchronize_stream(s).unwrap();
        assert_eq!(d.check_host_handout(p, 10_000), 0);
        d.host_free(p).unwrap();
        assert!(d.host_free(p).is_err(), "freed twice");
        assert!(d.host_free(0xdead_0000).is_err(), "never allocated");
        assert_eq!((d.host_bytes(), d.host_calls()), (0, (1, 1)));
        let kinds: Vec<ViolationKind> = d.violations().iter().map(|v| v.kind).collect();
        assert_eq!(kinds, [ViolationKind::HostReuse, ViolationKind::HostFreeInUse]);
    }

    #[test]
    fn host_uses_and_device_uses_are_apart() {
        let d = dev();
        let (s, t) = (d.create_stream().unwrap(), d.create_stream().unwrap());
        let host = d.host_alloc(4096).unwrap();
        let device = d.alloc(4096).unwrap();
        d.use_host(host, 4096, s, 1_000_000).unwrap();
        d.use_range(device, 4096, s, 1_000_000).unwrap();
        // Each checker sees its own kind of memory only, whatever the addresses.
        assert_eq!(d.check_handout(device, 4096, t), 1);
        assert_eq!(d.check_host_handout(host, 4096), 1);
        assert_eq!(d.violations().len(), 2);
        d.synchronize_stream(s).unwrap();
        d.host_free(host).unwrap();
    }

    #[test]
    fn waiting_on_an_event_orders_the_reuse() {
        let d = dev();
        let (a, b) = (d.create_stream().unwrap(), d.create_stream().unwrap());
        let p = d.alloc(4096).unwrap();
        d.use_range(p, 4096, b, 1_000_000).unwrap();
        let e = d.create_event().unwrap();
        d.record_event(e, b).unwrap();
        assert!(!d.query_event(e).unwrap());
        d.stream_wait_event(a, e).unwrap();
        assert_eq!(d.check_handout(p, 4096, a), 0);
        d.synchronize_event(e).unwrap();
        assert!(d.query_event(e).unwrap());
        assert!(d.violations().is_empty());
    }

    #[test]
    fn plain_free_synchronizes_the_device() {
        let d = dev();
        let s = d.create_stream().unwrap();
        let p = d.alloc(4096).unwrap();
        d.use_range(p, 4096, s, 5_000_000).unwrap();
        d.free(p).unwrap();
        assert!(d.now() >= 5_000_000);
        let q = d.alloc(4096).unwrap();
        assert_eq!(q, p, "best fit hands the same range back");
        assert_eq!(d.check_handout(q, 4096, Stream::DEFAULT), 0);
        assert!(d.free(q + 1).is_err());
    }

    #[test]
    fn pool_reuse_across_streams_waits_for_the_free() {
        let d = dev();
        let (a, b) = (d.create_stream().unwrap(), d.create_stream().unwrap());
        let pool = d.default_pool().unwrap();
        let p = d.alloc_async(1 << 20, pool, a).unwrap();
        d.use_range(p, 1 << 20, a, 1_000_000).unwrap();
        d.free_async(p, a).unwrap();
        // Same stream: at once, no wait.
        let before = d.stream_ready_at(a).unwrap();
        let q = d.alloc_async(1 << 20, pool, a).unwrap();
        assert_eq!(q, p);
        assert_eq!(d.stream_ready_at(a).unwrap(), before);
        d.use_range(q, 1 << 20, a, 1_000_000).unwrap();
        d.free_async(q, a).unwrap();
        // Another stream: the driver inserts a wait on the free.
        let r = d.alloc_async(1 << 20, pool, b).unwrap();
        assert_eq!(r, p);
        assert!(d.stream_ready_at(b).unwrap() >= d.stream_ready_at(a).unwrap());
        assert_eq!(d.check_handout(r, 1 << 20, b), 0);
        assert_eq!(d.pool_attr(pool, PoolAttr::UsedMemCurrent).unwrap(), 1 << 20);
        d.free_async(r, b).unwrap();
        d.synchronize_stream(b).unwrap();
        assert_eq!(
            d.pool_attr(pool, PoolAttr::ReservedMemCurrent).unwrap(),
            0,
            "threshold 0 releases at sync"
        );
        assert_eq!(d.mem_info().unwrap().used(), 0);
    }

    #[test]
    fn pool_threshold_and_trim() {
        let d = dev();
        let pool = d.create_pool(PoolProps::default()).unwrap();
        d.set_pool_attr(pool, PoolAttr::ReleaseThreshold, u64::MAX).unwrap();
        let s = d.create_stream().unwrap();
        let p = d.alloc_async(3 << 20, pool, s).unwrap();
        d.free_async(p, s).unwrap();
        d.synchronize_stream(s).unwrap();
        assert_eq!(d.pool_attr(pool, PoolAttr::ReservedMemCurrent).unwrap(), 4 << 20);
        d.trim_pool(pool, 0).unwrap();
        assert_eq!(d.pool_attr(pool, PoolAttr::ReservedMemCurrent).unwrap(), 0);
        assert_eq!(d.pool_attr(pool, PoolAttr::ReservedMemHigh).unwrap(), 4 << 20);
        d.destroy_pool(pool).unwrap();
    }

    #[test]
    fn out_of_memory_carries_figures() {
        let d = dev();
        match d.alloc(2 << 30) {
            Err(Error::OutOfMemory(r)) => {
                assert_eq!((r.requested, r.device_total), (2 << 30, 1 << 30));
            }
            other => panic!("expected out of memory, got {other:?}"),
        }
    }

    #[test]
    fn host_function_runs_when_its_stream_reaches_it() {
        let d = dev();
        let s = d.create_stream().unwrap();
        let p = d.alloc(4096).unwrap();
        d.use_range(p, 4096, s, 1_000_000).unwrap();
        let ran = Arc::new(AtomicBool::new(false));
        let r = ran.clone();
        d.launch_host_func(s, Box::new(move || r.store(true, Ordering::SeqCst))).unwrap();
        assert!(!ran.load(Ordering::SeqCst));
        d.synchronize_stream(s).unwrap();
        d.advance(1);
        assert!(ran.load(Ordering::SeqCst));
    }

    #[test]
    fn capture_records_and_launch_replays() {
        let d = dev();
        let s = d.create_stream().unwrap();
        let p = d.alloc(4096).unwrap();
        d.begin_capture(s).unwrap();
        assert_eq!(d.capture_status(s).unwrap(), CaptureStatus::Active);
        let captured_at = d.stream_ready_at(s).unwrap();
        d.memset_async(p, 1, 4096, s).unwrap();
        assert_eq!(d.stream_ready_at(s).unwrap(), captured_at, "captured work does not run");
        let g = d.end_capture(s).unwrap();
        assert_eq!(d.capture_status(s).unwrap(), CaptureStatus::None);
        let before = d.stream_ready_at(s).unwrap();
        let e = d.instantiate_graph(g).unwrap();
        d.launch_graph(e, s).unwrap();
        assert!(d.stream_ready_at(s).unwrap() > before);
        d.destroy_graph_exec(e).unwrap();
        d.destroy_graph(g).unwrap();
    }

    #[test]
    fn same_seed_same_timeline() {
        let run = || {
            let d = SimDevice::new(SimConfig { seed: 7, ..SimConfig::with_capacity(1 << 30) });
            let s = d.create_stream().unwrap();
            let p = d.alloc(1 << 20).unwrap();
            for _ in 0..10 {
                d.memset_async(p, 0, 1 << 20, s).unwrap();
            }
            d.stream_ready_at(s).unwrap()
        };
        assert_eq!(run(), run());
    }
}
