//! `deltafin-spec`: speculative decoding with K3 as the sole authority.
//!
//! Drafters (DSpark for chat, Qwen3 0.6B/1.7B for raw completion) propose tokens; K3
//! verifies each proposal in one pass and only its own greedy choices are ever emitted.
//!
//! Every generation, drafted or not, runs through one driver, [`generation::Generation`].
//! The verification core ([`verify`], used by the driver's drafted steps) is exact by construction:
//! the verify pass ([`K3Model::forward_exact`]) produces, for every row, the bit-identical
//! logits that one-token decode would, and the state is rolled back exactly (KDA states
//! restored, MLA caches truncated) to the accepted length. The emitted sequence therefore
//! equals plain greedy decoding whatever the drafter proposes.

// No unsafe code: this crate needs none (docs/ARCHITECTURE.md "Invariants").
#![forbid(unsafe_code)]

use deltafin_k3::generate::{Choose, GenerateError, Greedy, LogitSummary};
use deltafin_k3::model::state::State;
use deltafin_k3::model::taps::Taps;
use deltafin_k3::model::{K3Model, LogitRows};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

pub mod batch;
pub mod dense;
pub mod dspark;
pub mod escalate;
mod fields;
pub mod generation;
pub mod policy;
pub mod qwen3;
pub mod select;
mod tensors;
pub mod uag;

pub use batch::{BatchStats, Batcher};
pub use generation::{Event, Finished, Generation, Sequence, generate, generate_with};
pub use policy::{Clock, PolicyMode, PolicyReport, PolicyState, SpecPolicy, WallClock};

/// Anything that proposes the next tokens.
pub trait Drafter {
    /// Propose up to `max` tokens to follow `history` (the prompt and every emitted token,
    /// the newest last). An empty proposal means "no guess"; it never affects correctness.
    fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32>;

    /// K3 layers whose partial sums `P` this drafter reads (docs/K3.md §9.3); empty (the
    /// default) when it reads none.
    fn tap_layers(&self) -> &[usize] {
        &[]
    }

    /// K3 committed the positions `first_position …` with these taps (one row per position,
    /// oldest first, layers in [`Drafter::tap_layers`] order). Called only for drafters with
    /// tap layers, for every position K3 processes and keeps, in order.
    fn observe(&mut self, first_position: usize, taps: &Taps) {
        let _ = (first_position, taps);
    }

    /// The drafter's estimate, for each token of its last proposal, of the probability that
    /// K3 accepts it given the ones before it (DSpark: `σ(c_r)`; Qwen: its softmax
    /// probabilities). Empty (the default) when it has none; used only to choose the width.
    fn confidence(&self) -> &[f32] {
        &[]
    }

    /// The step this drafter was asked to draft for is committed: `step` says how many of
    /// its drafts K3 verified and accepted, how many tokens came out and how long the whole
    /// step took on the run's clock. The default ignores it; [`escalate::Escalating`] uses it
    /// to compare drafters by measured tokens per second.
    fn feedback(&mut self, step: &StepFeedback) {
        let _ = step;
    }
}

/// What a drafting step gave, reported to [`Drafter::feedback`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepFeedback {
    /// Drafts K3 verified (the proposal after the policy's cut; 0 when there was none).
    pub proposed: usize,
    /// Drafts K3 accepted.
    pub accepted: usize,
    /// Tokens the step committed (accepted drafts and K3's own token).
    pub emitted: usize,
    /// Wall time of the step (proposal and verify pass), seconds.
    pub seconds: f64,
}

/// Outcome of one verify pass.
#[derive(Clone, Debug, PartialEq)]
pub struct Verified {
    /// How many drafts K3 agreed with (a prefix of the proposal).
    pub accepted: usize,
    /// K3's own next token after the accepted drafts.
    pub next: u32,
    /// The logits K3 chose `next` from.
    pub next_logits: Vec<f32>,
}

/// Verify `drafts` after `pending` (the newest K3-chosen token, not yet run through K3).
///
/// Runs K3 once over `[pending, d₁…d_k]`; row `i` is K3's distribution after `d_i` (row 0
/// after `pending`). `rows.rule` chooses the token of each row in turn; the longest prefix of
/// drafts equal to those choices is accepted, then the rule's token from the first
/// disagreeing row is `next` (not yet accepted by the rule: the caller emits it). With
/// [`Greedy`] that is "accept while `d_{i+1} = argmax(row i)`". On return `state` holds
/// exactly `pending, d₁…d_accepted` beyond what it held before.
///
/// With `taps`, also appends the partial sums of the positions it keeps (`pending` and the
/// accepted drafts: the rows of rejected drafts are dropped; each kept row is what the replay
/// of the accepted prefix computes, the exact pass being row-invariant).
pub fn verify(
    model: &K3Model,
    state: &mut State,
    pending: u32,
    drafts: &[u32],
    rows: &mut RuleRows<'_>,
    taps: Option<&mut Taps>,
) -> Result<Verified, SpecError> {
    verify_rows(model, state, pending, drafts, rows, taps)
}

/// The token rule as verification drives it: `rule` chooses the token of generated position
/// `step + i` from row `i`; a draft equal to that choice is accepted (and the rule told), so
/// the ids are the rule's own choices whatever the drafter proposes. Verification stops after
/// an accepted draft in `stop_ids` (nothing follows a stop token).
pub struct RuleRows<'r> {
    /// The token rule (its state holds every id accepted before `step`).
    pub rule: &'r mut dyn Choose,
    /// Generated position of row 0's token.
    pub step: usize,
    /// Ids that end generation.
    pub stop_ids: &'r [u32],
}

fn verify_rows(
    model: &K3Model,
    state: &mut State,
    pending: u32,
    drafts: &[u32],
    rows: &mut RuleRows<'_>,
    mut taps: Option<&mut Taps>,
) -> Result<Verified, GenerateError> {
    let saved = (!drafts.is_empty()).then(|| state.checkpoint());
    let mut tape = Vec::with_capacity(drafts.len() + 1);
    tape.push(pending);
    tape.extend_from_slice(drafts);
    let kept_rows = taps.as_ref().map_or(0, |t| t.rows());
    let logits = match taps.as_deref_mut() {
        Some(t) => model.forward_exact_tapped(state, &tape, LogitRows::All, t)?,
        None => model.forward_exact(state, &tape, LogitRows::All)?,
    };
    let mut accepted = 0;
    let next = loop {
        let choice = rows
            .rule
            .choose(rows.step + accepted, logits.row(accepted))
            .map_err(GenerateError::Choose)?;
        if drafts.get(accepted) != Some(&choice) {
            break choice;
        }
        rows.rule.accept(choice).map_err(GenerateError::Choose)?;
        accepted += 1;
        if rows.stop_ids.contains(&choice) {
            break choice;
        }
    };
    if let Some(t) = taps {
        t.truncate(kept_rows + accepted + 1);
    }
    let next_logits = logits.row(accepted).to_vec();
    if let Some(cp) = saved.filter(|_| accepted < drafts.len()) {
        // Drop the rejected rows: back to the saved state, then replay the accepted prefix
        // with the same exact pass (its rows are bit-identical to the ones just computed; only
        // the state is needed, so only the last row's logits are formed).
        state.rollback(&cp, &model.dims)?;
        model.forward_exact(state, &tape[..accepted + 1], LogitRows::Last)?;
    }
    Ok(Verified {
        accepted,
        next,
        next_logits,
    })
}

/// Counters of a speculative run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecStats {
    /// K3 passes after the prefill (verify passes, including those with no draft).
    pub verify_passes: usize,
    /// Draft tokens proposed.
    pub proposed: usize,
    /// Draft tokens K3 accepted.
    pub accepted: usize,
    /// Verify passes that carried at least one draft.
    pub drafting_passes: usize,
}

impl SpecStats {
    /// Accepted / proposed.
    pub fn acceptance_rate(&self) -> f64 {
        if self.proposed == 0 {
            0.0
        } else {
            self.accepted as f64 / self.proposed as f64
        }
    }
    /// Mean drafts accepted per pass that carried drafts.
    pub fn mean_accepted_length(&self) -> f64 {
        if self.drafting_passes == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafting_passes as f64
        }
    }
    /// Mean tokens emitted per verify pass (accepted drafts + K3's own token).
    pub fn tokens_per_pass(&self) -> f64 {
        if self.verify_passes == 0 {
            0.0
        } else {
            (self.accepted + self.verify_passes) as f64 / self.verify_passes as f64
        }
    }
}

/// What one step of a generation committed, reported as it happens: the first step is K3's
/// token after the prompt, every later step one decode or one draft + verify pass.
#[derive(Clone, Debug, PartialEq)]
pub struct Committed<'a> {
    /// Generated position of `ids[0]` (0: the first generated token).
    pub first: usize,
    /// Tokens this step emitted, in order (accepted drafts, then K3's own token).
    pub ids: &'a [u32],
    /// Drafts proposed in this step (0 for the prefill).
    pub proposed: usize,
    /// Drafts K3 accepted in this step.
    pub accepted: usize,
    /// Wall time of the step (the prefill for the first, else the decode or the proposal +
    /// verify pass), on the run's clock.
    pub duration: Duration,
    /// K3's logit for the step's last id when K3 chose it from its own row (with
    /// `summary`'s log-sum-exp it gives the token's logprob); `None` when the step ended on
    /// an accepted draft that is a stop id.
    pub logit: Option<f32>,
    /// The largest logits and log-sum-exp of the row the last id was chosen from, when the
    /// generation asks for them ([`generation::Generation::top_logits`]).
    pub summary: Option<&'a LogitSummary>,
    /// The drafting policy after this step (plain decoding: a fixed width of 0).
    pub policy: PolicyReport,
}

/// An error of speculative generation: the driver's ([`GenerateError`]: the model failed,
/// the callback asked to stop, or the token rule failed).
pub type SpecError = GenerateError;

/// Greedy generation of up to `max_new` tokens after `prompt`, with drafts from `drafter`
/// verified by K3 (`width` drafts at most per pass, always). Stops after a token in
/// `stop_ids`. The returned ids equal plain greedy decoding exactly.
pub fn generate_speculative(
    model: &K3Model,
    prompt: &[u32],
    max_new: usize,
    stop_ids: &[u32],
    width: usize,
    drafter: &mut dyn Drafter,
    interrupt: &AtomicBool,
) -> Result<(Vec<u32>, SpecStats), SpecError> {
    generate_speculative_streaming(
        model,
        prompt,
        max_new,
        stop_ids,
        width,
        drafter,
        interrupt,
        |_| Ok(()),
    )
}

/// [`generate_speculative`] that reports every step to `on_commit` as it is committed (for
/// streaming output and per-step statistics); an error from `on_commit` stops generation.
#[allow(clippy::too_many_arguments)]
pub fn generate_speculative_streaming(
    model: &K3Model,
    prompt: &[u32],
    max_new: usize,
    stop_ids: &[u32],
    width: usize,
    drafter: &mut dyn Drafter,
    interrupt: &AtomicBool,
    on_commit: impl FnMut(&Committed<'_>) -> Result<(), String>,
) -> Result<(Vec<u32>, SpecStats), SpecError> {
    let mut policy = SpecPolicy::fixed(width);
    generate_with_policy(
        model,
        prompt,
        max_new,
        stop_ids,
        drafter,
        &mut Greedy,
        &mut policy,
        &WallClock::new(),
        interrupt,
        on_commit,
    )
}

/// Speculative generation under a drafting `policy` ([`policy`]: when to draft, how many
/// drafts to verify), timed by `clock`, with every token chosen by `rule`; every step is
/// reported to `on_commit`. The ids equal plain decoding with the same rule
/// ([`generate_with`]) exactly, whatever the policy and the drafter do. A thin wrapper over
/// [`Generation`] with no context bound.
#[allow(clippy::too_many_arguments)]
pub fn generate_with_policy(
    model: &K3Model,
    prompt: &[u32],
    max_new: usize,
    stop_ids: &[u32],
    drafter: &mut dyn Drafter,
    rule: &mut dyn Choose,
    policy: &mut SpecPolicy,
    clock: &dyn Clock,
    interrupt: &AtomicBool,
    on_commit: impl FnMut(&Committed<'_>) -> Result<(), String>,
) -> Result<(Vec<u32>, SpecStats), SpecError> {
    let mut on_commit = on_commit;
    let done = Generation::new(model, prompt)
        .stop_ids(stop_ids.to_vec())
        .max_new(Some(max_new))
        .rule(rule)
        .drafter(drafter, policy)
        .clock(clock)
        .interrupt(interrupt)
        .run(|ev| match ev {
            Event::Prefilled { .. } => Ok(()),
            Event::Committed(c) => on_commit(&c),
        })?;
    Ok((done.ids, done.stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed(Vec<u32>);
    impl Drafter for Fixed {
        fn propose(&mut self, _history: &[u32], max: usize) -> Vec<u32> {
            self.0.iter().copied().take(max).collect()
        }
    }

    #[test]
    fn stats_ratios() {
        let s = SpecStats {
            verify_passes: 4,
            proposed: 10,
            accepted: 6,
            drafting_passes: 3,
        };
        assert_eq!(s.mean_accepted_length(), 2.0);
        assert_eq!(s.acceptance_rate(), 0.6);
        assert_eq!(s.tokens_per_pass(), 2.5);
        assert_eq!(SpecStats::default().tokens_per_pass(), 0.0);
        let mut f = Fixed(vec![1, 2, 3]);
        assert_eq!(f.propose(&[], 2), vec![1, 2]);
    }
}
