//! The server loads through the engine builder: with a memory budget the routed experts
//! stream from disk, and completions are the same as with every expert resident.

mod common;

use common::*;
use deltafin_k3::engine::EngineConfig;
use deltafin_openai::{Engine, LoadError};
use serde_json::json;

fn completion(s: &TestServer) -> String {
    let r = post_json(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "Streaming under a budget", "max_tokens": 5}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn a_budgeted_engine_streams_and_answers_as_the_resident_one() {
    let cfg = any_port();
    let resident = TestServer::start(cfg.clone());
    resident.wait_ready();
    let want = completion(&resident);
    drop(resident);

    let root = model_root().to_path_buf();
    let budgeted = EngineConfig {
        memory_budget: Some(2_000_000_000),
        ..EngineConfig::default()
    };
    let engine = Engine::load_with(&root, &budgeted).unwrap();
    assert!(engine.model.experts.stats().is_some(), "experts stream");
    drop(engine);
    let streamed = TestServer::start_with(cfg, move || {
        Engine::load_with(&root, &budgeted).map_err(|e| e.to_string())
    });
    streamed.wait_ready();
    assert_eq!(completion(&streamed), want);
}

#[test]
fn a_budget_reserving_two_sequences_runs_a_side_request_beside_a_whole_context() {
    let root = model_root().to_path_buf();
    let with = |sequences: usize| {
        let config = EngineConfig {
            memory_budget: Some(2_000_000_000),
            sequences,
            ..EngineConfig::default()
        };
        let engine = Engine::load_with(&root, &config)
            .unwrap()
            .with_parallel(None);
        let plan = engine.plan.clone().unwrap();
        let s = &engine.sharing;
        // A main turn holding the whole admitted context, and a short side request.
        let main_and_side = s.state_bytes(engine.max_context, 0) + s.state_bytes(600, 400);
        (plan.sequences, s.parallel, s.reserve_bytes >= main_and_side)
    };
    assert_eq!(with(1), (1, 1, false));
    assert_eq!(with(2), (2, 2, true));
}

#[test]
fn load_errors_keep_their_words() {
    let d = tempfile::tempdir().unwrap();
    let e = Engine::load(d.path()).err().unwrap();
    assert!(matches!(e, LoadError::NotInstalled { .. }), "{e}");
    let small = EngineConfig {
        memory_budget: Some(1_000),
        ..EngineConfig::default()
    };
    let e = Engine::load_with(model_root(), &small).err().unwrap();
    let msg = e.to_string();
    assert!(msg.starts_with("cannot load the K3 model from "), "{msg}");
    assert!(
        msg.contains("is too small even with every spine layer streamed"),
        "{msg}"
    );
}
