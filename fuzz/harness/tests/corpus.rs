//! The fuzz corpora as a regression test: every file of `fuzz/corpus/<target>/` (the
//! seeds) and `fuzz/regressions/<target>/` (inputs that once crashed a target) runs through
//! its harness. A panic fails the test and names the file; each target's corpus must hold
//! seeds. The campaigns themselves (`tools/fuzz/run_all.sh`) are not part of CI.

use deltafin_fuzz_harness::{Harness, TARGETS};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The files of `dir`, sorted; none if it does not exist.
fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("read a corpus directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// Runs every input of `name`'s corpus and regressions; returns the failures.
fn run_target(name: &str, harness: Harness) -> Vec<String> {
    let corpus = inputs(&fuzz_dir().join("corpus").join(name));
    let regressions = inputs(&fuzz_dir().join("regressions").join(name));
    let mut failures = Vec::new();
    if corpus.is_empty() {
        failures.push(format!("{name}: fuzz/corpus/{name}/ holds no seeds"));
    }
    for path in corpus.iter().chain(&regressions) {
        let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        // Caught only to name the input; the panic message is printed by the hook as well.
        if catch_unwind(AssertUnwindSafe(|| harness(&data))).is_err() {
            failures.push(format!("{name}: {} panics", path.display()));
        }
    }
    failures
}

#[test]
fn every_target_has_a_fuzz_target_file() {
    for (name, _) in TARGETS {
        let path = fuzz_dir().join("fuzz_targets").join(format!("{name}.rs"));
        assert!(path.is_file(), "{} is missing", path.display());
    }
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).expect("fuzz/Cargo.toml");
    for (name, _) in TARGETS {
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "fuzz/Cargo.toml has no [[bin]] {name}"
        );
    }
}

#[test]
fn corpora_and_regressions_run_clean() {
    // The targets run on a few threads; each harness keeps its scratch files per thread.
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(4));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&(name, harness)) = TARGETS.get(i) else {
                        break;
                    };
                    let f = run_target(name, harness);
                    failures.lock().expect("failure list").extend(f);
                }
            });
        }
    });
    let failures = failures.into_inner().expect("failure list");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
