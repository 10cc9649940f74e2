//! [`EngineBuilder`]: open an install, plan its memory, assemble the expert stack, load the
//! model and place it on the device, in that order.
//!
//! ```no_run
//! use deltafin_k3::engine::EngineBuilder;
//! let engine = EngineBuilder::new("/models/k3")
//!     .memory_budget(Some(64_000_000_000))
//!     .build()?;
//! println!("{:?}", engine.plan);
//! # Ok::<(), deltafin_k3::engine::EngineError>(())
//! ```

use crate::engine::config::{EngineConfig, Scale4Mode};
use crate::engine::error::EngineError;
use crate::engine::experts::{Base, ExpertLayerFactory, assemble_expert_stack, learned_heat};
use crate::engine::placement::{place_on_device, select};
use crate::engine::plan::{ExpertSizes, MemoryPlan, PlanInputs, PlanRequest, plan_memory};
use crate::engine::progress::{LoadProgress, Silent, with_copy_progress};
use crate::model::K3Model;
use crate::text::tokenizer::Tokenizer;
use crate::weights::install;
use crate::weights::loader::{EngineOptions, assemble_model, touch_embedding_in_background};
use crate::weights::resident::{HugePages, ResidentCopy};
use deltafin_store::checkpoint::{Checkpoint, Layout};
use deltafin_store::spine_int8::{SpineError, SpineFormat, int8_spine_present, tensor_dir};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// A loaded model with everything a caller needs to run it.
pub struct LoadedEngine {
    /// The model, placed on its device.
    pub model: K3Model,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// The opened checkpoint.
    pub checkpoint: Arc<Checkpoint>,
    /// The memory split when experts stream under a budget (`None`: resident experts).
    pub plan: Option<MemoryPlan>,
    /// Seconds from opening the install to a placed model.
    pub load_seconds: f64,
    /// The spine the model multiplies with.
    pub spine: SpineFormat,
    /// Where the products run (`device=cpu`, `device=cuda:0 … spine=N/M matrices …`).
    pub device_line: String,
    /// The copies into huge-page memory made while loading (the routed experts, then the
    /// resident spine), with how their bytes were read.
    pub resident_copies: Vec<ResidentCopy>,
    /// Where the routed experts' products run: `cpu`, or the device (`cuda:0`).
    pub expert_backend: String,
    /// The scale4 setting (`K3_EXPERT_SCALE4`) and whether the routed experts take their
    /// scales from the sidecars.
    pub scale4: (Scale4Mode, bool),
}

impl LoadedEngine {
    /// The startup words of the routed experts: `expert_backend=… scale4=MODE(sidecars|raw
    /// scales)`.
    pub fn experts_words(&self) -> String {
        let (mode, used) = self.scale4;
        let mode = match mode {
            Scale4Mode::Auto => "auto",
            Scale4Mode::Off => "off",
            Scale4Mode::Require => "require",
        };
        format!(
            "expert_backend={} scale4={mode}({})",
            self.expert_backend,
            if used { "sidecars" } else { "raw scales" }
        )
    }

    /// The most positions (prompt and answer) a sequence may hold on this engine: the
    /// model's context, capped by what memory holds. Under a budget that is the plan's
    /// reserved context; without one, as many positions as half of the memory available now
    /// holds at twice the per-position state (the MLA cache, and a stored prefix state's
    /// copy of it), the prompt ids included. A prefill's activations are bounded by its
    /// pass length ([`crate::prefix::prefill::PREFILL_CHUNK`]), not by the prompt.
    pub fn admitted_context(&self) -> usize {
        let positions = self.checkpoint.config().text.max_position_embeddings;
        if let Some(plan) = &self.plan {
            return positions.min(plan.context_tokens);
        }
        let per_position = 2 * (self.model.dims.mla_cache_bytes_per_token() as u64 + 4);
        match crate::engine::host::meminfo() {
            Some(m) => {
                let fits = (m.available / 2) / per_position.max(1);
                positions.min(usize::try_from(fits).unwrap_or(usize::MAX))
            }
            None => positions,
        }
    }

    /// What a prefix state computed by this engine depends on, as a string the prefix
    /// cache keys its entries under ([`crate::prefix::PrefixCache`]): the crate version,
    /// `config.json`'s bytes, the name (relative to the root, so not how the root is spelled
    /// or where it lies), length and modification time of every spine file
    /// (the shards, or a stream install's spine; the int8 spine's tensor files when that is
    /// the spine), the spine format and the device line. A rewritten or re-synthesized
    /// checkpoint, another spine or another device gets other keys, so a state is never
    /// offered to an engine that would not have computed the same bits.
    pub fn state_tag(&self) -> String {
        use sha2::{Digest, Sha256};
        let root = self.checkpoint.root();
        let mut h = Sha256::new();
        h.update(env!("CARGO_PKG_VERSION").as_bytes());
        h.update(std::fs::read(root.join("config.json")).unwrap_or_default());
        let mut files: Vec<PathBuf> = self
            .checkpoint
            .spine_files()
            .iter()
            .map(|p| p.to_path_buf())
            .collect();
        if self.spine == SpineFormat::Int8
            && let Ok(rd) = std::fs::read_dir(tensor_dir(root))
        {
            let mut int8: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
            int8.sort();
            files.extend(int8);
        }
        for f in files {
            // Named relative to the root: the same install spelled `x`, `./x` or by its
            // absolute path, or moved elsewhere, keeps its keys.
            h.update(
                f.strip_prefix(root)
                    .unwrap_or(f.as_path())
                    .to_string_lossy()
                    .as_bytes(),
            );
            if let Ok(m) = std::fs::metadata(&f) {
                h.update(m.len().to_le_bytes());
                let t = m
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_nanos());
                h.update(t.to_le_bytes());
            }
        }
        h.update(self.spine.as_str().as_bytes());
        h.update(self.device_line.as_bytes());
        hex::encode(h.finalize())
    }
}

/// Builds a [`LoadedEngine`] from an install root and an [`EngineConfig`].
pub struct EngineBuilder {
    root: PathBuf,
    config: EngineConfig,
    layer: Option<ExpertLayerFactory>,
    progress: Box<dyn LoadProgress>,
    runtime: Option<u64>,
}

impl EngineBuilder {
    /// A builder for the install at `root` with [`EngineConfig::default`].
    pub fn new(root: impl Into<PathBuf>) -> EngineBuilder {
        EngineBuilder {
            root: root.into(),
            config: EngineConfig::default(),
            layer: None,
            progress: Box::new(Silent),
            runtime: None,
        }
    }

    /// Replace the whole configuration.
    pub fn config(mut self, config: EngineConfig) -> EngineBuilder {
        self.config = config;
        self
    }

    /// The whole-process RAM budget in bytes (`None`: every expert resident).
    pub fn memory_budget(mut self, bytes: Option<u64>) -> EngineBuilder {
        self.config.memory_budget = bytes;
        self
    }

    /// The spine format.
    pub fn spine(mut self, format: SpineFormat) -> EngineBuilder {
        self.config.spine = format;
        self
    }

    /// The most tokens of context the caller will hold (the budget reserves state for them).
    pub fn context_tokens(mut self, tokens: Option<usize>) -> EngineBuilder {
        self.config.context_tokens = tokens;
        self
    }

    /// Generations that will run together (a budget reserves state for each, as far as the
    /// expert cache can spare it; [`EngineConfig::sequences`]).
    pub fn sequences(mut self, n: usize) -> EngineBuilder {
        self.config.sequences = n.max(1);
        self
    }

    /// An expert layer over the engine's source, made once the checkpoint is open.
    pub fn expert_layer(mut self, factory: ExpertLayerFactory) -> EngineBuilder {
        self.layer = Some(factory);
        self
    }

    /// Where the load's report lines and copy progress go (default: nowhere).
    pub fn progress(mut self, progress: Box<dyn LoadProgress>) -> EngineBuilder {
        self.progress = progress;
        self
    }

    /// Plan with this process RSS instead of measuring it (for comparing plans).
    pub fn runtime_bytes(mut self, bytes: u64) -> EngineBuilder {
        self.runtime = Some(bytes);
        self
    }

    /// The configuration in force.
    pub fn engine_config(&self) -> &EngineConfig {
        &self.config
    }

    /// The memory plan the build would use, without loading the model (`None` without a
    /// budget). Opens the install and reads its expert table.
    pub fn plan(&self) -> Result<Option<MemoryPlan>, EngineError> {
        let Some(budget) = self.config.memory_budget else {
            return Ok(None);
        };
        self.check_install()?;
        let checkpoint = install::open_checkpoint(&self.root)?;
        let huge_pages = self.config.huge_pages;
        Ok(Some(self.plan_for(&checkpoint, budget, huge_pages)?))
    }

    /// What the planner is given for `budget` bytes ([`plan_memory`] of it is the plan the
    /// build would use with that budget), without loading the model: for asking how much
    /// context a budget admits ([`crate::engine::plan::max_context_tokens`]). Opens the
    /// checkpoint and reads its expert table; does not check the int8 spine.
    pub fn plan_inputs(&self, budget: u64) -> Result<PlanInputs, EngineError> {
        let checkpoint = install::open_checkpoint(&self.root)?;
        self.plan_inputs_for(&checkpoint, budget, self.config.huge_pages)
    }

    fn check_install(&self) -> Result<(), EngineError> {
        let root = &self.root;
        if let Some(what) = install::missing(root) {
            return Err(EngineError::NotInstalled {
                root: root.clone(),
                what,
            });
        }
        check_spine(root, self.config.spine)
    }

    fn plan_for(
        &self,
        checkpoint: &Checkpoint,
        budget: u64,
        huge_pages: HugePages,
    ) -> Result<MemoryPlan, EngineError> {
        let inputs = self.plan_inputs_for(checkpoint, budget, huge_pages)?;
        Ok(plan_memory(&inputs)?)
    }

    fn plan_inputs_for(
        &self,
        checkpoint: &Checkpoint,
        budget: u64,
        huge_pages: HugePages,
    ) -> Result<PlanInputs, EngineError> {
        let cfg = checkpoint.config();
        let layers = cfg.n_layers();
        if let Some(cap) = self.config.spine_resident_layers
            && cap > layers
        {
            return Err(EngineError::ResidentLayers {
                requested: cap,
                layers,
            });
        }
        let table = deltafin_store::experts::expert_table(checkpoint)
            .map_err(EngineError::context("cannot locate the routed experts"))?;
        let experts = ExpertSizes {
            expert_bytes: table.shape.expert_bytes(),
            buffer_bytes: table.max_buffer_bytes(),
            count: table.expert_count(),
            contiguous: table.all_contiguous(),
        };
        let stored_spine = match checkpoint.layout() {
            Layout::Shards => {
                let mut file_bytes = 0u64;
                for p in checkpoint.shard_paths() {
                    file_bytes += std::fs::metadata(p)
                        .map_err(EngineError::context(format!("cannot stat {}", p.display())))?
                        .len();
                }
                file_bytes.saturating_sub(experts.expert_bytes * experts.count as u64)
            }
            Layout::StreamInstall => checkpoint.spine_bytes(),
        };
        // Everything resident after loading: code and libraries (file-backed), the
        // tokenizer, the allocator (anonymous). Spine pages are hardly touched yet and are
        // counted in the spine.
        let runtime = self
            .runtime
            .unwrap_or_else(|| crate::engine::host::proc_memory().map_or(0, |m| m.rss));
        Ok(PlanInputs::for_model(
            cfg,
            self.config.spine,
            stored_spine,
            experts,
            PlanRequest {
                budget,
                runtime,
                pin: self.config.heat.pin_bytes,
                context_tokens: self.config.context_tokens,
                resident_layers_cap: self.config.spine_resident_layers,
                spine_copied: huge_pages.copies(),
                state_cache: self.config.state_cache_ram,
                sequences: self.config.sequences,
            },
        ))
    }

    /// Open the install, plan, assemble the expert stack, load and place the model.
    pub fn build(mut self) -> Result<LoadedEngine, EngineError> {
        let layer = self.layer.take();
        let config = &self.config;
        let placement = select(config.device, config.expert_backend)?;
        self.check_install()?;
        let root = self.root.as_path();
        let progress = self.progress.as_ref();
        let t = Instant::now();
        let (checkpoint, tokenizer) = install::open(root)?;
        let cfg = checkpoint.config();
        if let Some(cap) = config.spine_resident_layers
            && cap > cfg.n_layers()
        {
            return Err(EngineError::ResidentLayers {
                requested: cap,
                layers: cfg.n_layers(),
            });
        }
        let (learned, heat_path) = learned_heat(root, cfg, config.heat.enabled, progress);
        let candidates = learned.pin_candidates().len();
        // A spine that goes to a device is not copied: the host copy would only be
        // uploaded and kept.
        let huge_pages = if placement.spine {
            HugePages::Off
        } else {
            config.huge_pages
        };
        let engine = EngineOptions {
            spine: config.spine,
            spine_resident_layers: config.spine_resident_layers,
            spine_stream: config.spine_stream,
            // The huge-page copy runs after loading, with progress.
            huge_pages: HugePages::Off,
            ..EngineOptions::default()
        };
        let mut copies = Vec::new();
        let scale4;
        let (mut model, plan) = match config.memory_budget {
            None => {
                let copy = config.copy_resident_experts && huge_pages.copies();
                let stack = assemble_expert_stack(
                    &checkpoint,
                    config,
                    Base::Resident { copy },
                    &learned,
                    heat_path,
                    layer,
                    progress,
                )?;
                copies.extend(stack.copy);
                scale4 = stack.scale4;
                let mut model = assemble_model(checkpoint.clone(), &engine, stack.experts)
                    .map_err(build_context(root))?;
                model.route_observers = stack.observers;
                (model, None)
            }
            Some(budget) => {
                let load = || -> Result<(K3Model, MemoryPlan, bool), EngineError> {
                    let plan = self.plan_for(&checkpoint, budget, huge_pages)?;
                    let stream = deltafin_experts::StreamOptions {
                        cache_bytes: plan.cache,
                        ..config.stream.clone()
                    };
                    let stack = assemble_expert_stack(
                        &checkpoint,
                        config,
                        Base::Streaming(stream),
                        &learned,
                        heat_path,
                        layer,
                        progress,
                    )?;
                    let engine = EngineOptions {
                        spine_resident_layers: Some(plan.spine_resident_layers),
                        ..engine
                    };
                    let mut model = assemble_model(checkpoint.clone(), &engine, stack.experts)?;
                    model.route_observers = stack.observers;
                    Ok((model, plan, stack.scale4))
                };
                let (model, plan, used) = load().map_err(build_context(root))?;
                scale4 = used;
                (model, Some(plan))
            }
        };
        progress.info(&format!(
            "layout={} ({} routed experts missing locally{})",
            checkpoint.layout().as_str(),
            deltafin_store::experts::stream_install_missing_experts(&checkpoint).len(),
            match checkpoint.layout() {
                Layout::Shards => "",
                Layout::StreamInstall => ", fetched on demand from the hub",
            },
        ));
        progress.info(&format!(
            "expert_heat={} ({} passes learned, {} pin candidates) pinned_tier={:.3} GB",
            if config.heat.enabled { "on" } else { "off" },
            learned.passes,
            candidates,
            plan.as_ref().map_or(0.0, |m| m.pin as f64 / 1e9),
        ));
        if huge_pages.copies() {
            let c = with_copy_progress(progress, "resident spine", |p| {
                model.copy_spine_to_huge_pages(p)
            })
            .map_err(EngineError::context(
                "copying the resident spine into huge-page memory",
            ))?;
            progress.info(&c.describe());
            copies.push(c.clone());
            model.resident_copy = Some(c);
        }
        // After the copy, so that the two reads do not compete for the disk.
        touch_embedding_in_background(&model);
        install::check_vocab(&tokenizer, &model)?;
        let device_line = place_on_device(&mut model, &placement, config.device_reserve, progress)?;
        let expert_backend = match (&placement.device, placement.experts) {
            (Some(dev), true) => dev
                .describe()
                .split_whitespace()
                .next()
                .unwrap_or("device")
                .to_string(),
            _ => "cpu".to_string(),
        };
        Ok(LoadedEngine {
            model,
            tokenizer,
            checkpoint,
            plan,
            load_seconds: t.elapsed().as_secs_f64(),
            spine: config.spine,
            device_line,
            resident_copies: copies,
            expert_backend,
            scale4: (config.scale4, scale4),
        })
    }
}

/// "cannot build the model from ROOT" over an error.
fn build_context<E: Into<crate::engine::error::BoxError>>(
    root: &Path,
) -> impl FnOnce(E) -> EngineError {
    EngineError::context(format!("cannot build the model from {}", root.display()))
}

/// With the int8 spine requested, fail unless `k3-resident-int8/` exists under `root`
/// (the error says how to convert it or to ask for the bf16 spine).
pub fn check_spine(root: &Path, spine: SpineFormat) -> Result<(), EngineError> {
    if spine == SpineFormat::Int8 && !int8_spine_present(root) {
        return Err(SpineError::NotConverted {
            dir: tensor_dir(root),
            root: root.to_path_buf(),
        }
        .into());
    }
    Ok(())
}

#[cfg(test)]
#[path = "builder_tests.rs"]
mod tests;
