use super::*;

fn store() -> store::Store {
    store::Store::in_memory(1_000_000)
}
use crate::MODEL_ID;

const LIMITS: Limits = Limits {
    max_tokens: 1000,
    default_thinking: deltafin_k3::text::chat::Thinking::On(ReasoningEffort::High),
    model_aliases: &[],
};

fn parse_with(extra: Value) -> Result<(GenRequest, ResponsesMeta), ApiError> {
    let mut body = json!({"model": MODEL_ID, "input": "hi"});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    parse(
        &body,
        &LIMITS,
        &crate::seal::Sealer::ephemeral(),
        Some(&store()),
    )
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
fn defaults() {
    let (r, meta) = parse_with(json!({})).unwrap();
    assert_eq!(r.surface, Surface::Chat);
    assert_eq!(r.max_new, 1000);
    assert!(!r.stream && r.stop.is_empty() && r.logprobs.is_none());
    let c = controls(&r);
    assert!(c.thinking);
    assert_eq!(c.effort, ReasoningEffort::High);
    assert!(c.tools.is_empty() && c.response_format.is_none() && c.parallel_tool_calls);
    assert!(!meta.summary);
    assert_eq!(
        meta.echo["reasoning"],
        json!({"effort": "high", "summary": null})
    );
    assert_eq!(meta.echo["text"], json!({"format": {"type": "text"}}));
    assert_eq!(meta.echo["tool_choice"], "auto");
    assert_eq!(meta.echo["metadata"], json!({}));
    assert_eq!(
        parse_with(json!({"max_output_tokens": 5}))
            .unwrap()
            .0
            .max_new,
        5
    );
    let e = err(json!({"max_output_tokens": 5000}));
    assert!(e.message.contains("limit of 1000"), "{e}");
    // Stored by default, as OpenAI's API.
    let (_, meta) = parse_with(json!({})).unwrap();
    assert!(meta.store);
    assert_eq!(meta.echo["store"], true);
    assert!(
        err(json!({"max_output_tokens": 0}))
            .message
            .contains("positive")
    );
    assert!(
        parse(
            &json!({}),
            &LIMITS,
            &crate::seal::Sealer::ephemeral(),
            Some(&store())
        )
        .unwrap_err()
        .message
        .contains("`input` is required")
    );
    assert!(
        err(json!({"model": "gpt-5"}))
            .message
            .contains("unavailable")
    );
    assert!(parse_with(json!({"model": null})).is_ok());
}

#[test]
fn reasoning_rules() {
    let th = |r: Value| {
        let (req, meta) = parse_with(json!({"reasoning": r})).unwrap();
        let c = controls(&req);
        (c.thinking, c.effort, meta.summary)
    };
    assert!(!th(json!({"effort": "none"})).0);
    // `minimal` is below the template's lowest level: thinking off, as on chat completions.
    assert!(!th(json!({"effort": "minimal"})).0);
    assert_eq!(
        th(json!({"effort": "medium"})),
        (true, ReasoningEffort::Medium, false)
    );
    assert_eq!(
        th(json!({"effort": "xhigh"})),
        (true, ReasoningEffort::Max, false)
    );
    assert_eq!(
        th(json!({"summary": "auto"})),
        (true, ReasoningEffort::High, true)
    );
    assert_eq!(
        th(json!({"effort": "low", "summary": "detailed"})),
        (true, ReasoningEffort::Low, true)
    );
    assert!(
        err(json!({"reasoning": {"summary": "concise"}}))
            .message
            .contains("concise")
    );
    // A summary without reasoning: nothing to summarize, no item (Codex sends this).
    assert!(!th(json!({"effort": "none", "summary": "auto"})).2);
    assert!(
        err(json!({"reasoning": {"effort": "ultra"}}))
            .message
            .contains("effort")
    );
    assert!(
        err(json!({"reasoning": {"generate_summary": "auto"}}))
            .message
            .contains("`generate_summary`")
    );
    let (_, meta) = parse_with(json!({"reasoning": {"effort": "none"}})).unwrap();
    assert_eq!(meta.echo["reasoning"]["effort"], "none");
}

#[test]
fn text_formats() {
    let f = |t: Value| {
        controls(&parse_with(json!({"text": t})).unwrap().0)
            .response_format
            .clone()
    };
    assert_eq!(
        f(json!({"format": {"type": "text"}, "verbosity": "medium"})),
        None
    );
    assert_eq!(
        f(json!({"format": {"type": "json_object"}})),
        Some(ResponseFormat::JsonObject)
    );
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    assert_eq!(
        f(
            json!({"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": true}})
        ),
        Some(ResponseFormat::JsonSchema(schema))
    );
    assert!(
        err(json!({"text": {"verbosity": "low"}}))
            .message
            .contains("verbosity")
    );
    assert!(
        err(json!({"text": {"format": {"type": "json_schema", "schema": {}}}}))
            .message
            .contains("name")
    );
    assert!(
        err(json!({"text": {"format": {"type": "grammar"}}}))
            .message
            .contains("text, json_object or json_schema")
    );
}

#[test]
fn tools_and_choice() {
    let tool = json!({"type": "function", "name": "get_weather", "description": "now",
                      "parameters": {"type": "object"}, "strict": true});
    let (r, meta) = parse_with(
        json!({"tools": [tool.clone()], "tool_choice": "required", "parallel_tool_calls": false}),
    )
    .unwrap();
    let c = controls(&r);
    assert_eq!(
        c.tools,
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "description": "now",
                                                       "parameters": {"type": "object"}, "strict": true}})
        ]
    );
    assert_eq!(c.tool_mode, ToolMode::Required);
    assert!(!c.parallel_tool_calls);
    assert_eq!(meta.echo["tools"], json!([tool.clone()]));
    assert_eq!(meta.echo["parallel_tool_calls"], false);
    let (r, _) = parse_with(json!({"tools": [tool.clone()], "tool_choice": {"type": "function", "name": "get_weather"}})).unwrap();
    assert_eq!(
        controls(&r).tool_mode,
        ToolMode::Named("get_weather".into())
    );
    assert_eq!(
        controls(&parse_with(json!({"tool_choice": "none"})).unwrap().0).tool_mode,
        ToolMode::None
    );
    assert!(
        err(json!({"tools": [tool.clone()], "tool_choice": {"type": "function", "name": "x"}}))
            .message
            .contains("not one of")
    );
    assert!(
        err(json!({"tool_choice": "required"}))
            .message
            .contains("needs `tools`")
    );
    // Hosted web search is not offered to the model; other hosted tools are refused with
    // the client setting that stops sending them.
    let (r, meta) = parse_with(
        json!({"tools": [tool.clone(), {"type": "web_search", "external_web_access": false}]}),
    )
    .unwrap();
    assert_eq!(controls(&r).tools.len(), 1);
    assert_eq!(meta.echo["tools"][1]["type"], "web_search");
    assert!(
        err(json!({"tools": [{"type": "image_generation"}]}))
            .message
            .contains("Codex")
    );
    // Functions nested in a namespace are declared by their names and remember it.
    let (r, meta) = parse_with(json!({"tools": [{"type": "namespace", "name": "agents", "description": "d",
        "tools": [{"type": "function", "name": "close_agent", "parameters": {"type": "object"}}]}]}))
    .unwrap();
    assert_eq!(controls(&r).tools[0]["function"]["name"], "close_agent");
    assert_eq!(meta.namespaces["close_agent"], "agents");
    assert!(err(json!({"tools": [tool.clone(), {"type": "namespace", "name": "n", "tools": [tool.clone()]}]})).message.contains("twice"));
    assert!(
        err(json!({"tools": [{"type": "function", "name": "a b"}]}))
            .message
            .contains("letters")
    );
    assert!(
        err(json!({"tools": [tool.clone(), tool.clone()]}))
            .message
            .contains("twice")
    );
    assert!(
        err(json!({"tools": [{"type": "function", "name": "f", "defer_loading": true}]}))
            .message
            .contains("defer_loading")
    );
    assert!(
        err(json!({"tool_choice": {"type": "allowed_tools", "tools": []}}))
            .message
            .contains("not implemented")
    );
}

#[test]
fn state_and_other_refusals() {
    assert!(parse_with(json!({"store": false, "include": [], "truncation": "disabled", "background": false,
                              "user": "u", "prompt_cache_key": "k", "safety_identifier": "s",
                              "metadata": {"a": "b"}, "temperature": 0, "top_p": 1, "top_logprobs": 0,
                              "client_metadata": {"x-codex-installation-id": "i"}, "service_tier": "auto"})).is_ok());
    assert!(parse_with(json!({"store": true})).is_ok());
    let e = err(json!({"previous_response_id": "resp_1"}));
    assert!(e.message.contains("not stored here"), "{e}");
    assert_eq!(e.status, 404);
    let (_, meta) = parse_with(json!({"include": ["reasoning.encrypted_content"]})).unwrap();
    assert!(meta.encrypted_reasoning);
    assert!(
        err(json!({"include": ["message.output_text.logprobs"]}))
            .message
            .contains("chat/completions")
    );
    assert!(
        err(json!({"include": ["mystery"]}))
            .message
            .contains("mystery")
    );
    assert!(
        err(json!({"client_metadata": {"a": 1}}))
            .message
            .contains("client_metadata")
    );
    assert!(
        err(json!({"truncation": "auto"}))
            .message
            .contains("disabled")
    );
    assert!(
        err(json!({"background": true}))
            .message
            .contains("background")
    );
    assert!(
        err(json!({"top_logprobs": 3}))
            .message
            .contains("top_logprobs")
    );
    assert!(
        err(json!({"service_tier": "flex"}))
            .message
            .contains("service_tier")
    );
    assert!(
        err(json!({"max_tool_calls": 2}))
            .message
            .contains("max_tool_calls")
    );
    let (r, _) = parse_with(json!({"temperature": 0.2, "seed": 9})).unwrap();
    assert_eq!(r.sampling.map(|s| (s.temperature, s.seed)), Some((0.2, 9)));
    assert!(err(json!({"top_p": 2})).message.contains("(0, 1]"));
    assert!(
        err(json!({"metadata": {"a": 1}}))
            .message
            .contains("string values")
    );
    assert!(
        err(json!({"stream_options": {"include_obfuscation": false}}))
            .message
            .contains("requires `stream: true`")
    );
    assert!(
        parse_with(json!({"stream": true, "stream_options": {"include_obfuscation": false}}))
            .is_ok()
    );
    assert!(
        err(json!({"stream": true, "stream_options": {"include_obfuscation": true}}))
            .message
            .contains("obfuscation")
    );
    let e = err(json!({"conversation": "c"}));
    assert!(
        e.message
            .starts_with("`conversation` is not supported by Deltafin's native /v1/responses"),
        "{e}"
    );
    assert!(
        err(json!({"instructions": [1]}))
            .message
            .contains("instructions")
    );
}

#[test]
fn instructions_come_first() {
    let (r, meta) = parse_with(
        json!({"instructions": "be terse", "input": [{"role": "user", "content": "x"}]}),
    )
    .unwrap();
    let Prompt::Chat { messages, .. } = &r.prompt else {
        panic!()
    };
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0].role, "system");
    assert_eq!(meta.echo["instructions"], "be terse");
}

#[test]
fn effort_spellings_are_the_shared_ones_and_aliases_are_served() {
    for (effort, on) in [
        ("minimal", false),
        ("off", false),
        ("none", false),
        ("low", true),
        ("xhigh", true),
    ] {
        let b = json!({"model": MODEL_ID, "input": "hi", "reasoning": {"effort": effort}});
        let (r, _) = parse(
            &b,
            &LIMITS,
            &crate::seal::Sealer::ephemeral(),
            Some(&store()),
        )
        .unwrap();
        let Prompt::Chat { controls, .. } = r.prompt else {
            panic!("not a chat")
        };
        assert_eq!(controls.thinking, on, "{effort}");
    }
    let b = json!({"model": MODEL_ID, "input": "hi", "reasoning": {"effort": "huge"}});
    assert!(
        parse(
            &b,
            &LIMITS,
            &crate::seal::Sealer::ephemeral(),
            Some(&store())
        )
        .is_err()
    );
    let aliases = vec!["gpt-4o".to_string()];
    let limits = Limits {
        model_aliases: &aliases,
        ..LIMITS
    };
    assert!(
        parse(
            &json!({"model": "gpt-4o", "input": "hi"}),
            &limits,
            &crate::seal::Sealer::ephemeral(),
            Some(&store())
        )
        .is_ok()
    );
    let e = parse(
        &json!({"model": "gpt-5", "input": "hi"}),
        &limits,
        &crate::seal::Sealer::ephemeral(),
        Some(&store()),
    )
    .unwrap_err();
    assert_eq!(e.code, "model_not_found");
}
