//! The facade: one allocator stack per device, built lazily from a typed [`Config`].
//!
//! The stack for each device, outermost first (each layer only when configured):
//!
//! ```text
//! Pointers -> Limit -> Retry -> Counted -> Traced -> Tagged -> strategy
//! ```
//!
//! [`Pointers`] keeps the allocations a front end knows by pointer (the stack's one table
//! from a pointer to its allocation); below it every layer has one allocation path, the
//! handle's. Limit comes first so that a request over the limit fails at once, without making
//! Retry wait; Retry wraps the statistics and trace layers so that its attempts are counted
//! and logged as what they are; the strategy is the allocator itself, built by its entry in
//! [`STRATEGIES`]. Strategies without stream methods (`plain`, `best_fit`) are wrapped in
//! [`SingleStream`](crate::adaptors::SingleStream) so that every device offers
//! a [`StreamAllocator`]. [`Tagged`] serves allocations made under a [tag](crate::tags) from
//! pools that sleep and wake ([`Facade::sleep`]), where the configuration can: a caching
//! strategy (`stream_safe`, `best_fit`) over stitched ranges; elsewhere tags are not looked at
//! and [`Facade::sleep`] says why.

mod config;
mod presets;
pub mod private_pools;
pub mod strategies;

pub use config::{
    parse_duration, parse_size, Config, DeviceKind, LimitSpec, PoolChoice, Strategy, DEFAULT_WAIT_TIMEOUT,
    ENV_VAR, KEYS,
};
pub use presets::Preset;
pub use strategies::{StrategySpec, STRATEGIES};

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::adaptors::{Counted, Limit, PointerEntry, Pointers, ReservedLimit, Retry, StreamStats, Traced};
use crate::allocation::{Allocation, Allocator, BlockState, Segment, SegmentBlock, Stats, StreamAllocator};
use crate::allocators::{BackingKind, BestFitConfig, StreamSafeConfig, TagStats, Tagged};
use crate::device::cuda::CudaDevice;
use crate::device::sim::{SimConfig, SimDevice};
use crate::device::{Device, DevicePtr, Stream};
use crate::error::{try_each, Error, Result};
use crate::tags::Tag;
use crate::trace::TraceWriter;
use private_pools::{PoolId, PrivatePools};

/// A device as opened: the device, and the simulator behind it with `device=sim`.
type Opened = (Arc<dyn Device>, Option<Arc<SimDevice>>);

/// The most devices one facade serves.
pub const MAX_DEVICES: usize = 64;
const _: () = assert!(MAX_DEVICES <= u64::BITS as usize, "Facade::built_mask has a bit per device");

/// The settings of the caching pools of `config`'s `best_fit` and `stream_safe` strategies
/// on `device`: the backing `config` names, but chunks on a device without virtual memory
/// management (which stitched ranges and segments need).
fn pool_config(config: &Config, device: &dyn Device) -> Result<BestFitConfig> {
    let mapped = config.backing.spec().mapped;
    let backing =
        if mapped && !device.supports_virtual_memory()? { BackingKind::CHUNKS } else { config.backing };
    Ok(BestFitConfig {
        growth: config.growth,
        backing,
        wait_timeout: config.wait_timeout,
        ..Default::default()
    })
}

/// Whether the stack `config` describes on `device`, whose caching pools get `pool`, can put
/// tags to sleep; else [`Error::Unsupported`] naming what in the configuration cannot.
fn sleep_support(config: &Config, pool: &BestFitConfig, device: &dyn Device) -> Result<()> {
    let why = match config.strategy.spec().no_sleep {
        Some(why) => why.to_string(),
        None if config.backing.spec().sleeps && pool.backing == config.backing => return Ok(()),
        None if config.backing.spec().sleeps => format!(
            "device {} has no virtual memory management, so backing={} fell back to chunks, which cannot be \
             given back at their addresses",
            device.ordinal(),
            config.backing.name()
        ),
        None => format!("backing={} cannot give memory back at its addresses", config.backing.name()),
    };
    Err(Error::Unsupported(format!(
        "tags do not sleep here: {why}; strategy=stream_safe (or best_fit) with backing=stitched, the default, on a \
         device with virtual memory management can (tagged allocations are served as untagged ones meanwhile)"
    )))
}

/// The layers of a device's stack below [`Pointers`].
pub type DynAllocator = Arc<dyn StreamAllocator>;

/// A device's allocator stack: allocations by handle on any stream ([`StreamAllocator`]) and
/// by pointer ([`Pointers`], for front ends that hand raw pointers out), through the same
/// layers.
pub type Stack = Pointers<DynAllocator>;

/// The layer of a stack that serves tagged allocations and puts tags to sleep.
pub type TagLayer = Arc<Tagged<DynAllocator>>;

/// What the facade keeps for one device.
pub struct DeviceStack {
    /// The device.
    pub device: Arc<dyn Device>,
    /// The simulated device behind [`DeviceStack::device`], with `device=sim`.
    pub sim: Option<Arc<SimDevice>>,
    /// The outermost layer of its stack, which keeps the allocations made by pointer.
    pub allocator: Arc<Stack>,
    /// The per-stream statistics layer, with `stats=true`.
    pub stats: Option<Arc<Counted<DynAllocator>>>,
    /// The trace layer, with `trace=PATH`.
    pub trace: Option<Arc<Traced<DynAllocator, File>>>,
    /// Pools apart from the stack, for CUDA graphs and frameworks' memory pools.
    pub private: PrivatePools,
    /// The cap on what the stack holds from the device (PyTorch's memory fraction), applied
    /// by [`DeviceStack::allocate_ptr_with`]; none until set.
    pub reserved_limit: ReservedLimit,
    /// The layer that serves tagged allocations, or why the configuration has none (tags
    /// then are not looked at).
    pub tags: Result<TagLayer>,
}

impl DeviceStack {
    /// Allocates `size` bytes on `stream` from the stack (not a private pool) by pointer,
    /// keeping `word` with it ([`Pointers::allocate_ptr_with`]), under
    /// [`DeviceStack::reserved_limit`].
    #[inline]
    pub fn allocate_ptr_with(&self, size: usize, stream: Stream, word: u64) -> Result<DevicePtr> {
        self.reserved_limit.allocate_ptr_with(&self.allocator, size, stream, word)
    }

    /// Puts `tags` to sleep ([`Tagged::sleep`]): after the work of the streams that use their
    /// memory, the streams recorded on the stack's allocations by pointer included. Why not,
    /// where the configuration has no tags.
    pub fn sleep(&self, tags: &[Tag], offload: bool) -> Result<usize> {
        let layer = self.tags.as_ref().map_err(Clone::clone)?;
        layer.sleep(tags, offload, &self.allocator.recorded_streams())
    }

    /// The segments the stack and its private pools hold from the device, with their blocks
    /// ([`Allocator::segments`]), each with the private pool that holds it (`None`: the stack),
    /// in address order. Where the stack's memory is the driver's to place (`strategy=async`),
    /// each of its live allocations is a segment of one block, its size as asked for: the
    /// driver's cache is not listed.
    pub fn segments(&self) -> Result<Vec<(Option<PoolId>, Segment)>> {
        let mut main = Vec::new();
        if let Err(Error::Unsupported(_)) = self.allocator.segments(&mut main) {
            main = self
                .allocator
                .entries()
                .into_iter()
                .map(|(addr, e)| Segment {
                    addr,
                    size: e.size,
                    stream: e.stream,
                    blocks: vec![SegmentBlock { addr, size: e.size, state: BlockState::Allocated }],
                })
                .collect();
        }
        let mut pools = Vec::new();
        self.private.segments(&mut pools)?;
        let mut all: Vec<_> = main
            .into_iter()
            .map(|s| (None, s))
            .chain(pools.into_iter().map(|(id, s)| (Some(id), s)))
            .collect();
        all.sort_by_key(|(_, s)| s.addr);
        Ok(all)
    }
}

/// A stream as a front end names it where it frees: with its device when the name says which
/// (a simulated stream's handle), else (`None`: the legacy default stream, or a CUDA stream)
/// any device's.
#[derive(Debug, Clone, Copy)]
pub struct StreamHint {
    /// The device of the stream, if the name says.
    pub device: Option<usize>,
    /// The stream.
    pub stream: Stream,
}

impl StreamHint {
    /// The legacy default stream.
    pub const DEFAULT: Self = Self { device: None, stream: Stream::DEFAULT };

    /// The stream as `stack` is to see it, as a hint of the stream an allocation was made on:
    /// a stream of another device is none of its streams (the simulators number their
    /// streams alike), and only the legacy default stream stands there for it.
    fn on(self, stack: &DeviceStack) -> Stream {
        match self.device {
            Some(d) if d != stack.device.ordinal() => Stream::DEFAULT,
            _ => self.stream,
        }
    }
}

/// What a stack kept for an allocation freed or looked up by pointer ([`Facade::free_ptr`],
/// [`Facade::entry`]), and where.
#[derive(Debug, Clone, Copy)]
pub struct Freed {
    /// The device whose stack (or private pool) held it.
    pub device: usize,
    /// What its table kept.
    pub entry: PointerEntry,
    /// The private pool that held it, if one did.
    pub pool: Option<PoolId>,
}

/// Per-device allocator stacks built from one [`Config`], created on first use of each
/// device, thread-safely. The constructor makes no driver call.
///
/// # Examples
///
/// ```
/// use streamalloc::facade::{Config, Facade};
/// use streamalloc::Stream;
///
/// let facade = Facade::new(Config::parse("device=sim,sim_capacity=1GiB,strategy=best_fit")?);
/// let a = facade.allocate(4 << 20, 0, Stream::DEFAULT)?; // 4 MiB on device 0's stack
/// assert_eq!(facade.stats(0).allocated, 4 << 20);
/// drop(a);
/// assert_eq!(facade.stats(0).allocated, 0);
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct Facade {
    config: Config,
    stacks: Box<[OnceLock<DeviceStack>]>,
    /// Bit `i` is set once the stack of device `i` is built: a free looks through the stacks
    /// in use without touching the other slots.
    built_mask: AtomicU64,
    building: Mutex<()>,
}

impl Facade {
    /// A facade for `config`.
    pub fn new(config: Config) -> Self {
        let stacks = (0..MAX_DEVICES).map(|_| OnceLock::new()).collect();
        Self { config, stacks, built_mask: AtomicU64::new(0), building: Mutex::new(()) }
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The stack of device `ordinal`, built on first use.
    #[inline]
    pub fn stack(&self, ordinal: usize) -> Result<&DeviceStack> {
        match self.built(ordinal) {
            Some(stack) => Ok(stack),
            None => self.build_stack_of(ordinal),
        }
    }

    /// [`Facade::stack`] where it is not built yet.
    #[cold]
    fn build_stack_of(&self, ordinal: usize) -> Result<&DeviceStack> {
        let slot = self.stacks.get(ordinal).ok_or_else(|| {
            Error::InvalidArgument(format!("device {ordinal} is beyond the {MAX_DEVICES} a facade serves"))
        })?;
        let _building = self.building.lock();
        if let Some(stack) = slot.get() {
            return Ok(stack);
        }
        let stack = self.build(ordinal)?;
        let stack = slot.get_or_init(|| stack);
        self.built_mask.fetch_or(1 << ordinal, Ordering::Release);
        Ok(stack)
    }

    /// The stack of device `ordinal` if it is built (the device is in use).
    #[inline]
    pub fn built(&self, ordinal: usize) -> Option<&DeviceStack> {
        self.stacks.get(ordinal)?.get()
    }

    /// The stacks built so far, by device ordinal.
    #[inline]
    pub fn built_stacks(&self) -> impl Iterator<Item = &DeviceStack> {
        let mut mask = self.built_mask.load(Ordering::Acquire);
        std::iter::from_fn(move || {
            while mask != 0 {
                let i = mask.trailing_zeros() as usize;
                mask &= mask - 1;
                if let Some(stack) = self.built(i) {
                    return Some(stack);
                }
            }
            None
        })
    }

    /// Lets device `peer` read and write the memory that device `ordinal`'s allocators map
    /// (`backing=stitched`), mapped so far and later ([`VirtualMemory::grant_mapped_access`](crate::device::VirtualMemory::grant_mapped_access)); builds
    /// the stack if needed. Plain allocations (`backing=chunks`, private pools) follow the
    /// context-level peer access the program enables itself (`cudaDeviceEnablePeerAccess`);
    /// mapped memory does not, and needs this call too. The driver's pools (`strategy=async`)
    /// are not covered: see [`AsyncPool::grant_peer_access`](crate::allocators::AsyncPool::grant_peer_access).
    pub fn enable_peer_access(&self, ordinal: usize, peer: usize) -> Result<()> {
        self.stack(ordinal)?.device.grant_mapped_access(peer)
    }

    /// Tells device `ordinal`'s allocators, its private pools included, that `stream` is
    /// about to be destroyed, once no allocation made on it is live
    /// ([`StreamAllocator::retire_stream`]); nothing for a device not used yet. Every part is
    /// tried; the first error is returned.
    pub fn retire_stream(&self, ordinal: usize, stream: Stream) -> Result<()> {
        let Some(stack) = self.built(ordinal) else { return Ok(()) };
        let main = stack.allocator.retire_stream(stream);
        let private = stack.private.retire_stream(stream);
        main.and(private)
    }

    /// The allocator stack of device `ordinal`.
    pub fn allocator(&self, ordinal: usize) -> Result<&Arc<Stack>> {
        Ok(&self.stack(ordinal)?.allocator)
    }

    /// Allocates `size` bytes on device `ordinal`, owned by `stream`.
    pub fn allocate(&self, size: usize, ordinal: usize, stream: Stream) -> Result<Allocation> {
        self.allocator(ordinal)?.allocate_on(size, stream)
    }

    /// The stacks built so far, that of `device` (if it is one in use) first.
    pub fn stacks_from(&self, device: Option<usize>) -> impl Iterator<Item = &DeviceStack> {
        let first = device.and_then(|d| self.built(d));
        let rest = self.built_stacks().filter(move |s| !first.is_some_and(|f| std::ptr::eq(f, *s)));
        first.into_iter().chain(rest)
    }

    /// Frees the allocation at `ptr` (null: nothing to do), made by any stack or private pool;
    /// `device` and `owner` are where the caller says it was made, looked at first. What the
    /// stack kept for it, also for a free deferred to the end of the captures (the caller is
    /// done with the allocation; the stack frees it later).
    ///
    /// Under `async`, memory from outside a capture freed on its capturing stream waits for
    /// the capture's end (see `PrivatePools::defer_free`), which only the stack holding `ptr`
    /// decides. The stacks are asked in turn; one that cannot tell (its device does not know
    /// `owner`: a stream of another device) frees nothing here, and its error stands only if
    /// `ptr` is none of the other stacks' (its memory then stays allocated rather than be
    /// freed into a graph): another device's error never cancels the free. A pointer no stack
    /// holds is [`Error::InvalidArgument`].
    pub fn free_ptr(
        &self,
        ptr: DevicePtr,
        device: Option<usize>,
        owner: StreamHint,
    ) -> Result<Option<Freed>> {
        if ptr == 0 {
            return Ok(None);
        }
        // No private pool active, no free deferred: `device`'s stack is asked first, as below.
        if let Some(stack) = device.and_then(|d| self.built(d)) {
            if !self.built_stacks().any(|s| s.private.is_active()) {
                if let Some(entry) = stack.allocator.take_ptr(ptr, owner.on(stack)) {
                    return Ok(Some(Freed { device: stack.device.ordinal(), entry, pool: None }));
                }
            }
        }
        let mut undecided: Vec<(&DeviceStack, Error)> = Vec::new();
        for stack in self.stacks_from(device) {
            // While a pool is active the allocation's own stream decides, whatever the hint.
            let hint = owner.on(stack);
            let owner_here = match stack.private.is_active() {
                true => stack.allocator.entry(ptr, Some(hint)).map_or(hint, |e| e.stream),
                false => hint,
            };
            match stack.private.defer_free(ptr, owner_here) {
                Ok(true) => return Ok(entry_in(stack, ptr)),
                Ok(false) => {}
                Err(e) => undecided.push((stack, e)),
            }
        }
        if undecided.is_empty() {
            return self.free_now(ptr, device, owner).map(Some);
        }
        let decided = |s: &DeviceStack| !undecided.iter().any(|(u, _)| std::ptr::eq(*u, s));
        if let Some(freed) = self.free_in(ptr, device, owner, decided) {
            return Ok(Some(freed));
        }
        // The pointer is the memory of a stack that could not decide (whose device knows it),
        // or of none.
        let holder = undecided.iter().position(|(s, _)| s.device.address_range(ptr).is_ok());
        Err(holder.map_or_else(|| not_live(ptr), |i| undecided.swap_remove(i).1))
    }

    /// Records `stream` on the allocation at `ptr` (null: nothing to do), made by any stack or
    /// private pool ([`Pointers::record_stream_ptr`], [`PrivatePools::record_stream`]): its
    /// memory is not reused before the work `stream` has at the free. The stacks of the
    /// stream's device (all, where the hint names none) are asked in turn; the one that holds
    /// `ptr` decides, and a refusal (a stream its device does not know) stands only if `ptr` is
    /// none of the others'. Nothing is recorded where [`Error::InvalidArgument`] comes back: a
    /// pointer no stack of the stream's device holds, or a stream that is no live stream of
    /// the device that holds it.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamHint) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        // A stack of another device than the stream's, which the hint names, holds nothing the
        // stream may be recorded on.
        let of_stream = |s: &&DeviceStack| stream.device.is_none_or(|d| d == s.device.ordinal());
        let s = stream.stream;
        let stacks =
            self.stacks_from(None).filter(of_stream).map(|st| st.allocator.record_stream_ptr(ptr, s));
        let pools = self.stacks_from(None).filter(of_stream).map(|st| st.private.record_stream(ptr, s));
        let mut refused = None;
        for found in stacks.chain(pools) {
            match found {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    refused.get_or_insert(e);
                }
            }
        }
        Err(refused.unwrap_or_else(|| match stream.device {
            Some(d) => Error::InvalidArgument(format!(
                "{ptr:#x} is not a live allocation of device {d}, whose stream {:#x} is (a stream is \
                 recorded on its own device's memory only)",
                s.raw()
            )),
            None => not_live(ptr),
        }))
    }

    /// Frees the allocation at `ptr` (not null), of `owner`, from whichever stack or private
    /// pool made it (`device`'s first), deferring nothing.
    pub fn free_now(&self, ptr: DevicePtr, device: Option<usize>, owner: StreamHint) -> Result<Freed> {
        self.free_in(ptr, device, owner, |_| true).ok_or_else(|| not_live(ptr))
    }

    /// What the stack or private pool holding the live allocation at `ptr` keeps for it.
    pub fn entry(&self, ptr: DevicePtr) -> Result<Freed> {
        self.built_stacks().find_map(|s| entry_in(s, ptr)).ok_or_else(|| not_live(ptr))
    }

    /// Frees the allocation at `ptr` (not null), of `owner`, from whichever of the stacks
    /// `among` takes, or their private pools, made it (`device`'s first); what was kept for
    /// it, if one did.
    fn free_in(
        &self,
        ptr: DevicePtr,
        device: Option<usize>,
        owner: StreamHint,
        among: impl Fn(&DeviceStack) -> bool,
    ) -> Option<Freed> {
        let freed = |s: &DeviceStack, entry, pool| Freed { device: s.device.ordinal(), entry, pool };
        let mut stacks = self.stacks_from(device).filter(|s| among(s));
        stacks.find_map(|s| s.allocator.take_ptr(ptr, owner.on(s)).map(|e| freed(s, e, None))).or_else(|| {
            let mut stacks = self.stacks_from(device).filter(|s| among(s));
            stacks.find_map(|s| s.private.take(ptr, owner.on(s)).map(|(id, e)| freed(s, e, Some(id))))
        })
    }

    /// Statistics of device `ordinal` (zeros if it has not been used).
    pub fn stats(&self, ordinal: usize) -> Stats {
        self.stacks.get(ordinal).and_then(OnceLock::get).map(|s| s.allocator.stats()).unwrap_or_default()
    }

    /// Per-stream figures of device `ordinal`, with `stats=true`.
    pub fn stream_stats(&self, ordinal: usize) -> Option<Vec<(Stream, StreamStats)>> {
        self.stacks.get(ordinal)?.get()?.stats.as_ref().map(|s| s.per_stream())
    }

    /// Statistics summed over every device in use.
    pub fn global_stats(&self) -> Stats {
        self.built_stacks().map(|s| s.allocator.stats()).sum()
    }

    /// The ordinals of the devices in use.
    pub fn devices_in_use(&self) -> Vec<usize> {
        (0..MAX_DEVICES).filter(|i| self.built(*i).is_some()).collect()
    }

    /// Releases cached memory on every device in use; the bytes returned in all. Every
    /// device is tried; the first error is returned after that.
    pub fn release_all(&self) -> Result<usize> {
        let mut total = 0;
        try_each(self.built_stacks(), |stack| {
            total += stack.allocator.release()?;
            Ok(())
        })?;
        Ok(total)
    }

    /// The figures of the page-locked host memory the sleeps with offload keep, over every
    /// device in use ([`Tagged::offload_stats`]). The device's release leaves that memory, as
    /// PyTorch's `empty_cache` leaves pinned memory: the next sleep pins nothing.
    pub fn offload_stats(&self) -> Stats {
        self.tag_layers().map(|t| t.offload_stats()).sum()
    }

    /// Restarts the peaks of [`Facade::offload_stats`] from the current figures.
    pub fn reset_offload_peak_stats(&self) {
        self.tag_layers().for_each(|t| t.reset_offload_peak_stats());
    }

    /// Gives back the page-locked host memory kept for offloads that no sleeping tag holds, on
    /// every device in use; the bytes. Every device is tried; the first error is returned
    /// after that.
    pub fn release_offload_memory(&self) -> Result<usize> {
        let mut total = 0;
        try_each(self.tag_layers(), |tags| {
            total += tags.release_offload_memory()?;
            Ok(())
        })?;
        Ok(total)
    }

    /// The tag layers of the devices in use whose configuration has one.
    fn tag_layers(&self) -> impl Iterator<Item = &TagLayer> {
        self.built_stacks().filter_map(|stack| stack.tags.as_ref().ok())
    }

    /// The tag layer of device `ordinal` (its stack built if needed), or why its configuration
    /// has none.
    fn tag_layer(&self, ordinal: usize) -> Result<&TagLayer> {
        self.stack(ordinal)?.tags.as_ref().map_err(Clone::clone)
    }

    /// The tags named `names`.
    fn tags(names: &[&str]) -> Result<Vec<Tag>> {
        names.iter().map(|n| Tag::new(n)).collect()
    }

    /// Puts the tags named `names` to sleep on device `ordinal` ([`Tagged::sleep`]): once the
    /// work already enqueued on the streams that use their memory is done (the host waits at
    /// most `wait_timeout`, for those streams only), their memory goes back to the device and
    /// their addresses stay reserved; with `offload`, their contents are kept in page-locked
    /// host memory until [`Facade::wake`]. The bytes given back at their addresses. A tag
    /// asleep already is left as it is (0 bytes). [`Error::Unsupported`] naming the
    /// configuration where it cannot sleep (strategy `plain` or `async`, a backing other than
    /// stitched ranges, a device without virtual memory management).
    ///
    /// # Examples
    ///
    /// ```
    /// use streamalloc::facade::{Config, Facade};
    /// use streamalloc::{tags, Stream};
    ///
    /// let facade = Facade::new(Config::parse("device=sim,sim_capacity=1GiB")?);
    /// let kv = {
    ///     let _tag = tags::scope("kv_cache")?;
    ///     facade.allocate(64 << 20, 0, Stream::DEFAULT)?
    /// };
    /// let reserved = facade.stats(0).reserved;
    /// assert_eq!(facade.sleep(0, &["kv_cache"], true)?, 64 << 20);
    /// assert_eq!(facade.stats(0).reserved, reserved - (64 << 20));
    /// assert_eq!(facade.wake(0, &["kv_cache"])?, 64 << 20); // mapped again at kv.ptr()
    /// # drop(kv);
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub fn sleep(&self, ordinal: usize, names: &[&str], offload: bool) -> Result<usize> {
        let tags = Self::tags(names)?;
        self.stack(ordinal)?.sleep(&tags, offload)
    }

    /// Wakes the tags named `names` on device `ordinal` ([`Tagged::wake`]): fresh memory at
    /// the addresses they slept, their offloaded contents copied back before this returns. The
    /// bytes mapped again. An awake tag is left as it is (0 bytes).
    pub fn wake(&self, ordinal: usize, names: &[&str]) -> Result<usize> {
        let tags = Self::tags(names)?;
        self.tag_layer(ordinal)?.wake(&tags)
    }

    /// Drops the tag named `name` on device `ordinal` ([`Tagged::drop_tag`]): its pool's
    /// memory and address reservations go back, so that it costs nothing. The bytes its pool
    /// had reserved. [`Error::InvalidArgument`] while it has live allocations.
    pub fn drop_tag(&self, ordinal: usize, name: &str) -> Result<usize> {
        let tag = Tag::new(name)?;
        self.tag_layer(ordinal)?.drop_tag(tag)
    }

    /// The figures of the tag named `name` on device `ordinal` ([`Tagged::tag_stats`]).
    pub fn tag_stats(&self, ordinal: usize, name: &str) -> Result<TagStats> {
        let tag = Tag::new(name)?;
        Ok(self.tag_layer(ordinal)?.tag_stats(tag))
    }

    /// Writes out what the trace layers have buffered (a process-wide facade is never
    /// dropped, so a front end calls this at exit). Every device is tried; the first error
    /// is returned after that.
    pub fn flush(&self) -> Result<()> {
        try_each(self.built_stacks().filter_map(|s| s.trace.as_ref()), |trace| trace.flush())
    }

    /// The device, and the simulator behind it with `device=sim`.
    fn open_device(&self, ordinal: usize) -> Result<Opened> {
        Ok(match self.config.device {
            DeviceKind::Cuda => (CudaDevice::new(ordinal)?, None),
            DeviceKind::Sim => {
                let sim = SimDevice::new(SimConfig {
                    ordinal,
                    virtual_memory: self.config.sim_virtual_memory,
                    ..SimConfig::with_capacity(self.config.sim_capacity)
                });
                (sim.clone(), Some(sim))
            }
        })
    }

    fn build(&self, ordinal: usize) -> Result<DeviceStack> {
        let (device, sim) = self.open_device(ordinal)?;
        let mut stack = Self::build_stack(&self.config, device)?;
        stack.sim = sim;
        Ok(stack)
    }

    /// Builds the stack `config` describes on `device` (the `device` and `sim_*`
    /// keys do not apply: the device is given). What a facade builds for each device it
    /// serves; also for a caller that builds stacks one after another on a device it opened
    /// once, such as a trace replay comparing configurations. The stack's `sim` is `None`.
    pub fn build_stack(config: &Config, device: Arc<dyn Device>) -> Result<DeviceStack> {
        let c = config;
        let ordinal = device.ordinal();
        let pool = pool_config(c, &*device)?;
        let mut a = (c.strategy.spec().build)(c, &device, pool)?;
        let tags = sleep_support(c, &pool, &*device).and_then(|()| {
            let config = StreamSafeConfig { pool, ..Default::default() };
            Ok(Arc::new(Tagged::new(a.clone(), device.clone(), config)?))
        });
        if let Ok(layer) = &tags {
            a = layer.clone();
        }
        let mut trace = None;
        if let Some(path) = &c.trace {
            let path = if ordinal == 0 {
                path.clone()
            } else {
                PathBuf::from(format!("{}.{ordinal}", path.display()))
            };
            let t = Arc::new(Traced::new(a, TraceWriter::create(path)?));
            trace = Some(t.clone());
            a = t;
        }
        let mut stats = None;
        if c.stats {
            let s = Arc::new(Counted::new(a));
            stats = Some(s.clone());
            a = s;
        }
        if let Some(timeout) = c.retry_timeout {
            a = Arc::new(Retry::new(a, timeout));
        }
        if let Some(limit) = c.limit {
            a = Arc::new(Limit::new(a, limit.bytes(device.mem_info()?.total)));
        }
        let private = PrivatePools::new(device.clone(), pool, c.strategy.spec().driver_pool);
        let allocator = Arc::new(Pointers::new(a, device.clone(), c.wait_timeout));
        Ok(DeviceStack {
            device,
            sim: None,
            allocator,
            stats,
            trace,
            private,
            reserved_limit: ReservedLimit::default(),
            tags,
        })
    }
}

/// What `stack` or its private pools keep for `ptr`, if they hold it.
fn entry_in(stack: &DeviceStack, ptr: DevicePtr) -> Option<Freed> {
    let device = stack.device.ordinal();
    match stack.allocator.entry(ptr, None) {
        Some(entry) => Some(Freed { device, entry, pool: None }),
        None => stack.private.entry(ptr).map(|(id, entry)| Freed { device, entry, pool: Some(id) }),
    }
}

fn not_live(ptr: DevicePtr) -> Error {
    Error::InvalidArgument(format!(
        "{ptr:#x} is not a live streamalloc allocation (freed twice, or not made by streamalloc)"
    ))
}
