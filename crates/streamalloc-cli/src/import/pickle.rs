//! The pickle reader of `import`: reads a pickle of any protocol (0 to 5) as a stream,
//! without running any of it, and keeps only what the reading of a PyTorch memory snapshot
//! needs, so that its memory stays a small part of the pickle's size.
//!
//! Most of a snapshot's bytes are stack frames (each trace entry's `frames`, each segment's),
//! which the import does not read. The reader keeps:
//!
//! * of a dict, the fields the import reads (an entry's `action` and its integers `addr`,
//!   `size`, `stream` and `time_us`; the snapshot's `device_traces`). A dict with an `action`
//!   becomes a compact entry ([`Raw`], 40 bytes) once it is put into a list or dict; any other
//!   dict is dropped then (the snapshot itself, never put anywhere, is kept);
//! * of a list (or tuple or set), the entries it holds, as runs of entry indices, or the lists
//!   of entries it holds, sharing their runs (a list changed after it was put into another is
//!   copied first, and the copies are bounded by the bytes read); a list that holds anything
//!   else cannot be read as a trace, and its items are dropped as they come;
//! * of a string, which of the words the import looks for it is; strings are never stored.
//!
//! The memo (the objects the pickle stores to refer to again, `BINGET`) keeps what a later
//! reference may need in that form: an entry or a list of entries referred to twice reads the
//! same both times, and what was dropped reads back as a value the import does not read.
//! Nothing kept holds anything that holds more (a list keeps entry indices, not lists), so
//! neither reading nor dropping recurses, however deep the pickle nests; the stack holds at
//! most [`STACK_MOST`] values, more than any snapshot needs.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io::Read;
use std::rc::Rc;

use rustc_hash::FxHashMap;

/// The strings the reading looks for: keys of the snapshot and of its entries, and the
/// actions it converts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Word {
    DeviceTraces,
    Action,
    Addr,
    Size,
    Stream,
    TimeUs,
    Alloc,
    FreeRequested,
    FreeCompleted,
    /// Any other string.
    Other,
}

/// Each [`Word`] but `Other`, as the pickle spells it.
const WORDS: [(&str, Word); 9] = [
    ("device_traces", Word::DeviceTraces),
    ("action", Word::Action),
    ("addr", Word::Addr),
    ("size", Word::Size),
    ("stream", Word::Stream),
    ("time_us", Word::TimeUs),
    ("alloc", Word::Alloc),
    ("free_requested", Word::FreeRequested),
    ("free_completed", Word::FreeCompleted),
];

/// The length of the longest of [`WORDS`]: a longer string is [`Word::Other`], skipped unread.
const LONGEST_WORD: u64 = {
    let (mut i, mut longest) = (0, 0);
    while i < WORDS.len() {
        if WORDS[i].0.len() > longest {
            longest = WORDS[i].0.len();
        }
        i += 1;
    }
    longest as u64
};

/// The most bytes of a text argument (protocol 0 and 1 numbers, strings, names) that are
/// kept; the rest of a longer one is skipped (such a string is no word, such a number fits
/// no integer the import reads).
const TEXT_KEPT: usize = 256;

impl Word {
    fn of(bytes: &[u8]) -> Word {
        WORDS.iter().find(|(text, _)| text.as_bytes() == bytes).map_or(Word::Other, |(_, word)| *word)
    }

    /// The word as the snapshot spells it.
    pub(super) fn text(self) -> &'static str {
        WORDS.iter().find(|(_, word)| *word == self).map_or("(another string)", |(text, _)| text)
    }
}

/// The integer fields of an entry, in [`Raw`]'s order, and their names.
const FIELDS: [(Word, &str); 4] =
    [(Word::Addr, "addr"), (Word::Size, "size"), (Word::Stream, "stream"), (Word::TimeUs, "time_us")];

/// What an integer field of an entry holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Kind {
    /// Absent, or `None`.
    #[default]
    Absent,
    Int,
    /// An integer out of `i64`'s range.
    TooBig,
    /// Anything that is no integer.
    NotInt,
}

/// A trace entry as the pickle holds it, unchecked: its action and integer fields.
#[derive(Clone, Copy, Debug)]
struct Raw {
    action: Word,
    kinds: [Kind; 4],
    values: [i64; 4],
}

/// A trace entry: its action and its integer fields (`None` when absent or `None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Entry {
    /// `action` ([`Word::Other`] for any but those the import converts).
    pub action: Word,
    /// `addr`: the block's address.
    pub addr: Option<i64>,
    /// `size`: the block's bytes.
    pub size: Option<i64>,
    /// `stream`: the stream's value.
    pub stream: Option<i64>,
    /// `time_us`: microseconds since any origin (absent before torch 2.1).
    pub time_us: Option<i64>,
}

/// A run of consecutive entries: the index of the first, and how many.
type Run = (u32, u32);

/// A value of the pickle, as far as it is kept.
#[derive(Clone, Debug)]
enum Value {
    None,
    Int(i64),
    /// An integer out of `i64`'s range.
    TooBig,
    Word(Word),
    /// A dict not put anywhere yet (being filled), or one with `device_traces`.
    Dict(Rc<RefCell<Dict>>),
    List(Rc<RefCell<List>>),
    /// A dict with an `action`, made compact: an index into [`Machine::entries`].
    Entry(u32),
    /// What the import does not read: a bool, a float, bytes, what Python code would build
    /// (an object, a global), and dropped dicts and lists.
    Other,
}

/// A dict: the fields the import reads.
#[derive(Debug, Default)]
struct Dict {
    /// `action`: [`Word::Other`] for any value that is none of the words (a string the
    /// memo no longer holds reads back as such a value).
    action: Option<Word>,
    kinds: [Kind; 4],
    values: [i64; 4],
    /// `device_traces`.
    device_traces: Option<Traces>,
    /// The memo id it was last stored under.
    memo: Option<u64>,
    /// The entry it became.
    entry: Option<u32>,
}

/// The value of a `device_traces` key.
#[derive(Debug)]
enum Traces {
    None,
    List(Rc<RefCell<List>>),
    NotAList,
}

/// A list, tuple or set: what it holds, as far as it can be read as (a list of) trace
/// entries.
#[derive(Debug, Default)]
struct List {
    items: Items,
    len: usize,
    /// The memo id it was last stored under.
    memo: Option<u64>,
}

/// What a [`List`] holds.
#[derive(Debug, Default)]
enum Items {
    #[default]
    Empty,
    /// Shared with the lists it was put into: copied (see [`List::push`]) when changed after.
    Entries(Rc<Vec<Run>>),
    /// Lists of entries (each `Empty` or `Entries` when put in), sharing their runs: a list
    /// referred to many times costs a pointer each.
    Lists(Vec<Rc<Vec<Run>>>),
    /// Anything else: `at`, the index of the first item that is no list of entries.
    Other { at: usize },
}

impl List {
    /// Its runs (shared), when it holds entries only (or nothing).
    fn entries(&self) -> Option<Rc<Vec<Run>>> {
        match &self.items {
            Items::Empty => Some(Rc::default()),
            Items::Entries(runs) => Some(runs.clone()),
            _ => None,
        }
    }

    /// Adds `item` (settled: see [`Machine::settle`]); `runs` are its runs when it is a list
    /// of entries. Returns the runs copied: those of a list of entries changed after it was
    /// put into another, which keeps what it held then.
    fn push(&mut self, item: &Value, runs: Option<Rc<Vec<Run>>>) -> usize {
        let at = self.len;
        self.len += 1;
        let mut copied = 0;
        self.items = match (std::mem::take(&mut self.items), item, runs) {
            (Items::Empty, Value::Entry(i), _) => Items::Entries(Rc::new(vec![(*i, 1)])),
            (Items::Entries(mut shared), Value::Entry(i), _) => {
                if Rc::strong_count(&shared) > 1 {
                    copied = shared.len();
                }
                let runs = Rc::make_mut(&mut shared);
                match runs.last_mut() {
                    Some((first, n)) if first.checked_add(*n) == Some(*i) => *n += 1,
                    _ => runs.push((*i, 1)),
                }
                Items::Entries(shared)
            }
            (Items::Empty, _, Some(runs)) => Items::Lists(vec![runs]),
            (Items::Lists(mut lists), _, Some(runs)) => {
                lists.push(runs);
                Items::Lists(lists)
            }
            (Items::Lists(_), _, None) => Items::Other { at },
            (Items::Other { at }, _, _) => Items::Other { at },
            (Items::Empty | Items::Entries(_), _, _) => Items::Other { at: 0 },
        };
        copied
    }
}

/// The memo: the values kept for a later reference, and every id stored.
#[derive(Default)]
struct Memo {
    /// Entries, by the id (below 2^32, as every pickler writes them) of the dict they were:
    /// the most of what is kept, in 8 bytes each.
    entries: FxHashMap<u32, u32>,
    /// Any other value kept (words, integers, dicts and lists being filled or kept).
    kept: FxHashMap<u64, Value>,
    stored: Ids,
}

impl Memo {
    /// What `id` holds: `None` when it was never stored.
    fn get(&self, id: u64) -> Option<Value> {
        let entry = || u32::try_from(id).ok().and_then(|id| self.entries.get(&id)).map(|e| Value::Entry(*e));
        match self.kept.get(&id) {
            Some(value) => Some(value.clone()),
            None => entry().or_else(|| self.stored.contains(id).then_some(Value::Other)),
        }
    }

    /// Stores `value` (`None`: a value not kept) under `id`.
    fn put(&mut self, id: u64, value: Option<Value>) {
        if !self.stored.insert(id) {
            // Stored before: what it held goes.
            self.kept.remove(&id);
            if let Ok(id) = u32::try_from(id) {
                self.entries.remove(&id);
            }
        }
        match (value, u32::try_from(id)) {
            (Some(Value::Entry(e)), Ok(id)) => {
                self.entries.insert(id, e);
            }
            (Some(value), _) => {
                self.kept.insert(id, value);
            }
            (None, _) => {}
        }
    }

    /// Replaces what `id` holds by `value` (or nothing) if it still holds `object`.
    fn settled(&mut self, id: u64, object: &Value, value: Option<Value>) {
        if self.kept.get(&id).is_some_and(|v| same(v, object)) {
            self.kept.remove(&id);
            self.put(id, value);
        }
    }
}

/// Whether `a` and `b` are the same dict or list.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Dict(a), Value::Dict(b)) => Rc::ptr_eq(a, b),
        (Value::List(a), Value::List(b)) => Rc::ptr_eq(a, b),
        _ => false,
    }
}

/// A set of integers (the memo ids stored), as ranges: the ids a pickler stores count up, so
/// this is one range.
#[derive(Default)]
struct Ids {
    /// First id of each range -> its last.
    ranges: BTreeMap<u64, u64>,
    count: u64,
}

impl Ids {
    fn contains(&self, id: u64) -> bool {
        self.ranges.range(..=id).next_back().is_some_and(|(_, last)| *last >= id)
    }

    /// Adds `id`; whether it is new.
    fn insert(&mut self, id: u64) -> bool {
        if self.contains(id) {
            return false;
        }
        self.count += 1;
        let before =
            self.ranges.range(..id).next_back().filter(|(_, last)| **last + 1 == id).map(|(f, _)| *f);
        let after = id.checked_add(1).and_then(|next| self.ranges.remove(&next));
        let first = before.unwrap_or(id);
        self.ranges.insert(first, after.unwrap_or(id));
        true
    }
}

/// The trace entries of a snapshot, per device, checked.
pub(super) struct Snapshot {
    entries: Vec<Raw>,
    devices: Vec<Rc<Vec<Run>>>,
    /// Whether each device has an `alloc` entry.
    allocates: Vec<bool>,
}

impl Snapshot {
    /// The number of devices.
    pub(super) fn devices(&self) -> usize {
        self.devices.len()
    }

    /// The devices with an `alloc` entry.
    pub(super) fn allocating(&self) -> impl Iterator<Item = usize> + '_ {
        self.allocates.iter().enumerate().filter(|(_, a)| **a).map(|(d, _)| d)
    }

    /// The entries of `device`, oldest first.
    pub(super) fn entries(&self, device: usize) -> impl Iterator<Item = Entry> + Clone + '_ {
        let runs = self.devices.get(device).map_or(&[][..], |runs| runs.as_slice());
        runs.iter().flat_map(|(first, n)| (*first..*first + *n).map(|i| self.entry(i)))
    }

    fn entry(&self, index: u32) -> Entry {
        let raw = &self.entries[index as usize];
        let field = |i: usize| (raw.kinds[i] == Kind::Int).then_some(raw.values[i]);
        Entry { action: raw.action, addr: field(0), size: field(1), stream: field(2), time_us: field(3) }
    }
}

/// Reads the snapshot pickled in `input`, telling `progress` each count of bytes read: its
/// trace entries, or `None` when it has no `device_traces` (absent or `None`). An error says
/// where the pickle is broken (the opcode and its byte) or what is not as torch writes it.
pub(super) fn read_snapshot(
    input: impl Read,
    progress: &mut dyn FnMut(u64),
) -> Result<Option<Snapshot>, String> {
    let mut m = Machine {
        input: Input { inner: input, buf: vec![0; 1 << 20], pos: 0, end: 0, base: 0, progress },
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Memo::default(),
        entries: Vec::new(),
        copied: 0,
    };
    if !m.input.fill()? {
        return Err("the file is empty".into());
    }
    let top = loop {
        let at = m.input.offset();
        let op = m.input.u8().map_err(|_| "the pickle ends before its STOP opcode".to_string())?;
        let held = match m.step(op) {
            Ok(Some(top)) => break top,
            Ok(None) => m.held(),
            Err(e) => Err(e),
        };
        held.map_err(|e| format!("{e} (opcode {op:#04x} at byte {at})"))?;
    };
    let Value::Dict(top) = top else { return Err("the pickle holds no dict".into()) };
    let top = top.borrow();
    let list = match &top.device_traces {
        None | Some(Traces::None) => return Ok(None),
        Some(Traces::NotAList) => return Err("`device_traces` is not a list".into()),
        Some(Traces::List(list)) => list.borrow(),
    };
    let devices = match &list.items {
        Items::Empty => Vec::new(),
        Items::Lists(lists) => lists.clone(),
        Items::Entries(_) => return Err(not_entries(0)),
        Items::Other { at } => return Err(not_entries(*at)),
    };
    // Each list of entries is checked once, however many devices share it.
    let mut allocates = Vec::with_capacity(devices.len());
    let mut checked: FxHashMap<*const Vec<Run>, bool> = FxHashMap::default();
    for (d, runs) in devices.iter().enumerate() {
        if let Some(allocating) = checked.get(&Rc::as_ptr(runs)) {
            allocates.push(*allocating);
            continue;
        }
        let mut allocating = false;
        let indices = runs.iter().flat_map(|(first, n)| *first..*first + *n);
        for (i, index) in indices.enumerate() {
            let raw = &m.entries[index as usize];
            allocating |= raw.action == Word::Alloc;
            for ((_, name), kind) in FIELDS.iter().zip(raw.kinds) {
                let what = match kind {
                    Kind::TooBig => "is out of range",
                    Kind::NotInt => "is not an integer",
                    Kind::Absent | Kind::Int => continue,
                };
                return Err(format!("`device_traces[{d}][{i}]`: `{name}` {what}"));
            }
        }
        checked.insert(Rc::as_ptr(runs), allocating);
        allocates.push(allocating);
    }
    Ok(Some(Snapshot { entries: m.entries, devices, allocates }))
}

fn not_entries(device: usize) -> String {
    format!("`device_traces[{device}]` is not a list of trace entries (dicts with an `action`)")
}

/// The bytes of a pickle, read as they are needed, and where the reading is.
struct Input<'p, R> {
    inner: R,
    buf: Vec<u8>,
    /// What of `buf` is read (`pos`) and filled (`end`).
    pos: usize,
    end: usize,
    /// The offset in the pickle of `buf[0]`.
    base: u64,
    progress: &'p mut dyn FnMut(u64),
}

impl<R: Read> Input<'_, R> {
    /// The offset in the pickle of the next byte.
    fn offset(&self) -> u64 {
        self.base + self.pos as u64
    }

    /// Reads more when all that was read is used; false at the end of the pickle.
    fn fill(&mut self) -> Result<bool, String> {
        if self.pos < self.end {
            return Ok(true);
        }
        self.base += self.end as u64;
        self.pos = 0;
        self.end = 0;
        let n = loop {
            match self.inner.read(&mut self.buf) {
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("reading the pickle at byte {}: {e}", self.base)),
            }
        };
        self.end = n;
        (self.progress)(n as u64);
        Ok(n > 0)
    }

    fn ends_early(&self) -> String {
        format!("the pickle ends early (at byte {})", self.offset())
    }

    fn u8(&mut self) -> Result<u8, String> {
        if !self.fill()? {
            return Err(self.ends_early());
        }
        self.pos += 1;
        Ok(self.buf[self.pos - 1])
    }

    fn read(&mut self, out: &mut [u8]) -> Result<(), String> {
        let mut done = 0;
        while done < out.len() {
            if !self.fill()? {
                return Err(self.ends_early());
            }
            let n = (out.len() - done).min(self.end - self.pos);
            out[done..done + n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
            self.pos += n;
            done += n;
        }
        Ok(())
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0; N];
        self.read(&mut out)?;
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// Passes over `n` bytes.
    fn skip(&mut self, mut n: u64) -> Result<(), String> {
        while n > 0 {
            if !self.fill()? {
                return Err(self.ends_early());
            }
            let step = n.min((self.end - self.pos) as u64);
            self.pos += step as usize;
            n -= step;
        }
        Ok(())
    }

    /// `n` bytes when there are at most `most`, else `None` (they are passed over).
    fn bytes_up_to(&mut self, n: u64, most: u64) -> Result<Option<Vec<u8>>, String> {
        if n > most {
            self.skip(n)?;
            return Ok(None);
        }
        let mut out = vec![0; n as usize];
        self.read(&mut out)?;
        Ok(Some(out))
    }

    /// A text argument: the bytes up to the next newline, when there are at most
    /// [`TEXT_KEPT`] (a longer one is passed over: `None`).
    fn line(&mut self) -> Result<Option<Vec<u8>>, String> {
        let mut kept = Vec::new();
        let mut whole = true;
        loop {
            if !self.fill()? {
                return Err("the pickle ends early (in a text argument)".into());
            }
            let rest = &self.buf[self.pos..self.end];
            let (len, found) = match rest.iter().position(|b| *b == b'\n') {
                Some(len) => (len, true),
                None => (rest.len(), false),
            };
            if whole && kept.len() + len <= TEXT_KEPT {
                kept.extend_from_slice(&rest[..len]);
            } else {
                whole = false;
            }
            self.pos += len + usize::from(found);
            if found {
                return Ok(whole.then_some(kept));
            }
        }
    }

    /// A text argument that is ASCII (a number, a name); `None` when longer than
    /// [`TEXT_KEPT`].
    fn text(&mut self) -> Result<Option<String>, String> {
        match self.line()? {
            Some(bytes) => {
                String::from_utf8(bytes).map(Some).map_err(|_| "a text argument is not ASCII".into())
            }
            None => Ok(None),
        }
    }
}

/// An integer written as text (`I`, `L`: decimal, a trailing `L` allowed); a text too long
/// to keep (`None`) is an integer too big.
fn text_int(text: Option<&str>) -> Value {
    let Some(text) = text else { return Value::TooBig };
    let text = text.trim().trim_end_matches('L');
    match text.parse::<i128>() {
        Ok(n) => i64::try_from(n).map_or(Value::TooBig, Value::Int),
        Err(_) if text.trim_start_matches(['-', '+']).bytes().all(|b| b.is_ascii_digit()) => Value::TooBig,
        Err(_) => Value::Other,
    }
}

/// A little-endian two's complement integer (`LONG1`, `LONG4`) of at most 16 bytes.
fn le_int(bytes: &[u8]) -> Value {
    let fill = if bytes.last().is_some_and(|b| b & 0x80 != 0) { 0xff } else { 0 };
    let mut full = [fill; 16];
    full[..bytes.len()].copy_from_slice(bytes);
    i64::try_from(i128::from_le_bytes(full)).map_or(Value::TooBig, Value::Int)
}

/// A protocol 0 `UNICODE` argument (raw-unicode-escape: Latin-1 with `\uXXXX` and
/// `\UXXXXXXXX` escapes) or `STRING` argument (a quoted Python literal, read as Latin-1;
/// escapes other than `\\`, `\'`, `\"`, `\n`, `\t`, `\r` and `\xNN` are kept as written).
fn text_string(bytes: &[u8], quoted: bool) -> Result<String, String> {
    let text: String = bytes.iter().map(|b| char::from(*b)).collect();
    let body = if quoted {
        let q = text.chars().next().filter(|q| *q == '\'' || *q == '"');
        let q = q.ok_or("a STRING argument is not quoted")?;
        text.strip_prefix(q).and_then(|t| t.strip_suffix(q)).ok_or("a STRING argument is not quoted")?
    } else {
        &text
    };
    /// The character of the `n` hexadecimal digits that come next.
    fn hex(chars: &mut std::str::Chars<'_>, n: usize) -> Result<char, String> {
        let digits: String = chars.take(n).collect();
        let code = u32::from_str_radix(&digits, 16).ok().filter(|_| digits.len() == n);
        code.and_then(char::from_u32).ok_or_else(|| "a bad escape in a string".to_string())
    }
    let mut out = String::with_capacity(body.len());
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        let escaped = match (chars.clone().next(), quoted) {
            (Some('u'), false) => Some(4),
            (Some('U'), false) => Some(8),
            (Some('x'), true) => Some(2),
            _ => None,
        };
        let simple = match (chars.clone().next(), quoted) {
            (Some(e @ ('\\' | '\'' | '"')), true) => Some(e),
            (Some('n'), true) => Some('\n'),
            (Some('t'), true) => Some('\t'),
            (Some('r'), true) => Some('\r'),
            _ => None,
        };
        match (escaped, simple) {
            (Some(n), _) => {
                chars.next();
                out.push(hex(&mut chars, n)?);
            }
            (None, Some(e)) => {
                chars.next();
                out.push(e);
            }
            (None, None) => out.push('\\'),
        }
    }
    Ok(out)
}

/// The pickle machine: its input, stack, marks and memo, and the entries it made.
struct Machine<'p, R> {
    input: Input<'p, R>,
    stack: Vec<Value>,
    /// Stack lengths at each `MARK` still open.
    marks: Vec<usize>,
    memo: Memo,
    entries: Vec<Raw>,
    /// Runs copied from lists of entries changed after they were put into others (see
    /// [`List::push`]): at most [`Machine::held`]'s bound.
    copied: u64,
}

/// The most values (and marks) the pickle's stack may hold at once. Python's pickler puts
/// at most 1,000 items (or pairs) between a mark and the opcode that takes them, and a
/// snapshot nests a few levels deep: its stack holds a few thousand at most.
const STACK_MOST: usize = 100_000;

/// The runs a pickle may make copied, beyond one per byte read (see [`Machine::held`]).
const COPIED_SLACK: u64 = 1 << 20;

/// What an opcode finds when the stack (or its part since the last mark) runs out.
const UNDERFLOW: &str = "the pickle's stack runs out";

impl<R: Read> Machine<'_, R> {
    /// Whether what the machine holds is within its bounds, so that its memory is bounded by
    /// the entries and lists the pickle makes (each a few bytes of it at least) however it
    /// refers to them: a stack of at most [`STACK_MOST`], and at most one run copied per byte
    /// read (a list referred to again is shared, not copied; see [`List::push`]).
    fn held(&self) -> Result<(), String> {
        let stack = self.stack.len() + self.marks.len();
        if stack > STACK_MOST {
            return Err(format!(
                "the pickle holds more than {STACK_MOST} values at once on its stack (a snapshot holds a \
                 few thousand at most)"
            ));
        }
        if self.copied > self.input.offset() + COPIED_SLACK {
            return Err(format!(
                "the pickle changes lists of entries after putting them into others so often that \
                 reading it would copy {} runs of entries from {} bytes (no snapshot does)",
                self.copied,
                self.input.offset()
            ));
        }
        Ok(())
    }

    fn push(&mut self, value: Value) {
        self.stack.push(value);
    }

    fn pop(&mut self) -> Result<Value, String> {
        self.stack.pop().ok_or_else(|| UNDERFLOW.to_string())
    }

    /// The values pushed since the last mark, which is closed.
    fn pop_mark(&mut self) -> Result<Vec<Value>, String> {
        let at = self.marks.pop().filter(|at| *at <= self.stack.len()).ok_or(UNDERFLOW)?;
        Ok(self.stack.split_off(at))
    }

    fn top(&self) -> Result<Value, String> {
        self.stack.last().cloned().ok_or_else(|| UNDERFLOW.to_string())
    }

    /// Drops `values`, which the pickle took off its stack: see [`Machine::settle`].
    fn discard(&mut self, values: Vec<Value>) -> Result<(), String> {
        values.into_iter().try_for_each(|v| self.settle(v).map(drop))
    }

    /// What `value`, put into a list or dict (or dropped), is kept as: a dict with an `action`
    /// becomes an entry, a dict with `device_traces` stays, and any other dict, and a
    /// list that holds no (lists of) entries, become [`Value::Other`]. The memo follows.
    fn settle(&mut self, value: Value) -> Result<Value, String> {
        let settled = match &value {
            Value::Dict(dict) => {
                let Ok(mut d) = dict.try_borrow_mut() else { return Ok(Value::Other) };
                match (d.entry, d.action) {
                    (Some(index), _) => Value::Entry(index),
                    (None, Some(action)) => {
                        let index = u32::try_from(self.entries.len())
                            .ok()
                            .filter(|i| *i < u32::MAX)
                            .ok_or_else(|| "the pickle holds 2^32 trace entries or more".to_string())?;
                        self.entries.push(Raw { action, kinds: d.kinds, values: d.values });
                        d.entry = Some(index);
                        Value::Entry(index)
                    }
                    _ if d.device_traces.is_some() => return Ok(value.clone()),
                    _ => Value::Other,
                }
            }
            Value::List(list) => match list.try_borrow() {
                Ok(l) if !matches!(l.items, Items::Other { .. }) => return Ok(value.clone()),
                _ => Value::Other,
            },
            _ => return Ok(value),
        };
        let id = match &value {
            Value::Dict(dict) => dict.borrow().memo,
            Value::List(list) => list.borrow().memo,
            _ => None,
        };
        if let Some(id) = id {
            let kept = matches!(settled, Value::Entry(_)).then(|| settled.clone());
            self.memo.settled(id, &value, kept);
        }
        Ok(settled)
    }

    /// A new list, tuple or set of `items`.
    fn list(&mut self, items: Vec<Value>) -> Result<Value, String> {
        let list = Value::List(Rc::default());
        self.append(&list, items)?;
        Ok(list)
    }

    /// A new dict of the key, value pairs in `items`.
    fn dict(&mut self, items: Vec<Value>) -> Result<Value, String> {
        let dict = Value::Dict(Rc::default());
        self.set_items(&dict, items)?;
        Ok(dict)
    }

    /// Adds `items` to the list or set `target` (what is no list is left alone: an object).
    fn append(&mut self, target: &Value, items: Vec<Value>) -> Result<(), String> {
        for item in items {
            let item = self.settle(item)?;
            let Value::List(list) = target else { continue };
            let runs = match &item {
                Value::List(l) if !Rc::ptr_eq(l, list) => l.try_borrow().ok().and_then(|l| l.entries()),
                _ => None,
            };
            if let Ok(mut list) = list.try_borrow_mut() {
                self.copied += list.push(&item, runs) as u64;
            }
        }
        Ok(())
    }

    /// Adds the key, value pairs in `items` to the dict `target` (what is no dict is left
    /// alone: an object's state).
    fn set_items(&mut self, target: &Value, items: Vec<Value>) -> Result<(), String> {
        if items.len() % 2 != 0 {
            return Err("a key without a value".into());
        }
        let mut items = items.into_iter();
        while let (Some(key), Some(value)) = (items.next(), items.next()) {
            let key = self.settle(key)?;
            let settled = self.settle(value.clone())?;
            let (Value::Dict(dict), Value::Word(key)) = (target, key) else { continue };
            // A list that holds no entries stays itself as `device_traces`, for the error.
            let value =
                if key == Word::DeviceTraces && matches!(value, Value::List(_)) { value } else { settled };
            let Ok(mut d) = dict.try_borrow_mut() else { continue };
            match key {
                Word::Action => d.action = Some(if let Value::Word(w) = value { w } else { Word::Other }),
                Word::DeviceTraces => {
                    d.device_traces = Some(match value {
                        Value::None => Traces::None,
                        Value::List(list) => Traces::List(list),
                        _ => Traces::NotAList,
                    })
                }
                _ => {
                    let Some(i) = FIELDS.iter().position(|(word, _)| *word == key) else { continue };
                    (d.kinds[i], d.values[i]) = match value {
                        Value::None => (Kind::Absent, 0),
                        Value::Int(n) => (Kind::Int, n),
                        Value::TooBig => (Kind::TooBig, 0),
                        _ => (Kind::NotInt, 0),
                    };
                }
            }
        }
        Ok(())
    }

    fn memo_get(&mut self, id: u64) -> Result<(), String> {
        let value = self.memo.get(id).ok_or_else(|| format!("memo {id} was never stored"))?;
        self.push(value);
        Ok(())
    }

    fn memo_put(&mut self, id: u64) -> Result<(), String> {
        let value = self.top()?;
        let kept = match &value {
            Value::Dict(dict) => match dict.try_borrow_mut() {
                // An entry already: kept as one.
                Ok(d) if d.entry.is_some() => d.entry.map(Value::Entry),
                Ok(mut d) => {
                    d.memo = Some(id);
                    Some(value.clone())
                }
                Err(_) => None,
            },
            Value::List(list) => match list.try_borrow_mut() {
                Ok(mut l) if !matches!(l.items, Items::Other { .. }) => {
                    l.memo = Some(id);
                    Some(value.clone())
                }
                _ => None,
            },
            Value::Int(_) | Value::TooBig | Value::Entry(_) | Value::None => Some(value),
            Value::Word(word) if *word != Word::Other => Some(value),
            Value::Word(_) | Value::Other => None,
        };
        self.memo.put(id, kept);
        Ok(())
    }

    /// A string of `n` bytes: the word it is.
    fn word(&mut self, n: u64) -> Result<Value, String> {
        let bytes = self.input.bytes_up_to(n, LONGEST_WORD)?;
        Ok(Value::Word(bytes.map_or(Word::Other, |b| Word::of(&b))))
    }

    /// Runs opcode `op`; at `STOP`, the value returned.
    fn step(&mut self, op: u8) -> Result<Option<Value>, String> {
        match op {
            b'.' => return self.pop().map(Some),
            b'(' => self.marks.push(self.stack.len()),
            // POP: with nothing pushed since the last mark, that mark.
            b'0' => {
                if self.marks.last() == Some(&self.stack.len()) {
                    self.marks.pop();
                } else {
                    let value = self.pop()?;
                    self.discard(vec![value])?;
                }
            }
            b'1' => {
                let values = self.pop_mark()?;
                self.discard(values)?;
            }
            b'2' => {
                let top = self.top()?;
                self.push(top)
            }
            // Scalars.
            b'N' => self.push(Value::None),
            0x88 | 0x89 => self.push(Value::Other),
            b'I' => {
                let value = match self.input.text()?.as_deref() {
                    Some("00" | "01") => Value::Other,
                    text => text_int(text),
                };
                self.push(value)
            }
            b'L' => {
                let value = text_int(self.input.text()?.as_deref());
                self.push(value)
            }
            b'J' => {
                let value = i32::from_le_bytes(self.input.array()?);
                self.push(Value::Int(value.into()))
            }
            b'K' => {
                let value = self.input.u8()?;
                self.push(Value::Int(value.into()))
            }
            b'M' => {
                let value = u16::from_le_bytes(self.input.array()?);
                self.push(Value::Int(value.into()))
            }
            0x8a | 0x8b => {
                let n = if op == 0x8a {
                    self.input.u8()?.into()
                } else {
                    let n = i32::from_le_bytes(self.input.array()?);
                    u64::try_from(n).map_err(|_| "a negative length".to_string())?
                };
                let value = self.input.bytes_up_to(n, 16)?.map_or(Value::TooBig, |b| le_int(&b));
                self.push(value)
            }
            b'F' => {
                if let Some(text) = self.input.text()? {
                    text.trim().parse::<f64>().map_err(|_| "a bad FLOAT".to_string())?;
                }
                self.push(Value::Other)
            }
            b'G' => {
                self.input.skip(8)?;
                self.push(Value::Other)
            }
            // Strings and bytes.
            b'S' | b'V' => {
                let value = match self.input.line()? {
                    Some(bytes) => Word::of(text_string(&bytes, op == b'S')?.as_bytes()),
                    None => Word::Other,
                };
                self.push(Value::Word(value))
            }
            b'T' | b'X' => {
                let n = self.input.u32()?;
                let value = self.word(n.into())?;
                self.push(value)
            }
            b'U' | 0x8c => {
                let n = self.input.u8()?;
                let value = self.word(n.into())?;
                self.push(value)
            }
            0x8d => {
                let n = self.input.u64()?;
                let value = self.word(n)?;
                self.push(value)
            }
            b'B' | b'C' | 0x8e | 0x96 => {
                let n = match op {
                    b'B' => self.input.u32()?.into(),
                    b'C' => self.input.u8()?.into(),
                    _ => self.input.u64()?,
                };
                self.input.skip(n)?;
                self.push(Value::Other)
            }
            // Containers.
            b']' | b')' | 0x8f => self.push(Value::List(Rc::default())),
            b'}' => self.push(Value::Dict(Rc::default())),
            b'l' | b't' | 0x91 => {
                let items = self.pop_mark()?;
                let value = self.list(items)?;
                self.push(value)
            }
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                let at = self.stack.len().checked_sub(n).ok_or(UNDERFLOW)?;
                let items = self.stack.split_off(at);
                let value = self.list(items)?;
                self.push(value)
            }
            b'd' => {
                let items = self.pop_mark()?;
                let value = self.dict(items)?;
                self.push(value)
            }
            b'a' => {
                let item = self.pop()?;
                let target = self.top()?;
                self.append(&target, vec![item])?
            }
            b'e' | 0x90 => {
                let items = self.pop_mark()?;
                let target = self.top()?;
                self.append(&target, items)?
            }
            b's' => {
                let value = self.pop()?;
                let key = self.pop()?;
                let target = self.top()?;
                self.set_items(&target, vec![key, value])?
            }
            b'u' => {
                let items = self.pop_mark()?;
                let target = self.top()?;
                self.set_items(&target, items)?
            }
            // The memo.
            b'g' | b'p' => {
                let id = match text_int(self.input.text()?.as_deref()) {
                    Value::Int(id) => u64::try_from(id).map_err(|_| "a bad memo id".to_string())?,
                    _ => return Err("a bad memo id".into()),
                };
                if op == b'g' {
                    self.memo_get(id)?
                } else {
                    self.memo_put(id)?
                }
            }
            b'h' => {
                let id = self.input.u8()?;
                self.memo_get(id.into())?
            }
            b'j' => {
                let id = self.input.u32()?;
                self.memo_get(id.into())?
            }
            b'q' => {
                let id = self.input.u8()?;
                self.memo_put(id.into())?
            }
            b'r' => {
                let id = self.input.u32()?;
                self.memo_put(id.into())?
            }
            0x94 => self.memo_put(self.memo.stored.count)?,
            // What Python code would build: objects, not read.
            b'c' => {
                self.input.line()?;
                self.input.line()?;
                self.push(Value::Other)
            }
            b'i' => {
                self.input.line()?;
                self.input.line()?;
                let args = self.pop_mark()?;
                self.discard(args)?;
                self.push(Value::Other)
            }
            b'o' => {
                let args = self.pop_mark()?;
                self.discard(args)?;
                self.push(Value::Other)
            }
            b'P' => {
                self.input.line()?;
                self.push(Value::Other)
            }
            b'Q' | b'R' | 0x81 | 0x92 | 0x93 => {
                let popped = match op {
                    b'Q' => 1,
                    0x92 => 3,
                    _ => 2,
                };
                for _ in 0..popped {
                    let value = self.pop()?;
                    self.discard(vec![value])?;
                }
                self.push(Value::Other)
            }
            // BUILD: the object on the stack takes the state popped.
            b'b' => {
                let state = self.pop()?;
                self.discard(vec![state])?;
                self.top()?;
            }
            0x82..=0x84 => {
                self.input.skip(1 << (op - 0x82))?;
                self.push(Value::Other)
            }
            0x97 => self.push(Value::Other),
            0x98 => {
                self.top()?;
            }
            // Framing.
            0x80 => {
                let protocol = self.input.u8()?;
                if protocol > 5 {
                    return Err(format!("protocol {protocol} (this reads 0 to 5)"));
                }
            }
            0x95 => {
                self.input.u64()?;
            }
            _ => return Err("an unknown opcode".into()),
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(bytes: &[u8]) -> Result<Option<Snapshot>, String> {
        read_snapshot(bytes, &mut |_| {})
    }

    fn entries(snapshot: &Snapshot, device: usize) -> Vec<Entry> {
        snapshot.entries(device).collect()
    }

    /// Pickle protocol 0 to 5 opcodes, as Python writes them (bytes from `pickle.dumps`).
    #[test]
    fn reads_what_each_protocol_writes() {
        // pickle.dumps({'device_traces': [[{'action': 'alloc', 'addr': 2**40, 'size': -3,
        // 'stream': None, 'time_us': 7, 'f': 1.5, 'b': True, 's': 'caf\xe9 \u2603'}]]}, protocol=0)
        let p0 = b"(dp0\nVdevice_traces\np1\n(lp2\n(lp3\n(dp4\nVaction\np5\nValloc\np6\nsVaddr\np7\n\
                   L1099511627776L\nsVsize\np8\nI-3\nsVstream\np9\nNsVtime_us\np10\nI7\nsVf\np11\nF1.5\n\
                   sVb\np12\nI01\nsVs\np13\nVcaf\xe9 \\u2603\np14\nsaas.";
        // The same, protocol 4 (MEMOIZE, SHORT_BINUNICODE, LONG1, BININT, NEWTRUE, BINFLOAT, FRAME).
        let p4 = b"\x80\x04\x95\x82\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\rdevice_traces\x94]\x94]\x94}\x94(\
                   \x8c\x06action\x94\x8c\x05alloc\x94\x8c\x04addr\x94\x8a\x06\x00\x00\x00\x00\x00\x01\x8c\
                   \x04size\x94J\xfd\xff\xff\xff\x8c\x06stream\x94N\x8c\x07time_us\x94K\x07\x8c\x01f\x94G?\
                   \xf8\x00\x00\x00\x00\x00\x00\x8c\x01b\x94\x88\x8c\x01s\x94\x8c\tcaf\xc3\xa9 \xe2\x98\x83\
                   \x94uaas.";
        // Protocol 0 with the action escaped: '\u0066ree_requested'.
        let escaped = b"(dp0\nVdevice_traces\np1\n(lp2\n(lp3\n(dp4\nVaction\np5\nV\\u0066ree_requested\n\
                        p6\nsVaddr\np7\nI16\nsaas.";
        for bytes in [&p0[..], &p4[..]] {
            let snapshot = read(bytes).unwrap().unwrap();
            let want = Entry {
                action: Word::Alloc,
                addr: Some(1 << 40),
                size: Some(-3),
                stream: None,
                time_us: Some(7),
            };
            assert_eq!((snapshot.devices(), entries(&snapshot, 0)), (1, vec![want]));
        }
        let snapshot = read(escaped).unwrap().unwrap();
        assert_eq!(entries(&snapshot, 0)[0].action, Word::FreeRequested);
        assert_eq!(entries(&snapshot, 0)[0].addr, Some(16));
    }

    /// Issue 33: an object the pickle refers to again through its memo reads the same, and
    /// nesting costs no stack.
    #[test]
    fn memo_references_read_the_same_and_nesting_does_not_recurse() {
        // e = {'action': 'alloc', 'addr': 1}; t = [e, e]
        // pickle.dumps({'first': e, 'frames': [{'x': 1}], 'device_traces': [t, t]}, protocol=2)
        let shared = b"\x80\x02}q\x00(X\x05\x00\x00\x00firstq\x01}q\x02(X\x06\x00\x00\x00actionq\x03X\
                       \x05\x00\x00\x00allocq\x04X\x04\x00\x00\x00addrq\x05K\x01uX\x06\x00\x00\x00framesq\
                       \x06]q\x07}q\x08X\x01\x00\x00\x00xq\tK\x01saX\r\x00\x00\x00device_tracesq\n]q\x0b(]q\
                       \x0c(h\x02h\x02eh\x0ceu.";
        let snapshot = read(shared).unwrap().unwrap();
        let e = Entry { action: Word::Alloc, addr: Some(1), size: None, stream: None, time_us: None };
        assert_eq!(snapshot.devices(), 2);
        assert_eq!((entries(&snapshot, 0), entries(&snapshot, 1)), (vec![e, e], vec![e, e]));
        assert_eq!(snapshot.entries.len(), 1, "the entry referred to again is the same one");

        // Lists each in the one before: as deep as the stack may hold, and a million (refused
        // by the stack's bound, issue 52 #5, without recursing either).
        let nested = |depth: usize| {
            let mut deep = vec![b'('; depth];
            deep.extend(std::iter::repeat_n(b'l', depth));
            deep.push(b'.');
            read(&deep).err().unwrap()
        };
        assert_eq!(nested(STACK_MOST), "the pickle holds no dict");
        assert!(nested(1_000_000).contains("values at once on its stack"), "{}", nested(1_000_000));
    }

    /// What the import does not read is not kept: a dict without `action`, a list of them, a
    /// string, each stored in the memo and referred to again, reads back as nothing the
    /// import reads; entries and lists of entries stay.
    #[test]
    fn what_is_not_read_is_dropped_from_the_memo() {
        // frame = {'filename': 'train.py', 'line': 1}; e = {'action': 'alloc', 'frames': [frame]}
        // pickle.dumps({'device_traces': [[e, dict(e, frames=[frame, frame])]]}, protocol=4)
        let bytes = b"\x80\x04\x95q\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\rdevice_traces\x94]\x94]\x94(}\x94(\x8c\
                      \x06action\x94\x8c\x05alloc\x94\x8c\x06frames\x94]\x94}\x94(\x8c\x08filename\x94\x8c\x08train.py\
                      \x94\x8c\x04line\x94K\x01uau}\x94(h\x05h\x06h\x07]\x94(h\th\teueas.";
        let mut m = Machine {
            input: Input {
                inner: &bytes[..],
                buf: vec![0; 64],
                pos: 0,
                end: 0,
                base: 0,
                progress: &mut |_| {},
            },
            stack: Vec::new(),
            marks: Vec::new(),
            memo: Memo::default(),
            entries: Vec::new(),
            copied: 0,
        };
        let top = loop {
            let op = m.input.u8().unwrap();
            if let Some(top) = m.step(op).unwrap() {
                break top;
            }
        };
        assert_eq!(m.entries.len(), 2);
        // The top dict, its lists, the words 'device_traces', 'action' and 'alloc', and the
        // two entries (apart); not 'frames', the frames lists, the frame, 'filename',
        // 'train.py', 'line'.
        let mut kept: Vec<u64> = m.memo.kept.keys().copied().collect();
        kept.sort();
        assert_eq!(kept, [0, 1, 2, 3, 5, 6], "{:?}", m.memo.kept);
        let mut entries: Vec<(u32, u32)> = m.memo.entries.iter().map(|(id, e)| (*id, *e)).collect();
        entries.sort();
        assert_eq!(entries, [(4, 0), (13, 1)]);
        assert_eq!(m.memo.stored.count, 15);
        assert_eq!(m.memo.stored.ranges.len(), 1);
        drop(top);
    }

    /// An action string first stored as a frame's name (which the memo drops) and referred
    /// to again as an entry's action: the entry reads, its action another than those
    /// converted.
    #[test]
    fn an_action_the_memo_dropped_reads_as_another_action() {
        // pickle.dumps({'device_traces': [[{'action': 'alloc', 'addr': 1, 'frames': [{'name':
        // 'segment_alloc'}]}, {'action': 'segment_alloc', 'addr': 2}]]}, protocol=4)
        let bytes = b"\x80\x04\x95k\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\rdevice_traces\x94]\x94]\x94(}\x94(\x8c\
                      \x06action\x94\x8c\x05alloc\x94\x8c\x04addr\x94K\x01\x8c\x06frames\x94]\x94}\x94\x8c\x04name\
                      \x94\x8c\rsegment_alloc\x94sau}\x94(h\x05h\x0ch\x07K\x02ueas.";
        let snapshot = read(bytes).unwrap().unwrap();
        let actions: Vec<(Word, Option<i64>)> = snapshot.entries(0).map(|e| (e.action, e.addr)).collect();
        assert_eq!(actions, [(Word::Alloc, Some(1)), (Word::Other, Some(2))]);
    }

    #[test]
    fn bad_pickles_are_errors_naming_the_byte() {
        let cases: [(&[u8], &str); 8] = [
            (b"", "the file is empty"),
            (b"\x80\x04}", "ends before its STOP"),
            (b"\x80\x04h\x05.", "memo 5 was never stored (opcode 0x68 at byte 2)"),
            (b"\x80\x04a.", "stack runs out (opcode 0x61 at byte 2)"),
            (
                b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\xff",
                "ends early (at byte 11) (opcode 0x8d at byte 2)",
            ),
            (b"\x80\x04\xff", "an unknown opcode (opcode 0xff at byte 2)"),
            (
                b"\x80\x04}\x8c\rdevice_traces]]}\x8c\x06action\x8c\x05allocs\x8c\x04addr\x8c\x01xsaas.",
                "`device_traces[0][0]`: `addr` is not an integer",
            ),
            (b"\x80\x04}\x8c\rdevice_traces]]}aas.", "`device_traces[0]` is not a list of trace entries"),
        ];
        for (bytes, want) in cases {
            match read(bytes) {
                Err(e) => assert!(e.contains(want), "{bytes:?}: {e}"),
                Ok(_) => panic!("{bytes:?} read"),
            }
        }
        assert!(read(b"\x80\x09.").err().unwrap().contains("protocol 9"));
        assert!(read(b"\x80\x04}.").unwrap().is_none(), "no device_traces");
    }

    #[test]
    fn ids_are_ranges() {
        let mut ids = Ids::default();
        for id in [0, 1, 3, 2, 7, u64::MAX, 5, 6, 2] {
            ids.insert(id);
        }
        assert_eq!(ids.count, 8);
        let ranges: Vec<(u64, u64)> = ids.ranges.iter().map(|(a, b)| (*a, *b)).collect();
        assert_eq!(ranges, [(0, 3), (5, 7), (u64::MAX, u64::MAX)]);
        assert!(ids.contains(6) && !ids.contains(4) && !ids.contains(8) && ids.contains(u64::MAX));
    }
}
