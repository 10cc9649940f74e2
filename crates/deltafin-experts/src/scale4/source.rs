//! [`Scale4Experts`]: experts served with their scales from the sidecars.

use super::manifest::Scale4Sidecars;
use crate::error::ExpertError;
use crate::source::{ExpertSource, ExpertWeights, Layered, SourceLayer};
use deltafin_tensor::{Bytes, Mxfp4Matrix};

/// The [`SourceLayer`] whose E8M0 scales come from scale4 sidecars: the E2M1 codes come from
/// the inner source (the raw expert) unchanged, the scale bytes are decoded from the record,
/// so every product is bit-identical to the inner source's. Scheduling hints and stats pass
/// through ([`Layered`]).
pub struct Scale4Experts {
    sidecars: Scale4Sidecars,
}

impl Scale4Experts {
    /// Serve `inner`'s experts with scales from `sidecars`.
    pub fn new(inner: Box<dyn ExpertSource>, sidecars: Scale4Sidecars) -> Layered<Scale4Experts> {
        Layered::new(inner, Scale4Experts { sidecars })
    }

    /// The sidecars the scales come from.
    pub fn sidecars(&self) -> &Scale4Sidecars {
        &self.sidecars
    }
}

impl SourceLayer for Scale4Experts {
    fn adapt(&self, layer: usize, expert: usize, w: &mut ExpertWeights) -> Result<(), ExpertError> {
        let scales = self
            .sidecars
            .scales(layer, expert)
            .map_err(|e| ExpertError::Unavailable {
                layer,
                expert,
                message: format!("scale4 sidecar: {e}"),
            })?;
        let [s1, s2, s3] = scales;
        let with = |m: &Mxfp4Matrix, s: Vec<u8>, name: &str| {
            m.with_scales(name, Bytes::from_vec(s))
                .map_err(|source| ExpertError::Tensor {
                    layer,
                    expert,
                    source,
                })
        };
        *w = ExpertWeights {
            w1: with(&w.w1, s1, "w1")?,
            w2: with(&w.w2, s2, "w2")?,
            w3: with(&w.w3, s3, "w3")?,
        };
        Ok(())
    }
}
