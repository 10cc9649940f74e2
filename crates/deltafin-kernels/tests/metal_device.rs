//! Metal device correctness (macOS with feature `metal`): every kernel on the GPU against the
//! CPU reference on random inputs with ragged shapes, batch-width invariance, run-to-run
//! determinism, and the doctor canaries.
//!
//! **Not yet run on Apple hardware.** Every test needs a Metal device, so they are
//! `#[ignore]`d; on a Mac: `cargo test -p deltafin-kernels --features metal --test
//! metal_device -- --ignored --nocapture`. Run without a usable device, a test fails and says
//! why. On other platforms this file compiles to nothing (`tests/metal_logic.rs` checks the
//! kernel logic there). The shared checks and their bounds are in `common/mod.rs`.
#![cfg(all(target_os = "macos", feature = "metal"))]

mod common;

use deltafin_kernels::metal::MetalDevice;

/// The device; a test that runs without one fails here.
fn device(test: &str) -> MetalDevice {
    common::device_for(test, "Metal", MetalDevice::open(), |d| {
        format!("{} — kernels: {}", d.info(), d.kernel_origin())
    })
}

common::device_tests!(
    "needs a Metal device (macOS): run with --ignored",
    device,
    common::scalar_cpu,
    matmul: metal_matmul_matches_cpu_on_ragged_shapes,
    kda: metal_kda_step_matches_cpu_over_several_tokens,
    mla: metal_mla_decode_matches_cpu,
    canaries: metal_canaries_pass
);
