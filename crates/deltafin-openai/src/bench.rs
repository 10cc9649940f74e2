//! `GET /v1/benchmark` and `GET /v1/benchmark/latency.svg` (docs/SERVER.md "The last
//! benchmark"): the newest `deltafin benchmark` evidence directory under the server's
//! benchmark directory, its `result.json` and its latency plot, for the chat page.
//!
//! Only the two fixed file names of an evidence directory are ever read, each under a size
//! limit; nothing of the request names a path.

use crate::error::{ApiError, json_response, scrub_paths};
use crate::page;
use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// The route of the result.
pub const RESULT_PATH: &str = "/v1/benchmark";
/// The route of the plot.
pub const PLOT_PATH: &str = "/v1/benchmark/latency.svg";
/// The largest `result.json` or `latency.svg` served.
pub const MAX_FILE_BYTES: u64 = 16 << 20;
/// Entries of the benchmark directory looked at, at most.
const MAX_ENTRIES: usize = 10_000;
/// The policy of the plot: an SVG opened on its own runs no script and loads nothing.
const PLOT_CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; sandbox";

fn not_found(message: String) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "not_found",
        code: "benchmark_not_found",
        param: None,
        message: scrub_paths(&message),
    }
}

/// When `p` was last modified (`None`: it is not a readable file).
fn modified(p: &Path) -> Option<SystemTime> {
    let m = std::fs::metadata(p).ok()?;
    m.is_file().then(|| m.modified().ok()).flatten()
}

/// The evidence directory to show: `dir` itself when it holds a `result.json`, else its
/// subdirectory whose `result.json` was written last (ties: the greater name).
pub fn latest(dir: &Path) -> Result<(PathBuf, SystemTime), ApiError> {
    if let Some(t) = modified(&dir.join("result.json")) {
        return Ok((dir.to_path_buf(), t));
    }
    let entries = std::fs::read_dir(dir).map_err(|e| {
        not_found(format!(
            "no benchmark to show: the benchmark directory {} cannot be read ({e}); `deltafin benchmark` writes its evidence under bench-results/, and `deltafin serve --benchmark-dir DIR` names where to look",
            dir.display()
        ))
    })?;
    let mut best: Option<(SystemTime, PathBuf)> = None;
    for entry in entries.take(MAX_ENTRIES).flatten() {
        let p = entry.path();
        let Some(t) = modified(&p.join("result.json")) else {
            continue;
        };
        if best.as_ref().is_none_or(|(bt, bp)| (t, &p) > (*bt, bp)) {
            best = Some((t, p));
        }
    }
    best.map(|(t, p)| (p, t)).ok_or_else(|| {
        not_found(format!(
            "no benchmark to show: {} holds no `deltafin benchmark` evidence directory (one with a result.json)",
            dir.display()
        ))
    })
}

/// `path` read whole, when it is a file of at most [`MAX_FILE_BYTES`].
fn read_small(path: &Path) -> Result<Vec<u8>, ApiError> {
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let len = std::fs::metadata(path)
        .map_err(|e| not_found(format!("the last benchmark has no {name} ({e})")))?
        .len();
    if len > MAX_FILE_BYTES {
        return Err(ApiError::server(format!(
            "the last benchmark's {name} is {len} bytes, more than the {MAX_FILE_BYTES} served"
        )));
    }
    std::fs::read(path).map_err(|e| ApiError::server(format!("cannot read {name}: {e}")))
}

/// The answer of `GET /v1/benchmark`.
fn result(dir: &Path) -> Result<Response, ApiError> {
    let (evidence, when) = latest(dir)?;
    let bytes = read_small(&evidence.join("result.json"))?;
    let result: Value = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::server(format!("the last benchmark's result.json is not JSON: {e}"))
    })?;
    let name = evidence
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let plot = modified(&evidence.join("latency.svg")).is_some();
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "object": "deltafin.benchmark",
            "directory": name,
            "modified": when.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            "plot": if plot { json!(PLOT_PATH) } else { Value::Null },
            "result": result,
        }),
    ))
}

/// The answer of `GET /v1/benchmark/latency.svg`.
fn plot(dir: &Path) -> Result<Response, ApiError> {
    let (evidence, _) = latest(dir)?;
    let bytes = read_small(&evidence.join("latency.svg"))?;
    let mut resp = Response::new(Body::from(bytes));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("image/svg+xml"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    page::protect(h, PLOT_CSP);
    Ok(resp)
}

/// `GET` of [`RESULT_PATH`] or [`PLOT_PATH`] with the server's benchmark directory (`None`:
/// the server was started without one).
pub async fn serve(path: &str, dir: Option<PathBuf>) -> Response {
    let Some(dir) = dir else {
        return not_found(
            "no benchmark to show: this server has no benchmark directory (`deltafin serve --benchmark-dir DIR`)".into(),
        )
        .into_response();
    };
    let plot_asked = path == PLOT_PATH;
    let answer =
        tokio::task::spawn_blocking(move || if plot_asked { plot(&dir) } else { result(&dir) })
            .await
            .unwrap_or_else(|e| {
                Err(ApiError::server(format!(
                    "reading the benchmark failed: {e}"
                )))
            });
    answer.unwrap_or_else(IntoResponse::into_response)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn evidence(root: &Path, name: &str, result: &str, svg: bool) -> PathBuf {
        let d = root.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("result.json"), result).unwrap();
        if svg {
            std::fs::write(d.join("latency.svg"), "<svg/>").unwrap();
        }
        d
    }

    fn body(r: Response) -> (u16, Vec<u8>) {
        let status = r.status().as_u16();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        (
            status,
            rt.block_on(axum::body::to_bytes(r.into_body(), 1 << 20))
                .unwrap()
                .to_vec(),
        )
    }

    #[test]
    fn the_newest_evidence_directory_is_shown() {
        let t = tempfile::tempdir().unwrap();
        assert_eq!(latest(t.path()).unwrap_err().code, "benchmark_not_found");
        let old = evidence(t.path(), "native-a", r#"{"schema":"old"}"#, false);
        let new = evidence(t.path(), "native-b", r#"{"schema":"new"}"#, true);
        let past = SystemTime::now() - std::time::Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(old.join("result.json"))
            .unwrap()
            .set_modified(past)
            .unwrap();
        assert_eq!(latest(t.path()).unwrap().0, new);
        // An evidence directory itself is shown as it is.
        assert_eq!(latest(&old).unwrap().0, old);
        let (s, b) = body(result(t.path()).unwrap());
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(s, 200);
        assert_eq!(v["directory"], "native-b");
        assert_eq!(v["result"]["schema"], "new");
        assert_eq!(v["plot"], PLOT_PATH);
        let r = plot(t.path()).unwrap();
        assert_eq!(r.headers()[header::CONTENT_SECURITY_POLICY], PLOT_CSP);
        assert_eq!(body(r).1, b"<svg/>");
        // Without a plot, or with a result that is not JSON, it says so.
        assert_eq!(plot(&old).unwrap_err().code, "benchmark_not_found");
        std::fs::write(old.join("result.json"), "{").unwrap();
        assert_eq!(result(&old).unwrap_err().status, 500);
    }
}
