//! Stored responses (`store`, `previous_response_id`, `GET`/`DELETE /v1/responses/{id}`,
//! `GET /v1/responses/{id}/input_items`): each answered Responses request with `store` on
//! (OpenAI's default) is kept with the conversation it continues, so that a later request can
//! name it instead of resending the conversation.
//!
//! Records live in `k3-meta/responses/<id>.json` beside the state cache and survive restarts;
//! each is written whole (a temporary file, synced, then renamed), and the oldest are removed
//! when the store passes its byte budget. A record that cannot be read is skipped with a
//! warning, never served. On a read-only model root the store is in memory.

use crate::error::ApiError;
use axum::http::{Method, StatusCode};
use axum::response::Response;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

/// Default byte budget of the store.
pub const DEFAULT_BYTES: u64 = 1_000_000_000;
/// Most bytes kept in memory when the store has no directory.
pub const MEMORY_BYTES: u64 = 256 * 1024 * 1024;
/// The store's folder under a model root's `k3-meta/`.
pub const DIR: &str = "responses";

/// One stored response.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// The response object as it was answered.
    pub response: Value,
    /// The request's own input items, as `input_items` lists them.
    pub input_items: Vec<Value>,
    /// The whole conversation up to and including this response's output, as input items:
    /// what a request naming it as `previous_response_id` continues.
    pub conversation: Vec<Value>,
}

impl Record {
    fn to_json(&self) -> Value {
        json!({"response": self.response, "input_items": self.input_items, "conversation": self.conversation})
    }

    fn from_json(v: Value) -> Option<Record> {
        let Value::Object(mut o) = v else { return None };
        let items = |v: Option<Value>| match v {
            Some(Value::Array(a)) => Some(a),
            _ => None,
        };
        let response = o.remove("response").filter(Value::is_object)?;
        Some(Record {
            response,
            input_items: items(o.remove("input_items"))?,
            conversation: items(o.remove("conversation"))?,
        })
    }
}

struct Entry {
    bytes: u64,
    /// When it was written (the oldest go first).
    stamp: SystemTime,
    /// In-memory stores hold the record itself.
    record: Option<Record>,
}

/// The store of one server.
pub struct Store {
    dir: Option<PathBuf>,
    budget: u64,
    entries: Mutex<HashMap<String, Entry>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("dir", &self.dir)
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

/// A response id as this server writes them: `resp_` and hex digits. Anything else is not
/// looked up (and never becomes a path).
pub fn valid_id(id: &str) -> bool {
    id.strip_prefix("resp_")
        .is_some_and(|h| !h.is_empty() && h.len() <= 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

impl Store {
    /// A store in memory with `budget` bytes (at most [`MEMORY_BYTES`]).
    pub fn in_memory(budget: u64) -> Store {
        Store {
            dir: None,
            budget: budget.min(MEMORY_BYTES),
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// The store under `state_dir` (a model root's `k3-meta/`): its folder is created and
    /// indexed; `Err` with the reason when it cannot be (the caller falls back to memory).
    pub fn in_dir(state_dir: &Path, budget: u64) -> Result<Store, String> {
        let dir = state_dir.join(DIR);
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let mut entries = HashMap::new();
        let listing =
            std::fs::read_dir(&dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
        for entry in listing.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let path = entry.path();
            if name.starts_with('.') && name.ends_with(".tmp") {
                // A write that never finished (the process died): it was never a record.
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let Some(id) = name.strip_suffix(".json").filter(|id| valid_id(id)) else {
                continue;
            };
            let Ok(meta) = entry.metadata() else { continue };
            entries.insert(
                id.to_string(),
                Entry {
                    bytes: meta.len(),
                    stamp: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                    record: None,
                },
            );
        }
        let store = Store {
            dir: Some(dir),
            budget,
            entries: Mutex::new(entries),
        };
        store.evict(&mut store.lock());
        Ok(store)
    }

    /// Where records are kept (`None`: in memory).
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn path(&self, id: &str) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(format!("{id}.json")))
    }

    /// Keeps `record` as `id`. A record larger than the whole budget is not kept (a warning
    /// says so); a failed write is a warning, and the answer already sent stands.
    pub fn put(&self, id: &str, record: &Record) {
        if !valid_id(id) {
            return;
        }
        let text = record.to_json().to_string();
        let bytes = text.len() as u64;
        if bytes > self.budget {
            crate::log_line!(
                "deltafin: warning: response {id} ({bytes} bytes) is larger than the response store's budget ({} bytes) and is not stored",
                self.budget
            );
            return;
        }
        if let Some(path) = self.path(id)
            && let Err(e) = write_whole(&path, text.as_bytes())
        {
            crate::log_line!("deltafin: warning: response {id} is not stored: {e}");
            return;
        }
        let mut entries = self.lock();
        entries.insert(
            id.to_string(),
            Entry {
                bytes,
                stamp: SystemTime::now(),
                record: self.dir.is_none().then(|| record.clone()),
            },
        );
        self.evict(&mut entries);
    }

    /// The record of `id`, if it is stored and readable.
    pub fn get(&self, id: &str) -> Option<Record> {
        if !valid_id(id) {
            return None;
        }
        let entries = self.lock();
        let entry = entries.get(id)?;
        if let Some(r) = &entry.record {
            return Some(r.clone());
        }
        drop(entries);
        let path = self.path(id)?;
        let text = std::fs::read(&path).ok()?;
        match serde_json::from_slice(&text)
            .ok()
            .and_then(Record::from_json)
        {
            Some(r) => Some(r),
            None => {
                crate::log_line!(
                    "deltafin: warning: {} is not a readable stored response; it is skipped",
                    path.display()
                );
                None
            }
        }
    }

    /// Removes `id`; whether it was stored.
    pub fn delete(&self, id: &str) -> bool {
        if !valid_id(id) {
            return false;
        }
        let removed = self.lock().remove(id).is_some();
        if removed && let Some(path) = self.path(id) {
            let _ = std::fs::remove_file(path);
        }
        removed
    }

    /// Removes the oldest records until the store is within its budget.
    fn evict(&self, entries: &mut HashMap<String, Entry>) {
        let mut total: u64 = entries.values().map(|e| e.bytes).sum();
        if total <= self.budget {
            return;
        }
        let mut by_age: Vec<(SystemTime, String)> =
            entries.iter().map(|(k, e)| (e.stamp, k.clone())).collect();
        by_age.sort();
        for (_, id) in by_age {
            if total <= self.budget {
                break;
            }
            if let Some(e) = entries.remove(&id) {
                total -= e.bytes;
                if let Some(path) = self.path(&id) {
                    let _ = std::fs::remove_file(path);
                }
            }
        }
    }
}

/// Writes `bytes` to `path` whole: a temporary file beside it, synced, then renamed.
fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("record");
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

fn not_found(id: &str) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        code: "response_not_found",
        param: None,
        ..ApiError::invalid(format!(
            "Response with id {id:?} not found: it was never stored (`store: false`), was deleted, or was removed to keep the response store within its budget"
        ))
    }
}

/// `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`,
/// `GET /v1/responses/{id}/input_items`; `rest` is the path after `/v1/responses/`.
pub(crate) fn answer(
    store: Option<&Store>,
    method: &Method,
    rest: &str,
) -> Result<Response, ApiError> {
    let (id, tail) = match rest.split_once('/') {
        Some((id, tail)) => (id, Some(tail)),
        None => (rest, None),
    };
    let Some(store) = store else {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            ..ApiError::invalid(
                "this server keeps no responses (`deltafin serve --response-store-gb 0`)",
            )
        });
    };
    let ok = |v: Value| crate::error::json_response(StatusCode::OK, &v);
    match (method, tail) {
        (&Method::GET, None) => store
            .get(id)
            .map(|r| ok(r.response))
            .ok_or_else(|| not_found(id)),
        (&Method::DELETE, None) => {
            if store.delete(id) {
                Ok(ok(json!({"id": id, "object": "response", "deleted": true})))
            } else {
                Err(not_found(id))
            }
        }
        (&Method::GET, Some("input_items")) => {
            let r = store.get(id).ok_or_else(|| not_found(id))?;
            let first = r.input_items.first().and_then(|i| i.get("id")).cloned();
            let last = r.input_items.last().and_then(|i| i.get("id")).cloned();
            Ok(ok(json!({
                "object": "list", "data": r.input_items,
                "first_id": first, "last_id": last, "has_more": false,
            })))
        }
        (&Method::POST, Some("cancel")) => Err(ApiError::invalid(
            "only background responses can be cancelled, and Deltafin runs none (`background: true` is refused)",
        )),
        (_, None | Some("input_items")) => Err(ApiError::method_not_allowed()),
        _ => Err(ApiError::not_found()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(n: usize) -> Record {
        Record {
            response: json!({"id": format!("resp_{n:x}"), "object": "response", "pad": "x".repeat(100)}),
            input_items: vec![json!({"type": "message", "role": "user", "content": "hi"})],
            conversation: vec![json!({"type": "message", "role": "user", "content": "hi"})],
        }
    }

    #[test]
    fn records_survive_a_restart_and_the_oldest_go_first() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::in_dir(dir.path(), 10_000).unwrap();
        s.put("resp_a1", &record(1));
        assert_eq!(s.get("resp_a1"), Some(record(1)));
        // Restart: the index is rebuilt from the folder.
        let s = Store::in_dir(dir.path(), 10_000).unwrap();
        assert_eq!(s.get("resp_a1"), Some(record(1)));
        assert!(s.delete("resp_a1"));
        assert!(!s.delete("resp_a1"));
        assert_eq!(s.get("resp_a1"), None);
        // A small budget keeps only the newest.
        let one = record(1).to_json().to_string().len() as u64;
        let s = Store::in_dir(dir.path(), one * 2 + 10).unwrap();
        for i in 0..5 {
            s.put(&format!("resp_b{i}"), &record(i));
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(s.get("resp_b0"), None);
        assert!(s.get("resp_b4").is_some() && s.get("resp_b3").is_some());
        let files = std::fs::read_dir(dir.path().join(DIR)).unwrap().count();
        assert_eq!(files, 2);
    }

    #[test]
    fn damaged_records_and_foreign_names_are_never_served() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::in_dir(dir.path(), 10_000).unwrap();
        s.put("resp_c1", &record(1));
        std::fs::write(dir.path().join(DIR).join("resp_c1.json"), b"{\"respo").unwrap();
        assert_eq!(s.get("resp_c1"), None);
        for bad in [
            "../x",
            "resp_",
            "resp_zz",
            "x/../../etc/passwd",
            "resp_c1/..",
        ] {
            assert_eq!(s.get(bad), None, "{bad}");
            s.put(bad, &record(2));
        }
        // A leftover temporary file is swept on start.
        std::fs::write(dir.path().join(DIR).join(".resp_d.json.1.tmp"), b"x").unwrap();
        let _ = Store::in_dir(dir.path(), 10_000).unwrap();
        assert!(!dir.path().join(DIR).join(".resp_d.json.1.tmp").exists());
    }

    #[test]
    fn memory_stores_keep_records() {
        let s = Store::in_memory(10_000);
        s.put("resp_e1", &record(1));
        assert_eq!(s.get("resp_e1"), Some(record(1)));
        assert!(s.dir().is_none());
    }
}
