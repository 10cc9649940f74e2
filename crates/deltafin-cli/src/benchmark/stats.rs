//! min / median / max spreads and their JSON and table forms.

use serde_json::{Value, json};

/// min / median / max of a sample.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
    pub n: usize,
}

/// Spread of `v` (`None` when empty); the median of an even count is the mean of the middle
/// two.
pub fn spread(v: &[f64]) -> Option<Spread> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let median = if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    };
    Some(Spread {
        min: s[0],
        median,
        max: s[n - 1],
        n,
    })
}

pub(super) fn spread_json(s: Option<Spread>) -> Value {
    match s {
        Some(s) => json!({"min": s.min, "median": s.median, "max": s.max, "n": s.n}),
        None => Value::Null,
    }
}

pub(super) fn overlaps(a: Option<Spread>, b: Option<Spread>) -> Value {
    match (a, b) {
        (Some(a), Some(b)) => json!(a.min <= b.max && b.min <= a.max),
        _ => Value::Null,
    }
}

pub(super) fn ratio(a: Option<Spread>, base: Option<Spread>) -> Value {
    match (a, base) {
        (Some(a), Some(b)) if b.median > 0.0 => json!(a.median / b.median),
        _ => Value::Null,
    }
}

pub(super) fn fmt_spread(s: Option<Spread>, digits: usize) -> String {
    match s {
        Some(s) => format!(
            "{:.d$} / {:.d$} / {:.d$}",
            s.min,
            s.median,
            s.max,
            d = digits
        ),
        None => "-".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_of_an_even_sample_and_of_none() {
        let s = spread(&[3.0, 1.0, 2.0, 10.0]).unwrap();
        assert_eq!((s.min, s.median, s.max, s.n), (1.0, 2.5, 10.0, 4));
        assert!(spread(&[]).is_none());
    }
}
