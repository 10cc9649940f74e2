//! Responses `instructions` and `input` items onto the chat messages K3's template renders.
//!
//! Messages keep their role (`developer` renders as `system`); an assistant turn gathers the
//! `reasoning` item, the assistant message and the `function_call` items that follow one
//! another; each `function_call_output` becomes a tool message named after its call.
//! Anything the template cannot render as sent is refused with the reason (docs/SERVER.md,
//! "/v1/responses").

use crate::error::ApiError;
use crate::request::MULTIMODAL;
use crate::seal::Sealer;
use deltafin_k3::text::chat::{ChatMessage, Content, ToolCall};
use serde_json::{Map, Value};
use std::collections::HashMap;

/// The endpoint name used in messages.
pub const ENDPOINT: &str = "/v1/responses";

pub use crate::strict::{bad, string};

/// Refuses a key of `obj` that is not in `allowed`, naming it and where it is.
pub fn only_keys(
    obj: &Map<String, Value>,
    allowed: &[&str],
    param: &str,
    what: &str,
) -> Result<(), ApiError> {
    crate::strict::only_keys(obj, allowed, param, what, ENDPOINT)
}

/// `input` as a list of items, each with an `id` (`<prefix>_<n>` where the client sent none):
/// what a stored response lists as its `input_items` and continues from.
pub fn with_ids(input: &Value, prefix: &str) -> Vec<Value> {
    let items = match input {
        Value::String(s) => vec![serde_json::json!({
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": s}],
        })],
        Value::Array(items) => items.clone(),
        _ => return Vec::new(),
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, mut item)| {
            if let Some(obj) = item.as_object_mut()
                && !obj.get("id").is_some_and(Value::is_string)
            {
                obj.insert("id".into(), Value::from(format!("{prefix}_{i}")));
            }
            item
        })
        .collect()
}

/// The chat messages of `instructions` and `input` (a string or a list of items); `sealer`
/// opens reasoning items' `encrypted_content`.
pub fn convert(
    instructions: Option<&str>,
    input: &Value,
    sealer: &Sealer,
) -> Result<Vec<ChatMessage>, ApiError> {
    let mut b = Builder {
        sealer: Some(sealer),
        ..Builder::default()
    };
    if let Some(text) = instructions {
        b.out.push(ChatMessage::new("system", text));
    }
    match input {
        Value::String(s) => b.out.push(ChatMessage::new("user", s)),
        Value::Array(items) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                b.item(&format!("input[{i}]"), item)?;
            }
            b.flush();
        }
        _ => {
            return Err(bad(
                "input",
                "`input` must be a string or a non-empty array of input items",
            ));
        }
    }
    if b.out.last().is_some_and(|m| m.role == "assistant") {
        return Err(bad(
            "input",
            "input ending with an assistant turn (prefill) is not implemented: K3's template always opens a new assistant message; end with a user message or function_call_output",
        ));
    }
    Ok(b.out)
}

#[derive(Default)]
struct Builder<'s> {
    /// Opens sealed reasoning.
    sealer: Option<&'s Sealer>,
    out: Vec<ChatMessage>,
    /// The assistant turn being gathered.
    pending: Option<ChatMessage>,
    /// `call_id` → function name, for the outputs that answer them.
    call_names: HashMap<String, String>,
}

impl Builder<'_> {
    fn flush(&mut self) {
        if let Some(m) = self.pending.take() {
            self.out.push(m);
        }
    }

    /// The assistant turn to add to; a new one when `starts_new` says the pending one is
    /// past where this item goes.
    fn assistant(&mut self, starts_new: impl Fn(&ChatMessage) -> bool) -> &mut ChatMessage {
        if self.pending.as_ref().is_some_and(&starts_new) {
            self.flush();
        }
        self.pending.get_or_insert_with(|| ChatMessage {
            role: "assistant".into(),
            ..Default::default()
        })
    }

    fn item(&mut self, p: &str, item: &Value) -> Result<(), ApiError> {
        let obj = item
            .as_object()
            .ok_or_else(|| bad(p, "every input item must be a JSON object"))?;
        let kind = match obj.get("type") {
            None | Some(Value::Null) if obj.contains_key("role") => "message",
            Some(Value::String(t)) => t.as_str(),
            _ => return Err(bad(p, "every input item needs a `type` string")),
        };
        match kind {
            "message" => self.message(p, obj),
            "function_call" => {
                only_keys(
                    obj,
                    &[
                        "type",
                        "call_id",
                        "name",
                        "arguments",
                        "id",
                        "status",
                        "namespace",
                    ],
                    p,
                    "a function_call item",
                )?;
                let call_id = string(obj, "call_id", p, "a function_call item")?;
                let name = string(obj, "name", p, "a function_call item")?;
                let arguments = string(obj, "arguments", p, "a function_call item")?;
                if obj
                    .get("namespace")
                    .is_some_and(|n| !n.is_string() && !n.is_null())
                {
                    return Err(bad(p, "function_call `namespace` must be a string"));
                }
                // Arguments that are JSON must be an object. Text that is not JSON (a call a
                // length limit cut off, as this server answered it) is rendered verbatim as
                // the template's raw `json` block (docs/K3.md §8.4).
                if let Ok(v) = serde_json::from_str::<Value>(arguments)
                    && !v.is_object()
                {
                    return Err(bad(
                        p,
                        "function_call `arguments` must be the JSON text of an object",
                    ));
                }
                if self
                    .call_names
                    .insert(call_id.to_string(), name.to_string())
                    .is_some()
                {
                    return Err(bad(
                        p,
                        format!("function_call call_id {call_id:?} is used twice"),
                    ));
                }
                self.assistant(|_| false).tool_calls.push(ToolCall {
                    id: Some(call_id.to_string()),
                    name: name.to_string(),
                    arguments: arguments.to_string(),
                });
                Ok(())
            }
            "function_call_output" => {
                only_keys(
                    obj,
                    &["type", "call_id", "output", "id", "status"],
                    p,
                    "a function_call_output item",
                )?;
                let call_id = string(obj, "call_id", p, "a function_call_output item")?;
                let name = self.call_names.get(call_id).cloned().ok_or_else(|| {
                    bad(
                        p,
                        format!(
                            "function_call_output `call_id` {call_id:?} matches no earlier function_call item"
                        ),
                    )
                })?;
                let parts = match obj.get("output") {
                    Some(Value::String(s)) => vec![s.clone()],
                    Some(Value::Array(parts)) => text_parts(p, parts, &["input_text"])?,
                    _ => {
                        return Err(bad(
                            p,
                            "function_call_output `output` must be a string or an array of input_text parts",
                        ));
                    }
                };
                self.flush();
                self.out.push(ChatMessage {
                    role: "tool".into(),
                    content: Some(Content::Parts(parts)),
                    tool: Some(name),
                    tool_call_id: Some(call_id.to_string()),
                    ..Default::default()
                });
                Ok(())
            }
            "reasoning" => self.reasoning(p, obj),
            other => Err(bad(
                p,
                format!(
                    "input item type `{other}` is not implemented by Deltafin's native {ENDPOINT}; refusing to silently ignore it"
                ),
            )),
        }
    }

    fn message(&mut self, p: &str, obj: &Map<String, Value>) -> Result<(), ApiError> {
        only_keys(
            obj,
            &["type", "role", "content", "id", "status", "phase"],
            p,
            "a message item",
        )?;
        let role = string(obj, "role", p, "a message item")?;
        let (role, kinds): (&str, &[&str]) = match role {
            "user" => ("user", &["input_text"]),
            "system" | "developer" => ("system", &["input_text"]),
            "assistant" => ("assistant", &["output_text", "input_text"]),
            other => {
                return Err(bad(
                    p,
                    format!(
                        "unsupported message role `{other}`; {ENDPOINT} takes user, system, developer and assistant messages"
                    ),
                ));
            }
        };
        if role != "assistant" && obj.get("phase").is_some_and(|v| !v.is_null()) {
            return Err(bad(p, "`phase` belongs to assistant messages"));
        }
        let parts = match obj.get("content") {
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(parts)) => text_parts(p, parts, kinds)?,
            _ => {
                return Err(bad(
                    p,
                    "message `content` must be a string or an array of content parts",
                ));
            }
        };
        if role == "assistant" {
            let m = self.assistant(|m| m.content.is_some() || !m.tool_calls.is_empty());
            m.content = Some(Content::Parts(parts));
        } else {
            self.flush();
            self.out.push(ChatMessage {
                role: role.into(),
                content: Some(Content::Parts(parts)),
                ..Default::default()
            });
        }
        Ok(())
    }

    fn reasoning(&mut self, p: &str, obj: &Map<String, Value>) -> Result<(), ApiError> {
        only_keys(
            obj,
            &[
                "type",
                "id",
                "summary",
                "content",
                "encrypted_content",
                "status",
            ],
            p,
            "a reasoning item",
        )?;
        // The sealed ids of this server's own answer restore the reasoning token for token.
        let ids = match obj.get("encrypted_content") {
            None | Some(Value::Null) => None,
            Some(Value::String(token)) => {
                let sealer = self.sealer.ok_or_else(|| bad(p, "no sealer"))?;
                Some(sealer.open(token).map_err(|e| {
                    bad(
                        p,
                        format!(
                            "reasoning `encrypted_content` cannot be restored: {e}; send the reasoning as `content` or `summary` text without `encrypted_content`, or start the conversation again"
                        ),
                    )
                })?)
            }
            Some(_) => return Err(bad(p, "reasoning `encrypted_content` must be a string")),
        };
        let texts = |key: &str, kind: &str| -> Result<Vec<String>, ApiError> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(Vec::new()),
                Some(Value::Array(parts)) => text_parts(p, parts, &[kind]),
                Some(_) => Err(bad(p, format!("reasoning `{key}` must be an array"))),
            }
        };
        let content = texts("content", "reasoning_text")?;
        let summary = texts("summary", "summary_text")?;
        if !obj.contains_key("summary") {
            return Err(bad(p, "a reasoning item needs `summary` (an array)"));
        }
        // Deltafin's own items carry the text once: in `content`, or verbatim as the summary.
        let text = if content.is_empty() {
            summary.join("\n\n")
        } else {
            content.concat()
        };
        let m = self.assistant(|m| {
            m.reasoning_content.is_some() || m.content.is_some() || !m.tool_calls.is_empty()
        });
        m.reasoning_content = Some(text);
        m.reasoning_ids = ids;
        Ok(())
    }
}

/// The texts of content parts, each `{"type": KIND, "text": …}` with KIND in `kinds`
/// (output text may carry empty `annotations` and `logprobs`).
fn text_parts(p: &str, parts: &[Value], kinds: &[&str]) -> Result<Vec<String>, ApiError> {
    let mut out = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let pp = format!("{p}.content[{j}]");
        let obj = part
            .as_object()
            .ok_or_else(|| bad(&pp, "every content part must be a JSON object"))?;
        let kind = obj.get("type").and_then(Value::as_str).unwrap_or_default();
        if matches!(kind, "input_image" | "input_file" | "input_audio") {
            return Err(bad(&pp, MULTIMODAL));
        }
        if !kinds.contains(&kind) {
            return Err(bad(
                &pp,
                format!(
                    "content part type `{kind}` is not allowed here; expected {}",
                    kinds.join(" or ")
                ),
            ));
        }
        only_keys(
            obj,
            &["type", "text", "annotations", "logprobs"],
            &pp,
            "a content part",
        )?;
        for key in ["annotations", "logprobs"] {
            match obj.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::Array(a)) if a.is_empty() || key == "logprobs" => {}
                Some(_) => {
                    return Err(bad(
                        &pp,
                        format!(
                            "content part `{key}` are not implemented; refusing to silently ignore them"
                        ),
                    ));
                }
            }
        }
        out.push(string(obj, "text", &pp, "a content part")?.to_string());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sealer() -> Sealer {
        Sealer::ephemeral()
    }

    fn convert_list(v: Value) -> Vec<ChatMessage> {
        convert(None, &v, &sealer()).unwrap()
    }

    fn parts(m: &ChatMessage) -> Vec<String> {
        match &m.content {
            Some(Content::Parts(p)) => p.clone(),
            Some(Content::Text(t)) => vec![t.clone()],
            None => vec![],
        }
    }

    #[test]
    fn strings_and_instructions() {
        let m = convert(Some("be brief"), &json!("hi"), &sealer()).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(
            (m[0].role.as_str(), parts(&m[0])),
            ("system", vec!["be brief".to_string()])
        );
        assert_eq!(
            (m[1].role.as_str(), parts(&m[1])),
            ("user", vec!["hi".to_string()])
        );
        assert!(convert(None, &json!([]), &sealer()).is_err());
        assert!(convert(None, &json!(3), &sealer()).is_err());
    }

    #[test]
    fn a_tool_round_trip_in_the_input() {
        let m = convert_list(json!([
            {"role": "developer", "content": "use tools"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look it up"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}", "id": "fc_1", "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"role": "user", "content": "thanks"}
        ]));
        assert_eq!(m.len(), 5);
        assert_eq!(m[0].role, "system");
        let a = &m[2];
        assert_eq!(a.role, "assistant");
        assert_eq!(a.reasoning_content.as_deref(), Some("look it up"));
        assert_eq!(parts(a), vec!["Checking."]);
        assert_eq!(a.tool_calls[0].name, "get_weather");
        assert_eq!(a.tool_calls[0].id.as_deref(), Some("call_1"));
        let t = &m[3];
        assert_eq!(
            (
                t.role.as_str(),
                t.tool.as_deref(),
                t.tool_call_id.as_deref()
            ),
            ("tool", Some("get_weather"), Some("call_1"))
        );
        assert_eq!(parts(t), vec!["sunny"]);
        assert_eq!(m[4].role, "user");
    }

    #[test]
    fn turns_split_where_they_must() {
        let m = convert_list(json!([
            {"role": "user", "content": "go"},
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": ""},
            {"type": "function_call_output", "call_id": "a", "output": [{"type": "input_text", "text": "1"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s1"}, {"type": "summary_text", "text": "s2"}]},
            {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "b", "output": "2"}
        ]));
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["user", "assistant", "tool", "assistant", "tool"]);
        assert_eq!(m[3].reasoning_content.as_deref(), Some("s1\n\ns2"));
        assert_eq!(m[3].tool_calls[0].id.as_deref(), Some("b"));
    }

    #[test]
    fn sealed_reasoning_restores_its_ids() {
        let s = sealer();
        let token = s.seal(&[11, 163_587, 12]);
        let m = convert(
            None,
            &json!([{"role": "user", "content": "x"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "shown"}], "encrypted_content": token},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "y"}]),
            &s,
        )
        .unwrap();
        assert_eq!(m[1].reasoning_ids.as_deref(), Some(&[11, 163_587, 12][..]));
        // Another server's token is refused, naming the way out.
        let e = convert(
            None,
            &json!([{"type": "reasoning", "summary": [], "encrypted_content": token}, {"role": "user", "content": "y"}]),
            &sealer(),
        )
        .unwrap_err();
        assert!(e.message.contains("not made by this server"), "{e}");
        let items = with_ids(
            &json!([{"role": "user", "content": "x"}, {"id": "keep", "role": "user", "content": "y"}]),
            "in_ab",
        );
        assert_eq!(items[0]["id"], "in_ab_0");
        assert_eq!(items[1]["id"], "keep");
        assert_eq!(with_ids(&json!("hi"), "p")[0]["content"][0]["text"], "hi");
    }

    #[test]
    fn refusals_name_the_problem() {
        let one = |input: Value| convert(None, &input, &sealer()).unwrap_err();
        let e =
            one(json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]));
        assert!(e.message.contains("text-only"), "{e}");
        let e =
            one(json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": "pre"}]));
        assert!(e.message.contains("prefill"), "{e}");
        let e = one(json!([{"type": "function_call_output", "call_id": "zz", "output": "x"}]));
        assert!(
            e.message.contains("matches no earlier function_call"),
            "{e}"
        );
        let e = one(json!([{"type": "item_reference", "id": "x"}]));
        assert!(
            e.message.contains("`item_reference` is not implemented"),
            "{e}"
        );
        let e = one(
            json!([{"type": "reasoning", "summary": [], "encrypted_content": "abc"}, {"role": "user", "content": "x"}]),
        );
        assert!(
            e.message.contains("encrypted_content` cannot be restored"),
            "{e}"
        );
        let e = one(json!([{"role": "critic", "content": "x"}]));
        assert!(e.message.contains("role `critic`"), "{e}");
        let e = one(json!([{"role": "user", "content": "x", "name": "bob"}]));
        assert!(e.message.contains("`name`"), "{e}");
        let e = one(json!([{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]));
        assert!(e.message.contains("not allowed here"), "{e}");
        let e = one(
            json!([{"type": "function_call", "call_id": "a", "name": "f", "arguments": "[1]"}, {"role": "user", "content": "x"}]),
        );
        assert!(e.message.contains("JSON text of an object"), "{e}");
        // A call cut off by a length limit comes back as its text.
        let m = convert_list(json!([{"role": "user", "content": "x"},
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{\"q\": \"ab"},
            {"type": "function_call_output", "call_id": "a", "output": "r"}]));
        assert_eq!(m[1].tool_calls[0].arguments, "{\"q\": \"ab");
        let e = one(
            json!([{"role": "assistant", "content": [{"type": "output_text", "text": "x", "annotations": [{"type": "url_citation"}]}]}, {"role": "user", "content": "x"}]),
        );
        assert!(e.message.contains("annotations"), "{e}");
    }
}
