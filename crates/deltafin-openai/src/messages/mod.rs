//! `POST /v1/messages`: the Anthropic Messages API on K3.
//!
//! A request is validated strictly (every field works exactly or is refused with a 400 that
//! names it, in Anthropic's error shape) and translated into the chat [`GenRequest`] the
//! other endpoints run: the XTML chat prompt with its [`ChatControls`], stop sequences and
//! the token budget. [`reply::MessagesReply`] renders the generation as a `message` object
//! or Anthropic's event stream. docs/SERVER.md, "/v1/messages", lists every rule.

mod content;
mod context;
pub mod reply;
pub mod wire;

use crate::error::ApiError;
use crate::request::{ChatControls, GenRequest, Limits, Prompt, Surface, ToolMode};
use crate::seal::Sealer;
use axum::http::HeaderMap;
use deltafin_k3::sampling::Sampling;
use deltafin_k3::text::chat::{ReasoningEffort, ResponseFormat, Thinking};
use serde_json::{Map, Value, json};
use std::collections::HashMap;
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
    /// `thinking.display: "omitted"`: thinking blocks carry only their signature.
    pub omit_thinking: bool,
    /// The `context_management` edits applied, as the response reports them.
    pub applied_edits: Option<Value>,
}

/// Beta names (`anthropic-beta`) whose features this endpoint implements as Anthropic
/// documents them, or that ask nothing of a local server. Any other name is accepted as
/// well: a beta only unlocks request fields and blocks, and every one of those is checked
/// on its own (an unknown one is refused by name), so a beta name alone never changes an
/// answer (docs/SERVER.md "/v1/messages").
pub const KNOWN_BETAS: &[&str] = &[
    "claude-code-20250219",
    "interleaved-thinking-2025-05-14",
    "context-management-2025-06-27",
    "mid-conversation-tool-changes-2026-07-01",
    "thinking-token-count-2026-05-13",
    "advanced-tool-use-2025-11-20",
    "effort-2025-11-24",
    "fine-grained-tool-streaming-2025-05-14",
    "token-efficient-tools-2025-02-19",
    "prompt-caching-2024-07-31",
    "extended-cache-ttl-2025-04-11",
    "output-128k-2025-02-19",
    "context-1m-2025-08-07",
    "structured-outputs-2025-11-13",
];

/// Checks the headers Anthropic clients send: `anthropic-version` must be one of
/// [`API_VERSIONS`]; `anthropic-beta` names are accepted (see [`KNOWN_BETAS`]). `x-api-key`
/// and `authorization` are checked by the server's access rules, not here.
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
    for v in headers.get_all("anthropic-beta") {
        if v.to_str().is_err() {
            return Err(ApiError::invalid(
                "`anthropic-beta` must be a comma-separated list of beta names",
            ));
        }
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
    "context_management",
];

/// Validates a `/v1/messages` body and translates it; `sealer` opens the signatures of
/// thinking blocks sent back.
pub fn parse(
    body: &Value,
    limits: &Limits,
    sealer: &Sealer,
) -> Result<(GenRequest, MessagesMeta), ApiError> {
    parse_body(body, limits, sealer, false)
}

/// Validates a `/v1/messages/count_tokens` body (a Messages request without `max_tokens`,
/// `stream`, stop sequences or sampling) and translates it.
pub fn parse_count(body: &Value, limits: &Limits, sealer: &Sealer) -> Result<GenRequest, ApiError> {
    parse_body(body, limits, sealer, true).map(|(r, _)| r)
}

/// Fields `count_tokens` takes (what shapes the prompt).
const COUNT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "system",
    "thinking",
    "tools",
    "tool_choice",
    "output_config",
    "context_management",
    "cache_control",
];

fn parse_body(
    body: &Value,
    limits: &Limits,
    sealer: &Sealer,
    counting: bool,
) -> Result<(GenRequest, MessagesMeta), ApiError> {
    let obj = body
        .as_object()
        .ok_or_else(|| ApiError::invalid("request body must be a JSON object"))?;
    let (fields, endpoint) = if counting {
        (COUNT_FIELDS, "/v1/messages/count_tokens")
    } else {
        (FIELDS, ENDPOINT)
    };
    crate::strict::known_fields(obj, fields, endpoint)?;
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
        None if counting => limits.max_tokens as u64,
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
    let max_new = if counting {
        limits.max_tokens
    } else {
        crate::request::within_server_limit("max_tokens", asked, limits)?
    };

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

    let think = thinking(obj, asked)?;
    let (tools, deferred) = tools(get("tools"))?;
    let (tool_mode, parallel_tool_calls) = tool_choice(get("tool_choice"), &tools)?;
    let edits = context::Edits::parse(get("context_management"))?;

    let messages = match get("messages") {
        Some(Value::Array(items)) if !items.is_empty() => items,
        _ => return Err(bad("messages", "`messages` must be a non-empty JSON array")),
    };
    let declared: Vec<String> = tools
        .iter()
        .filter_map(|t| t["function"]["name"].as_str().map(str::to_string))
        .collect();
    let cx = content::Convert {
        sealer,
        deferred: &deferred,
        declared: &declared,
    };
    let mut messages = content::convert(get("system"), messages, &cx)?;
    let applied_edits = edits.apply(&mut messages);
    let controls = ChatControls {
        thinking: think.on,
        effort: think.effort,
        tools,
        tool_mode,
        parallel_tool_calls,
        response_format: think.format,
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
    let meta = MessagesMeta {
        stops,
        omit_thinking: think.omit,
        applied_edits,
    };
    Ok((req, meta))
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

/// What `thinking` and `output_config` ask for.
struct ThinkingSetup {
    /// Thinking on.
    on: bool,
    /// Its effort (used only when on).
    effort: ReasoningEffort,
    /// `display: "omitted"`.
    omit: bool,
    /// `output_config.format`.
    format: Option<ResponseFormat>,
}

/// The effort of `output_config.effort` (Anthropic's default is `high`).
fn anthropic_effort(e: &Value) -> Result<ReasoningEffort, ApiError> {
    match e.as_str() {
        Some("low") => Ok(ReasoningEffort::Low),
        Some("medium") => Ok(ReasoningEffort::Medium),
        Some("high") => Ok(ReasoningEffort::High),
        Some("xhigh" | "max") => Ok(ReasoningEffort::Max),
        _ => Err(bad(
            "output_config",
            "`output_config.effort` must be low, medium, high, xhigh or max",
        )),
    }
}

/// `thinking` and `output_config` with Anthropic's meaning: no `thinking` is no thinking;
/// `enabled` thinks at the effort its budget selects, `adaptive` at `output_config.effort`
/// (default `high`, Anthropic's default effort). K3's effort steers only its thinking, so
/// without thinking the effort can only be the default.
fn thinking(obj: &Map<String, Value>, max_tokens: u64) -> Result<ThinkingSetup, ApiError> {
    let get = |k: &str| field(obj, k);
    let mut on = false;
    let mut effort = ReasoningEffort::High;
    let mut omit = false;
    let mut from_budget = None;
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
                on = true;
                from_budget = Some(budget_effort(budget));
            }
            "adaptive" => {
                only_keys(t, &["type", "display"], "thinking", "`thinking`")?;
                on = true;
            }
            "disabled" => only_keys(t, &["type"], "thinking", "`thinking`")?,
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
            Some(d) if d == "omitted" => omit = true,
            Some(_) => {
                return Err(bad(
                    "thinking",
                    "`thinking.display` must be \"summarized\" or \"omitted\"",
                ));
            }
        }
    }
    if let Some(e) = from_budget {
        effort = e;
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
            let asked = anthropic_effort(e)?;
            if !on && asked != ReasoningEffort::High {
                return Err(bad(
                    "output_config",
                    "`output_config.effort` other than \"high\" (the default) needs thinking: K3's effort steers only its thinking channel, and this request has none (no `thinking`, or `thinking: {\"type\": \"disabled\"}`); send `thinking: {\"type\": \"adaptive\"}` or leave the effort out",
                ));
            }
            effort = asked;
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
    Ok(ThinkingSetup {
        on,
        effort,
        omit,
        format,
    })
}

/// Tool names: what Anthropic allows.
fn valid_tool_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Client tools `{name, description?, input_schema, type?: "custom", cache_control?,
/// defer_loading?, strict?}` in the function shape the template declares. A tool with
/// `defer_loading: true` is not declared up front: it is loaded where a `tool_reference` or
/// `tool_addition` block names it (the template's dynamic tool declaration). Returns the
/// tools declared up front and the deferred ones by name.
pub(super) fn tools(v: Option<&Value>) -> Result<(Vec<Value>, HashMap<String, Value>), ApiError> {
    let Some(v) = v else {
        return Ok((Vec::new(), HashMap::new()));
    };
    let items = v
        .as_array()
        .ok_or_else(|| bad("tools", "`tools` must be an array"))?;
    let mut out: Vec<Value> = Vec::with_capacity(items.len());
    let mut deferred = HashMap::new();
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
                        "tool type {k} (an Anthropic server tool) is not implemented: Deltafin runs no server tools; declare client tools with `name` and `input_schema` (Claude Code sends only client tools unless a server tool is configured)"
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
                "defer_loading",
                "strict",
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
        match t.get("strict") {
            None | Some(Value::Null) => {}
            Some(Value::Bool(b)) => {
                function.insert("strict".into(), Value::Bool(*b));
            }
            Some(_) => return Err(bad(&p, "tool `strict` must be a boolean")),
        }
        let tool = json!({"type": "function", "function": function});
        match t.get("defer_loading") {
            None | Some(Value::Null) | Some(Value::Bool(false)) => out.push(tool),
            Some(Value::Bool(true)) => {
                deferred.insert(name.to_string(), tool);
            }
            Some(_) => return Err(bad(&p, "tool `defer_loading` must be a boolean")),
        }
    }
    if out.is_empty() && !deferred.is_empty() {
        return Err(bad(
            "tools",
            "every tool has `defer_loading: true`: at least one tool (such as the client's tool search) must be declared up front",
        ));
    }
    Ok((out, deferred))
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
