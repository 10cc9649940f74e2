//! `deltafin upgrade` against a local bare repository: fast-forward and rebuild, and the
//! refusals (dirty tree, diverged branch, no upstream, failed build, not a checkout).
//!
//! The checkout and the rebuild command are overridden with the test-only variables
//! `DELTAFIN_UPGRADE_REPO` and `DELTAFIN_UPGRADE_BUILD_CMD`, so no cargo build runs.

mod common;

use common::{assert_says, exits};

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fake build: writes both profile artifacts and a marker file.
const FAKE_BUILD: &str = "mkdir -p target/debug target/release && printf built > target/debug/deltafin && printf built > target/release/deltafin && echo ran >> build-ran.txt";

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args([
            "-c",
            "user.name=Deltafin Test",
            "-c",
            "user.email=test@deltafin.invalid",
            "-c",
            "commit.gpgsign=false",
            "-c",
            "init.defaultBranch=main",
        ])
        .args(args)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn commit_file(dir: &Path, file: &str, content: &str) {
    let p = dir.join(file);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, content).unwrap();
    git(dir, &["add", file]);
    git(dir, &["commit", "-q", "-m", &format!("update {file}")]);
}

/// A commit upstream (made in the seed and pushed) that the checkout does not have yet.
fn push_upstream(r: &Repos, file: &str, content: &str) {
    commit_file(&r.seed, file, content);
    git(&r.seed, &["push", "-q"]);
}

struct Repos {
    _tmp: tempfile::TempDir,
    /// Where upstream commits are made and pushed from.
    seed: PathBuf,
    /// The checkout under test (tracks origin/main).
    clone: PathBuf,
}

fn setup() -> Repos {
    let tmp = tempfile::tempdir().unwrap();
    let bare = tmp.path().join("upstream.git");
    let seed = tmp.path().join("seed");
    let clone = tmp.path().join("clone");
    std::fs::create_dir_all(&bare).unwrap();
    git(&bare, &["init", "-q", "--bare", "-b", "main"]);
    std::fs::create_dir_all(&seed).unwrap();
    git(&seed, &["init", "-q", "-b", "main"]);
    commit_file(&seed, "Cargo.toml", "[workspace]\n");
    commit_file(&seed, "Cargo.lock", "# lock\n");
    commit_file(&seed, "crates/deltafin-cli/Cargo.toml", "[package]\n");
    commit_file(
        &seed,
        ".gitignore",
        "target/\nbuild-ran.txt\n*.safetensors\n",
    );
    git(&seed, &["remote", "add", "origin", bare.to_str().unwrap()]);
    git(&seed, &["push", "-q", "-u", "origin", "main"]);
    git(
        tmp.path(),
        &[
            "clone",
            "-q",
            bare.to_str().unwrap(),
            clone.to_str().unwrap(),
        ],
    );
    Repos {
        _tmp: tmp,
        seed,
        clone,
    }
}

fn upgrade(repo: &Path, build: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .arg("upgrade")
        .env("DELTAFIN_UPGRADE_REPO", repo)
        .env("DELTAFIN_UPGRADE_BUILD_CMD", build)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env_remove("CARGO_TARGET_DIR")
        .output()
        .unwrap()
}

fn head(dir: &Path) -> String {
    git(dir, &["rev-parse", "HEAD"])
}

#[test]
fn fast_forwards_rebuilds_and_leaves_model_data_alone() {
    let r = setup();
    // Model data in the checkout: untracked and ignored files.
    std::fs::create_dir_all(r.clone.join("k3-experts")).unwrap();
    std::fs::write(r.clone.join("k3-experts/L1-E0.bin"), b"expert").unwrap();
    std::fs::write(r.clone.join("model-00001.safetensors"), b"weights").unwrap();
    push_upstream(&r, "src.rs", "fn main() {}\n");

    let t = exits(&upgrade(&r.clone, FAKE_BUILD), 0);
    assert_says(
        &t,
        &[
            "Deltafin safe native upgrade",
            "model weights and caches are not touched",
            "build profile: ",
            "fast-forwarded",
            "loader audit skipped",
            "Upgrade complete: ",
            "Downloaded models and caches remain in place.",
        ],
    );
    assert_eq!(head(&r.clone), head(&r.seed));
    assert!(r.clone.join("src.rs").is_file());
    assert_eq!(
        std::fs::read_to_string(r.clone.join("build-ran.txt")).unwrap(),
        "ran\n"
    );
    assert_eq!(
        std::fs::read(r.clone.join("k3-experts/L1-E0.bin")).unwrap(),
        b"expert"
    );
    assert_eq!(
        std::fs::read(r.clone.join("model-00001.safetensors")).unwrap(),
        b"weights"
    );

    // Up to date: nothing fetched, no rebuild.
    let t = exits(&upgrade(&r.clone, FAKE_BUILD), 0);
    assert!(t.contains("Already up to date"), "{t}");
    assert_eq!(
        std::fs::read_to_string(r.clone.join("build-ran.txt")).unwrap(),
        "ran\n",
        "no rebuild when nothing changed"
    );
}

#[test]
fn refuses_a_dirty_tree() {
    let r = setup();
    push_upstream(&r, "src.rs", "fn main() {}\n");
    std::fs::write(r.clone.join("Cargo.toml"), "[workspace]\n# local edit\n").unwrap();
    let before = head(&r.clone);
    let t = exits(&upgrade(&r.clone, FAKE_BUILD), 1);
    assert_says(&t, &["uncommitted changes", "Cargo.toml"]);
    assert_eq!(head(&r.clone), before);
    assert!(!r.clone.join("build-ran.txt").exists());
}

#[test]
fn refuses_a_diverged_branch_and_leaves_ahead_commits_alone() {
    let r = setup();
    commit_file(&r.clone, "local.txt", "mine\n");
    let local = head(&r.clone);
    // Only ahead: left alone.
    let t = exits(&upgrade(&r.clone, FAKE_BUILD), 0);
    assert!(t.contains("1 local commit ahead"), "{t}");
    assert_eq!(head(&r.clone), local);
    // Upstream moves too: diverged.
    push_upstream(&r, "theirs.txt", "theirs\n");
    let t = exits(&upgrade(&r.clone, FAKE_BUILD), 1);
    assert_says(&t, &["diverged", "1 local and 1 upstream"]);
    assert_eq!(head(&r.clone), local);
    assert!(!r.clone.join("build-ran.txt").exists());
}

#[test]
fn refuses_a_branch_without_upstream_and_a_detached_head() {
    let r = setup();
    git(&r.clone, &["checkout", "-q", "-b", "local-only"]);
    let t = exits(&upgrade(&r.clone, FAKE_BUILD), 1);
    assert!(t.contains("branch `local-only` has no upstream"), "{t}");

    git(&r.clone, &["checkout", "-q", "--detach"]);
    let t = exits(&upgrade(&r.clone, FAKE_BUILD), 1);
    assert!(t.contains("detached HEAD"), "{t}");
}

#[test]
fn a_failed_build_is_reported_and_a_non_checkout_refused() {
    let r = setup();
    push_upstream(&r, "src.rs", "fn main() {}\n");
    let t = exits(&upgrade(&r.clone, "exit 3"), 1);
    assert_says(&t, &["the rebuild failed", "cargo build --locked"]);
    assert_eq!(
        head(&r.clone),
        head(&r.seed),
        "the fast-forward itself happened"
    );

    let empty = tempfile::tempdir().unwrap();
    let t = exits(&upgrade(empty.path(), FAKE_BUILD), 1);
    assert!(t.contains("is not a deltafin checkout"), "{t}");

    let out = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args(["upgrade", "--now"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "upgrade accepts no arguments");
}

/// The rebuild ignores the shell's build environment: compiler flags, cargo profile and target
/// settings, the original's LibTorch variables never reach the build, which writes the
/// checkout's own target/ (the recorded profile decides everything).
#[test]
fn the_rebuild_ignores_build_environment_variables() {
    let r = setup();
    push_upstream(&r, "src.rs", "fn main() {}\n");
    let build = format!("env > build-env.txt && {FAKE_BUILD}");
    let out = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .arg("upgrade")
        .env("DELTAFIN_UPGRADE_REPO", &r.clone)
        .env("DELTAFIN_UPGRADE_BUILD_CMD", &build)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("RUSTFLAGS", "-C target-cpu=native")
        .env("CARGO_PROFILE_RELEASE_LTO", "fat")
        .env("CARGO_TARGET_DIR", "/elsewhere")
        .env("LIBTORCH", "/opt/libtorch")
        .env("CC", "clang")
        .env("K3_KEEP_ME", "1")
        .output()
        .unwrap();
    let t = exits(&out, 0);
    assert_says(
        &t,
        &[
            "ignoring the build environment",
            "CARGO_PROFILE_RELEASE_LTO",
            "CARGO_TARGET_DIR",
            "LIBTORCH",
            "RUSTFLAGS",
            "Upgrade complete: ",
        ],
    );
    let env = std::fs::read_to_string(r.clone.join("build-env.txt")).unwrap();
    for name in [
        "RUSTFLAGS=",
        "CARGO_PROFILE_RELEASE_LTO=",
        "CARGO_TARGET_DIR=",
        "LIBTORCH=",
        "CC=",
    ] {
        assert!(
            !env.lines().any(|l| l.starts_with(name)),
            "{name} reached the build: {env}"
        );
    }
    assert!(env.lines().any(|l| l == "K3_KEEP_ME=1"), "{env}");
    // The artifact is looked for in the checkout's target/, not CARGO_TARGET_DIR.
    assert!(
        t.contains(&r.clone.join("target").display().to_string()),
        "{t}"
    );
}
