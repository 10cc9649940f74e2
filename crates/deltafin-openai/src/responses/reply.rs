//! A generation as a Responses `response` object, or its typed event stream:
//! `response.created`, `response.in_progress`, then per output item
//! `response.output_item.added`, its part and text/argument deltas and their `.done`
//! events, `response.output_item.done`, and finally `response.completed` (or
//! `response.incomplete` when the token budget ran out). Every event carries a
//! `sequence_number` counting from 0.
//!
//! Items come in the order the model writes them: a `reasoning` item (its text as
//! `reasoning_text` content, or verbatim as the summary when `reasoning.summary` asked for
//! one), a `message` with one `output_text` part, then one `function_call` item per call. An
//! item opens with its first text, so an empty channel has no item; the streamed items equal
//! the non-streamed ones.

use super::ResponsesMeta;
use super::store::{Record, Store};
use crate::MODEL_ID;
use crate::engine::{FinishReason, Usage};
use crate::error::ApiError;
use crate::output::{Delta, ToolCallDelta};
use crate::reply::{Reply, ReplyContext, assemble_tool_calls, sse_event};
use crate::seal::Sealer;
use serde_json::{Value, json};
use std::sync::Arc;

/// Longest a stream goes without a data event while the prompt is prefilled.
pub const KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(15);

/// The output item being streamed.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Open {
    Reasoning,
    Message,
    /// A function call: the model's call index, its call id and name.
    Call {
        index: usize,
        call_id: String,
        name: String,
    },
}

/// The Responses rendering of one generation.
pub struct ResponsesReply {
    ctx: ReplyContext,
    meta: ResponsesMeta,
    sealer: Sealer,
    store: Option<Arc<Store>>,
    /// The reasoning's ids (they arrive with its last text).
    reasoning_ids: Vec<u32>,
    /// When the last data event was written (a long prefill repeats `response.in_progress`).
    last_event: std::time::Instant,
    seq: u64,
    /// Finished output items.
    items: Vec<Value>,
    open: Option<Open>,
    /// Text (or arguments) of the open item so far.
    text: String,
    /// Tool calls whose item has been opened.
    started_calls: Vec<usize>,
}

fn usage_object(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

fn status(finish: FinishReason) -> &'static str {
    if finish == FinishReason::Length {
        "incomplete"
    } else {
        "completed"
    }
}

impl ResponsesReply {
    /// A reply for the request `meta` describes.
    pub fn new(
        ctx: ReplyContext,
        meta: ResponsesMeta,
        sealer: Sealer,
        store: Option<Arc<Store>>,
    ) -> Self {
        ResponsesReply {
            ctx,
            meta,
            sealer,
            store,
            reasoning_ids: Vec::new(),
            last_event: std::time::Instant::now(),
            seq: 0,
            items: Vec::new(),
            open: None,
            text: String::new(),
            started_calls: Vec::new(),
        }
    }

    fn item_id(&self, prefix: &str, output_index: usize) -> String {
        format!("{prefix}_{}_{output_index}", self.ctx.suffix)
    }

    fn call_id(&self, index: usize, given: Option<&str>) -> String {
        given.map_or_else(
            || format!("call_{}_{index}", self.ctx.suffix),
            str::to_string,
        )
    }

    fn reasoning_item(&self, at: usize, text: Option<&str>, status: &str) -> Value {
        let id = self.item_id("rs", at);
        let parts = |kind: &str| match text {
            Some(t) => json!([{"type": kind, "text": t}]),
            None => json!([]),
        };
        let mut item = if self.meta.summary {
            json!({"id": id, "type": "reasoning", "summary": parts("summary_text"), "status": status})
        } else {
            json!({"id": id, "type": "reasoning", "summary": [], "content": parts("reasoning_text"), "status": status})
        };
        // Once the reasoning is complete, its sealed ids (when asked for).
        if self.meta.encrypted_reasoning && text.is_some() {
            item["encrypted_content"] = Value::from(self.sealer.seal(&self.reasoning_ids));
        }
        item
    }

    fn message_item(&self, at: usize, text: Option<&str>, status: &str) -> Value {
        let content = match text {
            Some(t) => json!([output_text(t)]),
            None => json!([]),
        };
        json!({"id": self.item_id("msg", at), "type": "message", "role": "assistant", "status": status, "content": content})
    }

    fn call_item(&self, at: usize, call_id: &str, name: &str, args: &str, status: &str) -> Value {
        let mut item = json!({"id": self.item_id("fc", at), "type": "function_call", "status": status,
               "call_id": call_id, "name": name, "arguments": args});
        // A function of a `namespace` tool names its namespace.
        if let Some(ns) = self.meta.namespaces.get(name) {
            item["namespace"] = Value::from(ns.as_str());
        }
        item
    }

    /// Keeps the finished response when `store` asked for it: the response, this request's
    /// input items, and the conversation a later request continues (with the reasoning
    /// always sealed, so that it comes back exactly).
    fn keep(&self, response: &Value) {
        let (Some(store), true) = (&self.store, self.meta.store) else {
            return;
        };
        let mut conversation = self.meta.conversation.clone();
        if let Some(items) = response["output"].as_array() {
            for item in items {
                let mut item = item.clone();
                if item["type"] == "reasoning" {
                    item["encrypted_content"] = Value::from(self.sealer.seal(&self.reasoning_ids));
                }
                conversation.push(item);
            }
        }
        let record = Record {
            response: response.clone(),
            input_items: self.meta.input_items.clone(),
            conversation,
        };
        store.put(&self.ctx.id, &record);
    }

    fn response(
        &self,
        status: &str,
        output: Vec<Value>,
        usage: Option<&Usage>,
        error: Value,
    ) -> Value {
        let mut r = json!({
            "id": self.ctx.id, "object": "response", "created_at": self.ctx.created, "status": status,
            "background": false, "error": error,
            "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "model": MODEL_ID, "output": output,
            "truncation": "disabled", "max_tool_calls": null, "usage": usage.map(usage_object),
        });
        for (k, v) in &self.meta.echo {
            r[k] = v.clone();
        }
        r
    }

    /// One event: `data` with its `type` and the next sequence number.
    fn event(&mut self, name: &str, mut data: Value) -> String {
        self.last_event = std::time::Instant::now();
        data["type"] = Value::from(name);
        data["sequence_number"] = Value::from(self.seq);
        self.seq += 1;
        sse_event(name, &data)
    }

    /// The open item's `item_id` / `output_index` fields.
    fn at(&self) -> Value {
        let at = self.items.len();
        let prefix = match self.open {
            Some(Open::Reasoning) => "rs",
            Some(Open::Message) => "msg",
            _ => "fc",
        };
        json!({"item_id": self.item_id(prefix, at), "output_index": at})
    }

    fn with(&self, extra: Value) -> Value {
        let mut v = self.at();
        if let (Some(m), Value::Object(e)) = (v.as_object_mut(), extra) {
            m.extend(e);
        }
        v
    }

    fn start(&mut self, open: Open, out: &mut Vec<String>) {
        self.close("completed", out);
        let at = self.items.len();
        let item = match &open {
            Open::Reasoning => self.reasoning_item(at, None, "in_progress"),
            Open::Message => self.message_item(at, None, "in_progress"),
            Open::Call { call_id, name, .. } => {
                self.call_item(at, call_id, name, "", "in_progress")
            }
        };
        self.open = Some(open);
        self.text.clear();
        out.push(self.event(
            "response.output_item.added",
            json!({"output_index": at, "item": item}),
        ));
        let part = match self.open {
            Some(Open::Reasoning) if self.meta.summary => Some((
                "response.reasoning_summary_part.added",
                json!({"summary_index": 0, "part": {"type": "summary_text", "text": ""}}),
            )),
            Some(Open::Reasoning) => Some((
                "response.content_part.added",
                json!({"content_index": 0, "part": {"type": "reasoning_text", "text": ""}}),
            )),
            Some(Open::Message) => Some((
                "response.content_part.added",
                json!({"content_index": 0, "part": output_text("")}),
            )),
            _ => None,
        };
        if let Some((name, extra)) = part {
            let data = self.with(extra);
            out.push(self.event(name, data));
        }
    }

    fn close(&mut self, status: &str, out: &mut Vec<String>) {
        let Some(open) = self.open.clone() else {
            return;
        };
        let at = self.items.len();
        let text = std::mem::take(&mut self.text);
        let (events, item): (Vec<(&str, Value)>, Value) = match &open {
            Open::Reasoning if self.meta.summary => (
                vec![
                    (
                        "response.reasoning_summary_text.done",
                        json!({"summary_index": 0, "text": text}),
                    ),
                    (
                        "response.reasoning_summary_part.done",
                        json!({"summary_index": 0, "part": {"type": "summary_text", "text": text}}),
                    ),
                ],
                self.reasoning_item(at, Some(&text), status),
            ),
            Open::Reasoning => (
                vec![
                    (
                        "response.reasoning_text.done",
                        json!({"content_index": 0, "text": text}),
                    ),
                    (
                        "response.content_part.done",
                        json!({"content_index": 0, "part": {"type": "reasoning_text", "text": text}}),
                    ),
                ],
                self.reasoning_item(at, Some(&text), status),
            ),
            Open::Message => (
                vec![
                    (
                        "response.output_text.done",
                        json!({"content_index": 0, "text": text, "logprobs": []}),
                    ),
                    (
                        "response.content_part.done",
                        json!({"content_index": 0, "part": output_text(&text)}),
                    ),
                ],
                self.message_item(at, Some(&text), status),
            ),
            Open::Call { call_id, name, .. } => (
                vec![(
                    "response.function_call_arguments.done",
                    json!({"name": name, "arguments": text}),
                )],
                self.call_item(at, call_id, name, &text, status),
            ),
        };
        for (name, extra) in events {
            let data = self.with(extra);
            out.push(self.event(name, data));
        }
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": at, "item": item}),
        ));
        self.items.push(item);
        self.open = None;
    }

    fn tool_piece(&mut self, p: &ToolCallDelta, out: &mut Vec<String>) -> Result<(), ApiError> {
        let same = matches!(&self.open, Some(Open::Call { index, .. }) if *index == p.index);
        if !same {
            if self.started_calls.contains(&p.index) {
                return Err(ApiError::server(format!(
                    "tool call {} continued after the next item started",
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
            let open = Open::Call {
                index: p.index,
                call_id: self.call_id(p.index, p.id.as_deref()),
                name: name.clone(),
            };
            self.start(open, out);
        }
        if !p.arguments.is_empty() {
            self.text.push_str(&p.arguments);
            let data = self.with(json!({"delta": p.arguments}));
            out.push(self.event("response.function_call_arguments.delta", data));
        }
        Ok(())
    }
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

impl Reply for ResponsesReply {
    fn body(&mut self, all: Delta, finish: FinishReason, usage: &Usage) -> Result<Value, ApiError> {
        self.reasoning_ids = all.reasoning_ids.clone();
        let calls = assemble_tool_calls(&all.tool_calls);
        let count = usize::from(!all.reasoning.is_empty())
            + usize::from(!all.content.is_empty())
            + calls.len();
        let st = |at: usize| {
            if at + 1 == count {
                status(finish)
            } else {
                "completed"
            }
        };
        let mut output = Vec::with_capacity(count);
        if !all.reasoning.is_empty() {
            output.push(self.reasoning_item(output.len(), Some(&all.reasoning), st(output.len())));
        }
        if !all.content.is_empty() {
            output.push(self.message_item(output.len(), Some(&all.content), st(output.len())));
        }
        for c in &calls {
            let call_id = self.call_id(c.index, c.id.as_deref());
            output.push(self.call_item(
                output.len(),
                &call_id,
                &c.name,
                &c.arguments,
                st(output.len()),
            ));
        }
        let response = self.response(status(finish), output, Some(usage), Value::Null);
        self.keep(&response);
        Ok(response)
    }

    fn opening(&mut self) -> Vec<String> {
        let snapshot = self.response("in_progress", Vec::new(), None, Value::Null);
        vec![
            self.event("response.created", json!({"response": snapshot})),
            self.event("response.in_progress", json!({"response": snapshot})),
        ]
    }

    fn delta(&mut self, d: Delta) -> Result<Vec<String>, ApiError> {
        let mut out = Vec::new();
        self.reasoning_ids.extend_from_slice(&d.reasoning_ids);
        if !d.reasoning.is_empty() {
            if self.open != Some(Open::Reasoning) {
                self.start(Open::Reasoning, &mut out);
            }
            self.text.push_str(&d.reasoning);
            let (name, extra) = if self.meta.summary {
                (
                    "response.reasoning_summary_text.delta",
                    json!({"summary_index": 0, "delta": d.reasoning}),
                )
            } else {
                (
                    "response.reasoning_text.delta",
                    json!({"content_index": 0, "delta": d.reasoning}),
                )
            };
            let data = self.with(extra);
            out.push(self.event(name, data));
        }
        if !d.content.is_empty() {
            if self.open != Some(Open::Message) {
                self.start(Open::Message, &mut out);
            }
            self.text.push_str(&d.content);
            let data = self.with(json!({"content_index": 0, "delta": d.content, "logprobs": []}));
            out.push(self.event("response.output_text.delta", data));
        }
        for p in &d.tool_calls {
            self.tool_piece(p, &mut out)?;
        }
        Ok(out)
    }

    fn done(&mut self, finish: FinishReason, usage: &Usage) -> Vec<String> {
        let mut out = Vec::new();
        self.close(status(finish), &mut out);
        let st = status(finish);
        let response = self.response(st, self.items.clone(), Some(usage), Value::Null);
        self.keep(&response);
        let name = if st == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        out.push(self.event(name, json!({"response": response})));
        out
    }

    /// The prefill comment, and every [`KEEP_ALIVE`] a `response.in_progress` event: clients
    /// such as Codex time a stream out on its data events (comments do not count), and a long
    /// prompt can take minutes to prefill.
    fn prefill(&mut self, done: usize, total: usize) -> Vec<String> {
        let mut out = vec![crate::engine::prefill_comment(done, total)];
        if self.last_event.elapsed() >= KEEP_ALIVE {
            let snapshot = self.response("in_progress", Vec::new(), None, Value::Null);
            out.push(self.event("response.in_progress", json!({"response": snapshot})));
        }
        out
    }

    fn failed(&mut self, e: &ApiError) -> Vec<String> {
        let error = json!({"code": "server_error", "message": e.message});
        let response = self.response("failed", self.items.clone(), None, error);
        vec![self.event("response.failed", json!({"response": response}))]
    }
}

#[cfg(test)]
mod tests;
