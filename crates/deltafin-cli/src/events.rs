//! The run events file (`--events-jsonl`, schema `deltafin.run_event.v1`): one JSON object
//! per line, each with `schema`, `event`, `wall_time_ns` and `monotonic_ns`.
//!
//! Each event is written whole through [`AppendFile`]: a full disk cuts the file back to
//! its last whole event and the run stops with an error naming the file.

use anyhow::{Context, Result};
use deltafin_tensor::append::{AppendFile, AppendOptions};
use serde_json::{Map, Value, json};
use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Largest events file written; past it, further events are dropped with one warning.
pub const MAX_EVENTS_BYTES: u64 = 128 * 1024 * 1024;

pub struct EventWriter {
    out: AppendFile,
    origin: Instant,
    written: u64,
    full: bool,
}

impl EventWriter {
    pub fn create(path: &Path) -> Result<EventWriter> {
        let opts = AppendOptions {
            truncate: true,
            ..AppendOptions::default()
        };
        let out = AppendFile::open(path, opts)
            .with_context(|| format!("cannot create the events file {}", path.display()))?;
        Ok(EventWriter {
            out,
            origin: Instant::now(),
            written: 0,
            full: false,
        })
    }

    /// Write one event: `fields` must be a JSON object; the common fields are added first.
    pub fn emit(&mut self, event: &str, fields: Value) -> Result<()> {
        let mut obj = Map::new();
        obj.insert("schema".into(), json!("deltafin.run_event.v1"));
        obj.insert("event".into(), json!(event));
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        obj.insert("wall_time_ns".into(), json!(wall));
        obj.insert(
            "monotonic_ns".into(),
            json!(self.origin.elapsed().as_nanos() as u64),
        );
        if let Value::Object(m) = fields {
            obj.extend(m);
        }
        let mut line = serde_json::to_string(&Value::Object(obj))?;
        line.push('\n');
        if self.full {
            return Ok(());
        }
        if self.written + line.len() as u64 > MAX_EVENTS_BYTES {
            self.full = true;
            eprintln!(
                "deltafin: warning: the events file reached its {} MiB limit; later events are not written",
                MAX_EVENTS_BYTES >> 20
            );
            return Ok(());
        }
        let n = self.out.append(line.as_bytes()).with_context(|| {
            format!(
                "cannot write the events file {} (it keeps the events before this one)",
                self.out.path().display()
            )
        })?;
        self.written += n;
        Ok(())
    }
}
