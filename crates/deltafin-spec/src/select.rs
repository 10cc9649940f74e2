//! Which drafter a generation uses (product contract §2 "drafters"): DSpark for chat (and
//! for everything when `K3_DSPARK=on`), the Qwen3 0.6B Base cross-tokenizer drafter for raw
//! completions (`K3_UAG_DRAFT`; escalating to the 1.7B when both are installed and the 1.7B
//! pays, [`crate::escalate`]), nothing otherwise. Shared by `deltafin run` and the server.
//!
//! The policy measurements of a finished generation can be handed back with
//! [`DraftModels::remember`]; the next generation with the same drafter then starts from them
//! ([`SpecPolicy::carry_over`]) instead of measuring `T(0)` and probing again.

use crate::Drafter;
use crate::dspark::{BLOCK, DraftMode, DsparkDrafter, DsparkModel, SpecConfig};
use crate::escalate::Escalating;
use crate::policy::{PolicyMode, SpecPolicy};
use crate::qwen3::Qwen3Model;
use crate::uag::{QWEN_LARGE_DIR, QWEN_SMALL_DIR, QwenTokenizer, UagDrafter, open_draft_dir};
use deltafin_k3::model::K3Model;
use deltafin_k3::text::tokenizer::Tokenizer;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// The DSpark directory under the model root.
pub const DSPARK_DIR: &str = "k3-draft-dspark";

/// Which surfaces will generate (only their drafters are loaded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Surfaces {
    /// Chat (XTML) prompts.
    pub chat: bool,
    /// Raw completions.
    pub raw: bool,
}

/// Draft models loaded for a model root, with the settings they run under.
pub struct DraftModels {
    /// DSpark and its `K3_DSPARK` mode.
    pub dspark: Option<(Arc<DsparkModel>, DraftMode)>,
    /// The Qwen draft, its tokenizer and the `K3_UAG_DRAFT` mode.
    pub qwen: Option<(Arc<Qwen3Model>, Arc<QwenTokenizer>, DraftMode)>,
    /// The Qwen3 1.7B draft and its tokenizer, when installed beside the 0.6B.
    pub qwen_large: Option<(Arc<Qwen3Model>, Arc<QwenTokenizer>)>,
    /// The settings.
    pub config: SpecConfig,
    /// The last remembered policy of each drafter (by [`Chosen::name`]).
    memory: Mutex<HashMap<&'static str, SpecPolicy>>,
}

/// A drafter ready for one generation.
pub struct Chosen {
    /// `dspark`, `qwen3-0.6b` or `qwen3-0.6b+1.7b` (escalating).
    pub name: &'static str,
    /// The drafter.
    pub drafter: Box<dyn Drafter + Send>,
    /// Its policy (mode from the environment, width `K3_SPEC_DEPTH`).
    pub policy: SpecPolicy,
}

fn policy_mode(m: DraftMode) -> PolicyMode {
    match m {
        DraftMode::On => PolicyMode::On,
        _ => PolicyMode::Auto,
    }
}

impl DraftModels {
    /// Load the drafters `config` allows for `surfaces` from `root`. A drafter set to `on`
    /// that is absent, or one present but broken (either mode), is an error naming the
    /// file; an `auto` drafter that is not installed is simply not used.
    pub fn load(
        root: &Path,
        config: &SpecConfig,
        surfaces: Surfaces,
        k3: &K3Model,
    ) -> Result<DraftModels, String> {
        let mut out = DraftModels {
            dspark: None,
            qwen: None,
            qwen_large: None,
            config: config.clone(),
            memory: Mutex::new(HashMap::new()),
        };
        let dspark_wanted =
            config.dspark == DraftMode::On || (config.dspark == DraftMode::Auto && surfaces.chat);
        let dir = root.join(DSPARK_DIR);
        if dspark_wanted {
            if dir.join("config.json").is_file() {
                let m = DsparkModel::open(&dir).map_err(|e| {
                    format!("cannot load the DSpark drafter from {}: {e}", dir.display())
                })?;
                m.check_target(k3)
                    .map_err(|e| format!("DSpark does not fit this K3: {e}"))?;
                out.dspark = Some((Arc::new(m), config.dspark));
            } else if config.dspark == DraftMode::On {
                return Err(format!(
                    "K3_DSPARK=on but no DSpark checkpoint at {} (config.json missing): run `deltafin setup-dspark --destination {}` or set K3_DSPARK=off",
                    dir.display(),
                    dir.display()
                ));
            }
        }
        // Qwen drafts raw completions only when DSpark does not take them (K3_DSPARK=on).
        let qdir = root.join(QWEN_SMALL_DIR);
        let qwen_wanted =
            surfaces.raw && config.dspark != DraftMode::On && config.uag != DraftMode::Off;
        if qwen_wanted && (config.uag == DraftMode::On || qdir.is_dir()) {
            let uag = if config.uag == DraftMode::On {
                "on"
            } else {
                "auto"
            };
            let (m, t) = open_draft_dir(&qdir).map_err(|e| {
                format!(
                    "{e} (K3_UAG_DRAFT={uag}: install it with `deltafin setup-qwen` or set K3_UAG_DRAFT=off)"
                )
            })?;
            out.qwen = Some((Arc::new(m), Arc::new(t), config.uag));
            // The 1.7B second opinion: used only beside the 0.6B, when installed.
            let ldir = root.join(QWEN_LARGE_DIR);
            if ldir.is_dir() {
                let (m, t) = open_draft_dir(&ldir).map_err(|e| {
                    format!(
                        "{e} (K3_UAG_DRAFT={uag}: reinstall it with `deltafin setup-qwen`, remove {}, or set K3_UAG_DRAFT=off)",
                        ldir.display()
                    )
                })?;
                out.qwen_large = Some((Arc::new(m), Arc::new(t)));
            }
        }
        Ok(out)
    }

    /// The drafter for one generation (`chat`: an XTML prompt), or `None` for plain decode.
    pub fn choose(
        &self,
        k3: &K3Model,
        k3_tok: &Arc<Tokenizer>,
        chat: bool,
    ) -> Result<Option<Chosen>, String> {
        if let Some((m, mode)) = &self.dspark
            && (chat || *mode == DraftMode::On)
        {
            let d = DsparkDrafter::new(m.clone(), k3, self.config.dspark_max_context)
                .map_err(|e| format!("DSpark does not fit this K3: {e}"))?;
            return Ok(Some(Chosen {
                name: "dspark",
                drafter: Box::new(d),
                policy: self.policy("dspark", || {
                    SpecPolicy::new(
                        policy_mode(*mode),
                        self.config.depth.min(BLOCK),
                        self.config.min_speedup,
                    )
                }),
            }));
        }
        if let Some((m, t, mode)) = &self.qwen
            && !chat
        {
            let small = Box::new(UagDrafter::new(m.clone(), t.clone(), k3_tok.clone()));
            let (name, drafter): (&'static str, Box<dyn Drafter + Send>) = match &self.qwen_large {
                Some((lm, lt)) => (
                    "qwen3-0.6b+1.7b",
                    Box::new(Escalating::new(
                        small,
                        Box::new(UagDrafter::new(lm.clone(), lt.clone(), k3_tok.clone())),
                    )),
                ),
                None => ("qwen3-0.6b", small),
            };
            return Ok(Some(Chosen {
                name,
                drafter,
                policy: self.policy(name, || {
                    SpecPolicy::new(
                        policy_mode(*mode),
                        self.config.depth,
                        self.config.min_speedup,
                    )
                }),
            }));
        }
        Ok(None)
    }

    /// The remembered policy of `name` carried over, else `fresh()`.
    fn policy(&self, name: &'static str, fresh: impl FnOnce() -> SpecPolicy) -> SpecPolicy {
        let memory = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        memory.get(name).map_or_else(fresh, SpecPolicy::carry_over)
    }

    /// Remember the policy of a finished generation with the drafter `name`
    /// ([`Chosen::name`]): the next [`DraftModels::choose`] of that drafter starts from its
    /// measurements.
    pub fn remember(&self, name: &'static str, policy: &SpecPolicy) {
        let mut memory = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        memory.insert(name, policy.clone());
    }

    /// A one-line description: `dspark=<mode> uag=<mode>` with what is loaded.
    pub fn describe(&self) -> String {
        let mode = |m: DraftMode| match m {
            DraftMode::Off => "off",
            DraftMode::Auto => "auto",
            DraftMode::On => "on",
        };
        let loaded = |b: bool| if b { "" } else { " (not loaded)" };
        format!(
            "dspark={}{} uag={}{}{} depth={} min_speedup={}",
            mode(self.config.dspark),
            loaded(self.dspark.is_some()),
            mode(self.config.uag),
            loaded(self.qwen.is_some()),
            if self.qwen_large.is_some() {
                " (+1.7b)"
            } else {
                ""
            },
            self.config.depth,
            self.config.min_speedup
        )
    }
}
