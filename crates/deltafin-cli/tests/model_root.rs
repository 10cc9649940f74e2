//! The model root of `run` and `serve`: `--model-root`, else `DELTAFIN_ROOT`, else `.` (as
//! `setup` and `doctor` resolve it), and a wrong root named for what it is — a path that does
//! not exist, a file, a directory without an install — before anything else is checked.

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
