//! Which drafter a generation uses (product contract §2 "drafters"): DSpark for chat (and
//! for everything when `K3_DSPARK=on`), the Qwen3 0.6B Base cross-tokenizer drafter for raw
//! completions (`K3_UAG_DRAFT`), nothing otherwise. Shared by `deltafin run` and the server.

use crate::Drafter;
use crate::dspark::{BLOCK, DraftMode, DsparkDrafter, DsparkModel, SpecConfig};
use crate::policy::{PolicyMode, SpecPolicy};
use crate::qwen3::Qwen3Model;
use crate::uag::{QWEN_SMALL_DIR, QwenTokenizer, UagDrafter, open_draft_dir};
use deltafin_k3::model::K3Model;
use deltafin_k3::tokenizer::Tokenizer;
use std::path::Path;
use std::sync::Arc;

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
    /// The settings.
    pub config: SpecConfig,
}

/// A drafter ready for one generation.
pub struct Chosen {
    /// `dspark` or `qwen3-0.6b`.
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
            config: config.clone(),
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
                policy: SpecPolicy::new(
                    policy_mode(*mode),
                    self.config.depth.min(BLOCK),
                    self.config.min_speedup,
                ),
            }));
        }
        if let Some((m, t, mode)) = &self.qwen
            && !chat
        {
            return Ok(Some(Chosen {
                name: "qwen3-0.6b",
                drafter: Box::new(UagDrafter::new(m.clone(), t.clone(), k3_tok.clone())),
                policy: SpecPolicy::new(
                    policy_mode(*mode),
                    self.config.depth,
                    self.config.min_speedup,
                ),
            }));
        }
        Ok(None)
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
            "dspark={}{} uag={}{} depth={} min_speedup={}",
            mode(self.config.dspark),
            loaded(self.dspark.is_some()),
            mode(self.config.uag),
            loaded(self.qwen.is_some()),
            self.config.depth,
            self.config.min_speedup
        )
    }
}
