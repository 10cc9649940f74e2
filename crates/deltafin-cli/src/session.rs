//! Loading what every model command needs: the checkpoint, the model, the tokenizer, the
//! Ctrl-C flag, and strict parsing of environment variables.

use anyhow::{Context, Result, anyhow, bail};
use deltafin_experts::heat::{self, HeatDims, HeatRecorder, HeatTable};
use deltafin_experts::stream::PILOT_BREAK_EVEN_PRECISION;
use deltafin_experts::{DirectIo, PilotGate, RouterTrace, StreamOptions, TraceMode};
use deltafin_k3::checkpoint::{Checkpoint, Layout};
use deltafin_k3::install;
use deltafin_k3::loader::{
    CheckpointExperts, EngineOptions, dims_from_config, expert_table, load_model_with_experts,
    stream_install_missing_experts, streaming_experts,
};
use deltafin_k3::model::K3Model;
use deltafin_k3::resident::HugePages;
use deltafin_k3::spine_int8::{SpineChoice, SpineFormat, quantized_tensors};
use deltafin_k3::spine_stream::SpineStreamOptions;
use deltafin_k3::tokenizer::Tokenizer;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// A loaded model with its tokenizer.
pub struct Session {
    pub model: K3Model,
    pub tokenizer: Tokenizer,
    pub checkpoint: Arc<Checkpoint>,
    pub load_seconds: f64,
    /// The memory split when experts stream under a budget (`None`: resident experts).
    pub memory: Option<MemoryPlan>,
    /// The spine the model multiplies with.
    pub spine: SpineFormat,
}

/// How the model is loaded.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadOptions {
    /// Whole-process RAM budget in bytes; `None` keeps every expert resident (mmap).
    pub memory_budget: Option<u64>,
    /// `--device` / `K3_DEV`.
    pub device: crate::device::DeviceRequest,
    /// `--expert-backend` / `K3_MOE`.
    pub expert_backend: crate::device::ExpertBackendRequest,
    /// `K3_EXPERT_SCALE4`: where routed experts take their E8M0 scales from.
    pub expert_scale4: crate::scale4::Scale4Mode,
    /// The spine format (`--spine` / `K3_SPINE`; the CLI default `auto` is int8).
    pub spine: SpineFormat,
    /// The most tokens of context this session will ever hold, when the command knows it
    /// (`run` with `--max-new`: the prompt's bound plus `max_new`); the memory budget then
    /// reserves state for that many tokens instead of [`CONTEXT_RESERVE_TOKENS`], and the
    /// rest goes to the spine and the expert cache.
    pub context_tokens: Option<usize>,
}

/// The spine from `--spine`, else `K3_SPINE`, else `auto` (= int8). Both are parsed
/// strictly; `mixed` is rejected with its reason.
pub fn resolve_spine(flag: Option<&str>) -> Result<SpineFormat> {
    let env = env_var("K3_SPINE")?
        .map(|v| {
            v.parse::<SpineChoice>()
                .map_err(|e| anyhow!("environment variable K3_SPINE: {e}"))
        })
        .transpose()?;
    let choice = match flag {
        Some(f) => f
            .parse::<SpineChoice>()
            .map_err(|e| anyhow!("--spine: {e}"))?,
        None => env.unwrap_or_default(),
    };
    Ok(choice.format())
}

/// Tokens of KV/state reserved inside a memory budget (capped by the model context) when the
/// command does not know how long its context can grow (the server, an open-ended `run`).
pub const CONTEXT_RESERVE_TOKENS: usize = 32_768;

/// The split of a memory budget (bytes).
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    pub budget: u64,
    /// Non-expert tensor bytes of the shards: the resident spine (copied into huge-page
    /// memory at load when `spine_copied`, else mmap'd and resident as it is touched).
    pub spine: u64,
    /// Whether the resident spine is copied into huge-page memory (`DELTAFIN_HUGE_PAGES`).
    pub spine_copied: bool,
    /// KDA state plus the MLA cache for `context_tokens`.
    pub state: u64,
    pub context_tokens: usize,
    /// Process memory after loading (RSS: code, libraries, tokenizer, allocator).
    pub runtime: u64,
    /// Activation scratch and the one expert that may be multiplied while evicted.
    pub scratch: u64,
    /// What is left: the expert cache.
    pub cache: u64,
    /// Of the cache, the pinned tier (`K3_EXPERT_PIN_GB`).
    pub pin: u64,
    /// Payload bytes of one expert, and the experts over all MoE layers.
    pub expert_bytes: u64,
    pub experts: usize,
    /// Whether every expert's six tensors are gap-free in its shard (one read per expert).
    pub contiguous: bool,
    /// Spine layers kept resident, of `spine_layers` (the rest are streamed per pass).
    pub spine_resident_layers: usize,
    pub spine_layers: usize,
    /// Matrix bytes of the streamed layers (read once per forward pass), and the two
    /// reusable layer buffers of streaming (both 0 when the whole spine is resident).
    pub spine_streamed: u64,
    pub spine_buffers: u64,
}

impl MemoryPlan {
    /// The startup line.
    pub fn describe(&self, io: &str, threads: usize, pilot: &str) -> String {
        let gb = |b: u64| b as f64 / 1e9;
        format!(
            "memory budget {:.3} GB = spine {:.3} GB ({}) + state {:.3} GB ({} tokens) + runtime {:.3} GB + scratch {:.3} GB + expert cache {:.3} GB ({} of {} experts, {:.1}%; pinned tier {:.3} GB of it); experts stream from the shards ({}; {}), io={io} read_threads={threads} pilot_gate={pilot}",
            gb(self.budget),
            gb(self.spine),
            if self.spine_resident_layers >= self.spine_layers {
                if self.spine_copied {
                    "resident, copied into huge-page memory at load".to_string()
                } else {
                    "mmap'd, resident as touched".to_string()
                }
            } else {
                format!(
                    "resident part; {} of {} layers resident, {} streamed: {:.3} GB read per forward pass into 2 buffers of {:.3} GB",
                    self.spine_resident_layers,
                    self.spine_layers,
                    self.spine_layers - self.spine_resident_layers,
                    gb(self.spine_streamed),
                    gb(self.spine_buffers / 2),
                )
            },
            gb(self.state),
            self.context_tokens,
            gb(self.runtime),
            gb(self.scratch),
            gb(self.cache),
            self.cache / self.expert_bytes.max(1),
            self.experts,
            100.0 * self.cache as f64
                / (self.expert_bytes.max(1) * self.experts.max(1) as u64) as f64,
            gb(self.pin),
            if self.contiguous {
                "six tensors contiguous: one read per expert"
            } else {
                "non-contiguous: one read per run of tensors"
            },
            "explicit reads, never the mmap",
        )
    }
}

/// Memory counters of this process from `/proc/self/status` (Linux), in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcMemory {
    /// Resident set now (anonymous + file + shmem) and its peak.
    pub rss: u64,
    pub peak_rss: u64,
    pub rss_anon: u64,
    pub rss_file: u64,
    /// Anonymous memory in transparent huge pages (`/proc/self/smaps_rollup`; 0 where the
    /// file does not exist).
    pub anon_huge: u64,
}

/// Read `/proc/self/status`; `None` where it does not exist.
pub fn proc_memory() -> Option<ProcMemory> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let mut m = ProcMemory::default();
    for line in text.lines() {
        let mut it = line.split_whitespace();
        let (Some(key), Some(v)) = (it.next(), it.next()) else {
            continue;
        };
        let Ok(kb) = v.parse::<u64>() else { continue };
        match key {
            "VmRSS:" => m.rss = kb * 1024,
            "VmHWM:" => m.peak_rss = kb * 1024,
            "RssAnon:" => m.rss_anon = kb * 1024,
            "RssFile:" => m.rss_file = kb * 1024,
            _ => {}
        }
    }
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    m.anon_huge = rollup
        .lines()
        .find_map(|l| l.strip_prefix("AnonHugePages:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024);
    Some(m)
}

/// A decimal GB value (`1e9` bytes): a positive finite number.
pub fn parse_gb(text: &str) -> std::result::Result<u64, String> {
    let v: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number of GB"))?;
    if !v.is_finite() || v <= 0.0 || v > 1e6 {
        return Err(format!(
            "{text:?} must be a positive number of GB (at most 1e6)"
        ));
    }
    Ok((v * 1e9) as u64)
}

/// The budget from `--memory-budget-gb`, else `K3_MEMORY_BUDGET_GB`, else none. Both are
/// parsed strictly.
pub fn resolve_memory_budget(flag: Option<&str>) -> Result<Option<u64>> {
    let env = env_var("K3_MEMORY_BUDGET_GB")?
        .map(|v| parse_gb(&v).map_err(|e| anyhow!("environment variable K3_MEMORY_BUDGET_GB: {e}")))
        .transpose()?;
    match flag {
        Some(f) => Ok(Some(
            parse_gb(f).map_err(|e| anyhow!("--memory-budget-gb: {e}"))?,
        )),
        None => Ok(env),
    }
}

fn env_choice<T>(
    name: &str,
    default: T,
    parse: impl Fn(&str) -> std::result::Result<T, String>,
) -> Result<T> {
    match env_var(name)? {
        None => Ok(default),
        Some(v) => parse(&v).map_err(|e| anyhow!("environment variable {name}: {e}")),
    }
}

/// Streaming options from `K3_EXPERT_READ_THREADS` (1…16, default min(CPUs, 4)),
/// `K3_EXPERT_STREAM_NOCACHE` (`auto`/`1`: O_DIRECT where allowed, `0`: page cache),
/// `K3_PILOT_GATE` (`off`, `measure`, `on`, `ranked`), `K3_PILOT_GATE_THRESHOLD` ([0, 1),
/// 0.10), `K3_PILOT_GATE_WARMUP` (1…100000, 16), `K3_PILOT_RANK_PRECISION` ([0, 1], 0.5: the
/// break-even) and `K3_PILOT_MAX_GUESSES` (0…4096, 0 = no cap), all parsed strictly.
pub fn stream_options_from_env(cache_bytes: u64) -> Result<StreamOptions> {
    let base = StreamOptions::with_cache_bytes(cache_bytes);
    let read_threads = env_choice("K3_EXPERT_READ_THREADS", base.read_threads, |v| {
        v.parse::<usize>()
            .ok()
            .filter(|n| (1..=16).contains(n))
            .ok_or_else(|| format!("{v:?} is not an integer in 1…16"))
    })?;
    let direct_io = env_choice("K3_EXPERT_STREAM_NOCACHE", DirectIo::Auto, |v| match v {
        "auto" | "1" => Ok(DirectIo::Auto),
        "0" => Ok(DirectIo::Off),
        _ => Err(format!("{v:?} is not auto, 0 or 1")),
    })?;
    let threshold = env_choice("K3_PILOT_GATE_THRESHOLD", 0.10, |v| {
        v.parse::<f64>()
            .ok()
            .filter(|x| (0.0..1.0).contains(x))
            .ok_or_else(|| format!("{v:?} is not a number in [0, 1)"))
    })?;
    let warmup = env_choice("K3_PILOT_GATE_WARMUP", 16, |v| {
        v.parse::<u64>()
            .ok()
            .filter(|n| (1..=100_000).contains(n))
            .ok_or_else(|| format!("{v:?} is not an integer in 1…100000"))
    })?;
    let precision = env_choice("K3_PILOT_RANK_PRECISION", PILOT_BREAK_EVEN_PRECISION, |v| {
        v.parse::<f64>()
            .ok()
            .filter(|x| (0.0..=1.0).contains(x))
            .ok_or_else(|| format!("{v:?} is not a number in [0, 1]"))
    })?;
    let max_guesses = env_choice("K3_PILOT_MAX_GUESSES", 0, |v| {
        v.parse::<usize>()
            .ok()
            .filter(|n| *n <= 4096)
            .ok_or_else(|| format!("{v:?} is not an integer in 0…4096"))
    })?;
    let pilot = env_choice("K3_PILOT_GATE", PilotGate::Off, |v| match v {
        "off" => Ok(PilotGate::Off),
        "measure" => Ok(PilotGate::Measure),
        "on" => Ok(PilotGate::On { threshold, warmup }),
        "ranked" => Ok(PilotGate::Ranked {
            precision,
            warmup,
            max_guesses,
        }),
        _ => Err(format!("{v:?} is not off, measure, on or ranked")),
    })?;
    Ok(StreamOptions {
        cache_bytes,
        read_threads,
        direct_io,
        pilot,
    })
}

/// The learned expert-cache settings: `K3_EXPERT_HEAT` (`on`/`off`, default on: record the
/// persistent route histogram, §4.8) and `K3_EXPERT_PIN_GB` (decimal GB ≥ 0, default 0: the
/// pinned tier inside the expert cache). Both parsed strictly.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HeatSettings {
    pub enabled: bool,
    pub pin_bytes: u64,
}

/// [`HeatSettings`] from the environment.
pub fn heat_settings_from_env() -> Result<HeatSettings> {
    let enabled = env_choice("K3_EXPERT_HEAT", true, |v| match v {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{v:?} is not on or off")),
    })?;
    let pin_bytes = env_choice("K3_EXPERT_PIN_GB", 0, |v| match v.trim() {
        "0" => Ok(0),
        t => parse_gb(t).map_err(|e| format!("{e}, or 0 for no pinned tier")),
    })?;
    Ok(HeatSettings { enabled, pin_bytes })
}

/// The histogram's shape for a config: MoE layers 1…L−1, E experts, top-k.
pub fn heat_dims(cfg: &deltafin_k3::config::K3Config) -> HeatDims {
    HeatDims {
        layers: cfg.n_layers().saturating_sub(1),
        experts: cfg.text.num_experts,
        top_k: cfg.text.num_experts_per_token,
    }
}

/// Matrix bytes of each layer's spine projections in `format` (what streaming a layer
/// reads per pass): bf16 bytes, or int8 codes plus f16 row scales.
pub fn layer_spine_bytes(cfg: &deltafin_k3::config::K3Config, format: SpineFormat) -> Vec<u64> {
    let mut per = vec![0u64; cfg.n_layers()];
    for t in quantized_tensors(cfg) {
        let Some(rest) = t.name.split("model.layers.").nth(1) else {
            continue;
        };
        let Some(l) = rest.split('.').next().and_then(|n| n.parse::<usize>().ok()) else {
            continue;
        };
        let (rows, cols) = (t.shape[0] as u64, t.shape[1] as u64);
        if let Some(b) = per.get_mut(l) {
            *b += match format {
                SpineFormat::Int8 => rows * cols + rows * 2,
                _ => t.byte_len() as u64,
            };
        }
    }
    per
}

/// Spine streaming settings from `K3_PROVIDER_RESIDENT_LAYERS` (0…layers: at most this
/// many resident layers; unset: as the memory budget allows), `K3_SPINE_READ_THREADS`
/// (1…16, default 4) and `K3_SPINE_STREAM_NOCACHE` (`auto`/`1`: O_DIRECT where allowed,
/// `0`: page cache), all parsed strictly.
pub fn spine_stream_from_env(layers: usize) -> Result<(Option<usize>, SpineStreamOptions)> {
    let cap = env_choice("K3_PROVIDER_RESIDENT_LAYERS", None, |v| {
        v.parse::<usize>()
            .ok()
            .filter(|n| *n <= layers)
            .map(Some)
            .ok_or_else(|| format!("{v:?} is not an integer in 0…{layers}"))
    })?;
    let base = SpineStreamOptions::default();
    let read_threads = env_choice("K3_SPINE_READ_THREADS", base.read_threads, |v| {
        v.parse::<usize>()
            .ok()
            .filter(|n| (1..=16).contains(n))
            .ok_or_else(|| format!("{v:?} is not an integer in 1…16"))
    })?;
    let direct_io = env_choice("K3_SPINE_STREAM_NOCACHE", DirectIo::Auto, |v| match v {
        "auto" | "1" => Ok(DirectIo::Auto),
        "0" => Ok(DirectIo::Off),
        _ => Err(format!("{v:?} is not auto, 0 or 1")),
    })?;
    Ok((
        cap,
        SpineStreamOptions {
            read_threads,
            direct_io,
        },
    ))
}

/// Split `budget` and build the streaming model; `pin` bytes of the expert cache become the
/// pinned tier, filled from the `learned` histogram's candidates (hottest first), and the
/// cache's heat starts from the learned rates.
fn plan_and_load(
    checkpoint: &Arc<Checkpoint>,
    budget: u64,
    pin: u64,
    learned: &HeatTable,
    scale4: crate::scale4::Scale4Mode,
    engine: &EngineOptions,
    context_tokens: Option<usize>,
) -> Result<(K3Model, MemoryPlan, StreamOptions)> {
    let cfg = checkpoint.config();
    let table = expert_table(checkpoint).context("cannot locate the routed experts")?;
    let expert_bytes = table.shape.expert_bytes();
    let experts = table.expert_count();
    let mut spine = match checkpoint.layout() {
        Layout::Shards => {
            let mut file_bytes = 0u64;
            for p in checkpoint.shard_paths() {
                file_bytes += std::fs::metadata(p)
                    .with_context(|| format!("cannot stat {}", p.display()))?
                    .len();
            }
            file_bytes.saturating_sub(expert_bytes * experts as u64)
        }
        Layout::StreamInstall => checkpoint.spine_bytes(),
    };
    if engine.spine == SpineFormat::Int8 {
        // The quantized matrices are read from the int8 files instead of the shards.
        for t in quantized_tensors(cfg) {
            let (rows, cols) = (t.shape[0] as u64, t.shape[1] as u64);
            spine = spine.saturating_sub(t.byte_len() as u64) + rows * cols + rows * 2;
        }
    }
    let dims = dims_from_config(cfg, &EngineOptions::default());
    let context_tokens = context_tokens
        .unwrap_or(CONTEXT_RESERVE_TOKENS)
        .min(cfg.text.max_position_embeddings);
    let state = (dims.kda_state_bytes() + context_tokens * dims.mla_cache_bytes_per_token()) as u64;
    // Everything resident after loading: code and libraries (file-backed), the tokenizer,
    // the allocator (anonymous). Spine pages are hardly touched yet and counted above.
    let runtime = proc_memory().map_or(0, |m| m.rss);
    // Prefill activations of a 512-token chunk (≈16 live f32 rows of width D), two rows
    // of logits, one expert buffer that may outlive its eviction while multiplied, and the
    // `lm_head` rows gathered for the provisional next token (`deltafin_k3::next_token`).
    let scratch = (16 * 512 * dims.hidden_size * 4 + 2 * dims.vocab_size * 4) as u64
        + table.max_buffer_bytes()
        + deltafin_k3::next_token::provisional_bytes(
            dims.vocab_size,
            dims.hidden_size,
            engine.spine == SpineFormat::Int8,
        );
    let gb = |b: u64| b as f64 / 1e9;
    // The minimum expert cache: one token's routed experts of one layer.
    let min_cache = cfg.text.num_experts_per_token.max(1) as u64 * table.max_buffer_bytes();
    let per_layer = layer_spine_bytes(cfg, engine.spine);
    let layers = per_layer.len();
    let cap = engine.spine_resident_layers.unwrap_or(layers).min(layers);
    // Resident spine with layers `k..` streamed: their matrices leave, two reusable layer
    // buffers (current + prefetch, page-rounded) come in.
    let with_resident = |k: usize| -> (u64, u64, u64) {
        if k >= layers {
            return (spine, 0, 0);
        }
        let streamed: u64 = per_layer[k..].iter().sum();
        let buffers = 2 * per_layer[k..]
            .iter()
            .map(|b| b + 16 * 4096)
            .max()
            .unwrap_or(0);
        (spine.saturating_sub(streamed), streamed, buffers)
    };
    let fixed = state + runtime + scratch + min_cache;
    let fits = |k: usize| {
        let (resident, _, buffers) = with_resident(k);
        resident + buffers + fixed <= budget
    };
    let Some(resident_layers) = (0..=cap).rev().find(|&k| fits(k)) else {
        let (resident, _, buffers) = with_resident(0);
        bail!(
            "memory budget {:.3} GB is too small even with every spine layer streamed: the resident spine (embedding, lm_head, norms, routers: {:.3} GB), two spine layer buffers ({:.3} GB), the state ({:.3} GB for {context_tokens} tokens), the runtime ({:.3} GB), scratch ({:.3} GB) and the minimum expert cache ({} experts, {:.3} GB) need {:.3} GB",
            gb(budget),
            gb(resident),
            gb(buffers),
            gb(state),
            gb(runtime),
            gb(scratch),
            cfg.text.num_experts_per_token,
            gb(min_cache),
            gb(resident + buffers + fixed)
        );
    };
    let (spine, spine_streamed, spine_buffers) = with_resident(resident_layers);
    let reserved = spine + spine_buffers + state + runtime + scratch;
    let cache = budget.saturating_sub(reserved);
    if pin > 0 && pin + table.max_buffer_bytes() > cache {
        bail!(
            "K3_EXPERT_PIN_GB: a pinned tier of {:.3} GB does not fit the expert cache of {:.3} GB left by the memory budget (at least one expert buffer, {} bytes, must stay unpinned)",
            gb(pin),
            gb(cache),
            table.max_buffer_bytes()
        );
    }
    let opts = stream_options_from_env(cache)?;
    let plan = MemoryPlan {
        budget,
        spine,
        spine_copied: engine.huge_pages.copies(),
        state,
        context_tokens,
        runtime,
        scratch,
        cache,
        pin,
        expert_bytes,
        experts,
        contiguous: table.all_contiguous(),
        spine_resident_layers: resident_layers,
        spine_layers: layers,
        spine_streamed,
        spine_buffers,
    };
    let fetch = match checkpoint.layout() {
        Layout::Shards => None,
        Layout::StreamInstall => {
            let remote = crate::stream_install::remote_experts(checkpoint.root())?;
            // A table of few files opens every file up front: fetch the missing ones first.
            if table.files.len() <= deltafin_experts::stream::MAX_OPEN_FILES {
                for (l, e) in stream_install_missing_experts(checkpoint) {
                    deltafin_fetch::expert::ExpertFetch::fetch_expert(&remote, l, e).with_context(
                        || format!("stream install: fetching expert {e} of layer {l}"),
                    )?;
                }
            }
            Some(remote)
        }
    };
    let src =
        streaming_experts(checkpoint, opts.clone()).context("cannot set up expert streaming")?;
    src.set_pin_tier(&learned.pin_candidates(), pin)
        .context("cannot set up the pinned expert tier")?;
    if learned.mass > 0.0 {
        let d = learned.dims;
        let rates: Vec<((usize, usize), f64)> = (1..=d.layers)
            .flat_map(|l| (0..d.experts).map(move |e| (l, e)))
            .map(|(l, e)| ((l, e), learned.get(l, e) / learned.mass))
            .filter(|(_, r)| *r > 0.0)
            .collect();
        src.seed_heat(&rates, (d.layers * d.top_k) as f64);
    }
    let mut experts = crate::scale4::wrap_experts(checkpoint, Box::new(src), scale4)?;
    if let Some(remote) = fetch {
        experts = Box::new(crate::stream_install::FetchingExperts::new(
            checkpoint.root(),
            Box::new(remote),
            experts,
        ));
    }
    // The huge-page copy runs after loading, with a progress bar (`load_with`, `with_copy_progress`).
    let engine = EngineOptions {
        spine_resident_layers: Some(resident_layers),
        huge_pages: HugePages::Off,
        ..engine.clone()
    };
    let model = load_model_with_experts(checkpoint.clone(), &engine, experts)?;
    Ok((model, plan, opts))
}

/// With the int8 spine requested, fail unless `k3-resident-int8/` exists under `root` (with
/// the message that says how to convert it or to pass `--spine bf16`).
pub fn check_spine(root: &Path, spine: SpineFormat) -> Result<()> {
    if spine == SpineFormat::Int8 && !deltafin_k3::spine_int8::int8_spine_present(root) {
        return Err(deltafin_k3::spine_int8::SpineError::NotConverted {
            dir: deltafin_k3::spine_int8::tensor_dir(root),
            root: root.to_path_buf(),
        }
        .into());
    }
    Ok(())
}

/// Open and validate the install at `root`; without a memory budget every expert stays
/// resident (mmap), with one the routed experts stream from disk. A missing install is
/// reported with what is missing and how to get it.
pub fn load_with(root: &Path, opts: &LoadOptions) -> Result<Session> {
    check_kernels()?;
    let reserve = device_reserve()?;
    let placement = crate::device::select(opts.device, opts.expert_backend)?;
    if let Some(what) = install::missing(root) {
        bail!(
            "no K3 model installed at {}: {what}.\n\
             Run `deltafin setup --model-root {}` to install Kimi K3, or pass --model-root PATH \
             pointing at an install (a synthesized test checkpoint: `cargo xtask synth --preset tiny --out DIR`).",
            root.display(),
            root.display()
        );
    }
    check_spine(root, opts.spine)?;
    let t = Instant::now();
    let (checkpoint, tokenizer) = install::open(root)?;
    let heat_cfg = heat_settings_from_env()?;
    let dims = heat_dims(checkpoint.config());
    let heat_path = root.join(heat::HEAT_FILE);
    let learned = if heat_cfg.enabled {
        let loaded = heat::load(&heat_path, dims);
        if let Some(note) = &loaded.note {
            eprintln!("deltafin: note: {note}");
        }
        loaded.table
    } else {
        HeatTable::empty(dims)
    };
    let candidates = learned.pin_candidates();
    let (spine_cap, spine_stream) = spine_stream_from_env(checkpoint.config().n_layers())?;
    let engine = EngineOptions {
        spine: opts.spine,
        spine_resident_layers: spine_cap,
        spine_stream,
        huge_pages: huge_pages_from_env(placement.spine)?,
        ..EngineOptions::default()
    };
    let (mut model, memory) = match opts.memory_budget {
        None => {
            if heat_cfg.pin_bytes > 0 {
                eprintln!(
                    "deltafin: note: K3_EXPERT_PIN_GB has no effect without a memory budget: every expert is resident"
                );
            }
            let resident = CheckpointExperts::new(checkpoint.clone());
            if engine.huge_pages.copies() && checkpoint.layout() == Layout::Shards {
                copy_experts_if_they_fit(&resident)?;
            }
            let mut experts =
                crate::scale4::wrap_experts(&checkpoint, Box::new(resident), opts.expert_scale4)?;
            if checkpoint.layout() == Layout::StreamInstall {
                experts = Box::new(crate::stream_install::FetchingExperts::new(
                    root,
                    Box::new(crate::stream_install::remote_experts(root)?),
                    experts,
                ));
            }
            let loader = EngineOptions {
                huge_pages: HugePages::Off,
                ..engine.clone()
            };
            let model = load_model_with_experts(checkpoint.clone(), &loader, experts)
                .with_context(|| format!("cannot build the model from {}", root.display()))?;
            (model, None)
        }
        Some(budget) => {
            let (model, plan, _) = plan_and_load(
                &checkpoint,
                budget,
                heat_cfg.pin_bytes,
                &learned,
                opts.expert_scale4,
                &engine,
                opts.context_tokens,
            )
            .with_context(|| format!("cannot build the model from {}", root.display()))?;
            (model, Some(plan))
        }
    };
    eprintln!(
        "[deltafin] layout={} ({} routed experts missing locally{})",
        checkpoint.layout().as_str(),
        stream_install_missing_experts(&checkpoint).len(),
        match checkpoint.layout() {
            Layout::Shards => "",
            Layout::StreamInstall => ", fetched on demand from the hub",
        },
    );
    eprintln!(
        "[deltafin] expert_heat={} ({} passes learned, {} pin candidates) pinned_tier={:.3} GB",
        if heat_cfg.enabled { "on" } else { "off" },
        learned.passes,
        candidates.len(),
        memory.as_ref().map_or(0.0, |m| m.pin as f64 / 1e9),
    );
    if heat_cfg.enabled {
        model
            .route_observers
            .push(Box::new(HeatRecorder::new(heat_path.clone(), dims)));
    }
    if engine.huge_pages.copies() {
        let c = with_copy_progress("resident spine", |p| model.copy_spine_to_huge_pages(p))
            .context("copying the resident spine into huge-page memory")?;
        eprintln!("[deltafin] {}", c.describe());
        model.resident_copy = Some(c);
    }
    install::check_vocab(&tokenizer, &model)?;
    place_on_device(&mut model, &placement, reserve)?;
    Ok(Session {
        model,
        tokenizer,
        checkpoint,
        load_seconds: t.elapsed().as_secs_f64(),
        memory,
        spine: opts.spine,
    })
}

/// With every expert resident (no memory budget), copy the experts into huge-page memory
/// when they take at most half of the memory available now; otherwise they stay mapped
/// from the shards (paged in as used) and a note says why.
fn copy_experts_if_they_fit(experts: &CheckpointExperts) -> Result<()> {
    let need = experts.total_bytes();
    let available = crate::doctor::meminfo().map(|m| m.available);
    match available {
        Some(avail) if need.saturating_mul(2) <= avail => {
            let c = with_copy_progress("routed experts", |p| experts.copy_to_huge_pages(p))
                .context("copying the routed experts into huge-page memory")?;
            eprintln!("[deltafin] {}", c.describe());
        }
        _ => eprintln!(
            "deltafin: note: routed experts stay mapped from the shards: {:.3} GB is more than half of the {} available ({}=off never copies them)",
            need as f64 / 1e9,
            available.map_or("(unknown) memory".into(), |a| format!(
                "{:.3} GB",
                a as f64 / 1e9
            )),
            HugePages::ENV
        ),
    }
    Ok(())
}

/// Run a huge-page copy with a byte progress bar on stderr (hidden when stderr is not a
/// terminal; a K3 spine is tens of GB).
fn with_copy_progress<T>(what: &str, copy: impl FnOnce(&(dyn Fn(u64, u64) + Sync)) -> T) -> T {
    let bar = crate::convert::progress_bar(0);
    bar.set_message(format!("copying the {what} into huge-page memory"));
    let out = copy(&|bytes, total| {
        bar.set_length(total);
        bar.inc(bytes);
    });
    bar.finish_and_clear();
    out
}

/// `DELTAFIN_HUGE_PAGES` (`auto`, the default, or `off`): whether the resident spine is
/// copied into huge-page memory at load (`deltafin_k3::resident`). A spine that goes to a
/// device is not copied: the host copy would only be uploaded and kept.
pub fn huge_pages_from_env(spine_on_device: bool) -> Result<HugePages> {
    let mode = match env_var(HugePages::ENV)? {
        None => HugePages::Auto,
        Some(v) => HugePages::parse(&v)
            .map_err(|e| anyhow!("environment variable {}: {e}", HugePages::ENV))?,
    };
    Ok(if spine_on_device {
        HugePages::Off
    } else {
        mode
    })
}

/// Default of `K3_DEV_RESERVE_GB`: device memory left free for the CUDA context and the
/// per-product activation and result buffers (a prefill of `n` tokens needs `n · width · 4`
/// bytes per product; `lm_head` over every row, as `perplexity` does, `n · vocab · 4`).
pub const DEVICE_RESERVE_GB: f64 = 2.0;

/// `K3_DEV_RESERVE_GB` (GB of device memory kept free, default [`DEVICE_RESERVE_GB`]);
/// a value that is not a finite non-negative number is an error.
pub fn device_reserve() -> Result<u64> {
    match env_var("K3_DEV_RESERVE_GB")? {
        None => Ok((DEVICE_RESERVE_GB * 1e9) as u64),
        Some(v) => match v.trim().parse::<f64>() {
            Ok(gb) if gb.is_finite() && gb >= 0.0 => Ok((gb * 1e9) as u64),
            _ => bail!(
                "environment variable K3_DEV_RESERVE_GB: {v:?} is not a number of GB (>= 0) of device memory to keep free"
            ),
        },
    }
}

/// The device part of [`backend_description`], set once the model is placed.
static DEVICE_LINE: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Put the model on the device `placement` names (nothing for the CPU): the spine while it
/// fits the free device memory minus `reserve`, then a device expert cache in what is left
/// minus `reserve`. Says at startup what went where.
pub fn place_on_device(
    model: &mut K3Model,
    placement: &crate::device::Placement,
    reserve: u64,
) -> Result<()> {
    let gb = |b: u64| b as f64 / 1e9;
    let mut line = "device=cpu".to_string();
    if let Some(dev) = &placement.device {
        line = format!("device={}", dev.describe());
        if placement.spine {
            let free = dev.free_bytes()?;
            let budget = free.saturating_sub(reserve);
            let report = model
                .offload_spine(dev.clone(), budget)
                .context("offloading the spine to the device")?;
            eprintln!(
                "[deltafin] {} (device had {:.3} GB free, {:.3} GB reserved: K3_DEV_RESERVE_GB)",
                report.describe(),
                gb(free),
                gb(reserve)
            );
            line += &format!(
                " spine={}/{} matrices",
                report.on_device.len(),
                report.on_device.len() + report.on_cpu.len()
            );
        }
        if placement.experts {
            let free = dev.free_bytes()?;
            let budget = free.saturating_sub(reserve);
            let cache = Arc::new(deltafin_k3::offload::DeviceExpertCache::new(
                dev.clone(),
                budget,
            ));
            eprintln!(
                "[deltafin] routed experts on {}: device expert cache {:.3} GB (LRU; experts are read on the host as before and uploaded on a miss)",
                dev.describe(),
                gb(budget)
            );
            line += &format!(" expert_cache={:.3}GB", gb(budget));
            model.set_device_experts(cache);
        }
    }
    *DEVICE_LINE.lock().unwrap_or_else(|p| p.into_inner()) = Some(line);
    Ok(())
}

/// The router trace asked for by `--router-trace PATH` / `--router-trace-mode M`, else
/// `K3_TRACE_PATH` / `K3_TRACE` (`off`, `buffered`, `sync`; all parsed strictly): a path
/// alone means `buffered`, a path with `off` or a mode without a path is an error. A relative
/// path is under the model root.
pub fn resolve_router_trace(
    flag_path: Option<&Path>,
    flag_mode: Option<&str>,
    root: &Path,
) -> Result<Option<(std::path::PathBuf, TraceMode)>> {
    let parse = |v: &str| match v {
        "off" => Ok(None),
        "buffered" => Ok(Some(TraceMode::Buffered)),
        "sync" => Ok(Some(TraceMode::Sync)),
        _ => Err(format!("{v:?} is not off, buffered or sync")),
    };
    let env_mode = env_var("K3_TRACE")?
        .map(|v| parse(&v).map_err(|e| anyhow!("environment variable K3_TRACE: {e}")))
        .transpose()?;
    let env_path = env_var("K3_TRACE_PATH")?;
    if env_path.as_deref() == Some("") {
        bail!("environment variable K3_TRACE_PATH is empty");
    }
    let flag_mode = flag_mode
        .map(|v| parse(v).map_err(|e| anyhow!("--router-trace-mode: {e}")))
        .transpose()?;
    let mode = flag_mode.or(env_mode);
    let path = flag_path
        .map(Path::to_path_buf)
        .or(env_path.map(std::path::PathBuf::from));
    match (path, mode) {
        (None, None | Some(None)) => Ok(None),
        (None, Some(Some(m))) => bail!(
            "router trace mode {} needs a path: --router-trace PATH or K3_TRACE_PATH",
            m.name()
        ),
        (Some(p), Some(None)) => bail!(
            "router trace path {} given with mode off: drop the path or choose buffered or sync",
            p.display()
        ),
        (Some(p), m) => Ok(Some((
            root.join(p),
            m.flatten().unwrap_or(TraceMode::Buffered),
        ))),
    }
}

/// Append every pass's routes to `path` (§4.9) from now on.
pub fn attach_router_trace(model: &mut K3Model, path: &Path, mode: TraceMode) -> Result<()> {
    let t = RouterTrace::create_with_mode(path, mode)
        .with_context(|| format!("router trace: cannot open {}", path.display()))?;
    model.route_observers.push(Box::new(t));
    Ok(())
}

/// With a memory plan, say at startup how the budget is split and how experts are read.
pub fn report_memory_plan(model: &K3Model, plan: Option<&MemoryPlan>) {
    if let Some(s) = &model.spine_stream {
        eprintln!("[deltafin] {}", s.split().describe());
    }
    let Some(plan) = plan else { return };
    let (io, threads) = model
        .experts
        .stats()
        .map(|s| (s.io_path, s.read_threads))
        .unwrap_or_default();
    let pilot = env_var("K3_PILOT_GATE")
        .ok()
        .flatten()
        .unwrap_or_else(|| "off".into());
    eprintln!("[deltafin] {}", plan.describe(&io, threads, &pilot));
}

/// The expert-streaming summary (stderr): cache hits, prefetch recall, bytes read, achieved
/// GB/s, per-layer hit rates and recall, and the process memory (`/proc/self/status`:
/// peak RSS = anonymous + file-backed + shmem pages).
pub fn report_expert_stats(model: &K3Model) {
    if let Some(c) = &model.device_experts {
        eprintln!("[stats] {}", c.stats().describe(c.budget()));
    }
    if let Some(s) = &model.spine_stream {
        let st = s.stats();
        eprintln!(
            "[stats] spine streamed_layers={} passes={} layer_reads={} bytes_read={} read_s={:.3} read_gbps={:.3} wait_s={:.3}",
            s.split().layers - s.split().resident,
            st.passes,
            st.layer_reads,
            st.bytes_read,
            st.read_seconds,
            st.read_gbps(),
            st.wait_seconds
        );
    }
    if let Some(st) = model.experts.stats() {
        eprintln!("[stats] experts {}", st.summary_line());
        eprintln!(
            "[stats] experts hit% by layer: {}",
            st.per_layer_hit_rates()
        );
        eprintln!(
            "[stats] experts recall% by layer: {}",
            st.per_layer_recall()
        );
        eprintln!(
            "[stats] experts PILOT precision% by rank (decode; decayed, off = gated): {}",
            st.per_rank_precision()
        );
        match model.provisional_head() {
            Some(Ok(h)) => {
                let (right, judged) = model.provisional_accuracy();
                eprintln!(
                    "[stats] experts PILOT next token (guessed from {} lm_head rows before lm_head): right {right} of {judged} ({:.1}%)",
                    h.len(),
                    100.0 * right as f64 / judged.max(1) as f64
                );
            }
            Some(Err(e)) => eprintln!("[stats] experts PILOT next token: off ({e})"),
            None => {}
        }
    }
    if let Some(c) = &model.resident_copy {
        eprintln!("[stats] {}", c.describe());
    }
    if let Some(m) = proc_memory() {
        eprintln!(
            "[stats] memory peak_rss={} rss={} rss_anon={} rss_file={} anon_huge_pages={}",
            m.peak_rss, m.rss, m.rss_anon, m.rss_file, m.anon_huge
        );
    }
}

/// A flag raised by the first Ctrl-C; a second Ctrl-C exits at once with status 130.
pub fn interrupt_flag() -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let f = flag.clone();
    let installed = ctrlc::set_handler(move || {
        if f.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!(
            "\ndeltafin: interrupt received, stopping after the current token (Ctrl-C again to quit now)"
        );
    });
    if let Err(e) = installed {
        eprintln!("deltafin: warning: Ctrl-C handler not installed: {e}");
    }
    flag
}

/// Value of environment variable `name`, if set; a non-UTF-8 value is an error.
pub fn env_var(name: &str) -> Result<Option<String>> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            bail!("environment variable {name} is not valid UTF-8")
        }
    }
}

/// Install the kernel settings from the environment now (each parsed strictly), so a bad
/// value is a clear startup error rather than a failure at the first product.
pub fn check_kernels() -> Result<()> {
    crate::kernel_env::install().map_err(|e| anyhow::anyhow!("{e}"))
}

/// The compute backend line shared by the startup echo and the events file.
pub fn backend_description() -> String {
    let device = DEVICE_LINE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .unwrap_or_else(|| "device=cpu".into());
    format!(
        "{device} threads={} kernels={} {}",
        rayon::current_num_threads(),
        deltafin_kernels::kernel_backend(),
        deltafin_kernels::pool_settings(),
    )
}
