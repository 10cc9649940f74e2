//! `--device auto|cpu|mps|cuda|cuda:N` (`K3_DEV`) and `--expert-backend
//! auto|cpu|metal|cuda` (`K3_MOE`) → the engine's device requests (docs/CLI.md,
//! "Devices"). What each request does, and the errors for one that cannot run, are the
//! engine's (`deltafin_k3::engine::placement`).

use crate::env::env_var;
use anyhow::{Result, anyhow};
pub use deltafin_k3::engine::placement::{parse_device, parse_expert_backend};
use deltafin_k3::engine::{DeviceRequest, ExpertBackendRequest};

/// `--device`, else `K3_DEV`, else `auto`; a bad value is an error, the variable's too when
/// the flag wins over it.
pub fn resolve_device(flag: Option<&str>) -> Result<DeviceRequest> {
    let env = env_var("K3_DEV")?
        .map(|v| parse_device(&v).map_err(|e| anyhow!("environment variable K3_DEV: {e}")))
        .transpose()?;
    match flag {
        Some(v) => parse_device(v).map_err(|e| anyhow!("--device {e}")),
        None => Ok(env.unwrap_or(DeviceRequest::Auto)),
    }
}

/// `--expert-backend`, else `K3_MOE`, else `auto`; as [`resolve_device`].
pub fn resolve_expert_backend(flag: Option<&str>) -> Result<ExpertBackendRequest> {
    let env = env_var("K3_MOE")?
        .map(|v| parse_expert_backend(&v).map_err(|e| anyhow!("environment variable K3_MOE: {e}")))
        .transpose()?;
    match flag {
        Some(v) => parse_expert_backend(v).map_err(|e| anyhow!("--expert-backend {e}")),
        None => Ok(env.unwrap_or(ExpertBackendRequest::Auto)),
    }
}
