//! The model installation: config, index, shards, tokenizer, drafters.

use super::memory::gib;
use super::report::{Report, Status};
use deltafin_k3::text::tokenizer::Tokenizer;
use deltafin_k3::weights::checkpoint::{CONFIG_FILE, Checkpoint, CheckpointError, INDEX_FILE};
use deltafin_k3::weights::config::{K3Config, REAL_CONFIG_JSON};
use deltafin_k3::weights::inventory::{self, TensorKind};
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

/// Check the install at `root`; returns the largest shard, for the disk probe.
pub(super) fn model_checks(r: &mut Report, root: &Path, available: Option<u64>) -> Option<PathBuf> {
    let rd = root.display().to_string();
    let config_path = root.join(CONFIG_FILE);
    if !config_path.is_file() {
        r.fail(
            "model root",
            format!("no K3 model installed at {rd}: {CONFIG_FILE} is missing"),
            format!(
                "install it with `deltafin setup --model-root {rd}`, point --model-root (or DELTAFIN_ROOT) at an install, or check only the host with `deltafin doctor --runtime-only`"
            ),
        );
        return None;
    }
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
    config_contract(r, &cfg, available);

    let mut largest: Option<(u64, PathBuf)> = None;
    match Checkpoint::open(root) {
        Ok(ckpt) if ckpt.layout() == deltafin_k3::weights::checkpoint::Layout::StreamInstall => {
            let missing = deltafin_k3::weights::loader::stream_install_missing_experts(&ckpt).len();
            r.add(
                "checkpoint",
                Status::Ok,
                format!(
                    "stream install: {} spine tensor files ({:.2} GiB) in k3-resident/tensors/ with their exact sizes; {missing} routed experts not yet in k3-experts/ (fetched on demand)",
                    ckpt.spine_files().len(),
                    gib(ckpt.spine_bytes())
                ),
            );
        }
        Ok(ckpt) => {
            let paths = ckpt.shard_paths();
            let mut bytes = 0u64;
            for p in &paths {
                let len = std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
                bytes += len;
                if largest.as_ref().is_none_or(|(l, _)| len > *l) {
                    largest = Some((len, p.to_path_buf()));
                }
            }
            r.add(
                "checkpoint",
                Status::Ok,
                format!(
                    "{INDEX_FILE} and {} shards ({:.2} GiB) complete: every tensor of the K3 inventory present with its dtype, shape and byte range",
                    paths.len(),
                    gib(bytes)
                ),
            );
        }
        Err(e) => {
            let fix = checkpoint_fix(&e, root);
            r.fail("checkpoint", e.to_string(), fix);
        }
    }

    match Tokenizer::from_dir(root) {
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
            format!(
                "restore the pinned tokenizer files with `deltafin setup-k3 --meta-only --model-root {rd}`"
            ),
        ),
        Err(e) => r.fail(
            "tokenizer",
            e.to_string(),
            format!(
                "restore the pinned tokenizer files with `deltafin setup-k3 --meta-only --model-root {rd}`"
            ),
        ),
    }
    if !root.join("generation_config.json").is_file() {
        r.add(
            "generation_config.json",
            Status::Warn,
            "absent (not read by the runtime; `deltafin setup-k3 --meta-only` restores it)",
        );
    }
    draft_checks(r, root);
    for (dir, what) in [
        ("k3-resident-int8", "row-int8 spine"),
        ("k3-resident-packs", "DFSP spine packs"),
        ("k3-experts-scale4", "scale4 expert sidecars"),
    ] {
        if root.join(dir).is_dir() {
            r.add(
                what,
                Status::Info,
                format!("{dir}/ present but not used by this build (it reads the original shards)"),
            );
        }
    }
    largest.map(|(_, p)| p)
}

/// The model contract line and the context admitted by the memory available.
pub(super) fn config_contract(r: &mut Report, cfg: &K3Config, available: Option<u64>) {
    let dims = dims_from_config(cfg, &EngineOptions::default());
    if let Err(e) = dims.validate() {
        r.fail(
            "config.json",
            e.to_string(),
            "restore the pinned metadata with `deltafin setup-k3 --meta-only`",
        );
        return;
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
    let context = cfg.text.max_position_embeddings as u64;
    r.contract_after = r.checks.len();
    r.model_contract = Some(format!(
        "model contract: Kimi K3 {} layers ({} KDA, {} MLA), {} experts/top-{}, context {}",
        dims.num_layers(),
        dims.num_kda_layers(),
        dims.num_mla_layers(),
        dims.num_experts,
        dims.experts_per_token,
        context
    ));
    let spine: u64 = inventory::text_inventory(cfg)
        .iter()
        .filter(|t| matches!(t.kind, TensorKind::Spine { .. }))
        .map(|t| t.byte_len() as u64)
        .sum();
    let kda = dims.kda_state_bytes() as u64;
    let per_token = dims.mla_cache_bytes_per_token() as u64;
    r.facts.insert("spine_bytes".into(), json!(spine));
    r.facts.insert("kda_state_bytes".into(), json!(kda));
    r.facts
        .insert("mla_cache_bytes_per_token".into(), json!(per_token));
    let Some(avail) = available else {
        r.add(
            "admitted context",
            Status::Warn,
            "unknown: free memory could not be read",
        );
        return;
    };
    let fixed = spine + kda;
    let room = avail.saturating_sub(fixed);
    let admitted = room
        .checked_div(per_token)
        .map_or(context, |n| n.min(context));
    r.admitted_context = Some(admitted);
    let detail = format!(
        "{admitted} of {context} tokens: MLA cache {per_token} B/token into {:.2} GiB available after the {:.2} GiB spine and {:.3} GiB KDA state",
        gib(room),
        gib(spine),
        gib(kda)
    );
    if admitted == 0 {
        r.add(
            "admitted context",
            Status::Warn,
            format!(
                "{detail}; the spine does not fit in free memory and will be re-read from disk"
            ),
        );
    } else {
        r.add("admitted context", Status::Info, detail);
    }
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
        match check_draft_dir(&dspark) {
            Ok(n) => r.add(
                "draft dspark",
                Status::Ok,
                format!("k3-draft-dspark/: config and {n} tensors"),
            ),
            Err(e) => r.fail(
                "draft dspark",
                e,
                format!(
                    "reinstall it with `deltafin setup-dspark --destination {rd}/k3-draft-dspark`"
                ),
            ),
        }
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
                match check_draft_dir(&root.join(d)) {
                    Ok(n) => r.add(
                        "draft qwen",
                        Status::Ok,
                        format!("{d}/: config and {n} tensors"),
                    ),
                    Err(e) => r.fail(
                        "draft qwen",
                        e,
                        format!("reinstall the pair with `deltafin setup-qwen --model-root {rd}`"),
                    ),
                }
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
