//! MXFP4 products on int8 activations (the llama.cpp MXFP4 × Q8_0 scheme, AVX-512 VNNI).
//!
//! Each activation row is quantised once per call, per 32-column block `blk`:
//! `d = absmax(blk) / 127`, `q_c = round_half_even(x_c / d)` in −127…127 (an all-zero block
//! has `d = 0` and codes 0; a block holding a non-finite value has `d = NaN`, so the product
//! is NaN as in f32). A weight code `w_c` (E2M1) is looked up as the unsigned byte
//! `u_c = 2·E2M1(w_c) + 12` (0…24), multiplied with `q_c` by `vpdpbusd` (exact int32 sums of
//! four products per dword lane), and the offset is removed with the activation-only
//! correction `12 · Σ q_c`, so per 8-column lane
//!
//! ```text
//! S = Σ u_c·q_c − 12·Σ q_c = Σ 2·E2M1(w_c)·q_c          (exact in int32)
//! y = Σ_lanes f32(S) · (2^(e−127) · d · 0.5)            (one f32 FMA per lane and span)
//! ```
//!
//! Error against the f32-activation product: each activation moves by at most half a step,
//! `|x_c − d·q_c| ≤ d/2`, so `|Δy| ≤ Σ_c |W_c| · d_blk(c) / 2 = Σ_c |W_c| · absmax_blk(c) / 254`
//! (plus f32 rounding of the sum), about 0.4% of the block's largest activation per unit of
//! weight — the same order as llama.cpp's Q8_0 activations for MXFP4.
//!
//! `DELTAFIN_MXFP4_ACT=f32|q8|q16|q16x2|q8x3` chooses the activation format of AVX-512 MXFP4
//! products. The default is `q8x3` ([`crate::mxfp4_q8x3`]: three int8 digits, about f32's own
//! precision). This one-level `q8` fails the forward-pass fidelity tests (f64 block oracles,
//! prefill-vs-decode, the llama.cpp oracle with f32 experts), see docs/NUMERICS.md, so it is
//! opt-in (AVX-512 VNNI only; other backends always use f32).

use std::borrow::Cow;
use std::sync::OnceLock;

use deltafin_tensor::mxfp4::{E2M1, GROUP};

/// Environment variable choosing the MXFP4 activation format.
pub const ACT_ENV_VAR: &str = "DELTAFIN_MXFP4_ACT";

/// Activation format of MXFP4 products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mxfp4Act {
    /// f32 activations, f32 accumulation (every backend).
    F32,
    /// int8 activations per 32-column block, exact int32 sums (AVX-512 VNNI only; elsewhere
    /// the f32 path runs).
    Q8,
    /// int16 activations per 32-column block, one level ([`crate::mxfp4_q16`]; AVX-512
    /// VNNI only).
    Q16,
    /// int16 activations per 32-column block, two levels (the remainder quantised again on a
    /// 65536× finer step: about f32's own precision; [`crate::mxfp4_q16`]; AVX-512 VNNI only).
    Q16x2,
    /// int8 activations per 32-column block, three levels folded into one exact int32 sum
    /// (about f32's own precision; [`crate::mxfp4_q8x3`]; AVX-512 VNNI only).
    Q8x3,
}

impl Mxfp4Act {
    /// The name used by `DELTAFIN_MXFP4_ACT` and in logs.
    pub fn name(self) -> &'static str {
        match self {
            Mxfp4Act::F32 => "f32",
            Mxfp4Act::Q8 => "q8",
            Mxfp4Act::Q16 => "q16",
            Mxfp4Act::Q16x2 => "q16x2",
            Mxfp4Act::Q8x3 => "q8x3",
        }
    }
}

/// A bad `DELTAFIN_MXFP4_ACT` setting.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Mxfp4ActError {
    #[error("{ACT_ENV_VAR}={value:?} is not one of f32, q8, q16, q16x2, q8x3")]
    Unknown { value: String },
}

/// Parse a `DELTAFIN_MXFP4_ACT` value strictly (`f32`, `q8`, `q16`, `q16x2` or `q8x3`, nothing
/// else).
pub fn parse_mxfp4_act(value: &str) -> Result<Mxfp4Act, Mxfp4ActError> {
    match value {
        "f32" => Ok(Mxfp4Act::F32),
        "q8" => Ok(Mxfp4Act::Q8),
        "q16" => Ok(Mxfp4Act::Q16),
        "q16x2" => Ok(Mxfp4Act::Q16x2),
        "q8x3" => Ok(Mxfp4Act::Q8x3),
        _ => Err(Mxfp4ActError::Unknown {
            value: value.to_string(),
        }),
    }
}

/// The activation format used when `DELTAFIN_MXFP4_ACT` is unset (on AVX-512 VNNI; every
/// other CPU runs f32).
/// `q8x3`: f32's precision like `q16x2`, and on `mini` (AVX-512 VNNI + VBMI, 2 threads) its
/// products are 1.1–1.25× faster (docs/PERFORMANCE.md, "Session 11").
pub const DEFAULT_ACT: Mxfp4Act = Mxfp4Act::Q8x3;

/// The requested activation format (unset → [`DEFAULT_ACT`]), resolved once per process.
pub fn select_mxfp4_act() -> Result<Mxfp4Act, Mxfp4ActError> {
    static SELECTED: OnceLock<Result<Mxfp4Act, Mxfp4ActError>> = OnceLock::new();
    SELECTED
        .get_or_init(|| match std::env::var(ACT_ENV_VAR) {
            Err(std::env::VarError::NotPresent) => Ok(DEFAULT_ACT),
            Err(std::env::VarError::NotUnicode(v)) => Err(Mxfp4ActError::Unknown {
                value: v.to_string_lossy().into_owned(),
            }),
            Ok(v) => parse_mxfp4_act(&v),
        })
        .clone()
}

/// Whether this CPU has the 512-bit `vpdpbusd` the q8 kernel needs.
pub(crate) fn vnni_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The activation format AVX-512 MXFP4 products use in this process: the requested (or
/// default) `q8`, `q16`, `q16x2` or `q8x3` when VNNI is present, else `f32`.
///
/// # Panics
/// If `DELTAFIN_MXFP4_ACT` is invalid (binaries report it first through
/// [`crate::select_backend`]).
pub fn avx512_mxfp4_act() -> Mxfp4Act {
    static ACTIVE: OnceLock<Mxfp4Act> = OnceLock::new();
    *ACTIVE.get_or_init(|| match select_mxfp4_act() {
        Ok(Mxfp4Act::F32) => Mxfp4Act::F32,
        Ok(act) if vnni_available() => act,
        Ok(_) => Mxfp4Act::F32,
        Err(e) => panic!("{e}"),
    })
}

/// Columns of one span: four MXFP4 blocks, one 64-byte load of weight codes.
pub(crate) const SPAN: usize = 128;
/// f32 slots of one span in the q8 image: 16 lane scales, 16 int32 corrections, 64 even-column
/// codes, 64 odd-column codes.
pub(crate) const SPAN_SLOTS: usize = 64;

/// `2·E2M1(code) + 12` for codes 0…15: the unsigned weight bytes of the q8 product.
pub(crate) const E2M1_X2_PLUS_12: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (2.0 * E2M1[i] + 12.0) as u8;
        i += 1;
    }
    t
};

/// The weight-byte offset removed by the correction term.
pub(crate) const OFFSET: i32 = 12;

/// The q8 image of activation rows of `cols` values: per row, `ceil(cols / 128)` spans of
/// [`SPAN_SLOTS`] f32 slots each. Span `s` covers columns `128s + 8i + t` (lane `i` = 0…15,
/// `t` = 0…7; lane `i` lies in block `4s + i/4`):
/// - slots 0..16: lane `i`'s `d/2` of its block (0 for padding);
/// - slots 16..32: lane `i`'s correction `12 · Σ_t q` as int32;
/// - slots 32..48: 64 int8 codes of the even columns, byte `4i + k` = column `8i + 2k`;
/// - slots 48..64: 64 int8 codes of the odd columns, byte `4i + k` = column `8i + 2k + 1`.
///
/// Byte `4i + k` of a span's 64 weight bytes holds exactly columns `8i + 2k` (low nibble) and
/// `8i + 2k + 1` (high nibble), so the low/high nibble vectors meet these two code vectors
/// lane for lane. Columns past `cols` are zero (code 0, scale 0).
pub(crate) fn q8_image(xs: &[f32], cols: usize) -> (Cow<'static, [f32]>, usize) {
    let nspan = cols.div_ceil(SPAN);
    let stride = nspan * SPAN_SLOTS;
    let rows = xs.len().checked_div(cols).unwrap_or(0);
    let mut img = vec![0f32; rows * stride];
    for (dst, src) in img
        .chunks_exact_mut(stride)
        .zip(xs.chunks_exact(cols.max(1)))
    {
        for (s, span) in dst.chunks_exact_mut(SPAN_SLOTS).enumerate() {
            let (dh, rest) = span.split_at_mut(16);
            let (corr, codes) = rest.split_at_mut(16);
            let corr: &mut [i32] = bytemuck::cast_slice_mut(corr);
            let codes: &mut [i8] = bytemuck::cast_slice_mut(codes);
            let (even, odd) = codes.split_at_mut(64);
            for k in 0..SPAN / GROUP {
                let c0 = s * SPAN + k * GROUP;
                if c0 >= cols {
                    break;
                }
                let block = &src[c0..(c0 + GROUP).min(cols)];
                let (d, q) = quantize_block(block);
                for (i, &qc) in q.iter().enumerate() {
                    let col = k * GROUP + i; // column within the span
                    if col.is_multiple_of(2) {
                        even[col / 2] = qc;
                    } else {
                        odd[col / 2] = qc;
                    }
                }
                for l in 0..4 {
                    let lane = 4 * k + l;
                    dh[lane] = d * 0.5;
                    let sum: i32 = q[8 * l..8 * l + 8].iter().map(|&v| v as i32).sum();
                    corr[lane] = OFFSET * sum;
                }
            }
        }
    }
    (Cow::Owned(img), stride)
}

/// One block of up to 32 values → `(d, codes)`: `d = absmax/127`, codes
/// `round_half_even(x/d)` clamped to ±127, zero-padded to 32; all-zero → `(0, 0…)`;
/// a non-finite value → `(NaN, 0…)`.
pub(crate) fn quantize_block(block: &[f32]) -> (f32, [i8; GROUP]) {
    let mut q = [0i8; GROUP];
    let d = int8_step(block);
    if d.is_nan() || d == 0.0 {
        return (d, q);
    }
    for (o, &v) in q.iter_mut().zip(block) {
        *o = (v / d).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    (d, q)
}

/// The int8 step of one block: `absmax/127`, 0 for an all-zero block, NaN when the block
/// holds a non-finite value (shared by the q8 and q8x3 quantisers).
pub(crate) fn int8_step(block: &[f32]) -> f32 {
    if !block.iter().all(|v| v.is_finite()) {
        return f32::NAN;
    }
    block.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0
}
