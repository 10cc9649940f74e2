//! The K3 forward pass on a compute device (issue 11): the spine offloaded to a
//! [`ProductDevice`] while it fits a byte budget, and a device cache of routed experts.
//!
//! **Spine** ([`K3Model::offload_spine`]): the matrices are uploaded in forward order — for
//! each resident layer `0, 1, …` its projections in [`crate::model::layer::linears_mut`]
//! order, then `lm_head` — as long as each one fits what is left of the budget; the first
//! one that does not fit ends the upload, so the device holds a prefix of the forward pass
//! and everything after it stays on the CPU. Offloaded projections ([`Linear::Device`]) run
//! their products on the device; the rest of each layer (norms, AttnRes, the KDA recurrence,
//! the MLA attention, SiTU, the MoE sum) stays on the CPU, so activations travel to the
//! device and back once per product. Never offloaded:
//! - `kv_b_proj` of the MLA layers: the absorbed attention reads its rows element-wise on the
//!   CPU (it is never a product), so a device copy would only take memory;
//! - the routers: they decide which experts run, and CUDA's last-bit differences could flip a
//!   route, so routing stays bit-exact on the CPU (a router is small);
//! - the embedding: one row lookup per token;
//! - layers the spine streamer reads from disk per pass (`--spine-resident-layers`): their
//!   weights change every pass.
//!
//! **Routed experts**: the device cache of uploaded experts is
//! [`crate::model::device_experts`] (re-exported here).
//!
//! With the CPU stand-in ([`deltafin_kernels::HostDevice`]) every result is bit-identical to
//! the CPU path (the tests check this); on CUDA the products differ in the last bits
//! (docs/NUMERICS.md, "CUDA kernels").

use std::sync::Arc;

use deltafin_kernels::ProductDevice;

use crate::model::linear::{Linear, Offloaded};

use crate::error::ModelError;
use crate::model::K3Model;
pub use crate::model::device_experts::{DeviceCacheStats, DeviceExpert, DeviceExpertCache};
use crate::model::layer::linears_mut;
use deltafin_store::inventory::{self, name};

/// Why a spine matrix stayed on the CPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeptReason {
    /// It did not fit what was left of the budget (it and everything after it).
    Budget,
    /// `kv_b_proj`: read element-wise by the CPU attention, never a product.
    ElementWise,
    /// The layer is streamed from disk per pass.
    Streamed,
}

/// What [`K3Model::offload_spine`] placed where.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OffloadReport {
    /// The device.
    pub device: String,
    /// The budget it was given.
    pub budget: u64,
    /// Uploaded matrices in upload order, with their bytes.
    pub on_device: Vec<(String, u64)>,
    /// Matrices left on the CPU, with their bytes and why.
    pub on_cpu: Vec<(String, u64, KeptReason)>,
}

impl OffloadReport {
    /// Bytes uploaded.
    pub fn device_bytes(&self) -> u64 {
        self.on_device.iter().map(|m| m.1).sum()
    }

    /// Bytes left on the CPU for `why`.
    fn kept(&self, why: &KeptReason) -> (usize, u64) {
        self.on_cpu
            .iter()
            .filter(|m| &m.2 == why)
            .fold((0, 0), |(n, b), m| (n + 1, b + m.1))
    }

    /// Startup lines: what is on the device and what stayed on the CPU, and why.
    pub fn describe(&self) -> String {
        let gb = |b: u64| b as f64 / 1e9;
        let mut s = format!(
            "spine on {}: {} matrices, {:.3} GB (budget {:.3} GB)",
            self.device,
            self.on_device.len(),
            gb(self.device_bytes()),
            gb(self.budget)
        );
        if let Some((first, _, _)) = self.on_cpu.iter().find(|m| m.2 == KeptReason::Budget) {
            let (n, b) = self.kept(&KeptReason::Budget);
            s += &format!(
                "; on the CPU: {n} matrices, {:.3} GB, from {first} on (beyond the budget)",
                gb(b)
            );
        }
        let (n, b) = self.kept(&KeptReason::Streamed);
        if n > 0 {
            s += &format!(
                "; on the CPU: {n} matrices, {:.3} GB of streamed layers",
                gb(b)
            );
        }
        let (n, b) = self.kept(&KeptReason::ElementWise);
        if n > 0 {
            s += &format!(
                "; on the CPU: {n} kv_b_proj, {:.3} GB (read element-wise by the MLA attention)",
                gb(b)
            );
        }
        s + "; always on the CPU: embedding, routers, norms, attention, KDA recurrence"
    }
}

fn host_bytes(m: &Linear) -> u64 {
    m.weights().weight_bytes() as u64
}

impl K3Model {
    /// Upload the spine to `device` in forward order while it fits `budget` bytes (see the
    /// module documentation for the order and what is never offloaded). Matrices already on
    /// a device are left as they are. An upload error (other than the budget, which is
    /// checked before each upload) is an error naming the matrix.
    pub fn offload_spine(
        &mut self,
        device: Arc<dyn ProductDevice>,
        budget: u64,
    ) -> Result<OffloadReport, ModelError> {
        let mut report = OffloadReport {
            device: device.describe(),
            budget,
            ..Default::default()
        };
        let resident = self
            .spine_stream
            .as_ref()
            .map_or(self.layers.len(), |s| s.resident_layers());
        let mut left = budget;
        let mut full = false;
        let mut place =
            |name: String, m: &mut Linear, report: &mut OffloadReport| -> Result<(), ModelError> {
                if let Linear::Device(d) = m {
                    report.on_device.push((name, d.weights.bytes()));
                    return Ok(());
                }
                let bytes = host_bytes(m);
                if full || bytes > left {
                    full = true;
                    report.on_cpu.push((name, bytes, KeptReason::Budget));
                    return Ok(());
                }
                let up = Offloaded::upload(&name, m, device.clone())?;
                left -= bytes;
                *m = Linear::Device(Arc::new(up));
                report.on_device.push((name, bytes));
                Ok(())
            };
        for (l, layer) in self.layers.iter_mut().enumerate() {
            for (suffix, m) in linears_mut(layer) {
                let name = format!("model.layers.{l}.{suffix}");
                if l >= resident {
                    report
                        .on_cpu
                        .push((name, host_bytes(m), KeptReason::Streamed));
                } else if suffix == name::mla::KV_B_PROJ {
                    report
                        .on_cpu
                        .push((name, host_bytes(m), KeptReason::ElementWise));
                } else {
                    place(name, m, &mut report)?;
                }
            }
        }
        place(inventory::LM_HEAD.into(), &mut self.lm_head, &mut report)?;
        Ok(report)
    }

    /// Run the routed experts' products on `cache`'s device (`--expert-backend cuda`).
    pub fn set_device_experts(&mut self, cache: Arc<DeviceExpertCache>) {
        self.device_experts = Some(cache);
    }
}
