//! Running a stream install (docs/K3.md §12.1, §5.2): the spine is read from
//! `k3-resident/tensors/` by the checkpoint, and the routed experts come from
//! `k3-experts/L{l}-E{e}.bin`; an expert whose file is missing is fetched first, by byte
//! range from the hub's shards (`deltafin_fetch::expert::RemoteExperts`: verified, cached on
//! disk), then read by the wrapped expert source as if it had always been there.

use anyhow::{Context, Result};
use deltafin_experts::{ExpertError, ExpertSource, Layered, PilotGuess, SourceLayer};
use deltafin_fetch::expert::{ExpertFetch, RemoteExperts};
use deltafin_fetch::hub::HubClient;
use deltafin_fetch::manifest::Manifests;
use std::path::Path;

/// The on-demand fetcher of the install at `root`: the K3 manifest (`DELTAFIN_MANIFESTS` or
/// the built-in one), the hub (`HF_ENDPOINT`, `HF_TOKEN`) and the pinned inventory that
/// `deltafin setup --stream` wrote. No network is touched here. Plain HTTP only with
/// `DELTAFIN_INSECURE_HTTP=1`.
pub fn remote_experts(root: &Path) -> Result<RemoteExperts> {
    let ms = Manifests::from_env().context("stream install: loading the source manifests")?;
    let client = HubClient::from_env(false).context("stream install: hub endpoint")?;
    RemoteExperts::open(root, &ms.k3, client).with_context(|| {
        format!(
            "stream install at {}: cannot open the expert inventory (rerun `deltafin setup --stream`)",
            root.display()
        )
    })
}

/// The [`SourceLayer`] of a stream install: before the inner source reads an expert, its
/// `k3-experts/` file is made present through `fetch` (a no-op without network when the
/// file is already complete). Everything else passes through ([`Layered`]).
pub struct FetchingExperts {
    fetch: Box<dyn ExpertFetch>,
    root: std::path::PathBuf,
}

impl FetchingExperts {
    /// `inner` (which reads the `k3-experts/` files under `root`) with this layer on top.
    pub fn new(
        root: &Path,
        fetch: Box<dyn ExpertFetch>,
        inner: Box<dyn ExpertSource>,
    ) -> Layered<FetchingExperts> {
        Layered::new(
            inner,
            FetchingExperts {
                fetch,
                root: root.to_path_buf(),
            },
        )
    }

    fn present(&self, layer: usize, expert: usize) -> bool {
        deltafin_fetch::plan::expert_path(&self.root, layer, expert).is_file()
    }
}

impl SourceLayer for FetchingExperts {
    /// Make the expert's file present, fetching it when missing.
    fn prepare(&self, layer: usize, expert: usize) -> Result<(), ExpertError> {
        self.fetch
            .fetch_expert(layer, expert)
            .map_err(|e| ExpertError::Unavailable {
                layer,
                expert,
                message: format!(
                    "not in k3-experts/ of this stream install, and fetching it from the hub failed: {e}"
                ),
            })?;
        Ok(())
    }
    fn begin_layer(&self, inner: &dyn ExpertSource, layer: usize, experts: &[usize]) {
        // Fetch what is missing before the inner source starts reading. A failed fetch is
        // reported by `expert` (which tries again and returns the hub's error). The inner
        // source then knows every pending expert, so `next_ready` passes through.
        for &e in experts {
            let _ = self.prepare(layer, e);
        }
        inner.begin_layer(layer, experts)
    }
    fn predict(&self, inner: &dyn ExpertSource, layer: usize, rows: usize, guesses: &[PilotGuess]) {
        // A guess never triggers a download; only experts already on disk are prefetched.
        let present: Vec<PilotGuess> = guesses
            .iter()
            .copied()
            .filter(|g| self.present(layer, g.expert))
            .collect();
        inner.predict(layer, rows, &present)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltafin_experts::ExpertWeights;
    use deltafin_fetch::FetchError;
    use deltafin_k3::model::moe::InMemoryExperts;
    use std::path::PathBuf;

    struct Offline;
    impl ExpertFetch for Offline {
        fn fetch_expert(&self, _: usize, _: usize) -> Result<PathBuf, FetchError> {
            Err(FetchError::Invalid("connection refused".into()))
        }
    }

    #[test]
    fn a_failed_fetch_names_layer_expert_and_the_hub_error() {
        let dir = tempfile::tempdir().unwrap();
        let src = FetchingExperts::new(
            dir.path(),
            Box::new(Offline),
            Box::new(InMemoryExperts::default()),
        );
        src.begin_layer(2, &[5]);
        let err = src.expert(2, 5).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("expert 5 of layer 2"), "{msg}");
        assert!(msg.contains("connection refused"), "{msg}");
        assert!(!src.layer().present(2, 5));
    }

    /// An inner source that writes down the scheduling calls it receives.
    #[derive(Clone, Default)]
    struct Calls(std::sync::Arc<std::sync::Mutex<Vec<String>>>);
    impl ExpertSource for Calls {
        fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError> {
            InMemoryExperts::default().expert(layer, expert)
        }
        fn begin_layer(&self, layer: usize, experts: &[usize]) {
            self.0
                .lock()
                .unwrap()
                .push(format!("begin {layer} {experts:?}"));
        }
        fn next_ready(&self, layer: usize, pending: &[usize]) -> usize {
            self.0
                .lock()
                .unwrap()
                .push(format!("next_ready {layer} {pending:?}"));
            pending.len() - 1
        }
        fn wants_prediction(&self) -> bool {
            true
        }
        fn predict(&self, layer: usize, rows: usize, guesses: &[PilotGuess]) {
            let ids: Vec<usize> = guesses.iter().map(|g| g.expert).collect();
            self.0
                .lock()
                .unwrap()
                .push(format!("predict {layer} {rows} {ids:?}"));
        }
        fn stats(&self) -> Option<deltafin_experts::ExpertStats> {
            Some(deltafin_experts::ExpertStats {
                read_threads: 7,
                ..Default::default()
            })
        }
    }

    #[test]
    fn every_hint_reaches_the_inner_source_and_guesses_only_name_present_experts() {
        let dir = tempfile::tempdir().unwrap();
        let present = deltafin_fetch::plan::expert_path(dir.path(), 3, 6);
        std::fs::create_dir_all(present.parent().unwrap()).unwrap();
        std::fs::write(&present, b"bytes").unwrap();
        let calls = Calls::default();
        let src = FetchingExperts::new(dir.path(), Box::new(Offline), Box::new(calls.clone()));
        src.begin_layer(2, &[1, 4]);
        assert_eq!(src.next_ready(2, &[1, 4, 5]), 2);
        assert!(src.wants_prediction());
        assert_eq!(src.stats().map(|s| s.read_threads), Some(7));
        let guess = |expert| PilotGuess {
            expert,
            rank: 0,
            votes: 1,
        };
        src.predict(3, 5, &[guess(6), guess(7)]);
        assert_eq!(
            *calls.0.lock().unwrap(),
            [
                "begin 2 [1, 4]",
                "next_ready 2 [1, 4, 5]",
                "predict 3 5 [6]"
            ]
        );
    }
}
