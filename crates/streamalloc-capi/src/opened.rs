//! The ranges of other processes' memory that `streamalloc_ipc_open` mapped in this process
//! (C ABI state, kept by [`State`](crate::state::State); `ipc.rs` maps and unmaps them).

use std::collections::HashMap;

use core_alloc::DevicePtr;
use parking_lot::Mutex;

/// Ranges [`streamalloc_ipc_open`](crate::streamalloc_ipc_open) mapped in this process and not
/// yet closed: base -> device ordinal and bytes; and the pool allocations it imported
/// (memory of another process's driver pool, `strategy=async`): base -> the import.
#[derive(Default)]
pub(crate) struct Opened(
    pub(crate) Mutex<HashMap<DevicePtr, (usize, usize)>>,
    pub(crate) Mutex<HashMap<DevicePtr, PoolImport>>,
);

/// A pool allocation of another process imported by `streamalloc_ipc_open`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PoolImport {
    /// The device ordinal.
    pub(crate) device: usize,
    /// The exporter's process id and the export's serial: one import per export.
    pub(crate) export: (u32, u64),
    /// Opens not yet closed: the import is freed with the last.
    pub(crate) opens: usize,
}
