//! Test logic shared by the GPU kernel tests (`cuda_device.rs`, `metal_device.rs`) and the
//! Metal logic test (`metal_logic.rs`): random inputs, the per-value bounds against the CPU,
//! and the matmul / KDA / MLA checks, each run through a closure that calls the kernel under
//! test (a device, or the Metal sources compiled for the host); the device tests run them
//! through [`GpuDevice`], which both devices have (`device_*`). The KDA and MLA references
//! (`KdaStep::reference`, `MlaDecode::reference`: `deltafin_kernels::reference`) are
//! line-by-line f32 ports of the recurrent step in `crates/deltafin-k3/src/kda.rs` and of
//! `MlaWeights::attend` (t = 1) in `mla.rs`.
// Each test binary uses a part of this module.
#![allow(dead_code)]

use deltafin_kernels::gpu::{GpuDevice, KdaStep, MlaDecode, MlaShape};
use deltafin_kernels::{Backend, Weights, matmul_with};
use deltafin_tensor::{Bf16Matrix, Mxfp4Matrix, RowInt8Matrix, bf16};

mod shared;
mod skip;
#[allow(unused_imports)] // each test binary uses a part
pub use shared::{Rng, mxfp4};
#[allow(unused_imports)] // Not every test binary has a test that may skip.
pub use skip::skip;

pub fn bf16m(rng: &mut Rng, rows: usize, cols: usize) -> Bf16Matrix {
    let v: Vec<bf16> = rng
        .vec(rows * cols)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    Bf16Matrix::from_values(rows, cols, &v).unwrap()
}

pub fn int8m(rng: &mut Rng, rows: usize, cols: usize) -> RowInt8Matrix {
    RowInt8Matrix::quantize("t", rows, cols, &rng.vec(rows * cols)).unwrap()
}

/// One `rows × cols` matrix in every weight format: bf16 and row-int8 of the same values, and
/// MXFP4 when `cols` is a multiple of its 32-value block.
pub struct WeightSet {
    bf: Bf16Matrix,
    i8m: RowInt8Matrix,
    mx: Option<Mxfp4Matrix>,
}

impl WeightSet {
    pub fn random(rng: &mut Rng, rows: usize, cols: usize) -> Self {
        let vals = rng.vec(rows * cols);
        let bv: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
        WeightSet {
            bf: Bf16Matrix::from_values(rows, cols, &bv).unwrap(),
            i8m: RowInt8Matrix::quantize("t", rows, cols, &vals).unwrap(),
            mx: cols.is_multiple_of(32).then(|| mxfp4(rng, rows, cols)),
        }
    }

    pub fn all(&self) -> Vec<Weights<'_>> {
        let mut ws = vec![Weights::Bf16(&self.bf), Weights::RowInt8(&self.i8m)];
        if let Some(m) = &self.mx {
            ws.push(Weights::Mxfp4(m));
        }
        ws
    }
}

/// `W·xs` for `n` activation rows by the portable scalar CPU kernels: f32 activations like the
/// GPU kernels (the SIMD backends may quantise activations for row-int8 and MXFP4 products).
pub fn scalar_cpu(w: Weights<'_>, xs: &[f32], n: usize) -> Vec<f32> {
    let mut cpu = vec![0f32; n * w.rows()];
    matmul_with(Backend::Scalar, w, xs, n, &mut cpu);
    cpu
}

/// `|got − cpu| ≤ 1e-5 · Σ|w x|` per value, where `Σ|w x|` is the f32 rounding scale of a dot
/// product of this row (computed from the dequantized row); `who` names the kernel under test.
pub fn check_products(
    what: &str,
    who: &str,
    w: Weights<'_>,
    xs: &[f32],
    n: usize,
    got: &[f32],
    cpu: &[f32],
) {
    let (rows, cols) = (w.rows(), w.cols());
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
            let (g, c) = (got[b * rows + r] as f64, cpu[b * rows + r] as f64);
            let err = (g - c).abs() / (mag + 1e-30);
            worst = worst.max(err);
            assert!(
                err <= 1e-5,
                "{what}: row {r}, batch row {b}: {who} {g} vs cpu {c} (Σ|wx| {mag})"
            );
        }
    }
    eprintln!("  {what}: worst error / Σ|wx| = {worst:.2e}");
}

/// A device's products on ragged shapes (rows not multiples of the 8-row block; columns with
/// and without the 16-byte path) in every format and at batch widths 1…17, against `cpu`
/// within [`check_products`]' bound; batch-width invariance (activation row 0 of a batch gives
/// the bits of n = 1) and run-to-run determinism, bit for bit.
pub fn check_matmul_on_ragged_shapes<M>(
    upload: impl Fn(Weights<'_>) -> M,
    matmul: impl Fn(&M, &[f32], usize) -> Vec<f32>,
    cpu: impl Fn(Weights<'_>, &[f32], usize) -> Vec<f32>,
) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let shapes = [
        (1, 32),
        (37, 96),
        (64, 203),
        (129, 512),
        (515, 1000),
        (300, 7168),
    ];
    for (rows, cols) in shapes {
        let set = WeightSet::random(&mut rng, rows, cols);
        for w in set.all() {
            let dm = upload(w);
            let (mut single_x, mut single_y) = (Vec::new(), Vec::new());
            for n in [1usize, 2, 3, 5, 13, 16, 17] {
                let xs = rng.vec(n * cols);
                let gpu = matmul(&dm, &xs, n);
                check_products(
                    &format!("{} {rows}x{cols} n={n}", w.dtype()),
                    "gpu",
                    w,
                    &xs,
                    n,
                    &gpu,
                    &cpu(w, &xs, n),
                );
                if n == 1 {
                    (single_x, single_y) = (xs.clone(), gpu.clone());
                } else {
                    let mut xs2 = xs.clone();
                    xs2[..cols].copy_from_slice(&single_x);
                    let gpu2 = matmul(&dm, &xs2, n);
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
            assert_eq!(matmul(&dm, &xs, 3), matmul(&dm, &xs, 3));
        }
    }
}

/// `a` (from the kernel `who`) within `tol` of the largest `|b|` (the reference), every value
/// finite.
pub fn close(what: &str, who: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = a.iter().position(|x| !x.is_finite()) {
        panic!("{what}: value {i} is {} (never written, or overflow)", a[i]);
    }
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / scale)
        .fold(0f32, f32::max);
    eprintln!("  {what}: worst |{who} − cpu| / max|cpu| = {worst:.2e}");
    assert!(worst <= tol, "{what}: {worst:e} > {tol:e}");
}

fn l2n(v: &mut [f32]) {
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
    v.iter_mut().for_each(|x| *x /= n);
}

/// `steps` KDA recurrent steps per `(heads, d)` shape through `step` (state `[heads, d, d]`
/// updated in place, returns the `[heads, d]` outputs), against the reference: outputs and
/// state within 1e-5 of their largest value after every step. The inputs: q and k
/// L2-normalised per head, log-decays `g` in (−1, 0) (α ∈ (0.37, 1)), `beta` in (0, 1).
pub fn check_kda_steps(
    who: &str,
    shapes: &[(usize, usize)],
    steps: usize,
    mut step: impl FnMut(&mut [f32], &KdaStep<'_>) -> Vec<f32>,
) {
    let mut rng = Rng(7);
    for &(heads, d) in shapes {
        let mut s_dev = vec![0f32; heads * d * d];
        let mut s_cpu = s_dev.clone();
        for t in 0..steps {
            let (mut q, mut k, v) = (rng.vec(heads * d), rng.vec(heads * d), rng.vec(heads * d));
            let g: Vec<f32> = (0..heads * d).map(|_| -0.5 * (rng.f() + 1.0)).collect();
            let beta: Vec<f32> = (0..heads).map(|_| 0.5 * (rng.f() + 1.0)).collect();
            for h in 0..heads {
                l2n(&mut q[h * d..(h + 1) * d]);
                l2n(&mut k[h * d..(h + 1) * d]);
            }
            let (q, k, v, g, beta) = (&q[..], &k[..], &v[..], &g[..], &beta[..]);
            let x = KdaStep {
                heads,
                d,
                q,
                k,
                v,
                g,
                beta,
            };
            let out = step(&mut s_dev, &x);
            let o_cpu = x.reference(&mut s_cpu);
            let at = format!("KDA H={heads} d={d} step {t}");
            close(&format!("{at} out"), who, &out, &o_cpu, 1e-5);
            close(&format!("{at} state"), who, &s_dev, &s_cpu, 1e-5);
        }
    }
}

/// A small MLA shape: 3 heads, head sizes and kv_lora not multiples of 32.
pub const MLA_SMALL: MlaShape = MlaShape {
    heads: 3,
    nope: 16,
    rope: 8,
    v: 24,
    kvl: 72,
};

/// Every `(shape, tokens)` case through `decode` against the reference, within 2e-5 of the
/// largest output (bf16 inputs as the cache holds them).
pub fn check_mla_decode(
    who: &str,
    cases: &[(MlaShape, usize)],
    mut decode: impl FnMut(&MlaDecode<'_>) -> Vec<f32>,
) {
    let mut rng = Rng(11);
    let bfv = |rng: &mut Rng, len: usize, amp: f32| -> Vec<bf16> {
        (0..len).map(|_| bf16::from_f32(amp * rng.f())).collect()
    };
    for &(shape, tokens) in cases {
        let MlaShape {
            heads,
            nope,
            rope,
            v,
            kvl,
        } = shape;
        let q = rng.vec(heads * (nope + rope));
        let kv_b = bfv(&mut rng, heads * (nope + v) * kvl, 0.2);
        let latent = bfv(&mut rng, tokens * kvl, 1.0);
        let tail = bfv(&mut rng, tokens * rope, 1.0);
        let gate = rng.vec(heads * v);
        let (q, kv_b, latent, tail, gate) = (&q[..], &kv_b[..], &latent[..], &tail[..], &gate[..]);
        let x = MlaDecode {
            shape,
            tokens,
            q,
            kv_b,
            latent,
            tail,
            gate,
        };
        let got = decode(&x);
        close(
            &format!("MLA {shape:?} n={tokens}"),
            who,
            &got,
            &x.reference(),
            2e-5,
        );
    }
}

/// The `kind` device `opened` for `test`, described on stderr; the test fails here, saying why,
/// when there is none.
pub fn device_for<D, E: std::fmt::Display>(
    test: &str,
    kind: &str,
    opened: Result<D, E>,
    describe: impl Fn(&D) -> String,
) -> D {
    match opened {
        Ok(d) => {
            eprintln!("{test}: {}", describe(&d));
            d
        }
        Err(e) => panic!("{test} needs a usable {kind} device: {e}"),
    }
}

/// A device call's result; the test fails naming the call when it is an error.
fn on_device<T, E: std::fmt::Display>(call: &str, r: Result<T, E>) -> T {
    r.unwrap_or_else(|e| panic!("{call} failed on the device: {e}"))
}

/// [`check_matmul_on_ragged_shapes`] on a device, against `cpu`.
pub fn device_matmul_on_ragged_shapes<D: GpuDevice>(
    dev: &D,
    cpu: impl Fn(Weights<'_>, &[f32], usize) -> Vec<f32>,
) {
    check_matmul_on_ragged_shapes(
        |w| on_device("upload_weights", dev.upload_weights(w)),
        |m, xs, n| on_device("matmul", dev.matmul(m, xs, n)),
        cpu,
    );
}

/// [`check_kda_steps`] on a device: six tokens at d = 40 (not a multiple of 32), 128 and 300
/// (more columns than threads).
pub fn device_kda_steps<D: GpuDevice>(dev: &D) {
    check_kda_steps("gpu", &[(3, 40), (4, 128), (2, 300)], 6, |s, x| {
        on_device("kda_step", dev.kda_step(s, x))
    });
}

/// [`check_mla_decode`] on a device: [`MLA_SMALL`] and K3's shape, from one cached token to
/// more than the threads of a block.
pub fn device_mla_decode<D: GpuDevice>(dev: &D) {
    let k3 = MlaShape {
        heads: 8,
        nope: 128,
        rope: 64,
        v: 128,
        kvl: 512,
    };
    let cases = [
        (MLA_SMALL, 1),
        (MLA_SMALL, 7),
        (MLA_SMALL, 333),
        (k3, 1),
        (k3, 1500),
    ];
    check_mla_decode("gpu", &cases, |x| {
        on_device("mla_decode", dev.mla_decode(x))
    });
}

/// The checks every GPU backend's device test runs, each an `#[ignore]`d (`$why`) test named
/// as given, on the device `$device(test name)` opens: the products against `$cpu` on ragged
/// shapes, several KDA steps, MLA decodes, and the doctor's canaries.
#[allow(unused_macros)] // the device test binaries use it
macro_rules! device_tests {
    ($why:literal, $device:ident, $cpu:expr,
        matmul: $matmul:ident, kda: $kda:ident, mla: $mla:ident, canaries: $canaries:ident) => {
        #[test]
        #[ignore = $why]
        fn $matmul() {
            $crate::common::device_matmul_on_ragged_shapes(&$device(stringify!($matmul)), $cpu);
        }

        #[test]
        #[ignore = $why]
        fn $kda() {
            $crate::common::device_kda_steps(&$device(stringify!($kda)));
        }

        #[test]
        #[ignore = $why]
        fn $mla() {
            $crate::common::device_mla_decode(&$device(stringify!($mla)));
        }

        #[test]
        #[ignore = $why]
        fn $canaries() {
            $crate::common::device_canaries(&$device(stringify!($canaries)));
        }
    };
}
#[allow(unused_imports)]
pub(crate) use device_tests;

/// The doctor's canaries on a device: every one passes.
pub fn device_canaries<D: GpuDevice>(dev: &D) {
    for (name, r) in deltafin_kernels::gpu::canaries(dev) {
        match r {
            Ok(e) => eprintln!("  canary {name}: {e:.2e}"),
            Err(e) => panic!("canary {name}: {e}"),
        }
    }
}
