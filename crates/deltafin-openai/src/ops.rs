//! The endpoints around generation: `GET /health`, `GET /metrics`, `POST /tokenize`,
//! `POST /detokenize` (docs/SERVER.md), and reading a request body under the size limit.

use crate::engine::Engine;
use crate::error::{ApiError, json_response};
use crate::metrics::{self, Metrics, Snapshot};
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

/// A request body that stops arriving for this long is answered with 408.
pub const BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// `GET /health` from whether the engine serves requests: 200 `{"status":"ok"}`, else the
/// state's 503 (`model_loading`, `server_shutting_down`, `server_error` after a failed load).
pub fn health(ready: Result<(), ApiError>) -> Response {
    match ready {
        Ok(()) => json_response(StatusCode::OK, &json!({"status": "ok"})),
        Err(e) if e.kind == "server_shutting_down" => ApiError::stopping().into_response(),
        Err(e) => ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            ..e
        }
        .into_response(),
    }
}

/// `GET /metrics`: the text exposition.
pub fn metrics(m: &Metrics, s: &Snapshot) -> Response {
    let mut resp = Response::new(Body::from(m.render(s)));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(metrics::CONTENT_TYPE),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    resp
}

/// Which tokenizer endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerOp {
    /// `POST /tokenize`.
    Tokenize,
    /// `POST /detokenize`.
    Detokenize,
}

/// `POST /tokenize` and `POST /detokenize` on the loaded model's tokenizer; they never wait
/// for the generation slot.
pub async fn tokenizer(
    engine: Arc<Engine>,
    req: Request,
    limit: usize,
    deadline: Duration,
    budget: &Arc<BodyBudget>,
    op: TokenizerOp,
) -> Result<Response, ApiError> {
    let (body, hold) = read_body(req, limit, deadline, budget).await?;
    let json: Value = serde_json::from_slice(&body)
        .map_err(|_| ApiError::invalid("request body must be valid JSON"))?;
    drop(body);
    // The tokenizer's own work is bounded by the body's size; the bytes are held until the
    // answer is built.
    let _hold = hold;
    let out = tokio::task::spawn_blocking(move || match op {
        TokenizerOp::Tokenize => crate::tokenize::tokenize(&engine.tokenizer, &json),
        TokenizerOp::Detokenize => crate::tokenize::detokenize(&engine.tokenizer, &json),
    })
    .await
    .map_err(|e| ApiError::server(format!("the tokenizer failed: {e}")))??;
    Ok(json_response(StatusCode::OK, &out))
}

/// Default time a whole request body may take to arrive (`ServerConfig::body_deadline`).
pub const BODY_DEADLINE: Duration = Duration::from_secs(120);

/// How many bytes of request bodies all requests together may hold while they are read
/// and validated, as a multiple of the per-request limit.
pub const BODY_BUDGET_REQUESTS: usize = 4;

/// The bytes of request bodies held now, across all connections (docs/SERVER.md "Limits"):
/// a request holds its body's bytes from the first chunk until it is validated and queued
/// (or refused), so that many large bodies arriving together cannot exhaust memory, while
/// slow small ones cost nothing.
#[derive(Debug)]
pub struct BodyBudget {
    held: std::sync::atomic::AtomicUsize,
    cap: usize,
}

impl BodyBudget {
    /// A budget of `cap` bytes.
    pub fn new(cap: usize) -> Self {
        BodyBudget {
            held: std::sync::atomic::AtomicUsize::new(0),
            cap,
        }
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A request's share of the [`BodyBudget`]; given back when dropped.
#[derive(Debug)]
pub struct BodyHold {
    budget: Arc<BodyBudget>,
    bytes: usize,
}

impl BodyHold {
    fn new(budget: &Arc<BodyBudget>) -> Self {
        BodyHold {
            budget: budget.clone(),
            bytes: 0,
        }
    }

    /// Takes `n` more bytes, or refuses when the budget would be passed.
    fn grow(&mut self, n: usize) -> Result<(), ApiError> {
        use std::sync::atomic::Ordering;
        let b = &self.budget;
        b.held
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |h| {
                h.checked_add(n).filter(|&t| t <= b.cap)
            })
            .map_err(|_| ApiError::bodies_busy(b.cap))?;
        self.bytes += n;
        Ok(())
    }
}

impl Drop for BodyHold {
    fn drop(&mut self) {
        self.budget
            .held
            .fetch_sub(self.bytes, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Reads the body: `Content-Length` first, then at most `limit` bytes, each chunk within
/// [`BODY_IDLE_TIMEOUT`] of the last and the whole within `deadline` (a client trickling
/// bytes cannot hold its place for longer). The bytes are held in `budget` until the
/// returned [`BodyHold`] is dropped.
pub async fn read_body(
    req: Request,
    limit: usize,
    deadline: Duration,
    budget: &Arc<BodyBudget>,
) -> Result<(Bytes, BodyHold), ApiError> {
    let until = tokio::time::Instant::now() + deadline;
    if let Some(len) = req.headers().get(header::CONTENT_LENGTH)
        && let Some(len) = len.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok())
        && len > limit as u64
    {
        return Err(ApiError::too_large(limit));
    }
    let mut hold = BodyHold::new(budget);
    let mut stream = req.into_body().into_data_stream();
    let mut buf = Vec::new();
    loop {
        let idle = tokio::time::Instant::now() + BODY_IDLE_TIMEOUT;
        match tokio::time::timeout_at(idle.min(until), stream.next()).await {
            Err(_) if tokio::time::Instant::now() >= until => {
                return Err(ApiError::body_deadline(deadline.as_secs_f64()));
            }
            Err(_) => return Err(ApiError::body_timeout(BODY_IDLE_TIMEOUT.as_secs())),
            Ok(None) => break,
            Ok(Some(Err(_))) => return Err(ApiError::invalid("could not read request body")),
            Ok(Some(Ok(chunk))) => {
                if buf.len() + chunk.len() > limit {
                    return Err(ApiError::too_large(limit));
                }
                hold.grow(chunk.len())?;
                buf.extend_from_slice(&chunk);
            }
        }
    }
    Ok((Bytes::from(buf), hold))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body_of(r: Response) -> (u16, Value) {
        let status = r.status().as_u16();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let bytes = rt
            .block_on(axum::body::to_bytes(r.into_body(), 1 << 20))
            .unwrap();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    #[test]
    fn health_is_ok_only_when_ready() {
        assert_eq!(body_of(health(Ok(()))), (200, json!({"status": "ok"})));
        for (r, kind) in [
            (ApiError::loading(), "model_loading"),
            (ApiError::shutting_down(), "server_shutting_down"),
            (
                ApiError::server("the model failed to load: no disk"),
                "server_error",
            ),
        ] {
            let r = Err(r);
            let (status, v) = body_of(health(r));
            assert_eq!(status, 503);
            assert_eq!(v["error"]["type"], kind);
            assert_eq!(v["error"]["code"], kind);
        }
        let (_, v) = body_of(health(Err(ApiError::shutting_down())));
        assert_eq!(v["error"]["message"], "the server is shutting down");
    }
}
