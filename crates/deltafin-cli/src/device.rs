//! Compute device selection: `--device auto|cpu|mps|cuda|cuda:N` (`K3_DEV`) and
//! `--expert-backend auto|cpu|metal|cuda` (`K3_MOE`), product-contract §1.3/§1.4.
//!
//! Selection is capability-gated: `auto` picks a GPU only for work that has a GPU path in this
//! build, and asking for a backend that cannot run is an error naming what is missing (the
//! feature, the driver library, the device, or the model path). The K3 forward pass has no
//! GPU path yet (the CUDA kernels exist in `deltafin_kernels::cuda` and are checked, but are
//! not wired into the model), so `auto` resolves to the CPU and an explicit GPU request is an
//! error that says what was found and what would not run there: deltafin never runs on the
//! CPU while claiming a GPU. The same holds for Metal (`deltafin_kernels::metal`, macOS with
//! feature `metal`): `--device mps` names the Mac's GPU when it finds one, then refuses.

use anyhow::{Result, anyhow, bail};

use crate::session::env_var;

/// What `--device` / `K3_DEV` asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceRequest {
    /// The best device with a model path: the CPU in this build.
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// Apple GPU through Metal (macOS only).
    Mps,
    /// An NVIDIA GPU; `None` = `cuda:0`.
    Cuda(Option<usize>),
}

/// What `--expert-backend` / `K3_MOE` asks for (where routed-expert products run).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertBackendRequest {
    /// Follow the device: the CPU in this build.
    #[default]
    Auto,
    /// The CPU kernels.
    Cpu,
    /// Metal (macOS only).
    Metal,
    /// CUDA on the selected CUDA device (`cuda:0` unless `--device cuda:N`).
    Cuda,
}

/// Parse a `--device` value.
pub fn parse_device(s: &str) -> std::result::Result<DeviceRequest, String> {
    Ok(match s {
        "auto" => DeviceRequest::Auto,
        "cpu" => DeviceRequest::Cpu,
        "mps" => DeviceRequest::Mps,
        "cuda" => DeviceRequest::Cuda(None),
        other => match other.strip_prefix("cuda:") {
            Some(n) => DeviceRequest::Cuda(Some(n.parse::<usize>().map_err(|_| {
                format!("`{other}`: the CUDA device index after `cuda:` must be a number")
            })?)),
            None => {
                return Err(format!(
                    "`{other}` is not a device (expected auto, cpu, mps, cuda or cuda:N)"
                ));
            }
        },
    })
}

/// Parse an `--expert-backend` value.
pub fn parse_expert_backend(s: &str) -> std::result::Result<ExpertBackendRequest, String> {
    Ok(match s {
        "auto" => ExpertBackendRequest::Auto,
        "cpu" => ExpertBackendRequest::Cpu,
        "metal" => ExpertBackendRequest::Metal,
        "cuda" => ExpertBackendRequest::Cuda,
        other => {
            return Err(format!(
                "`{other}` is not an expert backend (expected auto, cpu, metal or cuda)"
            ));
        }
    })
}

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

/// The CUDA devices this binary can use, one line each, or why there are none.
pub fn cuda_devices() -> std::result::Result<Vec<String>, String> {
    #[cfg(feature = "cuda")]
    {
        deltafin_kernels::cuda::list_devices()
            .map(|v| v.iter().map(|d| d.to_string()).collect())
            .map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("this deltafin was built without the `cuda` feature".into())
    }
}

/// Check that `cuda:ordinal` exists; returns its description.
fn find_cuda(flag: &str, ordinal: usize) -> Result<String> {
    let devices = cuda_devices().map_err(|e| anyhow!("{flag}: {e}"))?;
    match devices.get(ordinal) {
        Some(d) => Ok(d.clone()),
        None if devices.is_empty() => bail!("{flag}: the NVIDIA driver reports no CUDA device"),
        None => bail!(
            "{flag}: cuda:{ordinal} does not exist; this machine has {} CUDA device(s): {}",
            devices.len(),
            devices.join("; ")
        ),
    }
}

/// The Metal device this binary can use (its description), or why there is none: not macOS,
/// built without the `metal` feature, or no device.
pub fn metal_device() -> std::result::Result<String, String> {
    #[cfg(all(target_os = "macos", feature = "metal"))]
    {
        deltafin_kernels::metal::metal_available()
            .map(|d| d.to_string())
            .map_err(|e| e.to_string())
    }
    #[cfg(all(target_os = "macos", not(feature = "metal")))]
    {
        Err("this deltafin was built without the `metal` feature".into())
    }
    #[cfg(not(target_os = "macos"))]
    {
        Err(format!(
            "Metal is an Apple GPU API and exists only on macOS; this is {}",
            std::env::consts::OS
        ))
    }
}

/// The error for an explicit Metal request: what is missing, or — with a device — that the
/// model has no Metal path yet.
fn metal_request(flag: &str, what: &str) -> anyhow::Error {
    match metal_device() {
        Ok(found) => anyhow!(
            "{flag}: found {found}, but {what} has no Metal path in this build: the Metal kernels \
             (deltafin_kernels::metal — MXFP4/bf16/int8 products, KDA step, MLA decode) are \
             compiled but untested on Apple hardware and not yet wired into the K3 forward pass, \
             so nothing of the model would run on the GPU. Use --device cpu (or auto) and \
             --expert-backend cpu (or auto)"
        ),
        Err(why) => anyhow!(
            "{flag}: {why} — use cpu{}",
            if cfg!(feature = "cuda") && !cfg!(target_os = "macos") {
                " (or cuda on an NVIDIA machine)"
            } else {
                ""
            }
        ),
    }
}

/// Decide where the model runs. Returns the description for the startup line, or an error
/// naming what is missing for an explicit request that cannot be honoured.
pub fn select(device: DeviceRequest, experts: ExpertBackendRequest) -> Result<String> {
    let no_path = |flag: &str, found: &str, what: &str| {
        anyhow!(
            "{flag}: found {found}, but {what} has no CUDA path in this build: the CUDA kernels \
             (deltafin_kernels::cuda — MXFP4/bf16/int8 products, KDA step, MLA decode) are \
             compiled and tested but not yet wired into the K3 forward pass, so nothing of the \
             model would run on the GPU. Use --device cpu (or auto) and --expert-backend cpu (or auto)"
        )
    };
    let ordinal = match device {
        DeviceRequest::Cuda(n) => n.unwrap_or(0),
        _ => 0,
    };
    match device {
        DeviceRequest::Auto | DeviceRequest::Cpu => {}
        DeviceRequest::Mps => {
            return Err(metal_request(
                "--device mps",
                "the K3 forward pass (spine, attention, experts)",
            ));
        }
        DeviceRequest::Cuda(_) => {
            let flag = format!("--device cuda:{ordinal}");
            let found = find_cuda(&flag, ordinal)?;
            return Err(no_path(
                &flag,
                &found,
                "the K3 forward pass (spine, attention, experts)",
            ));
        }
    }
    match experts {
        ExpertBackendRequest::Auto | ExpertBackendRequest::Cpu => {}
        ExpertBackendRequest::Metal => {
            return Err(metal_request(
                "--expert-backend metal",
                "the routed-expert MoE path",
            ));
        }
        ExpertBackendRequest::Cuda => {
            let flag = "--expert-backend cuda";
            let found = find_cuda(flag, ordinal)?;
            return Err(no_path(flag, &found, "the routed-expert MoE path"));
        }
    }
    Ok(match device {
        DeviceRequest::Auto => {
            "device=cpu (auto: the K3 forward pass runs on the CPU in this build)"
        }
        _ => "device=cpu",
    }
    .to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_spelling_and_rejects_the_rest() {
        assert_eq!(parse_device("auto"), Ok(DeviceRequest::Auto));
        assert_eq!(parse_device("cpu"), Ok(DeviceRequest::Cpu));
        assert_eq!(parse_device("mps"), Ok(DeviceRequest::Mps));
        assert_eq!(parse_device("cuda"), Ok(DeviceRequest::Cuda(None)));
        assert_eq!(parse_device("cuda:3"), Ok(DeviceRequest::Cuda(Some(3))));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU", ""] {
            let e = parse_device(bad).unwrap_err();
            assert!(e.contains(&format!("`{bad}`")), "{e}");
        }
        assert_eq!(
            parse_expert_backend("metal"),
            Ok(ExpertBackendRequest::Metal)
        );
        assert_eq!(parse_expert_backend("cuda"), Ok(ExpertBackendRequest::Cuda));
        assert!(parse_expert_backend("mps").unwrap_err().contains("`mps`"));
    }

    #[test]
    fn cpu_and_auto_select_the_cpu() {
        assert_eq!(
            select(DeviceRequest::Cpu, ExpertBackendRequest::Cpu).unwrap(),
            "device=cpu"
        );
        assert!(
            select(DeviceRequest::Auto, ExpertBackendRequest::Auto)
                .unwrap()
                .starts_with("device=cpu (auto")
        );
    }

    #[test]
    fn gpu_requests_fail_with_what_is_missing() {
        let e = select(DeviceRequest::Cuda(Some(7)), ExpertBackendRequest::Auto)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("--device cuda:7: "), "{e}");
        // Whatever this machine has, the message names the missing piece.
        assert!(
            e.contains("built without the `cuda` feature")
                || e.contains("libcuda")
                || e.contains("no CUDA device")
                || e.contains("does not exist")
                || e.contains("no CUDA path"),
            "{e}"
        );
        let e = select(DeviceRequest::Cpu, ExpertBackendRequest::Cuda)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("--expert-backend cuda: "), "{e}");
        let e = select(DeviceRequest::Mps, ExpertBackendRequest::Auto)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--device mps"), "{e}");
        let e = select(DeviceRequest::Cpu, ExpertBackendRequest::Metal)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--expert-backend metal"), "{e}");
        if !cfg!(target_os = "macos") {
            assert!(e.contains("only on macOS"), "{e}");
        } else {
            assert!(
                e.contains("without the `metal` feature")
                    || e.contains("no Metal device")
                    || e.contains("no Metal path"),
                "{e}"
            );
        }
    }
}
