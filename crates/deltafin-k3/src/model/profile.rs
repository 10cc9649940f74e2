//! Per-layer phase timing of every forward pass (`deltafin run --layer-profile`): when a
//! [`LayerProfile`] sink is set on the model, each pass reports, for each layer, how long its
//! phases took. Timing only: the values a pass computes are the same with or without it.

use std::time::{Duration, Instant};

/// One layer of one forward pass, timed.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerPhases {
    /// The layer, `0..layers`.
    pub layer: usize,
    /// Layers of the model.
    pub layers: usize,
    /// Positions of the pass (1 for a decode step, the chunk length of a prefill pass, the
    /// draft width + 1 of a verify pass).
    pub rows: usize,
    /// `kda` or `mla`.
    pub attention: &'static str,
    /// `dense` or `moe`.
    pub ffn: &'static str,
    /// Waiting for the layer's weights (a streamed spine layer's reads; zero when resident).
    pub weights: Duration,
    /// The Attention-Residuals mix and the input norm (and the read hints issued there).
    pub mix: Duration,
    /// The attention block (KDA or gated MLA).
    pub attention_time: Duration,
    /// The second mix and norm, then the dense MLP or the latent MoE (router, routed experts
    /// — their reads included — and shared experts).
    pub ffn_time: Duration,
}

impl LayerPhases {
    /// The whole layer.
    pub fn total(&self) -> Duration {
        self.weights + self.mix + self.attention_time + self.ffn_time
    }
}

/// Where a model sends its [`LayerPhases`] (called on the thread that runs the pass, once
/// per layer, in layer order).
pub type LayerProfile = Box<dyn Fn(&LayerPhases) + Send + Sync>;

/// The clock of one pass: the instants between a layer's phases.
pub(crate) struct PassClock {
    rows: usize,
    start: Instant,
    weights: Instant,
    mix: Instant,
    attention: Instant,
}

impl PassClock {
    pub(crate) fn new(rows: usize) -> PassClock {
        let now = Instant::now();
        PassClock {
            rows,
            start: now,
            weights: now,
            mix: now,
            attention: now,
        }
    }

    /// A layer begins (before its weights are fetched).
    pub(crate) fn layer_started(&mut self) {
        self.start = Instant::now();
    }

    /// Its weights are at hand.
    pub(crate) fn weights_ready(&mut self) {
        self.weights = Instant::now();
    }

    /// Its attention begins.
    pub(crate) fn attention_started(&mut self) {
        self.mix = Instant::now();
    }

    /// Its attention is done.
    pub(crate) fn attention_done(&mut self) {
        self.attention = Instant::now();
    }

    /// The layer is done: its phases.
    pub(crate) fn layer_done(
        &self,
        layer: usize,
        layers: usize,
        kinds: (&'static str, &'static str),
    ) -> LayerPhases {
        let end = Instant::now();
        LayerPhases {
            layer,
            layers,
            rows: self.rows,
            attention: kinds.0,
            ffn: kinds.1,
            weights: self.weights.saturating_duration_since(self.start),
            mix: self.mix.saturating_duration_since(self.weights),
            attention_time: self.attention.saturating_duration_since(self.mix),
            ffn_time: end.saturating_duration_since(self.attention),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::model::LogitRows;
    use crate::model::forward::tests::random_model;
    use std::sync::{Arc, Mutex};

    /// A profiled model computes the same bits as an unprofiled one, and reports every layer
    /// of every pass once, in order, with the pass's rows and each layer's kinds.
    #[test]
    fn every_layer_of_every_pass_is_reported_and_no_value_changes() {
        let (plain, _) = random_model(17);
        let (mut profiled, _) = random_model(17);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        profiled.layer_profile = Some(Box::new(move |p: &super::LayerPhases| {
            sink.lock()
                .unwrap()
                .push((p.layer, p.layers, p.rows, p.attention, p.ffn));
            assert!(p.total() >= p.ffn_time);
        }));
        let passes: [&[u32]; 3] = [&[5, 9, 2, 7], &[3], &[8, 1]];
        let (mut a, mut b) = (plain.new_state(), profiled.new_state());
        for (i, t) in passes.iter().enumerate() {
            let want = plain.forward(&mut a, t, LogitRows::All).unwrap();
            let got = if i == 1 {
                profiled.forward_exact(&mut b, t, LogitRows::All).unwrap()
            } else {
                profiled.forward(&mut b, t, LogitRows::All).unwrap()
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got.values), bits(&want.values), "pass {i}");
        }
        let seen = seen.lock().unwrap();
        let n = plain.layers.len();
        assert_eq!(seen.len(), passes.len() * n);
        for (i, t) in passes.iter().enumerate() {
            for l in 0..n {
                let (layer, layers, rows, attn, ffn) = seen[i * n + l];
                assert_eq!((layer, layers, rows), (l, n, t.len()));
                let kinds = (
                    match plain.dims.attn_kind(l) {
                        deltafin_store::dims::AttnKind::Kda => "kda",
                        deltafin_store::dims::AttnKind::Mla => "mla",
                    },
                    match plain.dims.ffn_kind(l) {
                        deltafin_store::dims::FfnKind::Dense => "dense",
                        deltafin_store::dims::FfnKind::Moe => "moe",
                    },
                );
                assert_eq!((attn, ffn), kinds, "layer {l}");
            }
        }
    }
}
