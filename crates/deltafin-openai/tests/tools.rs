//! Tool calling and thinking control end to end on the synthesized tiny checkpoint: the
//! prompt each request renders (against the renderer driven directly with the options the
//! reference gives those fields), the answer (against direct greedy generation read by the
//! assembler), streaming, and validation over HTTP.

mod common;

use common::*;
use deltafin_k3::generate::{GenerateEvent, GenerateOptions};
use deltafin_k3::text::chat::{
    ChatMessage, ChatOptions, ReasoningEffort, ToolCall, ToolChoice, encode_chat,
};
use deltafin_k3::text::tokenizer::END_OF_MSG;
use deltafin_openai::ServerConfig;
use deltafin_openai::output::{Assembler, Delta, EarlyEnd};
use deltafin_openai::request::{ChatControls, ToolMode};
use deltafin_openai::response::chat_message;
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

fn weather() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"]}}})
}

/// Direct generation from `prompt`, read by the assembler of `controls`: the message the
/// server must answer, the finish reason, and the token counts.
fn direct(prompt: &[u32], controls: &ChatControls, max_new: usize) -> (Value, &'static str) {
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
    let mut asm = Assembler::for_chat(&e.tokenizer, controls, vec![]);
    let mut d = Delta::default();
    for &id in &ids {
        d.extend(asm.push(id, None).unwrap());
        if asm.early_end().is_some() {
            break;
        }
    }
    d.extend(asm.finish().unwrap());
    let ended = ids.last() == Some(&END_OF_MSG);
    let finish = match asm.early_end() {
        Some(EarlyEnd::CallLimit) => "tool_calls",
        Some(_) => "stop",
        None if ended && asm.tool_calls() > 0 => "tool_calls",
        None if ended => "stop",
        None => "length",
    };
    (chat_message(&d), finish)
}

fn chat(body: &Value) -> Value {
    let r = post_json(server().addr, "/v1/chat/completions", body);
    let v = r.json();
    assert_eq!(r.status, 200, "{v}");
    v
}

/// The history of one agent-loop turn: the user asks, the assistant called the tool, the
/// tool answered.
fn agent_history() -> (Value, Vec<ChatMessage>) {
    let wire = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "refusal": null,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}
    ]);
    let msgs = vec![
        ChatMessage::new("user", "Weather in Paris?"),
        ChatMessage {
            role: "assistant".into(),
            tool_calls: vec![ToolCall {
                id: Some("call_1".into()),
                name: "get_weather".into(),
                arguments: "{\"city\": \"Paris\"}".into(),
            }],
            ..Default::default()
        },
        ChatMessage {
            role: "tool".into(),
            tool_call_id: Some("call_1".into()),
            content: Some(deltafin_k3::text::chat::Content::Text("Sunny, 21 C".into())),
            ..Default::default()
        },
    ];
    (wire, msgs)
}

#[test]
fn tools_and_thinking_render_as_the_reference_and_answer_exactly() {
    let tok = &engine().tokenizer;
    let user = || vec![ChatMessage::new("user", "Weather in Paris?")];
    let wire_user = json!([{"role": "user", "content": "Weather in Paris?"}]);
    let (wire_history, history) = agent_history();
    let base = ChatControls::with_effort(ReasoningEffort::Max);
    let with_tools = ChatControls {
        tools: vec![weather()],
        ..base.clone()
    };
    // (request fields, messages, options the reference renders them with, controls)
    let cases: Vec<(Value, Value, Vec<ChatMessage>, ChatOptions, ChatControls)> = vec![
        (
            json!({"reasoning_effort": "none"}),
            wire_user.clone(),
            user(),
            ChatOptions {
                thinking: false,
                ..Default::default()
            },
            ChatControls {
                thinking: false,
                ..base.clone()
            },
        ),
        (
            json!({"tools": [weather()], "reasoning_effort": "low"}),
            wire_user.clone(),
            user(),
            ChatOptions {
                tools: vec![weather()],
                effort: Some(ReasoningEffort::Low),
                ..Default::default()
            },
            with_tools.clone(),
        ),
        (
            json!({"tools": [weather()], "tool_choice": "none", "reasoning_effort": "off"}),
            wire_user.clone(),
            user(),
            ChatOptions {
                thinking: false,
                tools: vec![weather()],
                tool_choice: Some(ToolChoice::Forbidden),
                ..Default::default()
            },
            ChatControls {
                thinking: false,
                tool_mode: ToolMode::None,
                ..with_tools.clone()
            },
        ),
        (
            json!({"tool_choice": "none"}),
            wire_user.clone(),
            user(),
            ChatOptions {
                tool_choice: Some(ToolChoice::Forbidden),
                ..Default::default()
            },
            ChatControls {
                tool_mode: ToolMode::None,
                ..base.clone()
            },
        ),
        (
            json!({"tools": [weather()], "reasoning_effort": "minimal", "parallel_tool_calls": false}),
            wire_history,
            history,
            ChatOptions {
                thinking: false,
                tools: vec![weather()],
                ..Default::default()
            },
            ChatControls {
                thinking: false,
                parallel_tool_calls: false,
                ..with_tools.clone()
            },
        ),
    ];
    for (fields, wire, messages, opts, controls) in cases {
        let mut body = json!({"messages": wire, "max_tokens": 12});
        for (k, v) in fields.as_object().unwrap() {
            body[k] = v.clone();
        }
        let prompt = encode_chat(tok, &messages, &opts).unwrap();
        let (message, finish) = direct(&prompt, &controls, 12);
        let v = chat(&body);
        assert_eq!(v["usage"]["prompt_tokens"], prompt.len(), "{fields}");
        assert_eq!(v["choices"][0]["message"], message, "{fields}");
        assert_eq!(v["choices"][0]["finish_reason"], finish, "{fields}");
        if !controls.thinking {
            assert_eq!(
                v["usage"]["completion_tokens_details"]["reasoning_tokens"],
                0
            );
            assert_eq!(v["choices"][0]["message"]["reasoning_content"], "");
        }
        // Streaming gives the same answer.
        body["stream"] = json!(true);
        let r = post_json(server().addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200);
        let frames: Vec<Value> = r
            .sse()
            .iter()
            .filter(|p| *p != "[DONE]")
            .map(|p| serde_json::from_str(p).unwrap())
            .collect();
        let text = |key: &str| -> String {
            frames
                .iter()
                .filter_map(|f| f["choices"][0]["delta"][key].as_str())
                .collect()
        };
        let content = message["content"].as_str().unwrap_or("");
        assert_eq!(text("content"), content, "{fields}");
        assert_eq!(
            text("reasoning_content"),
            message["reasoning_content"],
            "{fields}"
        );
        assert_eq!(
            frames.last().unwrap()["choices"][0]["finish_reason"],
            finish,
            "{fields}"
        );
    }
}

#[test]
fn tool_fields_are_validated_over_http() {
    let a = server().addr;
    let msgs = json!([{"role": "user", "content": "x"}]);
    let cases = [
        (
            json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]}),
            "tools[0].function.params",
        ),
        (json!({"reasoning_effort": "ultra"}), "reasoning_effort"),
        (json!({"parallel_tool_calls": 1}), "parallel_tool_calls"),
    ];
    for (fields, param) in cases {
        let mut body = json!({"messages": msgs});
        for (k, v) in fields.as_object().unwrap() {
            body[k] = v.clone();
        }
        let e = post_json(a, "/v1/chat/completions", &body).error(400);
        assert_eq!(e["param"], param, "{fields}: {e}");
        assert_eq!(e["type"], "invalid_request_error");
    }
    // Tool-call history that names an undeclared tool is fine (it is history).
    let (wire, _) = agent_history();
    let body = json!({"messages": wire, "max_tokens": 1});
    assert_eq!(post_json(a, "/v1/chat/completions", &body).status, 200);
}

/// A tool whose only argument is an enum, so a forced call is short under any weights.
fn unit_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather", "description": "Current weather.",
        "parameters": {"type": "object", "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"], "additionalProperties": false}}})
}

#[test]
fn forced_calls_have_the_openai_shape() {
    let a = server().addr;
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    for (choice, parallel) in [(named, true), (json!("required"), false)] {
        let body = json!({
            "messages": [{"role": "user", "content": "Weather?"}], "tools": [unit_tool()],
            "tool_choice": choice, "parallel_tool_calls": parallel, "reasoning_effort": "none",
            "max_tokens": 900, "logprobs": true,
        });
        let v = chat(&body);
        let c = &v["choices"][0];
        assert_eq!(
            c["finish_reason"], "tool_calls",
            "{}",
            c["message"]["tool_calls"]
        );
        let m = &c["message"];
        let calls = m["tool_calls"].as_array().expect("tool_calls");
        assert!(!calls.is_empty());
        if !parallel {
            assert_eq!(calls.len(), 1, "{m}");
        }
        for call in calls {
            assert_eq!(call["type"], "function");
            assert!(call["id"].as_str().unwrap().starts_with("call_"));
            assert_eq!(call["function"]["name"], "get_weather");
            let args: Value =
                serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            assert!(
                args == json!({"unit": "celsius"}) || args == json!({"unit": "fahrenheit"}),
                "{args}"
            );
        }
        // Content is null when empty; its logprobs cover exactly its text (tool tokens have none).
        let content = m["content"].as_str().unwrap_or("");
        assert!(!m["content"].is_null() || content.is_empty());
        let bytes: Vec<u8> = c["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|e| e["bytes"].as_array().unwrap().clone())
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(bytes, content.as_bytes());
        // Streaming: the first entry of a call carries id, type, name and empty arguments; the
        // rest carry argument text only; together they are the non-streaming calls.
        let mut sbody = body.clone();
        sbody["stream"] = json!(true);
        let r = post_json(a, "/v1/chat/completions", &sbody);
        let frames: Vec<Value> = r
            .sse()
            .iter()
            .filter(|p| *p != "[DONE]")
            .map(|p| serde_json::from_str(p).unwrap())
            .collect();
        let mut streamed: Vec<(String, String, String)> = Vec::new();
        for f in &frames {
            for entry in f["choices"][0]["delta"]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
            {
                let i = entry["index"].as_u64().unwrap() as usize;
                if i == streamed.len() {
                    assert_eq!(entry["type"], "function", "{entry}");
                    assert_eq!(entry["function"]["arguments"], "", "{entry}");
                    streamed.push((
                        entry["id"].as_str().unwrap().into(),
                        entry["function"]["name"].as_str().unwrap().into(),
                        String::new(),
                    ));
                } else {
                    assert_eq!(i + 1, streamed.len(), "{entry}");
                    assert!(entry.get("id").is_none() && entry["function"].get("name").is_none());
                    streamed[i].2 += entry["function"]["arguments"].as_str().unwrap();
                }
            }
        }
        assert_eq!(streamed.len(), calls.len());
        for ((id, name, args), call) in streamed.iter().zip(calls) {
            assert!(id.starts_with("call_") && id != call["id"].as_str().unwrap());
            assert_eq!(name, call["function"]["name"].as_str().unwrap());
            assert_eq!(args, call["function"]["arguments"].as_str().unwrap());
        }
        assert_eq!(
            frames.last().unwrap()["choices"][0]["finish_reason"],
            "tool_calls"
        );
    }
}
