//! `scale4-manifest.json` and the validated sidecars of one model.

use super::error::{Scale4Error, io_err};
use super::format::*;
use crate::error::ExpertError;
use serde::{Deserialize, Serialize};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// One layer entry of the manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestLayer {
    pub layer: usize,
    pub file: String,
    pub bytes: u64,
    pub experts: usize,
    pub sha256: String,
}

/// `scale4-manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scale4Manifest {
    pub schema: String,
    pub version: u32,
    pub layout: u32,
    pub moe_intermediate_size: usize,
    pub routed_expert_hidden_size: usize,
    pub num_experts: usize,
    pub header_bytes: u64,
    pub record_bytes: u64,
    pub blob_bytes: u64,
    /// sha256 of the model's `config.json` the sidecars were made for.
    pub config_sha256: String,
    /// Experts validated against the raw source (all of them).
    pub validated_experts: usize,
    pub layers: Vec<ManifestLayer>,
}

impl Scale4Manifest {
    /// A manifest for `layers` (layer, sha256) converted with `layout`.
    pub fn new(layout: &Scale4Layout, config_sha256: String, layers: &[(usize, String)]) -> Self {
        Scale4Manifest {
            schema: SCHEMA.into(),
            version: VERSION,
            layout: LAYOUT_ID,
            moe_intermediate_size: layout.shape.f,
            routed_expert_hidden_size: layout.shape.lr,
            num_experts: layout.num_experts,
            header_bytes: layout.header_bytes(),
            record_bytes: layout.record_bytes(),
            blob_bytes: layout.blob_bytes(),
            config_sha256,
            validated_experts: layers.len() * layout.num_experts,
            layers: layers
                .iter()
                .map(|(l, sha)| ManifestLayer {
                    layer: *l,
                    file: layer_file_name(*l),
                    bytes: layout.file_bytes(),
                    experts: layout.num_experts,
                    sha256: sha.clone(),
                })
                .collect(),
        }
    }

    /// Write atomically (`.tmp` + fsync + rename).
    pub fn write(&self, dir: &Path) -> Result<(), Scale4Error> {
        let path = dir.join(MANIFEST_FILE);
        let tmp = dir.join(format!("{MANIFEST_FILE}.tmp"));
        let text = serde_json::to_string_pretty(self).map_err(|e| Scale4Error::Manifest {
            path: path.clone(),
            message: e.to_string(),
        })?;
        std::fs::write(&tmp, text + "\n").map_err(io_err(&tmp))?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io_err(&path))
    }
}

/// Validated sidecars of one model: the manifest agrees with the layout, the MoE layers and
/// the config digest, and every layer file has the right size and header. (Layer digests
/// are checked by the converter; at run time each record is validated, checksum included,
/// when it is read.)
pub struct Scale4Sidecars {
    layout: Scale4Layout,
    /// Per layer: the open file and its path (`None` for dense layers).
    files: Vec<Option<(std::fs::File, PathBuf)>>,
}

impl Scale4Sidecars {
    /// Open `dir` for a model with `layout`, `moe_layers[l]` true for MoE layers, and the
    /// sha256 of its `config.json`.
    pub fn open(
        dir: &Path,
        layout: Scale4Layout,
        moe_layers: &[bool],
        config_sha256: &str,
    ) -> Result<Scale4Sidecars, Scale4Error> {
        let path = dir.join(MANIFEST_FILE);
        let bad = |message: String| Scale4Error::Manifest {
            path: path.clone(),
            message,
        };
        let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
        let m: Scale4Manifest =
            serde_json::from_str(&text).map_err(|e| bad(format!("not a valid manifest: {e}")))?;
        let want = Scale4Manifest::new(&layout, config_sha256.to_string(), &[]);
        let fields = [
            ("schema", m.schema.clone(), want.schema),
            ("version", m.version.to_string(), want.version.to_string()),
            ("layout", m.layout.to_string(), want.layout.to_string()),
            (
                "moe_intermediate_size",
                m.moe_intermediate_size.to_string(),
                layout.shape.f.to_string(),
            ),
            (
                "routed_expert_hidden_size",
                m.routed_expert_hidden_size.to_string(),
                layout.shape.lr.to_string(),
            ),
            (
                "num_experts",
                m.num_experts.to_string(),
                layout.num_experts.to_string(),
            ),
            (
                "header_bytes",
                m.header_bytes.to_string(),
                want.header_bytes.to_string(),
            ),
            (
                "record_bytes",
                m.record_bytes.to_string(),
                want.record_bytes.to_string(),
            ),
            (
                "blob_bytes",
                m.blob_bytes.to_string(),
                want.blob_bytes.to_string(),
            ),
            ("config_sha256", m.config_sha256.clone(), want.config_sha256),
        ];
        for (name, found, expected) in fields {
            if found != expected {
                return Err(bad(format!(
                    "{name} is {found}, the model needs {expected}"
                )));
            }
        }
        let moe: Vec<usize> = (0..moe_layers.len()).filter(|&l| moe_layers[l]).collect();
        let listed: Vec<usize> = m.layers.iter().map(|l| l.layer).collect();
        if listed != moe {
            return Err(bad(format!(
                "lists layers {listed:?}, the model's MoE layers are {moe:?}"
            )));
        }
        let total = moe.len() * layout.num_experts;
        if m.validated_experts != total {
            return Err(bad(format!(
                "validated_experts is {}, activation needs all {total} experts validated",
                m.validated_experts
            )));
        }
        let mut files: Vec<Option<(std::fs::File, PathBuf)>> =
            (0..moe_layers.len()).map(|_| None).collect();
        for entry in &m.layers {
            if entry.file != layer_file_name(entry.layer)
                || entry.bytes != layout.file_bytes()
                || entry.experts != layout.num_experts
            {
                return Err(bad(format!(
                    "layer {} entry ({}, {} bytes, {} experts) disagrees with the layout ({}, {} bytes, {} experts)",
                    entry.layer,
                    entry.file,
                    entry.bytes,
                    entry.experts,
                    layer_file_name(entry.layer),
                    layout.file_bytes(),
                    layout.num_experts
                )));
            }
            let p = dir.join(&entry.file);
            let f = std::fs::File::open(&p).map_err(io_err(&p))?;
            let len = f.metadata().map_err(io_err(&p))?.len();
            if len != entry.bytes {
                return Err(Scale4Error::File {
                    path: p,
                    message: format!("is {len} bytes, the manifest says {}", entry.bytes),
                });
            }
            let mut h = vec![0u8; layout.header_bytes() as usize];
            f.read_exact_at(&mut h, 0).map_err(io_err(&p))?;
            check_file_header(&layout, entry.layer, &h, &p)?;
            files[entry.layer] = Some((f, p));
        }
        Ok(Scale4Sidecars { layout, files })
    }

    /// The layout.
    pub fn layout(&self) -> &Scale4Layout {
        &self.layout
    }

    /// Read and validate expert `expert`'s record of `layer`.
    pub fn record(&self, layer: usize, expert: usize) -> Result<EncodedScales, Scale4Error> {
        let Some(Some((f, path))) = self.files.get(layer) else {
            return Err(Scale4Error::Source(ExpertError::Unavailable {
                layer,
                expert,
                message: "no scale4 sidecar for this layer".into(),
            }));
        };
        if expert >= self.layout.num_experts {
            return Err(Scale4Error::Source(ExpertError::Unavailable {
                layer,
                expert,
                message: format!("out of range (num_experts = {})", self.layout.num_experts),
            }));
        }
        let mut rec = vec![0u8; self.layout.record_bytes() as usize];
        f.read_exact_at(&mut rec, self.layout.record_offset(expert))
            .map_err(io_err(path))?;
        parse_record(&self.layout, layer, expert, &rec, path)
    }

    /// The three E8M0 scale arrays of one expert, decoded from its record.
    pub fn scales(&self, layer: usize, expert: usize) -> Result<[Vec<u8>; 3], Scale4Error> {
        Ok(decode_expert(&self.layout, &self.record(layer, expert)?))
    }
}
