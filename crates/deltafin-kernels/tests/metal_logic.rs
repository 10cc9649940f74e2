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
//! - KDA and MLA: `deltafin_kernels::reference` (f32 ports of the model code) within
//!   1e-5 / 2e-5 of the largest output, the CUDA tests' bounds (`exp` differs by a few ulp).
//!
//! This tests the kernels' *logic* — indexing, ragged tails, batch splitting, reduction order,
//! barrier placement, SIMD-group uniformity — not the Metal compiler, its fast-math choices, or
//! Apple hardware. Without a C++ compiler (`$CXX`, else `c++`) every test prints a SKIP line,
//! unless `DELTAFIN_REQUIRE_CXX=1` (set by `.ci/run`), which makes that a failure. The shared
//! checks and their bounds are in `common/mod.rs`.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use common::{MLA_SMALL, WeightSet};
use deltafin_kernels::Weights;
use deltafin_kernels::metal::sources::{
    MATVEC_THREADS, MLA_THREADS, ROWS_PER_GROUP, kda_threadgroup_bytes, kda_threads,
    mla_threadgroup_bytes,
};
use deltafin_kernels::metal::{MlaParams, MlaShape, batch_split, library_source};
use deltafin_tensor::bf16;
use deltafin_tensor::mxfp4::E2M1;
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

/// The compiled kernels, or `None` when there is no C++ compiler (`common::skip`: a SKIP line,
/// or a failure with `DELTAFIN_REQUIRE_CXX=1`).
fn shim(test: &str) -> Option<&'static Mutex<Shim>> {
    static SHIM: OnceLock<Result<Mutex<Shim>, String>> = OnceLock::new();
    let shim = SHIM.get_or_init(|| {
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        if Command::new(&cxx).arg("--version").output().is_err() {
            return Err(format!("no C++ compiler `{cxx}` (install one or set CXX)"));
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
        Ok(Mutex::new(Shim { lib, _dir: dir }))
    });
    match shim {
        Ok(s) => Some(s),
        Err(why) => {
            common::skip(test, "DELTAFIN_REQUIRE_CXX", why);
            None
        }
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

#[test]
fn metal_products_follow_the_documented_order_and_match_the_cpu() {
    let test = "metal_products_follow_the_documented_order_and_match_the_cpu";
    let Some(shim) = shim(test) else { return };
    let s = shim.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = common::Rng(0x9e37_79b9_7f4a_7c15);
    // Rows not multiples of the 8-row threadgroup; columns with and without the chunked path
    // (bf16: % 8, int8: % 16) and with more chunks or groups than lanes.
    let shapes = [(1, 32), (13, 96), (40, 200), (17, 72), (9, 1056)];
    for (rows, cols) in shapes {
        let set = WeightSet::random(&mut rng, rows, cols);
        for w in set.all() {
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
                let cpu = common::scalar_cpu(w, &xs, n);
                common::check_products(&what, "shim", w, &xs, n, &got, &cpu);
            }
        }
    }
}

#[test]
fn metal_kda_step_matches_the_reference_over_several_tokens() {
    let Some(shim) = shim("metal_kda_step_matches_the_reference_over_several_tokens") else {
        return;
    };
    let s = shim.lock().unwrap_or_else(|e| e.into_inner());
    // d not a multiple of 32, one simdgroup per 32 columns, and more columns than threads.
    common::check_kda_steps("shim", &[(3, 40), (2, 128), (2, 300)], 3, |state, x| {
        let (heads, d) = (x.heads, x.d);
        let mut out = vec![f32::NAN; heads * d];
        // SAFETY: every buffer has the [heads, d(, d)] length the kernel reads or writes.
        let rc = unsafe {
            let f: Symbol<KdaFn> = s.lib.get(b"shim_kda_step").unwrap();
            f(
                state.as_mut_ptr(),
                x.q.as_ptr(),
                x.k.as_ptr(),
                x.v.as_ptr(),
                x.g.as_ptr(),
                x.beta.as_ptr(),
                out.as_mut_ptr(),
                heads as u32,
                d as u32,
                kda_threads(d) as u32,
                kda_threadgroup_bytes(d) as u32,
            )
        };
        s.check("kda_step", rc);
        out
    });
}

#[test]
fn metal_mla_decode_matches_the_reference() {
    let Some(shim) = shim("metal_mla_decode_matches_the_reference") else {
        return;
    };
    let s = shim.lock().unwrap_or_else(|e| e.into_inner());
    let k3ish = MlaShape {
        heads: 2,
        nope: 128,
        rope: 64,
        v: 128,
        kvl: 512,
    };
    // One token; fewer tokens than simdgroups; more tokens than threads (strided softmax).
    common::check_mla_decode(
        "shim",
        &[
            (MLA_SMALL, 1),
            (MLA_SMALL, 7),
            (MLA_SMALL, 333),
            (k3ish, 1),
            (k3ish, 40),
        ],
        |x| {
            let (sh, n) = (x.shape, x.tokens);
            let (heads, rope, v, kvl) = (sh.heads, sh.rope, sh.v, sh.kvl);
            let bits = |x: &[bf16]| x.iter().map(|b| b.to_bits()).collect::<Vec<u16>>();
            let (kvb_b, lat_b, tail_b) = (bits(x.kv_b), bits(x.latent), bits(x.tail));
            let params = sh.params(n).unwrap();
            let mut scores = vec![f32::NAN; heads * n];
            let mut out = vec![f32::NAN; heads * v];
            // SAFETY: every buffer has the length `mla.metal` documents for this shape.
            let rc = unsafe {
                let f: Symbol<MlaFn> = s.lib.get(b"shim_mla_decode").unwrap();
                f(
                    x.q.as_ptr(),
                    kvb_b.as_ptr(),
                    lat_b.as_ptr(),
                    tail_b.as_ptr(),
                    x.gate.as_ptr(),
                    scores.as_mut_ptr(),
                    out.as_mut_ptr(),
                    heads as u32,
                    &params,
                    MLA_THREADS as u32,
                    mla_threadgroup_bytes(kvl, rope) as u32,
                )
            };
            s.check("mla_decode", rc);
            out
        },
    );
}
