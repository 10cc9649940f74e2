//! `deltafin`: run Kimi K3 on one machine.
//!
//! `deltafin [run] [OPTIONS]` prefills a prompt and decodes it (greedily, or by K3's seeded
//! sampling with `--temperature`); `deltafin perplexity` scores a text teacher-forced. See
//! `docs/CLI.md` for every flag and environment variable (`environment` holds the table
//! `--help` prints).

mod benchmark;
mod buildinfo;
mod convert;
mod device;
mod doctor;
mod elfdeps;
mod engine_config;
mod env;
mod environment;
mod errtext;
mod events;
mod kernel_env;
mod npz;
mod pack;
mod perplexity;
mod place;
mod plot;
mod prefill_bar;
mod run;
mod scale4;
mod serve;
mod session;
mod setup;
mod stream_install;
mod upgrade;
mod warm;

#[cfg(test)]
mod plan_equality_tests;

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

/// Deltafin native runtime
#[derive(Parser, Debug)]
#[command(
    name = "deltafin",
    version,
    about = "Deltafin native runtime",
    long_about = "Deltafin native runtime\n\nRuns Moonshot AI's Kimi K3 on one machine. Every emitted token is K3's own choice: its argmax\n(greedy decoding, the default) or, with --temperature, its seeded draw from its own\ndistribution, reproducible bit for bit. With no subcommand, `deltafin` is `deltafin run`.",
    after_help = "`deltafin --help` also lists the environment variables.",
    after_long_help = environment::help(),
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Prefill one prompt, then decode it (greedily, or sampling with --temperature) and
    /// stream the completion (the default).
    #[command(
        after_help = "`deltafin run --help` also lists the environment variables.",
        after_long_help = environment::help()
    )]
    Run(RunArgs),
    /// Score a text teacher-forced through the prefill path: mean NLL and perplexity.
    Perplexity(PerplexityArgs),
    /// Read-only, network-free health audit of the host and the model install.
    Doctor(doctor::DoctorArgs),
    /// Relaunch `run` once per arm and repetition (ABBA order) and compare the arms.
    Benchmark(benchmark::BenchmarkArgs),
    /// Fast-forward this git checkout and rebuild with the recorded build profile.
    Upgrade,
    /// OpenAI-compatible HTTP server (docs/SERVER.md).
    #[command(
        after_help = "`deltafin serve --help` also lists the environment variables.",
        after_long_help = environment::help()
    )]
    Serve(serve::ServeArgs),
    /// One-shot install: K3 metadata, DSpark, optional Qwen, weights (docs/SETUP.md).
    Setup(setup::SetupArgs),
    /// Install (--meta-only) or verify (--check) the pinned K3 metadata and tensor inventory.
    SetupK3(setup::SetupK3Args),
    /// Install, verify (--check) or remotely audit (--audit-only) the pinned DSpark drafter.
    SetupDspark(setup::SetupDsparkArgs),
    /// Install or verify (--check) the Qwen3 0.6B + 1.7B Base pair.
    SetupQwen(setup::SetupQwenArgs),
    /// Transfer spine and/or expert weights.
    FetchWeights(setup::FetchWeightsArgs),
    /// Rank routed experts from router traces and the heat histogram; optionally fetch the
    /// best-ranked missing ones.
    WarmExpertCache(warm::WarmArgs),
    /// Write lossless 4-bit scale sidecars of the routed experts (K3SC4V2).
    ConvertExpertsScale4(scale4::Scale4Args),
    /// Quantize the BF16 spine to the row-int8 spine (the default; not weight-exact).
    ConvertSpineInt8(convert::ConvertSpineInt8Args),
    /// Build or verify (--verify-only) the DFSP per-layer spine packs.
    PackSpine(pack::PackSpineArgs),
    /// Copy routed experts into expert homes on other drives, each copy verified
    /// (docs/CLI.md "place-experts").
    PlaceExperts(place::PlaceArgs),
}

/// `--model-root`, the one definition of the flag every command that takes a model root
/// flattens in (docs/CLI.md "The model root").
#[derive(Args, Debug, Clone, Default)]
pub struct RootArg {
    /// Install root: config.json, the tokenizer files, and the release shards or a stream
    /// install [env: DELTAFIN_ROOT; default: the current directory].
    #[arg(long, value_name = "PATH")]
    pub model_root: Option<PathBuf>,
}

impl RootArg {
    /// An explicit root, as if `--model-root PATH` was given.
    pub fn at(path: PathBuf) -> Self {
        Self {
            model_root: Some(path),
        }
    }

    /// `--model-root`, else `DELTAFIN_ROOT`, else `.` ([`env::model_root`]).
    pub fn resolve(&self) -> PathBuf {
        env::model_root(self.model_root.as_deref())
    }
}

/// Options shared by the commands that load the model.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    #[command(flatten)]
    pub install: RootArg,
    /// Whole-process RAM budget in decimal GB [env: K3_MEMORY_BUDGET_GB]. Default: no budget,
    /// every expert resident through the shard mmaps. With a budget the spine stays mmap'd, the
    /// KV/state and runtime are reserved, and the routed experts stream from disk into an
    /// expert cache of what remains.
    #[arg(long, value_name = "GB")]
    pub memory_budget_gb: Option<String>,
    /// Compute device: auto, cpu, mps, cuda or cuda:N [env: K3_DEV; default auto]. auto runs
    /// on the CPU; cuda[:N] offloads the spine (while it fits; K3_DEV_RESERVE_GB stays free)
    /// and, with --expert-backend auto, the routed experts to that GPU; a GPU that cannot be
    /// used is an error naming what is missing (mps: no Metal path).
    #[arg(long, value_name = "DEV")]
    pub device: Option<String>,
    /// Where routed-expert products run: auto, cpu, metal or cuda [env: K3_MOE; default auto
    /// = follow --device].
    #[arg(long, value_name = "BACKEND")]
    pub expert_backend: Option<String>,
    /// Spine format: auto or int8 (row-int8, quantized; needs `deltafin convert-spine-int8`),
    /// bf16 (the original weights, weight-exact) [env: K3_SPINE; default: auto = int8].
    #[arg(long, value_name = "FORMAT")]
    pub spine: Option<String>,
    /// Reader threads per streamed spine layer (when the spine does not fit the memory budget
    /// and layers are read per pass), 1…16 [env: K3_SPINE_READ_THREADS; default 4].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=16))]
    pub spine_read_threads: Option<u64>,
    /// Prefix states kept between prompts: on or off [env: K3_STATE_CACHE; default on]. On:
    /// a prompt that begins like an earlier one (the same chat history, a repeated prompt)
    /// resumes from the stored state after that beginning instead of prefilling it again,
    /// with the same bits; states live in RAM (K3_STATE_CACHE_RAM_GB, default 1; inside a
    /// memory budget) and under the model root in `k3-meta/state-cache/`
    /// (K3_STATE_CACHE_DISK_GB, default 16), which survives restarts and is safe to delete.
    #[arg(long, value_name = "on|off")]
    pub state_cache: Option<String>,
    /// Expert homes: directories on other drives holding verified copies of routed experts
    /// (`deltafin place-experts`), comma-separated [env: K3_EXPERT_HOMES]. Under a memory
    /// budget an expert a home holds is read from the holding drive with the fewest bytes
    /// outstanding, so the reads of a token are spread over the drives; a missing home or one
    /// of another model is an error, a copy that fails its checksum is read elsewhere.
    #[arg(long, value_name = "DIR[,DIR…]")]
    pub expert_homes: Option<String>,
}

impl ModelArgs {
    /// The model root: `--model-root`, else `DELTAFIN_ROOT`, else `.` ([`RootArg::resolve`]).
    pub fn root(&self) -> PathBuf {
        self.install.resolve()
    }
}

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Text to continue (raw completion) or the user message (with --chat).
    #[arg(long, value_name = "TEXT", default_value = "The capital of France is")]
    pub prompt: String,
    /// Wrap the prompt in K3's XTML chat template (thinking on unless --no-thinking).
    #[arg(long)]
    pub chat: bool,
    /// Stop after at most N generated tokens (default: until end of message or a full
    /// context).
    #[arg(long, value_name = "N")]
    pub max_new: Option<usize>,
    /// Thinking effort for --chat: low, medium, high or max; none, off or minimal turn
    /// thinking off [env: K3_REASONING_EFFORT; default: max].
    #[arg(long, value_name = "LEVEL", requires = "chat")]
    pub reasoning_effort: Option<String>,
    /// --chat without thinking: the answer starts at once (the generation prompt opens
    /// `response`); the same as --reasoning-effort none.
    #[arg(long, requires = "chat", conflicts_with = "reasoning_effort")]
    pub no_thinking: bool,
    /// Sample at this temperature (0 < T ≤ 2) instead of greedy decoding; each token is
    /// K3's own draw with its position's seeded random number [env: K3_TEMPERATURE; default:
    /// greedy].
    #[arg(long, value_name = "T")]
    pub temperature: Option<f64>,
    /// Sampling: keep the smallest most-likely set reaching probability P [env: K3_TOP_P;
    /// default 1: all].
    #[arg(long, value_name = "P")]
    pub top_p: Option<f64>,
    /// Sampling: keep the K most likely tokens [env: K3_TOP_K; default 0: all].
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Sampling: drop tokens less likely than M × the most likely one [env: K3_MIN_P;
    /// default 0].
    #[arg(long, value_name = "M")]
    pub min_p: Option<f64>,
    /// Sampling seed: the same seed gives the same tokens [env: K3_SEED; default: a fresh
    /// one, printed and written to the events file].
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// Print a live cumulative speed line per token instead of the text.
    #[arg(long)]
    pub stats: bool,
    /// Print one line per layer of every forward pass (prefill chunk, decode step, verify
    /// pass) on stderr: `[phase layer N/L] pass= rows= kinds total_ms= weights_ms= mix_ms=
    /// attention_ms= ffn_ms=` (timing only; the tokens are unchanged).
    #[arg(long)]
    pub layer_profile: bool,
    /// Write one JSON object per line (schema deltafin.run_event.v1) to PATH.
    #[arg(long, value_name = "PATH")]
    pub events_jsonl: Option<PathBuf>,
    /// Add the N largest logits (N ≤ 100) and the log-sum-exp of every distribution to the
    /// events file.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=100))]
    pub top_logits: Option<u16>,
    /// Append the routes of every pass (JSONL, one line per MoE layer and up to 56 rows) to
    /// PATH; a relative PATH is under the model root [env: K3_TRACE_PATH].
    #[arg(long, value_name = "PATH")]
    pub router_trace: Option<PathBuf>,
    /// Router trace mode: off, buffered (a whole pass at a time) or sync (flush every line);
    /// a path alone means buffered [env: K3_TRACE; default: off].
    #[arg(long, value_name = "MODE")]
    pub router_trace_mode: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
}

#[derive(Args, Debug, Clone)]
pub struct PerplexityArgs {
    /// UTF-8 text file to score (encoded as raw text, specials off, no BOS).
    #[arg(long, value_name = "PATH")]
    pub file: PathBuf,
    /// Score at most the first N tokens of the file.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(2..))]
    pub max_tokens: Option<u64>,
    /// Positions per forward pass.
    #[arg(long, value_name = "N", default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub chunk: u64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also write an SVG plot of the loss along the text to PATH: each scored position's
    /// negative log-likelihood (the mean of each bucket past 2,000 positions) and the running
    /// mean.
    #[arg(long, value_name = "PATH")]
    pub plot: Option<PathBuf>,
    #[command(flatten)]
    pub model: ModelArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The original's variables deltafin has no counterpart for stop every command but
    // `doctor` (which reports them) and `upgrade` (which ignores the runtime environment).
    if !matches!(cli.command, Some(Command::Doctor(_) | Command::Upgrade))
        && let Err(e) = environment::check_refused()
    {
        eprintln!("deltafin: error: {e:#}");
        return ExitCode::from(1);
    }
    // The kernel settings, before anything runs a kernel; the commands that compute report a
    // bad value as their error (`session::check_kernels`), the others keep the defaults.
    let _ = kernel_env::install();
    let result = match cli.command {
        Some(Command::Run(args)) => run::run(&args),
        Some(Command::Perplexity(args)) => perplexity::perplexity(&args),
        Some(Command::Doctor(args)) => doctor::doctor(&args),
        Some(Command::Benchmark(args)) => benchmark::benchmark(&args),
        Some(Command::Upgrade) => upgrade::upgrade(),
        Some(Command::Serve(args)) => serve::serve(&args),
        Some(Command::Setup(args)) => setup::setup(&args),
        Some(Command::SetupK3(args)) => setup::setup_k3(&args),
        Some(Command::SetupDspark(args)) => setup::setup_dspark(&args),
        Some(Command::SetupQwen(args)) => setup::setup_qwen(&args),
        Some(Command::FetchWeights(args)) => setup::fetch_weights(&args),
        Some(Command::WarmExpertCache(args)) => warm::warm_expert_cache(&args),
        Some(Command::ConvertExpertsScale4(args)) => scale4::convert(&args),
        Some(Command::ConvertSpineInt8(args)) => convert::convert_spine_int8(&args),
        Some(Command::PackSpine(args)) => pack::pack_spine_cmd(&args),
        Some(Command::PlaceExperts(args)) => place::place_experts(&args),
        None => run::run(&cli.run),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("deltafin: error: {}", errtext::describe(&e));
            ExitCode::from(1)
        }
    }
}
