use super::*;
use crate::engine::config::{HeatSettings, RouterTraceRequest};
use crate::engine::experts::ExpertLayer;
use crate::engine::plan::PlanError;
use crate::model::moe::{ExpertError, ExpertSource, ExpertWeights};
use crate::synth::{SynthDims, SynthSpec, synthesize};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A tiny checkpoint with 43 MB of experts ([`SynthDims::tiny_streaming`]).
fn tiny() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    synthesize(d.path(), &SynthSpec::new(SynthDims::tiny_streaming(), 3)).unwrap();
    d
}

fn greedy(e: &LoadedEngine, n: usize) -> Vec<u32> {
    let mut st = e.model.new_state();
    let mut tok = 17u32;
    let mut out = Vec::new();
    for _ in 0..n {
        let logits = e.model.decode(&mut st, tok).unwrap();
        let best = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap();
        out.push(best);
        tok = best;
    }
    out
}

#[derive(Default)]
struct Lines(Mutex<Vec<String>>);
impl LoadProgress for Arc<Lines> {
    fn info(&self, line: &str) {
        self.0.lock().unwrap().push(format!("info {line}"));
    }
    fn note(&self, line: &str) {
        self.0.lock().unwrap().push(format!("note {line}"));
    }
}

#[test]
fn budgeted_and_resident_loads_decode_the_same_tokens() {
    let d = tiny();
    let resident = EngineBuilder::new(d.path()).build().unwrap();
    assert!(resident.plan.is_none());
    assert_eq!(resident.spine, SpineFormat::Bf16);
    assert_eq!(resident.device_line, "device=cpu");
    let lines = Arc::new(Lines::default());
    let budget = 200_000_000;
    let streamed = EngineBuilder::new(d.path())
        .memory_budget(Some(budget))
        .runtime_bytes(50_000_000)
        .progress(Box::new(lines.clone()))
        .build()
        .unwrap();
    let plan = streamed.plan.clone().unwrap();
    assert_eq!(plan.budget, budget);
    assert!(streamed.model.experts.stats().is_some(), "experts stream");
    assert_eq!(greedy(&resident, 6), greedy(&streamed, 6));
    let lines = lines.0.lock().unwrap();
    assert!(
        lines.iter().any(|l| l.starts_with("info layout=shards")),
        "{lines:?}"
    );
    assert!(
        lines.iter().any(|l| l.starts_with("info expert_heat=off")),
        "{lines:?}"
    );
}

#[test]
fn plan_without_loading_equals_the_loaded_plan_and_refuses_small_budgets() {
    let d = tiny();
    let b = || {
        EngineBuilder::new(d.path())
            .memory_budget(Some(200_000_000))
            .runtime_bytes(50_000_000)
    };
    let dry = b().plan().unwrap().unwrap();
    let loaded = b().build().unwrap().plan.unwrap();
    assert_eq!(dry, loaded);
    // The planner's inputs for the same budget give the same plan.
    let inputs = b().plan_inputs(200_000_000).unwrap();
    assert_eq!(plan_memory(&inputs).unwrap(), dry);
    assert_eq!(EngineBuilder::new(d.path()).plan().unwrap(), None);
    let e = EngineBuilder::new(d.path())
        .memory_budget(Some(1_000_000))
        .runtime_bytes(0)
        .build()
        .err()
        .unwrap();
    let msg = crate::engine::experts::chain(&e);
    assert!(msg.starts_with("cannot build the model from "), "{msg}");
    assert!(
        msg.contains("is too small even with every spine layer streamed"),
        "{msg}"
    );
    let mut cfg = EngineConfig {
        memory_budget: Some(200_000_000),
        spine_resident_layers: Some(15),
        ..EngineConfig::default()
    };
    let e = EngineBuilder::new(d.path())
        .config(cfg.clone())
        .build()
        .err()
        .unwrap();
    assert!(
        matches!(
            e,
            EngineError::ResidentLayers {
                requested: 15,
                layers: 14
            }
        ),
        "{e:?}"
    );
    cfg.spine_resident_layers = Some(5);
    cfg.heat = HeatSettings {
        enabled: false,
        pin_bytes: 10_000_000_000,
    };
    let e = EngineBuilder::new(d.path())
        .config(cfg)
        .runtime_bytes(50_000_000)
        .plan()
        .err()
        .unwrap();
    assert!(
        matches!(e, EngineError::Plan(PlanError::PinTooLarge { .. })),
        "{e:?}"
    );
}

#[test]
fn missing_installs_and_spines_are_named() {
    let d = tempfile::tempdir().unwrap();
    let e = EngineBuilder::new(d.path()).build().err().unwrap();
    let msg = e.to_string();
    assert!(
        msg.contains("no K3 model installed") && msg.contains("config.json is missing"),
        "{msg}"
    );
    let d = tiny();
    let e = EngineBuilder::new(d.path())
        .spine(SpineFormat::Int8)
        .build()
        .err()
        .unwrap();
    assert!(matches!(e, EngineError::Spine(_)), "{e:?}");
}

/// Counts the experts read through it.
struct Counting(Arc<AtomicUsize>);
struct CountingSource(Arc<AtomicUsize>, Box<dyn ExpertSource>);
impl ExpertLayer for Counting {
    fn wrap(self: Box<Self>, inner: Box<dyn ExpertSource>) -> Box<dyn ExpertSource> {
        Box::new(CountingSource(self.0, inner))
    }
}
impl ExpertSource for CountingSource {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights, ExpertError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        self.1.expert(layer, expert)
    }
    fn begin_layer(&self, layer: usize, experts: &[usize]) {
        self.1.begin_layer(layer, experts)
    }
    fn stats(&self) -> Option<deltafin_experts::ExpertStats> {
        self.1.stats()
    }
}

#[test]
fn an_injected_layer_sees_every_expert_and_observers_sit_on_top() {
    let d = tiny();
    let n = Arc::new(AtomicUsize::new(0));
    let counter = n.clone();
    let trace = d.path().join("trace.jsonl");
    let cfg = EngineConfig {
        memory_budget: Some(200_000_000),
        heat: HeatSettings {
            enabled: true,
            pin_bytes: 0,
        },
        router_trace: Some(RouterTraceRequest {
            path: trace.clone(),
            mode: deltafin_experts::TraceMode::Sync,
        }),
        ..EngineConfig::default()
    };
    let e = EngineBuilder::new(d.path())
        .config(cfg)
        .runtime_bytes(50_000_000)
        .expert_layer(Box::new(move |_: &Checkpoint| {
            Ok(Some(Box::new(Counting(counter)) as Box<dyn ExpertLayer>))
        }))
        .build()
        .unwrap();
    greedy(&e, 2);
    assert!(n.load(Ordering::Relaxed) > 0);
    drop(e);
    assert!(std::fs::read_to_string(&trace).unwrap().lines().count() > 0);
    assert!(d.path().join(deltafin_experts::heat::HEAT_FILE).is_file());
    // A failing factory's error is the load's error.
    let e = EngineBuilder::new(d.path())
        .expert_layer(Box::new(|_: &Checkpoint| Err("hub unreachable".into())))
        .build()
        .err()
        .unwrap();
    assert_eq!(e.to_string(), "hub unreachable");
}
