//! `POST /v1/messages`: the Anthropic Messages API on K3.
//!
//! A request is validated strictly (every field works exactly or is refused with a 400 that
//! names it, in Anthropic's error shape) and translated into the chat [`GenRequest`] the
//! other endpoints run: the XTML chat prompt with its [`ChatControls`], stop sequences and
//! the token budget. [`reply::MessagesReply`] renders the generation as a `message` object
//! or Anthropic's event stream. docs/SERVER.md, "/v1/messages", lists every rule.

mod content;
pub mod reply;
pub mod wire;

use crate::error::ApiError;
use crate::request::{ChatControls, GenRequest, Limits, Prompt, Surface, ToolMode};
use axum::http::HeaderMap;
use deltafin_k3::sampling::Sampling;
use deltafin_k3::text::chat::{ReasoningEffort, ResponseFormat, Thinking};
use serde_json::{Map, Value, json};
use wire::{ENDPOINT, bad, check_cache_control, object, only_keys, string};

/// The Messages API versions (the `anthropic-version` header) whose request and response
/// shapes this endpoint implements: the original one and the one current clients send.
pub const API_VERSIONS: &[&str] = &["2023-06-01", "2026-10-21"];
/// Most `stop_sequences`.
pub const MAX_STOP_SEQUENCES: usize = 8;
/// Smallest `thinking.budget_tokens` (Anthropic's rule).
pub const MIN_THINKING_BUDGET: u64 = 1024;

/// What the reply needs from the request.
#[derive(Clone, Debug, PartialEq)]
pub struct MessagesMeta {
    /// The stop sequences, to report the one that matched.
    pub stops: Vec<String>,
}

/// Checks the headers Anthropic clients send: `anthropic-version` must be one of
/// [`API_VERSIONS`]; `anthropic-beta` asks for features that are not implemented. `x-api-key` and
/// `authorization` are accepted (there is no authentication).
pub fn check_headers(headers: &HeaderMap) -> Result<(), ApiError> {
    if let Some(v) = headers.get("anthropic-version") {
        let v = v.to_str().unwrap_or_default().trim();
        if !API_VERSIONS.contains(&v) {
            return Err(ApiError::invalid(format!(
                "`anthropic-version: {v}` is not a Messages API version Deltafin implements; send one of {}",
                API_VERSIONS.join(", ")
            )));
        }
    }
    if let Some(v) = headers.get("anthropic-beta") {
        let v = String::from_utf8_lossy(v.as_bytes());
        return Err(ApiError::invalid(format!(
            "`anthropic-beta: {v}` asks for beta features, which Deltafin does not implement; refusing to silently ignore the header"
        )));
    }
    Ok(())
}

const FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "messages",
    "system",
    "metadata",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "thinking",
    "tools",
    "tool_choice",
    "output_config",
    "service_tier",
    "cache_control",
];

/// Validates a `/v1/messages` body and translates it.
pub fn parse(body: &Value, limits: &Limits) -> Result<(GenRequest, MessagesMeta), ApiError> {
    let obj = body
        .as_object()
        .ok_or_else(|| ApiError::invalid("request body must be a JSON object"))?;
    if let Some(k) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(bad(
            k,
            format!(
                "`{k}` is not supported by Deltafin's native {ENDPOINT} endpoint; refusing to silently ignore an unknown or generation-semantic field"
            ),
        ));
    }
    let get = |k: &str| field(obj, k);

    match get("model") {
        None => return Err(bad("model", "`model` is required")),
        Some(Value::String(m)) if crate::models::is_served(m, limits.model_aliases) => {}
        Some(Value::String(m)) => {
            return Err(ApiError::model_not_found(m, limits.model_aliases));
        }
        Some(_) => return Err(bad("model", "`model` must be a JSON string")),
    }

    let asked = match get("max_tokens") {
        None => return Err(bad("max_tokens", "`max_tokens` is required")),
        Some(v) => match v.as_u64() {
            Some(0) => {
                return Err(bad(
                    "max_tokens",
                    "`max_tokens: 0` (prompt-cache warm-up) is not implemented: Deltafin has no prompt cache; ask for at least 1 token",
                ));
            }
            Some(n) => n,
            None => return Err(bad("max_tokens", "`max_tokens` must be a positive integer")),
        },
    };
    let max_new = usize::try_from(asked)
        .unwrap_or(usize::MAX)
        .min(limits.max_tokens);

    let stream = match get("stream") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("stream", "`stream` must be a boolean")),
    };
    let sampling = sampling(obj)?;
    if let Some(m) = get("metadata") {
        let m = object(m, "metadata", "`metadata`")?;
        only_keys(m, &["user_id"], "metadata", "`metadata`")?;
        if m.get("user_id")
            .is_some_and(|u| !u.is_string() && !u.is_null())
        {
            return Err(bad("metadata", "`metadata.user_id` must be a string"));
        }
    }
    // One tier of capacity: both values are honoured as they are.
    if let Some(t) = get("service_tier")
        && t != "auto"
        && t != "standard_only"
    {
        return Err(bad(
            "service_tier",
            "`service_tier` must be \"auto\" or \"standard_only\"",
        ));
    }
    check_cache_control(get("cache_control"), "cache_control")?;
    let stops = stop_sequences(get("stop_sequences"))?;

    let (thinking, effort, response_format) = thinking(obj, asked, limits.default_thinking)?;
    let tools = tools(get("tools"))?;
    let (tool_mode, parallel_tool_calls) = tool_choice(get("tool_choice"), &tools)?;

    let messages = match get("messages") {
        Some(Value::Array(items)) if !items.is_empty() => items,
        _ => return Err(bad("messages", "`messages` must be a non-empty JSON array")),
    };
    let messages = content::convert(get("system"), messages)?;
    let controls = ChatControls {
        thinking,
        effort,
        tools,
        tool_mode,
        parallel_tool_calls,
        response_format,
    };
    let req = GenRequest {
        sampling,
        surface: Surface::Chat,
        prompt: Prompt::Chat { messages, controls },
        max_new,
        stream,
        include_usage: false,
        stop: stops.clone(),
        logprobs: None,
    };
    Ok((req, MessagesMeta { stops }))
}

/// A top-level field; `null` means absent.
fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

/// `temperature` 0…1, `top_p`, `top_k`, `min_p`, `seed` (docs/SERVER.md "Sampling"; Anthropic
/// has no `seed`, so a sampled request without one gets a fresh seed, reported back).
fn sampling(obj: &Map<String, Value>) -> Result<Option<Sampling>, ApiError> {
    crate::request::parse_sampling(|k| field(obj, k), 1.0)
}

fn stop_sequences(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let Some(v) = v else { return Ok(Vec::new()) };
    let items = v.as_array().ok_or_else(|| {
        bad(
            "stop_sequences",
            "`stop_sequences` must be an array of strings",
        )
    })?;
    if items.len() > MAX_STOP_SEQUENCES {
        return Err(bad(
            "stop_sequences",
            format!(
                "`stop_sequences` holds {} sequences; at most {MAX_STOP_SEQUENCES} are allowed",
                items.len()
            ),
        ));
    }
    items
        .iter()
        .map(|s| match s.as_str() {
            Some(s) if !s.is_empty() => Ok(s.to_string()),
            _ => Err(bad(
                "stop_sequences",
                "`stop_sequences` must hold non-empty strings",
            )),
        })
        .collect()
}

/// The thinking effort a `budget_tokens` selects (docs/SERVER.md, "Thinking").
pub fn budget_effort(budget: u64) -> ReasoningEffort {
    match budget {
        0..4096 => ReasoningEffort::Low,
        4096..16384 => ReasoningEffort::Medium,
        16384..32768 => ReasoningEffort::High,
        _ => ReasoningEffort::Max,
    }
}

/// `thinking` and `output_config`: thinking on or off, its effort, the output format.
fn thinking(
    obj: &Map<String, Value>,
    max_tokens: u64,
    default: Thinking,
) -> Result<(bool, ReasoningEffort, Option<ResponseFormat>), ApiError> {
    let get = |k: &str| field(obj, k);
    let (mut on, mut effort) = thinking_default(default);
    if let Some(t) = get("thinking") {
        let t = object(t, "thinking", "`thinking`")?;
        let kind = string(t, "type", "thinking", "`thinking`")?;
        match kind {
            "enabled" => {
                only_keys(
                    t,
                    &["type", "budget_tokens", "display"],
                    "thinking",
                    "`thinking`",
                )?;
                let budget = t
                    .get("budget_tokens")
                    .and_then(Value::as_u64)
                    .ok_or_else(|| {
                        bad("thinking", "`thinking.budget_tokens` must be an integer")
                    })?;
                if budget < MIN_THINKING_BUDGET || budget >= max_tokens {
                    return Err(bad(
                        "thinking",
                        format!(
                            "`thinking.budget_tokens` must be >= {MIN_THINKING_BUDGET} and less than `max_tokens` ({max_tokens})"
                        ),
                    ));
                }
                effort = budget_effort(budget);
            }
            "adaptive" => only_keys(t, &["type", "display"], "thinking", "`thinking`")?,
            "disabled" => {
                only_keys(t, &["type"], "thinking", "`thinking`")?;
                on = false;
            }
            other => {
                return Err(bad(
                    "thinking",
                    format!(
                        "`thinking.type` {other:?} is not implemented; use enabled, adaptive or disabled"
                    ),
                ));
            }
        }
        match t.get("display") {
            None | Some(Value::Null) => {}
            Some(d) if d == "summarized" => {}
            Some(d) if d == "omitted" => {
                return Err(bad(
                    "thinking",
                    "`thinking.display: \"omitted\"` is not implemented: Deltafin returns the thinking text",
                ));
            }
            Some(_) => {
                return Err(bad(
                    "thinking",
                    "`thinking.display` must be \"summarized\" or \"omitted\"",
                ));
            }
        }
    }
    let mut format = None;
    if let Some(oc) = get("output_config") {
        let oc = object(oc, "output_config", "`output_config`")?;
        only_keys(
            oc,
            &["effort", "format"],
            "output_config",
            "`output_config`",
        )?;
        if let Some(e) = oc.get("effort").filter(|e| !e.is_null()) {
            if !on {
                return Err(bad(
                    "output_config",
                    "`output_config.effort` needs thinking: K3's effort only steers its thinking channel, which `thinking: disabled` turns off",
                ));
            }
            effort = match e.as_str() {
                Some("low") => ReasoningEffort::Low,
                Some("medium") => ReasoningEffort::Medium,
                Some("high") => ReasoningEffort::High,
                Some("xhigh" | "max") => ReasoningEffort::Max,
                _ => {
                    return Err(bad(
                        "output_config",
                        "`output_config.effort` must be low, medium, high, xhigh or max",
                    ));
                }
            };
        }
        if let Some(f) = oc.get("format").filter(|f| !f.is_null()) {
            let f = object(f, "output_config", "`output_config.format`")?;
            only_keys(
                f,
                &["type", "schema"],
                "output_config",
                "`output_config.format`",
            )?;
            if f.get("type") != Some(&Value::from("json_schema")) {
                return Err(bad(
                    "output_config",
                    "`output_config.format.type` must be \"json_schema\"",
                ));
            }
            match f.get("schema") {
                Some(s @ Value::Object(_)) => format = Some(ResponseFormat::JsonSchema(s.clone())),
                _ => {
                    return Err(bad(
                        "output_config",
                        "`output_config.format.schema` must be a JSON object",
                    ));
                }
            }
        }
    }
    Ok((on, effort, format))
}

/// Tool names: what Anthropic allows.
fn valid_tool_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Client tools `{name, description?, input_schema, type?: "custom", cache_control?}` in the
/// function shape the template declares.
fn tools(v: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    let Some(v) = v else { return Ok(Vec::new()) };
    let items = v
        .as_array()
        .ok_or_else(|| bad("tools", "`tools` must be an array"))?;
    let mut out: Vec<Value> = Vec::with_capacity(items.len());
    let mut names: Vec<&str> = Vec::new();
    for (i, t) in items.iter().enumerate() {
        let p = format!("tools[{i}]");
        let t = object(t, &p, "every tool")?;
        match t.get("type") {
            None | Some(Value::Null) => {}
            Some(k) if k == "custom" => {}
            Some(k) => {
                return Err(bad(
                    &p,
                    format!(
                        "tool type {k} (an Anthropic server tool) is not implemented; declare client tools with `name` and `input_schema`"
                    ),
                ));
            }
        }
        only_keys(
            t,
            &[
                "type",
                "name",
                "description",
                "input_schema",
                "cache_control",
            ],
            &p,
            "a tool",
        )?;
        check_cache_control(t.get("cache_control"), &p)?;
        let name = string(t, "name", &p, "every tool")?;
        if !valid_tool_name(name) {
            return Err(bad(
                &p,
                format!("tool name {name:?} must be 1 to 64 letters, digits, `_` or `-`"),
            ));
        }
        if names.contains(&name) {
            return Err(bad(&p, format!("tool name {name:?} is declared twice")));
        }
        names.push(name);
        let schema = match t.get("input_schema") {
            Some(Value::Object(s)) if s.get("type") == Some(&Value::from("object")) => s.clone(),
            _ => {
                return Err(bad(
                    &p,
                    "tool `input_schema` must be a JSON Schema object with `\"type\": \"object\"`",
                ));
            }
        };
        let mut function = Map::new();
        function.insert("name".into(), Value::from(name));
        match t.get("description") {
            None | Some(Value::Null) => {}
            Some(Value::String(d)) => {
                function.insert("description".into(), Value::from(d.as_str()));
            }
            Some(_) => return Err(bad(&p, "tool `description` must be a string")),
        }
        function.insert("parameters".into(), Value::Object(schema));
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(out)
}

/// `tool_choice` onto the tool mode and whether several calls may come.
fn tool_choice(v: Option<&Value>, tools: &[Value]) -> Result<(ToolMode, bool), ApiError> {
    let Some(v) = v else {
        return Ok((ToolMode::Auto, true));
    };
    let c = object(v, "tool_choice", "`tool_choice`")?;
    let kind = string(c, "type", "tool_choice", "`tool_choice`")?;
    let allowed: &[&str] = match kind {
        "auto" | "any" => &["type", "disable_parallel_tool_use"],
        "tool" => &["type", "name", "disable_parallel_tool_use"],
        "none" => &["type"],
        other => {
            return Err(bad(
                "tool_choice",
                format!("`tool_choice.type` {other:?} must be auto, any, tool or none"),
            ));
        }
    };
    only_keys(c, allowed, "tool_choice", "`tool_choice`")?;
    let parallel = match c.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => !b,
        Some(_) => {
            return Err(bad(
                "tool_choice",
                "`tool_choice.disable_parallel_tool_use` must be a boolean",
            ));
        }
    };
    let mode = match kind {
        "auto" => ToolMode::Auto,
        "none" => ToolMode::None,
        "any" => ToolMode::Required,
        _ => {
            let name = string(c, "name", "tool_choice", "`tool_choice` of type tool")?;
            let declared = tools.iter().any(|t| t["function"]["name"] == name);
            if !declared {
                return Err(bad(
                    "tool_choice",
                    format!("`tool_choice.name` {name:?} is not one of the declared `tools`"),
                ));
            }
            ToolMode::Named(name.to_string())
        }
    };
    if tools.is_empty() && matches!(mode, ToolMode::Required) {
        return Err(bad(
            "tool_choice",
            "`tool_choice` of type any needs `tools`",
        ));
    }
    Ok((mode, parallel))
}

#[cfg(test)]
mod tests;

/// The server's default thinking (`K3_REASONING_EFFORT`) as (on, effort).
pub(crate) fn thinking_default(default: Thinking) -> (bool, ReasoningEffort) {
    match default {
        Thinking::Off => (false, ReasoningEffort::Max),
        Thinking::On(effort) => (true, effort),
    }
}
