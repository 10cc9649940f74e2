//! Answering a generation through a [`Reply`] (the Messages and Responses endpoints): one
//! JSON body, or an event stream with the headers every stream of the server carries.

use crate::conn::{CancelOnDrop, ClientConn, abandoned, unless_gone};
use crate::engine::{GenEvent, prefill_comment};
use crate::error::{ApiError, json_response};
use crate::output::Delta;
use crate::reply::Reply;
use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use std::collections::VecDeque;
use std::convert::Infallible;
use tokio::sync::mpsc;

/// Answers a generation with `reply`: its JSON body, or its event stream.
pub(crate) async fn answer_with(
    reply: Box<dyn Reply>,
    stream: bool,
    rx: mpsc::UnboundedReceiver<GenEvent>,
    guard: CancelOnDrop,
    conn: ClientConn,
) -> Result<Response, ApiError> {
    if stream {
        return Ok(reply_sse(reply, rx, guard, conn));
    }
    match unless_gone(&conn, collect_reply(reply, rx, guard)).await {
        Some(r) => r,
        None => Ok(abandoned()),
    }
}

async fn collect_reply(
    mut reply: Box<dyn Reply>,
    mut rx: mpsc::UnboundedReceiver<GenEvent>,
    mut guard: CancelOnDrop,
) -> Result<Response, ApiError> {
    let mut all = Delta::default();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Delta(d) => all.extend(d),
            GenEvent::Prefill { .. } => {}
            GenEvent::Done { finish, usage } => {
                guard.armed = false;
                let body = reply.body(all, finish, &usage)?;
                return Ok(json_response(StatusCode::OK, &body));
            }
            GenEvent::Failed(e) => {
                guard.armed = false;
                return Err(e);
            }
        }
    }
    Err(ApiError::server("the generation ended without a result"))
}

struct ReplySse {
    conn: ClientConn,
    reply: Box<dyn Reply>,
    rx: mpsc::UnboundedReceiver<GenEvent>,
    guard: CancelOnDrop,
    pending: VecDeque<String>,
    ended: bool,
}

impl ReplySse {
    fn on_event(&mut self, ev: Option<GenEvent>) {
        let frames = match ev {
            Some(GenEvent::Prefill { done, total, .. }) => vec![prefill_comment(done, total)],
            Some(GenEvent::Delta(d)) => match self.reply.delta(d) {
                Ok(frames) => frames,
                // The guard stays armed: dropping the stream stops the generation.
                Err(e) => {
                    self.ended = true;
                    self.reply.failed(&e)
                }
            },
            Some(GenEvent::Done { finish, usage }) => {
                self.ended = true;
                self.guard.armed = false;
                self.reply.done(finish, &usage)
            }
            Some(GenEvent::Failed(e)) => {
                self.ended = true;
                self.guard.armed = false;
                self.reply.failed(&e)
            }
            None => {
                self.ended = true;
                self.reply
                    .failed(&ApiError::server("the generation ended without a result"))
            }
        };
        self.pending.extend(frames);
    }
}

/// The event stream of `reply`: its opening events at once, then one batch per event.
fn reply_sse(
    mut reply: Box<dyn Reply>,
    rx: mpsc::UnboundedReceiver<GenEvent>,
    guard: CancelOnDrop,
    conn: ClientConn,
) -> Response {
    let st = ReplySse {
        pending: reply.opening().into(),
        conn,
        reply,
        rx,
        guard,
        ended: false,
    };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(f) = st.pending.pop_front() {
                return Some((Ok::<Bytes, Infallible>(Bytes::from(f)), st));
            }
            if st.ended {
                return None;
            }
            let ev = unless_gone(&st.conn, st.rx.recv()).await?;
            st.on_event(ev);
        }
    });
    sse_headers(Response::new(Body::from_stream(stream)))
}

/// The headers of every event stream.
pub(crate) fn sse_headers(mut resp: Response) -> Response {
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(header::CONNECTION, HeaderValue::from_static("close"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    resp
}
