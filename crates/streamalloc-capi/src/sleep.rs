//! Tags, sleep and wake through the C ABI (issue 36). The calling thread's tag
//! ([`streamalloc_tag_push`], [`streamalloc_tag_pop`]) puts the allocations it makes (by any
//! face: the C API, PyTorch's, CuPy's) in a pool of the tag's own, which
//! [`streamalloc_sleep`] gives back to the device, keeping its addresses, and
//! [`streamalloc_wake`] maps again at the same addresses (the contents copied back where the
//! sleep offloaded them), so that CUDA graphs captured over them stay valid. Where the
//! configuration cannot sleep (`strategy=plain` or `async`, a backing other than
//! `stitched`, a device without virtual memory management) tags are not looked at and
//! sleep and wake are `STREAMALLOC_UNSUPPORTED`, with a message naming the configuration.

use std::ffi::CStr;
use std::os::raw::{c_char, c_int};

use core_alloc::allocators::TagStats;
use core_alloc::facade::TagLayer;
use core_alloc::tags::{self, Tag};
use core_alloc::{Allocator, Error, Result};

use crate::fork;
use crate::state::State;
use crate::status::{self, StreamallocStatus};

/// `s`, a tag name from C.
///
/// # Safety
/// `s` is null (an error) or a NUL-terminated string.
unsafe fn name<'a>(s: *const c_char) -> Result<&'a str> {
    if s.is_null() {
        return Err(Error::InvalidArgument("a tag name is null".into()));
    }
    // SAFETY: non-null, and NUL-terminated by the caller's contract.
    let s = unsafe { CStr::from_ptr(s) };
    s.to_str().map_err(|_| Error::InvalidArgument("a tag name is not UTF-8".into()))
}

/// The `ntags` tags named at `names`.
///
/// # Safety
/// `names` is null (an error unless `ntags` is 0) or valid for reading `ntags` pointers, each
/// null (an error) or a NUL-terminated string.
unsafe fn tags_at(names: *const *const c_char, ntags: usize) -> Result<Vec<Tag>> {
    if ntags == 0 {
        return Ok(Vec::new());
    }
    if names.is_null() {
        return Err(Error::InvalidArgument(format!("tags is null, with ntags {ntags}")));
    }
    // SAFETY: non-null and valid for `ntags` reads by the caller's contract.
    let names = unsafe { std::slice::from_raw_parts(names, ntags) };
    // SAFETY: each is null or NUL-terminated by the caller's contract.
    names.iter().map(|&n| unsafe { name(n) }.and_then(Tag::new)).collect()
}

/// The tag layer of `device`'s stack, or why its configuration has none.
fn layer(state: &State, device: c_int) -> Result<&TagLayer> {
    state.stack(device)?.tags.as_ref().map_err(Clone::clone)
}

/// Makes the tag named `tag` the calling thread's current tag, until the matching
/// [`streamalloc_tag_pop`]: the allocations the thread makes meanwhile, on any device, come
/// from the tag's pool. Pushes nest. A name is UTF-8 text, not empty, without control
/// characters.
///
/// # Safety
/// `tag` is null (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_tag_push(tag: *const c_char) -> StreamallocStatus {
    status::status(|| {
        // Tag names are interned under a lock, which a child forked meanwhile would inherit.
        fork::check()?;
        fork::note_use();
        // SAFETY: by the caller's contract.
        tags::push(unsafe { name(tag) }?)
    })
}

/// Restores the tag that was current before the calling thread's latest
/// [`streamalloc_tag_push`]; `STREAMALLOC_INVALID_ARGUMENT` when the thread pushed none.
#[no_mangle]
pub extern "C" fn streamalloc_tag_pop() -> StreamallocStatus {
    status::status(|| fork::check().and_then(|()| tags::pop()))
}

/// Puts the `ntags` tags named at `tags` to sleep on `device`: once the work enqueued so far
/// on the streams that use their memory has completed (the owning streams of their pools,
/// the streams recorded on their allocations, the frees pending on recorded streams; an
/// internal stream waits on events recorded on them, and the host waits for that stream
/// alone, at most `wait_timeout`, else `STREAMALLOC_TIMEOUT` naming the streams and nothing
/// sleeps), their memory goes back to the device and their addresses stay reserved. With
/// `offload` not 0, their contents are first copied to page-locked host memory, and
/// [`streamalloc_wake`] copies them back. Meanwhile allocating in a sleeping tag is
/// `STREAMALLOC_INVALID_ARGUMENT` naming the tag; freeing its allocations is allowed; other
/// tags and untagged allocations go on; `streamalloc_release` leaves it alone. A tag asleep
/// already is left as it is. A tag with live memory exported to another process
/// ([`streamalloc_ipc_export`](crate::streamalloc_ipc_export), until freed and released) is
/// `STREAMALLOC_INVALID_ARGUMENT` and nothing sleeps. Work enqueued on a tag's memory after
/// the call is the caller's error.
///
/// # Safety
/// `tags` is null (an error unless `ntags` is 0) or valid for reading `ntags` pointers, each
/// null (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_sleep(
    device: c_int,
    tags: *const *const c_char,
    ntags: usize,
    offload: c_int,
) -> StreamallocStatus {
    status::status(|| {
        let state = State::get()?;
        // SAFETY: by the caller's contract.
        let tags = unsafe { tags_at(tags, ntags) }?;
        state.stack(device)?.sleep(&tags, offload != 0).map(drop)
    })
}

/// Wakes the `ntags` tags named at `tags` on `device`: fresh memory mapped at the addresses
/// they slept and, where the sleep offloaded them, their contents copied back; it returns once
/// the copies have completed, so work enqueued afterwards on any stream sees them. All the
/// tags' memory is mapped or none (`STREAMALLOC_OUT_OF_MEMORY` when the device lacks it even
/// after the other pools gave their free memory back: the tags sleep on, their contents
/// kept). An awake tag is left as it is. Without offload the contents are undefined.
///
/// # Safety
/// As [`streamalloc_sleep`]'s `tags`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_wake(
    device: c_int,
    tags: *const *const c_char,
    ntags: usize,
) -> StreamallocStatus {
    status::status(|| {
        let state = State::get()?;
        // SAFETY: by the caller's contract.
        let tags = unsafe { tags_at(tags, ntags) }?;
        let layer = layer(state, device)?;
        if let Some(limit) = state.fraction_limit(device)? {
            within_fraction(state, layer, device, &tags, limit)?;
        }
        layer.wake(&tags).map(drop)
    })
}

/// Whether waking `tags` keeps device `device` within the limit of
/// `streamalloc_set_memory_fraction` (issue 52, #15: a wake ignored it), on reserved memory
/// as an allocation under the limit: the memory the tags slept, with what the stack holds,
/// must fit; if not, the cache goes back and it is looked at again; then
/// [`Error::LimitExceeded`], the tags asleep still.
fn within_fraction(state: &State, layer: &TagLayer, device: c_int, tags: &[Tag], limit: usize) -> Result<()> {
    let slept: usize = tags.iter().map(|&t| layer.tag_stats(t).slept).sum();
    let stack = state.stack(device)?;
    let fits = || stack.allocator.stats().reserved.saturating_add(slept) <= limit;
    if slept == 0 || fits() {
        return Ok(());
    }
    let released = stack.allocator.release();
    if fits() {
        return Ok(());
    }
    released?;
    Err(Error::LimitExceeded {
        device: stack.device.ordinal(),
        requested: slept,
        in_use: stack.allocator.stats().reserved,
        limit,
    })
}

/// Drops the tag named `tag` on `device`: its pool's memory and address reservations go
/// back to the device, so that the tag costs nothing; a later allocation under the name
/// starts afresh. `STREAMALLOC_INVALID_ARGUMENT` while it has live allocations (free them
/// first; nothing is dropped), `STREAMALLOC_TIMEOUT` when frees pending on recorded streams
/// outlast `wait_timeout`. A tag that allocated nothing there is dropped at once.
///
/// # Safety
/// `tag` is null (an error) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_tag_drop(device: c_int, tag: *const c_char) -> StreamallocStatus {
    status::status(|| {
        let state = State::get()?;
        // SAFETY: by the caller's contract.
        let tag = Tag::new(unsafe { name(tag) }?)?;
        layer(state, device)?.drop_tag(tag).map(drop)
    })
}

/// Writes the figures of the tag named `tag` on `device` to `*out` (zeros for a tag that
/// allocated nothing there); `STREAMALLOC_UNSUPPORTED` where the configuration has no tags.
///
/// # Safety
/// `tag` is null (an error) or a NUL-terminated string; `out` is null (an error) or valid for
/// writing a `streamalloc_tag_stats_t`.
#[no_mangle]
pub unsafe extern "C" fn streamalloc_tag_stats(
    device: c_int,
    tag: *const c_char,
    out: *mut TagStats,
) -> StreamallocStatus {
    status::status(|| {
        if out.is_null() {
            return Err(Error::InvalidArgument("out is null".into()));
        }
        let state = State::get()?;
        // SAFETY: by the caller's contract.
        let tag = Tag::new(unsafe { name(tag) }?)?;
        let stats = layer(state, device)?.tag_stats(tag);
        // SAFETY: `out` is non-null and, by the caller's contract, valid for writes.
        unsafe { out.write(stats) };
        Ok(())
    })
}
