//! The numerical-failure check of the forward pass: every layer's attention and FFN outputs,
//! the embedding rows and the logits must be finite. A NaN or an infinity (damaged weights:
//! an infinite norm weight, an E8M0 scale byte of 0xFF) stops the pass with
//! [`ModelError::NonFinite`] naming where it first appeared, instead of letting a NaN row
//! reach the token rule (whose argmax of NaNs is token 0).
//!
//! The check rides on the additions the layer loop makes anyway: `P ← P + o` and
//! `P ← P + FFN` become [`add_checked`], which ORs the exponent bits of each sum as it
//! writes it (branch-free, vectorised, in the same pass over memory), and a NaN or infinity
//! in `o` or the FFN output makes its sum non-finite. The few outputs not added that way (a
//! block's first attention output, the embedding rows, the MoE's routed and shared sums, the
//! logits) are scanned once; on K3 that is a few `D`-sized rows per token beside weight reads
//! of hundreds of megabytes. Only on failure is anything scanned twice, to name the site.

use crate::error::ModelError;

/// Whether every value of `v` is finite (neither NaN nor ±infinity).
#[inline]
pub fn all_finite(v: &[f32]) -> bool {
    // No early exit within a chunk: a branch-free OR vectorises.
    v.chunks(1024)
        .all(|c| c.iter().fold(0u32, |acc, &x| acc | bad(x)) == 0)
}

/// Whether the exponent bits of `x` are all ones (an infinity or a NaN), as 0 or 1.
#[inline(always)]
fn bad(x: f32) -> u32 {
    const EXP: u32 = 0x7f80_0000;
    u32::from(x.to_bits() & EXP == EXP)
}

/// `p += o`, element by element; whether every sum is finite (one pass, no branch).
#[inline]
pub fn add_checked(p: &mut [f32], o: &[f32]) -> bool {
    let mut acc = 0u32;
    for (a, &b) in p.iter_mut().zip(o) {
        *a += b;
        acc |= bad(*a);
    }
    acc == 0
}

/// `Err(NonFinite)` at `site` (built only on failure) unless `v` is all finite.
#[inline]
pub fn check(v: &[f32], site: impl FnOnce() -> String) -> Result<(), ModelError> {
    if all_finite(v) {
        Ok(())
    } else {
        Err(ModelError::NonFinite { site: site() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nan_and_infinities_anywhere() {
        let mut v = vec![1.5f32; 3000];
        assert!(all_finite(&v));
        assert!(all_finite(&[]));
        assert!(all_finite(&[
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            0.0,
            -0.0
        ]));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN] {
            for at in [0, 1023, 1024, 2999] {
                v[at] = bad;
                assert!(!all_finite(&v), "{bad} at {at}");
                v[at] = 1.5;
            }
        }
        let e = check(&[f32::NAN], || "layer 3's attention output".into()).unwrap_err();
        assert!(
            e.to_string().contains(
                "non-finite value (NaN or infinity) first appeared in layer 3's attention output"
            ),
            "{e}"
        );
        assert!(check(&[1.0], || unreachable!()).is_ok());
        let mut p = vec![1.0f32; 100];
        assert!(add_checked(&mut p, &[2.0; 100]));
        assert_eq!(p, [3.0; 100]);
        let mut o = vec![0.5f32; 100];
        o[77] = f32::NAN;
        assert!(!add_checked(&mut p, &o));
        assert!(p[77].is_nan() && p[76] == 3.5);
        // A finite sum that overflows is not finite either.
        let mut p = vec![f32::MAX];
        assert!(!add_checked(&mut p, &[f32::MAX]));
    }
}
