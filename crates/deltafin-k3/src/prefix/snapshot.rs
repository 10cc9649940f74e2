//! [`Snapshot`]: what a prefix state holds, its cache [`Key`], and the shape check both
//! tiers apply before handing a state to a model.

use crate::model::state::{LayerState, State};
use crate::model::taps::Taps;
use deltafin_store::dims::{AttnKind, ModelDims};

/// A stored prefix state: the state after the prefix and, when the run that stored it
/// collected them, the prefix's taps.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pub state: State,
    pub taps: Option<Taps>,
}

impl Snapshot {
    /// Bytes held in memory.
    pub fn bytes(&self) -> usize {
        self.state.bytes() + self.taps.as_ref().map_or(0, |t| t.values().len() * 4)
    }
}

/// A key: SHA-256 of the tag and the ids.
pub type Key = [u8; 32];

/// Whether `state` has the layer kinds and sizes of `dims` (and MLA caches as long as its
/// position).
pub(crate) fn shaped_for(state: &State, dims: &ModelDims) -> bool {
    state.layers.len() == dims.num_layers()
        && state
            .layers
            .iter()
            .zip(&dims.attn_kinds)
            .all(|(l, k)| match (l, k) {
                (LayerState::Kda(s), AttnKind::Kda) => {
                    s.recurrent.len() == dims.kda_recurrent_values()
                        && s.conv.len() == dims.kda_conv_values()
                }
                (LayerState::Mla(c), AttnKind::Mla) => {
                    let (a, b) = c.values();
                    a == state.position * dims.kv_lora_rank
                        && b == state.position * dims.qk_rope_head_dim
                        && c.is_dtype(dims.mla_cache_dtype)
                }
                _ => false,
            })
}
