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
//! The copy reads each matrix from its file straight into its place in the mapping, with
//! large reads, several in flight, O_DIRECT where the filesystem takes it
//! ([`deltafin_tensor::storage::copy_to_anonymous`]), so a cold load runs at the disk's
//! sequential speed instead of one page fault per 4 KiB; it replaces the mapped views and
//! drops any of their pages from the process, so the resident set stays one copy of the spine.
//!
//! Selected by [`HugePages`] (`DELTAFIN_HUGE_PAGES=auto|off` for the CLI): `auto` copies
//! when the system grants huge pages to an advised mapping (Linux with transparent huge
//! pages `always` or `madvise`), `off` keeps the zero-copy mappings.

mod copy;

pub use crate::model::spine::ResidentCopy;
pub use deltafin_store::resident::{HugePages, transparent_huge_pages};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::K3Model;
    use crate::model::LogitRows;
    use crate::model::layer::linears_mut;
    use crate::weights::loader::{CheckpointExperts, EngineOptions, load_model_with_experts};
    use deltafin_store::checkpoint::Checkpoint;
    use deltafin_store::spine_int8::SpineFormat;
    use deltafin_tensor::storage::CopyStats;
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
            // Padding: under two 4 KiB blocks per view (codes and scales of a matrix).
            assert!(c.bytes >= done && c.bytes - done < 8192 * c.matrices as u64 * 2);
            // Everything came from the files, none through their mappings.
            assert_eq!(c.stats.read_bytes(), done);
            assert_eq!(c.stats.memory_bytes, 0);
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

            // Every moved view lies in one mapping of the reported size, in the visiting
            // order, each at its source's offset modulo 4 KiB (read from its file with
            // aligned reads), and none is the mapped original.
            let before = views(&mut mapped);
            let after = views(&mut copied);
            assert_eq!(before.len(), after.len());
            let base = after[0].0;
            let mut at = base;
            for (&(p, len), &(q, len0)) in after.iter().zip(&before) {
                assert_eq!(len, len0);
                assert!(p >= at, "{spine:?}: not in the visiting order");
                assert_eq!(p % 4096, q % 4096, "{spine:?}: page offset changed");
                assert_ne!(p, q);
                at = p + len;
            }
            assert!((at - base) as u64 <= spine_copy.bytes);
            assert!(spine_copy.bytes - ((at - base) as u64) < 8192);
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
    fn the_copy_report_reads_as_one_line() {
        let d = ResidentCopy {
            what: "resident spine",
            matrices: 3,
            bytes: 2_500_000_000,
            huge_advised: false,
            stats: CopyStats {
                direct_bytes: 2_000_000_000,
                buffered_bytes: 400_000_000,
                memory_bytes: 100_000_000,
                seconds: 2.5,
                ..CopyStats::default()
            },
        }
        .describe();
        assert!(
            d.contains("3 matrices")
                && d.contains("2.500 GB")
                && d.contains("4 KiB")
                && d.contains("2.000 GB with O_DIRECT")
                && d.contains("1.000 GB/s"),
            "{d}"
        );
    }
}
