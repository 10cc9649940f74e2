//! The CUDA kernel sources of `kernels/cuda/`, embedded at build time.
//!
//! Every file is compiled as `PRELUDE + file` (the prelude holds the bf16 / E2M1 / E8M0
//! decoders and the fixed-order warp and block reductions), so NVRTC needs no headers.

/// The shared prelude (`kernels/cuda/prelude.cuh`).
pub const PRELUDE: &str = include_str!("../../../../kernels/cuda/prelude.cuh");

pub use crate::gpu::{BATCH_WIDTHS, KernelSource};

/// The full translation unit of `k` handed to NVRTC: the prelude, then the file.
pub fn translation_unit(k: &KernelSource) -> String {
    format!("{PRELUDE}{}", k.section())
}

/// Every kernel file.
pub const KERNELS: [KernelSource; 3] =
    crate::gpu::kernel_sources!("../../../../kernels/cuda/", "cu");
