//! The runtime checks: build, CPU features, kernels, GPU backends and their canaries.

use super::canaries::canaries;
use super::report::{Report, Status};
use crate::buildinfo;
use crate::elfdeps;
use serde_json::json;
pub(super) fn runtime_checks(r: &mut Report) {
    let os = std::env::consts::OS;
    let arch = std::env::consts::ARCH;
    let supported = matches!(
        (os, arch),
        ("linux", "x86_64") | ("linux", "aarch64") | ("macos", "aarch64")
    );
    let host = format!(
        "{os}/{arch}; built for {} (profile {}, features {})",
        buildinfo::TARGET,
        buildinfo::PROFILE,
        buildinfo::features_text()
    );
    r.facts.insert("os".into(), json!(os));
    r.facts.insert("arch".into(), json!(arch));
    r.facts
        .insert("build_target".into(), json!(buildinfo::TARGET));
    r.facts
        .insert("build_profile".into(), json!(buildinfo::PROFILE));
    r.facts
        .insert("build_features".into(), json!(buildinfo::features()));
    if supported {
        r.add("host", Status::Ok, host);
    } else {
        r.add(
            "host",
            Status::Warn,
            format!("{host}; not a qualified platform (Linux x86-64/aarch64, macOS arm64)"),
        );
    }
    // Variables of the original that every other command refuses.
    let refused: Vec<String> = crate::environment::REFUSED
        .iter()
        .filter(|v| std::env::var_os(v.name).is_some())
        .filter_map(|v| crate::environment::refusal(v.name))
        .collect();
    if refused.is_empty() {
        r.add(
            "environment",
            Status::Ok,
            "no variable of the original that deltafin refuses is set",
        );
    } else {
        r.fail(
            "environment",
            refused.join("; "),
            "unset the variables named: run, serve and the other commands refuse to start with them",
        );
    }
    if buildinfo::PROFILE != "release" {
        r.add(
            "build",
            Status::Warn,
            "this binary is not an optimized release build; expect much lower speed (build with `cargo build --release -p deltafin-cli`)",
        );
    }

    match std::env::current_exe()
        .map_err(|e| format!("cannot locate the running binary: {e}"))
        .and_then(|exe| elfdeps::audit(&exe))
    {
        Ok(elfdeps::LoaderDeps::Needed(names)) => {
            r.facts.insert("loader_needed".into(), json!(names));
            r.add(
                "loader",
                Status::Ok,
                format!(
                    "direct dynamic dependencies: {} (no Python runtime)",
                    if names.is_empty() {
                        "none (static)".to_string()
                    } else {
                        names.join(" ")
                    }
                ),
            );
        }
        Ok(elfdeps::LoaderDeps::NotElf) => r.add(
            "loader",
            Status::Info,
            "not an ELF binary: the dynamic-library audit covers ELF only",
        ),
        Err(e) => r.fail(
            "loader",
            e,
            "rebuild deltafin from a clean checkout with `cargo build --release -p deltafin-cli`",
        ),
    }

    let (present, absent) = cpu_features();
    r.facts.insert("cpu_features".into(), json!(present));
    r.add(
        "cpu features",
        Status::Info,
        format!(
            "{} logical CPUs; present: {}; absent: {}",
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            if present.is_empty() {
                "none".to_string()
            } else {
                present.join(" ")
            },
            if absent.is_empty() {
                "none".to_string()
            } else {
                absent.join(" ")
            }
        ),
    );
    let backend = deltafin_kernels::kernel_backend();
    r.facts.insert("kernel_backend".into(), json!(backend));
    r.add(
        "kernels",
        Status::Info,
        format!(
            "CPU kernel path `{backend}` with {} compute threads",
            rayon::current_num_threads()
        ),
    );
    gpu_checks(r);
    for c in canaries() {
        r.checks.push(c);
    }
}

/// GPU backends compiled in, the devices they find and the device path of the model
/// (information only: the model runs on a GPU only when `--device cuda` / `--expert-backend
/// cuda` asks for it).
pub(super) fn gpu_checks(r: &mut Report) {
    let mut compiled: Vec<&str> = Vec::new();
    if cfg!(feature = "cuda") {
        compiled.push("cuda");
    }
    if deltafin_kernels::metal::COMPILED {
        compiled.push("metal");
    }
    r.facts.insert("gpu_backends".into(), json!(compiled));
    let devices = deltafin_k3::engine::placement::cuda_devices();
    r.facts.insert(
        "cuda_devices".into(),
        json!(devices.clone().unwrap_or_default()),
    );
    let metal = deltafin_k3::engine::placement::metal_device();
    r.facts
        .insert("metal_device".into(), json!(metal.clone().ok()));
    let cuda = match (&devices, cfg!(feature = "cuda")) {
        (_, false) => "cuda not compiled in (built without the `cuda` feature)".to_string(),
        (Ok(v), true) if v.is_empty() => {
            "cuda compiled in; the NVIDIA driver reports no device".to_string()
        }
        (Ok(v), true) => format!("cuda compiled in; devices: {}", v.join("; ")),
        (Err(e), true) => format!("cuda compiled in; no usable device: {e}"),
    };
    let metal_detail = match (&metal, deltafin_kernels::metal::COMPILED) {
        (Ok(d), _) => format!("Metal compiled in (untested on Apple hardware); device: {d}"),
        (Err(e), true) => format!("Metal compiled in (untested on Apple hardware); no device: {e}"),
        (Err(e), false) => format!("Metal not built: {e}"),
    };
    let path = if cfg!(feature = "cuda") {
        "device path: --device cuda[:N] offloads the spine (and, with --expert-backend \
         auto|cuda, the routed experts) to a CUDA device, tested through a CPU stand-in but not \
         yet on a GPU; --device auto stays on the CPU; no Metal path"
    } else {
        "device path: the CPU only (no `cuda` feature); no Metal path"
    };
    r.facts.insert(
        "device_path".into(),
        json!(if cfg!(feature = "cuda") {
            "cpu (auto), cuda on request"
        } else {
            "cpu"
        }),
    );
    r.add(
        "gpu backends",
        Status::Info,
        format!("{cuda}; {metal_detail}; {path}"),
    );
    #[cfg(feature = "cuda")]
    if let Ok(v) = &devices {
        for ordinal in 0..v.len() {
            cuda_canaries(r, ordinal);
        }
    }
    #[cfg(all(target_os = "macos", feature = "metal"))]
    if metal.is_ok() {
        metal_canaries(r);
    }
}

/// Compile the Metal kernels and run the canaries against the CPU references. Problems are
/// warnings: the model does not run on the GPU in this build.
#[cfg(all(target_os = "macos", feature = "metal"))]
pub(super) fn metal_canaries(r: &mut Report) {
    use deltafin_kernels::metal::{MetalDevice, canaries};
    let opened = MetalDevice::open()
        .map(|dev| (dev.kernel_origin().to_string(), canaries(&dev)))
        .map_err(|e| e.to_string());
    gpu_lines(
        r,
        "mps",
        opened,
        "the Metal kernels are untested on Apple hardware: please report this message; keep \
         --device cpu",
        "the Metal kernels disagree with the CPU on this Mac; keep --device cpu",
    );
}

/// Open `cuda:ordinal` (NVRTC compiles the kernels) and run the kernel canaries against the
/// CPU references. Problems are warnings: the model runs on the GPU only when asked for
/// (`--device cuda`), and a run that asks fails with the same error.
#[cfg(feature = "cuda")]
pub(super) fn cuda_canaries(r: &mut Report, ordinal: usize) {
    use deltafin_kernels::cuda::{CudaDevice, canaries};
    let opened = CudaDevice::open_with(ordinal, &crate::kernel_env::cuda_paths_from_env())
        .map(|dev| (dev.kernel_origin().to_string(), canaries(&dev)))
        .map_err(|e| e.to_string());
    gpu_lines(
        r,
        &format!("cuda:{ordinal}"),
        opened,
        "install the CUDA toolkit's NVRTC or `pip install nvidia-cuda-nvrtc-cu12` and set \
         DELTAFIN_NVRTC to its libnvrtc.so.12",
        "the CUDA kernels disagree with the CPU on this device; keep --device cpu",
    );
}

/// One GPU's canary results by name (the worst relative error, or why it failed).
#[cfg(any(feature = "cuda", all(target_os = "macos", feature = "metal")))]
type CanaryResults = Vec<(String, Result<f64, String>)>;

/// The lines of one opened GPU (`device`: `mps`, `cuda:N`): `DEVICE kernels` (compiled, and
/// from where; or the reason it could not be opened, a warning with `open_fix`), then a line
/// `DEVICE canary NAME` per canary (a disagreement is a warning with `canary_fix`).
#[cfg(any(feature = "cuda", all(target_os = "macos", feature = "metal")))]
fn gpu_lines(
    r: &mut Report,
    device: &str,
    opened: Result<(String, CanaryResults), String>,
    open_fix: &str,
    canary_fix: &str,
) {
    let (origin, results) = match opened {
        Ok(v) => v,
        Err(e) => {
            r.warn(format!("{device} kernels"), e, open_fix);
            return;
        }
    };
    r.add(
        format!("{device} kernels"),
        Status::Ok,
        format!("MXFP4, bf16, row-int8 products, KDA and MLA decode compiled ({origin})"),
    );
    for (name, res) in results {
        let name = format!("{device} canary {name}");
        match res {
            Ok(err) => r.add(
                name,
                Status::Ok,
                format!("worst relative error {err:.1e} vs the CPU"),
            ),
            Err(e) => r.warn(name, e, canary_fix),
        }
    }
}

/// The CPU features the kernels can use, split into (present, absent).
pub(super) fn cpu_features() -> (Vec<&'static str>, Vec<&'static str>) {
    let mut present = Vec::new();
    let mut absent = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        let list: [(&str, bool); 6] = [
            ("avx2", std::arch::is_x86_feature_detected!("avx2")),
            ("fma", std::arch::is_x86_feature_detected!("fma")),
            ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
            ("avx512bw", std::arch::is_x86_feature_detected!("avx512bw")),
            (
                "avx512_bf16",
                std::arch::is_x86_feature_detected!("avx512bf16"),
            ),
            (
                "avx512vnni",
                std::arch::is_x86_feature_detected!("avx512vnni"),
            ),
        ];
        for (name, on) in list {
            if on {
                present.push(name);
            } else {
                absent.push(name);
            }
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            present.push("neon");
        } else {
            absent.push("neon");
        }
    }
    (present, absent)
}
