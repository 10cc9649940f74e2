//! `tools`, `tool_choice` and `parallel_tool_calls` of a chat request (docs/SERVER.md
//! "Tool calling"), validated as strictly as OpenAI does: function tools only, names of 1…64
//! characters `[A-Za-z0-9_-]`, declared once, `parameters` a JSON object, no unknown key.

use crate::error::ApiError;
use serde_json::{Map, Value};

/// `tool_choice`, as the client asked it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ToolMode {
    /// `auto` (the default when tools are declared): the model decides.
    #[default]
    Auto,
    /// `none`: the model must not call tools.
    None,
    /// `required`: the model must call at least one tool.
    Required,
    /// `{"type":"function","function":{"name":…}}`: the model must call this tool.
    Named(String),
}

/// The validated tool fields of one request.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct ToolFields {
    /// The declared tools as they are rendered (`null` members left out).
    pub tools: Vec<Value>,
    /// `tool_choice`.
    pub mode: ToolMode,
    /// `parallel_tool_calls` (default true).
    pub parallel: bool,
}

/// Longest function name OpenAI accepts.
pub const MAX_TOOL_NAME_CHARS: usize = 64;

fn unsupported_key(path: &str) -> ApiError {
    ApiError::invalid_param(
        path,
        format!(
            "`{path}` is not supported by Deltafin's native /v1/chat/completions endpoint; refusing to silently ignore it"
        ),
    )
}

/// Whether `name` is 1…64 characters of `A-Z a-z 0-9 _ -`.
pub fn valid_tool_name(name: &str) -> bool {
    (1..=MAX_TOOL_NAME_CHARS).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The members of `obj` that are not `null`, each of which must be in `allowed`.
fn members(
    obj: &Map<String, Value>,
    path: &str,
    allowed: &[&str],
) -> Result<Map<String, Value>, ApiError> {
    let mut out = Map::new();
    for (key, value) in obj {
        if !allowed.contains(&key.as_str()) {
            return Err(unsupported_key(&format!("{path}.{key}")));
        }
        if !value.is_null() {
            out.insert(key.clone(), value.clone());
        }
    }
    Ok(out)
}

/// One `tools[i]`: `{"type":"function","function":{"name","description"?,"parameters"?,
/// "strict"?}}`; returns it as rendered and its name.
fn parse_tool(i: usize, tool: &Value) -> Result<(Value, String), ApiError> {
    let path = format!("tools[{i}]");
    let obj = tool
        .as_object()
        .ok_or_else(|| ApiError::invalid_param(&path, format!("`{path}` must be a JSON object")))?;
    let mut tool = members(obj, &path, &["type", "function"])?;
    match tool.get("type") {
        Some(Value::String(t)) if t == "function" => {}
        None => {
            return Err(ApiError::invalid_param(
                &format!("{path}.type"),
                format!("`{path}.type` is required and must be \"function\""),
            ));
        }
        Some(other) => {
            return Err(ApiError::invalid_param(
                &format!("{path}.type"),
                format!(
                    "`{path}.type` {other} is not implemented by native Deltafin; only \"function\" tools are"
                ),
            ));
        }
    }
    let fpath = format!("{path}.function");
    let function = match tool.get("function") {
        Some(Value::Object(f)) => {
            members(f, &fpath, &["name", "description", "parameters", "strict"])?
        }
        None => {
            return Err(ApiError::invalid_param(
                &fpath,
                format!("`{fpath}` is required"),
            ));
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                &fpath,
                format!("`{fpath}` must be a JSON object"),
            ));
        }
    };
    let name = match function.get("name") {
        Some(Value::String(n)) if valid_tool_name(n) => n.clone(),
        Some(Value::String(n)) => {
            return Err(ApiError::invalid_param(
                &format!("{fpath}.name"),
                format!(
                    "`{fpath}.name` {n:?} must be 1 to {MAX_TOOL_NAME_CHARS} characters of a-z, A-Z, 0-9, underscores and dashes"
                ),
            ));
        }
        None => {
            return Err(ApiError::invalid_param(
                &format!("{fpath}.name"),
                format!("`{fpath}.name` is required"),
            ));
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                &format!("{fpath}.name"),
                format!("`{fpath}.name` must be a JSON string"),
            ));
        }
    };
    let check = |key: &str, ok: fn(&Value) -> bool, what: &str| match function.get(key) {
        Some(v) if !ok(v) => Err(ApiError::invalid_param(
            &format!("{fpath}.{key}"),
            format!("`{fpath}.{key}` must be {what}"),
        )),
        _ => Ok(()),
    };
    check("description", Value::is_string, "a JSON string")?;
    check(
        "parameters",
        Value::is_object,
        "a JSON object (a JSON Schema)",
    )?;
    check("strict", Value::is_boolean, "a boolean")?;
    tool.insert("function".into(), Value::Object(function));
    Ok((Value::Object(tool), name))
}

/// `tool_choice` against the declared `names`.
fn parse_choice(v: Option<&Value>, names: &[String]) -> Result<ToolMode, ApiError> {
    let shape = "`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\":\"function\",\"function\":{\"name\":\"…\"}}";
    let needs_tools = |what: &str| {
        ApiError::invalid_param(
            "tool_choice",
            format!("`tool_choice` {what} is only allowed when `tools` are specified"),
        )
    };
    let mode = match v {
        None => return Ok(ToolMode::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "none" => return Ok(ToolMode::None),
            "auto" => return Ok(ToolMode::Auto),
            "required" if names.is_empty() => return Err(needs_tools("\"required\"")),
            "required" => return Ok(ToolMode::Required),
            _ => return Err(ApiError::invalid_param("tool_choice", shape)),
        },
        Some(Value::Object(obj)) => obj,
        Some(_) => return Err(ApiError::invalid_param("tool_choice", shape)),
    };
    let obj = members(mode, "tool_choice", &["type", "function"])?;
    match obj.get("type") {
        Some(Value::String(t)) if t == "function" => {}
        Some(Value::String(t)) => {
            return Err(ApiError::invalid_param(
                "tool_choice",
                format!(
                    "`tool_choice` of type {t:?} is not implemented by native Deltafin; {shape}"
                ),
            ));
        }
        _ => return Err(ApiError::invalid_param("tool_choice", shape)),
    }
    let function = match obj.get("function") {
        Some(Value::Object(f)) => members(f, "tool_choice.function", &["name"])?,
        _ => return Err(ApiError::invalid_param("tool_choice", shape)),
    };
    let Some(Value::String(name)) = function.get("name") else {
        return Err(ApiError::invalid_param(
            "tool_choice",
            "`tool_choice.function.name` must be a JSON string",
        ));
    };
    if names.is_empty() {
        return Err(needs_tools(&format!("naming function `{name}`")));
    }
    if !names.contains(name) {
        return Err(ApiError::invalid_param(
            "tool_choice",
            format!("`tool_choice` names function `{name}`, which is not declared in `tools`"),
        ));
    }
    Ok(ToolMode::Named(name.clone()))
}

/// `tools`, `tool_choice` and `parallel_tool_calls` of a chat body (`null` = absent).
pub(super) fn parse_tool_fields(obj: &Map<String, Value>) -> Result<ToolFields, ApiError> {
    let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let mut tools = Vec::new();
    let mut names: Vec<String> = Vec::new();
    match get("tools") {
        None => {}
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let (tool, name) = parse_tool(i, item)?;
                if names.contains(&name) {
                    return Err(ApiError::invalid_param(
                        &format!("tools[{i}].function.name"),
                        format!("function `{name}` is declared more than once in `tools`"),
                    ));
                }
                names.push(name);
                tools.push(tool);
            }
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "tools",
                "`tools` must be an array of function tools",
            ));
        }
    }
    let mode = parse_choice(get("tool_choice"), &names)?;
    let parallel = match get("parallel_tool_calls") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid_param(
                "parallel_tool_calls",
                "`parallel_tool_calls` must be a boolean",
            ));
        }
    };
    Ok(ToolFields {
        tools,
        mode,
        parallel,
    })
}

#[cfg(test)]
mod tests {
    use super::super::{ChatControls, Limits, Prompt, Surface, parse};
    use super::*;
    use deltafin_k3::text::chat::{ReasoningEffort, Thinking};
    use serde_json::json;

    const LIMITS: Limits<'static> = Limits {
        max_tokens: 100,
        default_thinking: Thinking::On(ReasoningEffort::High),
        model_aliases: &[],
    };

    fn chat(extra: Value) -> Result<ChatControls, ApiError> {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        match parse(&body, Surface::Chat, &LIMITS)?.prompt {
            Prompt::Chat { controls, .. } => Ok(controls),
            Prompt::Raw(_) => unreachable!(),
        }
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {
            "name": "get_weather", "description": "Weather.", "strict": true,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
    }

    fn err(extra: Value) -> ApiError {
        chat(extra).unwrap_err()
    }

    #[test]
    fn tools_are_kept_as_rendered() {
        let c = chat(json!({"tools": [weather(), {"type": "function",
            "function": {"name": "noop-2", "description": null, "parameters": null}}]}))
        .unwrap();
        assert_eq!(c.tools[0], weather());
        // `null` members are absent.
        assert_eq!(
            c.tools[1],
            json!({"type": "function", "function": {"name": "noop-2"}})
        );
        assert_eq!(c.tool_mode, ToolMode::Auto);
        assert!(c.parallel_tool_calls);
        assert_eq!(
            chat(json!({"tools": null})).unwrap().tools,
            Vec::<Value>::new()
        );
        assert_eq!(
            chat(json!({"tools": []})).unwrap().tools,
            Vec::<Value>::new()
        );
    }

    #[test]
    fn bad_tools_are_refused_by_path() {
        let cases = [
            (json!("x"), "tools", "must be an array"),
            (json!([1]), "tools[0]", "must be a JSON object"),
            (
                json!([{"function": {"name": "a"}}]),
                "tools[0].type",
                "is required",
            ),
            (
                json!([{"type": "custom", "custom": {}}]),
                "tools[0].custom",
                "is not supported",
            ),
            (
                json!([{"type": "web_search", "function": {"name": "a"}}]),
                "tools[0].type",
                "only \"function\" tools",
            ),
            (
                json!([{"type": "function"}]),
                "tools[0].function",
                "is required",
            ),
            (
                json!([{"type": "function", "function": {"name": "a", "examples": []}}]),
                "tools[0].function.examples",
                "refusing to silently ignore it",
            ),
            (
                json!([{"type": "function", "function": {"description": "d"}}]),
                "tools[0].function.name",
                "is required",
            ),
            (
                json!([{"type": "function", "function": {"name": "has space"}}]),
                "tools[0].function.name",
                "1 to 64 characters",
            ),
            (
                json!([{"type": "function", "function": {"name": ""}}]),
                "tools[0].function.name",
                "1 to 64 characters",
            ),
            (
                json!([{"type": "function", "function": {"name": "a".repeat(65)}}]),
                "tools[0].function.name",
                "1 to 64 characters",
            ),
            (
                json!([{"type": "function", "function": {"name": "a", "parameters": "{}"}}]),
                "tools[0].function.parameters",
                "a JSON object",
            ),
            (
                json!([{"type": "function", "function": {"name": "a", "strict": "yes"}}]),
                "tools[0].function.strict",
                "a boolean",
            ),
            (
                json!([{"type": "function", "function": {"name": "a", "description": 1}}]),
                "tools[0].function.description",
                "a JSON string",
            ),
            (
                json!([weather(), weather()]),
                "tools[1].function.name",
                "declared more than once",
            ),
        ];
        for (tools, param, fragment) in cases {
            let e = err(json!({ "tools": tools }));
            assert_eq!(e.status, 400);
            assert_eq!(e.param.as_deref(), Some(param), "{tools}: {e}");
            assert!(e.message.contains(fragment), "{tools}: {e}");
        }
        assert!(valid_tool_name(&"A-z_9".repeat(13)[..64]));
        assert!(!valid_tool_name("é"));
    }

    #[test]
    fn tool_choice_rules() {
        let with = |choice: Value| chat(json!({"tools": [weather()], "tool_choice": choice}));
        assert_eq!(with(json!("auto")).unwrap().tool_mode, ToolMode::Auto);
        assert_eq!(with(json!("none")).unwrap().tool_mode, ToolMode::None);
        assert_eq!(
            with(json!("required")).unwrap().tool_mode,
            ToolMode::Required
        );
        assert_eq!(
            with(json!({"type": "function", "function": {"name": "get_weather"}}))
                .unwrap()
                .tool_mode,
            ToolMode::Named("get_weather".into())
        );
        // `none` and `auto` need no tools; `required` and a named function do.
        assert_eq!(
            chat(json!({"tool_choice": "none"})).unwrap().tool_mode,
            ToolMode::None
        );
        assert_eq!(
            chat(json!({"tool_choice": "auto"})).unwrap().tool_mode,
            ToolMode::Auto
        );
        for choice in [
            json!("required"),
            json!({"type": "function", "function": {"name": "get_weather"}}),
        ] {
            let e = err(json!({ "tool_choice": choice }));
            assert_eq!(e.param.as_deref(), Some("tool_choice"));
            assert!(
                e.message
                    .contains("only allowed when `tools` are specified"),
                "{e}"
            );
        }
        let cases = [
            (json!("sometimes"), "must be \"none\""),
            (json!(3), "must be \"none\""),
            (
                json!({"type": "function", "function": {"name": "other"}}),
                "not declared in `tools`",
            ),
            (
                json!({"type": "allowed_tools", "allowed_tools": {}}),
                "`tool_choice.allowed_tools` is not supported",
            ),
            (
                json!({"type": "custom"}),
                "type \"custom\" is not implemented",
            ),
            (
                json!({"type": "function", "function": {"name": "get_weather", "x": 1}}),
                "`tool_choice.function.x` is not supported",
            ),
            (
                json!({"type": "function", "function": {}}),
                "must be a JSON string",
            ),
            (
                json!({"function": {"name": "get_weather"}}),
                "must be \"none\"",
            ),
        ];
        for (choice, fragment) in cases {
            let e = with(choice.clone()).unwrap_err();
            assert!(e.message.contains(fragment), "{choice}: {e}");
        }
    }

    #[test]
    fn parallel_tool_calls_and_thinking_together() {
        let c = chat(json!({"tools": [weather()], "parallel_tool_calls": false,
                            "reasoning_effort": "none"}))
        .unwrap();
        assert!(!c.parallel_tool_calls && !c.thinking);
        assert!(
            chat(json!({"parallel_tool_calls": null}))
                .unwrap()
                .parallel_tool_calls
        );
        let e = err(json!({"parallel_tool_calls": "no"}));
        assert_eq!(e.param.as_deref(), Some("parallel_tool_calls"));
        // Thinking on keeps the server default effort when none is asked.
        assert_eq!(chat(json!({})).unwrap().effort, ReasoningEffort::High);
        assert_eq!(
            chat(json!({"reasoning_effort": "low"})).unwrap().effort,
            ReasoningEffort::Low
        );
    }
}
