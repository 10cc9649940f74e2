//! The decoded text of one output channel (reasoning or content) and how much of it has been
//! released: incomplete UTF-8 and a suffix that could still become a stop sequence are held
//! back; a completed stop sequence cuts the text.

use super::delta::{TokenEntry, TokenLogprob};
use deltafin_k3::text::tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

struct Record {
    entry: Option<TokenEntry>,
    start_byte: usize,
}

/// The decoded text of one channel and what of it has been released.
#[derive(Default)]
pub(super) struct ChannelText {
    decoder: StreamDecoder,
    text: String,
    chars: usize,
    released: usize,
    records: Vec<Record>,
    /// No more text is held back (the channel ended or a stop sequence cut it).
    pub(super) closed: bool,
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

    /// Decodes `id` onto the text; returns true if a stop sequence now matches.
    pub(super) fn push(
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

    /// Flushes the decoder: the text so far is complete (more may follow later, as a new run
    /// of tokens, after [`ChannelText::reopen`]). Returns true if a stop sequence matched.
    pub(super) fn close(&mut self, stops: &[String]) -> bool {
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

    /// More text follows a close (a malformed tools block surfaced as content).
    pub(super) fn reopen(&mut self) {
        self.closed = false;
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

    /// The text and log-probability entries that can be sent now.
    pub(super) fn release(&mut self, stops: &[String]) -> (String, Vec<TokenEntry>) {
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
