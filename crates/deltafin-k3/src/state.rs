//! Per-sequence decoding state (k3-model.md §6): KDA recurrent states and convolution windows,
//! MLA latent caches, and the number of positions processed.

use crate::dims::{AttnKind, ModelDims};
use crate::kda::KdaState;
use crate::mla::MlaCache;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_follow_dims() {
        let dims = crate::model::tests::tiny_dims();
        let s = State::new(&dims);
        assert_eq!(s.layers.len(), dims.num_layers());
        assert_eq!(s.bytes(), dims.kda_state_bytes());
        assert!(s.is_empty());
    }
}
