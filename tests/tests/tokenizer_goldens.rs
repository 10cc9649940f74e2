//! Tokenizer parity with Python tiktoken 0.14.0 + Moonshot's wrapper
//! (fixture from tools/oracle/tokenizer_goldens.py).

use std::path::Path;

use deltafin_k3::text::tokenizer::Tokenizer;
use serde_json::Value;

fn tokenizer() -> Tokenizer {
    let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../assets/kimi"));
    Tokenizer::from_dir(dir).expect("load assets/kimi")
}

fn load_cases() -> Vec<Value> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/tokenizer/goldens.json"
    );
    let text = std::fs::read_to_string(path).expect("read goldens.json");
    let doc: Value = serde_json::from_str(&text).expect("parse goldens.json");
    doc["cases"].as_array().expect("cases array").clone()
}

/// The case text: `text`, or the concatenation of `parts[i].repeat` × `parts[i].count`.
fn case_text(case: &Value) -> String {
    if let Some(t) = case.get("text") {
        return t.as_str().expect("text is a string").to_string();
    }
    let parts = case["parts"].as_array().expect("text or parts");
    parts
        .iter()
        .map(|p| {
            let s = p["repeat"].as_str().expect("repeat");
            let n = p["count"].as_u64().expect("count") as usize;
            s.repeat(n)
        })
        .collect()
}

fn ids(case: &Value) -> Vec<u32> {
    case["ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
}

fn preview(s: &str) -> String {
    if s.chars().count() > 200 {
        format!(
            "{:?}… ({} chars)",
            s.chars().take(200).collect::<String>(),
            s.chars().count()
        )
    } else {
        format!("{s:?}")
    }
}

#[test]
fn tokenizer_matches_tiktoken_goldens() {
    let tok = tokenizer();
    let cases = load_cases();
    assert!(cases.len() >= 300, "only {} cases", cases.len());
    let mut long = 0;
    for (i, case) in cases.iter().enumerate() {
        let text = case_text(case);
        let allow = case["allow_special"].as_bool().expect("allow_special");
        let expected = ids(case);
        let got = tok.encode(&text, allow);
        if got != expected {
            let first = got
                .iter()
                .zip(&expected)
                .position(|(a, b)| a != b)
                .unwrap_or(got.len().min(expected.len()));
            let lo = first.saturating_sub(5);
            panic!(
                "case {i} (allow_special={allow}) text {}\n first difference at id index {first}\n \
                 ours     [{lo}..]: {:?}\n expected [{lo}..]: {:?}\n ours (all, {} ids): {:?}\n expected (all, {} ids): {:?}",
                preview(&text),
                &got[lo..(lo + 12).min(got.len())],
                &expected[lo..(lo + 12).min(expected.len())],
                got.len(),
                if got.len() <= 200 {
                    &got[..]
                } else {
                    &got[..200]
                },
                expected.len(),
                if expected.len() <= 200 {
                    &expected[..]
                } else {
                    &expected[..200]
                },
            );
        }
        if text.chars().count() > 25_000 {
            long += 1;
        }
    }
    assert!(
        long >= 8,
        "expected long (>25,000 char) cases, found {long}"
    );
}

#[test]
fn decode_round_trips_golden_texts() {
    let tok = tokenizer();
    for (i, case) in load_cases().iter().enumerate() {
        let text = case_text(case);
        let allow = case["allow_special"].as_bool().expect("allow_special");
        let encoded = tok.encode(&text, allow);
        let bytes = tok.decode_bytes(&encoded).expect("ids in range");
        assert_eq!(bytes, text.as_bytes(), "case {i}: {}", preview(&text));
        assert_eq!(
            tok.decode(&encoded).expect("ids in range"),
            text,
            "case {i}"
        );
    }
}

#[test]
fn specials_on_and_off_differ_only_where_spelled() {
    let tok = tokenizer();
    let text = "a <|open|> b [BOS] c <|reserved_token_163700|>";
    let on = tok.encode(text, true);
    let off = tok.encode_ordinary(text);
    assert!(on.contains(&163587) && on.contains(&163584) && on.contains(&163700));
    assert!(off.iter().all(|&id| id < 163_584), "{off:?}");
}
