//! Logic test of the Metal kernels on any host, without a GPU or the Metal compiler: the
//! `.metal` sources (`deltafin_kernels::metal::library_source`, exactly the text Metal
//! compiles) are compiled as C++17 by the host compiler against the shim in `metal_shim/`
//! (address-space qualifiers as empty macros, every GPU thread a fiber under a deterministic
//! scheduler, `threadgroup_barrier` and `simd_shuffle_xor` modelled with real waits; see
//! `metal_shim/metal_stdlib`), dispatched with the same geometry as the macOS device wrapper
//! (`metal::sources`), and compared with:
//! - the products: a Rust model of the documented reduction order of `matvec.metal` (lane-
//!   strided chunks, explicit fma, xor butterfly), **bit for bit**, and the scalar CPU
//!   kernels (`matmul_with(Backend::Scalar, ..)`, f32 activations) within `1e-5 · Σ|w·x|` per value, the CUDA tests' bound;
//! - KDA and MLA: `deltafin_kernels::cuda::reference` (f32 ports of the model code) within
//!   1e-5 / 2e-5 of the largest output, the CUDA tests' bounds (`exp` differs by a few ulp).
//!
//! This tests the kernels' *logic* — indexing, ragged tails, batch splitting, reduction order,
//! barrier placement, SIMD-group uniformity — not the Metal compiler, its fast-math choices, or
//! Apple hardware. Without a C++ compiler (`$CXX`, else `c++`) every test prints a SKIP line.

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use deltafin_kernels::cuda::reference;
use deltafin_kernels::metal::sources::{
    MATVEC_THREADS, MLA_THREADS, ROWS_PER_GROUP, kda_threadgroup_bytes, kda_threads,
    mla_threadgroup_bytes,
};
use deltafin_kernels::metal::{MlaParams, MlaShape, batch_split, library_source};
use deltafin_kernels::{Backend, Weights, matmul_with};
use deltafin_tensor::mxfp4::E2M1;
use deltafin_tensor::{Bf16Matrix, Bytes, Mxfp4Matrix, RowInt8Matrix, bf16};
use libloading::{Library, Symbol};

const STDLIB: &str = include_str!("metal_shim/metal_stdlib");
const LAUNCH: &str = include_str!("metal_shim/launch.cpp");

type MatmulFn = unsafe extern "C" fn(
    *const std::ffi::c_char,
    i32,
    *const u8,
    *const u8,
    *const f32,
    *mut f32,
    u32,
    u32,
    u32,
    u32,
) -> i32;
type KdaFn = unsafe extern "C" fn(
    *mut f32,
    *const f32,
    *const f32,
    *const f32,
    *const f32,
    *const f32,
    *mut f32,
    u32,
    u32,
    u32,
    u32,
) -> i32;
type MlaFn = unsafe extern "C" fn(
    *const f32,
    *const u16,
    *const u16,
    *const u16,
    *const f32,
    *mut f32,
    *mut f32,
    u32,
    *const MlaParams,
    u32,
    u32,
) -> i32;
type ErrFn = unsafe extern "C" fn() -> *const std::ffi::c_char;

/// The compiled kernels; the shim's scheduler is global state, so calls are serialised.
struct Shim {
    lib: Library,
    _dir: tempfile::TempDir,
}

impl Shim {
    fn check(&self, what: &str, rc: i32) {
        if rc != 0 {
            // SAFETY: the symbol exists in the library built below and returns a C string.
            let msg = unsafe {
                let f: Symbol<ErrFn> = self.lib.get(b"shim_last_error").unwrap();
                std::ffi::CStr::from_ptr(f()).to_string_lossy().into_owned()
            };
            panic!("{what}: {msg}");
        }
    }
}

fn shim() -> Option<&'static Mutex<Shim>> {
    static SHIM: OnceLock<Option<Mutex<Shim>>> = OnceLock::new();
    SHIM.get_or_init(|| {
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        if Command::new(&cxx).arg("--version").output().is_err() {
            eprintln!("SKIP Metal logic tests: no C++ compiler `{cxx}` (set CXX)");
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("metal_stdlib"), STDLIB).unwrap();
        let unit = dir.path().join("metal_kernels.cpp");
        std::fs::write(
            &unit,
            format!("{}\n// ---- launchers ----\n{LAUNCH}", library_source()),
        )
        .unwrap();
        let so: PathBuf = dir.path().join("libmetal_shim.so");
        let out = Command::new(&cxx)
            .args([
                "-std=c++17",
                "-O1",
                "-shared",
                "-fPIC",
                "-fsigned-char",
                "-ffp-contract=off",
            ])
            .args([
                "-Wall",
                "-Wno-attributes",
                "-Wno-unused-parameter",
                "-Werror",
            ])
            .arg("-I")
            .arg(dir.path())
            .arg("-o")
            .arg(&so)
            .arg(&unit)
            .output()
            .expect("run the C++ compiler");
        assert!(
            out.status.success(),
            "the .metal sources do not compile through the host shim:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // SAFETY: a library we just built; its initialisers only set up statics.
        let lib = unsafe { Library::new(&so) }.expect("load the shim library");
        Some(Mutex::new(Shim { lib, _dir: dir }))
    })
    .as_ref()
}

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

/// `n` activation rows through `w` on the shim, split into dispatches as the device does.
fn shim_matmul(s: &Shim, w: Weights<'_>, xs: &[f32], n: usize) -> Vec<f32> {
    let (rows, cols) = (w.rows(), w.cols());
    let mut ys = vec![f32::NAN; n * rows];
    let bf_bits: Vec<u16>;
    let i8_scales: Vec<f32>;
    let mx_words: Vec<u32>;
    let (kind, wp, sp): (&std::ffi::CStr, *const u8, *const u8) = match w {
        Weights::Bf16(m) => {
            bf_bits = m.data().iter().map(|v| v.to_bits()).collect();
            (c"bf16", bf_bits.as_ptr().cast(), std::ptr::null())
        }
        Weights::RowInt8(m) => {
            i8_scales = (0..rows).map(|r| m.scale(r)).collect();
            (
                c"rowint8",
                m.data().as_ptr().cast(),
                i8_scales.as_ptr().cast(),
            )
        }
        // The kernel reads the packed codes as u32 words: copy them to an aligned buffer.
        Weights::Mxfp4(m) => {
            mx_words = m
                .packed()
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (c"mxfp4", mx_words.as_ptr().cast(), m.scales().as_ptr())
        }
        Weights::F32 { .. } => unreachable!(),
    };
    let groups = rows.div_ceil(ROWS_PER_GROUP) as u32;
    for (done, nb) in batch_split(n) {
        // SAFETY: buffers hold the shapes the kernel reads (rows·cols weights, nb·cols inputs,
        // nb·rows outputs from the offsets).
        let rc = unsafe {
            let f: Symbol<MatmulFn> = s.lib.get(b"shim_matmul").unwrap();
            f(
                kind.as_ptr(),
                nb as i32,
                wp,
                sp,
                xs[done * cols..].as_ptr(),
                ys[done * rows..].as_mut_ptr(),
                rows as u32,
                cols as u32,
                groups,
                MATVEC_THREADS as u32,
            )
        };
        s.check(&format!("matmul_{}_nb{nb}", w.dtype()), rc);
    }
    ys
}

/// The reduction order documented in `matvec.metal`, in Rust: lane l accumulates its chunks
/// (chunk index ≡ l mod 32) with fma, then the xor butterfly (16, 8, 4, 2, 1) sums the lanes.
fn model_product(w: Weights<'_>, r: usize, x: &[f32]) -> f32 {
    let cols = w.cols();
    let mut lanes = [0f32; 32];
    let mut scale = 1.0;
    match w {
        Weights::Mxfp4(m) => {
            let packed = &m.packed()[r * cols / 2..(r + 1) * cols / 2];
            let scales = &m.scales()[r * cols / 32..(r + 1) * cols / 32];
            for (g, &e) in scales.iter().enumerate() {
                let s = f32::from_bits(if e == 0 { 1 << 22 } else { (e as u32) << 23 });
                let mut part = 0f32;
                for k in 0..32 {
                    let byte = packed[g * 16 + k / 2];
                    let code = if k % 2 == 0 { byte & 15 } else { byte >> 4 };
                    part = E2M1[code as usize].mul_add(x[g * 32 + k], part);
                }
                lanes[g % 32] = s.mul_add(part, lanes[g % 32]);
            }
        }
        Weights::Bf16(m) => {
            let row = &m.data()[r * cols..(r + 1) * cols];
            let chunk = if cols.is_multiple_of(8) { 8 } else { 1 };
            for c in 0..cols {
                let l = (c / chunk) % 32;
                lanes[l] = row[c].to_f32().mul_add(x[c], lanes[l]);
            }
        }
        Weights::RowInt8(m) => {
            let row = m.row(r);
            let chunk = if cols.is_multiple_of(16) { 16 } else { 1 };
            for c in 0..cols {
                let l = (c / chunk) % 32;
                lanes[l] = (row[c] as f32).mul_add(x[c], lanes[l]);
            }
            scale = m.scale(r);
        }
        Weights::F32 { .. } => unreachable!(),
    }
    for off in [16, 8, 4, 2, 1] {
        let prev = lanes;
        for (l, v) in lanes.iter_mut().enumerate() {
            *v = prev[l] + prev[l ^ off];
        }
    }
    lanes[0] * scale
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

/// `|shim − cpu| ≤ 1e-5 · Σ|w x|` per value (the CUDA tests' bound).
fn check_vs_cpu(what: &str, w: Weights<'_>, xs: &[f32], n: usize, got: &[f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    // The portable scalar CPU kernels: f32 activations like the Metal kernels (the SIMD
    // backends may quantise activations to int16/int8 for row-int8 and MXFP4 products).
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
            let (g, c) = (got[b * rows + r] as f64, cpu[b * rows + r] as f64);
            let err = (g - c).abs() / (mag + 1e-30);
            worst = worst.max(err);
            assert!(
                err <= 1e-5,
                "{what}: row {r}, batch row {b}: shim {g} vs cpu {c} (Σ|wx| {mag})"
            );
        }
    }
    eprintln!("  {what}: worst error / Σ|wx| = {worst:.2e}");
}

#[test]
fn metal_products_follow_the_documented_order_and_match_the_cpu() {
    let Some(shim) = shim() else { return };
    let s = shim.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // Rows not multiples of the 8-row threadgroup; columns with and without the chunked path
    // (bf16: % 8, int8: % 16) and with more chunks or groups than lanes.
    let shapes = [(1, 32), (13, 96), (40, 200), (17, 72), (9, 1056)];
    for (rows, cols) in shapes {
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
            for n in [1usize, 3, 16, 19] {
                let xs = rng.vec(n * cols);
                let got = shim_matmul(&s, w, &xs, n);
                let what = format!("{} {rows}x{cols} n={n}", w.dtype());
                for b in 0..n {
                    for r in 0..rows {
                        let want = model_product(w, r, &xs[b * cols..(b + 1) * cols]);
                        assert_eq!(
                            got[b * rows + r].to_bits(),
                            want.to_bits(),
                            "{what}: row {r}, batch row {b}: shim {} vs documented order {want}",
                            got[b * rows + r]
                        );
                    }
                }
                check_vs_cpu(&what, w, &xs, n, &got);
            }
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
        panic!("{what}: value {i} is {} (never written, or overflow)", a[i]);
    }
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / scale)
        .fold(0f32, f32::max);
    eprintln!("  {what}: worst |shim − cpu| / max|cpu| = {worst:.2e}");
    assert!(worst <= tol, "{what}: {worst:e} > {tol:e}");
}

#[test]
fn metal_kda_step_matches_the_reference_over_several_tokens() {
    let Some(shim) = shim() else { return };
    let s = shim.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng(7);
    // d not a multiple of 32, one simdgroup per 32 columns, and more columns than threads.
    for (heads, d) in [(3usize, 40usize), (2, 128), (2, 300)] {
        let mut s_shim = vec![0f32; heads * d * d];
        let mut s_cpu = s_shim.clone();
        for step in 0..3 {
            let mut q = rng.vec(heads * d);
            let mut k = rng.vec(heads * d);
            let v = rng.vec(heads * d);
            let g: Vec<f32> = (0..heads * d).map(|_| -0.5 * (rng.f() + 1.0)).collect();
            let beta: Vec<f32> = (0..heads).map(|_| 0.5 * (rng.f() + 1.0)).collect();
            for h in 0..heads {
                l2n(&mut q[h * d..(h + 1) * d]);
                l2n(&mut k[h * d..(h + 1) * d]);
            }
            let mut out = vec![f32::NAN; heads * d];
            // SAFETY: every buffer has the [heads, d(, d)] length the kernel reads or writes.
            let rc = unsafe {
                let f: Symbol<KdaFn> = s.lib.get(b"shim_kda_step").unwrap();
                f(
                    s_shim.as_mut_ptr(),
                    q.as_ptr(),
                    k.as_ptr(),
                    v.as_ptr(),
                    g.as_ptr(),
                    beta.as_ptr(),
                    out.as_mut_ptr(),
                    heads as u32,
                    d as u32,
                    kda_threads(d) as u32,
                    kda_threadgroup_bytes(d) as u32,
                )
            };
            s.check("kda_step", rc);
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
                &out,
                &o_cpu,
                1e-5,
            );
            close(
                &format!("KDA H={heads} d={d} step {step} state"),
                &s_shim,
                &s_cpu,
                1e-5,
            );
        }
    }
}

#[test]
fn metal_mla_decode_matches_the_reference() {
    let Some(shim) = shim() else { return };
    let s = shim.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = Rng(11);
    let small = MlaShape {
        heads: 3,
        nope: 16,
        rope: 8,
        v: 24,
        kvl: 72,
    };
    let k3ish = MlaShape {
        heads: 2,
        nope: 128,
        rope: 64,
        v: 128,
        kvl: 512,
    };
    // One token; fewer tokens than simdgroups; more tokens than threads (strided softmax).
    for (sh, n) in [
        (small, 1usize),
        (small, 7),
        (small, 333),
        (k3ish, 1),
        (k3ish, 40),
    ] {
        let bfv = |rng: &mut Rng, len: usize, amp: f32| -> Vec<bf16> {
            (0..len).map(|_| bf16::from_f32(amp * rng.f())).collect()
        };
        let q = rng.vec(sh.heads * (sh.nope + sh.rope));
        let kvb = bfv(&mut rng, sh.heads * (sh.nope + sh.v) * sh.kvl, 0.2);
        let latent = bfv(&mut rng, n * sh.kvl, 1.0);
        let tail = bfv(&mut rng, n * sh.rope, 1.0);
        let gate = rng.vec(sh.heads * sh.v);
        let bits = |x: &[bf16]| x.iter().map(|b| b.to_bits()).collect::<Vec<u16>>();
        let (kvb_b, lat_b, tail_b) = (bits(&kvb), bits(&latent), bits(&tail));
        let params = sh.params(n).unwrap();
        let mut scores = vec![f32::NAN; sh.heads * n];
        let mut out = vec![f32::NAN; sh.heads * sh.v];
        // SAFETY: every buffer has the length `mla.metal` documents for this shape.
        let rc = unsafe {
            let f: Symbol<MlaFn> = s.lib.get(b"shim_mla_decode").unwrap();
            f(
                q.as_ptr(),
                kvb_b.as_ptr(),
                lat_b.as_ptr(),
                tail_b.as_ptr(),
                gate.as_ptr(),
                scores.as_mut_ptr(),
                out.as_mut_ptr(),
                sh.heads as u32,
                &params,
                MLA_THREADS as u32,
                mla_threadgroup_bytes(sh.kvl, sh.rope) as u32,
            )
        };
        s.check("mla_decode", rc);
        let cpu = reference::mla_decode(
            (sh.heads, sh.nope, sh.rope, sh.v, sh.kvl),
            n,
            &q,
            &kvb,
            &latent,
            &tail,
            &gate,
        );
        close(&format!("MLA {sh:?} n={n}"), &out, &cpu, 2e-5);
    }
}
