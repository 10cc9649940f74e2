//! The full hash check of a converted spine ([`verify_spine`]).

use super::convert::*;
use super::format::*;
use crate::checkpoint::Checkpoint;
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::Read;
use std::path::Path;

/// Result of a full check.
#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    pub tensors: usize,
    pub bytes_hashed: u64,
}

pub(super) fn sha256_file(name: &str, path: &Path) -> Result<(String, u64), SpineError> {
    let mut f = File::open(path).map_err(|e| tensor_err(name, path, e.to_string()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f
            .read(&mut buf)
            .map_err(|e| tensor_err(name, path, e.to_string()))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((hex::encode(h.finalize()), n))
}

/// Re-hash every output and its BF16 source against the receipts (`convert-spine-int8
/// --check`). The first mismatch is an error naming the tensor and the file.
pub fn verify_spine(
    ckpt: &Checkpoint,
    progress: &mut dyn FnMut(&ConvertProgress),
) -> Result<VerifyReport, SpineError> {
    let root = ckpt.root();
    if !int8_spine_present(root) {
        return Err(SpineError::NotConverted {
            dir: tensor_dir(root),
            root: root.to_path_buf(),
        });
    }
    let specs = quantized_tensors(ckpt.config());
    let total_bytes: u64 = specs.iter().map(|s| s.byte_len() as u64).sum();
    let mut report = VerifyReport::default();
    let mut done_bytes = 0;
    for spec in &specs {
        let name = spec.name.as_str();
        let files = TensorFiles::new(root, name);
        let r = read_receipt(name, &files)?;
        check_receipt(spec, &files, &r)?;
        for (path, want) in [(&files.i8, &r.i8_sha256), (&files.sc, &r.sc_sha256)] {
            let (got, n) = sha256_file(name, path)?;
            report.bytes_hashed += n;
            if &got != want {
                return Err(tensor_err(
                    name,
                    path,
                    format!(
                        "sha256 {got} does not match the receipt's {want} (corrupt: rerun `deltafin convert-spine-int8 --no-resume`)"
                    ),
                ));
            }
        }
        let src = ckpt.tensor_bytes(name)?;
        let got = hex::encode(Sha256::digest(src.as_slice()));
        report.bytes_hashed += src.len() as u64;
        if got != r.source_sha256 {
            return Err(tensor_err(
                name,
                &files.receipt,
                format!(
                    "the checkpoint's BF16 bytes hash to {got}, the receipt records {}: the int8 spine was converted from other weights",
                    r.source_sha256
                ),
            ));
        }
        report.tensors += 1;
        done_bytes += spec.byte_len() as u64;
        progress(&ConvertProgress {
            tensor: name,
            done_bytes,
            total_bytes,
        });
    }
    Ok(report)
}
