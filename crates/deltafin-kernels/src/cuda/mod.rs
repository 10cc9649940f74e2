//! CUDA backend (issue 11): kernel sources, runtime NVRTC, and — with feature `cuda` — the
//! device wrapper.
//!
//! - [`sources`] embeds `kernels/cuda/*.cu` (always compiled, so the compile check runs in
//!   every `cargo test`).
//! - [`nvrtc`] loads `libnvrtc` at run time and compiles the sources to PTX.
//! - `device` (feature `cuda`, cudarc with dynamic loading: no toolkit at build time) checks
//!   for `libcuda` before touching cudarc, opens a device, uploads weights, launches the
//!   kernels and downloads results.
//! - `products` (feature `cuda`): `CudaProducts`, the device as a
//!   [`crate::offload::ProductDevice`] (what `deltafin --device cuda` offloads the spine and
//!   the routed experts to).
//!
//! Kernel numerics: f32 accumulation; each output value's reduction order is fixed by the
//! shape alone (documented in each `.cu` file), so results are bit-identical run to run on one
//! GPU and independent of the batch width. They differ from the CPU backends in the last bits
//! (different lane layouts, fused multiply-add, `expf`): the tests bound the difference.

pub mod nvrtc;
pub mod sources;

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod products;
#[cfg(feature = "cuda")]
pub use device::{
    CudaDevice, CudaError, DeviceInfo, DeviceMatrix, MlaShape, canaries, cuda_available,
    device_count, list_devices,
};
#[cfg(feature = "cuda")]
pub use products::CudaProducts;

pub use nvrtc::{Nvrtc, NvrtcError, Ptx};
pub use sources::{BATCH_WIDTHS, KERNELS, KernelSource, PRELUDE, translation_unit};

/// Virtual architectures the CI compile check targets (A100-class and H100/H200-class).
pub const CHECK_ARCHS: [&str; 2] = ["compute_80", "compute_90"];
