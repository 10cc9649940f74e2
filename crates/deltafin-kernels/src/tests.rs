//! Kernel tests: scalar against f64, every SIMD path against scalar on random ragged shapes,
//! and bit-identity across thread counts and batch widths within each backend.

use crate::dispatch::Backend;
use crate::layout::Image;
use crate::matvec::*;
use crate::prepared::{Epilogue, Kernel, Layout};
use crate::test_shared::{Rng, mxfp4, pool, pools};
use deltafin_tensor::{Bf16Matrix, Mxfp4Matrix, RowInt8Matrix, bf16};

/// The CPU features the x86-64 kernel tests need.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum Cpu {
    /// AVX2 and FMA (the `avx2` backend).
    Avx2,
    /// AVX-512 F/BW/VL and FMA (the `avx512` backend).
    Avx512,
    /// The `avx512` backend with VNNI (the integer-activation tiles).
    Avx512Vnni,
    /// AVX-512 VBMI (the `vpermb` MXFP4 decode).
    Avx512Vbmi,
}

/// Whether this CPU has `feature` for `test`; when it does not, a
/// [`crate::test_skip::skip`]: a SKIP line on stderr, or a failure under the feature's
/// `DELTAFIN_REQUIRE_*` switch (docs/OPERATIONS.md, "Test switches").
#[cfg(target_arch = "x86_64")]
#[track_caller]
fn cpu_has(feature: Cpu, test: &str) -> bool {
    let avx512 = Backend::Avx512.is_supported();
    let (present, switch, what) = match feature {
        Cpu::Avx2 => (Backend::Avx2.is_supported(), "AVX2", "AVX2 + FMA"),
        Cpu::Avx512 => (avx512, "AVX512", "AVX-512 F/BW/VL"),
        Cpu::Avx512Vnni => (
            avx512 && crate::dispatch::vnni_available(),
            "AVX512_VNNI",
            "AVX-512 VNNI",
        ),
        Cpu::Avx512Vbmi => (
            crate::x86::avx512::vbmi_available(),
            "AVX512_VBMI",
            "AVX-512 VBMI",
        ),
    };
    if !present {
        let switch = format!("DELTAFIN_REQUIRE_{switch}");
        crate::test_skip::skip(test, &switch, &format!("this CPU has no {what}"));
    }
    present
}

/// On aarch64 the tests below compare the NEON entries with the scalar ones only when NEON
/// is detected: a failed detection would leave the scalar backend alone, every comparison
/// passing vacuously. A SKIP line, or a failure under `DELTAFIN_REQUIRE_NEON=1`
/// (`tools/ci/aarch64.sh` sets it).
#[cfg(target_arch = "aarch64")]
#[test]
fn neon_backend_is_detected_and_compared() {
    if !Backend::Neon.is_supported() {
        crate::test_skip::skip(
            "neon_backend_is_detected_and_compared",
            "DELTAFIN_REQUIRE_NEON",
            "this CPU reports no NEON",
        );
        return;
    }
    assert_eq!(Backend::available(), [Backend::Neon, Backend::Scalar]);
    assert_eq!(Backend::detect(), Backend::Neon);
    let rng = &mut Rng(0xae64);
    let m = Mats::new(rng, 3, 64);
    for w in m.all() {
        let names: Vec<&str> = entries_for(&w).iter().map(|k| k.name).collect();
        assert!(
            names.iter().any(|n| n.ends_with("/neon")) && names.len() == 2,
            "{}: entries {names:?}",
            w.dtype()
        );
    }
}

/// The optional Armv8 features of this CPU are the ones `DELTAFIN_AARCH64_EXPECT_FEATURES`
/// names (a comma list of `dotprod`, `i8mm`, `bf16`, or `none`), so each qemu CPU model of
/// `tools/ci/aarch64.sh` is known to have run with (`max`) or without (`cortex-a72`) them.
/// Unset, the features are only printed.
#[cfg(target_arch = "aarch64")]
#[test]
fn aarch64_cpu_features_are_the_expected_ones() {
    let found: Vec<&str> = [
        (
            "dotprod",
            std::arch::is_aarch64_feature_detected!("dotprod"),
        ),
        ("i8mm", std::arch::is_aarch64_feature_detected!("i8mm")),
        ("bf16", std::arch::is_aarch64_feature_detected!("bf16")),
    ]
    .into_iter()
    .filter_map(|(name, present)| present.then_some(name))
    .collect();
    let found = if found.is_empty() {
        "none".to_string()
    } else {
        found.join(",")
    };
    eprintln!("aarch64 optional features: {found}");
    if let Ok(want) = std::env::var("DELTAFIN_AARCH64_EXPECT_FEATURES") {
        assert_eq!(found, want, "the CPU's optional features");
    }
}

/// `got` equals `want` bit for bit (NaNs included); the failure names `what` and the first
/// value that differs.
#[track_caller]
pub(crate) fn assert_bits(what: impl std::fmt::Display, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: value {i}: {} vs {}", got[i], want[i]);
    }
}

/// Owned weights of every format with the same shape.
struct Mats {
    f32: Vec<f32>,
    bf16: Bf16Matrix,
    i8: RowInt8Matrix,
    mx: Option<Mxfp4Matrix>,
    rows: usize,
    cols: usize,
}

impl Mats {
    fn new(rng: &mut Rng, rows: usize, cols: usize) -> Mats {
        let f32 = rng.vec(rows * cols);
        let bv: Vec<bf16> = f32.iter().map(|&v| bf16::from_f32(v)).collect();
        let bf16 = Bf16Matrix::from_values(rows, cols, &bv).unwrap();
        let i8 = RowInt8Matrix::quantize("t", rows, cols, &f32).unwrap();
        let mx = cols.is_multiple_of(32).then(|| mxfp4(rng, rows, cols));
        Mats {
            f32,
            bf16,
            i8,
            mx,
            rows,
            cols,
        }
    }

    /// [`Mats::new`], then `n` activation rows of `cols`.
    fn with_input(rng: &mut Rng, rows: usize, cols: usize, n: usize) -> (Mats, Vec<f32>) {
        let m = Mats::new(rng, rows, cols);
        (m, rng.vec(n * cols))
    }

    fn all(&self) -> Vec<Weights<'_>> {
        let mut v = vec![
            Weights::F32 {
                data: &self.f32,
                rows: self.rows,
                cols: self.cols,
            },
            Weights::Bf16(&self.bf16),
            Weights::RowInt8(&self.i8),
        ];
        if let Some(m) = &self.mx {
            v.push(Weights::Mxfp4(m));
        }
        v
    }
}

/// Row `r` of `w` as f64 values.
fn row_f64(w: &Weights<'_>, r: usize) -> Vec<f64> {
    let cols = w.cols();
    let mut out = vec![0f32; cols];
    match w {
        Weights::F32 { data, .. } => out.copy_from_slice(&data[r * cols..(r + 1) * cols]),
        Weights::Bf16(m) => out
            .iter_mut()
            .zip(m.row(r))
            .for_each(|(o, v)| *o = v.to_f32()),
        Weights::RowInt8(m) => m.dequantize_row(r, &mut out),
        Weights::Mxfp4(m) => m.dequantize_row(r, &mut out),
    }
    out.into_iter().map(f64::from).collect()
}

/// Exact product in f64 and `Σ |w x|` per output value (the scale of f32 rounding error).
fn reference(w: &Weights<'_>, xs: &[f32], n: usize) -> (Vec<f64>, Vec<f64>) {
    let (rows, cols) = (w.rows(), w.cols());
    let mut want = vec![0f64; n * rows];
    let mut mag = vec![0f64; n * rows];
    for r in 0..rows {
        let wr = row_f64(w, r);
        for b in 0..n {
            for c in 0..cols {
                let p = wr[c] * xs[b * cols + c] as f64;
                want[b * rows + r] += p;
                mag[b * rows + r] += p.abs();
            }
        }
    }
    (want, mag)
}

/// Every table entry this CPU runs for weights of `w`'s format (both MXFP4 activation
/// formats where the CPU has both, whatever the installed setting).
fn entries_for(w: &Weights<'_>) -> Vec<&'static Kernel> {
    let prefix = format!("{}/", w.dtype());
    Backend::available()
        .into_iter()
        .flat_map(|be| crate::table::isa(be).entries())
        .filter(|k| k.name.starts_with(&prefix))
        .collect()
}

/// The product by table entry `k` (`ys` overwritten).
fn run_entry(k: &'static Kernel, w: Weights<'_>, xs: &[f32], n: usize, ys: &mut [f32]) {
    crate::matvec::product_with(k, w, xs, n, ys, Epilogue::Store);
}

/// The activation-quantisation error bound of entry `k` per output value (0 for f32
/// activations): row-int8 on the q16 image `Σ_c |w_rc| · absmax(x_b) / 65534` (half a step
/// of `absmax/32767`), MXFP4 on the q8x3 image one fine step per column (`Q8X3_DIV`).
fn quant_bound(k: &Kernel, w: &Weights<'_>, xs: &[f32], n: usize) -> Vec<f64> {
    let (rows, cols) = (w.rows(), w.cols());
    let mut out = vec![0f64; n * rows];
    match k.layout {
        Layout::Mxfp4Q8x3 => return block_bound(w, xs, n, Q8X3_DIV),
        Layout::RowInt8Q16 => {}
        _ => return out,
    }
    for r in 0..rows {
        let wabs: f64 = row_f64(w, r).iter().map(|v| v.abs()).sum();
        for b in 0..n {
            let absmax = xs[b * cols..(b + 1) * cols]
                .iter()
                .fold(0f64, |m, &v| m.max(v.abs() as f64));
            out[b * rows + r] = wabs * absmax / 65534.0;
        }
    }
    out
}

/// `Σ_c |W_rc| · absmax_blk(c)(x_b) / div` per output value (32-column blocks).
fn block_bound(w: &Weights<'_>, xs: &[f32], n: usize, div: f64) -> Vec<f64> {
    let (rows, cols) = (w.rows(), w.cols());
    let mut out = vec![0f64; n * rows];
    for r in 0..rows {
        let wr = row_f64(w, r);
        for b in 0..n {
            let x = &xs[b * cols..(b + 1) * cols];
            let mut bound = 0f64;
            for (wb, xb) in wr.chunks(32).zip(x.chunks(32)) {
                let absmax = xb.iter().fold(0f64, |m, &v| m.max(v.abs() as f64));
                bound += wb.iter().map(|v| v.abs()).sum::<f64>() * absmax / div;
            }
            out[b * rows + r] = bound;
        }
    }
    out
}

fn assert_close(what: &str, got: &[f32], want: &[f64], mag: &[f64], rel: f64) {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = rel * mag[i] + 1e-37;
        assert!(
            (g as f64 - w).abs() <= tol,
            "{what}: value {i}: got {g}, want {w}, tol {tol}"
        );
    }
}

#[test]
fn every_backend_matches_f64_on_ragged_shapes() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut shapes = vec![
        (1, 1, 1),
        (7, 13, 3),
        (3, 64, 5),
        (33, 96, 4),
        (9, 1000, 2),
        (5, 1120, 6),
    ];
    for _ in 0..24 {
        let cols = if rng.below(2) == 0 {
            1 + rng.below(300)
        } else {
            32 * (1 + rng.below(10))
        };
        shapes.push((1 + rng.below(40), cols, 1 + rng.below(9)));
    }
    for &(rows, cols, n) in &shapes {
        let (m, xs) = Mats::with_input(&mut rng, rows, cols, n);
        for w in m.all() {
            let (want, mag) = reference(&w, &xs, n);
            let mut scalar = vec![0f32; n * rows];
            matmul_with(Backend::Scalar, w, &xs, n, &mut scalar);
            for k in entries_for(&w) {
                let mut ys = vec![f32::NAN; n * rows];
                run_entry(k, w, &xs, n, &mut ys);
                let what = format!("{} [{rows}x{cols}] n={n}", k.name);
                // f32 accumulation: error ≲ (terms per lane + reduction depth)·eps·Σ|w x|.
                // AVX-512 (VNNI) and AVX2 row-int8 quantise activations to int16 (q16): at most
                // half a step, absmax(x)/65534, per value, i.e. Σ|w|·absmax(x)/65534; AVX-512
                // VNNI MXFP4 to q8x3 per 32-column block: one fine step per column.
                let q16 = quant_bound(k, &w, &xs, n);
                let mag: Vec<f64> = mag.iter().zip(&q16).map(|(m, q)| m + q * 1e5).collect();
                assert_close(&what, &ys, &want, &mag, 1e-5);
                // SIMD against the scalar reference: both within f32 rounding of each other.
                for (i, (&a, &s)) in ys.iter().zip(&scalar).enumerate() {
                    let tol = 2e-5 * mag[i] + 1e-37;
                    assert!(
                        ((a - s) as f64).abs() <= tol,
                        "{what}: vs scalar at {i}: {a} vs {s}"
                    );
                }
            }
        }
    }
}

#[test]
fn bit_identical_across_threads_and_batch_widths() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    // Large enough to be split over threads: rows·cols·n well above the parallel threshold.
    let (rows, cols, n) = (301, 544, 7);
    let (m, xs) = Mats::with_input(&mut rng, rows, cols, n);
    let pools = pools();
    for w in m.all() {
        for k in entries_for(&w) {
            let what = k.name;
            let run = |pool: &rayon::ThreadPool, xs: &[f32], n: usize| {
                let mut ys = vec![0f32; n * rows];
                pool.install(|| run_entry(k, w, xs, n, &mut ys));
                ys
            };
            let base = run(&pools[0], &xs, n);
            for p in &pools[1..] {
                let threads = p.current_num_threads();
                assert_bits(
                    format!("{what} on {threads} threads"),
                    &run(p, &xs, n),
                    &base,
                );
            }
            // Every batch width 1..=n, and each row alone, give the same bits.
            for width in 1..=n {
                let part = run(&pools[1], &xs[..width * cols], width);
                assert_bits(
                    format!("{what} width {width}"),
                    &part,
                    &base[..width * rows],
                );
            }
            for b in 0..n {
                let single = run(&pools[1], &xs[b * cols..(b + 1) * cols], 1);
                let want = &base[b * rows..(b + 1) * rows];
                assert_bits(format!("{what} row {b} alone"), &single, want);
            }
            // The fused accumulate applies `y + α·v` to the very same product values.
            let alpha = rng.vec(n);
            let y0 = rng.vec(n * rows);
            let mut acc = y0.clone();
            pools[1].install(|| {
                crate::matvec::product_with(k, w, &xs, n, &mut acc, Epilogue::Axpy(&alpha))
            });
            let want: Vec<f32> = (0..n * rows)
                .map(|i| y0[i] + alpha[i / rows] * base[i])
                .collect();
            assert_bits(format!("{what}: axpy"), &acc, &want);
        }
    }
}

/// Batch composition (issue: several conversations at once): a row's product does not depend
/// on which other rows share its batch, their number, their order or the thread split.
/// Random compositions drawn from a pool of rows — repeats, any order, widths 1–12 — give
/// each row exactly the bits of that row alone, for every table entry of every format.
#[test]
fn any_batch_composition_gives_each_row_its_solo_bits() {
    let mut rng = Rng(0xc0de_ba7c_4e55_0001);
    let (rows, cols, pool_rows) = (131, 352, 10);
    let (m, pool) = Mats::with_input(&mut rng, rows, cols, pool_rows);
    let pools = pools();
    for w in m.all() {
        for k in entries_for(&w) {
            let run = |p: &rayon::ThreadPool, xs: &[f32], n: usize| {
                let mut ys = vec![0f32; n * rows];
                p.install(|| run_entry(k, w, xs, n, &mut ys));
                ys
            };
            let solo: Vec<Vec<f32>> = (0..pool_rows)
                .map(|b| run(&pools[0], &pool[b * cols..(b + 1) * cols], 1))
                .collect();
            for trial in 0..12 {
                let n = 1 + rng.below(12);
                let pick: Vec<usize> = (0..n).map(|_| rng.below(pool_rows)).collect();
                let xs: Vec<f32> = pick
                    .iter()
                    .flat_map(|&b| pool[b * cols..(b + 1) * cols].iter().copied())
                    .collect();
                let p = &pools[trial % pools.len()];
                let ys = run(p, &xs, n);
                for (i, &b) in pick.iter().enumerate() {
                    assert_bits(
                        format!(
                            "{} trial {trial}: row {b} at {i} of {n} on {} threads",
                            k.name,
                            p.current_num_threads()
                        ),
                        &ys[i * rows..(i + 1) * rows],
                        &solo[b],
                    );
                }
            }
        }
    }
}

/// Members reading the same input share one activation image per layout (a layer's
/// projections of one normalised state); every value still equals the member's own product,
/// for decode widths (guided scheduling) and a batched one, on 1–3 threads.
#[test]
fn group_members_sharing_an_input_equal_separate_products() {
    let mut rng = Rng(0x5aa3_d00d_0001);
    let cols = 320;
    let mats: Vec<Mats> = [97, 64, 130, 33]
        .iter()
        .map(|&r| Mats::new(&mut rng, r, cols))
        .collect();
    let pools = pools();
    for be in Backend::available() {
        for n in [1, 2, 5] {
            let x = rng.vec(n * cols);
            let other = rng.vec(n * cols);
            // Every format of every matrix; all but the last member read `x`.
            let ws: Vec<Weights<'_>> = mats.iter().flat_map(|m| m.all()).collect();
            let input = |i: usize| -> &[f32] { if i + 1 == ws.len() { &other } else { &x } };
            let want: Vec<Vec<f32>> = ws
                .iter()
                .enumerate()
                .map(|(i, w)| {
                    let mut ys = vec![0f32; n * w.rows()];
                    matmul_with(be, *w, input(i), n, &mut ys);
                    ys
                })
                .collect();
            for pool in &pools {
                let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; n * w.rows()]).collect();
                let mut group: Vec<GroupProduct<'_>> = ws
                    .iter()
                    .zip(outs.iter_mut())
                    .enumerate()
                    .map(|(i, (w, ys))| GroupProduct {
                        w: *w,
                        xs: input(i),
                        n,
                        ys,
                    })
                    .collect();
                pool.install(|| matmul_group_with(be, &mut group));
                drop(group);
                for (i, (got, want)) in outs.iter().zip(&want).enumerate() {
                    let threads = pool.current_num_threads();
                    let what = format!("{} n={n} threads={threads} member {i}", be.name());
                    assert_bits(
                        format!("{what} ({}) in the group", ws[i].dtype()),
                        got,
                        want,
                    );
                }
            }
        }
    }
}

#[test]
fn group_equals_separate_products() {
    let mut rng = Rng(0x0005_eed0_f6a0);
    // Members of different formats, shapes and batch widths; one with no activation rows.
    let shapes = [
        (301, 544, 3),
        (40, 96, 1),
        (129, 320, 5),
        (3, 64, 0),
        (17, 33, 4),
    ];
    let mats: Vec<Mats> = shapes
        .iter()
        .map(|&(r, c, _)| Mats::new(&mut rng, r, c))
        .collect();
    let pools = pools();
    for be in Backend::available() {
        for pick in 0..4 {
            let ws: Vec<Weights<'_>> = mats
                .iter()
                .map(|m| {
                    let all = m.all();
                    all[pick.min(all.len() - 1)]
                })
                .collect();
            let inputs: Vec<(Vec<f32>, usize)> = ws
                .iter()
                .zip(&shapes)
                .map(|(w, &(_, _, n))| (rng.vec(n * w.cols()), n))
                .collect();
            let want: Vec<Vec<f32>> = ws
                .iter()
                .zip(&inputs)
                .map(|(w, (xs, n))| {
                    let mut ys = vec![0f32; n * w.rows()];
                    matmul_with(be, *w, xs, *n, &mut ys);
                    ys
                })
                .collect();
            for pool in &pools {
                let mut outs: Vec<Vec<f32>> = ws
                    .iter()
                    .zip(&inputs)
                    .map(|(w, (_, n))| vec![0f32; n * w.rows()])
                    .collect();
                let mut group: Vec<GroupProduct<'_>> = ws
                    .iter()
                    .zip(&inputs)
                    .zip(outs.iter_mut())
                    .map(|((w, (xs, n)), ys)| GroupProduct {
                        w: *w,
                        xs,
                        n: *n,
                        ys,
                    })
                    .collect();
                pool.install(|| matmul_group_with(be, &mut group));
                drop(group);
                for (i, (got, want)) in outs.iter().zip(&want).enumerate() {
                    let what = format!("{} member {i} ({}) in the group", be.name(), ws[i].dtype());
                    assert_bits(what, got, want);
                }
            }
        }
    }
}

#[test]
fn public_wrappers_use_the_selected_backend() {
    let mut rng = Rng(77);
    let m = Mats::new(&mut rng, 40, 96);
    let x = rng.vec(96);
    let be = crate::settings::backend();
    let mut a = vec![0f32; 40];
    let mut b = vec![0f32; 40];
    matvec_bf16(&m.bf16, &x, &mut a);
    matmul_with(be, Weights::Bf16(&m.bf16), &x, 1, &mut b);
    assert_eq!(a, b);
    matvec_rowint8(&m.i8, &x, &mut a);
    matmul_with(be, Weights::RowInt8(&m.i8), &x, 1, &mut b);
    assert_eq!(a, b);
    let mx = m.mx.as_ref().unwrap();
    matvec_mxfp4(mx, &x, &mut a);
    matmul_with(be, Weights::Mxfp4(mx), &x, 1, &mut b);
    assert_eq!(a, b);
    matvec_f32(&m.f32, 40, 96, &x, &mut a);
    matmul_with(
        be,
        Weights::F32 {
            data: &m.f32,
            rows: 40,
            cols: 96,
        },
        &x,
        1,
        &mut b,
    );
    assert_eq!(a, b);
    assert_eq!(crate::kernel_backend(), be.name());
    assert!(crate::kernel_summary().starts_with(&format!("kernels={}", be.name())));
}

#[test]
fn rowint8_product_uses_stored_f16_scale() {
    // absmax 3 → scale 3/127, not representable in f16: the kernel must use the stored value.
    let vals = [3.0f32, -1.0, 0.5, 2.0];
    let m = RowInt8Matrix::quantize("w", 1, 4, &vals).unwrap();
    let x = [1.0f32, 1.0, 1.0, 1.0];
    let q: Vec<f32> = m.row(0).iter().map(|&q| q as f32).collect();
    let want = m.scales()[0].to_f32() * q.iter().sum::<f32>();
    for be in Backend::available() {
        let mut y = [0f32];
        matmul_with(be, Weights::RowInt8(&m), &x, 1, &mut y);
        assert_eq!(y[0], want, "{}", be.name());
    }
}

#[test]
#[should_panic(expected = "input length")]
fn shape_mismatch_panics() {
    let w = Bf16Matrix::from_values(2, 3, &[bf16::ZERO; 6]).unwrap();
    let mut y = [0f32; 2];
    matvec_bf16(&w, &[0.0; 4], &mut y);
}

/// On a VNNI machine the AVX-512 row-int8 product takes the q16 path; the plain f32 kernel
/// (used by AVX-512 CPUs without VNNI) is checked here directly against the scalar one.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_int8_f32_kernel_matches_scalar() {
    if !cpu_has(Cpu::Avx512, "avx512_int8_f32_kernel_matches_scalar") {
        return;
    }
    let mut rng = Rng(0xa5a5_1234);
    for cols in [1usize, 15, 16, 17, 63, 64, 65, 200, 513, 1000] {
        let w: Vec<i8> = (0..cols)
            .map(|_| (rng.below(255) as i32 - 127) as i8)
            .collect();
        let x0 = rng.vec(cols);
        let x1 = rng.vec(cols);
        // SAFETY: AVX-512 checked above; rows have `cols` values.
        let got = unsafe { crate::x86::avx512::dot_i8(&w, [&x0, &x1]) };
        let want = crate::scalar::dot_i8(&w, [&x0, &x1]);
        for b in 0..2 {
            let x = if b == 0 { &x0 } else { &x1 };
            let mag: f32 = w
                .iter()
                .zip(x.iter())
                .map(|(&q, &v)| (q as f32 * v).abs())
                .sum();
            assert!(
                (got[b] - want[b]).abs() <= 2e-5 * mag + 1e-30,
                "cols {cols} row {b}: {} vs {}",
                got[b],
                want[b]
            );
        }
    }
}

/// Activation rows with an all-zero block, a block of wildly different magnitude and ties
/// (values on exact half steps) now and then.
fn q8_activations(rng: &mut Rng, n: usize, cols: usize) -> Vec<f32> {
    let mut xs: Vec<f32> = rng.vec(n * cols);
    for row in xs.chunks_mut(cols) {
        for blk in row.chunks_mut(32) {
            match rng.below(6) {
                0 => blk.fill(0.0),
                1 => blk.iter_mut().for_each(|v| *v *= 1e4),
                2 => {
                    // absmax 127 → d = 1: k + 0.5 lies exactly on a tie.
                    blk[0] = 127.0;
                    for (i, v) in blk.iter_mut().enumerate().skip(1) {
                        *v = (i as f32 - 16.0) + 0.5;
                    }
                }
                _ => {}
            }
        }
    }
    xs
}

/// The AVX-512 f32-activation MXFP4 kernel (the `mxfp4_act = f32` setting, and every
/// AVX-512 CPU without VNNI) checked directly against the scalar one.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_mxfp4_f32_kernel_matches_scalar() {
    if !cpu_has(Cpu::Avx512, "avx512_mxfp4_f32_kernel_matches_scalar") {
        return;
    }
    let rows = 4;
    let mut rng = Rng(0x3141_5926);
    for cols in [32usize, 64, 96, 128, 160, 256, 352, 1024] {
        let m = mxfp4(&mut rng, rows, cols);
        let w = Weights::Mxfp4(&m);
        let xs = rng.vec(2 * cols);
        let img = crate::layout::mxfp4_f32_image(&xs, cols, cols / 128);
        let (_, mag) = reference(&w, &xs, 2);
        for r in 0..rows {
            let (p, s) = (m.packed_row(r), m.scales_row(r));
            // SAFETY: AVX-512 checked above; image rows have `cols` values.
            let got = unsafe {
                crate::x86::avx512::dot_mxfp4(p, s, [&img[..cols], &img[cols..2 * cols]])
            };
            let want = crate::scalar::dot_mxfp4(p, s, [&xs[..cols], &xs[cols..]]);
            for b in 0..2 {
                let tol = 2e-5 * mag[b * rows + r] + 1e-37;
                assert!(
                    ((got[b] - want[b]) as f64).abs() <= tol,
                    "cols {cols} row {r} b {b}: {} vs {}",
                    got[b],
                    want[b]
                );
            }
        }
    }
}

#[test]
fn summary_names_the_mxfp4_activation_format_in_use() {
    let summary = crate::kernel_summary();
    let want = crate::settings::current().mxfp4_act_in_use().name();
    assert!(summary.contains(&format!("mxfp4_act={want}")), "{summary}");
}

/// The register-tiled batched products (`tile.rs`): every value of a batched product equals
/// the single-row decode product bit for bit, whatever the batch width (1..=20, so every
/// tile shape and ragged edge occurs), the row range a thread gets and the thread count;
/// and the values stay within f32 rounding of the exact product.
mod tiled {
    use super::*;

    /// Each activation row alone, as decode computes it (`n = 1`, calling thread only).
    fn single_rows(be: Backend, w: Weights<'_>, xs: &[f32], n: usize) -> Vec<f32> {
        let (rows, cols) = (w.rows(), w.cols());
        let pool = pool(1);
        let mut ys = vec![0f32; n * rows];
        for b in 0..n {
            pool.install(|| {
                matmul_with(
                    be,
                    w,
                    &xs[b * cols..(b + 1) * cols],
                    1,
                    &mut ys[b * rows..(b + 1) * rows],
                )
            });
        }
        ys
    }

    #[test]
    fn batched_equals_single_row_bit_for_bit_on_random_shapes() {
        let mut rng = Rng(0x7117_ed00_5eed_0001);
        let pools = pools();
        // Ragged columns (partial 32-column groups, fewer than one group), odd row counts
        // (a 1-row tile at the end of each range), and shapes above the parallel threshold.
        let shapes = [
            (1, 1),
            (3, 31),
            (5, 33),
            (17, 64),
            (33, 95),
            (130, 257),
            (67, 1030),
        ];
        for &(rows, cols) in &shapes {
            let m = Mats::new(&mut rng, rows, cols);
            let nmax = 20;
            let xs: Vec<f32> = (0..nmax * cols).map(|_| rng.f() * 4.0).collect();
            for be in Backend::available() {
                for w in [Weights::Bf16(&m.bf16), Weights::RowInt8(&m.i8)] {
                    let what = format!("{} {} {rows}x{cols}", be.name(), w.dtype());
                    let single = single_rows(be, w, &xs, nmax);
                    for n in 1..=nmax {
                        for pool in &pools {
                            let mut ys = vec![0f32; n * rows];
                            pool.install(|| matmul_with(be, w, &xs[..n * cols], n, &mut ys));
                            let threads = pool.current_num_threads();
                            let at = format!("{what}: n={n}, {threads} threads ({rows} per row)");
                            assert_bits(at, &ys, &single[..n * rows]);
                        }
                    }
                    // Against the exact product: f32 rounding of Σ|w·x| (plus the int16
                    // activation bound of the VNNI row-int8 path).
                    let n = 9;
                    let mut ys = vec![0f32; n * rows];
                    pools[1].install(|| matmul_with(be, w, &xs[..n * cols], n, &mut ys));
                    let (want, mag) = reference(&w, &xs[..n * cols], n);
                    let k = crate::table::isa(be).kernel(&w, crate::settings::current().mxfp4_act);
                    let q = quant_bound(k, &w, &xs[..n * cols], n);
                    for (i, &g) in ys.iter().enumerate() {
                        let tol = 1e-5 * mag[i] + 2.0 * q[i] + 1e-30;
                        assert!(
                            (g as f64 - want[i]).abs() <= tol,
                            "{what}: value {i}: got {g}, want {}, tol {tol}",
                            want[i]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn batched_matches_scalar_within_tolerance() {
        let mut rng = Rng(0x7117_ed00_5eed_0002);
        let (rows, cols, n) = (45, 1000, 13);
        let (m, xs) = Mats::with_input(&mut rng, rows, cols, n);
        let w = Weights::Bf16(&m.bf16);
        let mut want = vec![0f32; n * rows];
        matmul_with(Backend::Scalar, w, &xs, n, &mut want);
        let (_, mag) = reference(&w, &xs, n);
        for be in Backend::available() {
            let mut got = vec![0f32; n * rows];
            matmul_with(be, w, &xs, n, &mut got);
            let want64: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
            assert_close(
                &format!("{} bf16 vs scalar", be.name()),
                &got,
                &want64,
                &mag,
                2e-6,
            );
        }
    }
}

#[test]
fn serial_product_equals_parallel_product() {
    let mut rng = Rng(0x5e71_a10d);
    // Large enough that `matmul` forks (rows × cols × n above the parallel threshold).
    let mats = Mats::new(&mut rng, 300, 256);
    let pool = pool(3);
    for w in mats.all() {
        for n in [1usize, 2, 5] {
            let xs = rng.vec(n * w.cols());
            let mut want = vec![0f32; n * w.rows()];
            pool.install(|| matmul(w, &xs, n, &mut want));
            let mut got = vec![f32::NAN; n * w.rows()];
            pool.install(|| matmul_serial(w, &xs, n, &mut got));
            assert_bits(format!("{} n={n} serial", w.dtype()), &got, &want);
        }
    }
}

/// The KDA step written out as plain scalar loops (the form it replaced in `deltafin-k3`).
fn kda_step_scalar(s: &mut [f32], [q, k, v, g]: [&[f32]; 4], beta: f32, o: &mut [f32]) {
    let d = q.len();
    let mut u = v.to_vec();
    for r in 0..d {
        let alpha = crate::vmath::exp_one(g[r]);
        for c in 0..d {
            s[r * d + c] *= alpha;
            u[c] -= k[r] * s[r * d + c];
        }
    }
    for x in u.iter_mut() {
        *x *= beta;
    }
    for r in 0..d {
        for c in 0..d {
            s[r * d + c] += k[r] * u[c];
            o[c] += q[r] * s[r * d + c];
        }
    }
}

#[test]
fn kda_delta_step_is_bit_identical_to_scalar_loops() {
    let mut rng = Rng(0x0cda_5eed);
    for d in [1usize, 7, 16, 33, 128] {
        let mut s: Vec<f32> = rng.vec(d * d);
        let mut s_ref = s.clone();
        let mut o = vec![0f32; d];
        let mut o_ref = vec![0f32; d];
        let mut u = vec![0f32; d];
        for _step in 0..3 {
            let q = rng.vec(d);
            let k = rng.vec(d);
            let v = rng.vec(d);
            let g: Vec<f32> = (0..d).map(|_| -rng.f().abs()).collect();
            let beta = 0.5 + 0.25 * rng.f();
            crate::ops::kda_delta_step(&mut s, &q, &k, &v, &g, beta, &mut u, &mut o);
            kda_step_scalar(&mut s_ref, [&q, &k, &v, &g], beta, &mut o_ref);
            assert_bits(format!("d={d}: state"), &s, &s_ref);
            assert_bits(format!("d={d}: output"), &o, &o_ref);
        }
    }
}

/// The AVX-512 and AVX2 q16 block quantisers equal the portable one bit for bit: random blocks of
/// every length 1..=256, values that divide to exact halves (ties), zeros, and non-finite
/// values.
#[test]
fn q16_block_simd_equals_scalar() {
    use crate::layout::q16_block_scalar;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut cases: Vec<Vec<f32>> = Vec::new();
    for len in 1..=256usize {
        cases.push((0..len).map(|_| rng.f() * 4.0).collect());
    }
    // absmax 32767 makes the scale 1, so k + 0.5 are exact ties.
    let mut ties: Vec<f32> = (0..200).map(|k| k as f32 - 99.5).collect();
    ties.push(32767.0);
    cases.push(ties);
    cases.push(vec![0.0; 37]);
    cases.push(vec![-0.0, 0.0, -0.0]);
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut v: Vec<f32> = rng.vec(70);
        v[41] = bad;
        cases.push(v);
    }
    #[cfg(target_arch = "x86_64")]
    let (avx512, avx2) = (
        cpu_has(Cpu::Avx512, "q16_block_simd_equals_scalar (AVX-512)"),
        cpu_has(Cpu::Avx2, "q16_block_simd_equals_scalar (AVX2)"),
    );
    for case in &cases {
        let mut b = vec![0i16; case.len()];
        let sb = q16_block_scalar(case, &mut b);
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            let mut a = vec![0i16; case.len()];
            // SAFETY: AVX-512 F/BW/VL are present (checked above).
            let sa = unsafe { crate::x86::avx512::q16_block(case, &mut a) };
            assert_eq!(
                sa.to_bits(),
                sb.to_bits(),
                "avx512 scale, len {}",
                case.len()
            );
            assert_eq!(a, b, "avx512 codes, len {}", case.len());
        }
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            let mut c = vec![0i16; case.len()];
            // SAFETY: AVX2 and FMA are present (checked above).
            let sc = unsafe { crate::x86::avx2::q16_block(case, &mut c) };
            assert_eq!(sc.to_bits(), sb.to_bits(), "avx2 scale, len {}", case.len());
            assert_eq!(c, b, "avx2 codes, len {}", case.len());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (sb, &b);
    }
}

/// Every value of a register tile's rows `r0…` equals the wanted bits (`want[row][b]`).
#[cfg(target_arch = "x86_64")]
fn assert_tile_bits(want: &[Vec<f32>], r0: usize, got: &[Vec<f32>], what: &str) {
    for (i, gr) in got.iter().enumerate() {
        assert_bits(
            format!("{what} row {}", r0 + i),
            gr,
            &want[r0 + i][..gr.len()],
        );
    }
}

/// `$run!(NR, NB)` for every MXFP4 register-tile shape the products use (1–3 weight rows ×
/// 1–4 activation rows; 3 × 3 does not occur).
#[cfg(target_arch = "x86_64")]
macro_rules! each_tile_shape {
    ($run:ident) => {
        $run!(1, 1);
        $run!(1, 2);
        $run!(1, 3);
        $run!(1, 4);
        $run!(2, 1);
        $run!(2, 2);
        $run!(2, 3);
        $run!(2, 4);
        $run!(3, 1);
        $run!(3, 2);
        $run!(3, 4);
    };
}

/// The MXFP4 tiles' prefetch distance is a whole number of tiles and at least the shared
/// distance, so each row's prefetch lands on the same column of a later tile's row.
#[cfg(target_arch = "x86_64")]
#[test]
fn mxfp4_tile_prefetch_distance_is_whole_tiles() {
    use crate::x86::avx512_q8x3::{MXFP4_PREFETCH_BYTES as PREFETCH_BYTES, tile_prefetch_distance};
    for cols in [32, 512, 1024, 2048, 7168] {
        for nr in 1..=3 {
            // Packed bytes of `nr` rows: 16 per 32-column block.
            let tile = nr * 16 * (cols / 32);
            let d = tile_prefetch_distance(tile);
            assert_eq!(d % tile, 0, "cols {cols} nr {nr}: {d}");
            assert!(d >= PREFETCH_BYTES, "cols {cols} nr {nr}: {d}");
            assert!(d < PREFETCH_BYTES + tile, "cols {cols} nr {nr}: {d}");
        }
    }
    assert_eq!(tile_prefetch_distance(2 * 3584), 7168);
    assert_eq!(tile_prefetch_distance(2 * 512), 6144);
    assert_eq!(tile_prefetch_distance(3 * 1024), 6144);
    assert_eq!(tile_prefetch_distance(2 * 2048), 8192);
}

/// Every value of the q8x3 MXFP4 product (the AVX-512 VNNI table entry, whatever the installed
/// setting) equals the entry's scalar reference on the q8x3 image bit for bit, for ragged
/// shapes, batch widths 1…16 and 1–3 threads.
#[cfg(target_arch = "x86_64")]
#[test]
fn mxfp4_q8x3_products_equal_scalar_reference_across_batches_and_threads() {
    if !cpu_has(
        Cpu::Avx512Vnni,
        "mxfp4_q8x3_products_equal_scalar_reference_across_batches_and_threads",
    ) {
        return;
    }
    let Some(k) = crate::table::isa(Backend::Avx512).mxfp4_q8x3.as_ref() else {
        panic!("the AVX-512 VNNI table has no q8x3 entry");
    };
    let Some(reference) = k.reference else {
        panic!("{}: no scalar reference", k.name);
    };
    let mut rng = Rng(0x0016_0016_7777);
    let pools = pools();
    for (rows, cols) in [
        (1usize, 32usize),
        (5, 96),
        (7, 160),
        (37, 416),
        (64, 1056),
        (130, 544),
        // Whole groups of 16 blocks: one-row products take the two-row q8x3 kernel.
        (33, 512),
        (6, 1024),
    ] {
        let m = mxfp4(&mut rng, rows, cols);
        let w = Weights::Mxfp4(&m);
        let raw = crate::weights::Raw::of(w);
        let nmax = 16;
        let xs = q8_activations(&mut rng, nmax, cols);
        let (img, base, stride) = (k.prepare)(&xs, cols);
        let want: Vec<f32> = (0..nmax * rows)
            .map(|i| {
                let (b, r) = (i / rows, i % rows);
                reference(raw, r, &img[base + b * stride..base + (b + 1) * stride])
            })
            .collect();
        for n in 1..=nmax {
            for (t, pool) in pools.iter().enumerate() {
                let mut ys = vec![f32::NAN; n * rows];
                pool.install(|| run_entry(k, w, &xs[..n * cols], n, &mut ys));
                let what = format!("[{rows}x{cols}] n {n} threads {}", t + 1);
                assert_bits(what, &ys, &want[..n * rows]);
            }
        }
    }
}

/// Entries with a scalar reference (the scalar entries are their own, the q8x3 entry has
/// the model of its integer arithmetic) equal it on every value; every ISA this CPU runs has
/// an entry for every weight format.
#[test]
fn entries_with_a_reference_equal_it() {
    let mut rng = Rng(0x7ab1_e000_0001);
    let m = Mats::new(&mut rng, 37, 416);
    let n = 5;
    let xs = q8_activations(&mut rng, n, 416);
    for w in m.all() {
        for k in entries_for(&w) {
            let Some(reference) = k.reference else {
                continue;
            };
            let raw = crate::weights::Raw::of(w);
            let (img, base, stride) = (k.prepare)(&xs, w.cols());
            let mut ys = vec![f32::NAN; n * w.rows()];
            run_entry(k, w, &xs, n, &mut ys);
            let want: Vec<f32> = (0..n * w.rows())
                .map(|i| {
                    let (b, r) = (i / w.rows(), i % w.rows());
                    reference(raw, r, &img[base + b * stride..base + (b + 1) * stride])
                })
                .collect();
            assert_bits(k.name, &ys, &want);
        }
    }
    for be in Backend::available() {
        let isa = crate::table::isa(be);
        assert!(isa.entries().all(|k| k.backend == be));
        for w in m.all() {
            assert!(
                entries_for(&w).iter().any(|k| k.backend == be),
                "{} has no {} entry",
                be.name(),
                w.dtype()
            );
        }
    }
}

/// Column counts of the image-builder tests: whole spans, ragged spans and blocks, K3 rows.
#[cfg(target_arch = "x86_64")]
const IMAGE_COLS: [usize; 11] = [32, 64, 96, 128, 160, 200, 416, 1000, 1024, 2048 + 96, 7168];

/// Activation rows whose 32-column blocks are, in turn (shifted by one block per row): all
/// zero, holding a NaN, holding an infinity, tiny (×1e-38), huge (×3e38), full of ties, all
/// negative zero, small (×1e-33), or as drawn.
#[cfg(target_arch = "x86_64")]
fn awkward_activations(rng: &mut Rng, n: usize, cols: usize) -> Vec<f32> {
    let mut xs = q8_activations(rng, n, cols);
    for (i, x) in xs.iter_mut().enumerate() {
        let (row, c) = (i / cols, i % cols);
        *x = match (c / 32 + row) % 9 {
            0 => 0.0,
            1 if c % 32 == 7 => f32::NAN,
            2 if c % 32 == 3 => f32::INFINITY,
            3 => *x * 1e-38,
            4 => *x * 3e38,
            5 => (c % 5) as f32 * 0.5 - 1.0,
            6 => -0.0,
            7 => *x * 1e-33,
            _ => *x,
        };
    }
    xs
}

/// The q8x3 image as the products build it (whole blocks through the AVX-512 quantiser
/// where present, `fused`) or with the portable quantiser only.
fn q8x3_image_with(xs: &[f32], cols: usize, fused: bool) -> Image<'static> {
    #[cfg(target_arch = "x86_64")]
    if fused && Backend::Avx512.is_supported() {
        let block = |x: &[f32; 32], sp: &mut [f32], k: usize| {
            // SAFETY: AVX-512 F/BW/VL are present (checked above); `sp` is one span, k < 4.
            unsafe { crate::x86::avx512_q8x3::q8x3_image_block(x, sp, k) }
        };
        return crate::mxfp4_q8x3::q8x3_image(xs, cols, Some(block));
    }
    let _ = fused;
    crate::mxfp4_q8x3::q8x3_image_portable(xs, cols)
}

/// [`q8x3_image_with`] as the products build it.
fn q8x3_image(xs: &[f32], cols: usize) -> Image<'static> {
    q8x3_image_with(xs, cols, true)
}

/// `block_bound`'s divisor for q8x3 activations: one fine step `d/65536 = absmax/(127·65536)`
/// per column (the error is at most three quarters of one).
const Q8X3_DIV: f64 = 127.0 * 65536.0;

/// Column `c` of a q8x3 image row: `(d·2^−17, correction of its lane, [q1, q2, q3])`.
fn q8x3_column(row: &[f32], c: usize) -> (f32, i32, [i8; 3]) {
    use crate::mxfp4_q8x3::SPAN_SLOTS;
    let (span, col) = (c / 128, c % 128);
    let sp = &row[span * SPAN_SLOTS..(span + 1) * SPAN_SLOTS];
    let corr: &[i32] = bytemuck::cast_slice(&sp[16..32]);
    let codes: &[i8] = bytemuck::cast_slice(&sp[32..]);
    let lane = col / 8;
    let q = std::array::from_fn(|lv| codes[128 * lv + 64 * (col % 2) + col / 2]);
    (sp[lane], corr[lane], q)
}

/// The q8x3 image: the layout (lane scales `d·2^−17`, corrections `12·Σ T`, even/odd code
/// bytes per digit), the digits of [`crate::mxfp4_q8x3::q8x3_block`]'s `T` (q2, q3 in
/// −128…127, q1 in −127…127), the reconstruction error `|x − d·T/65536| ≤ 0.75·d/65536`,
/// zero padding, 0 for zero blocks and NaN for non-finite ones.
#[test]
fn mxfp4_q8x3_image_follows_the_quantisation_rule() {
    use crate::mxfp4_q8x3::{OFFSET, digits, q8x3_block};
    let mut rng = Rng(0x0083_0083_1234);
    for cols in [32usize, 96, 128, 160, 416, 1024, 1056, 7168] {
        let n = 3;
        let mut xs = q8_activations(&mut rng, n, cols);
        if cols == 160 {
            xs[5] = f32::NAN;
            xs[cols + 40] = f32::NEG_INFINITY;
        }
        let (img, base, stride) = q8x3_image(&xs, cols);
        assert_eq!((img.as_ptr() as usize + 4 * base) % 64, 0);
        assert_eq!(stride, cols.div_ceil(128) * crate::mxfp4_q8x3::SPAN_SLOTS);
        for b in 0..n {
            let row = &img[base + b * stride..base + (b + 1) * stride];
            let x = &xs[b * cols..(b + 1) * cols];
            for (blk, chunk) in x.chunks(32).enumerate() {
                let (d, q) = q8x3_block(chunk);
                let absmax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (i, &v) in chunk.iter().enumerate() {
                    let c = 32 * blk + i;
                    let (ls, corr, got) = q8x3_column(row, c);
                    assert_eq!(got, digits(q[i]), "cols {cols} b {b} c {c}");
                    assert_eq!(
                        65536 * got[0] as i32 + 256 * got[1] as i32 + got[2] as i32,
                        q[i]
                    );
                    assert!(got[0] >= -127, "cols {cols} b {b} c {c}: {got:?}");
                    let lane0 = 8 * (i / 8);
                    let want_corr = OFFSET * q[lane0..lane0 + 8].iter().sum::<i32>();
                    assert_eq!(corr, want_corr, "cols {cols} b {b} c {c}");
                    if d.is_nan() {
                        assert!(ls.is_nan() && got == [0; 3], "cols {cols} b {b} c {c}");
                        continue;
                    }
                    assert_eq!(ls.to_bits(), (d / 131072.0).to_bits(), "cols {cols} c {c}");
                    if absmax == 0.0 {
                        assert_eq!((ls, got), (0.0, [0; 3]));
                        continue;
                    }
                    assert_eq!(d, absmax / 127.0);
                    let step = d as f64 / 65536.0;
                    let rec = step * q[i] as f64;
                    assert!(
                        (rec - v as f64).abs() <= 0.75 * step,
                        "cols {cols} b {b} c {c}: {v} → {rec} (d {d}, T {})",
                        q[i]
                    );
                }
            }
            // Padding columns of the last span: codes 0, scale 0, correction 0.
            for c in cols..cols.next_multiple_of(128) {
                let (ls, corr, got) = q8x3_column(row, c);
                assert_eq!((ls, corr, got), (0.0, 0, [0; 3]), "cols {cols} pad {c}");
            }
        }
    }
    // Digits: balanced base 256, at the extremes too.
    for t in [
        0, 1, -1, 127, 128, -128, -129, 255, 256, 32767, 32768, -32768, 8323072, -8323199,
    ] {
        let [a, b, c] = digits(t);
        assert_eq!(65536 * a as i32 + 256 * b as i32 + c as i32, t, "{t}");
    }
    // When the fine step would underflow, T is a whole number of 65536ths.
    let (d, q) = q8x3_block(&[1e-36f32; 32]);
    assert!(d > 0.0 && q == [127 * 65536; 32]);
}

/// q8x3 MXFP4 activations: the scalar reference of the quantised arithmetic stays within
/// the activation-quantisation bound of the exact f32-activation product (`Σ_c
/// |W_c|·absmax_blk/(127·65536)`) plus f32 rounding (1e-5·Σ|W x|).
#[test]
fn mxfp4_q8x3_scalar_reference_bounds_the_error() {
    let mut rng = Rng(0x0083_4321_2222);
    for (rows, cols) in [
        (3usize, 32usize),
        (4, 160),
        (5, 416),
        (2, 1056),
        (3, 7168 / 4),
    ] {
        let m = mxfp4(&mut rng, rows, cols);
        let w = Weights::Mxfp4(&m);
        let n = 3;
        let xs = q8_activations(&mut rng, n, cols);
        let (want, mag) = reference(&w, &xs, n);
        let (img, base, stride) = q8x3_image(&xs, cols);
        let bound = block_bound(&w, &xs, n, Q8X3_DIV);
        for r in 0..rows {
            for b in 0..n {
                let x = &img[base + b * stride..base + (b + 1) * stride];
                let [got] = crate::scalar::dot_mxfp4_q8x3(m.packed_row(r), m.scales_row(r), [x]);
                let i = b * rows + r;
                let tol = bound[i] + 1e-5 * mag[i] + 1e-37;
                assert!(
                    (got as f64 - want[i]).abs() <= tol,
                    "[{rows}x{cols}] r {r} b {b}: {got} vs {} (tol {tol})",
                    want[i]
                );
            }
        }
    }
}

/// The AVX-512 VNNI q8x3 MXFP4 tile kernel equals the scalar reference bit for bit for both
/// weight decodes (`vpshufb`; `vpermb` where the CPU has AVX-512 VBMI), every tile shape
/// (1–3 weight rows × 1–4 activation rows), 1…20 blocks (ragged last spans of 1–3 blocks)
/// and K3-sized rows.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_mxfp4_q8x3_kernel_equals_scalar_reference_bitwise() {
    use crate::x86::avx512_q8x3::{
        dot_mxfp4_q8x3_pair_vbmi, dot_mxfp4_q8x3_tile, dot_mxfp4_q8x3_tile_bw,
        dot_mxfp4_q8x3_tile_vbmi,
    };
    const TEST: &str = "avx512_mxfp4_q8x3_kernel_equals_scalar_reference_bitwise";
    if !cpu_has(Cpu::Avx512Vnni, TEST) {
        return;
    }
    // Without VBMI only the vpshufb decode is checked.
    let vbmi = cpu_has(Cpu::Avx512Vbmi, &format!("{TEST} (the vpermb decode)"));
    let decodes: &[bool] = if vbmi { &[false, true] } else { &[false] };
    let mut rng = Rng(0x0083_abab_0303);
    let mut cols_list: Vec<usize> = (1..=20).map(|k| 32 * k).collect();
    cols_list.extend([7168, 2048 + 96, 1024]);
    for cols in cols_list {
        let rows = 4;
        let m = mxfp4(&mut rng, rows, cols);
        let n = 4;
        let xs = q8_activations(&mut rng, n, cols);
        let (img, base, stride) = q8x3_image(&xs, cols);
        let x = |b: usize| &img[base + b * stride..base + (b + 1) * stride];
        let want: Vec<Vec<f32>> = (0..rows)
            .map(|r| {
                let (p, s) = (m.packed_row(r), m.scales_row(r));
                (0..n)
                    .map(|b| crate::scalar::dot_mxfp4_q8x3(p, s, [x(b)])[0])
                    .collect()
            })
            .collect();
        let check = |r0: usize, got: &[Vec<f32>], what: &str| {
            assert_tile_bits(&want, r0, got, &format!("cols {cols} {what}"))
        };
        let (p, s) = (|r: usize| m.packed_row(r), |r: usize| m.scales_row(r));
        macro_rules! run {
            ($nr:literal, $nb:literal) => {{
                for r0 in 0..=rows - $nr {
                    let ps: [&[u8]; $nr] = std::array::from_fn(|i| p(r0 + i));
                    let ss: [&[u8]; $nr] = std::array::from_fn(|i| s(r0 + i));
                    let xb: [&[f32]; $nb] = std::array::from_fn(|b| x(b));
                    for &vbmi in decodes {
                        // SAFETY: AVX-512 VNNI checked above, VBMI when `vbmi`; image rows
                        // cover every span.
                        let got = unsafe {
                            if vbmi {
                                dot_mxfp4_q8x3_tile_vbmi::<$nr, $nb>(ps, ss, xb)
                            } else {
                                dot_mxfp4_q8x3_tile_bw::<$nr, $nb>(ps, ss, xb)
                            }
                        };
                        let got: Vec<Vec<f32>> = got.iter().map(|v| v.to_vec()).collect();
                        check(r0, &got, &format!("NR={} NB={} vbmi={vbmi}", $nr, $nb));
                    }
                    // SAFETY: as above.
                    let got = unsafe { dot_mxfp4_q8x3_tile::<$nr, $nb>(ps, ss, xb) };
                    let got: Vec<Vec<f32>> = got.iter().map(|v| v.to_vec()).collect();
                    check(r0, &got, concat!("dispatch NR=", $nr, " NB=", $nb));
                }
            }};
        }
        each_tile_shape!(run);
        // The two-row kernel of one-activation-row tiles (whole groups of 16 blocks).
        if vbmi && cols % 512 == 0 {
            for r0 in 0..rows - 1 {
                #[allow(clippy::needless_range_loop)] // `b` indexes the image and `want`
                for b in 0..n {
                    let (p0, p1, s0, s1) = (p(r0), p(r0 + 1), s(r0), s(r0 + 1));
                    // SAFETY: AVX-512 VNNI and VBMI checked above; two rows of `cols / 32`
                    // blocks, a multiple of 16; the image row covers every span.
                    let got = unsafe {
                        dot_mxfp4_q8x3_pair_vbmi(
                            p0.as_ptr(),
                            p1.as_ptr(),
                            s0.as_ptr(),
                            s1.as_ptr(),
                            cols / 32,
                            x(b).as_ptr(),
                        )
                    };
                    let at = format!("cols {cols} pair rows {r0}, {} activation {b}", r0 + 1);
                    assert_bits(at, &got, &[want[r0][b], want[r0 + 1][b]]);
                }
            }
        }
    }
}

/// The AVX-512 q8x3 image builder gives the same image, bit for bit, as the portable
/// per-block path, for ragged columns (a last block of 1–31 values takes the portable path
/// in both) and blocks that are all zero, non-finite, tiny (the finer steps underflow),
/// huge, or full of ties.
#[cfg(target_arch = "x86_64")]
#[test]
fn mxfp4_q8x3_fused_image_equals_portable_image() {
    let mut rng = Rng(0x0f05_ed83_2222);
    if !cpu_has(Cpu::Avx512, "mxfp4_q8x3_fused_image_equals_portable_image") {
        return;
    }
    for cols in IMAGE_COLS {
        for n in 1..=3 {
            let xs = awkward_activations(&mut rng, n, cols);
            let (a, ba, sa) = q8x3_image_with(&xs, cols, true);
            let (b, bb, sb) = q8x3_image_with(&xs, cols, false);
            assert_eq!(sa, sb);
            let what = format!("cols {cols} n {n} image");
            assert_bits(what, &a[ba..ba + n * sa], &b[bb..bb + n * sb]);
        }
    }
}

/// The far (L2) prefetch distance of the row-int8 and bf16 tiles is a whole number of tiles
/// and at least [`crate::tile::FAR_PREFETCH_BYTES`], so each row's far prefetch lands on the
/// same column of a later tile's row and every line of the stream is asked for once.
#[cfg(target_arch = "x86_64")]
#[test]
fn far_prefetch_distance_is_whole_tiles() {
    use crate::tile::{FAR_PREFETCH_BYTES, far_distance};
    for tile in [
        1usize,
        512,
        1024,
        4096,
        3 * 1024,
        2 * 7168,
        4 * 2048,
        2 * 14336,
        40000,
    ] {
        let d = far_distance(tile);
        assert_eq!(d % tile, 0, "tile {tile}: {d}");
        assert!(d >= FAR_PREFETCH_BYTES, "tile {tile}: {d}");
        assert!(d < FAR_PREFETCH_BYTES + tile, "tile {tile}: {d}");
    }
    assert_eq!(far_distance(4096), 16 * 1024);
    assert_eq!(far_distance(2 * 7168), 28672);
}
