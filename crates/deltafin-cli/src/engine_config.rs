//! Flags and environment variables → [`EngineConfig`]: the one mapping every model command
//! (`run`, `serve`, `perplexity`) loads through. Every value is parsed strictly; a bad one is
//! an error naming the flag or the variable.

use crate::ModelArgs;
use crate::device::{resolve_device, resolve_expert_backend};
use crate::env::{env_choice, env_var, parse_gb};
use anyhow::{Result, anyhow, bail};
use deltafin_experts::stream::PILOT_BREAK_EVEN_PRECISION;
use deltafin_experts::{DirectIo, PilotGate, StreamOptions, TraceMode};
use deltafin_k3::config::K3Config;
use deltafin_k3::engine::{
    DEVICE_RESERVE_GB, EngineConfig, HeatSettings, RouterTraceRequest, Scale4Mode,
};
use deltafin_k3::weights::checkpoint::CONFIG_FILE;
use deltafin_k3::weights::resident::HugePages;
use deltafin_k3::weights::spine_int8::{SpineChoice, SpineFormat};
use deltafin_k3::weights::spine_stream::SpineStreamOptions;
use std::path::{Path, PathBuf};

/// The engine configuration of the model flags `model` (and their environment variables),
/// with `router_trace` and `context_tokens` as the command resolved them.
pub fn engine_config(
    model: &ModelArgs,
    router_trace: Option<RouterTraceRequest>,
    context_tokens: Option<usize>,
) -> Result<EngineConfig> {
    // The original's legacy quality guards, against the model's own routed experts per token
    // (without a readable config the engine reports the missing install first).
    let top_k = K3Config::from_file(model.root().join(CONFIG_FILE))
        .ok()
        .map(|c| c.text.num_experts_per_token);
    crate::environment::check_legacy_guards(top_k)?;
    let memory_budget = resolve_memory_budget(model.memory_budget_gb.as_deref())?;
    let device = resolve_device(model.device.as_deref())?;
    let expert_backend = resolve_expert_backend(model.expert_backend.as_deref())?;
    let scale4 = scale4_from_env()?;
    let spine = resolve_spine(model.spine.as_deref())?;
    let device_reserve = device_reserve()?;
    let heat = heat_settings_from_env()?;
    let (spine_resident_layers, spine_stream) =
        spine_stream_settings(&model.root(), model.spine_read_threads)?;
    let huge_pages = huge_pages_from_env()?;
    // The streaming variables are parsed always (a bad or non-UTF-8 value is an error even
    // without a budget) and used only when experts stream.
    let streamed = stream_options_from_env()?;
    let stream = match memory_budget {
        Some(_) => streamed,
        None => StreamOptions::with_cache_bytes(0),
    };
    let states = state_cache_settings(model)?;
    let expert_homes = resolve_expert_homes(model.expert_homes.as_deref())?;
    Ok(EngineConfig {
        expert_homes,
        state_cache_ram: if states.enabled { states.ram_bytes } else { 0 },
        memory_budget,
        spine,
        device,
        expert_backend,
        device_reserve,
        scale4,
        context_tokens,
        // One generation; `serve` sets its own count.
        sequences: 1,
        stream,
        spine_resident_layers,
        spine_stream,
        heat,
        router_trace,
        huge_pages,
        copy_resident_experts: true,
    })
}

/// The expert homes from `--expert-homes`, else `K3_EXPERT_HOMES`, else none: a
/// comma-separated list of directories (an empty value is none; an empty entry in a list is
/// an error).
pub fn resolve_expert_homes(flag: Option<&str>) -> Result<Vec<PathBuf>> {
    let (value, name) = match flag {
        Some(v) => (Some(v.to_string()), "--expert-homes"),
        None => (env_var("K3_EXPERT_HOMES")?, "K3_EXPERT_HOMES"),
    };
    match value {
        // Empty: no homes (an arm of `benchmark` can turn them off this way).
        Some(v) if v.trim().is_empty() => Ok(Vec::new()),
        None => Ok(Vec::new()),
        Some(v) => parse_dir_list(&v).map_err(|e| anyhow!("{name}: {e}")),
    }
}

/// `DIR[,DIR…]` → the directories; an empty entry is an error.
pub fn parse_dir_list(v: &str) -> std::result::Result<Vec<PathBuf>, String> {
    v.split(',')
        .map(|d| {
            let d = d.trim();
            if d.is_empty() {
                Err(format!("{v:?} has an empty entry (DIR[,DIR…])"))
            } else {
                Ok(PathBuf::from(d))
            }
        })
        .collect()
}

/// The prefix-state cache of a command (`--state-cache`, `K3_STATE_CACHE`,
/// `K3_STATE_CACHE_RAM_GB`, `K3_STATE_CACHE_DISK_GB`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateCacheSettings {
    pub enabled: bool,
    /// The RAM tier (reserved in a memory budget's plan).
    pub ram_bytes: u64,
    /// The disk tier under `k3-meta/state-cache/` (0: none).
    pub disk_bytes: u64,
}

/// Default disk tier (decimal GB).
pub const STATE_CACHE_DISK_GB: u64 = 16;

/// [`StateCacheSettings`] from `--state-cache` (else `K3_STATE_CACHE`, else on) and the two
/// size variables (decimal GB ≥ 0; 0 turns a tier off), all parsed strictly.
pub fn state_cache_settings(model: &ModelArgs) -> Result<StateCacheSettings> {
    let on_off = |v: &str| match v {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{v:?} is not on or off")),
    };
    let enabled = match model.state_cache.as_deref() {
        Some(v) => on_off(v).map_err(|e| anyhow!("--state-cache: {e}"))?,
        None => env_choice("K3_STATE_CACHE", true, on_off)?,
    };
    let size_bytes = |name: &str, default: u64| {
        env_choice(name, default, |v| match v.trim() {
            "0" => Ok(0),
            v => parse_gb(v).map_err(|e| format!("{e} (0 turns the tier off)")),
        })
    };
    let size = |name: &str, default_gb: u64| size_bytes(name, default_gb * 1_000_000_000);
    Ok(StateCacheSettings {
        enabled,
        ram_bytes: size_bytes(
            "K3_STATE_CACHE_RAM_GB",
            deltafin_k3::engine::config::STATE_CACHE_RAM,
        )?,
        disk_bytes: size("K3_STATE_CACHE_DISK_GB", STATE_CACHE_DISK_GB)?,
    })
}

/// The spine from `--spine`, else `K3_SPINE`, else `auto` (= int8). Both are parsed
/// strictly; `mixed` is rejected with its reason.
pub fn resolve_spine(flag: Option<&str>) -> Result<SpineFormat> {
    Ok(resolve_spine_choice(flag)?.0.format())
}

/// [`resolve_spine`]'s choice, and where it came from in the operator's words
/// (`--spine int8`, `K3_SPINE=bf16`, `the default --spine auto`).
pub fn resolve_spine_choice(flag: Option<&str>) -> Result<(SpineChoice, String)> {
    let env = env_var("K3_SPINE")?;
    let env_choice = env
        .as_deref()
        .map(|v| {
            v.parse::<SpineChoice>()
                .map_err(|e| anyhow!("environment variable K3_SPINE: {e}"))
        })
        .transpose()?;
    Ok(match (flag, env_choice) {
        (Some(f), _) => (
            f.parse::<SpineChoice>()
                .map_err(|e| anyhow!("--spine: {e}"))?,
            format!("--spine {f}"),
        ),
        (None, Some(c)) => (c, format!("K3_SPINE={}", env.unwrap_or_default())),
        (None, None) => (SpineChoice::default(), "the default --spine auto".into()),
    })
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

/// `K3_EXPERT_SCALE4` (`auto`, the default, `off` or `require`), strictly.
pub fn scale4_from_env() -> Result<Scale4Mode> {
    env_choice("K3_EXPERT_SCALE4", Scale4Mode::Auto, Scale4Mode::parse)
}

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

/// Streaming options from `K3_EXPERT_READ_THREADS` (reads in flight per drive: `auto` or
/// 1…16, default `auto` = [`deltafin_experts::stream::DEFAULT_READ_DEPTH`], measured),
/// `K3_EXPERT_STREAM_NOCACHE` (`auto`/`1`: O_DIRECT where allowed, `0`: page cache),
/// `K3_PILOT_GATE` (`off`, `measure`, `on`, `ranked`), `K3_PILOT_GATE_THRESHOLD` ([0, 1),
/// 0.10), `K3_PILOT_GATE_WARMUP` (1…100000, 16), `K3_PILOT_RANK_PRECISION` ([0, 1], 0.5: the
/// break-even) and `K3_PILOT_MAX_GUESSES` (0…4096, 0 = no cap), all parsed strictly. The
/// cache size is the memory plan's.
pub fn stream_options_from_env() -> Result<StreamOptions> {
    let base = StreamOptions::with_cache_bytes(0);
    let read_threads = env_choice("K3_EXPERT_READ_THREADS", base.read_threads, |v| {
        parse_read_depth(v)
    })?;
    let direct_io = direct_io_env("K3_EXPERT_STREAM_NOCACHE")?;
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
        cache_bytes: 0,
        read_threads,
        direct_io,
        pilot,
    })
}

/// An expert read depth per drive: `auto` (the measured default) or an integer 1…16.
pub fn parse_read_depth(v: &str) -> std::result::Result<usize, String> {
    use deltafin_experts::stream::{DEFAULT_READ_DEPTH, MAX_READ_DEPTH};
    if v == "auto" {
        return Ok(DEFAULT_READ_DEPTH);
    }
    v.parse::<usize>()
        .ok()
        .filter(|n| (1..=MAX_READ_DEPTH).contains(n))
        .ok_or_else(|| format!("{v:?} is not auto or an integer in 1…{MAX_READ_DEPTH}"))
}

/// Reader threads from the variable `name` (an integer 1…16), else `default`.
fn read_threads_env(name: &str, default: usize) -> Result<usize> {
    env_choice(name, default, |v| {
        v.parse::<usize>()
            .ok()
            .filter(|n| (1..=16).contains(n))
            .ok_or_else(|| format!("{v:?} is not an integer in 1…16"))
    })
}

/// The O_DIRECT policy from the variable `name`: `auto`/`1` (where allowed, the default) or
/// `0` (the page cache).
fn direct_io_env(name: &str) -> Result<DirectIo> {
    env_choice(name, DirectIo::Auto, |v| match v {
        "auto" | "1" => Ok(DirectIo::Auto),
        "0" => Ok(DirectIo::Off),
        _ => Err(format!("{v:?} is not auto, 0 or 1")),
    })
}

/// The learned expert-cache settings: `K3_EXPERT_HEAT` (`on`/`off`, default on: record the
/// persistent route histogram, §4.8) and `K3_EXPERT_PIN_GB` (decimal GB ≥ 0, default 0: the
/// pinned tier inside the expert cache). Both parsed strictly.
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

/// Spine streaming settings from `K3_PROVIDER_RESIDENT_LAYERS` (0…layers of the config
/// under `root`: at most this many resident layers; unset: as the memory budget allows),
/// `--spine-read-threads` (`read_threads_flag`, else `K3_SPINE_READ_THREADS`: 1…16, default
/// 4) and `K3_SPINE_STREAM_NOCACHE` (`auto`/`1`: O_DIRECT where allowed, `0`: page cache), all
/// parsed strictly (the variable too when the flag wins).
pub fn spine_stream_settings(
    root: &Path,
    read_threads_flag: Option<u64>,
) -> Result<(Option<usize>, SpineStreamOptions)> {
    let cap = match env_var("K3_PROVIDER_RESIDENT_LAYERS")? {
        None => None,
        Some(v) => {
            // The bound is the model's layer count; without a readable config the engine
            // reports the missing install first.
            let layers =
                K3Config::from_file(root.join(CONFIG_FILE)).map_or(usize::MAX, |c| c.n_layers());
            let bound = if layers == usize::MAX {
                "the model's layer count".to_string()
            } else {
                layers.to_string()
            };
            Some(
                v.parse::<usize>()
                    .ok()
                    .filter(|n| *n <= layers)
                    .ok_or_else(|| {
                        anyhow!(
                            "environment variable K3_PROVIDER_RESIDENT_LAYERS: {v:?} is not an integer in 0…{bound}"
                        )
                    })?,
            )
        }
    };
    let base = SpineStreamOptions::default();
    let from_env = read_threads_env("K3_SPINE_READ_THREADS", base.read_threads)?;
    // clap bounds the flag to 1…16.
    let read_threads = read_threads_flag.map_or(from_env, |n| n as usize);
    let direct_io = direct_io_env("K3_SPINE_STREAM_NOCACHE")?;
    Ok((
        cap,
        SpineStreamOptions {
            read_threads,
            direct_io,
        },
    ))
}

/// `DELTAFIN_HUGE_PAGES` (`auto`, the default, or `off`): whether resident weights are
/// copied into huge-page memory at load (never a spine that goes to a device).
pub fn huge_pages_from_env() -> Result<HugePages> {
    match env_var(HugePages::ENV)? {
        None => Ok(HugePages::Auto),
        Some(v) => HugePages::parse(&v)
            .map_err(|e| anyhow!("environment variable {}: {e}", HugePages::ENV)),
    }
}

/// The router trace asked for by `--router-trace PATH` / `--router-trace-mode M`, else
/// `K3_TRACE_PATH` / `K3_TRACE` (`off`, `buffered`, `sync`; all parsed strictly): a path
/// alone means `buffered`, a path with `off` or a mode without a path is an error. A relative
/// path is under the model root.
pub fn resolve_router_trace(
    flag_path: Option<&Path>,
    flag_mode: Option<&str>,
    root: &Path,
) -> Result<Option<RouterTraceRequest>> {
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
        .or(env_path.map(PathBuf::from));
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
        (Some(p), m) => Ok(Some(RouterTraceRequest {
            path: root.join(p),
            mode: m.flatten().unwrap_or(TraceMode::Buffered),
        })),
    }
}

#[cfg(test)]
mod read_depth_tests {
    use super::parse_read_depth;
    use deltafin_experts::stream::DEFAULT_READ_DEPTH;

    #[test]
    fn read_depth_is_auto_or_one_to_sixteen() {
        assert_eq!(parse_read_depth("auto"), Ok(DEFAULT_READ_DEPTH));
        assert_eq!(parse_read_depth("1"), Ok(1));
        assert_eq!(parse_read_depth("16"), Ok(16));
        for bad in ["0", "17", "", "eight", "-1", "Auto"] {
            assert!(parse_read_depth(bad).is_err(), "{bad:?}");
        }
    }
}
