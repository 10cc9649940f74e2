//! The endpoints around generation on a synthesized tiny checkpoint: `/health` through
//! loading and readiness, the `/metrics` exposition (every line parsed, counters moving with
//! requests, the expert cache under a memory budget), `/tokenize` and `/detokenize`, model
//! aliases, request ids, and a server whose default is thinking off.

mod common;

use common::*;
use deltafin_k3::engine::EngineConfig;
use deltafin_k3::generate::GenerateOptions;
use deltafin_k3::text::chat::{ChatMessage, Thinking, encode_chat};
use deltafin_k3::text::tokenizer::END_OF_MSG;
use deltafin_openai::{Engine, MODEL_ID, Server, ServerConfig};
use deltafin_spec::generate;
use serde_json::json;
use std::collections::{BTreeMap, HashSet};
use std::sync::OnceLock;
use std::sync::atomic::AtomicBool;

fn aliases() -> Vec<String> {
    vec!["kimi-k3".to_string(), "org/k3:latest".to_string()]
}

/// A server with two aliases, shared by the tests that only read.
fn server() -> &'static TestServer {
    static S: OnceLock<TestServer> = OnceLock::new();
    S.get_or_init(|| {
        let s = TestServer::start(ServerConfig {
            queue: 8,
            model_aliases: aliases(),
            ..any_port()
        });
        s.wait_ready();
        s
    })
}

/// One parsed sample: name, labels, value.
type Sample = (String, BTreeMap<String, String>, f64);

fn valid_name(n: &str) -> bool {
    let mut c = n.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == ':')
}

fn parse_labels(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = text;
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"").expect("label has =\"");
        assert!(valid_name(key), "label name {key:?}");
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            let (i, ch) = chars.next().expect("label value is closed");
            match ch {
                '\\' => match chars.next().expect("escape").1 {
                    'n' => value.push('\n'),
                    '\\' => value.push('\\'),
                    '"' => value.push('"'),
                    other => panic!("bad escape \\{other}"),
                },
                '"' => break i,
                ch => value.push(ch),
            }
        };
        assert!(
            out.insert(key.to_string(), value).is_none(),
            "duplicate label {key}"
        );
        rest = &after[end + 1..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
    out
}

/// Parses a text exposition strictly: every line is a HELP, a TYPE or a sample of a family
/// declared (HELP then TYPE) before it; names are valid and `deltafin_`; counters end in
/// `_total` and are non-negative; no sample repeats. Returns the TYPEs and the samples.
fn parse_exposition(text: &str) -> (BTreeMap<String, String>, Vec<Sample>) {
    assert!(text.ends_with('\n'), "exposition ends with a newline");
    let mut types = BTreeMap::new();
    let mut helps = HashSet::new();
    let mut samples: Vec<Sample> = Vec::new();
    let mut seen = HashSet::new();
    for line in text.lines() {
        assert!(!line.is_empty(), "empty line in exposition");
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').expect("HELP has text");
            assert!(!help.trim().is_empty(), "{line}");
            assert!(helps.insert(name.to_string()), "second HELP for {name}");
            assert!(!types.contains_key(name), "HELP after TYPE for {name}");
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE has a kind");
            assert!(helps.contains(name), "TYPE without HELP: {name}");
            assert!(matches!(kind, "counter" | "gauge"), "{line}");
            if kind == "counter" {
                assert!(name.ends_with("_total"), "counter {name}");
            }
            assert!(types.insert(name.to_string(), kind.to_string()).is_none());
        } else {
            assert!(!line.starts_with('#'), "unknown comment {line}");
            let (series, value) = line.rsplit_once(' ').expect("sample has a value");
            let (name, labels) = match series.split_once('{') {
                Some((n, l)) => (n, parse_labels(l.strip_suffix('}').expect("labels close"))),
                None => (series, BTreeMap::new()),
            };
            assert!(valid_name(name) && name.starts_with("deltafin_"), "{name}");
            let kind = types
                .get(name)
                .unwrap_or_else(|| panic!("{name} has no TYPE"));
            let v: f64 = match value {
                "NaN" => f64::NAN,
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                v => v.parse().unwrap_or_else(|_| panic!("value of {line}")),
            };
            if kind == "counter" {
                assert!(v >= 0.0, "{line}");
            }
            assert!(seen.insert(series.to_string()), "repeated sample {series}");
            samples.push((name.to_string(), labels, v));
        }
    }
    (types, samples)
}

fn scrape(s: &TestServer) -> (BTreeMap<String, String>, Vec<Sample>) {
    let r = get(s.addr, "/metrics");
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    parse_exposition(std::str::from_utf8(&r.body).unwrap())
}

fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let want: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    samples
        .iter()
        .find(|(n, l, _)| n == name && *l == want)
        .map(|s| s.2)
}

#[test]
fn health_follows_loading_and_readiness() {
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let root = model_root().to_path_buf();
    let s = TestServer::start_with(any_port(), move || {
        go_rx.recv().map_err(|e| e.to_string())?;
        load_engine(&root)
    });
    let e = get(s.addr, "/health").error(503);
    assert_eq!(e["type"], "model_loading");
    assert_eq!(
        get(s.addr, "/v1/health").error(503)["code"],
        "model_loading"
    );
    // The tokenizer comes with the model.
    let e = post_json(s.addr, "/tokenize", &json!({"content": "a"})).error(503);
    assert_eq!(e["code"], "model_loading");
    let (_, samples) = scrape(&s);
    assert_eq!(value(&samples, "deltafin_model_ready", &[]), Some(0.0));
    go_tx.send(()).unwrap();
    wait_until(
        std::time::Duration::from_secs(30),
        || get(s.addr, "/health").status == 200,
        "health ok",
    );
    let r = get(s.addr, "/health");
    assert_eq!(r.json(), json!({"status": "ok"}));
    assert_eq!(
        r.header("content-type"),
        Some("application/json; charset=utf-8")
    );
    assert_eq!(request(s.addr, "HEAD", "/health", b"").status, 200);
    assert_eq!(
        request(s.addr, "POST", "/health", b"{}").error(405)["code"],
        "method_not_allowed"
    );
    s.shutdown().unwrap();
}

#[test]
fn metrics_parse_and_count_requests_and_tokens() {
    let s = server();
    let (types, before) = scrape(s);
    for (name, kind) in [
        ("deltafin_requests_total", "counter"),
        ("deltafin_prompt_tokens_total", "counter"),
        ("deltafin_completion_tokens_total", "counter"),
        ("deltafin_prefill_seconds_total", "counter"),
        ("deltafin_decode_seconds_total", "counter"),
        ("deltafin_decode_tokens_total", "counter"),
        ("deltafin_last_prefill_tokens_per_second", "gauge"),
        ("deltafin_last_decode_tokens_per_second", "gauge"),
        ("deltafin_generations_total", "counter"),
        ("deltafin_generation_busy", "gauge"),
        ("deltafin_queue_depth", "gauge"),
        ("deltafin_queue_capacity", "gauge"),
        ("deltafin_model_ready", "gauge"),
        ("deltafin_uptime_seconds", "gauge"),
        ("deltafin_expert_cache_hits_total", "counter"),
        ("deltafin_expert_cache_misses_total", "counter"),
        ("deltafin_expert_cache_hit_ratio", "gauge"),
        ("deltafin_expert_read_bytes_total", "counter"),
    ] {
        assert_eq!(types.get(name).map(String::as_str), Some(kind), "{name}");
    }
    assert_eq!(value(&before, "deltafin_model_ready", &[]), Some(1.0));
    assert_eq!(value(&before, "deltafin_queue_capacity", &[]), Some(8.0));
    // Every expert is resident: no cache, so no samples.
    assert_eq!(
        value(
            &before,
            "deltafin_expert_cache_hits_total",
            &[("cache", "host")]
        ),
        None
    );
    let counted = |samples: &[Sample], name: &str, labels: &[(&str, &str)]| {
        value(samples, name, labels).unwrap_or(0.0)
    };

    let r = post_json(
        s.addr,
        "/completions",
        &json!({"prompt": "Count these tokens", "max_tokens": 4}),
    );
    assert_eq!(r.status, 200);
    let usage = r.json()["usage"].clone();
    let bad = post_json(s.addr, "/v1/completions", &json!({"prompt": ""}));
    assert_eq!(bad.status, 400);
    assert_eq!(get(s.addr, "/no/such/path").status, 404);
    assert_eq!(get(s.addr, "/v1/models/unknown-model").status, 404);
    let s_uptime = counted(&before, "deltafin_uptime_seconds", &[]);

    // The log of a request is written once its answer is complete: wait for the counts.
    let mut after = Vec::new();
    wait_until(
        std::time::Duration::from_secs(10),
        || {
            after = scrape(s).1;
            counted(
                &after,
                "deltafin_requests_total",
                &[("endpoint", "other"), ("status", "404")],
            ) >= 1.0
        },
        "requests counted",
    );
    let grew = |name: &str, labels: &[(&str, &str)]| {
        counted(&after, name, labels) - counted(&before, name, labels)
    };
    // `/completions` is counted under its own path.
    assert!(
        grew(
            "deltafin_requests_total",
            &[("endpoint", "/completions"), ("status", "200")]
        ) >= 1.0
    );
    assert!(
        grew(
            "deltafin_requests_total",
            &[("endpoint", "/v1/completions"), ("status", "400")]
        ) >= 1.0
    );
    assert!(
        grew(
            "deltafin_requests_total",
            &[("endpoint", "/v1/models/{id}"), ("status", "404")]
        ) >= 1.0
    );
    assert!(
        grew(
            "deltafin_requests_total",
            &[("endpoint", "/metrics"), ("status", "200")]
        ) >= 1.0
    );
    let prompt = usage["prompt_tokens"].as_f64().unwrap();
    let completion = usage["completion_tokens"].as_f64().unwrap();
    // Other tests share this server: at least this request's tokens were added.
    assert!(grew("deltafin_prompt_tokens_total", &[]) >= prompt);
    assert!(grew("deltafin_completion_tokens_total", &[]) >= completion);
    assert!(grew("deltafin_generations_total", &[("outcome", "finished")]) >= 1.0);
    assert!(grew("deltafin_prefill_seconds_total", &[]) > 0.0);
    assert!(counted(&after, "deltafin_last_prefill_tokens_per_second", &[]) > 0.0);
    assert!(counted(&after, "deltafin_uptime_seconds", &[]) >= s_uptime);
    let busy = counted(&after, "deltafin_generation_busy", &[]);
    assert!(busy == 0.0 || busy == 1.0);
}

#[test]
fn a_streaming_cache_reports_its_hits() {
    let root = model_root().to_path_buf();
    let budgeted = EngineConfig {
        memory_budget: Some(2_000_000_000),
        ..EngineConfig::default()
    };
    let s = TestServer::start_with(any_port(), move || {
        Engine::load_with(&root, &budgeted).map_err(|e| e.to_string())
    });
    s.wait_ready();
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "Streaming experts", "max_tokens": 4}),
    );
    assert_eq!(r.status, 200);
    let (_, samples) = scrape(&s);
    let hits = value(
        &samples,
        "deltafin_expert_cache_hits_total",
        &[("cache", "host")],
    )
    .unwrap();
    let misses = value(
        &samples,
        "deltafin_expert_cache_misses_total",
        &[("cache", "host")],
    )
    .unwrap();
    assert!(misses > 0.0, "the first reads miss");
    let ratio = value(
        &samples,
        "deltafin_expert_cache_hit_ratio",
        &[("cache", "host")],
    )
    .unwrap();
    assert!((ratio - hits / (hits + misses)).abs() < 1e-12);
    assert!(value(&samples, "deltafin_expert_read_bytes_total", &[]).unwrap() > 0.0);
    s.shutdown().unwrap();
}

#[test]
fn tokenize_and_detokenize_like_llama_server() {
    let a = server().addr;
    let tok = &engine().tokenizer;
    let text = "The capital of France is <|open|>";
    let r = post_json(a, "/tokenize", &json!({"content": text}));
    assert_eq!(r.status, 200);
    assert!(
        r.header("x-request-id")
            .is_some_and(|id| id.starts_with("req-"))
    );
    let want = tok.encode_ordinary(text);
    assert_eq!(r.json(), json!({"tokens": want}));
    // The ids a completion's usage counts.
    let c = post_json(
        a,
        "/v1/completions",
        &json!({"prompt": text, "max_tokens": 1}),
    )
    .json();
    assert_eq!(c["usage"]["prompt_tokens"], want.len());
    let v = post_json(
        a,
        "/tokenize",
        &json!({"content": "é", "with_pieces": true}),
    )
    .json();
    assert_eq!(v["tokens"][0]["id"], json!(tok.encode_ordinary("é")[0]));
    let v = post_json(a, "/detokenize", &json!({"tokens": tok.encode(text, true)})).json();
    assert_eq!(v, json!({"content": text}));
    let e = post_json(a, "/detokenize", &json!({"tokens": [1, 2, 99_999_999]})).error(400);
    assert_eq!(e["param"], "tokens[2]");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("`tokens[2]` is 99999999")
    );
    let e = post_json(a, "/tokenize", &json!({"text": "a"})).error(400);
    assert_eq!(e["param"], "text");
    assert_eq!(
        request(a, "POST", "/tokenize", b"{").error(400)["message"],
        "request body must be valid JSON"
    );
    assert_eq!(get(a, "/tokenize").error(405)["code"], "method_not_allowed");
    assert_eq!(
        get(a, "/detokenize").error(405)["code"],
        "method_not_allowed"
    );
}

#[test]
fn aliases_are_listed_and_accepted() {
    let a = server().addr;
    let v = get(a, "/v1/models").json();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [MODEL_ID, "kimi-k3", "org/k3:latest"]);
    for m in v["data"].as_array().unwrap() {
        assert_eq!(m["object"], "model");
        assert_eq!(m["owned_by"], "deltafin");
        assert_eq!(m["created"], v["data"][0]["created"]);
    }
    assert_eq!(
        get(a, "/v1/models/org/k3:latest").json()["id"],
        "org/k3:latest"
    );
    assert_eq!(get(a, "/models/kimi-k3").json()["id"], "kimi-k3");
    let e = get(a, "/v1/models/k3").error(404);
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("aliases `kimi-k3`, `org/k3:latest`")
    );
    let r = post_json(
        a,
        "/v1/chat/completions",
        &json!({"model": "kimi-k3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    // Responses name the model by its id, as vLLM does with --served-model-name.
    assert_eq!(v["model"], MODEL_ID);
    assert_eq!(r.header("x-request-id"), v["id"].as_str());
    let e = post_json(
        a,
        "/v1/completions",
        &json!({"model": "KIMI-K3", "prompt": "x"}),
    )
    .error(400);
    assert_eq!(e["param"], "model");
}

#[test]
fn bad_aliases_are_refused_at_bind() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for (names, says) in [
        (vec![""], "must not be empty"),
        (vec!["a b"], "whitespace"),
        (vec!["x", "x"], "given twice"),
        (vec![MODEL_ID], "own id"),
    ] {
        let cfg = ServerConfig {
            model_aliases: names.iter().map(|s| s.to_string()).collect(),
            ..any_port()
        };
        let err = rt
            .block_on(Server::bind_with_loader(cfg, || Err("not loaded".into())))
            .err()
            .expect("bind refuses");
        assert!(err.to_string().contains(says), "{err}");
    }
}

#[test]
fn a_server_whose_default_is_thinking_off_answers_in_content() {
    let s = TestServer::start(ServerConfig {
        default_thinking: Thinking::Off,
        ..any_port()
    });
    s.wait_ready();
    let r = post_json(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6}),
    );
    let v = r.json();
    assert_eq!(r.status, 200, "{v}");
    let e = engine();
    let ids = encode_chat(
        &e.tokenizer,
        &[ChatMessage::new("user", "Hello")],
        &Thinking::Off.chat_options(),
    )
    .unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    let opts = GenerateOptions {
        max_new: Some(6),
        stop_ids: vec![END_OF_MSG],
        max_context: e.max_context,
        top_logits: 0,
    };
    let out = generate(&e.model, &ids, &opts, &AtomicBool::new(false), |_| Ok(())).unwrap();
    let controls = deltafin_openai::request::ChatControls::with_thinking(Thinking::Off);
    let mut asm = deltafin_openai::output::Assembler::for_chat(&e.tokenizer, &controls, vec![]);
    let mut d = deltafin_openai::output::Delta::default();
    for id in &out.ids {
        d.extend(asm.push(*id, None).unwrap());
    }
    d.extend(asm.finish().unwrap());
    let m = &v["choices"][0]["message"];
    assert_eq!(m["content"], d.content.as_str());
    assert_eq!(m["reasoning_content"], "");
    assert_eq!(
        v["usage"]["completion_tokens_details"]["reasoning_tokens"],
        0
    );
    // A request's own effort still turns thinking on.
    let r = post_json(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1, "reasoning_effort": "low"}),
    );
    assert!(r.json()["usage"]["prompt_tokens"].as_u64().unwrap() > ids.len() as u64);
    s.shutdown().unwrap();
}
