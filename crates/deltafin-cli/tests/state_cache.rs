//! `deltafin run --state-cache`: a repeated or extended prompt resumes from the state the
//! previous process left in `k3-meta/state-cache/` and prints exactly what a cold run
//! prints; `off` leaves nothing; a bad value is named.

mod common;

use common::{checkpoint, deltafin_bf16};
use deltafin_k3::synth::SynthDims;
use std::path::Path;
use std::process::Output;

const UNSET: &[&str] = &[
    "K3_STATE_CACHE",
    "K3_STATE_CACHE_RAM_GB",
    "K3_STATE_CACHE_DISK_GB",
    "K3_REASONING_EFFORT",
    "K3_DSPARK",
    "K3_UAG_DRAFT",
];

fn run(root: &Path, prompt: &str, cache: &str) -> Output {
    deltafin_bf16(
        root,
        &[
            "run",
            "--prompt",
            prompt,
            "--max-new",
            "8",
            "--state-cache",
            cache,
        ],
        UNSET,
        &[],
    )
}

fn ok(o: &Output) -> (String, String) {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{err}");
    (String::from_utf8_lossy(&o.stdout).into_owned(), err)
}

fn entries(root: &Path) -> usize {
    std::fs::read_dir(root.join("k3-meta").join("state-cache"))
        .map(|d| {
            d.flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "k3state"))
                .count()
        })
        .unwrap_or(0)
}

#[test]
fn repeated_prompts_resume_from_the_disk_tier_with_the_same_text() {
    let root = checkpoint(SynthDims::tiny(), 11);
    let long: String = (0..60)
        .map(|i| format!("line {i} of a long prompt; "))
        .collect();
    let cold = ok(&run(root.path(), &long, "off")).0;
    assert_eq!(entries(root.path()), 0, "--state-cache off stores nothing");
    let (first, err) = ok(&run(root.path(), &long, "on"));
    assert_eq!(first, cold);
    assert!(!err.contains("restored from the state cache"), "{err}");
    assert_eq!(entries(root.path()), 1);
    // A second process: the same prompt, then a longer one.
    let (again, err) = ok(&run(root.path(), &long, "on"));
    assert_eq!(again, cold);
    assert!(err.contains("restored from the state cache"), "{err}");
    let longer = format!("{long} and a few more words at the end.");
    let cold_longer = ok(&run(root.path(), &longer, "off")).0;
    let (warm_longer, err) = ok(&run(root.path(), &longer, "on"));
    assert_eq!(warm_longer, cold_longer);
    assert!(err.contains("restored from the state cache"), "{err}");
    // A damaged entry is reported, never used, and the text is still the cold one.
    for e in std::fs::read_dir(root.path().join("k3-meta/state-cache"))
        .unwrap()
        .flatten()
    {
        let mut b = std::fs::read(e.path()).unwrap();
        let i = b.len() - 40;
        b[i] ^= 1;
        std::fs::write(e.path(), b).unwrap();
    }
    let (after, err) = ok(&run(root.path(), &long, "on"));
    assert_eq!(after, cold);
    assert!(err.contains("damaged"), "{err}");
    // Bad values are named.
    let o = run(root.path(), &long, "maybe");
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--state-cache"));
    let o = deltafin_bf16(
        root.path(),
        &["run", "--prompt", "x", "--max-new", "1"],
        UNSET,
        &[("K3_STATE_CACHE_DISK_GB", "-1")],
    );
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("K3_STATE_CACHE_DISK_GB"));
}
