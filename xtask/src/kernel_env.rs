//! The kernel settings from the environment (`DELTAFIN_KERNEL`, `DELTAFIN_MXFP4_ACT`,
//! `DELTAFIN_POOL_SPIN`, `DELTAFIN_POOL_PREFETCH` and the CUDA search paths, as `deltafin`
//! reads them), installed once before a bench runs a kernel.

use anyhow::{Result, anyhow};

/// Parse the environment's kernel settings strictly and install them.
pub fn install() -> Result<()> {
    let settings = deltafin_kernels::KernelSettings::from_lookup(|name| std::env::var_os(name))
        .map_err(|e| anyhow!("{e}"))?;
    deltafin_kernels::configure(settings).map_err(|e| anyhow!("{e}"))
}
