//! The accept loop (docs/SERVER.md "Limits"): at most `max_connections` open connections (one
//! more is answered 503 `too_many_connections` and closed), HTTP/1.1 with a deadline on every
//! request head (which is also the keep-alive idle limit: an idle connection is closed when
//! the next head does not arrive in time), and a graceful shutdown.
//!
//! axum's own `serve` has no timer (so no header deadline) and no connection cap, hence this
//! loop over hyper's connection builder.

use crate::conn::ClientConn;
use axum::Router;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tower_service::Service;

/// What the loop enforces.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ListenLimits {
    pub(crate) max_connections: usize,
    pub(crate) header_deadline: Duration,
}

/// Counters of the loop, read by `/metrics` and the tests.
#[derive(Debug, Default)]
pub(crate) struct ConnCounters {
    /// Connections open now.
    pub(crate) open: AtomicU64,
    /// Connections refused because `max_connections` were open.
    pub(crate) refused: AtomicU64,
    /// Failed `accept` calls (e.g. out of file descriptors).
    pub(crate) accept_errors: AtomicU64,
}

/// Holds an open connection's place; counts it down when the connection ends.
struct Open {
    _permit: tokio::sync::OwnedSemaphorePermit,
    counters: Arc<ConnCounters>,
}

impl Drop for Open {
    fn drop(&mut self) {
        self.counters.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Serves `app` on `listener` until `stop` completes, then stops accepting and waits up to
/// `grace` for the open connections to finish their requests.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ListenLimits,
    counters: Arc<ConnCounters>,
    stop: impl Future<Output = ()>,
    grace: Duration,
) -> bool {
    let places = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_deadline)
        .keep_alive(true);
    tokio::pin!(stop);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = &mut stop => break,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(e) => {
                // Out of descriptors or a transient error: back off instead of spinning.
                let n = counters.accept_errors.fetch_add(1, Ordering::Relaxed);
                if n.is_power_of_two() || n == 0 {
                    crate::log_line!("[deltafin serve] accept failed ({e}); retrying");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = places.clone().try_acquire_owned() else {
            counters.refused.fetch_add(1, Ordering::Relaxed);
            refuse(stream, limits.max_connections);
            continue;
        };
        counters.open.fetch_add(1, Ordering::SeqCst);
        let open = Open {
            _permit: permit,
            counters: counters.clone(),
        };
        let _ = stream.set_nodelay(true);
        let client = ClientConn::of(&stream);
        let router = app.clone();
        let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
            req.extensions_mut().insert(ConnectInfo(client.clone()));
            let mut router = router.clone();
            async move { router.call(req.map(axum::body::Body::new)).await }
        });
        let conn = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            // A connection's errors (a reset, a head past its deadline) end that connection
            // only.
            let _ = conn.await;
            drop(open);
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => true,
        () = tokio::time::sleep(grace) => false,
    }
}

/// How long a refused connection is kept to drain what the client sent (closing a socket
/// with unread input resets it, and the client could lose the answer).
const REFUSE_LINGER: Duration = Duration::from_secs(1);

/// Answers a connection over the cap with a 503 and closes it, in a task that lives at most
/// [`REFUSE_LINGER`].
fn refuse(mut stream: TcpStream, cap: usize) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = serde_json::json!({"error": {
        "message": format!("the server has {cap} open connections (--max-connections); retry later"),
        "type": "server_busy",
        "param": null,
        "code": "too_many_connections",
    }})
    .to_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    tokio::spawn(async move {
        let _ = tokio::time::timeout(REFUSE_LINGER, async {
            stream.write_all(answer.as_bytes()).await?;
            stream.shutdown().await?;
            let mut sink = [0u8; 4096];
            while stream.read(&mut sink).await? > 0 {}
            Ok::<(), std::io::Error>(())
        })
        .await;
    });
}
