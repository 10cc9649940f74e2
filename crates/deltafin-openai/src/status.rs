//! `GET /v1/status` (docs/SERVER.md "Status"): what the server and K3 are doing, as one JSON
//! object read from the same counters and snapshot as `/metrics`: the model's state, the
//! slot and queue, the running prefill, the last generation's speeds, the expert caches, the
//! prefix-state cache and the memory plan. The chat page polls it.

use crate::engine::Engine;
use crate::error::{ApiError, json_response};
use crate::metrics::{Counters, Snapshot};
use crate::{MODEL_ID, ServerConfig};
use axum::http::StatusCode;
use axum::response::Response;
use deltafin_k3::engine::MemoryPlan;
use serde_json::{Value, json};
use std::sync::Arc;

/// The object's `object` field.
pub const OBJECT: &str = "deltafin.status";

/// hits / (hits + misses), or null before the first lookup.
fn ratio(hits: u64, misses: u64) -> Value {
    let all = hits + misses;
    if all == 0 {
        Value::Null
    } else {
        json!(hits as f64 / all as f64)
    }
}

fn plan_json(p: &MemoryPlan) -> Value {
    json!({
        "budget_bytes": p.budget,
        "spine_bytes": p.spine,
        "spine_copied": p.spine_copied,
        "spine_resident_layers": p.spine_resident_layers,
        "spine_layers": p.spine_layers,
        "spine_streamed_bytes": p.spine_streamed,
        "spine_buffer_bytes": p.spine_buffers,
        "state_bytes": p.state,
        "context_tokens": p.context_tokens,
        "runtime_bytes": p.runtime,
        "scratch_bytes": p.scratch,
        "state_cache_bytes": p.state_cache,
        "expert_cache_bytes": p.cache,
        "pinned_bytes": p.pin,
        "expert_bytes": p.expert_bytes,
        "experts": p.experts,
    })
}

/// The status object. `engine` is the loaded engine, or why requests cannot use it yet
/// (loading, shutting down, a failed load).
pub fn status_json(
    cfg: &ServerConfig,
    counters: &Counters,
    snap: &Snapshot,
    engine: Result<Arc<Engine>, ApiError>,
) -> Value {
    let (state, error) = match &engine {
        Ok(_) => ("ready", Value::Null),
        Err(e) => (
            match e.code {
                "model_loading" => "loading",
                "server_shutting_down" => "shutting_down",
                _ => "failed",
            },
            json!(e.message),
        ),
    };
    let host = snap.host_experts.as_ref().map(|h| {
        let t = h.total();
        json!({
            "hits": t.hits,
            "misses": t.misses,
            "hit_ratio": ratio(t.hits, t.misses),
            "read_bytes": t.bytes_read,
            "cache_budget_bytes": h.cache_budget_bytes,
        })
    });
    let device = snap.device_experts.as_ref().map(|d| {
        json!({
            "hits": d.hits,
            "misses": d.misses,
            "hit_ratio": ratio(d.hits, d.misses),
        })
    });
    let state_cache = snap.state_cache.as_ref().map(|c| {
        json!({
            "ram_hits": c.ram_hits,
            "disk_hits": c.disk_hits,
            "misses": c.misses,
            "stored": c.stored,
            "ram_bytes": c.ram_bytes,
            "ram_entries": c.ram_entries,
        })
    });
    let model = engine.as_ref().ok().map(|e| {
        json!({
            "context_tokens": e.max_context,
            "spine": e.spine.as_str(),
            "device": e.device_line,
            "layers": e.model.layers.len(),
            "memory_plan": e.plan.as_ref().map(plan_json),
        })
    });
    let prefill = counters
        .prefill
        .map(|p| json!({"done": p.done, "total": p.total, "reused": p.reused}));
    json!({
        "object": OBJECT,
        "model": MODEL_ID,
        "state": state,
        "error": error,
        "uptime_seconds": snap.uptime_seconds,
        "slot": {
            "busy": snap.busy,
            "queue_depth": snap.queue_depth,
            "queue_capacity": snap.queue_capacity,
        },
        "sequences": snap.sequences.map(|q| json!({
            "parallel": q.parallel,
            "active": q.active,
            "state_reserve_bytes": q.reserve_bytes,
            "state_reserved_bytes": q.reserved_bytes,
            "decode_batches": q.batch.batches,
            "batched_decode_steps": q.batch.batched_steps,
            "largest_decode_batch": q.batch.largest,
        })),
        "prefill": prefill,
        "last_generation": {
            "prefill_tokens_per_second": counters.last_prefill_tokens_per_second,
            "decode_tokens_per_second": counters.last_decode_tokens_per_second,
        },
        "totals": {
            "generations_finished": snap.generations_finished,
            "generations_cancelled": snap.generations_cancelled,
            "prompt_tokens": counters.prompt_tokens,
            "completion_tokens": counters.completion_tokens,
            "decode_tokens": counters.decode_tokens,
            "prefill_seconds": counters.prefill_seconds,
            "decode_seconds": counters.decode_seconds,
            "prefix_reused_tokens": counters.prefix_reused_tokens,
            "memo_answers": counters.memo_answers,
        },
        "experts": {"host": host, "device": device},
        "state_cache": state_cache,
        "model_info": model,
        "limits": {
            "max_tokens": cfg.max_tokens,
            "max_request_bytes": cfg.max_request_bytes,
        },
    })
}

/// `GET /v1/status`.
pub fn status(
    cfg: &ServerConfig,
    counters: &Counters,
    snap: &Snapshot,
    engine: Result<Arc<Engine>, ApiError>,
) -> Response {
    json_response(StatusCode::OK, &status_json(cfg, counters, snap, engine))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::PrefillNow;
    use deltafin_k3::model::device_experts::DeviceCacheStats;

    #[test]
    fn the_object_says_what_runs() {
        let cfg = ServerConfig::default();
        let counters = Counters {
            prompt_tokens: 7,
            last_decode_tokens_per_second: 2.5,
            prefill: Some(PrefillNow {
                done: 64,
                total: 100,
                reused: 64,
            }),
            ..Counters::default()
        };
        let snap = Snapshot {
            busy: true,
            queue_depth: 1,
            queue_capacity: 4,
            device_experts: Some(DeviceCacheStats {
                hits: 3,
                misses: 1,
                ..Default::default()
            }),
            ..Snapshot::default()
        };
        let v = status_json(&cfg, &counters, &snap, Err(ApiError::loading()));
        assert_eq!(v["object"], OBJECT);
        assert_eq!(v["state"], "loading");
        assert!(v["error"].is_string());
        assert_eq!(
            v["slot"],
            json!({"busy": true, "queue_depth": 1, "queue_capacity": 4})
        );
        assert_eq!(
            v["prefill"],
            json!({"done": 64, "total": 100, "reused": 64})
        );
        assert_eq!(v["totals"]["prompt_tokens"], 7);
        assert_eq!(v["last_generation"]["decode_tokens_per_second"], 2.5);
        assert_eq!(v["experts"]["device"]["hit_ratio"], 0.75);
        assert!(v["experts"]["host"].is_null() && v["model_info"].is_null());
        let idle = status_json(
            &cfg,
            &Counters::default(),
            &Snapshot::default(),
            Err(ApiError::shutting_down()),
        );
        assert_eq!(idle["state"], "shutting_down");
        assert!(idle["prefill"].is_null());
        assert_eq!(ratio(0, 0), Value::Null);
    }
}
