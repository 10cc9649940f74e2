//! One generation request from body to answer: the body read under its limits, parsed by
//! the API's parser ([`crate::front`]), the prompt encoded, then a place taken (the running
//! generation plus `--queue` waiters, in arrival order), the generation run on a blocking
//! worker, and the answer written by the API's reply ([`crate::transport`]).

use crate::conn::{CancelOnDrop, ClientConn, abandoned, unless_gone};
use crate::engine::{Ending, Engine, GenEvent, run_generation_timed};
use crate::error::{ApiError, json_response};
use crate::front::{self, Api, ParseContext, ReplyParts};
use crate::metrics::RequestLog;
use crate::ops::read_body;
use crate::reply::ReplyContext;
use crate::request::{GenRequest, Limits};
use crate::state::{AppState, unix_now};
use crate::transport::{Answer, answer_with};
use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::mpsc;

/// A request read, parsed and encoded.
struct Prepared {
    req: GenRequest,
    front: front::Front,
    prompt: Vec<u32>,
}

/// The preamble every generation request shares: the body (its bytes counted against the
/// body budget until they are dropped), the API's parser, the shared limits, the prompt
/// encoded off the async threads.
async fn prepare(
    state: &Arc<AppState>,
    engine: &Arc<Engine>,
    api: Api,
    req: Request,
) -> Result<(Prepared, crate::ops::BodyHold), ApiError> {
    let headers: HeaderMap = req.headers().clone();
    let (body, hold) = read_body(
        req,
        state.cfg.max_request_bytes,
        state.cfg.body_deadline,
        &state.bodies,
    )
    .await?;
    let json: Value = serde_json::from_slice(&body)
        .map_err(|_| ApiError::invalid("request body must be valid JSON"))?;
    drop(body);
    let cx = ParseContext {
        limits: limits(state),
        headers: &headers,
        sealer: &state.sealer,
        store: state.store.as_deref(),
    };
    let (gen_req, front) = front::parse(api, &json, &cx)?;
    drop(json);
    let engine_context = engine.max_context;
    let engine = engine.clone();
    let (req, prompt) = tokio::task::spawn_blocking(move || {
        let ids = engine.encode(&gen_req, api.prompt_param());
        ids.map(|ids| (gen_req, ids))
    })
    .await
    .map_err(|e| ApiError::server(format!("prompt encoding failed: {e}")))??;
    // A request that asks for less context than the server admits gets it: its prompt must
    // fit, and the answer stops where the context is full.
    let mut req = req;
    if let Some(limit) = front.context_limit() {
        if prompt.len() > limit {
            return Err(ApiError {
                message: format!(
                    "the prompt is {} tokens long but this request allows {limit} positions of context (`options.num_ctx`); raise `num_ctx` or leave it out (the server admits {} positions)",
                    prompt.len(),
                    engine_context
                ),
                ..ApiError::context_length(api.prompt_param(), prompt.len(), limit)
            });
        }
        req.max_new = req.max_new.min(limit + 1 - prompt.len());
    }
    Ok((Prepared { req, front, prompt }, hold))
}

fn limits(state: &AppState) -> Limits<'_> {
    Limits {
        max_tokens: state.cfg.max_tokens,
        default_thinking: state.cfg.default_thinking,
        model_aliases: &state.cfg.model_aliases,
    }
}

/// `POST /v1/messages/count_tokens`: the prompt tokens a Messages request would have, with
/// nothing generated (the request is parsed as `/v1/messages` parses it, without
/// `max_tokens`).
pub(crate) async fn count_tokens(
    state: &Arc<AppState>,
    req: Request,
) -> Result<Response, ApiError> {
    let engine = state.ready_engine()?;
    let headers: HeaderMap = req.headers().clone();
    let (body, _hold) = read_body(
        req,
        state.cfg.max_request_bytes,
        state.cfg.body_deadline,
        &state.bodies,
    )
    .await?;
    let json: Value = serde_json::from_slice(&body)
        .map_err(|_| ApiError::invalid("request body must be valid JSON"))?;
    drop(body);
    let cx = ParseContext {
        limits: limits(state),
        headers: &headers,
        sealer: &state.sealer,
        store: None,
    };
    crate::messages::check_headers(&headers)?;
    let req = crate::messages::parse_count(&json, &cx.limits, cx.sealer)?;
    crate::request::check_limits(&req)?;
    let n = tokio::task::spawn_blocking(move || engine.count(&req, "messages"))
        .await
        .map_err(|e| ApiError::server(format!("prompt encoding failed: {e}")))??;
    Ok(json_response(StatusCode::OK, &json!({"input_tokens": n})))
}

/// A generation request: validated and encoded before it takes a place, then run.
pub(crate) async fn generate(
    state: Arc<AppState>,
    api: Api,
    req: Request,
    conn: ClientConn,
    log: RequestLog,
    suffix: String,
) -> Result<Response, ApiError> {
    let engine = state.ready_engine()?;
    // The body is read and the request validated before it takes a place: a slow or
    // malformed request never keeps a valid one out.
    let (Prepared { req, front, prompt }, hold) = prepare(&state, &engine, api, req).await?;
    // A place: at most `parallel` generations plus `queue` waiters.
    let sharing = &engine.sharing;
    let Some(ticket) = state.try_reserve(sharing.parallel) else {
        state.stats.busy_rejections.fetch_add(1, Ordering::Relaxed);
        return Err(ApiError::busy());
    };
    drop(hold);
    // Wait for a slot, then for the state the request's context can reach, in arrival
    // order (crate::sharing); a client that leaves drops this future.
    let Some(permit) = unless_gone(&conn, sharing.slots.clone().acquire_owned()).await else {
        return Ok(abandoned());
    };
    let permit = permit.map_err(|_| ApiError::shutting_down())?;
    let units = sharing.units_for(prompt.len(), req.max_new);
    let room = sharing.reserve.clone().acquire_many_owned(units);
    let Some(room) = unless_gone(&conn, room).await else {
        return Ok(abandoned());
    };
    let room = room.map_err(|_| ApiError::shutting_down())?;
    if state.shutdown.load(Ordering::SeqCst) {
        return Err(ApiError::shutting_down());
    }
    let prompt_tokens = prompt.len();
    let interrupt = Arc::new(AtomicBool::new(false));
    let guard = CancelOnDrop {
        flag: interrupt.clone(),
        armed: true,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let worker_state = state.clone();
    let worker_engine = engine.clone();
    let gen_for_worker = req.clone();
    tokio::task::spawn_blocking(move || {
        let slot_permit = permit;
        let state_room = room;
        let reservation = ticket;
        let st = worker_state;
        st.stats.generations_started.fetch_add(1, Ordering::SeqCst);
        if let Ok(mut cur) = st.current.lock() {
            cur.push(interrupt.clone());
        }
        if st.shutdown.load(Ordering::SeqCst) {
            interrupt.store(true, Ordering::SeqCst);
        }
        let (ending, timing) = run_generation_timed(
            &worker_engine,
            &gen_for_worker,
            &prompt,
            &interrupt,
            &st.shutdown,
            |ev| {
                if let GenEvent::Prefill {
                    done,
                    total,
                    reused,
                } = &ev
                {
                    st.metrics.prefill_progress(*done, *total, *reused);
                }
                tx.send(ev).is_ok()
            },
        );
        st.metrics.prefill_progress(0, 0, 0);
        if let Ok(mut cur) = st.current.lock() {
            cur.retain(|f| !Arc::ptr_eq(f, &interrupt));
        }
        // Free the slot before the answer is complete on the client's side.
        drop(state_room);
        drop(slot_permit);
        drop(reservation);
        let counter = match &ending {
            Ending::Cancelled(_)
            | Ending::Event(GenEvent::Failed(ApiError {
                kind: "server_shutting_down",
                ..
            })) => &st.stats.generations_cancelled,
            Ending::Event(_) => &st.stats.generations_finished,
        };
        if let Ending::Event(GenEvent::Done { usage, .. }) = &ending {
            st.metrics.record_generation(usage, &timing);
        }
        st.metrics.record_reuse(&timing);
        counter.fetch_add(1, Ordering::SeqCst);
        if let Ending::Event(ev) = ending {
            let _ = tx.send(ev);
        }
    });
    // A sampled answer names its seed, so that the run can be repeated.
    let seed = req.sampling.map(|s| s.seed);
    let ctx = ReplyContext {
        id: log.id().to_string(),
        suffix,
        created: unix_now(),
        prompt_tokens,
        max_new: req.max_new,
    };
    let reply = front.reply(
        &req,
        ReplyParts {
            ctx,
            engine,
            sealer: state.sealer.clone(),
            store: state.store.clone(),
        },
    );
    let answer = Answer {
        stream: req.stream,
        rx,
        guard,
        conn,
        log,
    };
    with_seed(answer_with(reply, answer).await, seed)
}

/// The `X-Deltafin-Seed` header of a sampled answer (docs/SERVER.md "Sampling").
fn with_seed(answer: Result<Response, ApiError>, seed: Option<u64>) -> Result<Response, ApiError> {
    let Some(seed) = seed else { return answer };
    let mut resp = answer?;
    resp.headers_mut()
        .insert("x-deltafin-seed", axum::http::HeaderValue::from(seed));
    Ok(resp)
}
