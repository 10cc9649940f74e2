//! The Metal kernel sources of `kernels/metal/`, embedded at build time (on every platform, so
//! the host-compiler logic test runs in every `cargo test`), and the launch geometry shared by
//! the device wrapper and that test.
//!
//! The whole library is one translation unit: [`PRELUDE`] followed by every file of
//! [`KERNELS`] ([`library_source`]); Metal compiles it at run time with `newLibraryWithSource`.

/// The shared prelude (`kernels/metal/prelude.metal`): decoders, fixed-order reductions.
pub const PRELUDE: &str = include_str!("../../../../kernels/metal/prelude.metal");

pub use crate::gpu::{BATCH_WIDTHS, KernelSource, batch_split};

/// Every kernel file, in library order.
pub const KERNELS: [KernelSource; 3] =
    crate::gpu::kernel_sources!("../../../../kernels/metal/", "metal");

/// The library's full source: the prelude, then every kernel file.
pub fn library_source() -> String {
    let mut s = String::from(PRELUDE);
    for k in KERNELS {
        s.push_str(&k.section());
    }
    s
}

/// Threads per threadgroup of the product kernels (8 simdgroups of 32).
pub const MATVEC_THREADS: usize = 256;

/// Weight rows per threadgroup of the product kernels (`ROWS_PER_GROUP` in `matvec.metal`).
pub const ROWS_PER_GROUP: usize = 8;

/// Threads per threadgroup of `mla_decode`.
pub const MLA_THREADS: usize = 256;

/// The SIMD-group width the kernels assume.
pub const SIMD_WIDTH: usize = 32;

/// Threads per threadgroup of `kda_step` for head dimension `d`: one per value column, in
/// whole simdgroups, at most 256 (threads then stride the columns).
pub fn kda_threads(d: usize) -> usize {
    d.div_ceil(SIMD_WIDTH).clamp(1, 8) * SIMD_WIDTH
}

/// Threadgroup memory bytes of `kda_step` (alpha, k, q: `3·d` floats).
pub fn kda_threadgroup_bytes(d: usize) -> usize {
    3 * d * 4
}

/// Threadgroup memory bytes of `mla_decode` (q_lat / ctx, qt, 32 floats of scratch).
pub fn mla_threadgroup_bytes(kvl: usize, rope: usize) -> usize {
    (kvl + rope + 32) * 4
}

/// `struct MatvecParams` of `matvec.metal`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatvecParams {
    /// Weight rows.
    pub rows: u32,
    /// Columns.
    pub cols: u32,
}

/// `struct KdaParams` of `kda.metal`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KdaParams {
    /// Head dimension.
    pub d: u32,
}

/// `struct MlaParams` of `mla.metal`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaParams {
    /// Cached tokens.
    pub n: u32,
    /// `qk_nope_head_dim`.
    pub nope: u32,
    /// `qk_rope_head_dim`.
    pub rope: u32,
    /// `v_head_dim`.
    pub vdim: u32,
    /// `kv_lora_rank`.
    pub kvl: u32,
    /// Softmax scale `1/√(nope + rope)`.
    pub scale: f32,
}

pub use crate::gpu::MlaShape;

impl MlaShape {
    /// The kernel parameters for `n` cached tokens, or `None` if a size exceeds 32 bits.
    pub fn params(&self, n: usize) -> Option<MlaParams> {
        let u = |x: usize| u32::try_from(x).ok();
        Some(MlaParams {
            n: u(n)?,
            nope: u(self.nope)?,
            rope: u(self.rope)?,
            vdim: u(self.v)?,
            kvl: u(self.kvl)?,
            scale: self.scale(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_point_is_defined_in_its_file() {
        for k in KERNELS {
            for e in k.entries {
                // Product kernels are stamped out by DEFINE_NB(NB) from `matmul_<kind>_nb##NB`.
                let stem = e.rsplit_once("_nb").map_or(*e, |(s, _)| s);
                assert!(
                    k.text.contains(&format!("kernel void {e}("))
                        || k.text.contains(&format!("kernel void {stem}_nb##NB(")),
                    "{}: no kernel {e}",
                    k.file
                );
            }
        }
        for nb in BATCH_WIDTHS {
            assert!(KERNELS[0].text.contains(&format!("DEFINE_NB({nb})")));
        }
        assert!(library_source().starts_with(PRELUDE));
    }

    #[test]
    fn batches_split_largest_first() {
        assert_eq!(batch_split(0), vec![]);
        assert_eq!(batch_split(1), vec![(0, 1)]);
        assert_eq!(batch_split(3), vec![(0, 2), (2, 1)]);
        assert_eq!(batch_split(16), vec![(0, 16)]);
        assert_eq!(batch_split(23), vec![(0, 16), (16, 4), (20, 2), (22, 1)]);
    }

    #[test]
    fn kda_threads_are_whole_simdgroups() {
        assert_eq!(kda_threads(1), 32);
        assert_eq!(kda_threads(40), 64);
        assert_eq!(kda_threads(128), 128);
        assert_eq!(kda_threads(300), 256);
    }
}
