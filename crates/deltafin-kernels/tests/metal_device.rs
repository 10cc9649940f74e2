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

#[test]
#[ignore = "needs a Metal device (macOS): run with --ignored"]
fn metal_matmul_matches_cpu_on_ragged_shapes() {
    let dev = device("metal_matmul_matches_cpu_on_ragged_shapes");
    common::device_matmul_on_ragged_shapes(&dev, common::scalar_cpu);
}

#[test]
#[ignore = "needs a Metal device (macOS): run with --ignored"]
fn metal_kda_step_matches_cpu_over_several_tokens() {
    common::device_kda_steps(&device("metal_kda_step_matches_cpu_over_several_tokens"));
}

#[test]
#[ignore = "needs a Metal device (macOS): run with --ignored"]
fn metal_mla_decode_matches_cpu() {
    common::device_mla_decode(&device("metal_mla_decode_matches_cpu"));
}

#[test]
#[ignore = "needs a Metal device (macOS): run with --ignored"]
fn metal_canaries_pass() {
    common::device_canaries(&device("metal_canaries_pass"));
}
