use super::*;
use crate::engine::CONTEXT_RESERVE_TOKENS;
use deltafin_experts::layout::ReadPlan;
use deltafin_experts::{ExpertLocation, ExpertShape};
use deltafin_store::config::REAL_CONFIG_JSON;
use deltafin_store::inventory::{TensorKind, text_inventory};

const GB: u64 = 1_000_000_000;

fn real() -> K3Config {
    K3Config::from_json_str(REAL_CONFIG_JSON).unwrap()
}

/// The real K3's expert sizes as the shards store them (contiguous experts).
fn real_experts(cfg: &K3Config) -> ExpertSizes {
    let shape = ExpertShape {
        f: cfg.text.moe_intermediate_size,
        lr: cfg.text.routed_expert_hidden_size,
    };
    let mut ranges = [(0u64, 0u64); 6];
    let mut at = 0;
    for (r, len) in ranges.iter_mut().zip(shape.tensor_bytes()) {
        *r = (at, len);
        at += len;
    }
    let loc = ExpertLocation { file: 0, ranges };
    let moe_layers = (0..cfg.n_layers()).filter(|&l| !cfg.is_dense(l)).count();
    ExpertSizes {
        expert_bytes: shape.expert_bytes(),
        buffer_bytes: ReadPlan::new(&loc).buf_len,
        count: moe_layers * cfg.text.num_experts,
        contiguous: true,
    }
}

/// The stored (bf16) spine of the real K3: every non-expert text tensor of the inventory.
fn real_stored_spine(cfg: &K3Config) -> u64 {
    text_inventory(cfg)
        .iter()
        .filter(|t| matches!(t.kind, TensorKind::Spine { .. }))
        .map(|t| t.byte_len() as u64)
        .sum()
}

fn real_inputs(budget_gb: u64, format: SpineFormat) -> PlanInputs {
    let cfg = real();
    PlanInputs::for_model(
        &cfg,
        format,
        real_stored_spine(&cfg),
        real_experts(&cfg),
        PlanRequest {
            budget: budget_gb * GB,
            runtime: GB / 2,
            pin: 0,
            context_tokens: None,
            resident_layers_cap: None,
            spine_copied: true,
            state_cache: 0,
            sequences: 1,
        },
    )
}

/// Every byte of the budget is accounted for, and the cache holds at least one token's
/// routed experts of a layer.
fn check_split(p: &MemoryPlan, i: &PlanInputs) {
    assert_eq!(
        p.spine + p.spine_buffers + p.state + p.runtime + p.scratch + p.state_cache + p.cache,
        p.budget,
        "{p:?}"
    );
    assert!(
        p.cache >= i.experts_per_token as u64 * i.expert_buffer,
        "{p:?}"
    );
    assert!(p.spine_resident_layers <= p.spine_layers);
    assert_eq!(
        p.spine_streamed == 0,
        p.spine_resident_layers == p.spine_layers
    );
    assert_eq!(p.spine_buffers == 0, p.spine_streamed == 0);
    let streamed: u64 = i.layer_spine[p.spine_resident_layers..].iter().sum();
    assert_eq!(p.spine_streamed, streamed);
    assert_eq!(p.spine + streamed, i.spine);
}

#[test]
fn real_k3_sizes_feed_the_planner() {
    let cfg = real();
    let i = real_inputs(128, SpineFormat::Int8);
    assert_eq!(i.layer_spine.len(), 93);
    assert!(i.layer_spine.iter().all(|&b| b > 0));
    // §6 of the model card: 443.1 MiB of KDA state, 576 bf16 values per token per MLA
    // layer over 24 layers; the server reserve of 32,768 tokens.
    assert_eq!(i.kda_state, 464_633_856);
    assert_eq!(i.mla_cache_per_token, 27_648);
    assert_eq!(i.context_tokens, CONTEXT_RESERVE_TOKENS);
    assert_eq!(i.experts_per_token, cfg.text.num_experts_per_token);
    // The int8 spine is smaller than the stored bf16 one; the streamable layers are most of it.
    let bf16 = real_inputs(128, SpineFormat::Bf16);
    assert!(i.spine < bf16.spine, "{} {}", i.spine, bf16.spine);
    assert!(i.layer_spine.iter().sum::<u64>() < i.spine);
    assert!(i.expert_buffer >= i.expert_bytes);
    // A context longer than the model's is capped.
    let mut long = real_inputs(128, SpineFormat::Int8);
    let req = PlanRequest {
        budget: 128 * GB,
        runtime: 0,
        pin: 0,
        context_tokens: Some(usize::MAX / 2),
        resident_layers_cap: None,
        spine_copied: false,
        state_cache: 0,
        sequences: 1,
    };
    long.context_tokens = PlanInputs::for_model(
        &cfg,
        SpineFormat::Int8,
        real_stored_spine(&cfg),
        real_experts(&cfg),
        req,
    )
    .context_tokens;
    assert_eq!(long.context_tokens, cfg.text.max_position_embeddings);
}

#[test]
fn real_k3_at_16_64_128_and_512_gb() {
    let mut last: Option<MemoryPlan> = None;
    for budget in [16, 64, 128, 512] {
        for format in [SpineFormat::Int8, SpineFormat::Bf16] {
            let i = real_inputs(budget, format);
            let p = plan_memory(&i).unwrap_or_else(|e| panic!("{budget} GB {format:?}: {e}"));
            check_split(&p, &i);
            assert_eq!(p.spine_layers, 93);
            assert_eq!(p.experts, i.experts);
            if format == SpineFormat::Int8 {
                if let Some(prev) = &last {
                    // More budget never means fewer resident layers or a smaller cache.
                    assert!(p.spine_resident_layers >= prev.spine_resident_layers);
                    assert!(p.cache >= prev.cache);
                }
                last = Some(p.clone());
            }
            let line = p.describe("pread", 4, "off");
            assert!(line.starts_with(&format!("memory budget {budget}.000 GB = spine")));
            match budget {
                // 16 GB cannot hold the whole spine of either format: layers stream.
                16 => {
                    assert!(p.spine_resident_layers < 93, "{p:?}");
                    assert!(line.contains("layers resident"), "{line}");
                }
                // From 128 GB the whole spine of either format is resident.
                128 | 512 => {
                    assert_eq!(p.spine_resident_layers, 93, "{budget} {format:?}");
                    assert!(line.contains("copied into huge-page memory"), "{line}");
                }
                _ => {}
            }
        }
    }
    // 64 GB holds the whole int8 spine (about half of the bf16 one).
    let p = plan_memory(&real_inputs(64, SpineFormat::Int8)).unwrap();
    assert_eq!(p.spine_resident_layers, 93, "{p:?}");
    // 512 GB caches a sizeable part, but not all, of the ≈1.5 TB of experts.
    let p = plan_memory(&real_inputs(512, SpineFormat::Int8)).unwrap();
    let all = p.expert_bytes * p.experts as u64;
    assert!(p.cache > all / 5 && p.cache < all, "{p:?}");
}

#[test]
fn a_budget_below_the_minimum_is_refused_with_the_parts() {
    let i = real_inputs(2, SpineFormat::Int8);
    let e = plan_memory(&i).unwrap_err();
    let PlanError::TooSmall { need, budget, .. } = &e else {
        panic!("{e:?}")
    };
    assert!(need > budget);
    let msg = e.to_string();
    assert!(
        msg.starts_with("memory budget 2.000 GB is too small even with every spine layer streamed"),
        "{msg}"
    );
    assert!(msg.contains("32768 tokens"), "{msg}");
    // The smallest budget that plans is exactly `need`, with every layer streamed.
    let mut at = i.clone();
    at.budget = *need;
    let p = plan_memory(&at).unwrap();
    assert_eq!(p.spine_resident_layers, 0);
    assert_eq!(p.cache, at.experts_per_token as u64 * at.expert_buffer);
    check_split(&p, &at);
    at.budget -= 1;
    assert!(matches!(plan_memory(&at), Err(PlanError::TooSmall { .. })));
}

#[test]
fn the_resident_layer_cap_and_the_pinned_tier() {
    let mut i = real_inputs(128, SpineFormat::Int8);
    i.resident_layers_cap = Some(10);
    let p = plan_memory(&i).unwrap();
    assert_eq!(p.spine_resident_layers, 10);
    check_split(&p, &i);
    i.resident_layers_cap = Some(1000);
    assert_eq!(plan_memory(&i).unwrap().spine_resident_layers, 93);
    i.resident_layers_cap = None;
    let cache = plan_memory(&i).unwrap().cache;
    i.pin = cache - i.expert_buffer;
    assert_eq!(plan_memory(&i).unwrap().pin, i.pin);
    i.pin += 1;
    let e = plan_memory(&i).unwrap_err();
    assert!(matches!(e, PlanError::PinTooLarge { .. }), "{e:?}");
    assert!(
        e.to_string().contains("does not fit the expert cache"),
        "{e}"
    );
}

#[test]
fn a_known_context_leaves_more_for_the_cache() {
    let open = plan_memory(&real_inputs(64, SpineFormat::Int8)).unwrap();
    let mut i = real_inputs(64, SpineFormat::Int8);
    i.context_tokens = 1000;
    let short = plan_memory(&i).unwrap();
    assert_eq!(
        short.cache - open.cache,
        (CONTEXT_RESERVE_TOKENS as u64 - 1000) * i.mla_cache_per_token
    );
}

#[test]
fn small_sizes_by_hand() {
    // Two layers of 100 B, a 50 B rest of spine, 10 B state, 1 expert buffer of 8 B.
    let i = PlanInputs {
        budget: 1_000,
        spine: 250,
        layer_spine: vec![100, 100],
        resident_layers_cap: None,
        kda_state: 10,
        mla_cache_per_token: 0,
        context_tokens: 0,
        sequences: 1,
        runtime: 0,
        scratch: 0,
        expert_bytes: 8,
        expert_buffer: 8,
        experts: 10,
        experts_per_token: 1,
        pin: 0,
        contiguous: false,
        spine_copied: false,
        state_cache: 0,
    };
    let p = plan_memory(&i).unwrap();
    assert_eq!((p.spine_resident_layers, p.spine, p.cache), (2, 250, 740));
    // The prefix-state RAM tier is reserved before the expert cache.
    let with_states = plan_memory(&PlanInputs {
        state_cache: 100,
        ..i.clone()
    })
    .unwrap();
    assert_eq!((with_states.state_cache, with_states.cache), (100, 640));
    // At most an eighth of the budget, and never the expert cache's minimum.
    let greedy = |ask: u64, budget: u64| {
        plan_memory(&PlanInputs {
            state_cache: ask,
            budget,
            ..i.clone()
        })
        .unwrap()
    };
    assert_eq!(greedy(10_000, 1_000).state_cache, 125);
    let tight = greedy(10_000, 278);
    assert_eq!((tight.state_cache, tight.cache), (10, 8));
    assert!(
        p.describe("x", 1, "off")
            .contains("mmap'd, resident as touched")
    );
    assert!(p.describe("x", 1, "off").contains("non-contiguous"));
    // A cache larger than every expert holds all of them, not more.
    assert_eq!(p.cached_experts(), 10);
    assert!(
        p.describe("x", 1, "off")
            .contains("(10 of 10 experts, 100.0%;")
    );
    // Three sequences: two more KDA states (10 B each) from the expert cache.
    let three = plan_memory(&PlanInputs {
        sequences: 3,
        ..i.clone()
    })
    .unwrap();
    assert_eq!((three.sequences, three.state, three.cache), (3, 30, 720));
    assert!(three.describe("x", 1, "off").contains("3 sequences"));
    assert!(p.describe("x", 1, "off").contains("(0 tokens, 1 sequence)"));
    // Only as many as the cache can spare above its minimum (one buffer): 268 + 15 B holds
    // one more state, not two, and the plan never fails for them.
    let spare = plan_memory(&PlanInputs {
        sequences: 3,
        budget: 268 + 15,
        ..i.clone()
    })
    .unwrap();
    assert_eq!((spare.sequences, spare.state, spare.cache), (2, 20, 13));
    let none = plan_memory(&PlanInputs {
        sequences: 3,
        budget: 268,
        ..i.clone()
    })
    .unwrap();
    assert_eq!((none.sequences, none.state, none.cache), (1, 10, 8));
    // 300 B: the whole spine (250) + state (10) + one buffer (8) fits.
    let p = plan_memory(&PlanInputs {
        budget: 268,
        ..i.clone()
    })
    .unwrap();
    assert_eq!((p.spine_resident_layers, p.cache), (2, 8));
    // One byte less: the second layer streams (two buffers of 100 + slack do not fit
    // either), so the budget is refused.
    assert!(
        plan_memory(&PlanInputs {
            budget: 267,
            ..i.clone()
        })
        .is_err()
    );
}

#[test]
fn the_longest_admitted_context_is_the_last_that_plans() {
    let cfg = real();
    let limit = cfg.text.max_position_embeddings;
    for (budget, format) in [(16, SpineFormat::Int8), (20, SpineFormat::Bf16)] {
        let i = real_inputs(budget, format);
        let n = max_context_tokens(&i, limit).unwrap();
        assert!(n > CONTEXT_RESERVE_TOKENS && n < limit, "{budget} GB: {n}");
        let at = |tokens| PlanInputs {
            context_tokens: tokens,
            ..i.clone()
        };
        plan_memory(&at(n)).unwrap();
        assert!(
            matches!(plan_memory(&at(n + 1)), Err(PlanError::TooSmall { .. })),
            "{budget} GB: {n} + 1"
        );
    }
    // A budget that holds the whole context is capped by the limit.
    assert_eq!(
        max_context_tokens(&real_inputs(512, SpineFormat::Int8), 1000),
        Some(1000)
    );
    // Below the minimum plan not even an empty context fits.
    assert_eq!(
        max_context_tokens(&real_inputs(2, SpineFormat::Int8), limit),
        None
    );
}

#[test]
fn a_server_on_real_k3_reserves_a_second_sequence_where_the_cache_spares_it() {
    for budget_gb in [64, 512] {
        let one = real_inputs(budget_gb, SpineFormat::Int8);
        let p1 = plan_memory(&one).unwrap();
        let p2 = plan_memory(&PlanInputs {
            sequences: 2,
            ..one.clone()
        })
        .unwrap();
        assert_eq!((p1.sequences, p2.sequences), (1, 2));
        // A KDA state (0.46 GB) and 8,192 positions (0.23 GB) more.
        let side = one.kda_state + SIDE_CONTEXT_TOKENS as u64 * one.mla_cache_per_token;
        assert!((600_000_000..800_000_000).contains(&side), "{side}");
        assert_eq!(p2.state, p1.state + side);
        assert_eq!(p2.cache + p2.state_cache, p1.cache + p1.state_cache - side);
        assert_eq!(p2.spine_resident_layers, p1.spine_resident_layers);
        check_split(&p2, &one);
    }
}
