//! The server with drafters (DSpark for chat completions, Qwen for completions, as
//! `deltafin serve` loads them) answers exactly what the server without drafters answers:
//! same text, finish reasons, usage, stream frames and stop-sequence cuts.

mod common;

use common::*;
use deltafin_k3::config::K3Config;
use deltafin_k3::prefix::{CacheConfig, PrefixCache};
use deltafin_k3::synth::{
    QwenSize, SynthDims, SynthSpec, synthesize, synthesize_dspark, synthesize_qwen3,
};
use deltafin_k3::text::tokenizer::Tokenizer;
use deltafin_openai::ServerConfig;
use deltafin_spec::dspark::{DraftMode, SpecConfig};
use deltafin_spec::select::{DraftModels, Surfaces};
use deltafin_spec::uag::synthesize_tokenizer_json;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

fn root() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    synthesize(d.path(), &SynthSpec::new(SynthDims::tiny(), 11)).unwrap();
    let cfg = K3Config::from_file(d.path().join("config.json")).unwrap();
    synthesize_dspark(&d.path().join("k3-draft-dspark"), 3, &cfg).unwrap();
    let q = d.path().join("k3-draft-qwen3-0.6b-base");
    synthesize_qwen3(&q, 5, QwenSize::Small).unwrap();
    let tok = Tokenizer::from_dir(d.path()).unwrap();
    std::fs::write(
        q.join("tokenizer.json"),
        synthesize_tokenizer_json(&tok, 3000).to_string(),
    )
    .unwrap();
    d
}

fn start(root: &Path, spec: Option<SpecConfig>) -> TestServer {
    start_cached(root, spec, None)
}

/// [`start`] with prefix states kept in `states` (RAM and disk).
fn start_cached(root: &Path, spec: Option<SpecConfig>, states: Option<PathBuf>) -> TestServer {
    let root: PathBuf = root.to_path_buf();
    let s = TestServer::start_with(
        ServerConfig {
            queue: 8,
            ..any_port()
        },
        move || {
            let mut e = load_engine(&root)?;
            if let Some(spec) = spec {
                let surfaces = Surfaces {
                    chat: true,
                    raw: true,
                };
                let d = DraftModels::load(&root, &spec, surfaces, &e.model)?;
                assert!(d.dspark.is_some());
                assert_eq!(d.qwen.is_some(), spec.dspark != DraftMode::On);
                e.drafts = Some(d);
            }
            if let Some(dir) = states {
                let config = CacheConfig {
                    ram_bytes: 1 << 30,
                    disk: Some((dir, 1 << 30)),
                };
                let cache = PrefixCache::new(&e.model, "drafting", &config, Box::new(|_| {}))?;
                e = e.with_state_cache(cache);
            }
            Ok(e)
        },
    );
    s.wait_ready();
    s
}

/// The response without its per-request id and timestamp.
fn answer(s: &TestServer, path: &str, body: &Value) -> Value {
    let r = post_json(s.addr, path, body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    if body["stream"] == true {
        let frames: Vec<Value> = r
            .sse()
            .iter()
            .filter(|f| f.as_str() != "[DONE]")
            .map(|f| {
                let mut v: Value = serde_json::from_str(f).unwrap();
                v.as_object_mut().unwrap().remove("id");
                v.as_object_mut().unwrap().remove("created");
                if let Some(calls) = v["choices"][0]["delta"]["tool_calls"].as_array_mut() {
                    for c in calls {
                        c.as_object_mut().unwrap().remove("id");
                    }
                }
                v
            })
            .collect();
        return Value::Array(frames);
    }
    let mut v = r.json();
    v.as_object_mut().unwrap().remove("id");
    v.as_object_mut().unwrap().remove("created");
    // Tool-call ids are unique per answer.
    if let Some(calls) = v["choices"][0]["message"]["tool_calls"].as_array_mut() {
        for c in calls {
            c.as_object_mut().unwrap().remove("id");
        }
    }
    v
}

#[test]
fn drafted_responses_equal_plain_responses() {
    let dir = root();
    let plain = start(dir.path(), None);
    let mut bodies = Vec::new();
    for (prompt, max) in [
        ("The capital of France is", 12),
        ("A story:", 24),
        ("def f(x):", 9),
    ] {
        for stream in [false, true] {
            bodies.push((
                "/v1/completions",
                json!({"prompt": prompt, "max_tokens": max, "stream": stream}),
            ));
        }
    }
    for stream in [false, true] {
        bodies.push((
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "stream": stream}),
        ));
    }
    // Constrained answers (a JSON schema, a required tool call): K3's argmax over what the
    // grammar allows, with drafts the grammar forbids simply rejected.
    let tool = json!({"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"which": {"type": "string", "enum": ["a", "b"]}},
        "required": ["which"]}}});
    let schema = json!({"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["ok", "n"], "additionalProperties": false});
    for stream in [false, true] {
        for thinking in ["none", "high"] {
            bodies.push((
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "JSON please"}],
                       "max_tokens": 40, "stream": stream, "reasoning_effort": thinking,
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "r", "schema": schema}}}),
            ));
        }
        bodies.push((
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Pick"}], "max_tokens": 40,
                   "stream": stream, "reasoning_effort": "none", "tools": [tool],
                   "tool_choice": "required"}),
        ));
    }
    // Seeded sampling: the same seed gives the same answer with drafting on.
    for stream in [false, true] {
        bodies.push((
            "/v1/completions",
            json!({"prompt": "A story:", "max_tokens": 16, "stream": stream,
                   "temperature": 1.0, "top_p": 0.95, "seed": 11}),
        ));
        bodies.push((
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16,
                   "stream": stream, "temperature": 0.7, "seed": 12, "reasoning_effort": "none"}),
        ));
    }
    let mut want: Vec<Value> = bodies.iter().map(|(p, b)| answer(&plain, p, b)).collect();
    // The thinking-off constrained answers are complete: the schema's JSON, the forced call.
    for w in &want {
        let Some(choice) = w.get("choices").map(|c| &c[0]) else {
            continue;
        };
        if choice["finish_reason"] == "tool_calls" {
            let args = choice["message"]["tool_calls"][0]["function"]["arguments"]
                .as_str()
                .unwrap();
            let args: Value = serde_json::from_str(args).unwrap();
            assert!(
                args == json!({"which": "a"}) || args == json!({"which": "b"}),
                "{args}"
            );
        }
    }
    // Stop sequences cut mid-proposal: take one from the middle of the plain text.
    let text = want[2]["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 8, "{text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    for stream in [false, true] {
        let b = json!({"prompt": "A story:", "max_tokens": 24, "stop": stop, "stream": stream});
        want.push(answer(&plain, "/v1/completions", &b));
        bodies.push(("/v1/completions", b));
    }
    assert_eq!(
        want.last().unwrap().as_array().unwrap().last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
    drop(plain);

    let configs = [
        SpecConfig {
            dspark: DraftMode::On,
            ..SpecConfig::default()
        },
        SpecConfig {
            dspark: DraftMode::Auto,
            uag: DraftMode::On,
            depth: 4,
            ..SpecConfig::default()
        },
        SpecConfig::default(),
    ];
    for spec in configs {
        let s = start(dir.path(), Some(spec.clone()));
        for ((path, body), w) in bodies.iter().zip(&want) {
            assert_eq!(&answer(&s, path, body), w, "{spec:?} {path} {body}");
        }
    }
}

/// A chat continued over two turns with every drafter configuration and prefix states kept
/// (the second turn resumes from the first's; DSpark gets the restored prefix's taps):
/// the answers are the plain server's.
#[test]
fn drafted_turns_from_stored_states_equal_plain_turns() {
    let dir = root();
    let system: String = (0..30)
        .map(|i| format!("Rule {i}: be brief and exact."))
        .collect::<Vec<_>>()
        .join(" ");
    let turn1 = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": "Name a colour."}),
    ];
    let body = |m: &Vec<Value>, stream: bool| json!({"messages": m, "max_tokens": 10, "reasoning_effort": "none", "stream": stream});
    let plain = start(dir.path(), None);
    let a1 = answer(&plain, "/v1/chat/completions", &body(&turn1, false));
    let said = a1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let mut turn2 = turn1.clone();
    turn2.push(json!({"role": "assistant", "content": said}));
    turn2.push(json!({"role": "user", "content": "Another one?"}));
    let want: Vec<Value> = [(&turn1, false), (&turn2, false), (&turn2, true)]
        .iter()
        .map(|(m, stream)| answer(&plain, "/v1/chat/completions", &body(m, *stream)))
        .collect();
    drop(plain);
    for spec in [
        None,
        Some(SpecConfig {
            dspark: DraftMode::On,
            ..SpecConfig::default()
        }),
    ] {
        let states = tempfile::tempdir().unwrap();
        let s = start_cached(dir.path(), spec.clone(), Some(states.path().to_path_buf()));
        let got: Vec<Value> = [(&turn1, false), (&turn2, false), (&turn2, true)]
            .iter()
            .map(|(m, stream)| answer(&s, "/v1/chat/completions", &body(m, *stream)))
            .collect();
        assert_eq!(got, want, "spec {spec:?}");
        let metrics = String::from_utf8(get(s.addr, "/metrics").body).unwrap();
        let reused: f64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix("deltafin_prefix_reused_tokens_total "))
            .and_then(|v| v.parse().ok())
            .unwrap();
        assert!(reused >= 128.0, "reused {reused} with {spec:?}");
    }
}
