//! `streamalloc import`: a PyTorch memory snapshot into a trace `replay` takes.
//!
//! `torch.cuda.memory._dump_snapshot(path)` pickles a dict whose `device_traces` holds, per
//! device, the entries `torch.cuda.memory._record_memory_history()` recorded, oldest first:
//! dicts with `action` (`alloc`, `free_requested`, `free_completed`, `segment_alloc`,
//! `segment_free`, `segment_map`, `segment_unmap`, `oom`, `snapshot`), `addr`, `size`,
//! `stream` and, in recent versions, `time_us`. Every other field (`frames`, `segments`,
//! ...) is ignored.
//!
//! `alloc` becomes an `allocate` row; `free_requested` (the moment the program released the
//! tensor) becomes a `free` row, or `free_completed` when no request was recorded for a
//! live block. A free of a block allocated before recording began (the history's ring
//! buffer dropped its allocation) is skipped and counted; blocks still allocated at the
//! dump stay live in the trace. Streams keep their values; the thread is 0 (snapshots do
//! not record threads); without `time_us` the time is the entry's index.
//!
//! The pickle is read here ([`Pickle::read`]), without running any of it: its stack machine
//! builds lists and dicts into arenas and refers to them by index, so an object the pickle
//! refers to again through its memo is the same object, and no nesting, however deep, costs
//! stack (reading, walking and dropping never recurse).

use std::collections::HashMap;
use std::path::Path;
use std::rc::Rc;

use streamalloc::trace::{Action, Record, TraceWriter};

/// One trace entry; absent fields are `None`.
#[derive(Debug)]
struct Entry {
    action: String,
    addr: Option<i64>,
    size: Option<i64>,
    stream: Option<i64>,
    time_us: Option<i64>,
}

/// What an import wrote and skipped.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// The snapshot's device whose entries were converted.
    pub device: usize,
    /// `allocate` rows.
    pub allocations: usize,
    /// `free` rows.
    pub frees: usize,
    /// Distinct streams.
    pub streams: usize,
    /// Allocations not freed by the end of the recording.
    pub live_at_end: usize,
    /// Frees of blocks allocated before recording began, skipped.
    pub unknown_frees: usize,
    /// Allocations at the address of a block still live: the block's free was not recorded,
    /// so one is written first.
    pub missed_frees: usize,
    /// Entries without `time_us`.
    pub untimed: usize,
}

/// Converts the snapshot at `input` into a trace at `output`; `device` picks the snapshot's
/// device (default: the only one with entries).
pub fn import(input: &Path, output: &Path, device: Option<usize>) -> Result<Summary, String> {
    let bytes = std::fs::read(input).map_err(|e| format!("{}: {e}", input.display()))?;
    let not_a_snapshot = |e: String| {
        format!(
            "{}: not a PyTorch memory snapshot (the pickle torch.cuda.memory._dump_snapshot writes): {e}",
            input.display()
        )
    };
    let pickle = Pickle::read(&bytes).map_err(not_a_snapshot)?;
    let traces = pickle.device_traces().map_err(not_a_snapshot)?.ok_or_else(|| {
        format!(
            "{}: the snapshot has no `device_traces`: record with \
             torch.cuda.memory._record_memory_history() before the workload runs",
            input.display()
        )
    })?;
    let used: Vec<usize> =
        (0..traces.len()).filter(|d| traces[*d].iter().any(|e| e.action == "alloc")).collect();
    let device = match (device, used.as_slice()) {
        (Some(d), _) if d < traces.len() => d,
        (Some(d), _) => {
            return Err(format!("{}: --gpu {d}: the snapshot has {} devices", input.display(), traces.len()))
        }
        (None, [d]) => *d,
        (None, []) => return Err(format!("{}: the snapshot recorded no allocation", input.display())),
        (None, _) => {
            let list: Vec<String> = used.iter().map(ToString::to_string).collect();
            return Err(format!(
                "{}: the snapshot has allocations on devices {}: choose one with --gpu",
                input.display(),
                list.join(", ")
            ));
        }
    };
    let mut writer = TraceWriter::create(output).map_err(|e| e.to_string())?;
    let summary = convert(&traces[device], device, |r| writer.write(r).map_err(|e| e.to_string()))?;
    writer.finish().map_err(|e| e.to_string())?;
    Ok(summary)
}

/// Converts `entries` (one device's), passing each row to `write`.
fn convert(
    entries: &[Entry],
    device: usize,
    mut write: impl FnMut(&Record) -> Result<(), String>,
) -> Result<Summary, String> {
    let mut summary = Summary { device, ..Summary::default() };
    // Live block address -> (size, whether its free was requested).
    let mut live: HashMap<u64, (usize, bool)> = HashMap::new();
    let mut streams: Vec<u64> = Vec::new();
    for (index, e) in entries.iter().enumerate() {
        let action = match e.action.as_str() {
            "alloc" => Action::Allocate,
            "free_requested" | "free_completed" => Action::Free,
            _ => continue,
        };
        let field = |value: Option<i64>, name: &str| {
            value.ok_or_else(|| format!("entry {index} (`{}`) has no `{name}`", e.action))
        };
        let ptr = field(e.addr, "addr")? as u64;
        let stream = e.stream.unwrap_or(0) as u64;
        let time_us = match e.time_us {
            Some(t) => t as u64,
            None => {
                summary.untimed += 1;
                index as u64
            }
        };
        let mut record = Record { thread: 0, time_us, action, ptr, size: 0, stream };
        match action {
            Action::Allocate => {
                let size = usize::try_from(field(e.size, "size")?)
                    .map_err(|_| format!("entry {index} (`alloc`) has a negative size"))?;
                // A block whose free was requested (and written) may be reused before its
                // completion is recorded; one whose free was not recorded is freed first.
                if let Some((old, false)) = live.remove(&ptr) {
                    summary.missed_frees += 1;
                    summary.frees += 1;
                    write(&Record { action: Action::Free, size: old, ..record })?;
                }
                live.insert(ptr, (size, false));
                if !streams.contains(&stream) {
                    streams.push(stream);
                }
                summary.allocations += 1;
                record.size = size;
                write(&record)?;
            }
            _ => match live.get_mut(&ptr) {
                // A request, or a completion with no request recorded: the free.
                Some((size, requested)) if !*requested => {
                    record.size = *size;
                    if e.action == "free_requested" {
                        *requested = true;
                    } else {
                        live.remove(&ptr);
                    }
                    summary.frees += 1;
                    write(&record)?;
                }
                // The completion of a recorded request.
                Some(_) => {
                    live.remove(&ptr);
                }
                None if e.action == "free_requested" => summary.unknown_frees += 1,
                None => {}
            },
        }
    }
    summary.streams = streams.len();
    summary.live_at_end = live.values().filter(|(_, requested)| !requested).count();
    Ok(summary)
}

/// A value of a pickle. Lists, tuples, sets and dicts live in the [`Pickle`]'s arenas and
/// are referred to by index: a value owns nothing nested, so neither reading, walking nor
/// dropping one recurses, however deep the pickle nests, and an object the pickle refers to
/// again (its memo) is the same object, shared.
#[derive(Clone, Debug)]
enum Value {
    None,
    /// An integer (`i128` holds every one `LONG1` writes in up to 16 bytes).
    Int(i128),
    /// An integer too large for `i128`.
    BigInt,
    Str(Rc<str>),
    /// A list, tuple or set: an index into [`Pickle::seqs`].
    Seq(usize),
    /// A dict: an index into [`Pickle::dicts`].
    Dict(usize),
    /// What the import does not read: a bool, a float, bytes, or anything Python code would
    /// build (a class instance, a global).
    Other,
}

/// A pickle read into values, without running any of it.
#[derive(Debug)]
struct Pickle {
    seqs: Vec<Vec<Value>>,
    dicts: Vec<Vec<(Value, Value)>>,
    /// The value the pickle ends with (`STOP`).
    top: Value,
}

/// The bytes of a pickle and where the reading is.
struct Bytes<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Bytes<'a> {
    fn take(&mut self, n: u64) -> Result<&'a [u8], String> {
        let end =
            usize::try_from(n).ok().and_then(|n| self.pos.checked_add(n)).filter(|e| *e <= self.data.len());
        let end = end.ok_or_else(|| format!("the pickle ends early (at byte {})", self.data.len()))?;
        let bytes = &self.data[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N as u64)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A text argument: the bytes up to the next newline.
    fn line_bytes(&mut self) -> Result<&'a [u8], String> {
        let rest = &self.data[self.pos..];
        let len =
            rest.iter().position(|b| *b == b'\n').ok_or("the pickle ends early (in a text argument)")?;
        self.pos += len + 1;
        Ok(&rest[..len])
    }

    /// A text argument that is ASCII (a number, a name).
    fn line(&mut self) -> Result<&'a str, String> {
        std::str::from_utf8(self.line_bytes()?).map_err(|_| "a text argument is not ASCII".to_string())
    }
}

/// An integer written as text (`I`, `L`, `g`, `p`: decimal, a trailing `L` allowed).
fn text_int(text: &str) -> Value {
    let text = text.trim().trim_end_matches('L');
    match text.parse::<i128>() {
        Ok(n) => Value::Int(n),
        Err(_) if text.trim_start_matches(['-', '+']).bytes().all(|b| b.is_ascii_digit()) => Value::BigInt,
        Err(_) => Value::Other,
    }
}

/// A little-endian two's complement integer (`LONG1`, `LONG4`).
fn le_int(bytes: &[u8]) -> Value {
    if bytes.len() > 16 {
        return Value::BigInt;
    }
    let fill = if bytes.last().is_some_and(|b| b & 0x80 != 0) { 0xff } else { 0 };
    let mut full = [fill; 16];
    full[..bytes.len()].copy_from_slice(bytes);
    Value::Int(i128::from_le_bytes(full))
}

/// A protocol 0 `UNICODE` argument (raw-unicode-escape: Latin-1 with `\uXXXX` and
/// `\UXXXXXXXX` escapes) or `STRING` argument (a quoted Python literal, read as Latin-1;
/// escapes other than `\\`, `\'`, `\"`, `\n`, `\t`, `\r` and `\xNN` are kept as written).
fn text_string(bytes: &[u8], quoted: bool) -> Result<Rc<str>, String> {
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
    Ok(out.into())
}

impl Pickle {
    /// Reads `data`, a pickle of any protocol (0 to 5), without running any of it: what
    /// would run Python code (globals, `REDUCE`, `BUILD`, ...) becomes [`Value::Other`]. An
    /// unknown opcode, a reference to nothing in the memo, or a stack that runs out is an
    /// error naming the opcode and its byte.
    fn read(data: &[u8]) -> Result<Self, String> {
        if data.is_empty() {
            return Err("the file is empty".into());
        }
        let mut m = Machine {
            bytes: Bytes { data, pos: 0 },
            stack: Vec::new(),
            marks: Vec::new(),
            memo: HashMap::new(),
            seqs: Vec::new(),
            dicts: Vec::new(),
        };
        loop {
            let at = m.bytes.pos;
            let op = m.bytes.u8().map_err(|_| "the pickle ends before its STOP opcode".to_string())?;
            match m.step(op) {
                Ok(Some(top)) => return Ok(Pickle { seqs: m.seqs, dicts: m.dicts, top }),
                Ok(None) => {}
                Err(e) => return Err(format!("{e} (opcode {op:#04x} at byte {at})")),
            }
        }
    }

    /// The value of `key` in the dict `dict`, if `dict` is a dict that has it.
    fn get(&self, dict: &Value, key: &str) -> Option<&Value> {
        let Value::Dict(d) = dict else { return None };
        self.dicts[*d].iter().rev().find(|(k, _)| matches!(k, Value::Str(s) if &**s == key)).map(|(_, v)| v)
    }

    /// The items of `value` when it is a list or tuple.
    fn items(&self, value: &Value) -> Option<&[Value]> {
        match value {
            Value::Seq(i) => Some(&self.seqs[*i]),
            _ => None,
        }
    }

    /// The snapshot's `device_traces`: per device, its entries; `None` when it has none
    /// (absent or `None`). An error says what is not as torch writes it.
    fn device_traces(&self) -> Result<Option<Vec<Vec<Entry>>>, String> {
        if !matches!(self.top, Value::Dict(_)) {
            return Err("the pickle holds no dict".into());
        }
        let traces = match self.get(&self.top, "device_traces") {
            None | Some(Value::None) => return Ok(None),
            Some(traces) => traces,
        };
        let devices = self.items(traces).ok_or("`device_traces` is not a list")?;
        let mut out = Vec::with_capacity(devices.len());
        for (d, device) in devices.iter().enumerate() {
            let entries = self.items(device).ok_or_else(|| format!("`device_traces[{d}]` is not a list"))?;
            let entry = |(i, e): (usize, &Value)| {
                let place = || format!("`device_traces[{d}][{i}]`");
                let action = match self.get(e, "action") {
                    Some(Value::Str(s)) => s.to_string(),
                    _ if !matches!(e, Value::Dict(_)) => return Err(format!("{} is not a dict", place())),
                    _ => return Err(format!("{} has no `action` string", place())),
                };
                let int = |name: &str| match self.get(e, name) {
                    None | Some(Value::None) => Ok(None),
                    Some(Value::Int(n)) => i64::try_from(*n)
                        .map(Some)
                        .map_err(|_| format!("{}: `{name}` is out of range", place())),
                    Some(_) => Err(format!("{}: `{name}` is not an integer", place())),
                };
                Ok(Entry {
                    action,
                    addr: int("addr")?,
                    size: int("size")?,
                    stream: int("stream")?,
                    time_us: int("time_us")?,
                })
            };
            out.push(entries.iter().enumerate().map(entry).collect::<Result<Vec<_>, String>>()?);
        }
        Ok(Some(out))
    }
}

/// The pickle machine: its stack, marks and memo, and the arenas of what it built.
struct Machine<'a> {
    bytes: Bytes<'a>,
    stack: Vec<Value>,
    /// Stack lengths at each `MARK` still open.
    marks: Vec<usize>,
    memo: HashMap<u64, Value>,
    seqs: Vec<Vec<Value>>,
    dicts: Vec<Vec<(Value, Value)>>,
}

/// What an opcode finds when the stack (or its part since the last mark) runs out.
const UNDERFLOW: &str = "the pickle's stack runs out";

impl Machine<'_> {
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

    /// A new list, tuple or set of `items`.
    fn seq(&mut self, items: Vec<Value>) -> Value {
        self.seqs.push(items);
        Value::Seq(self.seqs.len() - 1)
    }

    /// A new dict of the key, value pairs in `items`.
    fn dict(&mut self, items: Vec<Value>) -> Result<Value, String> {
        self.dicts.push(Vec::new());
        let dict = Value::Dict(self.dicts.len() - 1);
        self.set_items(&dict, items)?;
        Ok(dict)
    }

    /// Adds `items` to the list or set `target` (what is no list is left alone: an object).
    fn append(&mut self, target: &Value, items: Vec<Value>) {
        if let Value::Seq(i) = target {
            self.seqs[*i].extend(items);
        }
    }

    /// Adds the key, value pairs in `items` to the dict `target` (what is no dict is left
    /// alone: an object's state).
    fn set_items(&mut self, target: &Value, items: Vec<Value>) -> Result<(), String> {
        if items.len() % 2 != 0 {
            return Err("a key without a value".into());
        }
        if let Value::Dict(i) = target {
            let mut items = items.into_iter();
            while let (Some(k), Some(v)) = (items.next(), items.next()) {
                self.dicts[*i].push((k, v));
            }
        }
        Ok(())
    }

    fn memo_get(&mut self, id: u64) -> Result<(), String> {
        let value = self.memo.get(&id).cloned().ok_or_else(|| format!("memo {id} was never stored"))?;
        self.push(value);
        Ok(())
    }

    fn memo_put(&mut self, id: u64) -> Result<(), String> {
        let value = self.top()?;
        self.memo.insert(id, value);
        Ok(())
    }

    /// A string of `n` bytes of UTF-8 (`lossy` for protocol 0 and 1 `STRING`s, which can be
    /// any bytes).
    fn string(&mut self, n: u64) -> Result<Value, String> {
        let bytes = self.bytes.take(n)?;
        let text = std::str::from_utf8(bytes).map_err(|_| "a string is not UTF-8".to_string())?;
        Ok(Value::Str(text.into()))
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
                    self.pop()?;
                }
            }
            b'1' => {
                self.pop_mark()?;
            }
            b'2' => {
                let top = self.top()?;
                self.push(top)
            }
            // Scalars.
            b'N' => self.push(Value::None),
            0x88 => self.push(Value::Other),
            0x89 => self.push(Value::Other),
            b'I' => {
                let value = match self.bytes.line()? {
                    "00" => Value::Other,
                    "01" => Value::Other,
                    text => text_int(text),
                };
                self.push(value)
            }
            b'L' => {
                let value = text_int(self.bytes.line()?);
                self.push(value)
            }
            b'J' => {
                let value = i32::from_le_bytes(self.bytes.array()?);
                self.push(Value::Int(value.into()))
            }
            b'K' => {
                let value = self.bytes.u8()?;
                self.push(Value::Int(value.into()))
            }
            b'M' => {
                let value = u16::from_le_bytes(self.bytes.array()?);
                self.push(Value::Int(value.into()))
            }
            0x8a => {
                let n = self.bytes.u8()?;
                let value = le_int(self.bytes.take(n.into())?);
                self.push(value)
            }
            0x8b => {
                let n = i32::from_le_bytes(self.bytes.array()?);
                let n = u64::try_from(n).map_err(|_| "a negative length".to_string())?;
                let value = le_int(self.bytes.take(n)?);
                self.push(value)
            }
            b'F' => {
                self.bytes.line()?.trim().parse::<f64>().map_err(|_| "a bad FLOAT".to_string())?;
                self.push(Value::Other)
            }
            b'G' => {
                self.bytes.take(8)?;
                self.push(Value::Other)
            }
            // Strings and bytes.
            b'S' => {
                let value = text_string(self.bytes.line_bytes()?, true)?;
                self.push(Value::Str(value))
            }
            b'V' => {
                let value = text_string(self.bytes.line_bytes()?, false)?;
                self.push(Value::Str(value))
            }
            b'T' | b'X' => {
                let n = self.bytes.u32()?;
                let value = if op == b'T' { self.latin1(n.into())? } else { self.string(n.into())? };
                self.push(value)
            }
            b'U' => {
                let n = self.bytes.u8()?;
                let value = self.latin1(n.into())?;
                self.push(value)
            }
            0x8c => {
                let n = self.bytes.u8()?;
                let value = self.string(n.into())?;
                self.push(value)
            }
            0x8d => {
                let n = self.bytes.u64()?;
                let value = self.string(n)?;
                self.push(value)
            }
            b'B' | b'C' | 0x8e | 0x96 => {
                let n = match op {
                    b'B' => self.bytes.u32()?.into(),
                    b'C' => self.bytes.u8()?.into(),
                    _ => self.bytes.u64()?,
                };
                self.bytes.take(n)?;
                self.push(Value::Other)
            }
            // Containers.
            b']' | b')' | 0x8f => {
                let value = self.seq(Vec::new());
                self.push(value)
            }
            b'}' => {
                let value = self.dict(Vec::new())?;
                self.push(value)
            }
            b'l' | b't' | 0x91 => {
                let items = self.pop_mark()?;
                let value = self.seq(items);
                self.push(value)
            }
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                let at = self.stack.len().checked_sub(n).ok_or(UNDERFLOW)?;
                let items = self.stack.split_off(at);
                let value = self.seq(items);
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
                self.append(&target, vec![item])
            }
            b'e' | 0x90 => {
                let items = self.pop_mark()?;
                let target = self.top()?;
                self.append(&target, items)
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
                let Value::Int(id) = text_int(self.bytes.line()?) else { return Err("a bad memo id".into()) };
                let id = u64::try_from(id).map_err(|_| "a bad memo id".to_string())?;
                if op == b'g' {
                    self.memo_get(id)?
                } else {
                    self.memo_put(id)?
                }
            }
            b'h' => {
                let id = self.bytes.u8()?;
                self.memo_get(id.into())?
            }
            b'j' => {
                let id = self.bytes.u32()?;
                self.memo_get(id.into())?
            }
            b'q' => {
                let id = self.bytes.u8()?;
                self.memo_put(id.into())?
            }
            b'r' => {
                let id = self.bytes.u32()?;
                self.memo_put(id.into())?
            }
            0x94 => self.memo_put(self.memo.len() as u64)?,
            // What Python code would build: objects, not read.
            b'c' => {
                self.bytes.line()?;
                self.bytes.line()?;
                self.push(Value::Other)
            }
            b'i' => {
                self.bytes.line()?;
                self.bytes.line()?;
                self.pop_mark()?;
                self.push(Value::Other)
            }
            b'o' => {
                self.pop_mark()?;
                self.push(Value::Other)
            }
            b'P' => {
                self.bytes.line()?;
                self.push(Value::Other)
            }
            b'Q' | b'R' | 0x81 | 0x92 | 0x93 => {
                let popped = match op {
                    b'Q' => 1,
                    0x92 => 3,
                    _ => 2,
                };
                for _ in 0..popped {
                    self.pop()?;
                }
                self.push(Value::Other)
            }
            // BUILD: the object on the stack takes the state popped.
            b'b' => {
                self.pop()?;
                self.top()?;
            }
            0x82..=0x84 => {
                self.bytes.take(1 << (op - 0x82))?;
                self.push(Value::Other)
            }
            0x97 => self.push(Value::Other),
            0x98 => {
                self.top()?;
            }
            // Framing.
            0x80 => {
                let protocol = self.bytes.u8()?;
                if protocol > 5 {
                    return Err(format!("protocol {protocol} (this reads 0 to 5)"));
                }
            }
            0x95 => {
                self.bytes.u64()?;
            }
            _ => return Err("an unknown opcode".into()),
        }
        Ok(None)
    }

    /// A protocol 0 or 1 byte string (`BINSTRING`, `SHORT_BINSTRING`) of `n` bytes, read as
    /// Latin-1.
    fn latin1(&mut self, n: u64) -> Result<Value, String> {
        Ok(Value::Str(self.bytes.take(n)?.iter().map(|b| char::from(*b)).collect::<String>().into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(action: &str, addr: i64, size: i64) -> Entry {
        Entry { action: action.into(), addr: Some(addr), size: Some(size), stream: Some(0), time_us: None }
    }

    fn rows(entries: &[Entry]) -> (Summary, Vec<Record>) {
        let mut out = Vec::new();
        let summary = convert(entries, 0, |r| {
            out.push(*r);
            Ok(())
        })
        .unwrap();
        (summary, out)
    }

    #[test]
    fn requests_are_the_frees_and_completions_only_close_them() {
        let (s, out) = rows(&[
            entry("free_requested", 0x10, 4), // allocated before recording began
            entry("free_completed", 0x10, 4),
            entry("segment_alloc", 0x100, 1024),
            entry("alloc", 0x100, 8),
            entry("free_requested", 0x100, 8),
            entry("alloc", 0x200, 16),
            entry("free_completed", 0x100, 8),
            entry("alloc", 0x100, 32),
            entry("free_completed", 0x200, 16), // completion without a recorded request
            entry("alloc", 0x300, 64),          // live at the end
            entry("alloc", 0x300, 64),          // its free was not recorded
        ]);
        let actions: Vec<(Action, u64, usize)> = out.iter().map(|r| (r.action, r.ptr, r.size)).collect();
        assert_eq!(
            actions,
            [
                (Action::Allocate, 0x100, 8),
                (Action::Free, 0x100, 8),
                (Action::Allocate, 0x200, 16),
                (Action::Allocate, 0x100, 32),
                (Action::Free, 0x200, 16),
                (Action::Allocate, 0x300, 64),
                (Action::Free, 0x300, 64),
                (Action::Allocate, 0x300, 64),
            ]
        );
        assert_eq!((s.allocations, s.frees, s.unknown_frees, s.missed_frees), (5, 3, 1, 1));
        assert_eq!((s.live_at_end, s.untimed, s.streams), (2, 10, 1), "the segment entry is not counted");
        assert_eq!(out[0].time_us, 3, "untimed entries are timed by their index");
    }

    #[test]
    fn an_alloc_without_an_address_is_an_error_naming_the_entry() {
        let mut e = entry("alloc", 0, 8);
        e.addr = None;
        let err = convert(&[entry("snapshot", 0, 0), e], 0, |_| Ok(())).unwrap_err();
        assert_eq!(err, "entry 1 (`alloc`) has no `addr`");
    }

    /// A block whose free was requested (and written) and whose address an allocation
    /// reuses before the completion is recorded: its free is not written twice.
    #[test]
    fn a_requested_free_is_not_written_again_when_the_address_is_reused() {
        let (s, out) =
            rows(&[entry("alloc", 0x100, 8), entry("free_requested", 0x100, 8), entry("alloc", 0x100, 8)]);
        let actions: Vec<Action> = out.iter().map(|r| r.action).collect();
        assert_eq!(actions, [Action::Allocate, Action::Free, Action::Allocate]);
        assert_eq!((s.frees, s.missed_frees), (1, 0));
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
        for bytes in [&p0[..], &p4[..]] {
            let pickle = Pickle::read(bytes).unwrap();
            let traces = pickle.device_traces().unwrap().unwrap();
            let e = &traces[0][0];
            let fields = (e.action.as_str(), e.addr, e.size, e.stream, e.time_us);
            assert_eq!(fields, ("alloc", Some(1 << 40), Some(-3), None, Some(7)));
            let devices = pickle.items(pickle.get(&pickle.top, "device_traces").unwrap()).unwrap();
            let entry = &pickle.items(&devices[0]).unwrap()[0];
            assert!(matches!(pickle.get(entry, "s"), Some(Value::Str(s)) if &**s == "caf\u{e9} \u{2603}"));
        }
    }

    /// Issue 33: an object the pickle refers to again through its memo is the same object,
    /// and nesting costs no stack.
    #[test]
    fn memo_references_share_and_nesting_does_not_recurse() {
        // d = {'x': 1}; pickle.dumps({'a': d, 'b': [d, d]}, protocol=2)
        let shared = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01}q\x02X\x01\x00\x00\x00xq\x03K\x01sX\x01\
                       \x00\x00\x00bq\x04]q\x05(h\x02h\x02eu.";
        let pickle = Pickle::read(shared).unwrap();
        let a = pickle.get(&pickle.top, "a").unwrap();
        let b = pickle.items(pickle.get(&pickle.top, "b").unwrap()).unwrap();
        for v in [a, &b[0], &b[1]] {
            assert!(matches!(pickle.get(v, "x"), Some(Value::Int(1))), "{v:?}");
        }
        // A million lists, each in the one before.
        let depth = 1_000_000;
        let mut deep = vec![b'('; depth];
        deep.extend(std::iter::repeat_n(b'l', depth));
        deep.push(b'.');
        let pickle = Pickle::read(&deep).unwrap();
        assert_eq!(pickle.seqs.len(), depth);
        assert_eq!(pickle.device_traces().unwrap_err(), "the pickle holds no dict");
    }

    #[test]
    fn bad_pickles_are_errors_naming_the_byte() {
        let cases: [(&[u8], &str); 6] = [
            (b"", "the file is empty"),
            (b"\x80\x04}", "ends before its STOP"),
            (b"\x80\x04h\x05.", "memo 5 was never stored (opcode 0x68 at byte 2)"),
            (b"\x80\x04a.", "stack runs out (opcode 0x61 at byte 2)"),
            (b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\xff", "ends early"),
            (b"\x80\x04\xff", "an unknown opcode (opcode 0xff at byte 2)"),
        ];
        for (bytes, want) in cases {
            match Pickle::read(bytes) {
                Err(e) => assert!(e.contains(want), "{bytes:?}: {e}"),
                Ok(_) => panic!("{bytes:?} read"),
            }
        }
        assert!(Pickle::read(b"\x80\x09.").unwrap_err().contains("protocol 9"));
    }
}
