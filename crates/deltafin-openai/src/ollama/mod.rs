//! The Ollama API that many local tools speak (Open WebUI, Continue, editors): `/api/chat`
//! and `/api/generate` on the same engine, streamed as JSON lines (Ollama's default) or as
//! one body, and the listings `/api/tags`, `/api/show`, `/api/version`, `/api/ps`
//! ([`routes`]). What deltafin cannot do (embeddings, pulling or creating models, images) is
//! refused by name. Requests are validated as strictly as every other endpoint: an option
//! that would change the answer in a way deltafin cannot reproduce is refused, a setting that
//! asks nothing of generation (`keep_alive`, the runner's thread and GPU knobs) is accepted
//! (docs/SERVER.md "Ollama API").

pub mod reply;
pub mod routes;

use crate::error::ApiError;
use crate::request::{ChatControls, GenRequest, Limits, MULTIMODAL, Prompt, Surface, ToolMode};
use crate::strict::{bad, known_fields, object, only_keys, string};
use deltafin_k3::text::chat::{
    ChatMessage, Content, ReasoningEffort, ResponseFormat, Thinking, ToolCall,
};
use serde_json::{Map, Value, json};

/// The endpoint names used in messages.
const CHAT: &str = "/api/chat";
const GENERATE: &str = "/api/generate";

/// The Ollama API version whose endpoints and fields are implemented (`/api/version`).
pub const API_VERSION: &str = "0.12.6";

/// What the reply needs from the request.
#[derive(Clone, Debug, PartialEq)]
pub struct OllamaMeta {
    /// `/api/chat` (a `message` per chunk) or `/api/generate` (a `response` string).
    pub chat: bool,
    /// The model name as the client gave it (echoed).
    pub model: String,
    /// `options.num_ctx`: the context this request may fill (prompt and answer).
    pub num_ctx: Option<usize>,
}

/// `{"error": "…"}`, Ollama's error body.
pub fn error_body(e: &ApiError) -> Value {
    json!({"error": e.message})
}

/// Whether `name` names the model, in Ollama's spelling too (`name:latest`).
pub fn served(name: &str, aliases: &[String]) -> bool {
    let base = name.strip_suffix(":latest").unwrap_or(name);
    crate::models::is_served(base, aliases)
}

const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "tools",
    "format",
    "options",
    "stream",
    "keep_alive",
    "think",
];
const GENERATE_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "suffix",
    "images",
    "format",
    "options",
    "system",
    "template",
    "stream",
    "raw",
    "keep_alive",
    "context",
    "think",
];

/// Options that only tune the runner (threads, batching, memory mapping, GPU layers): they
/// change no answer.
const RUNNER_OPTIONS: &[&str] = &[
    "num_batch",
    "num_gpu",
    "main_gpu",
    "low_vram",
    "f16_kv",
    "logits_all",
    "vocab_only",
    "use_mmap",
    "use_mlock",
    "num_thread",
    "numa",
    "num_keep",
    "repeat_last_n",
];

/// Sampling options that must keep their neutral value (deltafin implements no penalties).
const NEUTRAL_OPTIONS: &[(&str, f64)] = &[
    ("repeat_penalty", 1.0),
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("mirostat", 0.0),
    ("typical_p", 1.0),
    ("tfs_z", 1.0),
];

/// Validates an `/api/chat` (`chat`) or `/api/generate` body and translates it.
pub fn parse(
    body: &Value,
    chat: bool,
    limits: &Limits,
) -> Result<(GenRequest, OllamaMeta), ApiError> {
    let obj = body
        .as_object()
        .ok_or_else(|| ApiError::invalid("request body must be a JSON object"))?;
    let (fields, endpoint) = if chat {
        (CHAT_FIELDS, CHAT)
    } else {
        (GENERATE_FIELDS, GENERATE)
    };
    known_fields(obj, fields, endpoint)?;
    let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let model = string(obj, "model", "model", "the request")?;
    if !served(model, limits.model_aliases) {
        return Err(ApiError::model_not_found(model, limits.model_aliases));
    }
    let stream = match get("stream") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("stream", "`stream` must be a boolean")),
    };
    // keep_alive asks how long the model stays loaded: deltafin's stays loaded while the
    // server runs, whatever it says.
    if let Some(k) = get("keep_alive")
        && !(k.is_string() || k.is_number())
    {
        return Err(bad(
            "keep_alive",
            "`keep_alive` must be a duration string or a number of seconds",
        ));
    }
    let opts = Options::parse(get("options"), limits)?;
    let thinking = think(get("think"), limits.default_thinking)?;
    let response_format = format(get("format"))?;
    let (tools, tool_mode) = if chat {
        (tools(get("tools"))?, ToolMode::Auto)
    } else {
        (Vec::new(), ToolMode::None)
    };

    let prompt = if chat {
        let messages = match get("messages") {
            Some(Value::Array(items)) if !items.is_empty() => items,
            _ => return Err(bad("messages", "`messages` must be a non-empty array")),
        };
        let mut out = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            out.push(message(i, m)?);
        }
        if out.last().is_some_and(|m| m.role == "assistant") {
            return Err(bad(
                "messages",
                "a final assistant message (prefill) is not implemented: K3's template always opens a new assistant message; end with a user or tool message",
            ));
        }
        chat_prompt(out, thinking, tools, tool_mode, response_format)
    } else {
        generate_prompt(obj, thinking, response_format)?
    };
    let req = GenRequest {
        surface: if matches!(prompt, Prompt::Raw(_)) {
            Surface::Completions
        } else {
            Surface::Chat
        },
        prompt,
        max_new: opts.max_new,
        stream,
        include_usage: false,
        stop: opts.stop,
        logprobs: None,
        sampling: opts.sampling,
    };
    let meta = OllamaMeta {
        chat,
        model: model.to_string(),
        num_ctx: opts.num_ctx,
    };
    Ok((req, meta))
}

fn chat_prompt(
    messages: Vec<ChatMessage>,
    thinking: Thinking,
    tools: Vec<Value>,
    tool_mode: ToolMode,
    response_format: Option<ResponseFormat>,
) -> Prompt {
    Prompt::Chat {
        messages,
        controls: ChatControls {
            thinking: thinking.is_on(),
            effort: thinking.effort().unwrap_or(ReasoningEffort::Max),
            tools,
            tool_mode,
            parallel_tool_calls: true,
            response_format,
        },
    }
}

/// `/api/generate`: `raw: true` is the prompt as it is (a completion); otherwise the
/// template renders `system` and `prompt` as one user turn, as Ollama does.
fn generate_prompt(
    obj: &Map<String, Value>,
    thinking: Thinking,
    response_format: Option<ResponseFormat>,
) -> Result<Prompt, ApiError> {
    let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
    for key in ["template", "context"] {
        if get(key).is_some() {
            return Err(bad(
                key,
                format!(
                    "`{key}` is not implemented: K3's chat template is fixed, and Deltafin keeps conversations as messages (use /api/chat)"
                ),
            ));
        }
    }
    if get("images").is_some_and(|i| i.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(bad("images", MULTIMODAL));
    }
    if get("suffix").is_some_and(|s| s != "") {
        return Err(bad(
            "suffix",
            "`suffix` (fill-in-the-middle) is not implemented: K3 has no infill template",
        ));
    }
    let prompt = match get("prompt") {
        Some(Value::String(p)) if !p.is_empty() => p.clone(),
        Some(Value::String(_)) | None => {
            return Err(bad(
                "prompt",
                "`prompt` must be a non-empty string (Ollama's empty prompt only loads the model; Deltafin's is always loaded)",
            ));
        }
        Some(_) => return Err(bad("prompt", "`prompt` must be a string")),
    };
    let system = match get("system") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(bad("system", "`system` must be a string")),
    };
    let raw = match get("raw") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("raw", "`raw` must be a boolean")),
    };
    if raw {
        if system.is_some() || response_format.is_some() || get("think").is_some() {
            return Err(bad(
                "raw",
                "`raw: true` takes the prompt as it is: `system`, `format` and `think` need the template",
            ));
        }
        return Ok(Prompt::Raw(prompt));
    }
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(ChatMessage::new("system", &s));
    }
    messages.push(ChatMessage::new("user", &prompt));
    Ok(chat_prompt(
        messages,
        thinking,
        Vec::new(),
        ToolMode::None,
        response_format,
    ))
}

/// `think`: `true`/`false`, or `low`/`medium`/`high` (absent: the server's default).
fn think(v: Option<&Value>, default: Thinking) -> Result<Thinking, ApiError> {
    match v {
        None => Ok(default),
        Some(Value::Bool(false)) => Ok(Thinking::Off),
        Some(Value::Bool(true)) => Ok(match default {
            Thinking::Off => Thinking::On(ReasoningEffort::Max),
            on => on,
        }),
        Some(Value::String(s)) => match s.as_str() {
            "low" => Ok(Thinking::On(ReasoningEffort::Low)),
            "medium" => Ok(Thinking::On(ReasoningEffort::Medium)),
            "high" => Ok(Thinking::On(ReasoningEffort::High)),
            _ => Err(bad(
                "think",
                "`think` must be true, false, \"low\", \"medium\" or \"high\"",
            )),
        },
        Some(_) => Err(bad(
            "think",
            "`think` must be true, false, \"low\", \"medium\" or \"high\"",
        )),
    }
}

/// `format`: `"json"` or a JSON schema, enforced by constrained decoding.
fn format(v: Option<&Value>) -> Result<Option<ResponseFormat>, ApiError> {
    match v {
        None => Ok(None),
        Some(Value::String(s)) if s == "json" => Ok(Some(ResponseFormat::JsonObject)),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(s @ Value::Object(_)) => Ok(Some(ResponseFormat::JsonSchema(s.clone()))),
        Some(_) => Err(bad(
            "format",
            "`format` must be \"json\" or a JSON schema object",
        )),
    }
}

/// Function tools in the OpenAI shape Ollama takes.
fn tools(v: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    let Some(v) = v else { return Ok(Vec::new()) };
    let items = v
        .as_array()
        .ok_or_else(|| bad("tools", "`tools` must be an array"))?;
    let mut out = Vec::with_capacity(items.len());
    for (i, t) in items.iter().enumerate() {
        let p = format!("tools[{i}]");
        let obj = object(t, &p, "every tool")?;
        only_keys(obj, &["type", "function"], &p, "a tool", CHAT)?;
        if obj.get("type").is_some_and(|t| t != "function") {
            return Err(bad(&p, "only `function` tools are implemented"));
        }
        let f = object(
            obj.get("function").unwrap_or(&Value::Null),
            &p,
            "a tool's `function`",
        )?;
        only_keys(
            f,
            &["name", "description", "parameters"],
            &p,
            "a function",
            CHAT,
        )?;
        let name = string(f, "name", &p, "a function")?;
        if !crate::request::valid_tool_name(name) {
            return Err(bad(
                &p,
                format!("function name {name:?} must be 1 to 64 letters, digits, `_` or `-`"),
            ));
        }
        if out.iter().any(|t: &Value| t["function"]["name"] == name) {
            return Err(bad(&p, format!("function name {name:?} is declared twice")));
        }
        let mut function = f.clone();
        function.retain(|_, v| !v.is_null());
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(out)
}

/// One `/api/chat` message.
fn message(i: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let p = format!("messages[{i}]");
    let obj = object(m, &p, "every message")?;
    only_keys(
        obj,
        &[
            "role",
            "content",
            "thinking",
            "images",
            "tool_calls",
            "tool_name",
        ],
        &p,
        "a message",
        CHAT,
    )?;
    if obj
        .get("images")
        .is_some_and(|i| i.as_array().is_none_or(|a| !a.is_empty()))
    {
        return Err(bad(&p, MULTIMODAL));
    }
    let role = string(obj, "role", &p, "every message")?;
    let content = match obj.get("content") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(Content::Text(s.clone())),
        Some(_) => return Err(bad(&p, "message `content` must be a string")),
    };
    let opt = |key: &str| -> Result<Option<String>, ApiError> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(bad(&p, format!("message `{key}` must be a string"))),
        }
    };
    let mut msg = ChatMessage {
        content,
        ..Default::default()
    };
    match role {
        "system" | "user" => {
            for key in ["thinking", "tool_calls", "tool_name"] {
                if obj.get(key).is_some_and(|v| !v.is_null()) {
                    return Err(bad(
                        &p,
                        format!("`{key}` belongs to another role, not `{role}`"),
                    ));
                }
            }
        }
        "assistant" => {
            msg.reasoning_content = opt("thinking")?;
            if let Some(calls) = obj.get("tool_calls").filter(|c| !c.is_null()) {
                let calls = calls
                    .as_array()
                    .ok_or_else(|| bad(&p, "`tool_calls` must be an array"))?;
                for (k, c) in calls.iter().enumerate() {
                    let pk = format!("{p}.tool_calls[{k}]");
                    let c = object(c, &pk, "a tool call")?;
                    only_keys(
                        c,
                        &["function", "id", "type", "index"],
                        &pk,
                        "a tool call",
                        CHAT,
                    )?;
                    let f = object(
                        c.get("function").unwrap_or(&Value::Null),
                        &pk,
                        "a call's `function`",
                    )?;
                    only_keys(
                        f,
                        &["name", "arguments", "index"],
                        &pk,
                        "a call's function",
                        CHAT,
                    )?;
                    let name = string(f, "name", &pk, "a call's function")?;
                    let arguments = match f.get("arguments") {
                        None | Some(Value::Null) => "{}".to_string(),
                        Some(v @ Value::Object(_)) => v.to_string(),
                        // Some clients send the OpenAI spelling: a JSON text of an object.
                        Some(Value::String(s))
                            if matches!(serde_json::from_str(s), Ok(Value::Object(_))) =>
                        {
                            s.clone()
                        }
                        Some(_) => return Err(bad(&pk, "tool call `arguments` must be an object")),
                    };
                    let id = match c.get("id") {
                        None | Some(Value::Null) => None,
                        Some(Value::String(s)) => Some(s.clone()),
                        Some(_) => return Err(bad(&pk, "tool call `id` must be a string")),
                    };
                    msg.tool_calls.push(ToolCall {
                        id,
                        name: name.to_string(),
                        arguments,
                    });
                }
            }
        }
        "tool" => msg.tool = opt("tool_name")?,
        other => {
            return Err(bad(
                &p,
                format!(
                    "unsupported message role `{other}`; {CHAT} takes system, user, assistant and tool messages"
                ),
            ));
        }
    }
    msg.role = role.to_string();
    Ok(msg)
}

/// What `options` asks for.
struct Options {
    max_new: usize,
    stop: Vec<String>,
    sampling: Option<deltafin_k3::sampling::Sampling>,
    num_ctx: Option<usize>,
}

impl Options {
    fn parse(v: Option<&Value>, limits: &Limits) -> Result<Options, ApiError> {
        const P: &str = "options";
        let empty = Map::new();
        let obj = match v {
            None => &empty,
            Some(v) => object(v, P, "`options`")?,
        };
        let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
        const SAMPLING: &[&str] = &["temperature", "top_p", "top_k", "min_p", "seed"];
        for (k, val) in obj {
            let known = SAMPLING.contains(&k.as_str())
                || RUNNER_OPTIONS.contains(&k.as_str())
                || ["num_predict", "num_ctx", "stop"].contains(&k.as_str());
            if let Some((_, neutral)) = NEUTRAL_OPTIONS.iter().find(|(n, _)| n == k) {
                if val.as_f64() != Some(*neutral) && !val.is_null() {
                    return Err(bad(
                        P,
                        format!(
                            "`options.{k}` other than {neutral} is not implemented: Deltafin samples K3's own distribution with temperature, top_k, top_p and min_p only"
                        ),
                    ));
                }
            } else if !known {
                return Err(bad(
                    P,
                    format!(
                        "`options.{k}` is not an option Deltafin implements; refusing to silently ignore it"
                    ),
                ));
            }
        }
        let sampling = crate::request::parse_sampling(|k| get(k), 2.0).map_err(|e| ApiError {
            param: Some(P.into()),
            ..e
        })?;
        let max_new = match get("num_predict") {
            None => limits.max_tokens,
            Some(v) => match v.as_i64() {
                // -1: no limit, -2: until the context is full (the server's limit still holds).
                Some(-1 | -2) => limits.max_tokens,
                Some(n) if n > 0 => {
                    crate::request::within_server_limit("options.num_predict", n as u64, limits)?
                }
                _ => {
                    return Err(bad(
                        P,
                        "`options.num_predict` must be a positive integer, -1 or -2",
                    ));
                }
            },
        };
        let num_ctx = match get("num_ctx") {
            None => None,
            Some(v) => Some(
                v.as_u64()
                    .filter(|n| *n > 0)
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| bad(P, "`options.num_ctx` must be a positive integer"))?,
            ),
        };
        let stop = match get("stop") {
            None => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|s| match s.as_str() {
                    Some(s) if !s.is_empty() => Ok(s.to_string()),
                    _ => Err(bad(P, "`options.stop` must hold non-empty strings")),
                })
                .collect::<Result<_, _>>()?,
            Some(Value::String(s)) if !s.is_empty() => vec![s.clone()],
            Some(_) => return Err(bad(P, "`options.stop` must be an array of strings")),
        };
        Ok(Options {
            max_new,
            stop,
            sampling,
            num_ctx,
        })
    }
}

/// An RFC 3339 UTC timestamp with nanoseconds (Ollama's `created_at`).
pub fn timestamp(t: std::time::SystemTime) -> String {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_nanos()
    )
}

#[cfg(test)]
mod tests;
