//! The install lock of a model root (docs/SETUP.md, "The install lock"): one lock file,
//! `k3-meta/install.lock`, so that no two writers ever share a `.part` file or publish over
//! each other.
//!
//! - The installers (`setup` and its steps, `fetch-weights`) hold the whole file for as long
//!   as they write, and write who they are into it for the message a refused writer prints.
//! - Each routed-expert fetch (a stream install's on-demand fetcher in `run` or `serve`,
//!   `warm-expert-cache --fetch`) holds one byte of it, at the expert's index, for the time
//!   of that one expert: fetches of different experts, in one process or several, run side
//!   by side; two fetches of the same expert run one after the other, and the second finds
//!   the file complete.
//!
//! The kernel drops a lock when its holder exits or is killed, so a crash never leaves a
//! stale lock. A whole-file holder and any expert holder exclude each other.

use crate::error::FetchError;
use deltafin_k3::weights::filelock::{Holder, RangeLock, Span, try_lock_span};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The lock file, under the model root.
pub const INSTALL_LOCK: &str = "k3-meta/install.lock";

/// How long an installer waits for the expert fetches in flight to finish before it refuses.
pub const INSTALLER_WAIT: Duration = Duration::from_secs(30);

/// How long an expert fetch waits for another fetch of the same expert to finish.
pub const EXPERT_WAIT: Duration = Duration::from_secs(600);

const POLL: Duration = Duration::from_millis(20);

/// The lock file's path at `root`.
pub fn lock_path(root: &Path) -> PathBuf {
    root.join(INSTALL_LOCK)
}

/// A held install lock (the whole file or one expert's byte); dropping it releases it.
#[derive(Debug)]
pub struct InstallLock {
    held: RangeLock,
    whole: bool,
}

impl Drop for InstallLock {
    fn drop(&mut self) {
        if self.whole {
            // Best effort: the next refused writer then names nobody stale.
            let _ = self.held.file().set_len(0);
        }
    }
}

fn open_failed(path: &Path) -> impl FnOnce(std::io::Error) -> FetchError + '_ {
    move |source| FetchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Who wrote themselves into the lock file (an installer), or a generic description.
fn installer_named_in(path: &Path) -> String {
    let mut s = String::new();
    let named = std::fs::File::open(path)
        .and_then(|f| f.take(256).read_to_string(&mut s))
        .is_ok_and(|_| !s.trim().is_empty());
    if named {
        s.trim().to_string()
    } else {
        "another deltafin installer".to_string()
    }
}

fn take(path: &Path, span: Span, wait: Duration) -> Result<Result<RangeLock, Holder>, FetchError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(open_failed(dir))?;
    }
    let start = Instant::now();
    loop {
        match try_lock_span(path, span).map_err(open_failed(path))? {
            Ok(l) => return Ok(Ok(l)),
            // An installer holds the root: waiting would stall for as long as it runs.
            Err(Holder::Whole) => return Ok(Err(Holder::Whole)),
            Err(h) if start.elapsed() >= wait => return Ok(Err(h)),
            Err(_) => std::thread::sleep(POLL),
        }
    }
}

/// Take the whole install lock of `root` for the installer `what` (e.g. `deltafin setup`),
/// waiting up to `wait` for expert fetches in flight; refused with a message naming the
/// holder when another installer holds it or the fetches do not stop.
pub fn lock_install(root: &Path, what: &str, wait: Duration) -> Result<InstallLock, FetchError> {
    let path = lock_path(root);
    match take(&path, Span::Whole, wait)? {
        Ok(held) => {
            let mut f = held.file();
            let me = format!("`{what}` (pid {})", std::process::id());
            f.set_len(0)
                .and_then(|()| f.rewind())
                .and_then(|()| f.write_all(me.as_bytes()))
                .map_err(open_failed(&path))?;
            Ok(InstallLock { held, whole: true })
        }
        Err(Holder::Whole) => Err(FetchError::Busy(format!(
            "{what}: {} is already installing into {} (it holds {}); wait for it to finish or stop it",
            installer_named_in(&path),
            root.display(),
            path.display()
        ))),
        Err(Holder::Range) => Err(FetchError::Busy(format!(
            "{what}: a running deltafin is still fetching experts into {} after {} s (a stream \
             install's `run` or `serve`, or `warm-expert-cache --fetch`); stop it and rerun",
            root.display(),
            wait.as_secs()
        ))),
    }
}

/// The lock index of expert `expert` of layer `layer` with `per_layer` experts a layer.
pub fn expert_index(layer: usize, expert: usize, per_layer: usize) -> Result<u64, FetchError> {
    (layer as u64)
        .checked_mul(per_layer as u64)
        .and_then(|i| i.checked_add(expert as u64))
        .ok_or_else(|| {
            FetchError::Invalid(format!(
                "expert {expert} of layer {layer}: no lock index with {per_layer} experts a layer"
            ))
        })
}

/// Take the lock of routed expert `index` ([`expert_index`]) (its position in the layer-major order) at
/// `root`, waiting up to `wait` for another fetch of the same expert; refused at once while
/// an installer holds the root.
pub fn lock_expert(root: &Path, index: u64, wait: Duration) -> Result<InstallLock, FetchError> {
    let path = lock_path(root);
    // Byte 0 is never an expert's: a whole-file holder and readers of the name agree on it.
    let at = index.checked_add(1).ok_or_else(|| {
        FetchError::Invalid(format!("expert index {index} is out of range for the lock"))
    })?;
    match take(&path, Span::Byte(at), wait)? {
        Ok(held) => Ok(InstallLock { held, whole: false }),
        Err(Holder::Whole) => Err(FetchError::Busy(format!(
            "cannot fetch an expert into {}: {} is installing into it (it holds {}); rerun when it is done",
            root.display(),
            installer_named_in(&path),
            path.display()
        ))),
        Err(Holder::Range) => Err(FetchError::Busy(format!(
            "another fetch of the same expert into {} did not finish within {} s",
            root.display(),
            wait.as_secs()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_installer_is_refused_naming_the_first() {
        let d = tempfile::tempdir().unwrap();
        let first = lock_install(d.path(), "deltafin setup", Duration::ZERO).unwrap();
        // Refused at once, however long it would wait for expert fetches.
        let t = Instant::now();
        let e =
            lock_install(d.path(), "deltafin fetch-weights", Duration::from_secs(60)).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        let msg = e.to_string();
        assert!(msg.contains("`deltafin setup` (pid "), "{msg}");
        assert!(msg.contains("install.lock"), "{msg}");
        // An expert fetch is refused at once, naming the installer too.
        let e = lock_expert(d.path(), 5, Duration::from_secs(60)).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(e.to_string().contains("`deltafin setup`"), "{e}");
        drop(first);
        assert!(lock_install(d.path(), "deltafin fetch-weights", Duration::ZERO).is_ok());
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn expert_fetches_share_the_root_and_an_installer_waits_for_them() {
        let d = tempfile::tempdir().unwrap();
        let a = lock_expert(d.path(), 0, Duration::ZERO).unwrap();
        let b = lock_expert(d.path(), 1, Duration::ZERO).unwrap();
        // The same expert waits for its holder.
        assert!(lock_expert(d.path(), 0, Duration::ZERO).is_err());
        let e = lock_install(d.path(), "deltafin setup", Duration::ZERO).unwrap_err();
        assert!(e.to_string().contains("still fetching experts"), "{e}");
        // An installer that waits gets the root once the fetches end.
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop((a, b));
        });
        let held = lock_install(d.path(), "deltafin setup", Duration::from_secs(20)).unwrap();
        release.join().unwrap();
        drop(held);
    }
}
