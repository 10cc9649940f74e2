//! Several requests at once (`--parallel`): N concurrent requests (N = 1…9, mixed prompt
//! lengths and budgets, mixed endpoints, greedy, seeded sampling, a grammar and logprobs, one streaming
//! client that leaves midway) each get exactly the answer they get alone, their decode steps
//! really share passes, and the reserve and slots are free afterwards.

mod common;

use common::*;
use deltafin_openai::ServerConfig;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::time::Duration;

fn start(parallel: usize) -> TestServer {
    let root = model_root().to_path_buf();
    let s = TestServer::start_with(
        ServerConfig {
            queue: 16,
            ..any_port()
        },
        move || load_engine(&root).map(|e| e.with_parallel(Some((parallel, "test")))),
    );
    s.wait_ready();
    s
}

/// One request: the path, the body, and extra headers.
#[derive(Clone)]
struct Req {
    path: &'static str,
    body: Value,
}

fn send(s: &TestServer, r: &Req) -> Resp {
    let extra: &[(&str, &str)] = if r.path == "/v1/messages" {
        &[("anthropic-version", "2023-06-01")]
    } else {
        &[]
    };
    let mut c = connect(s.addr);
    c.write_all(&request_bytes(
        "POST",
        r.path,
        r.body.to_string().as_bytes(),
        extra,
    ))
    .unwrap();
    read_all(&mut c)
}

/// What of an answer must not depend on what ran beside it: everything but ids, times and
/// the fingerprint.
fn answer(r: &Resp) -> Value {
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let mut v = r.json();
    strip(&mut v);
    v
}

fn strip(v: &mut Value) {
    match v {
        Value::Object(m) => {
            for k in [
                "id",
                "created",
                "created_at",
                "completed_at",
                "system_fingerprint",
            ] {
                m.remove(k);
            }
            for (_, x) in m.iter_mut() {
                strip(x);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(strip),
        _ => {}
    }
}

/// Nine different requests over four endpoints (one constrained by a JSON schema).
fn requests() -> Vec<Req> {
    let long: String = (0..60).map(|i| format!("word{i} ")).collect();
    vec![
        Req {
            path: "/v1/completions",
            body: json!({"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0}),
        },
        Req {
            path: "/v1/chat/completions",
            body: json!({"messages": [{"role": "user", "content": "Hello there"}],
                         "max_tokens": 16, "reasoning_effort": "none"}),
        },
        Req {
            path: "/v1/completions",
            body: json!({"prompt": long, "max_tokens": 9, "temperature": 0.8, "seed": 42}),
        },
        Req {
            path: "/v1/messages",
            body: json!({"model": "deltafin-kimi-k3", "max_tokens": 20,
                         "messages": [{"role": "user", "content": "Write a title"}]}),
        },
        Req {
            path: "/v1/chat/completions",
            body: json!({"messages": [{"role": "user", "content": "Count"}],
                         "max_tokens": 12, "logprobs": true, "top_logprobs": 3,
                         "reasoning_effort": "none"}),
        },
        Req {
            path: "/v1/responses",
            body: json!({"input": "Summarize: a b c", "max_output_tokens": 18, "store": false}),
        },
        Req {
            path: "/v1/completions",
            body: json!({"prompt": "x", "max_tokens": 30, "temperature": 1.0, "seed": 7}),
        },
        Req {
            path: "/v1/chat/completions",
            body: json!({"messages": [{"role": "user", "content": "Answer in JSON."}],
                         "reasoning_effort": "none", "max_tokens": 40,
                         "response_format": {"type": "json_schema", "json_schema": {
                             "name": "t", "strict": true, "schema": {
                                 "type": "object",
                                 "properties": {"ok": {"type": "boolean"},
                                                "n": {"type": "integer", "minimum": 1, "maximum": 9}},
                                 "required": ["ok", "n"], "additionalProperties": false}}}}),
        },
        Req {
            path: "/v1/chat/completions",
            body: json!({"messages": [{"role": "system", "content": long},
                                      {"role": "user", "content": "and?"}],
                         "max_tokens": 10, "reasoning_effort": "none"}),
        },
    ]
}

fn metric(s: &TestServer, name: &str) -> f64 {
    let text = String::from_utf8(get(s.addr, "/metrics").body).unwrap();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix(' '))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

#[test]
fn concurrent_requests_get_their_solo_answers() {
    let s = start(8);
    let reqs = requests();
    let solo: Vec<Value> = reqs.iter().map(|r| answer(&send(&s, r))).collect();
    for n in 1..=reqs.len() {
        let together: Vec<Value> = std::thread::scope(|sc| {
            let handles: Vec<_> = reqs[..n]
                .iter()
                .map(|r| {
                    let s = &s;
                    sc.spawn(move || answer(&send(s, r)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, (a, b)) in solo.iter().zip(&together).enumerate() {
            assert_eq!(a, b, "request {i} of {n} together differs from alone");
        }
    }
    assert!(
        metric(&s, "deltafin_largest_decode_batch") >= 2.0,
        "no decode pass ever ran two generations"
    );
    s.wait_idle();
    assert_eq!(metric(&s, "deltafin_state_reserved_bytes"), 0.0);
    assert_eq!(metric(&s, "deltafin_active_sequences"), 0.0);
    assert_eq!(metric(&s, "deltafin_parallel_sequences"), 8.0);
}

#[test]
fn a_client_leaving_midway_changes_no_other_answer() {
    let s = start(4);
    let reqs = requests();
    let picks = [0usize, 3, 4, 6];
    let solo: Vec<Value> = picks.iter().map(|&i| answer(&send(&s, &reqs[i]))).collect();
    let together: Vec<Value> = std::thread::scope(|sc| {
        // A long stream, dropped after its first few frames.
        sc.spawn(|| {
            let mut c = connect(s.addr);
            let body = json!({"prompt": "leave", "max_tokens": 100_000, "stream": true});
            c.write_all(&request_bytes(
                "POST",
                "/v1/completions",
                body.to_string().as_bytes(),
                &[],
            ))
            .unwrap();
            let mut r = BufReader::new(c);
            let mut frames = 0;
            let mut line = String::new();
            while frames < 4 {
                line.clear();
                if r.read_line(&mut line).unwrap() == 0 {
                    break;
                }
                frames += usize::from(line.starts_with("data: {"));
            }
        });
        std::thread::sleep(Duration::from_millis(20));
        let handles: Vec<_> = picks
            .iter()
            .map(|&i| {
                let (s, r) = (&s, &reqs[i]);
                sc.spawn(move || answer(&send(s, r)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(solo, together);
    s.wait_idle();
    assert_eq!(metric(&s, "deltafin_state_reserved_bytes"), 0.0);
}
