//! When to draft and how many drafts to verify (product contract §1.4 `K3_DSPARK`,
//! `K3_UAG_DRAFT`, `K3_DSPARK_AUTO_MIN_SPEEDUP`, `K3_SPEC_DEPTH`; §2 drafter policy).
//!
//! The policy never touches correctness (K3 verifies every draft); it only decides the cost.
//!
//! **Cost model.** `T(0)` is the measured time of a plain decode step; `V(k)` the measured time
//! of a verify pass over `k` drafts (exponential moving averages), and `D` the time the drafter
//! took for this step's proposal (a fixed cost, whatever the width). A width not yet measured
//! is extrapolated as `V(k) = T(0) + k·m`, with `m` the mean measured marginal cost per extra
//! verified token (`(V(j) − T(0)) / j` over the measured widths; before any, `m = T(0)/2`).
//! For real K3 `m` is large because `k` tokens touch the union of their experts.
//!
//! **Width.** With `p_i` the probability that draft `i` is accepted given the ones before it
//! (the drafter's own confidence when it gives one, else the measured acceptance rate), a
//! pass with `k` drafts emits `E(k) = 1 + Σ_{i≤k} Π_{j≤i} p_j` tokens on average. The policy
//! verifies the `k ≤ K3_SPEC_DEPTH` that maximises `E(k) / (D + V(k))` (tokens per second of
//! this step; `D` is already spent, so it favours using the proposal). Every
//! [`EXPLORE_STEPS`]-th drafting step with a measured acceptance of at least one half verifies
//! the whole proposal instead, so `V(k)` of the wide widths is measured, not only
//! extrapolated: one noisy `T(0)` or narrow-pass sample cannot lock the width narrow (seen on
//! `mini`, docs/PERFORMANCE.md).
//!
//! **Auto.** [`BASELINE_STEPS`] plain steps measure `T(0)`; then [`PROBE_STEPS`] drafting
//! steps measure the speed-up `s = emitted · T(0) / seconds − 1` (tokens per second with drafts
//! over the plain rate, minus one). Drafting continues while `s` over the last
//! [`WINDOW_STEPS`] drafting steps stays at or above `K3_DSPARK_AUTO_MIN_SPEEDUP`; otherwise the
//! run falls back to plain decode and probes again after [`REPROBE_TOKENS`] plain tokens,
//! doubling that interval after every failed probe up to [`MAX_REPROBE_TOKENS`]. A probe ends
//! early when even perfect acceptance could not pay: `max_k (k + 1) / (D + V(k))` below
//! `(1 + margin) / T(0)`.
//!
//! **Across generations.** [`SpecPolicy::carry_over`] starts the next generation of the same
//! process from this one's measurements (`T(0)`, `V(k)`, `D`, acceptance, the speed-up window,
//! the re-probe interval): the baseline is measured once per session, not once per prompt, and
//! a drafter that was switched off stays off (its plain-token count keeps running towards the
//! next probe) instead of paying a fresh probe on every short request.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Default of `K3_DSPARK_AUTO_MIN_SPEEDUP`.
pub const DEFAULT_MIN_SPEEDUP: f64 = 0.03;
/// Plain steps that measure `T(0)` before the first probe.
pub const BASELINE_STEPS: usize = 2;
/// Drafting steps of a probe.
pub const PROBE_STEPS: usize = 4;
/// Drafting steps whose speed-up keeps drafting on.
pub const WINDOW_STEPS: usize = 8;
/// Plain tokens before the first re-probe after a failed probe or a switch-off.
pub const REPROBE_TOKENS: usize = 32;
/// Longest re-probe interval (tokens).
pub const MAX_REPROBE_TOKENS: usize = 1024;
/// Width of the first probe step (the original's probe with 2 drafts).
pub const PROBE_WIDTH: usize = 2;
/// Every this many drafting steps, a well-accepted drafter's whole proposal is verified.
pub const EXPLORE_STEPS: usize = 16;
/// Weight of a new measurement in the moving averages.
const EMA: f64 = 0.3;
/// Marginal cost per extra verified token, as a fraction of `T(0)`, before any is measured.
const PRIOR_MARGINAL: f64 = 0.5;

/// A monotonic clock (injected so tests can fix the timings).
pub trait Clock {
    /// Time since an arbitrary fixed origin.
    fn now(&self) -> Duration;
}

/// The wall clock.
#[derive(Clone, Copy, Debug)]
pub struct WallClock(Instant);

impl WallClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        WallClock(Instant::now())
    }
}

impl Default for WallClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for WallClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

/// How the policy drafts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyMode {
    /// Always ask for and verify up to the width (no cost model, no probing).
    Fixed,
    /// Always draft (`=on`); the width is cost-aware, at least 1.
    On,
    /// Draft only while the measured speed-up beats the margin (`=auto`).
    Auto,
}

/// Where the policy is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyState {
    /// Measuring the plain step.
    Baseline,
    /// Drafting to measure the speed-up.
    Probing,
    /// Drafting.
    Drafting,
    /// Plain decode (auto switched drafting off).
    Plain,
}

impl PolicyState {
    /// `baseline`, `probing`, `drafting` or `plain`.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyState::Baseline => "baseline",
            PolicyState::Probing => "probing",
            PolicyState::Drafting => "drafting",
            PolicyState::Plain => "plain",
        }
    }
}

/// A snapshot of the policy for reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PolicyReport {
    /// The mode.
    pub mode: PolicyMode,
    /// The state.
    pub state: PolicyState,
    /// Drafts verified by the last step.
    pub width: usize,
    /// Measured speed-up over the current window (`None` before a drafting step and `T(0)`).
    pub speedup: Option<f64>,
    /// Measured plain step time `T(0)` (seconds).
    pub plain_seconds: Option<f64>,
    /// Marginal cost per extra verified token as a fraction of `T(0)`.
    pub marginal: Option<f64>,
    /// Mean proposal time as a fraction of `T(0)`.
    pub draft_cost: Option<f64>,
    /// Times auto switched drafting off.
    pub switched_off: usize,
}

/// The drafting policy of one generation.
#[derive(Clone, Debug)]
pub struct SpecPolicy {
    mode: PolicyMode,
    max_width: usize,
    min_speedup: f64,
    state: PolicyState,
    /// Steps taken in the current state.
    steps_in_state: usize,
    /// `T(0)`.
    plain_s: Option<f64>,
    /// `V(k)` for k = 0 … max_width (index 0 unused).
    pass_s: Vec<Option<f64>>,
    /// Mean proposal time `D`.
    draft_s: Option<f64>,
    /// Drafts K3 looked at (accepted ones plus the first rejected one) and accepted.
    examined: usize,
    accepted: usize,
    /// (emitted, seconds) of recent drafting steps.
    window: VecDeque<(usize, f64)>,
    plain_tokens: usize,
    reprobe_after: usize,
    last_width: usize,
    switched_off: usize,
}

impl SpecPolicy {
    /// A policy drafting up to `max_width` tokens per pass; `min_speedup` is the auto margin.
    pub fn new(mode: PolicyMode, max_width: usize, min_speedup: f64) -> Self {
        SpecPolicy {
            mode,
            max_width,
            min_speedup,
            state: match mode {
                PolicyMode::Fixed => PolicyState::Drafting,
                _ => PolicyState::Baseline,
            },
            steps_in_state: 0,
            plain_s: None,
            pass_s: vec![None; max_width + 1],
            draft_s: None,
            examined: 0,
            accepted: 0,
            window: VecDeque::new(),
            plain_tokens: 0,
            reprobe_after: REPROBE_TOKENS,
            last_width: 0,
            switched_off: 0,
        }
    }

    /// The policy for the next generation with the same drafter and target: every
    /// measurement carries over, so a session measures `T(0)` once. A policy that was drafting
    /// keeps drafting (its window still decides), one that was plain stays plain until its
    /// re-probe interval has passed in plain tokens, one still measuring its baseline or
    /// probing continues where it was.
    pub fn carry_over(&self) -> Self {
        let mut next = self.clone();
        next.steps_in_state = if self.state == PolicyState::Probing {
            // A probe resumes at full width (its first narrow step is done).
            self.steps_in_state.max(1)
        } else {
            self.steps_in_state
        };
        next
    }

    /// Always `width` drafts per pass.
    pub fn fixed(width: usize) -> Self {
        Self::new(PolicyMode::Fixed, width, DEFAULT_MIN_SPEEDUP)
    }

    /// The current state.
    pub fn state(&self) -> PolicyState {
        self.state
    }

    /// Drafts to ask the drafter for in the next step (0: a plain step).
    pub fn ask(&self) -> usize {
        match self.state {
            PolicyState::Baseline | PolicyState::Plain => 0,
            PolicyState::Probing if self.steps_in_state == 0 => PROBE_WIDTH.min(self.max_width),
            _ => self.max_width,
        }
    }

    /// Measured acceptance probability of a draft given the ones before it (Laplace-smoothed).
    pub fn acceptance(&self) -> f64 {
        (self.accepted as f64 + 1.0) / (self.examined as f64 + 2.0)
    }

    /// Marginal cost per extra verified token (seconds), from the measured widths.
    fn marginal_s(&self) -> Option<f64> {
        let t0 = self.plain_s?;
        let slopes: Vec<f64> = (1..self.pass_s.len())
            .filter_map(|k| self.pass_s[k].map(|t| ((t - t0) / k as f64).max(0.0)))
            .collect();
        Some(if slopes.is_empty() {
            PRIOR_MARGINAL * t0
        } else {
            slopes.iter().sum::<f64>() / slopes.len() as f64
        })
    }

    /// `V(k)` (`T(0)` for k = 0): measured, else extrapolated from `T(0)` and the marginal
    /// cost.
    pub fn cost(&self, k: usize) -> Option<f64> {
        let t0 = self.plain_s?;
        if k == 0 {
            return Some(t0);
        }
        if let Some(Some(t)) = self.pass_s.get(k) {
            return Some(*t);
        }
        Some(t0 + k as f64 * self.marginal_s()?)
    }

    /// How many of `n` proposed drafts to verify, given the drafter's per-token
    /// `confidence` (probabilities, possibly empty or shorter than `n`) and the
    /// `draft_seconds` the proposal took: the `k` that maximises expected tokens per second.
    /// Probing and `on` verify at least one.
    pub fn cut(&self, confidence: &[f32], n: usize, draft_seconds: f64) -> usize {
        let n = n.min(self.max_width);
        if self.mode == PolicyMode::Fixed || n == 0 {
            return n;
        }
        let alpha = self.acceptance();
        if self.state == PolicyState::Drafting
            && self.steps_in_state % EXPLORE_STEPS == EXPLORE_STEPS - 1
            && alpha >= 0.5
        {
            return n;
        }
        let mut best = (0usize, f64::MIN);
        let (mut expected, mut reach) = (1.0f64, 1.0f64);
        for k in 0..=n {
            if k > 0 {
                let p = confidence
                    .get(k - 1)
                    .map_or(alpha, |&c| f64::from(c).clamp(0.0, 1.0));
                reach *= p;
                expected += reach;
            }
            let Some(t) = self.cost(k) else {
                return n;
            };
            let rate = expected / (draft_seconds + t).max(1e-12);
            if rate > best.1 * (1.0 + 1e-9) {
                best = (k, rate);
            }
        }
        let floor =
            usize::from(matches!(self.state, PolicyState::Probing) || self.mode == PolicyMode::On);
        best.0.max(floor)
    }

    /// Speed-up over the window of drafting steps: `Σ emitted · T(0) / Σ seconds − 1`.
    pub fn speedup(&self) -> Option<f64> {
        let t0 = self.plain_s?;
        let (n, s) = self
            .window
            .iter()
            .fold((0usize, 0f64), |(n, s), &(e, t)| (n + e, s + t));
        (!self.window.is_empty() && s > 0.0).then(|| n as f64 * t0 / s - 1.0)
    }

    /// Record a committed step: `proposed` drafts verified, `accepted` of them accepted,
    /// `emitted` tokens committed, `seconds` of the whole step of which `draft_seconds` were
    /// the proposal.
    pub fn record(
        &mut self,
        proposed: usize,
        accepted: usize,
        emitted: usize,
        seconds: f64,
        draft_seconds: f64,
    ) {
        self.last_width = proposed;
        let ema = |old: Option<f64>, x: f64| Some(old.map_or(x, |o| o + EMA * (x - o)));
        if draft_seconds > 0.0 {
            self.draft_s = ema(self.draft_s, draft_seconds);
        }
        let verify_s = (seconds - draft_seconds).max(0.0);
        if proposed == 0 {
            self.plain_s = ema(self.plain_s, verify_s);
            self.plain_tokens += emitted;
        } else {
            if let Some(slot) = self.pass_s.get_mut(proposed) {
                *slot = ema(*slot, verify_s);
            }
            self.examined += (accepted + 1).min(proposed);
            self.accepted += accepted;
            self.window.push_back((emitted, seconds));
            if self.window.len() > WINDOW_STEPS {
                self.window.pop_front();
            }
        }
        self.steps_in_state += 1;
        match (self.mode, self.state) {
            (PolicyMode::Fixed, _) => {}
            (_, PolicyState::Baseline) => {
                let need = if self.mode == PolicyMode::On {
                    1
                } else {
                    BASELINE_STEPS
                };
                if self.steps_in_state >= need {
                    self.enter(if self.mode == PolicyMode::On {
                        PolicyState::Drafting
                    } else {
                        PolicyState::Probing
                    });
                }
            }
            (PolicyMode::On, _) => {}
            (_, PolicyState::Plain) => {
                if self.plain_tokens >= self.reprobe_after {
                    self.enter(PolicyState::Probing);
                }
            }
            (_, PolicyState::Probing | PolicyState::Drafting)
                if proposed > 0 && self.hopeless() =>
            {
                self.back_off();
            }
            (_, PolicyState::Probing) => {
                if self.window.len() >= PROBE_STEPS {
                    if self.speedup().is_some_and(|s| s >= self.min_speedup) {
                        self.reprobe_after = REPROBE_TOKENS;
                        self.enter(PolicyState::Drafting);
                    } else {
                        self.back_off();
                    }
                }
            }
            (_, PolicyState::Drafting) => {
                if self.window.len() >= WINDOW_STEPS
                    && self.speedup().is_none_or(|s| s < self.min_speedup)
                {
                    self.reprobe_after = REPROBE_TOKENS;
                    self.switch_off();
                }
            }
        }
    }

    /// Even if every draft were accepted, no width would beat the margin.
    fn hopeless(&self) -> bool {
        let (Some(t0), Some(d)) = (self.plain_s, self.draft_s) else {
            return false;
        };
        let best = (1..=self.max_width)
            .filter_map(|k| self.cost(k).map(|v| (k + 1) as f64 / (d + v)))
            .fold(0f64, f64::max);
        best * t0 < 1.0 + self.min_speedup
    }

    /// Drafting did not pay: switch off, and wait longer before the next probe, doubling
    /// after every switch-off but the first.
    fn back_off(&mut self) {
        self.reprobe_after = if self.switched_off == 0 {
            REPROBE_TOKENS
        } else {
            (self.reprobe_after * 2).min(MAX_REPROBE_TOKENS)
        };
        self.switch_off();
    }

    fn switch_off(&mut self) {
        self.switched_off += 1;
        self.enter(PolicyState::Plain);
    }

    fn enter(&mut self, state: PolicyState) {
        self.state = state;
        self.steps_in_state = 0;
        if matches!(state, PolicyState::Probing | PolicyState::Plain) {
            self.window.clear();
            self.plain_tokens = 0;
        }
    }

    /// A snapshot for reports.
    pub fn report(&self) -> PolicyReport {
        PolicyReport {
            mode: self.mode,
            state: self.state,
            width: self.last_width,
            speedup: self.speedup(),
            plain_seconds: self.plain_s,
            marginal: self
                .marginal_s()
                .zip(self.plain_s)
                .map(|(m, t0)| m / t0.max(1e-12)),
            draft_cost: self
                .draft_s
                .zip(self.plain_s)
                .map(|(d, t0)| d / t0.max(1e-12)),
            switched_off: self.switched_off,
        }
    }
}

/// A bad `K3_DSPARK_AUTO_MIN_SPEEDUP`.
pub fn parse_min_speedup(v: &str) -> Option<f64> {
    v.parse::<f64>()
        .ok()
        .filter(|x| x.is_finite() && (0.0..1.0).contains(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drive a policy through `steps` steps of a simulated run: a plain step costs 1 s, a
    /// pass with k drafts `1 + marginal·k + draft_s`, and each draft is accepted while
    /// `accept(i)` holds.
    fn simulate(
        mode: PolicyMode,
        steps: usize,
        marginal: f64,
        draft_s: f64,
        accept: impl Fn(usize) -> bool,
    ) -> (SpecPolicy, Vec<PolicyState>) {
        let mut p = SpecPolicy::new(mode, 7, DEFAULT_MIN_SPEEDUP);
        let mut states = Vec::new();
        for _ in 0..steps {
            let ask = p.ask();
            let d = if ask > 0 { draft_s } else { 0.0 };
            let k = p.cut(&[], ask, d);
            let acc = (0..k).take_while(|&i| accept(i)).count();
            let secs = d + 1.0 + marginal * k as f64;
            let emitted = acc + 1;
            p.record(k, acc, emitted, secs, d);
            states.push(p.state());
        }
        (p, states)
    }

    #[test]
    fn a_perfect_cheap_drafter_stays_on_at_a_wide_width() {
        let (p, states) = simulate(PolicyMode::Auto, 200, 0.1, 0.01, |_| true);
        assert_eq!(&states[..2], &[PolicyState::Baseline, PolicyState::Probing]);
        assert!(states[10..].iter().all(|&s| s == PolicyState::Drafting));
        let r = p.report();
        assert_eq!(r.width, 7);
        assert_eq!(r.switched_off, 0);
        assert!(r.speedup.unwrap() > 3.0, "{r:?}");
        assert!((r.marginal.unwrap() - 0.1).abs() < 0.02, "{r:?}");
    }

    #[test]
    fn a_bad_drafter_is_switched_off_and_reprobed_rarely() {
        let (p, states) = simulate(PolicyMode::Auto, 400, 0.1, 0.01, |_| false);
        let drafting = states
            .iter()
            .filter(|&&s| s != PolicyState::Plain && s != PolicyState::Baseline)
            .count();
        assert!(states[6..10].contains(&PolicyState::Plain), "{states:?}");
        // Probes: after 32, 64, 128, 256 plain tokens (doubling) — few drafting steps.
        assert!(drafting <= 4 * PROBE_STEPS + 4, "{drafting}");
        assert!(p.report().switched_off >= 3);
        // `on` never switches off, but the cost model keeps it at width 1.
        let (p, states) = simulate(PolicyMode::On, 100, 0.1, 0.01, |_| false);
        assert!(states[1..].iter().all(|&s| s == PolicyState::Drafting));
        assert_eq!(p.report().width, 1);
    }

    #[test]
    fn an_accurate_but_slow_drafter_is_switched_off() {
        // Every draft accepted, but drafting costs 8 plain steps: hopeless after one probe step.
        let (p, states) = simulate(PolicyMode::Auto, 90, 0.1, 8.0, |_| true);
        assert_eq!(p.state(), PolicyState::Plain);
        assert_eq!(states[2], PolicyState::Plain, "{states:?}");
    }

    #[test]
    fn width_follows_confidence_and_marginal_cost() {
        let mut p = SpecPolicy::new(PolicyMode::On, 8, DEFAULT_MIN_SPEEDUP);
        p.record(0, 0, 1, 1.0, 0.0);
        // Expensive wide passes (real K3: the expert union grows): measured 0.9 per token.
        p.record(2, 2, 3, 2.8, 0.0);
        let conf = [0.95f32, 0.9, 0.9, 0.2, 0.9, 0.9, 0.9, 0.9];
        let k = p.cut(&conf, 8, 0.0);
        assert!((1..=3).contains(&k), "{k}");
        // Cheap passes: worth verifying past the unsure fourth draft.
        let mut q = SpecPolicy::new(PolicyMode::On, 8, DEFAULT_MIN_SPEEDUP);
        q.record(0, 0, 1, 1.0, 0.0);
        q.record(2, 2, 3, 1.02, 0.0);
        assert_eq!(q.cut(&[0.99; 8], 8, 0.0), 8);
        assert!(q.cut(&conf, 8, 0.0) >= k);
        // A costly proposal already paid for is worth verifying wider.
        assert!(p.cut(&conf, 8, 5.0) > k);
        // Fixed: every proposed draft.
        assert_eq!(SpecPolicy::fixed(4).cut(&[0.0; 8], 8, 0.0), 4);
        // Auto drafting may verify none when nothing is likely (a plain step).
        let mut a = SpecPolicy::new(PolicyMode::Auto, 8, DEFAULT_MIN_SPEEDUP);
        a.record(0, 0, 1, 1.0, 0.0);
        a.record(0, 0, 1, 1.0, 0.0);
        a.state = PolicyState::Drafting;
        a.record(2, 2, 3, 2.8, 0.0);
        assert_eq!(a.cut(&[0.01; 8], 8, 0.0), 0);
    }

    /// One simulated generation of `tokens` tokens under `p` (costs as in [`simulate`]).
    fn generation(
        p: &mut SpecPolicy,
        tokens: usize,
        marginal: f64,
        draft_s: f64,
        accept: impl Fn(usize) -> bool,
    ) -> (usize, f64) {
        let (mut emitted, mut secs) = (0usize, 0f64);
        while emitted < tokens {
            let ask = p.ask();
            let d = if ask > 0 { draft_s } else { 0.0 };
            let k = p.cut(&[], ask, d);
            let acc = (0..k).take_while(|&i| accept(i)).count();
            let t = d + 1.0 + marginal * k as f64;
            p.record(k, acc, acc + 1, t, d);
            emitted += acc + 1;
            secs += t;
        }
        (emitted, secs)
    }

    #[test]
    fn carried_over_policies_measure_the_baseline_once_per_session() {
        // A useless drafter (never accepted) on many short generations: per-prompt policies
        // pay baseline and probe every time; a carried-over policy stays plain.
        let (mut fresh_s, mut session_s) = (0f64, 0f64);
        let mut session = SpecPolicy::new(PolicyMode::Auto, 7, DEFAULT_MIN_SPEEDUP);
        let mut tokens = 0;
        for _ in 0..20 {
            let mut p = SpecPolicy::new(PolicyMode::Auto, 7, DEFAULT_MIN_SPEEDUP);
            let (n, s) = generation(&mut p, 16, 0.1, 0.3, |_| false);
            fresh_s += s;
            tokens += n;
            let mut q = session.carry_over();
            let (_, s) = generation(&mut q, 16, 0.1, 0.3, |_| false);
            session_s += s;
            session = q;
        }
        // Plain decode would take `tokens` seconds.
        let plain = tokens as f64;
        assert!(
            fresh_s > plain * 1.08,
            "per prompt: {fresh_s} s vs plain {plain} s"
        );
        assert!(
            session_s < plain * 1.03,
            "session: {session_s} s vs plain {plain} s"
        );
        assert_eq!(session.state(), PolicyState::Plain);
        // Re-probes still happen, at a doubling interval over the whole session.
        assert!(session.report().switched_off >= 2, "{:?}", session.report());
        // A perfect drafter keeps drafting across generations, never re-measuring T(0).
        let mut session = SpecPolicy::new(PolicyMode::Auto, 7, DEFAULT_MIN_SPEEDUP);
        generation(&mut session, 12, 0.1, 0.01, |_| true);
        // The first generation ended inside its probe: the next resumes it at full width.
        assert_eq!(session.state(), PolicyState::Probing);
        assert_eq!(session.carry_over().ask(), 7);
        generation(&mut session, 64, 0.1, 0.01, |_| true);
        for _ in 0..5 {
            let mut q = session.carry_over();
            assert_eq!(q.state(), PolicyState::Drafting);
            assert_eq!(q.ask(), 7);
            let (n, s) = generation(&mut q, 16, 0.1, 0.01, |_| true);
            assert!(n as f64 / s > 3.0, "{n} tokens in {s}");
            session = q;
        }
        // Fixed stays fixed.
        assert_eq!(SpecPolicy::fixed(3).carry_over().ask(), 3);
    }

    #[test]
    fn a_low_plain_sample_does_not_lock_the_width_narrow() {
        // `on` measures T(0) once: a sample at half the true step time makes the marginal
        // cost look 1.6 × T(0) after width-1 passes; the periodic full-width pass measures
        // V(7) and the width widens.
        let mut p = SpecPolicy::new(PolicyMode::On, 7, DEFAULT_MIN_SPEEDUP);
        p.record(0, 0, 1, 0.5, 0.0);
        let mut widths = Vec::new();
        for _ in 0..48 {
            let k = p.cut(&[], 7, 0.0);
            p.record(k, k, k + 1, 1.0 + 0.3 * k as f64, 0.0);
            widths.push(k);
        }
        assert_eq!(widths[0], 1, "{widths:?}");
        assert!(
            widths[..EXPLORE_STEPS - 1].iter().all(|&k| k <= 2),
            "{widths:?}"
        );
        assert!(
            widths[EXPLORE_STEPS..].iter().all(|&k| k == 7),
            "{widths:?}"
        );
        // A drafter that is rarely accepted is not explored.
        let mut q = SpecPolicy::new(PolicyMode::On, 7, DEFAULT_MIN_SPEEDUP);
        q.record(0, 0, 1, 1.0, 0.0);
        for _ in 0..40 {
            let k = q.cut(&[], 7, 0.0);
            assert!(k <= 1, "{k}");
            q.record(k, 0, 1, 1.0 + 0.3 * k as f64, 0.0);
        }
    }

    #[test]
    fn min_speedup_is_parsed_strictly() {
        assert_eq!(parse_min_speedup("0.03"), Some(0.03));
        assert_eq!(parse_min_speedup("0"), Some(0.0));
        for bad in ["1", "-0.1", "nan", "inf", "", "3%"] {
            assert_eq!(parse_min_speedup(bad), None, "{bad}");
        }
    }
}
