//! What the engine says while it loads. The library never prints; a caller that wants the
//! startup lines (the `deltafin` CLI writes them to stderr) implements [`LoadProgress`].

/// Receives the load's report lines and the progress of its huge-page copies. Every method
/// has a no-op default; [`Silent`] is the implementation that ignores everything.
pub trait LoadProgress: Send + Sync {
    /// A startup line: what was loaded and where (the CLI prefixes `[deltafin] `).
    fn info(&self, _line: &str) {}
    /// A note: a setting that has no effect, or a fallback (the CLI prefixes
    /// `deltafin: note: `).
    fn note(&self, _line: &str) {}
    /// A copy of `what` into huge-page memory starts (a K3 spine is tens of GB).
    fn copy_started(&self, _what: &str) {}
    /// `bytes` more of the `total` bytes of the running copy are done.
    fn copy_advanced(&self, _bytes: u64, _total: u64) {}
    /// The running copy ended.
    fn copy_finished(&self) {}
}

/// Reports nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct Silent;

impl LoadProgress for Silent {}

/// Run `copy` of `what` with its byte progress going to `progress`.
pub(crate) fn with_copy_progress<T>(
    progress: &dyn LoadProgress,
    what: &str,
    copy: impl FnOnce(&(dyn Fn(u64, u64) + Sync)) -> T,
) -> T {
    progress.copy_started(what);
    let out = copy(&|bytes, total| progress.copy_advanced(bytes, total));
    progress.copy_finished();
    out
}
