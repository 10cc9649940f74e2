//! The memory planner: how a whole-process RAM budget is split between the spine, the
//! state, the runtime, scratch and the expert cache, and how many spine layers stay
//! resident. [`plan_memory`] is a pure function of sizes; [`PlanInputs::for_model`] derives
//! the model's sizes from its config, also without I/O. The engine builder measures what
//! only the running process and the files know (stored spine bytes, the process RSS, the
//! expert table) and passes them in.

use crate::weights::loader::{EngineOptions, dims_from_config};
use deltafin_store::config::K3Config;
use deltafin_store::spine_int8::{SpineFormat, quantized_tensors};

/// Tokens of KV/state reserved inside a memory budget (capped by the model context) when the
/// caller does not know how long its context can grow (a server, an open-ended run).
pub const CONTEXT_RESERVE_TOKENS: usize = 32_768;

/// Positions of MLA cache the plan reserves, beside a KDA state, for each generation that
/// runs beside the first ([`PlanInputs::sequences`]): room for a side request (a title, a
/// summary, a sub-agent's short turn) while a main turn holds the whole reserved context.
pub const SIDE_CONTEXT_TOKENS: usize = 8_192;

/// Everything [`plan_memory`] needs, in bytes unless said otherwise.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanInputs {
    /// The whole-process budget.
    pub budget: u64,
    /// The resident spine in the chosen format with every layer resident (embedding,
    /// `lm_head`, norms, routers and every layer's projections).
    pub spine: u64,
    /// Matrix bytes of each layer's spine projections in the chosen format (what streaming
    /// that layer reads per pass).
    pub layer_spine: Vec<u64>,
    /// At most this many resident spine layers (`None`: as the budget allows).
    pub resident_layers_cap: Option<usize>,
    /// The KDA recurrent state (independent of the context).
    pub kda_state: u64,
    /// MLA cache bytes per token of context.
    pub mla_cache_per_token: u64,
    /// Tokens of context to reserve state for (already capped by the model's context).
    pub context_tokens: usize,
    /// Generations that may run together (a server's `--parallel`; 1 for one run): beyond
    /// the first, the plan reserves a KDA state and [`SIDE_CONTEXT_TOKENS`] positions of MLA
    /// cache for each that the expert cache can spare ([`MemoryPlan::sequences`]).
    pub sequences: usize,
    /// Process memory after loading (code, libraries, tokenizer, allocator).
    pub runtime: u64,
    /// Activation scratch and the one expert buffer that may be multiplied while evicted.
    pub scratch: u64,
    /// The RAM tier of the prefix-state cache asked for (`crate::prefix`; 0: none); the plan
    /// gives it at most an eighth of the budget and what the expert cache can spare.
    pub state_cache: u64,
    /// Payload bytes of one expert.
    pub expert_bytes: u64,
    /// Bytes of one expert cache buffer (payload plus alignment).
    pub expert_buffer: u64,
    /// Experts over all MoE layers.
    pub experts: usize,
    /// Routed experts per token (the minimum cache holds one token's experts of a layer).
    pub experts_per_token: usize,
    /// The pinned tier asked for (0: none).
    pub pin: u64,
    /// Whether every expert's six tensors are gap-free in its file.
    pub contiguous: bool,
    /// Whether the resident spine is copied into huge-page memory at load.
    pub spine_copied: bool,
}

/// The split of a memory budget (bytes).
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    pub budget: u64,
    /// The resident spine (copied into huge-page memory at load when `spine_copied`, else
    /// mmap'd and resident as it is touched).
    pub spine: u64,
    /// Whether the resident spine is copied into huge-page memory.
    pub spine_copied: bool,
    /// A KDA state per sequence plus the MLA cache for `context_tokens` and, for each
    /// sequence beyond the first, [`SIDE_CONTEXT_TOKENS`] more (at most `context_tokens`).
    pub state: u64,
    pub context_tokens: usize,
    /// Sequences `state` is reserved for: the ones asked for ([`PlanInputs::sequences`]) as
    /// far as the expert cache can spare their states beyond its minimum, at least 1. Their
    /// contexts together share the reserved positions (admission counts each request's
    /// prompt and `max_tokens`).
    pub sequences: usize,
    /// Process memory after loading (RSS: code, libraries, tokenizer, allocator).
    pub runtime: u64,
    /// Activation scratch and the one expert that may be multiplied while evicted.
    pub scratch: u64,
    /// The RAM tier of the prefix-state cache.
    pub state_cache: u64,
    /// What is left: the expert cache.
    pub cache: u64,
    /// Of the cache, the pinned tier.
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

/// Why a budget cannot be planned.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// Even with every spine layer streamed, the fixed parts and the minimum expert cache
    /// exceed the budget.
    #[error(
        "memory budget {:.3} GB is too small even with every spine layer streamed: the resident spine (embedding, lm_head, norms, routers: {:.3} GB), two spine layer buffers ({:.3} GB), the state ({:.3} GB for {context_tokens} tokens), the runtime ({:.3} GB), scratch ({:.3} GB) and the minimum expert cache ({experts_per_token} experts, {:.3} GB) need {:.3} GB",
        gb(*budget), gb(*resident), gb(*buffers), gb(*state), gb(*runtime), gb(*scratch), gb(*min_cache), gb(*need)
    )]
    TooSmall {
        budget: u64,
        resident: u64,
        buffers: u64,
        state: u64,
        context_tokens: usize,
        runtime: u64,
        scratch: u64,
        experts_per_token: usize,
        min_cache: u64,
        need: u64,
    },
    /// The pinned tier leaves no unpinned expert buffer in the cache.
    #[error(
        "K3_EXPERT_PIN_GB: a pinned tier of {:.3} GB does not fit the expert cache of {:.3} GB left by the memory budget (at least one expert buffer, {buffer} bytes, must stay unpinned)",
        gb(*pin), gb(*cache)
    )]
    PinTooLarge { pin: u64, cache: u64, buffer: u64 },
}

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

/// The prefix-state RAM tier takes at most `1 / STATE_CACHE_SHARE` of a budget.
pub const STATE_CACHE_SHARE: u64 = 8;

/// Bytes of a page-aligned slack added to each spine layer buffer.
const LAYER_BUFFER_SLACK: u64 = 16 * 4096;

/// Split `i.budget`: keep as many spine layers resident as fit (at most the cap) with the
/// state, runtime, scratch and a minimum expert cache (one token's routed experts of one
/// layer); the rest is the expert cache, of which `i.pin` is the pinned tier.
pub fn plan_memory(i: &PlanInputs) -> Result<MemoryPlan, PlanError> {
    let state = i.kda_state + i.context_tokens as u64 * i.mla_cache_per_token;
    let min_cache = i.experts_per_token.max(1) as u64 * i.expert_buffer;
    let layers = i.layer_spine.len();
    let cap = i.resident_layers_cap.unwrap_or(layers).min(layers);
    // Resident spine with layers `k..` streamed: their matrices leave, two reusable layer
    // buffers (current + prefetch, page-rounded) come in.
    let with_resident = |k: usize| -> (u64, u64, u64) {
        if k >= layers {
            return (i.spine, 0, 0);
        }
        let streamed: u64 = i.layer_spine[k..].iter().sum();
        let buffers = 2 * i.layer_spine[k..]
            .iter()
            .map(|b| b + LAYER_BUFFER_SLACK)
            .max()
            .unwrap_or(0);
        (i.spine.saturating_sub(streamed), streamed, buffers)
    };
    let fixed = state + i.runtime + i.scratch + min_cache;
    let fits = |k: usize| {
        let (resident, _, buffers) = with_resident(k);
        resident + buffers + fixed <= i.budget
    };
    let Some(resident_layers) = (0..=cap).rev().find(|&k| fits(k)) else {
        let (resident, _, buffers) = with_resident(0);
        return Err(PlanError::TooSmall {
            budget: i.budget,
            resident,
            buffers,
            state,
            context_tokens: i.context_tokens,
            runtime: i.runtime,
            scratch: i.scratch,
            experts_per_token: i.experts_per_token,
            min_cache,
            need: resident + buffers + fixed,
        });
    };
    let (spine, spine_streamed, spine_buffers) = with_resident(resident_layers);
    let reserved = spine + spine_buffers + state + i.runtime + i.scratch;
    let mut room = i.budget.saturating_sub(reserved);
    let keep = min_cache.max(i.pin + i.expert_buffer);
    // More sequences: a KDA state and a side context each, from the expert cache, as far as
    // it stays above its minimum (never making a plan fail, nor streaming a spine layer).
    let side =
        i.kda_state + SIDE_CONTEXT_TOKENS.min(i.context_tokens) as u64 * i.mla_cache_per_token;
    let more = (i.sequences.max(1) - 1)
        .min(usize::try_from(room.saturating_sub(keep) / side.max(1)).unwrap_or(usize::MAX));
    let state = state + more as u64 * side;
    room -= more as u64 * side;
    // The prefix-state RAM tier: what was asked, at most an eighth of the budget, and never
    // the expert cache's minimum (nor the pinned tier and one unpinned buffer). It never
    // makes a plan fail: a small budget just holds fewer prefix states in RAM.
    let state_cache = i
        .state_cache
        .min(i.budget / STATE_CACHE_SHARE)
        .min(room.saturating_sub(keep));
    let cache = room - state_cache;
    if i.pin > 0 && i.pin + i.expert_buffer > cache {
        return Err(PlanError::PinTooLarge {
            pin: i.pin,
            cache,
            buffer: i.expert_buffer,
        });
    }
    Ok(MemoryPlan {
        budget: i.budget,
        spine,
        spine_copied: i.spine_copied,
        state,
        context_tokens: i.context_tokens,
        sequences: 1 + more,
        runtime: i.runtime,
        scratch: i.scratch,
        state_cache,
        cache,
        pin: i.pin,
        expert_bytes: i.expert_bytes,
        experts: i.experts,
        contiguous: i.contiguous,
        spine_resident_layers: resident_layers,
        spine_layers: layers,
        spine_streamed,
        spine_buffers,
    })
}

/// The most tokens of context (at most `limit`) whose state [`plan_memory`] fits in
/// `i.budget` beside everything else `i` asks for: the largest `context_tokens` for which
/// the plan succeeds (`None`: not even an empty context fits). A plan's feasibility only
/// falls as its context grows (more state, a smaller expert cache), so a bisection finds it.
pub fn max_context_tokens(i: &PlanInputs, limit: usize) -> Option<usize> {
    let fits = |tokens: usize| {
        plan_memory(&PlanInputs {
            context_tokens: tokens,
            ..i.clone()
        })
        .is_ok()
    };
    if !fits(0) {
        return None;
    }
    // Invariant: `lo` fits, `hi + 1` does not (or is past `limit`).
    let (mut lo, mut hi) = (0usize, limit);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Some(lo)
}

/// Matrix bytes of each layer's spine projections in `format` (what streaming a layer
/// reads per pass): bf16 bytes, or int8 codes plus f16 row scales.
pub fn layer_spine_bytes(cfg: &K3Config, format: SpineFormat) -> Vec<u64> {
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

/// The resident spine in `format` from its stored (bf16) bytes: the quantized matrices are
/// read from the int8 files instead (codes plus f16 row scales).
pub fn spine_bytes_in_format(cfg: &K3Config, format: SpineFormat, stored: u64) -> u64 {
    let mut spine = stored;
    if format == SpineFormat::Int8 {
        for t in quantized_tensors(cfg) {
            let (rows, cols) = (t.shape[0] as u64, t.shape[1] as u64);
            spine = spine.saturating_sub(t.byte_len() as u64) + rows * cols + rows * 2;
        }
    }
    spine
}

/// Scratch: prefill activations of a 512-token chunk (≈16 live f32 rows of width D), two
/// rows of logits, one expert buffer that may outlive its eviction while multiplied, and
/// the `lm_head` rows gathered for the provisional next token ([`crate::model::next_token`]).
pub fn scratch_bytes(cfg: &K3Config, format: SpineFormat, expert_buffer: u64) -> u64 {
    let (d, v) = (cfg.text.hidden_size, cfg.text.vocab_size);
    (16 * 512 * d * 4 + 2 * v * 4) as u64
        + expert_buffer
        + crate::model::next_token::provisional_bytes(v, d, format == SpineFormat::Int8)
}

/// The sizes of the routed experts as stored (from the expert table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertSizes {
    /// Payload bytes of one expert.
    pub expert_bytes: u64,
    /// Bytes of one cache buffer.
    pub buffer_bytes: u64,
    /// Experts over all MoE layers.
    pub count: usize,
    /// Whether every expert's six tensors are gap-free.
    pub contiguous: bool,
}

/// What the caller asks of the plan, beside the model's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanRequest {
    /// The budget.
    pub budget: u64,
    /// The process RSS after loading.
    pub runtime: u64,
    /// The pinned tier.
    pub pin: u64,
    /// Tokens of context (`None`: [`CONTEXT_RESERVE_TOKENS`]; capped by the
    /// model's context).
    pub context_tokens: Option<usize>,
    /// At most this many resident spine layers.
    pub resident_layers_cap: Option<usize>,
    /// Whether the resident spine is copied into huge-page memory.
    pub spine_copied: bool,
    /// Bytes for the RAM tier of the prefix-state cache.
    pub state_cache: u64,
    /// Generations that may run together ([`PlanInputs::sequences`]).
    pub sequences: usize,
}

impl PlanInputs {
    /// The planner's inputs for the model of `cfg` with its spine in `format`,
    /// `stored_spine` bytes of non-expert tensors as stored, and experts of `experts`.
    pub fn for_model(
        cfg: &K3Config,
        format: SpineFormat,
        stored_spine: u64,
        experts: ExpertSizes,
        req: PlanRequest,
    ) -> PlanInputs {
        let dims = dims_from_config(cfg, &EngineOptions::default());
        let context_tokens = req
            .context_tokens
            .unwrap_or(CONTEXT_RESERVE_TOKENS)
            .min(cfg.text.max_position_embeddings);
        PlanInputs {
            budget: req.budget,
            spine: spine_bytes_in_format(cfg, format, stored_spine),
            layer_spine: layer_spine_bytes(cfg, format),
            resident_layers_cap: req.resident_layers_cap,
            kda_state: dims.kda_state_bytes() as u64,
            mla_cache_per_token: dims.mla_cache_bytes_per_token() as u64,
            context_tokens,
            sequences: req.sequences.max(1),
            runtime: req.runtime,
            scratch: scratch_bytes(cfg, format, experts.buffer_bytes),
            state_cache: req.state_cache,
            expert_bytes: experts.expert_bytes,
            expert_buffer: experts.buffer_bytes,
            experts: experts.count,
            experts_per_token: cfg.text.num_experts_per_token,
            pin: req.pin,
            contiguous: experts.contiguous,
            spine_copied: req.spine_copied,
        }
    }
}

impl MemoryPlan {
    /// Experts the expert cache holds (at most all of them).
    pub fn cached_experts(&self) -> u64 {
        (self.cache / self.expert_bytes.max(1)).min(self.experts as u64)
    }

    /// The startup line: how the budget is split and how experts are read (`io`, `threads`
    /// and `pilot`: the expert source's read path, its reader threads and the PILOT gate).
    pub fn describe(&self, io: &str, threads: usize, pilot: &str) -> String {
        format!(
            "memory budget {:.3} GB = spine {:.3} GB ({}) + state {:.3} GB ({} tokens, {} sequence{}) + runtime {:.3} GB + scratch {:.3} GB + prefix states {:.3} GB + expert cache {:.3} GB ({} of {} experts, {:.1}%; pinned tier {:.3} GB of it); experts stream from the shards ({}; {}), io={io} read_threads={threads} pilot_gate={pilot}",
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
            self.sequences,
            if self.sequences == 1 { "" } else { "s" },
            gb(self.runtime),
            gb(self.scratch),
            gb(self.state_cache),
            gb(self.cache),
            self.cached_experts(),
            self.experts,
            100.0 * self.cached_experts() as f64 / self.experts.max(1) as f64,
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

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
