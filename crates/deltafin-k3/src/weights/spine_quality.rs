//! The int8-vs-bf16 quality report (docs/K3.md §12.6 ⚠, §10 row 3): the weight error of
//! every quantized tensor, and the end-to-end drift of the int8 model against the
//! weight-exact bf16 model over teacher-forced sequences.
//!
//! Per position `p` of each sequence (both models see the same tokens):
//! - logit drift `‖z₈ − z₁₆‖ / ‖z₁₆‖`;
//! - top-1 agreement `argmax z₈ = argmax z₁₆` (the greedy choice);
//! - next-token NLL `−log softmax(z)[x_{p+1}]` under each model (positions with a next token).

use crate::error::ModelError;
use crate::generate::greedy;
use crate::model::LogitRows;
use crate::weights::loader::{EngineOptions, LoadError, SpineFormat, load_model};
use deltafin_store::checkpoint::Checkpoint;
use deltafin_store::spine_int8::{TensorFiles, quantized_tensors};
use std::sync::Arc;

/// The measured report.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct QualityReport {
    /// Quantized tensors and their weight rel-RMS: mean, max and the worst tensor.
    pub tensors: usize,
    pub weight_rel_rms_mean: f64,
    pub weight_rel_rms_max: f64,
    pub worst_tensor: String,
    /// Teacher-forced positions compared.
    pub positions: usize,
    /// Logit rel-L2 per position: mean, median, max.
    pub logit_rel_l2_mean: f64,
    pub logit_rel_l2_median: f64,
    pub logit_rel_l2_max: f64,
    /// Fraction of positions whose greedy (argmax) token agrees.
    pub top1_agreement: f64,
    /// Mean next-token NLL (nats) of each model, and the mean |difference| per position.
    pub nll_bf16: f64,
    pub nll_int8: f64,
    pub nll_abs_diff_mean: f64,
}

/// An error of the report: loading either model or a forward pass.
#[derive(Debug, thiserror::Error)]
pub enum QualityError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{0}")]
    Input(String),
}

fn nll(z: &[f32], target: u32) -> f64 {
    let m = z.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = m + z.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
    lse - z[target as usize] as f64
}

/// Compare the int8 spine (which must be converted) with bf16 over `sequences` (token ids,
/// each at least one token).
pub fn quality_report(
    ckpt: Arc<Checkpoint>,
    sequences: &[Vec<u32>],
) -> Result<QualityReport, QualityError> {
    if sequences.is_empty() || sequences.iter().any(|s| s.is_empty()) {
        return Err(QualityError::Input(
            "the quality report needs at least one non-empty sequence".into(),
        ));
    }
    let mut r = QualityReport::default();
    let mut worst = (0f64, String::new());
    let mut sum = 0f64;
    for spec in quantized_tensors(ckpt.config()) {
        let files = TensorFiles::new(ckpt.root(), &spec.name);
        let text = std::fs::read_to_string(&files.receipt)
            .map_err(|e| QualityError::Input(format!("{}: {e}", files.receipt.display())))?;
        let receipt: deltafin_store::spine_int8::Receipt = serde_json::from_str(&text)
            .map_err(|e| QualityError::Input(format!("{}: {e}", files.receipt.display())))?;
        sum += receipt.weight_rel_rms;
        r.tensors += 1;
        if receipt.weight_rel_rms > worst.0 {
            worst = (receipt.weight_rel_rms, spec.name.clone());
        }
    }
    r.weight_rel_rms_mean = sum / r.tensors.max(1) as f64;
    (r.weight_rel_rms_max, r.worst_tensor) = worst;

    let load = |spine| {
        load_model(
            ckpt.clone(),
            &EngineOptions {
                spine,
                ..Default::default()
            },
        )
    };
    let (m16, m8) = (load(SpineFormat::Bf16)?, load(SpineFormat::Int8)?);
    let vocab = m16.dims.vocab_size;
    let mut drift = Vec::new();
    let (mut agree, mut n_nll) = (0usize, 0usize);
    let (mut nll16, mut nll8, mut nll_diff) = (0f64, 0f64, 0f64);
    for seq in sequences {
        let a = m16.forward(&mut m16.new_state(), seq, LogitRows::All)?;
        let b = m8.forward(&mut m8.new_state(), seq, LogitRows::All)?;
        for p in 0..seq.len() {
            let (z16, z8) = (a.row(p), b.row(p));
            let num: f64 = z8
                .iter()
                .zip(z16)
                .map(|(x, y)| ((x - y) as f64).powi(2))
                .sum();
            let den: f64 = z16.iter().map(|y| (*y as f64).powi(2)).sum();
            drift.push((num / den.max(1e-300)).sqrt());
            agree += usize::from(greedy(z16) == greedy(z8));
            if let Some(&next) = seq.get(p + 1)
                && (next as usize) < vocab
            {
                let (x, y) = (nll(z16, next), nll(z8, next));
                nll16 += x;
                nll8 += y;
                nll_diff += (x - y).abs();
                n_nll += 1;
            }
        }
    }
    r.positions = drift.len();
    r.logit_rel_l2_mean = drift.iter().sum::<f64>() / drift.len() as f64;
    r.logit_rel_l2_max = drift.iter().fold(0f64, |a, &b| a.max(b));
    drift.sort_by(f64::total_cmp);
    r.logit_rel_l2_median = drift[drift.len() / 2];
    r.top1_agreement = agree as f64 / r.positions as f64;
    let k = n_nll.max(1) as f64;
    (r.nll_bf16, r.nll_int8, r.nll_abs_diff_mean) = (nll16 / k, nll8 / k, nll_diff / k);
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{SynthDims, SynthSpec, synthesize};
    use deltafin_store::spine_int8::{ConvertOptions, convert_spine};

    #[test]
    fn tiny_quality_report_within_loose_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let dims = SynthDims {
            vocab: 1024,
            ..SynthDims::tiny()
        };
        synthesize(dir.path(), &SynthSpec::new(dims, 7)).unwrap();
        let ckpt = Arc::new(Checkpoint::open(dir.path()).unwrap());
        assert!(
            quality_report(ckpt.clone(), &[vec![1, 2]]).is_err(),
            "not converted"
        );
        convert_spine(&ckpt, &ConvertOptions::default(), &mut |_| {}).unwrap();
        let seqs: Vec<Vec<u32>> = (0..3u32)
            .map(|s| (0..24).map(|i| (i * 131 + s * 977 + 5) % 1024).collect())
            .collect();
        let r = quality_report(ckpt, &seqs).unwrap();
        assert_eq!(r.positions, 72);
        assert!(r.tensors > 100);
        // ≈ 0.4% weight error (uniform-ish synthesized rows), never above 1%.
        assert!(
            r.weight_rel_rms_mean > 1e-3 && r.weight_rel_rms_max < 1e-2,
            "{r:?}"
        );
        assert!(
            r.logit_rel_l2_median > 0.0 && r.logit_rel_l2_median < 0.5,
            "{r:?}"
        );
        assert!(r.top1_agreement > 0.5, "{r:?}");
        assert!(r.nll_bf16.is_finite() && r.nll_int8.is_finite());
        // The synthesized model is confident (large logits, ≈ 17 nats on these arbitrary
        // sequences): bound the NLL change relative to the NLL.
        assert!(r.nll_abs_diff_mean < 0.1 * r.nll_bf16, "{r:?}");
        eprintln!("{r:#?}");
        assert!(quality_report(Arc::new(Checkpoint::open(dir.path()).unwrap()), &[]).is_err());
    }
}
