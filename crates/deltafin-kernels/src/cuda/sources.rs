//! The CUDA kernel sources of `kernels/cuda/`, embedded at build time.
//!
//! Every file is compiled as `PRELUDE + file` (the prelude holds the bf16 / E2M1 / E8M0
//! decoders and the fixed-order warp and block reductions), so NVRTC needs no headers.

/// The shared prelude (`kernels/cuda/prelude.cuh`).
pub const PRELUDE: &str = include_str!("../../../../kernels/cuda/prelude.cuh");

/// One kernel file and the `extern "C"` entry points it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// File name under `kernels/cuda/`.
    pub file: &'static str,
    /// The file's text (without the prelude).
    pub text: &'static str,
    /// Entry points the file must export.
    pub entries: &'static [&'static str],
}

impl KernelSource {
    /// The full translation unit handed to NVRTC.
    pub fn unit(&self) -> String {
        format!("{PRELUDE}\n// ---- {} ----\n{}", self.file, self.text)
    }
}

/// Activation-row widths with a compiled small-batch kernel; larger batches are split.
pub const BATCH_WIDTHS: [usize; 5] = [16, 8, 4, 2, 1];

/// Every kernel file.
pub const KERNELS: [KernelSource; 3] = [
    KernelSource {
        file: "matvec.cu",
        text: include_str!("../../../../kernels/cuda/matvec.cu"),
        entries: &[
            "matmul_mxfp4_nb1",
            "matmul_mxfp4_nb2",
            "matmul_mxfp4_nb4",
            "matmul_mxfp4_nb8",
            "matmul_mxfp4_nb16",
            "matmul_bf16_nb1",
            "matmul_bf16_nb2",
            "matmul_bf16_nb4",
            "matmul_bf16_nb8",
            "matmul_bf16_nb16",
            "matmul_rowint8_nb1",
            "matmul_rowint8_nb2",
            "matmul_rowint8_nb4",
            "matmul_rowint8_nb8",
            "matmul_rowint8_nb16",
        ],
    },
    KernelSource {
        file: "kda.cu",
        text: include_str!("../../../../kernels/cuda/kda.cu"),
        entries: &["kda_step"],
    },
    KernelSource {
        file: "mla.cu",
        text: include_str!("../../../../kernels/cuda/mla.cu"),
        entries: &["mla_decode"],
    },
];
