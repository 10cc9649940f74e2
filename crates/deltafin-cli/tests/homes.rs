//! Expert homes (docs/K3.md §12.11): `deltafin place-experts` copies the routed experts into
//! plain directories standing in for drives, each copy verified, resumably; `run
//! --expert-homes` under a memory budget reads them and emits the same tokens; a damaged
//! copy is read elsewhere, a missing home or one of another model is an error naming it.

mod common;

use common::{checkpoint, deltafin_bf16, exits, fails_with, stdout_stderr};
use deltafin_k3::synth::SynthDims;
use std::path::Path;
use std::process::Output;

const UNSET: &[&str] = &[
    "K3_MEMORY_BUDGET_GB",
    "K3_PILOT_GATE",
    "K3_EXPERT_PIN_GB",
    "K3_EXPERT_HOMES",
];

fn deltafin(root: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let env = [&[("K3_EXPERT_HEAT", "off")], env].concat();
    deltafin_bf16(root, args, UNSET, &env)
}

fn joined(dirs: &[&Path]) -> String {
    dirs.iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(",")
}

const RUN: &[&str] = &["run", "--prompt", "Expert homes keep", "--max-new", "8"];

#[test]
fn placed_homes_are_verified_resumable_and_give_the_same_tokens() {
    let root = checkpoint(SynthDims::tiny_streaming(), 3);
    let root = root.path();
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let homes = joined(&[a.path(), b.path()]);

    // The plan: bytes per home and free space; nothing is written.
    let dry = deltafin(
        root,
        &["place-experts", "--homes", &homes, "--dry-run"],
        &[],
    );
    let out = exits(&dry, 0);
    assert!(out.contains("to place") && out.contains("free"), "{out}");
    assert!(!a.path().join("deltafin-experts").exists());

    let placed = deltafin(root, &["place-experts", "--homes", &homes], &[]);
    let out = exits(&placed, 0);
    assert!(out.contains("copies placed and verified"), "{out}");
    // Resumed: nothing left.
    let again = exits(
        &deltafin(root, &["place-experts", "--homes", &homes], &[]),
        0,
    );
    assert!(again.contains("total: 0 copies to place"), "{again}");

    let resident = deltafin(root, RUN, &[]);
    let want = stdout_stderr(&resident).0;
    exits(&resident, 0);
    let budget = [RUN, &["--memory-budget-gb", "0.2", "--stats"]].concat();
    let with_homes = [&budget[..], &["--expert-homes", &homes]].concat();
    let o = deltafin(root, &with_homes, &[]);
    let err = stdout_stderr(&o).1;
    assert!(o.status.success(), "{err}");
    // `--stats` prints speed lines instead of the text: the tokens are compared without it.
    let homes_run = [
        RUN,
        &["--memory-budget-gb", "0.2", "--expert-homes", &homes],
    ]
    .concat();
    let same = deltafin(root, &homes_run, &[]);
    assert_eq!(stdout_stderr(&same).0, want, "{}", stdout_stderr(&same).1);
    assert!(err.contains("expert_homes=2"), "{err}");
    assert!(
        err.contains(" homes=") && err.contains("home_fallbacks=0"),
        "{err}"
    );
    // The homes served the reads (bytes > 0 on both).
    let homes_field = err
        .split(" homes=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_default()
        .to_string();
    for part in homes_field.split(',') {
        let bytes: u64 = part.rsplit(':').next().unwrap_or("0").parse().unwrap_or(0);
        assert!(bytes > 0, "{homes_field}");
    }
    // The same tokens through K3_EXPERT_HOMES, without --stats.
    let env_run = deltafin(
        root,
        &[RUN, &["--memory-budget-gb", "0.2"]].concat(),
        &[("K3_EXPERT_HOMES", &homes)],
    );
    assert_eq!(
        stdout_stderr(&env_run).0,
        want,
        "{}",
        stdout_stderr(&env_run).1
    );

    // A damaged copy: every slot of home a's first layer file gets a flipped byte. The run
    // still emits the same tokens (the copies fail their checksum and are read elsewhere).
    let files = a.path().join("deltafin-experts");
    let layer_file = std::fs::read_dir(&files)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "experts"))
        .min()
        .unwrap();
    let mut bytes = std::fs::read(&layer_file).unwrap();
    for x in bytes.iter_mut().step_by(4096) {
        *x ^= 0x40;
    }
    std::fs::write(&layer_file, bytes).unwrap();
    let o = deltafin(root, &homes_run, &[]);
    let (out, err) = stdout_stderr(&o);
    assert!(o.status.success(), "{err}");
    assert_eq!(out, want, "{err}");
    assert!(err.contains("fails its CRC-32 check"), "{err}");
    // --check finds them, drops them, and a rerun places them again.
    let check = deltafin(root, &["place-experts", "--homes", &homes, "--check"], &[]);
    let out = exits(&check, 1);
    assert!(out.contains("dropped"), "{out}");
    let replaced = exits(
        &deltafin(root, &["place-experts", "--homes", &homes], &[]),
        0,
    );
    assert!(!replaced.contains("total: 0 copies"), "{replaced}");
    exits(
        &deltafin(root, &["place-experts", "--homes", &homes, "--check"], &[]),
        0,
    );

    // A home that is not there is an error naming it.
    let gone = a.path().join("unplugged");
    let o = deltafin(
        root,
        &[
            &budget[..],
            &["--expert-homes", &joined(&[&gone, b.path()])],
        ]
        .concat(),
        &[],
    );
    let err = fails_with(&o, "not mounted");
    assert!(err.contains(&gone.display().to_string()), "{err}");
    // A home of another model (the same config, other weights) is refused.
    let other = checkpoint(SynthDims::tiny_streaming(), 4);
    let o = deltafin(other.path(), &with_homes, &[]);
    fails_with(&o, "another model");
    let o = deltafin(other.path(), &["place-experts", "--homes", &homes], &[]);
    fails_with(&o, "another model");
    // Bad values name the flag.
    fails_with(
        &deltafin(
            root,
            &[&budget[..], &["--expert-homes", "a,,b"]].concat(),
            &[],
        ),
        "--expert-homes",
    );
}

#[test]
fn doctor_probes_each_home_and_fails_a_missing_one() {
    let root = checkpoint(SynthDims::tiny_streaming(), 5);
    let root = root.path();
    let a = tempfile::tempdir().unwrap();
    let homes = a.path().display().to_string();
    exits(
        &deltafin(
            root,
            &["place-experts", "--homes", &homes, "--replicas", "1"],
            &[],
        ),
        0,
    );
    let o = deltafin(
        root,
        &[
            "doctor",
            "--memory-budget-gb",
            "0.2",
            "--expert-homes",
            &homes,
        ],
        &[],
    );
    let (out, _) = stdout_stderr(&o);
    let line = out
        .lines()
        .find(|l| l.contains(&format!("expert home {homes}")))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains("[ ok ]") && line.contains("GB/s"), "{line}");
    let gone = a.path().join("unplugged");
    let o = deltafin(
        root,
        &["doctor", "--expert-homes", &gone.display().to_string()],
        &[],
    );
    let out = exits(&o, 1);
    assert!(
        out.contains("[FAIL] expert homes") && out.contains("not mounted"),
        "{out}"
    );
}
