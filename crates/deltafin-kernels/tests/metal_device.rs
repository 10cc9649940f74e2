//! Metal device correctness (macOS with feature `metal`): every kernel on the GPU against the
//! CPU reference on random inputs with ragged shapes, batch-width invariance, run-to-run
//! determinism, and the doctor canaries.
//!
//! **Not yet run on Apple hardware.** On a Mac: `cargo test -p deltafin-kernels --features
//! metal --test metal_device -- --nocapture`. Without a Metal device every test prints a SKIP
//! line and returns; with `DELTAFIN_REQUIRE_GPU=1` that is a failure instead. On other
//! platforms this file compiles to nothing (`tests/metal_logic.rs` checks the kernel logic
//! there).
#![cfg(all(target_os = "macos", feature = "metal"))]

use deltafin_kernels::cuda::reference;
use deltafin_kernels::metal::{MetalDevice, MlaShape, canaries};
use deltafin_kernels::{Backend, Weights, matmul_with};
use deltafin_tensor::{Bf16Matrix, Bytes, Mxfp4Matrix, RowInt8Matrix, bf16};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
}

/// The device, or `None` after printing why the test is skipped.
fn device(test: &str) -> Option<MetalDevice> {
    match MetalDevice::open() {
        Ok(d) => {
            eprintln!("{test}: {} — kernels: {}", d.info(), d.kernel_origin());
            Some(d)
        }
        Err(e) => {
            assert!(
                std::env::var("DELTAFIN_REQUIRE_GPU").map_or(true, |v| v != "1"),
                "DELTAFIN_REQUIRE_GPU=1 but no usable Metal device: {e}"
            );
            eprintln!("SKIP {test}: {e}");
            None
        }
    }
}

fn mxfp4(rng: &mut Rng, rows: usize, cols: usize) -> Mxfp4Matrix {
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next() as u8).collect();
    let scales: Vec<u8> = (0..rows * cols / 32)
        .map(|_| match rng.next() % 16 {
            0 => 0,
            1 => 140,
            _ => 118 + (rng.next() % 16) as u8,
        })
        .collect();
    Mxfp4Matrix::new(
        "t",
        Bytes::from_vec(packed),
        Bytes::from_vec(scales),
        rows,
        cols,
    )
    .unwrap()
}

/// `|gpu − cpu| ≤ 1e-5 · Σ|w x|` per value against the scalar CPU kernels (f32 activations).
fn check_products(what: &str, w: Weights<'_>, xs: &[f32], n: usize, gpu: &[f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    let mut cpu = vec![0f32; n * rows];
    matmul_with(Backend::Scalar, w, xs, n, &mut cpu);
    let mut row = vec![0f32; cols];
    let mut worst = 0f64;
    for r in 0..rows {
        match w {
            Weights::Bf16(m) => {
                for (o, v) in row.iter_mut().zip(m.row(r)) {
                    *o = v.to_f32();
                }
            }
            Weights::RowInt8(m) => m.dequantize_row(r, &mut row),
            Weights::Mxfp4(m) => m.dequantize_row(r, &mut row),
            Weights::F32 { .. } => unreachable!(),
        }
        for b in 0..n {
            let mag: f64 = row
                .iter()
                .zip(&xs[b * cols..(b + 1) * cols])
                .map(|(&a, &x)| (a as f64 * x as f64).abs())
                .sum();
            let (g, c) = (gpu[b * rows + r] as f64, cpu[b * rows + r] as f64);
            let err = (g - c).abs() / (mag + 1e-30);
            worst = worst.max(err);
            assert!(
                err <= 1e-5,
                "{what}: row {r}, batch row {b}: gpu {g} vs cpu {c} (Σ|wx| {mag})"
            );
        }
    }
    eprintln!("  {what}: worst error / Σ|wx| = {worst:.2e}");
}

#[test]
fn metal_matmul_matches_cpu_on_ragged_shapes() {
    let Some(dev) = device("metal_matmul_matches_cpu_on_ragged_shapes") else {
        return;
    };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for (rows, cols) in [
        (1, 32),
        (37, 96),
        (64, 203),
        (129, 512),
        (515, 1000),
        (300, 7168),
    ] {
        let vals = rng.vec(rows * cols);
        let bv: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
        let bf = Bf16Matrix::from_values(rows, cols, &bv).unwrap();
        let i8m = RowInt8Matrix::quantize("t", rows, cols, &vals).unwrap();
        let mx = cols.is_multiple_of(32).then(|| mxfp4(&mut rng, rows, cols));
        let mut ws = vec![Weights::Bf16(&bf), Weights::RowInt8(&i8m)];
        if let Some(m) = &mx {
            ws.push(Weights::Mxfp4(m));
        }
        for w in ws {
            let dm = dev.upload_weights(w).unwrap();
            let (mut single_x, mut single_y) = (Vec::new(), Vec::new());
            for n in [1usize, 2, 3, 5, 13, 16, 17] {
                let xs = rng.vec(n * cols);
                let gpu = dev.matmul(&dm, &xs, n).unwrap();
                check_products(
                    &format!("{} {rows}x{cols} n={n}", w.dtype()),
                    w,
                    &xs,
                    n,
                    &gpu,
                );
                if n == 1 {
                    (single_x, single_y) = (xs.clone(), gpu.clone());
                } else {
                    // Batch-width invariance: activation row 0 of a batch gives the bits of n = 1.
                    let mut xs2 = xs.clone();
                    xs2[..cols].copy_from_slice(&single_x);
                    let gpu2 = dev.matmul(&dm, &xs2, n).unwrap();
                    for r in 0..rows {
                        assert_eq!(
                            gpu2[r].to_bits(),
                            single_y[r].to_bits(),
                            "{} {rows}x{cols}: row {r} differs between n=1 and n={n}",
                            w.dtype()
                        );
                    }
                }
            }
            let xs = rng.vec(3 * cols);
            assert_eq!(
                dev.matmul(&dm, &xs, 3).unwrap(),
                dev.matmul(&dm, &xs, 3).unwrap()
            );
        }
    }
}

fn l2n(v: &mut [f32]) {
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
    v.iter_mut().for_each(|x| *x /= n);
}

fn close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = a.iter().position(|x| !x.is_finite()) {
        panic!("{what}: value {i} is {}", a[i]);
    }
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / scale)
        .fold(0f32, f32::max);
    eprintln!("  {what}: worst |gpu − cpu| / max|cpu| = {worst:.2e}");
    assert!(worst <= tol, "{what}: {worst:e} > {tol:e}");
}

#[test]
fn metal_kda_step_matches_cpu_over_several_tokens() {
    let Some(dev) = device("metal_kda_step_matches_cpu_over_several_tokens") else {
        return;
    };
    let mut rng = Rng(7);
    for (heads, d) in [(3usize, 40usize), (4, 128), (2, 300)] {
        let mut s_gpu = vec![0f32; heads * d * d];
        let mut s_cpu = s_gpu.clone();
        for step in 0..6 {
            let mut q = rng.vec(heads * d);
            let mut k = rng.vec(heads * d);
            let v = rng.vec(heads * d);
            let g: Vec<f32> = (0..heads * d).map(|_| -0.5 * (rng.f() + 1.0)).collect();
            let beta: Vec<f32> = (0..heads).map(|_| 0.5 * (rng.f() + 1.0)).collect();
            for h in 0..heads {
                l2n(&mut q[h * d..(h + 1) * d]);
                l2n(&mut k[h * d..(h + 1) * d]);
            }
            let o_gpu = dev
                .kda_step(heads, d, &mut s_gpu, &q, &k, &v, &g, &beta)
                .unwrap();
            let mut o_cpu = Vec::new();
            for h in 0..heads {
                let sl = h * d..(h + 1) * d;
                o_cpu.extend(reference::kda_step(
                    &mut s_cpu[h * d * d..(h + 1) * d * d],
                    &q[sl.clone()],
                    &k[sl.clone()],
                    &v[sl.clone()],
                    &g[sl],
                    beta[h],
                ));
            }
            close(
                &format!("KDA H={heads} d={d} step {step} out"),
                &o_gpu,
                &o_cpu,
                1e-5,
            );
            close(
                &format!("KDA H={heads} d={d} step {step} state"),
                &s_gpu,
                &s_cpu,
                1e-5,
            );
        }
    }
}

#[test]
fn metal_mla_decode_matches_cpu() {
    let Some(dev) = device("metal_mla_decode_matches_cpu") else {
        return;
    };
    let mut rng = Rng(11);
    let small = MlaShape {
        heads: 3,
        nope: 16,
        rope: 8,
        v: 24,
        kvl: 72,
    };
    let k3 = MlaShape {
        heads: 8,
        nope: 128,
        rope: 64,
        v: 128,
        kvl: 512,
    };
    for (sh, n) in [
        (small, 1usize),
        (small, 7),
        (small, 333),
        (k3, 1),
        (k3, 1500),
    ] {
        let bfv = |rng: &mut Rng, len: usize, amp: f32| -> Vec<bf16> {
            (0..len).map(|_| bf16::from_f32(amp * rng.f())).collect()
        };
        let q = rng.vec(sh.heads * (sh.nope + sh.rope));
        let kvb = bfv(&mut rng, sh.heads * (sh.nope + sh.v) * sh.kvl, 0.2);
        let latent = bfv(&mut rng, n * sh.kvl, 1.0);
        let tail = bfv(&mut rng, n * sh.rope, 1.0);
        let gate = rng.vec(sh.heads * sh.v);
        let gpu = dev
            .mla_decode(sh, n, &q, &kvb, &latent, &tail, &gate)
            .unwrap();
        let cpu = reference::mla_decode(
            (sh.heads, sh.nope, sh.rope, sh.v, sh.kvl),
            n,
            &q,
            &kvb,
            &latent,
            &tail,
            &gate,
        );
        close(&format!("MLA {sh:?} n={n}"), &gpu, &cpu, 2e-5);
    }
}

#[test]
fn metal_canaries_pass() {
    let Some(dev) = device("metal_canaries_pass") else {
        return;
    };
    for (name, r) in canaries(&dev) {
        match r {
            Ok(e) => eprintln!("  canary {name}: {e:.2e}"),
            Err(e) => panic!("canary {name}: {e}"),
        }
    }
}
