//! `deltafin upgrade`: fast-forward the git checkout this binary was built from and rebuild
//! it with the recorded build profile (product contract §7). Model data is never touched: the
//! command only runs `git fetch`, `git merge --ff-only` and `cargo build`.
//!
//! The rebuild ignores the build environment of the shell (`RUSTFLAGS`, `CARGO_PROFILE_*`,
//! `CARGO_TARGET_DIR`, `LIBTORCH`, `CC`, …: [`is_build_variable`]): it is removed from the
//! build's environment, so the new binary is built with the recorded profile and features
//! and nothing else, into the checkout's own `target/`.
//!
//! Test-only overrides (documented in docs/OPERATIONS.md): `DELTAFIN_UPGRADE_REPO` names the
//! checkout instead of searching for it, and `DELTAFIN_UPGRADE_BUILD_CMD` replaces the cargo
//! build with a `sh -c` command run in the checkout.

use crate::buildinfo;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// Files and directories that identify a deltafin checkout.
pub const CHECKOUT_MARKERS: [&str; 4] = [
    ".git",
    "Cargo.toml",
    "Cargo.lock",
    "crates/deltafin-cli/Cargo.toml",
];

/// How many ancestors of the running binary are searched for the checkout.
pub const MAX_ANCESTORS: usize = 8;

fn is_checkout(dir: &Path) -> bool {
    CHECKOUT_MARKERS.iter().all(|m| dir.join(m).exists())
}

/// The checkout: `DELTAFIN_UPGRADE_REPO` (tests), else the nearest of the binary's ancestors
/// (at most [`MAX_ANCESTORS`] levels up), else the current directory.
fn locate_checkout() -> Result<PathBuf> {
    if let Some(dir) = crate::env::env_var("DELTAFIN_UPGRADE_REPO")? {
        let dir = PathBuf::from(dir);
        if !is_checkout(&dir) {
            bail!(
                "DELTAFIN_UPGRADE_REPO={} is not a deltafin checkout (it needs {})",
                dir.display(),
                CHECKOUT_MARKERS.join(", ")
            );
        }
        return Ok(dir);
    }
    let exe = std::env::current_exe().context("cannot locate the running binary")?;
    let exe = exe.canonicalize().unwrap_or(exe);
    for dir in exe.ancestors().skip(1).take(MAX_ANCESTORS) {
        if is_checkout(dir) {
            return Ok(dir.to_path_buf());
        }
    }
    let cwd = std::env::current_dir().context("cannot read the current directory")?;
    if is_checkout(&cwd) {
        return Ok(cwd);
    }
    bail!(
        "no deltafin checkout found: neither the {MAX_ANCESTORS} directories above {} nor the current directory {} hold {}.\n\
         Run `deltafin upgrade` from the checkout, or update it by hand (`git pull --ff-only && cargo build --locked --release -p deltafin-cli`).",
        exe.display(),
        cwd.display(),
        CHECKOUT_MARKERS.join(", ")
    )
}

/// Run `git -C repo args…` to completion; only failing to start git is an error.
fn git_output(repo: &Path, args: &[&str]) -> Result<std::process::Output> {
    Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(args)
        .output()
        .context("cannot run git (is it installed and on PATH?)")
}

/// Run `git -C repo args…` and return its trimmed stdout; a failure is an error naming the
/// command and carrying git's message.
fn git(repo: &Path, args: &[&str]) -> Result<String> {
    let out = git_output(repo, args)?;
    if !out.status.success() {
        bail!(
            "`git {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// `git` that may fail: `None` on a non-zero exit.
fn git_opt(repo: &Path, args: &[&str]) -> Result<Option<String>> {
    let out = git_output(repo, args)?;
    Ok(out
        .status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string()))
}

/// The cargo command line that rebuilds this binary with its recorded profile and features.
pub fn rebuild_args() -> Vec<String> {
    let mut args: Vec<String> = vec!["build".into(), "--locked".into()];
    if buildinfo::PROFILE == "release" {
        args.push("--release".into());
    }
    args.push("-p".into());
    args.push("deltafin-cli".into());
    let features = buildinfo::features();
    if !features.is_empty() {
        args.push("--features".into());
        args.push(features.join(","));
    }
    args
}

/// Whether `name` is a variable that changes what cargo, rustc or a build script builds (or
/// where): compiler flags and wrappers, the toolchain, cargo's profile, build and target
/// settings, C toolchains, and the original deltafin's build variables (LibTorch, CUDA and
/// ROCm build switches, `DELTAFIN_BUILD_*`). `upgrade` builds without them.
pub fn is_build_variable(name: &str) -> bool {
    const EXACT: &[&str] = &[
        "RUSTFLAGS",
        "RUSTDOCFLAGS",
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTC_BOOTSTRAP",
        "RUSTUP_TOOLCHAIN",
        "CARGO_INCREMENTAL",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_ENCODED_RUSTDOCFLAGS",
        "CC",
        "CXX",
        "AR",
        "CFLAGS",
        "CXXFLAGS",
        "CPPFLAGS",
        "LDFLAGS",
        "LIBTORCH",
        "DELTAFIN_TORCH_ROOT",
        "DELTAFIN_CUDA_MOE",
        "DELTAFIN_CUDA_ARCHITECTURES",
        "DELTAFIN_HIPCC",
        "DELTAFIN_HIP_ARCHITECTURES",
        "HIP_PATH",
        "ROCM_PATH",
    ];
    const PREFIXES: &[&str] = &[
        "CARGO_PROFILE_",
        "CARGO_BUILD_",
        "CARGO_TARGET_",
        "CARGO_FEATURE_",
        "LIBTORCH_",
        "DELTAFIN_BUILD_",
        "CC_",
        "CXX_",
        "AR_",
        "CFLAGS_",
        "CXXFLAGS_",
    ];
    EXACT.contains(&name) || PREFIXES.iter().any(|p| name.starts_with(p))
}

/// The build variables set in this process's environment ([`is_build_variable`]), sorted.
fn build_variables_set() -> Vec<String> {
    let mut names: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter(|k| is_build_variable(k))
        .collect();
    names.sort();
    names
}

/// Refuse an in-progress merge, rebase, cherry-pick or revert.
fn check_no_operation_in_progress(repo: &Path) -> Result<()> {
    for marker in [
        "MERGE_HEAD",
        "rebase-merge",
        "rebase-apply",
        "CHERRY_PICK_HEAD",
        "REVERT_HEAD",
    ] {
        let p = git(repo, &["rev-parse", "--git-path", marker])?;
        let p = if Path::new(&p).is_absolute() {
            PathBuf::from(p)
        } else {
            repo.join(p)
        };
        if p.exists() {
            bail!(
                "refusing to upgrade: a git operation is in progress in {} ({marker} exists); finish or abort it first",
                repo.display()
            );
        }
    }
    Ok(())
}

/// Fast-forward and rebuild. Exit status 0 when up to date or upgraded; an error otherwise.
pub fn upgrade() -> Result<ExitCode> {
    let repo = locate_checkout()?;
    println!("Deltafin safe native upgrade");
    println!("repository: {}", repo.display());
    println!("model weights and caches are not touched");
    println!(
        "build profile: {} (target {}, features {})",
        buildinfo::PROFILE,
        buildinfo::TARGET,
        buildinfo::features_text()
    );

    let dirty = git(
        repo.as_path(),
        &["status", "--porcelain", "--untracked-files=no"],
    )?;
    if !dirty.is_empty() {
        let listed: Vec<&str> = dirty.lines().take(10).collect();
        bail!(
            "refusing to upgrade: the working tree of {} has uncommitted changes to tracked files:\n{}\nCommit or stash them first.",
            repo.display(),
            listed.join("\n")
        );
    }
    check_no_operation_in_progress(&repo)?;
    let Some(branch) = git_opt(&repo, &["symbolic-ref", "--quiet", "--short", "HEAD"])? else {
        bail!(
            "refusing to upgrade: {} is not on a branch (detached HEAD); check out a branch that tracks an upstream",
            repo.display()
        );
    };
    let Some(upstream) = git_opt(
        &repo,
        &["rev-parse", "--abbrev-ref", "--symbolic-full-name", "@{u}"],
    )?
    else {
        bail!(
            "refusing to upgrade: branch `{branch}` has no upstream; set one with `git branch --set-upstream-to=<remote>/<branch> {branch}`"
        );
    };
    println!("branch: {branch} (upstream {upstream})");
    git(&repo, &["fetch", "--quiet"])
        .context("cannot fetch the upstream (the network or the remote is unavailable)")?;
    let counts = git(
        &repo,
        &["rev-list", "--left-right", "--count", "HEAD...@{u}"],
    )?;
    let nums: Vec<u64> = counts
        .split_whitespace()
        .map(|s| s.parse::<u64>())
        .collect::<std::result::Result<_, _>>()
        .with_context(|| format!("unexpected `git rev-list --count` output {counts:?}"))?;
    let [ahead, behind] = nums[..] else {
        bail!("unexpected `git rev-list --count` output {counts:?}");
    };
    match (ahead, behind) {
        (_, 0) if ahead > 0 => {
            println!(
                "{ahead} local commit{} ahead of {upstream} left alone; nothing to fetch. Already up to date.",
                if ahead == 1 { "" } else { "s" }
            );
            return Ok(ExitCode::SUCCESS);
        }
        (0, 0) => {
            println!("Already up to date with {upstream}; nothing to rebuild.");
            return Ok(ExitCode::SUCCESS);
        }
        (0, _) => {}
        _ => bail!(
            "refusing to upgrade: branch `{branch}` has diverged from {upstream} ({ahead} local and {behind} upstream commits); reconcile them by hand (git rebase or merge), then rerun"
        ),
    }
    let before = git(&repo, &["rev-parse", "--short", "HEAD"])?;
    git(&repo, &["merge", "--ff-only", "--quiet", "@{u}"])?;
    let after = git(&repo, &["rev-parse", "--short", "HEAD"])?;
    println!("fast-forwarded {before}..{after} ({behind} commits)");

    let ignored = build_variables_set();
    if !ignored.is_empty() {
        println!(
            "ignoring the build environment (the rebuild uses the recorded profile): {}",
            ignored.join(", ")
        );
    }
    let clean = |mut c: Command| {
        for k in &ignored {
            c.env_remove(k);
        }
        c
    };
    let status = match crate::env::env_var("DELTAFIN_UPGRADE_BUILD_CMD")? {
        Some(cmd) => {
            println!("rebuilding (test override): {cmd}");
            let mut c = clean(Command::new("sh"));
            c.arg("-c")
                .arg(&cmd)
                .current_dir(&repo)
                .status()
                .with_context(|| format!("cannot run the build command `{cmd}`"))?
        }
        None => {
            let args = rebuild_args();
            println!("rebuilding: cargo {}", args.join(" "));
            let mut c = clean(Command::new("cargo"));
            c.args(&args)
                .current_dir(&repo)
                .status()
                .context("cannot run cargo (is the Rust toolchain on PATH?)")?
        }
    };
    if !status.success() {
        bail!(
            "the rebuild failed ({status}); the checkout is already at {after}: fix the build and run `cargo {}` in {}",
            rebuild_args().join(" "),
            repo.display()
        );
    }
    // CARGO_TARGET_DIR is a build variable: the build always writes the checkout's target/.
    let artifact = repo
        .join("target")
        .join(if buildinfo::PROFILE == "release" {
            "release"
        } else {
            "debug"
        })
        .join(format!("deltafin{}", std::env::consts::EXE_SUFFIX));
    if !artifact.is_file() {
        bail!(
            "the rebuild finished but {} does not exist",
            artifact.display()
        );
    }
    match crate::elfdeps::audit(&artifact) {
        Ok(crate::elfdeps::LoaderDeps::Needed(names)) => println!(
            "loader audit: {} direct dynamic dependencies, no Python runtime",
            names.len()
        ),
        Ok(crate::elfdeps::LoaderDeps::NotElf) => {
            println!("loader audit skipped: the artifact is not an ELF file")
        }
        Err(e) => bail!("the rebuilt binary failed the loader audit: {e}"),
    }
    println!(
        "Upgrade complete: {}. Downloaded models and caches remain in place.",
        artifact.display()
    );
    Ok(ExitCode::SUCCESS)
}
