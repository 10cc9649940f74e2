//! Compile check of every CUDA kernel without a GPU: NVRTC → PTX for `compute_80` and
//! `compute_90`, then `ptxas` → SASS for `sm_80` / `sm_90`, printing ptxas' register and
//! spill report.
//!
//! Tools come from `DELTAFIN_NVRTC` / `DELTAFIN_PTXAS`, else from the pip wheels
//! `nvidia-cuda-nvrtc-cu12` / `nvidia-cuda-nvcc-cu12` found by asking `$DELTAFIN_CUDA_PYTHON`
//! (or `python3`). Without them the test prints a SKIP line (`common::skip`), unless
//! `DELTAFIN_REQUIRE_NVRTC=1` (set by `.ci/run`), which turns a missing tool into a failure.
//! With `DELTAFIN_CUDA_PTX_OUT` set, the PTX is also written there (`<arch>/<file>.ptx`) for the
//! GPU check bundle.

mod common;

use std::path::PathBuf;
use std::process::Command;

use deltafin_kernels::CudaPaths;
use deltafin_kernels::cuda::{CHECK_ARCHS, KERNELS, Nvrtc, translation_unit};

/// Ask a Python interpreter where a pip wheel's `nvidia.<module>` package lives.
fn wheel_dir(module: &str) -> Option<PathBuf> {
    let pythons = [
        std::env::var("DELTAFIN_CUDA_PYTHON").ok(),
        Some("python3".into()),
    ];
    for py in pythons.into_iter().flatten() {
        let out = Command::new(&py)
            .args([
                "-c",
                &format!("import nvidia.{module} as m; print(list(m.__path__)[0])"),
            ])
            .output();
        if let Ok(out) = out
            && out.status.success()
        {
            let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            if dir.is_dir() {
                return Some(dir);
            }
        }
    }
    None
}

fn find_nvrtc() -> Option<Nvrtc> {
    if std::env::var_os("DELTAFIN_NVRTC").is_some() {
        // The test binary is an edge: it reads the search paths as `deltafin` does.
        return Nvrtc::load(&CudaPaths::from_lookup(|name| std::env::var_os(name))).ok();
    }
    let dir = wheel_dir("cuda_nvrtc")?.join("lib");
    Nvrtc::load_from(&dir.join("libnvrtc.so.12"))
        .or_else(|_| Nvrtc::load_from(&dir.join("libnvrtc.so.13")))
        .ok()
}

fn find_ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("DELTAFIN_PTXAS") {
        return Some(PathBuf::from(p));
    }
    let p = wheel_dir("cuda_nvcc")?.join("bin").join("ptxas");
    p.is_file().then_some(p)
}

#[test]
fn cuda_kernels_compile_to_ptx_and_sass() {
    let (Some(nvrtc), Some(ptxas)) = (find_nvrtc(), find_ptxas()) else {
        common::skip(
            "cuda_kernels_compile_to_ptx_and_sass",
            "DELTAFIN_REQUIRE_NVRTC",
            "NVRTC or ptxas was not found (pip install nvidia-cuda-nvrtc-cu12 \
             nvidia-cuda-nvcc-cu12, or set DELTAFIN_NVRTC / DELTAFIN_PTXAS)",
        );
        return;
    };
    let version = nvrtc.version().expect("nvrtcVersion");
    eprintln!(
        "NVRTC {version:?} from {}; ptxas {}",
        nvrtc.path(),
        ptxas.display()
    );
    let tmp = tempfile::tempdir().expect("tempdir");
    let ptx_out = std::env::var_os("DELTAFIN_CUDA_PTX_OUT").map(PathBuf::from);
    for arch in CHECK_ARCHS {
        let sm = arch.replace("compute_", "sm_");
        for k in KERNELS {
            let ptx = nvrtc
                .compile_ptx(k.file, &translation_unit(&k), arch, &[])
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(ptx.text.contains(".version"), "{}: no PTX header", k.file);
            for entry in k.entries {
                assert!(
                    ptx.text.contains(&format!(".entry {entry}(")),
                    "{} for {arch}: entry point {entry} missing from the PTX",
                    k.file
                );
            }
            if !ptx.log.trim().is_empty() {
                eprintln!("{} {arch} NVRTC log:\n{}", k.file, ptx.log);
            }
            let ptx_path = tmp.path().join(format!("{}.{arch}.ptx", k.file));
            std::fs::write(&ptx_path, &ptx.text).expect("write PTX");
            if let Some(dir) = &ptx_out {
                let d = dir.join(arch);
                std::fs::create_dir_all(&d).expect("create PTX output dir");
                std::fs::write(d.join(format!("{}.ptx", k.file)), &ptx.text).expect("write PTX");
            }
            let cubin = tmp.path().join(format!("{}.{sm}.cubin", k.file));
            let out = Command::new(&ptxas)
                .arg(format!("-arch={sm}"))
                .args(["-O3", "-v", "-o"])
                .arg(&cubin)
                .arg(&ptx_path)
                .output()
                .expect("run ptxas");
            let report = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success(),
                "ptxas {sm} failed for {}:\n{report}{}",
                k.file,
                String::from_utf8_lossy(&out.stdout)
            );
            let size = std::fs::metadata(&cubin).expect("cubin written").len();
            assert!(size > 0, "{}: empty cubin for {sm}", k.file);
            eprintln!("== {} → {sm} ({size} B SASS)", k.file);
            for line in report.lines().filter(|l| {
                l.contains("Function properties") || l.contains("registers") || l.contains("spill")
            }) {
                eprintln!("   {}", line.trim_start_matches("ptxas info    : ").trim());
            }
            // Register spills would put every kernel's hot loop through local memory.
            for line in report.lines().filter(|l| l.contains("spill stores")) {
                assert!(
                    line.contains(" 0 bytes spill stores") && line.contains(" 0 bytes spill loads"),
                    "{} on {sm} spills registers: {line}",
                    k.file
                );
            }
        }
    }
}
