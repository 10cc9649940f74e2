//! Removing checkpoints that test binaries share through a `static`.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, Once};

static PATHS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Removes the directory tree at `path` when the process exits (normally or through
/// `std::process::exit`, as the test harness ends). For a checkpoint that a test binary
/// synthesizes once and keeps in a `static`: a value in a `static` is never dropped, so a
/// `tempfile::TempDir` there would stay on disk after every run.
pub fn remove_at_exit(path: &Path) {
    static REGISTER: Once = Once::new();
    extern "C" fn remove_all() {
        // A poisoned lock still holds the paths.
        let paths = PATHS.lock().unwrap_or_else(|e| e.into_inner());
        for p in paths.iter() {
            let _ = std::fs::remove_dir_all(p);
        }
    }
    REGISTER.call_once(|| {
        // SAFETY: `remove_all` is a plain `extern "C"` function that takes no arguments and
        // does not unwind out (it only locks a mutex and removes files).
        unsafe { libc::atexit(remove_all) };
    });
    PATHS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(path.to_path_buf());
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_registered_directory_is_removed_when_the_process_exits() {
        // The removal happens at exit, so a child process runs it: this test binary, asked
        // to run only the helper below.
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("kept-in-a-static");
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "synth::cleanup::tests::helper_registers_a_directory",
                "--ignored",
                "--nocapture",
            ])
            .env("SYNTH_CLEANUP_TEST_DIR", &target)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("created"),
            "the helper did not run: {out:?}"
        );
        assert!(!target.exists(), "{} was left behind", target.display());
    }

    /// Creates `$SYNTH_CLEANUP_TEST_DIR` and registers it.
    #[test]
    #[ignore = "a helper: run in a child process by a_registered_directory_is_removed_when_the_process_exits"]
    fn helper_registers_a_directory() {
        let d = std::path::PathBuf::from(std::env::var_os("SYNTH_CLEANUP_TEST_DIR").unwrap());
        std::fs::create_dir_all(d.join("sub")).unwrap();
        std::fs::write(d.join("sub/f"), b"x").unwrap();
        super::remove_at_exit(&d);
        println!("created {}", d.display());
    }
}
