//! The K3 XTML chat format (spec §8): rendering a conversation into segments and ids.
//!
//! A conversation renders to a list of [`Segment`]s: XTML markers as special ids, and every
//! other piece (tag names, each attribute piece, escaped values, bodies) as a separate text
//! segment. [`encode_chat`] encodes each text segment on its own with specials disallowed,
//! so BPE never merges across pieces and user text spelling `<|open|>` stays plain text.
//!
//! The renderer follows NeMo-Automodel 0.7.0's `build_chat_segments` (pinned by
//! `tests/fixtures/chat/goldens.json`), except where the spec says otherwise: the
//! thinking-effort message defaults to `max` when thinking is on (§8.3), and a message with
//! an unknown role is an error rather than skipped.

use std::fmt;
use std::str::FromStr;

use serde_json::Value;

use crate::tokenizer::{self, Tokenizer, is_py_space};

/// One rendered piece of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// A special token id (`<|open|>`, `<|close|>`, `<|sep|>`, `<|end_of_msg|>`).
    Special(u32),
    /// Ordinary text, encoded on its own with specials disallowed. Never empty.
    Text(String),
}

/// Message content: a string, or an array of text parts rendered in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// The texts of `{"type": "text", "text": …}` parts.
    Parts(Vec<String>),
}

/// One tool call in an assistant message.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ToolCall {
    /// The call id that tool results refer to (`tool_call_id`).
    pub id: Option<String>,
    /// The function name.
    pub name: String,
    /// The arguments as JSON text (an object). Blank means no arguments; text that is not
    /// JSON is rendered verbatim as a raw `json` block (§8.4).
    pub arguments: String,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The content; `None` renders nothing.
    pub content: Option<Content>,
    /// Optional `name` attribute (system/user/assistant); for tool messages a fallback tool name.
    pub name: Option<String>,
    /// Tool messages: the tool name (takes precedence over `name`).
    pub tool: Option<String>,
    /// Assistant reasoning, rendered in the think channel when thinking is on.
    pub reasoning_content: Option<String>,
    /// Assistant tool calls.
    pub tool_calls: Vec<ToolCall>,
    /// Tool messages: the id of the assistant call this result answers.
    pub tool_call_id: Option<String>,
    /// System messages: tools added mid-conversation (rendered as the dynamic declaration).
    pub tools: Vec<Value>,
}

impl ChatMessage {
    /// A message with `role` and text `content`.
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.to_string(),
            content: Some(Content::Text(content.to_string())),
            ..Default::default()
        }
    }

    /// Parses an OpenAI-style message object: `role`, `content` (string, null, or an array
    /// of `{"type":"text","text":…}` parts), `name`, `tool`, `reasoning_content` (or
    /// `reasoning`), `tool_calls` (`[{id, type, function: {name, arguments}}]` with
    /// arguments as a JSON string or object), `tool_call_id`, `tools`. Any other key, and any
    /// non-text content part, is an error naming it.
    pub fn from_json(value: &Value) -> Result<ChatMessage, ChatError> {
        let bad = |reason: String| ChatError::BadMessage { reason };
        let obj = value
            .as_object()
            .ok_or_else(|| bad(format!("message is not a JSON object: {value}")))?;
        let opt_str = |key: &str| -> Result<Option<String>, ChatError> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(other) => Err(bad(format!("`{key}` must be a string, found {other}"))),
            }
        };
        let mut msg = ChatMessage {
            role: opt_str("role")?.ok_or_else(|| bad("message has no `role`".to_string()))?,
            name: opt_str("name")?,
            tool: opt_str("tool")?,
            tool_call_id: opt_str("tool_call_id")?,
            ..Default::default()
        };
        let reasoning = opt_str("reasoning_content")?.filter(|s| !s.is_empty());
        msg.reasoning_content = match reasoning {
            Some(r) => Some(r),
            None => opt_str("reasoning")?,
        };
        for key in obj.keys() {
            if !matches!(
                key.as_str(),
                "role"
                    | "content"
                    | "name"
                    | "tool"
                    | "reasoning_content"
                    | "reasoning"
                    | "tool_calls"
                    | "tool_call_id"
                    | "tools"
            ) {
                return Err(bad(format!(
                    "unknown message field `{key}` (role {:?})",
                    msg.role
                )));
            }
        }
        msg.content = match obj.get("content") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(Content::Text(s.clone())),
            Some(Value::Array(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for (i, part) in parts.iter().enumerate() {
                    let kind = part.get("type").and_then(Value::as_str);
                    let text = part.get("text").and_then(Value::as_str);
                    match (kind, text) {
                        (Some("text"), Some(t)) => texts.push(t.to_string()),
                        _ => {
                            return Err(bad(format!(
                                "content part {i} is not a text part {{\"type\":\"text\",\"text\":…}}: {part}"
                            )));
                        }
                    }
                }
                Some(Content::Parts(texts))
            }
            Some(other) => {
                return Err(bad(format!(
                    "`content` must be a string, null or an array of parts, found {other}"
                )));
            }
        };
        match obj.get("tools") {
            None | Some(Value::Null) => {}
            Some(Value::Array(tools)) => msg.tools = tools.clone(),
            Some(other) => return Err(bad(format!("`tools` must be an array, found {other}"))),
        }
        match obj.get("tool_calls") {
            None | Some(Value::Null) => {}
            Some(Value::Array(calls)) => {
                for (i, call) in calls.iter().enumerate() {
                    msg.tool_calls.push(
                        parse_tool_call(call)
                            .map_err(|reason| bad(format!("tool_calls[{i}]: {reason}")))?,
                    );
                }
            }
            Some(other) => {
                return Err(bad(format!("`tool_calls` must be an array, found {other}")));
            }
        }
        Ok(msg)
    }
}

/// `{id, type, function: {name, arguments}}` or the flat `{id, name, arguments}`.
fn parse_tool_call(call: &Value) -> Result<ToolCall, String> {
    let obj = call
        .as_object()
        .ok_or_else(|| format!("not an object: {call}"))?;
    for key in obj.keys() {
        if !matches!(
            key.as_str(),
            "id" | "type" | "function" | "name" | "arguments"
        ) {
            return Err(format!("unknown field `{key}`"));
        }
    }
    if let Some(t) = obj.get("type")
        && t != "function"
    {
        return Err(format!("`type` must be \"function\", found {t}"));
    }
    let id = match obj.get("id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => Some(other.to_string()),
    };
    let function = match obj.get("function") {
        Some(Value::Object(f)) => f,
        Some(other) => return Err(format!("`function` must be an object, found {other}")),
        None => obj,
    };
    let name = function
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| "missing string `name`".to_string())?
        .to_string();
    let arguments = match function.get("arguments") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(v @ Value::Object(_)) => v.to_string(),
        Some(other) => {
            return Err(format!(
                "`arguments` must be a JSON object or a JSON string, found {other}"
            ));
        }
    };
    Ok(ToolCall {
        id,
        name,
        arguments,
    })
}

/// The thinking effort of §8.3.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningEffort {
    /// `low`
    Low,
    /// `medium`
    Medium,
    /// `high`
    High,
    /// `max` (the default when thinking is on)
    Max,
}

impl ReasoningEffort {
    /// The template spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ReasoningEffort::Low => "low",
            ReasoningEffort::Medium => "medium",
            ReasoningEffort::High => "high",
            ReasoningEffort::Max => "max",
        }
    }
}

impl fmt::Display for ReasoningEffort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A reasoning effort that is not one of `low`, `medium`, `high`, `max`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid reasoning effort {value:?}: expected one of low, medium, high, max")]
pub struct ParseEffortError {
    /// The rejected value.
    pub value: String,
}

impl FromStr for ReasoningEffort {
    type Err = ParseEffortError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "low" => Ok(ReasoningEffort::Low),
            "medium" => Ok(ReasoningEffort::Medium),
            "high" => Ok(ReasoningEffort::High),
            "max" => Ok(ReasoningEffort::Max),
            _ => Err(ParseEffortError {
                value: s.to_string(),
            }),
        }
    }
}

/// `tool_choice` values that add an internal system message (§8.2 step 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolChoice {
    /// `required`: the model must call a tool.
    Required,
    /// `none`: the model must not call tools.
    Forbidden,
}

/// `response_format` values that add an internal system message (§8.2 step 4).
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    /// `json_object`
    JsonObject,
    /// `json_schema` with the schema.
    JsonSchema(Value),
}

/// Rendering options.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatOptions {
    /// Thinking mode (default true): think blocks in assistant history, thinking-effort
    /// message, generation prompt opening `think`.
    pub thinking: bool,
    /// Thinking effort; `None` means `max` when thinking (§8.3). Ignored when not thinking.
    pub effort: Option<ReasoningEffort>,
    /// Append the assistant generation prompt (default true).
    pub add_generation_prompt: bool,
    /// Tools declared up front (JSON Schema function specs), rendered deep-sorted.
    pub tools: Vec<Value>,
    /// Optional `tool_choice` message after the conversation.
    pub tool_choice: Option<ToolChoice>,
    /// Optional `response_format` message after the conversation.
    pub response_format: Option<ResponseFormat>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        ChatOptions {
            thinking: true,
            effort: None,
            add_generation_prompt: true,
            tools: Vec::new(),
            tool_choice: None,
            response_format: None,
        }
    }
}

/// Errors from rendering or encoding a conversation.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// A message's role is not system, user, assistant or tool.
    #[error("message {index}: unknown role {role:?} (expected system, user, assistant or tool)")]
    UnknownRole {
        /// Message index.
        index: usize,
        /// The role given.
        role: String,
    },
    /// A tool message whose tool name cannot be resolved.
    #[error(
        "message {index}: tool message needs a tool name: set `tool` or `name`, or answer a preceding assistant tool call"
    )]
    UnresolvedToolName {
        /// Message index.
        index: usize,
    },
    /// Tool-call arguments that parse as JSON but not as an object.
    #[error(
        "message {index}: tool call {call} ({name}): arguments must be a JSON object, found {found}"
    )]
    ArgumentsNotObject {
        /// Message index.
        index: usize,
        /// 1-based call index.
        call: usize,
        /// Function name.
        name: String,
        /// The JSON type found.
        found: &'static str,
    },
    /// A message that cannot be parsed from JSON.
    #[error("invalid chat message: {reason}")]
    BadMessage {
        /// What is wrong.
        reason: String,
    },
    /// The tokenizer's XTML marker ids differ from the K3 ids.
    #[error("tokenizer has {spelling} at {found:?}, expected id {expected}")]
    MarkerMismatch {
        /// The marker spelling.
        spelling: &'static str,
        /// The K3 id.
        expected: u32,
        /// The tokenizer's id.
        found: Option<u32>,
    },
}

/// Builds segments in §8.1 primitives.
struct Builder {
    out: Vec<Segment>,
}

impl Builder {
    fn text(&mut self, s: &str) {
        if !s.is_empty() {
            self.out.push(Segment::Text(s.to_string()));
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
                    if let Some(r) = &msg.reasoning_content
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
fn render_tool_calls(b: &mut Builder, index: usize, calls: &[ToolCall]) -> Result<(), ChatError> {
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
fn order_messages(messages: &[ChatMessage]) -> Vec<(usize, Option<&str>)> {
    let mut order = Vec::with_capacity(messages.len());
    let mut i = 0;
    let mut calls: &[ToolCall] = &[];
    while i < messages.len() {
        if messages[i].role != "tool" {
            if messages[i].role == "assistant" {
                calls = &messages[i].tool_calls;
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
                calls.iter().position(|c| c.id.as_deref() == Some(id))
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
    let segments = render_segments(messages, opts)?;
    Ok(encode_segments(tok, &segments))
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
        }
    }
    ids
}

/// The XTML type name of a JSON value (§8.4).
fn json_type(value: &Value) -> &'static str {
    match value {
        Value::String(_) => "string",
        Value::Number(_) => "number",
        Value::Bool(_) => "boolean",
        Value::Null => "null",
        Value::Object(_) => "object",
        Value::Array(_) => "array",
    }
}

/// Python `json.dumps(value, ensure_ascii=False, separators=(",", ":"))` of the value with
/// keys sorted at every level (`deep_sort_dict`).
fn py_json_compact_sorted(value: &Value) -> String {
    py_json(value, ",", ":", true)
}

/// Python `json.dumps(value, ensure_ascii=False, separators=(item_sep, key_sep),
/// sort_keys=sort)`: floats use Python's `repr`, non-ASCII is kept, control characters are
/// escaped as Python does. Integers beyond 64 bits are held as floats by `serde_json` and
/// print as floats (Python would keep them exact).
pub fn py_json(value: &Value, item_sep: &str, key_sep: &str, sort: bool) -> String {
    let mut out = String::new();
    write_py_json(&mut out, value, item_sep, key_sep, sort);
    out
}

fn write_py_json(out: &mut String, value: &Value, item_sep: &str, key_sep: &str, sort: bool) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                out.push_str(&i.to_string());
            } else if let Some(u) = n.as_u64() {
                out.push_str(&u.to_string());
            } else if let Some(f) = n.as_f64() {
                out.push_str(&py_float_repr(f));
            }
        }
        Value::String(s) => write_py_str(out, s, false),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                write_py_json(out, item, item_sep, key_sep, sort);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                write_py_str(out, k, false);
                out.push_str(key_sep);
                write_py_json(out, v, item_sep, key_sep, sort);
            }
            out.push('}');
        }
    }
}

/// A string as Python's `json` writes it: `encode_basestring`, or with `ensure_ascii`
/// `encode_basestring_ascii` (every character outside `' '..='~'` as `\uXXXX` UTF-16 units).
pub fn write_py_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python `float.__repr__` of a finite f64: the shortest round-trip digits, positional when
/// the decimal exponent is in -4..16 (with a `.0` for integral values), otherwise
/// `d.ddde±XX`.
fn py_float_repr(f: f64) -> String {
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.to_string();
    }
    // Rust's `{:e}` gives the shortest round-trip digits, like Python's repr.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if negative { "-" } else { "" };
    if !(-4..16).contains(&exp) {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{first}{frac}e{esign}{:02}", exp.abs());
    }
    let decpt = exp + 1;
    let n = digits.len() as i32;
    if decpt <= 0 {
        format!("{sign}0.{}{digits}", "0".repeat((-decpt) as usize))
    } else if decpt >= n {
        format!("{sign}{digits}{}.0", "0".repeat((decpt - n) as usize))
    } else {
        let (int, frac) = digits.split_at(decpt as usize);
        format!("{sign}{int}.{frac}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn texts(segs: &[Segment]) -> String {
        segs.iter()
            .map(|s| match s {
                Segment::Special(tokenizer::OPEN) => "<|open|>".to_string(),
                Segment::Special(tokenizer::CLOSE) => "<|close|>".to_string(),
                Segment::Special(tokenizer::SEP) => "<|sep|>".to_string(),
                Segment::Special(tokenizer::END_OF_MSG) => "<|end_of_msg|>".to_string(),
                Segment::Special(id) => format!("<{id}>"),
                Segment::Text(t) => t.clone(),
            })
            .collect()
    }

    fn no_think() -> ChatOptions {
        ChatOptions {
            thinking: false,
            ..Default::default()
        }
    }

    #[test]
    fn user_hello_segments() {
        let segs = render_segments(&[ChatMessage::new("user", "Hello")], &no_think()).unwrap();
        assert_eq!(
            texts(&segs),
            "<|open|>message role=\"user\"<|sep|>Hello<|close|>message<|sep|><|end_of_msg|>\
             <|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>"
        );
        // Attribute pieces are separate segments.
        assert_eq!(segs[1], Segment::Text("message".into()));
        assert_eq!(segs[2], Segment::Text(" role".into()));
        assert_eq!(segs[3], Segment::Text("=\"".into()));
        assert_eq!(segs[4], Segment::Text("user".into()));
        assert_eq!(segs[5], Segment::Text("\"".into()));
    }

    #[test]
    fn default_effort_is_max_when_thinking() {
        let segs =
            render_segments(&[ChatMessage::new("user", "hi")], &ChatOptions::default()).unwrap();
        let t = texts(&segs);
        assert!(t.starts_with("<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>"));
        assert!(t.contains("`thinking_effort=max`."));
        assert!(t.ends_with("<|open|>think<|sep|>"));
        let low = ChatOptions {
            effort: Some(ReasoningEffort::Low),
            ..Default::default()
        };
        assert!(texts(&render_segments(&[], &low).unwrap()).contains("`thinking_effort=low`."));
        let off = ChatOptions {
            effort: Some(ReasoningEffort::High),
            ..no_think()
        };
        assert!(!texts(&render_segments(&[], &off).unwrap()).contains("thinking_effort"));
    }

    #[test]
    fn attribute_values_are_escaped() {
        let mut m = ChatMessage::new("user", "x");
        m.name = Some("Tom \"& Jerry\"".into());
        let t = texts(&render_segments(&[m], &no_think()).unwrap());
        assert!(
            t.contains(" name=\"Tom &quot;&amp; Jerry&quot;\"<|sep|>"),
            "{t}"
        );
        assert_eq!(escape("a&quot;"), "a&amp;quot;");
        assert_eq!(escape("<|open|>'"), "<|open|>'");
    }

    #[test]
    fn tool_index_counter_restarts_per_assistant() {
        let mut a1 = ChatMessage::new("assistant", "");
        a1.tool_calls = vec![
            ToolCall {
                id: Some("c1".into()),
                name: "f".into(),
                arguments: "{}".into(),
            },
            ToolCall {
                id: Some("c2".into()),
                name: "g".into(),
                arguments: String::new(),
            },
        ];
        let tool = |content: &str| ChatMessage {
            role: "tool".into(),
            content: Some(Content::Text(content.into())),
            ..Default::default()
        };
        let a2 = a1.clone();
        let msgs = vec![a1, tool("r1"), tool("r2"), a2, tool("s1")];
        let t = texts(&render_segments(&msgs, &no_think()).unwrap());
        assert!(
            t.contains("role=\"tool\" tool=\"f\" index=\"1\"<|sep|>r1"),
            "{t}"
        );
        assert!(
            t.contains("role=\"tool\" tool=\"g\" index=\"2\"<|sep|>r2"),
            "{t}"
        );
        assert!(
            t.contains("role=\"tool\" tool=\"f\" index=\"1\"<|sep|>s1"),
            "{t}"
        );
        assert!(t.contains(
            "<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|close|>call<|sep|>\
             <|open|>call tool=\"g\" index=\"2\"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
        ));
    }

    #[test]
    fn matched_tool_results_are_reordered() {
        let mut a = ChatMessage::new("assistant", "");
        a.tool_calls = vec![
            ToolCall {
                id: Some("x".into()),
                name: "first".into(),
                arguments: "{}".into(),
            },
            ToolCall {
                id: Some("y".into()),
                name: "second".into(),
                arguments: "{}".into(),
            },
        ];
        let res = |id: &str, name: &str, c: &str| ChatMessage {
            role: "tool".into(),
            content: Some(Content::Text(c.into())),
            tool_call_id: Some(id.into()),
            name: Some(name.into()),
            ..Default::default()
        };
        let msgs = vec![a, res("y", "stale", "B"), res("x", "stale", "A")];
        let t = texts(&render_segments(&msgs, &no_think()).unwrap());
        let a_at = t.find("tool=\"first\" index=\"1\"<|sep|>A").expect(&t);
        let b_at = t.find("tool=\"second\" index=\"2\"<|sep|>B").expect(&t);
        assert!(a_at < b_at);
    }

    #[test]
    fn unknown_role_and_unresolved_tool_are_errors() {
        let err = render_segments(&[ChatMessage::new("developer", "x")], &no_think()).unwrap_err();
        assert!(err.to_string().contains("\"developer\""), "{err}");
        let err = render_segments(&[ChatMessage::new("tool", "x")], &no_think()).unwrap_err();
        assert!(
            matches!(err, ChatError::UnresolvedToolName { index: 0 }),
            "{err}"
        );
    }

    #[test]
    fn tool_arguments_render_per_type() {
        let mut a = ChatMessage::new("assistant", "ok");
        a.tool_calls = vec![ToolCall {
            id: None,
            name: "f".into(),
            arguments:
                r#"{"s":"str","n":1.5,"i":-3,"b":true,"z":null,"o":{"k":[1,"é"]},"a":[1e100,2]}"#
                    .into(),
        }];
        let t = texts(&render_segments(&[a.clone()], &no_think()).unwrap());
        for (k, ty, v) in [
            ("s", "string", "str"),
            ("n", "number", "1.5"),
            ("i", "number", "-3"),
            ("b", "boolean", "true"),
            ("z", "null", "null"),
            ("o", "object", "{\"k\": [1, \"é\"]}"),
            ("a", "array", "[1e+100, 2]"),
        ] {
            let want = format!(
                "<|open|>argument key=\"{k}\" type=\"{ty}\"<|sep|>{v}<|close|>argument<|sep|>"
            );
            assert!(t.contains(&want), "{want} not in {t}");
        }
        a.tool_calls[0].arguments = "not json".into();
        let t = texts(&render_segments(&[a.clone()], &no_think()).unwrap());
        assert!(t.contains("<|open|>json type=\"object\"<|sep|>not json<|close|>json<|sep|>"));
        a.tool_calls[0].arguments = "[1]".into();
        let err = render_segments(&[a], &no_think()).unwrap_err();
        assert!(err.to_string().contains("found array"), "{err}");
    }

    #[test]
    fn python_float_repr() {
        for (f, s) in [
            (1.5, "1.5"),
            (100.0, "100.0"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (123456789.125, "123456789.125"),
            (0.1, "0.1"),
            (-0.0, "-0.0"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
        ] {
            assert_eq!(py_float_repr(f), s, "{f}");
        }
    }

    #[test]
    fn tools_json_is_sorted_and_compact() {
        let v = json!([{"b": 1, "a": {"d": "ü", "c": [true, null]}}]);
        assert_eq!(
            py_json_compact_sorted(&v),
            r#"[{"a":{"c":[true,null],"d":"ü"},"b":1}]"#
        );
        assert_eq!(
            py_json(&json!("a\u{1}\n\"\\"), ",", ":", true),
            r#""a\u0001\n\"\\""#
        );
    }

    #[test]
    fn effort_parsing_is_strict() {
        assert_eq!(
            "medium".parse::<ReasoningEffort>(),
            Ok(ReasoningEffort::Medium)
        );
        let err = "MAX".parse::<ReasoningEffort>().unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("\"MAX\"") && msg.contains("low, medium, high, max"),
            "{msg}"
        );
    }

    #[test]
    fn message_from_json() {
        let m = ChatMessage::from_json(&json!({
            "role": "assistant",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "tool_calls": [{"id": "1", "type": "function",
                            "function": {"name": "f", "arguments": {"q": 1}}}]
        }))
        .unwrap();
        assert_eq!(
            m.content,
            Some(Content::Parts(vec!["a".into(), "b".into()]))
        );
        assert_eq!(m.tool_calls[0].arguments, r#"{"q":1}"#);
        let err = ChatMessage::from_json(&json!({"role": "user", "contnet": "x"})).unwrap_err();
        assert!(err.to_string().contains("`contnet`"), "{err}");
        let err =
            ChatMessage::from_json(&json!({"role": "user", "content": [{"type": "image_url"}]}))
                .unwrap_err();
        assert!(err.to_string().contains("content part 0"), "{err}");
    }

    #[test]
    fn py_str_matches_python_json_both_ways() {
        // json.dumps("é\x7f\n\x01😀") and json.dumps(..., ensure_ascii=False).
        let s = "é\u{7f}\n\u{1}😀";
        let (mut ascii, mut raw) = (String::new(), String::new());
        write_py_str(&mut ascii, s, true);
        write_py_str(&mut raw, s, false);
        assert_eq!(ascii, r#""\u00e9\u007f\n\u0001\ud83d\ude00""#);
        assert_eq!(raw, "\"é\u{7f}\\n\\u0001😀\"");
    }
}
