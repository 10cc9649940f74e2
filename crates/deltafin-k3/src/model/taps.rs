//! Hidden-state taps for drafters (docs/K3.md §4.2, §9.3): the AttnRes partial sum `P`
//! after chosen 0-based layers, rounded to bf16, for every position a forward call processes.
//!
//! A [`Taps`] collector is passed to [`crate::model::K3Model::forward_tapped`] /
//! [`crate::model::K3Model::forward_exact_tapped`]; it only copies `P` and never changes
//! the numerics of the forward pass.

use crate::error::ModelError;
use deltafin_tensor::bf16;

/// Collects `P` after `layer_ids` (in that order), one row of `layer_ids.len() · D` values
/// per processed position, position-major. Values are bf16-rounded and stored widened.
#[derive(Clone, Debug, PartialEq)]
pub struct Taps {
    layer_ids: Vec<usize>,
    hidden: usize,
    /// Rows `[positions, layer_ids.len() · hidden]`, oldest first.
    values: Vec<f32>,
    /// Row index where the current forward call's positions start.
    first_row: usize,
}

impl Taps {
    /// A collector for `P` after each layer of `layer_ids` (distinct, each below
    /// `num_layers`) of a model with hidden size `hidden`.
    pub fn new(layer_ids: &[usize], num_layers: usize, hidden: usize) -> Result<Taps, ModelError> {
        if layer_ids.is_empty() {
            return Err(ModelError::Dims("no tap layers given".into()));
        }
        for (i, &l) in layer_ids.iter().enumerate() {
            if l >= num_layers {
                return Err(ModelError::Dims(format!(
                    "tap layer {l} is outside the model's {num_layers} layers"
                )));
            }
            if layer_ids[..i].contains(&l) {
                return Err(ModelError::Dims(format!("tap layer {l} is listed twice")));
            }
        }
        Ok(Taps {
            layer_ids: layer_ids.to_vec(),
            hidden,
            values: Vec::new(),
            first_row: 0,
        })
    }

    /// A collector holding `values` (rows of `layer_ids.len() · hidden`, as [`Self::values`]
    /// returns them) already collected: a stored prefix's taps
    /// ([`crate::prefix`]). `values` must be whole rows.
    pub fn with_rows(
        layer_ids: &[usize],
        num_layers: usize,
        hidden: usize,
        values: Vec<f32>,
    ) -> Result<Taps, ModelError> {
        let mut t = Taps::new(layer_ids, num_layers, hidden)?;
        if !values.len().is_multiple_of(t.width().max(1)) {
            return Err(ModelError::Dims(format!(
                "{} tap values are not whole rows of {}",
                values.len(),
                t.width()
            )));
        }
        t.first_row = values.len() / t.width().max(1);
        t.values = values;
        Ok(t)
    }

    /// The hidden size of a row's layer slot.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// The tapped layers, in row order.
    pub fn layer_ids(&self) -> &[usize] {
        &self.layer_ids
    }

    /// Values per position (`layer_ids.len() · hidden`).
    pub fn width(&self) -> usize {
        self.layer_ids.len() * self.hidden
    }

    /// Positions collected.
    pub fn rows(&self) -> usize {
        self.values.len() / self.width()
    }

    /// Row `i`: the concatenated bf16-rounded taps of one position.
    pub fn row(&self, i: usize) -> &[f32] {
        let w = self.width();
        &self.values[i * w..(i + 1) * w]
    }

    /// Every collected row, contiguous (`rows() · width()` values).
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// Keep only the first `rows` positions.
    pub fn truncate(&mut self, rows: usize) {
        self.values.truncate(rows * self.width());
        self.first_row = self.first_row.min(rows);
    }

    /// Forget every collected position.
    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Start a forward call over `t` positions: append `t` empty rows.
    pub(crate) fn begin(&mut self, t: usize) {
        self.first_row = self.rows();
        self.values
            .resize(self.values.len() + t * self.width(), 0.0);
    }

    /// `p` holds `P` (rows of `hidden`) for the current call's positions after layer `l`.
    pub(crate) fn record(&mut self, l: usize, p: &[f32]) {
        let (h, w, first) = (self.hidden, self.width(), self.first_row);
        for (slot, _) in self
            .layer_ids
            .iter()
            .enumerate()
            .filter(|(_, id)| **id == l)
        {
            for (r, src) in p.chunks_exact(h).enumerate() {
                let start = (first + r) * w + slot * h;
                for (dst, &v) in self.values[start..start + h].iter_mut().zip(src) {
                    *dst = bf16::from_f32(v).to_f32();
                }
            }
        }
    }
}
