//! `--layers` lists: comma-separated ascending, disjoint, non-adjacent items, each `N` or
//! `A-B` with `A < B`, inside the MoE layer range (1…92 for K3). Only the canonical form is
//! accepted (`1-3`, not `1,2,3` or `3-1` or `1-2,3`), so one set has one spelling.

use crate::error::FetchError;

/// Parse `spec` against the inclusive bounds `lo..=hi`.
pub fn parse_layers(spec: &str, lo: usize, hi: usize) -> Result<Vec<usize>, FetchError> {
    let bad = |msg: String| FetchError::Invalid(format!("--layers {spec:?}: {msg}"));
    if spec.is_empty() {
        return Err(bad("empty".into()));
    }
    let num = |s: &str| -> Result<usize, FetchError> {
        if s.is_empty()
            || !s.bytes().all(|b| b.is_ascii_digit())
            || (s.len() > 1 && s.starts_with('0'))
        {
            return Err(bad(format!("{s:?} is not a layer number")));
        }
        let n: usize = s.parse().map_err(|_| bad(format!("{s:?} is too large")))?;
        if n < lo || n > hi {
            return Err(bad(format!("layer {n} is outside {lo}..={hi}")));
        }
        Ok(n)
    };
    let mut out: Vec<usize> = Vec::new();
    for item in spec.split(',') {
        let (a, b) = match item.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a >= b {
                    return Err(bad(format!("range {item:?} must run upwards (A < B)")));
                }
                (a, b)
            }
            None => {
                let n = num(item)?;
                (n, n)
            }
        };
        if let Some(&last) = out.last() {
            if a <= last {
                return Err(bad(format!("{item:?} is not above the previous item")));
            }
            if a == last + 1 {
                return Err(bad(format!(
                    "{item:?} touches the previous item; write the merged range"
                )));
            }
        }
        out.extend(a..=b);
    }
    Ok(out)
}

/// The canonical spelling of a set of layers.
pub fn format_layers(layers: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            layers[i].to_string()
        } else {
            format!("{}-{}", layers[i], layers[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_lists() {
        assert_eq!(
            parse_layers("1-3,5,92", 1, 92).unwrap(),
            vec![1, 2, 3, 5, 92]
        );
        assert_eq!(format_layers(&[1, 2, 3, 5, 92]), "1-3,5,92");
        for bad in [
            "", "0", "93", "3-1", "1,2", "1-2,3", "5,4", "1-3,2", "01", "1-", "a", "1,,2", " 1",
        ] {
            assert!(parse_layers(bad, 1, 92).is_err(), "{bad:?} accepted");
        }
        let e = parse_layers("1-40,93", 1, 92).unwrap_err().to_string();
        assert!(e.contains("93") && e.contains("1..=92"), "{e}");
    }
}
