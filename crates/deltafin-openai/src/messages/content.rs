//! Anthropic `system` and `messages` onto the chat messages K3's template renders.
//!
//! A user turn's text blocks become one user message, each `tool_result` block a tool
//! message (named after the `tool_use` it answers); an assistant turn's `thinking` block
//! becomes its reasoning, its text blocks its content and its `tool_use` blocks its tool
//! calls. Consecutive turns of one role are one turn, as Anthropic combines them. Anything
//! the template cannot render as sent is refused with the reason (docs/SERVER.md,
//! "/v1/messages").

use super::wire::{bad, check_cache_control, object, only_keys, signature, string};
use crate::error::ApiError;
use crate::request::MULTIMODAL;
use crate::seal::Sealer;
use deltafin_k3::text::chat::{ChatMessage, Content, ToolCall};
use serde_json::{Map, Value};
use std::collections::HashMap;

/// The first text of the `system` block Claude Code adds to every request: client
/// identification that changes with every session (its version and entry point), not an
/// instruction. It is kept out of the prompt, so that one agent's sessions share their
/// prefix state (llama.cpp and vLLM strip it too).
pub const BILLING_HEADER: &str = "x-anthropic-billing-header:";

/// What converting a conversation needs besides the messages.
pub struct Convert<'a> {
    /// Opens the signatures of thinking blocks sent back.
    pub sealer: &'a Sealer,
    /// Tools declared with `defer_loading: true` (name → the declaration), loaded into the
    /// conversation where a `tool_reference` block names them.
    pub deferred: &'a HashMap<String, Value>,
    /// The names of the tools declared up front (a reference to one adds nothing).
    pub declared: &'a [String],
}

/// The chat messages of `system` (absent, a string or text blocks) and `messages`.
pub fn convert(
    system: Option<&Value>,
    messages: &[Value],
    cx: &Convert<'_>,
) -> Result<Vec<ChatMessage>, ApiError> {
    let mut b = Builder {
        sealer: Some(cx.sealer),
        deferred: Some(cx.deferred),
        declared: cx.declared,
        ..Builder::default()
    };
    if let Some(system) = system {
        let mut parts = text_content(system, "system", "`system`")?;
        parts.retain(|t| !t.starts_with(BILLING_HEADER));
        if !parts.is_empty() {
            b.out.push(message("system", parts));
        }
    }
    for (i, m) in messages.iter().enumerate() {
        b.turn(i, m)?;
    }
    if b.out.last().is_some_and(|m| m.role == "assistant") {
        return Err(bad(
            &format!("messages[{}]", messages.len() - 1),
            "a final assistant message (prefill) is not implemented: K3's template always opens a new assistant message; end with a user turn",
        ));
    }
    Ok(b.out)
}

fn message(role: &str, parts: Vec<String>) -> ChatMessage {
    ChatMessage {
        role: role.to_string(),
        content: Some(Content::Parts(parts)),
        ..Default::default()
    }
}

/// Appends `more` text parts to a message's content.
fn append_parts(m: &mut ChatMessage, more: Vec<String>) {
    match &mut m.content {
        Some(Content::Parts(p)) => p.extend(more),
        Some(Content::Text(t)) => {
            let mut p = vec![std::mem::take(t)];
            p.extend(more);
            m.content = Some(Content::Parts(p));
        }
        None => m.content = Some(Content::Parts(more)),
    }
}

/// A string, or an array of text blocks: their texts (`""` and `[]` give none).
fn text_content(v: &Value, param: &str, what: &str) -> Result<Vec<String>, ApiError> {
    match v {
        Value::String(s) if s.is_empty() => Ok(Vec::new()),
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(blocks) => {
            let mut out = Vec::with_capacity(blocks.len());
            for (j, block) in blocks.iter().enumerate() {
                let p = format!("{param}[{j}]");
                let obj = object(block, &p, "a content block")?;
                match obj.get("type").and_then(Value::as_str) {
                    Some("text") => out.push(text_block(obj, &p)?),
                    Some(t) if is_media(t) => return Err(bad(&p, MULTIMODAL)),
                    Some(t) => {
                        return Err(bad(&p, format!("{what} takes only text blocks, not `{t}`")));
                    }
                    None => return Err(bad(&p, "every content block needs a `type` string")),
                }
            }
            Ok(out)
        }
        _ => Err(bad(
            param,
            format!("{what} must be a string or an array of text blocks"),
        )),
    }
}

fn is_media(t: &str) -> bool {
    matches!(
        t,
        "image" | "document" | "search_result" | "container_upload"
    )
}

/// `{"type":"text","text":…}` with optional `cache_control` and empty `citations`.
fn text_block(obj: &Map<String, Value>, p: &str) -> Result<String, ApiError> {
    only_keys(
        obj,
        &["type", "text", "cache_control", "citations"],
        p,
        "a text block",
    )?;
    check_cache_control(obj.get("cache_control"), p)?;
    match obj.get("citations") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(_) => {
            return Err(bad(
                p,
                "text block `citations` are not implemented; refusing to silently ignore them",
            ));
        }
    }
    Ok(string(obj, "text", p, "a text block")?.to_string())
}

/// A tool a `tool_addition` block adds.
enum Added {
    /// One of the request's tools, by name.
    Named(String),
    /// A definition given in the block (the template's function shape).
    Defined(Value),
}

#[derive(Default)]
struct Builder<'a> {
    sealer: Option<&'a Sealer>,
    deferred: Option<&'a HashMap<String, Value>>,
    /// The tools declared up front.
    declared: &'a [String],
    /// Deferred tools already loaded (each is declared once).
    loaded: Vec<String>,
    out: Vec<ChatMessage>,
    /// `tool_use` id → tool name, for the results that answer them.
    tool_names: HashMap<String, String>,
    /// Whether the last message came from a user turn's text (so a following user turn's
    /// text joins it).
    user_text_open: bool,
}

impl Builder<'_> {
    fn turn(&mut self, i: usize, m: &Value) -> Result<(), ApiError> {
        let param = format!("messages[{i}]");
        let obj = object(m, &param, "every message")?;
        only_keys(obj, &["role", "content"], &param, "a message")?;
        let role = string(obj, "role", &param, "every message")?;
        let content = obj
            .get("content")
            .filter(|c| !c.is_null())
            .ok_or_else(|| bad(&param, "every message needs `content`"))?;
        if content.as_array().is_some_and(Vec::is_empty) {
            return Err(bad(
                &param,
                "message `content` must hold at least one block",
            ));
        }
        let blocks = match content {
            Value::String(s) => vec![Value::from(s.as_str())],
            Value::Array(a) => a.clone(),
            _ => {
                return Err(bad(
                    &param,
                    "message `content` must be a string or an array of content blocks",
                ));
            }
        };
        match role {
            "user" => self.user(&param, &blocks),
            "assistant" => self.assistant(&param, &blocks),
            "system" => {
                self.system(&param, content)?;
                self.user_text_open = false;
                Ok(())
            }
            other => Err(bad(
                &param,
                format!(
                    "unsupported message role `{other}`; {} takes user, assistant and system messages",
                    super::wire::ENDPOINT
                ),
            )),
        }
    }

    /// A mid-conversation system message: its text blocks, and `tool_addition` blocks that
    /// load deferred tools at this place (the template's dynamic tool declaration).
    fn system(&mut self, param: &str, content: &Value) -> Result<(), ApiError> {
        let blocks = match content {
            Value::String(s) => {
                self.out.push(message("system", vec![s.clone()]));
                return Ok(());
            }
            Value::Array(blocks) => blocks,
            _ => {
                return Err(bad(
                    param,
                    "a system message's `content` must be a string or an array of blocks",
                ));
            }
        };
        let mut texts = Vec::new();
        let mut added: Vec<Added> = Vec::new();
        for (j, block) in blocks.iter().enumerate() {
            let p = format!("{param}.content[{j}]");
            let obj = object(block, &p, "a content block")?;
            match obj.get("type").and_then(Value::as_str) {
                Some("text") => texts.push(text_block(obj, &p)?),
                Some("tool_addition") => {
                    only_keys(
                        obj,
                        &["type", "tool", "cache_control"],
                        &p,
                        "a tool_addition block",
                    )?;
                    check_cache_control(obj.get("cache_control"), &p)?;
                    let tool = object(
                        obj.get("tool").unwrap_or(&Value::Null),
                        &p,
                        "`tool_addition.tool`",
                    )?;
                    match tool.get("type").and_then(Value::as_str) {
                        // A tool of the request's `tools` (usually deferred), by name.
                        Some("tool_reference") => {
                            only_keys(tool, &["type", "name"], &p, "a tool_reference")?;
                            added.push(Added::Named(
                                string(tool, "name", &p, "a tool_reference")?.to_string(),
                            ));
                        }
                        // A whole definition (the `inline-tools` beta).
                        Some("tool_definition") => {
                            only_keys(tool, &["type", "definition"], &p, "a tool_definition")?;
                            let def = tool.get("definition").cloned().unwrap_or(Value::Null);
                            let (declared, deferred) = super::tools(Some(&Value::Array(vec![def])))
                                .map_err(|e| {
                                    bad(
                                        &p,
                                        format!("`tool_addition.tool.definition`: {}", e.message),
                                    )
                                })?;
                            added.extend(
                                declared
                                    .into_iter()
                                    .chain(deferred.into_values())
                                    .map(Added::Defined),
                            );
                        }
                        Some(t) => {
                            return Err(bad(
                                &p,
                                format!(
                                    "`tool_addition.tool.type` {t:?} is not implemented: Deltafin adds `tool_reference` and `tool_definition` tools (MCP references need an MCP connector)"
                                ),
                            ));
                        }
                        None => return Err(bad(&p, "`tool_addition.tool` needs a `type` string")),
                    }
                }
                Some("tool_removal") => {
                    return Err(bad(
                        &p,
                        "`tool_removal` is not implemented: K3's template can add tools mid-conversation but has no way to withdraw one",
                    ));
                }
                Some(t) if is_media(t) => return Err(bad(&p, MULTIMODAL)),
                Some(t) => {
                    return Err(bad(
                        &p,
                        format!("a system message takes text and tool_addition blocks, not `{t}`"),
                    ));
                }
                None => return Err(bad(&p, "every content block needs a `type` string")),
            }
        }
        if !texts.is_empty() {
            self.out.push(message("system", texts));
        }
        let mut names = Vec::new();
        let mut defined = Vec::new();
        for a in added {
            match a {
                Added::Named(n) => names.push(n),
                Added::Defined(t) => defined.push(t),
            }
        }
        self.load_tools(&names, param)?;
        if !defined.is_empty() {
            self.out.push(ChatMessage {
                role: "system".into(),
                tools: defined,
                ..Default::default()
            });
        }
        Ok(())
    }

    /// Declares the deferred tools `names` (those not loaded yet) at this place.
    fn load_tools(&mut self, names: &[String], p: &str) -> Result<(), ApiError> {
        let mut tools = Vec::new();
        for name in names {
            if self.declared.contains(name) {
                // Declared up front: it is in the prompt already, so adding it again asks
                // for nothing.
                continue;
            }
            let tool = self.deferred.and_then(|d| d.get(name)).ok_or_else(|| {
                bad(
                    p,
                    format!("tool {name:?} is not one of the request's `tools`"),
                )
            })?;
            if !self.loaded.contains(name) {
                self.loaded.push(name.clone());
                tools.push(tool.clone());
            }
        }
        if !tools.is_empty() {
            self.out.push(ChatMessage {
                role: "system".into(),
                tools,
                ..Default::default()
            });
        }
        Ok(())
    }

    fn push_user_text(&mut self, texts: &mut Vec<String>) {
        if texts.is_empty() {
            return;
        }
        let texts = std::mem::take(texts);
        match self.out.last_mut() {
            Some(last) if self.user_text_open => append_parts(last, texts),
            _ => self.out.push(message("user", texts)),
        }
        self.user_text_open = true;
    }

    fn user(&mut self, param: &str, blocks: &[Value]) -> Result<(), ApiError> {
        let mut texts = Vec::new();
        // Deferred tools named by the tool results of this turn, loaded after them.
        let mut referenced: Vec<String> = Vec::new();
        for (j, block) in blocks.iter().enumerate() {
            let p = format!("{param}.content[{j}]");
            if let Value::String(s) = block {
                texts.push(s.clone());
                continue;
            }
            let obj = object(block, &p, "a content block")?;
            match obj.get("type").and_then(Value::as_str) {
                Some("text") => texts.push(text_block(obj, &p)?),
                Some("tool_result") => {
                    self.push_user_text(&mut texts);
                    let msg = self.tool_result(obj, &p, &mut referenced)?;
                    self.out.push(msg);
                    self.user_text_open = false;
                }
                Some(t) if is_media(t) => return Err(bad(&p, MULTIMODAL)),
                Some(t @ ("tool_use" | "thinking" | "redacted_thinking")) => {
                    return Err(bad(
                        &p,
                        format!("a `{t}` block belongs in an assistant message"),
                    ));
                }
                Some(t) => return Err(unsupported_block(&p, t)),
                None => return Err(bad(&p, "every content block needs a `type` string")),
            }
        }
        if !referenced.is_empty() {
            self.load_tools(&referenced, param)?;
            self.user_text_open = false;
        }
        self.push_user_text(&mut texts);
        Ok(())
    }

    fn tool_result(
        &self,
        obj: &Map<String, Value>,
        p: &str,
        referenced: &mut Vec<String>,
    ) -> Result<ChatMessage, ApiError> {
        only_keys(
            obj,
            &[
                "type",
                "tool_use_id",
                "content",
                "is_error",
                "cache_control",
            ],
            p,
            "a tool_result block",
        )?;
        check_cache_control(obj.get("cache_control"), p)?;
        let id = string(obj, "tool_use_id", p, "a tool_result block")?;
        let name = self.tool_names.get(id).ok_or_else(|| {
            bad(p, format!("tool_result `tool_use_id` {id:?} matches no tool_use block of an earlier assistant message"))
        })?;
        let is_error = match obj.get("is_error") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(bad(p, "tool_result `is_error` must be a boolean")),
        };
        let mut parts = match obj.get("content") {
            None | Some(Value::Null) => Vec::new(),
            Some(c) => result_content(c, &format!("{p}.content"), referenced)?,
        };
        // The template has no error flag: a failed call's result says so in its text.
        if is_error {
            parts.insert(0, "Error: ".to_string());
        }
        Ok(ChatMessage {
            role: "tool".into(),
            content: Some(Content::Parts(parts)),
            tool: Some(name.clone()),
            tool_call_id: Some(id.to_string()),
            ..Default::default()
        })
    }

    fn assistant(&mut self, param: &str, blocks: &[Value]) -> Result<(), ApiError> {
        self.user_text_open = false;
        // Consecutive assistant turns are one turn.
        let mut msg = match self.out.last() {
            Some(last) if last.role == "assistant" => self.out.pop().unwrap_or_default(),
            _ => ChatMessage {
                role: "assistant".into(),
                ..Default::default()
            },
        };
        for (j, block) in blocks.iter().enumerate() {
            let p = format!("{param}.content[{j}]");
            if let Value::String(s) = block {
                self.assistant_text(&mut msg, s.clone(), &p)?;
                continue;
            }
            let obj = object(block, &p, "a content block")?;
            match obj.get("type").and_then(Value::as_str) {
                Some("text") => {
                    let t = text_block(obj, &p)?;
                    self.assistant_text(&mut msg, t, &p)?;
                }
                Some("thinking") => thinking_block(&mut msg, obj, &p, self.sealer)?,
                Some("redacted_thinking") => {
                    return Err(bad(
                        &p,
                        "`redacted_thinking` blocks are not implemented: Deltafin never redacts thinking, so it cannot read one back; send the `thinking` block it returned, or drop the block",
                    ));
                }
                Some("tool_use") => {
                    only_keys(
                        obj,
                        &["type", "id", "name", "input", "cache_control"],
                        &p,
                        "a tool_use block",
                    )?;
                    check_cache_control(obj.get("cache_control"), &p)?;
                    let id = string(obj, "id", &p, "a tool_use block")?;
                    let name = string(obj, "name", &p, "a tool_use block")?;
                    let input = match obj.get("input") {
                        Some(v @ Value::Object(_)) => v.to_string(),
                        _ => return Err(bad(&p, "tool_use `input` must be a JSON object")),
                    };
                    if self
                        .tool_names
                        .insert(id.to_string(), name.to_string())
                        .is_some()
                    {
                        return Err(bad(&p, format!("tool_use id {id:?} is used twice")));
                    }
                    msg.tool_calls.push(ToolCall {
                        id: Some(id.to_string()),
                        name: name.to_string(),
                        arguments: input,
                    });
                }
                Some(t) if is_media(t) => return Err(bad(&p, MULTIMODAL)),
                Some("tool_result") => {
                    return Err(bad(&p, "a `tool_result` block belongs in a user message"));
                }
                Some(t) => return Err(unsupported_block(&p, t)),
                None => return Err(bad(&p, "every content block needs a `type` string")),
            }
        }
        self.out.push(msg);
        Ok(())
    }

    /// Text of an assistant turn: it renders before the tool calls, so none may precede it.
    fn assistant_text(&self, msg: &mut ChatMessage, text: String, p: &str) -> Result<(), ApiError> {
        if !msg.tool_calls.is_empty() {
            return Err(bad(
                p,
                "assistant text after a tool_use block cannot be rendered: K3's template puts an assistant message's text before its tool calls",
            ));
        }
        append_parts(msg, vec![text]);
        Ok(())
    }
}

/// A tool result's content: a string, or text blocks and `tool_reference` blocks (a client's
/// tool search naming deferred tools, loaded after the result).
fn result_content(
    v: &Value,
    p: &str,
    referenced: &mut Vec<String>,
) -> Result<Vec<String>, ApiError> {
    let Value::Array(blocks) = v else {
        return text_content(v, p, "tool_result `content`");
    };
    let mut texts = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        let pj = format!("{p}[{j}]");
        let obj = object(block, &pj, "a content block")?;
        match obj.get("type").and_then(Value::as_str) {
            Some("tool_reference") => {
                only_keys(
                    obj,
                    &["type", "tool_name", "cache_control"],
                    &pj,
                    "a tool_reference block",
                )?;
                check_cache_control(obj.get("cache_control"), &pj)?;
                referenced
                    .push(string(obj, "tool_name", &pj, "a tool_reference block")?.to_string());
            }
            _ => texts.extend(text_content(
                &Value::Array(vec![block.clone()]),
                p,
                "tool_result `content`",
            )?),
        }
    }
    Ok(texts)
}

/// A `thinking` block: the first of its assistant turn, sent back as Deltafin returned it.
/// Its `signature` carries the reasoning's exact ids ([`crate::seal`]), so the reasoning
/// renders token for token (also when `display: "omitted"` left its text empty).
fn thinking_block(
    msg: &mut ChatMessage,
    obj: &Map<String, Value>,
    p: &str,
    sealer: Option<&Sealer>,
) -> Result<(), ApiError> {
    only_keys(
        obj,
        &["type", "thinking", "signature", "cache_control"],
        p,
        "a thinking block",
    )?;
    check_cache_control(obj.get("cache_control"), p)?;
    let thinking = string(obj, "thinking", p, "a thinking block")?;
    let sig = string(obj, "signature", p, "a thinking block")?;
    if msg.reasoning_content.is_some() || msg.reasoning_ids.is_some() {
        return Err(bad(
            p,
            "an assistant turn can carry one thinking block; K3's template has one thinking channel per message",
        ));
    }
    if msg.content.is_some() || !msg.tool_calls.is_empty() {
        return Err(bad(
            p,
            "a thinking block must come first in its assistant turn, before text and tool_use blocks",
        ));
    }
    if sig.starts_with(crate::seal::PREFIX) {
        let ids = sealer
            .ok_or_else(|| bad(p, "no sealer"))?
            .open(sig)
            .map_err(|e| {
                bad(
                    p,
                    format!(
                        "thinking block `signature` cannot be restored: {e}; send thinking blocks back exactly as this server returned them, or drop them"
                    ),
                )
            })?;
        msg.reasoning_ids = Some(ids);
    } else if sig != signature(thinking) {
        return Err(bad(
            p,
            "thinking block `signature` does not match its text: send thinking blocks back exactly as Deltafin returned them",
        ));
    }
    msg.reasoning_content = Some(thinking.to_string());
    Ok(())
}

fn unsupported_block(p: &str, t: &str) -> ApiError {
    bad(
        p,
        format!(
            "content block type `{t}` is not implemented by Deltafin's native {}; refusing to silently ignore it",
            super::wire::ENDPOINT
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn conv(system: Option<Value>, msgs: Value) -> Result<Vec<ChatMessage>, ApiError> {
        let sealer = Sealer::ephemeral();
        let deferred = HashMap::new();
        let cx = Convert {
            sealer: &sealer,
            deferred: &deferred,
            declared: &[],
        };
        convert(system.as_ref(), msgs.as_array().unwrap(), &cx)
    }

    fn parts(m: &ChatMessage) -> Vec<String> {
        match &m.content {
            Some(Content::Parts(p)) => p.clone(),
            Some(Content::Text(t)) => vec![t.clone()],
            None => vec![],
        }
    }

    #[test]
    fn system_and_text_turns() {
        let m = conv(
            Some(json!([{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}])),
            json!([{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "again"}]}]),
        )
        .unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(
            (m[0].role.as_str(), parts(&m[0])),
            ("system", vec!["be brief".to_string()])
        );
        // Consecutive user turns are one turn.
        assert_eq!(parts(&m[1]), vec!["hi", "again"]);
        assert!(
            conv(Some(json!("")), json!([{"role": "user", "content": "x"}]))
                .unwrap()
                .len()
                == 1
        );
    }

    #[test]
    fn tool_history_round_trip() {
        let sig = signature("let me look");
        let m = conv(
            None,
            json!([
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "let me look", "signature": sig},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "text", "text": "thanks"}
                ]}
            ]),
        )
        .unwrap();
        assert_eq!(m.len(), 4);
        let a = &m[1];
        assert_eq!(a.reasoning_content.as_deref(), Some("let me look"));
        assert_eq!(parts(a), vec!["Checking."]);
        assert_eq!(a.tool_calls.len(), 1);
        assert_eq!(a.tool_calls[0].name, "get_weather");
        assert_eq!(a.tool_calls[0].id.as_deref(), Some("toolu_1"));
        assert_eq!(
            serde_json::from_str::<Value>(&a.tool_calls[0].arguments).unwrap(),
            json!({"city": "Paris"})
        );
        let t = &m[2];
        assert_eq!(
            (
                t.role.as_str(),
                t.tool.as_deref(),
                t.tool_call_id.as_deref()
            ),
            ("tool", Some("get_weather"), Some("toolu_1"))
        );
        assert_eq!(parts(t), vec!["sunny"]);
        assert_eq!(
            (m[3].role.as_str(), parts(&m[3])),
            ("user", vec!["thanks".to_string()])
        );
    }

    #[test]
    fn tool_result_errors_and_blocks() {
        let history = |result: Value| {
            conv(
                None,
                json!([
                    {"role": "user", "content": "go"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                    {"role": "user", "content": [result]}
                ]),
            )
        };
        let m = history(
            json!({"type": "tool_result", "tool_use_id": "t", "is_error": true,
                               "content": [{"type": "text", "text": "boom"}]}),
        )
        .unwrap();
        assert_eq!(parts(&m[2]), vec!["Error: ", "boom"]);
        let e = history(json!({"type": "tool_result", "tool_use_id": "nope", "content": "x"}))
            .unwrap_err();
        assert!(e.message.contains("matches no tool_use"), "{e}");
        let e = history(json!({"type": "tool_result", "tool_use_id": "t",
                               "content": [{"type": "image", "source": {}}]}))
        .unwrap_err();
        assert!(e.message.contains("text-only"), "{e}");
        let e = history(json!({"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}))
            .unwrap_err();
        assert!(e.message.contains("is_error"), "{e}");
    }

    #[test]
    fn refusals_name_the_problem() {
        let one = |msgs: Value| conv(None, msgs).unwrap_err();
        let e =
            one(json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": "pre"}]));
        assert!(e.message.contains("prefill"), "{e}");
        assert_eq!(e.param.as_deref(), Some("messages[1]"));
        let e = one(json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]));
        assert!(e.message.contains("text-only"), "{e}");
        let e = one(json!([{"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "zz"}]},
            {"role": "user", "content": "y"}]));
        assert!(e.message.contains("redacted_thinking"), "{e}");
        let e = one(json!([{"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "a", "signature": "forged"}]},
            {"role": "user", "content": "y"}]));
        assert!(e.message.contains("signature"), "{e}");
        let e = one(json!([{"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}, {"type": "text", "text": "after"}]},
            {"role": "user", "content": "y"}]));
        assert!(e.message.contains("after a tool_use"), "{e}");
        let e = one(
            json!([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
        );
        assert!(e.message.contains("assistant message"), "{e}");
        let e = one(json!([{"role": "user", "content": "x", "name": "bob"}]));
        assert!(e.message.contains("`name`"), "{e}");
        let e = one(json!([{"role": "critic", "content": "x"}]));
        assert!(e.message.contains("role `critic`"), "{e}");
        let e = one(json!([{"role": "user", "content": []}]));
        assert!(e.message.contains("at least one"), "{e}");
        let e = one(json!([{"role": "user", "content": [{"type": "server_tool_use"}]}]));
        assert!(
            e.message.contains("`server_tool_use` is not implemented"),
            "{e}"
        );
        let e = one(
            json!([{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{}]}]}]),
        );
        assert!(e.message.contains("citations"), "{e}");
    }

    #[test]
    fn consecutive_assistant_turns_merge() {
        let m = conv(
            None,
            json!([
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "a"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"k": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}
            ]),
        )
        .unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(parts(&m[1]), vec!["a"]);
        assert_eq!(m[1].tool_calls.len(), 1);
        assert_eq!(parts(&m[2]), Vec::<String>::new());
    }
}
