//! Every refusal an agent or a client library can meet, with its exact status and message
//! (tests/fixtures/refusals.json): a message is part of the interface (it says what to change),
//! so a change to one is a deliberate edit of the fixture. `DELTAFIN_BLESS=1` writes what the
//! server answers now into the fixture's `status` and `message` (review the diff).

mod common;

use common::*;
use deltafin_openai::ServerConfig;
use serde_json::Value;

/// The message of an error body in any of the server's shapes: OpenAI's and Anthropic's
/// `error.message`, Ollama's `error` string.
fn message(body: &Value) -> Option<&str> {
    body["error"]["message"]
        .as_str()
        .or_else(|| body["error"].as_str())
}

#[test]
fn each_refusal_says_what_to_change() {
    let path = format!(
        "{}/tests/fixtures/refusals.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap();
    let mut cases: Vec<Value> = serde_json::from_str(&text).unwrap();
    let s = TestServer::start(ServerConfig {
        queue: 4,
        max_tokens: 4096,
        ..any_port()
    });
    s.wait_ready();
    let bless = std::env::var("DELTAFIN_BLESS").as_deref() == Ok("1");
    let mut wrong = Vec::new();
    for case in &mut cases {
        let what = case["what"].as_str().unwrap().to_string();
        let r = post_json(s.addr, case["path"].as_str().unwrap(), &case["body"]);
        let body: Value = serde_json::from_slice(&r.body)
            .unwrap_or_else(|e| panic!("{what}: the error body is not JSON ({e})"));
        let got = message(&body)
            .unwrap_or_else(|| panic!("{what}: no error message in {body}"))
            .to_string();
        assert!(r.status >= 400, "{what}: answered {} {body}", r.status);
        if bless {
            case["status"] = Value::from(r.status);
            case["message"] = Value::from(got);
        } else if case["status"] != r.status || case["message"] != got.as_str() {
            wrong.push(format!(
                "{what}:\n  expected {} {}\n  got      {} {got:?}",
                case["status"], case["message"], r.status
            ));
        }
    }
    if bless {
        let mut out = String::from("[\n");
        for (i, c) in cases.iter().enumerate() {
            out.push_str("  ");
            out.push_str(&c.to_string());
            out.push_str(if i + 1 < cases.len() { ",\n" } else { "\n" });
        }
        out.push_str("]\n");
        std::fs::write(&path, out).unwrap();
        eprintln!("DELTAFIN_BLESS=1: wrote {} refusals to {path}", cases.len());
    }
    assert!(
        wrong.is_empty(),
        "{} refusals changed:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}
