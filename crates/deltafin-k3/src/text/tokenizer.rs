//! The Kimi K3 tokenizer (spec §7): tiktoken byte-level rank BPE over `tiktoken.model`,
//! the exact Moonshot pre-tokenizer regex, 256 special tokens, and Moonshot's
//! 400,000 / 25,000 character splitting rule.
//!
//! Encoding reproduces Python `tiktoken` 0.14.0 driven by Moonshot's `TikTokenTokenizer`
//! wrapper id for id (pinned by `tests/fixtures/tokenizer/goldens.json`).
//!
//! The pre-tokenizer regex (§7.3) contains one lookahead alternative, `\s+(?!\S)`. It is
//! evaluated with the `regex` crate on the other seven alternatives plus an explicit rule
//! for the lookahead (see [`Tokenizer::split_pieces`]), which is exact and much faster than
//! a backtracking engine.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use regex::Regex;
use rustc_hash::FxHashMap;

/// Number of reserved special tokens after the BPE ranks (`num_reserved_special_tokens`).
pub const NUM_SPECIAL_TOKENS: u32 = 256;
/// `[BOS]`: beginning of a document; never added by the chat encoder.
pub const BOS: u32 = 163584;
/// `[EOS]`: end of a pretraining document (the tokenizer's `eos_token`).
pub const EOS: u32 = 163585;
/// `<|end_of_msg|>`: end of a chat turn; `config.json` `eos_token_id`, the chat stop token.
pub const END_OF_MSG: u32 = 163586;
/// `<|open|>`: XTML open marker.
pub const OPEN: u32 = 163587;
/// `<|close|>`: XTML close marker.
pub const CLOSE: u32 = 163588;
/// `<|sep|>`: XTML separator.
pub const SEP: u32 = 163589;

/// Moonshot's wrapper cuts the text into slices of this many characters (§7.4 step 1).
pub const MAX_ENCODE_CHARS: usize = 400_000;
/// No run of whitespace or of non-whitespace in one piece exceeds this many characters
/// (§7.4 step 2).
pub const MAX_RUN_CHARS: usize = 25_000;

/// Pieces longer than this many bytes are merged with the O(n log n) heap variant of the
/// rank-merge algorithm; shorter ones with tiktoken's simple quadratic scan. Both give the
/// same result (lowest rank first, ties to the leftmost pair).
const HEAP_MERGE_THRESHOLD: usize = 256;

/// The first six alternatives of the §7.3 regex, shared by [`PATTERN`] and
/// `PATTERN_NO_LOOKAHEAD`.
macro_rules! k3_head_alternatives {
    () => {
        concat!(
            r"[\p{Han}]+",
            "|",
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            "|",
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            "|",
            r"\p{N}{1,3}",
            "|",
            r" ?[^\s\p{L}\p{N}]+[\r\n]*",
            "|",
            r"\s*[\r\n]+",
        )
    };
}

/// The §7.3 pre-tokenizer regex, verbatim (`|`-join of eight alternatives).
pub const PATTERN: &str = concat!(k3_head_alternatives!(), "|", r"\s+(?!\S)", "|", r"\s+");

/// [`PATTERN`] without the lookahead alternative `\s+(?!\S)`; the lookahead is applied
/// by [`Tokenizer::split_pieces`].
const PATTERN_NO_LOOKAHEAD: &str = concat!(k3_head_alternatives!(), "|", r"\s+");

/// Errors from loading the tokenizer files or decoding ids.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A tokenizer file could not be read.
    #[error("cannot read tokenizer file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A line of `tiktoken.model` is malformed or inconsistent.
    #[error("{path}:{line}: {reason}")]
    BadRankLine {
        /// The rank file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// The rank file as a whole is inconsistent (missing ranks, no lines).
    #[error("{path}: {reason}")]
    BadRankFile {
        /// The rank file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// `tokenizer_config.json` is malformed or inconsistent with the rank file.
    #[error("{path}: {reason}")]
    BadConfig {
        /// The config file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// An id outside `0..vocab_size` was given to a decoder.
    #[error("token id {id} is out of range (vocabulary size {vocab_size})")]
    IdOutOfRange {
        /// The offending id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// A regex failed to compile (an internal invariant; reported rather than panicking).
    #[error("cannot compile tokenizer regex: {0}")]
    Regex(#[from] regex::Error),
}

/// The Kimi K3 tokenizer: BPE ranks plus 256 specials (vocabulary 163,840 for the real files).
#[derive(Debug, Clone)]
pub struct Tokenizer {
    /// Token bytes -> id, for the BPE ranks only.
    encoder: FxHashMap<Vec<u8>, u32>,
    /// id -> token bytes, ranks followed by specials.
    decoder: Vec<Vec<u8>>,
    /// Special spelling -> id.
    specials: FxHashMap<String, u32>,
    /// Number of BPE ranks (= first special id).
    num_ranks: u32,
    /// [`PATTERN_NO_LOOKAHEAD`], compiled.
    pieces: Regex,
    /// Alternation of all escaped special spellings (tiktoken `allowed_special="all"`).
    special_re: Regex,
}

/// Python `str.isspace` (§7.4): the whitespace set of the 25,000 run rule. Differs from
/// [`char::is_whitespace`] by including U+001C..U+001F.
pub fn is_py_space(c: char) -> bool {
    matches!(
        c,
        '\u{9}'..='\u{d}'
            | '\u{1c}'..='\u{20}'
            | '\u{85}'
            | '\u{a0}'
            | '\u{1680}'
            | '\u{2000}'..='\u{200a}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{202f}'
            | '\u{205f}'
            | '\u{3000}'
    )
}

/// Splits `text` per §7.4: 400,000-character slices, then pieces in which no run of
/// whitespace (Python `str.isspace`) or of non-whitespace exceeds 25,000 characters.
/// Mirrors `TikTokenTokenizer._encode_text_piece`; empty input yields one empty piece.
pub fn split_for_encoding(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    loop {
        let slice_end = rest
            .char_indices()
            .nth(MAX_ENCODE_CHARS)
            .map_or(rest.len(), |(i, _)| i);
        let (slice, tail) = rest.split_at(slice_end);
        split_runs(slice, MAX_RUN_CHARS, &mut out);
        rest = tail;
        if rest.is_empty() {
            break;
        }
    }
    out
}

/// `_split_whitespaces_or_nonwhitespaces(s, max_run)`.
fn split_runs<'a>(s: &'a str, max_run: usize, out: &mut Vec<&'a str>) {
    let mut chars = s.char_indices().peekable();
    let mut run_is_space = chars.peek().is_some_and(|&(_, c)| is_py_space(c));
    let mut run_len = 0usize;
    let mut piece_start = 0usize;
    for (i, c) in chars {
        let is_space = is_py_space(c);
        if is_space != run_is_space {
            run_len = 1;
            run_is_space = is_space;
        } else {
            run_len += 1;
            if run_len > max_run {
                out.push(&s[piece_start..i]);
                piece_start = i;
                run_len = 1;
            }
        }
    }
    out.push(&s[piece_start..]);
}

impl Tokenizer {
    /// Loads `tiktoken.model` and `tokenizer_config.json` from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        Self::from_files(
            &dir.join("tiktoken.model"),
            &dir.join("tokenizer_config.json"),
        )
    }

    /// Loads the base64 rank file and the special-token names of `tokenizer_config.json`
    /// (`added_tokens_decoder`; unnamed specials are `<|reserved_token_{id}|>`).
    pub fn from_files(
        tiktoken_model: &Path,
        tokenizer_config: &Path,
    ) -> Result<Tokenizer, TokenizerError> {
        let ranks_text =
            std::fs::read_to_string(tiktoken_model).map_err(|source| TokenizerError::Io {
                path: tiktoken_model.to_path_buf(),
                source,
            })?;
        let config_text =
            std::fs::read_to_string(tokenizer_config).map_err(|source| TokenizerError::Io {
                path: tokenizer_config.to_path_buf(),
                source,
            })?;
        let ranks = parse_ranks(&ranks_text, tiktoken_model)?;
        let num_ranks = u32::try_from(ranks.len()).map_err(|_| TokenizerError::BadRankFile {
            path: tiktoken_model.to_path_buf(),
            reason: format!("{} ranks do not fit in u32 ids", ranks.len()),
        })?;
        let names = parse_special_names(&config_text, tokenizer_config, num_ranks)?;
        Self::from_parts(ranks, names)
    }

    /// Builds a tokenizer from rank-ordered token bytes and the 256 special spellings
    /// (index `i` is id `ranks.len() + i`).
    fn from_parts(ranks: Vec<Vec<u8>>, special_names: Vec<String>) -> Result<Self, TokenizerError> {
        let num_ranks = ranks.len() as u32;
        let mut encoder = FxHashMap::default();
        encoder.reserve(ranks.len());
        for (id, bytes) in ranks.iter().enumerate() {
            encoder.insert(bytes.clone(), id as u32);
        }
        let mut decoder = ranks;
        let mut specials = FxHashMap::default();
        for (i, name) in special_names.iter().enumerate() {
            specials.insert(name.clone(), num_ranks + i as u32);
            decoder.push(name.as_bytes().to_vec());
        }
        let pieces = Regex::new(PATTERN_NO_LOOKAHEAD)?;
        let alternation = special_names
            .iter()
            .map(|s| regex::escape(s))
            .collect::<Vec<_>>()
            .join("|");
        let special_re = Regex::new(&alternation)?;
        Ok(Tokenizer {
            encoder,
            decoder,
            specials,
            num_ranks,
            pieces,
            special_re,
        })
    }

    /// Vocabulary size: BPE ranks + 256 specials (163,840 for K3).
    pub fn vocab_size(&self) -> usize {
        self.decoder.len()
    }

    /// Number of BPE ranks; the first special id.
    pub fn num_ranks(&self) -> u32 {
        self.num_ranks
    }

    /// The id of a special-token spelling such as `"<|open|>"`, if it is one.
    pub fn special_id(&self, spelling: &str) -> Option<u32> {
        self.specials.get(spelling).copied()
    }

    /// Whether `id` is one of the 256 special tokens.
    pub fn is_special(&self, id: u32) -> bool {
        id >= self.num_ranks && (id as usize) < self.decoder.len()
    }

    /// The bytes of one token (for a special: its spelling), or `None` if out of range.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.decoder.get(id as usize).map(Vec::as_slice)
    }

    /// Encodes ordinary text: special spellings are plain text (`disallowed_special=()`).
    pub fn encode_ordinary(&self, text: &str) -> Vec<u32> {
        self.encode(text, false)
    }

    /// Moonshot's `encode(text, allow_special_tokens)` (§7.4, §7.5). With `allow_special`
    /// the 256 special spellings are matched first (tiktoken `allowed_special="all"`) and
    /// emitted as their ids; the text between them is ordinary.
    pub fn encode(&self, text: &str, allow_special: bool) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        for piece in split_for_encoding(text) {
            if allow_special {
                self.encode_with_specials(piece, &mut ids);
            } else {
                self.encode_plain(piece, &mut ids);
            }
        }
        ids
    }

    /// tiktoken's `encode(piece, allowed_special="all")`.
    fn encode_with_specials(&self, piece: &str, ids: &mut Vec<u32>) {
        let mut start = 0;
        for m in self.special_re.find_iter(piece) {
            self.encode_plain(&piece[start..m.start()], ids);
            // Every match of `special_re` is one of the spellings in `specials`.
            if let Some(&id) = self.specials.get(m.as_str()) {
                ids.push(id);
            }
            start = m.end();
        }
        self.encode_plain(&piece[start..], ids);
    }

    /// tiktoken's `encode_ordinary(piece)`: regex split, then BPE per regex piece.
    fn encode_plain(&self, text: &str, ids: &mut Vec<u32>) {
        for piece in self.split_pieces(text) {
            self.bpe(piece.as_bytes(), ids);
        }
    }

    /// The §7.3 regex pieces of `text`, in order; they concatenate to `text`.
    ///
    /// The compiled regex lacks the seventh alternative `\s+(?!\S)`. Leftmost-first
    /// alternation means a match differs only when the eighth alternative `\s+` matched: an
    /// all-whitespace match without `\r`/`\n` (alternative six, `\s*[\r\n]+`, precedes the
    /// lookahead and wins whenever the run holds a line break). That match is a maximal
    /// whitespace run; if text follows it and it has two or more characters, the lookahead
    /// alternative would have matched the run minus its last character, so the match is
    /// shortened by one character and the search resumes there.
    pub fn split_pieces<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut out = Vec::new();
        let mut pos = 0;
        while pos < text.len() {
            let Some(m) = self.pieces.find_at(text, pos) else {
                break;
            };
            let mut end = m.end();
            let s = m.as_str();
            if end < text.len()
                && s.chars().all(char::is_whitespace)
                && !s.contains(['\r', '\n'])
                && let Some((last, _)) = s.char_indices().next_back()
                && last > 0
            {
                end = m.start() + last;
            }
            if m.start() > pos {
                // The regex covers every character (`\s+` or one of the classes), so gaps
                // cannot occur; keep the bytes anyway rather than dropping text.
                out.push(&text[pos..m.start()]);
            }
            out.push(&text[m.start()..end]);
            pos = end;
        }
        if pos < text.len() {
            out.push(&text[pos..]);
        }
        out
    }

    /// Byte-level rank BPE of one regex piece (tiktoken `byte_pair_encode`).
    fn bpe(&self, piece: &[u8], ids: &mut Vec<u32>) {
        if piece.is_empty() {
            return;
        }
        if let Some(&id) = self.encoder.get(piece) {
            ids.push(id);
            return;
        }
        if piece.len() > HEAP_MERGE_THRESHOLD {
            self.bpe_heap(piece, ids);
        } else {
            self.bpe_scan(piece, ids);
        }
    }

    fn rank(&self, bytes: &[u8]) -> u32 {
        self.encoder.get(bytes).copied().unwrap_or(u32::MAX)
    }

    /// tiktoken's `_byte_pair_merge`: `parts[i] = (start, rank of bytes[start..parts[i+2].start])`.
    fn bpe_scan(&self, piece: &[u8], ids: &mut Vec<u32>) {
        let mut parts: Vec<(usize, u32)> = Vec::with_capacity(piece.len() + 1);
        let mut min = (u32::MAX, usize::MAX);
        for i in 0..piece.len() - 1 {
            let r = self.rank(&piece[i..i + 2]);
            if r < min.0 {
                min = (r, i);
            }
            parts.push((i, r));
        }
        parts.push((piece.len() - 1, u32::MAX));
        parts.push((piece.len(), u32::MAX));
        let rank_at = |parts: &[(usize, u32)], i: usize| -> u32 {
            if i + 3 < parts.len() {
                self.rank(&piece[parts[i].0..parts[i + 3].0])
            } else {
                u32::MAX
            }
        };
        while min.0 != u32::MAX {
            let i = min.1;
            if i > 0 {
                parts[i - 1].1 = rank_at(&parts, i - 1);
            }
            parts[i].1 = rank_at(&parts, i);
            parts.remove(i + 1);
            min = (u32::MAX, usize::MAX);
            for (j, &(_, r)) in parts[..parts.len() - 1].iter().enumerate() {
                if r < min.0 {
                    min = (r, j);
                }
            }
        }
        for w in parts.windows(2) {
            ids.push(self.rank(&piece[w[0].0..w[1].0]));
        }
    }

    /// The same merge order as [`Self::bpe_scan`] (lowest rank, ties to the leftmost pair)
    /// with a heap and a linked list: O(n log n) for long pieces.
    fn bpe_heap(&self, piece: &[u8], ids: &mut Vec<u32>) {
        let n = piece.len();
        // Parts are byte ranges [start[i], start[next[i]]); removed parts are skipped.
        let mut next: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; n];
        // Heap entries (rank, left part start, right part end) — stale entries are
        // detected by re-checking the current right end of the pair.
        let mut heap = BinaryHeap::new();
        for i in 0..n - 1 {
            let r = self.rank(&piece[i..i + 2]);
            if r != u32::MAX {
                heap.push(Reverse((r, i, i + 2)));
            }
        }
        let pair_end = |next: &[usize], i: usize| -> Option<usize> {
            let j = next[i];
            if j >= n { None } else { Some(next[j]) }
        };
        while let Some(Reverse((_, i, end))) = heap.pop() {
            if !alive[i] || pair_end(&next, i) != Some(end) {
                continue;
            }
            // Merge part i with its right neighbour j.
            let j = next[i];
            alive[j] = false;
            next[i] = next[j];
            if next[j] < n {
                prev[next[j]] = i;
            }
            if let Some(e) = pair_end(&next, i) {
                let nr = self.rank(&piece[i..e]);
                if nr != u32::MAX {
                    heap.push(Reverse((nr, i, e)));
                }
            }
            let p = prev[i];
            if p != usize::MAX {
                let e = next[i];
                let nr = self.rank(&piece[p..e]);
                if nr != u32::MAX {
                    heap.push(Reverse((nr, p, e)));
                }
            }
        }
        let mut i = 0;
        while i < n {
            ids.push(self.rank(&piece[i..next[i]]));
            i = next[i];
        }
    }

    /// Concatenated bytes of `ids` (specials contribute their spelling).
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.token_bytes(id).ok_or(TokenizerError::IdOutOfRange {
                id,
                vocab_size: self.vocab_size(),
            })?);
        }
        Ok(out)
    }

    /// Decodes `ids` to text. Invalid UTF-8 (for example a sequence cut in the middle of a
    /// multi-byte character) is replaced by U+FFFD, like tiktoken's `decode(errors="replace")`;
    /// use [`StreamDecoder`] for incremental output.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let bytes = self.decode_bytes(ids)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }
}

/// Parses `tiktoken.model`: one `base64 rank` per line; ranks must be exactly `0..n`
/// (each once) and token bytes unique. Returns the token bytes indexed by rank.
fn parse_ranks(text: &str, path: &Path) -> Result<Vec<Vec<u8>>, TokenizerError> {
    let bad = |line: usize, reason: String| TokenizerError::BadRankLine {
        path: path.to_path_buf(),
        line,
        reason,
    };
    let lines: Vec<&str> = text.lines().collect();
    let mut by_rank: Vec<Option<Vec<u8>>> = vec![None; lines.len()];
    let mut seen: FxHashMap<Vec<u8>, usize> = FxHashMap::default();
    let mut count = 0usize;
    for (idx, line) in lines.iter().enumerate() {
        let lineno = idx + 1;
        if line.trim().is_empty() {
            continue;
        }
        let mut fields = line.split(' ');
        let (Some(b64), Some(rank), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(bad(
                lineno,
                format!("expected `base64 rank`, found {line:?}"),
            ));
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| bad(lineno, format!("invalid base64 {b64:?}: {e}")))?;
        if bytes.is_empty() {
            return Err(bad(lineno, "empty token".to_string()));
        }
        let rank: usize = rank
            .parse()
            .map_err(|_| bad(lineno, format!("invalid rank {rank:?}")))?;
        if rank >= by_rank.len() {
            return Err(bad(
                lineno,
                format!(
                    "rank {rank} is not below the number of lines {}: ranks must be contiguous from 0",
                    by_rank.len()
                ),
            ));
        }
        if by_rank[rank].is_some() {
            return Err(bad(lineno, format!("duplicate rank {rank}")));
        }
        if let Some(first) = seen.insert(bytes.clone(), lineno) {
            return Err(bad(
                lineno,
                format!("token bytes {b64:?} already defined on line {first}"),
            ));
        }
        by_rank[rank] = Some(bytes);
        count += 1;
    }
    if count == 0 {
        return Err(TokenizerError::BadRankFile {
            path: path.to_path_buf(),
            reason: "no ranks".to_string(),
        });
    }
    by_rank.truncate(count);
    for b in 0..=255u8 {
        if !seen.contains_key(&[b][..]) {
            return Err(TokenizerError::BadRankFile {
                path: path.to_path_buf(),
                reason: format!("single byte 0x{b:02x} has no rank: byte-level BPE needs all 256"),
            });
        }
    }
    by_rank
        .into_iter()
        .enumerate()
        .map(|(rank, b)| {
            b.ok_or_else(|| TokenizerError::BadRankFile {
                path: path.to_path_buf(),
                reason: format!("rank {rank} is missing: ranks must be contiguous from 0"),
            })
        })
        .collect()
}

/// The 256 special spellings for ids `num_ranks..num_ranks+256` from `added_tokens_decoder`.
fn parse_special_names(
    text: &str,
    path: &Path,
    num_ranks: u32,
) -> Result<Vec<String>, TokenizerError> {
    let bad = |reason: String| TokenizerError::BadConfig {
        path: path.to_path_buf(),
        reason,
    };
    let config: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    let decoder = config
        .get("added_tokens_decoder")
        .ok_or_else(|| bad("missing field `added_tokens_decoder`".to_string()))?
        .as_object()
        .ok_or_else(|| bad("`added_tokens_decoder` is not an object".to_string()))?;
    let range = num_ranks..num_ranks + NUM_SPECIAL_TOKENS;
    let mut names: Vec<String> = range
        .clone()
        .map(|id| format!("<|reserved_token_{id}|>"))
        .collect();
    for (key, entry) in decoder {
        let id: u32 = key.parse().map_err(|_| {
            bad(format!(
                "added_tokens_decoder key {key:?} is not a token id"
            ))
        })?;
        if !range.contains(&id) {
            return Err(bad(format!(
                "added_tokens_decoder id {id} is outside the special-token range {}..{}",
                range.start, range.end
            )));
        }
        let content = entry
            .get("content")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| {
                bad(format!(
                    "added_tokens_decoder[{key:?}] has no string `content`"
                ))
            })?;
        if content.is_empty() {
            return Err(bad(format!(
                "added_tokens_decoder[{key:?}] has empty `content`"
            )));
        }
        names[(id - num_ranks) as usize] = content.to_string();
    }
    let mut seen: FxHashMap<&str, u32> = FxHashMap::default();
    for (i, name) in names.iter().enumerate() {
        let id = num_ranks + i as u32;
        if let Some(other) = seen.insert(name, id) {
            return Err(bad(format!(
                "special tokens {other} and {id} have the same spelling {name:?}"
            )));
        }
    }
    for field in ["bos_token", "eos_token", "pad_token", "unk_token"] {
        if let Some(v) = config.get(field) {
            let Some(s) = v.as_str() else {
                return Err(bad(format!("`{field}` is not a string")));
            };
            if !seen.contains_key(s) {
                return Err(bad(format!(
                    "`{field}` {s:?} is not one of the special tokens"
                )));
            }
        }
    }
    Ok(names)
}

/// Incremental decoder for streamed ids: emits only complete UTF-8 text and holds back an
/// incomplete trailing sequence until the next id completes it. Invalid bytes (not merely
/// incomplete ones) are emitted as U+FFFD at once.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// A decoder with nothing pending.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends the bytes of `id` and returns the text that is now complete.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        let bytes = tok.token_bytes(id).ok_or(TokenizerError::IdOutOfRange {
            id,
            vocab_size: tok.vocab_size(),
        })?;
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // `valid` bytes were just checked to be UTF-8.
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..start + valid])
                            .unwrap_or_default(),
                    );
                    start += valid;
                    match e.error_len() {
                        Some(len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start += len;
                        }
                        // Incomplete sequence at the end: hold it back.
                        None => break,
                    }
                }
            }
        }
        self.pending.drain(..start);
        Ok(out)
    }

    /// Bytes held back waiting for the rest of a UTF-8 sequence.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// Flushes what is left, with any incomplete sequence replaced by U+FFFD.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}

#[cfg(test)]
mod tests;
