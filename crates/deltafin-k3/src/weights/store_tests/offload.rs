//! The device offload of the spine (`model/offload.rs`) over a loaded checkpoint: what is
//! placed where, and logits equal to the host's.

use crate::error::ModelError;
use crate::model::K3Model;
use crate::model::LogitRows;
use crate::model::layer::linears_mut;
use crate::model::moe::{ExpertError, ExpertSource, ExpertWeights};
use crate::model::offload::*;
use crate::weights::loader::{EngineOptions, load_model};
use deltafin_kernels::HostDevice;
use deltafin_store::checkpoint::Checkpoint;
use deltafin_store::spine_int8::SpineFormat;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::Mutex;

const TOKENS: [u32; 5] = [1, 17, 99, 512, 3];
const DECODE: [u32; 3] = [5, 700, 42];
/// Forward calls per [`run`]: one prefill and the decode steps.
const PASSES: u64 = 1 + DECODE.len() as u64;

fn small() -> (tempfile::TempDir, Arc<Checkpoint>) {
    let (dir, ckpt) = crate::test_util::small_checkpoint(11, true);
    (dir, Arc::new(ckpt))
}

fn load(ckpt: &Arc<Checkpoint>, spine: SpineFormat, resident: Option<usize>) -> K3Model {
    load_model(
        ckpt.clone(),
        &EngineOptions {
            spine,
            spine_resident_layers: resident,
            ..Default::default()
        },
    )
    .unwrap()
}

/// Every row's logits of a 5-token prefill, then three decode steps.
fn run(m: &K3Model) -> Result<Vec<f32>, ModelError> {
    let mut st = m.new_state();
    let mut out = m.forward(&mut st, &TOKENS, LogitRows::All)?.values;
    for t in DECODE {
        out.extend(m.decode(&mut st, t)?);
    }
    Ok(out)
}

/// The spine matrices the forward pass multiplies, in forward order, with their bytes:
/// derived here from the layer structure, independently of `offload_spine`.
fn multiplied(m: &K3Model) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for (l, layer) in m.layers.iter().enumerate() {
        let mut layer = layer.clone();
        for (suffix, lin) in linears_mut(&mut layer) {
            // kv_b_proj is read row by row in the absorbed attention, never multiplied.
            if suffix != "self_attn.kv_b_proj.weight" {
                let bytes = lin.weights().weight_bytes() as u64;
                out.push((format!("model.layers.{l}.{suffix}"), bytes));
            }
        }
    }
    out.push((
        "lm_head.weight".into(),
        m.lm_head.weights().weight_bytes() as u64,
    ));
    out
}

/// (a) The whole spine on the stand-in device: bit-identical logits, and every spine
/// product ran there (each multiplied matrix uploaded once and used once per pass).
#[test]
fn offloaded_spine_is_bit_identical_and_every_product_runs_on_the_device() {
    let (_d, ckpt) = small();
    for spine in [SpineFormat::Bf16, SpineFormat::Int8] {
        let cpu = load(&ckpt, spine, None);
        let want = run(&cpu).unwrap();
        let expected = multiplied(&cpu);
        let mut m = load(&ckpt, spine, None);
        let dev = Arc::new(HostDevice::new(1 << 40));
        let report = m.offload_spine(dev.clone(), 1 << 40).unwrap();
        assert_eq!(report.on_device, expected, "{spine:?}");
        assert!(
            report
                .on_cpu
                .iter()
                .all(|c| c.2 == KeptReason::ElementWise && c.0.ends_with("kv_b_proj.weight"))
        );
        let mla_layers = (0..m.layers.len())
            .filter(|&l| m.dims.attn_kind(l) == deltafin_store::dims::AttnKind::Mla)
            .count();
        assert!(mla_layers > 0);
        assert_eq!(report.on_cpu.len(), mla_layers);
        let before = dev.counters();
        assert_eq!(before.uploads, expected.len() as u64);
        assert_eq!(
            before.upload_bytes,
            expected.iter().map(|e| e.1).sum::<u64>()
        );
        assert_eq!(before.products, 0);
        assert!(run(&m).unwrap() == want, "{spine:?}: logits differ");
        let c = dev.counters();
        let names: Vec<&str> = c.per_matrix.iter().map(|p| p.0.as_str()).collect();
        let want_names: Vec<&str> = expected.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(names, want_names);
        for (name, products) in &c.per_matrix {
            assert_eq!(*products, PASSES, "{spine:?}: {name}");
        }
        assert_eq!(c.products, PASSES * expected.len() as u64);
        // Offloading again keeps what is there and uploads nothing.
        let again = m.offload_spine(dev.clone(), 1 << 40).unwrap();
        assert_eq!(again.on_device, expected);
        assert_eq!(dev.counters().uploads, expected.len() as u64);
        assert!(
            report
                .describe()
                .contains(&format!("{} matrices", expected.len()))
        );
    }
}

/// (b) A budget that holds only part of the spine: the forward-order prefix that fits is
/// on the device, the rest on the CPU; streamed layers stay on the CPU; logits identical.
#[test]
fn a_partial_budget_offloads_a_prefix() {
    let (_d, ckpt) = small();
    let cpu = load(&ckpt, SpineFormat::Bf16, None);
    let want = run(&cpu).unwrap();
    let all = multiplied(&cpu);
    for keep in [0, 1, all.len() / 3, all.len() - 1] {
        let budget: u64 = all[..keep].iter().map(|e| e.1).sum::<u64>() + all[keep].1 - 1;
        let mut m = load(&ckpt, SpineFormat::Bf16, None);
        let dev = Arc::new(HostDevice::new(1 << 40));
        let report = m.offload_spine(dev.clone(), budget).unwrap();
        assert_eq!(report.on_device, all[..keep].to_vec(), "keep {keep}");
        let over: Vec<(String, u64)> = report
            .on_cpu
            .iter()
            .filter(|c| c.2 == KeptReason::Budget)
            .map(|c| (c.0.clone(), c.1))
            .collect();
        assert_eq!(over, all[keep..].to_vec(), "keep {keep}");
        assert!(
            report
                .describe()
                .contains(&format!("from {} on", all[keep].0))
        );
        assert!(run(&m).unwrap() == want, "keep {keep}: logits differ");
        let c = dev.counters();
        assert_eq!(c.uploads, keep as u64);
        assert_eq!(c.products, PASSES * keep as u64);
        assert!(c.resident_bytes <= budget);
    }
    // Streamed layers (2 of them resident) are never uploaded.
    let layers = cpu.layers.len();
    let mut m = load(&ckpt, SpineFormat::Int8, Some(2));
    let want8 = run(&load(&ckpt, SpineFormat::Int8, None)).unwrap();
    let dev = Arc::new(HostDevice::new(1 << 40));
    let report = m.offload_spine(dev.clone(), 1 << 40).unwrap();
    assert!(report.on_device.iter().all(|e| {
        e.0 == "lm_head.weight"
            || e.0.starts_with("model.layers.0.")
            || e.0.starts_with("model.layers.1.")
    }));
    let streamed = report
        .on_cpu
        .iter()
        .filter(|c| c.2 == KeptReason::Streamed)
        .count();
    assert!(streamed >= layers - 2, "{streamed}");
    assert!(
        run(&m).unwrap() == want8,
        "streamed + offloaded logits differ"
    );
    assert!(dev.counters().per_matrix.iter().all(|p| p.1 == PASSES));
}

/// An expert source that records every request.
struct Recording {
    inner: Box<dyn ExpertSource>,
    log: Mutex<Vec<(usize, usize)>>,
}

impl ExpertSource for Recording {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError> {
        self.log.lock().unwrap().push((layer, expert));
        self.inner.expert(layer, expert)
    }
}

/// Hits, misses and evictions of an LRU of `cap` entries over `requests`.
fn lru(requests: &[(usize, usize)], cap: usize) -> (u64, u64, u64) {
    let mut q: VecDeque<(usize, usize)> = VecDeque::new();
    let (mut hits, mut misses, mut evictions) = (0, 0, 0);
    for &r in requests {
        if let Some(i) = q.iter().position(|&x| x == r) {
            q.remove(i);
            hits += 1;
        } else {
            misses += 1;
            if q.len() == cap {
                q.pop_front();
                evictions += 1;
            }
        }
        q.push_back(r);
    }
    (hits, misses, evictions)
}

fn with_recording(m: &mut K3Model) -> Arc<Recording> {
    let inner = std::mem::replace(
        &mut m.experts,
        Box::new(crate::model::moe::InMemoryExperts::default()),
    );
    let rec = Arc::new(Recording {
        inner,
        log: Mutex::new(Vec::new()),
    });
    struct Shared(Arc<Recording>);
    impl ExpertSource for Shared {
        fn expert(&self, l: usize, e: usize) -> Result<ExpertWeights, ExpertError> {
            self.0.expert(l, e)
        }
    }
    m.experts = Box::new(Shared(rec.clone()));
    rec
}

/// (c) Routed experts through the device cache: identical logits, and the cache's hits,
/// misses and evictions are those of an LRU over the requests the model made.
#[test]
fn the_device_expert_cache_is_an_lru_with_identical_results() {
    let (_d, ckpt) = small();
    let want = run(&load(&ckpt, SpineFormat::Bf16, None)).unwrap();
    let d = &load(&ckpt, SpineFormat::Bf16, None).dims;
    let (f, lr) = (d.moe_intermediate, d.latent_size);
    // w1, w3 [F, Lr] and w2 [Lr, F] in MXFP4: half a byte per value, a scale per 32.
    let expert_bytes = (3 * f * lr / 2 + 3 * f * lr / 32) as u64;
    for cap in [3usize, 60, 10_000] {
        let mut m = load(&ckpt, SpineFormat::Bf16, None);
        let rec = with_recording(&mut m);
        let dev = Arc::new(HostDevice::new(1 << 40));
        let cache = Arc::new(DeviceExpertCache::new(
            dev.clone(),
            cap as u64 * expert_bytes,
        ));
        m.set_device_experts(cache.clone());
        assert!(run(&m).unwrap() == want, "cap {cap}: logits differ");
        let requests = rec.log.lock().unwrap().clone();
        assert!(!requests.is_empty());
        let (hits, misses, evictions) = lru(&requests, cap);
        let s = cache.stats();
        assert_eq!((s.hits, s.misses, s.evictions), (hits, misses, evictions));
        assert_eq!(s.uncached, 0);
        assert!(s.resident_bytes <= cap as u64 * expert_bytes);
        assert_eq!(s.uploaded_bytes, misses * expert_bytes);
        if cap < 100 {
            assert!(evictions > 0, "{s:?}");
        } else {
            // Everything fits: decode steps reuse the experts the prefill uploaded.
            assert!(evictions == 0 && hits > 0, "{s:?}");
        }
        // Three products per requested expert, all on the device; only cached experts
        // hold device memory.
        let c = dev.counters();
        assert_eq!(c.products, 3 * requests.len() as u64);
        assert_eq!(c.resident_bytes, s.resident_bytes);
        assert!(s.describe(cache.budget()).contains("hit rate"));
    }
    // A budget below one expert: every request uploads, nothing is kept.
    let mut m = load(&ckpt, SpineFormat::Bf16, None);
    let rec = with_recording(&mut m);
    let dev = Arc::new(HostDevice::new(1 << 40));
    let cache = Arc::new(DeviceExpertCache::new(dev.clone(), expert_bytes - 1));
    m.set_device_experts(cache.clone());
    assert!(run(&m).unwrap() == want);
    let s = cache.stats();
    let n = rec.log.lock().unwrap().len() as u64;
    assert_eq!((s.hits, s.misses, s.uncached, s.resident), (0, n, n, 0));
    assert_eq!(dev.counters().resident_bytes, 0);
}

/// (d) A device failure in the middle of a forward pass is an error naming the matrix,
/// for spine products and for expert products, never a panic or a CPU fallback.
#[test]
fn a_device_error_names_the_matrix() {
    let (_d, ckpt) = small();
    let mut m = load(&ckpt, SpineFormat::Bf16, None);
    let dev = Arc::new(HostDevice::new(1 << 40));
    let n = m
        .offload_spine(dev.clone(), 1 << 40)
        .unwrap()
        .on_device
        .len() as u64;
    dev.fail_products_from(n / 2);
    let e = run(&m).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ModelError::Device { .. }), "{msg}");
    assert!(
        msg.contains("model.layers.") && msg.contains(".weight"),
        "{msg}"
    );
    assert!(msg.contains("injected failure"), "{msg}");
    // Every later pass fails the same way (no silent fallback to the CPU).
    assert!(matches!(run(&m), Err(ModelError::Device { .. })));

    let mut m = load(&ckpt, SpineFormat::Bf16, None);
    let dev = Arc::new(HostDevice::new(1 << 40));
    m.set_device_experts(Arc::new(DeviceExpertCache::new(dev.clone(), 1 << 40)));
    dev.fail_products_from(7);
    let msg = run(&m).unwrap_err().to_string();
    assert!(msg.contains(".block_sparse_moe.experts."), "{msg}");
    // Expert products run concurrently, so the error reported may be that of any
    // product from the 7th on (the one whose expert comes first in route order).
    let k: Option<u64> = msg
        .split("injected failure of product ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|k| k.parse().ok());
    assert!(k.is_some_and(|k| k >= 7), "{msg}");

    // A device too small for an expert fails the upload with the expert's name.
    let mut m = load(&ckpt, SpineFormat::Bf16, None);
    let dev = Arc::new(HostDevice::new(100));
    m.set_device_experts(Arc::new(DeviceExpertCache::new(dev, 1 << 40)));
    let msg = run(&m).unwrap_err().to_string();
    assert!(
        msg.contains("out of memory uploading model.layers."),
        "{msg}"
    );
}
