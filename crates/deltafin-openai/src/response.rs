//! Response bodies and SSE frames (docs/SERVER.md "Responses", "Streaming"): the completion
//! and chat shapes, chat messages with tool calls, log-probability listings, usage.

use crate::MODEL_ID;
use crate::engine::{Engine, FinishReason, Usage};
use crate::error::ApiError;
use crate::output::{Delta, ToolCallDelta, chat_logprob_entries, completions_logprobs};
use crate::reply::Reply;
use crate::request::Surface;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::sync::Arc;

/// A complete call as OpenAI's `message.tool_calls` lists it:
/// `{"id", "type": "function", "function": {"name", "arguments"}}` (arguments a JSON text).
pub fn tool_call_json(call: &ToolCallDelta) -> Value {
    json!({
        "id": call.id.as_deref().unwrap_or_default(),
        "type": "function",
        "function": {"name": call.name.as_deref().unwrap_or_default(), "arguments": call.arguments},
    })
}

/// The streamed `delta.tool_calls` entries of one piece: a call's first piece is
/// `{"index", "id", "type": "function", "function": {"name", "arguments": ""}}`, and argument
/// text follows as `{"index", "function": {"arguments": "…"}}`.
pub fn tool_call_chunks(piece: &ToolCallDelta) -> Vec<Value> {
    let mut out = Vec::new();
    if piece.is_start() {
        out.push(json!({
            "index": piece.index,
            "id": piece.id.as_deref().unwrap_or_default(),
            "type": "function",
            "function": {"name": piece.name.as_deref().unwrap_or_default(), "arguments": ""},
        }));
    }
    if !piece.arguments.is_empty() {
        out.push(json!({"index": piece.index, "function": {"arguments": piece.arguments}}));
    }
    out
}

/// The assistant message of a whole answer: `content` is `null` when it is empty and the
/// answer has tool calls (as OpenAI), `tool_calls` is present only when there are calls.
pub fn chat_message(d: &Delta) -> Value {
    let calls = &d.tool_calls;
    let content = if d.content.is_empty() && !calls.is_empty() {
        Value::Null
    } else {
        Value::from(d.content.as_str())
    };
    let mut m = json!({"role": "assistant", "content": content, "reasoning_content": d.reasoning});
    if !calls.is_empty() {
        m["tool_calls"] = calls.iter().map(tool_call_json).collect();
    }
    m
}

/// What every response frame needs.
pub struct Shape {
    /// The endpoint.
    pub surface: Surface,
    /// The response id.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The engine (its tokenizer spells log-probability entries).
    pub engine: Arc<Engine>,
    /// Whether log-probabilities were asked for.
    pub logprobs: bool,
    /// Streams: whether a usage frame ends the stream.
    pub include_usage: bool,
}

impl Shape {
    /// The usage object.
    pub fn usage(&self, u: &Usage) -> Value {
        let mut v = json!({
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        });
        if self.surface == Surface::Chat {
            v["completion_tokens_details"] = json!({"reasoning_tokens": u.reasoning_tokens});
        }
        v
    }

    fn chat_logprobs(&self, d: &Delta, reasoning: bool, content: bool) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let tok = &self.engine.tokenizer;
        let mut v = json!({
            "content": if content { chat_logprob_entries(tok, &d.content_logprobs) } else { Value::Null },
            "refusal": null,
        });
        if reasoning {
            v["reasoning_content"] = chat_logprob_entries(tok, &d.reasoning_logprobs);
        }
        v
    }

    fn completions_logprobs(&self, d: &Delta) -> Value {
        if self.logprobs {
            completions_logprobs(&self.engine.tokenizer, &d.content_logprobs)
        } else {
            Value::Null
        }
    }

    /// The non-streaming body of a whole answer.
    pub fn full(&self, d: &Delta, finish: FinishReason, usage: &Usage) -> Value {
        match self.surface {
            Surface::Completions => json!({
                "id": self.id, "object": "text_completion", "created": self.created, "model": MODEL_ID,
                "choices": [{"index": 0, "text": d.content, "logprobs": self.completions_logprobs(d),
                             "finish_reason": finish.as_str()}],
                "usage": self.usage(usage),
            }),
            Surface::Chat => json!({
                "id": self.id, "object": "chat.completion", "created": self.created, "model": MODEL_ID,
                "choices": [{"index": 0,
                             "message": chat_message(d),
                             "logprobs": self.chat_logprobs(d, true, true),
                             "finish_reason": finish.as_str()}],
                "usage": self.usage(usage),
            }),
        }
    }

    /// A streamed chunk holding `choice`.
    pub fn chunk(&self, choice: Value) -> Value {
        let object = match self.surface {
            Surface::Completions => "text_completion",
            Surface::Chat => "chat.completion.chunk",
        };
        let mut v = json!({
            "id": self.id, "object": object, "created": self.created, "model": MODEL_ID,
            "choices": [choice],
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// The frames of one delta: chat sends reasoning, content and each tool-call entry as
    /// separate frames.
    pub fn delta_frames(&self, d: &Delta, out: &mut VecDeque<Value>) {
        match self.surface {
            Surface::Completions => out.push_back(self.chunk(json!({
                "index": 0, "text": d.content, "logprobs": self.completions_logprobs(d), "finish_reason": null,
            }))),
            Surface::Chat => {
                if !d.reasoning.is_empty() || !d.reasoning_logprobs.is_empty() {
                    out.push_back(self.chunk(json!({
                        "index": 0, "delta": {"reasoning_content": d.reasoning},
                        "logprobs": self.chat_logprobs(d, true, false), "finish_reason": null,
                    })));
                }
                if !d.content.is_empty() || !d.content_logprobs.is_empty() {
                    out.push_back(self.chunk(json!({
                        "index": 0, "delta": {"content": d.content},
                        "logprobs": self.chat_logprobs(d, false, true), "finish_reason": null,
                    })));
                }
                for entry in d.tool_calls.iter().flat_map(tool_call_chunks) {
                    out.push_back(self.chunk(json!({
                        "index": 0, "delta": {"tool_calls": [entry]}, "logprobs": null, "finish_reason": null,
                    })));
                }
            }
        }
    }

    /// The frame that carries the finish reason.
    pub fn finish_frame(&self, finish: FinishReason) -> Value {
        match self.surface {
            Surface::Completions => self.chunk(json!({
                "index": 0, "text": "", "logprobs": null, "finish_reason": finish.as_str(),
            })),
            Surface::Chat => self.chunk(json!({
                "index": 0, "delta": {}, "logprobs": null, "finish_reason": finish.as_str(),
            })),
        }
    }
}

/// One `data: …` frame of an OpenAI stream.
fn frame(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// The chat completions and completions answer: one body, or OpenAI's `data:` chunks ending
/// with `data: [DONE]`.
impl Reply for Shape {
    fn body(&mut self, all: Delta, finish: FinishReason, usage: &Usage) -> Result<Value, ApiError> {
        Ok(self.full(&all, finish, usage))
    }

    fn opening(&mut self) -> Vec<String> {
        if self.surface != Surface::Chat {
            return Vec::new();
        }
        let opening = self.chunk(json!({
            "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null,
        }));
        vec![frame(&opening)]
    }

    fn delta(&mut self, d: Delta) -> Result<Vec<String>, ApiError> {
        let mut frames = VecDeque::new();
        self.delta_frames(&d, &mut frames);
        Ok(frames.iter().map(frame).collect())
    }

    fn done(&mut self, finish: FinishReason, usage: &Usage) -> Vec<String> {
        let mut out = vec![frame(&self.finish_frame(finish))];
        if self.include_usage {
            let mut u = self.chunk(Value::Null);
            u["choices"] = json!([]);
            u["usage"] = self.usage(usage);
            out.push(frame(&u));
        }
        out.push("data: [DONE]\n\n".into());
        out
    }

    fn failed(&mut self, e: &ApiError) -> Vec<String> {
        let mut body = e.body();
        body["error"]["type"] = Value::from("server_error");
        body["error"]["code"] = Value::from(e.code);
        vec![frame(&body)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(index: usize, id: Option<&str>, name: Option<&str>, arguments: &str) -> ToolCallDelta {
        ToolCallDelta {
            index,
            id: id.map(String::from),
            name: name.map(String::from),
            arguments: arguments.into(),
        }
    }

    #[test]
    fn message_with_tool_calls() {
        let mut d = Delta {
            reasoning: "think".into(),
            ..Default::default()
        };
        d.extend(Delta {
            tool_calls: vec![
                call(0, Some("call_a"), Some("f"), ""),
                call(0, None, None, "{\"x\":"),
            ],
            ..Default::default()
        });
        d.extend(Delta {
            tool_calls: vec![
                call(0, None, None, "1}"),
                call(1, Some("call_b"), Some("g"), "{}"),
            ],
            ..Default::default()
        });
        assert_eq!(
            chat_message(&d),
            json!({"role": "assistant", "content": null, "reasoning_content": "think",
                   "tool_calls": [
                       {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}},
                       {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]})
        );
        // Content stays a string when there is some, and when there are no calls.
        d.content = "Sure.".into();
        assert_eq!(chat_message(&d)["content"], "Sure.");
        let plain = Delta::default();
        assert_eq!(
            chat_message(&plain),
            json!({"role": "assistant", "content": "", "reasoning_content": ""})
        );
    }

    #[test]
    fn streamed_tool_call_entries() {
        assert_eq!(
            tool_call_chunks(&call(2, Some("call_x"), Some("f"), "{\"a\"")),
            vec![
                json!({"index": 2, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": ""}}),
                json!({"index": 2, "function": {"arguments": "{\"a\""}}),
            ]
        );
        assert_eq!(
            tool_call_chunks(&call(0, None, None, "1}")),
            vec![json!({"index": 0, "function": {"arguments": "1}"}})]
        );
        assert!(tool_call_chunks(&call(0, None, None, "")).is_empty());
    }
}
