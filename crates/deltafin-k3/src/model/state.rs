//! Per-sequence decoding state (docs/K3.md §6): KDA recurrent states and convolution windows,
//! MLA latent caches, and the number of positions processed.

use crate::error::ModelError;
use crate::model::kda::KdaState;
use crate::model::mla::MlaCache;
use deltafin_store::dims::{AttnKind, ModelDims};

/// The state one layer carries between calls.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerState {
    /// A KDA layer: fixed-size recurrent state and conv window.
    Kda(KdaState),
    /// An MLA layer: the growing `ĉ`/`kt` cache.
    Mla(MlaCache),
}

/// The state of one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct State {
    /// One entry per decoder layer.
    pub layers: Vec<LayerState>,
    /// Positions processed so far.
    pub position: usize,
}

impl State {
    /// Fresh state for an empty sequence.
    pub fn new(dims: &ModelDims) -> State {
        State {
            layers: dims
                .attn_kinds
                .iter()
                .map(|k| match k {
                    AttnKind::Kda => LayerState::Kda(KdaState::new(dims)),
                    AttnKind::Mla => LayerState::Mla(MlaCache::new(dims)),
                })
                .collect(),
            position: 0,
        }
    }

    /// Positions processed so far.
    pub fn len(&self) -> usize {
        self.position
    }

    /// True before the first token.
    pub fn is_empty(&self) -> bool {
        self.position == 0
    }

    /// Bytes currently held (KDA states + MLA caches).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Kda(s) => (s.recurrent.len() + s.conv.len()) * 4,
                LayerState::Mla(c) => c.bytes(),
            })
            .sum()
    }
}

/// What is needed to return a [`State`] to an earlier length: the KDA states (fixed size,
/// overwritten in place) and the position; MLA caches are cut back instead of copied.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    kda: Vec<Option<KdaState>>,
    position: usize,
}

impl State {
    /// Save what [`State::rollback`] needs to return to the current length.
    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            kda: self
                .layers
                .iter()
                .map(|l| match l {
                    LayerState::Kda(s) => Some(s.clone()),
                    LayerState::Mla(_) => None,
                })
                .collect(),
            position: self.position,
        }
    }

    /// Return to the state saved by `cp` (taken from this state, which may have grown
    /// since). Exact: KDA states are restored bit for bit, MLA caches truncated. A
    /// checkpoint of a differently shaped state, or one ahead of this state, is an error and
    /// changes nothing.
    pub fn rollback(&mut self, cp: &Checkpoint, dims: &ModelDims) -> Result<(), ModelError> {
        let fits = cp.kda.len() == self.layers.len()
            && cp.position <= self.position
            && self.layers.iter().zip(&cp.kda).all(|(l, k)| match (l, k) {
                (LayerState::Kda(s), Some(k)) => s.recurrent.len() == k.recurrent.len(),
                (LayerState::Mla(_), None) => true,
                _ => false,
            });
        if !fits {
            return Err(ModelError::StateMismatch(
                "checkpoint was not taken from this state".into(),
            ));
        }
        for (l, saved) in self.layers.iter_mut().zip(&cp.kda) {
            match (l, saved) {
                (LayerState::Kda(s), Some(k)) => s.clone_from(k),
                (LayerState::Mla(c), _) => c.truncate(cp.position, dims),
                (LayerState::Kda(_), None) => {}
            }
        }
        self.position = cp.position;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_follow_dims() {
        let dims = crate::model::forward::tests::tiny_dims();
        let s = State::new(&dims);
        assert_eq!(s.layers.len(), dims.num_layers());
        assert_eq!(s.bytes(), dims.kda_state_bytes());
        assert!(s.is_empty());
    }
}
