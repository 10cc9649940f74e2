//! `POST /v1/responses`: the OpenAI Responses API subset that agent clients (Codex-style)
//! use, on K3.
//!
//! A request is validated strictly (every field works exactly or is refused with a 400 that
//! names it) and translated into the chat [`GenRequest`] the other endpoints run.
//! Nothing is stored: `store` must be false (or absent) and `previous_response_id` is
//! refused, so every request carries its whole conversation in `input`.
//! [`reply::ResponsesReply`] renders the generation as a `response` object or its typed event
//! stream. docs/SERVER.md, "/v1/responses", lists every rule.

pub mod input;
pub mod reply;

use crate::error::ApiError;
use crate::request::{ChatControls, GenRequest, Limits, Prompt, Surface, ToolMode};
use deltafin_k3::sampling::Sampling;
use deltafin_k3::text::chat::{ReasoningEffort, ResponseFormat, THINKING_SPELLINGS, Thinking};
use input::{ENDPOINT, bad, only_keys};
use serde_json::{Map, Value, json};

/// What the reply needs from the request: the settings a response object echoes.
#[derive(Clone, Debug, PartialEq)]
pub struct ResponsesMeta {
    /// `instructions`, `max_output_tokens`, `metadata`, `parallel_tool_calls`, `reasoning`,
    /// `temperature`, `text`, `tool_choice`, `tools`, `top_p`, `user` as the response
    /// reports them.
    pub echo: Map<String, Value>,
    /// `reasoning.summary` asked for: the reasoning text arrives as the item's summary
    /// (verbatim) instead of its `reasoning_text` content.
    pub summary: bool,
}

const FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "reasoning",
    "text",
    "stream",
    "stream_options",
    "store",
    "previous_response_id",
    "metadata",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "include",
    "truncation",
    "service_tier",
    "background",
    "max_tool_calls",
    "top_logprobs",
];

fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

/// Validates a `/v1/responses` body and translates it.
pub fn parse(body: &Value, limits: &Limits) -> Result<(GenRequest, ResponsesMeta), ApiError> {
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
    let mut echo = Map::new();

    match get("model") {
        None => {}
        Some(Value::String(m)) if crate::models::is_served(m, limits.model_aliases) => {}
        Some(Value::String(m)) => {
            return Err(ApiError::model_not_found(m, limits.model_aliases));
        }
        Some(_) => return Err(bad("model", "`model` must be a JSON string")),
    }
    refusals(obj)?;

    let max_new = match get("max_output_tokens") {
        None => {
            echo.insert("max_output_tokens".into(), Value::Null);
            limits.max_tokens
        }
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => {
                echo.insert("max_output_tokens".into(), Value::from(n));
                usize::try_from(n)
                    .unwrap_or(usize::MAX)
                    .min(limits.max_tokens)
            }
            _ => {
                return Err(bad(
                    "max_output_tokens",
                    "`max_output_tokens` must be a positive integer",
                ));
            }
        },
    };
    let stream = match get("stream") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("stream", "`stream` must be a boolean")),
    };
    if let Some(so) = get("stream_options") {
        if !stream {
            return Err(bad(
                "stream_options",
                "`stream_options` requires `stream: true`",
            ));
        }
        let so = so
            .as_object()
            .ok_or_else(|| bad("stream_options", "`stream_options` must be a JSON object"))?;
        only_keys(
            so,
            &["include_obfuscation"],
            "stream_options",
            "`stream_options`",
        )?;
        if so
            .get("include_obfuscation")
            .is_some_and(|v| v != &Value::Bool(false) && !v.is_null())
        {
            return Err(bad(
                "stream_options",
                "`stream_options.include_obfuscation: true` is not implemented: Deltafin's events carry no obfuscation padding",
            ));
        }
    }
    let sampling = sampling(obj, &mut echo)?;
    for key in ["user", "safety_identifier", "prompt_cache_key"] {
        match get(key) {
            None => {}
            Some(Value::String(s)) if key == "user" => {
                echo.insert("user".into(), Value::from(s.as_str()));
            }
            Some(Value::String(_)) => {}
            Some(_) => return Err(bad(key, format!("`{key}` must be a JSON string"))),
        }
    }
    let metadata = match get("metadata") {
        None => json!({}),
        Some(m @ Value::Object(map)) if map.values().all(Value::is_string) => m.clone(),
        Some(_) => {
            return Err(bad(
                "metadata",
                "`metadata` must be a JSON object of string values",
            ));
        }
    };
    echo.insert("metadata".into(), metadata);

    let instructions = match get("instructions") {
        None => None,
        Some(Value::String(s)) => Some(s.as_str()),
        Some(_) => {
            return Err(bad(
                "instructions",
                "`instructions` must be a string (input item lists belong in `input`)",
            ));
        }
    };
    echo.insert(
        "instructions".into(),
        instructions.map_or(Value::Null, Value::from),
    );

    let (thinking, effort, summary) =
        reasoning(get("reasoning"), limits.default_thinking, &mut echo)?;
    let response_format = text_config(get("text"), &mut echo)?;
    let tools = tools(get("tools"), &mut echo)?;
    let tool_mode = tool_choice(get("tool_choice"), &tools, &mut echo)?;
    let parallel_tool_calls = match get("parallel_tool_calls") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(bad(
                "parallel_tool_calls",
                "`parallel_tool_calls` must be a boolean",
            ));
        }
    };
    echo.insert(
        "parallel_tool_calls".into(),
        Value::from(parallel_tool_calls),
    );

    let input = get("input").ok_or_else(|| bad("input", "`input` is required"))?;
    let messages = input::convert(instructions, input)?;
    let controls = ChatControls {
        thinking,
        effort,
        tools: tools.iter().map(chat_tool).collect(),
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
        stop: Vec::new(),
        logprobs: None,
    };
    Ok((req, ResponsesMeta { echo, summary }))
}

/// Fields that are accepted only at the value that asks for nothing Deltafin lacks.
fn refusals(obj: &Map<String, Value>) -> Result<(), ApiError> {
    let get = |k: &str| field(obj, k);
    if get("store").is_some_and(|v| v != &Value::Bool(false)) {
        return Err(bad(
            "store",
            "`store: true` is not implemented: Deltafin keeps no responses (there is no GET /v1/responses/{id}); send `store: false`",
        ));
    }
    if get("previous_response_id").is_some() {
        return Err(bad(
            "previous_response_id",
            "`previous_response_id` is not implemented: Deltafin stores no responses; send the whole conversation in `input`",
        ));
    }
    if get("include").is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(bad(
            "include",
            "`include` is not implemented (reasoning.encrypted_content, logprobs and tool outputs are not available); send [] or leave it out",
        ));
    }
    if get("truncation").is_some_and(|v| v != "disabled") {
        return Err(bad(
            "truncation",
            "`truncation` must be \"disabled\": Deltafin never drops input; a prompt longer than the context is a 400",
        ));
    }
    if get("background").is_some_and(|v| v != &Value::Bool(false)) {
        return Err(bad("background", "`background: true` is not implemented"));
    }
    if get("top_logprobs").is_some_and(|v| v.as_u64() != Some(0)) {
        return Err(bad(
            "top_logprobs",
            "`top_logprobs` is not implemented on /v1/responses (use /v1/chat/completions); send 0 or leave it out",
        ));
    }
    for key in ["service_tier", "max_tool_calls"] {
        if get(key).is_some() {
            return Err(bad(
                key,
                format!(
                    "non-default `{key}` semantics are not implemented by native Deltafin; refusing to ignore the request"
                ),
            ));
        }
    }
    Ok(())
}

/// `temperature` 0…2, `top_p`, `top_k`, `min_p`, `seed` (docs/SERVER.md "Sampling");
/// `temperature` and `top_p` echoed.
fn sampling(
    obj: &Map<String, Value>,
    echo: &mut Map<String, Value>,
) -> Result<Option<Sampling>, ApiError> {
    let s = crate::request::parse_sampling(|k| field(obj, k), 2.0)?;
    for key in ["temperature", "top_p"] {
        echo.insert(key.into(), field(obj, key).cloned().unwrap_or(Value::Null));
    }
    Ok(s)
}

/// `reasoning`: thinking on or off, its effort, and whether the text is the summary.
fn reasoning(
    v: Option<&Value>,
    default: Thinking,
    echo: &mut Map<String, Value>,
) -> Result<(bool, ReasoningEffort, bool), ApiError> {
    let mut r = Map::new();
    let (mut on, default_effort) = crate::messages::thinking_default(default);
    let (mut effort, mut summary) = (default_effort, false);
    if let Some(v) = v {
        let obj = v
            .as_object()
            .ok_or_else(|| bad("reasoning", "`reasoning` must be a JSON object"))?;
        only_keys(obj, &["effort", "summary"], "reasoning", "`reasoning`")?;
        match obj.get("effort").filter(|e| !e.is_null()) {
            None => {}
            Some(e) => {
                let bad_effort = || {
                    bad(
                        "reasoning",
                        format!(
                            "`reasoning.effort` must be one of {THINKING_SPELLINGS} or xhigh (= max)"
                        ),
                    )
                };
                let e = e.as_str().ok_or_else(bad_effort)?;
                // The shared spellings (none/off/minimal = thinking off), and the Responses
                // API's `xhigh`, K3's highest template level.
                (on, effort) = if e.trim().eq_ignore_ascii_case("xhigh") {
                    (true, ReasoningEffort::Max)
                } else {
                    let t = Thinking::parse(e).map_err(|_| bad_effort())?;
                    (t.is_on(), t.effort().unwrap_or(default_effort))
                };
            }
        }
        match obj.get("summary").filter(|s| !s.is_null()) {
            None => {}
            Some(s) if s == "auto" || s == "detailed" => {
                summary = true;
                r.insert("summary".into(), s.clone());
            }
            Some(s) if s == "concise" => {
                return Err(bad(
                    "reasoning",
                    "`reasoning.summary: \"concise\"` is not implemented: K3 does not summarize; `auto` and `detailed` return the reasoning verbatim as the summary",
                ));
            }
            Some(_) => {
                return Err(bad(
                    "reasoning",
                    "`reasoning.summary` must be auto, concise or detailed",
                ));
            }
        }
        if summary && !on {
            return Err(bad(
                "reasoning",
                "`reasoning.summary` needs reasoning; `effort: none` turns it off",
            ));
        }
    }
    let shown = if on { effort.as_str() } else { "none" };
    r.insert("effort".into(), Value::from(shown));
    r.entry("summary").or_insert(Value::Null);
    echo.insert("reasoning".into(), Value::Object(r));
    Ok((on, effort, summary))
}

/// `text`: the output format (`text`, `json_object`, `json_schema`) and the default
/// verbosity.
fn text_config(
    v: Option<&Value>,
    echo: &mut Map<String, Value>,
) -> Result<Option<ResponseFormat>, ApiError> {
    let mut shown = json!({"format": {"type": "text"}});
    let mut format = None;
    if let Some(v) = v {
        let obj = v
            .as_object()
            .ok_or_else(|| bad("text", "`text` must be a JSON object"))?;
        only_keys(obj, &["format", "verbosity"], "text", "`text`")?;
        if obj
            .get("verbosity")
            .is_some_and(|v| !v.is_null() && v != "medium")
        {
            return Err(bad(
                "text",
                "`text.verbosity` other than \"medium\" (the default) is not implemented: K3 has no verbosity control",
            ));
        }
        if let Some(f) = obj.get("format").filter(|f| !f.is_null()) {
            let fo = f
                .as_object()
                .ok_or_else(|| bad("text", "`text.format` must be a JSON object"))?;
            match fo.get("type").and_then(Value::as_str) {
                Some("text") => only_keys(fo, &["type"], "text", "`text.format`")?,
                Some("json_object") => {
                    only_keys(fo, &["type"], "text", "`text.format`")?;
                    format = Some(ResponseFormat::JsonObject);
                }
                Some("json_schema") => {
                    only_keys(
                        fo,
                        &["type", "name", "schema", "description", "strict"],
                        "text",
                        "`text.format`",
                    )?;
                    if !fo.get("name").is_some_and(Value::is_string) {
                        return Err(bad("text", "`text.format.name` must be a string"));
                    }
                    if fo
                        .get("strict")
                        .is_some_and(|s| !s.is_boolean() && !s.is_null())
                    {
                        return Err(bad("text", "`text.format.strict` must be a boolean"));
                    }
                    match fo.get("schema") {
                        Some(s @ Value::Object(_)) => {
                            format = Some(ResponseFormat::JsonSchema(s.clone()));
                        }
                        _ => return Err(bad("text", "`text.format.schema` must be a JSON object")),
                    }
                }
                _ => {
                    return Err(bad(
                        "text",
                        "`text.format.type` must be text, json_object or json_schema",
                    ));
                }
            }
            shown["format"] = f.clone();
        }
    }
    echo.insert("text".into(), shown);
    Ok(format)
}

/// Function tools `{type:"function", name, description?, parameters, strict}` (the flat
/// Responses shape), echoed as given.
fn tools(v: Option<&Value>, echo: &mut Map<String, Value>) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    if let Some(v) = v {
        let items = v
            .as_array()
            .ok_or_else(|| bad("tools", "`tools` must be an array"))?;
        for (i, t) in items.iter().enumerate() {
            let p = format!("tools[{i}]");
            let obj = t
                .as_object()
                .ok_or_else(|| bad(&p, "every tool must be a JSON object"))?;
            match obj.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(other) => {
                    return Err(bad(
                        &p,
                        format!(
                            "tool type `{other}` is not implemented; only `function` tools are"
                        ),
                    ));
                }
                None => return Err(bad(&p, "every tool needs a `type` string")),
            }
            only_keys(
                obj,
                &["type", "name", "description", "parameters", "strict"],
                &p,
                "a function tool",
            )?;
            let name = obj.get("name").and_then(Value::as_str).unwrap_or_default();
            let valid = (1..=64).contains(&name.len())
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !valid {
                return Err(bad(
                    &p,
                    format!("function name {name:?} must be 1 to 64 letters, digits, `_` or `-`"),
                ));
            }
            if out.iter().any(|t: &Value| t["name"] == name) {
                return Err(bad(&p, format!("function name {name:?} is declared twice")));
            }
            if obj
                .get("description")
                .is_some_and(|d| !d.is_string() && !d.is_null())
            {
                return Err(bad(&p, "function `description` must be a string"));
            }
            if obj
                .get("parameters")
                .is_some_and(|s| !s.is_object() && !s.is_null())
            {
                return Err(bad(
                    &p,
                    "function `parameters` must be a JSON Schema object",
                ));
            }
            if obj
                .get("strict")
                .is_some_and(|s| !s.is_boolean() && !s.is_null())
            {
                return Err(bad(&p, "function `strict` must be a boolean"));
            }
            out.push(t.clone());
        }
    }
    echo.insert("tools".into(), Value::Array(out.clone()));
    Ok(out)
}

/// A flat Responses function tool in the chat shape the template declares.
fn chat_tool(t: &Value) -> Value {
    let mut function = Map::new();
    for key in ["name", "description", "parameters", "strict"] {
        if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
            function.insert(key.into(), v.clone());
        }
    }
    json!({"type": "function", "function": function})
}

fn tool_choice(
    v: Option<&Value>,
    tools: &[Value],
    echo: &mut Map<String, Value>,
) -> Result<ToolMode, ApiError> {
    let mode = match v {
        None => ToolMode::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolMode::Auto,
            "none" => ToolMode::None,
            "required" => ToolMode::Required,
            other => {
                return Err(bad(
                    "tool_choice",
                    format!("`tool_choice` {other:?} must be auto, none or required"),
                ));
            }
        },
        Some(Value::Object(c)) => {
            if c.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad(
                    "tool_choice",
                    "`tool_choice` objects other than {\"type\":\"function\",\"name\":…} are not implemented",
                ));
            }
            only_keys(c, &["type", "name"], "tool_choice", "`tool_choice`")?;
            let name = c.get("name").and_then(Value::as_str).unwrap_or_default();
            if !tools.iter().any(|t| t["name"] == name) {
                return Err(bad(
                    "tool_choice",
                    format!("`tool_choice.name` {name:?} is not one of the declared `tools`"),
                ));
            }
            ToolMode::Named(name.to_string())
        }
        Some(_) => {
            return Err(bad(
                "tool_choice",
                "`tool_choice` must be a string or an object",
            ));
        }
    };
    if tools.is_empty() && mode == ToolMode::Required {
        return Err(bad(
            "tool_choice",
            "`tool_choice: \"required\"` needs `tools`",
        ));
    }
    echo.insert(
        "tool_choice".into(),
        v.cloned().unwrap_or(Value::from("auto")),
    );
    Ok(mode)
}

#[cfg(test)]
mod tests;
