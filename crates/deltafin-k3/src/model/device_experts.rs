//! Routed experts on a compute device, for the forward pass on a device
//! ([`crate::model::offload`]).
//!
//! **Routed experts** ([`DeviceExpertCache`], `--expert-backend cuda`): an LRU of uploaded
//! experts keyed by `(layer, expert)` under a byte budget. The MoE layer asks for its route
//! union in the order the expert source delivers it (`next_ready`); on the layer's fetch
//! thread each expert is looked up, uploaded on a miss (evicting least recently used experts
//! beyond the budget), and its three products are handed to a pool task. What overlaps:
//! the uploads of later experts with the products of earlier ones and with the host's expert
//! reads and the shared experts' CPU work — every upload is issued before the layer awaits
//! its first product. What does not: on the device itself, uploads and products are
//! serialised on one stream ([`deltafin_kernels::cuda::CudaProducts`] holds one lock per
//! call), so a copy and a kernel never run at the same time. An expert larger than the whole
//! budget is uploaded, used and freed without being cached. An evicted expert's memory is
//! freed when the last product using it returns.
//!
//! With the CPU stand-in ([`deltafin_kernels::HostDevice`]) every result is bit-identical to
//! the CPU path (the tests check this); on CUDA the products differ in the last bits
//! (docs/NUMERICS.md, "CUDA kernels").

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use deltafin_experts::ExpertWeights;
use deltafin_kernels::{DeviceWeights, ProductDevice, Weights, situ_glu};

use crate::error::ModelError;
use deltafin_store::dims::ModelDims;

/// One routed expert on the device: `w1`, `w3` `[F, Lr]`, `w2` `[Lr, F]`.
#[derive(Debug)]
pub struct DeviceExpert {
    /// Layer.
    pub layer: usize,
    /// Expert id.
    pub expert: usize,
    w1: DeviceWeights,
    w2: DeviceWeights,
    w3: DeviceWeights,
}

impl DeviceExpert {
    /// Device bytes of the three matrices.
    pub fn bytes(&self) -> u64 {
        self.w1.bytes() + self.w2.bytes() + self.w3.bytes()
    }
}

/// Counters of a [`DeviceExpertCache`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceCacheStats {
    /// Lookups served from the cache.
    pub hits: u64,
    /// Lookups that uploaded the expert.
    pub misses: u64,
    /// Experts dropped to stay within the budget.
    pub evictions: u64,
    /// Misses too large for the whole budget (uploaded, used, not cached).
    pub uncached: u64,
    /// Bytes uploaded.
    pub uploaded_bytes: u64,
    /// Experts cached now.
    pub resident: usize,
    /// Bytes cached now.
    pub resident_bytes: u64,
}

impl DeviceCacheStats {
    /// `"device expert cache: 123 hits, 45 misses (…)"`.
    pub fn describe(&self, budget: u64) -> String {
        let total = self.hits + self.misses;
        format!(
            "device expert cache: {} hits, {} misses ({:.1}% hit rate), {} evictions, {} experts / {:.3} GB resident of {:.3} GB, {:.3} GB uploaded",
            self.hits,
            self.misses,
            if total > 0 {
                100.0 * self.hits as f64 / total as f64
            } else {
                0.0
            },
            self.evictions,
            self.resident,
            self.resident_bytes as f64 / 1e9,
            budget as f64 / 1e9,
            self.uploaded_bytes as f64 / 1e9
        )
    }
}

#[derive(Default)]
struct CacheInner {
    /// `(layer, expert)` → the expert and its last use.
    map: HashMap<(usize, usize), (Arc<DeviceExpert>, u64)>,
    tick: u64,
    stats: DeviceCacheStats,
}

/// Routed experts resident on a device: least recently used eviction under a byte budget.
pub struct DeviceExpertCache {
    device: Arc<dyn ProductDevice>,
    budget: u64,
    inner: Mutex<CacheInner>,
}

impl std::fmt::Debug for DeviceExpertCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceExpertCache")
            .field("device", &self.device.describe())
            .field("budget", &self.budget)
            .finish()
    }
}

impl DeviceExpertCache {
    /// An empty cache of at most `budget` bytes on `device`.
    pub fn new(device: Arc<dyn ProductDevice>, budget: u64) -> DeviceExpertCache {
        DeviceExpertCache {
            device,
            budget,
            inner: Mutex::new(CacheInner::default()),
        }
    }

    /// The byte budget.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn ProductDevice> {
        &self.device
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CacheInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The counters now.
    pub fn stats(&self) -> DeviceCacheStats {
        let g = self.lock();
        let mut s = g.stats.clone();
        s.resident = g.map.len();
        s.resident_bytes = g.map.values().map(|(e, _)| e.bytes()).sum();
        s
    }

    /// Expert `(layer, expert)` on the device: from the cache, or uploaded from `host`
    /// (then cached, evicting the least recently used experts beyond the budget).
    pub fn get_or_upload(
        &self,
        layer: usize,
        expert: usize,
        host: &ExpertWeights,
    ) -> Result<Arc<DeviceExpert>, ModelError> {
        {
            let mut g = self.lock();
            g.tick += 1;
            let tick = g.tick;
            if let Some((e, last)) = g.map.get_mut(&(layer, expert)) {
                *last = tick;
                let e = e.clone();
                g.stats.hits += 1;
                return Ok(e);
            }
        }
        let base = format!("model.layers.{layer}.block_sparse_moe.experts.{expert}");
        let up = |which: &str, m| {
            let name = format!("{base}.{which}");
            self.device
                .upload(&name, Weights::Mxfp4(m))
                .map_err(|e| ModelError::Device {
                    matrix: name,
                    message: e.to_string(),
                })
        };
        let e = Arc::new(DeviceExpert {
            layer,
            expert,
            w1: up("w1", &host.w1)?,
            w2: up("w2", &host.w2)?,
            w3: up("w3", &host.w3)?,
        });
        let bytes = e.bytes();
        let mut g = self.lock();
        g.stats.misses += 1;
        g.stats.uploaded_bytes += bytes;
        if bytes > self.budget {
            g.stats.uncached += 1;
            return Ok(e);
        }
        let mut held: u64 = g.map.values().map(|(e, _)| e.bytes()).sum();
        while held + bytes > self.budget {
            let Some((&key, _)) = g.map.iter().min_by_key(|(_, (_, last))| *last) else {
                break;
            };
            if let Some((old, _)) = g.map.remove(&key) {
                held -= old.bytes();
                g.stats.evictions += 1;
            }
        }
        g.tick += 1;
        let tick = g.tick;
        g.map.insert((layer, expert), (e.clone(), tick));
        Ok(e)
    }

    /// One expert over the gathered latent rows `x` (`n` rows of Lr): `W2 · SiTU(W1 x, W3 x)`,
    /// `[n, Lr]` — the same operations as the CPU expert path, products on the device.
    pub fn expert_rows(
        &self,
        dims: &ModelDims,
        e: &DeviceExpert,
        x: &[f32],
        n: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let mm = |w: &DeviceWeights, xs: &[f32], ys: &mut [f32]| {
            self.device
                .matmul(w, xs, n, ys)
                .map_err(|err| ModelError::Device {
                    matrix: w.name().to_string(),
                    message: err.to_string(),
                })
        };
        let f = e.w1.rows();
        let mut g = vec![0f32; n * f];
        let mut u = vec![0f32; n * f];
        mm(&e.w1, x, &mut g)?;
        mm(&e.w3, x, &mut u)?;
        let mut a = vec![0f32; n * f];
        situ_glu(&g, &u, dims.situ_beta, dims.situ_linear_beta, &mut a);
        let mut he = vec![0f32; n * dims.latent_size];
        mm(&e.w2, &a, &mut he)?;
        Ok(he)
    }
}
