//! Sharing mapped memory with another process: what [`Device::export_mapped`] hands out, and
//! the copying of its file descriptors into the receiving process ([`fetch_fds`],
//! `pidfd_open` and `pidfd_getfd`, as PyTorch's expandable segments do).
//!
//! The two system calls are this module's only `unsafe` code.
//!
//! [`Device::export_mapped`]: super::Device::export_mapped

use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use crate::error::{Error, Result};

/// One physical allocation under a range of mapped memory, exported for another process
/// ([`Device::export_mapped`](super::Device::export_mapped)).
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
