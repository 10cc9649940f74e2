//! `POST /v1/responses`: the OpenAI Responses API subset that agent clients (Codex-style)
//! use, on K3.
//!
//! A request is validated strictly (every field works exactly or is refused with a 400 that
//! names it) and translated into the chat [`GenRequest`] the other endpoints run.
//! Responses are stored unless `store: false` ([`store`]), so a request may continue one
//! with `previous_response_id`; reasoning comes back exactly through `encrypted_content`
//! ([`crate::seal`]). [`reply::ResponsesReply`] renders the generation as a `response`
//! object or its typed event stream. docs/SERVER.md, "/v1/responses", lists every rule.

pub mod input;
pub mod reply;
pub mod store;

use crate::error::ApiError;
use crate::request::{ChatControls, GenRequest, Limits, Prompt, Surface, ToolMode};
use crate::seal::Sealer;
use deltafin_k3::sampling::Sampling;
use deltafin_k3::text::chat::{ReasoningEffort, ResponseFormat, THINKING_SPELLINGS, Thinking};
use input::{ENDPOINT, bad, only_keys};
use serde_json::{Map, Value, json};
use std::collections::HashMap;

/// What the reply needs from the request: the settings a response object echoes, and what
/// storing it takes.
#[derive(Clone, Debug, PartialEq)]
pub struct ResponsesMeta {
    /// `instructions`, `max_output_tokens`, `metadata`, `parallel_tool_calls`, `reasoning`,
    /// `temperature`, `text`, `tool_choice`, `tools`, `top_p`, `user`, `store`,
    /// `previous_response_id` as the response reports them.
    pub echo: Map<String, Value>,
    /// `reasoning.summary` asked for: the reasoning text arrives as the item's summary
    /// (verbatim) instead of its `reasoning_text` content.
    pub summary: bool,
    /// `include: ["reasoning.encrypted_content"]`: reasoning items carry the sealed ids.
    pub encrypted_reasoning: bool,
    /// Keep the response (`store`, default true).
    pub store: bool,
    /// This request's input items (ids filled in), as `input_items` lists them.
    pub input_items: Vec<Value>,
    /// The conversation this response continues: the previous response's, then this
    /// request's input items.
    pub conversation: Vec<Value>,
    /// Function name → the `namespace` tool that declared it.
    pub namespaces: HashMap<String, String>,
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
    "client_metadata",
];

/// `include` values that are honoured: the sealed reasoning, and what only built-in tools
/// produce (deltafin runs none, so those outputs never appear and asking for them changes
/// nothing).
const INCLUDE_OK: &[&str] = &[
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "web_search_call.results",
    "file_search_call.results",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "message.input_image.image_url",
];

fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

/// Validates a `/v1/responses` body and translates it. `sealer` opens the reasoning of earlier
/// answers sent back; `store` holds the responses `previous_response_id` may name.
pub fn parse(
    body: &Value,
    limits: &Limits,
    sealer: &Sealer,
    store: Option<&store::Store>,
) -> Result<(GenRequest, ResponsesMeta), ApiError> {
    let obj = body
        .as_object()
        .ok_or_else(|| ApiError::invalid("request body must be a JSON object"))?;
    crate::strict::known_fields(obj, FIELDS, ENDPOINT)?;
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
    let encrypted_reasoning = refusals(obj)?;
    let keep = match get("store") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("store", "`store` must be a boolean")),
    };
    if keep && store.is_none() {
        return Err(bad(
            "store",
            "this server keeps no responses (`deltafin serve --response-store-gb 0`); send `store: false`",
        ));
    }
    echo.insert("store".into(), Value::from(keep));

    let max_new = match get("max_output_tokens") {
        None => {
            echo.insert("max_output_tokens".into(), Value::Null);
            limits.max_tokens
        }
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => {
                echo.insert("max_output_tokens".into(), Value::from(n));
                crate::request::within_server_limit("max_output_tokens", n, limits)?
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
        if let Some(s) = crate::strict::opt_string(obj, key)?
            && key == "user"
        {
            echo.insert("user".into(), Value::from(s));
        }
    }
    crate::strict::string_map(get("client_metadata"), "client_metadata")?;
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
    let (tools, namespaces) = tools(get("tools"), &mut echo)?;
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

    // The conversation: the stored one `previous_response_id` names, then `input`.
    let mut conversation = match get("previous_response_id") {
        None => {
            echo.insert("previous_response_id".into(), Value::Null);
            Vec::new()
        }
        Some(Value::String(id)) => {
            let record = store.and_then(|s| s.get(id)).ok_or_else(|| {
                ApiError {
                    status: axum::http::StatusCode::NOT_FOUND,
                    code: "previous_response_not_found",
                    ..bad(
                        "previous_response_id",
                        format!(
                            "previous response {id:?} is not stored here: it was answered with `store: false`, deleted, removed to keep the response store within its budget, or made by another server; send the whole conversation in `input` instead"
                        ),
                    )
                }
            })?;
            echo.insert("previous_response_id".into(), Value::from(id.as_str()));
            record.conversation
        }
        Some(_) => {
            return Err(bad(
                "previous_response_id",
                "`previous_response_id` must be a string",
            ));
        }
    };
    let input = get("input").ok_or_else(|| bad("input", "`input` is required"))?;
    let prefix = ResponsesMeta::item_prefix(input);
    let input_items = input::with_ids(input, &prefix);
    conversation.extend(input_items.iter().cloned());
    let messages = input::convert(instructions, &Value::Array(conversation.clone()), sealer)?;
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
    let meta = ResponsesMeta {
        echo,
        summary,
        encrypted_reasoning,
        store: keep,
        input_items,
        conversation,
        namespaces,
    };
    Ok((req, meta))
}

impl ResponsesMeta {
    /// A prefix for the ids of input items sent without one: unique enough per request (the
    /// digest of the input), so that `input_items` lists stable ids.
    fn item_prefix(input: &Value) -> String {
        use sha2::Digest as _;
        let d = sha2::Sha256::digest(input.to_string().as_bytes());
        format!("in_{}", hex::encode(&d[..8]))
    }
}

/// Fields that are accepted only at the value that asks for nothing Deltafin lacks; returns
/// whether `include` asks for the sealed reasoning.
fn refusals(obj: &Map<String, Value>) -> Result<bool, ApiError> {
    let get = |k: &str| field(obj, k);
    let mut encrypted = false;
    if let Some(v) = get("include") {
        let items = v
            .as_array()
            .ok_or_else(|| bad("include", "`include` must be an array of strings"))?;
        for item in items {
            match item.as_str() {
                Some("reasoning.encrypted_content") => encrypted = true,
                Some(i) if INCLUDE_OK.contains(&i) => {}
                Some("message.output_text.logprobs") => {
                    return Err(bad(
                        "include",
                        "`include: [\"message.output_text.logprobs\"]` is not implemented on /v1/responses (use /v1/chat/completions with `logprobs`); leave it out",
                    ));
                }
                Some(i) => {
                    return Err(bad(
                        "include",
                        format!(
                            "`include` value {i:?} is not one Deltafin implements; it knows {}",
                            INCLUDE_OK.join(", ")
                        ),
                    ));
                }
                None => return Err(bad("include", "`include` must be an array of strings")),
            }
        }
    }
    if get("truncation").is_some_and(|v| v != "disabled") {
        return Err(bad(
            "truncation",
            "`truncation` must be \"disabled\": Deltafin never drops input; a prompt longer than the context is a 400",
        ));
    }
    if get("background").is_some_and(|v| v != &Value::Bool(false)) {
        return Err(bad(
            "background",
            "`background: true` is not implemented: deltafin answers in the request that asks (stream it to see progress); leave `background` out",
        ));
    }
    if get("top_logprobs").is_some_and(|v| v.as_u64() != Some(0)) {
        return Err(bad(
            "top_logprobs",
            "`top_logprobs` is not implemented on /v1/responses (use /v1/chat/completions); send 0 or leave it out",
        ));
    }
    crate::request::service_tier(get("service_tier"))?;
    if get("max_tool_calls").is_some() {
        return Err(bad(
            "max_tool_calls",
            "non-default `max_tool_calls` semantics are not implemented by native Deltafin; refusing to ignore the request",
        ));
    }
    Ok(encrypted)
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
                        format!("`reasoning.effort` must be one of {THINKING_SPELLINGS}"),
                    )
                };
                let e = e.as_str().ok_or_else(bad_effort)?;
                let t = Thinking::parse(e).map_err(|_| bad_effort())?;
                (on, effort) = (t.is_on(), t.effort().unwrap_or(default_effort));
            }
        }
        match obj.get("summary").filter(|s| !s.is_null()) {
            None => {}
            // Without thinking there is no reasoning to summarize: no reasoning item comes,
            // which is what a summary of nothing is.
            Some(s) if s == "auto" || s == "detailed" => {
                summary = on;
                r.insert("summary".into(), s.clone());
            }
            Some(s) if s == "concise" => {
                return Err(bad(
                    "reasoning",
                    "`reasoning.summary: \"concise\"` is not implemented: K3 does not summarize its reasoning; `auto` and `detailed` return it verbatim as the summary (Codex: model_reasoning_summary = \"auto\")",
                ));
            }
            Some(_) => {
                return Err(bad(
                    "reasoning",
                    "`reasoning.summary` must be auto, concise or detailed",
                ));
            }
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

/// Hosted tools Deltafin cannot run, with the client setting that stops sending each.
const HOSTED: &[(&str, &str)] = &[
    ("file_search", "remove the file_search tool"),
    ("computer_use_preview", "remove the computer-use tool"),
    ("computer_use", "remove the computer-use tool"),
    ("code_interpreter", "remove the code_interpreter tool"),
    (
        "image_generation",
        "remove the image_generation tool (Codex: features.image_generation = false)",
    ),
    (
        "mcp",
        "connect MCP servers in the client instead (Codex: [mcp_servers] in config.toml), which sends them as function tools",
    ),
    (
        "local_shell",
        "use a function tool for the shell (Codex: the default shell tool of a custom provider)",
    ),
    (
        "custom",
        "declare the tool as a function tool (Codex: apply_patch_tool_type = \"function\")",
    ),
];

/// Function tools `{type:"function", name, description?, parameters, strict}` (the flat
/// Responses shape), function tools nested in a `namespace` (declared by their own names;
/// a call of one names its namespace), and `web_search` tools, which deltafin cannot run and
/// therefore does not offer to the model (docs/SERVER.md "/v1/responses"). Echoed as given.
/// Returns the function tools and, for each nested one, its namespace.
fn tools(
    v: Option<&Value>,
    echo: &mut Map<String, Value>,
) -> Result<(Vec<Value>, HashMap<String, String>), ApiError> {
    let mut out: Vec<Value> = Vec::new();
    let mut namespaces = HashMap::new();
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
                Some("function") => out.push(function_tool(&p, obj, &out)?),
                Some("namespace") => {
                    only_keys(
                        obj,
                        &["type", "name", "description", "tools"],
                        &p,
                        "a namespace tool",
                    )?;
                    let ns = obj.get("name").and_then(Value::as_str).unwrap_or_default();
                    if !valid_name(ns) {
                        return Err(bad(
                            &p,
                            format!(
                                "namespace name {ns:?} must be 1 to 64 letters, digits, `_` or `-`"
                            ),
                        ));
                    }
                    if obj
                        .get("description")
                        .is_some_and(|d| !d.is_string() && !d.is_null())
                    {
                        return Err(bad(&p, "namespace `description` must be a string"));
                    }
                    let nested = obj.get("tools").and_then(Value::as_array).ok_or_else(|| {
                        bad(
                            &p,
                            "a namespace tool needs `tools`, an array of function tools",
                        )
                    })?;
                    for (j, f) in nested.iter().enumerate() {
                        let pj = format!("{p}.tools[{j}]");
                        let fo = f
                            .as_object()
                            .ok_or_else(|| bad(&pj, "every tool must be a JSON object"))?;
                        if fo.get("type").and_then(Value::as_str) != Some("function") {
                            return Err(bad(&pj, "a namespace holds only function tools"));
                        }
                        let tool = function_tool(&pj, fo, &out)?;
                        namespaces.insert(
                            tool["name"].as_str().unwrap_or_default().to_string(),
                            ns.to_string(),
                        );
                        out.push(tool);
                    }
                }
                // deltafin has no search backend: the model is not offered the tool, so the
                // answer is the model's without searching, as when it chooses not to search.
                Some(
                    "web_search"
                    | "web_search_preview"
                    | "web_search_2025_08_26"
                    | "web_search_preview_2025_03_11",
                ) => {}
                Some(other) => {
                    let how = HOSTED
                        .iter()
                        .find(|(k, _)| *k == other)
                        .map_or("declare it as a function tool", |(_, how)| how);
                    return Err(bad(
                        &p,
                        format!(
                            "tool type `{other}` is not implemented: Deltafin runs no hosted tools; {how}"
                        ),
                    ));
                }
                None => return Err(bad(&p, "every tool needs a `type` string")),
            }
        }
        echo.insert("tools".into(), v.clone());
    } else {
        echo.insert("tools".into(), Value::Array(Vec::new()));
    }
    Ok((out, namespaces))
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// One function tool, checked (its name unique among `declared`).
fn function_tool(p: &str, obj: &Map<String, Value>, declared: &[Value]) -> Result<Value, ApiError> {
    only_keys(
        obj,
        &[
            "type",
            "name",
            "description",
            "parameters",
            "strict",
            "defer_loading",
        ],
        p,
        "a function tool",
    )?;
    let name = obj.get("name").and_then(Value::as_str).unwrap_or_default();
    if !valid_name(name) {
        return Err(bad(
            p,
            format!("function name {name:?} must be 1 to 64 letters, digits, `_` or `-`"),
        ));
    }
    if declared.iter().any(|t: &Value| t["name"] == name) {
        return Err(bad(p, format!("function name {name:?} is declared twice")));
    }
    if obj
        .get("description")
        .is_some_and(|d| !d.is_string() && !d.is_null())
    {
        return Err(bad(p, "function `description` must be a string"));
    }
    if obj
        .get("parameters")
        .is_some_and(|s| !s.is_object() && !s.is_null())
    {
        return Err(bad(p, "function `parameters` must be a JSON Schema object"));
    }
    if obj
        .get("strict")
        .is_some_and(|s| !s.is_boolean() && !s.is_null())
    {
        return Err(bad(p, "function `strict` must be a boolean"));
    }
    if obj
        .get("defer_loading")
        .is_some_and(|d| d != &Value::Bool(false) && !d.is_null())
    {
        return Err(bad(
            p,
            "function `defer_loading: true` is not implemented on /v1/responses (it needs the hosted tool search); declare the tool without it",
        ));
    }
    Ok(Value::Object(obj.clone()))
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
            match c.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(hosted @ ("web_search" | "web_search_preview")) => {
                    return Err(bad(
                        "tool_choice",
                        format!(
                            "`tool_choice` {{\"type\":\"{hosted}\"}} cannot be honoured: deltafin has no search backend, so the `{hosted}` tool is never offered to the model; use \"auto\" (Codex CLI: `web_search = \"disabled\"` stops sending the tool)"
                        ),
                    ));
                }
                _ => {
                    return Err(bad(
                        "tool_choice",
                        "`tool_choice` objects other than {\"type\":\"function\",\"name\":…} are not implemented",
                    ));
                }
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
