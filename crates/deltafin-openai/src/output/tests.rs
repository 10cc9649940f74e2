//! Assembler tests on scripted token streams (ids rendered by deltafin's own renderer and
//! tokenizer where the model would emit the same shape).

use super::*;
use std::path::Path;

fn kimi() -> Tokenizer {
    let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/kimi"));
    Tokenizer::from_dir(dir).expect("load assets/kimi tokenizer")
}

fn run(tok: &Tokenizer, chat: bool, stops: &[&str], ids: &[u32]) -> (Vec<Delta>, Delta, bool) {
    let mut a = Assembler::new(tok, chat, stops.iter().map(|s| s.to_string()).collect());
    let mut deltas = Vec::new();
    for (i, &id) in ids.iter().enumerate() {
        let lp = TokenLogprob {
            id,
            logprob: -(i as f64),
            top: vec![],
        };
        deltas.push(a.push(id, Some(lp)).unwrap());
        if a.stop_hit() {
            break;
        }
    }
    deltas.push(a.finish().unwrap());
    let mut all = Delta::default();
    for d in &deltas {
        all.extend(d.clone());
    }
    (deltas, all, a.stop_hit())
}

fn marker(tok: &Tokenizer, open: bool, tag: &str) -> Vec<u32> {
    let mut v = vec![if open { OPEN } else { CLOSE }];
    v.extend(tok.encode_ordinary(tag));
    v.push(SEP);
    v
}

#[test]
fn chat_channels_split_on_ids() {
    let tok = kimi();
    let mut ids = tok.encode_ordinary("Let me think <|close|>think<|sep|> hard.");
    ids.extend(marker(&tok, false, "think"));
    ids.extend(marker(&tok, true, "response"));
    ids.extend(tok.encode_ordinary("Paris."));
    ids.extend(marker(&tok, false, "response"));
    ids.extend(marker(&tok, false, "message"));
    ids.push(END_OF_MSG);
    let (_, all, stopped) = run(&tok, true, &[], &ids);
    assert!(!stopped);
    assert_eq!(all.reasoning, "Let me think <|close|>think<|sep|> hard.");
    assert_eq!(all.content, "Paris.");
    let n_reason = tok
        .encode_ordinary("Let me think <|close|>think<|sep|> hard.")
        .len();
    assert_eq!(all.reasoning_logprobs.len(), n_reason);
    assert_eq!(
        all.content_logprobs.len(),
        tok.encode_ordinary("Paris.").len()
    );
    // Offsets are character positions in the channel text.
    assert_eq!(all.content_logprobs[0].text_offset, 0);
}

#[test]
fn overlong_marker_is_text_and_specials_are_not() {
    let tok = kimi();
    let mut ids = vec![CLOSE];
    let words = tok.encode_ordinary(&"x ".repeat(MAX_MARKER_TOKENS + 4));
    ids.extend(&words);
    ids.push(EOS);
    let (_, all, _) = run(&tok, true, &[], &ids);
    assert_eq!(all.reasoning, tok.decode(&words).unwrap());
    assert_eq!(all.reasoning_logprobs.len(), words.len());
}

#[test]
fn unfinished_marker_is_text() {
    let tok = kimi();
    let mut ids = tok.encode_ordinary("a");
    ids.push(OPEN);
    ids.extend(tok.encode_ordinary("b"));
    let (_, all, _) = run(&tok, true, &[], &ids);
    assert_eq!(all.reasoning, "ab");
    assert!(all.content.is_empty());
}

#[test]
fn stop_across_token_boundaries_is_trimmed_and_held_back() {
    let tok = kimi();
    let text = "hello world, goodbye world";
    let ids: Vec<u32> = tok.encode_ordinary(text);
    let (deltas, all, stopped) = run(&tok, false, &["o w"], &ids);
    assert!(stopped);
    assert_eq!(all.content, "hell");
    // Nothing of the match was ever released.
    assert!(deltas.iter().all(|d| !d.content.contains('o')));
    let (_, all, stopped) = run(&tok, false, &["xyz"], &ids);
    assert!(!stopped);
    assert_eq!(all.content, text);
    // Raw completions drop the terminal stop id.
    let mut with_eos = ids.clone();
    with_eos.push(EOS);
    assert_eq!(run(&tok, false, &[], &with_eos).1.content, text);
}

#[test]
fn earliest_match_wins_and_logprobs_stop_with_the_text() {
    let tok = kimi();
    let ids: Vec<u32> = "abcdef"
        .bytes()
        .map(|b| tok.encode_ordinary(&(b as char).to_string())[0])
        .collect();
    let (_, all, stopped) = run(&tok, false, &["cd", "bcdx", "e"], &ids);
    assert!(stopped);
    assert_eq!(all.content, "ab");
    assert_eq!(all.content_logprobs.len(), 2);
    // Streaming holds back only a possible prefix: "b" may start "bcdx".
    let (deltas, _, _) = run(&tok, false, &["bcdx"], &ids);
    assert_eq!(deltas[0].content, "a");
    assert_eq!(deltas[1].content, "");
    assert_eq!(deltas[3].content, "");
    assert_eq!(deltas[4].content, "bcde");
}

#[test]
fn incomplete_utf8_is_held_back() {
    let tok = kimi();
    // Find a token that is an incomplete UTF-8 prefix.
    let id = (0..tok.num_ranks())
        .find(|&i| {
            let b = tok.token_bytes(i).unwrap();
            b.len() == 1 && b[0] >= 0xE0 && b[0] < 0xF0
        })
        .unwrap();
    let (deltas, all, _) = run(&tok, false, &[], &[id]);
    assert_eq!(deltas[0].content, "");
    assert_eq!(all.content, "\u{FFFD}");
}

// ---- Channels, thinking and stop sequences --------------------------------------------------

use crate::request::{ChatControls, ToolMode};
use deltafin_k3::text::chat::{
    ChatMessage, ChatOptions, ReasoningEffort, Segment, ToolCall, encode_segments, escape,
    render_segments,
};
use serde_json::json;

/// Controls with one declared tool (the tool's schema does not matter to the assembler).
fn controls(thinking: bool, parallel: bool) -> ChatControls {
    ChatControls {
        thinking,
        tools: vec![json!({"type": "function", "function": {"name": "get_weather"}})],
        parallel_tool_calls: parallel,
        ..ChatControls::with_effort(ReasoningEffort::Max)
    }
}

struct Run {
    deltas: Vec<Delta>,
    all: Delta,
    early: Option<EarlyEnd>,
    calls: usize,
}

fn run_chat(tok: &Tokenizer, controls: &ChatControls, stops: &[&str], ids: &[u32]) -> Run {
    let stops = stops.iter().map(|s| s.to_string()).collect();
    let mut a = Assembler::for_chat(tok, controls, stops);
    let mut deltas = Vec::new();
    for (i, &id) in ids.iter().enumerate() {
        let lp = TokenLogprob {
            id,
            logprob: -(i as f64),
            top: vec![],
        };
        deltas.push(a.push(id, Some(lp)).unwrap());
        if a.early_end().is_some() {
            break;
        }
    }
    deltas.push(a.finish().unwrap());
    let mut all = Delta::default();
    for d in &deltas {
        all.extend(d.clone());
    }
    Run {
        deltas,
        all,
        early: a.early_end(),
        calls: a.tool_calls(),
    }
}

/// What the model emits for `msg`: the assistant message as the renderer writes it into
/// history, after the generation prompt (`<|open|>message role="assistant"<|sep|>` and
/// `<|open|>think<|sep|>`, or `<|open|>response<|sep|>` with thinking off).
fn answer_ids(tok: &Tokenizer, msg: ChatMessage, thinking: bool) -> Vec<u32> {
    let opts = ChatOptions {
        thinking,
        add_generation_prompt: false,
        ..Default::default()
    };
    let mut segs = render_segments(&[msg], &opts).unwrap();
    // Drop the thinking-effort message: the answer starts at the assistant message.
    let start = segs
        .iter()
        .position(|s| *s == Segment::Text("assistant".into()))
        .unwrap()
        - 4;
    segs.drain(..start);
    let ids = encode_segments(tok, &segs);
    let second_sep = ids
        .iter()
        .enumerate()
        .filter(|(_, id)| **id == SEP)
        .nth(1)
        .unwrap()
        .0;
    ids[second_sep + 1..].to_vec()
}

fn assistant(reasoning: &str, content: &str, calls: &[(&str, &str)]) -> ChatMessage {
    ChatMessage {
        role: "assistant".into(),
        content: Some(deltafin_k3::text::chat::Content::Text(content.into())),
        reasoning_content: Some(reasoning.into()),
        tool_calls: calls
            .iter()
            .map(|(name, args)| ToolCall {
                id: None,
                name: name.to_string(),
                arguments: args.to_string(),
            })
            .collect(),
        ..Default::default()
    }
}

/// Segments of `open(tag, attrs)` / `close(tag)` (§8.1) for hand-made blocks.
fn open_segs(tag: &str, attrs: &[(&str, &str)]) -> Vec<Segment> {
    let mut v = vec![Segment::Special(OPEN), Segment::Text(tag.into())];
    for (k, val) in attrs {
        v.push(Segment::Text(format!(" {k}")));
        v.push(Segment::Text("=\"".into()));
        if !val.is_empty() {
            v.push(Segment::Text(escape(val)));
        }
        v.push(Segment::Text("\"".into()));
    }
    v.push(Segment::Special(SEP));
    v
}

fn close_segs(tag: &str) -> Vec<Segment> {
    vec![
        Segment::Special(CLOSE),
        Segment::Text(tag.into()),
        Segment::Special(SEP),
    ]
}

fn text_seg(t: &str) -> Vec<Segment> {
    vec![Segment::Text(t.into())]
}

/// A hand-made answer with thinking off: `content`, then `block` (already segments), then
/// the end of the message.
fn answer_with_block(tok: &Tokenizer, content: &str, block: Vec<Vec<Segment>>) -> Vec<u32> {
    let mut segs = text_seg(content);
    segs.extend(close_segs("response"));
    segs.extend(block.into_iter().flatten());
    segs.extend(close_segs("message"));
    segs.push(Segment::Special(END_OF_MSG));
    encode_segments(tok, &segs)
}

fn args_json(d: &ToolCallDelta) -> serde_json::Value {
    serde_json::from_str(&d.arguments)
        .unwrap_or_else(|e| panic!("arguments {:?} are not JSON: {e}", d.arguments))
}

#[test]
fn stops_apply_to_the_response_channel_only() {
    let tok = kimi();
    // The stop string in the reasoning does not end the answer; in the content it does.
    let mut ids = tok.encode_ordinary("one two three");
    ids.extend(marker(&tok, false, "think"));
    ids.extend(marker(&tok, true, "response"));
    ids.extend(tok.encode_ordinary("four two five"));
    ids.extend(marker(&tok, false, "response"));
    let (_, all, stopped) = run(&tok, true, &[" two"], &ids);
    assert!(stopped);
    assert_eq!(all.reasoning, "one two three");
    assert_eq!(all.content, "four");
    // Only reasoning: nothing stops, nothing is cut.
    let ids = tok.encode_ordinary("one two three");
    let (_, all, stopped) = run(&tok, true, &[" two"], &ids);
    assert!(!stopped);
    assert_eq!(
        (all.reasoning.as_str(), all.content.as_str()),
        ("one two three", "")
    );
    // Nor tool arguments.
    let mut ids = tok.encode_ordinary("r");
    ids.extend(answer_ids(
        &tok,
        assistant("", "", &[("get_weather", r#"{"city": "two"}"#)]),
        true,
    ));
    let r = run_chat(&tok, &controls(true, true), &["two"], &ids[1..]);
    assert_eq!(r.early, None);
    assert_eq!(args_json(&r.all.tool_calls[0]), json!({"city": "two"}));
}

#[test]
fn thinking_off_starts_in_the_response() {
    let tok = kimi();
    let ids = answer_ids(&tok, assistant("ignored", "Paris.", &[]), false);
    let r = run_chat(&tok, &controls(false, true), &[], &ids);
    assert_eq!(r.all.reasoning, "");
    assert_eq!(r.all.content, "Paris.");
    assert_eq!(r.calls, 0);
    let mut a = Assembler::for_chat(&tok, &controls(false, true), vec![]);
    for &id in &ids {
        a.push(id, None).unwrap();
    }
    assert_eq!(a.reasoning_tokens(), 0);
    // The same ids with thinking on are all reasoning (the think block never closes).
    let r = run_chat(&tok, &controls(true, true), &[], &ids);
    assert_eq!(r.all.content, "");
    assert!(r.all.reasoning.starts_with("Paris."));
}

// ---- Tool calls ------------------------------------------------------------------------------

#[test]
fn argument_form_round_trips_every_type() {
    let tok = kimi();
    let args = json!({
        "city": "Zürich \"old town\"\n\t\\ <|close|>argument<|sep|>",
        "days": 3, "ratio": 0.75, "metric": true, "note": null,
        "opts": {"lang": "fr", "nested": {"x": [1, 2.5, "é"]}},
        "tags": ["a", "b", 3], "unicode": "你好 😀 👨‍👩‍👧", "empty": "", "quote\"key&": "v\"&"
    });
    for thinking in [true, false] {
        let msg = assistant(
            "Need weather.",
            "Checking.",
            &[("get_weather", &args.to_string())],
        );
        let ids = answer_ids(&tok, msg, thinking);
        let r = run_chat(&tok, &controls(thinking, true), &[], &ids);
        assert_eq!(r.early, None);
        assert_eq!(r.all.content, "Checking.");
        assert_eq!(r.all.reasoning, if thinking { "Need weather." } else { "" });
        assert_eq!(r.calls, 1);
        let call = &r.all.tool_calls[0];
        assert_eq!(r.all.tool_calls.len(), 1, "{:?}", r.all.tool_calls);
        assert_eq!(call.index, 0);
        assert_eq!(call.name.as_deref(), Some("get_weather"));
        let id = call.id.as_deref().unwrap();
        assert!(id.starts_with("call_") && id.len() == 29, "{id}");
        // Keys keep their order; the literal `<|close|>argument<|sep|>` stays text.
        assert_eq!(args_json(call), args);
        let keys: Vec<String> = args_json(call)
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        let want: Vec<String> = args.as_object().unwrap().keys().cloned().collect();
        assert_eq!(keys, want);
        // No logprobs for tool tokens; content and reasoning keep theirs.
        assert_eq!(
            r.all.content_logprobs.len(),
            tok.encode_ordinary("Checking.").len()
        );
    }
}

#[test]
fn calls_stream_as_generated() {
    let tok = kimi();
    let msg = assistant(
        "",
        "",
        &[("get_weather", r#"{"city": "Paris and Rome", "days": 2}"#)],
    );
    let ids = answer_ids(&tok, msg, false);
    let r = run_chat(&tok, &controls(false, true), &[], &ids);
    let pieces: Vec<&ToolCallDelta> = r.deltas.iter().flat_map(|d| &d.tool_calls).collect();
    // The first piece announces the call with empty arguments, as soon as its marker closes.
    assert!(pieces[0].is_start() && pieces[0].arguments.is_empty());
    let announce = r
        .deltas
        .iter()
        .position(|d| !d.tool_calls.is_empty())
        .unwrap();
    assert_eq!(ids[announce], SEP);
    assert!(pieces[1..].iter().all(|p| !p.is_start() && p.index == 0));
    // The string value streams in several pieces; the number comes whole at its close.
    let texts: Vec<&str> = pieces[1..].iter().map(|p| p.arguments.as_str()).collect();
    assert_eq!(texts[0], r#"{"city":""#);
    assert!(texts.len() >= 5, "{texts:?}");
    assert!(texts.contains(&",\"days\":"), "{texts:?}");
    assert!(texts.contains(&"2"), "{texts:?}");
    assert_eq!(*texts.last().unwrap(), "}");
    assert_eq!(texts.concat(), r#"{"city":"Paris and Rome","days":2}"#);
    assert_eq!(r.all.tool_calls[0].arguments, texts.concat());
}

#[test]
fn two_parallel_calls_and_escaped_names() {
    let tok = kimi();
    let msg = assistant(
        "",
        "",
        &[
            ("get_weather", r#"{"city": "Paris"}"#),
            ("fn\"&name", r#"{"k&\"": "v"}"#),
        ],
    );
    let ids = answer_ids(&tok, msg, false);
    let r = run_chat(&tok, &controls(false, true), &[], &ids);
    assert_eq!(r.calls, 2);
    let calls = &r.all.tool_calls;
    assert_eq!(calls.len(), 2);
    assert_eq!((calls[0].index, calls[1].index), (0, 1));
    assert_eq!(calls[1].name.as_deref(), Some("fn\"&name"));
    assert_eq!(args_json(&calls[0]), json!({"city": "Paris"}));
    assert_eq!(args_json(&calls[1]), json!({"k&\"": "v"}));
    assert_ne!(calls[0].id, calls[1].id);
    // Ids are unique across answers too.
    let again = run_chat(&tok, &controls(false, true), &[], &ids);
    assert_ne!(again.all.tool_calls[0].id, calls[0].id);
}

#[test]
fn raw_json_form_and_calls_without_arguments() {
    let tok = kimi();
    // Not JSON: the renderer writes a raw json block; its text passes through.
    let msg = assistant("", "", &[("calc", "expr=1+1 (not json)"), ("calc", "")]);
    let ids = answer_ids(&tok, msg, false);
    let r = run_chat(&tok, &controls(false, true), &[], &ids);
    assert_eq!(r.all.tool_calls[0].arguments, "expr=1+1 (not json)");
    assert_eq!(r.all.tool_calls[1].arguments, "{}");
    // A raw block holding a JSON object (what the model may emit) is its text, as it came.
    let block = vec![
        open_segs("tools", &[]),
        open_segs("call", &[("tool", "calc"), ("index", "1")]),
        open_segs("json", &[("type", "object")]),
        text_seg("{\"expr\": \"2*21\", \"ü\": [1, 2]}"),
        close_segs("json"),
        close_segs("call"),
        close_segs("tools"),
    ];
    let ids = answer_with_block(&tok, "", block);
    let r = run_chat(&tok, &controls(false, true), &[], &ids);
    assert_eq!(r.all.content, "");
    assert_eq!(
        r.all.tool_calls[0].arguments,
        "{\"expr\": \"2*21\", \"ü\": [1, 2]}"
    );
}

#[test]
fn non_string_values_that_are_not_json_become_strings() {
    let tok = kimi();
    let block = vec![
        open_segs("tools", &[]),
        open_segs("call", &[("tool", "calc"), ("index", "1")]),
        open_segs("argument", &[("key", "n"), ("type", "number")]),
        text_seg(" 42 "),
        close_segs("argument"),
        open_segs("argument", &[("key", "x"), ("type", "number")]),
        text_seg("forty-two"),
        close_segs("argument"),
        open_segs("argument", &[("key", "k"), ("type", "object")]),
        text_seg("{\"a\": [1, 2]}"),
        close_segs("argument"),
        close_segs("call"),
        close_segs("tools"),
    ];
    let ids = answer_with_block(&tok, "", block);
    let r = run_chat(&tok, &controls(false, true), &[], &ids);
    assert_eq!(
        r.all.tool_calls[0].arguments,
        r#"{"n":42,"x":"forty-two","k":{"a": [1, 2]}}"#
    );
}

#[test]
fn whitespace_between_markers_is_allowed() {
    let tok = kimi();
    let block = vec![
        open_segs("tools", &[]),
        text_seg("\n"),
        open_segs("call", &[("tool", "calc"), ("index", "1")]),
        text_seg("\n  "),
        open_segs("argument", &[("key", "expr"), ("type", "string")]),
        text_seg("1+1"),
        close_segs("argument"),
        text_seg("\n"),
        close_segs("call"),
        text_seg("\n"),
        close_segs("tools"),
        text_seg("\n"),
    ];
    let ids = answer_with_block(&tok, "ok", block);
    let r = run_chat(&tok, &controls(false, true), &[], &ids);
    assert_eq!(r.all.content, "ok");
    assert_eq!(r.all.tool_calls[0].arguments, r#"{"expr":"1+1"}"#);
}

#[test]
fn malformed_blocks_surface_as_content() {
    let tok = kimi();
    let good_call = vec![
        open_segs("call", &[("tool", "calc"), ("index", "1")]),
        open_segs("argument", &[("key", "expr"), ("type", "string")]),
        text_seg("1"),
        close_segs("argument"),
        close_segs("call"),
    ];
    // An unknown marker after a complete call: the call stays, the rest is content, markers
    // spelled, up to the end of the message.
    let mut block = vec![open_segs("tools", &[])];
    block.extend(good_call.clone());
    block.push(open_segs("frob", &[("x", "1")]));
    block.push(text_seg("tail"));
    block.push(close_segs("tools"));
    let ids = answer_with_block(&tok, "Hi. ", block);
    let r = run_chat(&tok, &controls(false, true), &[], &ids);
    assert_eq!(r.calls, 1);
    assert_eq!(r.all.tool_calls[0].arguments, r#"{"expr":"1"}"#);
    assert_eq!(
        r.all.content,
        "Hi. <|open|>frob x=\"1\"<|sep|>tail<|close|>tools<|sep|>"
    );
    // Stray text between calls, and a call without a tool name.
    for (bad, spelled) in [
        (text_seg("oops"), "oops"),
        (
            open_segs("call", &[("index", "2")]),
            "<|open|>call index=\"2\"<|sep|>",
        ),
    ] {
        let mut block = vec![open_segs("tools", &[])];
        block.extend(good_call.clone());
        block.push(bad);
        block.push(close_segs("tools"));
        let ids = answer_with_block(&tok, "", block);
        let r = run_chat(&tok, &controls(false, true), &[], &ids);
        assert_eq!(r.calls, 1);
        assert_eq!(r.all.content, format!("{spelled}<|close|>tools<|sep|>"));
    }
    // Broken inside a call: what the call had stays (nothing is invented), the rest is content.
    let block = vec![
        open_segs("tools", &[]),
        open_segs("call", &[("tool", "calc"), ("index", "1")]),
        open_segs("argument", &[("key", "expr"), ("type", "string")]),
        text_seg("1+"),
        open_segs("argument", &[("key", "y"), ("type", "string")]),
        text_seg("z"),
    ];
    let ids = answer_with_block(&tok, "", block);
    let r = run_chat(&tok, &controls(false, true), &[], &ids);
    assert_eq!(r.all.tool_calls[0].arguments, r#"{"expr":"1+"#);
    assert_eq!(
        r.all.content,
        "<|open|>argument key=\"y\" type=\"string\"<|sep|>z"
    );
    // Text after the response that is not a tools block, and a marker with no meaning there.
    let mut ids = tok.encode_ordinary("A");
    ids.extend(marker(&tok, false, "response"));
    ids.extend(tok.encode_ordinary(" \n"));
    ids.extend(marker(&tok, true, "think"));
    ids.extend(tok.encode_ordinary("B"));
    ids.extend(marker(&tok, false, "message"));
    ids.extend(tok.encode_ordinary("C"));
    let r = run_chat(&tok, &controls(false, true), &[], &ids);
    assert_eq!(r.all.content, "A<|open|>think<|sep|>BC");
    // Inside a channel such a marker is text of the channel.
    let mut ids = tok.encode_ordinary("x");
    ids.extend(marker(&tok, true, "response"));
    ids.extend(tok.encode_ordinary("y"));
    let r = run_chat(&tok, &controls(false, true), &[], &ids);
    assert_eq!(r.all.content, "x<|open|>response<|sep|>y");
}

#[test]
fn truncation_mid_call_keeps_what_was_generated() {
    let tok = kimi();
    let msg = assistant(
        "",
        "",
        &[(
            "get_weather",
            r#"{"city": "Saint-Étienne", "days": 123456}"#,
        )],
    );
    let ids = answer_ids(&tok, msg, false);
    let text = |ids: &[u32]| tok.decode(ids).unwrap();
    // Cut inside the string value, one token into it.
    let value = (1..ids.len())
        .find(|&n| text(&ids[..n]).ends_with("type=\"string\"<|sep|>"))
        .unwrap();
    let first = text(&ids[value..value + 1]);
    assert!(first.len() < "Saint-Étienne".len(), "{first:?}");
    let r = run_chat(&tok, &controls(false, true), &[], &ids[..value + 1]);
    assert_eq!(r.calls, 1);
    assert_eq!(r.all.tool_calls[0].name.as_deref(), Some("get_weather"));
    assert_eq!(
        r.all.tool_calls[0].arguments,
        format!("{{\"city\":\"{first}")
    );
    // Cut inside the number: its buffered text is written as generated.
    let cut = (1..ids.len())
        .find(|&n| text(&ids[..n]).ends_with("123"))
        .unwrap();
    let r = run_chat(&tok, &controls(false, true), &[], &ids[..cut]);
    assert_eq!(
        r.all.tool_calls[0].arguments,
        r#"{"city":"Saint-Étienne","days":123"#
    );
    // Cut inside the call's open marker: no call yet; the marker's tokens are not a call.
    let cut = (1..ids.len())
        .find(|&n| text(&ids[..n]).ends_with("get_weather"))
        .unwrap();
    let r = run_chat(&tok, &controls(false, true), &[], &ids[..cut]);
    assert_eq!(r.calls, 0);
    assert!(r.all.tool_calls.is_empty());
}

#[test]
fn refused_tools_and_the_single_call_limit_end_the_answer() {
    let tok = kimi();
    let msg = assistant("", "Done.", &[("a", r#"{"x": 1}"#), ("b", r#"{"y": 2}"#)]);
    let ids = answer_ids(&tok, msg, false);
    // No tools declared (or tool_choice none): the answer ends where the block opens.
    for c in [
        ChatControls {
            tools: vec![],
            ..controls(false, true)
        },
        ChatControls {
            tool_mode: ToolMode::None,
            ..controls(false, true)
        },
    ] {
        let r = run_chat(&tok, &c, &[], &ids);
        assert_eq!(r.early, Some(EarlyEnd::ToolsRefused));
        assert_eq!(r.all.content, "Done.");
        assert!(r.all.tool_calls.is_empty());
    }
    // parallel_tool_calls: false ends the answer when the first call closes.
    let r = run_chat(&tok, &controls(false, false), &[], &ids);
    assert_eq!(r.early, Some(EarlyEnd::CallLimit));
    assert_eq!(r.calls, 1);
    assert_eq!(r.all.tool_calls.len(), 1);
    assert_eq!(args_json(&r.all.tool_calls[0]), json!({"x": 1}));
    // With both allowed, both come.
    let r = run_chat(&tok, &controls(false, true), &[], &ids);
    assert_eq!((r.early, r.calls), (None, 2));
}

#[test]
fn split_utf8_in_values_is_held_to_complete_characters() {
    let tok = kimi();
    // A lone continuation-needing byte token followed by the rest of the character.
    let s = "😀";
    let bytes_ids: Vec<u32> = s
        .bytes()
        .map(|b| {
            (0..tok.num_ranks())
                .find(|&i| tok.token_bytes(i) == Some(&[b][..]))
                .unwrap()
        })
        .collect();
    let mut ids = tok.encode_ordinary("");
    let head = answer_with_block(
        &tok,
        "",
        vec![
            open_segs("tools", &[]),
            open_segs("call", &[("tool", "t"), ("index", "1")]),
            open_segs("argument", &[("key", "e"), ("type", "string")]),
        ],
    );
    // Keep the block open: drop the trailing close(message) and END_OF_MSG.
    ids.extend(&head[..head.len() - 4]);
    ids.extend(&bytes_ids);
    ids.extend(encode_segments(
        &tok,
        &[
            close_segs("argument"),
            close_segs("call"),
            close_segs("tools"),
        ]
        .concat(),
    ));
    let r = run_chat(&tok, &controls(false, true), &[], &ids);
    let pieces: Vec<String> = r
        .deltas
        .iter()
        .flat_map(|d| &d.tool_calls)
        .map(|p| p.arguments.clone())
        .collect();
    assert!(
        pieces
            .iter()
            .all(|p| std::str::from_utf8(p.as_bytes()).is_ok())
    );
    assert_eq!(r.all.tool_calls[0].arguments, "{\"e\":\"😀\"}");
}

#[test]
fn a_marker_cut_off_inside_the_tools_block_is_not_content() {
    let tok = kimi();
    let mut ids = tok.encode_ordinary("Checking.");
    ids.extend(marker(&tok, false, "response"));
    ids.extend(marker(&tok, true, "tools"));
    ids.extend(marker(&tok, true, r#"call tool="get_weather" index="1""#));
    ids.extend(marker(&tok, true, r#"json type="object""#));
    ids.extend(tok.encode_ordinary(r#"{"which":"a"}"#));
    ids.extend(marker(&tok, false, "json"));
    ids.extend(marker(&tok, false, "call"));
    // The budget ends inside the next call's opening marker.
    ids.push(OPEN);
    ids.extend(tok.encode_ordinary(r#"call tool="get_weather"#));
    let all = run_chat(&tok, &controls(false, true), &[], &ids).all;
    assert_eq!(all.content, "Checking.");
    assert_eq!(all.tool_calls.len(), 1, "{:?}", all.tool_calls);
    let args: String = all
        .tool_calls
        .iter()
        .map(|c| c.arguments.as_str())
        .collect();
    assert_eq!(args, r#"{"which":"a"}"#);
}
