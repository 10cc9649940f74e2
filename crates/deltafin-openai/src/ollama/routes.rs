//! Ollama's endpoints besides generation: `GET /api/tags` and `GET /api/ps` (the model),
//! `POST /api/show` (its details, context length and capabilities), `GET /api/version`; the
//! model-management and embedding endpoints are refused with what to do instead.

use super::{API_VERSION, served, timestamp};
use crate::MODEL_ID;
use crate::error::{ApiError, json_response};
use crate::ops::read_body;
use crate::state::AppState;
use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::response::Response;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

/// What Ollama's listings say about the model.
fn details() -> Value {
    json!({
        "parent_model": "", "format": "safetensors", "family": "kimi_linear",
        "families": ["kimi_linear"], "parameter_size": "2.8T", "quantization_level": "MXFP4",
    })
}

/// A listing entry for `name`.
fn entry(state: &AppState, name: &str) -> Value {
    let modified = UNIX_EPOCH + Duration::from_secs(state.created);
    json!({
        "name": name, "model": name, "modified_at": timestamp(modified), "size": 0,
        "digest": "", "details": details(),
    })
}

fn names(state: &AppState) -> Vec<String> {
    std::iter::once(MODEL_ID.to_string())
        .chain(state.cfg.model_aliases.iter().cloned())
        .collect()
}

/// Answers `path` (under `/api/`).
pub(crate) async fn answer(
    state: &Arc<AppState>,
    req: Request,
    path: &str,
    method: &Method,
) -> Result<Response, ApiError> {
    let ok = |v: Value| json_response(StatusCode::OK, &v);
    let get = method == Method::GET || method == Method::HEAD;
    let need = |ok: bool| {
        if ok {
            Ok(())
        } else {
            Err(ApiError::method_not_allowed())
        }
    };
    match path {
        // Claude Code's reachability probe (it sends `HEAD /api/hello` at every start).
        "/api/hello" => {
            need(get)?;
            Ok(ok(json!({})))
        }
        "/api/version" => {
            need(get)?;
            Ok(ok(json!({"version": API_VERSION})))
        }
        "/api/tags" => {
            need(get)?;
            let models: Vec<Value> = names(state).iter().map(|n| entry(state, n)).collect();
            Ok(ok(json!({"models": models})))
        }
        "/api/ps" => {
            need(get)?;
            let engine = state.ready_engine().ok();
            let models: Vec<Value> = match &engine {
                Some(e) => names(state)
                    .iter()
                    .map(|n| {
                        let mut v = entry(state, n);
                        v["expires_at"] = Value::from("0001-01-01T00:00:00Z");
                        v["size_vram"] = Value::from(0);
                        v["context_length"] = Value::from(e.max_context);
                        v
                    })
                    .collect(),
                None => Vec::new(),
            };
            Ok(ok(json!({"models": models})))
        }
        "/api/show" => {
            need(*method == Method::POST)?;
            let (body, _hold) = read_body(
                req,
                state.cfg.max_request_bytes,
                state.cfg.body_deadline,
                &state.bodies,
            )
            .await?;
            let v: Value = serde_json::from_slice(&body)
                .map_err(|_| ApiError::invalid("request body must be valid JSON"))?;
            let obj = v
                .as_object()
                .ok_or_else(|| ApiError::invalid("request body must be a JSON object"))?;
            crate::strict::known_fields(obj, &["model", "name", "verbose", "system"], "/api/show")?;
            let name = obj
                .get("model")
                .or_else(|| obj.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid_param("model", "`model` must be a string"))?;
            if !served(name, &state.cfg.model_aliases) {
                return Err(ApiError::model_not_found(name, &state.cfg.model_aliases));
            }
            let engine = state.ready_engine()?;
            let modified = UNIX_EPOCH + Duration::from_secs(state.created);
            Ok(ok(json!({
                "modelfile": format!("# Kimi K3, served by deltafin\nFROM {MODEL_ID}\n"),
                "parameters": "",
                "template": "K3's XTML chat template (docs/K3.md §8), rendered by deltafin",
                "details": details(),
                "model_info": {
                    "general.architecture": "kimi_linear",
                    "kimi_linear.context_length": engine.max_context,
                    "kimi_linear.embedding_length": engine.model.dims.hidden_size,
                    "kimi_linear.block_count": engine.model.layers.len(),
                },
                "capabilities": ["completion", "tools", "thinking"],
                "modified_at": timestamp(modified),
            })))
        }
        "/api/embed" | "/api/embeddings" => Err(refused(
            "embeddings are not implemented: Deltafin serves Kimi K3, a generative model with no embedding head",
        )),
        "/api/pull" | "/api/push" | "/api/create" | "/api/copy" | "/api/delete" => Err(refused(
            "model management is not implemented: this server runs the one Kimi K3 install it was started on (`deltafin setup` installs it)",
        )),
        p if p.starts_with("/api/blobs") => Err(refused(
            "model management is not implemented: this server runs the one Kimi K3 install it was started on",
        )),
        _ => Err(ApiError::not_found()),
    }
}

fn refused(why: &str) -> ApiError {
    ApiError {
        status: StatusCode::NOT_IMPLEMENTED,
        code: "not_implemented",
        ..ApiError::invalid(why)
    }
}
