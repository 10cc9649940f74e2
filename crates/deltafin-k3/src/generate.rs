//! The vocabulary of generation, and teacher-forced scoring over a [`K3Model`].
//!
//! Every emitted token is chosen from K3's own logits by a [`Choose`] rule. The default,
//! [`Greedy`], takes the first index of the maximum logit (torch `argmax`), so every emitted
//! token is exactly defined by the model's logits; a constrained rule (structured output,
//! `deltafin-openai`) takes the maximum over the tokens its grammar allows, still K3's choice.
//! [`stop_ids`] is the one rule for the ids that end a generation. Logit summaries (top-N and
//! log-sum-exp) are the engine's own final logits after `lm_head`, unscaled.
//!
//! The generation loop itself is `deltafin_spec::generation::Generation`, the one driver
//! every front end and library user runs (plain or drafted); this module holds the types it
//! shares with them ([`GenerateOptions`], [`GenerateEvent`], [`GenerateOutcome`],
//! [`StopReason`], [`GenerateError`]).

use crate::error::ModelError;
pub use crate::model::greedy;
use crate::model::{K3Model, LogitRows};
use crate::text::tokenizer::{END_OF_MSG, EOS};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// A stop id (end of message / end of document) was produced; it is included in the ids.
    Eos,
    /// `max_new` tokens were produced.
    MaxNew,
    /// The context reached `max_context` positions.
    ContextFull,
    /// The interrupt flag was raised (Ctrl-C); stopped at a token boundary.
    Interrupted,
}

impl StopReason {
    /// The reason's name in run events and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::MaxNew => "max_new",
            StopReason::ContextFull => "context_full",
            StopReason::Interrupted => "interrupted",
        }
    }
}

/// The ids that end a generation, decided here for every front end (`deltafin run`, the
/// server's APIs): a chat turn ends with `<|end_of_msg|>`; a raw completion also stops at
/// `[EOS]`, the end of a pretraining document (product contract §2).
pub fn stop_ids(chat: bool) -> Vec<u32> {
    if chat {
        vec![END_OF_MSG]
    } else {
        vec![END_OF_MSG, EOS]
    }
}

/// Settings of one generation in the options form (`deltafin_spec::generate`).
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Stop after this many generated tokens (`None`: until a stop id or the context is full).
    pub max_new: Option<usize>,
    /// Token ids that end generation (the stop id itself is emitted).
    pub stop_ids: Vec<u32>,
    /// Largest number of positions (prompt + generated) the context may hold.
    pub max_context: usize,
    /// How many of the largest logits to report per distribution (0: none).
    pub top_logits: usize,
}

/// The N largest logits (`[id, logit]`, descending; ties by lower id) and the log-sum-exp
/// of a whole logit row.
#[derive(Clone, Debug, PartialEq)]
pub struct LogitSummary {
    pub top: Vec<(u32, f32)>,
    pub logsumexp: f64,
}

impl LogitSummary {
    pub fn of(logits: &[f32], n: usize) -> LogitSummary {
        LogitSummary {
            top: top_logits(logits, n),
            logsumexp: logsumexp(logits),
        }
    }
}

/// The `n` largest logits as `(id, logit)`, descending, ties broken by the lower id.
pub fn top_logits(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let cmp = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    idx.select_nth_unstable_by(n - 1, cmp);
    idx.truncate(n);
    idx.sort_by(cmp);
    idx.into_iter().map(|i| (i, logits[i as usize])).collect()
}

/// `log Σ exp(x)`, computed in f64 around the maximum.
pub fn logsumexp(logits: &[f32]) -> f64 {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    if !m.is_finite() {
        return m;
    }
    let s: f64 = logits.iter().map(|&x| (x as f64 - m).exp()).sum();
    m + s.ln()
}

/// The rule that turns K3's logits into the emitted token, one generated position at a time.
///
/// Plain decoding calls `choose(step, logits)` then `accept(id)` for every step in order.
/// Speculative verification ([`deltafin-spec`](../../deltafin_spec/index.html)) calls the same
/// pair on each verified row and accepts a draft only when it equals what `choose` returned,
/// so a drafted run emits exactly the ids of a plain one. A rule must therefore depend only
/// on `step`, the logits and the ids accepted before (never on how many times it was asked).
pub trait Choose {
    /// The token for generated position `step` (0 = the first generated token), from K3's
    /// logits for that position. An error ends generation ([`GenerateError::Choose`]).
    fn choose(&mut self, step: usize, logits: &[f32]) -> Result<u32, String>;
    /// `id` is emitted at the next position (it was returned by `choose`).
    fn accept(&mut self, id: u32) -> Result<(), String>;
}

/// K3's argmax at every step ([`greedy`]); the default rule.
#[derive(Clone, Copy, Debug, Default)]
pub struct Greedy;

impl Choose for Greedy {
    fn choose(&mut self, _step: usize, logits: &[f32]) -> Result<u32, String> {
        Ok(greedy(logits))
    }
    fn accept(&mut self, _id: u32) -> Result<(), String> {
        Ok(())
    }
}

/// One event of a generation, in order: `Prefilled` once, then one `Token` per emitted token.
#[derive(Clone, Debug)]
pub enum GenerateEvent<'a> {
    /// The prompt was processed; `summary` describes the last prompt position's logits.
    Prefilled {
        duration: Duration,
        summary: Option<&'a LogitSummary>,
    },
    /// Token `step` (0-based) was chosen from `summary`'s distribution; `duration` is the
    /// time of the forward pass that produced it (the prefill for step 0).
    Token {
        step: usize,
        id: u32,
        /// K3's logit for `id` (with `summary`'s log-sum-exp it gives the token's logprob).
        logit: f32,
        duration: Duration,
        summary: Option<&'a LogitSummary>,
    },
}

/// What a generation produced.
#[derive(Clone, Debug)]
pub struct GenerateOutcome {
    pub ids: Vec<u32>,
    pub stop: StopReason,
    pub prefill_duration: Duration,
    pub total_duration: Duration,
}

/// Errors of generation: the model failed, or the event consumer asked to stop.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("prompt of {prompt} tokens does not fit the context of {max_context} positions")]
    PromptTooLong { prompt: usize, max_context: usize },
    #[error("{0}")]
    Sink(String),
    /// The token rule failed (e.g. a grammar that allows no token).
    #[error("{0}")]
    Choose(String),
    /// A restored state does not hold the ids it was given with.
    #[error("the restored state holds {positions} positions but {ids} ids were given")]
    Restored { positions: usize, ids: usize },
}

/// Result of teacher-forced scoring.
#[derive(Clone, Debug, PartialEq)]
pub struct ScoreResult {
    /// Positions scored (tokens − 1: the first token has no prediction).
    pub tokens_scored: usize,
    /// Σ −log p(token_{i+1} | tokens_{≤i}), in nats.
    pub nll_sum: f64,
    /// Per-position log-probabilities, when requested.
    pub logprobs: Option<Vec<f64>>,
}

impl ScoreResult {
    pub fn mean_nll(&self) -> f64 {
        if self.tokens_scored == 0 {
            0.0
        } else {
            self.nll_sum / self.tokens_scored as f64
        }
    }
    pub fn perplexity(&self) -> f64 {
        self.mean_nll().exp()
    }
}

/// Teacher-forced scoring of `tokens` through the batched prefill path, `chunk` positions
/// per forward pass on one continuing state. `progress(done, total)` is called per chunk.
pub fn score(
    model: &K3Model,
    tokens: &[u32],
    chunk: usize,
    keep_logprobs: bool,
    interrupt: &AtomicBool,
    mut progress: impl FnMut(usize, usize),
) -> Result<ScoreResult, GenerateError> {
    let chunk = chunk.max(1);
    let mut state = model.new_state();
    let mut nll_sum = 0.0f64;
    let mut logprobs = keep_logprobs.then(Vec::new);
    let mut scored = 0usize;
    let n = tokens.len();
    let mut pos = 0;
    while pos + 1 < n {
        if interrupt.load(Ordering::Relaxed) {
            break;
        }
        // Feed tokens[pos..end]; row r predicts tokens[pos + r + 1].
        let end = (pos + chunk).min(n - 1);
        let logits = model.forward(&mut state, &tokens[pos..end], LogitRows::All)?;
        for r in 0..logits.rows {
            let row = logits.row(r);
            let target = tokens[pos + r + 1] as usize;
            let lp = row[target] as f64 - logsumexp(row);
            nll_sum -= lp;
            if let Some(v) = logprobs.as_mut() {
                v.push(lp);
            }
            scored += 1;
        }
        pos = end;
        progress(pos, n - 1);
    }
    Ok(ScoreResult {
        tokens_scored: scored,
        nll_sum,
        logprobs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_logits_descending_with_ties_to_lower_id() {
        let l = [0.5f32, 2.0, -1.0, 2.0, 1.5];
        assert_eq!(top_logits(&l, 3), vec![(1, 2.0), (3, 2.0), (4, 1.5)]);
        assert_eq!(top_logits(&l, 0), vec![]);
        assert_eq!(top_logits(&l, 10).len(), 5);
    }

    #[test]
    fn logsumexp_is_stable_and_exact() {
        let l = [1000.0f32, 1000.0];
        assert!((logsumexp(&l) - (1000.0 + 2f64.ln())).abs() < 1e-9);
        let l = [0.0f32, 1.0, 2.0];
        let want = (1f64 + 1f64.exp() + 2f64.exp()).ln();
        assert!((logsumexp(&l) - want).abs() < 1e-12);
    }

    #[test]
    fn greedy_takes_first_maximum() {
        assert_eq!(greedy(&[1.0, 3.0, 3.0, 2.0]), 1);
    }
}
