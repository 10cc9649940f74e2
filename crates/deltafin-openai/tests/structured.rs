//! Structured output end to end on the synthesized tiny checkpoint: `response_format`
//! JSON modes over HTTP give answers that parse and validate against the schema (checked by
//! the independent `jsonschema` validator), equal to K3's argmax over what the grammar
//! allows, streamed and not; schemas the grammar engine cannot compile are a 400.

mod common;

use common::*;
use deltafin_openai::ServerConfig;
use serde_json::{Value, json};
use std::sync::OnceLock;

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

fn chat(body: &Value) -> Value {
    let r = post_json(server().addr, "/v1/chat/completions", body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

/// The schemas of the test: nested objects, arrays, enums, numbers, unicode strings,
/// `additionalProperties: false`. Free strings and arrays are bounded so that a random-weight
/// model finishes inside `max_tokens`.
fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 150}},
            "required": ["name", "age"], "additionalProperties": false}),
        json!({"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Zürich", "東京", "São Paulo"]},
            "temp": {"type": "number", "minimum": -50, "maximum": 60},
            "ok": {"type": "boolean"}},
            "required": ["city", "temp", "ok"], "additionalProperties": false}),
        json!({"type": "object", "properties": {
            "items": {"type": "array", "minItems": 1, "maxItems": 3,
                      "items": {"type": "object", "properties": {
                          "id": {"type": "integer", "minimum": 1, "maximum": 9},
                          "tag": {"enum": ["a", "b", null]}},
                          "required": ["id", "tag"], "additionalProperties": false}},
            "meta": {"type": "object", "properties": {
                "v": {"const": 2}}, "required": ["v"], "additionalProperties": false}},
            "required": ["items", "meta"], "additionalProperties": false}),
        json!({"type": "array", "items": {"type": "string", "enum": ["x", "ÿ", "🙂"]},
               "minItems": 2, "maxItems": 4}),
    ]
}

fn body(format: Value, stream: bool) -> Value {
    json!({"messages": [{"role": "user", "content": "Answer in JSON."}],
           "reasoning_effort": "none", "max_tokens": 160, "stream": stream,
           "response_format": format})
}

fn streamed_content(body: &Value) -> (String, Value) {
    let r = post_json(server().addr, "/v1/chat/completions", body);
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let mut text = String::new();
    let mut finish = Value::Null;
    for f in r.sse().iter().filter(|f| f.as_str() != "[DONE]") {
        let v: Value = serde_json::from_str(f).unwrap();
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            text += c;
        }
        if !v["choices"][0]["finish_reason"].is_null() {
            finish = v["choices"][0]["finish_reason"].clone();
        }
    }
    (text, finish)
}

#[test]
fn json_schema_answers_validate() {
    for schema in schemas() {
        let validator = jsonschema::validator_for(&schema).unwrap();
        let format = json!({"type": "json_schema",
                            "json_schema": {"name": "answer", "schema": schema, "strict": true}});
        let v = chat(&body(format.clone(), false));
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "stop", "{v}");
        let text = c["message"]["content"].as_str().unwrap();
        let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        let errors: Vec<String> = validator
            .iter_errors(&parsed)
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{text} against {schema}: {errors:?}");
        // Streaming gives the same content.
        let (streamed, finish) = streamed_content(&body(format, true));
        assert_eq!((streamed.as_str(), finish), (text, json!("stop")));
    }
}

#[test]
fn json_object_answers_are_objects() {
    let v = chat(&body(json!({"type": "json_object"}), false));
    let c = &v["choices"][0];
    let text = c["message"]["content"].as_str().unwrap();
    if c["finish_reason"] == "stop" {
        let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert!(parsed.is_object(), "{text}");
    } else {
        // Cut by max_tokens: still the start of an object.
        assert_eq!(c["finish_reason"], "length");
        assert!(text.starts_with('{'), "{text}");
    }
}

#[test]
fn unconstrained_and_constrained_answers_differ_on_a_random_model() {
    // Without the grammar the tiny model's argmax is not JSON: the constraint does the work.
    let free = chat(
        &json!({"messages": [{"role": "user", "content": "Answer in JSON."}],
                            "reasoning_effort": "none", "max_tokens": 24}),
    );
    let text = free["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("");
    assert!(serde_json::from_str::<Value>(text).is_err(), "{text}");
}

#[test]
fn bad_formats_are_refused() {
    let a = server().addr;
    for (format, needle) in [
        (json!({"type": "xml"}), "response_format.type"),
        (
            json!({"type": "json_object", "schema": {}}),
            "unknown field `schema`",
        ),
        (
            json!({"type": "json_schema"}),
            "json_schema` must be a JSON object",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"schema": {}}}),
            "json_schema.name",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}),
            "cannot constrain",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}),
            "must be a JSON object",
        ),
    ] {
        let r = post_json(a, "/v1/chat/completions", &body(format.clone(), false));
        assert_eq!(r.status, 400, "{format}");
        let v = r.json();
        assert_eq!(v["error"]["param"], "response_format", "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{format}: {msg}");
    }
}
