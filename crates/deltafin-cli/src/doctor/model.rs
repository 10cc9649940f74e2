//! The model installation: config, index, shards, tokenizer, drafters; then what `run` and
//! `serve` would load from it ([`super::load`]).

use super::memory::gb;
use super::report::{Report, Status};
use crate::ModelArgs;
use deltafin_k3::config::{K3Config, REAL_CONFIG_JSON};
use deltafin_k3::model::inventory::{self, TensorKind};
use deltafin_k3::text::tokenizer::Tokenizer;
use deltafin_k3::weights::checkpoint::{CONFIG_FILE, Checkpoint, CheckpointError, INDEX_FILE};
use deltafin_k3::weights::loader::{EngineOptions, dims_from_config};
use deltafin_tensor::SafetensorsFile;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

/// A fix suggestion for a checkpoint error.
pub(super) fn checkpoint_fix(e: &CheckpointError, root: &Path) -> String {
    let r = root.display();
    match e {
        CheckpointError::MissingFile { .. } => {
            format!("install the model: `deltafin setup --model-root {r}`")
        }
        CheckpointError::Config(_) => format!(
            "config.json is not a valid K3 config: restore the pinned metadata with `deltafin setup-k3 --meta-only --model-root {r}`"
        ),
        CheckpointError::Tensor(_) => format!(
            "a weight file is damaged or truncated: delete it and fetch it again with `deltafin fetch-weights --model-root {r}`"
        ),
        CheckpointError::File { message, .. } if message.contains("does not exist") => format!(
            "a weight shard is missing: fetch it with `deltafin fetch-weights --model-root {r}`"
        ),
        CheckpointError::File { .. } | CheckpointError::Request { .. } => format!(
            "the weight index and the shards disagree: restore the metadata with `deltafin setup-k3 --meta-only --model-root {r}` and re-fetch with `deltafin fetch-weights --model-root {r}`"
        ),
    }
}

/// Check the install at `root` and what `run`/`serve` would load from it with `model`'s
/// flags; returns the largest shard, for the disk probe.
pub(super) fn model_checks(
    r: &mut Report,
    root: &Path,
    model: &ModelArgs,
    available: Option<u64>,
) -> Option<PathBuf> {
    let rd = root.display().to_string();
    if let Some(p) = crate::session::root_problem(root) {
        r.fail(
            "model root",
            p.detail,
            format!(
                "{}; or check only the host with `deltafin doctor --runtime-only`",
                p.fix
            ),
        );
        return None;
    }
    let config_path = root.join(CONFIG_FILE);
    let cfg = match K3Config::from_file(&config_path) {
        Ok(c) => c,
        Err(e) => {
            r.fail(
                "config.json",
                e.to_string(),
                format!(
                    "restore the pinned metadata with `deltafin setup-k3 --meta-only --model-root {rd}`"
                ),
            );
            return None;
        }
    };
    let consistent = config_contract(r, &cfg);

    let mut largest: Option<(u64, PathBuf)> = None;
    let checkpoint = match Checkpoint::open(root) {
        Ok(ckpt) => {
            largest = checkpoint_ok(r, &ckpt);
            Some(ckpt)
        }
        Err(e) => {
            let fix = checkpoint_fix(&e, root);
            r.fail("checkpoint", e.to_string(), fix);
            None
        }
    };

    let tokenizer_fix = format!(
        "restore the pinned tokenizer files with `deltafin setup-k3 --meta-only --model-root {rd}`"
    );
    let markers = |t: &Tokenizer| deltafin_k3::text::chat::check_chat_markers(t).err();
    match Tokenizer::from_dir(root) {
        Ok(t) if t.vocab_size() == cfg.text.vocab_size && markers(&t).is_some() => r.fail(
            "tokenizer",
            format!(
                "{}: chat requests would fail (completions still work)",
                markers(&t).map(|e| e.to_string()).unwrap_or_default()
            ),
            tokenizer_fix,
        ),
        Ok(t) if t.vocab_size() == cfg.text.vocab_size => r.add(
            "tokenizer",
            Status::Ok,
            format!(
                "tiktoken.model and tokenizer_config.json: {} tokens",
                t.vocab_size()
            ),
        ),
        Ok(t) => r.fail(
            "tokenizer",
            format!(
                "the tokenizer has {} tokens but config.json vocab_size is {}",
                t.vocab_size(),
                cfg.text.vocab_size
            ),
            tokenizer_fix,
        ),
        Err(e) => r.fail("tokenizer", e.to_string(), tokenizer_fix),
    }
    if !root.join("generation_config.json").is_file() {
        r.add(
            "generation_config.json",
            Status::Warn,
            "absent (not read by the runtime; `deltafin setup-k3 --meta-only` restores it)",
        );
    }
    draft_checks(r, root);
    writable_check(r, root);
    if consistent && let Some(ckpt) = &checkpoint {
        super::load::load_checks(r, ckpt, model, available);
        super::homes::homes_checks(r, ckpt, model);
    }
    largest.map(|(_, p)| p)
}

/// The `checkpoint` line of an install that opened; returns its largest shard (none for a
/// stream install).
fn checkpoint_ok(r: &mut Report, ckpt: &Checkpoint) -> Option<(u64, PathBuf)> {
    if ckpt.layout() == deltafin_k3::weights::checkpoint::Layout::StreamInstall {
        let missing = deltafin_store::experts::stream_install_missing_experts(ckpt).len();
        r.add(
            "checkpoint",
            Status::Ok,
            format!(
                "stream install: {} spine tensor files ({:.2} GB) in k3-resident/tensors/ with their exact sizes; {missing} routed experts not yet in k3-experts/ (fetched on demand)",
                ckpt.spine_files().len(),
                gb(ckpt.spine_bytes())
            ),
        );
        return None;
    }
    let paths = ckpt.shard_paths();
    let mut largest: Option<(u64, PathBuf)> = None;
    let mut bytes = 0u64;
    for p in &paths {
        let len = std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        bytes = bytes.saturating_add(len);
        if largest.as_ref().is_none_or(|(l, _)| len > *l) {
            largest = Some((len, p.to_path_buf()));
        }
    }
    r.add(
        "checkpoint",
        Status::Ok,
        format!(
            "{INDEX_FILE} and {} shards ({:.2} GB) complete: every tensor of the K3 inventory present with its dtype, shape and byte range",
            paths.len(),
            gb(bytes)
        ),
    );
    largest
}

/// The `config.json` line and the model contract line; false when the dimensions are
/// inconsistent (a failure).
pub(super) fn config_contract(r: &mut Report, cfg: &K3Config) -> bool {
    let dims = dims_from_config(cfg, &EngineOptions::default());
    if let Err(e) = dims.validate() {
        r.fail(
            "config.json",
            e.to_string(),
            "restore the pinned metadata with `deltafin setup-k3 --meta-only`",
        );
        return false;
    }
    let is_release = K3Config::from_json_str(REAL_CONFIG_JSON)
        .map(|real| &real == cfg)
        .unwrap_or(false);
    r.add(
        "config.json",
        Status::Ok,
        if is_release {
            "the released Kimi K3 configuration".to_string()
        } else {
            "a K3-format configuration with other dimensions (synthesized or scaled test model)"
                .to_string()
        },
    );
    r.contract_after = r.checks.len();
    r.model_contract = Some(format!(
        "model contract: Kimi K3 {} layers ({} KDA, {} MLA), {} experts/top-{}, context {}",
        dims.num_layers(),
        dims.num_kda_layers(),
        dims.num_mla_layers(),
        dims.num_experts,
        dims.experts_per_token,
        cfg.text.max_position_embeddings
    ));
    let spine: u64 = inventory::text_inventory(cfg)
        .iter()
        .filter(|t| matches!(t.kind, TensorKind::Spine { .. }))
        .map(|t| t.byte_len() as u64)
        .sum();
    r.facts.insert("spine_bytes".into(), json!(spine));
    r.facts.insert(
        "kda_state_bytes".into(),
        json!(dims.kda_state_bytes() as u64),
    );
    r.facts.insert(
        "mla_cache_bytes_per_token".into(),
        json!(dims.mla_cache_bytes_per_token() as u64),
    );
    true
}

/// A draft directory must hold a config and a safetensors file whose header is valid.
pub(super) fn check_draft_dir(dir: &Path) -> std::result::Result<u64, String> {
    let cfg = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg).map_err(|e| format!("{}: {e}", cfg.display()))?;
    serde_json::from_str::<Value>(&text)
        .map_err(|e| format!("{}: not valid JSON: {e}", cfg.display()))?;
    let st = dir.join("model.safetensors");
    let f = SafetensorsFile::open(&st).map_err(|e| e.to_string())?;
    Ok(f.tensors().len() as u64)
}

/// The line of the draft directory `root/dir`: its tensor count, or a failure with `fix`.
fn draft_dir_line(r: &mut Report, check: &str, root: &Path, dir: &str, fix: String) {
    match check_draft_dir(&root.join(dir)) {
        Ok(n) => r.add(check, Status::Ok, format!("{dir}/: config and {n} tensors")),
        Err(e) => r.fail(check, e, fix),
    }
}

pub(super) fn draft_checks(r: &mut Report, root: &Path) {
    let rd = root.display();
    let dspark = root.join("k3-draft-dspark");
    if !dspark.exists() {
        r.add(
            "draft dspark",
            Status::Info,
            "k3-draft-dspark/ absent (chat drafting off)",
        );
    } else {
        draft_dir_line(
            r,
            "draft dspark",
            root,
            "k3-draft-dspark",
            format!("reinstall it with `deltafin setup-dspark --destination {rd}/k3-draft-dspark`"),
        );
    }
    let pair = ["k3-draft-qwen3-0.6b-base", "k3-draft-qwen3-1.7b-base"];
    let present: Vec<bool> = pair.iter().map(|d| root.join(d).exists()).collect();
    match (present[0], present[1]) {
        (false, false) => r.add(
            "draft qwen",
            Status::Info,
            "Qwen3 pair absent (raw-completion drafting off)",
        ),
        (true, true) => {
            for d in pair {
                draft_dir_line(
                    r,
                    "draft qwen",
                    root,
                    d,
                    format!("reinstall the pair with `deltafin setup-qwen --model-root {rd}`"),
                );
            }
        }
        _ => {
            let (have, missing) = if present[0] {
                (pair[0], pair[1])
            } else {
                (pair[1], pair[0])
            };
            r.fail(
                "draft qwen",
                format!("partial Qwen3 pair: {have}/ is present but {missing}/ is missing"),
                format!(
                    "install the pair with `deltafin setup-qwen --model-root {rd}`, or remove {have}/"
                ),
            );
        }
    }
}

/// Whether run and serve can keep what they learn under `k3-meta/` (the directory, else the
/// root that would hold it): on a read-only root they run, but prefix states and the expert
/// heat stay in memory and are lost with the process.
fn writable_check(r: &mut Report, root: &Path) {
    let meta = root.join("k3-meta");
    let dir = if meta.is_dir() {
        meta
    } else {
        root.to_path_buf()
    };
    if let Err(e) = deltafin_k3::weights::install::writable(&dir) {
        r.warn(
            "model root writable",
            format!(
                "{} is not writable ({e}): run and serve keep prefix states and the expert heat in memory only (lost when they exit; no disk state cache, nothing learned across runs), and a router trace, the conversions and the installers cannot write there",
                dir.display()
            ),
            "mount the model root read-write (or give this user write access to k3-meta/) to keep states and heat across runs",
        );
    }
}
