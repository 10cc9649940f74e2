//! `deltafin-kernels`: the compute kernels of deltafin.
//!
//! Matrix-vector and small-batch matrix products over f32, bf16, row-int8 and MXFP4 weights
//! with f32 activations and f32 accumulation, plus the element-wise pieces the K3 blocks need
//! (RMS norms, SiTU, sigmoid, softmax; [`vmath`]: vectorised exp/tanh/sigmoid/silu that
//! are bit-identical across backends). The products dispatch at run time on the CPU's
//! features ([`dispatch`]: AVX-512, AVX2+FMA, NEON, portable scalar) through a table with one
//! entry per weight format × activation format on each instruction set (`table.rs`), and are
//! bit-identical across thread counts and batch widths within a backend. Kernels know shapes,
//! not models.
//!
//! The library reads no environment: a binary parses its [`KernelSettings`] (backend, MXFP4
//! activation format, pool switches, the CUDA backend's search paths) once at startup and
//! installs them with [`configure`]; without that the defaults run ([`settings`]).
//!
//! Shapes are internal invariants of the callers (the model validates every weight shape when
//! it is built), so the kernels check them with assertions and document the panic.

pub mod attn;
pub mod cuda;
pub mod dispatch;
pub mod gpu;
pub mod kda_chunk;
mod layout;
pub mod lookahead;
pub mod matvec;
pub mod metal;
pub mod mxfp4_q8x3;
#[cfg(target_arch = "aarch64")]
mod neon;
pub mod offload;
pub mod ops;
pub mod peak;
pub mod pool;
mod prepared;
pub mod probe;
pub mod reference;
mod rows;
mod scalar;
pub mod settings;
mod simd;
mod table;
/// What the unit tests share with the integration tests: random inputs, pools, the SKIP rule.
#[cfg(test)]
#[path = "../tests/common/shared.rs"]
#[allow(dead_code)] // not every target uses every part
mod test_shared;
#[cfg(test)]
#[path = "../tests/common/skip.rs"]
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)] // the CPU-feature tests
mod test_skip;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod tile;
#[cfg(target_arch = "x86_64")]
mod tiled;
pub mod vmath;
mod weights;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use attn::{
    CacheValue, axpy_bf16_f32, axpy_i8_f32, causal_latent_attention, dot_bf16_f32, dot_i8_f32,
    latent_attention,
};
pub use dispatch::{Backend, BackendError};
pub use kda_chunk::{KdaRows, kda_chunked, reduce_lanes};
pub use matvec::{
    GroupProduct, Weights, matmul, matmul_axpy, matmul_axpy_with, matmul_bf16, matmul_f32,
    matmul_group, matmul_group_serial, matmul_group_with, matmul_mxfp4, matmul_rowint8,
    matmul_serial, matmul_with, matvec_bf16, matvec_f32, matvec_mxfp4, matvec_rowint8,
};
pub use offload::{
    DeviceError, DeviceResult, DeviceWeights, HostCounters, HostDevice, ProductDevice,
};
pub use ops::{
    argmax, kda_delta_step, l2_normalize, rms_norm, rms_norm_inplace, sigmoid, silu, situ_glu,
    softmax_inplace,
};
pub use settings::{
    CudaPaths, KernelError, KernelSettings, Mxfp4Act, backend, configure, kernel_backend,
    kernel_summary, pool_settings,
};
pub use vmath::{exp_inplace, sigmoid_inplace, silu_inplace, tanh_inplace};
