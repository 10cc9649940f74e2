//! Where each routed expert's bytes lie, and how one expert is read into one buffer.
//!
//! An expert is six tensors in the docs/K3.md §3.4 order: w1 codes, w1 scales, w2 codes,
//! w2 scales, w3 codes, w3 scales. In the release shards they follow each other without gaps
//! (`contiguous`, one read); in a `k3-experts/L{l}-E{e}.bin` file they are the whole file.

use crate::error::ExpertError;
use deltafin_tensor::mxfp4::GROUP;
use std::path::PathBuf;

/// Alignment of buffers, file offsets and lengths of direct reads (the largest common
/// logical block size).
pub const ALIGN: u64 = 4096;

/// The logical shape of every routed expert: `w1`, `w3` `[f, lr]`, `w2` `[lr, f]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShape {
    /// `moe_intermediate_size` F.
    pub f: usize,
    /// `routed_expert_hidden_size` Lr.
    pub lr: usize,
}

impl ExpertShape {
    /// Byte lengths of the six tensors in §3.4 order.
    pub fn tensor_bytes(&self) -> [u64; 6] {
        let codes = (self.f * self.lr / 2) as u64;
        let scales = (self.f * self.lr / GROUP) as u64;
        [codes, scales, codes, scales, codes, scales]
    }

    /// Bytes of one expert (the six tensors).
    pub fn expert_bytes(&self) -> u64 {
        self.tensor_bytes().iter().sum()
    }

    /// `(rows, cols)` of w1, w2, w3.
    pub fn matrix_shapes(&self) -> [(usize, usize); 3] {
        [(self.f, self.lr), (self.lr, self.f), (self.f, self.lr)]
    }
}

/// One expert's six absolute `(offset, len)` ranges in file `file` of the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertLocation {
    /// Index into [`ExpertTable::files`].
    pub file: usize,
    /// §3.4 order.
    pub ranges: [(u64, u64); 6],
}

impl ExpertLocation {
    /// True when the six ranges follow each other without gaps (one read covers them).
    pub fn contiguous(&self) -> bool {
        self.ranges.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0)
    }
}

/// One aligned read: `len` bytes of the file from `file_offset` into the buffer at `buf_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub file_offset: u64,
    pub len: u64,
    pub buf_offset: u64,
    /// Bytes `[file_offset, file_offset + need_to)` must be read; the aligned tail past the
    /// end of the file may be missing.
    pub need_to: u64,
}

/// How one expert is laid into its buffer: the aligned reads and where each tensor lands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadPlan {
    pub regions: Vec<Region>,
    /// Buffer offset of each of the six tensors.
    pub tensor_at: [u64; 6],
    /// Buffer bytes this plan needs.
    pub buf_len: u64,
}

impl ReadPlan {
    /// Runs of gap-free consecutive ranges become one aligned region each (one region for a
    /// contiguous expert). Every region starts at an `ALIGN` multiple in the buffer and in
    /// the file, and has an `ALIGN`-multiple length.
    pub fn new(loc: &ExpertLocation) -> ReadPlan {
        let mut regions = Vec::new();
        let mut tensor_at = [0u64; 6];
        let mut buf_end = 0u64;
        let mut k = 0;
        while k < 6 {
            let start = loc.ranges[k].0;
            let mut end = start + loc.ranges[k].1;
            let mut j = k + 1;
            while j < 6 && loc.ranges[j].0 == end {
                end += loc.ranges[j].1;
                j += 1;
            }
            let a_start = start / ALIGN * ALIGN;
            let a_end = end.div_ceil(ALIGN) * ALIGN;
            let buf_offset = buf_end;
            for (i, t) in tensor_at.iter_mut().enumerate().take(j).skip(k) {
                *t = buf_offset + (loc.ranges[i].0 - a_start);
            }
            regions.push(Region {
                file_offset: a_start,
                len: a_end - a_start,
                buf_offset,
                need_to: end - a_start,
            });
            buf_end += a_end - a_start;
            k = j;
        }
        ReadPlan {
            regions,
            tensor_at,
            buf_len: buf_end,
        }
    }
}

/// Every MoE layer's experts: the files they live in and each expert's ranges.
#[derive(Clone, Debug)]
pub struct ExpertTable {
    /// Files the locations point into.
    pub files: Vec<PathBuf>,
    /// Shape of every expert.
    pub shape: ExpertShape,
    /// Per layer: `None` for a dense layer, else one location per expert id.
    pub layers: Vec<Option<Vec<ExpertLocation>>>,
}

impl ExpertTable {
    /// Check every location: a known file, and the six lengths of `shape`.
    pub fn validate(&self) -> Result<(), ExpertError> {
        if self.shape.f == 0 || self.shape.lr == 0 || !self.shape.lr.is_multiple_of(GROUP) {
            return Err(ExpertError::Setup(format!(
                "expert shape F={} Lr={} is not usable (Lr must be a positive multiple of {GROUP})",
                self.shape.f, self.shape.lr
            )));
        }
        let want = self.shape.tensor_bytes();
        for (layer, l) in self.layers.iter().enumerate() {
            for (expert, loc) in l.iter().flatten().enumerate() {
                let bad = |message: String| ExpertError::Unavailable {
                    layer,
                    expert,
                    message,
                };
                if loc.file >= self.files.len() {
                    return Err(bad(format!(
                        "file index {} is out of range ({} files)",
                        loc.file,
                        self.files.len()
                    )));
                }
                for (k, (&(_, len), &w)) in loc.ranges.iter().zip(&want).enumerate() {
                    if len != w {
                        return Err(bad(format!(
                            "tensor {k} of 6 in {} is {len} bytes, the shape needs {w}",
                            self.files[loc.file].display()
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// The location of `(layer, expert)`.
    pub fn get(&self, layer: usize, expert: usize) -> Result<&ExpertLocation, ExpertError> {
        let err = |message: String| ExpertError::Unavailable {
            layer,
            expert,
            message,
        };
        match self.layers.get(layer) {
            None => Err(err(format!(
                "layer out of range ({} layers)",
                self.layers.len()
            ))),
            Some(None) => Err(err("not a MoE layer".into())),
            Some(Some(l)) => l
                .get(expert)
                .ok_or_else(|| err(format!("expert out of range (num_experts = {})", l.len()))),
        }
    }

    /// Largest buffer any expert's plan needs (every buffer gets this size, so they are
    /// interchangeable).
    pub fn max_buffer_bytes(&self) -> u64 {
        self.layers
            .iter()
            .flatten()
            .flatten()
            .map(|loc| ReadPlan::new(loc).buf_len)
            .max()
            .unwrap_or(0)
    }

    /// Number of experts over all MoE layers.
    pub fn expert_count(&self) -> usize {
        self.layers.iter().flatten().map(Vec::len).sum()
    }

    /// Whether every expert's six ranges are gap-free.
    pub fn all_contiguous(&self) -> bool {
        self.layers
            .iter()
            .flatten()
            .flatten()
            .all(ExpertLocation::contiguous)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_expert_is_one_aligned_region() {
        let shape = ExpertShape { f: 64, lr: 32 };
        let b = shape.tensor_bytes();
        let mut at = 5000u64;
        let mut ranges = [(0, 0); 6];
        for (r, &len) in ranges.iter_mut().zip(&b) {
            *r = (at, len);
            at += len;
        }
        let loc = ExpertLocation { file: 0, ranges };
        assert!(loc.contiguous());
        let p = ReadPlan::new(&loc);
        assert_eq!(p.regions.len(), 1);
        let r = p.regions[0];
        assert_eq!((r.file_offset, r.buf_offset), (4096, 0));
        assert_eq!(r.len % ALIGN, 0);
        assert_eq!(p.tensor_at[0], 5000 - 4096);
        assert_eq!(p.tensor_at[1], 5000 - 4096 + b[0]);
        assert_eq!(r.need_to, at - 4096);
    }

    #[test]
    fn gaps_split_regions() {
        let loc = ExpertLocation {
            file: 0,
            ranges: [
                (100, 10),
                (110, 5),
                (9000, 10),
                (9010, 5),
                (20000, 10),
                (20010, 5),
            ],
        };
        assert!(!loc.contiguous());
        let p = ReadPlan::new(&loc);
        assert_eq!(p.regions.len(), 3);
        assert_eq!(p.tensor_at[2], 4096 + (9000 - 8192));
        for r in &p.regions {
            assert_eq!(r.buf_offset % ALIGN, 0);
            assert_eq!(r.file_offset % ALIGN, 0);
        }
    }
}
