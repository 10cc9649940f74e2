//! What the GPU backends (CUDA, Metal) share and the CPU can check without a device: the
//! inputs of the KDA and MLA kernels and their checks, the resident weight matrix, the device
//! operations written once over each backend's primitives ([`GpuBackend`], [`GpuDevice`]),
//! and the doctor's canaries.
//!
//! - [`sources`]: the source registry (the kernel files, their entry points, the batch widths).
//! - [`shapes`]: the op shapes (the KDA step and the MLA decode), their checks and CPU
//!   references.
//! - [`device`]: the device types ([`GpuBackend`], [`DeviceMatrix`], [`GpuDevice`]) and the
//!   kernels' inputs uploaded to a device.
//! - [`canaries`]: the doctor's canaries over any [`GpuDevice`].

pub mod canaries;
pub mod device;
pub mod shapes;
pub mod sources;
#[cfg(test)]
mod tests;

pub use canaries::canaries;
pub use device::{DeviceMatrix, Element, GpuBackend, GpuDevice};
// Used by the CUDA and Metal devices only (features `cuda`, `metal`).
#[allow(unused_imports)]
pub(crate) use shapes::index;
pub use shapes::{KdaStep, MlaDecode, MlaShape, ShapeError};
pub(crate) use sources::kernel_sources;
pub use sources::{BATCH_WIDTHS, KernelSource, MATMUL_ENTRIES, batch_split};
