//! Vectorised element-wise transcendentals in f32: `exp`, `tanh`, `sigmoid`, `silu`, and the
//! SiTU-GLU product built from them (docs/K3.md §4.8).
//!
//! Each function has one portable definition (`*_one`), a fixed sequence of IEEE f32 adds,
//! multiplies, divisions, comparisons and bit operations — no fused multiply-adds, no
//! approximate reciprocals, no libm calls. The slice functions apply that definition to every
//! element; the AVX-512 and AVX2 builds are the same loop compiled with those features (the
//! compiler vectorises it), so every backend, every position in a slice and every slice length
//! gives the bit-identical result of the scalar definition. Accuracy against f64 is tested
//! below and stated in docs/NUMERICS.md.
//!
//! `exp`: `n = rne(x·log₂e)` (by the 1.5·2²³ rounding constant), Cody–Waite reduction
//! `r = (x − n·ln2_hi) − n·ln2_lo` (`n·ln2_hi` is exact), the Cephes degree-5 polynomial
//! `e^r ≈ 1 + r + r²·P(r)` on `|r| ≤ ln2/2`, and the scaling by `2ⁿ` as two exact powers of
//! two (`2^⌊n/2⌋ · 2^(n−⌊n/2⌋)`), so gradual underflow rounds once and overflow gives `+∞`.
//! `tanh`: odd; for `|x| < 0.625` the Cephes odd polynomial, above `1 − 2/(e^{2|x|} + 1)`;
//! the sign is copied from `x` (so `tanh(−0) = −0`). `sigmoid(x) = 1/(1 + e^{−x})`,
//! `silu(x) = x·sigmoid(x)`.

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split so that `n · LN2_HI` is exact for `|n| ≤ 2¹⁵` (9 significant bits).
const LN2_HI: f32 = 0.693_359_4;
/// `ln 2 − LN2_HI`.
const LN2_LO: f32 = -2.121_944_4e-4;
/// Above this, `e^x` overflows to `+∞` (the clamp keeps `n ≤ 128`).
const EXP_HI: f32 = 89.0;
/// Below this, `e^x` rounds to `+0` (the clamp keeps `n ≥ −150`).
const EXP_LO: f32 = -104.0;
/// 1.5 · 2²³: adding it rounds a value of magnitude `< 2²²` to the nearest integer (ties to
/// even), which then sits in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;

/// `2ⁿ` for `−126 ≤ n ≤ 127`, built from the exponent bits.
#[inline(always)]
fn pow2i(n: i32) -> f32 {
    f32::from_bits((n.wrapping_add(127) as u32) << 23)
}

/// `e^x`, the portable definition every backend reproduces bit for bit.
#[inline(always)]
pub fn exp_one(x: f32) -> f32 {
    // `clamp` (not min/max) so that NaN passes through unchanged.
    let xc = x.clamp(EXP_LO, EXP_HI);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = (p * (r * r) + r) + 1.0;
    let n1 = ni >> 1;
    let n2 = ni.wrapping_sub(n1);
    y * pow2i(n1) * pow2i(n2)
}

/// `tanh x`, the portable definition every backend reproduces bit for bit.
#[inline(always)]
pub fn tanh_one(x: f32) -> f32 {
    let a = x.abs();
    let z = a * a;
    let mut p = -5.704_988_7e-3f32;
    p = p * z + 2.063_909e-2;
    p = p * z - 5.373_971_6e-2;
    p = p * z + 1.333_144_2e-1;
    p = p * z - 3.333_328e-1;
    let small = p * z * a + a;
    let e = exp_one(a + a);
    let large = 1.0 - 2.0 / (e + 1.0);
    let y = if a < 0.625 { small } else { large };
    y.copysign(x)
}

/// `σ(x) = 1 / (1 + e^{−x})`, the portable definition.
#[inline(always)]
pub fn sigmoid_one(x: f32) -> f32 {
    1.0 / (1.0 + exp_one(-x))
}

/// `silu(x) = x · σ(x)`, the portable definition.
#[inline(always)]
pub fn silu_one(x: f32) -> f32 {
    x * sigmoid_one(x)
}

/// SiTU-GLU of one element (docs/K3.md §4.8):
/// `[β₁·tanh(g/β₁)·σ(g)] · [β₂·tanh(u/β₂)]`, the portable definition.
#[inline(always)]
pub fn situ_glu_one(g: f32, u: f32, beta1: f32, beta2: f32) -> f32 {
    let gate = beta1 * tanh_one(g / beta1) * sigmoid_one(g);
    let up = beta2 * tanh_one(u / beta2);
    gate * up
}

/// Which element-wise function a slice pass applies.
#[derive(Clone, Copy)]
enum Op {
    Exp,
    Tanh,
    Sigmoid,
    Silu,
}

/// The portable loop; the SIMD builds compile exactly this.
#[inline(always)]
fn map_body(op: Op, x: &mut [f32]) {
    match op {
        Op::Exp => x.iter_mut().for_each(|v| *v = exp_one(*v)),
        Op::Tanh => x.iter_mut().for_each(|v| *v = tanh_one(*v)),
        Op::Sigmoid => x.iter_mut().for_each(|v| *v = sigmoid_one(*v)),
        Op::Silu => x.iter_mut().for_each(|v| *v = silu_one(*v)),
    }
}

crate::simd::simd_versions! {
    /// [`map_body`] compiled for `backend`.
    fn map_with(backend, op: Op, x: &mut [f32]) = map_body, wrappers #[inline(never)];
}

/// `x ← e^x` element-wise ([`exp_one`]).
pub fn exp_inplace(x: &mut [f32]) {
    map_with(crate::settings::backend(), Op::Exp, x)
}

/// `x ← tanh x` element-wise ([`tanh_one`]).
pub fn tanh_inplace(x: &mut [f32]) {
    map_with(crate::settings::backend(), Op::Tanh, x)
}

/// `x ← σ(x)` element-wise ([`sigmoid_one`]).
pub fn sigmoid_inplace(x: &mut [f32]) {
    map_with(crate::settings::backend(), Op::Sigmoid, x)
}

/// `x ← x·σ(x)` element-wise ([`silu_one`]).
pub fn silu_inplace(x: &mut [f32]) {
    map_with(crate::settings::backend(), Op::Silu, x)
}

#[inline(always)]
fn situ_body(g: &[f32], u: &[f32], beta1: f32, beta2: f32, out: &mut [f32]) {
    for ((o, &gi), &ui) in out.iter_mut().zip(g).zip(u) {
        *o = situ_glu_one(gi, ui, beta1, beta2);
    }
}

crate::simd::simd_versions! {
    /// [`situ_glu`] compiled for `backend` (lengths checked by the caller).
    pub(crate) fn situ_glu_with(backend, g: &[f32], u: &[f32], beta1: f32, beta2: f32,
        out: &mut [f32]) = situ_body, wrappers #[inline(never)];
}

/// SiTU-GLU over slices: `out[i] = situ_glu_one(g[i], u[i], β₁, β₂)`.
///
/// # Panics
/// If `g`, `u`, `out` differ in length.
pub fn situ_glu(g: &[f32], u: &[f32], beta1: f32, beta2: f32, out: &mut [f32]) {
    assert_eq!(g.len(), u.len(), "situ_glu: up length");
    assert_eq!(g.len(), out.len(), "situ_glu: output length");
    situ_glu_with(crate::settings::backend(), g, u, beta1, beta2, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backend;
    use crate::test_shared::Rng;

    const OPS: [(Op, &str); 4] = [
        (Op::Exp, "exp"),
        (Op::Tanh, "tanh"),
        (Op::Sigmoid, "sigmoid"),
        (Op::Silu, "silu"),
    ];

    fn one(op: Op, x: f32) -> f32 {
        match op {
            Op::Exp => exp_one(x),
            Op::Tanh => tanh_one(x),
            Op::Sigmoid => sigmoid_one(x),
            Op::Silu => silu_one(x),
        }
    }

    fn reference(op: Op, x: f64) -> f64 {
        match op {
            Op::Exp => x.exp(),
            Op::Tanh => x.tanh(),
            Op::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            Op::Silu => x / (1.0 + (-x).exp()),
        }
    }

    /// Equal bit patterns, or both NaN (NaN payloads are not part of the contract).
    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    /// Inputs that exercise every branch: random bit patterns (NaN, ±∞, subnormals), the
    /// model's ranges, signed zeros, tiny values, and the overflow/underflow thresholds.
    fn inputs() -> Vec<f32> {
        let mut rng = Rng(0x5eed_0fe1_e5e5);
        let mut v: Vec<f32> = vec![
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            1e-45,
            -1e-45,
            1e-30,
            -1e-20,
            f32::MAX,
            f32::MIN,
            88.722_83,
            88.722_84,
            89.0,
            89.5,
            -87.336_54,
            -87.4,
            -103.97,
            -103.98,
            -104.0,
            -104.5,
            0.625,
            -0.625,
            0.624_999_94,
            9.0,
            -9.0,
            20.0,
        ];
        for _ in 0..4000 {
            v.push(f32::from_bits(rng.next() as u32));
        }
        for _ in 0..4000 {
            v.push(rng.uniform(-110.0, 110.0));
        }
        for _ in 0..4000 {
            v.push(rng.uniform(-4.0, 4.0));
        }
        v
    }

    #[test]
    fn backends_slices_and_positions_are_bit_identical() {
        let xs = inputs();
        for b in Backend::available() {
            for (op, name) in OPS {
                let want: Vec<f32> = xs.iter().map(|&x| one(op, x)).collect();
                let mut got = xs.clone();
                map_with(b, op, &mut got);
                for (i, (&w, &g)) in want.iter().zip(&got).enumerate() {
                    assert!(same(w, g), "{name} {b:?} x={:e}: {w:e} vs {g:e}", xs[i]);
                }
                // Ragged lengths at every offset mod 17: each element is its own.
                for start in 0..17 {
                    for len in [0usize, 1, 3, 7, 8, 15, 16, 17, 31, 33, 63, 100] {
                        let mut part = xs[start..start + len].to_vec();
                        map_with(b, op, &mut part);
                        for (k, &p) in part.iter().enumerate() {
                            assert!(same(p, want[start + k]), "{name} {b:?} at {start}+{k}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn situ_backends_and_positions_are_bit_identical() {
        let mut rng = Rng(0x517_0009);
        let mut g = inputs();
        g.truncate(6000);
        let u: Vec<f32> = (0..g.len()).map(|_| rng.uniform(-60.0, 60.0)).collect();
        let want: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&a, &b)| situ_glu_one(a, b, 4.0, 25.0))
            .collect();
        for b in Backend::available() {
            let mut out = vec![0f32; g.len()];
            situ_glu_with(b, &g, &u, 4.0, 25.0, &mut out);
            assert!(out.iter().zip(&want).all(|(&a, &w)| same(a, w)), "{b:?}");
            for (start, len) in [(1usize, 5usize), (3, 16), (7, 33), (40, 1)] {
                let mut part = vec![0f32; len];
                let (gs, us) = (&g[start..start + len], &u[start..start + len]);
                situ_glu_with(b, gs, us, 4.0, 25.0, &mut part);
                let ok = part.iter().zip(&want[start..]).all(|(&a, &w)| same(a, w));
                assert!(ok, "{b:?} at {start}");
            }
        }
        let mut out = vec![0f32; 3];
        situ_glu(&g[..3], &u[..3], 4.0, 25.0, &mut out);
        assert!(out.iter().zip(&want).all(|(&a, &w)| same(a, w)));
    }

    #[test]
    fn special_values() {
        assert_eq!(exp_one(0.0), 1.0);
        assert_eq!(exp_one(-0.0), 1.0);
        assert_eq!(exp_one(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_one(f32::NEG_INFINITY).to_bits(), 0);
        assert!(exp_one(f32::NAN).is_nan());
        assert!(exp_one(88.722_83).is_finite());
        assert_eq!(exp_one(88.722_84), f32::INFINITY);
        assert_eq!(exp_one(1000.0), f32::INFINITY);
        // Gradual underflow: e^-100 ≈ 3.7e-44 is subnormal, e^-104 rounds to 0.
        let sub = exp_one(-100.0);
        assert!(sub > 0.0 && sub < f32::MIN_POSITIVE);
        assert!((sub as f64 / (-100f64).exp() - 1.0).abs() < 0.05);
        assert_eq!(exp_one(-104.5).to_bits(), 0);
        // Around the smallest normal (e^-87.3365 ≈ 2^-126).
        let x = -87.336_54f32;
        assert!((exp_one(x) as f64 / (x as f64).exp() - 1.0).abs() < 2.4e-7);
        assert_eq!(tanh_one(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(tanh_one(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(tanh_one(f32::INFINITY), 1.0);
        assert_eq!(tanh_one(f32::NEG_INFINITY), -1.0);
        assert_eq!(tanh_one(1e-30), 1e-30);
        assert_eq!(tanh_one(-1e-45), -1e-45);
        assert!(tanh_one(f32::NAN).is_nan());
        assert_eq!(sigmoid_one(f32::INFINITY), 1.0);
        assert_eq!(sigmoid_one(f32::NEG_INFINITY), 0.0);
        assert_eq!(sigmoid_one(0.0), 0.5);
        assert!(sigmoid_one(f32::NAN).is_nan());
        assert_eq!(silu_one(0.0), 0.0);
        assert_eq!(silu_one(f32::INFINITY), f32::INFINITY);
    }

    /// Distance in units in the last place of the f32 nearest to `want`.
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        if w == 0.0 {
            return (got as f64 - want).abs() / 1e-45;
        }
        let a = w.abs();
        let ulp = (f32::from_bits(a.to_bits() + 1) - a) as f64;
        (got as f64 - want).abs() / ulp
    }

    /// Maximum ulp error against f64 over a dense sweep of `[lo, hi]` plus random points.
    fn max_ulps(op: Op, lo: f32, hi: f32) -> (f64, f32) {
        let mut rng = Rng(0xacc_u64 << 32 | lo.to_bits() as u64);
        let n = 200_000;
        let mut worst = (0.0f64, 0.0f32);
        let sweep = (0..=n).map(|i| lo + (hi - lo) * (i as f32 / n as f32));
        let random: Vec<f32> = (0..n).map(|_| rng.uniform(lo, hi)).collect();
        for x in sweep.chain(random) {
            let e = ulps(one(op, x), reference(op, x as f64));
            if e > worst.0 {
                worst = (e, x);
            }
        }
        worst
    }

    /// Accuracy over the ranges the model uses (and beyond). Bounds are the measured maxima
    /// rounded up (docs/NUMERICS.md).
    #[test]
    fn accuracy_against_f64() {
        let cases: [(Op, &str, f32, f32, f64); 9] = [
            (Op::Exp, "exp", -87.0, 88.5, 1.0),
            (Op::Exp, "exp", -1.0, 1.0, 1.0),
            (Op::Tanh, "tanh", -10.0, 10.0, 1.5),
            (Op::Tanh, "tanh", -1.0, 1.0, 1.5),
            (Op::Tanh, "tanh", -1e-3, 1e-3, 1.0),
            (Op::Sigmoid, "sigmoid", -80.0, 30.0, 2.5),
            (Op::Sigmoid, "sigmoid", -4.0, 4.0, 2.5),
            (Op::Silu, "silu", -80.0, 30.0, 3.0),
            (Op::Silu, "silu", -4.0, 4.0, 3.0),
        ];
        for (op, name, lo, hi, bound) in cases {
            let (e, x) = max_ulps(op, lo, hi);
            eprintln!("{name} on [{lo}, {hi}]: max {e:.3} ulp at x = {x:e}");
            assert!(e <= bound, "{name} on [{lo}, {hi}]: {e} ulp at {x:e}");
        }
    }
}
