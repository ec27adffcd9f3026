//! Expandable segments (PyTorch's `expandable_segments`): one address reservation per size
//! class, mapped from its start as the pool grows.

use std::sync::Arc;

use parking_lot::Mutex;

use super::chunks::restore;
use super::{Backing, Chunks, Taken, Want};
use crate::device::Device;
use crate::error::{try_each, Error, OutOfMemory, Result};
use crate::policy::best_fit::{BestFitPolicy, TakenChunk};
use crate::policy::AddrRange;

/// The backing of expandable segments: each class (small, large) has one segment, a device
/// address reservation mapped from its start as needed ([`VirtualMemory::map`](crate::device::VirtualMemory::map)), grown at a miss by
/// what the request lacks past the segment's free end, rounded up to the mapping
/// granularity. Blocks merge across growths. Requests larger than the pool's growth size
/// ([`Want::own`]) get chunks of their own from a [`Chunks`] backing: in the segment, such a
/// block left a hole when freed that smaller requests split (on the simulator, peak reserved
/// over peak live 1.078 instead of 1.051 on GPT-2 training). A wholly free segment is
/// unmapped at a release, after the release took it out of the pool and waited for the
/// pool's stream (an unmap does not wait for the device as `cuMemFree` does); a growth of its
/// class meanwhile gets a chunk of its own. Its memory is mapped for this device alone.
pub struct Segments {
    device: Arc<dyn Device>,
    chunks: Chunks,
    state: Mutex<State>,
}

/// The address reservations, one per class, each made at the first growth of its class.
#[derive(Default)]
struct State {
    /// The device's mapping granularity (0 until the first growth).
    granularity: u64,
    /// Start of each class's reservation, by [`Class::index`](crate::policy::best_fit::Class::index).
    base: [Option<u64>; 2],
    /// Bytes mapped from each reservation's start: the size of the class's segment in the
    /// policy, 0 while it has none.
    mapped: [u64; 2],
    /// Size of every reservation: the device's memory, rounded up to the granularity.
    reservation: u64,
    /// Whether each class's segment is out of the pool for a release that waits for the
    /// pool's stream before unmapping it.
    releasing: [bool; 2],
}

impl Segments {
    /// Segments on the device of `chunks`; requests larger than the growth size get chunks
    /// from `chunks`.
    pub fn new(chunks: Chunks) -> Self {
        Self { device: chunks.device().clone(), chunks, state: Mutex::new(State::default()) }
    }
}

impl Backing for Segments {
    fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    fn grow(&self, books: &mut BestFitPolicy, want: &Want) -> Result<()> {
        let mut sg = self.state.lock();
        if want.own || sg.releasing[want.class.index()] {
            drop(sg);
            return self.chunks.grow(books, want);
        }
        let device = &self.device;
        if sg.granularity == 0 {
            let granularity = device.map_granularity()? as u64;
            let total = device.mem_info()?.total as u64;
            sg.reservation = total.div_ceil(granularity) * granularity;
            sg.granularity = granularity;
        }
        let c = want.class.index();
        let base = match sg.base[c] {
            Some(base) => base,
            None => {
                let base = device.reserve_address(sg.reservation as usize)?;
                sg.base[c] = Some(base);
                base
            }
        };
        let tail = books.segment_tail_free(base).unwrap_or(0);
        let need = (want.rounded - tail.min(want.rounded)).div_ceil(sg.granularity) * sg.granularity;
        if sg.mapped[c] + need > sg.reservation {
            return Err(Error::oom(OutOfMemory {
                device: device.ordinal(),
                requested: want.rounded as usize,
                hint: format!("the segment's reservation of {} bytes is full", sg.reservation),
                ..OutOfMemory::default()
            }));
        }
        let at = base + sg.mapped[c];
        device.map(at, need as usize)?;
        // The `need` bytes just mapped join the segment's end, where the request fits.
        let added = match sg.mapped[c] == 0 {
            true => books.add_segment(want.class, base, need),
            false => books.extend_segment(base, need),
        };
        match added {
            // A bug: the policy refused memory that is mapped; give it back.
            Err(_) => drop(device.unmap(at, need as usize)),
            Ok(()) => sg.mapped[c] += need,
        }
        added
    }

    /// Takes wholly free segments and chunks of their own out of the pool. A growth of a
    /// class whose segment is out for the release gets a chunk of its own until it ends.
    fn release_begin(&self, books: &mut BestFitPolicy) -> Result<Taken> {
        let mut sg = self.state.lock();
        let chunks = books.release_free_chunks();
        for chunk in &chunks {
            if let Some(c) = sg.base.iter().position(|&b| b == Some(chunk.addr)) {
                sg.releasing[c] = true;
            }
        }
        Ok(Taken { chunks, ..Taken::default() })
    }

    /// Unmaps the segments taken and frees the chunks, after the wait.
    fn release_end(&self, books: &mut BestFitPolicy, taken: Taken, waited: Result<()>) -> Result<usize> {
        let mut sg = self.state.lock();
        let chunks = taken.chunks;
        // The classes whose segment this release took (another release may hold the other's).
        for chunk in &chunks {
            if let Some(c) = sg.base.iter().position(|&b| b == Some(chunk.addr)) {
                sg.releasing[c] = false;
            }
        }
        if let Err(timeout @ Error::Timeout { .. }) = waited {
            restore(books, &chunks);
            return Err(timeout);
        }
        let mut released = 0;
        try_each(chunks, |chunk| {
            let TakenChunk { addr, size, .. } = chunk;
            match sg.base.iter().position(|&b| b == Some(addr)) {
                None => self.chunks.shrink(addr, size)?,
                Some(c) => {
                    // An unmap does not wait for the segment's last uses as a `cuMemFree` does:
                    // only after the wait.
                    let unmapped = match &waited {
                        Err(e) => Err(e.clone()),
                        Ok(()) => self.device.unmap(addr, size as usize),
                    };
                    match unmapped {
                        Ok(()) => sg.mapped[c] = 0,
                        // Still mapped: the segment stays in the pool, wholly free.
                        Err(e) => {
                            restore(books, &[chunk]);
                            return Err(e);
                        }
                    }
                }
            }
            released += size as usize;
            Ok(())
        })?;
        Ok(released)
    }

    fn teardown(&mut self, chunks: Vec<AddrRange>) {
        let sg = std::mem::take(self.state.get_mut());
        for c in chunks {
            if !sg.base.contains(&Some(c.addr)) {
                let _ = self.chunks.shrink(c.addr, c.len);
            }
        }
        if sg.mapped.iter().any(|&m| m > 0) {
            // An unmap does not wait for the last uses: wait for the device, as a chunk's
            // `cuMemFree` would, not for the pool's stream, which may have been destroyed.
            let _ = self.device.synchronize();
        }
        for (base, mapped) in sg.base.iter().zip(sg.mapped) {
            if let Some(base) = *base {
                if mapped > 0 {
                    let _ = self.device.unmap(base, mapped as usize);
                }
                let _ = self.device.free_address(base, sg.reservation as usize);
            }
        }
    }
}
