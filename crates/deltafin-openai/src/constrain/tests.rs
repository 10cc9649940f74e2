//! The answer grammar on scripted token streams: answers in the template's shape (rendered
//! with deltafin's tokenizer, the way the model would emit them) are accepted token by token
//! and end on `<|end_of_msg|>`; answers that break the constraint are refused at the first
//! token that breaks it.

use super::grammar::{Content, Shape, Tools};
use super::*;
use deltafin_k3::text::chat::ReasoningEffort;
use deltafin_k3::text::tokenizer::{CLOSE, OPEN, SEP};
use std::path::Path;
use std::sync::OnceLock;

fn kimi() -> Arc<Tokenizer> {
    static T: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/kimi"));
        Arc::new(Tokenizer::from_dir(dir).expect("load assets/kimi tokenizer"))
    })
    .clone()
}

fn grammars() -> &'static Grammars {
    static G: OnceLock<Grammars> = OnceLock::new();
    G.get_or_init(|| Grammars::new(kimi()).unwrap())
}

/// Ids of an answer written as pieces: `<open>tag` / `<close>tag` are markers, the rest text.
fn ids(pieces: &[&str]) -> Vec<u32> {
    let tok = kimi();
    let mut v = Vec::new();
    for p in pieces {
        if let Some(tag) = p.strip_prefix("<open>") {
            v.push(OPEN);
            v.extend(tok.encode_ordinary(tag));
            v.push(SEP);
        } else if let Some(tag) = p.strip_prefix("<close>") {
            v.push(CLOSE);
            v.extend(tok.encode_ordinary(tag));
            v.push(SEP);
        } else if *p == "<eom>" {
            v.push(END_OF_MSG);
        } else {
            v.extend(tok.encode_ordinary(p));
        }
    }
    v
}

/// How many ids the rule accepts (each one also being allowed by its mask).
fn accepted(shape: &Shape<'_>, answer: &[u32]) -> usize {
    let mut rule = grammars().rule(shape).unwrap();
    for (i, &id) in answer.iter().enumerate() {
        let mask = match rule.matcher.compute_mask() {
            Ok(m) => m,
            Err(_) => return i,
        };
        if !mask.is_allowed(id) || rule.accept(id).is_err() {
            return i;
        }
    }
    answer.len()
}

fn schema() -> Value {
    json!({"type": "object", "properties": {
        "name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"], "additionalProperties": false})
}

#[test]
fn json_content_after_thinking_and_without() {
    let s = schema();
    for thinking in [true, false] {
        let shape = Shape {
            thinking,
            content: Content::Json(&s),
            tools: Tools::Forbidden,
            parallel: true,
        };
        let mut good = if thinking {
            vec!["Let me see.", "<close>think", "<open>response"]
        } else {
            vec![]
        };
        good.extend([
            r#"{"name":"Zoë 🌍","n":42}"#,
            "<close>response",
            "<close>message",
            "<eom>",
        ]);
        let good = ids(&good);
        assert_eq!(accepted(&shape, &good), good.len(), "thinking {thinking}");

        let skip = usize::from(thinking) * 3;
        let mut pieces = if thinking {
            vec!["Let me see.", "<close>think", "<open>response"]
        } else {
            vec![]
        };
        for bad in [
            r#"{"name":"x","n":4.5}"#,
            r#"{"name":"x"}"#,
            r#"{"name":"x","n":1,"extra":1}"#,
            r#"Sure: {"name":"x","n":1}"#,
        ] {
            pieces.truncate(skip);
            pieces.extend([bad, "<close>response"]);
            let bad_ids = ids(&pieces);
            assert!(
                accepted(&shape, &bad_ids) < bad_ids.len(),
                "{bad} accepted (thinking {thinking})"
            );
        }
    }
}

fn tool(name: &str) -> Value {
    json!({"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer"}},
        "required": ["city"]}}})
}

#[test]
fn required_calls_take_declared_tools_in_both_argument_forms() {
    let tools = [tool("get_weather"), tool("get_time")];
    let shape = Shape {
        thinking: false,
        content: Content::Free,
        tools: Tools::Required(&tools),
        parallel: false,
    };
    let pieces = ids(&[
        "<close>response",
        "<open>tools",
        r#"<open>call tool="get_weather" index="1""#,
        r#"<open>argument key="city" type="string""#,
        "São Paulo",
        "<close>argument",
        r#"<open>argument key="unit" type="string""#,
        "celsius",
        "<close>argument",
        "<close>call",
        "<close>tools",
        "<close>message",
        "<eom>",
    ]);
    assert_eq!(accepted(&shape, &pieces), pieces.len());
    let raw = ids(&[
        "<close>response",
        "<open>tools",
        r#"<open>call tool="get_time" index="1""#,
        r#"<open>json type="object""#,
        r#"{"city":"Oslo","days":3}"#,
        "<close>json",
        "<close>call",
        "<close>tools",
        "<close>message",
        "<eom>",
    ]);
    assert_eq!(accepted(&shape, &raw), raw.len());
    // No call, content before a forced call, an undeclared tool, a value outside the enum, a
    // missing required argument, and a second call without parallel_tool_calls are refused.
    let refused: [&[&str]; 6] = [
        &["<close>response", "<close>message"],
        &["I will check.", "<close>response"],
        &[
            "<close>response",
            "<open>tools",
            r#"<open>call tool="rm_rf" index="1""#,
        ],
        &[
            "<close>response",
            "<open>tools",
            r#"<open>call tool="get_weather" index="1""#,
            r#"<open>argument key="city" type="string""#,
            "x",
            "<close>argument",
            r#"<open>argument key="unit" type="string""#,
            "kelvin",
        ],
        &[
            "<close>response",
            "<open>tools",
            r#"<open>call tool="get_weather" index="1""#,
            "<close>call",
        ],
        &[
            "<close>response",
            "<open>tools",
            r#"<open>call tool="get_time" index="1""#,
            r#"<open>json type="object""#,
            r#"{"city":"Oslo"}"#,
            "<close>json",
            "<close>call",
            r#"<open>call tool="get_time" index="2""#,
        ],
    ];
    for r in refused {
        let v = ids(r);
        assert!(accepted(&shape, &v) < v.len(), "accepted: {r:?}");
    }
}

#[test]
fn parallel_calls_count_their_index_up_to_the_cap() {
    let tools = [tool("get_time")];
    let shape = Shape {
        thinking: false,
        content: Content::Free,
        tools: Tools::Required(&tools),
        parallel: true,
    };
    let call = |k: usize| {
        vec![
            format!(r#"<open>call tool="get_time" index="{k}""#),
            r#"<open>json type="object""#.to_string(),
            r#"{"city":"Oslo"}"#.to_string(),
            "<close>json".to_string(),
            "<close>call".to_string(),
        ]
    };
    let answer = |ks: &[usize], close: bool| {
        let mut p = vec!["<close>response".to_string(), "<open>tools".to_string()];
        for &k in ks {
            p.extend(call(k));
        }
        if close {
            p.extend(["<close>tools", "<close>message", "<eom>"].map(String::from));
        }
        let p: Vec<&str> = p.iter().map(String::as_str).collect();
        ids(&p)
    };
    let two = answer(&[1, 2], true);
    assert_eq!(accepted(&shape, &two), two.len());
    let all: Vec<usize> = (1..=grammar::MAX_CALLS).collect();
    let full = answer(&all, true);
    assert_eq!(accepted(&shape, &full), full.len());
    for bad in [
        answer(&[1, 1], false),
        answer(&[2], false),
        answer(&(1..=grammar::MAX_CALLS + 1).collect::<Vec<_>>(), false),
    ] {
        assert!(accepted(&shape, &bad) < bad.len());
    }
}

#[test]
fn optional_calls_after_free_content_follow_the_schema() {
    // tool_choice auto with a strict tool: the model may answer in text, or call with
    // arguments that follow the schema.
    let tools = [tool("get_weather")];
    let shape = Shape {
        thinking: true,
        content: Content::Free,
        tools: Tools::Optional(&tools),
        parallel: true,
    };
    let text_only = ids(&[
        "Hmm.",
        "<close>think",
        "<open>response",
        "It is sunny.",
        "<close>response",
        "<close>message",
        "<eom>",
    ]);
    assert_eq!(accepted(&shape, &text_only), text_only.len());
    let call = ids(&[
        "Hmm.",
        "<close>think",
        "<open>response",
        "Checking.",
        "<close>response",
        "<open>tools",
        r#"<open>call tool="get_weather" index="1""#,
        r#"<open>argument key="city" type="string""#,
        "Lyon",
        "<close>argument",
        r#"<open>argument key="days" type="number""#,
        "3",
        "<close>argument",
        "<close>call",
        "<close>tools",
        "<close>message",
        "<eom>",
    ]);
    assert_eq!(accepted(&shape, &call), call.len());
    let bad_type = ids(&[
        "Hmm.",
        "<close>think",
        "<open>response",
        "<close>response",
        "<open>tools",
        r#"<open>call tool="get_weather" index="1""#,
        r#"<open>argument key="city" type="string""#,
        "Lyon",
        "<close>argument",
        r#"<open>argument key="days" type="number""#,
        "three",
    ]);
    assert!(accepted(&shape, &bad_type) < bad_type.len());
}

#[test]
fn a_named_choice_allows_only_that_tool() {
    let controls = ChatControls {
        tools: vec![tool("get_weather"), tool("get_time")],
        tool_mode: ToolMode::Named("get_time".into()),
        thinking: false,
        ..ChatControls::with_effort(ReasoningEffort::Max)
    };
    let mut rule = grammars().for_controls(&controls).unwrap().unwrap();
    let head = ids(&["<close>response", "<open>tools"]);
    for &id in &head {
        rule.accept(id).unwrap();
    }
    let named = ids(&[r#"<open>call tool="get_time" index="1""#]);
    let other = ids(&[r#"<open>call tool="get_weather" index="1""#]);
    let mut a = rule.matcher.deep_clone();
    assert!(a.consume_tokens(&named).is_ok());
    let mut b = rule.matcher.deep_clone();
    assert!(b.consume_tokens(&other).is_err());
}

#[test]
fn controls_without_a_constraint_build_no_rule() {
    let g = grammars();
    assert!(
        g.for_controls(&ChatControls::with_effort(ReasoningEffort::Max))
            .unwrap()
            .is_none()
    );
    let auto = ChatControls {
        tools: vec![tool("get_weather")],
        ..ChatControls::with_effort(ReasoningEffort::Max)
    };
    assert!(g.for_controls(&auto).unwrap().is_none());
    let mut strict = tool("get_weather");
    strict["function"]["strict"] = json!(true);
    let strict = ChatControls {
        tools: vec![strict],
        ..ChatControls::with_effort(ReasoningEffort::Max)
    };
    assert!(g.for_controls(&strict).unwrap().is_some());
    let bad = ChatControls {
        response_format: Some(ResponseFormat::JsonSchema(json!({"type": "no-such-type"}))),
        ..ChatControls::with_effort(ReasoningEffort::Max)
    };
    let Err(e) = g.for_controls(&bad) else {
        panic!("an invalid schema built a rule");
    };
    assert!(e.to_string().contains("cannot constrain"), "{e}");
}

#[test]
fn the_rule_takes_the_best_allowed_token() {
    let s = json!({"type": "object"});
    let shape = Shape {
        thinking: false,
        content: Content::Json(&s),
        tools: Tools::Forbidden,
        parallel: true,
    };
    let mut rule = grammars().rule(&shape).unwrap();
    let tok = kimi();
    let brace = tok.encode_ordinary("{");
    assert_eq!(brace.len(), 1);
    let mut logits = vec![0.0f32; tok.vocab_size()];
    // The model's favourite is plain text; `{` is second and must be chosen.
    let hello = tok.encode_ordinary("Hello")[0];
    logits[hello as usize] = 5.0;
    logits[brace[0] as usize] = 1.0;
    assert_eq!(rule.choose(0, &logits).unwrap(), brace[0]);
}
