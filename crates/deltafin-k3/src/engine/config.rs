//! [`EngineConfig`]: everything the engine builder is asked for, typed. Nothing here reads
//! the environment; the `deltafin` CLI maps its flags and variables onto these fields.

use crate::engine::placement::{DeviceRequest, ExpertBackendRequest};
use crate::weights::resident::HugePages;
use crate::weights::spine_stream::SpineStreamOptions;
use deltafin_experts::{StreamOptions, TraceMode};
use deltafin_store::spine_int8::SpineFormat;
use std::path::PathBuf;

pub use crate::engine::plan::CONTEXT_RESERVE_TOKENS;

/// Default RAM for prefix states (1 GB): about one K3 state of a few thousand tokens.
pub const STATE_CACHE_RAM: u64 = 1_000_000_000;

/// Default device memory left free for the CUDA context and the per-product activation and
/// result buffers, in decimal GB (a prefill of `n` tokens needs `n · width · 4` bytes per
/// product; `lm_head` over every row, as scoring does, `n · vocab · 4`).
pub const DEVICE_RESERVE_GB: f64 = 2.0;

/// Where routed experts take their E8M0 scales from (the lossless 4-bit sidecars of
/// `deltafin convert-experts-scale4`, or the raw scales).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Scale4Mode {
    /// Sidecars when complete and valid, else the raw scales.
    #[default]
    Auto,
    /// Never.
    Off,
    /// Sidecars, or an error.
    Require,
}

impl Scale4Mode {
    /// Parse `auto`, `off` or `require`.
    pub fn parse(v: &str) -> Result<Scale4Mode, String> {
        match v {
            "auto" => Ok(Scale4Mode::Auto),
            "off" => Ok(Scale4Mode::Off),
            "require" => Ok(Scale4Mode::Require),
            _ => Err(format!("{v:?} is not auto, off or require")),
        }
    }
}

/// The learned expert cache: whether the persistent route histogram (`k3-meta/`
/// `expert_heat.v1.bin`) is read and updated, and the pinned tier inside the expert cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeatSettings {
    /// Read the histogram at load (it seeds the cache and the pinned tier) and record every
    /// pass into it.
    pub enabled: bool,
    /// Bytes of the expert cache given to the pinned tier (0: none).
    pub pin_bytes: u64,
}

/// A router trace: every pass's routes appended to `path` (JSONL).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouterTraceRequest {
    /// The file (created 0600, appended to).
    pub path: PathBuf,
    /// Buffered (a whole pass at a time) or sync (flush every line).
    pub mode: TraceMode,
}

/// How the engine is loaded. [`EngineConfig::default`] is the library's plain load: every
/// expert resident through the shard mmaps, the weight-exact bf16 spine, the CPU, no scale4
/// sidecars, no route histogram, the resident spine copied into huge-page memory where the
/// system grants them.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Whole-process RAM budget in bytes; `None` keeps every expert resident (mmap). With a
    /// budget the routed experts stream from disk into an expert cache of what the spine,
    /// the state, the runtime and scratch leave ([`crate::engine::plan`]).
    pub memory_budget: Option<u64>,
    /// The spine format (int8 needs `k3-resident-int8/`).
    pub spine: SpineFormat,
    /// The compute device asked for.
    pub device: DeviceRequest,
    /// Where routed-expert products run.
    pub expert_backend: ExpertBackendRequest,
    /// Device memory kept free when placing weights on a device, in bytes.
    pub device_reserve: u64,
    /// Scale4 sidecars.
    pub scale4: Scale4Mode,
    /// The most tokens of context the caller will ever hold, when it knows it; the memory
    /// budget then reserves state for that many tokens instead of
    /// [`CONTEXT_RESERVE_TOKENS`].
    pub context_tokens: Option<usize>,
    /// Generations that will run together (a server's `--parallel`; 1 for one run): under a
    /// memory budget the plan reserves, for each beyond the first, a KDA state and
    /// [`crate::engine::plan::SIDE_CONTEXT_TOKENS`] positions, as far as the expert cache can
    /// spare them ([`crate::engine::MemoryPlan::sequences`]).
    pub sequences: usize,
    /// Expert streaming under a budget: read threads, O_DIRECT policy, PILOT gate (the
    /// cache size is the plan's, whatever `cache_bytes` says here).
    pub stream: StreamOptions,
    /// Expert homes (docs/K3.md §12.11): directories on other drives holding verified copies
    /// of routed experts, read instead of the model root's files when experts stream.
    pub expert_homes: Vec<std::path::PathBuf>,
    /// At most this many spine layers resident (the rest streamed per pass); `None`: as the
    /// memory budget allows (all of them without a budget).
    pub spine_resident_layers: Option<usize>,
    /// Reader threads and O_DIRECT policy of spine streaming.
    pub spine_stream: SpineStreamOptions,
    /// The learned expert cache.
    pub heat: HeatSettings,
    /// A router trace, if any.
    pub router_trace: Option<RouterTraceRequest>,
    /// Whether resident weights are copied into huge-page memory (never for a spine that
    /// goes to a device).
    pub huge_pages: HugePages,
    /// Without a budget and with huge pages on: also copy the routed experts into huge-page
    /// memory when they take at most half of the memory available (else they stay mapped,
    /// and a note says why).
    pub copy_resident_experts: bool,
    /// Bytes of RAM for prefix states ([`crate::prefix::PrefixCache`]'s RAM tier); under a
    /// memory budget the plan gives the tier this much, at most an eighth of the budget and
    /// never the expert cache's minimum ([`crate::engine::MemoryPlan::state_cache`]).
    pub state_cache_ram: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            memory_budget: None,
            spine: SpineFormat::Bf16,
            device: DeviceRequest::Cpu,
            expert_backend: ExpertBackendRequest::Cpu,
            device_reserve: (DEVICE_RESERVE_GB * 1e9) as u64,
            scale4: Scale4Mode::Off,
            context_tokens: None,
            sequences: 1,
            stream: StreamOptions::with_cache_bytes(0),
            expert_homes: Vec::new(),
            spine_resident_layers: None,
            spine_stream: SpineStreamOptions::default(),
            heat: HeatSettings {
                enabled: false,
                pin_bytes: 0,
            },
            router_trace: None,
            huge_pages: HugePages::Auto,
            copy_resident_experts: false,
            state_cache_ram: STATE_CACHE_RAM,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale4_mode_parsing_is_strict() {
        assert_eq!(Scale4Mode::parse("auto"), Ok(Scale4Mode::Auto));
        assert_eq!(Scale4Mode::parse("off"), Ok(Scale4Mode::Off));
        assert_eq!(Scale4Mode::parse("require"), Ok(Scale4Mode::Require));
        for bad in ["", "on", "AUTO", "1"] {
            assert!(Scale4Mode::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_default_is_the_plain_library_load() {
        let c = EngineConfig::default();
        assert_eq!(c.memory_budget, None);
        assert_eq!(c.spine, SpineFormat::Bf16);
        assert_eq!(c.scale4, Scale4Mode::Off);
        assert!(!c.heat.enabled && !c.copy_resident_experts);
        assert_eq!(c.device_reserve, 2_000_000_000);
    }
}
