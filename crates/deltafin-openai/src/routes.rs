//! Routing: which endpoint a request is for, the access check, the request id and log line
//! every request gets, and the endpoints that answer inline (models, health, metrics, the
//! tokenizer, token counting, stored responses, Ollama's listings). Generation requests go
//! to [`crate::admission`].

use crate::access::{self, Admit};
use crate::conn::{ClientConn, ClientLeft};
use crate::error::{ApiError, json_response};
use crate::front::Api;
use crate::metrics::{CLIENT_CLOSED, RequestLog};
use crate::ops::{self, TokenizerOp};
use crate::request::Surface;
use crate::state::AppState;
use crate::{MODEL_ID, bench, models, ollama, page, status};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;

/// What a path is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    /// A generation endpoint.
    Generate(Api),
    /// `POST /v1/messages/count_tokens`.
    CountTokens,
    /// Another endpoint of the Ollama API (`/api/...`).
    Ollama,
    /// Anything else (answered inline, or 404).
    Other,
}

fn route_of(path: &str) -> Route {
    match path {
        "/v1/completions" | "/completions" => Route::Generate(Api::OpenAi(Surface::Completions)),
        "/v1/chat/completions" | "/chat/completions" => Route::Generate(Api::OpenAi(Surface::Chat)),
        "/v1/messages" => Route::Generate(Api::Messages),
        "/v1/messages/count_tokens" => Route::CountTokens,
        "/v1/responses" | "/responses" => Route::Generate(Api::Responses),
        "/api/chat" => Route::Generate(Api::OllamaChat),
        "/api/generate" => Route::Generate(Api::OllamaGenerate),
        p if p.starts_with("/api/") => Route::Ollama,
        _ => Route::Other,
    }
}

/// The id prefix of a response to `route` (each API's own spelling).
fn id_prefix(route: Route) -> &'static str {
    match route {
        Route::Generate(Api::OpenAi(Surface::Completions)) => "cmpl-",
        Route::Generate(Api::OpenAi(Surface::Chat)) => "chatcmpl-",
        Route::Generate(Api::Messages) => "msg_",
        Route::Generate(Api::Responses) => "resp_",
        _ => "req-",
    }
}

/// The API whose error shape a request to `route` gets.
fn error_api(route: Route) -> Option<Api> {
    match route {
        Route::Generate(a) => Some(a),
        Route::CountTokens => Some(Api::Messages),
        Route::Ollama => Some(Api::OllamaChat),
        Route::Other => None,
    }
}

/// An error in the shape of the API a request came to (OpenAI's for the rest).
fn error_for(route: Route, e: ApiError) -> Response {
    match error_api(route) {
        Some(a) => a.error(e),
        None => e.into_response(),
    }
}

/// Every request: its id, its answer, then (when the answer's body is done) its log line
/// and its count.
pub(crate) async fn route(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let route = route_of(&path);
    let suffix = state.id_suffix();
    let log = RequestLog::new(
        state.metrics.clone(),
        method.as_str(),
        &path,
        &format!("{}{suffix}", id_prefix(route)),
        matches!(route, Route::Generate(_)),
    );
    let admitted = access::check(
        &state.cfg.access,
        &state.cfg.host,
        state.loopback,
        &method,
        &path,
        req.headers(),
    );
    let mut resp = match admitted {
        Ok(Admit::Serve(cors)) => {
            let mut resp = dispatch(&state, req, &path, &method, route, &log, suffix).await;
            access::add_cors(resp.headers_mut(), cors);
            resp
        }
        Ok(Admit::Answered(resp)) => resp,
        Err(e) => error_for(route, e),
    };
    log.set_status(if resp.extensions().get::<ClientLeft>().is_some() {
        CLIENT_CLOSED
    } else {
        resp.status().as_u16()
    });
    if let Ok(v) = HeaderValue::from_str(log.id()) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

async fn dispatch(
    state: &Arc<AppState>,
    req: Request,
    path: &str,
    method: &Method,
    route: Route,
    log: &RequestLog,
    suffix: String,
) -> Response {
    let get = method == Method::GET || method == Method::HEAD;
    match route {
        Route::Generate(api) => {
            if method != Method::POST {
                return api.error(ApiError::method_not_allowed());
            }
            let conn = req
                .extensions()
                .get::<axum::extract::ConnectInfo<ClientConn>>()
                .map(|c| c.0.clone())
                .unwrap_or(ClientConn {
                    #[cfg(unix)]
                    sock: None,
                });
            return match crate::admission::generate(
                state.clone(),
                api,
                req,
                conn,
                log.clone(),
                suffix,
            )
            .await
            {
                Ok(resp) => resp,
                Err(e) => api.error(e),
            };
        }
        Route::CountTokens => {
            if method != Method::POST {
                return Api::Messages.error(ApiError::method_not_allowed());
            }
            return crate::admission::count_tokens(state, req)
                .await
                .unwrap_or_else(|e| Api::Messages.error(e));
        }
        Route::Ollama => {
            return ollama::routes::answer(state, req, path, method)
                .await
                .unwrap_or_else(|e| Api::OllamaChat.error(e));
        }
        Route::Other => {}
    }
    let answer = |ok: bool, f: &dyn Fn() -> Response| {
        if ok {
            f()
        } else {
            ApiError::method_not_allowed().into_response()
        }
    };
    let aliases = &state.cfg.model_aliases;
    match path {
        "/v1/models" | "/models" => answer(method == Method::GET, &|| {
            let data: Vec<Value> = std::iter::once(MODEL_ID)
                .chain(aliases.iter().map(String::as_str))
                .map(|id| model_object(state, id))
                .collect();
            json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
        }),
        "/health" | "/v1/health" => answer(get, &|| ops::health(state.ready_engine().map(drop))),
        "/metrics" => answer(get, &|| ops::metrics(&state.metrics, &state.snapshot())),
        "/v1/status" => answer(get, &|| {
            let c = state.metrics.counters();
            status::status(&state.cfg, &c, &state.snapshot(), state.ready_engine())
        }),
        bench::RESULT_PATH | bench::PLOT_PATH if get => {
            bench::serve(path, state.cfg.benchmark_dir.clone()).await
        }
        bench::RESULT_PATH | bench::PLOT_PATH => ApiError::method_not_allowed().into_response(),
        p if page::is_page(p) => match page::serve(p, req.headers()) {
            Some(resp) if get => resp,
            _ => ApiError::method_not_allowed().into_response(),
        },
        "/tokenize" | "/detokenize" => {
            if method != Method::POST {
                return ApiError::method_not_allowed().into_response();
            }
            let op = if path == "/tokenize" {
                TokenizerOp::Tokenize
            } else {
                TokenizerOp::Detokenize
            };
            let limit = state.cfg.max_request_bytes;
            let result = match state.ready_engine() {
                Ok(engine) => {
                    ops::tokenizer(
                        engine,
                        req,
                        limit,
                        state.cfg.body_deadline,
                        &state.bodies,
                        op,
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            result.unwrap_or_else(IntoResponse::into_response)
        }
        p => {
            if let Some(rest) = p
                .strip_prefix("/v1/responses/")
                .or_else(|| p.strip_prefix("/responses/"))
            {
                return crate::responses::store::answer(state.store.as_deref(), method, rest)
                    .unwrap_or_else(IntoResponse::into_response);
            }
            let id = p
                .strip_prefix("/v1/models/")
                .or_else(|| p.strip_prefix("/models/"));
            match id {
                Some(id) if method == Method::GET => {
                    if models::is_served(id, aliases) {
                        json_response(StatusCode::OK, &model_object(state, id))
                    } else {
                        ApiError::model_not_found(id, aliases).into_response()
                    }
                }
                Some(_) => ApiError::method_not_allowed().into_response(),
                None => ApiError::not_found().into_response(),
            }
        }
    }
}

fn model_object(state: &AppState, id: &str) -> Value {
    json!({"id": id, "object": "model", "created": state.created, "owned_by": "deltafin"})
}
