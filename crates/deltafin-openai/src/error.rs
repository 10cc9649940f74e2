//! OpenAI-shaped errors: `{"error":{"message","type","param","code"}}` with their HTTP status.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// The message of the 429 answer (product contract §3.2).
pub const BUSY_MESSAGE: &str =
    "Deltafin is already serving one authoritative generation; retry this request later";

/// `text` with every word that is an absolute file path (`/…` with a second `/`, or
/// `C:\…`), quotes and trailing punctuation aside, replaced by `<path>`.
pub fn scrub_paths(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, word) in text.split(' ').enumerate() {
        if i > 0 {
            out.push(' ');
        }
        let trim: &[char] = &['`', '"', '\'', '(', ')', '[', ']', ',', ';', ':'];
        let core = word.trim_matches(trim);
        let unix = core.starts_with('/') && core[1..].contains('/');
        let windows =
            core.len() > 3 && core.as_bytes()[0].is_ascii_alphabetic() && &core[1..3] == ":\\";
        if (unix || windows) && !core.contains("://") {
            let start = word.find(core).unwrap_or(0);
            out.push_str(&word[..start]);
            out.push_str("<path>");
            out.push_str(&word[start + core.len()..]);
        } else {
            out.push_str(word);
        }
    }
    out
}

/// One refusal or failure, rendered as an OpenAI error body.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{status} {kind}: {message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// The error kind, written to `type`.
    pub kind: &'static str,
    /// The error code, written to `code` (the kind unless more specific).
    pub code: &'static str,
    /// The request parameter at fault, if one is.
    pub param: Option<String>,
    /// What is wrong, for a human.
    pub message: String,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            code: kind,
            param: None,
            message: message.into(),
        }
    }

    /// 400 `invalid_request_error` without a parameter.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 `invalid_request_error` naming the parameter `param`.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.to_string()),
            ..Self::invalid(message)
        }
    }

    /// 400 with code `context_length_exceeded`, naming the field that holds the prompt
    /// (`messages`, `prompt`, `input`).
    pub fn context_length(param: &str, prompt: usize, max_context: usize) -> Self {
        ApiError {
            code: "context_length_exceeded",
            param: Some(param.into()),
            ..Self::invalid(format!(
                "the prompt is {prompt} tokens long but this server admits {max_context} positions of context (prompt and answer: the model's context or, if smaller, what the memory plan holds)"
            ))
        }
    }

    /// 404 `not_found`.
    pub fn not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", "endpoint not found")
    }

    /// 404 for `GET /v1/models/{id}` with an id that is neither the model's nor an alias.
    pub fn model_not_found(id: &str, aliases: &[String]) -> Self {
        ApiError {
            code: "model_not_found",
            param: Some("model".into()),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "not_found",
                crate::models::unavailable(id, aliases),
            )
        }
    }

    /// 405 `method_not_allowed`.
    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "method is not allowed for this endpoint",
        )
    }

    /// 413 `request_too_large`.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            format!("request body exceeds the {limit}-byte limit"),
        )
    }

    /// 408 `request_timeout`: the body stopped arriving.
    pub fn body_timeout(seconds: u64) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            format!("no request body bytes arrived for {seconds} s; closing the connection"),
        )
    }

    /// 408 `request_timeout`: the whole body did not arrive within the deadline.
    pub fn body_deadline(seconds: f64) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            format!("the request body did not arrive within {seconds} s; closing the connection"),
        )
    }

    /// 429 `server_busy`.
    pub fn busy() -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "server_busy", BUSY_MESSAGE)
    }

    /// 429 `server_busy`: the request bodies being read together would pass `cap` bytes.
    pub fn bodies_busy(cap: usize) -> Self {
        Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "server_busy",
            format!("request bodies being read exceed {cap} bytes in all; retry later"),
        )
    }

    /// 500 `server_error`.
    ///
    /// The server's files are nobody's business but its operator's: the full message goes
    /// to the server's log, and the body says the same with every absolute path replaced by
    /// `<path>`.
    pub fn server(message: impl Into<String>) -> Self {
        let message = message.into();
        let public = scrub_paths(&message);
        if public != message {
            crate::log_line!("[deltafin serve] server error: {message}");
        }
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", public)
    }

    /// 503 `model_loading`.
    pub fn loading() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "model_loading",
            "the model is still loading; retry this request when it is ready",
        )
    }

    /// 503 `server_shutting_down`.
    pub fn shutting_down() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_shutting_down",
            "the server is shutting down; the generation was cancelled",
        )
    }

    /// 503 `server_shutting_down` for a request that arrives while the server stops
    /// (`GET /health`).
    pub fn stopping() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_shutting_down",
            "the server is shutting down",
        )
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }

    /// Whether the connection must be closed after this answer (the body may be unread).
    fn closes_connection(&self) -> bool {
        matches!(
            self.status,
            StatusCode::PAYLOAD_TOO_LARGE
                | StatusCode::TOO_MANY_REQUESTS
                | StatusCode::REQUEST_TIMEOUT
        )
    }
}

/// A JSON response with the contract's headers.
pub fn json_response(status: StatusCode, body: &Value) -> Response {
    let mut resp = (status, body.to_string()).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json; charset=utf-8"),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    resp
}

impl ApiError {
    /// The answer with `body` (another API's error shape) and this error's status and
    /// connection headers.
    pub fn response_with_body(&self, body: &Value) -> Response {
        let mut resp = json_response(self.status, body);
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.closes_connection() {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.response_with_body(&self.body())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_errors_name_no_paths() {
        let e = ApiError::server(
            "the model failed to load: cannot build the model from /work/mini-k3: `/work/mini-k3/model-00001.safetensors`: permission denied (see C:\\models\\k3)",
        );
        assert_eq!(
            e.message,
            "the model failed to load: cannot build the model from <path>: `<path>`: permission denied (see <path>)"
        );
        // Not paths: URLs, fractions, a lone slash.
        let e = ApiError::server("read 3/4 of https://hub.example/a/b at / speed");
        assert_eq!(e.message, "read 3/4 of https://hub.example/a/b at / speed");
    }
}
