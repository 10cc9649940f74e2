use crate::model::LogitRows;
use crate::model::layer::{Attention, Ffn};
use crate::model::linear::Linear;
use crate::weights::loader::{EngineOptions, load_model};
use deltafin_store::checkpoint::Checkpoint;
use deltafin_store::spine_int8::*;
use deltafin_tensor::RowInt8Matrix;
use half::f16;
use std::path::Path;
use std::sync::Arc;

/// 14 layers (KDA, MLA, dense, MoE), a 1,024-token vocabulary.
fn small() -> (tempfile::TempDir, Checkpoint) {
    crate::test_util::small_checkpoint(3, false)
}

fn convert_all(ckpt: &Checkpoint, opts: &ConvertOptions) -> ConvertReport {
    convert_spine(ckpt, opts, &mut |_| {}).unwrap()
}

/// Every file under the int8 tensor directory, sorted, with its bytes.
fn snapshot(root: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(tensor_dir(root))
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect();
    v.sort();
    v
}

#[test]
fn converted_spine_loads_as_the_quantization_rule_and_keeps_the_router_bf16() {
    let (dir, ckpt) = small();
    let missing = Int8Spine::open(dir.path(), ckpt.config())
        .unwrap_err()
        .to_string();
    assert!(
        missing.contains("deltafin convert-spine-int8") && missing.contains("--spine bf16"),
        "{missing}"
    );
    let r = convert_all(&ckpt, &ConvertOptions::default());
    assert_eq!(r.converted, r.tensors);
    assert!(r.weight_error.iter().all(|(_, e)| *e > 0.0 && *e < 0.01));
    let ckpt = Arc::new(ckpt);
    let int8 = load_model(
        ckpt.clone(),
        &EngineOptions {
            spine: SpineFormat::Int8,
            ..Default::default()
        },
    )
    .unwrap();
    let bf16 = load_model(ckpt.clone(), &EngineOptions::default()).unwrap();
    let same_rule = |lin: &Linear, name: &str| {
        let Linear::RowInt8(m) = lin else {
            panic!("{name} is not row-int8");
        };
        let want = RowInt8Matrix::from_bf16(name, &ckpt.bf16_matrix(name).unwrap()).unwrap();
        assert_eq!(m.data(), want.data(), "{name}");
        assert_eq!(m.scales(), want.scales(), "{name}");
    };
    same_rule(&int8.lm_head, "lm_head.weight");
    let mut moe_layers = 0;
    for (l, layer) in int8.layers.iter().enumerate() {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        match &layer.attn {
            Attention::Kda(w) => same_rule(&w.o_proj, &p("self_attn.o_proj.weight")),
            Attention::Mla(w) => same_rule(&w.kv_b_proj, &p("self_attn.kv_b_proj.weight")),
        }
        if let Ffn::Moe(m) = &layer.ffn {
            moe_layers += 1;
            same_rule(
                &m.latent_down,
                &p("block_sparse_moe.routed_expert_down_proj.weight"),
            );
            same_rule(
                &m.shared.up_proj,
                &p("block_sparse_moe.shared_experts.up_proj.weight"),
            );
            // The router multiplies the checkpoint's own BF16 bytes, so the routes of an
            // int8 run come from the unquantized router.
            let src = ckpt
                .bf16_matrix(&p("block_sparse_moe.gate.weight"))
                .unwrap();
            assert_eq!(m.router.weight.data(), src.data());
            let Ffn::Moe(mb) = &bf16.layers[l].ffn else {
                unreachable!()
            };
            let d = int8.dims.hidden_size;
            let y: Vec<f32> = (0..3 * d)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                .collect();
            let (ri, rb) = (
                m.router.route(&int8.dims, &y, 3),
                mb.router.route(&bf16.dims, &y, 3),
            );
            assert_eq!(format!("{ri:?}"), format!("{rb:?}"));
        }
    }
    assert!(moe_layers > 0);
    // The int8 model runs; its logits differ from bf16 (quantized) but stay finite and
    // of the same scale (the synthesized model amplifies a router flip, see
    // docs/NUMERICS.md, so no tighter bound holds for every seed).
    let ids = [1u32, 17, 99, 512, 3];
    let a = int8
        .forward(&mut int8.new_state(), &ids, LogitRows::All)
        .unwrap();
    let b = bf16
        .forward(&mut bf16.new_state(), &ids, LogitRows::All)
        .unwrap();
    let num: f64 = a
        .values
        .iter()
        .zip(&b.values)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum();
    let den: f64 = b.values.iter().map(|y| (*y as f64).powi(2)).sum();
    let rel = (num / den).sqrt();
    assert!(a.values.iter().all(|v| v.is_finite()));
    assert!(rel > 0.0 && rel < 1.0, "logit rel-L2 {rel}");
    // Rerunning finds everything complete; --check hashes it all.
    let again = convert_all(&ckpt, &ConvertOptions::default());
    assert_eq!((again.converted, again.read_bytes), (0, 0));
    let v = verify_spine(&ckpt, &mut |_| {}).unwrap();
    assert_eq!(v.tensors, r.tensors);
}

#[test]
fn interrupted_conversion_resumes_byte_identical() {
    let (da, a) = small();
    let (db, b) = small();
    let opts = ConvertOptions {
        checkpoint_rows: 48,
        ..Default::default()
    };
    convert_all(&a, &opts);
    let want = snapshot(da.path());
    // Stop after 100 durable rows each time (mid-tensor: the vocabulary has 1,024 rows).
    let stopping = ConvertOptions {
        stop_after_rows: Some(100),
        ..opts.clone()
    };
    let mut runs = 0;
    let (mut resumed, mut saw_parts) = (0, false);
    loop {
        let r = convert_all(&b, &stopping);
        resumed += r.resumed;
        runs += 1;
        if !r.stopped {
            break;
        }
        let files = snapshot(db.path());
        saw_parts |= files.iter().any(|(n, _)| n.ends_with(".i8.part"))
            && files.iter().any(|(n, _)| n.ends_with(".progress.json"));
        assert!(runs < 10_000, "no progress");
    }
    assert!(runs > 2 && saw_parts);
    assert!(resumed > 0, "no tensor was continued from a checkpoint");
    assert_eq!(snapshot(db.path()), want);

    // --no-resume starts over and ends identical too.
    let (dc, c) = small();
    let partial = convert_all(&c, &stopping);
    assert!(partial.stopped);
    let fresh = convert_all(
        &c,
        &ConvertOptions {
            resume: false,
            ..opts.clone()
        },
    );
    assert_eq!((fresh.resumed, fresh.converted), (0, fresh.tensors));
    assert_eq!(snapshot(dc.path()), want);
}

#[test]
fn a_second_converter_is_locked_out_and_bad_intervals_rejected() {
    let (dir, ckpt) = small();
    std::fs::create_dir_all(tensor_dir(dir.path())).unwrap();
    let held = lock(&dir.path().join(INT8_DIR)).unwrap();
    let e = convert_spine(&ckpt, &ConvertOptions::default(), &mut |_| {}).unwrap_err();
    assert!(matches!(e, SpineError::Locked { .. }), "{e}");
    assert!(e.to_string().contains(".convert.lock"), "{e}");
    drop(held);
    for bad in [0, MAX_CHECKPOINT_ROWS + 1] {
        let e = convert_spine(
            &ckpt,
            &ConvertOptions {
                checkpoint_rows: bad,
                ..Default::default()
            },
            &mut |_| {},
        )
        .unwrap_err();
        assert!(e.to_string().contains("--checkpoint-rows"), "{e}");
    }
}

#[test]
fn damaged_files_are_named_errors() {
    let (dir, ckpt) = small();
    convert_all(
        &ckpt,
        &ConvertOptions {
            checkpoint_rows: 4096,
            ..Default::default()
        },
    );
    let root = dir.path();
    let cfg = ckpt.config();
    let name = "language_model.model.layers.2.self_attn.o_proj.weight";
    let files = TensorFiles::new(root, name);
    let open_err = || Int8Spine::open(root, cfg).unwrap_err().to_string();

    // A truncated code file.
    let codes = std::fs::read(&files.i8).unwrap();
    std::fs::write(&files.i8, &codes[..codes.len() - 1]).unwrap();
    let e = open_err();
    assert!(
        e.contains(name) && e.contains(".i8") && e.contains("truncated"),
        "{e}"
    );
    // Same size, one byte changed: loading does not hash, --check names the file.
    let mut flipped = codes.clone();
    flipped[5] ^= 1;
    std::fs::write(&files.i8, &flipped).unwrap();
    Int8Spine::open(root, cfg).unwrap();
    let e = verify_spine(&ckpt, &mut |_| {}).unwrap_err().to_string();
    assert!(
        e.contains(name) && e.contains(".i8") && e.contains("sha256"),
        "{e}"
    );
    std::fs::write(&files.i8, &codes).unwrap();

    // A NaN scale.
    let scales = std::fs::read(&files.sc).unwrap();
    let mut nan = scales.clone();
    nan[..2].copy_from_slice(&f16::NAN.to_le_bytes());
    std::fs::write(&files.sc, &nan).unwrap();
    let e = open_err();
    assert!(
        e.contains(name) && e.contains(".sc") && e.contains("scale"),
        "{e}"
    );
    // A short scale file.
    std::fs::write(&files.sc, &scales[..2]).unwrap();
    let e = open_err();
    assert!(e.contains(name) && e.contains(".sc"), "{e}");
    std::fs::write(&files.sc, &scales).unwrap();

    // A receipt that is not JSON, a missing receipt, a receipt for other weights.
    let receipt = std::fs::read_to_string(&files.receipt).unwrap();
    std::fs::write(&files.receipt, "{").unwrap();
    let e = open_err();
    assert!(
        e.contains(name) && e.contains("row-i8.json") && e.contains("invalid receipt"),
        "{e}"
    );
    std::fs::remove_file(&files.receipt).unwrap();
    let e = open_err();
    assert!(e.contains(name) && e.contains("convert-spine-int8"), "{e}");
    let other = receipt.replace("\"source_sha256\": \"", "\"source_sha256\": \"00");
    std::fs::write(&files.receipt, other).unwrap();
    Int8Spine::open(root, cfg).unwrap();
    let e = verify_spine(&ckpt, &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains(name) && e.contains("other weights"), "{e}");
    std::fs::write(&files.receipt, &receipt).unwrap();
    Int8Spine::open(root, cfg).unwrap();
    verify_spine(&ckpt, &mut |_| {}).unwrap();
}
