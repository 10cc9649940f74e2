//! Pieces of the Anthropic wire format the request and reply sides share: the error body,
//! thinking signatures, stop reasons and strict object checks.

use crate::engine::{FinishReason, Usage};
use crate::error::ApiError;
use axum::http::StatusCode;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

/// The endpoint name used in messages.
pub const ENDPOINT: &str = "/v1/messages";

/// Anthropic's error `type` for one of the server's errors (by HTTP status).
pub fn error_type(e: &ApiError) -> &'static str {
    match e.status {
        StatusCode::BAD_REQUEST | StatusCode::METHOD_NOT_ALLOWED => "invalid_request_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::REQUEST_TIMEOUT => "timeout_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        _ => "api_error",
    }
}

/// `{"type":"error","error":{"type":…,"message":…}}`.
pub fn error_body(e: &ApiError) -> Value {
    json!({"type": "error", "error": {"type": error_type(e), "message": e.message}})
}

/// The signature of a thinking block: a digest of its text, so that a block sent back
/// changed is recognised (docs/SERVER.md, "Thinking").
pub fn signature(thinking: &str) -> String {
    let digest = Sha256::digest(thinking.as_bytes());
    format!("deltafin-k3-sha256:{}", hex::encode(digest))
}

/// Anthropic's `stop_reason` and `stop_sequence` for how the generation ended.
pub fn stop_reason(
    finish: FinishReason,
    usage: &Usage,
    max_new: usize,
    stops: &[String],
) -> (&'static str, Option<String>) {
    match finish {
        FinishReason::Stop => ("end_turn", None),
        FinishReason::StopSequence(i) => ("stop_sequence", stops.get(i).cloned()),
        FinishReason::ToolCalls => ("tool_use", None),
        // Fewer tokens than asked: the context filled first.
        FinishReason::Length if usage.completion_tokens < max_new => {
            ("model_context_window_exceeded", None)
        }
        FinishReason::Length => ("max_tokens", None),
    }
}

/// The usage object: `input_tokens`, `output_tokens`, no prompt cache, thinking tokens.
pub fn usage_object(prompt_tokens: usize, usage: Option<&Usage>) -> Value {
    let (output, thinking) = usage.map_or((0, 0), |u| (u.completion_tokens, u.reasoning_tokens));
    json!({
        "input_tokens": prompt_tokens,
        "output_tokens": output,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens_details": {"thinking_tokens": thinking},
    })
}

pub use crate::strict::{bad, object, string};

/// Refuses a key of `obj` that is not in `allowed`, naming it and where it is.
pub fn only_keys(
    obj: &Map<String, Value>,
    allowed: &[&str],
    param: &str,
    what: &str,
) -> Result<(), ApiError> {
    crate::strict::only_keys(obj, allowed, param, what, ENDPOINT)
}

/// A `cache_control` value: `{"type":"ephemeral"}` with an optional `ttl` of `5m` or `1h`.
/// It asks for prompt caching, which changes no output; Deltafin has no prompt cache.
pub fn check_cache_control(v: Option<&Value>, param: &str) -> Result<(), ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let obj = object(v, param, "`cache_control`")?;
    only_keys(obj, &["type", "ttl"], param, "`cache_control`")?;
    if obj.get("type") != Some(&Value::from("ephemeral")) {
        return Err(bad(param, "`cache_control.type` must be \"ephemeral\""));
    }
    match obj.get("ttl") {
        None | Some(Value::Null) => Ok(()),
        Some(t) if t == "5m" || t == "1h" => Ok(()),
        Some(_) => Err(bad(param, "`cache_control.ttl` must be \"5m\" or \"1h\"")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_take_anthropics_types() {
        let b = error_body(&ApiError::invalid("nope"));
        assert_eq!(
            b,
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "nope"}})
        );
        assert_eq!(error_type(&ApiError::busy()), "rate_limit_error");
        assert_eq!(error_type(&ApiError::too_large(1)), "request_too_large");
        assert_eq!(error_type(&ApiError::loading()), "overloaded_error");
        assert_eq!(error_type(&ApiError::server("x")), "api_error");
        assert_eq!(error_type(&ApiError::not_found()), "not_found_error");
        assert_eq!(error_type(&ApiError::body_timeout(60)), "timeout_error");
    }

    #[test]
    fn signatures_depend_on_the_text() {
        assert_eq!(signature("abc"), signature("abc"));
        assert_ne!(signature("abc"), signature("abd"));
        assert!(signature("").starts_with("deltafin-k3-sha256:"));
        assert_eq!(signature("").len(), "deltafin-k3-sha256:".len() + 64);
    }

    #[test]
    fn stop_reasons() {
        let u = Usage {
            prompt_tokens: 3,
            completion_tokens: 5,
            reasoning_tokens: 0,
        };
        let stops = vec!["x".to_string(), "yz".to_string()];
        assert_eq!(
            stop_reason(FinishReason::Stop, &u, 5, &stops),
            ("end_turn", None)
        );
        assert_eq!(
            stop_reason(FinishReason::StopSequence(1), &u, 5, &stops),
            ("stop_sequence", Some("yz".into()))
        );
        assert_eq!(
            stop_reason(FinishReason::ToolCalls, &u, 5, &stops).0,
            "tool_use"
        );
        assert_eq!(
            stop_reason(FinishReason::Length, &u, 5, &stops).0,
            "max_tokens"
        );
        assert_eq!(
            stop_reason(FinishReason::Length, &u, 9, &stops).0,
            "model_context_window_exceeded"
        );
    }

    #[test]
    fn cache_control_rules() {
        assert!(check_cache_control(None, "p").is_ok());
        assert!(check_cache_control(Some(&json!({"type": "ephemeral", "ttl": "1h"})), "p").is_ok());
        assert!(check_cache_control(Some(&json!({"type": "persistent"})), "p").is_err());
        assert!(
            check_cache_control(Some(&json!({"type": "ephemeral", "ttl": "2h"})), "p").is_err()
        );
        let e =
            check_cache_control(Some(&json!({"type": "ephemeral", "scope": 1})), "p").unwrap_err();
        assert!(e.message.contains("`scope`"), "{e}");
    }
}
