//! `deltafin-kernels`: the compute kernels of deltafin.
//!
//! Matrix-vector and small-batch matrix products over bf16, MXFP4 and row-int8 weights with
//! f32 activations and f32 accumulation, plus the element-wise pieces the K3 blocks need
//! (RMS norms, SiTU, sigmoid, softmax). CPU kernels dispatch on the running CPU's features;
//! CUDA (cudarc) and Metal backends live behind features. Kernels know shapes, not models.
//!
//! Shapes are internal invariants of the callers (the model validates every weight shape when
//! it is built), so the kernels check them with assertions and document the panic.

pub mod matvec;
pub mod ops;

pub use matvec::{matmul_bf16, matmul_mxfp4, matvec_bf16, matvec_mxfp4};
pub use ops::{
    argmax, l2_normalize, rms_norm, rms_norm_inplace, sigmoid, silu, situ_glu, softmax_inplace,
};

/// Name of the kernel implementation in use, for logs and `--stats`.
pub fn kernel_backend() -> &'static str {
    "portable"
}
