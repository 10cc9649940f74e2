use super::*;
use crate::MODEL_ID;
use axum::http::HeaderValue;

const LIMITS: Limits = Limits {
    max_tokens: 1000,
    default_thinking: deltafin_k3::text::chat::Thinking::On(ReasoningEffort::High),
    model_aliases: &[],
};

fn parse_with(extra: Value) -> Result<(GenRequest, MessagesMeta), ApiError> {
    let mut body = json!({"model": MODEL_ID, "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    parse(&body, &LIMITS, &crate::seal::Sealer::ephemeral())
}

fn controls(r: &GenRequest) -> &ChatControls {
    match &r.prompt {
        Prompt::Chat { controls, .. } => controls,
        Prompt::Raw(_) => panic!("not a chat prompt"),
    }
}

fn err(extra: Value) -> ApiError {
    parse_with(extra).unwrap_err()
}

#[test]
fn defaults_and_budget() {
    let (r, meta) = parse_with(json!({})).unwrap();
    assert_eq!(r.surface, Surface::Chat);
    assert_eq!(r.max_new, 100);
    assert!(!r.stream && r.stop.is_empty() && r.logprobs.is_none() && meta.stops.is_empty());
    let c = controls(&r);
    // No `thinking` is no thinking, as on Anthropic's API.
    assert!(!c.thinking);
    assert!(c.tools.is_empty() && c.response_format.is_none());
    assert_eq!(c.tool_mode, ToolMode::Auto);
    // A budget above the server's limit is refused, naming the limit and the client setting.
    let e = err(json!({"max_tokens": 5000}));
    assert!(
        e.message.contains("--max-tokens 1000")
            && e.message.contains("CLAUDE_CODE_MAX_OUTPUT_TOKENS"),
        "{e}"
    );
    assert_eq!(
        parse_with(json!({"max_tokens": 1000})).unwrap().0.max_new,
        1000
    );
    assert!(
        err(json!({"max_tokens": 0}))
            .message
            .contains("prompt-cache")
    );
    assert!(
        err(json!({"max_tokens": -3}))
            .message
            .contains("positive integer")
    );
    let mut body = json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]});
    assert!(
        parse(&body, &LIMITS, &crate::seal::Sealer::ephemeral())
            .unwrap_err()
            .message
            .contains("`max_tokens` is required")
    );
    body["max_tokens"] = json!(5);
    body.as_object_mut().unwrap().remove("model");
    assert!(
        parse(&body, &LIMITS, &crate::seal::Sealer::ephemeral())
            .unwrap_err()
            .message
            .contains("`model` is required")
    );
    assert!(
        err(json!({"model": "claude-sonnet-4-5"}))
            .message
            .contains("unavailable")
    );
}

#[test]
fn thinking_rules() {
    let wide = Limits {
        max_tokens: 100_000,
        ..LIMITS
    };
    let on = |t: Value| {
        let body = json!({"model": MODEL_ID, "max_tokens": 100_000, "thinking": t,
                          "messages": [{"role": "user", "content": "hi"}]});
        let (r, _) = parse(&body, &wide, &crate::seal::Sealer::ephemeral()).unwrap();
        let c = controls(&r);
        (c.thinking, c.effort)
    };
    assert_eq!(
        on(json!({"type": "enabled", "budget_tokens": 1024})),
        (true, ReasoningEffort::Low)
    );
    assert_eq!(
        on(json!({"type": "enabled", "budget_tokens": 4096})),
        (true, ReasoningEffort::Medium)
    );
    assert_eq!(
        on(json!({"type": "enabled", "budget_tokens": 20000})),
        (true, ReasoningEffort::High)
    );
    assert_eq!(
        on(json!({"type": "enabled", "budget_tokens": 32768})),
        (true, ReasoningEffort::Max)
    );
    assert_eq!(
        on(json!({"type": "adaptive", "display": "summarized"})),
        (true, ReasoningEffort::High)
    );
    assert!(!on(json!({"type": "disabled"})).0);
    let e = err(json!({"thinking": {"type": "enabled", "budget_tokens": 100}}));
    assert!(e.message.contains(">= 1024"), "{e}");
    let e =
        err(json!({"max_tokens": 1000, "thinking": {"type": "enabled", "budget_tokens": 1024}}));
    assert!(e.message.contains("less than `max_tokens`"), "{e}");
    assert!(
        err(json!({"thinking": {"type": "enabled"}}))
            .message
            .contains("budget_tokens")
    );
    assert!(
        err(json!({"thinking": {"type": "between_tools"}}))
            .message
            .contains("not implemented")
    );
    let (_, meta) =
        parse_with(json!({"thinking": {"type": "adaptive", "display": "omitted"}})).unwrap();
    assert!(meta.omit_thinking);
    assert!(
        err(json!({"thinking": {"type": "adaptive", "display": "hidden"}}))
            .message
            .contains("omitted")
    );
    assert!(
        err(json!({"thinking": {"type": "disabled", "budget_tokens": 2000}}))
            .message
            .contains("`budget_tokens`")
    );
    let adaptive = json!({"type": "adaptive"});
    let (r, _) =
        parse_with(json!({"thinking": adaptive, "output_config": {"effort": "medium"}})).unwrap();
    assert_eq!(controls(&r).effort, ReasoningEffort::Medium);
    let (r, _) =
        parse_with(json!({"thinking": adaptive, "output_config": {"effort": "xhigh"}})).unwrap();
    assert_eq!(controls(&r).effort, ReasoningEffort::Max);
    let e = err(json!({"thinking": {"type": "disabled"}, "output_config": {"effort": "low"}}));
    assert!(e.message.contains("needs thinking"), "{e}");
    // Without `thinking` the message names what the client sent, and `high` (the default)
    // is accepted.
    let e = err(json!({"output_config": {"effort": "low"}}));
    assert!(
        e.message.contains("no `thinking`") && !e.message.contains("budget"),
        "{e}"
    );
    let (r, _) = parse_with(json!({"output_config": {"effort": "high"}})).unwrap();
    assert!(!controls(&r).thinking);
    let (r, _) = parse_with(
        json!({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}),
    )
    .unwrap();
    assert_eq!(
        controls(&r).response_format,
        Some(ResponseFormat::JsonSchema(json!({"type": "object"})))
    );
    assert!(
        err(json!({"output_config": {"format": {"type": "json_object"}}}))
            .message
            .contains("json_schema")
    );
}

#[test]
fn sampling_rules() {
    let (r, _) = parse_with(json!({"temperature": 0, "top_p": 0.5, "top_k": 40})).unwrap();
    assert_eq!(r.sampling, None);
    let (r, _) = parse_with(json!({"temperature": 0.7, "top_k": 40, "seed": 5})).unwrap();
    let s = r.sampling.unwrap();
    assert_eq!((s.temperature, s.top_k, s.seed), (0.7, 40, 5));
    assert!(err(json!({"temperature": 1.5})).message.contains("0..=1"));
    assert!(err(json!({"top_p": 0})).message.contains("(0, 1]"));
    assert!(err(json!({"top_k": 1.5})).message.contains(">= 0"));
}

#[test]
fn stops_metadata_and_unknown_fields() {
    let (r, meta) = parse_with(json!({"stop_sequences": ["a", "bc"], "stream": true})).unwrap();
    assert_eq!(r.stop, vec!["a", "bc"]);
    assert_eq!(meta.stops, r.stop);
    assert!(r.stream);
    assert!(
        err(json!({"stop_sequences": [""]}))
            .message
            .contains("non-empty")
    );
    assert!(
        err(json!({"stop_sequences": "a"}))
            .message
            .contains("array")
    );
    assert!(
        err(json!({"stop_sequences": vec!["a"; 9]}))
            .message
            .contains("at most 8")
    );
    assert!(parse_with(json!({"metadata": {"user_id": "u1"}, "service_tier": "auto", "cache_control": {"type": "ephemeral"}})).is_ok());
    assert!(
        err(json!({"metadata": {"session": 1}}))
            .message
            .contains("`session`")
    );
    assert!(
        err(json!({"service_tier": "priority"}))
            .message
            .contains("service_tier")
    );
    let e = err(json!({"container": "c"}));
    assert!(
        e.message
            .starts_with("`container` is not supported by Deltafin's native /v1/messages"),
        "{e}"
    );
    assert_eq!(e.param.as_deref(), Some("container"));
    assert!(err(json!({"stream": "yes"})).message.contains("boolean"));
    assert!(err(json!({"messages": []})).message.contains("non-empty"));
    assert!(
        parse(&json!([1]), &LIMITS, &crate::seal::Sealer::ephemeral())
            .unwrap_err()
            .message
            .contains("JSON object")
    );
}

#[test]
fn tools_and_tool_choice() {
    let weather = json!({"name": "get_weather", "description": "Weather now", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}});
    let (r, _) = parse_with(json!({"tools": [weather.clone(), {"name": "noop", "input_schema": {"type": "object"}, "type": "custom"}]})).unwrap();
    let c = controls(&r);
    assert_eq!(
        c.tools[0],
        json!({"type": "function", "function": {"name": "get_weather", "description": "Weather now",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
    );
    assert_eq!(
        c.tools[1],
        json!({"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}})
    );
    assert!(c.parallel_tool_calls);
    let mode = |choice: Value| {
        let (r, _) =
            parse_with(json!({"tools": [weather.clone()], "tool_choice": choice})).unwrap();
        let c = controls(&r);
        (c.tool_mode.clone(), c.parallel_tool_calls)
    };
    assert_eq!(mode(json!({"type": "auto"})), (ToolMode::Auto, true));
    assert_eq!(
        mode(json!({"type": "any", "disable_parallel_tool_use": true})),
        (ToolMode::Required, false)
    );
    assert_eq!(
        mode(json!({"type": "tool", "name": "get_weather"})),
        (ToolMode::Named("get_weather".into()), true)
    );
    assert_eq!(mode(json!({"type": "none"})), (ToolMode::None, true));
    let e =
        err(json!({"tools": [weather.clone()], "tool_choice": {"type": "tool", "name": "other"}}));
    assert!(e.message.contains("not one of the declared"), "{e}");
    assert!(
        err(json!({"tool_choice": {"type": "any"}}))
            .message
            .contains("needs `tools`")
    );
    assert!(err(json!({"tools": [weather.clone()], "tool_choice": {"type": "none", "disable_parallel_tool_use": true}})).message.contains("disable_parallel_tool_use"));
    assert!(
        err(json!({"tools": [weather.clone()], "tool_choice": "auto"}))
            .message
            .contains("JSON object")
    );
    let e = err(json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}));
    assert!(e.message.contains("server tool"), "{e}");
    assert!(
        err(json!({"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}))
            .message
            .contains("letters")
    );
    assert!(
        err(json!({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}))
            .message
            .contains("input_schema")
    );
    assert!(
        err(json!({"tools": [weather.clone(), weather.clone()]}))
            .message
            .contains("twice")
    );
    // A deferred tool is not declared up front.
    let (r, _) = parse_with(json!({"tools": [weather.clone(), {"name": "f", "input_schema": {"type": "object"}, "defer_loading": true}]})).unwrap();
    assert_eq!(controls(&r).tools.len(), 1);
    assert!(err(json!({"tools": [{"name": "f", "input_schema": {"type": "object"}, "defer_loading": true}]})).message.contains("up front"));
}

#[test]
fn headers() {
    let mut h = HeaderMap::new();
    assert!(check_headers(&h).is_ok());
    h.insert("anthropic-version", HeaderValue::from_static("2023-06-01"));
    h.insert("x-api-key", HeaderValue::from_static("anything"));
    assert!(check_headers(&h).is_ok());
    h.insert("anthropic-version", HeaderValue::from_static("2026-10-21"));
    assert!(check_headers(&h).is_ok());
    h.insert("anthropic-version", HeaderValue::from_static("2099-01-01"));
    assert!(
        check_headers(&h)
            .unwrap_err()
            .message
            .contains("2023-06-01")
    );
    h.insert("anthropic-version", HeaderValue::from_static("2023-06-01"));
    // Beta names are accepted: every field or block a beta unlocks is checked on its own.
    h.insert(
        "anthropic-beta",
        HeaderValue::from_static(
            "claude-code-20250219,interleaved-thinking-2025-05-14,some-future-beta-2027-01-01",
        ),
    );
    assert!(check_headers(&h).is_ok());
}

#[test]
fn messages_become_chat_messages() {
    let (r, _) =
        parse_with(json!({"system": "sys", "messages": [{"role": "user", "content": "hello"}]}))
            .unwrap();
    let Prompt::Chat { messages, .. } = &r.prompt else {
        panic!()
    };
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0].role, "system");
    assert_eq!(messages[1].role, "user");
}

#[test]
fn model_aliases_are_served() {
    let aliases = vec!["claude-sonnet-4-5".to_string()];
    let limits = Limits {
        model_aliases: &aliases,
        ..LIMITS
    };
    let body = |m: &str| json!({"model": m, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]});
    assert!(
        parse(
            &body("claude-sonnet-4-5"),
            &limits,
            &crate::seal::Sealer::ephemeral()
        )
        .is_ok()
    );
    let e = parse(
        &body("claude-opus"),
        &limits,
        &crate::seal::Sealer::ephemeral(),
    )
    .unwrap_err();
    assert_eq!(e.code, "model_not_found");
}

#[test]
fn mid_conversation_tool_changes() {
    let tool = |name: &str, deferred: bool| json!({"name": name, "input_schema": {"type": "object"}, "defer_loading": deferred});
    let with_system = |blocks: Value| {
        parse_with(json!({
            "tools": [tool("Read", false), tool("Grep", true)],
            "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": blocks}]
        }))
    };
    // A reference to a deferred tool loads it at that place (the dynamic declaration).
    let (r, _) = with_system(json!([
        {"type": "text", "text": "Grep is available now."},
        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "Grep"}}
    ]))
    .unwrap();
    let Prompt::Chat { messages, controls } = &r.prompt else {
        panic!()
    };
    assert_eq!(controls.tools.len(), 1);
    let loaded = messages.last().unwrap();
    assert_eq!(loaded.role, "system");
    assert_eq!(loaded.tools[0]["function"]["name"], "Grep");
    assert_eq!(messages[messages.len() - 2].role, "system");
    // An inline definition is declared as it is.
    let (r, _) = with_system(
        json!([{"type": "tool_addition", "tool": {"type": "tool_definition",
        "definition": {"name": "Fetch", "description": "d", "input_schema": {"type": "object"}}}}]),
    )
    .unwrap();
    let Prompt::Chat { messages, .. } = &r.prompt else {
        panic!()
    };
    assert_eq!(
        messages.last().unwrap().tools[0]["function"]["name"],
        "Fetch"
    );
    // What the template cannot express is refused by name.
    let e = with_system(
        json!([{"type": "tool_removal", "tool": {"type": "tool_reference", "name": "Read"}}]),
    )
    .unwrap_err();
    assert!(e.message.contains("tool_removal"), "{e}");
    let e = with_system(
        json!([{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "Nope"}}]),
    )
    .unwrap_err();
    assert!(
        e.message.contains("is not one of the request's `tools`"),
        "{e}"
    );
    // Adding a tool that was declared up front adds nothing: the prompt is the one without
    // the block.
    let (with, _) = with_system(
        json!([{"type": "text", "text": "Read is here."}, {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "Read"}}]),
    )
    .unwrap();
    let (without, _) = with_system(json!([{"type": "text", "text": "Read is here."}])).unwrap();
    assert_eq!(
        format!("{:?}", with.prompt),
        format!("{:?}", without.prompt)
    );
    let e = with_system(json!([{"type": "tool_addition", "tool": {"type": "mcp_tool_reference", "server_name": "s", "name": "t"}}])).unwrap_err();
    assert!(e.message.contains("mcp_tool_reference"), "{e}");
}
