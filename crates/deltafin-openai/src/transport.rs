//! Answering a generation through a [`Reply`] (every endpoint): one JSON body, or a stream
//! with the headers every stream of the server carries. This is the one place that writes
//! how a generation ended on the request's log line.

use crate::conn::{CancelOnDrop, ClientConn, abandoned, unless_gone};
use crate::engine::{FinishReason, GenEvent, Usage};
use crate::error::{ApiError, json_response};
use crate::metrics::{GenSummary, RequestLog};
use crate::output::Delta;
use crate::reply::Reply;
use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use std::collections::VecDeque;
use std::convert::Infallible;
use tokio::sync::mpsc;

/// Everything an answer needs besides its reply.
pub(crate) struct Answer {
    /// Stream (`true`) or one body.
    pub stream: bool,
    /// The generation's events.
    pub rx: mpsc::UnboundedReceiver<GenEvent>,
    /// Stops the generation when the answer is dropped unfinished.
    pub guard: CancelOnDrop,
    /// The client's connection, to notice it leave.
    pub conn: ClientConn,
    /// The request's log line: held until the answer is complete on the wire.
    pub log: RequestLog,
}

/// Writes how the generation ended on the log line.
fn log_end(log: &RequestLog, end: Option<(FinishReason, &Usage)>) {
    log.set_summary(match end {
        Some((f, u)) => GenSummary {
            tokens: Some((u.prompt_tokens, u.completion_tokens)),
            finish: f.as_str(),
        },
        None => GenSummary {
            tokens: None,
            finish: "error",
        },
    });
}

/// Answers a generation with `reply`: its JSON body, or its stream.
pub(crate) async fn answer_with(reply: Box<dyn Reply>, a: Answer) -> Result<Response, ApiError> {
    if a.stream {
        return Ok(reply_stream(reply, a));
    }
    let conn = a.conn.clone();
    match unless_gone(&conn, collect_reply(reply, a)).await {
        Some(r) => r,
        None => Ok(abandoned()),
    }
}

async fn collect_reply(mut reply: Box<dyn Reply>, a: Answer) -> Result<Response, ApiError> {
    let Answer {
        mut rx,
        mut guard,
        log,
        ..
    } = a;
    let mut all = Delta::default();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Delta(d) => all.extend(d),
            GenEvent::Prefill { .. } => {}
            GenEvent::Done { finish, usage } => {
                guard.armed = false;
                log_end(&log, Some((finish, &usage)));
                let body = reply.body(all, finish, &usage)?;
                return Ok(json_response(StatusCode::OK, &body));
            }
            GenEvent::Failed(e) => {
                guard.armed = false;
                log_end(&log, None);
                return Err(e);
            }
        }
    }
    log_end(&log, None);
    Err(ApiError::server("the generation ended without a result"))
}

struct ReplyStream {
    conn: ClientConn,
    reply: Box<dyn Reply>,
    rx: mpsc::UnboundedReceiver<GenEvent>,
    guard: CancelOnDrop,
    log: RequestLog,
    pending: VecDeque<String>,
    ended: bool,
}

impl ReplyStream {
    fn on_event(&mut self, ev: Option<GenEvent>) {
        let frames = match ev {
            Some(GenEvent::Prefill { done, total, .. }) => self.reply.prefill(done, total),
            Some(GenEvent::Delta(d)) => match self.reply.delta(d) {
                Ok(frames) => frames,
                // The guard stays armed: dropping the stream stops the generation.
                Err(e) => {
                    self.ended = true;
                    log_end(&self.log, None);
                    self.reply.failed(&e)
                }
            },
            Some(GenEvent::Done { finish, usage }) => {
                self.ended = true;
                self.guard.armed = false;
                log_end(&self.log, Some((finish, &usage)));
                self.reply.done(finish, &usage)
            }
            Some(GenEvent::Failed(e)) => {
                self.ended = true;
                self.guard.armed = false;
                log_end(&self.log, None);
                self.reply.failed(&e)
            }
            None => {
                self.ended = true;
                log_end(&self.log, None);
                self.reply
                    .failed(&ApiError::server("the generation ended without a result"))
            }
        };
        self.pending.extend(frames);
    }
}

/// The stream of `reply`: its opening frames at once, then one batch per event. The log line
/// is written when the stream is dropped: when it ended, or when the client left.
fn reply_stream(mut reply: Box<dyn Reply>, a: Answer) -> Response {
    let kind = reply.stream_type();
    let st = ReplyStream {
        pending: reply.opening().into(),
        conn: a.conn,
        reply,
        rx: a.rx,
        guard: a.guard,
        log: a.log,
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
            // A client that leaves while nothing is written (prefill) is noticed too.
            let ev = unless_gone(&st.conn, st.rx.recv()).await?;
            st.on_event(ev);
        }
    });
    stream_headers(Response::new(Body::from_stream(stream)), kind)
}

/// The headers of every stream.
pub(crate) fn stream_headers(mut resp: Response, kind: &'static str) -> Response {
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(header::CONNECTION, HeaderValue::from_static("close"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    resp
}
