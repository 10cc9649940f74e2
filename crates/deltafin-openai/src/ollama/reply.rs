//! A generation in Ollama's shape: JSON lines (`application/x-ndjson`), one object per
//! release of text (`message` on `/api/chat`, `response` on `/api/generate`, with
//! `thinking` beside), tool calls whole in one object once the answer is complete, and a
//! last object with `done: true`, `done_reason` and the counts and durations; or, unstreamed,
//! that last object carrying the whole answer.

use super::{OllamaMeta, timestamp};
use crate::engine::{FinishReason, Usage};
use crate::error::ApiError;
use crate::output::Delta;
use crate::reply::{Reply, ReplyContext, arguments_object_of, assemble_tool_calls};
use serde_json::{Value, json};
use std::time::{Instant, SystemTime};

/// The Ollama rendering of one generation.
pub struct OllamaReply {
    ctx: ReplyContext,
    meta: OllamaMeta,
    started: Instant,
    /// When the first output arrived (the prompt's evaluation ends about then).
    first: Option<Instant>,
    /// Tool-call pieces, sent whole at the end.
    calls: Delta,
}

fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl OllamaReply {
    /// A reply for the request `meta` describes.
    pub fn new(ctx: ReplyContext, meta: OllamaMeta) -> Self {
        OllamaReply {
            ctx,
            meta,
            started: Instant::now(),
            first: None,
            calls: Delta::default(),
        }
    }

    fn line(v: &Value) -> String {
        format!("{v}\n")
    }

    /// An object with the model, the time, and the answer part.
    fn object(&self, reasoning: &str, content: &str, calls: Option<Vec<Value>>) -> Value {
        let mut v = json!({"model": self.meta.model, "created_at": timestamp(SystemTime::now())});
        if self.meta.chat {
            let mut m = json!({"role": "assistant", "content": content});
            if !reasoning.is_empty() {
                m["thinking"] = Value::from(reasoning);
            }
            if let Some(calls) = calls {
                m["tool_calls"] = Value::Array(calls);
            }
            v["message"] = m;
        } else {
            v["response"] = Value::from(content);
            if !reasoning.is_empty() {
                v["thinking"] = Value::from(reasoning);
            }
        }
        v["done"] = Value::Bool(false);
        v
    }

    /// The answer's calls; `cut`: the answer ended by its token budget.
    fn tool_calls(&self, all: &Delta, cut: bool) -> Result<Option<Vec<Value>>, ApiError> {
        let calls = assemble_tool_calls(&all.tool_calls);
        if calls.is_empty() {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(calls.len());
        for c in &calls {
            let mut call = json!({"function": {"index": c.index, "name": c.name, "arguments": arguments_object_of(c, cut)?}});
            if let Some(id) = &c.id {
                call["id"] = Value::from(id.as_str());
            }
            out.push(call);
        }
        Ok(Some(out))
    }

    /// The closing fields: why it ended, the counts and the durations (nanoseconds).
    fn finish(&self, v: &mut Value, finish: FinishReason, usage: &Usage) {
        let now = Instant::now();
        let first = self.first.unwrap_or(now);
        v["done"] = Value::Bool(true);
        v["done_reason"] = Value::from(match finish {
            FinishReason::Length => "length",
            _ => "stop",
        });
        v["total_duration"] = Value::from(nanos(now - self.started));
        v["load_duration"] = Value::from(0);
        v["prompt_eval_count"] = Value::from(usage.prompt_tokens);
        v["prompt_eval_duration"] = Value::from(nanos(first - self.started));
        v["eval_count"] = Value::from(usage.completion_tokens);
        v["eval_duration"] = Value::from(nanos(now - first));
    }
}

impl Reply for OllamaReply {
    fn body(&mut self, all: Delta, finish: FinishReason, usage: &Usage) -> Result<Value, ApiError> {
        let calls = self.tool_calls(&all, finish == FinishReason::Length)?;
        let mut v = self.object(&all.reasoning, &all.content, calls);
        self.finish(&mut v, finish, usage);
        Ok(v)
    }

    fn opening(&mut self) -> Vec<String> {
        Vec::new()
    }

    /// Nothing while the prompt is prefilled: a JSON line per report would be an answer
    /// chunk to Ollama's clients.
    fn prefill(&mut self, _done: usize, _total: usize) -> Vec<String> {
        Vec::new()
    }

    fn delta(&mut self, d: Delta) -> Result<Vec<String>, ApiError> {
        self.first.get_or_insert_with(Instant::now);
        if !d.tool_calls.is_empty() {
            self.calls.extend(Delta {
                tool_calls: d.tool_calls.clone(),
                ..Delta::default()
            });
        }
        if d.reasoning.is_empty() && d.content.is_empty() {
            return Ok(Vec::new());
        }
        Ok(vec![Self::line(&self.object(
            &d.reasoning,
            &d.content,
            None,
        ))])
    }

    fn done(&mut self, finish: FinishReason, usage: &Usage) -> Vec<String> {
        let mut out = Vec::new();
        match self.tool_calls(&self.calls, finish == FinishReason::Length) {
            Ok(Some(calls)) => out.push(Self::line(&self.object("", "", Some(calls)))),
            Ok(None) => {}
            Err(e) => return self.failed(&e),
        }
        let mut last = self.object("", "", None);
        self.finish(&mut last, finish, usage);
        out.push(Self::line(&last));
        out
    }

    fn failed(&mut self, e: &ApiError) -> Vec<String> {
        vec![Self::line(&super::error_body(e))]
    }

    fn stream_type(&self) -> &'static str {
        "application/x-ndjson"
    }
}

impl OllamaReply {
    /// The response id (logged; Ollama's objects carry none).
    pub fn id(&self) -> &str {
        &self.ctx.id
    }
}
