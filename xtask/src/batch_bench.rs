//! `cargo xtask batch-bench`: aggregate decode throughput of several sequences decoding
//! together ([`K3Model::forward_batch`]) against one sequence alone (issue 43; GB-scale, not
//! run in CI).
//!
//! Loads the checkpoint once per spine through the engine builder (`--spines int8,bf16`; int8
//! needs `deltafin convert-spine-int8` once), resident, or with the experts streamed when
//! `--budget-gb` is given. Then, `--rounds` times, for each stream count of `--streams` in
//! A B B A order (1 2 4 8 8 4 2 1): that many fresh sequences, each prefilled alone with its
//! own 5-token prompt (untimed), then `--tokens` greedy steps in which every sequence decodes
//! one token in one batched pass, timed. It prints aggregate token/s, token/s per stream,
//! the ratio of the aggregate to one stream's in the same round, and, when the experts
//! stream, the expert bytes read per generated token.
//!
//! With `--driver`, each stream is instead a whole generation (`deltafin_spec::Generation`)
//! on its own thread, sharing the model through a `deltafin_spec::Batcher` as `deltafin serve
//! --parallel N` runs them (prefill in exclusive turns, decode steps batched); the rate is the
//! one while every stream decodes (from the end of the last prefill to the first stream's last
//! token: while prefills run, the streams already decoding take a step per prefill layer). `--ttft-prompt N` (N > 0) then also measures
//! the time to first token of a short request (8 tokens) arriving 50 ms into the prefill of an
//! N-token prompt, beside that prefill's whole time and its time per layer.
//!
//! Every sequence's tokens are its solo tokens (`crates/deltafin-k3/tests/batch.rs` proves
//! the logits bit-identical); the bench only times them.

use anyhow::{Context, Result, bail};
use deltafin_k3::engine::EngineBuilder;
use deltafin_k3::generate::greedy;
use deltafin_k3::model::{K3Model, KdaForm, LogitRows, Segment};
use deltafin_k3::weights::spine_int8::SpineFormat;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint (e.g. `cargo xtask synth --preset mini --seed 1 --out DIR`).
    #[arg(long)]
    model_root: PathBuf,
    /// Spines to measure, comma-separated: int8, bf16.
    #[arg(long, default_value = "int8,bf16")]
    spines: String,
    /// Stream counts, comma-separated; each round runs them forward, then backward.
    #[arg(long, default_value = "1,2,4,8")]
    streams: String,
    /// Batched decode steps per run (each stream generates this many tokens).
    #[arg(long, default_value_t = 24)]
    tokens: usize,
    /// Rounds.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Memory budget in GB: the routed experts stream from disk into what is left (resident
    /// when absent).
    #[arg(long)]
    budget_gb: Option<f64>,
    /// Run each stream as a generation on its own thread through the batcher (the server's
    /// path) instead of driving `forward_batch` directly.
    #[arg(long)]
    driver: bool,
    /// With `--driver`: also time a short request's first token during a prefill of this many
    /// tokens (0: not measured).
    #[arg(long, default_value_t = 0)]
    ttft_prompt: usize,
}

/// The 5-token prompt of stream `i`.
fn prompt_of(i: usize) -> Vec<u32> {
    (0..5).map(|k| 1000 + 7 * i as u32 + k).collect()
}

/// `n` generations of `tokens` tokens each, on their own threads, sharing `model` through a
/// batcher (with one stream: alone on the pool, as `--parallel 1`). Returns the seconds the
/// `n × tokens` tokens take at the rate measured while every stream decodes (from the end of
/// the last prefill to the first stream's last token; the whole run when that window is
/// empty), and the expert bytes read.
fn run_driver(model: &K3Model, n: usize, tokens: usize) -> Result<(f64, u64)> {
    use deltafin_spec::{Batcher, Event, Generation};
    let read = || model.experts.stats().map_or(0, |s| s.device_bytes);
    let before = read();
    let batcher = Batcher::new();
    let t = Instant::now();
    // Per stream: when its prefill ended, and when each of its tokens was committed.
    type Times = (Instant, Vec<Instant>);
    let results: Vec<Result<Times>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|i| {
                let batcher = &batcher;
                s.spawn(move || -> Result<Times> {
                    let prompt = prompt_of(i);
                    let mut prefilled = Instant::now();
                    let mut commits = Vec::with_capacity(tokens);
                    let mut on_event = |ev: Event<'_>| {
                        match ev {
                            Event::Prefilled { .. } => prefilled = Instant::now(),
                            Event::Committed(c) => {
                                let now = Instant::now();
                                commits.extend(c.ids.iter().map(|_| now));
                            }
                        }
                        Ok(())
                    };
                    let g = || {
                        Generation::new(model, &prompt)
                            .stop_ids(Vec::new())
                            .max_new(Some(tokens))
                    };
                    if n > 1 {
                        g().batcher(batcher).run(&mut on_event)?;
                    } else {
                        deltafin_kernels::pool::run_warm(|| g().run(&mut on_event))?;
                    }
                    Ok((prefilled, commits))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| bail!("a stream panicked")))
            .collect()
    });
    let whole = t.elapsed().as_secs_f64();
    let times: Vec<Times> = results.into_iter().collect::<Result<_>>()?;
    if std::env::var_os("BATCH_BENCH_STATS").is_some() {
        eprintln!("  {n} streams: {:?}", batcher.stats());
    }
    let bytes = read().saturating_sub(before);
    let from = times.iter().map(|(p, _)| *p).max();
    let to = times.iter().filter_map(|(_, c)| c.last().copied()).min();
    let secs = match (from, to) {
        (Some(from), Some(to)) if to > from => {
            let in_window = times
                .iter()
                .flat_map(|(_, c)| c.iter())
                .filter(|&&c| c > from && c <= to)
                .count();
            let window = to.duration_since(from).as_secs_f64();
            if in_window >= n {
                (n * tokens) as f64 * window / in_window as f64
            } else {
                whole
            }
        }
        _ => whole,
    };
    Ok((secs, bytes))
}

/// Time to first token of an 8-token request arriving 50 ms into the prefill of a
/// `long`-token prompt, both through one batcher; also the long prefill's time and its time
/// per layer. Returns (ttft, long prefill, per layer) in seconds.
fn ttft(model: &K3Model, long: usize) -> Result<(f64, f64, f64)> {
    use deltafin_spec::{Batcher, Event, Generation};
    let batcher = Batcher::new();
    let long_prompt: Vec<u32> = (0..long as u32).map(|k| 1000 + (k * 31) % 5000).collect();
    let (short, prefill) = std::thread::scope(|s| -> Result<(f64, f64)> {
        let batcher = &batcher;
        let long_prompt = &long_prompt;
        let long_job = s.spawn(move || -> Result<f64> {
            let done = Generation::new(model, long_prompt)
                .stop_ids(Vec::new())
                .max_new(Some(1))
                .batcher(batcher)
                .run(|_| Ok(()))?;
            Ok(done.prefill_duration.as_secs_f64())
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        let arrived = Instant::now();
        let mut first: Option<f64> = None;
        let prompt: Vec<u32> = (0..8).map(|k| 2000 + k).collect();
        Generation::new(model, &prompt)
            .stop_ids(Vec::new())
            .max_new(Some(1))
            .batcher(batcher)
            .run(|ev| {
                if let Event::Committed(_) = ev {
                    first.get_or_insert(arrived.elapsed().as_secs_f64());
                }
                Ok(())
            })?;
        let prefill = long_job
            .join()
            .unwrap_or_else(|_| bail!("the long prefill panicked"))?;
        Ok((first.unwrap_or(f64::NAN), prefill))
    })?;
    Ok((short, prefill, prefill / model.layers.len().max(1) as f64))
}

/// One timed run: `n` sequences, `tokens` batched steps. Returns (seconds, expert bytes read
/// during the timed steps).
fn run_streams(model: &K3Model, n: usize, tokens: usize) -> Result<(f64, u64)> {
    let mut states: Vec<_> = (0..n).map(|_| model.new_state()).collect();
    let mut next = Vec::with_capacity(n);
    for (i, st) in states.iter_mut().enumerate() {
        next.push(greedy(&model.prefill(st, &prompt_of(i))?));
    }
    let read = || model.experts.stats().map_or(0, |s| s.device_bytes);
    let before = read();
    let t = Instant::now();
    deltafin_kernels::pool::run_warm(|| -> Result<()> {
        for _ in 0..tokens {
            let inputs: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let mut segments: Vec<Segment<'_>> = states
                .iter_mut()
                .zip(&inputs)
                .map(|(state, tokens)| Segment {
                    state,
                    tokens,
                    want: LogitRows::Last,
                    kda_form: KdaForm::Chunked,
                })
                .collect();
            let logits = model.forward_batch(&mut segments)?;
            for (t, l) in next.iter_mut().zip(&logits) {
                *t = greedy(l.last());
            }
        }
        Ok(())
    })?;
    Ok((t.elapsed().as_secs_f64(), read().saturating_sub(before)))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(args: &Args) -> Result<()> {
    crate::kernel_env::install()?;
    if args.tokens == 0 || args.rounds == 0 {
        bail!("--tokens and --rounds must be at least 1");
    }
    let streams: Vec<usize> = args
        .streams
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n >= 1)
                .with_context(|| format!("--streams: {s:?} is not a count of at least 1"))
        })
        .collect::<Result<_>>()?;
    let order: Vec<usize> = streams
        .iter()
        .copied()
        .chain(streams.iter().rev().copied())
        .collect();
    for name in args.spines.split(',').map(str::trim) {
        let spine = match name {
            "int8" => SpineFormat::Int8,
            "bf16" => SpineFormat::Bf16,
            other => bail!("--spines: {other:?} is not int8 or bf16"),
        };
        let t = Instant::now();
        let engine = EngineBuilder::new(&args.model_root)
            .spine(spine)
            .memory_budget(args.budget_gb.map(|g| (g * 1e9) as u64))
            .build()
            .with_context(|| format!("loading {} ({name} spine)", args.model_root.display()))?;
        let model = &engine.model;
        println!(
            "{name}: loaded in {:.1} s; experts {}",
            t.elapsed().as_secs_f64(),
            engine.experts_words()
        );
        let runner = if args.driver { run_driver } else { run_streams };
        runner(model, 1, 2)?; // first-touch costs stay out of the rounds
        // Per stream count: aggregate token/s, and its ratio to one stream in the same round.
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); streams.len()];
        let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); streams.len()];
        let mut bytes: Vec<Vec<f64>> = vec![Vec::new(); streams.len()];
        for round in 1..=args.rounds {
            let mut line = format!("{name} round {round}:");
            let mut this: Vec<Vec<f64>> = vec![Vec::new(); streams.len()];
            for &n in &order {
                let (secs, read) = runner(model, n, args.tokens)?;
                let generated = (n * args.tokens) as f64;
                let rate = generated / secs;
                let k = streams.iter().position(|&s| s == n).unwrap_or(0);
                this[k].push(rate);
                bytes[k].push(read as f64 / generated);
                line += &format!(" {n}×{rate:.2}");
            }
            println!("{line} token/s (aggregate, A B B A)");
            let base = this
                .iter()
                .zip(&streams)
                .find(|(_, n)| **n == 1)
                .map(|(r, _)| r.iter().sum::<f64>() / r.len() as f64);
            for (k, r) in this.iter().enumerate() {
                let mean = r.iter().sum::<f64>() / r.len() as f64;
                rates[k].push(mean);
                if let Some(b) = base {
                    ratios[k].push(mean / b);
                }
            }
        }
        for (k, &n) in streams.iter().enumerate() {
            let rate = median(&mut rates[k]);
            let ratio = if ratios[k].is_empty() {
                "—".to_string()
            } else {
                format!("{:.2} ×", median(&mut ratios[k]))
            };
            let read = if args.budget_gb.is_some() {
                format!(
                    ", expert bytes read per generated token {:.1} MB",
                    median(&mut bytes[k]) / 1e6
                )
            } else {
                String::new()
            };
            println!(
                "{name} {n} stream(s): aggregate {rate:.2} token/s, {:.2} per stream, {ratio} one stream{read}",
                rate / n as f64
            );
        }
        if args.driver && args.ttft_prompt > 0 {
            let (first, prefill, layer) = ttft(model, args.ttft_prompt)?;
            println!(
                "{name} time to first token of an 8-token request during a {}-token prefill: {first:.3} s (that prefill: {prefill:.3} s, {layer:.3} s per layer)",
                args.ttft_prompt
            );
        }
    }
    Ok(())
}
