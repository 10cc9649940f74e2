//! What the model asks of a routed-expert store: [`ExpertSource`], the weights it hands out
//! ([`ExpertWeights`]) and the PILOT guesses it may receive ([`PilotGuess`]); and
//! [`Layered`], the one wrapper through which a source that changes what an inner source
//! serves ([`SourceLayer`]: scale4 sidecars, on-demand fetching) forwards everything else.

use crate::error::ExpertError;
use crate::stats::ExpertStats;
use deltafin_tensor::Mxfp4Matrix;

/// One routed expert's three MXFP4 matrices (cheap to clone: the bytes are shared).
#[derive(Clone, Debug)]
pub struct ExpertWeights {
    /// `w1` gate `[F, Lr]`.
    pub w1: Mxfp4Matrix,
    /// `w2` down `[Lr, F]`.
    pub w2: Mxfp4Matrix,
    /// `w3` up `[F, Lr]`.
    pub w3: Mxfp4Matrix,
}

impl ExpertWeights {
    /// Check the three shapes: `w1`, `w3` `[f, lr]`, `w2` `[lr, f]`. The error names the
    /// checkpoint tensor at fault.
    pub fn check_shape(
        &self,
        f: usize,
        lr: usize,
        layer: usize,
        expert: usize,
    ) -> Result<(), ShapeMismatch> {
        for (name, m, rows, cols) in [
            ("w1", &self.w1, f, lr),
            ("w2", &self.w2, lr, f),
            ("w3", &self.w3, f, lr),
        ] {
            if m.rows() != rows || m.cols() != cols {
                return Err(ShapeMismatch {
                    tensor: format!(
                        "model.layers.{layer}.block_sparse_moe.experts.{expert}.{name}"
                    ),
                    expected: format!("[{rows}, {cols}]"),
                    found: format!("[{}, {}]", m.rows(), m.cols()),
                });
            }
        }
        Ok(())
    }
}

/// A routed-expert matrix whose shape disagrees with the model dimensions.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tensor `{tensor}`: expected shape {expected}, found {found}")]
pub struct ShapeMismatch {
    pub tensor: String,
    pub expected: String,
    pub found: String,
}

/// One PILOT guess: an expert the next layer's router, run on this layer's input, chose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PilotGuess {
    /// Expert id.
    pub expert: usize,
    /// Its best position over the pass's rows in the guessed route order (0 = some row's top
    /// choice).
    pub rank: usize,
    /// Rows whose guessed route holds it.
    pub votes: usize,
}

/// The guesses of one pass from each row's guessed route (ids in route order: descending
/// router score), most confident first: by best rank, then by votes (descending), then by id.
pub fn rank_guesses<'a>(routes: impl IntoIterator<Item = &'a [usize]>) -> Vec<PilotGuess> {
    let mut by_id: std::collections::BTreeMap<usize, PilotGuess> = Default::default();
    for ids in routes {
        for (rank, &expert) in ids.iter().enumerate() {
            let g = by_id.entry(expert).or_insert(PilotGuess {
                expert,
                rank,
                votes: 0,
            });
            g.rank = g.rank.min(rank);
            g.votes += 1;
        }
    }
    let mut out: Vec<PilotGuess> = by_id.into_values().collect();
    out.sort_by(|a, b| {
        a.rank
            .cmp(&b.rank)
            .then(b.votes.cmp(&a.votes))
            .then(a.expert.cmp(&b.expert))
    });
    out
}

/// Where routed-expert weights come from (memory, a page cache, a disk stream, ...).
///
/// The model calls [`ExpertSource::begin_layer`] with the union of a pass's routes before it
/// asks for those experts one by one (ascending id), and, when
/// [`ExpertSource::wants_prediction`] says so, [`ExpertSource::predict`] with a guess of the
/// next MoE layer's union. Neither hint changes which bytes an expert has, only when they are
/// read, so routing and numerics never depend on them. Watching the routes (heat, traces) is
/// not a source's business: see [`crate::observe`].
///
/// The hints have do-nothing defaults so that a source that reads nothing ahead implements
/// [`ExpertSource::expert`] alone. A source that wraps another one is a [`SourceLayer`] inside
/// [`Layered`], which forwards every method (a method added here is added to both).
pub trait ExpertSource: Send + Sync {
    /// Expert `expert` of MoE layer `layer`.
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError>;

    /// The experts this pass needs at `layer` (ascending, no duplicates), in the order they
    /// will be requested. A streaming source starts reading them now.
    fn begin_layer(&self, _layer: usize, _experts: &[usize]) {}

    /// Which of `pending` (experts of `layer` this pass still has to request, from the
    /// route union) to request next, as an index into `pending`: a streaming source blocks
    /// until one of them is in memory and names it, so the model multiplies hits first and
    /// misses in the order their reads complete. The default, 0, keeps the union's order.
    /// Only the request order changes, never a result (each expert's product lands in its
    /// own slot and the weighted sum runs in route order).
    fn next_ready(&self, _layer: usize, _pending: &[usize]) -> usize {
        0
    }

    /// Whether [`ExpertSource::predict`] is worth calling (it costs one extra router product).
    fn wants_prediction(&self) -> bool {
        false
    }

    /// A guess (PILOT: the next layer's router on this layer's input) of the union `layer`
    /// will need, for a pass of `rows` tokens, most confident first (see [`rank_guesses`]);
    /// precision and recall are measured against the later [`ExpertSource::begin_layer`].
    fn predict(&self, _layer: usize, _rows: usize, _guesses: &[PilotGuess]) {}

    /// Counters so far (`None` for sources that do no I/O).
    fn stats(&self) -> Option<ExpertStats> {
        None
    }
}

/// What a wrapping source changes about the source below it. [`Layered`] is the
/// [`ExpertSource`] that applies it: an expert is [`SourceLayer::prepare`]d, read from the
/// inner source, then [`SourceLayer::adapt`]ed; every scheduling method receives the `inner`
/// source and by default passes the call through unchanged, so a layer writes only the
/// methods it changes.
pub trait SourceLayer: Send + Sync {
    /// Before the inner source is asked for `expert` of `layer`: make it servable (e.g. put
    /// its file in place). An error is the answer of [`ExpertSource::expert`].
    fn prepare(&self, _layer: usize, _expert: usize) -> Result<(), ExpertError> {
        Ok(())
    }

    /// The inner source's weights of `expert` of `layer`, changed in place into what this
    /// layer serves (e.g. other scale bytes).
    fn adapt(
        &self,
        _layer: usize,
        _expert: usize,
        _weights: &mut ExpertWeights,
    ) -> Result<(), ExpertError> {
        Ok(())
    }

    /// [`ExpertSource::begin_layer`].
    fn begin_layer(&self, inner: &dyn ExpertSource, layer: usize, experts: &[usize]) {
        inner.begin_layer(layer, experts)
    }

    /// [`ExpertSource::next_ready`].
    fn next_ready(&self, inner: &dyn ExpertSource, layer: usize, pending: &[usize]) -> usize {
        inner.next_ready(layer, pending)
    }

    /// [`ExpertSource::wants_prediction`].
    fn wants_prediction(&self, inner: &dyn ExpertSource) -> bool {
        inner.wants_prediction()
    }

    /// [`ExpertSource::predict`].
    fn predict(&self, inner: &dyn ExpertSource, layer: usize, rows: usize, guesses: &[PilotGuess]) {
        inner.predict(layer, rows, guesses)
    }

    /// [`ExpertSource::stats`].
    fn stats(&self, inner: &dyn ExpertSource) -> Option<ExpertStats> {
        inner.stats()
    }
}

/// The source `inner` with `layer` on top: every [`ExpertSource`] call goes to the layer's
/// method of the same name, which passes it to `inner` unless the layer changes it.
pub struct Layered<L> {
    inner: Box<dyn ExpertSource>,
    layer: L,
}

impl<L: SourceLayer> Layered<L> {
    /// `layer` over `inner`.
    pub fn new(inner: Box<dyn ExpertSource>, layer: L) -> Layered<L> {
        Layered { inner, layer }
    }

    /// The layer.
    pub fn layer(&self) -> &L {
        &self.layer
    }

    /// The source below the layer.
    pub fn inner(&self) -> &dyn ExpertSource {
        self.inner.as_ref()
    }
}

impl<L: SourceLayer> ExpertSource for Layered<L> {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError> {
        self.layer.prepare(layer, expert)?;
        let mut weights = self.inner.expert(layer, expert)?;
        self.layer.adapt(layer, expert, &mut weights)?;
        Ok(weights)
    }
    fn begin_layer(&self, layer: usize, experts: &[usize]) {
        self.layer.begin_layer(self.inner.as_ref(), layer, experts)
    }
    fn next_ready(&self, layer: usize, pending: &[usize]) -> usize {
        self.layer.next_ready(self.inner.as_ref(), layer, pending)
    }
    fn wants_prediction(&self) -> bool {
        self.layer.wants_prediction(self.inner.as_ref())
    }
    fn predict(&self, layer: usize, rows: usize, guesses: &[PilotGuess]) {
        self.layer
            .predict(self.inner.as_ref(), layer, rows, guesses)
    }
    fn stats(&self) -> Option<ExpertStats> {
        self.layer.stats(self.inner.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::HintLog;

    /// A layer that changes nothing.
    struct Pass;
    impl SourceLayer for Pass {}

    /// A layer that refuses layer 0 before the inner source is asked.
    struct Gate;
    impl SourceLayer for Gate {
        fn prepare(&self, layer: usize, expert: usize) -> Result<(), ExpertError> {
            match layer {
                0 => Err(ExpertError::Unavailable {
                    layer,
                    expert,
                    message: "gated".into(),
                }),
                _ => Ok(()),
            }
        }
    }

    #[test]
    fn a_failed_prepare_is_the_answer_and_the_inner_source_is_not_asked() {
        let log = HintLog::default();
        let stack = Layered::new(Box::new(log.clone()), Gate);
        let err = stack.expert(0, 3).unwrap_err().to_string();
        assert!(err.contains("gated"), "{err}");
        assert!(log.take().is_empty());
        let err = stack.expert(1, 3).unwrap_err().to_string();
        assert!(err.contains("none"), "{err}");
        assert_eq!(log.take(), ["expert 1 3"]);
    }

    #[test]
    fn layered_forwards_every_method_to_the_inner_source() {
        let log = HintLog::default();
        let stack = Layered::new(Box::new(Layered::new(Box::new(log.clone()), Pass)), Pass);
        log.check_forwarding(&stack);
    }
}
