//! `/v1/messages` (Anthropic) and `/v1/responses` (OpenAI Responses) end to end on the
//! synthesized tiny checkpoint: the same tokens as `/v1/chat/completions` and as direct
//! generation, event streams that rebuild the non-streamed answer, history with tool
//! blocks, and refusals in each API's error shape.

mod common;

use common::*;
use deltafin_k3::generate::{GenerateEvent, GenerateOptions};
use deltafin_k3::text::chat::{
    ChatMessage, ChatOptions, Content, ReasoningEffort, ToolCall, encode_chat,
};
use deltafin_k3::text::tokenizer::END_OF_MSG;
use deltafin_openai::MODEL_ID;
use deltafin_openai::ServerConfig;
use deltafin_openai::messages::wire::signature;
use deltafin_openai::output::{Assembler, Delta};
use deltafin_spec::generate;
use serde_json::{Value, json};
use std::sync::OnceLock;
use std::sync::atomic::AtomicBool;

fn server() -> &'static TestServer {
    static S: OnceLock<TestServer> = OnceLock::new();
    shared_server(
        &S,
        ServerConfig {
            queue: 64,
            ..any_port()
        },
    )
}

/// What direct greedy generation releases from `prompt` (thinking on): the text, the
/// completion token count.
fn direct(prompt: &[u32], max_new: usize) -> (Delta, usize) {
    let e = engine();
    let opts = GenerateOptions {
        max_new: Some(max_new),
        stop_ids: vec![END_OF_MSG],
        max_context: e.max_context,
        top_logits: 0,
    };
    let mut ids = Vec::new();
    generate(&e.model, prompt, &opts, &AtomicBool::new(false), |ev| {
        if let GenerateEvent::Token { id, .. } = ev {
            ids.push(id);
        }
        Ok(())
    })
    .unwrap();
    let mut asm = Assembler::new(&e.tokenizer, true, vec![]);
    let mut d = Delta::default();
    for &id in &ids {
        d.extend(asm.push(id, None).unwrap());
    }
    d.extend(asm.finish().unwrap());
    let n = ids.len() - usize::from(ids.last() == Some(&END_OF_MSG));
    (d, n)
}

fn encode(messages: &[ChatMessage]) -> Vec<u32> {
    let opts = ChatOptions {
        effort: Some(ReasoningEffort::Max),
        ..Default::default()
    };
    encode_chat(&engine().tokenizer, messages, &opts).unwrap()
}

fn post(path: &str, body: &Value, headers: &[(&str, &str)]) -> Resp {
    let mut h = vec![("Content-Type", "application/json")];
    h.extend_from_slice(headers);
    raw(
        server().addr,
        &request_bytes("POST", path, body.to_string().as_bytes(), &h),
    )
}

/// `event:` / `data:` pairs of an SSE body; each data's `type` equals its event name.
fn typed_events(r: &Resp) -> Vec<(String, Value)> {
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        r.header("content-type"),
        Some("text/event-stream; charset=utf-8")
    );
    let text = String::from_utf8(r.body.clone()).unwrap();
    text.split("\n\n")
        // Comment frames (`: prefill D/T`) carry progress, not events.
        .filter(|b| !b.is_empty() && !b.starts_with(':'))
        .map(|block| {
            let (head, data) = block.split_once('\n').unwrap();
            let name = head.strip_prefix("event: ").unwrap().to_string();
            let v: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(v["type"], name.as_str(), "{block}");
            (name, v)
        })
        .collect()
}

/// An Anthropic-shaped error with the contract's headers; returns the inner error.
fn anthropic_error(r: &Resp, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        r.header("content-type"),
        Some("application/json; charset=utf-8")
    );
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
    assert!(
        v["error"]["message"].is_string() && v["error"]["type"].is_string(),
        "{v}"
    );
    v["error"].clone()
}

fn chat_reference(text: &str, max_tokens: usize) -> Value {
    let r = post_json(
        server().addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}),
    );
    assert_eq!(r.status, 200);
    r.json()
}

/// A Messages request thinking at `max`, the effort chat completions use by default here.
fn message_body(text: &str, max_tokens: usize) -> Value {
    json!({"model": MODEL_ID, "max_tokens": max_tokens, "messages": [{"role": "user", "content": text}],
           "thinking": {"type": "adaptive"}, "output_config": {"effort": "max"}})
}

#[test]
fn messages_answer_equals_chat_completions() {
    let chat = chat_reference("Hello", 12);
    let r = post(
        "/v1/messages",
        &message_body("Hello", 12),
        &[("anthropic-version", "2023-06-01"), ("x-api-key", "k")],
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("msg_"), "{v}");
    assert_eq!(
        (v["type"].as_str(), v["role"].as_str(), v["model"].as_str()),
        (Some("message"), Some("assistant"), Some(MODEL_ID))
    );
    let m = &chat["choices"][0]["message"];
    let (reasoning, content) = (
        m["reasoning_content"].as_str().unwrap(),
        m["content"].as_str().unwrap(),
    );
    let mut want = Vec::new();
    if !reasoning.is_empty() {
        // The signature seals the reasoning's ids (docs/SERVER.md "Reasoning round trips").
        let sig = v["content"][0]["signature"].as_str().unwrap_or_default();
        assert!(sig.starts_with(deltafin_openai::seal::PREFIX), "{v}");
        want.push(json!({"type": "thinking", "thinking": reasoning, "signature": sig}));
    }
    if !content.is_empty() {
        want.push(json!({"type": "text", "text": content}));
    }
    assert_eq!(v["content"], Value::Array(want));
    let stop = match chat["choices"][0]["finish_reason"].as_str().unwrap() {
        "stop" => "end_turn",
        _ => "max_tokens",
    };
    assert_eq!(v["stop_reason"], stop);
    assert_eq!(v["stop_sequence"], Value::Null);
    let u = &v["usage"];
    assert_eq!(u["input_tokens"], chat["usage"]["prompt_tokens"]);
    assert_eq!(u["output_tokens"], chat["usage"]["completion_tokens"]);
    assert_eq!(
        u["output_tokens_details"]["thinking_tokens"],
        chat["usage"]["completion_tokens_details"]["reasoning_tokens"]
    );
    assert_eq!(
        u["input_tokens"],
        encode(&[ChatMessage::new("user", "Hello")]).len()
    );
}

/// Rebuilds content blocks from Messages events, checking their grammar.
fn accumulate_messages(evs: &[(String, Value)]) -> (Vec<Value>, Value) {
    assert_eq!(evs[0].0, "message_start");
    assert_eq!(evs[1].0, "ping");
    assert_eq!(evs[evs.len() - 1].0, "message_stop");
    let delta = &evs[evs.len() - 2];
    assert_eq!(delta.0, "message_delta");
    let mut blocks: Vec<Value> = Vec::new();
    let mut open = false;
    for (name, v) in &evs[2..evs.len() - 2] {
        match name.as_str() {
            // Anthropic's keep-alive, also sent while the prompt is prefilled.
            "ping" => {}
            "content_block_start" => {
                assert!(!open, "a block started before the last one stopped");
                assert_eq!(v["index"], blocks.len());
                blocks.push(v["content_block"].clone());
                open = true;
            }
            "content_block_delta" => {
                assert!(open);
                assert_eq!(v["index"], blocks.len() - 1);
                let b = blocks.last_mut().unwrap();
                let d = &v["delta"];
                match d["type"].as_str().unwrap() {
                    "text_delta" => {
                        b["text"] = format!(
                            "{}{}",
                            b["text"].as_str().unwrap(),
                            d["text"].as_str().unwrap()
                        )
                        .into()
                    }
                    "thinking_delta" => {
                        b["thinking"] = format!(
                            "{}{}",
                            b["thinking"].as_str().unwrap(),
                            d["thinking"].as_str().unwrap()
                        )
                        .into()
                    }
                    "signature_delta" => b["signature"] = d["signature"].clone(),
                    other => panic!("unexpected delta {other}"),
                }
            }
            "content_block_stop" => {
                assert!(open);
                open = false;
            }
            other => panic!("unexpected event {other}"),
        }
    }
    assert!(!open);
    (blocks, delta.1.clone())
}

#[test]
fn messages_stream_rebuilds_the_answer() {
    let body = message_body("Stream me", 10);
    let full = post("/v1/messages", &body, &[]).json();
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let evs = typed_events(&post("/v1/messages", &sbody, &[]));
    let start = &evs[0].1["message"];
    assert!(start["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["stop_reason"], Value::Null);
    assert_eq!(
        start["usage"]["input_tokens"],
        full["usage"]["input_tokens"]
    );
    let (blocks, delta) = accumulate_messages(&evs);
    assert_eq!(Value::Array(blocks), full["content"]);
    assert_eq!(delta["delta"]["stop_reason"], full["stop_reason"]);
    assert_eq!(delta["usage"], full["usage"]);
}

#[test]
fn messages_history_with_tool_blocks_renders_like_chat() {
    let sig = signature("check the weather");
    let body = json!({
        "model": MODEL_ID, "max_tokens": 6, "system": [{"type": "text", "text": "You are terse."}],
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "max"},
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "check the weather", "signature": sig},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "And tomorrow?"}
            ]}
        ]
    });
    let v = post("/v1/messages", &body, &[]).json();
    let msgs = [
        ChatMessage {
            role: "system".into(),
            content: Some(Content::Parts(vec!["You are terse.".into()])),
            ..Default::default()
        },
        ChatMessage {
            role: "user".into(),
            content: Some(Content::Parts(vec!["Weather in Paris?".into()])),
            ..Default::default()
        },
        ChatMessage {
            role: "assistant".into(),
            reasoning_content: Some("check the weather".into()),
            tool_calls: vec![ToolCall {
                id: Some("toolu_1".into()),
                name: "get_weather".into(),
                arguments: "{\"city\":\"Paris\"}".into(),
            }],
            ..Default::default()
        },
        ChatMessage {
            role: "tool".into(),
            content: Some(Content::Parts(vec!["sunny".into()])),
            tool: Some("get_weather".into()),
            tool_call_id: Some("toolu_1".into()),
            ..Default::default()
        },
        ChatMessage {
            role: "user".into(),
            content: Some(Content::Parts(vec!["And tomorrow?".into()])),
            ..Default::default()
        },
    ];
    let ids = encode(&msgs);
    assert_eq!(v["usage"]["input_tokens"], ids.len(), "{v}");
    let (d, n) = direct(&ids, 6);
    assert_eq!(v["usage"]["output_tokens"], n);
    let thinking = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["type"] == "thinking");
    assert_eq!(
        thinking.map_or("", |b| b["thinking"].as_str().unwrap()),
        d.reasoning
    );
    // A changed thinking block is refused.
    let mut forged = body.clone();
    forged["messages"][1]["content"][0]["thinking"] = json!("something else");
    let e = anthropic_error(&post("/v1/messages", &forged, &[]), 400);
    assert!(e["message"].as_str().unwrap().contains("signature"), "{e}");
}

#[test]
fn messages_stop_sequences_report_the_match() {
    // Thinking off: the answer is response text, the channel stop sequences apply to.
    let mut body = message_body("Tell me a story", 24);
    body["thinking"] = json!({"type": "disabled"});
    body.as_object_mut().unwrap().remove("output_config");
    let full = post("/v1/messages", &body, &[]).json();
    let block = &full["content"][0];
    let key = if block["type"] == "thinking" {
        "thinking"
    } else {
        "text"
    };
    let text = block[key].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(
        chars.len() >= 6,
        "the tiny model wrote too little to cut: {full}"
    );
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let cut = &text[..text.find(&stop).unwrap()];
    body["stop_sequences"] = json!(["\u{0}never", stop]);
    let v = post("/v1/messages", &body, &[]).json();
    assert_eq!(v["stop_reason"], "stop_sequence", "{v}");
    assert_eq!(v["stop_sequence"], stop.as_str());
    let got = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["type"] == block["type"])
        .map_or("", |b| b[key].as_str().unwrap());
    assert_eq!(got, cut);
    body["stream"] = json!(true);
    let evs = typed_events(&post("/v1/messages", &body, &[]));
    let (blocks, delta) = accumulate_messages(&evs);
    assert_eq!(Value::Array(blocks), v["content"]);
    assert_eq!(
        delta["delta"],
        json!({"stop_reason": "stop_sequence", "stop_sequence": stop})
    );
}

#[test]
fn messages_refusals_are_anthropic_shaped() {
    let e = anthropic_error(
        &post(
            "/v1/messages",
            &json!({"model": MODEL_ID, "max_tokens": 5, "messages": [], "frob": 1}),
            &[],
        ),
        400,
    );
    assert_eq!(e["type"], "invalid_request_error");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .starts_with("`frob` is not supported"),
        "{e}"
    );
    let e = anthropic_error(
        &raw(
            server().addr,
            &request_bytes("POST", "/v1/messages", b"{nope", &[]),
        ),
        400,
    );
    assert_eq!(e["message"], "request body must be valid JSON");
    // Beta names are accepted (what a beta unlocks is checked field by field).
    let r = post(
        "/v1/messages",
        &message_body("x", 5),
        &[("anthropic-beta", "claude-code-20250219,tools-2024-04-04")],
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let e = anthropic_error(
        &post(
            "/v1/messages",
            &message_body("x", 5),
            &[("anthropic-version", "2020-01-01")],
        ),
        400,
    );
    assert!(e["message"].as_str().unwrap().contains("2023-06-01"), "{e}");
    let mut sampled = message_body("x", 5);
    sampled["temperature"] = json!(1.5);
    let e = anthropic_error(&post("/v1/messages", &sampled, &[]), 400);
    assert!(e["message"].as_str().unwrap().contains("0..=1"), "{e}");
    let e = anthropic_error(&get(server().addr, "/v1/messages"), 405);
    assert_eq!(e["type"], "invalid_request_error");
    // A prompt past the context is a 400 before generation.
    let long = "word ".repeat(engine().max_context + 10);
    let e = anthropic_error(&post("/v1/messages", &message_body(&long, 5), &[]), 400);
    assert!(e["message"].as_str().unwrap().contains("context"), "{e}");
}

fn response_body(input: Value, max: usize) -> Value {
    json!({"model": MODEL_ID, "input": input, "max_output_tokens": max, "store": false})
}

#[test]
fn responses_answer_equals_chat_completions() {
    let chat = chat_reference("Hello", 12);
    let r = post(
        "/v1/responses",
        &response_body(json!("Hello"), 12),
        &[("authorization", "Bearer k")],
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("resp_"), "{v}");
    assert_eq!(v["object"], "response");
    assert_eq!(v["model"], MODEL_ID);
    let m = &chat["choices"][0]["message"];
    let out = v["output"].as_array().unwrap();
    let reasoning = out.iter().find(|i| i["type"] == "reasoning");
    let message = out.iter().find(|i| i["type"] == "message");
    assert_eq!(
        reasoning.map_or("", |i| i["content"][0]["text"].as_str().unwrap()),
        m["reasoning_content"]
    );
    assert_eq!(
        message.map_or("", |i| i["content"][0]["text"].as_str().unwrap()),
        m["content"]
    );
    let (status, incomplete) = match chat["choices"][0]["finish_reason"].as_str().unwrap() {
        "stop" => ("completed", Value::Null),
        _ => ("incomplete", json!({"reason": "max_output_tokens"})),
    };
    assert_eq!(v["status"], status);
    assert_eq!(v["incomplete_details"], incomplete);
    let u = &v["usage"];
    assert_eq!(u["input_tokens"], chat["usage"]["prompt_tokens"]);
    assert_eq!(u["output_tokens"], chat["usage"]["completion_tokens"]);
    assert_eq!(u["total_tokens"], chat["usage"]["total_tokens"]);
    assert_eq!(
        u["output_tokens_details"]["reasoning_tokens"],
        chat["usage"]["completion_tokens_details"]["reasoning_tokens"]
    );
    assert_eq!(v["max_output_tokens"], 12);
    assert_eq!(v["store"], false);
}

#[test]
fn responses_stream_rebuilds_the_answer() {
    let body = response_body(json!("Stream me"), 10);
    let full = post("/v1/responses", &body, &[]).json();
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let evs = typed_events(&post("/v1/responses", &sbody, &[]));
    for (i, (_, v)) in evs.iter().enumerate() {
        assert_eq!(v["sequence_number"], i);
    }
    assert_eq!(evs[0].0, "response.created");
    assert_eq!(evs[1].0, "response.in_progress");
    assert_eq!(evs[0].1["response"]["status"], "in_progress");
    let (last, done) = evs.last().unwrap();
    assert_eq!(
        last,
        if full["status"] == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        }
    );
    let mut done = done["response"].clone();
    // Only the id and the creation time differ from the non-streamed response.
    done["id"] = full["id"].clone();
    done["created_at"] = full["created_at"].clone();
    let fix = |out: &Value| {
        let mut o = out.clone();
        for item in o.as_array_mut().unwrap() {
            item["id"] = json!("");
        }
        o
    };
    assert_eq!(fix(&done["output"]), fix(&full["output"]));
    done["output"] = full["output"].clone();
    assert_eq!(done, full);
    // The deltas add up to the items' texts.
    let text: String = evs
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, v)| v["delta"].as_str().unwrap())
        .collect();
    let message = full["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "message");
    assert_eq!(
        text,
        message.map_or("", |i| i["content"][0]["text"].as_str().unwrap())
    );
    let reasoning: String = evs
        .iter()
        .filter(|(n, _)| n == "response.reasoning_text.delta")
        .map(|(_, v)| v["delta"].as_str().unwrap())
        .collect();
    let item = full["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "reasoning");
    assert_eq!(
        reasoning,
        item.map_or("", |i| i["content"][0]["text"].as_str().unwrap())
    );
}

#[test]
fn responses_history_with_function_calls_renders_like_chat() {
    let input = json!([
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    ]);
    let mut body = response_body(input, 6);
    body["instructions"] = json!("You are terse.");
    let v = post("/v1/responses", &body, &[]).json();
    let msgs = [
        ChatMessage::new("system", "You are terse."),
        ChatMessage {
            role: "user".into(),
            content: Some(Content::Parts(vec!["Weather in Paris?".into()])),
            ..Default::default()
        },
        ChatMessage {
            role: "assistant".into(),
            tool_calls: vec![ToolCall {
                id: Some("call_1".into()),
                name: "get_weather".into(),
                arguments: "{\"city\":\"Paris\"}".into(),
            }],
            ..Default::default()
        },
        ChatMessage {
            role: "tool".into(),
            content: Some(Content::Parts(vec!["sunny".into()])),
            tool: Some("get_weather".into()),
            tool_call_id: Some("call_1".into()),
            ..Default::default()
        },
    ];
    let ids = encode(&msgs);
    assert_eq!(v["usage"]["input_tokens"], ids.len(), "{v}");
    let (d, n) = direct(&ids, 6);
    assert_eq!(v["usage"]["output_tokens"], n);
    let reasoning = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "reasoning");
    assert_eq!(
        reasoning.map_or("", |i| i["content"][0]["text"].as_str().unwrap()),
        d.reasoning
    );
    assert_eq!(v["instructions"], "You are terse.");
}

#[test]
fn responses_refusals_are_openai_shaped() {
    let mut b = response_body(json!("x"), 5);
    b["previous_response_id"] = json!("resp_1");
    let e = post("/v1/responses", &b, &[]).error(404);
    assert_eq!(e["param"], "previous_response_id");
    b = response_body(json!("x"), 5);
    b["tools"] = json!([{"type": "image_generation"}]);
    assert_eq!(
        post("/v1/responses", &b, &[]).error(400)["param"],
        "tools[0]"
    );
    assert_eq!(
        get(server().addr, "/v1/responses").error(405)["type"],
        "method_not_allowed"
    );
    let e = post("/responses", &json!({"input": "x", "frob": 1}), &[]).error(400);
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .starts_with("`frob` is not supported by Deltafin's native /v1/responses"),
        "{e}"
    );
}
