//! Reading tensors of an opened [`Checkpoint`]: spine tensors as zero-copy views or widened
//! vectors, and routed experts' matrices and byte spans.

use std::path::{Path, PathBuf};

use deltafin_tensor::{Bf16Matrix, Bytes, DType, Mxfp4Matrix, bf16};

use crate::inventory::{self, PREFIX};

use super::open::map_file;
use super::*;

impl Checkpoint {
    /// Resolve a text tensor (name with or without the `language_model.` prefix).
    fn find(&self, name: &str) -> Result<Found<'_>, CheckpointError> {
        let full = if name.starts_with(PREFIX) {
            name.to_string()
        } else {
            format!("{PREFIX}{name}")
        };
        let not_here = |full: String, message: &str| CheckpointError::Request {
            name: full,
            message: message.into(),
        };
        match &self.store {
            Store::Shards { shards, locate } => {
                let Some(&i) = locate.get(&full) else {
                    return Err(not_here(full, "not a text tensor of this checkpoint"));
                };
                let shard = &shards[i];
                let info = shard
                    .info(&full)
                    .ok_or_else(|| file_err(shard.path(), format!("tensor `{full}` vanished")))?;
                Ok(Found {
                    bytes: shard.bytes(&full)?,
                    full,
                    dtype: info.dtype,
                    shape: &info.shape,
                })
            }
            Store::Tensors { files } => match files.get(&full) {
                Some(t) => Ok(Found {
                    full,
                    bytes: t.bytes.clone(),
                    dtype: t.dtype,
                    shape: &t.shape,
                }),
                None => Err(not_here(
                    full,
                    "not a spine tensor of this stream install (routed experts are read from k3-experts/)",
                )),
            },
        }
    }

    /// Zero-copy bytes of a text tensor (name with or without the `language_model.` prefix).
    pub fn tensor_bytes(&self, name: &str) -> Result<Bytes, CheckpointError> {
        Ok(self.find(name)?.bytes)
    }

    /// The file, absolute byte offset and length of a text tensor (for explicit reads that
    /// bypass the mmap, e.g. spine streaming).
    pub fn tensor_file_range(&self, name: &str) -> Result<(PathBuf, u64, u64), CheckpointError> {
        let full = if name.starts_with(PREFIX) {
            name.to_string()
        } else {
            format!("{PREFIX}{name}")
        };
        match &self.store {
            Store::Shards { shards, locate } => {
                let Some(&i) = locate.get(&full) else {
                    return Err(CheckpointError::Request {
                        name: full,
                        message: "not a text tensor of this checkpoint".into(),
                    });
                };
                let shard = &shards[i];
                let (off, len) = shard
                    .absolute_range(&full)
                    .map_err(|e| file_err(shard.path(), e.to_string()))?;
                Ok((shard.path().to_path_buf(), off, len))
            }
            Store::Tensors { files } => match files.get(&full) {
                Some(t) => Ok((t.path.clone(), 0, t.bytes.len() as u64)),
                None => Err(CheckpointError::Request {
                    name: full,
                    message: "not a spine tensor of this stream install".into(),
                }),
            },
        }
    }

    /// Dtype and shape of a text tensor.
    pub fn tensor_info(&self, name: &str) -> Result<(DType, Vec<usize>), CheckpointError> {
        let found = self.find(name)?;
        Ok((found.dtype, found.shape.to_vec()))
    }

    /// A 2-D BF16 tensor as a matrix (`[1, D]` vectors included).
    pub fn bf16_matrix(&self, name: &str) -> Result<Bf16Matrix, CheckpointError> {
        let found = self.find(name)?;
        let (rows, cols) = match (found.dtype, found.shape) {
            (DType::BF16, &[r, c]) => (r, c),
            _ => {
                return Err(CheckpointError::Request {
                    name: found.full,
                    message: format!(
                        "is {} {:?}, not a 2-D BF16 matrix",
                        found.dtype, found.shape
                    ),
                });
            }
        };
        Ok(Bf16Matrix::new(&found.full, found.bytes, rows, cols)?)
    }

    /// A BF16 or F32 tensor of any rank (norms, biases, conv taps, `res_proj`) widened to f32.
    pub fn f32_vector(&self, name: &str) -> Result<Vec<f32>, CheckpointError> {
        let found = self.find(name)?;
        let full = found.full;
        // Read, not faulted in: a fault would bring the megabytes around this small tensor
        // into the page cache (readahead) during the load.
        let bytes = found
            .bytes
            .read_to_vec()
            .map_err(|e| CheckpointError::Request {
                name: full.clone(),
                message: format!("cannot read it: {e}"),
            })?;
        match found.dtype {
            DType::F32 => Ok(bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()),
            DType::BF16 => Ok(bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect()),
            other => Err(CheckpointError::Request {
                name: full,
                message: format!("is {other}, not BF16 or F32"),
            }),
        }
    }

    fn check_expert(&self, layer: usize, expert: usize) -> Result<(), CheckpointError> {
        let cfg = &self.config;
        let name = format!("{PREFIX}model.layers.{layer}.block_sparse_moe.experts.{expert}");
        if layer >= cfg.n_layers() || cfg.is_dense(layer) {
            return Err(CheckpointError::Request {
                name,
                message: format!("layer {layer} is not a MoE layer"),
            });
        }
        if expert >= cfg.text.num_experts {
            return Err(CheckpointError::Request {
                name,
                message: format!(
                    "expert {expert} is out of range (num_experts = {})",
                    cfg.text.num_experts
                ),
            });
        }
        Ok(())
    }

    /// The three MXFP4 matrices of `expert` in MoE layer `layer` (scales checked for NaN).
    pub fn expert_matrices(
        &self,
        layer: usize,
        expert: usize,
    ) -> Result<ExpertMatrices, CheckpointError> {
        let bytes = self.expert_tensor_bytes(layer, expert)?;
        self.expert_matrices_from(layer, expert, bytes)
    }

    /// The six tensors of `expert` in MoE layer `layer` as stored, in the §3.4 order (w1
    /// codes, w1 scales, w2 codes, …), sizes checked, values not read: the views
    /// [`Checkpoint::expert_matrices_from`] makes matrices of. Reading nothing lets a copy of
    /// every expert read them from the files in large reads before any scale is checked.
    pub fn expert_tensor_bytes(
        &self,
        layer: usize,
        expert: usize,
    ) -> Result<[Bytes; 6], CheckpointError> {
        self.check_expert(layer, expert)?;
        let lay = inventory::expert_layout(&self.config, layer, expert);
        // A stream install keeps each expert as one raw-v1 file: map it and slice the six
        // tensors in span order.
        let file = match self.store {
            Store::Shards { .. } => None,
            Store::Tensors { .. } => {
                let path = self.expert_file(layer, expert);
                let want = lay.total_bytes() as u64;
                let len = std::fs::metadata(&path)
                    .map_err(|e| {
                        file_err(
                            &path,
                            format!("layer {layer} expert {expert} is not available locally: {e}"),
                        )
                    })?
                    .len();
                if len != want {
                    return Err(file_err(
                        &path,
                        format!(
                            "layer {layer} expert {expert}: file is {len} bytes, the expert is {want}"
                        ),
                    ));
                }
                Some((map_file(&path)?, path))
            }
        };
        let mut at = 0usize;
        let mut part = |name: &str, len: usize| -> Result<Bytes, CheckpointError> {
            match &file {
                None => self.tensor_bytes(name),
                Some((bytes, path)) => {
                    let b = bytes.slice(at..at + len).ok_or_else(|| {
                        file_err(path, format!("tensor `{name}` lies beyond the file"))
                    })?;
                    at += len;
                    Ok(b)
                }
            }
        };
        let [a, b, c, d, e, f] = &lay.tensors;
        Ok([
            part(&a.name, a.bytes)?,
            part(&b.name, b.bytes)?,
            part(&c.name, c.bytes)?,
            part(&d.name, d.bytes)?,
            part(&e.name, e.bytes)?,
            part(&f.name, f.bytes)?,
        ])
    }

    /// The three MXFP4 matrices of `expert` in MoE layer `layer` over `bytes`, its six
    /// tensors in the §3.4 order (from [`Checkpoint::expert_tensor_bytes`], or copies of
    /// them): sizes and scales (no NaN) checked, each error naming the tensor.
    pub fn expert_matrices_from(
        &self,
        layer: usize,
        expert: usize,
        bytes: [Bytes; 6],
    ) -> Result<ExpertMatrices, CheckpointError> {
        self.check_expert(layer, expert)?;
        let lay = inventory::expert_layout(&self.config, layer, expert);
        let [p1, s1, p2, s2, p3, s3] = bytes;
        let mut mats = Vec::with_capacity(3);
        for (pair, (packed, scale)) in
            lay.tensors
                .chunks_exact(2)
                .zip([(p1, s1), (p2, s2), (p3, s3)])
        {
            let p = &pair[0];
            let [rows, cols] = inventory::ExpertLayout::logical_shape(&self.config, p.matrix);
            let name = p.name.trim_end_matches(".weight_packed");
            mats.push(Mxfp4Matrix::new(name, packed, scale, rows, cols)?);
        }
        let mut it = mats.into_iter();
        match (it.next(), it.next(), it.next()) {
            (Some(w1), Some(w2), Some(w3)) => Ok(ExpertMatrices { w1, w2, w3 }),
            _ => Err(CheckpointError::Request {
                name: format!("layer {layer} expert {expert}"),
                message: "internal: expected three matrices".into(),
            }),
        }
    }

    /// Absolute file ranges of one expert's six tensors, for direct span reads.
    pub fn expert_span(&self, layer: usize, expert: usize) -> Result<ExpertSpan, CheckpointError> {
        self.check_expert(layer, expert)?;
        let lay = inventory::expert_layout(&self.config, layer, expert);
        let mut ranges = [(0u64, 0u64); 6];
        if self.layout() == Layout::StreamInstall {
            // The expert's own file (which need not exist yet: it is fetched on demand).
            let mut at = 0u64;
            for (r, t) in ranges.iter_mut().zip(&lay.tensors) {
                *r = (at, t.bytes as u64);
                at += r.1;
            }
            return Ok(ExpertSpan {
                shard_path: self.expert_file(layer, expert),
                ranges,
                contiguous: true,
            });
        }
        let mut shard_path: Option<&Path> = None;
        for (k, t) in lay.tensors.iter().enumerate() {
            let Store::Shards { shards, locate } = &self.store else {
                break;
            };
            let full = t.name.clone();
            let Some(shard) = locate.get(&full).map(|&i| &shards[i]) else {
                return Err(CheckpointError::Request {
                    name: full,
                    message: "not a text tensor of this checkpoint".into(),
                });
            };
            match shard_path {
                None => shard_path = Some(shard.path()),
                Some(p) if p != shard.path() => {
                    return Err(CheckpointError::Request {
                        name: full,
                        message: format!(
                            "lies in {} but the expert's first tensor lies in {}: the expert spans shards",
                            shard.path().display(),
                            p.display()
                        ),
                    });
                }
                Some(_) => {}
            }
            ranges[k] = shard.absolute_range(&full)?;
        }
        let contiguous = ranges.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0);
        Ok(ExpertSpan {
            shard_path: shard_path.map(Path::to_path_buf).unwrap_or_default(),
            ranges,
            contiguous,
        })
    }
}
