//! Conversation state through the server (docs/SERVER.md "Conversation state"): a second
//! chat turn resumes from the first turn's prefix state with the cold answer's bits, from
//! RAM and after a restart from disk; the response memo; prefill progress as SSE comments
//! and in `/metrics`; a prefill stopped by a disconnect and by shutdown.

mod common;

use common::*;
use deltafin_k3::engine::{EngineBuilder, ExpertLayer};
use deltafin_k3::model::moe::{ExpertError, ExpertSource, ExpertWeights};
use deltafin_k3::prefix::{CacheConfig, PrefixCache};
use deltafin_openai::{Engine, ServerConfig};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The test engine with a prefix cache in `disk` (RAM tier on) and no response memo, so
/// that every request runs the model.
fn cached_engine(disk: &Path) -> Result<Engine, String> {
    let engine = load_engine(model_root())?;
    let config = CacheConfig {
        ram_bytes: 1 << 30,
        disk: Some((disk.to_path_buf(), 1 << 30)),
    };
    let cache = PrefixCache::new(
        &engine.model,
        "conversation-test",
        &config,
        Box::new(|_| {}),
    )?;
    Ok(engine.with_state_cache(cache))
}

fn cached_server(disk: PathBuf) -> TestServer {
    let s = TestServer::start_with(any_port(), move || cached_engine(&disk));
    s.wait_ready();
    s
}

fn plain_server() -> TestServer {
    let s = TestServer::start_with(any_port(), || load_engine(model_root()));
    s.wait_ready();
    s
}

fn system_text() -> String {
    (0..40)
        .map(|i| format!("Rule {i}: answer in plain words and keep to the facts."))
        .collect::<Vec<_>>()
        .join(" ")
}

fn turn1() -> Vec<Value> {
    vec![
        json!({"role": "system", "content": system_text()}),
        json!({"role": "user", "content": "What is the capital of France?"}),
    ]
}

fn turn2(answer: &str) -> Vec<Value> {
    let mut m = turn1();
    m.push(json!({"role": "assistant", "content": answer}));
    m.push(json!({"role": "user", "content": "And of Italy? Say it twice."}));
    m
}

fn chat(addr: std::net::SocketAddr, messages: &[Value]) -> Value {
    let body = json!({"messages": messages, "max_tokens": 12, "reasoning_effort": "none"});
    let r = post_json(addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

fn metric(addr: std::net::SocketAddr, name: &str) -> f64 {
    let text = String::from_utf8(get(addr, "/metrics").body).unwrap();
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

/// The answer's content and its usage.
fn content(v: &Value) -> (String, Value) {
    (
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string(),
        v["usage"].clone(),
    )
}

#[test]
fn a_second_turn_resumes_from_the_first_with_the_cold_answer() {
    let disk = tempfile::tempdir().unwrap();
    let cached = cached_server(disk.path().to_path_buf());
    let plain = plain_server();
    let a1 = chat(cached.addr, &turn1());
    assert_eq!(content(&a1), content(&chat(plain.addr, &turn1())));
    let prompt1 = a1["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        prompt1 > 130,
        "the first turn must span KDA chunks: {prompt1}"
    );
    let answer = content(&a1).0;
    let a2 = chat(cached.addr, &turn2(&answer));
    assert_eq!(content(&a2), content(&chat(plain.addr, &turn2(&answer))));
    assert!(metric(cached.addr, "deltafin_state_cache_hits_total{tier=\"ram\"}") >= 1.0);
    let reused = metric(cached.addr, "deltafin_prefix_reused_tokens_total");
    // The second turn reused at least the first turn's prompt up to its last 64-token
    // boundary before the message end.
    assert!(
        reused >= ((prompt1 - 2) / 64 * 64 - 64) as f64,
        "reused {reused}"
    );
    assert_eq!(
        metric(plain.addr, "deltafin_prefix_reused_tokens_total"),
        0.0
    );
    // A restarted server finds the states on disk.
    drop(cached);
    let restarted = cached_server(disk.path().to_path_buf());
    let again = chat(restarted.addr, &turn2(&answer));
    assert_eq!(content(&again), content(&a2));
    assert!(
        metric(
            restarted.addr,
            "deltafin_state_cache_hits_total{tier=\"disk\"}"
        ) >= 1.0
    );
    assert!(metric(restarted.addr, "deltafin_prefix_reused_tokens_total") > 0.0);
}

#[test]
fn the_memo_answers_an_identical_request_without_the_model() {
    // The server's default memo (32 answers, 64 MiB).
    let s = TestServer::start_with(any_port(), || {
        Engine::load(model_root()).map_err(|e| e.to_string())
    });
    s.wait_ready();
    let body = json!({"messages": turn1(), "max_tokens": 8, "reasoning_effort": "none"});
    let first = post_json(s.addr, "/v1/chat/completions", &body).json();
    let before = metric(s.addr, "deltafin_memo_answers_total");
    let second = post_json(s.addr, "/v1/chat/completions", &body).json();
    assert_eq!(metric(s.addr, "deltafin_memo_answers_total"), before + 1.0);
    assert_eq!(content(&first), content(&second));
    assert_ne!(first["id"], second["id"]);
    // Streamed, the same answer from the memo.
    let streamed = post_json(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": turn1(), "max_tokens": 8, "reasoning_effort": "none", "stream": true}),
    );
    assert_eq!(metric(s.addr, "deltafin_memo_answers_total"), before + 2.0);
    let text: String = streamed
        .sse()
        .iter()
        .filter(|p| p.starts_with('{'))
        .filter_map(|p| {
            let v: Value = serde_json::from_str(p).ok()?;
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(text, content(&first).0);
    // Another max_tokens is another request.
    let other = json!({"messages": turn1(), "max_tokens": 7, "reasoning_effort": "none"});
    post_json(s.addr, "/v1/chat/completions", &other);
    assert_eq!(metric(s.addr, "deltafin_memo_answers_total"), before + 2.0);
}

#[test]
fn a_streamed_prefill_reports_progress_in_comments() {
    let s = plain_server();
    let body = json!({"messages": turn1(), "max_tokens": 2, "reasoning_effort": "none", "stream": true,
                      "stream_options": {"include_usage": true}});
    let r = post_json(s.addr, "/v1/chat/completions", &body);
    let text = String::from_utf8(r.body.clone()).unwrap();
    let comments: Vec<&str> = text
        .split("\n\n")
        .filter_map(|b| b.strip_prefix(": prefill "))
        .collect();
    let usage: Value = r
        .sse()
        .iter()
        .filter_map(|p| serde_json::from_str::<Value>(p).ok())
        .find(|v| v["usage"].is_object())
        .unwrap();
    let total = usage["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(!comments.is_empty(), "{text}");
    assert_eq!(
        comments.last().copied(),
        Some(format!("{total}/{total}").as_str())
    );
    // The comments come before the answer ends.
    let first_comment = text.find(": prefill").unwrap();
    assert!(first_comment < text.find("\"finish_reason\":\"").unwrap());
}

/// Every routed expert read takes `delay`: a prefill of a few hundred tokens takes seconds.
struct Slow(Duration);

struct SlowSource {
    inner: Box<dyn ExpertSource>,
    delay: Duration,
}

impl ExpertSource for SlowSource {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError> {
        std::thread::sleep(self.delay);
        self.inner.expert(layer, expert)
    }
}

impl ExpertLayer for Slow {
    fn wrap(self: Box<Self>, inner: Box<dyn ExpertSource>) -> Box<dyn ExpertSource> {
        Box::new(SlowSource {
            inner,
            delay: self.0,
        })
    }
}

fn slow_server() -> TestServer {
    let s = TestServer::start_with(ServerConfig { ..any_port() }, || {
        let loaded = EngineBuilder::new(model_root())
            .expert_layer(Box::new(|_| {
                Ok(Some(Box::new(Slow(Duration::from_millis(15))) as _))
            }))
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Engine::from_loaded(loaded, None).with_memo(0, 0))
    });
    s.wait_ready();
    s
}

/// Opens a streamed chat with a long prompt and returns once its first prefill comment
/// arrived (the prefill is running), with the open stream and the time it took.
fn open_prefill(s: &TestServer) -> (BufReader<std::net::TcpStream>, Duration) {
    let body =
        json!({"messages": turn1(), "max_tokens": 4, "reasoning_effort": "none", "stream": true});
    let mut c = connect(s.addr);
    std::io::Write::write_all(
        &mut c,
        &request_bytes(
            "POST",
            "/v1/chat/completions",
            body.to_string().as_bytes(),
            &[],
        ),
    )
    .unwrap();
    let t = Instant::now();
    let mut r = BufReader::new(c);
    let mut line = String::new();
    loop {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "stream closed early");
        if line.starts_with(": prefill ") {
            return (r, t.elapsed());
        }
    }
}

#[test]
fn a_disconnect_or_shutdown_stops_a_running_prefill() {
    let s = slow_server();
    // How long the whole prefill takes when nobody leaves.
    let t = Instant::now();
    let body = json!({"messages": turn1(), "max_tokens": 1, "reasoning_effort": "none"});
    assert_eq!(post_json(s.addr, "/v1/chat/completions", &body).status, 200);
    let full = t.elapsed();
    assert!(
        full > Duration::from_secs(2),
        "the slow prefill took only {full:?}"
    );
    // The client leaves during the prefill: the generation is cancelled within a layer.
    let before = cancelled(&s.stats);
    let (stream, _) = open_prefill(&s);
    let left = Instant::now();
    drop(stream);
    wait_until(
        full / 2,
        || cancelled(&s.stats) == before + 1,
        "prefill cancelled after the disconnect",
    );
    let stop = left.elapsed();
    assert!(
        stop < full / 3,
        "stopped after {stop:?} of a {full:?} prefill"
    );
    s.wait_idle();
    assert_eq!(metric(s.addr, "deltafin_prefill_total_tokens"), 0.0);
    // Shutdown during a prefill ends it too, and the stream gets the shutdown error.
    let (mut stream, _) = open_prefill(&s);
    let reader = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut stream, &mut rest);
        rest
    });
    let t = Instant::now();
    s.shutdown().unwrap();
    assert!(t.elapsed() < full / 2, "shutdown took {:?}", t.elapsed());
    let rest = reader.join().unwrap();
    assert!(rest.contains("server_shutting_down"), "{rest}");
}
