//! Size limits of a parsed request (docs/SERVER.md "Limits"): conversations, tool calls,
//! tools and stop sequences beyond them are 400s naming the field, on every endpoint.

mod common;

use common::*;
use serde_json::{Value, json};
use std::sync::OnceLock;

fn server() -> &'static TestServer {
    static S: OnceLock<TestServer> = OnceLock::new();
    shared_server(&S, any_port())
}

fn refused(path: &str, body: &Value, param: &str, words: &str) {
    let r = post_json(server().addr, path, body);
    let e = r.error(400);
    assert_eq!(e["param"], param, "{e}");
    assert!(e["message"].as_str().unwrap().contains(words), "{e}");
}

#[test]
fn oversized_conversations_are_refused_with_the_field() {
    let msgs: Vec<Value> = (0..65_537)
        .map(|_| json!({"role": "user", "content": "x"}))
        .collect();
    refused(
        "/v1/chat/completions",
        &json!({"messages": msgs}),
        "messages",
        "at most 65536",
    );
    let calls: Vec<Value> = (0..1025)
        .map(|i| {
            json!({"id": format!("c{i}"), "type": "function",
                        "function": {"name": "f", "arguments": "{}"}})
        })
        .collect();
    let body = json!({"messages": [{"role": "user", "content": "x"},
                                   {"role": "assistant", "content": null, "tool_calls": calls},
                                   {"role": "user", "content": "y"}]});
    refused("/v1/chat/completions", &body, "messages", "at most 1024");
    let tools: Vec<Value> = (0..1025)
        .map(|i| json!({"type": "function", "function": {"name": format!("f{i}"), "parameters": {"type": "object"}}}))
        .collect();
    let body = json!({"messages": [{"role": "user", "content": "x"}], "tools": tools});
    refused("/v1/chat/completions", &body, "tools", "at most 1024");
    let long = "s".repeat(1025);
    refused(
        "/v1/completions",
        &json!({"prompt": "x", "stop": [long]}),
        "stop",
        "at most 1024",
    );
    // The Messages API is held to the same limits.
    let msgs: Vec<Value> = (0..65_537)
        .map(|i| json!({"role": if i % 2 == 0 {"user"} else {"assistant"}, "content": "x"}))
        .collect();
    let r = post_json(
        server().addr,
        "/v1/messages",
        &json!({"model": "deltafin-kimi-k3", "max_tokens": 1, "messages": msgs}),
    );
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    // Below the limits requests are served: results answered out of order are matched to
    // their calls.
    let calls: Vec<Value> = (0..32)
        .map(|i| {
            json!({"id": format!("c{i}"), "type": "function",
                        "function": {"name": "f", "arguments": "{}"}})
        })
        .collect();
    let mut msgs = vec![
        json!({"role": "user", "content": "x"}),
        json!({"role": "assistant", "content": null, "tool_calls": calls}),
    ];
    msgs.extend(
        (0..32)
            .rev()
            .map(|i| json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": "ok"})),
    );
    let r = post_json(
        server().addr,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 1, "reasoning_effort": "none"}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

/// Under a memory budget the admitted context is the plan's: a longer prompt is a 400 that
/// names it, before any generation starts.
#[test]
fn the_memory_plan_bounds_the_admitted_context() {
    let root = model_root().to_path_buf();
    let s = TestServer::start_with(any_port(), move || {
        let loaded = deltafin_k3::engine::EngineBuilder::new(&root)
            .memory_budget(Some(500_000_000))
            .context_tokens(Some(40))
            .build()
            .map_err(|e| e.to_string())?;
        let plan = loaded.plan.clone().ok_or("no plan")?;
        assert_eq!(loaded.admitted_context(), plan.context_tokens);
        assert_eq!(plan.context_tokens, 40);
        Ok(deltafin_openai::Engine::from_loaded(loaded, None).with_memo(0, 0))
    });
    s.wait_ready();
    let before = started(&s.stats);
    let prompt: String = (0..60).map(|i| format!("w{i} ")).collect();
    let e = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1}),
    )
    .error(400);
    assert_eq!(e["code"], "context_length_exceeded");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("admits 40 positions"),
        "{e}"
    );
    assert_eq!(started(&s.stats), before);
    let ok = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "w1 w2", "max_tokens": 100}),
    );
    let v = ok.json();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(v["usage"]["total_tokens"].as_u64().unwrap() <= 41);
}
