//! The server end to end on a synthesized tiny checkpoint: routing, response shapes,
//! exactness against direct generation, streaming, logprobs, stop sequences, validation.

mod common;

use common::*;
use deltafin_k3::generate::{GenerateEvent, GenerateOptions, LogitSummary};
use deltafin_k3::text::chat::{ChatMessage, ChatOptions, ReasoningEffort, encode_chat};
use deltafin_k3::text::tokenizer::{END_OF_MSG, EOS};
use deltafin_openai::{MODEL_ID, ServerConfig};
use deltafin_spec::generate;
use serde_json::{Value, json};
use std::sync::OnceLock;
use std::sync::atomic::AtomicBool;

fn server() -> &'static TestServer {
    static S: OnceLock<TestServer> = OnceLock::new();
    S.get_or_init(|| {
        let s = TestServer::start(ServerConfig {
            queue: 64,
            max_request_bytes: 1 << 20,
            ..any_port()
        });
        s.wait_ready();
        s
    })
}

/// Direct greedy generation: ids and the summary each token was chosen from.
fn direct(
    prompt: &[u32],
    max_new: usize,
    chat: bool,
    top: usize,
) -> Vec<(u32, Option<LogitSummary>)> {
    let e = engine();
    let opts = GenerateOptions {
        max_new: Some(max_new),
        stop_ids: if chat {
            vec![END_OF_MSG]
        } else {
            vec![END_OF_MSG, EOS]
        },
        max_context: e.max_context,
        top_logits: top,
    };
    let mut out = Vec::new();
    generate(&e.model, prompt, &opts, &AtomicBool::new(false), |ev| {
        if let GenerateEvent::Token { id, summary, .. } = ev {
            out.push((id, summary.cloned()));
        }
        Ok(())
    })
    .unwrap();
    out
}

fn chat_ids(text: &str) -> Vec<u32> {
    let opts = ChatOptions {
        effort: Some(ReasoningEffort::Max),
        ..Default::default()
    };
    encode_chat(
        &engine().tokenizer,
        &[ChatMessage::new("user", text)],
        &opts,
    )
    .unwrap()
}

#[test]
fn routing_and_models() {
    let a = server().addr;
    for path in ["/v1/models", "/models", "/v1/models?x=1"] {
        let r = get(a, path);
        assert_eq!(r.status, 200);
        assert_eq!(
            r.header("content-type"),
            Some("application/json; charset=utf-8")
        );
        let v = r.json();
        assert_eq!(v["object"], "list");
        assert_eq!(v["data"][0]["id"], MODEL_ID);
        assert_eq!(v["data"][0]["owned_by"], "deltafin");
    }
    assert_eq!(get(a, "/v1/models/deltafin-kimi-k3").json()["id"], MODEL_ID);
    assert_eq!(
        get(a, "/v1/models/gpt-4").error(404)["code"],
        "model_not_found"
    );
    assert_eq!(get(a, "/nope").error(404)["message"], "endpoint not found");
    let e = request(a, "POST", "/v1/models", b"{}").error(405);
    assert_eq!(e["message"], "method is not allowed for this endpoint");
    assert_eq!(
        get(a, "/v1/chat/completions").error(405)["type"],
        "method_not_allowed"
    );
    assert_eq!(
        request(a, "PUT", "/completions", b"{}").error(405)["code"],
        "method_not_allowed"
    );
}

#[test]
fn completion_equals_direct_generation() {
    let a = server().addr;
    let prompt = "The capital of France is";
    let r = post_json(
        a,
        "/completions",
        &json!({"prompt": prompt, "max_tokens": 7, "model": MODEL_ID}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["model"], MODEL_ID);
    let ids = engine().tokenizer.encode_ordinary(prompt);
    let want = direct(&ids, 7, false, 0);
    let want_ids: Vec<u32> = want
        .iter()
        .map(|(id, _)| *id)
        .filter(|&id| id != END_OF_MSG && id != EOS)
        .collect();
    let text = engine().tokenizer.decode(&want_ids).unwrap();
    let c = &v["choices"][0];
    assert_eq!(c["text"], text.as_str());
    assert_eq!(c["index"], 0);
    assert_eq!(c["logprobs"], Value::Null);
    let stopped = want
        .last()
        .is_some_and(|(id, _)| *id == END_OF_MSG || *id == EOS);
    assert_eq!(c["finish_reason"], if stopped { "stop" } else { "length" });
    let generated = want.len() - usize::from(stopped);
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": ids.len(), "completion_tokens": generated, "total_tokens": ids.len() + generated})
    );
}

#[test]
fn chat_equals_direct_generation_with_reasoning_split() {
    let a = server().addr;
    let r = post_json(
        a,
        "/v1/chat/completions",
        &json!({
            "messages": [{"role": "user", "content": "Hello"}], "max_completion_tokens": 6, "temperature": 0, "seed": 3
        }),
    );
    let v = r.json();
    assert_eq!(r.status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let ids = chat_ids("Hello");
    let want = direct(&ids, 6, true, 0);
    let m = &v["choices"][0]["message"];
    assert_eq!(m["role"], "assistant");
    // The generation prompt opened `think`: unmarked output is reasoning.
    let mut asm = deltafin_openai::output::Assembler::new(&engine().tokenizer, true, vec![]);
    let mut d = deltafin_openai::output::Delta::default();
    for (id, _) in &want {
        d.extend(asm.push(*id, None).unwrap());
    }
    d.extend(asm.finish().unwrap());
    assert_eq!(m["reasoning_content"], d.reasoning.as_str());
    assert_eq!(m["content"], d.content.as_str());
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    assert_eq!(
        v["usage"]["completion_tokens_details"]["reasoning_tokens"],
        asm.reasoning_tokens()
    );
}

fn stream_frames(path: &str, body: Value) -> Vec<Value> {
    let r = post_json(server().addr, path, &body);
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("content-type"),
        Some("text/event-stream; charset=utf-8")
    );
    assert_eq!(r.header("cache-control"), Some("no-cache"));
    assert_eq!(r.header("x-accel-buffering"), Some("no"));
    let p = r.sse();
    assert_eq!(p.last().map(String::as_str), Some("[DONE]"), "{p:?}");
    p[..p.len() - 1]
        .iter()
        .map(|s| serde_json::from_str(s).unwrap())
        .collect()
}

#[test]
fn chat_stream_matches_non_streaming() {
    let body = json!({"messages": [{"role": "user", "content": "Stream me"}], "max_tokens": 9});
    let full = post_json(server().addr, "/v1/chat/completions", &body).json();
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let frames = stream_frames("/v1/chat/completions", sbody);
    assert_eq!(
        frames[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let (mut reasoning, mut content) = (String::new(), String::new());
    let n = frames.len();
    for f in &frames[..n - 1] {
        assert_eq!(f["object"], "chat.completion.chunk");
        assert!(f.as_object().unwrap().contains_key("usage") && f["usage"].is_null());
        assert_eq!(f["id"], frames[0]["id"]);
        let d = &f["choices"][0]["delta"];
        reasoning += d["reasoning_content"].as_str().unwrap_or("");
        content += d["content"].as_str().unwrap_or("");
    }
    let fin = &frames[n - 2]["choices"][0];
    assert_eq!(fin["delta"], json!({}));
    assert_eq!(fin["finish_reason"], full["choices"][0]["finish_reason"]);
    assert_eq!(
        reasoning,
        full["choices"][0]["message"]["reasoning_content"]
            .as_str()
            .unwrap()
    );
    assert_eq!(
        content,
        full["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(frames[n - 1]["choices"], json!([]));
    assert_eq!(frames[n - 1]["usage"], full["usage"]);
    // Without include_usage no frame has a usage key.
    let frames = stream_frames(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": true}),
    );
    assert!(
        frames
            .iter()
            .all(|f| !f.as_object().unwrap().contains_key("usage"))
    );
}

#[test]
fn completions_stream_matches_non_streaming() {
    let body = json!({"prompt": "Once upon a time", "max_tokens": 10});
    let full = post_json(server().addr, "/v1/completions", &body).json();
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let frames = stream_frames("/v1/completions", sbody);
    let text: String = frames
        .iter()
        .map(|f| f["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, full["choices"][0]["text"].as_str().unwrap());
    let last = &frames[frames.len() - 1]["choices"][0];
    assert_eq!(last["text"], "");
    assert_eq!(last["finish_reason"], full["choices"][0]["finish_reason"]);
    assert!(frames.iter().all(|f| f["object"] == "text_completion"));
}

#[test]
fn chat_logprobs_are_the_engines_log_softmax() {
    let r = post_json(
        server().addr,
        "/v1/chat/completions",
        &json!({
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "logprobs": true, "top_logprobs": 3
        }),
    );
    let v = r.json();
    assert_eq!(r.status, 200, "{v}");
    let want = direct(&chat_ids("Hello"), 5, true, 3);
    let lp = &v["choices"][0]["logprobs"];
    let entries = lp["reasoning_content"].as_array().unwrap().clone();
    let tok = &engine().tokenizer;
    // Every generated ordinary token is reasoning text here (no markers in random output).
    let ordinary: Vec<&(u32, Option<LogitSummary>)> =
        want.iter().filter(|(id, _)| !tok.is_special(*id)).collect();
    assert_eq!(
        entries.len() + lp["content"].as_array().unwrap().len(),
        ordinary.len()
    );
    for (e, (id, s)) in entries.iter().zip(&ordinary) {
        let s = s.as_ref().unwrap();
        assert_eq!(e["bytes"], json!(tok.token_bytes(*id).unwrap()));
        let want_lp = f64::from(s.top[0].1) - s.logsumexp;
        assert_eq!(e["logprob"].as_f64().unwrap(), want_lp);
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        for (t, &(tid, logit)) in top.iter().zip(&s.top) {
            assert_eq!(t["bytes"], json!(tok.token_bytes(tid).unwrap()));
            assert_eq!(
                t["logprob"].as_f64().unwrap(),
                f64::from(logit) - s.logsumexp
            );
        }
        assert!(want_lp <= 0.0);
    }
    // The same values arrive when streaming.
    let frames = stream_frames(
        "/v1/chat/completions",
        json!({
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "logprobs": true, "top_logprobs": 3, "stream": true
        }),
    );
    let streamed: Vec<Value> = frames
        .iter()
        .filter_map(|f| {
            f["choices"][0]["logprobs"]["reasoning_content"]
                .as_array()
                .cloned()
        })
        .flatten()
        .collect();
    assert_eq!(streamed, entries);
}

#[test]
fn completion_logprobs_legacy_shape() {
    let prompt = "Numbers: 1, 2, 3";
    let r = post_json(
        server().addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 4, "logprobs": 2}),
    );
    let v = r.json();
    let want = direct(&engine().tokenizer.encode_ordinary(prompt), 4, false, 2);
    let lp = &v["choices"][0]["logprobs"];
    let tokens = lp["token_logprobs"].as_array().unwrap();
    let text_tokens: Vec<_> = want
        .iter()
        .filter(|(id, _)| *id != END_OF_MSG && *id != EOS)
        .collect();
    assert_eq!(tokens.len(), text_tokens.len());
    assert_eq!(lp["tokens"].as_array().unwrap().len(), tokens.len());
    assert_eq!(lp["text_offset"][0], 0);
    for (i, (_, s)) in text_tokens.iter().enumerate() {
        let s = s.as_ref().unwrap();
        assert_eq!(
            tokens[i].as_f64().unwrap(),
            f64::from(s.top[0].1) - s.logsumexp
        );
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 2);
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(best, tokens[i].as_f64().unwrap());
    }
}

#[test]
fn stop_sequences_cut_the_text_exactly() {
    let a = server().addr;
    let base = post_json(
        a,
        "/v1/completions",
        &json!({"prompt": "A story:", "max_tokens": 24}),
    )
    .json();
    let text = base["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 8, "need some text to cut: {text:?}");
    // A 3-character stop taken from the middle (likely spanning a token boundary).
    let mid = chars.len() / 2;
    let stop: String = chars[mid..mid + 3].iter().collect();
    let cut = text.find(&stop).unwrap();
    for stream in [false, true] {
        let body = json!({"prompt": "A story:", "max_tokens": 24, "stop": [stop, "\u{0}never"], "stream": stream});
        let (got, finish) = if stream {
            let frames = stream_frames("/v1/completions", body);
            let t: String = frames
                .iter()
                .map(|f| f["choices"][0]["text"].as_str().unwrap())
                .collect();
            (
                t,
                frames.last().unwrap()["choices"][0]["finish_reason"].clone(),
            )
        } else {
            let v = post_json(a, "/v1/completions", &body).json();
            (
                v["choices"][0]["text"].as_str().unwrap().to_string(),
                v["choices"][0]["finish_reason"].clone(),
            )
        };
        assert_eq!(got, text[..cut], "stream={stream}");
        assert_eq!(finish, "stop");
    }
    // Chat: stop sequences apply to the response channel only. A stop taken from the
    // reasoning changes nothing.
    let chat_body = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        post_json(a, "/v1/chat/completions", &b).json()
    };
    let base = chat_body(json!({}));
    let reasoning = base["choices"][0]["message"]["reasoning_content"]
        .as_str()
        .unwrap()
        .to_string();
    let rc: Vec<char> = reasoning.chars().collect();
    assert!(rc.len() >= 6, "need reasoning text: {reasoning:?}");
    let stop: String = rc[3..5].iter().collect();
    let v = chat_body(json!({"stop": stop}));
    assert_eq!(v["choices"][0], base["choices"][0]);
    assert_eq!(v["usage"], base["usage"]);
    // With thinking off the answer is content, and the same kind of stop cuts it.
    let base = chat_body(json!({"reasoning_effort": "none"}));
    let content = base["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let cc: Vec<char> = content.chars().collect();
    assert!(cc.len() >= 6, "need content text: {content:?}");
    let stop: String = cc[3..5].iter().collect();
    let cut = content.find(&stop).unwrap();
    let v = chat_body(json!({"reasoning_effort": "none", "stop": stop}));
    assert_eq!(v["choices"][0]["message"]["content"], &content[..cut]);
    assert_eq!(v["choices"][0]["message"]["reasoning_content"], "");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[test]
fn malformed_requests_get_well_formed_refusals() {
    let a = server().addr;
    let e = request(a, "POST", "/v1/chat/completions", b"{not json").error(400);
    assert_eq!(e["message"], "request body must be valid JSON");
    assert_eq!(e["type"], "invalid_request_error");
    let e = request(a, "POST", "/v1/completions", b"{\"prompt\": \"\xff\xfe\"}").error(400);
    assert_eq!(e["message"], "request body must be valid JSON");
    let e = request(a, "POST", "/v1/completions", b"[1,2]").error(400);
    assert_eq!(e["message"], "request body must be a JSON object");
    let e = post_json(a, "/v1/completions", &json!({"prompt": "x", "tools": []})).error(400);
    assert_eq!(e["param"], "tools");
    let e = post_json(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}], "temperature": 2.5}),
    )
    .error(400);
    assert_eq!(e["param"], "temperature");
    let e = post_json(a, "/v1/completions", &json!({"prompt": "x", "n": 2})).error(400);
    assert_eq!(
        e["message"],
        "`n` must be 1; Deltafin has one authoritative target stream"
    );
    let e = post_json(a, "/v1/completions", &json!({"prompt": ""})).error(400);
    assert_eq!(e["param"], "prompt");
    let e = request(a, "POST", "/v1/completions", b"").error(400);
    assert_eq!(e["message"], "request body must be valid JSON");
    // The server still serves.
    assert_eq!(
        post_json(
            a,
            "/v1/completions",
            &json!({"prompt": "x", "max_tokens": 1})
        )
        .status,
        200
    );
}

#[test]
fn context_overflow_is_a_400_before_generation() {
    let root = model_root().to_path_buf();
    let s = TestServer::start_with(any_port(), move || {
        let mut e = load_engine(&root)?;
        e.max_context = 8;
        Ok(e)
    });
    s.wait_ready();
    let before = started(&s.stats);
    let e = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "one two three four five six seven eight nine ten"}),
    )
    .error(400);
    assert_eq!(e["code"], "context_length_exceeded");
    assert_eq!(started(&s.stats), before);
    // A prompt that fits generates until the context is full: finish_reason length.
    let v = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "one two", "max_tokens": 100}),
    )
    .json();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(v["usage"]["total_tokens"].as_u64().unwrap() <= 9);
    s.shutdown().unwrap();
}

#[test]
fn completions_answer_503_while_loading() {
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let root = model_root().to_path_buf();
    let s = TestServer::start_with(any_port(), move || {
        go_rx.recv().map_err(|e| e.to_string())?;
        load_engine(&root)
    });
    assert_eq!(get(s.addr, "/v1/models").status, 200);
    let e = post_json(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}]}),
    )
    .error(503);
    assert_eq!(e["code"], "model_loading");
    go_tx.send(()).unwrap();
    s.wait_ready();
    assert_eq!(
        post_json(
            s.addr,
            "/v1/completions",
            &json!({"prompt": "x", "max_tokens": 1})
        )
        .status,
        200
    );
    s.shutdown().unwrap();
}

#[test]
fn a_failed_load_stops_the_server_with_the_reason() {
    let s = TestServer::start_with(any_port(), || Err("config.json is missing".to_string()));
    let err = s.join().unwrap_err();
    assert!(err.contains("config.json is missing"), "{err}");
}

#[test]
fn a_panicking_loader_fails_the_load_instead_of_loading_forever() {
    let s = TestServer::start_with(any_port(), || -> Result<deltafin_openai::Engine, String> {
        panic!("index out of bounds in the test loader")
    });
    let err = s.join().unwrap_err();
    assert!(err.contains("the model loader panicked"), "{err}");
    assert!(
        err.contains("index out of bounds in the test loader"),
        "{err}"
    );
}
