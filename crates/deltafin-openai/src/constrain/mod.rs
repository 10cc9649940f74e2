//! Constrained decoding (docs/SERVER.md "Constrained decoding"): `response_format` JSON
//! modes, `tool_choice` `required` / named, and `strict` tools.
//!
//! The grammar engine is llguidance (the one llama.cpp and vLLM use), over a token trie built
//! from K3's own tokenizer. At each step the rule takes K3's argmax over the tokens the
//! grammar allows ([`GrammarRule`], a [`Choose`] rule): still K3's choice, never a repair
//! afterwards. Speculative drafting stays on: verification asks the same rule for each row,
//! so a draft the grammar forbids is simply rejected and drafted ids equal plain ones.

pub mod grammar;

use crate::error::ApiError;
use crate::request::{ChatControls, ToolMode};
use deltafin_k3::generate::{Choose, greedy};
use deltafin_k3::sampling::Sampling;
use deltafin_k3::text::chat::ResponseFormat;
use deltafin_k3::text::tokenizer::{END_OF_MSG, Tokenizer};
use grammar::{Content, Shape, Tools};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use std::sync::{Arc, LazyLock};

/// K3's tokenizer as llguidance sees it: every token's bytes (a special as `0xFF` followed by
/// its spelling, toktrie's convention), and encoding through K3's own encoder.
struct K3TokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for K3TokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            Ok(text) => self.tokenizer.encode_ordinary(text),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// The parser factory of one tokenizer (built once per engine: the token trie of the whole
/// vocabulary).
pub struct Grammars {
    factory: ParserFactory,
    num_ranks: u32,
}

impl Grammars {
    /// The factory for `tokenizer`.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Grammars, String> {
        let vocab = tokenizer.vocab_size();
        let mut words = Vec::with_capacity(vocab);
        for id in 0..vocab as u32 {
            let bytes = tokenizer
                .token_bytes(id)
                .ok_or_else(|| format!("token {id} has no bytes"))?;
            words.push(if tokenizer.is_special(id) {
                let mut w = Vec::with_capacity(bytes.len() + 1);
                w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                w.extend_from_slice(bytes);
                w
            } else {
                bytes.to_vec()
            });
        }
        let info = TokRxInfo::new(vocab as u32, END_OF_MSG);
        let trie = TokTrie::from(&info, &words);
        let num_ranks = tokenizer.num_ranks();
        let env: TokEnv = Arc::new(K3TokEnv { trie, tokenizer });
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| format!("cannot build the grammar engine: {e}"))?;
        factory.quiet();
        Ok(Grammars { factory, num_ranks })
    }

    /// The rule of one answer of `shape`.
    pub fn rule(&self, shape: &Shape<'_>) -> Result<GrammarRule, String> {
        let lark = grammar::lark(shape, self.num_ranks)?;
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(lark))
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(GrammarRule {
            matcher,
            sampling: None,
        })
    }

    /// The rule a chat request's controls ask for (`None`: unconstrained); a schema the
    /// grammar engine cannot compile is the client's error.
    pub fn for_controls(&self, controls: &ChatControls) -> Result<Option<GrammarRule>, ApiError> {
        let Some(shape) = shape_of(controls) else {
            return Ok(None);
        };
        self.rule(&shape).map(Some).map_err(|e| {
            ApiError::invalid_param(
                param_of(controls),
                format!("cannot constrain the answer: {e}"),
            )
        })
    }
}

/// The parameter a grammar failure is blamed on.
fn param_of(controls: &ChatControls) -> &'static str {
    if controls.response_format.is_some() {
        "response_format"
    } else {
        "tools"
    }
}

/// Whether `controls` constrain the answer (a JSON `response_format`, a `none`, `required` or
/// named `tool_choice` over declared tools, or a `strict` tool the model may call).
pub fn constrains(controls: &ChatControls) -> bool {
    shape_of(controls).is_some()
}

/// The shape `controls` ask of the answer; `None` when nothing is constrained.
fn shape_of(controls: &ChatControls) -> Option<Shape<'_>> {
    static OBJECT: LazyLock<Value> = LazyLock::new(|| json!({"type": "object"}));
    let content = match &controls.response_format {
        None => None,
        Some(ResponseFormat::JsonObject) => Some(&*OBJECT),
        Some(ResponseFormat::JsonSchema(s)) => Some(s),
    };
    let declared = controls.tools.as_slice();
    let strict = declared
        .iter()
        .any(|t| t["function"]["strict"] == Value::Bool(true));
    let tools = match &controls.tool_mode {
        _ if declared.is_empty() => {
            content?;
            Tools::Forbidden
        }
        // Declared tools the model must not call: a tools block is forbidden.
        ToolMode::None => Tools::Forbidden,
        ToolMode::Required => Tools::Required(declared),
        // Names are unique (request validation); an undeclared one leaves nothing to call.
        ToolMode::Named(name) => Tools::Required(
            declared
                .iter()
                .position(|t| t["function"]["name"].as_str() == Some(name))
                .map_or(&[][..], |i| &declared[i..=i]),
        ),
        // The model decides; unconstrained unless a tool is strict or the content is JSON.
        ToolMode::Auto if content.is_none() && !strict => return None,
        ToolMode::Auto => Tools::Optional(declared),
    };
    Some(Shape {
        thinking: controls.thinking,
        content: content.map_or(Content::Free, Content::Json),
        tools,
        parallel: controls.parallel_tool_calls,
    })
}

/// K3's argmax over the tokens a grammar allows, or with sampling, the position's draw from
/// K3's distribution restricted to them (the grammar masks first, then the filters apply:
/// vLLM's order).
pub struct GrammarRule {
    matcher: Matcher,
    sampling: Option<Sampling>,
}

impl GrammarRule {
    /// The same grammar, sampled with `sampling` (`None`: argmax).
    pub fn with_sampling(self, sampling: Option<Sampling>) -> GrammarRule {
        GrammarRule { sampling, ..self }
    }
}

impl Choose for GrammarRule {
    fn choose(&mut self, step: usize, logits: &[f32]) -> Result<u32, String> {
        if let Some(s) = self.sampling {
            let mask = self
                .matcher
                .compute_mask()
                .map_err(|e| format!("grammar: {e}"))?;
            return s
                .sample(step, logits, &|id| {
                    (id as usize) < mask.len() && mask.is_allowed(id)
                })
                .ok_or_else(|| "grammar: no token of the model's vocabulary is allowed".into());
        }
        // The unconstrained argmax, when the grammar allows it, is also the first maximum
        // among the allowed ids; checking one token is far cheaper than a whole mask (most
        // steps of free text or of a long string take this path).
        let g = greedy(logits);
        if self
            .matcher
            .validate_tokens(&[g])
            .map_err(|e| format!("grammar: {e}"))?
            == 1
        {
            return Ok(g);
        }
        let mask = self
            .matcher
            .compute_mask()
            .map_err(|e| format!("grammar: {e}"))?;
        let allowed = |id: usize| id < mask.len() && mask.is_allowed(id as u32);
        let mut best: Option<(usize, f32)> = None;
        for (id, &l) in logits.iter().enumerate() {
            if allowed(id) && best.is_none_or(|(_, b)| l > b) {
                best = Some((id, l));
            }
        }
        best.map(|(id, _)| id as u32)
            .ok_or_else(|| "grammar: no token of the model's vocabulary is allowed".into())
    }

    fn accept(&mut self, id: u32) -> Result<(), String> {
        self.matcher
            .consume_token(id)
            .map_err(|e| format!("grammar: {e}"))
    }
}

#[cfg(test)]
mod tests;
