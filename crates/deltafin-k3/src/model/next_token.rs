//! PILOT across the token boundary: a provisional next token from a few `lm_head` rows.
//!
//! When experts stream from disk, the disk has nothing to read while `lm_head` runs: the next
//! token, and so the first MoE layer's routes, are unknown until its last row is done. On the
//! `stream` preset that is the largest idle stretch of a decode token (docs/PERFORMANCE.md,
//! "Choices the streaming path keeps"). This module names a provisional token first:
//!
//! ```text
//! S     ← the ⌈V / 32⌉ rows of lm_head with the largest norms ‖W_r‖ (chosen once)
//! τ̂     ← argmax_{r ∈ S} W_r · x           (x: the normalised final hidden row)
//! guess ← layer 1's router on RMS(E[τ̂]; layer 0's input norm)
//! ```
//!
//! and hands the guess to the expert source before the full `lm_head` product, so the reads
//! of the next pass's first MoE layer overlap it. Layer 0 is dense and its input is the
//! embedding row alone, so the guess is exactly the one the next pass makes from its own
//! token (`moe_schedule::predict_across_dense`) whenever `τ̂` is that token; when it is not,
//! the next pass's guess replaces this one and the source discards the reads it does not
//! repeat.
//! Whenever the emitted token's row is in `S`, `τ̂` is the greedy token (the argmax over a
//! subset that holds the overall argmax). Only the timing of reads depends on it: the logits
//! are always the full product's, unchanged.

use std::cmp::Ordering;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use deltafin_tensor::{Bf16Matrix, Bytes, RowInt8Matrix};
use half::bf16;
use rayon::prelude::*;

/// Greedy choice: the first index of the maximum (a NaN row yields id 0's position rule of
/// [`deltafin_kernels::argmax`]).
pub fn greedy(logits: &[f32]) -> u32 {
    deltafin_kernels::argmax(logits).unwrap_or(0) as u32
}

use crate::model::linear::Linear;

/// The share of the vocabulary in the provisional set: `⌈V / 32⌉` rows (5,120 of K3's 163,840:
/// 37 MB of int8 rows for K3's 7168 columns, 5.2 MB for `mini`'s 1024).
pub const PROVISIONAL_DIVISOR: usize = 32;

/// `Σ w²` of one row, in 16 f32 lanes (vectorised; the ranking needs no more precision).
fn sum_of_squares(row: &[f32]) -> f64 {
    let mut lanes = [0f32; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for (a, &w) in lanes.iter_mut().zip(c) {
            *a += w * w;
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|&w| w * w).sum();
    f64::from(lanes.iter().sum::<f32>() + tail)
}

/// Rows in the provisional set of a `vocab`-token `lm_head`.
pub fn provisional_rows(vocab: usize) -> usize {
    vocab.div_ceil(PROVISIONAL_DIVISOR)
}

/// Bytes the provisional set holds for a `[vocab, hidden]` `lm_head` (row-int8: codes and
/// one f16 scale per row; bf16: two bytes per value), for memory plans.
pub fn provisional_bytes(vocab: usize, hidden: usize, int8: bool) -> u64 {
    let per_row = if int8 { hidden + 2 } else { 2 * hidden };
    (provisional_rows(vocab) * per_row) as u64
}

/// Provisional tokens judged against the token the next pass began with.
#[derive(Debug, Default)]
pub struct Tally {
    /// The last provisional token, not yet judged.
    pub pending: Option<u32>,
    /// Provisional tokens that were the next pass's first token.
    pub right: u64,
    /// Provisional tokens judged.
    pub judged: u64,
}

impl Tally {
    /// Judge the pending provisional token (if any) against `first`, the first token of the
    /// pass that follows it.
    pub fn judge(&mut self, first: u32) {
        if let Some(p) = self.pending.take() {
            self.judged += 1;
            self.right += u64::from(p == first);
        }
    }
}

/// The `lm_head` rows of the provisional set, gathered into one small matrix.
pub struct ProvisionalHead {
    /// Vocabulary id of each gathered row, ascending.
    ids: Vec<u32>,
    rows: Linear,
}

impl std::fmt::Debug for ProvisionalHead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProvisionalHead")
            .field("rows", &self.ids.len())
            .field("dtype", &self.rows.dtype())
            .finish()
    }
}

impl ProvisionalHead {
    /// The `⌈V / 32⌉` rows of `lm_head` (its host form) with the largest Euclidean norms,
    /// ties to the lower id. Reads every row once. Fails only if the gathered rows do not
    /// form a valid matrix (an `lm_head` file holding the int8 code −128, which the
    /// product never writes).
    pub fn build(lm_head: &Linear) -> Result<ProvisionalHead, String> {
        let head = lm_head.host();
        let (v, cols) = (head.rows(), head.cols());
        let k = provisional_rows(v).min(v);
        let norms: Vec<f64> = (0..v)
            .into_par_iter()
            .map_init(
                || vec![0f32; cols],
                |row, r| {
                    head.row_f32(r, row);
                    sum_of_squares(row)
                },
            )
            .collect();
        let mut order: Vec<u32> = (0..v as u32).collect();
        let by_norm = |a: &u32, b: &u32| {
            norms[*b as usize]
                .partial_cmp(&norms[*a as usize])
                .unwrap_or(Ordering::Equal)
                .then(a.cmp(b))
        };
        if k < v {
            order.select_nth_unstable_by(k, by_norm);
        }
        order.truncate(k);
        order.sort_unstable();
        let bad = |m: String| format!("lm_head provisional rows: {m}");
        let rows = match head {
            Linear::RowInt8(m) => {
                let mut codes = Vec::with_capacity(k * cols);
                let mut scales = Vec::with_capacity(2 * k);
                for &id in &order {
                    codes.extend(m.row(id as usize).iter().map(|&c| c as u8));
                    scales.extend_from_slice(&m.scales()[id as usize].to_le_bytes());
                }
                let name = "lm_head.weight (provisional rows)";
                Linear::RowInt8(
                    RowInt8Matrix::new(
                        name,
                        Bytes::from_vec(codes),
                        Bytes::from_vec(scales),
                        k,
                        cols,
                    )
                    .map_err(|e| bad(e.to_string()))?,
                )
            }
            Linear::Bf16(m) => {
                let mut values: Vec<bf16> = Vec::with_capacity(k * cols);
                for &id in &order {
                    values.extend_from_slice(m.row(id as usize));
                }
                Linear::Bf16(
                    Bf16Matrix::from_values(k, cols, &values).map_err(|e| bad(e.to_string()))?,
                )
            }
            Linear::Device(_) => return Err(bad("the host form is itself offloaded".into())),
        };
        Ok(ProvisionalHead { ids: order, rows })
    }

    /// Rows in the set.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether the set is empty (never, for a vocabulary of at least one token).
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Bytes of the gathered rows (held beside the spine).
    pub fn bytes(&self) -> u64 {
        self.rows.weights().weight_bytes() as u64
    }

    /// The vocabulary ids of the set, ascending.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// `τ̂`: the id of the set's largest logit for the normalised hidden row `x` (the lowest
    /// id among equal logits), computed on the CPU.
    pub fn token(&self, x: &[f32]) -> Option<u32> {
        let logits = self.rows.apply_host(x, 1);
        let mut best: Option<(usize, f32)> = None;
        for (i, &v) in logits.iter().enumerate() {
            if best.is_none_or(|(_, b)| v > b) {
                best = Some((i, v));
            }
        }
        best.and_then(|(i, _)| self.ids.get(i).copied())
    }
}

/// A model's provisional head, gathered at the first pass that uses it, and the tally of
/// its tokens against the tokens the next passes began with.
#[derive(Debug, Default)]
pub(crate) struct Provisional {
    head: OnceLock<Result<ProvisionalHead, String>>,
    tally: Mutex<Tally>,
}

impl Provisional {
    /// The head over `lm_head`, gathered on the first call (`None` if that failed).
    pub(crate) fn head(&self, lm_head: &Linear) -> Option<&ProvisionalHead> {
        self.head
            .get_or_init(|| ProvisionalHead::build(lm_head))
            .as_ref()
            .ok()
    }

    /// The head once a pass has gathered it: `Err` names why it could not be.
    pub(crate) fn built(&self) -> Option<Result<&ProvisionalHead, &str>> {
        self.head.get().map(|r| r.as_ref().map_err(String::as_str))
    }

    fn tally(&self) -> MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A pass begins with token `first`: judge the pending provisional token.
    pub(crate) fn judge(&self, first: u32) {
        self.tally().judge(first);
    }

    /// `token` is the provisional next token, to be judged by the next pass.
    pub(crate) fn guessed(&self, token: u32) {
        self.tally().pending = Some(token);
    }

    /// `(right, judged)`.
    pub(crate) fn accuracy(&self) -> (u64, u64) {
        let t = self.tally();
        (t.right, t.judged)
    }
}
