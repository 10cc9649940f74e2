//! `deltafin pack-spine`: packs every layer, skips complete packs on a rerun, redoes `.part`
//! leftovers, verifies (`--verify-only`) and names a flipped byte's file, rejects an
//! out-of-range `--layer` and an int8 run without the int8 spine.

use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use std::path::Path;
use std::process::{Command, Output};

fn small_checkpoint(seed: u64) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let dims = SynthDims {
        vocab: 1024,
        ..SynthDims::tiny()
    };
    synthesize(d.path(), &SynthSpec::new(dims, seed)).unwrap();
    d
}

fn deltafin(args: &[&str], root: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args(args)
        .arg("--model-root")
        .arg(root)
        .env_remove("K3_SPINE")
        .output()
        .unwrap()
}

fn ok(o: &Output) -> String {
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    out
}

fn err(o: &Output) -> String {
    assert!(!o.status.success());
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn pack_spine_bf16_resume_verify_and_corruption() {
    let d = small_checkpoint(11);
    let root = d.path();
    let out = root.join("k3-resident-packs-bf16");
    let layers = std::fs::read_dir(root)
        .unwrap()
        .filter(|e| {
            let n = e.as_ref().unwrap().file_name();
            n.to_string_lossy().ends_with(".safetensors")
        })
        .count()
        - 3;
    // One layer first (a partial run), with a torn leftover of another.
    ok(&deltafin(
        &["pack-spine", "--spine", "bf16", "--layer", "1"],
        root,
    ));
    assert!(out.join("layer-001.dfsp").is_file());
    assert!(!out.join("layer-000.dfsp").exists());
    std::fs::write(out.join("layer-002.dfsp.part"), b"torn").unwrap();
    let s = ok(&deltafin(&["pack-spine", "--spine", "bf16"], root));
    assert!(
        s.contains(&format!(
            "packed {} of {} pack(s) (1 complete",
            layers,
            layers + 1
        )),
        "{s}"
    );
    assert!(s.contains("1 .part leftover(s) redone"), "{s}");
    assert!(!out.join("layer-002.dfsp.part").exists());
    assert!(out.join("globals.dfsp").is_file());
    let s = ok(&deltafin(&["pack-spine", "--spine", "bf16"], root));
    assert!(s.contains(&format!("packed 0 of {}", layers + 1)), "{s}");
    let s = ok(&deltafin(
        &["pack-spine", "--spine", "bf16", "--verify-only"],
        root,
    ));
    assert!(
        s.contains(&format!("{} bf16 pack(s) OK", layers + 1)),
        "{s}"
    );

    // A flipped payload byte: verify names the file and the chunk.
    let f = out.join("layer-003.dfsp");
    let mut b = std::fs::read(&f).unwrap();
    b[65536 + 10] ^= 1;
    std::fs::write(&f, &b).unwrap();
    let e = err(&deltafin(
        &["pack-spine", "--spine", "bf16", "--verify-only"],
        root,
    ));
    assert!(e.contains("layer-003.dfsp") && e.contains("chunk 0"), "{e}");

    // int8 packs without the int8 spine: the error says how to make it.
    let e = err(&deltafin(
        &[
            "pack-spine",
            "--spine",
            "int8",
            "--verify-only",
            "--output",
            out.to_str().unwrap(),
        ],
        root,
    ));
    assert!(e.contains("convert-spine-int8"), "{e}");

    let e = err(&deltafin(
        &[
            "pack-spine",
            "--spine",
            "bf16",
            "--layer",
            &layers.to_string(),
        ],
        root,
    ));
    assert!(e.contains("out of range"), "{e}");
}

#[test]
fn pack_spine_int8_needs_the_int8_spine_then_packs_it() {
    let d = small_checkpoint(12);
    let root = d.path();
    let e = err(&deltafin(&["pack-spine"], root));
    assert!(e.contains("convert-spine-int8"), "{e}");
    ok(&deltafin(
        &["convert-spine-int8", "--checkpoint-rows", "65536"],
        root,
    ));
    let s = ok(&deltafin(&["pack-spine", "--layer", "0"], root));
    assert!(s.contains("packed 1 of 1"), "{s}");
    let out = root.join("k3-resident-packs");
    assert!(out.join("layer-000.dfsp").is_file());
    ok(&deltafin(
        &["pack-spine", "--layer", "0", "--verify-only"],
        root,
    ));
    // The int8 pack under the bf16 root: rejected as the wrong format.
    let bf = root.join("k3-resident-packs-bf16");
    std::fs::create_dir_all(&bf).unwrap();
    std::fs::copy(out.join("layer-000.dfsp"), bf.join("layer-000.dfsp")).unwrap();
    let e = err(&deltafin(
        &[
            "pack-spine",
            "--spine",
            "bf16",
            "--layer",
            "0",
            "--verify-only",
        ],
        root,
    ));
    assert!(
        e.contains("holds the int8 spine where bf16 packs belong"),
        "{e}"
    );
}
