//! Sharing mapped memory with another process (IPC): [`streamalloc_ipc_export`] in the process
//! that allocated it, [`streamalloc_ipc_open`] and [`streamalloc_ipc_close`] in the one that
//! receives it, as PyTorch's expandable segments share theirs.
//!
//! Memory of `backing=stitched` (the default) or `backing=segments` pools is mapped into
//! address reservations from physical allocations of one granule each. The exporter hands out
//! a handle: a byte string naming its process, the device, and for each physical allocation
//! under the granules that hold the allocation, the number of a file descriptor, open in the
//! exporter, that stands for it (the device keeps it open while it maps the memory). The
//! receiver copies those descriptors into itself (`pidfd_getfd`), imports and maps them into
//! a reservation of its own, and closes the copies: its mappings keep the memory alive until
//! it closes the range, whatever the exporter frees or releases meanwhile. Memory of
//! `cuMemAlloc` chunks (`backing=chunks`, CUDA graphs' pools) is shared through CUDA IPC
//! handles (`cudaIpcGetMemHandle`) instead; memory of the driver's pool (`strategy=async`) is
//! not shared.
//!
//! The handle, little-endian: the version ([`STREAMALLOC_IPC_VERSION`]), the kind
//! ([`STREAMALLOC_IPC_KIND`], apart from PyTorch's own `'c'` and `'e'`), the exporter's process
//! id (u32), the device ordinal (u32), the number of pieces (u32), then per piece the
//! descriptor's number in the exporter (i32), the export's serial (u64: a descriptor number
//! reused by a later export gives another handle), the piece's offset in its allocation and
//! its length (u64 each). The receiver maps the pieces side by side, in order.

use std::os::fd::AsFd;
use std::os::raw::c_void;
use std::ptr;

use core_alloc::allocators::backing::share_mapped;
use core_alloc::device::ipc::{fetch_fds, SharedPiece};
use core_alloc::{DevicePtr, Error, Result};

use crate::state::{ordinal, State};
use crate::status::{self, StreamallocStatus};

/// The first byte of a handle of [`streamalloc_ipc_export`]: the version of its layout.
pub const STREAMALLOC_IPC_VERSION: u8 = 1;

/// The second byte of a handle of [`streamalloc_ipc_export`] (`'s'`): streamalloc's mapped
/// memory, told apart from PyTorch's kinds (`'c'`, a CUDA IPC handle; `'e'`, an expandable
/// segment of PyTorch's own allocator).
pub const STREAMALLOC_IPC_KIND: u8 = b's';

/// Bytes of a handle before its pieces.
const HEADER: usize = 14;
/// Bytes of a handle per piece.
const PIECE: usize = 28;

/// What a handle says.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Handle {
    pid: u32,
    device: u32,
    pieces: Vec<SharedPiece>,
}

impl Handle {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + PIECE * self.pieces.len());
        out.extend([STREAMALLOC_IPC_VERSION, STREAMALLOC_IPC_KIND]);
        out.extend(self.pid.to_le_bytes());
        out.extend(self.device.to_le_bytes());
        out.extend((self.pieces.len() as u32).to_le_bytes());
        for p in &self.pieces {
            out.extend(p.fd.to_le_bytes());
            out.extend(p.serial.to_le_bytes());
            out.extend(p.offset.to_le_bytes());
            out.extend(p.len.to_le_bytes());
        }
        out
    }

    fn decode(bytes: &[u8]) -> Result<Handle> {
        let bad = |why: String| Error::InvalidArgument(format!("not a streamalloc IPC handle: {why}"));
        let (version, kind) = match bytes {
            [version, kind, ..] if bytes.len() >= HEADER => (*version, *kind),
            _ => return Err(bad(format!("{} bytes", bytes.len()))),
        };
        if kind != STREAMALLOC_IPC_KIND {
            return Err(bad(format!("its kind is {:?}, not 's'", char::from(kind))));
        }
        if version != STREAMALLOC_IPC_VERSION {
            return Err(bad(format!(
                "version {version}, this library reads version {STREAMALLOC_IPC_VERSION} (the processes run \
                 different versions of streamalloc)"
            )));
        }
        let u32_at = |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
        let u64_at = |at: usize| {
            let mut b = [0; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let count = u32_at(10) as usize;
        if count == 0 || bytes.len() != HEADER + PIECE * count {
            return Err(bad(format!("{} bytes for {count} pieces", bytes.len())));
        }
        let pieces = (0..count)
            .map(|i| HEADER + PIECE * i)
            .map(|at| SharedPiece {
                fd: u32_at(at) as i32,
                serial: u64_at(at + 4),
                offset: u64_at(at + 12),
                len: u64_at(at + 20),
            })
            .collect();
        Ok(Handle { pid: u32_at(2), device: u32_at(6), pieces })
    }
}

/// The handle of the allocation at `[ptr, ptr + size)`, and the allocation's offset in the
/// range the handle maps.
pub(crate) fn export(state: &State, ptr: DevicePtr, size: usize) -> Result<(Vec<u8>, usize)> {
    if ptr == 0 || size == 0 {
        return Err(Error::InvalidArgument(format!("no allocation to share at {ptr:#x}+{size}")));
    }
    for stack in state.stacks() {
        match share_mapped(&*stack.device, ptr, size) {
            Ok(range) => {
                let device = stack.device.ordinal() as u32;
                let handle = Handle { pid: std::process::id(), device, pieces: range.pieces };
                return Ok((handle.encode(), (ptr - range.base) as usize));
            }
            // Not memory this device maps: perhaps another's.
            Err(Error::InvalidArgument(_)) => {}
            Err(e) => return Err(e),
        }
    }
    Err(Error::InvalidArgument(if state.config().strategy.spec().driver_pool {
        format!(
            "{ptr:#x} is memory of the driver's pool (strategy=async), which streamalloc cannot share with \
             another process; configure another strategy (stream_safe, the default, shares its mapped \
             memory; backing=chunks shares cuMemAlloc chunks through CUDA IPC handles)"
        )
    } else {
        format!(
            "{ptr:#x}+{size} is not memory streamalloc maps (backing=stitched or segments) on a device in use; \
             memory of cuMemAlloc chunks (backing=chunks, CUDA graphs' pools) is shared through CUDA IPC \
             handles (cudaIpcGetMemHandle) instead"
        )
    }))
}

/// Maps the range `bytes` (a handle of [`export`], possibly of another process) describes; its
/// base.
pub(crate) fn open(state: &State, bytes: &[u8]) -> Result<DevicePtr> {
    let handle = Handle::decode(bytes)?;
    let device = ordinal(i32::try_from(handle.device).unwrap_or(i32::MAX))?;
    let dev = &state.stack(device as i32)?.device;
    let size = handle
        .pieces
        .iter()
        .try_fold(0usize, |sum, p| usize::try_from(p.len).ok().and_then(|len| sum.checked_add(len)))
        .filter(|&size| size > 0)
        .ok_or_else(|| Error::InvalidArgument("a streamalloc IPC handle of no bytes, or too many".into()))?;
    let fds: Vec<i32> = handle.pieces.iter().map(|p| p.fd).collect();
    let copies = fetch_fds(handle.pid, &fds)?;
    let base = dev.reserve_address(size)?;
    let mut mapped = 0usize;
    let result = handle.pieces.iter().zip(&copies).try_for_each(|(p, fd)| {
        let len = p.len as usize;
        let offset = usize::try_from(p.offset)
            .map_err(|_| Error::InvalidArgument(format!("a piece at offset {}", p.offset)))?;
        dev.map_shared(base + mapped as u64, fd.as_fd(), offset, len)?;
        mapped += len;
        Ok(())
    });
    // The copies close here: the mappings hold the memory.
    drop(copies);
    if let Err(e) = result {
        // Nothing used the range yet.
        let unmapped = if mapped > 0 { dev.unmap(base, mapped) } else { Ok(()) };
        if unmapped.is_ok() {
            let _ = dev.free_address(base, size);
        }
        return Err(e);
    }
    state.opened().0.lock().insert(base, (device, size));
    Ok(base)
}

/// Unmaps a range [`open`] mapped, once the device's work is done, and frees its reservation.
pub(crate) fn close(state: &State, base: DevicePtr) -> Result<()> {
    let mut opened = state.opened().0.lock();
    let Some(&(device, size)) = opened.get(&base) else {
        return Err(Error::InvalidArgument(format!(
            "{base:#x} is not a range streamalloc_ipc_open mapped (closed twice, or never opened)"
        )));
    };
    let dev = &state.stack(device as i32)?.device;
    // An unmap does not wait for the work that uses the range, as cudaIpcCloseMemHandle does:
    // the device's work is waited for, at most `wait_timeout` (a synchronize on a thread of
    // its own, which a hung kernel leaves behind; the range stays open for a later close).
    let timeout = state.config().wait_timeout;
    let (done, finished) = std::sync::mpsc::channel();
    let waiter = dev.clone();
    std::thread::Builder::new()
        .name("streamalloc-ipc-close".into())
        .spawn(move || {
            let _ = done.send(waiter.synchronize());
        })
        .map_err(|e| Error::Internal(format!("starting the thread that waits for the device: {e}")))?;
    finished.recv_timeout(timeout).map_err(|_| Error::Timeout {
        waited_for: format!("the device's work before unmapping the IPC range at {base:#x} (it stays open)"),
        after: timeout,
    })??;
    dev.unmap(base, size)?;
    opened.remove(&base);
    drop(opened);
    dev.free_address(base, size)
}

/// Exports the allocation at `ptr` of `size` bytes (a live allocation of this library, as
/// large as it was asked for) for another process, when its memory is mapped
/// (`backing=stitched`, the default, or `backing=segments`). Writes the handle to `buf` and its
/// length to `*written`, and the allocation's offset in the range the handle maps to `*offset`
/// (the receiver adds it to the base that [`streamalloc_ipc_open`] gives). With `buf` NULL, or
/// `len` too small, writes only the length needed (the latter is
/// `STREAMALLOC_INVALID_ARGUMENT`). The handle names this process, the device and the file
/// descriptors, open in this process while it maps the memory, that stand for the memory's
/// physical allocations; the granules holding the allocation may hold others, which the
/// receiver sees too. The memory must stay allocated until the receiver has opened it (once
/// opened, the receiver's mapping keeps it). Memory that is not mapped is
/// `STREAMALLOC_INVALID_ARGUMENT` (`cuMemAlloc` chunks are shared with `cudaIpcGetMemHandle`;
/// the driver's pool, `strategy=async`, not at all); a device that refused to create
/// exportable memory is `STREAMALLOC_UNSUPPORTED`.
///
/// # Safety
/// `buf` is NULL or valid for writing `len` bytes; `written` and `offset` are NULL (an error)
/// or valid for writing a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_ipc_export(
    ptr: *mut c_void,
    size: usize,
    buf: *mut u8,
    len: usize,
    written: *mut usize,
    offset: *mut usize,
) -> StreamallocStatus {
    status::status(|| {
        // SAFETY: the caller's contract is this function's.
        unsafe { export_to(State::get()?, ptr as DevicePtr, size, buf, len, written, offset) }
    })
}

/// [`streamalloc_ipc_export`] on `state`.
///
/// # Safety
/// As [`streamalloc_ipc_export`]'s.
unsafe fn export_to(
    state: &State,
    ptr: DevicePtr,
    size: usize,
    buf: *mut u8,
    len: usize,
    written: *mut usize,
    offset: *mut usize,
) -> Result<()> {
    if written.is_null() || offset.is_null() {
        return Err(Error::InvalidArgument("written or offset is null".into()));
    }
    let (handle, at) = export(state, ptr, size)?;
    // SAFETY: both non-null and, by the caller's contract, valid for writes.
    unsafe {
        written.write(handle.len());
        offset.write(at);
    }
    if buf.is_null() {
        return Ok(());
    }
    if len < handle.len() {
        return Err(Error::InvalidArgument(format!(
            "a buffer of {len} bytes for a handle of {}",
            handle.len()
        )));
    }
    // SAFETY: `buf` is valid for `len >= handle.len()` bytes of writes by the caller's contract,
    // and cannot overlap `handle`, which this call made.
    unsafe { ptr::copy_nonoverlapping(handle.as_ptr(), buf, handle.len()) };
    Ok(())
}

/// Maps, in this process, the memory of a handle of [`streamalloc_ipc_export`] (made by
/// another process, or this one) into a range of its own, readable and writable by the
/// handle's device, and writes the range's base to `*ptr` (the exporter's allocation is at the
/// base plus the offset the export gave). The file descriptors are copied from the exporting
/// process (`pidfd_getfd`, Linux 5.6 or later), which needs permission to ptrace it: refused
/// (EPERM, e.g. a child under `kernel.yama.ptrace_scope` = 1), the call is
/// `STREAMALLOC_UNSUPPORTED` with that cause. The range keeps the memory alive until
/// [`streamalloc_ipc_close`], whatever the exporter does meanwhile. Each call maps the memory
/// anew (a receiver keeps one range per handle if it wants one).
///
/// # Safety
/// `handle` is valid for reading `len` bytes (NULL is an error); `ptr` is NULL (an error) or
/// valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_ipc_open(
    handle: *const u8,
    len: usize,
    ptr: *mut *mut c_void,
) -> StreamallocStatus {
    status::status(|| {
        if handle.is_null() || ptr.is_null() {
            return Err(Error::InvalidArgument("handle or ptr is null".into()));
        }
        // SAFETY: non-null and valid for `len` bytes of reads by the caller's contract.
        let bytes = unsafe { std::slice::from_raw_parts(handle, len) };
        let base = open(State::get()?, bytes)?;
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe { ptr.write(base as *mut c_void) };
        Ok(())
    })
}

/// Unmaps a range that [`streamalloc_ipc_open`] mapped (its base), once the device's work that
/// may use it is done (the device is synchronized, waiting at most `wait_timeout`: past it,
/// `STREAMALLOC_TIMEOUT` and the range stays mapped), and frees its address range; the memory
/// goes back to its device when no process maps it any more. A pointer that is no such range
/// (closed twice) is `STREAMALLOC_INVALID_ARGUMENT` and changes nothing.
#[no_mangle]
pub extern "C" fn streamalloc_ipc_close(ptr: *mut c_void) -> StreamallocStatus {
    status::status(|| close(State::get()?, ptr as DevicePtr))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use core_alloc::facade::Config;

    use super::*;

    fn sim(strategy: &str) -> State {
        State::new(Config::parse(&format!("device=sim,sim_capacity=4GiB,{strategy}")).unwrap())
    }

    fn used(state: &State) -> usize {
        state.stack(0).unwrap().device.mem_info().unwrap().used()
    }

    #[test]
    fn handles_round_trip_and_bad_ones_are_refused() {
        let piece = |fd, serial| SharedPiece { fd, serial, offset: 0, len: 2 << 20 };
        let handle = Handle { pid: 4242, device: 3, pieces: vec![piece(7, 1), piece(9, 2)] };
        let bytes = handle.encode();
        assert_eq!(bytes.len(), HEADER + 2 * PIECE);
        assert_eq!(&bytes[..2], &[STREAMALLOC_IPC_VERSION, b's']);
        assert_eq!(Handle::decode(&bytes).unwrap(), handle);
        for (bad, why) in [
            (&bytes[..HEADER + PIECE], "bytes for 2 pieces"),
            (&bytes[..1], "1 bytes"),
            (&[2, b'c', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0][..], "kind is 'c'"),
            (&[2, b's', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0][..], "version 2"),
            (&[1, b's', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0][..], "for 0 pieces"),
        ] {
            let e = Handle::decode(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
    }

    /// Export, open (in this same process: its own descriptors copied with `pidfd_getfd`) and
    /// close; the exporter frees and releases its memory while the range is open: the memory
    /// stays until the range is closed, and a second close is an error, not a second unmap.
    #[test]
    fn the_receivers_range_keeps_the_memory_until_closed() {
        let state = sim("strategy=stream_safe");
        let before = used(&state);
        let p = state.allocate(5 << 20, 0, 0).unwrap();
        let (bytes, offset) = export(&state, p, 5 << 20).unwrap();
        assert!(offset < 2 << 20);
        assert_eq!(bytes[1], STREAMALLOC_IPC_KIND);
        let shared: u64 = Handle::decode(&bytes).unwrap().pieces.iter().map(|p| p.len).sum();
        let held = used(&state);
        let base = open(&state, &bytes).unwrap();
        assert_ne!(base, p - offset as u64, "a range of its own");
        assert_eq!(used(&state), held, "the same memory");
        state.free(p, Some(0), 0).unwrap();
        assert!(state.release(0).unwrap() > 0);
        assert_eq!(used(&state), before + shared as usize, "still mapped by the receiver: not freed");
        let sim = state.stack(0).unwrap().sim.clone().unwrap();
        assert_eq!(sim.exported(), 0, "the exporter's descriptors closed with its mappings");
        close(&state, base).unwrap();
        assert_eq!(used(&state), before, "the receiver's close gave it back");
        let e = close(&state, base).unwrap_err();
        assert!(e.to_string().contains("closed twice"), "{e}");
        assert_eq!(used(&state), before);
        assert!(open(&state, &bytes).is_err(), "the exporter released it before this open");
        assert_eq!(used(&state), before, "a failed open leaves nothing mapped");
    }

    #[test]
    fn the_export_asks_for_a_buffer_large_enough() {
        let state = sim("strategy=stream_safe");
        let p = state.allocate(3 << 20, 0, 0).unwrap();
        let (handle, at) = export(&state, p, 3 << 20).unwrap();
        let (mut written, mut offset) = (0, usize::MAX);
        let mut buf = vec![0u8; handle.len()];
        // SAFETY: valid out-pointers, and a buffer of at least the length given.
        unsafe {
            export_to(&state, p, 3 << 20, ptr::null_mut(), 0, &mut written, &mut offset).unwrap();
            assert_eq!((written, offset), (handle.len(), at), "NULL: the length only");
            let e =
                export_to(&state, p, 3 << 20, buf.as_mut_ptr(), 10, &mut written, &mut offset).unwrap_err();
            assert!(e
                .to_string()
                .contains(&format!("a buffer of 10 bytes for a handle of {}", handle.len())));
            assert!(buf.iter().all(|&b| b == 0), "nothing written to a short buffer");
            export_to(&state, p, 3 << 20, buf.as_mut_ptr(), buf.len(), &mut written, &mut offset).unwrap();
        }
        assert_eq!(buf, handle);
        state.free(p, Some(0), 0).unwrap();
    }

    #[test]
    fn what_cannot_be_shared_says_why() {
        let chunks = sim("strategy=stream_safe,backing=chunks");
        let p = chunks.allocate(1 << 20, 0, 0).unwrap();
        let e = export(&chunks, p, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("cudaIpcGetMemHandle"), "{e}");
        let pool = sim("strategy=async");
        let p = pool.allocate(1 << 20, 0, 0).unwrap();
        let e = export(&pool, p, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("strategy=async"), "{e}");
        assert!(export(&pool, 0, 1 << 20).is_err());
    }
}
