//! `GET /metrics` and the request log: the server's counters as a Prometheus text exposition
//! (format 0.0.4), and one stderr line per request. docs/SERVER.md ("Metrics", "Request
//! log") lists every metric and field.

use crate::engine::{Timing, Usage};
use axum::http::StatusCode;
use deltafin_experts::ExpertStats;
use deltafin_k3::model::device_experts::DeviceCacheStats;
use deltafin_k3::prefix::CacheStats;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

/// The `Content-Type` of `GET /metrics`.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The status recorded for a request whose client left before its answer (nginx's
/// convention; nothing is sent).
pub const CLIENT_CLOSED: u16 = 499;

/// Counters the request path updates and `/metrics` reads.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    prefill_nanos: AtomicU64,
    decode_nanos: AtomicU64,
    decode_tokens: AtomicU64,
    last_prefill_tps: AtomicU64,
    last_decode_tps: AtomicU64,
    prefill_done: AtomicU64,
    prefill_total: AtomicU64,
    prefill_reused: AtomicU64,
    reused_tokens: AtomicU64,
    memo_answers: AtomicU64,
    numerical_failures: AtomicU64,
}

/// `/v1/models/{id}` (any id) is one endpoint; a path that is no endpoint (404) is `other`;
/// every other path is its own label.
pub fn endpoint_label(path: &str, status: u16) -> String {
    for prefix in ["/v1/models/", "/models/", "/v1/responses/", "/responses/"] {
        if path.starts_with(prefix) {
            return format!("{prefix}{{id}}");
        }
    }
    if status == StatusCode::NOT_FOUND.as_u16() {
        return "other".into();
    }
    path.to_string()
}

fn tokens_per_second(tokens: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        tokens as f64 / seconds
    } else {
        0.0
    }
}

impl Metrics {
    /// One answered request.
    pub fn count_request(&self, endpoint: String, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(PoisonError::into_inner);
        *m.entry((endpoint, status)).or_insert(0) += 1;
    }

    /// The running prefill has done `done` of `total` prompt positions, `reused` of them
    /// restored from a stored prefix state (`0, 0, 0`: none runs).
    pub fn prefill_progress(&self, done: usize, total: usize, reused: usize) {
        self.prefill_done.store(done as u64, Ordering::Relaxed);
        self.prefill_total.store(total as u64, Ordering::Relaxed);
        self.prefill_reused.store(reused as u64, Ordering::Relaxed);
    }

    /// The counters as numbers (what `GET /v1/status` reports beside the [`Snapshot`]).
    pub fn counters(&self) -> Counters {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let total = load(&self.prefill_total);
        Counters {
            prompt_tokens: load(&self.prompt_tokens),
            completion_tokens: load(&self.completion_tokens),
            decode_tokens: load(&self.decode_tokens),
            prefill_seconds: load(&self.prefill_nanos) as f64 * 1e-9,
            decode_seconds: load(&self.decode_nanos) as f64 * 1e-9,
            last_prefill_tokens_per_second: f64::from_bits(load(&self.last_prefill_tps)),
            last_decode_tokens_per_second: f64::from_bits(load(&self.last_decode_tps)),
            prefill: (total > 0).then(|| PrefillNow {
                done: load(&self.prefill_done),
                total,
                reused: load(&self.prefill_reused),
            }),
            prefix_reused_tokens: load(&self.reused_tokens),
            memo_answers: load(&self.memo_answers),
        }
    }

    /// What a generation took from the prefix cache and the memo, and whether it stopped
    /// on a numerical failure (called for every generation that ran).
    pub fn record_reuse(&self, timing: &Timing) {
        if timing.numerical_failure {
            self.numerical_failures.fetch_add(1, Ordering::Relaxed);
        }
        self.reused_tokens
            .fetch_add(timing.reused as u64, Ordering::Relaxed);
        if timing.from_memo {
            self.memo_answers.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A generation that ended normally (stop, length): its tokens and speeds (an answer
    /// from the memo counts its tokens only: it took no model time).
    pub fn record_generation(&self, usage: &Usage, timing: &Timing) {
        self.prompt_tokens
            .fetch_add(usage.prompt_tokens as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(usage.completion_tokens as u64, Ordering::Relaxed);
        if timing.from_memo {
            return;
        }
        let nanos = |d: std::time::Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.prefill_nanos
            .fetch_add(nanos(timing.prefill), Ordering::Relaxed);
        self.decode_nanos
            .fetch_add(nanos(timing.decode), Ordering::Relaxed);
        self.decode_tokens
            .fetch_add(timing.decode_tokens as u64, Ordering::Relaxed);
        let prefill = tokens_per_second(usage.prompt_tokens, timing.prefill.as_secs_f64());
        let decode = tokens_per_second(timing.decode_tokens, timing.decode.as_secs_f64());
        self.last_prefill_tps
            .store(prefill.to_bits(), Ordering::Relaxed);
        self.last_decode_tps
            .store(decode.to_bits(), Ordering::Relaxed);
    }
}

/// The running prefill's progress (prompt positions).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefillNow {
    /// Positions processed, restored ones included.
    pub done: u64,
    /// Positions of the prompt.
    pub total: u64,
    /// Positions restored from a stored prefix state.
    pub reused: u64,
}

/// [`Metrics`] read at one moment: totals of finished generations, the last one's speeds,
/// the running prefill.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Counters {
    /// Prompt and completion tokens of finished generations.
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Tokens generated after each prefill's first one.
    pub decode_tokens: u64,
    /// Wall time of prefills and of decoding.
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    /// Speeds of the last finished generation (0 before one).
    pub last_prefill_tokens_per_second: f64,
    pub last_decode_tokens_per_second: f64,
    /// The running prefill, if one runs.
    pub prefill: Option<PrefillNow>,
    /// Prompt positions restored from stored prefix states.
    pub prefix_reused_tokens: u64,
    /// Requests answered from the response memo.
    pub memo_answers: u64,
}

/// What `/metrics` reports besides [`Metrics`]: the server's state at the scrape.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// Seconds since the server bound its port.
    pub uptime_seconds: f64,
    /// The model is loaded.
    pub ready: bool,
    /// A generation is running.
    pub busy: bool,
    /// Requests holding a queue place.
    pub queue_depth: usize,
    /// `--queue`.
    pub queue_capacity: usize,
    /// Generations that ended (stop, length, an engine error), and that were cancelled.
    pub generations_finished: u64,
    pub generations_cancelled: u64,
    /// The streaming expert cache in host memory, when the experts stream (a memory budget).
    pub host_experts: Option<ExpertStats>,
    /// The device expert cache, when experts run on a device.
    pub device_experts: Option<DeviceCacheStats>,
    /// The prefix-state cache, when there is one.
    pub state_cache: Option<CacheStats>,
    /// The response memo: hits, misses, entries, bytes.
    pub memo: Option<(u64, u64, usize, usize)>,
    /// Connections open now, and refused because `--max-connections` were open.
    pub connections_open: u64,
    pub connections_refused: u64,
    /// Bytes of request bodies being read and validated.
    pub body_bytes_held: usize,
    /// How generations share the engine, once it is loaded.
    pub sequences: Option<SequencesNow>,
}

/// The generations sharing the engine ([`crate::sharing`]) at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SequencesNow {
    /// Generations that may run together (`--parallel`).
    pub parallel: usize,
    /// Generations running.
    pub active: usize,
    /// The state reserve, and the part running generations hold.
    pub reserve_bytes: u64,
    pub reserved_bytes: u64,
    /// The batcher's counters (all zero when one generation runs at a time).
    pub batch: deltafin_spec::BatchStats,
}

/// The generations sharing the engine: how many may and do run, the state they reserve, and
/// how their decode steps were batched (per-sequence speeds: each finished generation's
/// `deltafin_last_decode_tokens_per_second`; aggregate: `deltafin_decode_tokens_total` over
/// time).
fn render_sequences(e: &mut Exposition, q: &SequencesNow) {
    e.one(
        "deltafin_parallel_sequences",
        "gauge",
        "Generations that may run together (--parallel, else the memory plan's count).",
        q.parallel as f64,
    );
    e.one(
        "deltafin_active_sequences",
        "gauge",
        "Generations running now.",
        q.active as f64,
    );
    e.one(
        "deltafin_state_reserve_bytes",
        "gauge",
        "The state reserve generations take their KDA states and MLA caches from.",
        q.reserve_bytes as f64,
    );
    e.one(
        "deltafin_state_reserved_bytes",
        "gauge",
        "Of the state reserve, bytes the running generations hold.",
        q.reserved_bytes as f64,
    );
    e.one(
        "deltafin_batched_decode_passes_total",
        "counter",
        "Decode passes run for several generations at once (one pass per step of all of them).",
        q.batch.batches as f64,
    );
    e.one(
        "deltafin_batched_decode_steps_total",
        "counter",
        "Decode steps run in those passes (over the passes: the mean batch size).",
        q.batch.batched_steps as f64,
    );
    e.one(
        "deltafin_largest_decode_batch",
        "gauge",
        "The most generations one decode pass has run.",
        q.batch.largest as f64,
    );
    e.one(
        "deltafin_queued_decode_steps",
        "gauge",
        "Decode steps waiting for the next batched pass now.",
        q.batch.queued_steps as f64,
    );
    e.one(
        "deltafin_waiting_exclusive_turns",
        "gauge",
        "Prefills and drafted verifications waiting for their turn on the model now.",
        q.batch.waiting_turns as f64,
    );
    e.one(
        "deltafin_running_pass_seconds",
        "gauge",
        "How long the pass on the model now (a decode batch or a turn) has run; 0 when free.",
        q.batch.running_for.as_secs_f64(),
    );
}

/// Writes families and samples in the text format.
struct Exposition(String);

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        format!("{v}")
    }
}

impl Exposition {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.0.push_str(name);
        if !labels.is_empty() {
            let inner: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", escape_label(v)))
                .collect();
            let _ = write!(self.0, "{{{}}}", inner.join(","));
        }
        let _ = writeln!(self.0, " {}", number(value));
    }

    fn one(&mut self, name: &str, kind: &str, help: &str, value: f64) {
        self.family(name, kind, help);
        self.sample(name, &[], value);
    }
}

impl Metrics {
    /// The exposition of every metric.
    pub fn render(&self, s: &Snapshot) -> String {
        let mut e = Exposition(String::new());
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        e.one(
            "deltafin_uptime_seconds",
            "gauge",
            "Seconds since the server bound its port.",
            s.uptime_seconds,
        );
        e.one(
            "deltafin_model_ready",
            "gauge",
            "1 once the model is loaded and requests are served, else 0.",
            flag(s.ready),
        );
        e.family(
            "deltafin_requests_total",
            "counter",
            "Answered HTTP requests by endpoint and status (499: the client left first).",
        );
        {
            let m = self.requests.lock().unwrap_or_else(PoisonError::into_inner);
            for ((endpoint, status), n) in m.iter() {
                let status = status.to_string();
                e.sample(
                    "deltafin_requests_total",
                    &[("endpoint", endpoint), ("status", &status)],
                    *n as f64,
                );
            }
        }
        e.one(
            "deltafin_prompt_tokens_total",
            "counter",
            "Prompt tokens of finished generations.",
            load(&self.prompt_tokens) as f64,
        );
        e.one(
            "deltafin_completion_tokens_total",
            "counter",
            "Completion tokens of finished generations.",
            load(&self.completion_tokens) as f64,
        );
        e.one(
            "deltafin_prefill_seconds_total",
            "counter",
            "Seconds spent in the prefill of finished generations.",
            load(&self.prefill_nanos) as f64 * 1e-9,
        );
        e.one(
            "deltafin_decode_seconds_total",
            "counter",
            "Seconds spent decoding after the prefill in finished generations.",
            load(&self.decode_nanos) as f64 * 1e-9,
        );
        e.one(
            "deltafin_decode_tokens_total",
            "counter",
            "Tokens generated after the prefill's first token in finished generations.",
            load(&self.decode_tokens) as f64,
        );
        e.one(
            "deltafin_last_prefill_tokens_per_second",
            "gauge",
            "Prefill speed of the last finished generation (prompt tokens per second).",
            f64::from_bits(load(&self.last_prefill_tps)),
        );
        e.one(
            "deltafin_last_decode_tokens_per_second",
            "gauge",
            "Decode speed of the last finished generation (tokens after the first per second).",
            f64::from_bits(load(&self.last_decode_tps)),
        );
        e.family(
            "deltafin_generations_total",
            "counter",
            "Generations by outcome: finished (stop, length or an engine error) or cancelled (client gone or shutdown).",
        );
        e.sample(
            "deltafin_generations_total",
            &[("outcome", "finished")],
            s.generations_finished as f64,
        );
        e.sample(
            "deltafin_generations_total",
            &[("outcome", "cancelled")],
            s.generations_cancelled as f64,
        );
        e.one(
            "deltafin_numerical_failures_total",
            "counter",
            "Generations stopped because a NaN or infinite value appeared in the forward pass (damaged weights; answered 500 numerical_failure).",
            load(&self.numerical_failures) as f64,
        );
        e.one(
            "deltafin_generation_busy",
            "gauge",
            "1 while a generation runs, else 0.",
            flag(s.busy),
        );
        e.one(
            "deltafin_queue_depth",
            "gauge",
            "Requests holding a queue place, waiting for the generation slot.",
            s.queue_depth as f64,
        );
        e.one(
            "deltafin_queue_capacity",
            "gauge",
            "Queue places (--queue).",
            s.queue_capacity as f64,
        );
        e.one(
            "deltafin_connections_open",
            "gauge",
            "Open client connections.",
            s.connections_open as f64,
        );
        e.one(
            "deltafin_connections_refused_total",
            "counter",
            "Connections answered 503 too_many_connections (--max-connections were open).",
            s.connections_refused as f64,
        );
        e.one(
            "deltafin_request_body_bytes_held",
            "gauge",
            "Bytes of request bodies being read and validated (at most 4 x --max-request-bytes).",
            s.body_bytes_held as f64,
        );
        if let Some(q) = s.sequences {
            render_sequences(&mut e, &q);
        }
        self.render_experts(&mut e, s);
        self.render_state(&mut e, s);
        e.0
    }

    fn render_state(&self, e: &mut Exposition, s: &Snapshot) {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        e.one(
            "deltafin_prefill_done_tokens",
            "gauge",
            "Prompt positions the running prefill has processed (restored ones included); 0 when none runs.",
            load(&self.prefill_done),
        );
        e.one(
            "deltafin_prefill_total_tokens",
            "gauge",
            "Prompt positions of the running prefill; 0 when none runs.",
            load(&self.prefill_total),
        );
        e.one(
            "deltafin_prefix_reused_tokens_total",
            "counter",
            "Prompt positions restored from stored prefix states instead of prefilled.",
            load(&self.reused_tokens),
        );
        e.one(
            "deltafin_memo_answers_total",
            "counter",
            "Requests answered from the response memo.",
            load(&self.memo_answers),
        );
        if let Some(m) = s.memo {
            e.one(
                "deltafin_memo_entries",
                "gauge",
                "Answers held by the response memo.",
                m.2 as f64,
            );
        }
        let Some(c) = &s.state_cache else {
            return;
        };
        e.family(
            "deltafin_state_cache_hits_total",
            "counter",
            "Prefills resumed from a stored prefix state, by the tier it came from.",
        );
        e.sample(
            "deltafin_state_cache_hits_total",
            &[("tier", "ram")],
            c.ram_hits as f64,
        );
        e.sample(
            "deltafin_state_cache_hits_total",
            &[("tier", "disk")],
            c.disk_hits as f64,
        );
        e.one(
            "deltafin_state_cache_misses_total",
            "counter",
            "Prefills that found no stored prefix state.",
            c.misses as f64,
        );
        e.one(
            "deltafin_state_cache_stored_total",
            "counter",
            "Prefix states stored.",
            c.stored as f64,
        );
        e.one(
            "deltafin_state_cache_corrupt_total",
            "counter",
            "Damaged disk entries found, ignored and removed.",
            c.corrupt as f64,
        );
        e.one(
            "deltafin_state_cache_ram_bytes",
            "gauge",
            "Bytes of prefix states held in RAM.",
            c.ram_bytes as f64,
        );
    }

    fn render_experts(&self, e: &mut Exposition, s: &Snapshot) {
        let mut caches: Vec<(&str, u64, u64)> = Vec::new();
        if let Some(h) = &s.host_experts {
            let t = h.total();
            caches.push(("host", t.hits, t.misses));
        }
        if let Some(d) = &s.device_experts {
            caches.push(("device", d.hits, d.misses));
        }
        e.family(
            "deltafin_expert_cache_hits_total",
            "counter",
            "Routed-expert lookups served from the expert cache (host: streaming cache under a memory budget; device: the GPU cache).",
        );
        for (cache, hits, _) in &caches {
            e.sample(
                "deltafin_expert_cache_hits_total",
                &[("cache", cache)],
                *hits as f64,
            );
        }
        e.family(
            "deltafin_expert_cache_misses_total",
            "counter",
            "Routed-expert lookups that had to read (host) or upload (device) the expert.",
        );
        for (cache, _, misses) in &caches {
            e.sample(
                "deltafin_expert_cache_misses_total",
                &[("cache", cache)],
                *misses as f64,
            );
        }
        e.family(
            "deltafin_expert_cache_hit_ratio",
            "gauge",
            "hits / (hits + misses) since the model loaded; absent before the first lookup.",
        );
        for (cache, hits, misses) in &caches {
            if hits + misses > 0 {
                e.sample(
                    "deltafin_expert_cache_hit_ratio",
                    &[("cache", cache)],
                    *hits as f64 / (hits + misses) as f64,
                );
            }
        }
        e.family(
            "deltafin_expert_read_bytes_total",
            "counter",
            "Routed-expert payload bytes read from disk by the streaming cache (demand and prefetch).",
        );
        if let Some(h) = &s.host_experts {
            e.sample(
                "deltafin_expert_read_bytes_total",
                &[],
                h.total().bytes_read as f64,
            );
        }
    }
}

/// How a generation request ended, for its log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GenSummary {
    /// Prompt and completion tokens (`None` when it failed).
    pub tokens: Option<(usize, usize)>,
    /// The finish reason (`stop`, `length`, `tool_calls`), or `error`.
    pub finish: &'static str,
}

struct LogInner {
    metrics: Arc<Metrics>,
    method: String,
    path: String,
    id: String,
    start: Instant,
    status: AtomicU16,
    generation: bool,
    summary: Mutex<Option<GenSummary>>,
}

/// One request's log line and its count in `deltafin_requests_total`, written when the last
/// clone is dropped: when the handler returns, or when a stream ends.
#[derive(Clone)]
pub struct RequestLog(Arc<LogInner>);

impl RequestLog {
    /// The log of a request; `generation`: it may run a generation (its token counts are
    /// logged, `-` until known).
    pub fn new(
        metrics: Arc<Metrics>,
        method: &str,
        path: &str,
        id: &str,
        generation: bool,
    ) -> Self {
        RequestLog(Arc::new(LogInner {
            metrics,
            method: method.to_string(),
            path: path.to_string(),
            id: id.to_string(),
            start: Instant::now(),
            // Until the answer is known: a request whose handler is dropped before it
            // answers (hyper drops it when its client leaves) is one the client left.
            status: AtomicU16::new(CLIENT_CLOSED),
            generation,
            summary: Mutex::new(None),
        }))
    }

    /// The request's id.
    pub fn id(&self) -> &str {
        &self.0.id
    }

    /// The status of the answer.
    pub fn set_status(&self, status: u16) {
        self.0.status.store(status, Ordering::Relaxed);
    }

    /// How the generation ended.
    pub fn set_summary(&self, s: GenSummary) {
        *self
            .0
            .summary
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(s);
    }
}

impl LogInner {
    fn line(&self) -> String {
        let status = self.status.load(Ordering::Relaxed);
        let summary = *self.summary.lock().unwrap_or_else(PoisonError::into_inner);
        let (prompt, completion) = match summary.and_then(|s| s.tokens) {
            Some((p, c)) => (p.to_string(), c.to_string()),
            None => ("-".into(), "-".into()),
        };
        let finish = summary.map_or("-", |s| s.finish);
        // A generation that sent its head but no end: the client left or the stream broke.
        let finish = if self.generation && summary.is_none() && status == 200 {
            "cancelled"
        } else {
            finish
        };
        format!(
            "[deltafin serve] request id={} method={} path={} status={status} prompt_tokens={prompt} completion_tokens={completion} finish={finish} duration={:.3}s",
            self.id,
            self.method,
            self.path,
            self.start.elapsed().as_secs_f64(),
        )
    }
}

impl Drop for LogInner {
    fn drop(&mut self) {
        let status = self.status.load(Ordering::Relaxed);
        self.metrics
            .count_request(endpoint_label(&self.path, status), status);
        crate::log_line!("{}", self.line());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn labels_keep_cardinality_bounded() {
        assert_eq!(endpoint_label("/v1/models/abc", 404), "/v1/models/{id}");
        assert_eq!(endpoint_label("/models/x", 200), "/models/{id}");
        assert_eq!(endpoint_label("/nope/123", 404), "other");
        assert_eq!(
            endpoint_label("/v1/chat/completions", 400),
            "/v1/chat/completions"
        );
    }

    #[test]
    fn a_request_dropped_before_its_answer_counts_as_499() {
        let m = Arc::new(Metrics::default());
        drop(RequestLog::new(
            m.clone(),
            "POST",
            "/v1/completions",
            "cmpl-x",
            true,
        ));
        let answered = RequestLog::new(m.clone(), "GET", "/health", "req-x", false);
        answered.set_status(200);
        drop(answered);
        let text = m.render(&Snapshot::default());
        assert!(
            text.contains(
                "deltafin_requests_total{endpoint=\"/v1/completions\",status=\"499\"} 1\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("deltafin_requests_total{endpoint=\"/health\",status=\"200\"} 1\n"),
            "{text}"
        );
        assert!(!text.contains("status=\"0\""), "{text}");
    }

    #[test]
    fn text_format_escapes_and_numbers() {
        let mut e = Exposition(String::new());
        e.family("x_total", "counter", "a \\ b\nc");
        e.sample("x_total", &[("k", "q\"\\\n")], 3.0);
        e.sample("x_total", &[], f64::NAN);
        e.sample("x_total", &[], f64::INFINITY);
        e.sample("x_total", &[], 0.25);
        assert_eq!(
            e.0,
            "# HELP x_total a \\\\ b\\nc\n# TYPE x_total counter\nx_total{k=\"q\\\"\\\\\\n\"} 3\nx_total NaN\nx_total +Inf\nx_total 0.25\n"
        );
    }

    #[test]
    fn generations_add_up_and_set_the_last_speeds() {
        let m = Metrics::default();
        let usage = Usage {
            prompt_tokens: 10,
            completion_tokens: 5,
            reasoning_tokens: 0,
        };
        let timing = Timing {
            prefill: Duration::from_millis(500),
            decode: Duration::from_secs(2),
            decode_tokens: 4,
            ..Timing::default()
        };
        m.record_generation(&usage, &timing);
        m.record_generation(&usage, &timing);
        let text = m.render(&Snapshot::default());
        for line in [
            "deltafin_prompt_tokens_total 20\n",
            "deltafin_completion_tokens_total 10\n",
            "deltafin_prefill_seconds_total 1\n",
            "deltafin_decode_seconds_total 4\n",
            "deltafin_decode_tokens_total 8\n",
            "deltafin_last_prefill_tokens_per_second 20\n",
            "deltafin_last_decode_tokens_per_second 2\n",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        // Without an expert cache the families are declared, with no samples.
        assert!(text.contains("# TYPE deltafin_expert_cache_hits_total counter\n"));
        assert!(!text.contains("deltafin_expert_cache_hits_total{"));
        let with_cache = Snapshot {
            device_experts: Some(DeviceCacheStats {
                hits: 3,
                misses: 1,
                ..Default::default()
            }),
            ..Default::default()
        };
        let text = m.render(&with_cache);
        assert!(text.contains("deltafin_expert_cache_hits_total{cache=\"device\"} 3\n"));
        assert!(text.contains("deltafin_expert_cache_hit_ratio{cache=\"device\"} 0.75\n"));
    }
}
