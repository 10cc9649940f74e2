//! The PILOT gate and what it counts: per-rank precision of the guesses, and the pending
//! guess of each layer.

use crate::source::PilotGuess;
use crate::stats::RankStats;

/// The PILOT next-layer prefetch switch (`K3_PILOT_GATE`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PilotGate {
    /// Ungoverned: prefetch every layer's prediction (the product default).
    Off,
    /// Predict and report recall, but read nothing speculatively (the A/B baseline).
    Measure,
    /// Prefetch a layer's prediction only while its measured recall is at least `threshold`
    /// (after `warmup` predictions of that layer).
    On { threshold: f64, warmup: u64 },
    /// Prefetch a guess only while the measured precision of its rank (decayed, per pass
    /// kind: one row or several) is at least `precision`, once `warmup` guesses of that rank
    /// have been judged; at most `max_guesses` reads per prediction (0: no cap). Guesses are
    /// read most confident first in every mode.
    Ranked {
        precision: f64,
        warmup: u64,
        max_guesses: usize,
    },
}

impl PilotGate {
    /// `off`, `measure` or `on`.
    pub fn name(&self) -> &'static str {
        match self {
            PilotGate::Off => "off",
            PilotGate::Measure => "measure",
            PilotGate::On { .. } => "on",
            PilotGate::Ranked { .. } => "ranked",
        }
    }
}

/// Break-even precision of one PILOT guess (the `ranked` gate's default threshold).
///
/// When a layer's reads are on the critical path, a right guess read in advance takes one
/// expert read `τ` off the next layer's wait, and a wrong one adds `τ` of disk time that
/// the next demand reads queue behind. Guessing with precision `p` pays `p·τ − (1 − p)·τ`,
/// positive for `p > 1/2`. Cancellation only lowers a wrong guess's cost (its unstarted
/// pieces are dropped), so 1/2 is the conservative break-even.
pub const PILOT_BREAK_EVEN_PRECISION: f64 = 0.5;

/// Half-life, in judged guesses of one rank, of the precision the `ranked` gate uses.
pub const PILOT_RANK_HALF_LIFE: f64 = 128.0;

/// Ranks at or beyond this share one counter.
pub(super) const MAX_PILOT_RANKS: usize = 256;

/// One rank's counters: raw for the report, decayed for the gate.
#[derive(Clone, Default)]
pub(super) struct RankCounter {
    pub(super) stats: RankStats,
    pub(super) hits: f64,
    pub(super) total: f64,
}

impl RankCounter {
    pub(super) fn precision(&self) -> Option<f64> {
        (self.total > 0.0).then(|| self.hits / self.total)
    }

    /// Whether `gate` suppresses guesses of this rank now.
    pub(super) fn gated(&self, gate: PilotGate) -> bool {
        match gate {
            PilotGate::Ranked {
                precision, warmup, ..
            } => self.stats.guesses >= warmup && self.precision().unwrap_or(1.0) < precision,
            _ => false,
        }
    }

    pub(super) fn judge(&mut self, right: bool, prefetched: bool, gate: PilotGate) {
        let d = 0.5f64.powf(1.0 / PILOT_RANK_HALF_LIFE);
        self.hits = self.hits * d + f64::from(u8::from(right));
        self.total = self.total * d + 1.0;
        let st = &mut self.stats;
        st.guesses += 1;
        st.right += u64::from(right);
        st.prefetched += u64::from(prefetched);
        st.prefetched_right += u64::from(prefetched && right);
        self.stats.precision_now = self.precision();
        self.stats.gated = self.gated(gate);
    }
}

/// A layer's pending guess: the pass kind (0: one row, 1: several), the guesses in order,
/// and which of them were read.
pub(super) struct Prediction {
    pub(super) class: usize,
    pub(super) guesses: Vec<PilotGuess>,
    pub(super) issued: Vec<bool>,
    /// Reads an earlier guess for the same layer issued that this one does not name (see
    /// `State::discard_superseded`): judged with it, outside the per-rank counts.
    pub(super) carried: Vec<usize>,
}
