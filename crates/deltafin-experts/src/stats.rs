//! Counters of a streaming expert source, per layer and overall.

/// Counters of one MoE layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerStats {
    /// Route-union experts already resident (or in flight) from the cache when the layer began.
    pub hits: u64,
    /// Of those, the ones a PILOT prefetch brought in.
    pub prefetch_hits: u64,
    /// Of the hits, the ones served by the pinned tier.
    pub pinned_hits: u64,
    /// Route-union experts that had to be read for the layer.
    pub misses: u64,
    /// Expert payload bytes read for this layer (demand and prefetch).
    pub bytes_read: u64,
    /// Of those, bytes read speculatively by PILOT prefetch.
    pub prefetch_bytes: u64,
    /// PILOT predictions that were in the actual union (recall numerator).
    pub predicted_hits: u64,
    /// Actual union sizes of passes that had a prediction (recall denominator).
    pub predicted_total: u64,
    /// Passes with a prediction.
    pub predictions: u64,
    /// Whether the gate (`K3_PILOT_GATE=on`) currently suppresses this layer's prefetch.
    pub gated: bool,
    /// PILOT guesses whose read was issued (guesses already cached or gated are not).
    pub prefetch_issued: u64,
    /// Of those, the ones in the route union of the layer they were guessed for.
    pub prefetch_right: u64,
    /// Bytes transferred for issued guesses that were not in that union (wrong guesses,
    /// including the landed pieces of cancelled reads).
    pub prefetch_wasted_bytes: u64,
}

/// PILOT guesses of one rank (position in the guessed route; see
/// [`crate::PilotGuess::rank`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankStats {
    /// Guesses of this rank judged against a route union.
    pub guesses: u64,
    /// Of those, the ones in the union.
    pub right: u64,
    /// Guesses of this rank whose read was issued, and of those the right ones.
    pub prefetched: u64,
    pub prefetched_right: u64,
    /// The decayed precision the ranked gate uses now (`None` before any guess).
    pub precision_now: Option<f64>,
    /// Whether the ranked gate (`K3_PILOT_GATE=ranked`) suppresses this rank now.
    pub gated: bool,
}

impl RankStats {
    /// right / guesses, `None` without guesses.
    pub fn precision(&self) -> Option<f64> {
        (self.guesses > 0).then(|| self.right as f64 / self.guesses as f64)
    }
}

impl LayerStats {
    /// hits / (hits + misses), `None` before any access.
    pub fn hit_rate(&self) -> Option<f64> {
        let n = self.hits + self.misses;
        (n > 0).then(|| self.hits as f64 / n as f64)
    }

    /// Fraction of the actual route union that PILOT predicted, `None` without predictions.
    pub fn recall(&self) -> Option<f64> {
        (self.predicted_total > 0).then(|| self.predicted_hits as f64 / self.predicted_total as f64)
    }

    /// Fraction of the issued PILOT reads that were right, `None` without any.
    pub fn prefetch_precision(&self) -> Option<f64> {
        (self.prefetch_issued > 0).then(|| self.prefetch_right as f64 / self.prefetch_issued as f64)
    }

    /// Fraction of the actual route union that issued PILOT reads covered (the recall of what
    /// was prefetched), `None` without predictions.
    pub fn prefetch_recall(&self) -> Option<f64> {
        (self.predicted_total > 0).then(|| self.prefetch_right as f64 / self.predicted_total as f64)
    }
}

/// Counters of a streaming source since it was built.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExpertStats {
    /// Per layer (dense layers stay zero).
    pub layers: Vec<LayerStats>,
    /// Reads issued (one per aligned region).
    pub reads: u64,
    /// Of those, served by O_DIRECT.
    pub direct_reads: u64,
    /// Bytes transferred including alignment padding.
    pub device_bytes: u64,
    /// Wall time with at least one read in flight.
    pub io_busy_seconds: f64,
    /// Wall time the model waited for expert bytes.
    pub wait_seconds: f64,
    /// How reads are served (`direct` or `buffered (reason)`).
    pub io_path: String,
    /// Cache budget and its high-water mark (buffer bytes).
    pub cache_budget_bytes: u64,
    pub cache_peak_bytes: u64,
    /// Bytes of the cache given to the pinned tier, and the experts pinned so far.
    pub pin_budget_bytes: u64,
    pub pinned_experts: usize,
    /// Bytes of one expert's payload.
    pub expert_bytes: u64,
    /// I/O worker threads.
    pub read_threads: usize,
    /// PILOT guesses per rank in one-row (decode) passes.
    pub pilot_ranks: Vec<RankStats>,
    /// PILOT guesses per rank in passes of several rows (prefill, verification).
    pub pilot_ranks_batch: Vec<RankStats>,
    /// Per expert home, in the order given (empty without homes).
    pub homes: Vec<HomeReadStats>,
    /// Reads moved to another copy or the model root because a home's copy failed.
    pub home_fallbacks: u64,
}

/// Reads served by one expert home (docs/K3.md §12.11).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HomeReadStats {
    /// The home's directory.
    pub dir: String,
    /// Copies its journal lists.
    pub copies: usize,
    /// Piece reads served, and their bytes.
    pub reads: u64,
    pub bytes: u64,
    /// Copies whose read failed (each then read elsewhere).
    pub failures: u64,
}

impl ExpertStats {
    /// Sum over layers.
    pub fn total(&self) -> LayerStats {
        let mut t = LayerStats::default();
        for l in &self.layers {
            t.hits += l.hits;
            t.prefetch_hits += l.prefetch_hits;
            t.pinned_hits += l.pinned_hits;
            t.misses += l.misses;
            t.bytes_read += l.bytes_read;
            t.prefetch_bytes += l.prefetch_bytes;
            t.predicted_hits += l.predicted_hits;
            t.predicted_total += l.predicted_total;
            t.predictions += l.predictions;
            t.prefetch_issued += l.prefetch_issued;
            t.prefetch_right += l.prefetch_right;
            t.prefetch_wasted_bytes += l.prefetch_wasted_bytes;
        }
        t
    }

    /// Achieved read throughput: bytes transferred per second of busy I/O, in GB/s (10^9).
    pub fn read_gbps(&self) -> f64 {
        if self.io_busy_seconds > 0.0 {
            self.device_bytes as f64 / self.io_busy_seconds / 1e9
        } else {
            0.0
        }
    }

    /// `layer:hit%` for the MoE layers that saw traffic, e.g. `1:50.0 2:62.5`.
    pub fn per_layer_hit_rates(&self) -> String {
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(l, s)| s.hit_rate().map(|h| format!("{l}:{:.1}", 100.0 * h)))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// `layer:recall%` for the layers with predictions.
    pub fn per_layer_recall(&self) -> String {
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(l, s)| s.recall().map(|r| format!("{l}:{:.1}", 100.0 * r)))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// `rank:precision%` of one-row passes' guesses, with the decayed precision the ranked
    /// gate uses and `(off)` for gated ranks, e.g. `0:91.2(90.5) 1:80.0(78.1) 7:31.0(29.9,off)`.
    pub fn per_rank_precision(&self) -> String {
        self.pilot_ranks
            .iter()
            .enumerate()
            .filter_map(|(j, r)| {
                let p = r.precision()?;
                let now = r
                    .precision_now
                    .map_or(String::new(), |x| format!("{:.1}", 100.0 * x));
                let off = if r.gated { ",off" } else { "" };
                Some(format!("{j}:{:.1}({now}{off})", 100.0 * p))
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The one-line summary `--stats` prints.
    pub fn summary_line(&self) -> String {
        let t = self.total();
        let pct = |v: Option<f64>| {
            v.map(|x| format!("{:.1}%", 100.0 * x))
                .unwrap_or_else(|| "n/a".into())
        };
        format!(
            "hits={} misses={} hit_rate={} pinned_hits={} pinned={} pin_budget={} prefetch_hits={} prefetch_recall={} prefetch_issued={} prefetch_precision={} prefetched_recall={} prefetch_wasted_bytes={} bytes_read={} prefetch_bytes={} reads={} direct_reads={} read_gbps={:.3} io_busy={:.3}s wait={:.3}s cache_peak={} cache_budget={} io={} threads={}",
            t.hits,
            t.misses,
            pct(t.hit_rate()),
            t.pinned_hits,
            self.pinned_experts,
            self.pin_budget_bytes,
            t.prefetch_hits,
            pct(t.recall()),
            t.prefetch_issued,
            pct(t.prefetch_precision()),
            pct(t.prefetch_recall()),
            t.prefetch_wasted_bytes,
            t.bytes_read,
            t.prefetch_bytes,
            self.reads,
            self.direct_reads,
            self.read_gbps(),
            self.io_busy_seconds,
            self.wait_seconds,
            self.cache_peak_bytes,
            self.cache_budget_bytes,
            self.io_path,
            self.read_threads,
        ) + &self.homes_summary()
    }

    /// ` homes=DIR:bytes[:failed=N],… home_fallbacks=N` (empty without homes).
    pub fn homes_summary(&self) -> String {
        if self.homes.is_empty() {
            return String::new();
        }
        let per: Vec<String> = self
            .homes
            .iter()
            .map(|h| {
                let failed = if h.failures > 0 {
                    format!(":failed={}", h.failures)
                } else {
                    String::new()
                };
                format!("{}:{}{failed}", h.dir, h.bytes)
            })
            .collect();
        format!(
            " homes={} home_fallbacks={}",
            per.join(","),
            self.home_fallbacks
        )
    }
}
