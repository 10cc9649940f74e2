//! `cargo xtask stream-bench`: the GB-scale expert-streaming benchmark (not run in CI).
//!
//! 1. Probe the read bandwidth of the largest shard with the streaming read path:
//!    big sequential chunks, then expert-sized reads at random aligned offsets; the
//!    random-read probe runs again after the phases, and the ratios use the mean of both.
//! 2. Build the model with experts streamed into a cache of `--cache-gb`, prefill a prompt,
//!    greedy-decode `--tokens` tokens, and report per phase: bytes read, achieved GB/s
//!    (bytes ÷ busy I/O time) against the probe, decode tok/s against the I/O bound
//!    (missed expert bytes per token ÷ probe bandwidth), cache hit rate, PILOT recall, peak RSS,
//!    and where each token's time goes: waiting for expert bytes vs computing. With PILOT the
//!    demand misses undercount what the disk must bring in (a right guess is a miss read
//!    early), so the last column also gives the bound on the *needed* bytes: bytes read less
//!    the bytes read for wrong guesses, and the share of the phase the disk was busy (at least
//!    one read in flight), which does not depend on the probe's sample.
//!
//! The spine is the product default, row-int8 (`--spine int8`, needs `deltafin
//! convert-spine-int8` on the model root once), or the weight-exact `--spine bf16`.
//!
//! The page cache is dropped before each phase when `/proc/sys/vm/drop_caches` is writable.

use anyhow::{Context, Result, bail};
use deltafin_experts::probe::{ProbeOptions, probe};
use deltafin_experts::{DirectIo, ExpertStats, PilotGate, StreamOptions};
use deltafin_k3::weights::checkpoint::Checkpoint;
use deltafin_k3::weights::loader::{EngineOptions, load_model_with_experts, streaming_experts};
use deltafin_k3::weights::spine_int8::SpineFormat;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint (e.g. from `cargo xtask synth --preset stream --ram-gb N`).
    #[arg(long)]
    model_root: PathBuf,
    /// Expert cache size in decimal GB.
    #[arg(long)]
    cache_gb: f64,
    /// Prompt length (token ids 1000, 1001, …).
    #[arg(long, default_value_t = 16)]
    prompt_tokens: usize,
    /// Greedy decode steps.
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    /// I/O threads for the probe and the stream (reads in flight; default the expert
    /// reader's `auto` depth).
    #[arg(long, default_value_t = deltafin_experts::stream::DEFAULT_READ_DEPTH)]
    threads: usize,
    /// PILOT gate: off (prefetch), measure (no prefetch), on (per-layer recall gate), ranked
    /// (per-rank precision gate).
    #[arg(long, default_value = "off")]
    pilot: String,
    /// `ranked`: the least measured precision of a guess's rank for it to be read.
    #[arg(long, default_value_t = deltafin_experts::stream::PILOT_BREAK_EVEN_PRECISION)]
    pilot_precision: f64,
    /// `ranked`: guesses of a rank judged before its gate applies.
    #[arg(long, default_value_t = 16)]
    pilot_warmup: u64,
    /// `ranked`: at most this many PILOT reads per prediction (0: no cap).
    #[arg(long, default_value_t = 0)]
    pilot_max_guesses: usize,
    /// Sequential probe bytes in MB.
    #[arg(long, default_value_t = 2048)]
    probe_mb: u64,
    /// Expert-sized random probe reads.
    #[arg(long, default_value_t = 400)]
    probe_reads: u64,
    /// Use buffered reads instead of O_DIRECT.
    #[arg(long)]
    buffered: bool,
    /// Spine format: int8 (the product default; run `deltafin convert-spine-int8` first) or
    /// bf16.
    #[arg(long, default_value = "int8")]
    spine: String,
    /// Largest sub-read of an expert in KiB (a multiple of 4); 0 reads each expert whole.
    #[arg(long, default_value_t = 512)]
    read_piece_kib: u64,
}

fn drop_caches() -> bool {
    // Sync first so dirty pages can be dropped too.
    let _ = std::process::Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

fn peak_rss() -> u64 {
    crate::proc_status_bytes("VmHWM:")
}

struct Phase {
    name: &'static str,
    tokens: usize,
    seconds: f64,
    bytes: u64,
    device_bytes: u64,
    misses: u64,
    hits: u64,
    busy: f64,
    wait: f64,
    recall: Option<f64>,
    /// PILOT reads issued, the right ones, wasted bytes, and the union size they are judged
    /// against.
    issued: u64,
    right: u64,
    wasted: u64,
    predicted_total: u64,
}

fn delta(
    name: &'static str,
    a: &ExpertStats,
    b: &ExpertStats,
    tokens: usize,
    seconds: f64,
) -> Phase {
    let (ta, tb) = (a.total(), b.total());
    let recall = if tb.predicted_total > ta.predicted_total {
        Some(
            (tb.predicted_hits - ta.predicted_hits) as f64
                / (tb.predicted_total - ta.predicted_total) as f64,
        )
    } else {
        None
    };
    Phase {
        name,
        tokens,
        seconds,
        bytes: tb.bytes_read - ta.bytes_read,
        device_bytes: b.device_bytes - a.device_bytes,
        misses: tb.misses - ta.misses,
        hits: tb.hits - ta.hits,
        busy: b.io_busy_seconds - a.io_busy_seconds,
        wait: b.wait_seconds - a.wait_seconds,
        recall,
        issued: tb.prefetch_issued - ta.prefetch_issued,
        right: tb.prefetch_right - ta.prefetch_right,
        wasted: tb.prefetch_wasted_bytes - ta.prefetch_wasted_bytes,
        predicted_total: tb.predicted_total - ta.predicted_total,
    }
}

pub fn run(args: &Args) -> Result<()> {
    crate::kernel_env::install()?;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average at start: {}", load.trim());
    let ckpt = Arc::new(Checkpoint::open(&args.model_root).context("opening the checkpoint")?);
    let table = deltafin_store::experts::expert_table(&ckpt)?;
    let eb = table.shape.expert_bytes();
    let expert_total = eb * table.expert_count() as u64;
    let cache = (args.cache_gb * 1e9) as u64;
    println!(
        "experts: {} × {} B = {:.2} GB; cache {:.2} GB ({:.1}× smaller); contiguous: {}",
        table.expert_count(),
        eb,
        expert_total as f64 / 1e9,
        cache as f64 / 1e9,
        expert_total as f64 / cache as f64,
        table.all_contiguous()
    );
    let largest = table
        .files
        .iter()
        .max_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .context("no expert files")?
        .clone();
    let direct_io = if args.buffered {
        DirectIo::Off
    } else {
        DirectIo::Auto
    };
    let dropped = drop_caches();
    println!("page cache dropped: {dropped}");
    let probe_opts = |seed| ProbeOptions {
        sequential_bytes: args.probe_mb * 1_000_000,
        sequential_chunk: 8 << 20,
        random_size: eb,
        random_count: args.probe_reads,
        threads: args.threads,
        direct_io,
        seed,
    };
    let p = probe(&largest, &probe_opts(7))?;
    println!(
        "probe ({}): sequential {:.3} GB/s over {:.2} GB; expert-sized random {:.3} GB/s over {:.2} GB",
        p.io_path,
        p.sequential_gbps,
        p.sequential_bytes as f64 / 1e9,
        p.random_gbps,
        p.random_bytes as f64 / 1e9
    );

    let pilot = match args.pilot.as_str() {
        "off" => PilotGate::Off,
        "measure" => PilotGate::Measure,
        "on" => PilotGate::On {
            threshold: 0.10,
            warmup: 16,
        },
        "ranked" => PilotGate::Ranked {
            precision: args.pilot_precision,
            warmup: args.pilot_warmup,
            max_guesses: args.pilot_max_guesses,
        },
        other => bail!("--pilot {other:?} is not off, measure, on or ranked"),
    };
    let opts = StreamOptions {
        cache_bytes: cache,
        read_threads: args.threads,
        direct_io,
        pilot,
    };
    let spine = match args.spine.as_str() {
        "int8" => SpineFormat::Int8,
        "bf16" => SpineFormat::Bf16,
        other => bail!("--spine {other:?} is not int8 or bf16"),
    };
    drop_caches();
    let src = streaming_experts(&ckpt, opts)?;
    src.set_read_piece_bytes(args.read_piece_kib * 1024)
        .context("--read-piece-kib")?;
    let engine = EngineOptions {
        spine,
        ..EngineOptions::default()
    };
    let model = load_model_with_experts(ckpt.clone(), &engine, Box::new(src))
        .with_context(|| format!("loading the model with the {} spine", spine.as_str()))?;
    let stats = || model.experts.stats().unwrap_or_default();
    let prompt: Vec<u32> = (0..args.prompt_tokens as u32).map(|i| 1000 + i).collect();
    let mut state = model.new_state();
    // Threads as in `deltafin run`: the generation on a pool worker, the other workers kept
    // warm (`DELTAFIN_POOL_SPIN`).
    let (s0, s1, s2, prefill_s, decode_s) = deltafin_kernels::pool::run_warm(|| -> Result<_> {
        let s0 = stats();
        let t = Instant::now();
        let mut logits = model.prefill(&mut state, &prompt)?;
        let prefill_s = t.elapsed().as_secs_f64();
        let s1 = stats();
        let t = Instant::now();
        for _ in 0..args.tokens {
            let id = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map_or(0, |(i, _)| i as u32);
            logits = model.decode(&mut state, id)?;
        }
        let decode_s = t.elapsed().as_secs_f64();
        Ok((s0, s1, stats(), prefill_s, decode_s))
    })?;
    let phases = [
        delta("prefill", &s0, &s1, prompt.len(), prefill_s),
        delta("decode", &s1, &s2, args.tokens, decode_s),
    ];
    // The disk's random-read rate drifts by ±20% from minute to minute on a shared virtual
    // disk: probe again after the phases and hold them against the mean of both samples.
    drop_caches();
    let p_after = probe(&largest, &probe_opts(8))?;
    let random_gbps = (p.random_gbps + p_after.random_gbps) / 2.0;
    println!(
        "probe after the phases: expert-sized random {:.3} GB/s; the bounds below use the mean, {:.3} GB/s",
        p_after.random_gbps, random_gbps
    );
    println!(
        "io path: {}; threads {}; pilot {}; spine {}; read pieces ≤ {} KiB",
        s2.io_path,
        args.threads,
        args.pilot,
        spine.as_str(),
        args.read_piece_kib
    );
    println!(
        "| phase | tokens | s | tok/s | GB read | misses | hits | hit % | read GB/s (busy) | ÷ probe random | wait s | I/O-bound tok/s | tok/s ÷ bound | recall | wait ms/tok | compute ms/tok | I/O ms/tok at probe | PILOT reads/tok | prefetched precision | prefetched recall | wasted MB/tok | tok/s ÷ bound (needed bytes) | disk busy % |"
    );
    println!(
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for ph in &phases {
        let gbps = if ph.busy > 0.0 {
            ph.device_bytes as f64 / ph.busy / 1e9
        } else {
            0.0
        };
        let tps = ph.tokens as f64 / ph.seconds.max(1e-9);
        // Missed expert bytes per token ÷ probe bandwidth = seconds of I/O per token.
        let n = ph.tokens.max(1) as f64;
        // Tokens per second the disk allows for `bytes` per token at the probe's rate.
        let bound_for = |bytes: f64| {
            if bytes > 0.0 {
                random_gbps * 1e9 / bytes
            } else {
                f64::INFINITY
            }
        };
        let miss_bytes = ph.misses as f64 * eb as f64 / n;
        let bound = bound_for(miss_bytes);
        // The bound with every expert byte the phase had to bring in: bytes read less what
        // PILOT read for wrong guesses (a right guess is a miss read early; without PILOT
        // this is the demand misses, as above).
        let needed_bound = bound_for(ph.bytes.saturating_sub(ph.wasted) as f64 / n);
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {} | {} | {:.1} | {:.3} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} | {:.1} | {:.2} | {:.1} |",
            ph.name,
            ph.tokens,
            ph.seconds,
            tps,
            ph.bytes as f64 / 1e9,
            ph.misses,
            ph.hits,
            100.0 * ph.hits as f64 / (ph.hits + ph.misses).max(1) as f64,
            gbps,
            gbps / random_gbps.max(1e-9),
            ph.wait,
            bound,
            tps / bound,
            ph.recall
                .map_or("n/a".into(), |r| format!("{:.1}%", 100.0 * r)),
            // Per token: the model blocked on expert bytes, everything else (compute), and
            // what the missed bytes alone cost at the probe's bandwidth.
            1e3 * ph.wait / n,
            1e3 * (ph.seconds - ph.wait).max(0.0) / n,
            1e3 * miss_bytes / (random_gbps * 1e9).max(1.0),
            ph.issued as f64 / n,
            pct(ph.right, ph.issued),
            pct(ph.right, ph.predicted_total),
            ph.wasted as f64 / 1e6 / n,
            tps / needed_bound,
            // Share of the phase with at least one expert read in flight: the disk's idle
            // share is what no read order can recover without a guess to read.
            100.0 * ph.busy / ph.seconds.max(1e-9),
        );
    }
    // Decode guesses per rank (one-row passes): precision of all guesses and of the ones read.
    println!("| decode rank | guesses | precision | read | read precision | gated at end |");
    println!("|---:|---:|---:|---:|---:|---|");
    for (j, r) in s2.pilot_ranks.iter().enumerate() {
        let r1 = s1.pilot_ranks.get(j).cloned().unwrap_or_default();
        let (g, right) = (r.guesses - r1.guesses, r.right - r1.right);
        let (pf, pf_right) = (
            r.prefetched - r1.prefetched,
            r.prefetched_right - r1.prefetched_right,
        );
        println!(
            "| {j} | {g} | {} | {pf} | {} | {} |",
            pct(right, g),
            pct(pf_right, pf),
            r.gated
        );
    }
    println!(
        "cache peak {:.3} GB of {:.3} GB; process peak RSS {:.3} GB",
        s2.cache_peak_bytes as f64 / 1e9,
        cache as f64 / 1e9,
        peak_rss() as f64 / 1e9
    );
    let (right, judged) = model.provisional_accuracy();
    println!(
        "next-token PILOT (provisional token from the largest lm_head rows): right {right} of {judged} passes"
    );
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average at end: {}", load.trim());
    Ok(())
}

/// Print the hit-rate curve (markdown) on a Zipf trace: LRU, in-process heat, heat seeded
/// from a persisted histogram learned in an earlier session of the same routing (another
/// sample of 2000 tokens), and a pinned tier (half the cache, filled from that histogram's pin
/// candidates) in front of the seeded heat cache.
pub fn cache_curve(layers: usize, experts: usize, k: usize, tokens: usize, s: f64) {
    use deltafin_experts::heat::{HeatDims, HeatTable};
    use deltafin_experts::policy::{
        HeatCache, LruCache, PinnedCache, default_half_life, hit_rate, zipf_routes,
        zipf_routes_sampled,
    };
    let trace = zipf_routes(layers, experts, k, tokens, s, 1);
    let pool = layers * experts;
    // The earlier session: same per-layer ranking (seed 1), other samples.
    let earlier = zipf_routes_sampled(layers, experts, k, 2000, s, 1, 2);
    let mut table = HeatTable::empty(HeatDims {
        layers,
        experts,
        top_k: k,
    });
    for pass in earlier.chunks(layers * k) {
        let mut sets: Vec<Vec<usize>> = vec![Vec::new(); layers];
        for &key in pass {
            sets[key as usize / experts].push(key as usize % experts);
        }
        table.record_pass(sets.iter().enumerate().map(|(l, u)| (l + 1, u.as_slice())));
    }
    let key = |l: usize, e: usize| ((l - 1) * experts + e) as u64;
    let candidates: Vec<u64> = table
        .pin_candidates()
        .into_iter()
        .map(|(l, e)| key(l, e))
        .collect();
    println!(
        "Zipf s={s}: {layers} layers × {experts} experts, top-{k}, {tokens} tokens ({} requests; one token's working set = {} experts); persisted histogram from 2000 earlier tokens: {} pin candidates",
        trace.len(),
        layers * k,
        candidates.len()
    );
    println!(
        "| cache (experts) | share of pool | LRU hit % | heat hit % | heat seeded from the histogram hit % | pinned tier (½ cache) + seeded heat hit % |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for share in [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5] {
        let cap = ((pool as f64 * share).round() as usize).max(1);
        // Seed each expert with the heat the in-process counter settles at for its learned
        // rate r (routes per pass): r / (requests per pass) × H / ln 2.
        let prior = |h: f64| {
            let scale = default_half_life(cap) / std::f64::consts::LN_2 / (layers * k) as f64;
            (1..=layers)
                .flat_map(|l| (0..experts).map(move |e| (l, e)))
                .map(|(l, e)| {
                    (
                        key(l, e),
                        table.get(l, e) / table.mass.max(1e-9) * h * scale,
                    )
                })
                .collect::<Vec<_>>()
        };
        let lru = hit_rate(&mut LruCache::new(cap), &trace);
        let heat = hit_rate(&mut HeatCache::new(cap), &trace);
        let seeded = hit_rate(&mut HeatCache::with_prior(cap, prior(1.0)), &trace);
        let rest = cap - (cap / 2).min(candidates.len());
        let pinned = hit_rate(
            &mut PinnedCache::new(
                cap,
                cap / 2,
                &candidates,
                prior(default_half_life(rest) / default_half_life(cap)),
            ),
            &trace,
        );
        println!(
            "| {cap} | {:.0}% | {:.1} | {:.1} | {:.1} | {:.1} |",
            100.0 * share,
            100.0 * lru,
            100.0 * heat,
            100.0 * seeded,
            100.0 * pinned
        );
    }
}

/// `num / den` as a percentage with one decimal, or `n/a` when `den` is 0.
fn pct(num: u64, den: u64) -> String {
    if den > 0 {
        format!("{:.1}%", 100.0 * num as f64 / den as f64)
    } else {
        "n/a".into()
    }
}
