//! The kernel settings from the environment: `DELTAFIN_KERNEL`, `DELTAFIN_MXFP4_ACT`,
//! `DELTAFIN_POOL_SPIN`, `DELTAFIN_POOL_PREFETCH` and the CUDA search paths `DELTAFIN_NVRTC`,
//! `CUDA_HOME`, `CUDA_PATH`, `DELTAFIN_CUDA_PTX_DIR` (docs/CLI.md), parsed strictly once at
//! startup and installed in `deltafin-kernels`, which reads no environment itself.

use std::sync::OnceLock;

use deltafin_kernels::{CudaPaths, KernelError, KernelSettings};

/// The kernel settings the environment names (each unset variable at its default). A choice
/// that is not UTF-8 is refused showing what it holds; a path is taken as it is.
pub fn kernel_settings_from_env() -> Result<KernelSettings, KernelError> {
    KernelSettings::from_lookup(|name| std::env::var_os(name))
}

/// The CUDA search paths the environment names (never an error): for `doctor`, which checks
/// the device whether or not the other kernel settings parse.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn cuda_paths_from_env() -> CudaPaths {
    CudaPaths::from_lookup(|name| std::env::var_os(name))
}

/// Parse the environment's kernel settings and install them, once per process; later calls
/// return the first call's outcome. The error names the variable and the value.
pub fn install() -> Result<(), String> {
    static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            let settings = kernel_settings_from_env().map_err(|e| e.to_string())?;
            deltafin_kernels::configure(settings).map_err(|e| e.to_string())
        })
        .clone()
}
