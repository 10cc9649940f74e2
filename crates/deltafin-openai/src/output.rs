//! From generated token ids to what a client sees: reasoning, content and tool calls.
//!
//! Chat output is split into channels on **token ids** (docs/K3.md §8.5, docs/SERVER.md
//! "Responses"): a marker is `<|open|>` or `<|close|>`, ordinary tag tokens, then `<|sep|>`.
//! Text between the generation prompt's `<|open|>think<|sep|>` and `<|close|>think<|sep|>` is
//! `reasoning_content`; text between `<|open|>response<|sep|>` and `<|close|>response<|sep|>`
//! is `content` (with thinking off the answer starts inside the response). A tools block after
//! the response becomes tool calls (`tools`). A user or model string that spells `<|close|>`
//! is ordinary tokens and stays text.
//!
//! Stop sequences are matched on the content's decoded text across token boundaries (never on
//! reasoning or tool arguments); the match and everything after it is never emitted, and
//! while streaming only a suffix that could still become a match is held back (plus
//! incomplete UTF-8 and unfinished markers).
//!
//! Output that does not fit the answer's shape is never dropped: a marker with no meaning
//! where it stands is text (spelled with its markers), and from the first token after the
//! response that is neither whitespace nor part of a well-formed tools block, everything up
//! to `<|close|>message<|sep|>` is content.

mod channel;
mod delta;
#[cfg(test)]
mod tests;
mod tools;

pub use delta::*;

use crate::request::{ChatControls, GenRequest, Prompt, ToolMode};
use channel::ChannelText;
use deltafin_k3::text::tokenizer::{CLOSE, END_OF_MSG, EOS, OPEN, SEP, Tokenizer, TokenizerError};
use serde_json::{Map, Value, json};
pub(crate) use tools::renew_call_ids;
use tools::{CallIds, Step, ToolBlock, is_blank};

/// Longest tag (in ordinary tokens) a marker may carry before it is read as text.
pub const MAX_MARKER_TOKENS: usize = 16;
/// The same inside a tools block, where a tag carries a tool name or an argument key.
pub const MAX_TOOL_MARKER_TOKENS: usize = 256;

/// Where the chat output is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// The thinking channel.
    Reasoning,
    /// After `<|close|>think<|sep|>`, before `<|open|>response<|sep|>`.
    BeforeResponse,
    /// The response channel.
    Content,
    /// After `<|close|>response<|sep|>`: a tools block or the end of the message may follow.
    Epilogue,
    /// Inside the tools block.
    Tools,
    /// After `<|close|>tools<|sep|>`.
    AfterTools,
    /// After `<|close|>message<|sep|>`.
    After,
    /// Output that does not fit the answer's shape: every token is content.
    Raw,
}

/// Whether an answer's tools block becomes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolOutput {
    /// No tools were declared, or `tool_choice` is `none`: a tools block ends the answer
    /// where it opens (the response before it is complete).
    Refused,
    /// Calls are returned; with `single` (`parallel_tool_calls: false`) the answer ends when
    /// the first call closes.
    Allowed {
        /// At most one call.
        single: bool,
    },
}

/// Why an answer ended before the model ended its message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EarlyEnd {
    /// A stop sequence matched in the content.
    StopSequence,
    /// The one call `parallel_tool_calls: false` allows closed.
    CallLimit,
    /// A tools block opened although no calls may be returned ([`ToolOutput::Refused`]).
    ToolsRefused,
}

/// Turns generated ids into released text and tool calls, channel by channel.
pub struct Assembler<'t> {
    tok: &'t Tokenizer,
    chat: bool,
    phase: Phase,
    marker: Vec<(u32, Option<TokenLogprob>)>,
    reasoning: ChannelText,
    content: ChannelText,
    stops: Vec<String>,
    early: Option<EarlyEnd>,
    reasoning_tokens: usize,
    tools: ToolOutput,
    block: Option<ToolBlock>,
    call_ids: CallIds,
    calls: Vec<ToolCallDelta>,
    /// The reasoning's ids while it is written (`None` once released, or without thinking).
    reasoning_ids: Option<Vec<u32>>,
    /// How many ids the last completed marker had.
    last_marker_len: usize,
}

impl<'t> Assembler<'t> {
    /// An assembler for raw completion output, or for chat output after a thinking
    /// generation prompt with no tools.
    pub fn new(tok: &'t Tokenizer, chat: bool, stops: Vec<String>) -> Self {
        Assembler {
            tok,
            chat,
            phase: if chat {
                Phase::Reasoning
            } else {
                Phase::Content
            },
            marker: Vec::new(),
            reasoning: ChannelText::default(),
            content: ChannelText::default(),
            stops,
            early: None,
            reasoning_tokens: 0,
            tools: ToolOutput::Refused,
            block: None,
            call_ids: CallIds::new(),
            calls: Vec::new(),
            reasoning_ids: chat.then(Vec::new),
            last_marker_len: 0,
        }
    }

    /// An assembler for chat output rendered with `controls`: thinking on or off (the
    /// generation prompt opened `think` or `response`), and whether tool calls are returned.
    pub fn for_chat(tok: &'t Tokenizer, controls: &ChatControls, stops: Vec<String>) -> Self {
        let mut a = Assembler::new(tok, true, stops);
        if !controls.thinking {
            a.phase = Phase::Content;
            a.reasoning_ids = None;
        }
        a.tools = if controls.tools.is_empty() || controls.tool_mode == ToolMode::None {
            ToolOutput::Refused
        } else {
            ToolOutput::Allowed {
                single: !controls.parallel_tool_calls,
            }
        };
        a
    }

    /// The assembler `req` needs (raw or chat, its controls, its stop sequences).
    pub fn for_request(tok: &'t Tokenizer, req: &GenRequest) -> Self {
        match &req.prompt {
            Prompt::Raw(_) => Assembler::new(tok, false, req.stop.clone()),
            Prompt::Chat { controls, .. } => Assembler::for_chat(tok, controls, req.stop.clone()),
        }
    }

    /// Whether a stop sequence matched.
    pub fn stop_hit(&self) -> bool {
        self.early == Some(EarlyEnd::StopSequence)
    }

    /// Whether generation must end now (a stop sequence, the call limit, a refused tools
    /// block), and why.
    pub fn early_end(&self) -> Option<EarlyEnd> {
        self.early
    }

    /// Tool calls begun so far.
    pub fn tool_calls(&self) -> usize {
        self.block.as_ref().map_or(0, ToolBlock::calls)
    }

    /// Which stop sequence matched (its index in the request's list), once one has.
    pub fn matched_stop(&self) -> Option<usize> {
        self.reasoning.matched.or(self.content.matched)
    }

    /// Generated tokens up to and including the marker that closes the thinking channel.
    pub fn reasoning_tokens(&self) -> usize {
        self.reasoning_tokens
    }

    fn push_reasoning(&mut self, id: u32, lp: Option<TokenLogprob>) -> Result<(), TokenizerError> {
        self.reasoning.push(self.tok, id, lp, &[])?;
        Ok(())
    }

    fn push_content(&mut self, id: u32, lp: Option<TokenLogprob>) -> Result<(), TokenizerError> {
        if self.content.push(self.tok, id, lp, &self.stops)? {
            self.early = Some(EarlyEnd::StopSequence);
        }
        Ok(())
    }

    /// From here on every token is content (see the module comment).
    fn enter_raw(&mut self) {
        if self.phase == Phase::Tools
            && let Some(block) = self.block.as_mut()
        {
            block.abandon(&mut self.calls);
        }
        self.close_reasoning();
        self.content.reopen();
        self.phase = Phase::Raw;
    }

    /// One ordinary token.
    fn text_token(&mut self, id: u32, lp: Option<TokenLogprob>) -> Result<(), TokenizerError> {
        match self.phase {
            Phase::Reasoning => self.push_reasoning(id, lp),
            Phase::Content | Phase::Raw => self.push_content(id, lp),
            _ if is_blank(self.tok, id) && self.phase != Phase::Tools => Ok(()),
            // Text without the response marker: the response began implicitly.
            Phase::BeforeResponse => {
                self.close_reasoning();
                self.phase = Phase::Content;
                self.push_content(id, lp)
            }
            Phase::Tools => {
                let Some(block) = self.block.as_mut() else {
                    return Ok(());
                };
                if block.text(self.tok, id, &mut self.calls)? == Step::Broken {
                    self.enter_raw();
                    self.push_content(id, lp)?;
                }
                Ok(())
            }
            Phase::Epilogue | Phase::AfterTools | Phase::After => {
                self.enter_raw();
                self.push_content(id, lp)
            }
        }
    }

    /// A marker's tokens as text of the current channel, markers spelled.
    fn spell(&mut self, marker: Vec<(u32, Option<TokenLogprob>)>) -> Result<(), TokenizerError> {
        for (id, lp) in marker {
            if self.early.is_some() {
                break;
            }
            if self.phase == Phase::Reasoning {
                self.push_reasoning(id, lp)?;
            } else {
                self.push_content(id, lp)?;
            }
        }
        Ok(())
    }

    /// The ordinary tokens of an abandoned marker are text of the current channel.
    fn flush_marker(&mut self) -> Result<(), TokenizerError> {
        let pending = std::mem::take(&mut self.marker);
        for (id, lp) in pending.into_iter().skip(1) {
            if self.early.is_some() {
                break;
            }
            self.text_token(id, lp)?;
        }
        Ok(())
    }

    fn close_reasoning(&mut self) {
        self.reasoning.close(&[]);
    }

    fn close_content(&mut self) {
        if self.content.close(&self.stops) {
            self.early = Some(EarlyEnd::StopSequence);
        }
    }

    fn close_channels(&mut self) {
        self.close_reasoning();
        self.close_content();
    }

    fn complete_marker(&mut self) -> Result<(), TokenizerError> {
        let marker = std::mem::take(&mut self.marker);
        self.last_marker_len = marker.len();
        let ids: Vec<u32> = marker[1..marker.len() - 1]
            .iter()
            .map(|(id, _)| *id)
            .collect();
        let opening = marker[0].0 == OPEN;
        let tag = self.tok.decode(&ids)?;
        let end_of_message = !opening && tag == "message";
        match self.phase {
            Phase::Raw if end_of_message => {
                self.close_content();
                self.phase = Phase::After;
            }
            Phase::Raw => self.spell(marker)?,
            Phase::Tools if end_of_message => {
                // The block ends with the message: a call in progress keeps what it has.
                if let Some(block) = self.block.as_mut() {
                    block.abandon(&mut self.calls);
                }
                self.phase = Phase::After;
            }
            Phase::Tools => {
                let Some(block) = self.block.as_mut() else {
                    return Ok(());
                };
                match block.marker(opening, &tag, &self.call_ids, &mut self.calls) {
                    Step::Continue => {}
                    Step::CallClosed => {
                        if self.tools == (ToolOutput::Allowed { single: true }) {
                            self.early = Some(EarlyEnd::CallLimit);
                        }
                    }
                    Step::Closed => self.phase = Phase::AfterTools,
                    Step::Broken => {
                        self.enter_raw();
                        self.spell(marker)?;
                    }
                }
            }
            phase => match (opening, tag.as_str(), phase) {
                (false, "think", Phase::Reasoning) => {
                    self.close_reasoning();
                    self.phase = Phase::BeforeResponse;
                }
                (true, "response", Phase::Reasoning | Phase::BeforeResponse) => {
                    self.close_reasoning();
                    self.phase = Phase::Content;
                }
                (false, "response", Phase::Content) => {
                    self.close_content();
                    self.phase = Phase::Epilogue;
                }
                (
                    true,
                    "tools",
                    Phase::Reasoning | Phase::BeforeResponse | Phase::Content | Phase::Epilogue,
                ) => {
                    self.close_channels();
                    match self.tools {
                        ToolOutput::Refused => {
                            self.early.get_or_insert(EarlyEnd::ToolsRefused);
                            self.phase = Phase::After;
                        }
                        ToolOutput::Allowed { .. } => {
                            self.block = Some(ToolBlock::new());
                            self.phase = Phase::Tools;
                        }
                    }
                }
                (false, "message", _) => {
                    self.close_channels();
                    self.phase = Phase::After;
                }
                (_, _, Phase::Reasoning | Phase::Content) => self.spell(marker)?,
                _ => {
                    self.enter_raw();
                    self.spell(marker)?;
                }
            },
        }
        Ok(())
    }

    /// Takes one generated token (with its log-probabilities when requested).
    pub fn push(&mut self, id: u32, lp: Option<TokenLogprob>) -> Result<Delta, TokenizerError> {
        if self.early.is_some() {
            return Ok(Delta::default());
        }
        if !self.chat {
            // The terminal stop id of a raw completion is not text.
            if id != END_OF_MSG && id != EOS {
                self.text_token(id, lp)?;
            }
            return Ok(self.release());
        }
        let was_reasoning = self.phase == Phase::Reasoning;
        if was_reasoning {
            self.reasoning_tokens += 1;
            if let Some(ids) = self.reasoning_ids.as_mut() {
                ids.push(id);
            }
        }
        let limit = if self.phase == Phase::Tools {
            MAX_TOOL_MARKER_TOKENS
        } else {
            MAX_MARKER_TOKENS
        };
        if !self.marker.is_empty() {
            if id == SEP {
                self.marker.push((id, lp));
                self.complete_marker()?;
            } else if self.tok.is_special(id) {
                self.flush_marker()?;
                if (id == OPEN || id == CLOSE) && self.early.is_none() {
                    self.marker.push((id, lp));
                }
            } else {
                self.marker.push((id, lp));
                if self.marker.len() > limit {
                    self.flush_marker()?;
                }
            }
        } else if id == OPEN || id == CLOSE {
            self.marker.push((id, lp));
        } else if !self.tok.is_special(id) {
            self.text_token(id, lp)?;
        }
        if was_reasoning
            && self.phase != Phase::Reasoning
            && let Some(ids) = self.reasoning_ids.as_mut()
        {
            // The marker that ended the reasoning is not part of it.
            ids.truncate(ids.len().saturating_sub(self.last_marker_len));
        }
        Ok(self.release())
    }

    /// Generation ended: flushes unfinished markers, a cut-off tool call and incomplete
    /// UTF-8, and releases the rest.
    pub fn finish(&mut self) -> Result<Delta, TokenizerError> {
        if self.phase == Phase::Tools {
            // A marker cut off inside the tools block belongs to the block (a call that was
            // never completed), not to the content.
            self.marker.clear();
        } else if self.early.is_none() && !self.marker.is_empty() {
            self.flush_marker()?;
        }
        if self.phase == Phase::Tools
            && let Some(block) = self.block.as_mut()
        {
            block.abandon(&mut self.calls);
        }
        if self.early.is_none() {
            self.close_channels();
        }
        self.reasoning.closed = true;
        self.content.closed = true;
        Ok(self.release())
    }

    fn release(&mut self) -> Delta {
        if self.early.is_some() {
            self.reasoning.closed = true;
            self.content.closed = true;
        }
        let (reasoning, reasoning_logprobs) = self.reasoning.release(&[]);
        let (content, content_logprobs) = self.content.release(&self.stops);
        // The reasoning's ids go out once, when it can grow no more.
        let reasoning_over = self.phase != Phase::Reasoning || self.reasoning.closed;
        let reasoning_ids = match self.reasoning_ids.take() {
            Some(ids) if reasoning_over => ids,
            pending => {
                self.reasoning_ids = pending;
                Vec::new()
            }
        };
        Delta {
            reasoning,
            content,
            reasoning_logprobs,
            content_logprobs,
            tool_calls: std::mem::take(&mut self.calls),
            reasoning_ids,
        }
    }
}

/// A token's text for logprob listings: its own bytes, lossily decoded.
pub fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tok.token_bytes(id).unwrap_or_default().to_vec();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// Chat `logprobs.content`-style entries.
pub fn chat_logprob_entries(tok: &Tokenizer, entries: &[TokenEntry]) -> Value {
    let item = |id: u32, lp: f64| {
        let (text, bytes) = token_text(tok, id);
        let mut m = Map::new();
        m.insert("token".into(), Value::from(text));
        m.insert("logprob".into(), json!(lp));
        m.insert("bytes".into(), Value::from(bytes));
        m
    };
    Value::Array(
        entries
            .iter()
            .map(|e| {
                let mut m = item(e.lp.id, e.lp.logprob);
                let top: Vec<Value> =
                    e.lp.top
                        .iter()
                        .map(|&(id, lp)| Value::Object(item(id, lp)))
                        .collect();
                m.insert("top_logprobs".into(), Value::Array(top));
                Value::Object(m)
            })
            .collect(),
    )
}

/// The legacy completions `logprobs` object.
pub fn completions_logprobs(tok: &Tokenizer, entries: &[TokenEntry]) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top_logprobs = Vec::new();
    let mut offsets = Vec::new();
    for e in entries {
        tokens.push(Value::from(token_text(tok, e.lp.id).0));
        token_logprobs.push(json!(e.lp.logprob));
        let mut top = Map::new();
        for &(id, lp) in &e.lp.top {
            top.entry(token_text(tok, id).0).or_insert(json!(lp));
        }
        top_logprobs.push(Value::Object(top));
        offsets.push(Value::from(e.text_offset));
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    })
}
