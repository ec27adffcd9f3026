//! The simulated streams C holds, by handle (`device=sim`): what the library's state keeps
//! for [`crate::sim`]'s functions, in a module of its own so that the state does not depend on
//! the functions that use it.
//!
//! A simulated stream reaches C as a handle drawn at random from the 64-bit space, never as the
//! simulator's own id (see [`crate::sim`]).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher, RandomState};

use core_alloc::{Error, Result, Stream};
use parking_lot::Mutex;

/// The simulated streams C holds: handle -> (device, the simulator's stream).
#[derive(Default)]
pub(crate) struct SimStreams {
    by_handle: Mutex<HashMap<u64, (usize, Stream)>>,
    keys: RandomState,
}

impl SimStreams {
    /// A new handle for `stream` of `device`: random, never 0 and never one in use.
    pub(crate) fn insert(&self, device: usize, stream: Stream) -> u64 {
        let mut table = self.by_handle.lock();
        let mut n = table.len() as u64;
        loop {
            let mut h = self.keys.build_hasher();
            h.write_u64(n);
            h.write_u64(stream.raw());
            // Aligned like a pointer, as a `cudaStream_t` is.
            let handle = h.finish() & !7;
            if handle != 0 && !table.contains_key(&handle) {
                table.insert(handle, (device, stream));
                return handle;
            }
            n += 1;
        }
    }

    /// The device and stream of `handle`; NULL is the legacy default stream of any device.
    pub(crate) fn get(&self, handle: u64) -> Result<(Option<usize>, Stream)> {
        if handle == 0 {
            return Ok((None, Stream::DEFAULT));
        }
        let table = self.by_handle.lock();
        let &(device, stream) = table.get(&handle).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "stream {handle:#x} is not a simulated stream (device=sim takes NULL or a handle from \
                 streamalloc_sim_create_stream)"
            ))
        })?;
        Ok((Some(device), stream))
    }

    /// The handle of `stream` of `device` (0 for the legacy default stream, or a stream that
    /// has none: made by the library itself, or its handle destroyed).
    pub(crate) fn handle_of(&self, device: usize, stream: Stream) -> u64 {
        let table = self.by_handle.lock();
        table.iter().find(|(_, &(d, s))| d == device && s == stream).map_or(0, |(&h, _)| h)
    }

    /// Forgets `handle`; its device and stream, if it was one.
    pub(crate) fn remove(&self, handle: u64) -> Option<(usize, Stream)> {
        self.by_handle.lock().remove(&handle)
    }
}
