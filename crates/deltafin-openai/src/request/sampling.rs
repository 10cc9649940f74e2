//! The sampling fields every endpoint reads (docs/SERVER.md "Sampling"): `temperature`,
//! `top_p`, `top_k`, `min_p`, `seed`. No temperature (or 0) is greedy decoding, exactly as
//! before; then the filters still validate but change nothing (each keeps the greedy token).

use crate::error::ApiError;
use deltafin_k3::sampling::{Sampling, fresh_seed};
use serde_json::Value;

use super::finite_number;

/// Reads the sampling fields through `get` (absent and `null` are the same), with
/// `max_temperature` the endpoint's ceiling (OpenAI 2, Anthropic 1). A request that samples
/// without a `seed` gets a fresh one.
pub fn parse_sampling<'a>(
    get: impl Fn(&str) -> Option<&'a Value>,
    max_temperature: f64,
) -> Result<Option<Sampling>, ApiError> {
    let bad = |field: &str, what: &str| {
        ApiError::invalid_param(field, format!("`{field}` must be {what}"))
    };
    let temperature = match get("temperature") {
        None => 0.0,
        Some(v) => finite_number(v)
            .filter(|t| (0.0..=max_temperature).contains(t))
            .ok_or_else(|| bad("temperature", &format!("a number in 0..={max_temperature}")))?,
    };
    let top_p = match get("top_p") {
        None => 1.0,
        Some(v) => finite_number(v)
            .filter(|p| *p > 0.0 && *p <= 1.0)
            .ok_or_else(|| bad("top_p", "a number in (0, 1]"))?,
    };
    let top_k = match get("top_k") {
        None => 0,
        // 0 and -1 are the "off" spellings of vLLM and llama.cpp.
        Some(v) if v.as_i64() == Some(-1) => 0,
        Some(v) => v
            .as_u64()
            .and_then(|k| usize::try_from(k).ok())
            .ok_or_else(|| bad("top_k", "an integer >= 0 (0 or -1: off)"))?,
    };
    let min_p = match get("min_p") {
        None => 0.0,
        Some(v) => finite_number(v)
            .filter(|m| (0.0..=1.0).contains(m))
            .ok_or_else(|| bad("min_p", "a number in 0..=1"))?,
    };
    let seed = match get("seed") {
        None => None,
        // OpenAI documents `seed` as an integer; negative ones are read as their two's
        // complement, so every integer names one stream.
        Some(v) => Some(
            v.as_u64()
                .or_else(|| v.as_i64().map(|i| i as u64))
                .ok_or_else(|| bad("seed", "an integer"))?,
        ),
    };
    if temperature == 0.0 {
        return Ok(None);
    }
    let seed = seed.unwrap_or_else(fresh_seed);
    Sampling::new(temperature, top_k, top_p, min_p, seed)
        .map(Some)
        .map_err(|e| ApiError::invalid_param("temperature", e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value, max: f64) -> Result<Option<Sampling>, ApiError> {
        parse_sampling(|k| v.get(k).filter(|x| !x.is_null()), max)
    }

    #[test]
    fn greedy_without_a_temperature() {
        assert_eq!(parse(json!({}), 2.0).unwrap(), None);
        assert_eq!(
            parse(json!({"temperature": 0, "top_p": 0.5, "seed": 3}), 2.0).unwrap(),
            None
        );
    }

    #[test]
    fn sampling_fields_are_read() {
        let s = parse(
            json!({"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": -1}),
            2.0,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (s.temperature, s.top_p, s.top_k, s.min_p, s.seed),
            (0.7, 0.9, 40, 0.05, u64::MAX)
        );
        assert_eq!(
            parse(json!({"temperature": 1, "top_k": -1}), 1.0)
                .unwrap()
                .unwrap()
                .top_k,
            0
        );
        // A fresh seed when none is given.
        assert!(parse(json!({"temperature": 1}), 2.0).unwrap().is_some());
    }

    #[test]
    fn bad_values_name_their_field() {
        for (v, field) in [
            (json!({"temperature": 2.5}), "temperature"),
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"temperature": 1, "top_p": 0}), "top_p"),
            (json!({"temperature": 1, "top_k": 1.5}), "top_k"),
            (json!({"temperature": 1, "min_p": 2}), "min_p"),
            (json!({"temperature": 1, "seed": "x"}), "seed"),
        ] {
            let e = parse(v.clone(), 2.0).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{v}");
        }
        assert!(parse(json!({"temperature": 1.5}), 1.0).is_err());
    }
}
