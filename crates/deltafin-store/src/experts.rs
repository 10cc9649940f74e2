//! The checkpoint's routed experts as the expert crate sees them: where each expert's bytes
//! lie ([`expert_table`]), the geometry the scale4 sidecars, the heat histogram and the
//! expert homes are made for, and the one-file-per-expert conversion. Storage only: the
//! model never calls these; the engine and the CLI's conversions (`scale4`, `warm`,
//! `place-experts`) do.

use crate::checkpoint::{
    CONFIG_FILE, Checkpoint, CheckpointError, EXPERT_DIR, Layout, expert_file_name,
};
use crate::config::K3Config;
use deltafin_experts::heat::HeatDims;
use deltafin_experts::layout::{ExpertLocation, ExpertTable};
use deltafin_experts::scale4::Scale4Layout;
use deltafin_experts::{ExpertError, ExpertShape, HomeModel};
use sha2::{Digest, Sha256};
use std::path::Path;

/// Why the expert table could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ExpertsError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Experts(#[from] ExpertError),
}

/// The histogram's shape for a config: MoE layers 1…L−1, E experts, top-k.
pub fn heat_dims(cfg: &K3Config) -> HeatDims {
    HeatDims {
        layers: cfg.n_layers().saturating_sub(1),
        experts: cfg.text.num_experts,
        top_k: cfg.text.num_experts_per_token,
    }
}

/// The scale4 format layout and MoE layer mask of `cfg`.
pub fn scale4_layout(cfg: &K3Config) -> (Scale4Layout, Vec<bool>) {
    let layout = Scale4Layout {
        shape: ExpertShape {
            f: cfg.text.moe_intermediate_size,
            lr: cfg.text.routed_expert_hidden_size,
        },
        num_experts: cfg.text.num_experts,
    };
    let moe = (0..cfg.n_layers()).map(|l| !cfg.is_dense(l)).collect();
    (layout, moe)
}

/// SHA-256 (hex) of `root/config.json`: the scale4 sidecars name the config they were
/// converted for.
pub fn config_sha256(root: &Path) -> Result<String, CheckpointError> {
    let p = root.join(CONFIG_FILE);
    let bytes = std::fs::read(&p).map_err(|err| CheckpointError::File {
        path: p.clone(),
        message: format!("cannot read: {err}"),
    })?;
    Ok(hex::encode(Sha256::digest(&bytes)))
}

/// What the copies in an expert home of this checkpoint must be copies of: its
/// `config.json` digest and expert geometry.
pub fn home_model(checkpoint: &Checkpoint) -> Result<HomeModel, CheckpointError> {
    let cfg = checkpoint.config();
    Ok(HomeModel {
        config_sha256: config_sha256(checkpoint.root())?,
        f: cfg.text.moe_intermediate_size,
        lr: cfg.text.routed_expert_hidden_size,
        num_experts: cfg.text.num_experts,
        layers: cfg.n_layers(),
    })
}

/// Every MoE layer's expert byte ranges. With a `k3-experts/` directory under the model root
/// an expert is its own file there (a present one must have exactly the expert's size); the
/// ranges of the others come from the shards via [`Checkpoint::expert_span`] (one table
/// entry per distinct shard; an expert spanning shards is an error). In a stream install
/// ([`Layout::StreamInstall`]) every expert is its own file too, but a file may be absent
/// (fetched on demand, see [`stream_install_missing_experts`]); a present one must have the
/// expert's exact size.
pub fn expert_table(ckpt: &Checkpoint) -> Result<ExpertTable, ExpertsError> {
    let cfg = ckpt.config();
    let shape = ExpertShape {
        f: cfg.text.moe_intermediate_size,
        lr: cfg.text.routed_expert_hidden_size,
    };
    let dir = ckpt.root().join(EXPERT_DIR);
    let stream_install = ckpt.layout() == Layout::StreamInstall;
    let per_file = dir.is_dir() || stream_install;
    let mut files: Vec<std::path::PathBuf> = Vec::new();
    let mut layers = Vec::with_capacity(cfg.n_layers());
    for l in 0..cfg.n_layers() {
        if cfg.is_dense(l) {
            layers.push(None);
            continue;
        }
        let mut locs = Vec::with_capacity(cfg.text.num_experts);
        for e in 0..cfg.text.num_experts {
            if per_file {
                let path = dir.join(expert_file_name(l, e));
                let len = match std::fs::metadata(&path) {
                    Ok(m) => Some(m.len()),
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound && stream_install => {
                        None
                    }
                    // A full install reads an expert `k3-experts/` lacks (it holds only the
                    // experts `warm-expert-cache --fetch` made local) from its shard.
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                        locs.push(shard_location(ckpt, l, e, &mut files)?);
                        continue;
                    }
                    Err(err) => {
                        return Err(CheckpointError::File {
                            path: path.clone(),
                            message: format!("expert file of layer {l} expert {e}: {err}"),
                        }
                        .into());
                    }
                };
                if let Some(len) = len
                    && len != shape.expert_bytes()
                {
                    return Err(CheckpointError::File {
                        path,
                        message: format!(
                            "is {len} bytes, an expert of this config is {}",
                            shape.expert_bytes()
                        ),
                    }
                    .into());
                }
                let mut ranges = [(0u64, 0u64); 6];
                let mut at = 0;
                for (r, len) in ranges.iter_mut().zip(shape.tensor_bytes()) {
                    *r = (at, len);
                    at += len;
                }
                files.push(path);
                locs.push(ExpertLocation {
                    file: files.len() - 1,
                    ranges,
                });
                continue;
            }
            locs.push(shard_location(ckpt, l, e, &mut files)?);
        }
        layers.push(Some(locs));
    }
    let table = ExpertTable {
        files,
        shape,
        layers,
    };
    table.validate()?;
    Ok(table)
}

/// Where expert `e` of layer `l` lies in its shard, adding the shard to `files` (once).
fn shard_location(
    ckpt: &Checkpoint,
    l: usize,
    e: usize,
    files: &mut Vec<std::path::PathBuf>,
) -> Result<ExpertLocation, CheckpointError> {
    let span = ckpt.expert_span(l, e)?;
    let file = match files.iter().position(|p| *p == span.shard_path) {
        Some(i) => i,
        None => {
            files.push(span.shard_path.clone());
            files.len() - 1
        }
    };
    Ok(ExpertLocation {
        file,
        ranges: span.ranges,
    })
}

/// The `(layer, expert)` pairs of a stream install whose `k3-experts/` file does not exist
/// yet (empty for the shard layout).
pub fn stream_install_missing_experts(ckpt: &Checkpoint) -> Vec<(usize, usize)> {
    let cfg = ckpt.config();
    if ckpt.layout() != Layout::StreamInstall {
        return Vec::new();
    }
    (0..cfg.n_layers())
        .filter(|&l| !cfg.is_dense(l))
        .flat_map(|l| (0..cfg.text.num_experts).map(move |e| (l, e)))
        .filter(|&(l, e)| !ckpt.expert_file(l, e).is_file())
        .collect()
}

/// Write `k3-experts/L{l}-E{e}.bin` for every routed expert from the shards (positional
/// reads of each expert's ranges; each file written to `.tmp` and renamed). Returns the
/// number of files written. Afterwards [`expert_table`] uses the per-expert layout.
pub fn convert_to_expert_files(ckpt: &Checkpoint) -> Result<usize, CheckpointError> {
    use std::os::unix::fs::FileExt;
    if ckpt.layout() == Layout::StreamInstall {
        return Err(CheckpointError::File {
            path: ckpt.root().join(EXPERT_DIR),
            message: "this stream install already keeps one file per expert".into(),
        });
    }
    let cfg = ckpt.config();
    let dir = ckpt.root().join(EXPERT_DIR);
    let io = |path: &Path, err: std::io::Error| CheckpointError::File {
        path: path.to_path_buf(),
        message: err.to_string(),
    };
    let staging = ckpt.root().join(format!("{EXPERT_DIR}.tmp"));
    std::fs::create_dir_all(&staging).map_err(|e| io(&staging, e))?;
    let mut n = 0;
    let mut open: Option<(std::path::PathBuf, std::fs::File)> = None;
    for l in (0..cfg.n_layers()).filter(|&l| !cfg.is_dense(l)) {
        for e in 0..cfg.text.num_experts {
            let span = ckpt.expert_span(l, e)?;
            if open.as_ref().is_none_or(|(p, _)| *p != span.shard_path) {
                let f = std::fs::File::open(&span.shard_path)
                    .map_err(|err| io(&span.shard_path, err))?;
                open = Some((span.shard_path.clone(), f));
            }
            let Some((_, f)) = open.as_ref() else {
                continue;
            };
            let mut bytes = Vec::with_capacity(span.total_bytes() as usize);
            for &(off, len) in &span.ranges {
                let at = bytes.len();
                bytes.resize(at + len as usize, 0);
                f.read_exact_at(&mut bytes[at..], off)
                    .map_err(|err| io(&span.shard_path, err))?;
            }
            let path = staging.join(expert_file_name(l, e));
            std::fs::write(&path, &bytes).map_err(|err| io(&path, err))?;
            n += 1;
        }
    }
    std::fs::rename(&staging, &dir).map_err(|e| io(&dir, e))?;
    Ok(n)
}
