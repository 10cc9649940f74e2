//! Shared fixtures of the unit tests.

use crate::error::ExpertError;
use crate::heat::HeatDims;
use crate::source::{ExpertSource, ExpertWeights, PilotGuess};
use crate::stats::ExpertStats;
use std::sync::{Arc, Mutex};

/// A small layout: 3 MoE layers of 8 experts, top-2.
pub(crate) const DIMS: HeatDims = HeatDims {
    layers: 3,
    experts: 8,
    top_k: 2,
};

/// A source with no experts (the tests only record routes).
pub(crate) struct Nothing;
impl ExpertSource for Nothing {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError> {
        Err(ExpertError::Unavailable {
            layer,
            expert,
            message: "none".into(),
        })
    }
}

/// A source that writes down every scheduling call it receives, wants PILOT guesses, names
/// the last pending expert as ready and reports stats with 7 read threads (values no default
/// produces, so a wrapper that drops a call is seen).
#[derive(Clone, Default)]
pub(crate) struct HintLog(Arc<Mutex<Vec<String>>>);

impl HintLog {
    fn push(&self, event: String) {
        self.0.lock().unwrap().push(event);
    }

    pub(crate) fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }

    /// Call every scheduling method of `outer` (a stack of wrappers over this source) and
    /// check that each call reached this source unchanged and its answer came back.
    pub(crate) fn check_forwarding(&self, outer: &dyn ExpertSource) {
        self.take();
        outer.begin_layer(2, &[1, 4]);
        assert_eq!(self.take(), ["begin 2 [1, 4]"]);
        assert_eq!(outer.next_ready(2, &[1, 4, 5]), 2);
        assert_eq!(self.take(), ["next_ready 2 [1, 4, 5]"]);
        assert!(outer.wants_prediction());
        assert_eq!(self.take(), ["wants_prediction"]);
        let guess = PilotGuess {
            expert: 6,
            rank: 0,
            votes: 2,
        };
        outer.predict(3, 5, &[guess]);
        assert_eq!(self.take(), [format!("predict 3 5 [{guess:?}]")]);
        assert_eq!(outer.stats().map(|s| s.read_threads), Some(7));
        assert_eq!(self.take(), ["stats"]);
    }
}

impl ExpertSource for HintLog {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError> {
        self.push(format!("expert {layer} {expert}"));
        Nothing.expert(layer, expert)
    }
    fn begin_layer(&self, layer: usize, experts: &[usize]) {
        self.push(format!("begin {layer} {experts:?}"));
    }
    fn next_ready(&self, layer: usize, pending: &[usize]) -> usize {
        self.push(format!("next_ready {layer} {pending:?}"));
        pending.len().saturating_sub(1)
    }
    fn wants_prediction(&self) -> bool {
        self.push("wants_prediction".into());
        true
    }
    fn predict(&self, layer: usize, rows: usize, guesses: &[PilotGuess]) {
        self.push(format!("predict {layer} {rows} {guesses:?}"));
    }
    fn stats(&self) -> Option<ExpertStats> {
        self.push("stats".into());
        Some(ExpertStats {
            read_threads: 7,
            ..ExpertStats::default()
        })
    }
}
