//! The conversation's pieces: [`Segment`]s, message contents, tool calls, and
//! [`ChatMessage`] as read from OpenAI-style JSON.

use serde_json::Value;

use super::options::*;

/// One rendered piece of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// A special token id (`<|open|>`, `<|close|>`, `<|sep|>`, `<|end_of_msg|>`).
    Special(u32),
    /// Ordinary text, encoded on its own with specials disallowed. Never empty.
    Text(String),
    /// Ids emitted as they are: an earlier answer's own tokens restored exactly (see
    /// [`ChatMessage::reasoning_ids`]). Never empty.
    Ids(Vec<u32>),
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
    /// Assistant reasoning as the exact ids the model generated for it (restored from an
    /// answer's opaque reasoning token by a server front end): rendered in the think channel
    /// instead of encoding [`ChatMessage::reasoning_content`], so that the prompt holds the
    /// very tokens the model wrote, whatever their text would encode to.
    pub reasoning_ids: Option<Vec<u32>>,
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
pub(super) fn parse_tool_call(call: &Value) -> Result<ToolCall, String> {
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
