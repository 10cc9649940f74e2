//! Resident spine weights in anonymous memory backed by transparent huge pages.
//!
//! The spine is read once per decoded token, front to back. Mapped from the checkpoint (or
//! the int8 spine files) it sits in 4 KiB page-cache pages: every 4 KiB of weights costs a
//! TLB miss and a page-table walk, which on a virtual machine is a nested walk through the
//! host's tables too. Copied once at load into one anonymous mapping advised for
//! transparent huge pages, the same bytes need 512 times fewer walks; the product kernels
//! read exactly the same values (the copy is byte-for-byte, so tokens and logits do not
//! change).
//!
//! The copy replaces the mapped views and drops the mapped pages from the process as it
//! goes ([`deltafin_tensor::storage::copy_to_anonymous`]), so the resident set stays one
//! copy of the spine; the page cache may keep the file's pages, which the system reclaims
//! as it needs.
//!
//! Selected by [`HugePages`] (`DELTAFIN_HUGE_PAGES=auto|off` for the CLI): `auto` copies
//! when the system grants huge pages to an advised mapping (Linux with transparent huge
//! pages `always` or `madvise`), `off` keeps the zero-copy mappings.

use deltafin_tensor::storage::copy_to_anonymous;
use deltafin_tensor::{Bf16Matrix, Bytes};

use crate::linear::Linear;
use crate::model::{Ffn, K3Model, ModelError};
use crate::spine_stream::linears_mut;

/// Whether resident spine weights are copied into huge-page memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HugePages {
    /// Copy when the system grants transparent huge pages to an advised mapping.
    #[default]
    Auto,
    /// Keep the spine mapped from its files (zero-copy).
    Off,
}

impl HugePages {
    /// The environment variable the CLI reads.
    pub const ENV: &'static str = "DELTAFIN_HUGE_PAGES";

    /// Parse `auto` or `off` (strict; the error names the accepted values).
    pub fn parse(text: &str) -> Result<HugePages, String> {
        match text.trim() {
            "auto" => Ok(HugePages::Auto),
            "off" => Ok(HugePages::Off),
            other => Err(format!("{other:?} is not one of auto, off")),
        }
    }

    /// Whether to copy on this system.
    pub fn copies(self) -> bool {
        self == HugePages::Auto && transparent_huge_pages().is_some_and(|m| m != "never")
    }
}

/// The system's transparent-huge-page mode (`always`, `madvise` or `never`), `None` where
/// the system has none (not Linux, or the kernel was built without them).
pub fn transparent_huge_pages() -> Option<String> {
    let text = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    selected_mode(&text)
}

/// The bracketed entry of a sysfs choice list such as `always [madvise] never`.
fn selected_mode(text: &str) -> Option<String> {
    let start = text.find('[')?;
    let end = start + text[start..].find(']')?;
    Some(text[start + 1..end].to_string())
}

/// What [`K3Model::copy_spine_to_huge_pages`] copied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResidentCopy {
    /// What was copied (`resident spine`, `routed experts`).
    pub what: &'static str,
    /// Matrices copied (projections, routers, `lm_head`).
    pub matrices: usize,
    /// Bytes of the one anonymous mapping.
    pub bytes: u64,
    /// Whether the system accepted the huge-page advice for it.
    pub huge_advised: bool,
}

impl ResidentCopy {
    /// One line for `--stats` and the startup log.
    pub fn describe(&self) -> String {
        format!(
            "{}: {} matrices, {:.3} GB copied into anonymous memory ({})",
            self.what,
            self.matrices,
            self.bytes as f64 / 1e9,
            if self.huge_advised {
                "transparent huge pages advised"
            } else {
                "huge-page advice refused: 4 KiB pages"
            }
        )
    }
}

fn weights_err(name: &str, e: deltafin_tensor::TensorError) -> ModelError {
    ModelError::Weights {
        name: name.to_string(),
        message: e.to_string(),
    }
}

/// A spine matrix to be moved: a projection or a bf16-only matrix (the router).
enum Slot<'a> {
    Linear(String, &'a mut Linear),
    Bf16(String, &'a mut Bf16Matrix),
}

impl Slot<'_> {
    /// The host views, codes before scales; none for a matrix on a device.
    fn parts(&self) -> Vec<Bytes> {
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
            .map_or(self.layers.len(), |s| s.split().resident);
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
                    "cannot map {} bytes of anonymous memory for the copy: {e}",
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
        })
    }

    /// Visit the matrices [`K3Model::copy_spine_to_huge_pages`] moves, always in the same
    /// order.
    fn for_each_spine_matrix(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::loader::{CheckpointExperts, EngineOptions, load_model_with_experts};
    use crate::model::LogitRows;
    use crate::spine_int8::SpineFormat;
    use std::sync::Arc;

    fn small() -> (tempfile::TempDir, Arc<Checkpoint>) {
        let (dir, ckpt) = crate::test_util::small_checkpoint(5, true);
        (dir, Arc::new(ckpt))
    }

    /// The model with `HugePages::Off`; with `copy`, its spine and experts are then copied
    /// explicitly (so the test does not depend on the system's huge-page setting).
    fn load(
        ckpt: &Arc<Checkpoint>,
        spine: SpineFormat,
        copy: bool,
    ) -> (K3Model, Option<(ResidentCopy, ResidentCopy)>) {
        let experts = CheckpointExperts::new(ckpt.clone());
        let expert_copy = copy.then(|| experts.copy_to_huge_pages(&|_, _| {}).unwrap());
        let mut m = load_model_with_experts(
            ckpt.clone(),
            &EngineOptions {
                spine,
                huge_pages: HugePages::Off,
                ..Default::default()
            },
            Box::new(experts),
        )
        .unwrap();
        assert!(m.resident_copy.is_none());
        let copies = expert_copy.map(|e| {
            let done = std::sync::atomic::AtomicU64::new(0);
            let total = std::sync::atomic::AtomicU64::new(0);
            let c = m
                .copy_spine_to_huge_pages(&|bytes, of| {
                    done.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
                    total.store(of, std::sync::atomic::Ordering::Relaxed);
                })
                .unwrap();
            // Progress covers exactly the bytes copied, every one once.
            let (done, total) = (done.into_inner(), total.into_inner());
            assert_eq!(done, total);
            assert!(c.bytes >= done && c.bytes - done < 64 * c.matrices as u64 * 2);
            (c, e)
        });
        (m, copies)
    }

    /// A 4-token prefill's every row, then two decode steps.
    fn run(m: &K3Model) -> Vec<f32> {
        let mut st = m.new_state();
        let mut out = m
            .forward(&mut st, &[3, 77, 500, 9], LogitRows::All)
            .unwrap()
            .values;
        for t in [12, 901] {
            out.extend(m.decode(&mut st, t).unwrap());
        }
        out
    }

    /// Start address and length of every host view the copy moves, in its order.
    fn views(m: &mut K3Model) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let n = m.layers.len();
        m.for_each_spine_matrix(n, |slot| {
            out.extend(
                slot.parts()
                    .iter()
                    .map(|b| (b.as_slice().as_ptr() as usize, b.len())),
            );
            Ok(())
        })
        .unwrap();
        out
    }

    #[test]
    fn copied_weights_give_identical_logits_from_one_mapping_in_order_of_use() {
        let (_dir, ckpt) = small();
        for spine in [SpineFormat::Int8, SpineFormat::Bf16] {
            let (mut mapped, _) = load(&ckpt, spine, false);
            let (mut copied, report) = load(&ckpt, spine, true);
            let (spine_copy, expert_copy) = report.unwrap();
            assert_eq!(run(&mapped), run(&copied), "{spine:?}: logits changed");

            // Every moved view lies in one mapping of the reported size, back to back in the
            // visiting order at cache-line offsets, and none is the mapped original.
            let before = views(&mut mapped);
            let after = views(&mut copied);
            assert_eq!(before.len(), after.len());
            let base = after[0].0;
            let mut at = base;
            for (&(p, len), &(q, len0)) in after.iter().zip(&before) {
                assert_eq!(len, len0);
                assert_eq!(p, at, "{spine:?}: not back to back");
                assert_ne!(p, q);
                at += len.div_ceil(deltafin_tensor::storage::ANON_ALIGN)
                    * deltafin_tensor::storage::ANON_ALIGN;
            }
            assert_eq!((at - base) as u64, spine_copy.bytes);
            let cfg = ckpt.config();
            let moe = (0..cfg.n_layers()).filter(|&l| !cfg.is_dense(l)).count();
            let projections: usize = copied.layers.iter_mut().map(|l| linears_mut(l).len()).sum();
            assert_eq!(spine_copy.matrices, projections + moe + 1);
            assert_eq!(spine_copy.what, "resident spine");
            let per_layer = cfg.text.num_experts;
            assert_eq!(expert_copy.matrices, moe * per_layer * 3);
            assert_eq!(expert_copy.what, "routed experts");
            // Experts: the served views are the copies (inside the expert mapping).
            let served = copied.experts.expert(cfg.n_layers() - 1, 1).unwrap();
            let orig = ckpt.expert_matrices(cfg.n_layers() - 1, 1).unwrap();
            assert_eq!(served.w2.packed(), orig.w2.packed());
            assert_ne!(served.w2.packed().as_ptr(), orig.w2.packed().as_ptr());
        }
    }

    #[test]
    fn the_mode_parses_strictly_and_the_sysfs_choice_is_read() {
        assert_eq!(HugePages::parse("auto"), Ok(HugePages::Auto));
        assert_eq!(HugePages::parse(" off\n"), Ok(HugePages::Off));
        let e = HugePages::parse("on").unwrap_err();
        assert!(e.contains("\"on\"") && e.contains("auto, off"), "{e}");
        assert!(!HugePages::Off.copies());
        assert_eq!(
            selected_mode("always [madvise] never\n").as_deref(),
            Some("madvise")
        );
        assert_eq!(
            selected_mode("[always] madvise never").as_deref(),
            Some("always")
        );
        assert_eq!(selected_mode("always madvise never"), None);
        let d = ResidentCopy {
            what: "resident spine",
            matrices: 3,
            bytes: 2_500_000_000,
            huge_advised: false,
        }
        .describe();
        assert!(
            d.contains("3 matrices") && d.contains("2.500 GB") && d.contains("4 KiB"),
            "{d}"
        );
    }
}
