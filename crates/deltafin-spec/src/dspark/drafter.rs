//! [`DsparkDrafter`]: the DSpark model as a [`Drafter`], fed K3's taps of every committed
//! position, and [`SpecConfig`], the speculative-decoding settings of the `K3_*` variables.

use super::DsparkError;
use super::model::{DsparkContext, DsparkModel, Proposal};
use crate::Drafter;
use deltafin_k3::model::K3Model;
use deltafin_k3::model::linear::Linear;
use deltafin_k3::model::taps::Taps;
use deltafin_tensor::Bf16Matrix;
use std::sync::Arc;

/// Default of `K3_DSPARK_MAX_CONTEXT`.
pub const DEFAULT_MAX_CONTEXT: usize = 8192;
/// Default of `K3_SPEC_DEPTH` (product contract; DSpark itself drafts at most [`super::BLOCK`]).
pub const DEFAULT_DEPTH: usize = 8;

/// `K3_DSPARK`: whether to draft with DSpark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftMode {
    /// Never.
    Off,
    /// When a DSpark checkpoint is available (the default).
    Auto,
    /// Always; a missing checkpoint is an error.
    On,
}

/// A bad speculative-decoding environment variable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{variable}={value:?}: {message}")]
pub struct SpecConfigError {
    /// The variable.
    pub variable: &'static str,
    /// Its value.
    pub value: String,
    /// What is wrong.
    pub message: &'static str,
}

/// Speculative-decoding settings.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecConfig {
    /// `K3_DSPARK` (off|auto|on; default auto).
    pub dspark: DraftMode,
    /// `K3_DSPARK_MAX_CONTEXT` (default 8192; `0` reads as no bound): past this many
    /// positions DSpark stops drafting (and stops growing its context cache).
    pub dspark_max_context: usize,
    /// `K3_SPEC_DEPTH` (1..8, default 8): most drafts per verify pass.
    pub depth: usize,
    /// `K3_UAG_DRAFT` (off|auto|on; default auto): Qwen drafting for raw completions.
    pub uag: DraftMode,
    /// `K3_DSPARK_AUTO_MIN_SPEEDUP` ([0, 1), default 0.03): the speed-up `auto` must measure
    /// to keep drafting.
    pub min_speedup: f64,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            dspark: DraftMode::Auto,
            dspark_max_context: DEFAULT_MAX_CONTEXT,
            depth: DEFAULT_DEPTH,
            uag: DraftMode::Auto,
            min_speedup: crate::policy::DEFAULT_MIN_SPEEDUP,
        }
    }
}

fn parse_mode(v: &str) -> Option<DraftMode> {
    match v {
        "off" => Some(DraftMode::Off),
        "auto" => Some(DraftMode::Auto),
        "on" => Some(DraftMode::On),
        _ => None,
    }
}

impl SpecConfig {
    /// Parse `K3_DSPARK`, `K3_DSPARK_MAX_CONTEXT`, `K3_SPEC_DEPTH`, `K3_UAG_DRAFT` and
    /// `K3_DSPARK_AUTO_MIN_SPEEDUP` as `get` returns them (unset: defaults). The library reads
    /// no environment: the binary passes its environment lookup in.
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<SpecConfig, SpecConfigError> {
        let mut c = SpecConfig::default();
        let err = |variable, value: &str, message| SpecConfigError {
            variable,
            value: value.to_owned(),
            message,
        };
        if let Some(v) = get("K3_DSPARK") {
            c.dspark =
                parse_mode(&v).ok_or_else(|| err("K3_DSPARK", &v, "expected off, auto or on"))?;
        }
        if let Some(v) = get("K3_UAG_DRAFT") {
            c.uag = parse_mode(&v)
                .ok_or_else(|| err("K3_UAG_DRAFT", &v, "expected off, auto or on"))?;
        }
        if let Some(v) = get("K3_DSPARK_AUTO_MIN_SPEEDUP") {
            c.min_speedup = crate::policy::parse_min_speedup(&v).ok_or_else(|| {
                err(
                    "K3_DSPARK_AUTO_MIN_SPEEDUP",
                    &v,
                    "expected a number in [0, 1), e.g. 0.03",
                )
            })?;
        }
        if let Some(v) = get("K3_DSPARK_MAX_CONTEXT") {
            c.dspark_max_context = match v.parse::<usize>() {
                Ok(0) => usize::MAX,
                Ok(n) => n,
                Err(_) => {
                    return Err(err(
                        "K3_DSPARK_MAX_CONTEXT",
                        &v,
                        "expected a non-negative integer (0: no bound)",
                    ));
                }
            };
        }
        if let Some(v) = get("K3_SPEC_DEPTH") {
            c.depth = v
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=8).contains(n))
                .ok_or_else(|| err("K3_SPEC_DEPTH", &v, "expected an integer from 1 to 8"))?;
        }
        Ok(c)
    }
}

/// Counters of a drafter's work.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DsparkStats {
    /// Proposals made.
    pub proposals: usize,
    /// Calls that returned no draft (context past the limit, or out of step).
    pub skipped: usize,
}

/// DSpark as a [`Drafter`]: keeps the injected context of every position K3 committed
/// (fed through [`Drafter::observe`]) and drafts up to [`super::BLOCK`] tokens per call.
pub struct DsparkDrafter {
    model: Arc<DsparkModel>,
    embed: Bf16Matrix,
    lm_head: Linear,
    ctx: DsparkContext,
    max_context: usize,
    /// Positions K3 committed (observed), including any past the context limit.
    observed: usize,
    /// Set when the observations stopped matching the history (then no more drafts).
    out_of_step: bool,
    /// Cut a proposal before the first draft whose confidence `σ(c_r)` is below this
    /// (`None`: keep every draft; also when the checkpoint has no confidence head).
    pub min_confidence: Option<f32>,
    /// The last proposal before any confidence cut (tokens and confidence logits).
    pub last: Option<Proposal>,
    /// Work counters.
    pub stats: DsparkStats,
    /// `σ(c_r)` of the returned tokens (empty without a confidence head).
    confidence: Vec<f32>,
}

impl DsparkDrafter {
    /// A drafter for `k3` (checked with [`DsparkModel::check_target`]); borrows nothing:
    /// K3's embedding and `lm_head` matrices share their bytes.
    pub fn new(
        model: Arc<DsparkModel>,
        k3: &K3Model,
        max_context: usize,
    ) -> Result<DsparkDrafter, DsparkError> {
        model.check_target(k3)?;
        let ctx = model.new_context();
        Ok(DsparkDrafter {
            model,
            embed: k3.embed.clone(),
            lm_head: k3.lm_head.clone(),
            ctx,
            max_context,
            observed: 0,
            out_of_step: false,
            min_confidence: None,
            last: None,
            stats: DsparkStats::default(),
            confidence: Vec::new(),
        })
    }

    /// Positions held in the injected context.
    pub fn context_len(&self) -> usize {
        self.ctx.positions
    }

    /// The injected context (per-layer `ĉ` and rotated `k_rope` of every observed position).
    pub fn context(&self) -> &DsparkContext {
        &self.ctx
    }

    /// The drafter's model.
    pub fn model(&self) -> &DsparkModel {
        &self.model
    }

    /// Forget the sequence (a new conversation).
    pub fn reset(&mut self) {
        self.ctx = self.model.new_context();
        self.observed = 0;
        self.out_of_step = false;
        self.last = None;
    }
}

impl Drafter for DsparkDrafter {
    fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        // The anchor is the newest token, at position history.len() − 1; every earlier
        // position must be in the context.
        self.confidence.clear();
        let Some(&anchor) = history.last() else {
            return Vec::new();
        };
        let n = history.len() - 1;
        if max == 0
            || self.out_of_step
            || n != self.observed
            || n != self.ctx.positions
            || anchor as usize >= self.model.config.vocab_size
        {
            self.stats.skipped += 1;
            return Vec::new();
        }
        self.stats.proposals += 1;
        let p = self
            .model
            .propose(&self.embed, &self.lm_head, &self.ctx, anchor, max);
        let keep = match self.min_confidence {
            Some(min) => p
                .confidence
                .iter()
                .position(|&c| deltafin_kernels::sigmoid(c) < min)
                .unwrap_or(p.tokens.len()),
            None => p.tokens.len(),
        };
        let tokens = p.tokens[..keep.min(p.tokens.len())].to_vec();
        self.confidence = p
            .confidence
            .iter()
            .take(tokens.len())
            .map(|&c| deltafin_kernels::sigmoid(c))
            .collect();
        self.last = Some(p);
        tokens
    }

    fn tap_layers(&self) -> &[usize] {
        &self.model.config.target_layer_ids
    }

    fn confidence(&self) -> &[f32] {
        &self.confidence
    }

    fn observe(&mut self, first_position: usize, taps: &Taps) {
        let n = taps.rows();
        let width = self.model.context_proj.cols();
        if first_position != self.observed || taps.layer_ids() != self.tap_layers() {
            self.out_of_step = true;
        }
        if taps.width() != width {
            self.out_of_step = true;
        }
        self.observed = first_position + n;
        if self.out_of_step || self.ctx.positions != first_position {
            return;
        }
        if first_position + n > self.max_context {
            // Past the context limit DSpark stops drafting; the cache stays bounded.
            return;
        }
        self.model.append_context(&mut self.ctx, taps.values(), n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let v: Vec<(String, String)> = pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        move |k| v.iter().find(|(a, _)| a == k).map(|(_, b)| b.clone())
    }

    #[test]
    fn spec_config_from_lookup_is_strict() {
        assert_eq!(
            SpecConfig::from_lookup(lookup(&[])).unwrap(),
            SpecConfig::default()
        );
        let c = SpecConfig::from_lookup(lookup(&[
            ("K3_DSPARK", "on"),
            ("K3_DSPARK_MAX_CONTEXT", "4096"),
            ("K3_SPEC_DEPTH", "3"),
            ("K3_UAG_DRAFT", "off"),
            ("K3_DSPARK_AUTO_MIN_SPEEDUP", "0.1"),
        ]))
        .unwrap();
        assert_eq!(
            c,
            SpecConfig {
                dspark: DraftMode::On,
                dspark_max_context: 4096,
                depth: 3,
                uag: DraftMode::Off,
                min_speedup: 0.1,
            }
        );
        assert_eq!(
            SpecConfig::from_lookup(lookup(&[("K3_DSPARK_MAX_CONTEXT", "0")]))
                .unwrap()
                .dspark_max_context,
            usize::MAX
        );
        assert_eq!(SpecConfig::default().depth, 8);
        assert_eq!(
            SpecConfig::from_lookup(lookup(&[("K3_DSPARK", "off")]))
                .unwrap()
                .dspark,
            DraftMode::Off
        );
        for (k, v) in [
            ("K3_DSPARK", "yes"),
            ("K3_DSPARK", "ON"),
            ("K3_DSPARK_MAX_CONTEXT", "-1"),
            ("K3_DSPARK_MAX_CONTEXT", "8k"),
            ("K3_SPEC_DEPTH", "0"),
            ("K3_SPEC_DEPTH", "9"),
            ("K3_SPEC_DEPTH", " 3"),
            ("K3_UAG_DRAFT", "1"),
            ("K3_DSPARK_AUTO_MIN_SPEEDUP", "1.0"),
            ("K3_DSPARK_AUTO_MIN_SPEEDUP", "-0.01"),
            ("K3_DSPARK_AUTO_MIN_SPEEDUP", "fast"),
        ] {
            let e = SpecConfig::from_lookup(lookup(&[(k, v)])).unwrap_err();
            assert_eq!((e.variable, e.value.as_str()), (k, v));
            let s = e.to_string();
            assert!(s.contains(k) && s.contains(v), "{s}");
        }
    }
}
