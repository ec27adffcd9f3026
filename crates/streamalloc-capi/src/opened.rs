//! The ranges of other processes' memory that `streamalloc_ipc_open` mapped in this process
//! (C ABI state, kept by [`State`](crate::state::State); `ipc.rs` maps and unmaps them).

use std::collections::HashMap;

use core_alloc::DevicePtr;
use parking_lot::Mutex;

/// Ranges [`streamalloc_ipc_open`](crate::streamalloc_ipc_open) mapped in this process and not
/// yet closed: base -> device ordinal and bytes.
#[derive(Default)]
pub(crate) struct Opened(pub(crate) Mutex<HashMap<DevicePtr, (usize, usize)>>);
