//! Where the model's products run: the device and expert-backend requests, the CUDA and
//! Metal devices this build can use, and placing a loaded model on the chosen device.
//!
//! Selection is capability-gated: asking for a backend that cannot run is an error naming
//! what is missing (the feature, the driver library, the device, the kernels, or the model
//! path); the engine never runs on the CPU while claiming a GPU.
//!
//! CUDA (`deltafin_kernels::cuda::CudaProducts`, feature `cuda`): a CUDA device request
//! opens the device (NVRTC compiles the kernels) and the spine is offloaded to it while it
//! fits ([`crate::model::offload`]); a CUDA expert backend runs the routed experts' products there
//! through a device expert cache; with a CUDA device, the `auto` expert backend follows the
//! device. `auto` stays on the CPU: a GPU is used only when asked for.
//!
//! Metal (`deltafin_kernels::metal`, macOS with feature `metal`): a Metal request names the
//! Mac's GPU when it finds one, then refuses: the forward pass has no Metal path.
//!
//! The error messages name the CLI's spellings (`--device cuda:N`, `--expert-backend`).

use std::sync::Arc;

use crate::engine::error::EngineError;
use crate::engine::progress::LoadProgress;
use crate::model::K3Model;
use deltafin_kernels::ProductDevice;

/// What `--device` / `K3_DEV` asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceRequest {
    /// The CPU (a GPU only when asked for: the CUDA path is untested on hardware).
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
    /// Follow the device: CUDA with `--device cuda[:N]`, else the CPU.
    #[default]
    Auto,
    /// The CPU kernels.
    Cpu,
    /// Metal (macOS only).
    Metal,
    /// CUDA on the selected CUDA device (`cuda:0` unless `--device cuda:N`).
    Cuda,
}

/// Parse a device request: `auto`, `cpu`, `mps`, `cuda` or `cuda:N`.
pub fn parse_device(s: &str) -> Result<DeviceRequest, String> {
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

/// Parse an expert-backend request: `auto`, `cpu`, `metal` or `cuda`.
pub fn parse_expert_backend(s: &str) -> Result<ExpertBackendRequest, String> {
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

/// The CUDA devices this binary can use, one line each, or why there are none.
pub fn cuda_devices() -> Result<Vec<String>, String> {
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
fn find_cuda(flag: &str, ordinal: usize) -> Result<String, EngineError> {
    let devices = cuda_devices().map_err(|e| device_error(format!("{flag}: {e}")))?;
    match devices.get(ordinal) {
        Some(d) => Ok(d.clone()),
        None if devices.is_empty() => Err(device_error(format!(
            "{flag}: the NVIDIA driver reports no CUDA device"
        ))),
        None => Err(device_error(format!(
            "{flag}: cuda:{ordinal} does not exist; this machine has {} CUDA device(s): {}",
            devices.len(),
            devices.join("; ")
        ))),
    }
}

/// The Metal device this binary can use (its description), or why there is none: not macOS,
/// built without the `metal` feature, or no device.
pub fn metal_device() -> Result<String, String> {
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
fn metal_request(flag: &str, what: &str) -> EngineError {
    match metal_device() {
        Ok(found) => device_error(format!(
            "{flag}: found {found}, but {what} has no Metal path in this build: the Metal kernels \
             (deltafin_kernels::metal — MXFP4/bf16/int8 products, KDA step, MLA decode) are \
             compiled but untested on Apple hardware and not yet wired into the K3 forward pass, \
             so nothing of the model would run on the GPU. Use --device cpu (or auto) and \
             --expert-backend cpu (or auto)"
        )),
        Err(why) => device_error(format!(
            "{flag}: {why} — use cpu{}",
            if cfg!(feature = "cuda") && !cfg!(target_os = "macos") {
                " (or cuda on an NVIDIA machine)"
            } else {
                ""
            }
        )),
    }
}

/// Where the model's products run, decided before loading ([`select`]).
#[derive(Clone, Default)]
pub struct Placement {
    /// The startup line (`device=cpu`, `device=cuda:0 NVIDIA … (spine, experts)`).
    pub line: String,
    /// The device products are offloaded to; `None`: everything runs on the CPU.
    pub device: Option<Arc<dyn ProductDevice>>,
    /// Offload the spine to `device` (`--device cuda[:N]`).
    pub spine: bool,
    /// Run the routed experts' products on `device` (`--expert-backend cuda`, or `auto`
    /// with `--device cuda[:N]`).
    pub experts: bool,
}

impl std::fmt::Debug for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Placement")
            .field("line", &self.line)
            .field("spine", &self.spine)
            .field("experts", &self.experts)
            .finish()
    }
}

/// Open `cuda:ordinal` for products (kernels compiled by NVRTC, or `DELTAFIN_CUDA_PTX_DIR`).
#[cfg(feature = "cuda")]
fn open_cuda(
    flag: &str,
    found: &str,
    ordinal: usize,
) -> Result<Arc<dyn ProductDevice>, EngineError> {
    let dev = deltafin_kernels::cuda::CudaProducts::open(ordinal).map_err(|e| {
        device_error(format!(
            "{flag}: found {found}, but could not open it for the K3 forward pass: {e}"
        ))
    })?;
    Ok(Arc::new(dev))
}

/// Without the `cuda` feature [`find_cuda`] has already refused.
#[cfg(not(feature = "cuda"))]
fn open_cuda(
    flag: &str,
    _found: &str,
    _ordinal: usize,
) -> Result<Arc<dyn ProductDevice>, EngineError> {
    Err(device_error(format!(
        "{flag}: this deltafin was built without the `cuda` feature"
    )))
}

/// Decide where the model runs: open the CUDA device when one is asked for (an error names
/// what is missing: the feature, libcuda, the device, the kernels), refuse Metal with its
/// reason, or the CPU.
pub fn select(
    device: DeviceRequest,
    experts: ExpertBackendRequest,
) -> Result<Placement, EngineError> {
    let ordinal = match device {
        DeviceRequest::Cuda(n) => n.unwrap_or(0),
        _ => 0,
    };
    if device == DeviceRequest::Mps {
        return Err(metal_request(
            "--device mps",
            "the K3 forward pass (spine, attention, experts)",
        ));
    }
    if experts == ExpertBackendRequest::Metal {
        return Err(metal_request(
            "--expert-backend metal",
            "the routed-expert MoE path",
        ));
    }
    let spine = matches!(device, DeviceRequest::Cuda(_));
    let on_cuda = match experts {
        ExpertBackendRequest::Cuda => true,
        ExpertBackendRequest::Auto => spine,
        ExpertBackendRequest::Cpu | ExpertBackendRequest::Metal => false,
    };
    if !spine && !on_cuda {
        return Ok(Placement {
            line: match device {
                DeviceRequest::Auto => {
                    "device=cpu (auto: a GPU is used only when asked for, --device cuda)"
                }
                _ => "device=cpu",
            }
            .to_string(),
            ..Placement::default()
        });
    }
    let flag = if spine {
        format!("--device cuda:{ordinal}")
    } else {
        "--expert-backend cuda".to_string()
    };
    let found = find_cuda(&flag, ordinal)?;
    let dev = open_cuda(&flag, &found, ordinal)?;
    let what = match (spine, on_cuda) {
        (true, true) => "spine and routed experts",
        (true, false) => "spine; routed experts on the CPU",
        _ => "routed experts; spine on the CPU",
    };
    Ok(Placement {
        line: format!("device={} ({what})", dev.describe()),
        device: Some(dev),
        spine,
        experts: on_cuda,
    })
}

fn device_error(message: String) -> EngineError {
    EngineError::Device(message)
}

/// Put `model` on the device `placement` names (nothing for the CPU): the spine while it
/// fits the free device memory minus `reserve`, then a device expert cache in what is left
/// minus `reserve`. Says through `progress` what went where; returns the device part of the
/// backend line (`device=cpu`, `device=cuda:0 … spine=N/M matrices expert_cache=…GB`).
pub fn place_on_device(
    model: &mut K3Model,
    placement: &Placement,
    reserve: u64,
    progress: &dyn LoadProgress,
) -> Result<String, EngineError> {
    let gb = |b: u64| b as f64 / 1e9;
    let mut line = "device=cpu".to_string();
    if let Some(dev) = &placement.device {
        line = format!("device={}", dev.describe());
        if placement.spine {
            let free = dev.free_bytes()?;
            let budget = free.saturating_sub(reserve);
            let report = model
                .offload_spine(dev.clone(), budget)
                .map_err(EngineError::context("offloading the spine to the device"))?;
            progress.info(&format!(
                "{} (device had {:.3} GB free, {:.3} GB reserved: K3_DEV_RESERVE_GB)",
                report.describe(),
                gb(free),
                gb(reserve)
            ));
            line += &format!(
                " spine={}/{} matrices",
                report.on_device.len(),
                report.on_device.len() + report.on_cpu.len()
            );
        }
        if placement.experts {
            let free = dev.free_bytes()?;
            let budget = free.saturating_sub(reserve);
            let cache = Arc::new(crate::model::offload::DeviceExpertCache::new(
                dev.clone(),
                budget,
            ));
            progress.info(&format!(
                "routed experts on {}: device expert cache {:.3} GB (LRU; experts are read on the host as before and uploaded on a miss)",
                dev.describe(),
                gb(budget)
            ));
            line += &format!(" expert_cache={:.3}GB", gb(budget));
            model.set_device_experts(cache);
        }
    }
    Ok(line)
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
        let p = select(DeviceRequest::Cpu, ExpertBackendRequest::Cpu).unwrap();
        assert_eq!(p.line, "device=cpu");
        assert!(p.device.is_none() && !p.spine && !p.experts);
        let p = select(DeviceRequest::Auto, ExpertBackendRequest::Auto).unwrap();
        assert!(p.line.starts_with("device=cpu (auto"), "{}", p.line);
        assert!(p.device.is_none());
    }

    #[test]
    fn gpu_requests_fail_with_what_is_missing() {
        let e = select(DeviceRequest::Cuda(Some(7)), ExpertBackendRequest::Auto)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("--device cuda:7: "), "{e}");
        // Whatever this machine has, the message names the missing piece (no machine in CI
        // has eight GPUs).
        assert!(
            e.contains("built without the `cuda` feature")
                || e.contains("libcuda")
                || e.contains("no CUDA device")
                || e.contains("does not exist"),
            "{e}"
        );
        // Without a device (CI), asking for CUDA experts names what is missing; on a GPU
        // machine it opens cuda:0.
        match select(DeviceRequest::Cpu, ExpertBackendRequest::Cuda) {
            Err(e) => {
                let e = e.to_string();
                assert!(e.starts_with("--expert-backend cuda: "), "{e}");
            }
            Ok(p) => assert!(p.experts && !p.spine && p.device.is_some()),
        }
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
