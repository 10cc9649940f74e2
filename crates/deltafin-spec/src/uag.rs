//! Cross-tokenizer drafting with a Qwen3 model for raw completions (docs/K3.md §10, the
//! original's "universal assisted generation"): the K3 history is decoded to text, drafted
//! on by Qwen in its own tokens, and the continuation is re-encoded with K3. A proposal is
//! made only where the re-encoding reproduces the K3 history exactly.
//!
//! Qwen's own `tokenizer.json` is read by [`QwenTokenizer`] (the `tokenizers` crate, pure
//! Rust); [`open_draft_dir`] loads a `k3-draft-qwen3-*-base/` directory. The lazy 1.7B
//! second opinion (§10 step 5) is [`crate::escalate::Escalating`] over two of these drafters.

use crate::Drafter;
use crate::qwen3::{Qwen3Cache, Qwen3Error, Qwen3Model};
use deltafin_k3::text::tokenizer::Tokenizer;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The directory of the 0.6B draft under the model root.
pub const QWEN_SMALL_DIR: &str = "k3-draft-qwen3-0.6b-base";
/// The directory of the 1.7B draft under the model root.
pub const QWEN_LARGE_DIR: &str = "k3-draft-qwen3-1.7b-base";
/// The files of a Qwen draft directory this engine reads.
pub const QWEN_FILES: [&str; 3] = ["config.json", "model.safetensors", "tokenizer.json"];

/// Errors of loading a Qwen draft directory; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum UagError {
    /// A required file is absent.
    #[error("Qwen draft file {} is missing", path.display())]
    Missing {
        /// The file.
        path: PathBuf,
    },
    /// The model failed to load.
    #[error("Qwen draft model in {}: {source}", dir.display())]
    Model {
        /// The directory.
        dir: PathBuf,
        /// Why.
        source: Qwen3Error,
    },
    /// `tokenizer.json` is unreadable or does not fit the model.
    #[error("Qwen draft tokenizer {}: {message}", path.display())]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// Qwen's byte-level BPE tokenizer, read from its `tokenizer.json`.
pub struct QwenTokenizer {
    inner: tokenizers::Tokenizer,
}

impl QwenTokenizer {
    /// Read `path` (a Hugging Face `tokenizer.json`).
    pub fn from_file(path: &Path) -> Result<QwenTokenizer, UagError> {
        let bytes = std::fs::read(path).map_err(|e| UagError::Tokenizer {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| UagError::Tokenizer {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Ok(QwenTokenizer { inner })
    }

    /// Ids in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

impl DraftTokenizer for QwenTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    }
    fn decode(&self, ids: &[u32]) -> Option<String> {
        if ids.iter().any(|&i| self.inner.id_to_token(i).is_none()) {
            return None;
        }
        self.inner.decode(ids, false).ok()
    }
}

/// Load a Qwen draft directory (`config.json`, `model.safetensors`, `tokenizer.json`); every
/// tokenizer id must be inside the model's vocabulary.
pub fn open_draft_dir(dir: &Path) -> Result<(Qwen3Model, QwenTokenizer), UagError> {
    for f in QWEN_FILES {
        if !dir.join(f).is_file() {
            return Err(UagError::Missing { path: dir.join(f) });
        }
    }
    let model = Qwen3Model::open(dir).map_err(|source| UagError::Model {
        dir: dir.to_path_buf(),
        source,
    })?;
    let path = dir.join("tokenizer.json");
    let tok = QwenTokenizer::from_file(&path)?;
    if tok.vocab_size() > model.config.vocab_size {
        return Err(UagError::Tokenizer {
            path,
            message: format!(
                "{} token ids, more than the model's vocab_size {} (config.json)",
                tok.vocab_size(),
                model.config.vocab_size
            ),
        });
    }
    Ok((model, tok))
}

/// GPT-2's byte ↔ printable-character table of byte-level BPE.
fn byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        out[b as usize] = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('?')
        };
    }
    out
}

/// Qwen2/3's pre-tokenizer pattern.
const QWEN_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A small Qwen-like `tokenizer.json` for tests and synthesized installs (the real one is
/// not redistributed): NFC, Qwen's split pattern, byte-level BPE whose merges are K3's
/// lowest-ranked multi-byte tokens (at most `merges` of them), and `<|endoftext|>`.
pub fn synthesize_tokenizer_json(k3: &Tokenizer, merges: usize) -> Value {
    let chars = byte_chars();
    let spell = |b: &[u8]| -> String { b.iter().map(|&x| chars[x as usize]).collect() };
    let mut vocab = serde_json::Map::new();
    let mut known = std::collections::HashSet::new();
    for b in 0..=255u8 {
        vocab.insert(spell(&[b]), json!(b));
        known.insert(vec![b]);
    }
    let mut merge_list = Vec::new();
    for rank in 0..k3.num_ranks() {
        if merge_list.len() >= merges {
            break;
        }
        let Some(t) = k3.token_bytes(rank) else {
            continue;
        };
        if t.len() < 2 || known.contains(t) {
            continue;
        }
        if let Some(cut) =
            (1..t.len()).find(|&c| known.contains(&t[..c]) && known.contains(&t[c..]))
        {
            merge_list.push(format!("{} {}", spell(&t[..cut]), spell(&t[cut..])));
            vocab.insert(spell(t), json!(known.len()));
            known.insert(t.to_vec());
        }
    }
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{"id": known.len(), "content": "<|endoftext|>", "single_word": false,
                          "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_PATTERN}, "behavior": "Isolated", "invert": false},
            byte_level.clone(),
        ]},
        "post_processor": byte_level.clone(),
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": merge_list},
    })
}

/// The draft model's tokenizer.
pub trait DraftTokenizer {
    /// Token ids of `text`.
    fn encode(&self, text: &str) -> Vec<u32>;
    /// Text of `ids`; `None` when they do not decode (e.g. an id out of range).
    fn decode(&self, ids: &[u32]) -> Option<String>;
}

impl<T: DraftTokenizer + ?Sized> DraftTokenizer for Arc<T> {
    fn encode(&self, text: &str) -> Vec<u32> {
        (**self).encode(text)
    }
    fn decode(&self, ids: &[u32]) -> Option<String> {
        (**self).decode(ids)
    }
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
    /// Per-token acceptance estimate of the last proposal.
    confidence: Vec<f32>,
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
            confidence: Vec::new(),
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
    fn confidence(&self) -> &[f32] {
        &self.confidence
    }

    fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        self.confidence.clear();
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
        let tail = &all[history.len()..];
        let out: Vec<u32> = tail.iter().take(max).copied().collect();
        if !out.is_empty() {
            self.stats.proposals += 1;
            // The drafted text's probability (the product of Qwen's), spread evenly over the
            // K3 tokens that spell it.
            let log_p: f32 = drafts.iter().map(|&(_, p)| p.max(1e-9).ln()).sum();
            let each = (log_p / tail.len() as f32).exp();
            self.confidence = vec![each; out.len()];
        }
        out
    }
}
