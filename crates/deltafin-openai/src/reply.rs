//! How every endpoint answers one generation: OpenAI's chat completions and completions
//! ([`crate::response::Shape`]), the Anthropic Messages API (`/v1/messages`), the OpenAI
//! Responses API (`/v1/responses`) and the Ollama API (`/api/chat`, `/api/generate`).
//!
//! Each translates its request into the one [`crate::request::GenRequest`] the engine runs
//! and consumes the same [`crate::engine::GenEvent`] stream; a [`Reply`] turns that stream into
//! the endpoint's JSON body or its stream (server-sent events, or Ollama's JSON lines). The
//! server owns admission, disconnects, the request log and the transport
//! (`crate::transport`); a reply only says what to write.

use crate::engine::{FinishReason, Usage, prefill_comment};
use crate::error::ApiError;
use crate::output::{Delta, ToolCallDelta};
use serde_json::Value;

/// What every reply needs to know about its request besides the events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplyContext {
    /// The response id (`msg_…`, `resp_…`).
    pub id: String,
    /// Unique per response: the id without its prefix, for item and call ids.
    pub suffix: String,
    /// Unix seconds the response was created.
    pub created: u64,
    /// Tokens of the encoded prompt.
    pub prompt_tokens: usize,
    /// The token budget the generation ran with.
    pub max_new: usize,
}

/// One endpoint's rendering of a generation.
pub trait Reply: Send {
    /// The non-streaming body from everything the generation released.
    fn body(&mut self, all: Delta, finish: FinishReason, usage: &Usage) -> Result<Value, ApiError>;
    /// The events written as soon as the stream opens (before the first token).
    fn opening(&mut self) -> Vec<String>;
    /// The events of newly released output; an error ends the stream with [`Reply::failed`].
    fn delta(&mut self, d: Delta) -> Result<Vec<String>, ApiError>;
    /// The events that end a stream normally.
    fn done(&mut self, finish: FinishReason, usage: &Usage) -> Vec<String>;
    /// The event that reports a failure after the stream opened (the stream then ends).
    fn failed(&mut self, e: &ApiError) -> Vec<String>;
    /// What a stream writes while the prompt is prefilled (`done` of `total` positions):
    /// an SSE comment, which clients skip and which keeps idle connections alive.
    fn prefill(&mut self, done: usize, total: usize) -> Vec<String> {
        vec![prefill_comment(done, total)]
    }
    /// The `Content-Type` of the stream.
    fn stream_type(&self) -> &'static str {
        "text/event-stream; charset=utf-8"
    }
}

/// One server-sent event with a type line: `event: NAME`, `data: JSON`, blank line.
pub fn sse_event(name: &str, data: &Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

/// One complete tool call, assembled from its pieces.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolCall {
    /// 0-based position of the call in the answer.
    pub index: usize,
    /// The call id the model output carried, if any.
    pub id: Option<String>,
    /// The function name.
    pub name: String,
    /// The arguments' JSON text.
    pub arguments: String,
}

/// The calls of `pieces` in the order they started: the first piece of a call gives its id
/// and name, later pieces append to its arguments.
pub fn assemble_tool_calls(pieces: &[ToolCallDelta]) -> Vec<ToolCall> {
    let mut calls: Vec<ToolCall> = Vec::new();
    for p in pieces {
        let pos = match calls.iter().position(|c| c.index == p.index) {
            Some(pos) => pos,
            None => {
                calls.push(ToolCall {
                    index: p.index,
                    ..Default::default()
                });
                calls.len() - 1
            }
        };
        let call = &mut calls[pos];
        if call.id.is_none() {
            call.id.clone_from(&p.id);
        }
        if let Some(name) = &p.name {
            call.name.push_str(name);
        }
        call.arguments.push_str(&p.arguments);
    }
    calls
}

/// The arguments of a finished call as the JSON object they must be (blank means `{}`).
pub fn arguments_object(call: &ToolCall) -> Result<Value, ApiError> {
    arguments_object_of(call, false)
}

/// [`arguments_object`], where `cut` says the answer ended by its token budget: a call the
/// budget cut off is its arguments as far as they were complete (the members and elements
/// that ended before the cut), as Anthropic's and Ollama's clients rebuild a streamed call
/// that was cut; `{}` when none ended.
pub fn arguments_object_of(call: &ToolCall, cut: bool) -> Result<Value, ApiError> {
    if call.arguments.trim().is_empty() {
        return Ok(Value::Object(Default::default()));
    }
    match serde_json::from_str::<Value>(&call.arguments) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Err(_) if cut => {
            Ok(complete_prefix(&call.arguments)
                .unwrap_or_else(|| Value::Object(Default::default())))
        }
        _ => Err(ApiError::server(format!(
            "the model's call of `{}` has arguments that are not a JSON object: {}",
            call.name, call.arguments
        ))),
    }
}

/// The longest prefix of the cut JSON object `text` that ends after a complete member or
/// element, closed: `{"a":1,"b":"x` → `{"a":1}`. `None` when `text` does not open an object.
fn complete_prefix(text: &str) -> Option<Value> {
    let text = text.trim_start();
    if !text.starts_with('{') {
        return None;
    }
    // Open containers; the last point after which the text is complete, with the closers it
    // needs there.
    let mut open: Vec<u8> = Vec::new();
    let mut best: Option<(usize, String)> = None;
    let closers = |open: &[u8]| -> String {
        open.iter()
            .rev()
            .map(|&c| if c == b'{' { '}' } else { ']' })
            .collect()
    };
    // Whether the string being read is a member's key (then its end completes nothing).
    let mut key_next = false;
    let mut is_key = false;
    let mut in_string = false;
    let mut escaped = false;
    let mut scalar = false;
    let bytes = text.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
                if !is_key {
                    best = Some((i + 1, closers(&open)));
                }
            }
            continue;
        }
        if scalar && !(b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'+')) {
            scalar = false;
            best = Some((i, closers(&open)));
        }
        match b {
            b'"' => {
                in_string = true;
                is_key = key_next;
                key_next = false;
            }
            b'{' => {
                open.push(b);
                key_next = true;
                best = Some((i + 1, closers(&open)));
            }
            b'[' => {
                open.push(b);
                best = Some((i + 1, closers(&open)));
            }
            b'}' | b']' => {
                open.pop();
                best = Some((i + 1, closers(&open)));
                if open.is_empty() {
                    break;
                }
            }
            b',' => key_next = open.last() == Some(&b'{'),
            b':' | b' ' | b'\n' | b'\r' | b'\t' => {}
            _ => scalar = true,
        }
    }
    let (end, close) = best?;
    let mut fixed = text[..end].trim_end().to_string();
    if fixed.ends_with(',') {
        fixed.pop();
    }
    fixed.push_str(&close);
    match serde_json::from_str::<Value>(&fixed) {
        Ok(v @ Value::Object(_)) => Some(v),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn piece(index: usize, id: Option<&str>, name: Option<&str>, args: &str) -> ToolCallDelta {
        ToolCallDelta {
            index,
            id: id.map(str::to_string),
            name: name.map(str::to_string),
            arguments: args.to_string(),
        }
    }

    #[test]
    fn calls_assemble_in_start_order() {
        let calls = assemble_tool_calls(&[
            piece(0, Some("c0"), Some("get"), ""),
            piece(0, None, None, "{\"a\":"),
            piece(1, Some("c1"), Some("put"), "{}"),
            piece(0, None, None, "1}"),
        ]);
        assert_eq!(calls.len(), 2);
        assert_eq!(
            (calls[0].id.as_deref(), calls[0].name.as_str()),
            (Some("c0"), "get")
        );
        assert_eq!(calls[0].arguments, "{\"a\":1}");
        assert_eq!(arguments_object(&calls[0]).unwrap(), json!({"a": 1}));
        assert_eq!(calls[1].arguments, "{}");
    }

    #[test]
    fn arguments_must_be_an_object() {
        let mut c = ToolCall {
            name: "f".into(),
            ..Default::default()
        };
        assert_eq!(arguments_object(&c).unwrap(), json!({}));
        c.arguments = "[1]".into();
        let e = arguments_object(&c).unwrap_err();
        assert!(e.message.contains("not a JSON object"), "{e}");
        c.arguments = "{\"a\"".into();
        assert!(arguments_object(&c).is_err());
    }

    #[test]
    fn a_cut_call_keeps_what_was_complete() {
        let cut = |args: &str| {
            let c = ToolCall {
                name: "f".into(),
                arguments: args.into(),
                ..Default::default()
            };
            arguments_object_of(&c, true).unwrap()
        };
        assert_eq!(cut("{\"a\":1,\"b\":\"x"), json!({"a": 1}));
        assert_eq!(
            cut("{\"unit\":\"celsius\",\"-\":false,\"\\rif"),
            json!({"unit": "celsius", "-": false})
        );
        assert_eq!(cut("{\"a\":[1,2,{\"b\":tr"), json!({"a": [1, 2, {}]}));
        assert_eq!(
            cut("{\"a\":{\"b\":\"}\\\"\",\"c\":"),
            json!({"a": {"b": "}\""}})
        );
        assert_eq!(cut("{\"a\":12"), json!({}));
        assert_eq!(cut("{\"a"), json!({}));
        assert_eq!(cut("[1,2"), json!({}));
        assert_eq!(cut("{\"a\":1} trailing"), json!({"a": 1}));
        // Not cut: still an error.
        let c = ToolCall {
            name: "f".into(),
            arguments: "{\"a\":1,".into(),
            ..Default::default()
        };
        assert!(arguments_object_of(&c, false).is_err());
    }

    #[test]
    fn sse_events_carry_their_type_line() {
        assert_eq!(
            sse_event("ping", &json!({"type": "ping"})),
            "event: ping\ndata: {\"type\":\"ping\"}\n\n"
        );
    }
}
