//! User text quoted in errors: bounded and escaped, so that a configuration value or a line
//! of a file, however long or hostile, neither floods a log nor drives a terminal.

/// The most bytes of a line, or of any other text read or given, that an error quotes
/// ([`excerpt`]).
pub const EXCERPT: usize = 120;

/// `text` as an error may quote it: at most [`EXCERPT`] bytes, control characters escaped.
/// See [`excerpt_within`].
pub fn excerpt(text: &str) -> String {
    excerpt_within(text, EXCERPT)
}

/// `text` as an error may quote it: control characters (and the invisible ones that
/// reorder text) written as escapes (`\x1b`, `\u{202e}`), so that none reaches a terminal,
/// and at most `limit` bytes of that, cut at a character or escape, followed by
/// `... (N bytes in all)` (N: the length of `text`) when cut.
///
/// ```
/// use streamalloc::text::excerpt_within;
///
/// assert_eq!(excerpt_within("red\x1b[31m", 20), "red\\x1b[31m");
/// assert_eq!(excerpt_within(&"9".repeat(1000), 4), "9999... (1000 bytes in all)");
/// ```
pub fn excerpt_within(text: &str, limit: usize) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(text.len().min(limit) + 32);
    let mut escape = String::new();
    for (at, c) in text.char_indices() {
        let shown = if c.is_control() || is_reordering(c) {
            escape.clear();
            let _ = if c.is_ascii() {
                write!(escape, "\\x{:02x}", u32::from(c))
            } else {
                write!(escape, "\\u{{{:x}}}", u32::from(c))
            };
            escape.as_str()
        } else {
            &text[at..at + c.len_utf8()]
        };
        if out.len() + shown.len() > limit {
            let _ = write!(out, "... ({} bytes in all)", text.len());
            return out;
        }
        out.push_str(shown);
    }
    out
}

/// Whether `c` is one of the invisible characters that reorder the text around them
/// (bidirectional marks, embeddings, overrides and isolates).
fn is_reordering(c: char) -> bool {
    matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}
