//! Rendering a conversation into segments (§8.1 primitives, §8.2 order) and encoding
//! them into ids.

use serde_json::Value;
use std::collections::HashMap;

use super::message::*;
use super::options::*;
use super::py_json::*;
use crate::text::tokenizer::{self, Tokenizer, is_py_space};

/// Builds segments in §8.1 primitives.
pub(super) struct Builder {
    out: Vec<Segment>,
}

impl Builder {
    fn text(&mut self, s: &str) {
        if !s.is_empty() {
            self.out.push(Segment::Text(s.to_string()));
        }
    }

    fn ids(&mut self, ids: &[u32]) {
        if !ids.is_empty() {
            self.out.push(Segment::Ids(ids.to_vec()));
        }
    }

    fn special(&mut self, id: u32) {
        self.out.push(Segment::Special(id));
    }

    /// `open(tag, attrs)`.
    fn open(&mut self, tag: &str, attrs: &[(&str, &str)]) {
        self.special(tokenizer::OPEN);
        self.text(tag);
        for (key, value) in attrs {
            self.text(&format!(" {key}"));
            self.text("=\"");
            self.text(&escape(value));
            self.text("\"");
        }
        self.special(tokenizer::SEP);
    }

    /// `close(tag)`.
    fn close(&mut self, tag: &str) {
        self.special(tokenizer::CLOSE);
        self.text(tag);
        self.special(tokenizer::SEP);
    }

    fn end(&mut self) {
        self.special(tokenizer::END_OF_MSG);
    }

    fn content(&mut self, content: &Option<Content>) {
        match content {
            None => {}
            Some(Content::Text(s)) => self.text(s),
            Some(Content::Parts(parts)) => parts.iter().for_each(|p| self.text(p)),
        }
    }

    /// A `role="system" type=…` message with a trimmed body.
    fn internal_system(&mut self, kind: &str, body: &str) {
        self.open("message", &[("role", "system"), ("type", kind)]);
        self.text(body.trim_matches(is_py_space));
        self.close("message");
        self.end();
    }

    fn tool_declare(&mut self, tools: &[Value], dynamic: bool) {
        let json = py_json_compact_sorted(&Value::Array(tools.to_vec()));
        let body = if dynamic {
            format!(
                "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n\
                 You have access to all existing and extended tools.\n\
                 Here are the specs for the extended tools.\n\n```json\n{json}\n```"
            )
        } else {
            format!(
                "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{json}\n```"
            )
        };
        self.open("message", &[("role", "system"), ("type", "tool-declare")]);
        self.text(&body);
        self.close("message");
        self.end();
    }
}

/// `&` → `&amp;`, then `"` → `&quot;` (§8.1).
pub fn escape(value: &str) -> String {
    value.replace('&', "&amp;").replace('"', "&quot;")
}

/// Renders a conversation to segments (§8.2): tool declaration, thinking effort, the
/// messages, optional tool-choice / response-format messages, the generation prompt.
pub fn render_segments(
    messages: &[ChatMessage],
    opts: &ChatOptions,
) -> Result<Vec<Segment>, ChatError> {
    let mut b = Builder { out: Vec::new() };
    if !opts.tools.is_empty() {
        b.tool_declare(&opts.tools, false);
    }
    if opts.thinking {
        let effort = opts.effort.unwrap_or(ReasoningEffort::Max);
        b.internal_system(
            "thinking-effort",
            &format!(
                "`thinking_effort` guides on how much to think in your thinking channel \
                 (not including the response channel), supported values include `low`, \
                 `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort={effort}`."
            ),
        );
    }

    let mut last_calls: Option<&[ToolCall]> = None;
    let mut tool_index = 0usize;
    for (index, matched_tool) in order_messages(messages) {
        let msg = &messages[index];
        let with_name = |role: &'static str| -> Vec<(&'static str, &str)> {
            let mut attrs = vec![("role", role)];
            if let Some(name) = msg.name.as_deref().filter(|n| !n.is_empty()) {
                attrs.push(("name", name));
            }
            attrs
        };
        match msg.role.as_str() {
            "user" => {
                b.open("message", &with_name("user"));
                b.content(&msg.content);
                b.close("message");
                b.end();
            }
            "system" if !msg.tools.is_empty() => b.tool_declare(&msg.tools, true),
            "system" => {
                b.open("message", &with_name("system"));
                b.content(&msg.content);
                b.close("message");
                b.end();
            }
            "tool" => {
                tool_index += 1;
                let name = match matched_tool {
                    Some(matched) => Some(matched),
                    None => msg.tool.as_deref().or(msg.name.as_deref()).or_else(|| {
                        last_calls
                            .and_then(|calls| calls.get(tool_index - 1))
                            .map(|c| c.name.as_str())
                    }),
                };
                let name = name.ok_or(ChatError::UnresolvedToolName { index })?;
                let k = tool_index.to_string();
                b.open(
                    "message",
                    &[("role", "tool"), ("tool", name), ("index", &k)],
                );
                b.content(&msg.content);
                b.close("message");
                b.end();
            }
            "assistant" => {
                last_calls = Some(&msg.tool_calls);
                tool_index = 0;
                b.open("message", &with_name("assistant"));
                if opts.thinking {
                    b.open("think", &[]);
                    if let Some(ids) = &msg.reasoning_ids {
                        // The model's own tokens, as it wrote them.
                        b.ids(ids);
                    } else if let Some(r) = &msg.reasoning_content
                        && !r.trim_matches(is_py_space).is_empty()
                    {
                        b.text(r);
                    }
                    b.close("think");
                }
                b.open("response", &[]);
                b.content(&msg.content);
                b.close("response");
                render_tool_calls(&mut b, index, &msg.tool_calls)?;
                b.close("message");
                b.end();
            }
            other => {
                return Err(ChatError::UnknownRole {
                    index,
                    role: other.to_string(),
                });
            }
        }
    }

    match opts.tool_choice {
        Some(ToolChoice::Required) => b.internal_system(
            "tool-choice",
            "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
        ),
        Some(ToolChoice::Forbidden) => b.internal_system(
            "tool-choice",
            "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
        ),
        None => {}
    }
    const RAW_JSON: &str = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting.";
    match &opts.response_format {
        Some(ResponseFormat::JsonObject) => b.internal_system(
            "response-format",
            &format!("The system is invoked with `response_format=json_object`.\n{RAW_JSON}"),
        ),
        Some(ResponseFormat::JsonSchema(schema)) => b.internal_system(
            "response-format",
            &format!(
                "The system is invoked with `response_format=json_schema`.\n{RAW_JSON}\n\
                 The JSON data must match the following schema:\n```json\n{}\n```",
                py_json_compact_sorted(schema)
            ),
        ),
        None => {}
    }

    if opts.add_generation_prompt {
        b.open("message", &[("role", "assistant")]);
        b.open(if opts.thinking { "think" } else { "response" }, &[]);
    }
    Ok(b.out)
}

/// §8.4 tool calls of one assistant message.
pub(super) fn render_tool_calls(
    b: &mut Builder,
    index: usize,
    calls: &[ToolCall],
) -> Result<(), ChatError> {
    if calls.is_empty() {
        return Ok(());
    }
    b.open("tools", &[]);
    for (k, call) in calls.iter().enumerate() {
        let k = k + 1;
        let ks = k.to_string();
        b.open("call", &[("tool", &call.name), ("index", &ks)]);
        let raw = &call.arguments;
        if !raw.trim_matches(is_py_space).is_empty() {
            match serde_json::from_str::<Value>(raw) {
                Ok(Value::Object(args)) => {
                    for (key, value) in &args {
                        b.open("argument", &[("key", key), ("type", json_type(value))]);
                        match value {
                            Value::String(s) => b.text(s),
                            other => b.text(&py_json(other, ", ", ": ", false)),
                        }
                        b.close("argument");
                    }
                }
                Ok(other) => {
                    return Err(ChatError::ArgumentsNotObject {
                        index,
                        call: k,
                        name: call.name.clone(),
                        found: json_type(&other),
                    });
                }
                // Not JSON: rendered verbatim as a raw object block.
                Err(_) => {
                    b.open("json", &[("type", "object")]);
                    b.text(raw);
                    b.close("json");
                }
            }
        }
        b.close("call");
    }
    b.close("tools");
    Ok(())
}

/// The rendering order: message indices, each with the tool name fixed by matching its
/// `tool_call_id` to the preceding assistant's calls. A run of consecutive tool messages
/// whose ids all match is reordered into call order (stable), and the matched call's name
/// overrides `tool`/`name` (NeMo `normalize_xtml_tool_result_messages`); a run with any
/// unmatched id is left as it is.
pub(super) fn order_messages(messages: &[ChatMessage]) -> Vec<(usize, Option<&str>)> {
    let mut order = Vec::with_capacity(messages.len());
    let mut i = 0;
    let mut calls: &[ToolCall] = &[];
    // The current assistant turn's call ids → their first position: one lookup per tool
    // message, so a conversation renders in time linear in its length.
    let mut by_id: HashMap<&str, usize> = HashMap::new();
    while i < messages.len() {
        if messages[i].role != "tool" {
            if messages[i].role == "assistant" {
                calls = &messages[i].tool_calls;
                by_id.clear();
                for (pos, c) in calls.iter().enumerate() {
                    if let Some(id) = c.id.as_deref() {
                        by_id.entry(id).or_insert(pos);
                    }
                }
            }
            order.push((i, None));
            i += 1;
            continue;
        }
        let start = i;
        while i < messages.len() && messages[i].role == "tool" {
            i += 1;
        }
        let matched: Option<Vec<usize>> = messages[start..i]
            .iter()
            .map(|m| {
                let id = m.tool_call_id.as_deref()?;
                by_id.get(id).copied()
            })
            .collect();
        match matched {
            Some(positions) => {
                let mut run: Vec<(usize, usize)> = positions
                    .into_iter()
                    .enumerate()
                    .map(|(offset, pos)| (pos, start + offset))
                    .collect();
                run.sort();
                order.extend(
                    run.into_iter()
                        .map(|(pos, index)| (index, Some(calls[pos].name.as_str()))),
                );
            }
            None => order.extend((start..i).map(|index| (index, None))),
        }
    }
    order
}

/// Encodes a conversation: each text segment separately with specials disallowed, each
/// special as its id (NeMo `_encode_chat_segments`). No `[BOS]` is added.
pub fn encode_chat(
    tok: &Tokenizer,
    messages: &[ChatMessage],
    opts: &ChatOptions,
) -> Result<Vec<u32>, ChatError> {
    check_chat_markers(tok)?;
    let segments = render_segments(messages, opts)?;
    Ok(encode_segments(tok, &segments))
}

/// Whether the tokenizer has K3's XTML markers at K3's ids (the install's
/// `tokenizer_config.json` names them): chat rendering needs them, and an install whose file
/// was edited or damaged fails here ([`ChatError::MarkerMismatch`]), whatever the messages.
pub fn check_chat_markers(tok: &Tokenizer) -> Result<(), ChatError> {
    for (spelling, expected) in [
        ("<|open|>", tokenizer::OPEN),
        ("<|close|>", tokenizer::CLOSE),
        ("<|sep|>", tokenizer::SEP),
        ("<|end_of_msg|>", tokenizer::END_OF_MSG),
    ] {
        let found = tok.special_id(spelling);
        if found != Some(expected) {
            return Err(ChatError::MarkerMismatch {
                spelling,
                expected,
                found,
            });
        }
    }
    Ok(())
}

/// An upper bound on the length of [`encode_segments`]`(segments)` that needs no tokenizer:
/// one token per special, at most one per byte of text (byte-level BPE never emits a token for
/// less than a byte).
pub fn token_bound(segments: &[Segment]) -> usize {
    segments
        .iter()
        .map(|s| match s {
            Segment::Special(_) => 1,
            Segment::Text(text) => text.len(),
            Segment::Ids(ids) => ids.len(),
        })
        .sum()
}

/// Encodes rendered segments (text segments with specials disallowed).
pub fn encode_segments(tok: &Tokenizer, segments: &[Segment]) -> Vec<u32> {
    let mut ids = Vec::new();
    for segment in segments {
        match segment {
            Segment::Special(id) => ids.push(*id),
            Segment::Text(text) => ids.extend(tok.encode_ordinary(text)),
            Segment::Ids(restored) => ids.extend_from_slice(restored),
        }
    }
    ids
}
