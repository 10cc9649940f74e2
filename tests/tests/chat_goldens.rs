//! XTML chat encoding parity with NeMo-Automodel 0.7.0's renderer + tiktoken
//! (fixture from tools/oracle/chat_goldens.py).

use std::path::Path;

use deltafin_k3::text::chat::{
    ChatMessage, ChatOptions, ResponseFormat, ToolChoice, encode_chat, render_segments,
};
use deltafin_k3::text::tokenizer::Tokenizer;
use serde_json::Value;

fn tokenizer() -> Tokenizer {
    let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/kimi"));
    Tokenizer::from_dir(dir).expect("load assets/kimi")
}

fn options(o: &Value) -> ChatOptions {
    ChatOptions {
        thinking: o["thinking"].as_bool().expect("thinking"),
        effort: o["effort"]
            .as_str()
            .map(|e| e.parse().expect("valid effort")),
        add_generation_prompt: o["add_generation_prompt"]
            .as_bool()
            .expect("add_generation_prompt"),
        tools: o["tools"].as_array().expect("tools").clone(),
        tool_choice: match &o["tool_choice"] {
            Value::Null => None,
            Value::String(s) if s == "required" => Some(ToolChoice::Required),
            Value::String(s) if s == "none" => Some(ToolChoice::Forbidden),
            // A named function has no frame in the reference: nothing is rendered.
            Value::Object(named) if named["type"] == "function" => None,
            other => panic!("fixture tool_choice {other}"),
        },
        response_format: match o["response_format"]["type"].as_str() {
            None => None,
            Some("json_object") => Some(ResponseFormat::JsonObject),
            Some("json_schema") => Some(ResponseFormat::JsonSchema(
                o["response_format"]["json_schema"]["schema"].clone(),
            )),
            Some(other) => panic!("fixture response_format {other}"),
        },
    }
}

#[test]
fn chat_matches_nemo_goldens() {
    let tok = tokenizer();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/chat/goldens.json");
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("parse");
    let cases = doc["cases"].as_array().expect("cases");
    assert!(cases.len() >= 40, "only {} conversations", cases.len());
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let messages: Vec<ChatMessage> = case["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|m| ChatMessage::from_json(m).unwrap_or_else(|e| panic!("{name}: {e}")))
            .collect();
        let opts = options(&case["options"]);
        let expected: Vec<u32> = case["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        let got = encode_chat(&tok, &messages, &opts).unwrap_or_else(|e| panic!("{name}: {e}"));
        if got != expected {
            let segments = render_segments(&messages, &opts).expect("rendered above");
            let ours = tok.decode(&got).expect("in range");
            let first = got
                .iter()
                .zip(&expected)
                .position(|(a, b)| a != b)
                .unwrap_or(got.len().min(expected.len()));
            panic!(
                "case {name}: first difference at id {first}\n ours: {:?}\n want: {:?}\n \
                 ours text: {ours:?}\n want text: {:?}\n segments: {segments:?}",
                &got[first.saturating_sub(4)..(first + 8).min(got.len())],
                &expected[first.saturating_sub(4)..(first + 8).min(expected.len())],
                case["text"].as_str().unwrap_or_default(),
            );
        }
        // The rendered text (specials by spelling) is what NeMo rendered.
        assert_eq!(
            tok.decode(&got).expect("in range"),
            case["text"].as_str().expect("text"),
            "case {name}"
        );
    }
}

#[test]
fn spec_golden_user_hello() {
    let tok = tokenizer();
    let ids = encode_chat(
        &tok,
        &[ChatMessage::new("user", "Hello")],
        &ChatOptions {
            thinking: false,
            ..Default::default()
        },
    )
    .expect("encode");
    assert_eq!(
        ids,
        [
            163587, 2778, 6244, 878, 2482, 1, 163589, 19180, 163588, 2778, 163589, 163586, 163587,
            2778, 6244, 878, 69702, 1, 163589, 163587, 12092, 163589
        ]
    );
}
