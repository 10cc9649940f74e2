//! `deltafin convert-experts-scale4` and `K3_EXPERT_SCALE4` end to end on a tiny checkpoint:
//! the sidecars are written from the release shards or from `k3-experts/` files, and `run`
//! with `require` (resident and streaming) emits exactly the tokens and logits of `off`.

mod common;

use common::{checkpoint, jsonl, text};

use deltafin_k3::synth::SynthDims;
use deltafin_store::experts::convert_to_expert_files;
use serde_json::Value;
use std::path::Path;
use std::process::Output;

fn deltafin(args: &[&str], env: &[(&str, &str)]) -> Output {
    // The weight-exact spine (no conversion needed).
    let env = [&[("K3_SPINE", "bf16")], env].concat();
    common::deltafin(args, &["K3_EXPERT_SCALE4", "K3_MEMORY_BUDGET_GB"], &env)
}

/// Tokens and top logits of a short run (events file).
fn run(root: &Path, extra: &[&str], env: &[(&str, &str)]) -> Result<Vec<Value>, String> {
    let ev = root.join(format!("ev-{}.jsonl", extra.len() + env.len()));
    let _ = std::fs::remove_file(&ev);
    let r = root.display().to_string();
    let evs = ev.display().to_string();
    let mut args = vec![
        "run",
        "--model-root",
        &r,
        "--prompt",
        "Sidecars are lossless",
        "--max-new",
        "6",
        "--top-logits",
        "20",
        "--events-jsonl",
        &evs,
    ];
    args.extend(extra);
    let o = deltafin(&args, env);
    if !o.status.success() {
        return Err(text(&o));
    }
    Ok(jsonl(&ev)
        .into_iter()
        .filter_map(|v| {
            let keep = [
                "token_id",
                "top_logits",
                "logsumexp",
                "last_prompt_top_logits",
                "last_prompt_logsumexp",
            ];
            let o: serde_json::Map<String, Value> = v
                .as_object()?
                .iter()
                .filter(|(k, _)| keep.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            (!o.is_empty()).then_some(Value::Object(o))
        })
        .collect())
}

#[test]
fn convert_then_run_with_and_without_sidecars_is_identical() {
    let d = checkpoint(SynthDims::tiny(), 21);
    let root = d.path().display().to_string();
    let off = run(d.path(), &[], &[("K3_EXPERT_SCALE4", "off")]).unwrap();
    assert_eq!(off.len(), 7, "{off:?}"); // the prompt's last position + 6 steps
    let err = run(d.path(), &[], &[("K3_EXPERT_SCALE4", "require")]).unwrap_err();
    assert!(
        err.contains("K3_EXPERT_SCALE4=require") && err.contains("convert-experts-scale4"),
        "{err}"
    );
    let err = run(d.path(), &[], &[("K3_EXPERT_SCALE4", "yes")]).unwrap_err();
    assert!(
        err.contains("K3_EXPERT_SCALE4") && err.contains("auto, off or require"),
        "{err}"
    );

    let o = deltafin(
        &[
            "convert-experts-scale4",
            "--model-root",
            &root,
            "--workers",
            "2",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("layers converted") && text(&o).contains("read probe"),
        "{}",
        text(&o)
    );
    let manifest: Value = serde_json::from_str(
        &std::fs::read_to_string(d.path().join("k3-experts-scale4/scale4-manifest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(manifest["schema"], "deltafin-expert-scale4-v2");
    for env in [
        ("K3_EXPERT_SCALE4", "require"),
        ("K3_EXPERT_SCALE4", "auto"),
    ] {
        assert_eq!(run(d.path(), &[], &[env]).unwrap(), off, "{env:?}");
    }
    let streamed = run(
        d.path(),
        &["--memory-budget-gb", "0.5"],
        &[("K3_EXPERT_SCALE4", "require")],
    );
    assert_eq!(streamed.unwrap(), off);

    // A second run verifies and keeps every layer.
    let o = deltafin(&["convert-experts-scale4", "--model-root", &root], &[]);
    assert!(text(&o).contains("0 layers converted"), "{}", text(&o));

    // From k3-experts/ files as the source, into another output root: the same bytes.
    let ckpt = deltafin_k3::weights::checkpoint::Checkpoint::open(d.path()).unwrap();
    convert_to_expert_files(&ckpt).unwrap();
    let out2 = d.path().join("sc4-from-files");
    let o = deltafin(
        &[
            "convert-experts-scale4",
            "--model-root",
            &root,
            "--output-root",
            &out2.display().to_string(),
            "--no-resume",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        std::fs::read(out2.join("L1.sc4")).unwrap(),
        std::fs::read(d.path().join("k3-experts-scale4/L1.sc4")).unwrap()
    );
}

#[test]
fn bad_flags_are_clear_errors() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().display().to_string();
    for w in ["0", "17", "x"] {
        let o = deltafin(
            &[
                "convert-experts-scale4",
                "--model-root",
                &root,
                "--workers",
                w,
            ],
            &[],
        );
        assert!(!o.status.success());
        assert!(text(&o).contains("--workers"), "{}", text(&o));
    }
    let o = deltafin(&["convert-experts-scale4", "--model-root", &root], &[]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains(&format!(
            "no K3 model installed at {root}: config.json is missing"
        )),
        "{}",
        text(&o)
    );
}
