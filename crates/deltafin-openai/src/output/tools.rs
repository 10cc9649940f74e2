//! The tools block of a chat answer (docs/SERVER.md "Tool calls"), parsed on token ids and
//! turned into OpenAI tool-call pieces as it is generated.
//!
//! The block has the shape the renderer gives assistant history (docs/K3.md §8.4):
//! `<|open|>tools<|sep|>`, then per call `<|open|>call tool="NAME" index="k"<|sep|>` with either
//! argument pieces `<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>` or one
//! raw `<|open|>json type="object"<|sep|>RAW<|close|>json<|sep|>`, then `<|close|>call<|sep|>`;
//! the block ends with `<|close|>tools<|sep|>`. The assembler finds the markers (on ids) and
//! hands this parser each marker's tag text and every other token.
//!
//! Arguments are built as JSON object text while they stream: `{"K":` when an argument opens,
//! a `string` value JSON-escaped token by token between quotes, any other value buffered to
//! its close and written as its JSON text when it parses (else as a JSON string of the text);
//! `}` at the call's close (`{}` for a call without arguments). A raw `json` block's text passes
//! through as it comes. Nothing is invented: a call cut off keeps only what was generated.

use super::delta::{ToolCallDelta, push_tool_piece};
use deltafin_k3::text::tokenizer::{StreamDecoder, Tokenizer, TokenizerError, is_py_space};
use serde_json::Value;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// What a marker or token did to the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// Parsed; the block goes on.
    Continue,
    /// A call just closed.
    CallClosed,
    /// `<|close|>tools<|sep|>`: the block is complete.
    Closed,
    /// This marker or token does not fit the block's structure.
    Broken,
}

/// Call ids unique within the process (and across restarts, by the clock): `call_` and 24
/// hex digits (start time, assembler sequence, call position).
pub(super) struct CallIds {
    base: String,
}

impl CallIds {
    pub(super) fn new() -> CallIds {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let seq = SEQ.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff_ffff;
        let time = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0) as u32;
        CallIds {
            base: format!("call_{time:08x}{seq:012x}"),
        }
    }

    fn id(&self, index: usize) -> String {
        format!("{}{:04x}", self.base, index & 0xffff)
    }
}

/// Give every call that `calls` opens a new unique id (an answer replayed from the
/// response memo is a new response: its call ids are its own).
pub(crate) fn renew_call_ids(calls: &mut [ToolCallDelta]) {
    let ids = CallIds::new();
    for c in calls.iter_mut().filter(|c| c.id.is_some()) {
        c.id = Some(ids.id(c.index));
    }
}

/// The value of the argument (or raw block) being generated.
enum OpenValue {
    /// A `string` argument: JSON-escaped as it streams.
    Str,
    /// Any other type: buffered to its close.
    Other(String),
    /// A raw `json` block: passed through.
    Raw,
}

struct Call {
    index: usize,
    /// Argument pieces opened so far.
    args: usize,
    /// Whether a raw `json` block was opened.
    raw: bool,
    value: Option<OpenValue>,
}

/// The parser of one tools block.
pub(super) struct ToolBlock {
    calls: usize,
    call: Option<Call>,
    decoder: StreamDecoder,
}

impl ToolBlock {
    /// A block before its first call.
    pub(super) fn new() -> ToolBlock {
        ToolBlock {
            calls: 0,
            call: None,
            decoder: StreamDecoder::new(),
        }
    }

    /// Calls announced by this block.
    pub(super) fn calls(&self) -> usize {
        self.calls
    }

    fn args(out: &mut Vec<ToolCallDelta>, index: usize, text: impl Into<String>) {
        let arguments = text.into();
        if arguments.is_empty() {
            return;
        }
        push_tool_piece(
            out,
            ToolCallDelta {
                index,
                arguments,
                ..Default::default()
            },
        );
    }

    /// A complete marker: `opening` (`<|open|>`) or not, and its tag text between the marker
    /// id and `<|sep|>`.
    pub(super) fn marker(
        &mut self,
        opening: bool,
        tag: &str,
        ids: &CallIds,
        out: &mut Vec<ToolCallDelta>,
    ) -> Step {
        let Some((name, attrs)) = parse_tag(tag) else {
            return Step::Broken;
        };
        let attr = |key: &str| {
            attrs
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
        };
        match (opening, name, self.call.as_mut()) {
            (true, "call", None) => {
                let Some(tool) = attr("tool").filter(|t| !t.is_empty()) else {
                    return Step::Broken;
                };
                let index = self.calls;
                self.calls += 1;
                out.push(ToolCallDelta {
                    index,
                    id: Some(ids.id(index)),
                    name: Some(tool.to_string()),
                    arguments: String::new(),
                });
                self.call = Some(Call {
                    index,
                    args: 0,
                    raw: false,
                    value: None,
                });
                Step::Continue
            }
            (false, "tools", None) => Step::Closed,
            (true, "argument", Some(call)) if call.value.is_none() && !call.raw => {
                let Some(key) = attr("key") else {
                    return Step::Broken;
                };
                let mut text = String::from(if call.args == 0 { "{" } else { "," });
                text += &json_string(key);
                text.push(':');
                call.args += 1;
                call.value = Some(if attr("type") == Some("string") {
                    text.push('"');
                    OpenValue::Str
                } else {
                    OpenValue::Other(String::new())
                });
                Self::args(out, call.index, text);
                Step::Continue
            }
            (true, "json", Some(call)) if call.value.is_none() && !call.raw && call.args == 0 => {
                call.raw = true;
                call.value = Some(OpenValue::Raw);
                Step::Continue
            }
            (false, "argument", Some(call))
                if matches!(call.value, Some(OpenValue::Str | OpenValue::Other(_))) =>
            {
                let tail = std::mem::take(&mut self.decoder).finish();
                let text = match call.value.take() {
                    Some(OpenValue::Str) => json_fragment(&tail) + "\"",
                    Some(OpenValue::Other(mut buf)) => {
                        buf += &tail;
                        let trimmed = buf.trim_matches(is_py_space);
                        if serde_json::from_str::<Value>(trimmed).is_ok() {
                            trimmed.to_string()
                        } else {
                            json_string(&buf)
                        }
                    }
                    _ => String::new(),
                };
                Self::args(out, call.index, text);
                Step::Continue
            }
            (false, "json", Some(call)) if matches!(call.value, Some(OpenValue::Raw)) => {
                let tail = std::mem::take(&mut self.decoder).finish();
                call.value = None;
                Self::args(out, call.index, tail);
                Step::Continue
            }
            (false, "call", Some(call)) if call.value.is_none() => {
                let close = match (call.args, call.raw) {
                    (0, false) => "{}",
                    (0, true) => "",
                    _ => "}",
                };
                Self::args(out, call.index, close);
                self.call = None;
                Step::CallClosed
            }
            _ => Step::Broken,
        }
    }

    /// An ordinary token (text). Inside a value it is part of the value; between the block's
    /// markers only whitespace is allowed (and carries nothing).
    pub(super) fn text(
        &mut self,
        tok: &Tokenizer,
        id: u32,
        out: &mut Vec<ToolCallDelta>,
    ) -> Result<Step, TokenizerError> {
        let Some(call) = self.call.as_mut().filter(|c| c.value.is_some()) else {
            return Ok(if is_blank(tok, id) {
                Step::Continue
            } else {
                Step::Broken
            });
        };
        let piece = self.decoder.push(tok, id)?;
        let text = match &mut call.value {
            Some(OpenValue::Str) => json_fragment(&piece),
            Some(OpenValue::Other(buf)) => {
                buf.push_str(&piece);
                String::new()
            }
            _ => piece,
        };
        Self::args(out, call.index, text);
        Ok(Step::Continue)
    }

    /// The block ends here (generation ended, or the rest is not a tools block): what a value
    /// still holds is written as generated (a string value stays unterminated, a buffered
    /// value is written as its text), so nothing generated is lost and nothing is invented.
    pub(super) fn abandon(&mut self, out: &mut Vec<ToolCallDelta>) {
        let tail = std::mem::take(&mut self.decoder).finish();
        if let Some(call) = self.call.as_mut() {
            let text = match call.value.take() {
                Some(OpenValue::Str) => json_fragment(&tail),
                Some(OpenValue::Other(buf)) => buf + &tail,
                Some(OpenValue::Raw) => tail,
                None => String::new(),
            };
            Self::args(out, call.index, text);
        }
    }
}

/// Whether `id` is whitespace only (complete UTF-8, every character Python whitespace).
pub(super) fn is_blank(tok: &Tokenizer, id: u32) -> bool {
    tok.token_bytes(id)
        .and_then(|b| std::str::from_utf8(b).ok())
        .is_some_and(|s| !s.is_empty() && s.chars().all(is_py_space))
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    Value::from(s).to_string()
}

/// `s` JSON-escaped, without the quotes: escaping is per character, so the fragments of a
/// string's pieces concatenate to the escape of the whole string.
fn json_fragment(s: &str) -> String {
    let quoted = json_string(s);
    quoted[1..quoted.len() - 1].to_string()
}

/// Reverses the attribute escape (`&` → `&amp;`, then `"` → `&quot;`) in one pass; any
/// other `&` is itself.
fn unescape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(at) = rest.find('&') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        if let Some(after) = rest.strip_prefix("&amp;") {
            out.push('&');
            rest = after;
        } else if let Some(after) = rest.strip_prefix("&quot;") {
            out.push('"');
            rest = after;
        } else {
            out.push('&');
            rest = &rest[1..];
        }
    }
    out.push_str(rest);
    out
}

/// A marker's tag text: a name, then ` key="value"` attributes (values unescaped). `None`
/// when it has another shape or repeats an attribute.
pub(super) fn parse_tag(tag: &str) -> Option<(&str, Vec<(String, String)>)> {
    let (name, mut rest) = match tag.find(' ') {
        Some(i) => (&tag[..i], &tag[i..]),
        None => (tag, ""),
    };
    if name.is_empty() || name.contains(['"', '=']) {
        return None;
    }
    let mut attrs: Vec<(String, String)> = Vec::new();
    while !rest.is_empty() {
        rest = rest.strip_prefix(' ')?;
        let eq = rest.find("=\"")?;
        let key = &rest[..eq];
        if key.is_empty() || key.contains([' ', '"']) || attrs.iter().any(|(k, _)| k == key) {
            return None;
        }
        rest = &rest[eq + 2..];
        let end = rest.find('"')?;
        attrs.push((key.to_string(), unescape(&rest[..end])));
        rest = &rest[end + 1..];
    }
    Some((name, attrs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_and_escapes() {
        let (name, attrs) = parse_tag(r#"call tool="a&amp;&quot;b" index="1""#).unwrap();
        assert_eq!(name, "call");
        assert_eq!(
            attrs,
            vec![
                ("tool".to_string(), "a&\"b".to_string()),
                ("index".to_string(), "1".to_string())
            ]
        );
        assert_eq!(parse_tag("tools").unwrap(), ("tools", vec![]));
        assert_eq!(unescape("&amp;quot; & &lt;"), "&quot; & &lt;");
        for bad in [
            "",
            "call tool=x",
            r#"call tool="x"#,
            r#"call  tool="x""#,
            r#"call tool="x" tool="y""#,
            r#"call tool="x"y"#,
            r#"="x""#,
        ] {
            assert_eq!(parse_tag(bad), None, "{bad:?}");
        }
        assert_eq!(json_fragment("a\"\\\n😀"), "a\\\"\\\\\\n😀");
    }
}
