//! The kernel settings from the environment: `DELTAFIN_KERNEL`, `DELTAFIN_MXFP4_ACT`,
//! `DELTAFIN_POOL_SPIN` and `DELTAFIN_POOL_PREFETCH` (docs/CLI.md), parsed strictly once at
//! startup and installed in `deltafin-kernels`, which reads no environment itself.

use std::sync::OnceLock;

use deltafin_kernels::{KernelError, KernelSettings};

/// The kernel settings the environment names (each unset variable at its default).
pub fn kernel_settings_from_env() -> Result<KernelSettings, KernelError> {
    // A value that is not UTF-8 is passed on lossily, so it is refused showing what it holds.
    KernelSettings::from_lookup(|name| {
        std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
    })
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
