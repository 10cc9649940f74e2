//! The XTML chat renderer and the tokenizer on their own.

use crate::{MAX_INPUT, capped, kimi_tokenizer};
use deltafin_k3::text::chat::{
    ChatMessage, ChatOptions, ResponseFormat, ToolChoice, encode_chat, render_segments, token_bound,
};
use deltafin_k3::text::tokenizer::StreamDecoder;
use serde_json::Value;

/// Rendering options as `tests/fixtures/chat/goldens.json` spells them (`thinking`, `effort`,
/// `add_generation_prompt`, `tools`, `tool_choice`, `response_format`); what is missing or
/// malformed takes its default.
fn options(o: &Value) -> ChatOptions {
    let d = ChatOptions::default();
    ChatOptions {
        thinking: o["thinking"].as_bool().unwrap_or(d.thinking),
        effort: o["effort"].as_str().and_then(|e| e.parse().ok()),
        add_generation_prompt: o["add_generation_prompt"]
            .as_bool()
            .unwrap_or(d.add_generation_prompt),
        tools: o["tools"].as_array().cloned().unwrap_or_default(),
        tool_choice: match o["tool_choice"].as_str() {
            Some("required") => Some(ToolChoice::Required),
            Some("none") => Some(ToolChoice::Forbidden),
            _ => None,
        },
        response_format: match o["response_format"]["type"].as_str() {
            Some("json_object") => Some(ResponseFormat::JsonObject),
            Some("json_schema") => Some(ResponseFormat::JsonSchema(
                o["response_format"]["json_schema"]["schema"].clone(),
            )),
            _ => None,
        },
    }
}

/// A conversation as JSON: `{"messages": [...], "options": {...}}` (a case of the chat
/// goldens) or a bare array of messages. Each message goes through
/// [`ChatMessage::from_json`]; the conversation is rendered to segments and encoded with the
/// real tokenizer, and the ids decoded back.
pub fn chat_render(data: &[u8]) {
    let Ok(doc) = serde_json::from_slice::<Value>(capped(data, MAX_INPUT)) else {
        return;
    };
    let (messages, opts) = match &doc {
        Value::Array(m) => (m.as_slice(), ChatOptions::default()),
        Value::Object(o) => (
            o.get("messages")
                .and_then(Value::as_array)
                .map_or(&[][..], Vec::as_slice),
            o.get("options").map(options).unwrap_or_default(),
        ),
        _ => return,
    };
    let mut conversation = Vec::with_capacity(messages.len());
    for m in messages {
        match ChatMessage::from_json(m) {
            Ok(m) => conversation.push(m),
            Err(_) => return,
        }
    }
    if let Ok(segments) = render_segments(&conversation, &opts) {
        let _ = token_bound(&segments);
    }
    let tok = kimi_tokenizer();
    if let Ok(ids) = encode_chat(tok, &conversation, &opts) {
        let _ = tok.decode(&ids);
    }
}

/// Tokenizer encode and decode: the input as text (invalid UTF-8 replaced, as a `&str` can
/// hold only UTF-8) encoded with specials off and on (regex pieces, then BPE), the ids
/// decoded back; and the input as little-endian `u32` ids (mostly near the vocabulary, some
/// anywhere) decoded at once and through the streaming decoder.
pub fn tokenizer(data: &[u8]) {
    let data = capped(data, MAX_INPUT);
    let tok = kimi_tokenizer();
    let text = String::from_utf8_lossy(data);
    for allow_special in [false, true] {
        let ids = tok.encode(&text, allow_special);
        let _ = tok.decode_bytes(&ids);
    }
    let span = u32::try_from(tok.vocab_size())
        .unwrap_or(u32::MAX)
        .saturating_add(8);
    let ids: Vec<u32> = data
        .chunks_exact(4)
        .map(|c| {
            let raw = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            if raw & 0x8000_0000 == 0 {
                raw % span
            } else {
                raw
            }
        })
        .collect();
    let _ = tok.decode(&ids);
    let mut stream = StreamDecoder::new();
    for &id in &ids {
        if stream.push(tok, id).is_err() {
            break;
        }
    }
    let _ = stream.pending();
    let _ = stream.finish();
}
