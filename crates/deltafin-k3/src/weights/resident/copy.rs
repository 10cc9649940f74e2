//! [`K3Model::copy_spine_to_huge_pages`]: the copy of the resident spine into one anonymous
//! mapping advised for transparent huge pages ([`crate::weights::resident`]).

use deltafin_tensor::storage::copy_to_anonymous;
use deltafin_tensor::{Bf16Matrix, Bytes};

use crate::error::ModelError;
use crate::model::K3Model;
use crate::model::layer::{Ffn, linears_mut};
use crate::model::linear::Linear;
use crate::weights::resident::ResidentCopy;

fn weights_err(name: &str, e: deltafin_tensor::TensorError) -> ModelError {
    ModelError::Weights {
        name: name.to_string(),
        message: e.to_string(),
    }
}

/// A spine matrix to be moved: a projection or a bf16-only matrix (the router).
pub(super) enum Slot<'a> {
    Linear(String, &'a mut Linear),
    Bf16(String, &'a mut Bf16Matrix),
}

impl Slot<'_> {
    /// The host views, codes before scales; none for a matrix on a device.
    pub(super) fn parts(&self) -> Vec<Bytes> {
        match self {
            Slot::Bf16(_, m) => vec![m.bytes().clone()],
            Slot::Linear(_, l) => match &**l {
                Linear::Bf16(m) => vec![m.bytes().clone()],
                Linear::RowInt8(m) => vec![m.data_bytes().clone(), m.scale_bytes().clone()],
                Linear::Device(_) => Vec::new(),
            },
        }
    }

    /// Point the matrix at `views` (as many as [`Slot::parts`] gave, same sizes).
    fn rebase(&mut self, views: &mut impl Iterator<Item = Bytes>) -> Result<(), ModelError> {
        let mut next = |name: &str| {
            views.next().ok_or_else(|| ModelError::Weights {
                name: name.to_string(),
                message: "no copy for this matrix".into(),
            })
        };
        match self {
            Slot::Bf16(name, m) => {
                let b = next(name)?;
                **m = m.with_bytes(name, b).map_err(|e| weights_err(name, e))?;
            }
            Slot::Linear(name, l) => match &mut **l {
                Linear::Bf16(m) => {
                    let b = next(name)?;
                    *m = m.with_bytes(name, b).map_err(|e| weights_err(name, e))?;
                }
                Linear::RowInt8(m) => {
                    let data = next(name)?;
                    let scales = next(name)?;
                    *m = m
                        .with_bytes(name, data, scales)
                        .map_err(|e| weights_err(name, e))?;
                }
                Linear::Device(_) => {}
            },
        }
        Ok(())
    }
}

impl K3Model {
    /// Copy every resident spine matrix (the projections of the resident layers — all of
    /// them, or those before the streamed ones — in their order of use, each MoE layer's
    /// router, then `lm_head`) into one anonymous mapping advised for transparent huge pages,
    /// and point the model at the copies. The embedding stays mapped: decode reads one row of
    /// it per token. Matrices already on a device are left alone. `progress(bytes, total)`
    /// as [`copy_to_anonymous`] calls it.
    pub fn copy_spine_to_huge_pages(
        &mut self,
        progress: &(dyn Fn(u64, u64) + Sync),
    ) -> Result<ResidentCopy, ModelError> {
        let resident_layers = self
            .spine_stream
            .as_ref()
            .map_or(self.layers.len(), |s| s.resident_layers());
        let mut parts: Vec<Bytes> = Vec::new();
        let mut matrices = 0;
        self.for_each_spine_matrix(resident_layers, |slot| {
            let p = slot.parts();
            matrices += usize::from(!p.is_empty());
            parts.extend(p);
            Ok(())
        })?;
        let copies =
            copy_to_anonymous(&parts, true, progress).map_err(|e| ModelError::Weights {
                name: "resident spine".into(),
                message: format!(
                    "cannot copy {} bytes into anonymous memory: {e}",
                    parts.iter().map(Bytes::len).sum::<usize>()
                ),
            })?;
        drop(parts);
        let mut views = copies.views.into_iter();
        self.for_each_spine_matrix(resident_layers, |mut slot| slot.rebase(&mut views))?;
        Ok(ResidentCopy {
            what: "resident spine",
            matrices,
            bytes: copies.mapped as u64,
            huge_advised: copies.huge_advised,
            stats: copies.stats,
        })
    }

    /// Visit the matrices [`K3Model::copy_spine_to_huge_pages`] moves, always in the same
    /// order.
    pub(super) fn for_each_spine_matrix(
        &mut self,
        resident_layers: usize,
        mut f: impl FnMut(Slot<'_>) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        for (l, layer) in self.layers.iter_mut().enumerate().take(resident_layers) {
            for (suffix, m) in linears_mut(layer) {
                f(Slot::Linear(format!("model.layers.{l}.{suffix}"), m))?;
            }
            if let Ffn::Moe(moe) = &mut layer.ffn {
                f(Slot::Bf16(
                    format!("model.layers.{l}.block_sparse_moe.gate.weight"),
                    &mut moe.router.weight,
                ))?;
            }
        }
        f(Slot::Linear("lm_head.weight".into(), &mut self.lm_head))
    }
}
