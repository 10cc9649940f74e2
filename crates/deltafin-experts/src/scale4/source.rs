//! [`Scale4Experts`]: experts served with their scales from the sidecars.

use super::manifest::Scale4Sidecars;
use crate::error::ExpertError;
use crate::source::{ExpertSource, ExpertWeights, Layered, SourceLayer};
use deltafin_tensor::{Bytes, Mxfp4Matrix};
use std::collections::HashSet;
use std::sync::Mutex;

/// The [`SourceLayer`] whose E8M0 scales come from scale4 sidecars: the E2M1 codes come from
/// the inner source (the raw expert) unchanged, the scale bytes are decoded from the record,
/// so every product is bit-identical to the inner source's. Scheduling hints and stats pass
/// through ([`Layered`]).
///
/// A record that cannot be read or fails its checks is an error naming the file, layer and
/// expert ([`Scale4Experts::new`], `K3_EXPERT_SCALE4=require`), or, with
/// [`Scale4Experts::with_fallback`] (`auto`), the expert keeps the raw scales its inner
/// source read (the same bytes a valid record decodes to) and one warning per expert says
/// which record is damaged.
pub struct Scale4Experts {
    sidecars: Scale4Sidecars,
    /// `Some`: damaged records fall back to the raw scales; the experts already warned about.
    fallback: Option<Mutex<HashSet<(usize, usize)>>>,
}

impl Scale4Experts {
    /// Serve `inner`'s experts with scales from `sidecars`; a damaged record is an error.
    pub fn new(inner: Box<dyn ExpertSource>, sidecars: Scale4Sidecars) -> Layered<Scale4Experts> {
        Layered::new(
            inner,
            Scale4Experts {
                sidecars,
                fallback: None,
            },
        )
    }

    /// [`Scale4Experts::new`], but an expert whose record is damaged keeps its raw scales
    /// (lossless either way), with one warning on stderr per expert.
    pub fn with_fallback(
        inner: Box<dyn ExpertSource>,
        sidecars: Scale4Sidecars,
    ) -> Layered<Scale4Experts> {
        Layered::new(
            inner,
            Scale4Experts {
                sidecars,
                fallback: Some(Mutex::new(HashSet::new())),
            },
        )
    }

    /// The sidecars the scales come from.
    pub fn sidecars(&self) -> &Scale4Sidecars {
        &self.sidecars
    }
}

impl SourceLayer for Scale4Experts {
    fn adapt(&self, layer: usize, expert: usize, w: &mut ExpertWeights) -> Result<(), ExpertError> {
        let scales = match (self.sidecars.scales(layer, expert), &self.fallback) {
            (Ok(s), _) => s,
            (Err(e), Some(warned)) => {
                let first = warned
                    .lock()
                    .map(|mut w| w.insert((layer, expert)))
                    .unwrap_or(false);
                if first {
                    eprintln!(
                        "deltafin: warning: scale4 sidecar: {e}; expert {expert} of layer {layer} uses its raw scales (the same values); `deltafin convert-experts-scale4` rewrites the damaged layer"
                    );
                }
                return Ok(());
            }
            (Err(e), None) => {
                return Err(ExpertError::Unavailable {
                    layer,
                    expert,
                    message: format!("scale4 sidecar: {e}"),
                });
            }
        };
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
