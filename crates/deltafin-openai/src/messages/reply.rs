//! A generation as an Anthropic `message`: the JSON body, or the event stream
//! `message_start`, `ping`, per content block `content_block_start` /
//! `content_block_delta`… / `content_block_stop`, then `message_delta` and `message_stop`.
//!
//! Blocks come in the order the model writes them: `thinking` (its text, then a
//! `signature_delta` just before the block stops), `text`, then one `tool_use` block per call
//! (its input as `input_json_delta` pieces). A block opens with its first text, so an empty
//! channel has no block; the streamed blocks equal the non-streamed ones.

use super::MessagesMeta;
use super::wire::{error_body, stop_reason, usage_object};
use crate::MODEL_ID;
use crate::engine::{FinishReason, Usage};
use crate::error::ApiError;
use crate::output::{Delta, ToolCallDelta};
use crate::reply::{
    Reply, ReplyContext, ToolCall, arguments_object_of, assemble_tool_calls, sse_event,
};
use crate::seal::Sealer;
use serde_json::{Value, json};

/// The content block being streamed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Open {
    Thinking,
    Text,
    /// The tool call with this index.
    Tool(usize),
}

/// The Messages rendering of one generation.
pub struct MessagesReply {
    ctx: ReplyContext,
    meta: MessagesMeta,
    sealer: Sealer,
    /// The reasoning's ids (they arrive with its last text); sealed, they are the thinking
    /// block's signature.
    reasoning_ids: Vec<u32>,
    open: Option<Open>,
    /// Index of the next content block.
    next_index: usize,
    /// Tool calls whose block has been opened.
    started_calls: Vec<usize>,
}

impl MessagesReply {
    /// A reply for the request `meta` describes.
    pub fn new(ctx: ReplyContext, meta: MessagesMeta, sealer: Sealer) -> Self {
        MessagesReply {
            ctx,
            meta,
            sealer,
            reasoning_ids: Vec::new(),
            open: None,
            next_index: 0,
            started_calls: Vec::new(),
        }
    }

    /// Anthropic's `toolu_` id of a call: the assembler's unique `call_` id respelled, or
    /// one made from the message's suffix.
    fn tool_id(&self, index: usize, given: Option<&str>) -> String {
        match given {
            Some(id) => format!("toolu_{}", id.strip_prefix("call_").unwrap_or(id)),
            None => format!("toolu_{}_{index}", self.ctx.suffix),
        }
    }

    fn message(
        &self,
        content: Value,
        stop: (Option<&str>, Option<String>),
        usage: Option<&Usage>,
    ) -> Value {
        let mut m = json!({
            "id": self.ctx.id, "type": "message", "role": "assistant", "model": MODEL_ID,
            "content": content, "stop_reason": stop.0, "stop_sequence": stop.1,
            "usage": usage_object(self.ctx.prompt_tokens, usage),
        });
        if let Some(cm) = &self.meta.applied_edits {
            m["context_management"] = cm.clone();
        }
        m
    }

    /// Index of the open block (the last one started).
    fn index(&self) -> usize {
        self.next_index.saturating_sub(1)
    }

    fn close(&mut self, out: &mut Vec<String>) {
        let Some(open) = self.open.take() else { return };
        let index = self.index();
        if open == Open::Thinking {
            let sig = self.sealer.seal(&self.reasoning_ids);
            let delta = json!({"type": "signature_delta", "signature": sig});
            out.push(block_delta(index, delta));
        }
        out.push(sse_event(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": index}),
        ));
    }

    fn start(&mut self, open: Open, block: Value, out: &mut Vec<String>) {
        self.close(out);
        let index = self.next_index;
        self.next_index += 1;
        self.open = Some(open);
        out.push(sse_event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
    }

    fn tool_piece(&mut self, p: &ToolCallDelta, out: &mut Vec<String>) -> Result<(), ApiError> {
        if self.open != Some(Open::Tool(p.index)) {
            if self.started_calls.contains(&p.index) {
                return Err(ApiError::server(format!(
                    "tool call {} continued after the next block started",
                    p.index
                )));
            }
            let Some(name) = &p.name else {
                return Err(ApiError::server(format!(
                    "tool call {} started without its name",
                    p.index
                )));
            };
            self.started_calls.push(p.index);
            let block = json!({"type": "tool_use", "id": self.tool_id(p.index, p.id.as_deref()), "name": name, "input": {}});
            self.start(Open::Tool(p.index), block, out);
        }
        if !p.arguments.is_empty() {
            let delta = json!({"type": "input_json_delta", "partial_json": p.arguments});
            out.push(block_delta(self.index(), delta));
        }
        Ok(())
    }

    fn stop(&self, finish: FinishReason, usage: &Usage) -> (&'static str, Option<String>) {
        stop_reason(finish, usage, self.ctx.max_new, &self.meta.stops)
    }
}

fn block_delta(index: usize, delta: Value) -> String {
    sse_event(
        "content_block_delta",
        &json!({"type": "content_block_delta", "index": index, "delta": delta}),
    )
}

impl Reply for MessagesReply {
    fn body(&mut self, all: Delta, finish: FinishReason, usage: &Usage) -> Result<Value, ApiError> {
        let mut content = Vec::new();
        if !all.reasoning.is_empty() {
            let sig = self.sealer.seal(&all.reasoning_ids);
            let text = if self.meta.omit_thinking {
                ""
            } else {
                all.reasoning.as_str()
            };
            content.push(json!({"type": "thinking", "thinking": text, "signature": sig}));
        }
        if !all.content.is_empty() {
            content.push(json!({"type": "text", "text": all.content}));
        }
        for call in assemble_tool_calls(&all.tool_calls) {
            let ToolCall {
                index,
                ref id,
                ref name,
                ..
            } = call;
            let input = arguments_object_of(&call, finish == FinishReason::Length)?;
            content.push(json!({"type": "tool_use", "id": self.tool_id(index, id.as_deref()), "name": name, "input": input}));
        }
        let (reason, seq) = self.stop(finish, usage);
        Ok(self.message(Value::Array(content), (Some(reason), seq), Some(usage)))
    }

    fn opening(&mut self) -> Vec<String> {
        let message = self.message(json!([]), (None, None), None);
        vec![
            sse_event(
                "message_start",
                &json!({"type": "message_start", "message": message}),
            ),
            sse_event("ping", &json!({"type": "ping"})),
        ]
    }

    fn delta(&mut self, d: Delta) -> Result<Vec<String>, ApiError> {
        let mut out = Vec::new();
        self.reasoning_ids.extend_from_slice(&d.reasoning_ids);
        if !d.reasoning.is_empty() {
            if self.open != Some(Open::Thinking) {
                self.start(
                    Open::Thinking,
                    json!({"type": "thinking", "thinking": "", "signature": ""}),
                    &mut out,
                );
            }
            // `display: "omitted"`: the block carries only its signature.
            if !self.meta.omit_thinking {
                out.push(block_delta(
                    self.index(),
                    json!({"type": "thinking_delta", "thinking": d.reasoning}),
                ));
            }
        }
        if !d.content.is_empty() {
            if self.open != Some(Open::Text) {
                self.start(Open::Text, json!({"type": "text", "text": ""}), &mut out);
            }
            out.push(block_delta(
                self.index(),
                json!({"type": "text_delta", "text": d.content}),
            ));
        }
        for p in &d.tool_calls {
            self.tool_piece(p, &mut out)?;
        }
        Ok(out)
    }

    fn done(&mut self, finish: FinishReason, usage: &Usage) -> Vec<String> {
        let mut out = Vec::new();
        self.close(&mut out);
        let (reason, seq) = self.stop(finish, usage);
        let mut md = json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                "usage": usage_object(self.ctx.prompt_tokens, Some(usage))});
        if let Some(cm) = &self.meta.applied_edits {
            md["context_management"] = cm.clone();
        }
        out.push(sse_event("message_delta", &md));
        out.push(sse_event("message_stop", &json!({"type": "message_stop"})));
        out
    }

    fn failed(&mut self, e: &ApiError) -> Vec<String> {
        vec![sse_event("error", &error_body(e))]
    }

    /// The prefill comment, and a `ping` event (Anthropic's own keep-alive) with it, so that
    /// clients that time out silent streams see life while a long prompt is prefilled.
    fn prefill(&mut self, done: usize, total: usize) -> Vec<String> {
        vec![
            crate::engine::prefill_comment(done, total),
            sse_event("ping", &json!({"type": "ping"})),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> ReplyContext {
        ReplyContext {
            id: "msg_abc".into(),
            suffix: "abc".into(),
            created: 1,
            prompt_tokens: 7,
            max_new: 20,
        }
    }

    fn reply(stops: &[&str]) -> MessagesReply {
        MessagesReply::new(
            ctx(),
            MessagesMeta {
                stops: stops.iter().map(|s| s.to_string()).collect(),
                omit_thinking: false,
                applied_edits: None,
            },
            sealer(),
        )
    }

    /// One sealer for every reply of a test (signatures compare equal).
    fn sealer() -> Sealer {
        static S: std::sync::OnceLock<Sealer> = std::sync::OnceLock::new();
        S.get_or_init(Sealer::ephemeral).clone()
    }

    fn usage(c: usize, r: usize) -> Usage {
        Usage {
            prompt_tokens: 7,
            completion_tokens: c,
            reasoning_tokens: r,
        }
    }

    fn text(reasoning: &str, content: &str) -> Delta {
        Delta {
            reasoning: reasoning.into(),
            content: content.into(),
            ..Default::default()
        }
    }

    fn call(index: usize, name: Option<&str>, args: &str) -> Delta {
        Delta {
            tool_calls: vec![ToolCallDelta {
                index,
                id: name.map(|n| format!("call_{n}")),
                name: name.map(str::to_string),
                arguments: args.into(),
            }],
            ..Default::default()
        }
    }

    /// Parses `event: X\ndata: Y\n\n` frames into (X, Y), checking each data's `type` is X.
    fn events(frames: &[String]) -> Vec<(String, Value)> {
        frames
            .iter()
            .map(|f| {
                let (head, data) = f.strip_suffix("\n\n").unwrap().split_once('\n').unwrap();
                let name = head.strip_prefix("event: ").unwrap().to_string();
                let v: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
                assert_eq!(v["type"], name.as_str());
                (name, v)
            })
            .collect()
    }

    /// Runs a scripted generation through the stream side and the body side.
    fn run(deltas: Vec<Delta>, finish: FinishReason, u: Usage) -> (Vec<(String, Value)>, Value) {
        let mut r = reply(&["STOP"]);
        let mut frames = r.opening();
        let mut all = Delta::default();
        for d in deltas {
            frames.extend(r.delta(d.clone()).unwrap());
            all.extend(d);
        }
        frames.extend(r.done(finish, &u));
        let body = reply(&["STOP"]).body(all, finish, &u).unwrap();
        (events(&frames), body)
    }

    /// What the official client's accumulator does: rebuild the content blocks from events.
    fn accumulate(evs: &[(String, Value)]) -> Vec<Value> {
        let mut blocks: Vec<Value> = Vec::new();
        let mut json_text: Vec<String> = Vec::new();
        for (name, v) in evs {
            match name.as_str() {
                "content_block_start" => {
                    assert_eq!(v["index"], blocks.len());
                    blocks.push(v["content_block"].clone());
                    json_text.push(String::new());
                }
                "content_block_delta" => {
                    let i = v["index"].as_u64().unwrap() as usize;
                    let d = &v["delta"];
                    let b = &mut blocks[i];
                    match d["type"].as_str().unwrap() {
                        "text_delta" => {
                            b["text"] = format!(
                                "{}{}",
                                b["text"].as_str().unwrap(),
                                d["text"].as_str().unwrap()
                            )
                            .into()
                        }
                        "thinking_delta" => {
                            b["thinking"] = format!(
                                "{}{}",
                                b["thinking"].as_str().unwrap(),
                                d["thinking"].as_str().unwrap()
                            )
                            .into()
                        }
                        "signature_delta" => b["signature"] = d["signature"].clone(),
                        "input_json_delta" => {
                            json_text[i].push_str(d["partial_json"].as_str().unwrap())
                        }
                        t => panic!("unexpected delta {t}"),
                    }
                }
                "content_block_stop" => {
                    let i = v["index"].as_u64().unwrap() as usize;
                    if blocks[i]["type"] == "tool_use" && !json_text[i].is_empty() {
                        blocks[i]["input"] = serde_json::from_str(&json_text[i]).unwrap();
                    }
                }
                _ => {}
            }
        }
        blocks
    }

    #[test]
    fn thinking_text_and_tool_calls_stream_as_blocks() {
        let deltas = vec![
            text("let me ", ""),
            text("think", "Sure"),
            text("", ", calling."),
            call(0, Some("get"), ""),
            call(0, None, "{\"city\":"),
            call(0, None, "\"Paris\"}"),
            call(1, Some("put"), "{}"),
        ];
        let (evs, body) = run(deltas, FinishReason::ToolCalls, usage(12, 4));
        let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "ping",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
        );
        let start = &evs[0].1["message"];
        assert_eq!(start["content"], json!([]));
        assert_eq!(start["stop_reason"], Value::Null);
        assert_eq!(start["usage"]["input_tokens"], 7);
        assert_eq!(start["usage"]["output_tokens"], 0);
        // The signature comes just before the thinking block stops.
        assert_eq!(evs[5].1["delta"]["type"], "signature_delta");
        let md = &evs[18].1;
        assert_eq!(
            md["delta"],
            json!({"stop_reason": "tool_use", "stop_sequence": null})
        );
        assert_eq!(md["usage"]["output_tokens"], 12);
        assert_eq!(md["usage"]["output_tokens_details"]["thinking_tokens"], 4);
        // Streamed blocks equal the body's.
        assert_eq!(Value::Array(accumulate(&evs)), body["content"]);
        assert_eq!(
            body["content"],
            json!([
                {"type": "thinking", "thinking": "let me think", "signature": sealer().seal(&[])},
                {"type": "text", "text": "Sure, calling."},
                {"type": "tool_use", "id": "toolu_get", "name": "get", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_put", "name": "put", "input": {}},
            ])
        );
        assert_eq!(body["stop_reason"], "tool_use");
        assert_eq!(body["id"], "msg_abc");
        assert_eq!(body["type"], "message");
        assert_eq!(body["role"], "assistant");
    }

    #[test]
    fn stop_sequences_and_lengths() {
        let (evs, body) = run(
            vec![text("", "abc")],
            FinishReason::StopSequence(0),
            usage(3, 0),
        );
        assert_eq!(body["stop_reason"], "stop_sequence");
        assert_eq!(body["stop_sequence"], "STOP");
        assert_eq!(evs[evs.len() - 2].1["delta"]["stop_sequence"], "STOP");
        assert_eq!(body["content"], json!([{"type": "text", "text": "abc"}]));
        let (_, body) = run(vec![text("r", "")], FinishReason::Length, usage(20, 20));
        assert_eq!(body["stop_reason"], "max_tokens");
        assert_eq!(body["content"][0]["type"], "thinking");
        let (_, body) = run(vec![], FinishReason::Length, usage(5, 0));
        assert_eq!(body["stop_reason"], "model_context_window_exceeded");
        let (evs, body) = run(vec![], FinishReason::Stop, usage(0, 0));
        assert_eq!(body["content"], json!([]));
        assert_eq!(body["stop_reason"], "end_turn");
        assert_eq!(evs.len(), 4);
    }

    #[test]
    fn generated_tool_ids_and_bad_pieces() {
        let mut r = reply(&[]);
        let mut d = call(0, Some("f"), "{}");
        d.tool_calls[0].id = None;
        let evs = events(&r.delta(d).unwrap());
        assert_eq!(evs[0].1["content_block"]["id"], "toolu_abc_0");
        // A piece of a call whose block has closed cannot be streamed.
        r.delta(call(1, Some("g"), "{}")).unwrap();
        let e = r.delta(call(0, None, "x")).unwrap_err();
        assert!(e.message.contains("continued"), "{e}");
        let e = reply(&[]).delta(call(0, None, "{}")).unwrap_err();
        assert!(e.message.contains("without its name"), "{e}");
        // Arguments that are not an object fail the body.
        let e = reply(&[])
            .body(
                call(0, Some("f"), "[1]"),
                FinishReason::ToolCalls,
                &usage(1, 0),
            )
            .unwrap_err();
        assert!(e.message.contains("not a JSON object"), "{e}");
    }

    #[test]
    fn failures_are_error_events() {
        let evs = events(&reply(&[]).failed(&ApiError::server("boom")));
        assert_eq!(evs[0].0, "error");
        assert_eq!(
            evs[0].1["error"],
            json!({"type": "api_error", "message": "boom"})
        );
    }
}
