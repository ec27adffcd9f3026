//! Sharing mapped memory with another process: what [`Ipc::export_mapped`] hands out, and
//! the copying of its file descriptors into the receiving process ([`fetch_fds`],
//! `pidfd_open` and `pidfd_getfd`, as PyTorch's expandable segments do).
//!
//! Which descriptors this process exported, and with which serial, is kept in the process's
//! export registry ([`note_export`], [`forget_export`]): a memory file (`memfd`) named after
//! the process, whose descriptor a handle names too. A receiver reads it (through
//! `/proc/PID/fd`, which opens the file anew and copies no descriptor) before it copies any
//! descriptor: each piece's descriptor must be one the exporter exported, with the handle's
//! serial and at least the handle's length ([`check_exports`]). See DESIGN.md, Note [IPC
//! trust model].
//!
//! The system calls (`pidfd_open`, `pidfd_getfd`, `memfd_create`) are this module's only
//! `unsafe` code.
//!
//! [`Ipc::export_mapped`]: super::Ipc::export_mapped

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// Bytes of the registry per descriptor number: the serial and the length exported (u64
/// each, little-endian); zeros where the descriptor is no export.
const ENTRY: u64 = 16;

/// The registry of this process (see the [module docs](self)), made at its first export and
/// made anew in a child after `fork` (the parent's is not the child's).
static REGISTRY: Mutex<Option<(u32, File)>> = Mutex::new(None);

/// The last serial handed out, process-wide: serials are never reused, whatever device, and
/// start from the clock's nanoseconds when the registry is made.
static LAST_SERIAL: AtomicU64 = AtomicU64::new(0);

/// The name of the registry of process `pid`, as `/proc/PID/fd/N` shows it.
fn registry_link(pid: u32) -> String {
    format!("/memfd:streamalloc-ipc-{pid} (deleted)")
}

/// Runs `f` on this process's registry, made if missing.
fn with_registry<T>(f: impl FnOnce(&File) -> std::io::Result<T>) -> Result<T> {
    let pid = std::process::id();
    let mut registry = REGISTRY.lock();
    if registry.as_ref().is_none_or(|(owner, _)| *owner != pid) {
        let name = std::ffi::CString::new(format!("streamalloc-ipc-{pid}"))
            .map_err(|e| Error::Internal(format!("the registry's name: {e}")))?;
        // SAFETY: `name` is a NUL-terminated string that outlives the call; the flags are
        // plain bits.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(Error::Io(format!(
                "memfd_create of the IPC export registry: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: the kernel returned a new descriptor that nothing else owns.
        *registry = Some((pid, File::from(unsafe { OwnedFd::from_raw_fd(raw) })));
        // Serials start from the clock: another process that reuses this pid later (or a child
        // of this one after fork) hands out others.
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        LAST_SERIAL.fetch_max(now.as_nanos() as u64, Ordering::Relaxed);
    }
    let (_, file) = registry.as_ref().ok_or_else(|| Error::Internal("no IPC export registry".into()))?;
    f(file).map_err(|e| Error::Io(format!("the IPC export registry: {e}")))
}

/// Notes that descriptor `fd`, open in this process, stands for exported memory of `len`
/// bytes; the export's serial (new, never handed out before in this process).
pub fn note_export(fd: RawFd, len: u64) -> Result<u64> {
    let at = u64::try_from(fd).map_err(|_| Error::InvalidArgument(format!("descriptor {fd}")))? * ENTRY;
    let serial = LAST_SERIAL.fetch_add(1, Ordering::Relaxed) + 1;
    let mut entry = [0u8; ENTRY as usize];
    entry[..8].copy_from_slice(&serial.to_le_bytes());
    entry[8..].copy_from_slice(&len.to_le_bytes());
    with_registry(|file| file.write_all_at(&entry, at))?;
    Ok(serial)
}

/// Notes that descriptor `fd` is no export any more: called before it is closed, so that no
/// handle names its number once the number is reused. Errors only leave an entry that no
/// later export of the number matches (serials are never reused).
pub fn forget_export(fd: RawFd) {
    if let Ok(fd) = u64::try_from(fd) {
        let _ = with_registry(|file| file.write_all_at(&[0; ENTRY as usize], fd * ENTRY));
    }
}

/// The number of the descriptor of this process's registry, for a handle.
pub fn registry_fd() -> Result<RawFd> {
    with_registry(|file| Ok(file.as_raw_fd()))
}

/// Checks, without copying any descriptor of process `pid`, that its descriptor `registry` is
/// its export registry and that each piece's descriptor is an export of it with the piece's
/// serial and at least its offset plus length: the check of a handle before
/// [`fetch_fds`] (whose copies the caller checks again after, see DESIGN.md).
pub fn check_exports(pid: u32, registry: RawFd, pieces: &[SharedPiece]) -> Result<()> {
    let path = format!("/proc/{pid}/fd/{registry}");
    let refused = |why: String| Error::InvalidArgument(format!("IPC handle of process {pid} refused: {why}"));
    if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
        return Err(Error::InvalidArgument(format!(
            "IPC handle of process {pid}: the process has exited (a sender must live until the receiver has \
             opened what it shared; once opened, the receiver's mapping keeps the memory)"
        )));
    }
    let link = std::fs::read_link(&path).map_err(|e| match e.raw_os_error() {
        Some(libc::EACCES) | Some(libc::EPERM) => Error::Unsupported(format!(
            "reading {path} was refused: receiving memory of another process needs permission to ptrace it \
             (see kernel.yama.ptrace_scope)"
        )),
        _ => refused(format!("its descriptor {registry} is no export registry ({e})")),
    })?;
    if link.as_os_str() != registry_link(pid).as_str() {
        return Err(refused(format!(
            "its descriptor {registry} is no streamalloc export registry ({link:?})"
        )));
    }
    let file = File::open(&path).map_err(|e| refused(format!("opening {path}: {e}")))?;
    for p in pieces {
        let at = u64::try_from(p.fd).map_err(|_| refused(format!("descriptor {}", p.fd)))?;
        let mut entry = [0u8; ENTRY as usize];
        let (serial, len) = match file.read_exact_at(&mut entry, at * ENTRY) {
            Ok(()) => {
                let word = |i: usize| u64::from_le_bytes(entry[i..i + 8].try_into().unwrap_or_default());
                (word(0), word(8))
            }
            Err(_) => (0, 0),
        };
        if serial == 0 {
            return Err(refused(format!(
                "its descriptor {} is not exported (released by the exporter, or never an export)",
                p.fd
            )));
        }
        if serial != p.serial {
            return Err(refused(format!(
                "descriptor {} has serial {serial}, the handle says {} (the memory the handle named was \
                 released, and the number reused)",
                p.fd, p.serial
            )));
        }
        if p.offset.checked_add(p.len).is_none_or(|end| end > len) {
            return Err(refused(format!(
                "{} bytes from offset {} of descriptor {}, which stands for {len} bytes",
                p.len, p.offset, p.fd
            )));
        }
    }
    Ok(())
}

/// One physical allocation under a range of mapped memory, exported for another process
/// ([`Ipc::export_mapped`](super::Ipc::export_mapped)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedPiece {
    /// The POSIX file descriptor, open in this process, that stands for the allocation
    /// (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`). The device owns it: it stays open while
    /// this process maps the allocation and is closed with its last mapping here.
    pub fd: RawFd,
    /// The number of the export: no other export of the same device in this process has it,
    /// so a receiver never mistakes a later export that reuses the descriptor's number for
    /// this one.
    pub serial: u64,
    /// Where the range's part starts in the allocation, in bytes.
    pub offset: u64,
    /// Bytes of the range in the allocation.
    pub len: u64,
}

/// Bytes of the driver's data for an exported pool pointer (`CUmemPoolPtrExportData`).
pub const POOL_POINTER_DATA: usize = 64;

/// An allocation of a pool exported for another process
/// ([`Ipc::export_pool_pointer`](super::Ipc::export_pool_pointer)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolPointer {
    /// The POSIX file descriptor, open in this process, that stands for the pool; the device
    /// owns it and closes it when the allocation is freed (the registry forgets it first).
    pub fd: RawFd,
    /// The export's serial in the registry ([`note_export`]).
    pub serial: u64,
    /// The driver's data for the pointer (`cuMemPoolExportPointer`).
    pub data: [u8; POOL_POINTER_DATA],
}

/// Copies the file descriptors `fds` of the process `pid` into this one (`pidfd_open`, then
/// `pidfd_getfd` for each), in order. The kernel allows it where this process may ptrace
/// `pid` (the same user and, under Yama's `kernel.yama.ptrace_scope` = 1, `pid` a descendant
/// of this process, or a process that allowed it): an error says which permission was
/// missing. Linux 5.6 or later.
pub fn fetch_fds(pid: u32, fds: &[RawFd]) -> Result<Vec<OwnedFd>> {
    let target = libc::pid_t::try_from(pid)
        .map_err(|_| Error::InvalidArgument(format!("process id {pid} is out of range")))?;
    // SAFETY: pidfd_open takes a pid and flags by value and touches no memory of ours.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, target, 0) };
    if raw < 0 {
        return Err(syscall_error("pidfd_open", pid, None, std::io::Error::last_os_error()));
    }
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(raw as RawFd) };
    let pidfd_raw = std::os::fd::AsRawFd::as_raw_fd(&pidfd);
    fds.iter()
        .map(|&fd| {
            // SAFETY: pidfd_getfd takes its three arguments by value and touches no memory of
            // ours; `pidfd_raw` stays open (owned by `pidfd`) across the call.
            let raw = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd_raw, fd, 0) };
            if raw < 0 {
                return Err(syscall_error("pidfd_getfd", pid, Some(fd), std::io::Error::last_os_error()));
            }
            // SAFETY: the kernel returned a new descriptor (a copy of the other process's `fd`)
            // that nothing else owns.
            Ok(unsafe { OwnedFd::from_raw_fd(raw as RawFd) })
        })
        .collect()
}

/// The error of a failed `call` (`pidfd_open` or `pidfd_getfd` of `fd`) on process `pid`,
/// saying what the cause is likely to be.
fn syscall_error(call: &str, pid: u32, fd: Option<RawFd>, os: std::io::Error) -> Error {
    let what = match fd {
        Some(fd) => format!("{call} of descriptor {fd} of process {pid}"),
        None => format!("{call} of process {pid}"),
    };
    match os.raw_os_error() {
        Some(libc::ENOSYS) => Error::Unsupported(format!(
            "{what}: the kernel lacks the system call (Linux 5.6 or later is needed to receive shared \
             mapped memory)"
        )),
        Some(libc::EPERM) => Error::Unsupported(format!(
            "{what} was refused (EPERM): copying a descriptor out of another process needs permission to \
             ptrace it. Under Yama (kernel.yama.ptrace_scope = 1) only an ancestor may, so a child cannot \
             take its parent's descriptors: set kernel.yama.ptrace_scope = 0 (sysctl), give the receiving \
             process CAP_SYS_PTRACE, or share memory of cuMemAlloc chunks instead (backing=chunks); a \
             seccomp filter that forbids pidfd_getfd (some containers) refuses it the same way"
        )),
        Some(libc::ESRCH) => Error::InvalidArgument(format!("{what}: the process has exited")),
        Some(libc::EBADF) => Error::InvalidArgument(format!(
            "{what}: the process holds no such descriptor (it released the memory before it was opened)"
        )),
        _ => Error::InvalidArgument(format!("{what}: {os}")),
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn fetches_a_descriptor_of_a_process_as_a_copy_of_the_same_file() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let fetched = fetch_fds(std::process::id(), &[a.as_raw_fd()]).unwrap();
        assert_eq!(fetched.len(), 1);
        assert_ne!(fetched[0].as_raw_fd(), a.as_raw_fd());
        let ino = |fd: &OwnedFd| std::fs::File::from(fd.try_clone().unwrap()).metadata().unwrap().ino();
        assert_eq!(ino(&fetched[0]), ino(&OwnedFd::from(a)));
    }

    /// The registry says which descriptors are exports, with which serial and length, and
    /// forgets one before it closes; the check reads it without copying a descriptor.
    #[test]
    fn the_registry_checks_serials_lengths_and_forgotten_exports() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = a.as_raw_fd();
        let serial = note_export(fd, 4096).unwrap();
        let registry = registry_fd().unwrap();
        let me = std::process::id();
        let piece = |serial, len| SharedPiece { fd, serial, offset: 0, len };
        check_exports(me, registry, &[piece(serial, 4096)]).unwrap();
        let e = check_exports(me, registry, &[piece(serial ^ 1, 4096)]).unwrap_err().to_string();
        assert!(e.contains("serial"), "{e}");
        let e = check_exports(me, registry, &[piece(serial, 8192)]).unwrap_err().to_string();
        assert!(e.contains("stands for 4096 bytes"), "{e}");
        let e = check_exports(me, fd, &[piece(serial, 4096)]).unwrap_err().to_string();
        assert!(e.contains("no streamalloc export registry"), "{e}");
        let e = check_exports(i32::MAX as u32, registry, &[piece(serial, 4096)]).unwrap_err().to_string();
        assert!(e.contains("the process has exited"), "{e}");
        assert!(note_export(fd, 4096).unwrap() > serial, "serials are never reused");
        forget_export(fd);
        let e = check_exports(me, registry, &[piece(serial, 4096)]).unwrap_err().to_string();
        assert!(e.contains("not exported"), "{e}");
    }

    #[test]
    fn errors_name_the_cause() {
        let eperm = syscall_error("pidfd_getfd", 7, Some(3), std::io::Error::from_raw_os_error(libc::EPERM));
        let text = eperm.to_string();
        assert!(matches!(eperm, Error::Unsupported(_)));
        assert!(text.contains("EPERM") && text.contains("kernel.yama.ptrace_scope"), "{text}");
        let gone = syscall_error("pidfd_open", 7, None, std::io::Error::from_raw_os_error(libc::ESRCH));
        assert!(gone.to_string().contains("process 7: the process has exited"), "{gone}");
        // A descriptor the process does not hold (above any limit of open descriptors).
        let e = fetch_fds(std::process::id(), &[RawFd::MAX]).unwrap_err();
        assert!(e.to_string().contains("holds no such descriptor"), "{e}");
    }
}
