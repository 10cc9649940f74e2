//! Chat requests render exactly as the reference renders the same conversation and options:
//! golden conversations of tests/fixtures/chat/goldens.json (NeMo AutoModel's K3 encoder)
//! sent as OpenAI request bodies (`tools`, `tool_choice`, `reasoning_effort`), parsed and
//! rendered by the server's own path ([`deltafin_openai::engine::chat_options`]).

use deltafin_k3::text::chat::{ReasoningEffort, Thinking, encode_chat};
use deltafin_k3::text::tokenizer::Tokenizer;
use deltafin_openai::engine::chat_options;
use deltafin_openai::request::{Limits, Prompt, Surface, parse};
use serde_json::{Value, json};
use std::path::Path;

/// Cases whose messages and options an OpenAI request can carry.
const CASES: &[&str] = &[
    "user_hello_nothink",
    "user_hello_default_effort",
    "effort_low",
    "effort_medium",
    "effort_high",
    "tools_declared",
    "tools_declared_nothink",
    "tool_calls_two_parallel_in_order",
    "tool_choice_required",
    "tool_choice_required_nothink",
    "tool_choice_none",
    "tool_choice_named",
    "tool_choice_named_nothink",
    "tool_choice_none_without_tools",
    "agent_loop_second_turn",
    "agent_loop_second_turn_nothink",
];

#[test]
fn requests_render_like_the_reference() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let tok = Tokenizer::from_dir(&Path::new(root).join("assets/kimi")).unwrap();
    let doc: Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(root).join("tests/fixtures/chat/goldens.json")).unwrap(),
    )
    .unwrap();
    let limits = Limits {
        max_tokens: 16,
        default_thinking: Thinking::On(ReasoningEffort::Max),
        model_aliases: &[],
    };
    let mut seen = 0;
    for case in doc["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        if !CASES.contains(&name) {
            continue;
        }
        seen += 1;
        let o = &case["options"];
        assert_eq!(o["add_generation_prompt"], true, "{name}");
        assert!(o["response_format"].is_null(), "{name}");
        let mut body = json!({"messages": case["messages"], "tools": o["tools"]});
        if !o["tool_choice"].is_null() {
            body["tool_choice"] = o["tool_choice"].clone();
        }
        body["reasoning_effort"] = match (o["thinking"].as_bool().unwrap(), &o["effort"]) {
            (false, _) => json!("none"),
            (true, Value::Null) => Value::Null,
            (true, effort) => effort.clone(),
        };
        let req = parse(&body, Surface::Chat, &limits).unwrap_or_else(|e| panic!("{name}: {e}"));
        let Prompt::Chat { messages, controls } = req.prompt else {
            panic!("{name}: not a chat prompt")
        };
        let ids = encode_chat(&tok, &messages, &chat_options(&controls)).unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            ids,
            want,
            "{name}: ours {:?}\nwant {:?}",
            tok.decode(&ids),
            tok.decode(&want)
        );
    }
    assert_eq!(
        seen,
        CASES.len(),
        "a listed case is missing from the fixture"
    );
}
