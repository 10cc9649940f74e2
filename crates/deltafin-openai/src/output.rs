//! From generated token ids to the text a client sees.
//!
//! Chat output is split into channels on **token ids** (docs/K3.md §8.5): a marker is
//! `<|open|>` or `<|close|>`, ordinary tag tokens, then `<|sep|>`. Text between the generation
//! prompt's `<|open|>think<|sep|>` and `<|close|>think<|sep|>` is `reasoning_content`; text
//! between `<|open|>response<|sep|>` and `<|close|>response<|sep|>` is `content`. A user or
//! model string that spells `<|close|>` is ordinary tokens and stays text.
//!
//! Stop sequences are matched on each channel's decoded text across token boundaries; the
//! match and everything after it is never emitted, and while streaming only a suffix that
//! could still become a match is held back (plus incomplete UTF-8 and unfinished markers).

use deltafin_k3::text::tokenizer::{
    CLOSE, END_OF_MSG, EOS, OPEN, SEP, StreamDecoder, Tokenizer, TokenizerError,
};
use serde_json::{Map, Value, json};

/// Longest tag (in ordinary tokens) a marker may carry before it is read as text.
pub const MAX_MARKER_TOKENS: usize = 16;

/// The exact log-probability of one emitted token and its most likely alternatives
/// (log-softmax of K3's final logits at that position).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The emitted (greedy) token.
    pub id: u32,
    /// `logit[id] − logsumexp(logits)`.
    pub logprob: f64,
    /// The most likely tokens, descending, ties by lower id.
    pub top: Vec<(u32, f64)>,
}

/// A token's log-probability with the character offset of its text in its channel.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenEntry {
    /// The log-probabilities.
    pub lp: TokenLogprob,
    /// Offset (in Unicode scalar values) of the token's text in the channel's text.
    pub text_offset: usize,
}

/// A piece of one tool call in the model's output, in the shape of OpenAI's streamed
/// `tool_calls` deltas: the first piece of a call carries its `id` and `name`, later pieces
/// append to its `arguments` (a JSON object text, complete once the call has closed).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ToolCallDelta {
    /// 0-based position of the call in this answer.
    pub index: usize,
    /// The call id (first piece only).
    pub id: Option<String>,
    /// The function name (first piece only).
    pub name: Option<String>,
    /// More of the arguments' JSON text.
    pub arguments: String,
}

/// Newly releasable output.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Delta {
    /// Reasoning text (chat only).
    pub reasoning: String,
    /// Content text (the completion text on `/v1/completions`).
    pub content: String,
    /// Log-probabilities of the reasoning tokens whose text starts in `reasoning`.
    pub reasoning_logprobs: Vec<TokenEntry>,
    /// Log-probabilities of the content tokens whose text starts in `content`.
    pub content_logprobs: Vec<TokenEntry>,
    /// Tool-call pieces, in order (chat only).
    pub tool_calls: Vec<ToolCallDelta>,
}

impl Delta {
    /// Whether there is nothing to send.
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty()
            && self.content.is_empty()
            && self.reasoning_logprobs.is_empty()
            && self.content_logprobs.is_empty()
            && self.tool_calls.is_empty()
    }

    /// Appends `other`.
    pub fn extend(&mut self, other: Delta) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
        self.reasoning_logprobs.extend(other.reasoning_logprobs);
        self.content_logprobs.extend(other.content_logprobs);
        self.tool_calls.extend(other.tool_calls);
    }
}

struct Record {
    entry: Option<TokenEntry>,
    start_byte: usize,
}

/// The decoded text of one channel and what of it has been released.
#[derive(Default)]
struct ChannelText {
    decoder: StreamDecoder,
    text: String,
    chars: usize,
    released: usize,
    records: Vec<Record>,
    closed: bool,
}

impl ChannelText {
    /// Appends `piece`; returns true if a stop sequence now matches (the text is cut there).
    fn append(&mut self, piece: &str, lp: Option<TokenLogprob>, stops: &[String]) -> bool {
        self.records.push(Record {
            entry: lp.map(|lp| TokenEntry {
                lp,
                text_offset: self.chars,
            }),
            start_byte: self.text.len(),
        });
        self.text.push_str(piece);
        self.chars += piece.chars().count();
        self.check_stops(stops)
    }

    fn push(
        &mut self,
        tok: &Tokenizer,
        id: u32,
        lp: Option<TokenLogprob>,
        stops: &[String],
    ) -> Result<bool, TokenizerError> {
        let piece = self.decoder.push(tok, id)?;
        Ok(self.append(&piece, lp, stops))
    }

    /// A match can only start in the unreleased tail (a possible prefix is held back).
    fn check_stops(&mut self, stops: &[String]) -> bool {
        let tail = &self.text[self.released..];
        let hit = stops.iter().filter_map(|s| tail.find(s.as_str())).min();
        let Some(pos) = hit else { return false };
        let cut = self.released + pos;
        self.text.truncate(cut);
        self.chars = self.text.chars().count();
        self.records.retain(|r| r.start_byte < cut);
        self.closed = true;
        true
    }

    /// Flushes the decoder: no more tokens will come to this channel.
    fn close(&mut self, stops: &[String]) -> bool {
        if self.closed {
            return false;
        }
        self.closed = true;
        let tail = std::mem::take(&mut self.decoder).finish();
        if tail.is_empty() {
            return false;
        }
        self.text.push_str(&tail);
        self.chars += tail.chars().count();
        self.check_stops(stops)
    }

    /// Where released text may end: before the longest suffix that is a proper prefix of a
    /// stop sequence (nothing is held back once the channel is closed).
    fn release_point(&self, stops: &[String]) -> usize {
        if self.closed || stops.is_empty() {
            return self.text.len();
        }
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        let from = self
            .text
            .len()
            .saturating_sub(longest.saturating_sub(1))
            .max(self.released);
        (from..self.text.len())
            .filter(|&q| self.text.is_char_boundary(q))
            .find(|&q| {
                let suffix = &self.text[q..];
                stops
                    .iter()
                    .any(|s| s.len() > suffix.len() && s.starts_with(suffix))
            })
            .unwrap_or(self.text.len())
    }

    fn release(&mut self, stops: &[String]) -> (String, Vec<TokenEntry>) {
        let q = self.release_point(stops);
        let text = self.text[self.released..q].to_string();
        self.released = q;
        let n = if self.closed {
            self.records.len()
        } else {
            self.records.partition_point(|r| r.start_byte < q)
        };
        let entries = self.records.drain(..n).filter_map(|r| r.entry).collect();
        (text, entries)
    }
}

/// Where the chat output is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Reasoning,
    BeforeResponse,
    Content,
    After,
}

/// Turns generated ids into released text, channel by channel.
pub struct Assembler<'t> {
    tok: &'t Tokenizer,
    chat: bool,
    phase: Phase,
    marker: Vec<(u32, Option<TokenLogprob>)>,
    reasoning: ChannelText,
    content: ChannelText,
    stops: Vec<String>,
    stop_hit: bool,
    reasoning_tokens: usize,
}

impl<'t> Assembler<'t> {
    /// An assembler for chat output (after a thinking generation prompt) or raw completion
    /// output.
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
            stop_hit: false,
            reasoning_tokens: 0,
        }
    }

    /// Chat output after a generation prompt that opened `response` (thinking off): the
    /// first tokens are content, and no token counts as reasoning.
    pub fn after_response_prompt(mut self) -> Self {
        if self.chat {
            self.phase = Phase::Content;
        }
        self
    }

    /// Whether a stop sequence matched (generation must end).
    pub fn stop_hit(&self) -> bool {
        self.stop_hit
    }

    /// Generated tokens up to and including the marker that closes the thinking channel.
    pub fn reasoning_tokens(&self) -> usize {
        self.reasoning_tokens
    }

    fn channel(&mut self) -> Option<&mut ChannelText> {
        match self.phase {
            Phase::Reasoning => Some(&mut self.reasoning),
            Phase::Content => Some(&mut self.content),
            Phase::BeforeResponse | Phase::After => None,
        }
    }

    fn text_token(&mut self, id: u32, lp: Option<TokenLogprob>) -> Result<(), TokenizerError> {
        let stops = std::mem::take(&mut self.stops);
        let tok = self.tok;
        let hit = match self.channel() {
            Some(ch) => ch.push(tok, id, lp, &stops)?,
            None => false,
        };
        self.stops = stops;
        self.stop_hit |= hit;
        Ok(())
    }

    /// The ordinary tokens of an abandoned marker are text of the current channel.
    fn flush_marker(&mut self) -> Result<(), TokenizerError> {
        let pending = std::mem::take(&mut self.marker);
        for (id, lp) in pending.into_iter().skip(1) {
            if self.stop_hit {
                break;
            }
            self.text_token(id, lp)?;
        }
        Ok(())
    }

    fn close_channel(&mut self, reasoning: bool) {
        let stops = std::mem::take(&mut self.stops);
        let ch = if reasoning {
            &mut self.reasoning
        } else {
            &mut self.content
        };
        self.stop_hit |= ch.close(&stops);
        self.stops = stops;
    }

    fn complete_marker(&mut self) -> Result<(), TokenizerError> {
        let ids: Vec<u32> = self.marker[1..].iter().map(|(id, _)| *id).collect();
        let opening = self.marker[0].0 == OPEN;
        self.marker.clear();
        let tag = self.tok.decode(&ids)?;
        match (opening, tag.as_str(), self.phase) {
            (false, "think", Phase::Reasoning) => {
                self.close_channel(true);
                self.phase = Phase::BeforeResponse;
            }
            (true, "response", Phase::Reasoning | Phase::BeforeResponse) => {
                self.close_channel(true);
                self.phase = Phase::Content;
            }
            (false, "response", Phase::Content) | (true, "tools", _) | (false, "message", _) => {
                self.close_channel(true);
                self.close_channel(false);
                self.phase = Phase::After;
            }
            _ => {}
        }
        Ok(())
    }

    /// Takes one generated token (with its log-probabilities when requested).
    pub fn push(&mut self, id: u32, lp: Option<TokenLogprob>) -> Result<Delta, TokenizerError> {
        if self.stop_hit {
            return Ok(Delta::default());
        }
        if !self.chat {
            // The terminal stop id of a raw completion is not text.
            if id != END_OF_MSG && id != EOS {
                self.text_token(id, lp)?;
            }
            return Ok(self.release());
        }
        if self.phase == Phase::Reasoning {
            self.reasoning_tokens += 1;
        }
        if !self.marker.is_empty() {
            if id == SEP {
                self.complete_marker()?;
            } else if self.tok.is_special(id) {
                self.flush_marker()?;
                if id == OPEN || id == CLOSE {
                    self.marker.push((id, lp));
                }
            } else {
                self.marker.push((id, lp));
                if self.marker.len() > MAX_MARKER_TOKENS {
                    self.flush_marker()?;
                }
            }
        } else if id == OPEN || id == CLOSE {
            self.marker.push((id, lp));
        } else if !self.tok.is_special(id) {
            self.text_token(id, lp)?;
        }
        Ok(self.release())
    }

    /// Generation ended: flushes unfinished markers and incomplete UTF-8, releases the rest.
    pub fn finish(&mut self) -> Result<Delta, TokenizerError> {
        if !self.stop_hit && !self.marker.is_empty() {
            self.flush_marker()?;
        }
        if !self.stop_hit {
            self.close_channel(true);
        }
        if !self.stop_hit {
            self.close_channel(false);
        }
        self.reasoning.closed = true;
        self.content.closed = true;
        Ok(self.release())
    }

    fn release(&mut self) -> Delta {
        if self.stop_hit {
            self.reasoning.closed = true;
            self.content.closed = true;
        }
        let (reasoning, reasoning_logprobs) = self.reasoning.release(&self.stops);
        let (content, content_logprobs) = self.content.release(&self.stops);
        Delta {
            reasoning,
            content,
            reasoning_logprobs,
            content_logprobs,
            tool_calls: Vec::new(),
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

#[cfg(test)]
mod tests {
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
    fn without_thinking_the_output_starts_as_content() {
        let tok = kimi();
        let mut ids = tok.encode_ordinary("Paris.");
        ids.extend(marker(&tok, false, "response"));
        ids.extend(marker(&tok, false, "message"));
        ids.push(END_OF_MSG);
        let mut a = Assembler::new(&tok, true, vec![]).after_response_prompt();
        let mut all = Delta::default();
        for &id in &ids {
            all.extend(a.push(id, None).unwrap());
        }
        all.extend(a.finish().unwrap());
        assert_eq!(all.content, "Paris.");
        assert_eq!(all.reasoning, "");
        assert_eq!(a.reasoning_tokens(), 0);
        // Raw completions have no channels to start in.
        let mut raw = Assembler::new(&tok, false, vec![]).after_response_prompt();
        let d = raw.push(tok.encode_ordinary("x")[0], None).unwrap();
        assert_eq!(d.content, "x");
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

    #[test]
    fn stop_in_reasoning_channel() {
        let tok = kimi();
        let ids = tok.encode_ordinary("one two three");
        let (_, all, stopped) = run(&tok, true, &[" two"], &ids);
        assert!(stopped);
        assert_eq!(all.reasoning, "one");
        assert_eq!(all.content, "");
    }
}
