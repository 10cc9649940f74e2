//! Strict validation of `/v1/completions` and `/v1/chat/completions` request bodies.
//!
//! Every top-level field is either implemented exactly, accepted because it changes nothing
//! (e.g. `top_p` under greedy decoding), or refused with a 400 naming it. `docs/SERVER.md` lists the rule
//! for each field; the messages follow the product contract §3.3–§3.4.

mod sampling;
mod tools;

pub use sampling::parse_sampling;
pub use tools::{MAX_TOOL_NAME_CHARS, ToolMode, valid_tool_name};

use crate::error::ApiError;
use deltafin_k3::sampling::Sampling;
use deltafin_k3::text::chat::{
    ChatMessage, ReasoningEffort, ResponseFormat, THINKING_SPELLINGS, Thinking,
};
use serde_json::{Map, Value};

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Surface {
    /// `/v1/completions`: raw text, no template.
    Completions,
    /// `/v1/chat/completions`: the XTML chat template, thinking on.
    Chat,
}

impl Surface {
    /// The endpoint name used in messages.
    pub fn endpoint(self) -> &'static str {
        match self {
            Surface::Completions => "completions",
            Surface::Chat => "chat/completions",
        }
    }
}

/// What to generate from.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// Raw text, encoded with specials off and no BOS.
    Raw(String),
    /// A conversation and how the answer is controlled.
    Chat {
        /// The messages, in order.
        messages: Vec<ChatMessage>,
        /// Thinking, tools and output format.
        controls: ChatControls,
    },
}

/// How a chat request controls its answer beyond the messages: thinking, tools and the
/// response format. Every endpoint that renders the XTML chat template fills one.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatControls {
    /// Thinking on (the default) or off (`reasoning_effort: none`).
    pub thinking: bool,
    /// The effort of the thinking-effort system message (used only when thinking).
    pub effort: ReasoningEffort,
    /// Declared function tools, each `{"type":"function","function":{"name", "description"?,
    /// "parameters"?, "strict"?}}`, as they are rendered.
    pub tools: Vec<serde_json::Value>,
    /// `tool_choice`.
    pub tool_mode: ToolMode,
    /// `parallel_tool_calls` (default true): more than one call per answer allowed.
    pub parallel_tool_calls: bool,
    /// `response_format` `json_object` / `json_schema` (`None`: free text).
    pub response_format: Option<ResponseFormat>,
}

impl ChatControls {
    /// Thinking on at `effort`, no tools, free text.
    pub fn with_effort(effort: ReasoningEffort) -> Self {
        ChatControls {
            thinking: true,
            effort,
            tools: Vec::new(),
            tool_mode: ToolMode::Auto,
            parallel_tool_calls: true,
            response_format: None,
        }
    }

    /// `thinking` (on at its effort, or off), no tools, free text.
    pub fn with_thinking(thinking: Thinking) -> Self {
        ChatControls {
            thinking: thinking.is_on(),
            ..Self::with_effort(thinking.effort().unwrap_or(ReasoningEffort::Max))
        }
    }
}

/// A validated generation request.
#[derive(Clone, Debug, PartialEq)]
pub struct GenRequest {
    /// The endpoint.
    pub surface: Surface,
    /// The prompt.
    pub prompt: Prompt,
    /// Most tokens to generate.
    pub max_new: usize,
    /// Answer as server-sent events.
    pub stream: bool,
    /// Streams: append a usage frame.
    pub include_usage: bool,
    /// Stop sequences (0–4 non-empty strings), matched on the decoded text.
    pub stop: Vec<String>,
    /// `Some(k)`: report the log-probability of every emitted token and the `k` most likely
    /// alternatives.
    pub logprobs: Option<usize>,
    /// Seeded sampling (`None`: greedy decoding).
    pub sampling: Option<Sampling>,
}

/// Server-wide settings that validation needs.
#[derive(Clone, Copy, Debug)]
pub struct Limits<'a> {
    /// `--max-tokens`: per-response ceiling.
    pub max_tokens: usize,
    /// Thinking when a chat request names no effort (`K3_REASONING_EFFORT`, else `max`).
    pub default_thinking: Thinking,
    /// `--model-alias` names a request's `model` may use besides [`crate::MODEL_ID`].
    pub model_aliases: &'a [String],
}

/// Default `max_tokens` of `/v1/completions` (product contract §3.3).
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 256;
/// Most stop sequences per request (OpenAI's limit).
pub const MAX_STOP_SEQUENCES: usize = 4;
/// Longest stop sequence, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;
/// Most messages in one conversation.
pub const MAX_MESSAGES: usize = 65_536;
/// Most tool calls in one assistant message, and in a whole conversation.
pub const MAX_CALLS_PER_MESSAGE: usize = 1024;
/// Most tool calls in a whole conversation.
pub const MAX_CALLS: usize = 65_536;
/// Most tools declared by one request (its `tools` and its system messages' together).
pub const MAX_TOOLS: usize = 1024;

/// The size limits every endpoint's request is held to once parsed (docs/SERVER.md
/// "Limits"): they bound the work of rendering and matching, whatever fits in the body.
pub fn check_limits(req: &GenRequest) -> Result<(), ApiError> {
    for (i, s) in req.stop.iter().enumerate() {
        if s.len() > MAX_STOP_BYTES {
            return Err(ApiError::invalid_param(
                "stop",
                format!(
                    "stop sequence {i} is {} bytes long; at most {MAX_STOP_BYTES} are allowed",
                    s.len()
                ),
            ));
        }
    }
    let Prompt::Chat { messages, controls } = &req.prompt else {
        return Ok(());
    };
    if messages.len() > MAX_MESSAGES {
        return Err(ApiError::invalid_param(
            "messages",
            format!(
                "the conversation holds {} messages; at most {MAX_MESSAGES} are allowed",
                messages.len()
            ),
        ));
    }
    let mut calls = 0usize;
    let mut tools = controls.tools.len();
    for (i, m) in messages.iter().enumerate() {
        if m.tool_calls.len() > MAX_CALLS_PER_MESSAGE {
            return Err(ApiError::invalid_param(
                "messages",
                format!(
                    "message {i} holds {} tool calls; at most {MAX_CALLS_PER_MESSAGE} are allowed",
                    m.tool_calls.len()
                ),
            ));
        }
        calls += m.tool_calls.len();
        tools += m.tools.len();
    }
    if calls > MAX_CALLS {
        return Err(ApiError::invalid_param(
            "messages",
            format!("the conversation holds {calls} tool calls; at most {MAX_CALLS} are allowed"),
        ));
    }
    if tools > MAX_TOOLS {
        return Err(ApiError::invalid_param(
            "tools",
            format!("the request declares {tools} tools; at most {MAX_TOOLS} are allowed"),
        ));
    }
    Ok(())
}

/// A client's token budget `asked` for its answer (`param`: `max_tokens`,
/// `max_output_tokens`, …), which must not pass the server's `--max-tokens`: an answer cut at
/// the server's limit would look to the client like its own limit was reached.
pub fn within_server_limit(param: &str, asked: u64, limits: &Limits) -> Result<usize, ApiError> {
    let max = limits.max_tokens;
    match usize::try_from(asked) {
        Ok(n) if n <= max => Ok(n),
        _ => Err(ApiError::invalid_param(
            param,
            format!(
                "`{param}` {asked} is above this server's limit of {max} tokens per answer (`deltafin serve --max-tokens {max}`); ask for at most {max}{}",
                client_setting(param, max)
            ),
        )),
    }
}

/// The setting of the agent that sends `param` that lowers it to `max` (docs/AGENTS.md).
fn client_setting(param: &str, max: usize) -> String {
    match param {
        "max_tokens" => format!(
            " (Claude Code: CLAUDE_CODE_MAX_OUTPUT_TOKENS={max}; opencode: the model's `limit.output`)"
        ),
        "options.num_predict" => format!(" (`num_predict` {max} or -1)"),
        _ => String::new(),
    }
}

/// `service_tier`: `auto` and `default` (one tier of capacity: both are what happens);
/// a tier that asks for other processing (`flex`, `priority`, `scale`) is refused.
pub fn service_tier(v: Option<&Value>) -> Result<(), ApiError> {
    match v {
        None | Some(Value::Null) => Ok(()),
        Some(t) if t == "auto" || t == "default" => Ok(()),
        Some(_) => Err(ApiError::invalid_param(
            "service_tier",
            "`service_tier` must be \"auto\" or \"default\": Deltafin has one tier of processing",
        )),
    }
}

/// Largest `top_logprobs` on chat.
pub const MAX_CHAT_TOP_LOGPROBS: u64 = 20;
/// Largest `logprobs` on completions.
pub const MAX_COMPLETIONS_LOGPROBS: u64 = 5;

fn unknown(field: &str, surface: Surface) -> ApiError {
    crate::strict::unknown_field(field, &format!("/v1/{}", surface.endpoint()))
}

fn non_default(field: &str) -> ApiError {
    ApiError::invalid_param(
        field,
        format!(
            "non-default `{field}` semantics are not implemented by native Deltafin; refusing to ignore the request"
        ),
    )
}

/// A field that, when given (not null), must pass `ok`; else the error `message` naming it.
fn require(
    v: Option<&Value>,
    field: &str,
    ok: impl FnOnce(&Value) -> bool,
    message: &str,
) -> Result<(), ApiError> {
    match v {
        Some(v) if !ok(v) => Err(ApiError::invalid_param(field, message)),
        _ => Ok(()),
    }
}

pub(crate) fn finite_number(v: &Value) -> Option<f64> {
    v.as_f64().filter(|x| x.is_finite())
}

fn optional_uint(obj: &Map<String, Value>, field: &str) -> Result<Option<u64>, ApiError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            ApiError::invalid_param(field, format!("`{field}` must be a non-negative integer"))
        }),
    }
}

/// Fields both endpoints accept.
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "n",
    "best_of",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "user",
    "metadata",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "seed",
    "stop",
    "logprobs",
];
const COMPLETIONS_FIELDS: &[&str] = &["prompt", "echo", "suffix"];
const CHAT_FIELDS: &[&str] = &[
    "messages",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "modalities",
    "audio",
    "prediction",
    "service_tier",
    "store",
    "reasoning_effort",
    "chat_template_kwargs",
    "prompt_cache_key",
    "safety_identifier",
    "verbosity",
];

/// Validates a request body for `surface`.
pub fn parse(body: &Value, surface: Surface, limits: &Limits) -> Result<GenRequest, ApiError> {
    let obj = body
        .as_object()
        .ok_or_else(|| ApiError::invalid("request body must be a JSON object"))?;
    let own = match surface {
        Surface::Completions => COMPLETIONS_FIELDS,
        Surface::Chat => CHAT_FIELDS,
    };
    for key in obj.keys() {
        if !COMMON_FIELDS.contains(&key.as_str()) && !own.contains(&key.as_str()) {
            return Err(unknown(key, surface));
        }
    }
    let get = |k: &str| obj.get(k).filter(|v| !v.is_null());

    // model
    if let Some(m) = get("model") {
        let m = m
            .as_str()
            .ok_or_else(|| ApiError::invalid_param("model", "`model` must be a JSON string"))?;
        if !crate::models::is_served(m, limits.model_aliases) {
            return Err(ApiError::invalid_param(
                "model",
                crate::models::unavailable(m, limits.model_aliases),
            ));
        }
    }

    // max_tokens / max_completion_tokens
    let max_tokens = optional_uint(obj, "max_tokens")?;
    let max_completion_tokens = optional_uint(obj, "max_completion_tokens")?;
    if max_tokens.is_some() && max_completion_tokens.is_some() {
        return Err(ApiError::invalid_param(
            "max_tokens",
            "send only one of `max_tokens` and `max_completion_tokens`",
        ));
    }
    let asked = max_tokens.or(max_completion_tokens).unwrap_or(0);
    let default = match surface {
        Surface::Completions => COMPLETIONS_DEFAULT_MAX_TOKENS.min(limits.max_tokens),
        Surface::Chat => limits.max_tokens,
    };
    let max_new = if asked == 0 {
        default
    } else {
        let param = if max_tokens.is_some() {
            "max_tokens"
        } else {
            "max_completion_tokens"
        };
        within_server_limit(param, asked, limits)?
    };

    // stream / stream_options
    let stream = match get("stream") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid_param(
                "stream",
                "`stream` must be a boolean",
            ));
        }
    };
    let mut include_usage = false;
    if let Some(so) = get("stream_options") {
        if !stream {
            return Err(ApiError::invalid_param(
                "stream_options",
                "`stream_options` requires `stream: true`",
            ));
        }
        let so = so.as_object().ok_or_else(|| {
            ApiError::invalid_param("stream_options", "`stream_options` must be a JSON object")
        })?;
        for (k, v) in so {
            if k != "include_usage" {
                return Err(ApiError::invalid_param(
                    "stream_options",
                    format!(
                        "`stream_options.{k}` is not implemented; refusing to silently ignore it"
                    ),
                ));
            }
            include_usage = match v {
                Value::Null => false,
                Value::Bool(b) => *b,
                _ => {
                    return Err(ApiError::invalid_param(
                        "stream_options",
                        "`stream_options.include_usage` must be a boolean",
                    ));
                }
            };
        }
    }

    // n / best_of
    for field in ["n", "best_of"] {
        let message = format!("`{field}` must be 1; Deltafin has one authoritative target stream");
        require(get(field), field, |v| v.as_u64() == Some(1), &message)?;
    }

    // temperature / top_p / top_k / min_p / seed: greedy without a temperature.
    let sampling = parse_sampling(get, 2.0)?;

    // user / metadata / cache and safety identifiers: carry no generation semantics.
    for key in ["user", "prompt_cache_key", "safety_identifier"] {
        crate::strict::opt_string(obj, key)?;
    }
    let metadata = "`metadata` must be a JSON object";
    require(get("metadata"), "metadata", Value::is_object, metadata)?;

    // penalties and bias must keep their defaults.
    for field in ["frequency_penalty", "presence_penalty"] {
        if let Some(v) = get(field)
            && finite_number(v) != Some(0.0)
        {
            return Err(non_default(field));
        }
    }
    if let Some(v) = get("logit_bias")
        && v.as_object().is_none_or(|m| !m.is_empty())
    {
        return Err(non_default("logit_bias"));
    }

    let stop = parse_stop(get("stop"))?;

    let (prompt, logprobs) = match surface {
        Surface::Completions => (parse_completions_prompt(obj)?, completions_logprobs(obj)?),
        Surface::Chat => (parse_chat_prompt(obj, limits)?, chat_logprobs(obj)?),
    };

    Ok(GenRequest {
        surface,
        prompt,
        max_new,
        stream,
        include_usage,
        stop,
        logprobs,
        sampling,
    })
}

fn parse_stop(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let list = match v {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                match item {
                    Value::String(s) => out.push(s.clone()),
                    _ => {
                        return Err(ApiError::invalid_param(
                            "stop",
                            "`stop` must be a string or an array of strings",
                        ));
                    }
                }
            }
            out
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "stop",
                "`stop` must be a string or an array of strings",
            ));
        }
    };
    if list.len() > MAX_STOP_SEQUENCES {
        return Err(ApiError::invalid_param(
            "stop",
            format!(
                "`stop` holds {} sequences; at most {MAX_STOP_SEQUENCES} are allowed",
                list.len()
            ),
        ));
    }
    if list.iter().any(String::is_empty) {
        return Err(ApiError::invalid_param(
            "stop",
            "`stop` sequences must be non-empty strings",
        ));
    }
    Ok(list)
}

fn parse_completions_prompt(obj: &Map<String, Value>) -> Result<Prompt, ApiError> {
    let prompt = match obj.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) => {
            return Err(ApiError::invalid_param("prompt", "`prompt` is required"));
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "prompt",
                "`prompt` must be a JSON string for native completions",
            ));
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid_param(
            "prompt",
            "`prompt` must not be empty",
        ));
    }
    match obj.get("echo") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
        Some(_) => return Err(non_default("echo")),
    }
    match obj.get("suffix") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(_) => return Err(non_default("suffix")),
    }
    Ok(Prompt::Raw(prompt))
}

fn completions_logprobs(obj: &Map<String, Value>) -> Result<Option<usize>, ApiError> {
    match obj.get("logprobs") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(k) if k <= MAX_COMPLETIONS_LOGPROBS => Ok(Some(k as usize)),
            _ => Err(ApiError::invalid_param(
                "logprobs",
                format!("`logprobs` must be an integer in 0..={MAX_COMPLETIONS_LOGPROBS}"),
            )),
        },
    }
}

fn chat_logprobs(obj: &Map<String, Value>) -> Result<Option<usize>, ApiError> {
    let on = match obj.get("logprobs") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid_param(
                "logprobs",
                "`logprobs` must be a boolean",
            ));
        }
    };
    let top = match obj.get("top_logprobs") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(k) if k <= MAX_CHAT_TOP_LOGPROBS => Some(k as usize),
            _ => {
                return Err(ApiError::invalid_param(
                    "top_logprobs",
                    format!("`top_logprobs` must be an integer in 0..={MAX_CHAT_TOP_LOGPROBS}"),
                ));
            }
        },
    };
    match (on, top) {
        (false, Some(_)) => Err(ApiError::invalid_param(
            "top_logprobs",
            "`top_logprobs` requires `logprobs: true`",
        )),
        (false, None) => Ok(None),
        (true, k) => Ok(Some(k.unwrap_or(0))),
    }
}

fn parse_chat_prompt(obj: &Map<String, Value>, limits: &Limits) -> Result<Prompt, ApiError> {
    let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let response_format = parse_response_format(get("response_format"))?;
    let tool_fields = tools::parse_tool_fields(obj)?;
    require(
        get("modalities"),
        "modalities",
        |v| v.as_array().is_some_and(|a| a.len() == 1 && a[0] == "text"),
        "native Deltafin production inference is text-only; `modalities` must be [\"text\"]",
    )?;
    for field in ["audio", "prediction"] {
        if get(field).is_some() {
            return Err(non_default(field));
        }
    }
    service_tier(get("service_tier"))?;
    // `store` asks OpenAI to keep the completion for its dashboard; it changes no answer,
    // and Deltafin keeps no chat completions (docs/SERVER.md).
    if get("store").is_some_and(|v| !v.is_boolean()) {
        return Err(ApiError::invalid_param(
            "store",
            "`store` must be a boolean",
        ));
    }
    if get("verbosity").is_some_and(|v| v != "medium") {
        return Err(ApiError::invalid_param(
            "verbosity",
            "`verbosity` other than \"medium\" (the default) is not implemented: K3 has no verbosity control",
        ));
    }
    let thinking = match get("reasoning_effort") {
        None => limits.default_thinking,
        Some(Value::String(s)) => Thinking::parse(s).map_err(|e| {
            ApiError::invalid_param(
                "reasoning_effort",
                format!(
                    "`reasoning_effort` must be one of {THINKING_SPELLINGS}, not {:?}",
                    e.value
                ),
            )
        })?,
        Some(_) => {
            return Err(ApiError::invalid_param(
                "reasoning_effort",
                format!("`reasoning_effort` must be a JSON string: one of {THINKING_SPELLINGS}"),
            ));
        }
    };
    let thinking = template_kwargs(get("chat_template_kwargs"), thinking, limits)?;
    let messages = match get("messages") {
        Some(Value::Array(items)) if !items.is_empty() => items,
        _ => {
            return Err(ApiError::invalid_param(
                "messages",
                "`messages` must be a non-empty JSON array",
            ));
        }
    };
    let mut parsed = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        parsed.push(parse_message(i, m)?);
    }
    Ok(Prompt::Chat {
        messages: parsed,
        controls: ChatControls {
            thinking: thinking.is_on(),
            effort: thinking.effort().unwrap_or(ReasoningEffort::Max),
            tools: tool_fields.tools,
            tool_mode: tool_fields.mode,
            parallel_tool_calls: tool_fields.parallel,
            response_format,
        },
    })
}

/// `chat_template_kwargs` (vLLM's and SGLang's switches of the chat template): `thinking`
/// (K3's own switch) or `enable_thinking` (Qwen's spelling), a boolean. `true` keeps the
/// effort the request (or the server) chose; `false` turns thinking off. Other keys are
/// refused by name: K3's template has no other switch.
fn template_kwargs(
    v: Option<&Value>,
    thinking: Thinking,
    limits: &Limits,
) -> Result<Thinking, ApiError> {
    const P: &str = "chat_template_kwargs";
    let Some(v) = v else { return Ok(thinking) };
    let obj = v.as_object().ok_or_else(|| {
        ApiError::invalid_param(P, "`chat_template_kwargs` must be a JSON object")
    })?;
    if let (Some(a), Some(b)) = (obj.get("thinking"), obj.get("enable_thinking"))
        && a != b
    {
        return Err(ApiError::invalid_param(
            P,
            "`chat_template_kwargs.thinking` and `enable_thinking` disagree",
        ));
    }
    let mut out = thinking;
    for (k, val) in obj {
        match (k.as_str(), val) {
            ("thinking" | "enable_thinking", Value::Bool(false)) => out = Thinking::Off,
            ("thinking" | "enable_thinking", Value::Bool(true)) => {
                if !out.is_on() {
                    // On at the server's effort when the request named none that is on.
                    out = match limits.default_thinking {
                        Thinking::On(e) => Thinking::On(e),
                        Thinking::Off => Thinking::On(ReasoningEffort::Max),
                    };
                }
            }
            ("thinking" | "enable_thinking", _) => {
                return Err(ApiError::invalid_param(
                    P,
                    format!("`chat_template_kwargs.{k}` must be a boolean"),
                ));
            }
            _ => {
                return Err(ApiError::invalid_param(
                    P,
                    format!(
                        "`chat_template_kwargs.{k}` is not a switch of K3's chat template (it has `thinking`, also spelled `enable_thinking`); refusing to silently ignore it"
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// `response_format`: `{"type":"text"}` (the default), `{"type":"json_object"}`, or
/// `{"type":"json_schema","json_schema":{"name", "schema"?, "description"?, "strict"?}}`
/// (OpenAI's shape; a missing schema allows any JSON value). Enforced by constrained decoding
/// (docs/SERVER.md "Constrained decoding"); `strict` is accepted either way, since every
/// answer is constrained to the schema.
fn parse_response_format(v: Option<&Value>) -> Result<Option<ResponseFormat>, ApiError> {
    const P: &str = "response_format";
    let Some(v) = v else { return Ok(None) };
    let bad = |m: &str| ApiError::invalid_param(P, m);
    let obj = v
        .as_object()
        .ok_or_else(|| bad("`response_format` must be a JSON object"))?;
    let only = |keys: &[&str], what: &str| match obj.keys().find(|k| !keys.contains(&k.as_str())) {
        Some(k) => Err(bad(&format!("unknown field `{k}` in {what}"))),
        None => Ok(()),
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => only(&["type"], "`response_format`").map(|()| None),
        Some("json_object") => {
            only(&["type"], "`response_format`").map(|()| Some(ResponseFormat::JsonObject))
        }
        Some("json_schema") => {
            only(&["type", "json_schema"], "`response_format`")?;
            let js = obj
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| bad("`response_format.json_schema` must be a JSON object"))?;
            if let Some(k) = js
                .keys()
                .find(|k| !["name", "schema", "description", "strict"].contains(&k.as_str()))
            {
                return Err(bad(&format!(
                    "unknown field `{k}` in `response_format.json_schema`"
                )));
            }
            match js.get("name").and_then(Value::as_str) {
                Some(n) if valid_tool_name(n) => {}
                _ => {
                    return Err(bad(&format!(
                        "`response_format.json_schema.name` must be 1-{MAX_TOOL_NAME_CHARS} letters, digits, `_` or `-`"
                    )));
                }
            }
            if js.get("description").is_some_and(|d| !d.is_string()) {
                return Err(bad(
                    "`response_format.json_schema.description` must be a string",
                ));
            }
            if js
                .get("strict")
                .is_some_and(|s| !s.is_boolean() && !s.is_null())
            {
                return Err(bad(
                    "`response_format.json_schema.strict` must be a boolean",
                ));
            }
            let schema = match js.get("schema") {
                None | Some(Value::Null) => serde_json::json!({}),
                Some(s @ Value::Object(_)) => s.clone(),
                Some(_) => {
                    return Err(bad(
                        "`response_format.json_schema.schema` must be a JSON object",
                    ));
                }
            };
            Ok(Some(ResponseFormat::JsonSchema(schema)))
        }
        _ => Err(bad(
            "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

pub(crate) const MULTIMODAL: &str = "native Deltafin production inference is text-only; image and other multimodal chat content require the K3 vision/projector path, which is not implemented";

/// Checks one message against §3.4 and converts it.
fn parse_message(index: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let param = format!("messages[{index}]");
    let bad = |msg: String| ApiError::invalid_param(&param, msg);
    let obj = m
        .as_object()
        .ok_or_else(|| bad("every chat message must be an object".into()))?;
    let role = match obj.get("role") {
        Some(Value::String(r)) => r.as_str(),
        Some(_) => return Err(bad("chat message `role` must be a JSON string".into())),
        None => return Err(bad("every chat message needs a `role`".into())),
    };
    // `developer` is OpenAI's name for system instructions to newer models.
    let (role, allowed, null_only): (&str, &[&str], &[&str]) = match role {
        "system" | "user" | "developer" => (
            if role == "user" { "user" } else { "system" },
            &["role", "content", "name"],
            &[],
        ),
        "assistant" => (
            "assistant",
            &["role", "content", "name", "reasoning_content", "tool_calls"],
            // What OpenAI clients echo back from a previous answer.
            &["refusal", "audio", "function_call", "annotations"],
        ),
        "tool" => (
            "tool",
            &["role", "content", "name", "tool", "tool_call_id"],
            &[],
        ),
        other => {
            return Err(bad(format!(
                "unsupported chat message role `{other}`; native Deltafin supports system, developer, user, assistant, and tool history"
            )));
        }
    };
    let mut clean = Map::new();
    for (k, v) in obj {
        if allowed.contains(&k.as_str()) {
            clean.insert(k.clone(), v.clone());
        } else if null_only.contains(&k.as_str()) && v.is_null() {
        } else {
            return Err(bad(format!(
                "chat message field `{k}` is not implemented for role `{role}`; refusing to silently ignore it"
            )));
        }
    }
    clean.insert("role".into(), Value::from(role));
    match obj.get("content") {
        None | Some(Value::Null) if role == "assistant" => {}
        Some(Value::String(_)) => {}
        Some(Value::Array(parts)) => {
            for part in parts {
                let is_text = part.as_object().is_some_and(|p| {
                    p.len() == 2
                        && p.get("type") == Some(&Value::from("text"))
                        && p.get("text").is_some_and(Value::is_string)
                });
                if !is_text {
                    let kind = part.get("type").and_then(Value::as_str);
                    return Err(bad(match kind {
                        Some("text") => {
                            "a text content part must be exactly {\"type\":\"text\",\"text\":\"…\"}"
                                .into()
                        }
                        _ => MULTIMODAL.into(),
                    }));
                }
            }
        }
        _ => {
            return Err(bad(
                "chat message `content` must be text, an array, or null".into(),
            ));
        }
    }
    ChatMessage::from_json(&Value::Object(clean)).map_err(|e| bad(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MODEL_ID;
    use serde_json::json;

    const LIMITS: Limits<'static> = Limits {
        max_tokens: 1000,
        default_thinking: Thinking::On(ReasoningEffort::Max),
        model_aliases: &[],
    };

    fn chat(extra: Value) -> Result<GenRequest, ApiError> {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        parse(&body, Surface::Chat, &LIMITS)
    }

    fn completions(extra: Value) -> Result<GenRequest, ApiError> {
        let mut body = json!({"prompt": "hi"});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        parse(&body, Surface::Completions, &LIMITS)
    }

    #[test]
    fn defaults() {
        let r = completions(json!({})).unwrap();
        assert_eq!(r.max_new, 256);
        assert!(!r.stream && r.stop.is_empty() && r.logprobs.is_none());
        let r = chat(json!({})).unwrap();
        assert_eq!(r.max_new, 1000);
        let Prompt::Chat { controls, messages } = r.prompt else {
            panic!()
        };
        assert_eq!(controls, ChatControls::with_effort(ReasoningEffort::Max));
        assert_eq!(messages.len(), 1);
    }

    #[test]
    fn max_tokens_rules() {
        assert_eq!(completions(json!({"max_tokens": 5})).unwrap().max_new, 5);
        assert_eq!(completions(json!({"max_tokens": 0})).unwrap().max_new, 256);
        // Above the server's --max-tokens: refused, naming the field and the limit.
        let e = chat(json!({"max_completion_tokens": 5000})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_completion_tokens"));
        assert!(e.message.contains("limit of 1000"), "{e}");
        assert_eq!(chat(json!({"max_tokens": 1000})).unwrap().max_new, 1000);
        let e = chat(json!({"max_tokens": 1, "max_completion_tokens": 1})).unwrap_err();
        assert!(e.message.contains("only one of"), "{e}");
        let e = chat(json!({"max_tokens": -1})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(chat(json!({"max_tokens": 1.5})).is_err());
    }

    #[test]
    fn unknown_fields_are_refused_by_name() {
        let e = completions(json!({"reasoning_effort": "low"})).unwrap_err();
        assert!(
            e.message.starts_with(
                "`reasoning_effort` is not supported by Deltafin's native /v1/completions"
            ),
            "{e}"
        );
        let e = chat(json!({"frobnicate": 1})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("frobnicate"));
        assert_eq!(e.status, 400);
    }

    #[test]
    fn sampling_fields() {
        assert_eq!(
            chat(json!({"temperature": 0, "top_p": 1, "seed": 7}))
                .unwrap()
                .sampling,
            None
        );
        assert!(chat(json!({"top_p": 0.1})).is_ok());
        let s = chat(json!({"temperature": 0.7, "min_p": 0.1}))
            .unwrap()
            .sampling
            .unwrap();
        assert_eq!((s.temperature, s.min_p), (0.7, 0.1));
        assert!(chat(json!({"temperature": 3})).is_err());
        assert!(chat(json!({"top_p": 0})).is_err());
        assert!(chat(json!({"seed": "x"})).is_err());
        assert!(chat(json!({"frequency_penalty": 0})).is_ok());
        let e = chat(json!({"presence_penalty": 0.5})).unwrap_err();
        assert!(
            e.message.starts_with("non-default `presence_penalty`"),
            "{e}"
        );
        assert!(chat(json!({"logit_bias": {}})).is_ok());
        assert!(chat(json!({"logit_bias": {"1": 2}})).is_err());
        assert!(chat(json!({"n": 1, "best_of": 1})).is_ok());
        assert!(
            chat(json!({"n": 2}))
                .unwrap_err()
                .message
                .contains("must be 1")
        );
    }

    #[test]
    fn stop_rules() {
        assert_eq!(chat(json!({"stop": "x"})).unwrap().stop, vec!["x"]);
        assert_eq!(
            chat(json!({"stop": ["a", "b"]})).unwrap().stop,
            vec!["a", "b"]
        );
        assert!(chat(json!({"stop": []})).unwrap().stop.is_empty());
        assert!(chat(json!({"stop": ""})).is_err());
        assert!(chat(json!({"stop": ["a", "b", "c", "d", "e"]})).is_err());
        assert!(chat(json!({"stop": [1]})).is_err());
    }

    #[test]
    fn logprobs_rules() {
        assert_eq!(chat(json!({"logprobs": true})).unwrap().logprobs, Some(0));
        assert_eq!(
            chat(json!({"logprobs": true, "top_logprobs": 20}))
                .unwrap()
                .logprobs,
            Some(20)
        );
        assert!(chat(json!({"logprobs": true, "top_logprobs": 21})).is_err());
        assert!(chat(json!({"top_logprobs": 2})).is_err());
        assert_eq!(chat(json!({"logprobs": false})).unwrap().logprobs, None);
        assert_eq!(
            completions(json!({"logprobs": 5})).unwrap().logprobs,
            Some(5)
        );
        assert!(completions(json!({"logprobs": 6})).is_err());
        assert!(completions(json!({"logprobs": true})).is_err());
    }

    #[test]
    fn stream_options_rules() {
        let r = chat(json!({"stream": true, "stream_options": {"include_usage": true}})).unwrap();
        assert!(r.stream && r.include_usage);
        assert!(chat(json!({"stream_options": {"include_usage": true}})).is_err());
        let e = chat(json!({"stream": true, "stream_options": {"x": 1}})).unwrap_err();
        assert!(e.message.contains("`stream_options.x` is not implemented"));
        assert!(chat(json!({"stream": "yes"})).is_err());
    }

    #[test]
    fn chat_only_fields() {
        assert!(
            chat(json!({"tools": [], "tool_choice": "none", "response_format": {"type": "text"}}))
                .is_ok()
        );
        let e = chat(json!({"tools": [{"type": "function"}]})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].function"));
        let r = chat(json!({"response_format": {"type": "json_object"}})).unwrap();
        assert!(matches!(
            r.prompt,
            Prompt::Chat { ref controls, .. }
                if controls.response_format == Some(ResponseFormat::JsonObject)
        ));
        assert!(chat(json!({"response_format": {"type": "json_object", "x": 1}})).is_err());
        let r = chat(json!({"reasoning_effort": " High "})).unwrap();
        assert!(matches!(
            r.prompt,
            Prompt::Chat {
                controls: ChatControls {
                    thinking: true,
                    effort: ReasoningEffort::High,
                    ..
                },
                ..
            }
        ));
        // `none`, `off` and `minimal` turn thinking off (the template has no level below low).
        for off in ["none", "OFF", "minimal"] {
            let r = chat(json!({"reasoning_effort": off})).unwrap();
            let Prompt::Chat { controls, .. } = r.prompt else {
                panic!()
            };
            assert!(!controls.thinking, "{off}");
            assert_eq!(controls.effort, ReasoningEffort::Max);
        }
        let e = chat(json!({"reasoning_effort": "extreme"})).unwrap_err();
        assert!(
            e.message
                .contains("`none`, `off`, `minimal` (thinking off), `low`"),
            "{e}"
        );
        assert!(chat(json!({"reasoning_effort": "extreme"})).is_err());
        assert!(
            chat(json!({"reasoning_effort": 3}))
                .unwrap_err()
                .message
                .contains("JSON string")
        );
        // Fields that ask nothing of generation.
        for extra in [
            json!({"store": true}),
            json!({"prompt_cache_key": "k", "safety_identifier": "u1", "service_tier": "auto"}),
            json!({"verbosity": "medium", "metadata": {"a": "b"}}),
        ] {
            assert!(chat(extra.clone()).is_ok(), "{extra}");
        }
        assert!(chat(json!({"store": "yes"})).is_err());
        assert!(chat(json!({"service_tier": "flex"})).is_err());
        assert!(chat(json!({"verbosity": "low"})).is_err());
        assert!(chat(json!({"prompt_cache_key": 3})).is_err());
        assert!(chat(json!({"modalities": ["text", "audio"]})).is_err());
        // xhigh is max, as on the other endpoints.
        let r = chat(json!({"reasoning_effort": "xhigh"})).unwrap();
        assert!(matches!(
            r.prompt,
            Prompt::Chat {
                controls: ChatControls {
                    thinking: true,
                    effort: ReasoningEffort::Max,
                    ..
                },
                ..
            }
        ));
    }

    #[test]
    fn template_kwargs_switch_thinking() {
        let thinking = |extra: Value| match chat(extra).unwrap().prompt {
            Prompt::Chat { controls, .. } => (controls.thinking, controls.effort),
            Prompt::Raw(_) => panic!(),
        };
        assert!(!thinking(json!({"chat_template_kwargs": {"thinking": false}})).0);
        assert!(!thinking(json!({"chat_template_kwargs": {"enable_thinking": false}})).0);
        assert_eq!(
            thinking(
                json!({"reasoning_effort": "low", "chat_template_kwargs": {"thinking": true}})
            ),
            (true, ReasoningEffort::Low)
        );
        assert_eq!(
            thinking(
                json!({"reasoning_effort": "none", "chat_template_kwargs": {"thinking": true}})
            ),
            (true, ReasoningEffort::Max)
        );
        let e = chat(json!({"chat_template_kwargs": {"thinking": true, "enable_thinking": false}}))
            .unwrap_err();
        assert!(e.message.contains("disagree"), "{e}");
        let e =
            chat(json!({"chat_template_kwargs": {"add_generation_prompt": false}})).unwrap_err();
        assert!(e.message.contains("add_generation_prompt"), "{e}");
        assert!(chat(json!({"chat_template_kwargs": {"thinking": "yes"}})).is_err());
    }

    #[test]
    fn messages_rules() {
        let p = |msgs: Value| parse(&json!({"messages": msgs}), Surface::Chat, &LIMITS);
        assert!(p(json!([])).is_err());
        assert!(
            p(json!([1]))
                .unwrap_err()
                .message
                .contains("must be an object")
        );
        let e = p(json!([{"role": "critic", "content": "x"}])).unwrap_err();
        assert!(e.message.contains("unsupported chat message role `critic`"));
        let e = p(json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])).unwrap_err();
        assert!(e.message.contains("text-only"));
        let e = p(json!([{"role": "user", "content": "x", "tool_calls": []}])).unwrap_err();
        assert!(
            e.message
                .contains("field `tool_calls` is not implemented for role `user`")
        );
        assert!(p(json!([{"role": "user", "content": null}])).is_err());
        assert!(p(json!([{"role": "user", "content": 5}])).is_err());
        let ok = p(json!([
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "yo", "reasoning_content": "r", "refusal": null},
            {"role": "user", "content": "again"}
        ]))
        .unwrap();
        let Prompt::Chat { messages, .. } = ok.prompt else {
            panic!()
        };
        assert_eq!(messages[0].role, "system");
        assert!(p(json!([{"role": "assistant", "content": "x", "refusal": "no"}])).is_err());
    }

    #[test]
    fn prompt_rules() {
        let p = |v: Value| parse(&v, Surface::Completions, &LIMITS);
        assert!(p(json!({"prompt": ""})).is_err());
        assert!(
            p(json!({"prompt": ["a"]}))
                .unwrap_err()
                .message
                .contains("JSON string")
        );
        assert!(p(json!({})).is_err());
        assert!(p(json!({"prompt": "a", "echo": true})).is_err());
        assert!(p(json!({"prompt": "a", "suffix": "b"})).is_err());
        assert!(
            p(json!({"prompt": "a", "model": "gpt-4"}))
                .unwrap_err()
                .message
                .contains("unavailable")
        );
        assert!(p(json!({"prompt": "a", "model": MODEL_ID})).is_ok());
        assert!(p(json!([1])).unwrap_err().message.contains("JSON object"));
    }

    #[test]
    fn aliases_and_the_default_thinking_come_from_the_server() {
        let aliases = vec!["kimi".to_string(), "gpt-4o".to_string()];
        let limits = Limits {
            default_thinking: Thinking::Off,
            model_aliases: &aliases,
            ..LIMITS
        };
        let body = json!({"messages": [{"role": "user", "content": "hi"}]});
        for name in [MODEL_ID, "kimi", "gpt-4o"] {
            let mut b = body.clone();
            b["model"] = json!(name);
            assert!(parse(&b, Surface::Chat, &limits).is_ok(), "{name}");
        }
        let mut b = body.clone();
        b["model"] = json!("Kimi");
        let e = parse(&b, Surface::Chat, &limits).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("model"));
        assert!(
            e.message.contains("aliases `kimi`, `gpt-4o`"),
            "{}",
            e.message
        );
        // Without aliases an alias is just another unknown model.
        b["model"] = json!("kimi");
        assert!(parse(&b, Surface::Chat, &LIMITS).is_err());

        let Prompt::Chat { controls, .. } = parse(&body, Surface::Chat, &limits).unwrap().prompt
        else {
            panic!("chat prompt")
        };
        assert!(!controls.thinking);
        // A request's own effort wins over the server's default.
        let mut b = body.clone();
        b["reasoning_effort"] = json!("high");
        let Prompt::Chat { controls, .. } = parse(&b, Surface::Chat, &limits).unwrap().prompt
        else {
            panic!("chat prompt")
        };
        assert_eq!(
            (controls.thinking, controls.effort),
            (true, ReasoningEffort::High)
        );
    }
}
