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

use common::MLA_SMALL;
use deltafin_kernels::metal::{MetalDevice, MlaShape, canaries};

/// The device; a test that runs without one fails here.
fn device(test: &str) -> MetalDevice {
    match MetalDevice::open() {
        Ok(d) => {
            eprintln!("{test}: {} — kernels: {}", d.info(), d.kernel_origin());
            d
        }
        Err(e) => panic!("{test} needs a usable Metal device: {e}"),
    }
}

fn mla_shape((heads, nope, rope, v, kvl): common::Mla) -> MlaShape {
    MlaShape {
        heads,
        nope,
        rope,
        v,
        kvl,
    }
}

#[test]
#[ignore = "needs a Metal device (macOS): run with --ignored"]
fn metal_matmul_matches_cpu_on_ragged_shapes() {
    let dev = device("metal_matmul_matches_cpu_on_ragged_shapes");
    common::check_matmul_on_ragged_shapes(
        |w| dev.upload_weights(w).unwrap(),
        |m, xs, n| dev.matmul(m, xs, n).unwrap(),
        common::scalar_cpu,
    );
}

#[test]
#[ignore = "needs a Metal device (macOS): run with --ignored"]
fn metal_kda_step_matches_cpu_over_several_tokens() {
    let dev = device("metal_kda_step_matches_cpu_over_several_tokens");
    common::check_kda_steps(
        "gpu",
        &[(3, 40), (4, 128), (2, 300)],
        6,
        |heads, d, state, x| {
            dev.kda_step(heads, d, state, &x.q, &x.k, &x.v, &x.g, &x.beta)
                .unwrap()
        },
    );
}

#[test]
#[ignore = "needs a Metal device (macOS): run with --ignored"]
fn metal_mla_decode_matches_cpu() {
    let dev = device("metal_mla_decode_matches_cpu");
    let k3 = (8, 128, 64, 128, 512);
    common::check_mla_decode(
        "gpu",
        &[
            (MLA_SMALL, 1),
            (MLA_SMALL, 7),
            (MLA_SMALL, 333),
            (k3, 1),
            (k3, 1500),
        ],
        |sh, n, x| {
            dev.mla_decode(mla_shape(sh), n, &x.q, &x.kvb, &x.latent, &x.tail, &x.gate)
                .unwrap()
        },
    );
}

#[test]
#[ignore = "needs a Metal device (macOS): run with --ignored"]
fn metal_canaries_pass() {
    let dev = device("metal_canaries_pass");
    for (name, r) in canaries(&dev) {
        match r {
            Ok(e) => eprintln!("  canary {name}: {e:.2e}"),
            Err(e) => panic!("canary {name}: {e}"),
        }
    }
}
