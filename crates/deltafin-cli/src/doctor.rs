//! `deltafin doctor`: a read-only, network-free health audit of the host and, unless
//! `--runtime-only`, of the model installation (product contract §6).
//!
//! Every check ends as `ok`, `info`, `warn` or `fail`; a `fail` carries a fix suggestion and
//! makes the exit status 1. `--json` prints one object (schema `deltafin.doctor.v1`).

use crate::buildinfo;
use crate::elfdeps;
use crate::session;
use anyhow::Result;
use deltafin_k3::checkpoint::{CONFIG_FILE, Checkpoint, CheckpointError, INDEX_FILE};
use deltafin_k3::config::{K3Config, REAL_CONFIG_JSON};
use deltafin_k3::inventory::{self, TensorKind};
use deltafin_k3::loader::{EngineOptions, dims_from_config};
use deltafin_k3::tokenizer::Tokenizer;
use deltafin_tensor::{Bf16Matrix, Bytes, Mxfp4Matrix, SafetensorsFile, bf16, mxfp4};
use serde_json::{Value, json};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

/// `doctor` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct DoctorArgs {
    /// Check only the host (CPU, kernels, canaries, disk, memory); skip all model data.
    #[arg(long, conflicts_with = "model_root")]
    pub runtime_only: bool,
    /// Install root to audit [default: DELTAFIN_ROOT, else the current directory].
    #[arg(long, value_name = "PATH")]
    pub model_root: Option<PathBuf>,
    /// Print one JSON object (schema deltafin.doctor.v1) instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Bytes read (and, without a model root, written first) by the disk probe.
pub const DISK_PROBE_BYTES: u64 = 256 << 20;

/// Outcome of one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok,
    Info,
    Warn,
    Fail,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Info => "info",
            Status::Warn => "warn",
            Status::Fail => "fail",
        }
    }
}

/// One line of the report.
#[derive(Clone, Debug)]
pub struct Check {
    pub name: String,
    pub status: Status,
    pub detail: String,
    pub fix: Option<String>,
}

#[derive(Default)]
struct Report {
    checks: Vec<Check>,
    model_contract: Option<String>,
    /// Number of checks printed before the model contract line.
    contract_after: usize,
    admitted_context: Option<u64>,
    facts: serde_json::Map<String, Value>,
}

impl Report {
    fn add(&mut self, name: impl Into<String>, status: Status, detail: impl Into<String>) {
        self.checks.push(Check {
            name: name.into(),
            status,
            detail: detail.into(),
            fix: None,
        });
    }

    fn fail(&mut self, name: impl Into<String>, detail: impl Into<String>, fix: impl Into<String>) {
        self.checks.push(Check {
            name: name.into(),
            status: Status::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        });
    }

    fn problems(&self) -> usize {
        self.checks
            .iter()
            .filter(|c| c.status == Status::Fail)
            .count()
    }
}

/// Run the audit and print it; exit status 0 when healthy, 1 when a problem was found.
pub fn doctor(args: &DoctorArgs) -> Result<ExitCode> {
    let root = if args.runtime_only {
        None
    } else if let Some(r) = &args.model_root {
        Some(r.clone())
    } else {
        Some(PathBuf::from(
            session::env_var("DELTAFIN_ROOT")?.unwrap_or_else(|| ".".to_string()),
        ))
    };
    let mut report = Report::default();
    runtime_checks(&mut report);
    let mem = meminfo();
    memory_check(&mut report, mem);
    huge_pages_check(&mut report, deltafin_k3::resident::transparent_huge_pages());
    let mut probe_file: Option<PathBuf> = None;
    if let Some(root) = &root {
        probe_file = model_checks(&mut report, root, mem.map(|m| m.available));
    }
    disk_probe(&mut report, probe_file.as_deref());

    let problems = report.problems();
    if args.json {
        let checks: Vec<Value> = report
            .checks
            .iter()
            .map(|c| {
                json!({
                    "name": c.name,
                    "status": c.status.as_str(),
                    "detail": c.detail,
                    "fix": c.fix,
                })
            })
            .collect();
        let out = json!({
            "schema": "deltafin.doctor.v1",
            "healthy": problems == 0,
            "problems": problems,
            "runtime_only": args.runtime_only,
            "model_root": root.as_ref().map(|r| r.display().to_string()),
            "model_contract": report.model_contract,
            "admitted_context": report.admitted_context,
            "facts": Value::Object(report.facts.clone()),
            "checks": checks,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("deltafin doctor (read-only, network-free)");
        for (i, c) in report.checks.iter().enumerate() {
            if i == report.contract_after
                && let Some(line) = &report.model_contract
            {
                println!("{line}");
            }
            let tag = match c.status {
                Status::Ok => "[ ok ]",
                Status::Info => "[info]",
                Status::Warn => "[warn]",
                Status::Fail => "[FAIL]",
            };
            println!("{tag} {}: {}", c.name, c.detail);
            if let Some(fix) = &c.fix {
                println!("       fix: {fix}");
            }
        }
        if report.contract_after >= report.checks.len()
            && let Some(line) = &report.model_contract
        {
            println!("{line}");
        }
        if problems == 0 {
            println!("doctor: healthy");
        } else {
            println!(
                "doctor: {problems} problem{} found",
                if problems == 1 { "" } else { "s" }
            );
        }
    }
    Ok(if problems == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

// ---------------------------------------------------------------------------------------------
// Runtime

fn runtime_checks(r: &mut Report) {
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
        r.checks.push(Check {
            name: "host".into(),
            status: Status::Warn,
            detail: format!("{host}; not a qualified platform (Linux x86-64/aarch64, macOS arm64)"),
            fix: None,
        });
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
fn gpu_checks(r: &mut Report) {
    let mut compiled: Vec<&str> = Vec::new();
    if cfg!(feature = "cuda") {
        compiled.push("cuda");
    }
    if deltafin_kernels::metal::COMPILED {
        compiled.push("metal");
    }
    r.facts.insert("gpu_backends".into(), json!(compiled));
    let devices = crate::device::cuda_devices();
    r.facts.insert(
        "cuda_devices".into(),
        json!(devices.clone().unwrap_or_default()),
    );
    let metal = crate::device::metal_device();
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
fn metal_canaries(r: &mut Report) {
    use deltafin_kernels::metal::{MetalDevice, canaries};
    let dev = match MetalDevice::open() {
        Ok(d) => d,
        Err(e) => {
            r.checks.push(Check {
                name: "mps kernels".into(),
                status: Status::Warn,
                detail: e.to_string(),
                fix: Some(
                    "the Metal kernels are untested on Apple hardware: please report this \
                     message; keep --device cpu"
                        .into(),
                ),
            });
            return;
        }
    };
    r.add(
        "mps kernels",
        Status::Ok,
        format!(
            "MXFP4, bf16, row-int8 products, KDA and MLA decode compiled ({})",
            dev.kernel_origin()
        ),
    );
    for (name, res) in canaries(&dev) {
        let name = format!("mps canary {name}");
        match res {
            Ok(err) => r.add(
                name,
                Status::Ok,
                format!("worst relative error {err:.1e} vs the CPU"),
            ),
            Err(e) => r.checks.push(Check {
                name,
                status: Status::Warn,
                detail: e,
                fix: Some(
                    "the Metal kernels disagree with the CPU on this Mac; keep --device cpu".into(),
                ),
            }),
        }
    }
}

/// Open `cuda:ordinal` (NVRTC compiles the kernels) and run the kernel canaries against the
/// CPU references. Problems are warnings: the model runs on the GPU only when asked for
/// (`--device cuda`), and a run that asks fails with the same error.
#[cfg(feature = "cuda")]
fn cuda_canaries(r: &mut Report, ordinal: usize) {
    use deltafin_kernels::cuda::{CudaDevice, canaries};
    let dev = match CudaDevice::open(ordinal) {
        Ok(d) => d,
        Err(e) => {
            r.checks.push(Check {
                name: format!("cuda:{ordinal} kernels"),
                status: Status::Warn,
                detail: e.to_string(),
                fix: Some(
                    "install the CUDA toolkit's NVRTC or `pip install nvidia-cuda-nvrtc-cu12` and \
                     set DELTAFIN_NVRTC to its libnvrtc.so.12"
                        .into(),
                ),
            });
            return;
        }
    };
    r.add(
        format!("cuda:{ordinal} kernels"),
        Status::Ok,
        format!(
            "MXFP4, bf16, row-int8 products, KDA and MLA decode compiled ({})",
            dev.kernel_origin()
        ),
    );
    for (name, res) in canaries(&dev) {
        let name = format!("cuda:{ordinal} canary {name}");
        match res {
            Ok(err) => r.add(
                name,
                Status::Ok,
                format!("worst relative error {err:.1e} vs the CPU"),
            ),
            Err(e) => r.checks.push(Check {
                name,
                status: Status::Warn,
                detail: e,
                fix: Some(
                    "the CUDA kernels disagree with the CPU on this device; keep --device cpu"
                        .into(),
                ),
            }),
        }
    }
}

/// The CPU features the kernels can use, split into (present, absent).
fn cpu_features() -> (Vec<&'static str>, Vec<&'static str>) {
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

// ---------------------------------------------------------------------------------------------
// Canaries: each kernel on a small known input against an f64 reference.

/// Relative tolerance of the canaries: `|y − ref| ≤ CANARY_RTOL · Σ|terms| + CANARY_ATOL`.
pub const CANARY_RTOL: f64 = 1e-5;
/// Absolute floor of the canary tolerance.
pub const CANARY_ATOL: f64 = 1e-6;

/// Deterministic test values in [−1, 1] with a few bits of mantissa (exact in bf16).
fn pattern(i: usize, salt: usize) -> f32 {
    (((i * 7919 + salt * 104_729) % 257) as f32 - 128.0) / 128.0
}

fn canary_result(name: String, run: impl FnOnce() -> Result<(f64, usize), String>) -> Check {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
    match outcome {
        Ok(Ok((worst, n))) if worst <= 1.0 => Check {
            name,
            status: Status::Ok,
            detail: format!(
                "{n} outputs within tolerance (worst |error| {:.3}× the tolerance {CANARY_RTOL:e}·Σ|terms| + {CANARY_ATOL:e})",
                worst
            ),
            fix: None,
        },
        Ok(Ok((worst, n))) => Check {
            name,
            status: Status::Fail,
            detail: format!(
                "{n} outputs; worst error is {worst:.3e} times the tolerance {CANARY_RTOL:e}·Σ|terms| + {CANARY_ATOL:e}"
            ),
            fix: Some(
                "the compute kernels give wrong results on this CPU: report it with `deltafin doctor --json` output; try K3_MXFP4_DISABLE_AVX2=1".into(),
            ),
        },
        Ok(Err(msg)) => Check {
            name,
            status: Status::Fail,
            detail: msg,
            fix: Some("report it with `deltafin doctor --json` output".into()),
        },
        Err(_) => Check {
            name,
            status: Status::Fail,
            detail: "the kernel panicked on a valid input".into(),
            fix: Some("report it with `deltafin doctor --json` output".into()),
        },
    }
}

/// Worst `|y − ref| / (rtol·scale + atol)` over all outputs.
fn worst_ratio(y: &[f32], reference: &[f64], scale: &[f64]) -> f64 {
    y.iter()
        .zip(reference)
        .zip(scale)
        .map(|((&v, &r), &s)| {
            if !v.is_finite() {
                f64::INFINITY
            } else {
                (v as f64 - r).abs() / (CANARY_RTOL * s + CANARY_ATOL)
            }
        })
        .fold(0.0, f64::max)
}

fn canary_bf16(rows: usize, cols: usize) -> Result<(f64, usize), String> {
    let w: Vec<bf16> = (0..rows * cols)
        .map(|i| bf16::from_f32(pattern(i, 1)))
        .collect();
    let x: Vec<f32> = (0..cols).map(|i| pattern(i, 2)).collect();
    let m = Bf16Matrix::from_values(rows, cols, &w).map_err(|e| e.to_string())?;
    let mut y = vec![0f32; rows];
    deltafin_kernels::matvec_bf16(&m, &x, &mut y);
    let mut reference = vec![0f64; rows];
    let mut scale = vec![0f64; rows];
    for r in 0..rows {
        for c in 0..cols {
            let t = w[r * cols + c].to_f32() as f64 * x[c] as f64;
            reference[r] += t;
            scale[r] += t.abs();
        }
    }
    Ok((worst_ratio(&y, &reference, &scale), rows))
}

fn canary_mxfp4(rows: usize, cols: usize) -> Result<(f64, usize), String> {
    let packed: Vec<u8> = (0..rows * cols / 2)
        .map(|i| ((i * 37 + 11) % 256) as u8)
        .collect();
    let scales: Vec<u8> = (0..rows * cols / mxfp4::GROUP)
        .map(|i| 120 + (i % 11) as u8)
        .collect();
    let x: Vec<f32> = (0..cols).map(|i| pattern(i, 3)).collect();
    let m = Mxfp4Matrix::new(
        "doctor canary",
        Bytes::from_vec(packed.clone()),
        Bytes::from_vec(scales.clone()),
        rows,
        cols,
    )
    .map_err(|e| e.to_string())?;
    let mut y = vec![0f32; rows];
    deltafin_kernels::matvec_mxfp4(&m, &x, &mut y);
    let mut reference = vec![0f64; rows];
    let mut scale = vec![0f64; rows];
    let mut row = vec![0f32; cols];
    for r in 0..rows {
        let p = &packed[r * cols / 2..(r + 1) * cols / 2];
        let s = &scales[r * cols / mxfp4::GROUP..(r + 1) * cols / mxfp4::GROUP];
        mxfp4::dequantize_row(p, s, &mut row)
            .ok_or_else(|| "the reference dequantizer rejected the canary row".to_string())?;
        for c in 0..cols {
            let t = row[c] as f64 * x[c] as f64;
            reference[r] += t;
            scale[r] += t.abs();
        }
    }
    Ok((worst_ratio(&y, &reference, &scale), rows))
}

fn canary_rms_norm(n: usize) -> Result<(f64, usize), String> {
    let x: Vec<f32> = (0..n).map(|i| pattern(i, 4) * 3.0).collect();
    let w: Vec<f32> = (0..n).map(|i| 1.0 + pattern(i, 5) / 8.0).collect();
    let eps = 1e-5f32;
    let mut y = vec![0f32; n];
    deltafin_kernels::rms_norm(&x, &w, eps, &mut y);
    let ms: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / n as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    let reference: Vec<f64> = x
        .iter()
        .zip(&w)
        .map(|(&v, &wi)| wi as f64 * v as f64 * inv)
        .collect();
    let scale: Vec<f64> = reference.iter().map(|v| v.abs()).collect();
    Ok((worst_ratio(&y, &reference, &scale), n))
}

fn canary_softmax(n: usize) -> Result<(f64, usize), String> {
    let x: Vec<f32> = (0..n).map(|i| pattern(i, 6) * 20.0).collect();
    let mut y = x.clone();
    deltafin_kernels::softmax_inplace(&mut y);
    let max = x
        .iter()
        .map(|&v| v as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = x.iter().map(|&v| (v as f64 - max).exp()).sum();
    let reference: Vec<f64> = x.iter().map(|&v| (v as f64 - max).exp() / sum).collect();
    let scale: Vec<f64> = reference.iter().map(|v| v.abs()).collect();
    Ok((worst_ratio(&y, &reference, &scale), n))
}

fn canaries() -> Vec<Check> {
    vec![
        canary_result("canary matvec_bf16 32x32".into(), || canary_bf16(32, 32)),
        canary_result("canary matvec_bf16 512x2048 (parallel rows)".into(), || {
            canary_bf16(512, 2048)
        }),
        canary_result("canary matvec_mxfp4 32x32".into(), || canary_mxfp4(32, 32)),
        canary_result(
            "canary matvec_mxfp4 512x2048 (parallel rows)".into(),
            || canary_mxfp4(512, 2048),
        ),
        canary_result("canary rms_norm 7168".into(), || canary_rms_norm(7168)),
        canary_result("canary softmax 1024".into(), || canary_softmax(1024)),
    ]
}

// ---------------------------------------------------------------------------------------------
// Memory

/// `/proc/meminfo` figures in bytes.
#[derive(Clone, Copy, Debug)]
pub struct MemInfo {
    pub total: u64,
    pub available: u64,
}

/// Total and available memory from `/proc/meminfo` (Linux); `None` where it is unreadable.
pub fn meminfo() -> Option<MemInfo> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_meminfo(&text)
}

fn parse_meminfo(text: &str) -> Option<MemInfo> {
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let rest = line[name.len()..].trim_start_matches(':').trim();
        let kb: u64 = rest.split_whitespace().next()?.parse().ok()?;
        Some(kb * 1024)
    };
    Some(MemInfo {
        total: field("MemTotal")?,
        available: field("MemAvailable")?,
    })
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn memory_check(r: &mut Report, mem: Option<MemInfo>) {
    match mem {
        Some(m) => {
            r.facts.insert("mem_total_bytes".into(), json!(m.total));
            r.facts
                .insert("mem_available_bytes".into(), json!(m.available));
            r.add(
                "memory",
                Status::Ok,
                format!(
                    "{:.1} GiB available of {:.1} GiB",
                    gib(m.available),
                    gib(m.total)
                ),
            );
        }
        None => r.add(
            "memory",
            Status::Warn,
            "free memory unknown (/proc/meminfo is not readable on this host)",
        ),
    }
}

/// Transparent huge pages: whether `DELTAFIN_HUGE_PAGES=auto` copies the resident weights
/// into huge-page memory on this host (`mode`: the bracketed choice of
/// `/sys/kernel/mm/transparent_hugepage/enabled`, `None` where there is none).
fn huge_pages_check(r: &mut Report, mode: Option<String>) {
    r.facts
        .insert("transparent_huge_pages".into(), json!(mode.clone()));
    match mode.as_deref() {
        Some("always") | Some("madvise") => r.add(
            "huge pages",
            Status::Ok,
            format!(
                "transparent huge pages: {}; resident weights are copied into huge pages at load (DELTAFIN_HUGE_PAGES=auto)",
                mode.as_deref().unwrap_or_default()
            ),
        ),
        Some(other) => r.add(
            "huge pages",
            Status::Info,
            format!(
                "transparent huge pages: {other}; resident weights stay mapped in 4 KiB pages (decode measured ≈ 1.15 × faster from huge pages; enable with `echo madvise > /sys/kernel/mm/transparent_hugepage/enabled`)"
            ),
        ),
        None => r.add(
            "huge pages",
            Status::Info,
            "no transparent huge pages on this system: resident weights stay mapped from their files",
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Disk read probe

/// Drop `file`'s pages from the page cache where the OS allows it; true when it did.
fn drop_from_cache(file: &File) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid open descriptor; POSIX_FADV_DONTNEED only affects caching.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = file;
        false
    }
}

/// Read up to `limit` bytes of `path` after dropping it from the cache: (bytes, seconds,
/// dropped).
fn timed_read(path: &Path, limit: u64) -> std::io::Result<(u64, f64, bool)> {
    let mut f = File::open(path)?;
    let dropped = drop_from_cache(&f);
    let mut buf = vec![0u8; 8 << 20];
    let mut total = 0u64;
    let t = Instant::now();
    while total < limit {
        let want = buf.len().min((limit - total) as usize);
        let n = f.read(&mut buf[..want])?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    Ok((total, t.elapsed().as_secs_f64(), dropped))
}

fn disk_probe(r: &mut Report, model_file: Option<&Path>) {
    let result: std::io::Result<(String, u64, f64, bool)> = (|| match model_file {
        Some(p) => {
            let (n, s, d) = timed_read(p, DISK_PROBE_BYTES)?;
            Ok((p.display().to_string(), n, s, d))
        }
        None => {
            let mut tmp = tempfile::Builder::new()
                .prefix(".deltafin-doctor-probe-")
                .tempfile()?;
            let block: Vec<u8> = (0..(8usize << 20))
                .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
                .collect();
            let mut written = 0u64;
            while written < DISK_PROBE_BYTES {
                tmp.as_file_mut().write_all(&block)?;
                written += block.len() as u64;
            }
            tmp.as_file().sync_data()?;
            let path = tmp.path().to_path_buf();
            let (n, s, d) = timed_read(&path, DISK_PROBE_BYTES)?;
            Ok((
                format!("a temporary file in {}", std::env::temp_dir().display()),
                n,
                s,
                d,
            ))
        }
    })();
    match result {
        Ok((what, n, secs, dropped)) if n > 0 => {
            let gbps = n as f64 / secs.max(1e-9) / 1e9;
            r.facts.insert("disk_read_gb_per_s".into(), json!(gbps));
            r.facts.insert("disk_probe_bytes".into(), json!(n));
            r.facts
                .insert("disk_probe_cache_dropped".into(), json!(dropped));
            r.add(
                "disk read",
                Status::Info,
                format!(
                    "{gbps:.2} GB/s over {} MiB of {what} ({})",
                    n >> 20,
                    if dropped {
                        "page cache dropped first"
                    } else {
                        "page cache could not be dropped: the figure may be a cached read"
                    }
                ),
            );
        }
        Ok((what, _, _, _)) => r.add(
            "disk read",
            Status::Warn,
            format!("nothing to read in {what}"),
        ),
        Err(e) => r.add(
            "disk read",
            Status::Warn,
            format!("the read probe failed: {e}"),
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Model installation

/// A fix suggestion for a checkpoint error.
fn checkpoint_fix(e: &CheckpointError, root: &Path) -> String {
    let r = root.display();
    match e {
        CheckpointError::MissingFile { .. } => {
            format!("install the model: `deltafin setup --model-root {r}`")
        }
        CheckpointError::Config(_) => format!(
            "config.json is not a valid K3 config: restore the pinned metadata with `deltafin setup-k3 --meta-only --model-root {r}`"
        ),
        CheckpointError::Tensor(_) => format!(
            "a weight file is damaged or truncated: delete it and fetch it again with `deltafin fetch-weights --model-root {r}`"
        ),
        CheckpointError::File { message, .. } if message.contains("does not exist") => format!(
            "a weight shard is missing: fetch it with `deltafin fetch-weights --model-root {r}`"
        ),
        CheckpointError::File { .. } | CheckpointError::Request { .. } => format!(
            "the weight index and the shards disagree: restore the metadata with `deltafin setup-k3 --meta-only --model-root {r}` and re-fetch with `deltafin fetch-weights --model-root {r}`"
        ),
    }
}

/// Check the install at `root`; returns the largest shard, for the disk probe.
fn model_checks(r: &mut Report, root: &Path, available: Option<u64>) -> Option<PathBuf> {
    let rd = root.display().to_string();
    let config_path = root.join(CONFIG_FILE);
    if !config_path.is_file() {
        r.fail(
            "model root",
            format!("no K3 model installed at {rd}: {CONFIG_FILE} is missing"),
            format!(
                "install it with `deltafin setup --model-root {rd}`, point --model-root (or DELTAFIN_ROOT) at an install, or check only the host with `deltafin doctor --runtime-only`"
            ),
        );
        return None;
    }
    let cfg = match K3Config::from_file(&config_path) {
        Ok(c) => c,
        Err(e) => {
            r.fail(
                "config.json",
                e.to_string(),
                format!(
                    "restore the pinned metadata with `deltafin setup-k3 --meta-only --model-root {rd}`"
                ),
            );
            return None;
        }
    };
    config_contract(r, &cfg, available);

    let mut largest: Option<(u64, PathBuf)> = None;
    match Checkpoint::open(root) {
        Ok(ckpt) if ckpt.layout() == deltafin_k3::checkpoint::Layout::StreamInstall => {
            let missing = deltafin_k3::loader::stream_install_missing_experts(&ckpt).len();
            r.add(
                "checkpoint",
                Status::Ok,
                format!(
                    "stream install: {} spine tensor files ({:.2} GiB) in k3-resident/tensors/ with their exact sizes; {missing} routed experts not yet in k3-experts/ (fetched on demand)",
                    ckpt.spine_files().len(),
                    gib(ckpt.spine_bytes())
                ),
            );
        }
        Ok(ckpt) => {
            let paths = ckpt.shard_paths();
            let mut bytes = 0u64;
            for p in &paths {
                let len = std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
                bytes += len;
                if largest.as_ref().is_none_or(|(l, _)| len > *l) {
                    largest = Some((len, p.to_path_buf()));
                }
            }
            r.add(
                "checkpoint",
                Status::Ok,
                format!(
                    "{INDEX_FILE} and {} shards ({:.2} GiB) complete: every tensor of the K3 inventory present with its dtype, shape and byte range",
                    paths.len(),
                    gib(bytes)
                ),
            );
        }
        Err(e) => {
            let fix = checkpoint_fix(&e, root);
            r.fail("checkpoint", e.to_string(), fix);
        }
    }

    match Tokenizer::from_dir(root) {
        Ok(t) if t.vocab_size() == cfg.text.vocab_size => r.add(
            "tokenizer",
            Status::Ok,
            format!(
                "tiktoken.model and tokenizer_config.json: {} tokens",
                t.vocab_size()
            ),
        ),
        Ok(t) => r.fail(
            "tokenizer",
            format!(
                "the tokenizer has {} tokens but config.json vocab_size is {}",
                t.vocab_size(),
                cfg.text.vocab_size
            ),
            format!(
                "restore the pinned tokenizer files with `deltafin setup-k3 --meta-only --model-root {rd}`"
            ),
        ),
        Err(e) => r.fail(
            "tokenizer",
            e.to_string(),
            format!(
                "restore the pinned tokenizer files with `deltafin setup-k3 --meta-only --model-root {rd}`"
            ),
        ),
    }
    if !root.join("generation_config.json").is_file() {
        r.add(
            "generation_config.json",
            Status::Warn,
            "absent (not read by the runtime; `deltafin setup-k3 --meta-only` restores it)",
        );
    }
    draft_checks(r, root);
    for (dir, what) in [
        ("k3-resident-int8", "row-int8 spine"),
        ("k3-resident-packs", "DFSP spine packs"),
        ("k3-experts-scale4", "scale4 expert sidecars"),
    ] {
        if root.join(dir).is_dir() {
            r.add(
                what,
                Status::Info,
                format!("{dir}/ present but not used by this build (it reads the original shards)"),
            );
        }
    }
    largest.map(|(_, p)| p)
}

/// The model contract line and the context admitted by the memory available.
fn config_contract(r: &mut Report, cfg: &K3Config, available: Option<u64>) {
    let dims = dims_from_config(cfg, &EngineOptions::default());
    if let Err(e) = dims.validate() {
        r.fail(
            "config.json",
            e.to_string(),
            "restore the pinned metadata with `deltafin setup-k3 --meta-only`",
        );
        return;
    }
    let is_release = K3Config::from_json_str(REAL_CONFIG_JSON)
        .map(|real| &real == cfg)
        .unwrap_or(false);
    r.add(
        "config.json",
        Status::Ok,
        if is_release {
            "the released Kimi K3 configuration".to_string()
        } else {
            "a K3-format configuration with other dimensions (synthesized or scaled test model)"
                .to_string()
        },
    );
    let context = cfg.text.max_position_embeddings as u64;
    r.contract_after = r.checks.len();
    r.model_contract = Some(format!(
        "model contract: Kimi K3 {} layers ({} KDA, {} MLA), {} experts/top-{}, context {}",
        dims.num_layers(),
        dims.num_kda_layers(),
        dims.num_mla_layers(),
        dims.num_experts,
        dims.experts_per_token,
        context
    ));
    let spine: u64 = inventory::text_inventory(cfg)
        .iter()
        .filter(|t| matches!(t.kind, TensorKind::Spine { .. }))
        .map(|t| t.byte_len() as u64)
        .sum();
    let kda = dims.kda_state_bytes() as u64;
    let per_token = dims.mla_cache_bytes_per_token() as u64;
    r.facts.insert("spine_bytes".into(), json!(spine));
    r.facts.insert("kda_state_bytes".into(), json!(kda));
    r.facts
        .insert("mla_cache_bytes_per_token".into(), json!(per_token));
    let Some(avail) = available else {
        r.add(
            "admitted context",
            Status::Warn,
            "unknown: free memory could not be read",
        );
        return;
    };
    let fixed = spine + kda;
    let room = avail.saturating_sub(fixed);
    let admitted = room
        .checked_div(per_token)
        .map_or(context, |n| n.min(context));
    r.admitted_context = Some(admitted);
    let detail = format!(
        "{admitted} of {context} tokens: MLA cache {per_token} B/token into {:.2} GiB available after the {:.2} GiB spine and {:.3} GiB KDA state",
        gib(room),
        gib(spine),
        gib(kda)
    );
    if admitted == 0 {
        r.add(
            "admitted context",
            Status::Warn,
            format!(
                "{detail}; the spine does not fit in free memory and will be re-read from disk"
            ),
        );
    } else {
        r.add("admitted context", Status::Info, detail);
    }
}

/// A draft directory must hold a config and a safetensors file whose header is valid.
fn check_draft_dir(dir: &Path) -> std::result::Result<u64, String> {
    let cfg = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg).map_err(|e| format!("{}: {e}", cfg.display()))?;
    serde_json::from_str::<Value>(&text)
        .map_err(|e| format!("{}: not valid JSON: {e}", cfg.display()))?;
    let st = dir.join("model.safetensors");
    let f = SafetensorsFile::open(&st).map_err(|e| e.to_string())?;
    Ok(f.tensors().len() as u64)
}

fn draft_checks(r: &mut Report, root: &Path) {
    let rd = root.display();
    let dspark = root.join("k3-draft-dspark");
    if !dspark.exists() {
        r.add(
            "draft dspark",
            Status::Info,
            "k3-draft-dspark/ absent (chat drafting off)",
        );
    } else {
        match check_draft_dir(&dspark) {
            Ok(n) => r.add(
                "draft dspark",
                Status::Ok,
                format!("k3-draft-dspark/: config and {n} tensors"),
            ),
            Err(e) => r.fail(
                "draft dspark",
                e,
                format!(
                    "reinstall it with `deltafin setup-dspark --destination {rd}/k3-draft-dspark`"
                ),
            ),
        }
    }
    let pair = ["k3-draft-qwen3-0.6b-base", "k3-draft-qwen3-1.7b-base"];
    let present: Vec<bool> = pair.iter().map(|d| root.join(d).exists()).collect();
    match (present[0], present[1]) {
        (false, false) => r.add(
            "draft qwen",
            Status::Info,
            "Qwen3 pair absent (raw-completion drafting off)",
        ),
        (true, true) => {
            for d in pair {
                match check_draft_dir(&root.join(d)) {
                    Ok(n) => r.add(
                        "draft qwen",
                        Status::Ok,
                        format!("{d}/: config and {n} tensors"),
                    ),
                    Err(e) => r.fail(
                        "draft qwen",
                        e,
                        format!("reinstall the pair with `deltafin setup-qwen --model-root {rd}`"),
                    ),
                }
            }
        }
        _ => {
            let (have, missing) = if present[0] {
                (pair[0], pair[1])
            } else {
                (pair[1], pair[0])
            };
            r.fail(
                "draft qwen",
                format!("partial Qwen3 pair: {have}/ is present but {missing}/ is missing"),
                format!(
                    "install the pair with `deltafin setup-qwen --model-root {rd}`, or remove {have}/"
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canaries_pass_on_this_host() {
        for c in canaries() {
            assert_eq!(c.status, Status::Ok, "{}: {}", c.name, c.detail);
        }
    }

    #[test]
    fn canary_detects_a_wrong_result() {
        let y = [1.0f32, 2.0];
        let reference = [1.0f64, 2.1];
        let scale = [1.0f64, 2.0];
        assert!(worst_ratio(&y, &reference, &scale) > 1.0);
        assert!(worst_ratio(&[f32::NAN], &[0.0], &[0.0]).is_infinite());
    }

    #[test]
    fn the_huge_page_check_says_what_load_will_do() {
        for (mode, status, says) in [
            (Some("madvise"), Status::Ok, "copied into huge pages"),
            (Some("always"), Status::Ok, "copied into huge pages"),
            (Some("never"), Status::Info, "stay mapped in 4 KiB pages"),
            (None, Status::Info, "no transparent huge pages"),
        ] {
            let mut r = Report::default();
            huge_pages_check(&mut r, mode.map(String::from));
            assert_eq!(r.checks.len(), 1);
            assert_eq!(r.checks[0].status, status, "{mode:?}");
            assert!(r.checks[0].detail.contains(says), "{}", r.checks[0].detail);
            assert_eq!(r.facts["transparent_huge_pages"], json!(mode));
        }
    }

    #[test]
    fn meminfo_parses_kib_fields() {
        let m = parse_meminfo("MemTotal:       1000 kB\nMemFree: 10 kB\nMemAvailable:    500 kB\n")
            .unwrap();
        assert_eq!(m.total, 1_024_000);
        assert_eq!(m.available, 512_000);
        assert!(parse_meminfo("MemTotal: 1 kB\n").is_none());
    }
}
