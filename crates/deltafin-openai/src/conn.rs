//! The client's side of a request: noticing that the client left (while a handler waits,
//! during prefill, between stream frames), and what a request that lost its client answers.

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::net::TcpStream;

/// Raises a generation's interrupt flag when dropped armed (the handler or the SSE body
/// went away).
pub(crate) struct CancelOnDrop {
    pub(crate) flag: Arc<AtomicBool>,
    pub(crate) armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.flag.store(true, Ordering::SeqCst);
        }
    }
}

/// The client's socket, duplicated when the connection is accepted, so that a handler can
/// see the client leave while it waits (hyper does not poll a connection whose request said
/// `Connection: close`).
#[derive(Clone)]
pub(crate) struct ClientConn {
    #[cfg(unix)]
    pub(crate) sock: Option<Arc<std::net::TcpStream>>,
}

impl ClientConn {
    /// Duplicates the accepted socket's descriptor (no socket on other platforms, or when
    /// the process is out of descriptors: the client then counts as present).
    pub(crate) fn of(stream: &TcpStream) -> Self {
        #[cfg(unix)]
        {
            use std::os::fd::AsFd;
            // The duplicate shares the socket's non-blocking mode with tokio's descriptor.
            let sock = stream
                .as_fd()
                .try_clone_to_owned()
                .ok()
                .map(|fd| Arc::new(std::net::TcpStream::from(fd)));
            ClientConn { sock }
        }
        #[cfg(not(unix))]
        {
            let _ = stream;
            ClientConn {}
        }
    }
}

/// How often a waiting handler checks its client.
const CLIENT_CHECK_INTERVAL: Duration = Duration::from_millis(50);

impl ClientConn {
    /// Whether the client closed or reset its connection (a peek reads end-of-stream or
    /// fails). Unknown (no socket) counts as present.
    fn is_gone(&self) -> bool {
        #[cfg(unix)]
        if let Some(sock) = &self.sock {
            let mut b = [0u8; 1];
            return match sock.peek(&mut b) {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) => !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ),
            };
        }
        false
    }

    /// Completes once the client is gone.
    async fn gone(&self) {
        loop {
            tokio::time::sleep(CLIENT_CHECK_INTERVAL).await;
            if self.is_gone() {
                return;
            }
        }
    }
}

/// `fut`, or `None` if the client leaves first.
pub(crate) async fn unless_gone<T>(conn: &ClientConn, fut: impl Future<Output = T>) -> Option<T> {
    tokio::select! {
        v = fut => Some(v),
        _ = conn.gone() => None,
    }
}

/// Marks an answer nobody will read (logged and counted as
/// [`crate::metrics::CLIENT_CLOSED`]).
#[derive(Clone, Copy)]
pub(crate) struct ClientLeft;

/// An answer nobody will read (the client is gone).
pub(crate) fn abandoned() -> Response {
    let mut r = Response::new(Body::empty());
    *r.status_mut() = StatusCode::NO_CONTENT;
    r.extensions_mut().insert(ClientLeft);
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}
