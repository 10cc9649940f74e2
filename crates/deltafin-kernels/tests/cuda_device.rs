//! GPU correctness and speed of the CUDA kernels (feature `cuda`): every kernel against the CPU
//! reference on random inputs with ragged shapes, batch-width invariance, and the bandwidth
//! table (effective GB/s of weight bytes vs the device-to-device copy probe).
//!
//! Every test needs libcuda and a device, so they are `#[ignore]`d: `tools/gpu/check.sh` runs
//! them, or `cargo test -p deltafin-kernels --features cuda --test cuda_device -- --ignored`.
//! Run without a usable device, a test fails and says why. The shared checks and their bounds
//! are in `common/mod.rs`.
#![cfg(feature = "cuda")]

mod common;

use common::{Rng, bf16m, int8m, mxfp4};
use deltafin_kernels::CudaPaths;
use deltafin_kernels::cuda::{CudaDevice, DeviceMatrix};
use deltafin_kernels::gpu::{GpuBackend, GpuDevice};
use deltafin_kernels::{Weights, matmul};

/// The device; a test that runs without one fails here. The kernels come from where the
/// environment says (`DELTAFIN_NVRTC`, `DELTAFIN_CUDA_PTX_DIR`, …), as `deltafin` reads it.
fn device(test: &str) -> CudaDevice {
    let paths = CudaPaths::from_lookup(|name| std::env::var_os(name));
    common::device_for(test, "CUDA", CudaDevice::open_with(0, &paths), |d| {
        format!("{} — kernels: {}", d.info(), d.kernel_origin())
    })
}

/// The CPU's products (default kernel settings): the GPU takes f32 activations, and
/// the CPU's MXFP4 formats (`f32`, and `q8x3` on AVX-512 VNNI) keep f32's precision, so they
/// are compared directly.
fn cpu(w: Weights<'_>, xs: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * w.rows()];
    matmul(w, xs, n, &mut out);
    out
}

common::device_tests!(
    "needs a CUDA device: tools/gpu/check.sh, or --ignored",
    device,
    cpu,
    matmul: matmul_kernels_match_cpu_on_ragged_shapes,
    kda: kda_step_matches_cpu_over_several_tokens,
    mla: mla_decode_matches_cpu,
    canaries: doctor_canaries_pass
);

#[test]
#[ignore = "needs a CUDA device: tools/gpu/check.sh, or --ignored"]
fn matmul_bandwidth_vs_copy() {
    let dev = device("matmul_bandwidth_vs_copy");
    let mut rng = Rng(3);
    let copy = dev.copy_bandwidth(1 << 30, 5).unwrap();
    eprintln!("device-to-device copy: {copy:.0} GB/s (read + write)");
    println!("| kernel | shape | n | µs/call | weight GB/s | / copy GB/s |");
    println!("|---|---|---|---|---|---|");
    let mut worst_big = f64::INFINITY;
    // Large matrices (beyond L2) measure streaming bandwidth; K3 expert shapes (3072×7168,
    // 7168×3072 — moe_intermediate × hidden) measure what a routed expert costs.
    let shapes = [
        (16384usize, 16384usize, true),
        (3072, 7168, false),
        (7168, 3072, false),
    ];
    for (rows, cols, big) in shapes {
        let mats: Vec<(&str, DeviceMatrix)> = vec![
            (
                "mxfp4",
                dev.upload_weights(Weights::Mxfp4(&mxfp4(&mut rng, rows, cols)))
                    .unwrap(),
            ),
            (
                "bf16",
                dev.upload_weights(Weights::Bf16(&bf16m(&mut rng, rows, cols)))
                    .unwrap(),
            ),
            (
                "row-int8",
                dev.upload_weights(Weights::RowInt8(&int8m(&mut rng, rows, cols)))
                    .unwrap(),
            ),
        ];
        for (name, m) in &mats {
            for n in [1usize, 4, 16] {
                let iters = if big { 20 } else { 200 };
                let t = dev.time_matmul(m, n, iters).unwrap();
                let gbs = m.weight_bytes() as f64 / t / 1e9;
                let ratio = gbs / copy;
                if big && n == 1 {
                    worst_big = worst_big.min(ratio);
                }
                println!(
                    "| {name} | {rows}×{cols} | {n} | {:.1} | {gbs:.0} | {ratio:.2} |",
                    t * 1e6
                );
            }
        }
    }
    eprintln!("worst n=1 streaming ratio (goal ≥ 0.8): {worst_big:.2}");
    assert!(worst_big.is_finite() && worst_big > 0.0);
}
