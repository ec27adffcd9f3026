//! The CUDA driver API through `cudarc`, loaded at run time.
//!
//! [`CudaDevice`] implements [`Device`](super::Device) on one GPU's *primary context* (the context the CUDA
//! runtime, PyTorch and CuPy use), so memory and streams are shared with those libraries.
//!
//! * Loading: `libcuda` is opened at the first [`CudaDevice::new`] or [`cuda_available`], and
//!   every entry point this module calls is looked up once then. A machine without the driver
//!   (or with one too old) gets [`Error::NoDriver`], never a panic.
//! * Contexts: any thread may call any method. A call makes the primary context current on
//!   the calling thread unless it already is (one `cuCtxGetCurrent`). A thread with no current
//!   context keeps ours afterwards, so its next call costs nothing more; a thread that had
//!   *another* context current gets it back when the call returns, so callers such as PyTorch
//!   never see their current device change under them. The calls an allocation and a free
//!   make on an ordinary stream (`cuMemAllocFromPoolAsync`, `cuMemFreeAsync`,
//!   `cuStreamIsCapturing`) bind nothing: the driver takes the context from the stream (checked
//!   from a thread with no current context, `lab/async_same_run.cpp`), and the bind's
//!   `cuCtxGetCurrent` before each of them was a measurable share of their cost.
//! * Handles: a [`Stream`], [`Event`], [`Pool`], [`Graph`] or [`GraphExec`] holds the driver
//!   handle's pointer value; `Stream(0)` is the legacy default stream.
//! * Peers: pool access, mapped-memory access and (with the `test-util` feature) peer copies
//!   name another device by ordinal. A device opens each peer it is asked about once, as a
//!   private [`CudaDevice`] (which retains that ordinal's primary context), and keeps it for its
//!   own lifetime: a peer copy needs the peer's context, which must outlive the asynchronous
//!   copy. Being private, it never forms a reference cycle with the caller's own instance for
//!   that ordinal.
//! * Errors: a failing `CUresult` becomes [`Error::Driver`] with the driver's name for it and
//!   the entry point; `CUDA_ERROR_OUT_OF_MEMORY` from an allocation becomes
//!   [`Error::OutOfMemory`] with the device's free and total memory.
//!
//! This is the only module of the crate with `unsafe` code, but for the system calls of
//! [`super::ipc`].

use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_int, c_void, CStr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::panic::catch_unwind;
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use parking_lot::Mutex;

use super::ipc::{PoolPointer, SharedPiece, POOL_POINTER_DATA};
use super::{
    CaptureStatus, DeviceMemory, DevicePtr, DriverPools, Event, Events, Graph, GraphExec, Graphs, HostMemory,
    HostPtr, Ipc, MemInfo, Pool, PoolAttr, PoolProps, Stream, Streams, VirtualMemory,
};
use crate::error::{Error, OutOfMemory, Result};

/// The size from which [`VirtualMemory::map`] asks the device's free memory before creating
/// any: below it, a failing map holds little memory for a short while, and the query
/// (`cuMemGetInfo`, a driver round trip) would slow every small growth.
const MAP_CHECKED: usize = 256 << 20;

/// Every driver entry point this module calls, by the exact symbol name `cudarc` loads. `cudarc`
/// panics when a symbol is missing at its first call, so [`init_driver`] checks them all up
/// front and turns a missing one into [`Error::NoDriver`]. Keep in sync with the `sys::` calls
/// below (those of the `test-util` feature only with it).
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuGetErrorName",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuDriverGetVersion",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuMemGetInfo_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuDeviceGetDefaultMemPool",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemPoolGetAttribute",
    "cuMemPoolSetAttribute",
    "cuMemPoolTrimTo",
    "cuMemAllocFromPoolAsync",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuMemRelease",
    "cuMemRetainAllocationHandle",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemFreeAsync",
    "cuMemPoolExportToShareableHandle",
    "cuMemPoolExportPointer",
    "cuMemPoolImportFromShareableHandle",
    "cuMemPoolImportPointer",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
    "cuStreamWaitEvent",
    "cuStreamIsCapturing",
    "cuStreamGetFlags",
    #[cfg(feature = "test-util")]
    "cuLaunchHostFunc",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    #[cfg(feature = "test-util")]
    "cuMemsetD8Async",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
    "cuMemPoolSetAccess",
    #[cfg(feature = "test-util")]
    "cuMemPoolGetAccess",
    "cuPointerGetAttribute",
    #[cfg(feature = "test-util")]
    "cuMemcpyPeerAsync",
    "cuThreadExchangeStreamCaptureMode",
    "cuMemGetAddressRange_v2",
];

/// Whether a CUDA driver can be loaded and initialised here and shows at least one device.
/// The first call loads the driver; later calls are cheap.
pub fn cuda_available() -> bool {
    driver().is_ok() && device_count().is_ok_and(|n| n > 0)
}

/// Number of CUDA devices the driver shows (after `CUDA_VISIBLE_DEVICES`).
pub fn device_count() -> Result<usize> {
    driver()?;
    let mut n: c_int = 0;
    // SAFETY: the driver is loaded and initialised (`driver()` above) and `n` is a valid
    // out-pointer for the duration of the call.
    check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The CUDA version the driver supports, as (major, minor), e.g. (13, 0).
pub fn driver_version() -> Result<(u32, u32)> {
    driver()?;
    let mut v: c_int = 0;
    // SAFETY: the driver is loaded and initialised (`driver()` above) and `v` is a valid
    // out-pointer for the duration of the call.
    check(unsafe { sys::cuDriverGetVersion(&mut v) }, "cuDriverGetVersion")?;
    let v = u32::try_from(v).unwrap_or(0);
    Ok((v / 1000, v % 1000 / 10))
}

/// The [`Stream`] of a stream cudarc made: its `CUstream`. cudarc's streams live in the device's
/// primary context, the one [`CudaDevice`] uses. As any stream, it must not be used once
/// destroyed (cudarc destroys it when its last `Arc` goes).
pub fn stream_of(stream: &cudarc::driver::CudaStream) -> Stream {
    Stream(stream.cu_stream() as u64)
}

/// Loads and initialises the driver once per process; later calls return the cached outcome.
fn driver() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(init_driver).clone()
}

fn init_driver() -> Result<()> {
    // SAFETY: `is_culib_present` only tries to open the candidate library names and closes
    // them again; it has no other effect.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::NoDriver(
            "the CUDA driver library (libcuda.so) was not found; is LD_LIBRARY_PATH set?".into(),
        ));
    }
    // SAFETY: `culib` opens the library (running its initialisers, which is what loading a
    // driver means) and keeps it open for the process; it panics only if no candidate opens,
    // which the catch turns into an error.
    let lib = catch_unwind(|| unsafe { sys::culib() })
        .map_err(|_| Error::NoDriver("the CUDA driver library could not be opened".into()))?;
    for name in SYMBOLS {
        // SAFETY: the symbol is only looked up, never called or dereferenced here, so the
        // pointer type is irrelevant.
        if unsafe { lib.get::<*const c_void>(*name) }.is_err() {
            return Err(Error::NoDriver(format!(
                "the CUDA driver lacks `{name}`; a driver for CUDA 12 or later is needed"
            )));
        }
    }
    // SAFETY: every symbol the module uses exists (checked above), so cudarc's lazy loader
    // cannot panic; `cuInit(0)` is always valid to call and may be called many times.
    let res = unsafe { sys::cuInit(0) };
    if res != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::NoDriver(format!("cuInit failed with {} ({})", error_name(res), res as i32)));
    }
    Ok(())
}

/// The driver's name for `res`, e.g. `CUDA_ERROR_INVALID_VALUE`.
fn error_name(res: sys::CUresult) -> String {
    let mut p: *const std::ffi::c_char = ptr::null();
    // SAFETY: `cuGetErrorName` needs no initialisation and writes a pointer to a static,
    // nul-terminated string into `p`, or leaves it null for an unknown code.
    let ok = unsafe { sys::cuGetErrorName(res, &mut p) } == sys::CUresult::CUDA_SUCCESS;
    if ok && !p.is_null() {
        // SAFETY: on success `p` points to a static nul-terminated string owned by the driver.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        format!("CUresult {}", res as i32)
    }
}

/// `Ok` on `CUDA_SUCCESS`, else [`Error::Driver`] naming `call`.
fn check(res: sys::CUresult, call: &'static str) -> Result<()> {
    if res == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Driver { code: res as i32, name: error_name(res), call })
    }
}

fn stream(s: Stream) -> sys::CUstream {
    s.0 as usize as sys::CUstream
}
fn event(e: Event) -> sys::CUevent {
    e.0 as usize as sys::CUevent
}
fn pool(p: Pool) -> sys::CUmemoryPool {
    p.0 as usize as sys::CUmemoryPool
}
fn handle<T>(p: *mut T) -> u64 {
    p as usize as u64
}

/// A primary context handle, shareable between threads.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Ctx(sys::CUcontext);

// SAFETY: a `CUcontext` is an opaque driver handle; the driver API allows any thread to make a
// context current and use it, and we never dereference the pointer.
unsafe impl Send for Ctx {}
// SAFETY: as above; sharing the handle value between threads has no effect by itself.
unsafe impl Sync for Ctx {}

/// Keeps the device's context current for one call; puts back a foreign context on drop.
/// Not `Send`: it belongs to the thread that made it.
struct Bound {
    restore: Option<sys::CUcontext>,
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Some(prev) = self.restore {
            // SAFETY: `prev` was current on this thread a moment ago, so it is a live
            // context handle; failure only leaves our context current, which is harmless.
            let _ = unsafe { sys::cuCtxSetCurrent(prev) };
        }
    }
}

/// The calling thread in the relaxed stream-capture mode, with the primary context bound
/// ([`CudaDevice::bind_relaxed`]); the thread's previous mode comes back on drop, then its
/// previous context.
struct Relaxed {
    previous: sys::CUstreamCaptureMode,
    _bound: Bound,
}

impl Drop for Relaxed {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // SAFETY: `mode` is a valid in/out pointer; restoring can only fail if the driver is
        // gone, and then there is no mode to restore.
        let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
}

/// One CUDA device, driven through its primary context. See the [module docs](self).
pub struct CudaDevice {
    ordinal: usize,
    device: sys::CUdevice,
    ctx: Ctx,
    /// Peers opened for pool and mapped-memory access and peer copies, by ordinal.
    peers: Mutex<BTreeMap<usize, Arc<CudaDevice>>>,
    /// This device's mappings and the peers granted access to them.
    vmm: Mutex<Vmm>,
    /// Whether [`VirtualMemory::map`] creates memory that can be exported to another process
    /// (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`): until the device refuses it.
    exportable: AtomicBool,
    /// The page-locked host allocations of [`HostMemory::host_alloc`] not yet freed: address ->
    /// size. The copies to and from them ([`HostMemory::copy_to_pinned`]) are checked against it.
    pinned: Mutex<BTreeMap<HostPtr, usize>>,
    /// Pool allocations exported to other processes and pools imported from them.
    pool_ipc: Mutex<PoolIpc>,
}

/// What a [`CudaDevice`] knows of pool IPC ([`Ipc::export_pool_pointer`],
/// [`Ipc::import_pool_pointer`]).
#[derive(Default)]
struct PoolIpc {
    /// Each exportable pool's descriptor (`cuMemPoolExportToShareableHandle`), exported once
    /// and closed when the pool is destroyed.
    pool_fds: HashMap<Pool, OwnedFd>,
    /// Exported allocations: their pool, a copy of the pool's descriptor noted in the export
    /// registry (closed when the allocation is freed) and its serial.
    exports: HashMap<DevicePtr, (Pool, OwnedFd, u64)>,
    /// Pools imported from other processes, by the file their descriptor names (device and
    /// inode): imported once, kept for the process's life.
    imported: HashMap<(u64, u64), Pool>,
}

impl PoolIpc {
    /// Closes the export of `ptr`, if any, forgotten by the registry first.
    fn forget(&mut self, ptr: DevicePtr) {
        if let Some((_, fd, _)) = self.exports.remove(&ptr) {
            super::ipc::forget_export(fd.as_raw_fd());
        }
    }
}

/// What a [`CudaDevice`] knows of its mappings, for [`VirtualMemory::grant_mapped_access`] and
/// [`Ipc::export_mapped`].
#[derive(Default)]
struct Vmm {
    /// Start of every granule mapped by [`VirtualMemory::map`], [`VirtualMemory::map_alias`] or
    /// [`Ipc::map_shared`], and the number of the physical allocation behind it.
    granules: BTreeMap<u64, u64>,
    /// The physical allocations behind `granules`, by number.
    physical: HashMap<u64, Physical>,
    /// The number of the last physical allocation mapped.
    last_physical: u64,
    /// Other devices granted access to every mapping: ordinal and device handle.
    peers: Vec<(usize, sys::CUdevice)>,
}

/// What [`CudaDevice::map_granules`] gets each granule from: given the mappings and the
/// granule's offset, the handle of its allocation and, when this device maps that allocation
/// already, its number.
type GranuleHandle<'a> = dyn Fn(&Vmm, usize) -> Result<(sys::CUmemGenericAllocationHandle, Option<u64>)> + 'a;

/// A physical allocation this device maps (one granule).
struct Physical {
    /// Granules that map it here.
    mappings: u32,
    /// Its descriptor for other processes and the export's serial, once exported; closed
    /// with its last mapping here (an open descriptor would keep the memory alive).
    export: Option<(OwnedFd, u64)>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("ctx", &format_args!("{:#x}", handle(self.ctx.0)))
            .finish()
    }
}

impl CudaDevice {
    /// Opens device `ordinal`: loads and initialises the driver if needed and retains the
    /// device's primary context (released on drop). [`Error::NoDriver`] where there is no
    /// usable driver, [`Error::InvalidArgument`] for an ordinal the driver does not show.
    pub fn new(ordinal: usize) -> Result<Arc<CudaDevice>> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::InvalidArgument(format!(
                "CUDA device {ordinal} does not exist ({count} visible)"
            )));
        }
        let idx = c_int::try_from(ordinal)
            .map_err(|_| Error::InvalidArgument(format!("CUDA device ordinal {ordinal}")))?;
        let mut device: sys::CUdevice = 0;
        // SAFETY: the driver is initialised (`device_count` succeeded), `idx` is in range and
        // `device` is a valid out-pointer.
        check(unsafe { sys::cuDeviceGet(&mut device, idx) }, "cuDeviceGet")?;
        let mut ctx: sys::CUcontext = ptr::null_mut();
        // SAFETY: `device` is a valid device handle and `ctx` a valid out-pointer; the retain
        // is balanced by the release in `Drop`.
        check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device) }, "cuDevicePrimaryCtxRetain")?;
        Ok(Arc::new(CudaDevice {
            ordinal,
            device,
            ctx: Ctx(ctx),
            peers: Mutex::new(BTreeMap::new()),
            vmm: Mutex::new(Vmm::default()),
            exportable: AtomicBool::new(true),
            pinned: Mutex::new(BTreeMap::new()),
            pool_ipc: Mutex::new(PoolIpc::default()),
        }))
    }

    /// Makes the primary context current on this thread for the duration of the returned
    /// guard (see the [module docs](self)).
    fn bind(&self) -> Result<Bound> {
        let mut cur: sys::CUcontext = ptr::null_mut();
        // SAFETY: the driver is initialised (a `CudaDevice` exists) and `cur` is a valid
        // out-pointer.
        check(unsafe { sys::cuCtxGetCurrent(&mut cur) }, "cuCtxGetCurrent")?;
        if cur == self.ctx.0 {
            return Ok(Bound { restore: None });
        }
        // SAFETY: `self.ctx` is a primary context retained by `self`, hence alive.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx.0) }, "cuCtxSetCurrent")?;
        Ok(Bound { restore: (!cur.is_null()).then_some(cur) })
    }

    /// Makes `call`, a driver call on the explicit stream `s`, unbound where `s` is an
    /// ordinary stream (see the [module docs](self)); a call that fails unbound, other than
    /// for want of memory, is made again bound, so that a driver wanting a context gets one.
    /// The legacy and per-thread default streams stand for the current context's, so calls on
    /// them bind first.
    fn on_stream(&self, s: Stream, call: impl Fn() -> sys::CUresult) -> Result<sys::CUresult> {
        // CU_STREAM_LEGACY and CU_STREAM_PER_THREAD are the handles 0x1 and 0x2.
        if s.0 > 2 {
            match call() {
                sys::CUresult::CUDA_SUCCESS => return Ok(sys::CUresult::CUDA_SUCCESS),
                oom @ sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => return Ok(oom),
                _ => {}
            }
        }
        let _ctx = self.bind()?;
        Ok(call())
    }

    /// Binds the primary context and puts the calling thread in the relaxed stream-capture
    /// mode until the guard drops, for calls the driver calls "potentially unsafe" during a
    /// capture (`cuMemAlloc`, `cuMemFree`, `cuMemGetInfo`, the virtual-memory calls). In the
    /// default (global) mode they fail, and invalidate the capture, while any thread captures
    /// a graph; in relaxed mode they run, as PyTorch's caching allocator runs its `cudaMalloc`
    /// in a capture. None of them touches a captured stream, and memory a capture uses is
    /// never freed while it can be replayed (see `facade::private_pools`).
    fn bind_relaxed(&self) -> Result<Relaxed> {
        let bound = self.bind()?;
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid in/out pointer for the call.
        check(
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) },
            "cuThreadExchangeStreamCaptureMode",
        )?;
        Ok(Relaxed { previous: mode, _bound: bound })
    }

    /// `Err(Unsupported)` when `s` is capturing: `what` cannot be captured.
    fn refuse_capture(&self, s: Stream, what: &str) -> Result<()> {
        if self.capture_status(s)? == CaptureStatus::None {
            Ok(())
        } else {
            Err(Error::Unsupported(format!("{what} on stream {:#x} while it is capturing a graph", s.0)))
        }
    }

    /// Checks that `[ptr, ptr + len)` lies in one live page-locked allocation of this device
    /// (what `call`, a copy to or from it, is given).
    fn check_pinned(&self, ptr: HostPtr, len: usize, call: &str) -> Result<()> {
        let pinned = self.pinned.lock();
        let inside = pinned.range(..=ptr).next_back().is_some_and(|(&start, &size)| {
            ptr.checked_add(len as u64).is_some_and(|end| end <= start + size as u64)
        });
        if inside {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "{call} of {len} bytes at host address {ptr:#x}: not page-locked host memory that device {} \
             allocated (Device::host_alloc)",
            self.ordinal
        )))
    }

    /// The mapping granularity, checked to divide `size` (see [`whole_granules`]).
    fn granularity_of(&self, size: usize, call: &str) -> Result<usize> {
        let granularity = self.map_granularity()?;
        whole_granules(size, granularity, call)?;
        Ok(granularity)
    }

    /// Maps `[addr, addr + size)` granule by granule, each with the allocation handle that
    /// `handle(vmm, offset)` creates, retains or imports (one allocation of exactly
    /// `granularity` bytes), released once mapped, and grants this device and the peers of
    /// `vmm` read-write access to it. `handle` also gives the number of the physical
    /// allocation when it is one this device maps already (`None`: a new one). A failure
    /// unmaps the granules mapped so far (unused yet) and maps nothing. The caller has bound
    /// the context.
    fn map_granules(
        &self,
        addr: DevicePtr,
        size: usize,
        granularity: usize,
        handle: &GranuleHandle<'_>,
    ) -> Result<()> {
        let mut vmm = self.vmm.lock();
        let read_write = |device| sys::CUmemAccessDesc {
            location: device_location(device),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let access: Vec<sys::CUmemAccessDesc> =
            std::iter::once(self.device).chain(vmm.peers.iter().map(|&(_, d)| d)).map(read_write).collect();
        let mut done = 0;
        let result = (|| {
            while done < size {
                let at = addr + done as u64;
                let (h, known) = handle(&vmm, done)?;
                // SAFETY: `h` is an allocation of exactly the mapped size, created or retained
                // by `handle`; the driver validates that the range is reserved and unmapped.
                let mapped = check(unsafe { sys::cuMemMap(at, granularity, 0, h, 0) }, "cuMemMap");
                // SAFETY: `h` is ours (created or retained above, released once here); once
                // mapped, the mapping keeps the memory alive, and if the map failed this frees
                // a created allocation or drops the retained reference.
                let released = check(unsafe { sys::cuMemRelease(h) }, "cuMemRelease");
                mapped?;
                let id = known.unwrap_or_else(|| {
                    vmm.last_physical += 1;
                    vmm.last_physical
                });
                vmm.granules.insert(at, id);
                vmm.physical.entry(id).or_insert(Physical { mappings: 0, export: None }).mappings += 1;
                done += granularity;
                released?;
            }
            // One call for the whole range of whole mappings rather than one per granule, as
            // PyTorch's expandable segments do.
            // SAFETY: `access` holds `access.len()` fully initialised descriptors and
            // outlives the call; `[addr, addr + size)` is mapped, granule by granule.
            check(unsafe { sys::cuMemSetAccess(addr, size, access.as_ptr(), access.len()) }, "cuMemSetAccess")
        })();
        if result.is_err() && done > 0 {
            // A failed map maps nothing; the granules mapped so far are unused.
            let _ = self.unmap_granules(&mut vmm, addr, done, granularity);
        }
        result
    }

    /// Unmaps `[addr, addr + size)` granule by granule (see [`VirtualMemory::unmap`]). The caller
    /// has bound the context and holds `vmm`'s lock.
    fn unmap_granules(&self, vmm: &mut Vmm, addr: DevicePtr, size: usize, granularity: usize) -> Result<()> {
        for at in (addr..addr + size as u64).step_by(granularity) {
            // SAFETY: each granule is one whole mapping of `map` or `map_alias`; the caller
            // guarantees that no work uses the range any more (the driver frees the granule's
            // memory only with its last mapping).
            check(unsafe { sys::cuMemUnmap(at, granularity) }, "cuMemUnmap")?;
            let Some(id) = vmm.granules.remove(&at) else { continue };
            if let Some(p) = vmm.physical.get_mut(&id) {
                p.mappings -= 1;
                if p.mappings == 0 {
                    // Its descriptor, if exported, closes: this was its last mapping here. The
                    // registry forgets it first, so no handle names the number once reused.
                    if let Some((fd, _)) = vmm.physical.remove(&id).and_then(|p| p.export) {
                        super::ipc::forget_export(fd.as_raw_fd());
                    }
                }
            }
        }
        Ok(())
    }

    /// The device handle and primary context of ordinal `peer`: this device's own, or those of
    /// the peer opened at its first use (see the [module docs](self)).
    fn peer(&self, peer: usize) -> Result<(sys::CUdevice, Ctx)> {
        if peer == self.ordinal {
            return Ok((self.device, self.ctx));
        }
        let mut peers = self.peers.lock();
        if let Some(d) = peers.get(&peer) {
            return Ok((d.device, d.ctx));
        }
        let d = CudaDevice::new(peer)?;
        let found = (d.device, d.ctx);
        peers.insert(peer, d);
        Ok(found)
    }

    /// The out-of-memory error for a request of `size` bytes, with the device's figures.
    fn oom(&self, size: usize) -> Error {
        let info = self.mem_info().unwrap_or_default();
        Error::oom(OutOfMemory {
            device: self.ordinal,
            requested: size,
            device_free: info.free,
            device_total: info.total,
            ..OutOfMemory::default()
        })
    }

    /// `cuGraphInstantiateWithFlags` with `flags`.
    fn instantiate(&self, graph: Graph, flags: u64) -> Result<GraphExec> {
        let _ctx = self.bind()?;
        let mut x: sys::CUgraphExec = ptr::null_mut();
        // SAFETY: a context is current, the driver validates the graph handle and the flags,
        // and `x` is a valid out-pointer.
        check(
            unsafe { sys::cuGraphInstantiateWithFlags(&mut x, graph.0 as usize as sys::CUgraph, flags) },
            "cuGraphInstantiateWithFlags",
        )?;
        Ok(GraphExec(handle(x)))
    }

    // Sharing mapped memory with another process.

    /// Creates one physical allocation of `size` bytes for [`VirtualMemory::map`], exportable to
    /// another process (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`) until the device refuses
    /// that handle type; then, and from then on, without one (that memory cannot be shared).
    /// The caller has bound the context.
    fn create_granule(&self, size: usize) -> Result<sys::CUmemGenericAllocationHandle> {
        use sys::CUmemAllocationHandleType as Handles;
        let create = |handles| {
            let prop = allocation_prop(self.device, handles);
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: `prop` is fully initialised and `handle` a valid out-pointer, both alive
            // across the call.
            check(unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) }, "cuMemCreate").map(|()| handle)
        };
        if !self.exportable.load(Ordering::Relaxed) {
            return create(Handles::CU_MEM_HANDLE_TYPE_NONE);
        }
        match create(Handles::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
            Err(Error::Driver { code, .. }) if refuses_handle_type(code) => {
                // Refused for the handle type only if it succeeds without.
                let handle = create(Handles::CU_MEM_HANDLE_TYPE_NONE)?;
                self.exportable.store(false, Ordering::Relaxed);
                Ok(handle)
            }
            created => created,
        }
    }

    /// A new descriptor for the allocation mapped at granule `at`
    /// (`cuMemExportToShareableHandle`). The caller has bound the context.
    fn export_granule(&self, at: DevicePtr) -> Result<OwnedFd> {
        let handle = retain(at)?;
        let mut fd: c_int = -1;
        // SAFETY: for a POSIX file descriptor the driver writes an `int`, which `fd` is, alive
        // across the call; `handle` was retained above.
        let exported = check(
            unsafe {
                sys::cuMemExportToShareableHandle(
                    (&mut fd as *mut c_int).cast(),
                    handle,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            },
            "cuMemExportToShareableHandle",
        );
        // SAFETY: releases the reference retained above; the mapping keeps the memory.
        let released = check(unsafe { sys::cuMemRelease(handle) }, "cuMemRelease");
        match exported {
            Ok(()) => {
                // SAFETY: the driver made a new descriptor for the export, owned by nobody else.
                let fd = unsafe { OwnedFd::from_raw_fd(fd) };
                released.map(|()| fd)
            }
            Err(e) if !self.exportable.load(Ordering::Relaxed) => Err(Error::Unsupported(format!(
                "device {} refused exportable memory (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) at \
                 cuMemCreate, so its mapped memory cannot be shared with another process ({e}); memory of \
                 cuMemAlloc chunks (backing=chunks) can",
                self.ordinal
            ))),
            Err(e) => Err(e),
        }
    }
}

/// Whether `cuMemCreate`'s error `code` may be its refusal of a requested handle type.
fn refuses_handle_type(code: i32) -> bool {
    use sys::CUresult as R;
    [R::CUDA_ERROR_NOT_SUPPORTED, R::CUDA_ERROR_INVALID_VALUE, R::CUDA_ERROR_NOT_PERMITTED]
        .iter()
        .any(|&r| r as i32 == code)
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `new`. The symbol was checked at load time, so this
        // cannot panic; an error (e.g. the driver already shut down at process exit) is
        // ignored because there is nothing left to release.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

/// The memory location of device handle `device`.
fn device_location(device: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device }
}

/// The handle of the allocation mapped at `at` (`cuMemRetainAllocationHandle`), which the
/// caller releases. The caller has bound the context.
fn retain(at: DevicePtr) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `handle` is a valid out-pointer alive across the call; the driver validates that
    // `at` is mapped (and fails otherwise).
    check(
        unsafe { sys::cuMemRetainAllocationHandle(&mut handle, at as usize as *mut c_void) },
        "cuMemRetainAllocationHandle",
    )?;
    Ok(handle)
}

/// Checks that `size`, the size `call` (`map`, `map_alias` or `unmap`) was given, is whole
/// granules of `granularity`.
fn whole_granules(size: usize, granularity: usize, call: &str) -> Result<()> {
    if granularity == 0 || size % granularity != 0 {
        return Err(Error::InvalidArgument(format!("{call} of {size} bytes: not granules of {granularity}")));
    }
    Ok(())
}

/// Properties of the physical memory [`VirtualMemory::map`] creates: pinned memory of `device`,
/// exportable as `handles` says.
fn allocation_prop(
    device: sys::CUdevice,
    handles: sys::CUmemAllocationHandleType,
) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: handles,
        location: device_location(device),
        win32HandleMetaData: ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// Maps an attribute to the driver's, and whether its value is a `cuuint64_t` (else `int`).
fn pool_attr_raw(attr: PoolAttr) -> (sys::CUmemPool_attribute, bool) {
    use sys::CUmemPool_attribute as A;
    match attr {
        PoolAttr::ReleaseThreshold => (A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, true),
        PoolAttr::ReuseFollowEventDependencies => (A::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES, false),
        PoolAttr::ReuseAllowOpportunistic => (A::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC, false),
        PoolAttr::ReuseAllowInternalDependencies => {
            (A::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, false)
        }
        PoolAttr::ReservedMemCurrent => (A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, true),
        PoolAttr::ReservedMemHigh => (A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, true),
        PoolAttr::UsedMemCurrent => (A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT, true),
        PoolAttr::UsedMemHigh => (A::CU_MEMPOOL_ATTR_USED_MEM_HIGH, true),
    }
}

impl DeviceMemory for CudaDevice {
    fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn mem_info(&self) -> Result<MemInfo> {
        let _ctx = self.bind_relaxed()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: a context is current and both out-pointers are valid.
        check(unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }, "cuMemGetInfo")?;
        Ok(MemInfo { free, total })
    }

    fn alloc(&self, size: usize) -> Result<DevicePtr> {
        let _ctx = self.bind_relaxed()?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: a context is current and `p` is a valid out-pointer.
        match unsafe { sys::cuMemAlloc_v2(&mut p, size) } {
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(self.oom(size)),
            res => check(res, "cuMemAlloc").map(|()| p),
        }
    }

    fn free(&self, ptr: DevicePtr) -> Result<()> {
        let _ctx = self.bind_relaxed()?;
        // SAFETY: a context is current; the driver validates `ptr` and rejects anything it did
        // not hand out, and the caller owns the memory it frees.
        check(unsafe { sys::cuMemFree_v2(ptr) }, "cuMemFree")
    }

    fn address_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
        let _ctx = self.bind()?;
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: a context is current and both out-pointers are valid; the driver validates
        // `ptr`.
        check(unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }, "cuMemGetAddressRange")?;
        Ok((base, size))
    }
}

impl HostMemory for CudaDevice {
    /// In the relaxed capture mode, as `cuMemAlloc`: a pinned pool may grow while another
    /// thread captures a graph.
    fn host_alloc(&self, size: usize) -> Result<HostPtr> {
        let _ctx = self.bind_relaxed()?;
        let mut p: *mut c_void = ptr::null_mut();
        // SAFETY: a context is current, `p` is a valid out-pointer and the flag is one the
        // driver defines.
        match unsafe { sys::cuMemHostAlloc(&mut p, size, sys::CU_MEMHOSTALLOC_PORTABLE) } {
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(Error::oom(OutOfMemory {
                device: self.ordinal,
                host: true,
                requested: size,
                hint: "the host could not page-lock that much memory (host memory, or the locked-memory \
                       limit, ulimit -l)"
                    .into(),
                ..OutOfMemory::default()
            })),
            res => check(res, "cuMemHostAlloc").map(|()| {
                self.pinned.lock().insert(handle(p), size);
                handle(p)
            }),
        }
    }

    fn host_free(&self, p: HostPtr) -> Result<()> {
        let _ctx = self.bind_relaxed()?;
        // SAFETY: a context is current; the driver refuses a pointer that cuMemHostAlloc did
        // not hand out, and the caller owns the memory it frees.
        check(unsafe { sys::cuMemFreeHost(p as usize as *mut c_void) }, "cuMemFreeHost")?;
        self.pinned.lock().remove(&p);
        Ok(())
    }

    fn copy_to_pinned(&self, dst: HostPtr, src: DevicePtr, len: usize, s: Stream) -> Result<()> {
        self.check_pinned(dst, len, "copy_to_pinned")?;
        if len == 0 {
            return Ok(());
        }
        self.refuse_capture(s, "copy_to_pinned")?;
        let _ctx = self.bind()?;
        // SAFETY: `[dst, dst + len)` lies in a live page-locked allocation of this device
        // (checked above), which the caller keeps allocated and leaves alone until the copy has
        // completed (the trait's contract); the stream does not capture (checked above), so the
        // copy runs once, in its order; the driver checks that the source is device memory.
        check(
            unsafe { sys::cuMemcpyDtoHAsync_v2(dst as usize as *mut c_void, src, len, stream(s)) },
            "cuMemcpyDtoHAsync",
        )
    }

    fn copy_from_pinned(&self, dst: DevicePtr, src: HostPtr, len: usize, s: Stream) -> Result<()> {
        self.check_pinned(src, len, "copy_from_pinned")?;
        if len == 0 {
            return Ok(());
        }
        self.refuse_capture(s, "copy_from_pinned")?;
        let _ctx = self.bind()?;
        // SAFETY: `[src, src + len)` lies in a live page-locked allocation of this device
        // (checked above), which the caller keeps allocated and unwritten until the copy has
        // completed; the stream does not capture (checked above); the driver checks that the
        // destination is device memory.
        check(
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as usize as *const c_void, len, stream(s)) },
            "cuMemcpyHtoDAsync",
        )
    }
}

impl DriverPools for CudaDevice {
    fn default_pool(&self) -> Result<Pool> {
        let _ctx = self.bind()?;
        let mut p: sys::CUmemoryPool = ptr::null_mut();
        // SAFETY: `self.device` is a valid device and `p` a valid out-pointer.
        check(unsafe { sys::cuDeviceGetDefaultMemPool(&mut p, self.device) }, "cuDeviceGetDefaultMemPool")?;
        Ok(Pool(handle(p)))
    }

    fn create_pool(&self, props: PoolProps) -> Result<Pool> {
        let _ctx = self.bind()?;
        let raw = sys::CUmemPoolProps {
            allocType: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: if props.exportable {
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            } else {
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
            },
            location: device_location(self.device),
            win32SecurityAttributes: ptr::null_mut(),
            maxSize: props.max_size,
            usage: 0,
            reserved: [0; 54],
        };
        let mut p: sys::CUmemoryPool = ptr::null_mut();
        // SAFETY: `raw` is a fully initialised props struct (reserved bytes zero, as the
        // driver requires) that outlives the call; `p` is a valid out-pointer.
        check(unsafe { sys::cuMemPoolCreate(&mut p, &raw) }, "cuMemPoolCreate")?;
        Ok(Pool(handle(p)))
    }

    fn destroy_pool(&self, p: Pool) -> Result<()> {
        let _ctx = self.bind()?;
        {
            let mut ipc = self.pool_ipc.lock();
            let gone: Vec<DevicePtr> = ipc.exports.iter().filter(|e| e.1 .0 == p).map(|e| *e.0).collect();
            gone.into_iter().for_each(|ptr| ipc.forget(ptr));
            ipc.pool_fds.remove(&p);
        }
        // SAFETY: the driver validates the pool handle; destroying a pool with live
        // allocations is defined (they are freed when released).
        check(unsafe { sys::cuMemPoolDestroy(pool(p)) }, "cuMemPoolDestroy")
    }

    fn pool_attr(&self, p: Pool, attr: PoolAttr) -> Result<u64> {
        let _ctx = self.bind()?;
        let (a, wide) = pool_attr_raw(attr);
        if wide {
            let mut v: u64 = 0;
            // SAFETY: `a` is an attribute whose value is a `cuuint64_t`, and `v` is one.
            check(
                unsafe { sys::cuMemPoolGetAttribute(pool(p), a, (&mut v as *mut u64).cast()) },
                "cuMemPoolGetAttribute",
            )?;
            Ok(v)
        } else {
            let mut v: c_int = 0;
            // SAFETY: `a` is an attribute whose value is an `int`, and `v` is one.
            check(
                unsafe { sys::cuMemPoolGetAttribute(pool(p), a, (&mut v as *mut c_int).cast()) },
                "cuMemPoolGetAttribute",
            )?;
            Ok(u64::from(v != 0))
        }
    }

    fn set_pool_attr(&self, p: Pool, attr: PoolAttr, value: u64) -> Result<()> {
        let _ctx = self.bind()?;
        let (a, wide) = pool_attr_raw(attr);
        if wide {
            let mut v: u64 = value;
            // SAFETY: `a` takes a `cuuint64_t`, which `v` is; the driver only reads it.
            check(
                unsafe { sys::cuMemPoolSetAttribute(pool(p), a, (&mut v as *mut u64).cast()) },
                "cuMemPoolSetAttribute",
            )
        } else {
            let mut v: c_int = c_int::from(value != 0);
            // SAFETY: `a` takes an `int`, which `v` is; the driver only reads it.
            check(
                unsafe { sys::cuMemPoolSetAttribute(pool(p), a, (&mut v as *mut c_int).cast()) },
                "cuMemPoolSetAttribute",
            )
        }
    }

    fn set_pool_access(&self, p: Pool, peer: usize, enabled: bool) -> Result<()> {
        let (device, _) = self.peer(peer)?;
        let _ctx = self.bind()?;
        let flags = if enabled {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        } else {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE
        };
        let desc = sys::CUmemAccessDesc { location: device_location(device), flags };
        // SAFETY: `desc` is one fully initialised descriptor that outlives the call, as the
        // count of 1 says; the driver validates the pool handle and the device.
        check(unsafe { sys::cuMemPoolSetAccess(pool(p), &desc, 1) }, "cuMemPoolSetAccess")
    }

    fn trim_pool(&self, p: Pool, keep: usize) -> Result<()> {
        let _ctx = self.bind()?;
        // SAFETY: the driver validates the pool handle; trimming only releases unused memory.
        check(unsafe { sys::cuMemPoolTrimTo(pool(p), keep) }, "cuMemPoolTrimTo")
    }

    fn alloc_async(&self, size: usize, p: Pool, s: Stream) -> Result<DevicePtr> {
        let mut d: sys::CUdeviceptr = 0;
        let d_ptr: *mut sys::CUdeviceptr = &mut d;
        // SAFETY: `d_ptr` points to `d`, alive across the call; the driver validates the pool
        // and stream handles (and reports a missing context, see `on_stream`).
        let res =
            self.on_stream(s, || unsafe { sys::cuMemAllocFromPoolAsync(d_ptr, size, pool(p), stream(s)) })?;
        match res {
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(self.oom(size)),
            res => check(res, "cuMemAllocFromPoolAsync").map(|()| d),
        }
    }

    fn free_async(&self, ptr: DevicePtr, s: Stream) -> Result<()> {
        self.pool_ipc.lock().forget(ptr);
        // SAFETY: the driver validates `ptr` and the stream (and reports a missing context,
        // see `on_stream`); the caller owns the memory it frees.
        check(self.on_stream(s, || unsafe { sys::cuMemFreeAsync(ptr, stream(s)) })?, "cuMemFreeAsync")
    }
}

impl VirtualMemory for CudaDevice {
    fn supports_virtual_memory(&self) -> Result<bool> {
        let mut supported: c_int = 0;
        let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
        // SAFETY: the driver is initialised (a `CudaDevice` exists), `self.device` is a device
        // handle it gave, and `supported` is a valid out-pointer for the duration of the call.
        check(
            unsafe { sys::cuDeviceGetAttribute(&mut supported, attr, self.device) },
            "cuDeviceGetAttribute",
        )?;
        Ok(supported != 0)
    }

    fn map_granularity(&self) -> Result<usize> {
        let _ctx = self.bind()?;
        let prop = allocation_prop(self.device, sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE);
        let mut granularity = 0usize;
        let option = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: `prop` is fully initialised and `granularity` a valid out-pointer, both alive
        // across the call.
        check(
            unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, &prop, option) },
            "cuMemGetAllocationGranularity",
        )?;
        Ok(granularity)
    }

    fn reserve_address(&self, size: usize) -> Result<DevicePtr> {
        let _ctx = self.bind_relaxed()?;
        let mut addr: sys::CUdeviceptr = 0;
        // SAFETY: `addr` is a valid out-pointer; no fixed address or alignment is asked for.
        check(unsafe { sys::cuMemAddressReserve(&mut addr, size, 0, 0, 0) }, "cuMemAddressReserve")?;
        Ok(addr)
    }

    fn free_address(&self, addr: DevicePtr, size: usize) -> Result<()> {
        let _ctx = self.bind_relaxed()?;
        // SAFETY: the driver validates that the range is a reservation; the caller has
        // unmapped it.
        check(unsafe { sys::cuMemAddressFree(addr, size) }, "cuMemAddressFree")
    }

    /// Maps one physical allocation per granule, so that [`VirtualMemory::unmap`] can take back any
    /// granule-aligned part (the driver unmaps whole mappings only) and
    /// [`VirtualMemory::map_alias`] can map any granule again. Each allocation's handle is released
    /// once mapped: unmapping its last mapping then frees the memory.
    fn map(&self, addr: DevicePtr, size: usize) -> Result<()> {
        let _ctx = self.bind_relaxed()?;
        let granularity = self.granularity_of(size, "map")?;
        // Memory is created granule by granule: a size the device cannot hold would take all
        // of its free memory, from every other pool and process, before failing (DESIGN.md,
        // Note [requests beyond the device]), from MAP_CHECKED on.
        if size >= MAP_CHECKED && size > self.mem_info()?.free {
            return Err(self.oom(size));
        }
        self.map_granules(addr, size, granularity, &|_, _| Ok((self.create_granule(granularity)?, None)))
            .map_err(|e| match e {
                Error::Driver { code, .. } if code == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY as i32 => {
                    self.oom(size)
                }
                e => e,
            })
    }

    /// Retains the handle of each granule's allocation in the ranges of `from` (one per
    /// granule, see `map`) and maps them in order from `to`; each handle is released once
    /// mapped, so the memory lives as long as one of its mappings does.
    fn map_alias(&self, from: &[(DevicePtr, usize)], to: DevicePtr) -> Result<()> {
        let _ctx = self.bind_relaxed()?;
        let granularity = self.map_granularity()?;
        // The source of each granule of the target, in order.
        let mut sources = Vec::new();
        for &(addr, len) in from {
            whole_granules(len, granularity, "map_alias")?;
            sources.extend((addr..addr + len as u64).step_by(granularity));
        }
        if sources.is_empty() {
            return Err(Error::InvalidArgument("map_alias of nothing".into()));
        }
        let size = sources.len() * granularity;
        self.map_granules(to, size, granularity, &|vmm, offset| {
            let Some(&src) = sources.get(offset / granularity) else {
                return Err(Error::Internal(format!("map_alias: no source for offset {offset}")));
            };
            // The same physical allocation as the source's.
            Ok((retain(src)?, vmm.granules.get(&src).copied()))
        })
    }

    /// Records the peer, under the lock every mapping takes, and grants it access to each
    /// granule mapped so far; later mappings grant it with this device.
    fn grant_mapped_access(&self, peer: usize) -> Result<()> {
        if peer == self.ordinal {
            return Ok(());
        }
        let (device, _) = self.peer(peer)?;
        let _ctx = self.bind_relaxed()?;
        let granularity = self.map_granularity()?;
        let mut vmm = self.vmm.lock();
        if vmm.peers.iter().any(|&(p, _)| p == peer) {
            return Ok(());
        }
        let access = sys::CUmemAccessDesc {
            location: device_location(device),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        for &at in vmm.granules.keys() {
            // SAFETY: `access` is one fully initialised descriptor, as the count of 1 says;
            // `[at, at + granularity)` is one mapping of this device (the lock keeps it mapped).
            check(unsafe { sys::cuMemSetAccess(at, granularity, &access, 1) }, "cuMemSetAccess")?;
        }
        vmm.peers.push((peer, device));
        Ok(())
    }

    fn unmap(&self, addr: DevicePtr, size: usize) -> Result<()> {
        let _ctx = self.bind_relaxed()?;
        let granularity = self.granularity_of(size, "unmap")?;
        self.unmap_granules(&mut self.vmm.lock(), addr, size, granularity)
    }
}

impl Ipc for CudaDevice {
    fn export_mapped(&self, addr: DevicePtr, size: usize) -> Result<Vec<SharedPiece>> {
        let _ctx = self.bind_relaxed()?;
        let granularity = self.granularity_of(size, "export_mapped")?;
        if size == 0 || addr % granularity as u64 != 0 {
            return Err(Error::InvalidArgument(format!(
                "export_mapped of {addr:#x}+{size}: not a range of whole granules"
            )));
        }
        let mut guard = self.vmm.lock();
        let vmm = &mut *guard;
        let mut pieces = Vec::with_capacity(size / granularity);
        for at in (addr..addr + size as u64).step_by(granularity) {
            let physical =
                vmm.granules.get(&at).and_then(|id| vmm.physical.get_mut(id)).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "{at:#x} is not memory device {} maps (unmapped, or not mapped memory)",
                        self.ordinal
                    ))
                })?;
            let (fd, serial) = match &physical.export {
                Some((fd, serial)) => (fd.as_raw_fd(), *serial),
                None => {
                    let fd = self.export_granule(at)?;
                    let raw = fd.as_raw_fd();
                    let serial = super::ipc::note_export(raw, granularity as u64)?;
                    physical.export = Some((fd, serial));
                    (raw, serial)
                }
            };
            pieces.push(SharedPiece { fd, serial, offset: 0, len: granularity as u64 });
        }
        Ok(pieces)
    }

    fn exports_any(&self, addr: DevicePtr, size: usize) -> Result<bool> {
        let vmm = self.vmm.lock();
        let end = addr.saturating_add(size as u64);
        Ok(vmm
            .granules
            .range(addr..end)
            .any(|(_, id)| vmm.physical.get(id).is_some_and(|p| p.export.is_some())))
    }

    fn export_pool_pointer(&self, ptr: DevicePtr, len: usize) -> Result<PoolPointer> {
        let _ctx = self.bind_relaxed()?;
        let mut p: sys::CUmemoryPool = ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer of the attribute's type (a pool handle); the driver
        // validates `ptr`.
        check(
            unsafe {
                sys::cuPointerGetAttribute(
                    (&mut p as *mut sys::CUmemoryPool).cast(),
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
                    ptr,
                )
            },
            "cuPointerGetAttribute(MEMPOOL_HANDLE)",
        )
        .map_err(|e| Error::InvalidArgument(format!("{ptr:#x} is no pool allocation ({e})")))?;
        let pool_handle = Pool(handle(p));
        let mut guard = self.pool_ipc.lock();
        let ipc = &mut *guard;
        // The pool is shared before its pointers: the driver exports a pointer only "from an
        // already shared memory pool" (CUDA_ERROR_INVALID_VALUE before).
        let pool_fd = match ipc.pool_fds.entry(pool_handle) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let mut fd: c_int = -1;
                // SAFETY: for a POSIX file descriptor the driver writes an `int`, which `fd`
                // is, alive across the call.
                check(
                    unsafe {
                        sys::cuMemPoolExportToShareableHandle(
                            (&mut fd as *mut c_int).cast(),
                            p,
                            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                            0,
                        )
                    },
                    "cuMemPoolExportToShareableHandle",
                )?;
                // SAFETY: the driver made a new descriptor for the export, owned by nobody else.
                e.insert(unsafe { OwnedFd::from_raw_fd(fd) })
            }
        };
        let mut data = sys::CUmemPoolPtrExportData { reserved: [0; POOL_POINTER_DATA] };
        // SAFETY: `data` is a valid out-struct; the driver validates `ptr` (a live pool
        // allocation of an exportable pool, else an error).
        check(unsafe { sys::cuMemPoolExportPointer(&mut data, ptr) }, "cuMemPoolExportPointer")
            .map_err(|e| Error::InvalidArgument(format!("{ptr:#x}: memory of no exportable pool ({e})")))?;
        if let Some((_, fd, serial)) = ipc.exports.get(&ptr) {
            return Ok(PoolPointer { fd: fd.as_raw_fd(), serial: *serial, data: data.reserved });
        }
        let copy =
            pool_fd.try_clone().map_err(|e| Error::Io(format!("a copy of the pool's descriptor: {e}")))?;
        let raw = copy.as_raw_fd();
        let serial = super::ipc::note_export(raw, len as u64)?;
        ipc.exports.insert(ptr, (pool_handle, copy, serial));
        Ok(PoolPointer { fd: raw, serial, data: data.reserved })
    }

    fn import_pool_pointer(&self, fd: BorrowedFd<'_>, data: &[u8; POOL_POINTER_DATA]) -> Result<DevicePtr> {
        let _ctx = self.bind()?;
        let meta = fd
            .try_clone_to_owned()
            .and_then(|own| std::fs::File::from(own).metadata())
            .map_err(|e| Error::InvalidArgument(format!("descriptor {}: {e}", fd.as_raw_fd())))?;
        let file = (std::os::unix::fs::MetadataExt::dev(&meta), std::os::unix::fs::MetadataExt::ino(&meta));
        let mut ipc = self.pool_ipc.lock();
        let imported = match ipc.imported.get(&file) {
            Some(&p) => p,
            None => {
                let mut p: sys::CUmemoryPool = ptr::null_mut();
                // SAFETY: for a POSIX file descriptor the driver takes the descriptor's value as
                // the handle and only reads the file it names, which `fd` keeps open across the
                // call; `p` is a valid out-pointer.
                check(
                    unsafe {
                        sys::cuMemPoolImportFromShareableHandle(
                            &mut p,
                            fd.as_raw_fd() as usize as *mut c_void,
                            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                            0,
                        )
                    },
                    "cuMemPoolImportFromShareableHandle",
                )?;
                ipc.imported.insert(file, Pool(handle(p)));
                Pool(handle(p))
            }
        };
        let mut raw = sys::CUmemPoolPtrExportData { reserved: *data };
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: `raw` and `d` are valid for the call; the driver validates the imported pool
        // and the export data.
        check(
            unsafe { sys::cuMemPoolImportPointer(&mut d, pool(imported), &mut raw) },
            "cuMemPoolImportPointer",
        )?;
        Ok(d)
    }

    fn free_imported(&self, ptr: DevicePtr) -> Result<()> {
        let _ctx = self.bind()?;
        // SAFETY: the caller frees a pointer it imported and no longer uses; cuMemFree waits
        // for the device's work on it.
        check(unsafe { sys::cuMemFree_v2(ptr) }, "cuMemFree")
    }

    /// Imports the allocation (`cuMemImportFromShareableHandle`, which leaves `fd` open) and
    /// maps it as [`VirtualMemory::map`] maps its own.
    fn map_shared(&self, addr: DevicePtr, fd: BorrowedFd<'_>, offset: usize, len: usize) -> Result<()> {
        let _ctx = self.bind_relaxed()?;
        let granularity = self.map_granularity()?;
        if offset != 0 || len != granularity {
            return Err(Error::InvalidArgument(format!(
                "map_shared of {len} bytes from offset {offset}: an allocation is mapped whole, one granule \
                 of {granularity} bytes from offset 0"
            )));
        }
        self.map_granules(addr, len, granularity, &|_, _| {
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: for a POSIX file descriptor the driver takes the descriptor's value as the
            // handle pointer and only reads the file it names, which `fd` keeps open across the
            // call; `handle` is a valid out-pointer.
            check(
                unsafe {
                    sys::cuMemImportFromShareableHandle(
                        &mut handle,
                        fd.as_raw_fd() as usize as *mut c_void,
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    )
                },
                "cuMemImportFromShareableHandle",
            )?;
            Ok((handle, None))
        })
    }
}

impl Streams for CudaDevice {
    fn create_stream(&self) -> Result<Stream> {
        let _ctx = self.bind()?;
        let mut s: sys::CUstream = ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: a context is current and `s` is a valid out-pointer.
        check(unsafe { sys::cuStreamCreate(&mut s, flags) }, "cuStreamCreate")?;
        Ok(Stream(handle(s)))
    }

    fn destroy_stream(&self, s: Stream) -> Result<()> {
        let _ctx = self.bind()?;
        // SAFETY: the driver validates the handle; pending work still completes.
        check(unsafe { sys::cuStreamDestroy_v2(stream(s)) }, "cuStreamDestroy")
    }

    fn synchronize_stream(&self, s: Stream) -> Result<()> {
        let _ctx = self.bind()?;
        // SAFETY: a context is current and the driver validates the handle.
        check(unsafe { sys::cuStreamSynchronize(stream(s)) }, "cuStreamSynchronize")
    }

    fn synchronize(&self) -> Result<()> {
        let _ctx = self.bind()?;
        // SAFETY: the device's primary context is current; the call takes no arguments.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }

    fn stream_wait_event(&self, s: Stream, e: Event) -> Result<()> {
        let _ctx = self.bind()?;
        // SAFETY: a context is current and the driver validates both handles.
        check(unsafe { sys::cuStreamWaitEvent(stream(s), event(e), 0) }, "cuStreamWaitEvent")
    }

    fn capture_status(&self, s: Stream) -> Result<CaptureStatus> {
        let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let st_ptr: *mut sys::CUstreamCaptureStatus = &mut st;
        // SAFETY: `st_ptr` points to `st`, alive across the call; the driver validates the
        // stream (and reports a missing context, see `on_stream`).
        let res = self.on_stream(s, || unsafe { sys::cuStreamIsCapturing(stream(s), st_ptr) })?;
        check(res, "cuStreamIsCapturing")?;
        Ok(match st {
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => CaptureStatus::None,
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => CaptureStatus::Active,
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => CaptureStatus::Invalidated,
        })
    }

    fn check_stream(&self, s: Stream) -> Result<()> {
        let not_live = |e: Error| {
            Error::InvalidArgument(format!("stream {:#x} is not a live stream of this device: {e}", s.0))
        };
        // A capturing stream is live; cuStreamIsCapturing is allowed on it, while
        // cuStreamGetFlags fails there (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) and invalidates
        // the capture: PyTorch calls record_stream on the side streams of torch.cuda.graph.
        // See Note [record_stream on a capturing stream] in DESIGN.md.
        if self.capture_status(s).map_err(not_live)? != CaptureStatus::None {
            return Ok(());
        }
        let mut flags: std::ffi::c_uint = 0;
        let flags_ptr: *mut std::ffi::c_uint = &mut flags;
        // SAFETY: `flags_ptr` points to `flags`, alive across the call; the caller passes a
        // stream that was not destroyed (see Device::check_stream), and the driver refuses
        // one of another context.
        let res = self.on_stream(s, || unsafe { sys::cuStreamGetFlags(stream(s), flags_ptr) })?;
        check(res, "cuStreamGetFlags").map_err(not_live)
    }
}

impl Events for CudaDevice {
    fn create_event(&self) -> Result<Event> {
        let _ctx = self.bind()?;
        let mut e: sys::CUevent = ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: a context is current and `e` is a valid out-pointer.
        check(unsafe { sys::cuEventCreate(&mut e, flags) }, "cuEventCreate")?;
        Ok(Event(handle(e)))
    }

    fn destroy_event(&self, e: Event) -> Result<()> {
        let _ctx = self.bind()?;
        // SAFETY: the driver validates the handle; a pending recording still completes.
        check(unsafe { sys::cuEventDestroy_v2(event(e)) }, "cuEventDestroy")
    }

    fn record_event(&self, e: Event, s: Stream) -> Result<()> {
        let _ctx = self.bind()?;
        // SAFETY: a context is current and the driver validates both handles.
        check(unsafe { sys::cuEventRecord(event(e), stream(s)) }, "cuEventRecord")
    }

    fn query_event(&self, e: Event) -> Result<bool> {
        let _ctx = self.bind()?;
        // SAFETY: a context is current and the driver validates the handle.
        match unsafe { sys::cuEventQuery(event(e)) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            res => check(res, "cuEventQuery").map(|()| false),
        }
    }

    fn synchronize_event(&self, e: Event) -> Result<()> {
        let _ctx = self.bind()?;
        // SAFETY: a context is current and the driver validates the handle.
        check(unsafe { sys::cuEventSynchronize(event(e)) }, "cuEventSynchronize")
    }
}

impl Graphs for CudaDevice {
    fn begin_capture(&self, s: Stream) -> Result<()> {
        let _ctx = self.bind()?;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: a context is current and the driver validates the stream (capturing the
        // legacy default stream is rejected with an error).
        check(unsafe { sys::cuStreamBeginCapture_v2(stream(s), mode) }, "cuStreamBeginCapture")
    }

    fn end_capture(&self, s: Stream) -> Result<Graph> {
        let _ctx = self.bind()?;
        let mut g: sys::CUgraph = ptr::null_mut();
        // SAFETY: a context is current, the driver validates the stream and `g` is a valid
        // out-pointer.
        check(unsafe { sys::cuStreamEndCapture(stream(s), &mut g) }, "cuStreamEndCapture")?;
        Ok(Graph(handle(g)))
    }

    fn launch_graph(&self, exec: GraphExec, s: Stream) -> Result<()> {
        let _ctx = self.bind()?;
        // SAFETY: a context is current and the driver validates both handles.
        check(unsafe { sys::cuGraphLaunch(exec.0 as usize as sys::CUgraphExec, stream(s)) }, "cuGraphLaunch")
    }

    fn destroy_graph_exec(&self, exec: GraphExec) -> Result<()> {
        let _ctx = self.bind()?;
        // SAFETY: the driver validates the handle.
        check(unsafe { sys::cuGraphExecDestroy(exec.0 as usize as sys::CUgraphExec) }, "cuGraphExecDestroy")
    }

    fn destroy_graph(&self, graph: Graph) -> Result<()> {
        let _ctx = self.bind()?;
        // SAFETY: the driver validates the handle.
        check(unsafe { sys::cuGraphDestroy(graph.0 as usize as sys::CUgraph) }, "cuGraphDestroy")
    }

    fn instantiate_graph_auto_free(&self, graph: Graph) -> Result<GraphExec> {
        let auto_free = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
        self.instantiate(graph, u64::from(auto_free.0))
    }
}

/// What only tests and measurement programs call ([`DeviceTestExt`]), with the host-function
/// registry that exists for [`DeviceTestExt::launch_host_func`].
#[cfg(feature = "test-util")]
mod test_util {
    use std::panic::AssertUnwindSafe;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::super::{no_mapped_access, no_peer_access, DeviceTestExt, HostFn};
    use super::*;

    /// Closures enqueued by [`DeviceTestExt::launch_host_func`] that have not run yet, by id. The
    /// driver gets the id, not a pointer: a host function captured into a graph may run several
    /// times or never, and the registry makes both safe (the closure runs at most once; one that
    /// never runs stays here).
    static HOST_FNS: Mutex<BTreeMap<u64, HostFn>> = Mutex::new(BTreeMap::new());
    static NEXT_HOST_FN: AtomicU64 = AtomicU64::new(1);

    /// The `CUhostFn` every host function goes through: takes its closure out of [`HOST_FNS`] and
    /// runs it. A panic in the closure is caught: nothing may unwind into the driver.
    extern "C" fn run_host_fn(data: *mut c_void) {
        let id = data as usize as u64;
        let f = HOST_FNS.lock().remove(&id);
        if let Some(f) = f {
            let _ = catch_unwind(AssertUnwindSafe(f));
        }
    }

    impl CudaDevice {
        /// The stream-ordered pool `ptr` was allocated from, if any.
        fn pool_of(&self, ptr: DevicePtr) -> Result<Option<Pool>> {
            let _ctx = self.bind()?;
            let mut p: sys::CUmemoryPool = ptr::null_mut();
            let attr = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE;
            // SAFETY: a context is current; this attribute's value is a `CUmemoryPool`, which `p`
            // is, and the driver writes null for memory that is not from a pool.
            check(
                unsafe { sys::cuPointerGetAttribute((&mut p as *mut sys::CUmemoryPool).cast(), attr, ptr) },
                "cuPointerGetAttribute",
            )?;
            Ok((!p.is_null()).then(|| Pool(handle(p))))
        }
    }

    impl DeviceTestExt for CudaDevice {
        fn pool_access(&self, p: Pool, peer: usize) -> Result<bool> {
            let (device, _) = self.peer(peer)?;
            let _ctx = self.bind()?;
            let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
            let mut location = device_location(device);
            // SAFETY: both pointers are valid for the call; the driver only writes one of the
            // access flags (none, read, read-write), all of which the enum has, into `flags`.
            check(
                unsafe { sys::cuMemPoolGetAccess(&mut flags, pool(p), &mut location) },
                "cuMemPoolGetAccess",
            )?;
            Ok(flags == sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        }

        /// Enqueues `f` on `s`. If `s` is capturing, `f` is captured into the graph and runs at
        /// the graph's first launch only; if that graph never runs, `f` is never dropped.
        fn launch_host_func(&self, s: Stream, f: HostFn) -> Result<()> {
            let _ctx = self.bind()?;
            let id = NEXT_HOST_FN.fetch_add(1, Ordering::Relaxed);
            HOST_FNS.lock().insert(id, f);
            // SAFETY: `run_host_fn` is an `extern "C"` function that never unwinds and treats its
            // argument as an integer id (it never dereferences it), so any number of calls, or
            // none, is sound.
            let res =
                unsafe { sys::cuLaunchHostFunc(stream(s), Some(run_host_fn), id as usize as *mut c_void) };
            if res != sys::CUresult::CUDA_SUCCESS {
                HOST_FNS.lock().remove(&id);
            }
            check(res, "cuLaunchHostFunc")
        }

        fn memset_async(&self, ptr: DevicePtr, value: u8, len: usize, s: Stream) -> Result<()> {
            if len == 0 {
                return Ok(());
            }
            let _ctx = self.bind()?;
            // SAFETY: a context is current; the driver checks that `ptr..ptr + len` is device
            // memory and the caller owns it.
            check(unsafe { sys::cuMemsetD8Async(ptr, value, len, stream(s)) }, "cuMemsetD8Async")
        }

        /// Checks first that a pool allocation's pool grants `dst_device` access, so that a copy
        /// without access fails at once with [`Error::InvalidArgument`] naming the pool, instead
        /// of however the driver would treat it (possibly a fault that ruins the context).
        fn copy_peer(
            &self,
            dst: DevicePtr,
            dst_device: usize,
            src: DevicePtr,
            len: usize,
            s: Stream,
        ) -> Result<()> {
            if len == 0 {
                return Ok(());
            }
            let (_, dst_ctx) = self.peer(dst_device)?;
            if dst_device != self.ordinal {
                if let Some(p) = self.pool_of(src)? {
                    if !self.pool_access(p, dst_device)? {
                        return Err(no_peer_access(src, self.ordinal, dst_device, p));
                    }
                }
                let vmm = self.vmm.lock();
                let granule = vmm.granules.range(..=src).next_back().map(|(&g, _)| g);
                let mapped = match granule {
                    Some(g) => src < g + self.map_granularity()? as u64,
                    None => false,
                };
                if mapped && !vmm.peers.iter().any(|&(p, _)| p == dst_device) {
                    return Err(no_mapped_access(src, self.ordinal, dst_device));
                }
            }
            let _ctx = self.bind()?;
            // SAFETY: a context is current; both contexts are primary contexts retained by `self`
            // (its own, or a kept peer's), so they outlive the asynchronous copy; the driver checks
            // that both ranges are device memory of those contexts, and the caller owns them.
            check(
                unsafe { sys::cuMemcpyPeerAsync(dst, dst_ctx.0, src, self.ctx.0, len, stream(s)) },
                "cuMemcpyPeerAsync",
            )
        }

        fn copy_to_host(&self, dst: &mut [u8], src: DevicePtr, s: Stream) -> Result<()> {
            if dst.is_empty() {
                return Ok(());
            }
            // A captured copy would write into `dst` whenever the graph runs, long after this
            // borrow ends.
            self.refuse_capture(s, "copy_to_host")?;
            let _ctx = self.bind()?;
            // SAFETY: `dst` is valid for `dst.len()` bytes of writes and stays borrowed until the
            // stream is synchronized below, so the copy finishes before the borrow ends; the
            // stream is not capturing (checked above), so the copy is not deferred into a graph.
            check(
                unsafe { sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src, dst.len(), stream(s)) },
                "cuMemcpyDtoHAsync",
            )?;
            // SAFETY: a context is current and the driver validates the handle.
            check(unsafe { sys::cuStreamSynchronize(stream(s)) }, "cuStreamSynchronize")
        }

        fn copy_from_host(&self, dst: DevicePtr, src: &[u8], s: Stream) -> Result<()> {
            if src.is_empty() {
                return Ok(());
            }
            self.refuse_capture(s, "copy_from_host")?;
            let _ctx = self.bind()?;
            // SAFETY: `src` is valid for `src.len()` bytes of reads and stays borrowed until the
            // stream is synchronized below; the stream is not capturing (checked above).
            check(
                unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), stream(s)) },
                "cuMemcpyHtoDAsync",
            )?;
            // SAFETY: a context is current and the driver validates the handle.
            check(unsafe { sys::cuStreamSynchronize(stream(s)) }, "cuStreamSynchronize")
        }

        fn instantiate_graph(&self, graph: Graph) -> Result<GraphExec> {
            self.instantiate(graph, 0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        match CudaDevice::new(0) {
            Ok(dev) => assert!(cuda_available() && dev.ordinal() == 0),
            Err(Error::NoDriver(msg)) => {
                assert!(!cuda_available());
                assert!(!msg.is_empty());
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
    }

    #[test]
    fn symbol_list_covers_every_call() {
        let src = include_str!("cuda.rs");
        // The names the list holds only with the test-util feature, and where the code that
        // exists only with it starts.
        let lines: Vec<&str> = src.lines().collect();
        let gated: Vec<&str> = lines
            .windows(2)
            .filter(|w| w[0].trim() == "#[cfg(feature = \"test-util\")]")
            .filter_map(|w| w[1].trim().strip_prefix('"')?.strip_suffix("\","))
            .collect();
        let test_util_at = src.find("\nmod test_util {").expect("the test-util module");
        let mut rest = src;
        while let Some(i) = rest.find("sys::cu") {
            let tail = &rest[i + 5..];
            let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
            let name = &tail[..end];
            if tail[end..].starts_with('(') && name != "culib" {
                assert!(SYMBOLS.contains(&name), "{name} missing from SYMBOLS");
                let at = src.len() - tail.len();
                assert!(
                    at > test_util_at || !gated.contains(&name),
                    "{name} is called without the test-util feature but listed only with it"
                );
            }
            rest = &tail[end..];
        }
    }
}
