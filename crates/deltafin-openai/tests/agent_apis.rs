//! What the coding agents need of each API, end to end on the synthesized tiny checkpoint:
//! reasoning sent back restores the exact tokens K3 wrote (Responses `encrypted_content`,
//! Messages `signature`), stored responses and `previous_response_id` (surviving a restart),
//! `count_tokens`, Claude Code's billing block kept out of the prompt, deferred tools loaded
//! by `tool_reference`, `context_management`, the request log, and the Ollama API.

mod common;

use common::*;
use deltafin_k3::generate::{GenerateEvent, GenerateOptions};
use deltafin_k3::text::chat::{ChatMessage, ChatOptions, Content, ReasoningEffort, encode_chat};
use deltafin_k3::text::tokenizer::END_OF_MSG;
use deltafin_openai::output::{Assembler, Delta};
use deltafin_openai::{MODEL_ID, ServerConfig};
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

fn post(path: &str, body: &Value) -> Resp {
    post_json(server().addr, path, body)
}

/// What greedy generation from `prompt` releases (thinking on), as the server's assembler
/// sees it: the text, the reasoning's ids, the completion token count.
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

fn encode(messages: &[ChatMessage], effort: ReasoningEffort) -> Vec<u32> {
    let opts = ChatOptions {
        effort: Some(effort),
        ..Default::default()
    };
    encode_chat(&engine().tokenizer, messages, &opts).unwrap()
}

fn parts(text: &str) -> Option<Content> {
    Some(Content::Parts(vec![text.to_string()]))
}

/// The conversation of a second turn: `user`, the first answer (its reasoning as `ids`, its
/// content), then `again`.
fn second_turn(user: &str, ids: &[u32], content: &str, again: &str) -> Vec<ChatMessage> {
    vec![
        ChatMessage {
            role: "user".into(),
            content: parts(user),
            ..Default::default()
        },
        ChatMessage {
            role: "assistant".into(),
            content: (!content.is_empty()).then(|| Content::Parts(vec![content.to_string()])),
            reasoning_ids: Some(ids.to_vec()),
            ..Default::default()
        },
        ChatMessage {
            role: "user".into(),
            content: parts(again),
            ..Default::default()
        },
    ]
}

#[test]
fn responses_encrypted_reasoning_restores_the_exact_tokens() {
    let first = json!({"model": MODEL_ID, "input": "Hi", "max_output_tokens": 8, "store": false,
                       "reasoning": {"effort": "max"}, "include": ["reasoning.encrypted_content"]});
    let v = post("/v1/responses", &first).json();
    let prompt = encode(
        &[ChatMessage {
            role: "user".into(),
            content: parts("Hi"),
            ..Default::default()
        }],
        ReasoningEffort::Max,
    );
    let (d, _) = direct(&prompt, 8);
    assert!(
        !d.reasoning_ids.is_empty(),
        "the tiny model reasons first: {d:?}"
    );
    let output = v["output"].as_array().unwrap().clone();
    let item = output
        .iter()
        .find(|i| i["type"] == "reasoning")
        .expect("a reasoning item");
    assert!(
        item["encrypted_content"]
            .as_str()
            .unwrap()
            .starts_with("dfr1."),
        "{item}"
    );
    // Sent back with its text replaced: the sealed ids are what renders.
    let mut tampered = item.clone();
    tampered["content"] = json!([{"type": "reasoning_text", "text": "something else entirely"}]);
    let mut input = vec![json!({"role": "user", "content": "Hi"}), tampered];
    input.extend(output.iter().filter(|i| i["type"] != "reasoning").cloned());
    input.push(json!({"role": "user", "content": "More"}));
    let second = json!({"model": MODEL_ID, "input": input, "max_output_tokens": 6, "store": false,
                        "reasoning": {"effort": "max"}});
    let v2 = post("/v1/responses", &second).json();
    let want = encode(
        &second_turn("Hi", &d.reasoning_ids, &d.content, "More"),
        ReasoningEffort::Max,
    );
    assert_eq!(v2["usage"]["input_tokens"], want.len(), "{v2}");
    let (d2, n2) = direct(&want, 6);
    assert_eq!(v2["usage"]["output_tokens"], n2);
    let text: String = v2["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "reasoning")
        .map(|i| {
            i["content"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(text, d2.reasoning);
    // A token from another server (another key) is refused by name.
    let mut forged = second.clone();
    forged["input"][1]["encrypted_content"] =
        json!(deltafin_openai::seal::Sealer::ephemeral().seal(&[1, 2]));
    let e = post("/v1/responses", &forged).error(400);
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("not made by this server"),
        "{e}"
    );
}

#[test]
fn stored_responses_continue_list_and_delete() {
    let first = json!({"model": MODEL_ID, "input": "One", "max_output_tokens": 4,
                       "include": ["reasoning.encrypted_content"]});
    let v = post("/v1/responses", &first).json();
    assert_eq!(v["store"], true);
    let id = v["id"].as_str().unwrap().to_string();
    let got = get(server().addr, &format!("/v1/responses/{id}"));
    assert_eq!(got.status, 200);
    assert_eq!(got.json(), v);
    let items = get(server().addr, &format!("/v1/responses/{id}/input_items")).json();
    assert_eq!(items["object"], "list");
    assert_eq!(items["data"][0]["content"][0]["text"], "One");
    // Continued by id: the same prompt as sending the whole conversation back.
    let next = post(
        "/v1/responses",
        &json!({"model": MODEL_ID, "previous_response_id": id,
        "input": "Two", "max_output_tokens": 4}),
    )
    .json();
    assert_eq!(next["previous_response_id"], id.as_str());
    let mut whole = vec![json!({"role": "user", "content": "One"})];
    whole.extend(v["output"].as_array().unwrap().iter().cloned());
    whole.push(json!({"role": "user", "content": "Two"}));
    let resent = post(
        "/v1/responses",
        &json!({"model": MODEL_ID, "input": whole, "max_output_tokens": 4, "store": false}),
    )
    .json();
    assert_eq!(
        next["usage"]["input_tokens"],
        resent["usage"]["input_tokens"]
    );
    assert_eq!(
        next["output"].as_array().map(Vec::len),
        resent["output"].as_array().map(Vec::len)
    );
    let listed = get(
        server().addr,
        &format!("/v1/responses/{}/input_items", next["id"].as_str().unwrap()),
    )
    .json();
    assert_eq!(listed["data"][0]["content"][0]["text"], "Two");
    let del = request(server().addr, "DELETE", &format!("/v1/responses/{id}"), b"");
    assert_eq!(
        del.json(),
        json!({"id": id, "object": "response", "deleted": true})
    );
    assert_eq!(
        get(server().addr, &format!("/v1/responses/{id}")).error(404)["code"],
        "response_not_found"
    );
    let e = post(
        "/v1/responses",
        &json!({"model": MODEL_ID, "previous_response_id": id, "input": "x"}),
    )
    .error(404);
    assert_eq!(e["param"], "previous_response_id");
}

#[test]
fn stored_responses_survive_a_restart() {
    let state = tempfile::tempdir().unwrap();
    let cfg = || ServerConfig {
        state_dir: Some(state.path().to_path_buf()),
        ..any_port()
    };
    let first = TestServer::start(cfg());
    first.wait_ready();
    let body = json!({"model": MODEL_ID, "input": "Remember", "max_output_tokens": 3,
                      "include": ["reasoning.encrypted_content"]});
    let v = post_json(first.addr, "/v1/responses", &body).json();
    let id = v["id"].as_str().unwrap().to_string();
    first.shutdown().unwrap();
    let second = TestServer::start(cfg());
    second.wait_ready();
    assert_eq!(get(second.addr, &format!("/v1/responses/{id}")).json(), v);
    // The reasoning key survived too: the answer's sealed reasoning opens after the restart.
    let mut input = vec![json!({"role": "user", "content": "Remember"})];
    input.extend(v["output"].as_array().unwrap().iter().cloned());
    input.push(json!({"role": "user", "content": "And?"}));
    let r = post_json(
        second.addr,
        "/v1/responses",
        &json!({"model": MODEL_ID, "input": input, "max_output_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert!(state.path().join("reasoning.key").exists());
}

fn anthropic(path: &str, body: &Value, beta: &str) -> Resp {
    let h = [
        ("Content-Type", "application/json"),
        ("anthropic-version", "2023-06-01"),
        ("anthropic-beta", beta),
    ];
    raw(
        server().addr,
        &request_bytes("POST", path, body.to_string().as_bytes(), &h),
    )
}

const CLAUDE_BETAS: &str = "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,mid-conversation-tool-changes-2026-07-01,thinking-token-count-2026-05-13,advanced-tool-use-2025-11-20,effort-2025-11-24";

#[test]
fn messages_as_claude_code_sends_them() {
    let tool = |name: &str, deferred: bool| {
        let mut t = json!({"name": name, "description": format!("the {name} tool"),
                           "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "properties": {}}});
        if deferred {
            t["defer_loading"] = json!(true);
        }
        t
    };
    let body = |billing: &str| {
        json!({
            "model": MODEL_ID, "max_tokens": 6, "stream": false,
            "system": [{"type": "text", "text": format!("x-anthropic-billing-header: cc_version={billing};")},
                       {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
            "tools": [tool("Read", false), tool("ToolSearch", false), tool("WebFetch", true)],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "system", "content": [{"type": "text", "text": "# Environment", "cache_control": {"type": "ephemeral"}}]}],
            "metadata": {"user_id": "{\"device_id\":\"d\"}"},
            "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
        })
    };
    let a = anthropic("/v1/messages", &body("1.0"), CLAUDE_BETAS);
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    let a = a.json();
    let b = anthropic("/v1/messages", &body("2.0"), CLAUDE_BETAS).json();
    // The billing block changes every session and is not in the prompt.
    assert_eq!(a["usage"]["input_tokens"], b["usage"]["input_tokens"]);
    assert_eq!(a["content"], b["content"].clone());
    let sys = ChatMessage {
        role: "system".into(),
        content: parts("You are an agent."),
        ..Default::default()
    };
    let declared: Vec<Value> = ["Read", "ToolSearch"]
        .iter()
        .map(|n| json!({"type": "function", "function": {"name": n, "description": format!("the {n} tool"),
             "parameters": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "properties": {}}}}))
        .collect();
    let opts = ChatOptions {
        effort: Some(ReasoningEffort::High),
        tools: declared.clone(),
        ..Default::default()
    };
    let msgs = vec![
        sys.clone(),
        ChatMessage {
            role: "user".into(),
            content: parts("hi"),
            ..Default::default()
        },
        ChatMessage {
            role: "system".into(),
            content: parts("# Environment"),
            ..Default::default()
        },
    ];
    let want = encode_chat(&engine().tokenizer, &msgs, &opts).unwrap();
    assert_eq!(a["usage"]["input_tokens"], want.len(), "{a}");
    // `display: "omitted"`: the thinking block has no text, only the signature.
    if let Some(t) = a["content"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["type"] == "thinking")
    {
        assert_eq!(t["thinking"], "");
        assert!(t["signature"].as_str().unwrap().starts_with("dfr1."));
    }
    assert_eq!(a["context_management"], json!({"applied_edits": []}));
    // count_tokens gives the same count without generating.
    let mut count = body("3.0");
    for k in ["max_tokens", "stream", "metadata"] {
        count.as_object_mut().unwrap().remove(k);
    }
    let n = anthropic("/v1/messages/count_tokens", &count, CLAUDE_BETAS).json();
    assert_eq!(n["input_tokens"], want.len(), "{n}");

    // A tool search result naming WebFetch loads it after the results (the template's
    // dynamic declaration); the thinking block comes back with its signature.
    let mut turn2 = body("1.0");
    let mut history = turn2["messages"].as_array().unwrap().clone();
    let mut blocks = a["content"].as_array().unwrap().clone();
    blocks.retain(|b| b["type"] == "thinking");
    blocks.push(json!({"type": "tool_use", "id": "toolu_ts", "name": "ToolSearch", "input": {"query": "select:WebFetch"}}));
    history.push(json!({"role": "assistant", "content": blocks}));
    history.push(
        json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_ts",
                        "content": [{"type": "tool_reference", "tool_name": "WebFetch"}]}]}),
    );
    turn2["messages"] = json!(history);
    let r = anthropic("/v1/messages", &turn2, CLAUDE_BETAS);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let e = {
        let mut bad = turn2.clone();
        bad["messages"][3]["content"][0]["content"][0]["tool_name"] = json!("Nope");
        anthropic("/v1/messages", &bad, CLAUDE_BETAS).json()
    };
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("\"Nope\" is not one of the request's `tools`"),
        "{e}"
    );
}

#[test]
fn messages_without_thinking_do_not_think() {
    let r = anthropic(
        "/v1/messages",
        &json!({"model": MODEL_ID, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
        "",
    )
    .json();
    assert!(
        r["content"]
            .as_array()
            .unwrap()
            .iter()
            .all(|b| b["type"] != "thinking"),
        "{r}"
    );
    assert_eq!(r["usage"]["output_tokens_details"]["thinking_tokens"], 0);
}

#[test]
fn every_api_logs_its_end_under_its_own_id() {
    let m = anthropic(
        "/v1/messages",
        &json!({"model": MODEL_ID, "max_tokens": 3, "messages": [{"role": "user", "content": "a"}]}),
        "",
    );
    let r = post(
        "/v1/responses",
        &json!({"model": MODEL_ID, "input": "a", "max_output_tokens": 3, "store": false}),
    );
    // Each answer's id is its request id.
    assert_eq!(m.json()["id"].as_str(), m.header("x-request-id"));
    assert_eq!(r.json()["id"].as_str(), r.header("x-request-id"));
    let text = get(server().addr, "/metrics").body;
    let text = String::from_utf8_lossy(&text);
    for path in ["/v1/messages", "/v1/responses"] {
        let counted = format!("deltafin_requests_total{{endpoint=\"{path}\",status=\"200\"}}");
        assert!(
            text.contains(&counted),
            "{path} counted as answered: {text}"
        );
    }
    // A stored response's path is one label, whatever the id.
    let id = r.json()["id"].as_str().unwrap().to_string();
    let _ = get(server().addr, &format!("/v1/responses/{id}"));
    let text = String::from_utf8_lossy(&get(server().addr, "/metrics").body).to_string();
    assert!(!text.contains(&id), "{text}");
}

#[test]
fn ollama_chat_generate_and_listings() {
    let addr = server().addr;
    // Streamed by default: JSON lines ending with the done object.
    let r = post(
        "/api/chat",
        &json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}],
                                     "options": {"num_predict": 6}, "think": true}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("application/x-ndjson"));
    let lines: Vec<Value> = String::from_utf8(r.body.clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let last = lines.last().unwrap();
    assert_eq!(last["done"], true);
    assert_eq!(last["done_reason"], "length");
    assert_eq!(last["eval_count"], 6);
    let (thinking, content): (String, String) =
        lines
            .iter()
            .fold((String::new(), String::new()), |(t, c), l| {
                (
                    t + l["message"]["thinking"].as_str().unwrap_or(""),
                    c + l["message"]["content"].as_str().unwrap_or(""),
                )
            });
    // The same answer as chat completions.
    let chat = post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}),
    )
    .json();
    assert_eq!(
        thinking,
        chat["choices"][0]["message"]["reasoning_content"]
            .as_str()
            .unwrap()
    );
    assert_eq!(
        content,
        chat["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(last["prompt_eval_count"], chat["usage"]["prompt_tokens"]);
    // Not streamed: one object.
    let one = post(
        "/api/chat",
        &json!({"model": format!("{MODEL_ID}:latest"), "stream": false,
        "messages": [{"role": "user", "content": "Hi"}], "options": {"num_predict": 6}}),
    )
    .json();
    assert_eq!(one["done"], true);
    assert_eq!(one["message"]["content"].as_str().unwrap(), content);
    // /api/generate, raw: a completion.
    let g = post(
        "/api/generate",
        &json!({"model": MODEL_ID, "prompt": "Once upon", "raw": true, "stream": false,
                                          "options": {"num_predict": 5}}),
    )
    .json();
    let c = post(
        "/v1/completions",
        &json!({"prompt": "Once upon", "max_tokens": 5}),
    )
    .json();
    assert_eq!(g["response"], c["choices"][0]["text"]);
    // The listings.
    assert_eq!(get(addr, "/api/tags").json()["models"][0]["name"], MODEL_ID);
    assert!(get(addr, "/api/version").json()["version"].is_string());
    assert!(
        get(addr, "/api/ps").json()["models"][0]["context_length"]
            .as_u64()
            .unwrap()
            > 0
    );
    let show = post("/api/show", &json!({"model": MODEL_ID})).json();
    assert!(
        show["model_info"]["kimi_linear.context_length"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert_eq!(
        show["capabilities"],
        json!(["completion", "tools", "thinking"])
    );
    // What it cannot do is refused in Ollama's error shape.
    let e = post("/api/embed", &json!({"model": MODEL_ID, "input": "x"}));
    assert_eq!(e.status, 501);
    assert!(e.json()["error"].as_str().unwrap().contains("embeddings"));
    let e = post(
        "/api/chat",
        &json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}],
                                     "options": {"repeat_penalty": 1.3}}),
    );
    assert_eq!(e.status, 400);
    assert!(
        e.json()["error"]
            .as_str()
            .unwrap()
            .contains("repeat_penalty")
    );
}

#[test]
fn chat_completions_take_the_fields_agents_send() {
    let r = post(
        "/v1/chat/completions",
        &json!({
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "chat_template_kwargs": {"thinking": false}, "prompt_cache_key": "k", "safety_identifier": "u",
        "store": true, "service_tier": "auto"}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["choices"][0]["message"]["reasoning_content"], "");
    let r = post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                 "reasoning_effort": "xhigh"}),
    );
    assert_eq!(r.status, 200);
}

#[test]
fn ollama_num_ctx_bounds_the_request() {
    let body = |num_ctx: u64| {
        json!({"model": MODEL_ID, "stream": false, "options": {"num_ctx": num_ctx, "num_predict": 50},
                                    "messages": [{"role": "user", "content": "Hello there"}]})
    };
    let r = post("/api/chat", &body(4));
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    assert!(
        r.json()["error"]
            .as_str()
            .unwrap()
            .contains("allows 4 positions of context (`options.num_ctx`)")
    );
    let one = post("/api/chat", &body(100_000)).json();
    let prompt = one["prompt_eval_count"].as_u64().unwrap();
    // Three positions past the prompt: the answer stops when they are full.
    let cut = post("/api/chat", &body(prompt + 3)).json();
    assert_eq!(cut["done_reason"], "length");
    assert_eq!(
        cut["eval_count"].as_u64().unwrap(),
        4.min(one["eval_count"].as_u64().unwrap())
    );
}
