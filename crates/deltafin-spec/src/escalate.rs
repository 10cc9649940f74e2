//! "0.6B first, 1.7B only when it pays" (docs/K3.md §10 step 5, the lazy second opinion).
//!
//! [`Escalating`] drafts with the small drafter. When, over its last [`ESCALATE_WINDOW`]
//! drafting steps, K3 accepted fewer than [`LOW_ACCEPTANCE`] of its verified drafts — while
//! the policy still asks for drafts, i.e. drafting is otherwise judged profitable — it lets
//! the large drafter draft for a trial of [`TRIAL_STEPS`] steps and keeps whichever gave more
//! tokens per second of wall time (`Σ emitted / Σ seconds`, the same per-step measurement the
//! policy's speed-up uses, reported through [`Drafter::feedback`]). The first trial step is
//! not counted: it includes the large model's prefill of the whole history. When the small
//! drafter stays, the next trial waits [`RETRY_STEPS`] drafting steps, doubling after every
//! lost trial up to [`MAX_RETRY_STEPS`]. Once the large drafter has won it drafts for the rest
//! of the generation.
//!
//! Both drafters must read no K3 taps (the Qwen drafters read none): the run loop sizes its
//! taps once, from [`Drafter::tap_layers`] at the start.

use crate::{Drafter, StepFeedback};
use deltafin_k3::model::taps::Taps;
use std::collections::VecDeque;

/// Drafting steps of the small drafter that decide whether to try the large one.
pub const ESCALATE_WINDOW: usize = 8;
/// Acceptance (accepted / verified drafts over the window) below which the large drafter
/// is tried.
pub const LOW_ACCEPTANCE: f64 = 0.5;
/// Drafting steps of a trial of the large drafter (the first is its warm-up, not counted).
pub const TRIAL_STEPS: usize = 6;
/// Small-drafter steps after a lost trial before the next one.
pub const RETRY_STEPS: usize = 32;
/// Longest wait between trials (drafting steps).
pub const MAX_RETRY_STEPS: usize = 1024;

/// Which drafter is drafting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The small drafter.
    Small,
    /// The large drafter, on trial.
    Trial,
    /// The large drafter, kept.
    Large,
}

/// What the escalation did in one generation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EscalationStats {
    /// Trials of the large drafter started.
    pub trials: usize,
    /// Trials the large drafter won (0 or 1).
    pub escalated: usize,
    /// Measured tokens per second of the small drafter's window at the last decision.
    pub small_rate: Option<f64>,
    /// Measured tokens per second of the large drafter's last trial.
    pub large_rate: Option<f64>,
}

/// A drafter that starts small and escalates to a large one when that pays.
pub struct Escalating {
    small: Box<dyn Drafter + Send>,
    large: Box<dyn Drafter + Send>,
    phase: Phase,
    /// The phase that made the last proposal (its confidence is the one to report).
    proposer: Phase,
    window: VecDeque<StepFeedback>,
    trial: Vec<StepFeedback>,
    since_trial: usize,
    retry_after: usize,
    /// What happened.
    pub stats: EscalationStats,
}

/// `Σ emitted / Σ seconds` (`None` without time).
fn rate<'a>(steps: impl IntoIterator<Item = &'a StepFeedback>) -> Option<f64> {
    let (n, s) = steps
        .into_iter()
        .fold((0usize, 0f64), |(n, s), f| (n + f.emitted, s + f.seconds));
    (s > 0.0).then(|| n as f64 / s)
}

/// `Σ accepted / Σ proposed` (0 when nothing was verified).
fn acceptance<'a>(steps: impl IntoIterator<Item = &'a StepFeedback>) -> f64 {
    let (a, p) = steps.into_iter().fold((0usize, 0usize), |(a, p), f| {
        (a + f.accepted, p + f.proposed)
    });
    if p == 0 { 0.0 } else { a as f64 / p as f64 }
}

impl Escalating {
    /// Draft with `small`, escalating to `large` when it pays. Neither may read K3 taps.
    pub fn new(small: Box<dyn Drafter + Send>, large: Box<dyn Drafter + Send>) -> Self {
        debug_assert!(small.tap_layers().is_empty() && large.tap_layers().is_empty());
        Escalating {
            small,
            large,
            phase: Phase::Small,
            proposer: Phase::Small,
            window: VecDeque::new(),
            trial: Vec::new(),
            since_trial: 0,
            retry_after: 0,
            stats: EscalationStats::default(),
        }
    }

    /// Which drafter drafts now.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    fn active(&mut self) -> &mut (dyn Drafter + Send) {
        match self.phase {
            Phase::Small => self.small.as_mut(),
            Phase::Trial | Phase::Large => self.large.as_mut(),
        }
    }
}

impl Drafter for Escalating {
    fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        self.proposer = self.phase;
        self.active().propose(history, max)
    }

    fn observe(&mut self, first_position: usize, taps: &Taps) {
        self.small.observe(first_position, taps);
        self.large.observe(first_position, taps);
    }

    fn confidence(&self) -> &[f32] {
        match self.proposer {
            Phase::Small => self.small.confidence(),
            Phase::Trial | Phase::Large => self.large.confidence(),
        }
    }

    fn feedback(&mut self, step: &StepFeedback) {
        self.active().feedback(step);
        match self.phase {
            Phase::Small => {
                self.window.push_back(*step);
                if self.window.len() > ESCALATE_WINDOW {
                    self.window.pop_front();
                }
                self.since_trial += 1;
                if self.window.len() == ESCALATE_WINDOW
                    && self.since_trial >= self.retry_after
                    && acceptance(&self.window) < LOW_ACCEPTANCE
                {
                    self.phase = Phase::Trial;
                    self.trial.clear();
                    self.stats.trials += 1;
                }
            }
            Phase::Trial => {
                self.trial.push(*step);
                if self.trial.len() >= TRIAL_STEPS {
                    let small = rate(&self.window);
                    let large = rate(&self.trial[1..]);
                    self.stats.small_rate = small;
                    self.stats.large_rate = large;
                    if large.unwrap_or(0.0) > small.unwrap_or(0.0) {
                        self.phase = Phase::Large;
                        self.stats.escalated += 1;
                    } else {
                        self.phase = Phase::Small;
                        self.since_trial = 0;
                        self.retry_after = if self.retry_after == 0 {
                            RETRY_STEPS
                        } else {
                            (self.retry_after * 2).min(MAX_RETRY_STEPS)
                        };
                    }
                }
            }
            Phase::Large => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Proposes `n` copies of `token`; counts its proposals.
    struct Constant {
        token: u32,
        calls: usize,
    }

    impl Drafter for Constant {
        fn propose(&mut self, _history: &[u32], max: usize) -> Vec<u32> {
            self.calls += 1;
            vec![self.token; max]
        }
    }

    fn step(proposed: usize, accepted: usize, seconds: f64) -> StepFeedback {
        StepFeedback {
            proposed,
            accepted,
            emitted: accepted + 1,
            seconds,
        }
    }

    fn escalating() -> Escalating {
        Escalating::new(
            Box::new(Constant { token: 1, calls: 0 }),
            Box::new(Constant { token: 2, calls: 0 }),
        )
    }

    #[test]
    fn a_well_accepted_small_drafter_is_never_escalated() {
        let mut e = escalating();
        for _ in 0..100 {
            assert_eq!(e.propose(&[0], 4), vec![1; 4]);
            e.feedback(&step(4, 3, 1.0));
        }
        assert_eq!(e.phase(), Phase::Small);
        assert_eq!(e.stats.trials, 0);
    }

    #[test]
    fn the_large_drafter_is_kept_when_it_gives_more_tokens_per_second() {
        let mut e = escalating();
        for _ in 0..ESCALATE_WINDOW {
            assert_eq!(e.propose(&[0], 4), vec![1; 4]);
            e.feedback(&step(4, 0, 1.0));
        }
        assert_eq!(e.phase(), Phase::Trial);
        // Warm-up step (slow: the large model's prefill) is not counted.
        assert_eq!(e.propose(&[0], 4), vec![2; 4]);
        e.feedback(&step(4, 3, 30.0));
        for _ in 1..TRIAL_STEPS {
            e.propose(&[0], 4);
            e.feedback(&step(4, 3, 1.5));
        }
        assert_eq!(e.phase(), Phase::Large);
        assert_eq!(e.stats.escalated, 1);
        assert!(e.stats.large_rate.unwrap() > e.stats.small_rate.unwrap());
        // Kept for good.
        for _ in 0..50 {
            e.propose(&[0], 4);
            e.feedback(&step(4, 0, 5.0));
        }
        assert_eq!(e.phase(), Phase::Large);
    }

    #[test]
    fn a_large_drafter_that_does_not_pay_is_retried_at_doubling_intervals() {
        let mut e = escalating();
        let mut trial_starts = Vec::new();
        for i in 0..400 {
            let before = e.phase();
            e.propose(&[0], 4);
            // Both accept one draft in four; the large one costs twice as much.
            let secs = if before == Phase::Small { 1.0 } else { 2.0 };
            e.feedback(&step(4, 1, secs));
            if before == Phase::Small && e.phase() == Phase::Trial {
                trial_starts.push(i);
            }
        }
        assert_eq!(e.phase(), Phase::Small);
        assert_eq!(e.stats.escalated, 0);
        let gaps: Vec<usize> = trial_starts.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(
            gaps,
            [TRIAL_STEPS + 32, TRIAL_STEPS + 64, TRIAL_STEPS + 128]
        );
    }
}
