//! `cargo xtask`: developer tasks (checkpoint synthesis, conversions).
//!
//! - `cargo xtask synth --preset tiny|mini|stream|real-experts [--ram-gb N] [--seed N] --out DIR [dims]`
//! - `cargo xtask synth-layout --out DIR`: the real release layout at full scale (96 sparse
//!   shards, 1.42 TiB of tensors left as holes; docs/PERFORMANCE.md, "Full-scale layout")
//! - `cargo xtask synth-dspark --target DIR --out DIR [--seed N]`
//! - `cargo xtask synth-qwen3 --size 0.6b|1.7b --out DIR [--seed N] [--tokenizer-from K3_DIR]`
//! - `cargo xtask spine-quality --model-root DIR [--convert] [--json]`: the int8-vs-bf16
//!   quality report (docs/NUMERICS.md)
//! - `cargo xtask batch-bench --model-root DIR [--spines int8,bf16] [--streams 1,2,4,8]
//!   [--budget-gb N]`: several sequences decoding together against one (docs/PERFORMANCE.md)

// No unsafe code: this crate needs none (docs/ARCHITECTURE.md "Invariants").
#![forbid(unsafe_code)]

mod batch_bench;
mod kernel_env;
mod layout;
mod peak_probe;
mod resident_bench;
mod stream_bench;

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use deltafin_k3::config::K3Config;
use deltafin_k3::synth::{self, QwenSize, REAL_VOCAB, SynthDims, SynthReport, SynthSpec};

#[derive(Parser)]
#[command(name = "xtask", about = "deltafin developer tasks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum Preset {
    /// ≈ 36 MB, 14 layers, hidden 48, real vocabulary (tests).
    Tiny,
    /// ≈ 2.35 GB, 24 layers, hidden 1024, 128 experts top-8 (benchmarks).
    Mini,
    /// Routed experts exceed `--ram-gb` (streaming benchmarks).
    Stream,
    /// Real expert geometry: hidden 7168, 896 experts of 17,547,264 B top-16 in one MoE
    /// layer (15.7 GB; `--experts`, `--layers` scale it), small vocabulary.
    RealExperts,
}

#[derive(Clone, Copy, ValueEnum)]
enum QwenArg {
    #[value(name = "0.6b")]
    Small,
    #[value(name = "1.7b")]
    Large,
}

#[derive(Subcommand)]
enum Cmd {
    /// The README's main job: build `deltafin` (release), synthesize the tiny demo K3
    /// checkpoint if it is absent, and run `deltafin run` on it.
    Demo {
        /// Where the demo checkpoint lives (created if absent).
        #[arg(long, default_value = "demo-k3")]
        out: PathBuf,
        /// Tokens to generate.
        #[arg(long, default_value_t = 32)]
        max_new: usize,
        /// Extra arguments passed to `deltafin run` (after `--`).
        #[arg(last = true)]
        run_args: Vec<String>,
    },
    /// Write a synthetic K3 checkpoint in the release layout.
    Synth {
        #[arg(long, value_enum, default_value = "tiny")]
        preset: Preset,
        /// RAM size the `stream` preset's experts must exceed.
        #[arg(long)]
        ram_gb: Option<f64>,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long)]
        out: PathBuf,
        #[arg(long)]
        hidden: Option<usize>,
        #[arg(long)]
        layers: Option<usize>,
        #[arg(long)]
        experts: Option<usize>,
        #[arg(long)]
        top_k: Option<usize>,
        #[arg(long)]
        latent: Option<usize>,
        #[arg(long)]
        moe_inter: Option<usize>,
        #[arg(long)]
        kda_heads: Option<usize>,
        #[arg(long)]
        head_dim: Option<usize>,
        /// Vocabulary size; below 163840 only with `--small-vocab`.
        #[arg(long)]
        vocab: Option<usize>,
        /// Allow a vocabulary smaller than the real one (the tokenizer then does not fit).
        #[arg(long)]
        small_vocab: bool,
    },
    /// Write the real K3 release layout at full scale as sparse files: the 96 shards with the
    /// real index's tensors (shapes from the real config) and their data left as holes, the
    /// real config, index and tokenizer. Takes about 120 MB of disk.
    SynthLayout {
        #[arg(long)]
        out: PathBuf,
    },
    /// Expert-streaming benchmark: read-bandwidth probe, then prefill + greedy decode with
    /// experts streamed under a cache budget; prints ratios against the probe (not in CI).
    StreamBench(stream_bench::Args),
    /// Whole-model resident decode benchmark: memory read probe, then greedy decode with
    /// every weight resident, per spine; bytes per token from the loaded weights, effective
    /// GB/s and the ratio to the probe per round (not in CI).
    ResidentBench(resident_bench::Args),
    /// Peak-arithmetic probe: f32 FMA and int8 dot-product rates of this CPU with the
    /// kernels' instructions, and the spine products' in-cache rate as a fraction of them.
    PeakProbe(peak_probe::Args),
    /// Several sequences decoding together against one alone: aggregate and per-stream
    /// token/s with 1, 2, 4, 8 streams (A B B A), per spine, resident or under a memory
    /// budget with the expert bytes read per token (not in CI).
    BatchBench(batch_bench::Args),
    /// Write `k3-experts/L{layer}-E{expert}.bin` (one raw expert per file) from the shards;
    /// the streaming loader then reads experts from those files.
    ConvertExperts {
        #[arg(long)]
        model_root: PathBuf,
    },
    /// Expert-cache hit rate vs cache size on synthetic Zipf-skewed routing: the decayed-heat
    /// policy against plain LRU.
    CacheCurve {
        #[arg(long, default_value_t = 16)]
        layers: usize,
        #[arg(long, default_value_t = 128)]
        experts: usize,
        #[arg(long, default_value_t = 8)]
        top_k: usize,
        #[arg(long, default_value_t = 400)]
        tokens: usize,
        /// Zipf exponent.
        #[arg(long, default_value_t = 1.0)]
        s: f64,
    },
    /// Write a synthetic DSpark draft sized for a (synthetic) K3 checkpoint.
    SynthDspark {
        /// Directory with the target's config.json.
        #[arg(long)]
        target: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// The int8-vs-bf16 quality report on a checkpoint whose int8 spine is converted:
    /// weight rel-RMS, logit rel-L2, greedy agreement and NLL over teacher-forced texts.
    SpineQuality {
        #[arg(long)]
        model_root: PathBuf,
        /// Convert the int8 spine first when it is absent.
        #[arg(long)]
        convert: bool,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Write a synthetic Qwen3 Base draft.
    SynthQwen3 {
        #[arg(long, value_enum)]
        size: QwenArg,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Also write a Qwen-like byte-level BPE `tokenizer.json` built from the K3
        /// tokenizer in this directory (the real Qwen file is not redistributed).
        #[arg(long, value_name = "K3_DIR")]
        tokenizer_from: Option<PathBuf>,
    },
}

/// The texts the quality report scores teacher-forced (raw encoding, no BOS).
const QUALITY_TEXTS: [&str; 4] = [
    "The capital of France is Paris, and the capital of Germany is Berlin. Both cities lie on rivers.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "In 1905 Albert Einstein published four papers that changed physics: on the photoelectric effect, Brownian motion, special relativity and mass-energy equivalence.",
    "月が綺麗ですね。今日はとても良い天気で、公園には多くの人が散歩をしていました。",
];

fn spine_quality(root: &std::path::Path, convert: bool, json: bool) -> Result<()> {
    use deltafin_k3::weights::spine_int8::{ConvertOptions, convert_spine, int8_spine_present};
    let ckpt = std::sync::Arc::new(
        deltafin_k3::weights::checkpoint::Checkpoint::open(root)
            .with_context(|| format!("opening {}", root.display()))?,
    );
    if !int8_spine_present(root) {
        if !convert {
            bail!(
                "{} has no int8 spine: pass --convert or run `deltafin convert-spine-int8`",
                root.display()
            );
        }
        let r = convert_spine(&ckpt, &ConvertOptions::default(), &mut |_| {})?;
        eprintln!(
            "converted {} tensors: read {:.3} GB in {:.2} s ({:.3} GB/s)",
            r.converted,
            r.read_bytes as f64 / 1e9,
            r.seconds,
            r.read_bytes as f64 / 1e9 / r.seconds.max(1e-9)
        );
    }
    let tok = deltafin_k3::text::tokenizer::Tokenizer::from_dir(root)
        .with_context(|| format!("tokenizer of {}", root.display()))?;
    let seqs: Vec<Vec<u32>> = QUALITY_TEXTS
        .iter()
        .map(|t| tok.encode_ordinary(t))
        .collect();
    let r = deltafin_k3::weights::spine_quality::quality_report(ckpt, &seqs)?;
    if json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!("int8 vs bf16 on {}", root.display());
    println!(
        "  weight rel-RMS: mean {:.4}%, max {:.4}% ({}), {} tensors",
        100.0 * r.weight_rel_rms_mean,
        100.0 * r.weight_rel_rms_max,
        r.worst_tensor,
        r.tensors
    );
    println!(
        "  logit rel-L2 over {} positions: mean {:.4}, median {:.4}, max {:.4}",
        r.positions, r.logit_rel_l2_mean, r.logit_rel_l2_median, r.logit_rel_l2_max
    );
    println!(
        "  top-1 (greedy) agreement: {:.2}%",
        100.0 * r.top1_agreement
    );
    println!(
        "  mean NLL: bf16 {:.4}, int8 {:.4} nats (mean |Δ| per position {:.4})",
        r.nll_bf16, r.nll_int8, r.nll_abs_diff_mean
    );
    Ok(())
}

/// A `kB` field of `/proc/self/status` (`key` with its colon, e.g. `VmHWM:`) in bytes; 0 where
/// the file or the field does not exist.
fn proc_status_bytes(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn summary(r: &SynthReport) {
    println!(
        "wrote {} files, {} bytes ({} tensor bytes); config.json sha256 {}",
        r.files.len(),
        r.total_bytes,
        r.tensor_bytes,
        r.config_sha256
    );
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::SynthLayout { out } => {
            let assets = layout::default_assets_dir();
            let plan = layout::plan(&assets)?;
            println!(
                "writing the K3 release layout ({} shards, {} tensors, {} tensor bytes as holes) into {}",
                plan.shards.len(),
                plan.tensor_count(),
                plan.total_size,
                out.display()
            );
            let r = layout::write(&out, &plan, &assets, &mut |line| println!("  {line}"))?;
            println!(
                "wrote {} shards, {} tensors: {} bytes apparent, {} bytes on disk ({} tensor bytes)",
                r.shards, r.tensors, r.shard_bytes, r.shard_disk_bytes, r.tensor_bytes
            );
        }
        Cmd::StreamBench(args) => stream_bench::run(&args)?,
        Cmd::ResidentBench(args) => resident_bench::run(&args)?,
        Cmd::PeakProbe(args) => peak_probe::run(&args)?,
        Cmd::BatchBench(args) => batch_bench::run(&args)?,
        Cmd::ConvertExperts { model_root } => {
            let ckpt = deltafin_k3::weights::checkpoint::Checkpoint::open(&model_root)
                .with_context(|| format!("opening {}", model_root.display()))?;
            let n = deltafin_store::experts::convert_to_expert_files(&ckpt)?;
            println!(
                "wrote {n} expert files under {}",
                model_root
                    .join(deltafin_k3::weights::loader::EXPERT_DIR)
                    .display()
            );
        }
        Cmd::SpineQuality {
            model_root,
            convert,
            json,
        } => spine_quality(&model_root, convert, json)?,
        Cmd::CacheCurve {
            layers,
            experts,
            top_k,
            tokens,
            s,
        } => stream_bench::cache_curve(layers, experts, top_k, tokens, s),
        Cmd::Demo {
            out,
            max_new,
            run_args,
        } => demo(&out, max_new, &run_args)?,
        Cmd::Synth {
            preset,
            ram_gb,
            seed,
            out,
            hidden,
            layers,
            experts,
            top_k,
            latent,
            moe_inter,
            kda_heads,
            head_dim,
            vocab,
            small_vocab,
        } => {
            let ram_bytes = match preset {
                Preset::Stream => {
                    let gb = ram_gb.context("--preset stream needs --ram-gb")?;
                    if gb.is_nan() || gb <= 0.0 {
                        bail!("--ram-gb must be positive");
                    }
                    Some((gb * (1u64 << 30) as f64) as u64)
                }
                _ => None,
            };
            let mut d = match preset {
                Preset::Tiny => SynthDims::tiny(),
                Preset::Mini => SynthDims::mini(),
                Preset::Stream => SynthDims::stream(ram_bytes.unwrap_or(0)),
                Preset::RealExperts => SynthDims::real_experts(),
            };
            for (v, slot) in [
                (hidden, &mut d.hidden),
                (layers, &mut d.layers),
                (experts, &mut d.experts),
                (top_k, &mut d.top_k),
                (latent, &mut d.latent),
                (moe_inter, &mut d.moe_inter),
                (kda_heads, &mut d.kda_heads),
                (head_dim, &mut d.kda_head_dim),
            ] {
                if let Some(v) = v {
                    *slot = v;
                }
            }
            // Re-fit the stream preset's expert count to the overridden dims.
            if let (Some(ram), None) = (ram_bytes, experts) {
                d = d.with_experts_exceeding(ram);
            }
            if let Some(v) = vocab {
                if v < REAL_VOCAB && !small_vocab {
                    bail!(
                        "--vocab {v} is below the real {REAL_VOCAB}; pass --small-vocab to allow it"
                    );
                }
                d.vocab = v;
            }
            println!("synthesising {d:?} (seed {seed}) into {}", out.display());
            let r = synth::synthesize_with_progress(&out, &SynthSpec::new(d, seed), &mut |line| {
                println!("  {line}")
            })?;
            summary(&r);
        }
        Cmd::SynthDspark { target, out, seed } => {
            let cfg = K3Config::from_file(target.join("config.json"))?;
            let r = synth::synthesize_dspark(&out, seed, &cfg)?;
            summary(&r);
        }
        Cmd::SynthQwen3 {
            size,
            out,
            seed,
            tokenizer_from,
        } => {
            let size = match size {
                QwenArg::Small => QwenSize::Small,
                QwenArg::Large => QwenSize::Large,
            };
            let r = synth::synthesize_qwen3(&out, seed, size)?;
            summary(&r);
            if let Some(k3) = tokenizer_from {
                let tok = deltafin_k3::text::tokenizer::Tokenizer::from_dir(&k3)
                    .with_context(|| format!("K3 tokenizer in {}", k3.display()))?;
                let json = deltafin_spec::uag::synthesize_tokenizer_json(&tok, 3000);
                let path = out.join("tokenizer.json");
                std::fs::write(&path, json.to_string())
                    .with_context(|| format!("cannot write {}", path.display()))?;
                println!("wrote {}", path.display());
            }
        }
    }
    Ok(())
}

/// Build the release binary, synthesize the demo checkpoint when absent, run it.
fn demo(out: &std::path::Path, max_new: usize, run_args: &[String]) -> Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("xtask has no parent directory")?
        .to_path_buf();
    let out = if out.is_absolute() {
        out.to_path_buf()
    } else {
        root.join(out)
    };
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = std::process::Command::new(&cargo)
        .current_dir(&root)
        .args(["build", "--locked", "--release", "-p", "deltafin-cli"])
        .status()
        .with_context(|| format!("cannot run {cargo}"))?;
    if !status.success() {
        bail!("cargo build --release -p deltafin-cli failed ({status})");
    }
    if out.join("config.json").is_file() {
        println!("demo checkpoint present at {}", out.display());
    } else {
        println!(
            "synthesising the tiny demo K3 checkpoint (seed 0) into {}",
            out.display()
        );
        let r = synth::synthesize_with_progress(
            &out,
            &SynthSpec::new(SynthDims::tiny(), 0),
            &mut |line| println!("  {line}"),
        )?;
        summary(&r);
    }
    // The binary cargo just built: under CARGO_TARGET_DIR when set (relative to the
    // workspace, as cargo reads it), else the workspace's target/.
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .filter(|d| !d.is_empty())
        .map_or_else(|| root.join("target"), |d| root.join(d));
    let exe = target.join("release/deltafin");
    if deltafin_k3::weights::spine_int8::int8_spine_present(&out) {
        println!("int8 spine present at {}", out.display());
    } else {
        // The default spine (`--spine auto`) is row-int8: convert it once.
        println!(
            "running {} convert-spine-int8 --model-root {}",
            exe.display(),
            out.display()
        );
        let status = std::process::Command::new(&exe)
            .arg("convert-spine-int8")
            .arg("--model-root")
            .arg(&out)
            .status()
            .with_context(|| format!("cannot run {}", exe.display()))?;
        if !status.success() {
            bail!("deltafin convert-spine-int8 failed ({status})");
        }
    }
    let mut cmd = std::process::Command::new(&exe);
    cmd.arg("run")
        .arg("--model-root")
        .arg(&out)
        .arg("--max-new")
        .arg(max_new.to_string())
        .args(run_args);
    println!(
        "running {} run --model-root {} --max-new {max_new} {}",
        exe.display(),
        out.display(),
        run_args.join(" ")
    );
    let status = cmd
        .status()
        .with_context(|| format!("cannot run {}", exe.display()))?;
    if !status.success() {
        bail!("deltafin run failed ({status})");
    }
    Ok(())
}
