//! Router trace JSONL (docs/K3.md §12.9): one line per (pass, MoE layer, up to 56 rows),
//! `{"step": <pass>, "layer": <l>, "ids": [k × rows], "w": [weights, 5 decimals]}`.
//!
//! [`RouterTrace`] is a [`RouteObserver`] of the model. The file is opened append-only with
//! mode 0600, never through a symlink, and written through
//! [`deltafin_tensor::append::AppendFile`]: every write starts on a fresh line (a torn line
//! an earlier run left stays a line of its own, which readers skip) and a write the disk
//! takes only part of is cut back. Writing stops with one warning on stderr on the first
//! error (a full disk) and at 8 GiB, so the file only ever holds whole lines.
//! [`TraceMode::Buffered`] collects a whole pass in memory and appends it when the next pass
//! begins (or the trace is dropped); a pass over 4 MiB is discarded with a warning.
//! [`TraceMode::Sync`] writes every line as it is produced.

use crate::observe::{PassRoutes, RouteObserver};
use deltafin_tensor::append::{AppendFile, AppendOptions};
use std::path::Path;
use std::sync::Mutex;

/// Rows per trace line.
pub const ROWS_PER_LINE: usize = 56;
/// File size cap.
pub const MAX_TRACE_BYTES: u64 = 8 << 30;
/// Largest pass a buffered trace holds before discarding it.
pub const MAX_PASS_BYTES: usize = 4 << 20;

/// When trace lines reach the file (`--router-trace-mode`, `K3_TRACE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceMode {
    /// A whole pass is appended at once when it is complete.
    Buffered,
    /// Every line is written as it is produced.
    Sync,
}

impl TraceMode {
    /// `buffered` or `sync`.
    pub fn name(&self) -> &'static str {
        match self {
            TraceMode::Buffered => "buffered",
            TraceMode::Sync => "sync",
        }
    }
}

struct Writer {
    out: AppendFile,
    mode: TraceMode,
    /// The pass being assembled (buffered mode); `None` once it overflowed.
    pass: Option<String>,
    written: u64,
    step: u64,
    last_layer: Option<usize>,
    stopped: bool,
}

/// A [`RouteObserver`] that appends every pass's routes to a JSONL file.
pub struct RouterTrace {
    w: Mutex<Writer>,
}

impl RouterTrace {
    /// Open `path` for appending in buffered mode (created 0600; a symlink is refused).
    pub fn create(path: &Path) -> std::io::Result<RouterTrace> {
        RouterTrace::create_with_mode(path, TraceMode::Buffered)
    }

    /// [`RouterTrace::create`] with an explicit [`TraceMode`].
    pub fn create_with_mode(path: &Path, mode: TraceMode) -> std::io::Result<RouterTrace> {
        let opts = AppendOptions {
            mode: Some(0o600),
            no_follow: true,
            truncate: false,
        };
        let out = AppendFile::open(path, opts)?;
        let written = out.len()?;
        Ok(RouterTrace {
            w: Mutex::new(Writer {
                out,
                mode,
                pass: Some(String::new()),
                written,
                step: 0,
                last_layer: None,
                stopped: false,
            }),
        })
    }

    /// Append the pass being assembled.
    pub fn flush(&self) {
        if let Ok(mut w) = self.w.lock() {
            w.end_pass();
        }
    }

    /// Whether writing stopped (an error, or the size cap).
    pub fn stopped(&self) -> bool {
        self.w.lock().map(|w| w.stopped).unwrap_or(true)
    }
}

impl Writer {
    /// Append `text` (whole lines) unless the cap is reached or writing failed before.
    fn append(&mut self, text: &str) {
        if self.stopped {
            return;
        }
        if self.written + text.len() as u64 > MAX_TRACE_BYTES {
            self.stopped = true;
            eprintln!("deltafin: warning: router trace reached 8 GiB; no more lines are written");
            return;
        }
        match self.out.append(text.as_bytes()) {
            Ok(n) => self.written += n,
            Err(e) => {
                self.stopped = true;
                eprintln!(
                    "deltafin: warning: router trace {}: {e}; no more lines are written (the file keeps only whole lines)",
                    self.out.path().display()
                );
            }
        }
    }

    /// Buffered mode: append the assembled pass (if it did not overflow) and start the next.
    fn end_pass(&mut self) {
        if let Some(text) = self.pass.replace(String::new())
            && !text.is_empty()
        {
            self.append(&text);
        }
    }
}

impl Drop for RouterTrace {
    fn drop(&mut self) {
        self.flush();
    }
}

fn line(step: u64, layer: usize, ids: &[usize], weights: &[f32]) -> String {
    let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    let w: Vec<String> = weights
        .iter()
        .map(|x| {
            let r = (f64::from(*x) * 1e5).round() / 1e5;
            if r.is_finite() {
                format!("{r}")
            } else {
                "null".into()
            }
        })
        .collect();
    format!(
        "{{\"step\": {step}, \"layer\": {layer}, \"ids\": [{}], \"w\": [{}]}}\n",
        ids.join(", "),
        w.join(", ")
    )
}

impl RouteObserver for RouterTrace {
    fn observe(&self, r: &PassRoutes<'_>) {
        self.record_routes(r.layer, r.k, r.ids, r.weights);
    }
}

impl RouterTrace {
    /// Append the routes of one pass at `layer`: row `r` chose `ids[r·k..(r+1)·k]` with
    /// router weights `weights[r·k..(r+1)·k]`.
    pub fn record_routes(&self, layer: usize, k: usize, ids: &[usize], weights: &[f32]) {
        let Ok(mut w) = self.w.lock() else { return };
        // A layer at or below the previous one starts a new pass.
        if let Some(prev) = w.last_layer
            && layer <= prev
        {
            w.step += 1;
            w.end_pass();
        }
        w.last_layer = Some(layer);
        if w.stopped || k == 0 {
            return;
        }
        for (ci, wi) in ids
            .chunks(ROWS_PER_LINE * k)
            .zip(weights.chunks(ROWS_PER_LINE * k))
        {
            let text = line(w.step, layer, ci, wi);
            match w.mode {
                TraceMode::Sync => w.append(&text),
                TraceMode::Buffered => {
                    let step = w.step;
                    if let Some(pass) = w.pass.as_mut() {
                        if pass.len() + text.len() > MAX_PASS_BYTES {
                            w.pass = None;
                            eprintln!(
                                "deltafin: warning: router trace: pass {step} exceeds 4 MiB; it is discarded"
                            );
                        } else {
                            pass.push_str(&text);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_per_pass_and_layer() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        let t = RouterTrace::create(&p).unwrap();
        let ids: Vec<usize> = (0..60 * 2).map(|i| i % 7).collect();
        let w: Vec<f32> = (0..120).map(|i| i as f32 / 3.0).collect();
        t.record_routes(1, 2, &ids, &w);
        t.record_routes(2, 2, &[3, 4], &[0.123456, 0.5]);
        t.record_routes(1, 2, &[5, 6], &[1.0, 2.0]);
        drop(t);
        let text = std::fs::read_to_string(&p).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(lines[0].starts_with("{\"step\": 0, \"layer\": 1, \"ids\": [0, 1,"));
        let ids0 = lines[0]
            .split("\"ids\": [")
            .nth(1)
            .unwrap()
            .split(']')
            .next()
            .unwrap();
        assert_eq!(ids0.split(", ").count(), 56 * 2);
        assert_eq!(
            lines[2],
            "{\"step\": 0, \"layer\": 2, \"ids\": [3, 4], \"w\": [0.12346, 0.5]}"
        );
        assert!(lines[3].starts_with("{\"step\": 1, \"layer\": 1,"));
        for l in &lines {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let o = v.as_object().unwrap();
            assert_eq!(
                o.keys().collect::<Vec<_>>(),
                ["step", "layer", "ids", "w"],
                "{l}"
            );
            assert_eq!(
                o["ids"].as_array().unwrap().len(),
                o["w"].as_array().unwrap().len()
            );
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&p).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
            let link = dir.path().join("link.jsonl");
            std::os::unix::fs::symlink(&p, &link).unwrap();
            assert!(RouterTrace::create(&link).is_err());
        }
    }

    #[test]
    fn a_full_disk_stops_the_trace_with_one_warning() {
        // /dev/full: every write fails with ENOSPC, as on a full disk.
        let full = Path::new("/dev/full");
        if !full.exists() {
            panic!("/dev/full is missing: this test needs Linux");
        }
        for mode in [TraceMode::Sync, TraceMode::Buffered] {
            let t = RouterTrace::create_with_mode(full, mode).unwrap();
            t.record_routes(1, 1, &[3], &[0.5]);
            t.record_routes(1, 1, &[4], &[0.5]);
            assert!(t.stopped(), "{mode:?}");
            // Later passes are not tried again.
            t.record_routes(1, 1, &[5], &[0.5]);
            assert!(t.stopped());
        }
    }

    #[test]
    fn a_torn_line_from_an_earlier_run_stays_its_own_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        std::fs::write(
            &p,
            "{\"step\": 0, \"layer\": 1, \"ids\": [3], \"w\": [0.5]}\n{\"step\": 1, \"la",
        )
        .unwrap();
        let t = RouterTrace::create_with_mode(&p, TraceMode::Sync).unwrap();
        t.record_routes(1, 1, &[4], &[0.25]);
        drop(t);
        let text = std::fs::read_to_string(&p).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert_eq!(lines[1], "{\"step\": 1, \"la");
        assert_eq!(
            lines[2],
            "{\"step\": 0, \"layer\": 1, \"ids\": [4], \"w\": [0.25]}"
        );
        let mut counts = crate::rank::RouteCounts::default();
        let dims = crate::heat::HeatDims {
            layers: 2,
            experts: 8,
            top_k: 1,
        };
        let summary = crate::rank::read_trace(&p, dims, &mut counts).unwrap();
        assert_eq!((summary.lines, summary.torn), (2, 1));
    }

    #[test]
    fn buffered_writes_whole_passes_and_sync_every_line() {
        let dir = tempfile::tempdir().unwrap();
        let len = |p: &Path| std::fs::metadata(p).unwrap().len();
        let b = dir.path().join("b.jsonl");
        let t = RouterTrace::create_with_mode(&b, TraceMode::Buffered).unwrap();
        t.record_routes(1, 1, &[3], &[0.5]);
        t.record_routes(2, 1, &[4], &[0.5]);
        assert_eq!(len(&b), 0, "a pass in progress is not written");
        t.record_routes(1, 1, &[5], &[0.5]);
        let first_pass = len(&b);
        assert!(first_pass > 0);
        assert_eq!(std::fs::read_to_string(&b).unwrap().lines().count(), 2);
        // A pass larger than 4 MiB is discarded.
        let ids = vec![1usize; 600_000];
        let w = vec![0.25f32; 600_000];
        t.record_routes(2, 1, &ids, &w);
        t.record_routes(1, 1, &[6], &[0.5]);
        assert_eq!(len(&b), first_pass);
        drop(t);
        let text = std::fs::read_to_string(&b).unwrap();
        assert_eq!(text.lines().count(), 3, "{text}");
        assert!(
            text.lines()
                .last()
                .unwrap()
                .starts_with("{\"step\": 2, \"layer\": 1, \"ids\": [6]")
        );

        let s = dir.path().join("s.jsonl");
        let t = RouterTrace::create_with_mode(&s, TraceMode::Sync).unwrap();
        t.record_routes(1, 1, &[3], &[0.5]);
        assert_eq!(std::fs::read_to_string(&s).unwrap().lines().count(), 1);
        t.record_routes(2, 1, &[4], &[0.5]);
        assert_eq!(std::fs::read_to_string(&s).unwrap().lines().count(), 2);
    }
}
