//! `--device auto|cpu|mps|cuda|cuda:N` (`K3_DEV`) and `--expert-backend
//! auto|cpu|metal|cuda` (`K3_MOE`) → the engine's device requests (docs/CLI.md,
//! "Devices"). What each request does, and the errors for one that cannot run, are the
//! engine's (`deltafin_k3::engine::placement`).

use crate::env::env_var;
use anyhow::{Result, anyhow};
pub use deltafin_k3::engine::placement::{parse_device, parse_expert_backend};
use deltafin_k3::engine::{DeviceRequest, ExpertBackendRequest};

/// `--device`, else `K3_DEV`, else `auto`; a bad value (flag or variable) is an error.
pub fn resolve_device(flag: Option<&str>) -> Result<DeviceRequest> {
    match flag {
        Some(v) => parse_device(v).map_err(|e| anyhow!("--device {e}")),
        None => match env_var("K3_DEV")? {
            Some(v) => parse_device(&v).map_err(|e| anyhow!("environment variable K3_DEV: {e}")),
            None => Ok(DeviceRequest::Auto),
        },
    }
}

/// `--expert-backend`, else `K3_MOE`, else `auto`.
pub fn resolve_expert_backend(flag: Option<&str>) -> Result<ExpertBackendRequest> {
    match flag {
        Some(v) => parse_expert_backend(v).map_err(|e| anyhow!("--expert-backend {e}")),
        None => match env_var("K3_MOE")? {
            Some(v) => {
                parse_expert_backend(&v).map_err(|e| anyhow!("environment variable K3_MOE: {e}"))
            }
            None => Ok(ExpertBackendRequest::Auto),
        },
    }
}
