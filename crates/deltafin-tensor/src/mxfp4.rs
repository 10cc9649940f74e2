//! MXFP4 as packed by compressed-tensors `mxfp4-pack-quantized` (docs/K3.md §3.3).
//!
//! Logical weight `W[o, i]` of shape `[out, in]`:
//! - `packed[o, j]` (U8, `[out, in/2]`) holds element `i = 2j` in the low nibble and
//!   `i = 2j + 1` in the high nibble;
//! - a nibble is E2M1: bit 3 sign, bits 2..0 index `{0, 0.5, 1, 1.5, 2, 3, 4, 6}`;
//! - `scales[o, b]` (U8, `[out, in/32]`) is an E8M0 biased exponent: scale `2^(e - 127)`,
//!   one per 32 consecutive input columns; `e = 255` is NaN and rejected.

/// Number of input columns sharing one E8M0 scale.
pub const GROUP: usize = 32;

/// E2M1 code → value, for codes 0..15.
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// `2^(e - 127)` as an exact f32 (subnormal for small `e`). `None` for the NaN code 255.
pub fn e8m0_scale(e: u8) -> Option<f32> {
    match e {
        255 => None,
        0 => Some(f32::from_bits(1 << 22)), // 2^-127, subnormal
        e => Some(f32::from_bits((e as u32) << 23)),
    }
}

/// Dequantize one row: `packed` has `cols / 2` bytes, `scales` has `cols / 32` bytes.
/// Returns `None` if a scale byte is the NaN code 255 or lengths disagree.
pub fn dequantize_row(packed: &[u8], scales: &[u8], out: &mut [f32]) -> Option<()> {
    let cols = out.len();
    if !cols.is_multiple_of(GROUP) || packed.len() * 2 != cols || scales.len() * GROUP != cols {
        return None;
    }
    for (b, &e) in scales.iter().enumerate() {
        let s = e8m0_scale(e)?;
        let p = &packed[b * GROUP / 2..(b + 1) * GROUP / 2];
        let o = &mut out[b * GROUP..(b + 1) * GROUP];
        for (j, &byte) in p.iter().enumerate() {
            o[2 * j] = E2M1[(byte & 0x0f) as usize] * s;
            o[2 * j + 1] = E2M1[(byte >> 4) as usize] * s;
        }
    }
    Some(())
}

/// Encode a value to the nearest E2M1 code (ties to the even code), given its block scale.
/// Used by checkpoint synthesis; `x / scale` is clamped to ±6.
pub fn e2m1_encode(x: f32, scale: f32) -> u8 {
    let v = x / scale;
    let sign = if v.is_sign_negative() { 8u8 } else { 0 };
    let a = v.abs();
    let mut best = 0u8;
    let mut best_err = f32::INFINITY;
    for code in 0u8..8 {
        let err = (E2M1[code as usize] - a).abs();
        if err < best_err || (err == best_err && code % 2 == 0) {
            best_err = err;
            best = code;
        }
    }
    if best == 0 { 0 } else { best | sign }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_is_exact_power_of_two() {
        assert_eq!(e8m0_scale(127), Some(1.0));
        assert_eq!(e8m0_scale(128), Some(2.0));
        assert_eq!(e8m0_scale(120), Some(2f32.powi(-7)));
        assert_eq!(e8m0_scale(1), Some(2f32.powi(-126)));
        assert_eq!(e8m0_scale(0), Some(2f64.powi(-127) as f32));
        assert_eq!(e8m0_scale(255), None);
    }

    #[test]
    fn low_nibble_is_even_column() {
        let mut packed = vec![0u8; 16];
        packed[0] = 0x72; // col 0 = code 2 (1.0), col 1 = code 7 (6.0)
        packed[1] = 0x9f; // col 2 = code 15 (-6.0), col 3 = code 9 (-0.5)
        let mut out = vec![0f32; 32];
        dequantize_row(&packed, &[128], &mut out).unwrap();
        assert_eq!(&out[..4], &[2.0, 12.0, -12.0, -1.0]);
        assert!(dequantize_row(&packed, &[255], &mut out).is_none());
    }

    #[test]
    fn encode_roundtrips_table() {
        for (code, &v) in E2M1.iter().enumerate() {
            if code == 8 {
                continue; // -0 encodes as +0
            }
            assert_eq!(e2m1_encode(v * 4.0, 4.0) as usize, code);
        }
    }
}
