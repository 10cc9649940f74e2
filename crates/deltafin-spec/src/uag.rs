//! Cross-tokenizer drafting with a Qwen3 model for raw completions (k3-model.md §10, the
//! original's "universal assisted generation"): the K3 history is decoded to text, drafted
//! on by Qwen in its own tokens, and the continuation is re-encoded with K3. A proposal is
//! made only where the re-encoding reproduces the K3 history exactly.
//!
//! Not yet here: the 0.6B/1.7B pairing (§10 step 5) and `K3_UAG_DRAFT`; Qwen's own
//! `tokenizer.json` reader (any [`DraftTokenizer`] plugs in).

use crate::Drafter;
use crate::qwen3::{Qwen3Cache, Qwen3Model};
use deltafin_k3::tokenizer::Tokenizer;
use std::sync::Arc;

/// The draft model's tokenizer.
pub trait DraftTokenizer {
    /// Token ids of `text`.
    fn encode(&self, text: &str) -> Vec<u32>;
    /// Text of `ids`; `None` when they do not decode (e.g. an id out of range).
    fn decode(&self, ids: &[u32]) -> Option<String>;
}

/// Qwen drafts whose probability falls below this end the proposal (when more than 2
/// tokens are requested).
pub const MIN_DRAFT_PROBABILITY: f32 = 0.3;

/// Counters of a [`UagDrafter`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UagStats {
    /// Proposals returned (non-empty).
    pub proposals: usize,
    /// Calls where the K3 history does not survive decode → re-encode.
    pub history_mismatch: usize,
    /// Calls where K3's re-encoding of history + draft text does not start with the history.
    pub boundary_mismatch: usize,
    /// Calls where Qwen failed (a token outside its vocabulary).
    pub draft_errors: usize,
}

/// A Qwen3 model with its tokenizer, drafting for K3 across tokenizers.
pub struct UagDrafter<T: DraftTokenizer> {
    qwen: Arc<Qwen3Model>,
    qwen_tok: T,
    k3_tok: Arc<Tokenizer>,
    cache: Qwen3Cache,
    /// Qwen ids whose keys and values are in `cache`, in order.
    cached: Vec<u32>,
    /// Counters.
    pub stats: UagStats,
}

impl<T: DraftTokenizer> UagDrafter<T> {
    /// A drafter over `qwen` (tokenizing with `qwen_tok`) for a K3 with tokenizer `k3_tok`.
    pub fn new(qwen: Arc<Qwen3Model>, qwen_tok: T, k3_tok: Arc<Tokenizer>) -> Self {
        let cache = qwen.new_cache();
        UagDrafter {
            qwen,
            qwen_tok,
            k3_tok,
            cache,
            cached: Vec::new(),
            stats: UagStats::default(),
        }
    }

    /// Qwen's greedy continuation of `ids` (at most `n` tokens with probabilities), reusing
    /// the cached prefix shared with the previous call.
    fn qwen_draft(&mut self, ids: &[u32], n: usize) -> Option<Vec<(u32, f32)>> {
        let shared = self
            .cached
            .iter()
            .zip(ids)
            .take_while(|(a, b)| a == b)
            .count()
            .min(ids.len().saturating_sub(1));
        self.cache.truncate(shared, self.qwen.kv_width());
        self.cached.truncate(shared);
        match self.qwen.draft(&mut self.cache, &ids[shared..], n) {
            Ok(d) => {
                // The cache now holds ids and every draft but the last.
                self.cached.extend_from_slice(&ids[shared..]);
                self.cached
                    .extend(d.iter().take(d.len().saturating_sub(1)).map(|&(t, _)| t));
                Some(d)
            }
            Err(_) => {
                self.cache = self.qwen.new_cache();
                self.cached.clear();
                None
            }
        }
    }
}

impl<T: DraftTokenizer> Drafter for UagDrafter<T> {
    fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        if max == 0 || history.is_empty() {
            return Vec::new();
        }
        // 1. The history must survive decode → re-encode.
        let Ok(text) = self.k3_tok.decode(history) else {
            self.stats.history_mismatch += 1;
            return Vec::new();
        };
        if self.k3_tok.encode(&text, true) != history {
            self.stats.history_mismatch += 1;
            return Vec::new();
        }
        // 2. Qwen drafts clamp(max + 2, 3, 20) of its tokens.
        let q_ids = self.qwen_tok.encode(&text);
        if q_ids.is_empty() {
            self.stats.history_mismatch += 1;
            return Vec::new();
        }
        let Some(mut drafts) = self.qwen_draft(&q_ids, (max + 2).clamp(3, 20)) else {
            self.stats.draft_errors += 1;
            return Vec::new();
        };
        // 4. Cut at the first unconfident Qwen token.
        if max > 2
            && let Some(cut) = drafts.iter().position(|&(_, p)| p < MIN_DRAFT_PROBABILITY)
        {
            drafts.truncate(cut);
        }
        let ids: Vec<u32> = drafts.iter().map(|&(t, _)| t).collect();
        let Some(more) = self.qwen_tok.decode(&ids) else {
            self.stats.draft_errors += 1;
            return Vec::new();
        };
        // 3. K3's re-encoding of history + draft text must start with the history.
        let all = self.k3_tok.encode(&(text + &more), true);
        if !all.starts_with(history) {
            self.stats.boundary_mismatch += 1;
            return Vec::new();
        }
        let out: Vec<u32> = all[history.len()..].iter().take(max).copied().collect();
        if !out.is_empty() {
            self.stats.proposals += 1;
        }
        out
    }
}
