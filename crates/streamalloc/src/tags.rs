//! Tags: the calling thread's current tag says which pool its allocations come from, so that
//! a tag's memory can be put to sleep and woken again at the same addresses
//! ([`Facade::sleep`](crate::facade::Facade::sleep), [`Tagged`](crate::allocators::Tagged)).
//!
//! A tag is set by scope: [`scope`] returns a guard that makes the tag current on the calling
//! thread until it is dropped (nested scopes restore the tag around them); front ends without
//! guards (C) [`push`] and [`pop`]. Untagged allocations (no scope open) go where they went
//! before tags existed; reading the current tag is one relaxed atomic load until a thread
//! first sets a tag, one thread-local read after (a thread-local in a shared library is a
//! call of `__tls_get_addr`). Tags are names,
//! interned once per process: a [`Tag`] is a small number standing for one.
//!
//! # Examples
//!
//! ```
//! use streamalloc::tags;
//!
//! assert_eq!(tags::current(), None);
//! {
//!     let _kv = tags::scope("kv_cache")?;
//!     assert_eq!(tags::current().map(|t| t.name()).as_deref(), Some("kv_cache"));
//!     {
//!         let _w = tags::scope("weights")?;
//!         assert_eq!(tags::current(), Some(tags::Tag::new("weights")?));
//!     }
//!     assert_eq!(tags::current(), Some(tags::Tag::new("kv_cache")?));
//! }
//! assert_eq!(tags::current(), None);
//! # Ok::<(), streamalloc::Error>(())
//! ```

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use crate::error::{Error, Result};
use crate::text::excerpt;

/// A tag: an interned name (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(NonZeroU32);

/// The names interned so far: a tag's number is its index + 1.
#[derive(Default)]
struct Names {
    names: Vec<Arc<str>>,
    numbers: FxHashMap<Arc<str>, Tag>,
}

static NAMES: Mutex<Option<Names>> = Mutex::new(None);

/// Whether a thread has made a tag current: until then no thread has one. A thread sets it
/// before its own current tag, so its own reads see it.
static EVER_SET: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The calling thread's current tag (0: none).
    static CURRENT: Cell<u32> = const { Cell::new(0) };
    /// The tags [`push`] replaced, innermost last.
    static PUSHED: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

impl Tag {
    /// The tag named `name`, interned at its first use. A name is not empty and has no
    /// control characters ([`Error::InvalidArgument`] otherwise).
    pub fn new(name: &str) -> Result<Tag> {
        if name.is_empty() || name.chars().any(char::is_control) {
            return Err(Error::InvalidArgument(format!(
                "tag name `{}`: a tag is named by text without control characters, not empty",
                excerpt(name)
            )));
        }
        let mut names = NAMES.lock();
        let names = names.get_or_insert_with(Names::default);
        if let Some(&tag) = names.numbers.get(name) {
            return Ok(tag);
        }
        let number = u32::try_from(names.names.len() + 1)
            .ok()
            .and_then(NonZeroU32::new)
            .ok_or_else(|| Error::InvalidArgument("too many tag names in one process".into()))?;
        let name: Arc<str> = name.into();
        names.names.push(name.clone());
        names.numbers.insert(name, Tag(number));
        Ok(Tag(number))
    }

    /// The tag's name.
    pub fn name(&self) -> Arc<str> {
        let names = NAMES.lock();
        let index = self.0.get() as usize - 1;
        // Tags are made only by `Tag::new`, which interned the name first.
        names.as_ref().and_then(|n| n.names.get(index).cloned()).unwrap_or_else(|| "?".into())
    }

    fn from_raw(raw: u32) -> Option<Tag> {
        NonZeroU32::new(raw).map(Tag)
    }
}

impl std::fmt::Display for Tag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", excerpt(&self.name()))
    }
}

/// The calling thread's current tag: `None` outside every scope (and while the thread is
/// being torn down).
#[inline]
pub fn current() -> Option<Tag> {
    if !EVER_SET.load(Ordering::Relaxed) {
        return None;
    }
    current_set()
}

/// [`current`] once a tag was set: not inlined, so that the thread-local's address is not
/// computed before the check (the compiler hoists it).
#[inline(never)]
fn current_set() -> Option<Tag> {
    CURRENT.try_with(Cell::get).ok().and_then(Tag::from_raw)
}

/// Makes `tag` the calling thread's current tag; the one it replaces.
fn set(tag: Option<Tag>) -> u32 {
    let raw = tag.map_or(0, |t| t.0.get());
    if raw != 0 && !EVER_SET.load(Ordering::Relaxed) {
        EVER_SET.store(true, Ordering::Relaxed);
    }
    CURRENT.try_with(|c| c.replace(raw)).unwrap_or(0)
}

/// The guard of [`scope`]: while it lives, its tag is the thread's current tag. Not `Send`:
/// it belongs to the thread whose tag it set.
#[must_use = "the tag is current only while the guard lives"]
#[derive(Debug)]
pub struct Scope {
    previous: u32,
    _thread: PhantomData<*const ()>,
}

impl Drop for Scope {
    fn drop(&mut self) {
        let _ = CURRENT.try_with(|c| c.set(self.previous));
    }
}

/// Makes the tag named `name` the calling thread's current tag until the guard is dropped,
/// which restores the tag current before (scopes nest). Fails on a name [`Tag::new`] refuses.
pub fn scope(name: &str) -> Result<Scope> {
    let tag = Tag::new(name)?;
    Ok(Scope { previous: set(Some(tag)), _thread: PhantomData })
}

/// Makes the tag named `name` the calling thread's current tag until the matching [`pop`]
/// (for front ends without guards: C's `streamalloc_tag_push`).
pub fn push(name: &str) -> Result<()> {
    let tag = Tag::new(name)?;
    let previous = set(Some(tag));
    PUSHED
        .try_with(|p| p.borrow_mut().push(previous))
        .map_err(|_| Error::InvalidArgument("tag push during the thread's teardown".into()))
}

/// Restores the tag current before the calling thread's latest [`push`];
/// [`Error::InvalidArgument`] when this thread has pushed none.
pub fn pop() -> Result<()> {
    let previous = PUSHED.try_with(|p| p.borrow_mut().pop()).ok().flatten();
    let previous =
        previous.ok_or_else(|| Error::InvalidArgument("tag pop without a push on this thread".into()))?;
    set(Tag::from_raw(previous));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_and_pop_nest_and_a_pop_too_many_is_refused() {
        std::thread::spawn(|| {
            push("a").unwrap();
            push("b").unwrap();
            assert_eq!(current(), Some(Tag::new("b").unwrap()));
            pop().unwrap();
            assert_eq!(current().map(|t| t.name()).as_deref(), Some("a"));
            pop().unwrap();
            assert_eq!(current(), None);
            assert!(matches!(pop(), Err(Error::InvalidArgument(_))));
        })
        .join()
        .unwrap();
    }

    #[test]
    fn names_are_checked_and_interned_once() {
        assert!(Tag::new("").is_err());
        assert!(Tag::new("kv\n").is_err());
        assert_eq!(Tag::new("same").unwrap(), Tag::new("same").unwrap());
        assert_ne!(Tag::new("same").unwrap(), Tag::new("other").unwrap());
        assert_eq!(&*Tag::new("weights").unwrap().name(), "weights");
    }

    #[test]
    fn a_scope_is_the_calling_threads_own() {
        let _s = scope("here").unwrap();
        let elsewhere = std::thread::spawn(current).join().unwrap();
        assert_eq!((current().is_some(), elsewhere), (true, None));
    }
}
