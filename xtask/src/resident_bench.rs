//! `cargo xtask resident-bench`: whole-model resident decode against the memory read probe
//! (issue 4; GB-scale, not run in CI).
//!
//! Loads the checkpoint once per spine (`--spines int8,bf16`; int8 needs `deltafin
//! convert-spine-int8` once) with every routed expert resident, as `deltafin run` does
//! without a memory budget, including the copy into huge-page memory
//! (`--huge-pages auto|off`, as `DELTAFIN_HUGE_PAGES`). Then, `--rounds` times: the read probe
//! (a parallel streaming sum over `--probe-mib` of heap memory and of an anonymous mapping
//! advised for huge pages, best of five each; the round uses the larger), then for each spine a
//! fresh sequence: a 5-token prefill and `--tokens` greedy decode steps, timed, run as
//! `deltafin run` runs them (on a pool worker with the other workers kept warm).
//!
//! Bytes touched per decoded token are computed from the loaded weights: every spine
//! projection (int8 codes and scales, or bf16), every router, `lm_head`, one embedding row,
//! and per MoE layer `num_experts_per_token` routed experts (codes and scales). The norm,
//! bias and convolution vectors (under 0.1% of the bytes) are left out. Each round's ratio
//! is (bytes per token × decode tok/s) ÷ that round's probe; the summary gives medians, and
//! also the median effective GB/s ÷ the median probe (the probe alone swings by ±15% from one
//! round to the next on a shared host, more than decode does).

use anyhow::{Context, Result, bail};
use deltafin_k3::model::linear::Linear;
use deltafin_k3::model::{Ffn, K3Model};
use deltafin_k3::weights::checkpoint::Checkpoint;
use deltafin_k3::weights::loader::{CheckpointExperts, EngineOptions, load_model_with_experts};
use deltafin_k3::weights::resident::HugePages;
use deltafin_k3::weights::spine_int8::SpineFormat;
use deltafin_k3::weights::spine_stream::linears_mut;
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint (e.g. `cargo xtask synth --preset mini --seed 1 --out DIR`).
    #[arg(long)]
    model_root: PathBuf,
    /// Spines to measure, comma-separated: int8, bf16.
    #[arg(long, default_value = "int8,bf16")]
    spines: String,
    /// Greedy decode steps per run.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Rounds (probe, then one run per spine).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Copy the resident weights into huge-page memory: auto or off.
    #[arg(long, default_value = "auto")]
    huge_pages: String,
    /// Probe buffer size in MiB (far larger than the last-level cache).
    #[arg(long, default_value_t = 1024)]
    probe_mib: usize,
}

/// Bytes of one matrix's host views (codes and scales), 0 on a device.
fn linear_bytes(l: &Linear) -> u64 {
    match l {
        Linear::Bf16(m) => m.bytes().len() as u64,
        Linear::RowInt8(m) => (m.data_bytes().len() + m.scale_bytes().len()) as u64,
        Linear::Device(_) => 0,
    }
}

/// Weight bytes one decode step reads: (spine, routed experts).
fn bytes_per_token(model: &mut K3Model, top_k: usize) -> Result<(u64, u64)> {
    let mut spine = linear_bytes(&model.lm_head) + model.embed.cols() as u64 * 2;
    let mut experts = 0;
    for (l, layer) in model.layers.iter_mut().enumerate() {
        spine += linears_mut(layer)
            .into_iter()
            .map(|(_, m)| linear_bytes(m))
            .sum::<u64>();
        if let Ffn::Moe(moe) = &layer.ffn {
            spine += moe.router.weight.bytes().len() as u64;
            let e = model
                .experts
                .expert(l, 0)
                .with_context(|| format!("layer {l} expert 0"))?;
            let one: u64 = [&e.w1, &e.w2, &e.w3]
                .iter()
                .map(|w| (w.packed().len() + w.scales().len()) as u64)
                .sum();
            experts += one * top_k as u64;
        }
    }
    Ok((spine, experts))
}

/// GB/s of the best of five parallel read sums over `words`.
fn read_gbps(words: &[u64]) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        black_box(deltafin_kernels::probe::parallel_read_sum(black_box(words)));
        best = best.min(t.elapsed().as_secs_f64());
    }
    words.len() as f64 * 8.0 / best / 1e9
}

struct Loaded {
    spine: SpineFormat,
    model: K3Model,
    spine_bytes: u64,
    expert_bytes: u64,
}

pub fn run(args: &Args) -> Result<()> {
    crate::kernel_env::install()?;
    let huge =
        HugePages::parse(&args.huge_pages).map_err(|e| anyhow::anyhow!("--huge-pages: {e}"))?;
    if args.tokens == 0 || args.rounds == 0 || args.probe_mib == 0 {
        bail!("--tokens, --rounds and --probe-mib must be at least 1");
    }
    let ckpt = Arc::new(
        Checkpoint::open(&args.model_root)
            .with_context(|| format!("opening {}", args.model_root.display()))?,
    );
    let top_k = ckpt.config().text.num_experts_per_token;
    let checkpoint_bytes: u64 = std::fs::read_dir(&args.model_root)?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .filter_map(|e| std::fs::metadata(e.path()).ok())
        .map(|m| m.len())
        .sum();
    let mut loaded = Vec::new();
    for name in args.spines.split(',').map(str::trim) {
        let spine = match name {
            "int8" => SpineFormat::Int8,
            "bf16" => SpineFormat::Bf16,
            other => bail!("--spines: {other:?} is not int8 or bf16"),
        };
        let t = Instant::now();
        let experts = CheckpointExperts::new(ckpt.clone());
        if huge.copies() {
            let c = experts.copy_to_huge_pages(&|_, _| {})?;
            println!("{name}: {}", c.describe());
        }
        let engine = EngineOptions {
            spine,
            huge_pages: huge,
            ..EngineOptions::default()
        };
        let mut model = load_model_with_experts(ckpt.clone(), &engine, Box::new(experts))
            .with_context(|| format!("loading the model with the {name} spine"))?;
        if let Some(c) = &model.resident_copy {
            println!("{name}: {}", c.describe());
        }
        let (spine_bytes, expert_bytes) = bytes_per_token(&mut model, top_k)?;
        println!(
            "{name}: loaded in {:.2} s; bytes per decoded token {:.4} GB = spine {:.4} GB + {top_k} routed experts × MoE layers {:.4} GB",
            t.elapsed().as_secs_f64(),
            (spine_bytes + expert_bytes) as f64 / 1e9,
            spine_bytes as f64 / 1e9,
            expert_bytes as f64 / 1e9
        );
        loaded.push(Loaded {
            spine,
            model,
            spine_bytes,
            expert_bytes,
        });
    }
    println!(
        "resident set after loading: {:.3} GB for {} model(s) of the {:.3} GB checkpoint (one model alone: `deltafin run --stats`)",
        rss() as f64 / 1e9,
        loaded.len(),
        checkpoint_bytes as f64 / 1e9
    );
    // Probe buffers: the heap (4 KiB pages) and an anonymous mapping advised for huge pages.
    let words = args.probe_mib << 17;
    let heap = vec![1u64; words];
    let anon = deltafin_tensor::storage::copy_to_anonymous(
        &[deltafin_tensor::Bytes::from_vec(vec![1u8; words * 8])],
        true,
        &|_, _| {},
    )
    .context("mapping the huge-page probe buffer")?;
    let anon_words: &[u64] = bytemuck::cast_slice(anon.views[0].as_slice());
    let prompt: Vec<u32> = (0..5).map(|i| 1000 + i).collect();
    // One untimed pass per model: first-touch costs stay out of the rounds.
    for l in &loaded {
        let mut st = l.model.new_state();
        deltafin_kernels::pool::run_warm(|| -> Result<()> {
            let logits = l.model.prefill(&mut st, &prompt)?;
            l.model
                .decode(&mut st, deltafin_k3::generate::greedy(&logits))?;
            Ok(())
        })?;
    }
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); loaded.len()];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); loaded.len()];
    let mut probes = Vec::new();
    for round in 1..=args.rounds {
        let p_heap = read_gbps(&heap);
        let p_anon = read_gbps(anon_words);
        let probe = p_heap.max(p_anon);
        probes.push(probe);
        let mut line = format!(
            "round {round}: probe {p_heap:.2} GB/s heap, {p_anon:.2} GB/s huge-page mapping"
        );
        for (i, l) in loaded.iter().enumerate() {
            let mut st = l.model.new_state();
            let secs = deltafin_kernels::pool::run_warm(|| -> Result<f64> {
                let mut logits = l.model.prefill(&mut st, &prompt)?;
                let t = Instant::now();
                for _ in 0..args.tokens {
                    logits = l
                        .model
                        .decode(&mut st, deltafin_k3::generate::greedy(&logits))?;
                }
                Ok(t.elapsed().as_secs_f64())
            })?;
            let tps = args.tokens as f64 / secs;
            let gbps = (l.spine_bytes + l.expert_bytes) as f64 * tps / 1e9;
            rates[i].push(tps);
            ratios[i].push(gbps / probe);
            line += &format!(
                "; {} {tps:.2} tok/s = {gbps:.2} GB/s = {:.3} × probe",
                l.spine.as_str(),
                gbps / probe
            );
        }
        println!("{line}");
    }
    println!(
        "| spine | bytes/token GB | decode tok/s (median) | effective GB/s | probe GB/s (median) | median ÷ median probe | × probe per round | × probe (median of rounds) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---|---:|");
    for (i, l) in loaded.iter().enumerate() {
        let bytes = (l.spine_bytes + l.expert_bytes) as f64 / 1e9;
        let tps = median(&rates[i]);
        println!(
            "| {} | {bytes:.4} | {tps:.2} | {:.2} | {:.2} | {:.3} | {} | **{:.3}** |",
            l.spine.as_str(),
            bytes * tps,
            median(&probes),
            bytes * tps / median(&probes),
            ratios[i]
                .iter()
                .map(|r| format!("{r:.3}"))
                .collect::<Vec<_>>()
                .join(", "),
            median(&ratios[i])
        );
    }
    Ok(())
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

fn rss() -> u64 {
    crate::proc_status_bytes("VmRSS:")
}
