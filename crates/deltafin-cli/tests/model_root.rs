//! The model root of every command that takes one: `--model-root`, else `DELTAFIN_ROOT`, else
//! `.` (one rule, `RootArg`), and a wrong root named for what it is — a path that does not
//! exist, a file, a directory without an install — before anything else is checked.

mod common;

use common::{stdout_stderr, text};

use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

fn model_root() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        synthesize(d.path(), &SynthSpec::new(SynthDims::tiny(), 13)).unwrap();
        deltafin_k3::synth::remove_at_exit(d.path());
        d
    })
    .path()
}

/// `deltafin` with the weight-exact spine (no conversion needed) and `env`.
fn deltafin(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_deltafin"));
    cmd.args(args)
        .env_remove("DELTAFIN_ROOT")
        .env_remove("K3_MEMORY_BUDGET_GB")
        .env("K3_SPINE", "bf16");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

fn output(args: &[&str], env: &[(&str, &str)]) -> Output {
    deltafin(args, env).output().unwrap()
}

const RUN: [&str; 5] = ["run", "--max-new", "1", "--prompt", "Hi"];

/// `serve --port 0` until it listens: the startup lines, then the server is stopped.
fn serve_startup(env: &[(&str, &str)]) -> Vec<String> {
    let mut child = deltafin(&["serve", "--port", "0"], env)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = Vec::new();
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        let done = line.contains("listening on http://");
        lines.push(line);
        if done {
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    lines
}

#[test]
fn run_and_serve_take_the_root_from_deltafin_root_and_the_flag_wins() {
    let root = model_root().to_str().unwrap();
    let o = output(&RUN, &[("DELTAFIN_ROOT", root)]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        stdout_stderr(&o)
            .1
            .contains(&format!(" model_root={root} ")),
        "{}",
        text(&o)
    );
    let o = output(
        &[&RUN[..], &["--model-root", root]].concat(),
        &[("DELTAFIN_ROOT", "/no/such/install")],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));

    let lines = serve_startup(&[("DELTAFIN_ROOT", root)]);
    assert!(
        lines
            .iter()
            .any(|l| l.contains(&format!(" model_root={root} "))),
        "{lines:?}"
    );
}

#[test]
fn a_root_that_does_not_exist_says_so() {
    for (args, env) in [
        (&["--model-root", "/no/such/install"][..], &[][..]),
        (&[], &[("DELTAFIN_ROOT", "/no/such/install")]),
    ] {
        for cmd in [&RUN[..], &["serve", "--port", "0"]] {
            // The default int8 spine too: a wrong path is not a missing conversion.
            let o = output(
                &[cmd, args].concat(),
                &[env, &[("K3_SPINE", "auto")]].concat(),
            );
            let err = stdout_stderr(&o).1;
            assert_eq!(o.status.code(), Some(1), "{cmd:?} {env:?}: {err}");
            assert!(
                err.contains("model root /no/such/install does not exist"),
                "{cmd:?} {env:?}: {err}"
            );
            assert!(!err.contains("convert-spine-int8"), "{err}");
            assert!(
                !err.contains("setup --model-root /no/such/install"),
                "{err}"
            );
        }
    }
}

#[test]
fn a_root_that_is_no_install_says_what_is_missing() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"").unwrap();
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let config_only = tmp.path().join("config-only");
    std::fs::create_dir(&config_only).unwrap();
    std::fs::copy(
        model_root().join("config.json"),
        config_only.join("config.json"),
    )
    .unwrap();
    for (root, says) in [
        (
            &file,
            format!("model root {} is not a directory", file.display()),
        ),
        (
            &empty,
            format!(
                "no K3 model installed at {}: config.json is missing",
                empty.display()
            ),
        ),
        (
            &config_only,
            format!(
                "no K3 model installed at {}: it has neither model.safetensors.index.json",
                config_only.display()
            ),
        ),
    ] {
        let root = root.to_str().unwrap();
        for cmd in [&RUN[..], &["serve", "--port", "0"]] {
            let o = output(
                &[cmd, &["--model-root", root]].concat(),
                &[("K3_SPINE", "auto")],
            );
            let err = stdout_stderr(&o).1;
            assert_eq!(o.status.code(), Some(1), "{cmd:?} {root}: {err}");
            assert!(err.contains(&says), "{cmd:?}: {err}");
            assert!(!err.contains("convert-spine-int8"), "{err}");
        }
    }
}

/// A fresh tiny install (the commands below write into their root).
fn fresh_root(seed: u64) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    synthesize(d.path(), &SynthSpec::new(SynthDims::tiny(), seed)).unwrap();
    d
}

fn succeeds(o: &Output, what: &str) {
    assert_eq!(o.status.code(), Some(0), "{what}: {}", text(o));
}

/// The commands that write under their model root: with only `DELTAFIN_ROOT` set they write
/// there; with a wrong `DELTAFIN_ROOT` and `--model-root` the flag wins (a rerun over the
/// outputs, which must find them); with only a wrong `DELTAFIN_ROOT` they say it does not
/// exist.
#[test]
fn the_converters_take_the_root_from_deltafin_root_and_the_flag_wins() {
    let cases: [(&[&str], &str); 3] = [
        (&["convert-spine-int8"], "k3-resident-int8"),
        (
            &["pack-spine", "--spine", "bf16", "--layer", "0"],
            "k3-resident-packs-bf16/layer-000.dfsp",
        ),
        (
            &["convert-experts-scale4", "--workers", "1"],
            "k3-experts-scale4/scale4-manifest.json",
        ),
    ];
    for (i, (args, output_path)) in cases.into_iter().enumerate() {
        let d = fresh_root(40 + i as u64);
        let root = d.path().to_str().unwrap();
        let o = output(args, &[("DELTAFIN_ROOT", root)]);
        succeeds(&o, &format!("{args:?} under DELTAFIN_ROOT"));
        assert!(
            d.path().join(output_path).exists(),
            "{args:?}: {}",
            text(&o)
        );

        let o = output(
            &[args, &["--model-root", root]].concat(),
            &[("DELTAFIN_ROOT", "/no/such/install")],
        );
        succeeds(&o, &format!("{args:?} with --model-root"));

        let o = output(args, &[("DELTAFIN_ROOT", "/no/such/install")]);
        let err = stdout_stderr(&o).1;
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("model root /no/such/install does not exist"),
            "{args:?}: {err}"
        );
    }
    // The int8 check re-hashes what the conversion wrote: it found the same root.
    let d = fresh_root(43);
    let root = d.path().to_str().unwrap();
    succeeds(
        &output(&["convert-spine-int8"], &[("DELTAFIN_ROOT", root)]),
        "convert-spine-int8",
    );
    succeeds(
        &output(
            &["convert-spine-int8", "--check", "--model-root", root],
            &[("DELTAFIN_ROOT", "/no/such/install")],
        ),
        "convert-spine-int8 --check",
    );
}

/// `benchmark` resolves the root once and passes it to every run: the campaign records it.
#[test]
fn benchmark_takes_the_root_from_deltafin_root_and_the_flag_wins() {
    let root = model_root().to_str().unwrap();
    let canonical = model_root().canonicalize().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    for (name, extra, env) in [
        ("env", &[][..], root),
        ("flag", &["--model-root", root][..], "/no/such/install"),
    ] {
        let ev = tmp.path().join(name);
        let o = output(
            &[
                &["benchmark", "--reps", "1", "--max-new", "1", "--output-dir"][..],
                &[ev.to_str().unwrap()],
                extra,
            ]
            .concat(),
            &[("DELTAFIN_ROOT", env)],
        );
        succeeds(&o, name);
        let campaign: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(ev.join("campaign.json")).unwrap())
                .unwrap();
        assert_eq!(
            campaign["arguments"]["model_root"],
            canonical.display().to_string(),
            "{name}"
        );
    }
    let o = output(
        &["benchmark", "--reps", "1", "--max-new", "1"],
        &[("DELTAFIN_ROOT", "/no/such/install")],
    );
    let err = stdout_stderr(&o).1;
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("model root /no/such/install does not exist"),
        "{err}"
    );
}

/// Every other command that takes a root reads a wrong `DELTAFIN_ROOT` as that root.
#[test]
fn a_wrong_deltafin_root_is_named_by_every_command() {
    let tmp = tempfile::tempdir().unwrap();
    let text_file = tmp.path().join("t.txt");
    std::fs::write(&text_file, "some text to score").unwrap();
    let file = text_file.to_str().unwrap();
    for args in [&["perplexity", "--file", file][..], &["warm-expert-cache"]] {
        let o = output(args, &[("DELTAFIN_ROOT", "/no/such/install")]);
        let err = stdout_stderr(&o).1;
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("model root /no/such/install does not exist"),
            "{args:?}: {err}"
        );
    }
    let root = model_root().to_str().unwrap();
    let o = output(&["perplexity", "--file", file], &[("DELTAFIN_ROOT", root)]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
}
