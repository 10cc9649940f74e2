//! Metal backend (issue 11, macOS only): kernel sources and — on macOS with feature `metal` —
//! the device wrapper.
//!
//! - [`sources`] embeds `kernels/metal/*.metal` and the launch geometry (always compiled: the
//!   host-compiler logic test `tests/metal_logic.rs` runs the kernels' logic as C++ on Linux).
//! - `device` (`cfg(all(target_os = "macos", feature = "metal"))`, objc2-metal) finds the
//!   system Metal device, compiles the library from source at run time, uploads weights into
//!   shared-storage buffers, dispatches and reads back. On every other platform nothing of it
//!   is compiled.
//!
//! **Untested on Apple hardware** until someone runs `cargo test -p deltafin-kernels
//! --features metal` on a Mac (docs/PERFORMANCE.md, "Metal kernels"). What is checked
//! elsewhere: the device code type-checks for `aarch64-apple-darwin` (`.ci/run`), and the
//! kernel logic (indexing, reduction order, barriers, SIMD shuffles) matches the CPU reference
//! when the `.metal` sources run as C++ through a host shim.
//!
//! Kernel numerics mirror the CUDA kernels (`crate::cuda`): f32 accumulation, each output's
//! reduction order fixed by the shape alone (documented per `.metal` file), so results are
//! independent of the batch width; they differ from the CPU backends in the last bits.
//! [`crate::reference`] is the CPU reference for KDA and MLA, [`crate::matmul`] for the
//! products.

pub mod sources;

#[cfg(all(target_os = "macos", feature = "metal"))]
mod device;
#[cfg(all(target_os = "macos", feature = "metal"))]
pub use device::{DeviceInfo, DeviceMatrix, MetalDevice, MetalError, canaries, metal_available};

pub use sources::{
    BATCH_WIDTHS, KERNELS, KdaParams, KernelSource, MatvecParams, MlaParams, MlaShape, PRELUDE,
    batch_split, library_source,
};

/// Whether this build contains the Metal device backend (macOS with feature `metal`).
pub const COMPILED: bool = cfg!(all(target_os = "macos", feature = "metal"));
