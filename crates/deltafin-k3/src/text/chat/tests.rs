use super::message::*;
use super::options::*;
use super::py_json::*;
use super::render::*;
use crate::text::tokenizer::{self};
use serde_json::json;

fn texts(segs: &[Segment]) -> String {
    segs.iter()
        .map(|s| match s {
            Segment::Special(tokenizer::OPEN) => "<|open|>".to_string(),
            Segment::Special(tokenizer::CLOSE) => "<|close|>".to_string(),
            Segment::Special(tokenizer::SEP) => "<|sep|>".to_string(),
            Segment::Special(tokenizer::END_OF_MSG) => "<|end_of_msg|>".to_string(),
            Segment::Special(id) => format!("<{id}>"),
            Segment::Text(t) => t.clone(),
            Segment::Ids(ids) => format!("{ids:?}"),
        })
        .collect()
}

fn no_think() -> ChatOptions {
    ChatOptions {
        thinking: false,
        ..Default::default()
    }
}

#[test]
fn user_hello_segments() {
    let segs = render_segments(&[ChatMessage::new("user", "Hello")], &no_think()).unwrap();
    assert_eq!(
        texts(&segs),
        "<|open|>message role=\"user\"<|sep|>Hello<|close|>message<|sep|><|end_of_msg|>\
         <|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>"
    );
    // Attribute pieces are separate segments.
    assert_eq!(segs[1], Segment::Text("message".into()));
    assert_eq!(segs[2], Segment::Text(" role".into()));
    assert_eq!(segs[3], Segment::Text("=\"".into()));
    assert_eq!(segs[4], Segment::Text("user".into()));
    assert_eq!(segs[5], Segment::Text("\"".into()));
}

#[test]
fn default_effort_is_max_when_thinking() {
    let segs = render_segments(&[ChatMessage::new("user", "hi")], &ChatOptions::default()).unwrap();
    let t = texts(&segs);
    assert!(t.starts_with("<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>"));
    assert!(t.contains("`thinking_effort=max`."));
    assert!(t.ends_with("<|open|>think<|sep|>"));
    let low = ChatOptions {
        effort: Some(ReasoningEffort::Low),
        ..Default::default()
    };
    assert!(texts(&render_segments(&[], &low).unwrap()).contains("`thinking_effort=low`."));
    let off = ChatOptions {
        effort: Some(ReasoningEffort::High),
        ..no_think()
    };
    assert!(!texts(&render_segments(&[], &off).unwrap()).contains("thinking_effort"));
}

#[test]
fn attribute_values_are_escaped() {
    let mut m = ChatMessage::new("user", "x");
    m.name = Some("Tom \"& Jerry\"".into());
    let t = texts(&render_segments(&[m], &no_think()).unwrap());
    assert!(
        t.contains(" name=\"Tom &quot;&amp; Jerry&quot;\"<|sep|>"),
        "{t}"
    );
    assert_eq!(escape("a&quot;"), "a&amp;quot;");
    assert_eq!(escape("<|open|>'"), "<|open|>'");
}

/// A tool call with an id.
fn call(id: &str, name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        id: Some(id.into()),
        name: name.into(),
        arguments: arguments.into(),
    }
}

#[test]
fn tool_index_counter_restarts_per_assistant() {
    let mut a1 = ChatMessage::new("assistant", "");
    a1.tool_calls = vec![call("c1", "f", "{}"), call("c2", "g", "")];
    let tool = |content: &str| ChatMessage {
        role: "tool".into(),
        content: Some(Content::Text(content.into())),
        ..Default::default()
    };
    let a2 = a1.clone();
    let msgs = vec![a1, tool("r1"), tool("r2"), a2, tool("s1")];
    let t = texts(&render_segments(&msgs, &no_think()).unwrap());
    assert!(
        t.contains("role=\"tool\" tool=\"f\" index=\"1\"<|sep|>r1"),
        "{t}"
    );
    assert!(
        t.contains("role=\"tool\" tool=\"g\" index=\"2\"<|sep|>r2"),
        "{t}"
    );
    assert!(
        t.contains("role=\"tool\" tool=\"f\" index=\"1\"<|sep|>s1"),
        "{t}"
    );
    assert!(t.contains(
        "<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|close|>call<|sep|>\
         <|open|>call tool=\"g\" index=\"2\"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
    ));
}

#[test]
fn matched_tool_results_are_reordered() {
    let mut a = ChatMessage::new("assistant", "");
    a.tool_calls = vec![call("x", "first", "{}"), call("y", "second", "{}")];
    let res = |id: &str, name: &str, c: &str| ChatMessage {
        role: "tool".into(),
        content: Some(Content::Text(c.into())),
        tool_call_id: Some(id.into()),
        name: Some(name.into()),
        ..Default::default()
    };
    let msgs = vec![a, res("y", "stale", "B"), res("x", "stale", "A")];
    let t = texts(&render_segments(&msgs, &no_think()).unwrap());
    let a_at = t.find("tool=\"first\" index=\"1\"<|sep|>A").expect(&t);
    let b_at = t.find("tool=\"second\" index=\"2\"<|sep|>B").expect(&t);
    assert!(a_at < b_at);
}

#[test]
fn unknown_role_and_unresolved_tool_are_errors() {
    let err = render_segments(&[ChatMessage::new("developer", "x")], &no_think()).unwrap_err();
    assert!(err.to_string().contains("\"developer\""), "{err}");
    let err = render_segments(&[ChatMessage::new("tool", "x")], &no_think()).unwrap_err();
    assert!(
        matches!(err, ChatError::UnresolvedToolName { index: 0 }),
        "{err}"
    );
}

#[test]
fn tool_arguments_render_per_type() {
    let mut a = ChatMessage::new("assistant", "ok");
    a.tool_calls = vec![ToolCall {
        id: None,
        name: "f".into(),
        arguments:
            r#"{"s":"str","n":1.5,"i":-3,"b":true,"z":null,"o":{"k":[1,"é"]},"a":[1e100,2]}"#.into(),
    }];
    let t = texts(&render_segments(&[a.clone()], &no_think()).unwrap());
    for (k, ty, v) in [
        ("s", "string", "str"),
        ("n", "number", "1.5"),
        ("i", "number", "-3"),
        ("b", "boolean", "true"),
        ("z", "null", "null"),
        ("o", "object", "{\"k\": [1, \"é\"]}"),
        ("a", "array", "[1e+100, 2]"),
    ] {
        let want =
            format!("<|open|>argument key=\"{k}\" type=\"{ty}\"<|sep|>{v}<|close|>argument<|sep|>");
        assert!(t.contains(&want), "{want} not in {t}");
    }
    a.tool_calls[0].arguments = "not json".into();
    let t = texts(&render_segments(&[a.clone()], &no_think()).unwrap());
    assert!(t.contains("<|open|>json type=\"object\"<|sep|>not json<|close|>json<|sep|>"));
    a.tool_calls[0].arguments = "[1]".into();
    let err = render_segments(&[a], &no_think()).unwrap_err();
    assert!(err.to_string().contains("found array"), "{err}");
}

#[test]
fn python_float_repr() {
    for (f, s) in [
        (1.5, "1.5"),
        (100.0, "100.0"),
        (1e16, "1e+16"),
        (1e15, "1000000000000000.0"),
        (0.0001, "0.0001"),
        (0.00001, "1e-05"),
        (-2.5e-7, "-2.5e-07"),
        (123456789.125, "123456789.125"),
        (0.1, "0.1"),
        (-0.0, "-0.0"),
        (1.7976931348623157e308, "1.7976931348623157e+308"),
    ] {
        assert_eq!(py_float_repr(f), s, "{f}");
    }
}

#[test]
fn tools_json_is_sorted_and_compact() {
    let v = json!([{"b": 1, "a": {"d": "ü", "c": [true, null]}}]);
    assert_eq!(
        py_json_compact_sorted(&v),
        r#"[{"a":{"c":[true,null],"d":"ü"},"b":1}]"#
    );
    assert_eq!(
        py_json(&json!("a\u{1}\n\"\\"), ",", ":", true),
        r#""a\u0001\n\"\\""#
    );
}

#[test]
fn effort_parsing_is_strict() {
    assert_eq!(
        "medium".parse::<ReasoningEffort>(),
        Ok(ReasoningEffort::Medium)
    );
    let err = "MAX".parse::<ReasoningEffort>().unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("\"MAX\"") && msg.contains("low, medium, high, max"),
        "{msg}"
    );
}

#[test]
fn thinking_spellings() {
    use ReasoningEffort::*;
    for (raw, want) in [
        ("none", Thinking::Off),
        (" OFF ", Thinking::Off),
        ("Minimal", Thinking::Off),
        ("low", Thinking::On(Low)),
        ("medium", Thinking::On(Medium)),
        (" High", Thinking::On(High)),
        ("MAX", Thinking::On(Max)),
    ] {
        assert_eq!(Thinking::parse(raw), Ok(want), "{raw:?}");
        assert_eq!(raw.parse::<Thinking>(), Ok(want), "{raw:?}");
    }
    let err = Thinking::parse("extreme").unwrap_err();
    assert_eq!(err.value, "extreme");
    assert!(
        err.to_string().contains("`minimal` (thinking off)"),
        "{err}"
    );
    assert!(Thinking::parse("").is_err());
    let mut opts = ChatOptions::default();
    Thinking::Off.apply(&mut opts);
    assert!(!opts.thinking && opts.effort.is_none());
    Thinking::On(Medium).apply(&mut opts);
    assert!(opts.thinking && opts.effort == Some(Medium));
}

#[test]
fn thinking_display_and_chat_options() {
    assert_eq!(Thinking::Off.to_string(), "none");
    assert_eq!(Thinking::On(ReasoningEffort::High).to_string(), "high");
    assert_eq!(Thinking::Off.chat_options(), no_think());
    let on = Thinking::On(ReasoningEffort::Low).chat_options();
    assert_eq!((on.thinking, on.effort), (true, Some(ReasoningEffort::Low)));
    let off = texts(&render_segments(&[], &Thinking::Off.chat_options()).unwrap());
    assert!(off.ends_with("<|open|>response<|sep|>") && !off.contains("thinking_effort"));
}

#[test]
fn message_from_json() {
    let m = ChatMessage::from_json(&json!({
        "role": "assistant",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        "tool_calls": [{"id": "1", "type": "function",
                        "function": {"name": "f", "arguments": {"q": 1}}}]
    }))
    .unwrap();
    assert_eq!(
        m.content,
        Some(Content::Parts(vec!["a".into(), "b".into()]))
    );
    assert_eq!(m.tool_calls[0].arguments, r#"{"q":1}"#);
    let err = ChatMessage::from_json(&json!({"role": "user", "contnet": "x"})).unwrap_err();
    assert!(err.to_string().contains("`contnet`"), "{err}");
    let err = ChatMessage::from_json(&json!({"role": "user", "content": [{"type": "image_url"}]}))
        .unwrap_err();
    assert!(err.to_string().contains("content part 0"), "{err}");
}

#[test]
fn py_str_matches_python_json_both_ways() {
    // json.dumps("é\x7f\n\x01😀") and json.dumps(..., ensure_ascii=False).
    let s = "é\u{7f}\n\u{1}😀";
    let (mut ascii, mut raw) = (String::new(), String::new());
    write_py_str(&mut ascii, s, true);
    write_py_str(&mut raw, s, false);
    assert_eq!(ascii, r#""\u00e9\u007f\n\u0001\ud83d\ude00""#);
    assert_eq!(raw, "\"é\u{7f}\\n\\u0001😀\"");
}
