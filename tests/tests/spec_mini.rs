//! Speculative decoding on `mini` (a synthesized, memory-bound K3: hidden 1024, 24 layers,
//! 128 experts top-8, the real vocabulary; 0.85 GB of weights read per decoded token): the
//! cost of a verify pass against a decode step, and the speed-up of drafters built to agree
//! with the target (recorded in docs/PERFORMANCE.md, "Speculative decoding on mini").
//!
//! Both tests are measurements (`#[ignore]`) and need the checkpoint: set `DELTAFIN_MINI` to
//! its root (read only; the int8 spine must already be converted for `int8`). Without the
//! variable they fail and say so. Run in a release build:
//!
//! ```text
//! DELTAFIN_MINI=/work/mini-k3 cargo test --release -p deltafin-tests --test spec_mini \
//!     -- --ignored --nocapture --test-threads 1
//! ```
//!
//! `DELTAFIN_MINI_SPINE` (`bf16`, `int8` or `both`, default `both`) chooses the spine(s);
//! `DELTAFIN_MINI_MAX_NEW` (default 64) the tokens per prompt of the drafter measurement.

use deltafin_k3::config::K3Config;

use deltafin_k3::generate::Greedy;
use deltafin_k3::model::{K3Model, LogitRows};
use deltafin_k3::synth::synthesize_dspark;
use deltafin_k3::text::tokenizer::{END_OF_MSG, EOS, Tokenizer};
use deltafin_k3::weights::loader::{EngineOptions, open_model};
use deltafin_k3::weights::spine_int8::SpineFormat;
use deltafin_spec::dspark::{BLOCK, DsparkDrafter, DsparkModel};
use deltafin_spec::{
    Drafter, PolicyMode, PolicyReport, SpecPolicy, SpecStats, WallClock, generate_with_policy,
};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

const STOP: [u32; 2] = [END_OF_MSG, EOS];
const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Kimi K3 routes every token to sixteen of 896 experts per layer; the spine stays resident.",
    "Once upon a time, in a small village by the sea, there lived",
];

fn mini_root() -> PathBuf {
    match std::env::var_os("DELTAFIN_MINI") {
        Some(p) => PathBuf::from(p),
        None => panic!("set DELTAFIN_MINI to the mini checkpoint root (e.g. /work/mini-k3)"),
    }
}

fn spines() -> Vec<SpineFormat> {
    match std::env::var("DELTAFIN_MINI_SPINE").as_deref() {
        Ok("bf16") => vec![SpineFormat::Bf16],
        Ok("int8") => vec![SpineFormat::Int8],
        Ok("both") | Err(_) => vec![SpineFormat::Bf16, SpineFormat::Int8],
        Ok(other) => panic!("DELTAFIN_MINI_SPINE={other}: expected bf16, int8 or both"),
    }
}

fn spine_name(s: SpineFormat) -> &'static str {
    match s {
        SpineFormat::Bf16 => "bf16",
        SpineFormat::Int8 => "int8",
    }
}

fn load(root: &Path, spine: SpineFormat) -> K3Model {
    let opts = EngineOptions {
        spine,
        ..EngineOptions::default()
    };
    open_model(root, &opts).unwrap()
}

fn uptime() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn greedy_ids(model: &K3Model, prompt: &[u32], n: usize) -> Vec<u32> {
    deltafin_tests::plain_greedy(model, prompt, n)
}

/// `V(k)`, the time of one exact verify pass over `[pending, d₁…d_k]` (all rows' logits, as
/// `verify` forms them), against `T(0)`, one plain decode step, after the prompt and on
/// K3's own greedy continuation (the drafts an agreeing drafter would send). Repeats are
/// taken in the order 0…8 then 8…0 (A B B A) and the median is reported.
#[test]
#[ignore = "measurement on mini; needs DELTAFIN_MINI"]
fn mini_verify_cost_against_a_decode_step() {
    let root = mini_root();
    let tok = Tokenizer::from_dir(&root).unwrap();
    const K: usize = 8;
    const REPEATS: usize = 2;
    for spine in spines() {
        let model = load(&root, spine);
        // times[k] over prompts and repeats, as ratios to that prompt's T(0).
        let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); K + 1];
        let mut secs: Vec<Vec<f64>> = vec![Vec::new(); K + 1];
        let mut plain: Vec<f64> = Vec::new();
        let started = uptime();
        for text in &PROMPTS[..3] {
            let prompt = tok.encode_ordinary(text);
            let cont = greedy_ids(&model, &prompt, K + 2);
            let mut state = model.new_state();
            model.prefill(&mut state, &prompt).unwrap();
            let cp = state.checkpoint();
            let time = |k: usize, state: &mut deltafin_k3::model::state::State| {
                let t = Instant::now();
                if k == 0 {
                    model.decode(state, cont[0]).unwrap();
                } else {
                    model
                        .forward_exact(state, &cont[..k + 1], LogitRows::All)
                        .unwrap();
                }
                let s = t.elapsed().as_secs_f64();
                state.rollback(&cp, &model.dims).unwrap();
                s
            };
            // Warm-up (page cache, thread pool).
            time(0, &mut state);
            time(K, &mut state);
            let mut t: Vec<Vec<f64>> = vec![Vec::new(); K + 1];
            for _ in 0..REPEATS {
                for k in (0..=K).chain((0..=K).rev()) {
                    t[k].push(time(k, &mut state));
                }
            }
            let t0 = median(&mut t[0].clone());
            plain.push(t0);
            for k in 0..=K {
                for &x in &t[k] {
                    ratios[k].push(x / t0);
                    secs[k].push(x);
                }
            }
        }
        eprintln!(
            "mini, spine {}: load average {started} → {}",
            spine_name(spine),
            uptime()
        );
        eprintln!(
            "T(0) per prompt: {}",
            plain
                .iter()
                .map(|s| format!("{:.1} ms", s * 1e3))
                .collect::<Vec<_>>()
                .join(", ")
        );
        eprintln!("| k | rows | median V(k) | V(k) / T(0) | (V(k) / T(0)) / (k + 1) |");
        eprintln!("|---|---|---|---|---|");
        for k in 0..=K {
            let r = median(&mut ratios[k]);
            eprintln!(
                "| {k} | {} | {:.1} ms | {:.2} | {:.2} |",
                k + 1,
                median(&mut secs[k]) * 1e3,
                r,
                r / (k + 1) as f64
            );
        }
        // The premise of drafting on a memory-bound model: eight drafts cost well under
        // eight extra decode steps.
        let r8 = median(&mut ratios[K]);
        assert!(r8 < (K + 1) as f64, "V(8)/T(0) = {r8}");
    }
}

/// The free bigram-table drafter.
struct BigramTable(HashMap<u32, u32>);

impl Drafter for BigramTable {
    fn propose(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        let mut out = Vec::new();
        let Some(&last) = history.last() else {
            return out;
        };
        let mut t = last;
        while out.len() < max {
            let Some(&n) = self.0.get(&t) else { break };
            out.push(n);
            t = n;
        }
        out
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Arm {
    Plain,
    Bigram(PolicyMode, bool),
    Dspark(PolicyMode, bool),
}

fn arm_name(a: Arm) -> String {
    let mode = |m: PolicyMode, session: bool| match (m, session) {
        (PolicyMode::Fixed, _) => format!("fixed {BLOCK}"),
        (PolicyMode::On, _) => "on".to_string(),
        (PolicyMode::Auto, false) => "auto (per prompt)".to_string(),
        (PolicyMode::Auto, true) => "auto (session)".to_string(),
    };
    match a {
        Arm::Plain => "plain greedy | –".to_string(),
        Arm::Bigram(m, s) => format!("bigram table | {}", mode(m, s)),
        Arm::Dspark(m, s) => format!("agreeing DSpark | {}", mode(m, s)),
    }
}

#[derive(Default, Clone)]
struct Outcome {
    secs: Vec<f64>,
    stats: SpecStats,
    last: Option<PolicyReport>,
}

/// Plain greedy against the agreeing drafters under each policy on mini: acceptance, mean
/// accepted length, verify passes, tokens/s and speed-up; the emitted ids equal plain greedy.
/// Arms run A B B A (the list, then reversed) in one time window.
#[test]
#[ignore = "measurement on mini; needs DELTAFIN_MINI"]
fn mini_agreeing_drafters_under_each_policy() {
    let root = mini_root();
    let n: usize = std::env::var("DELTAFIN_MINI_MAX_NEW")
        .ok()
        .map(|v| v.parse().expect("DELTAFIN_MINI_MAX_NEW: a token count"))
        .unwrap_or(64);
    let tok = Tokenizer::from_dir(&root).unwrap();
    let prompts: Vec<Vec<u32>> = PROMPTS[..3]
        .iter()
        .map(|t| tok.encode_ordinary(t))
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let dspark_dir = tmp.path().join("dspark");
    let cfg = K3Config::from_file(root.join("config.json")).unwrap();
    synthesize_dspark(&dspark_dir, 77, &cfg).unwrap();
    let base = DsparkModel::open(&dspark_dir).unwrap();
    for spine in spines() {
        let model = load(&root, spine);
        base.check_target(&model).unwrap();
        greedy_ids(&model, &prompts[0], 4);
        let truths: Vec<Vec<u32>> = prompts.iter().map(|p| greedy_ids(&model, p, n)).collect();
        let tokens: usize = truths.iter().map(Vec::len).sum();
        let seqs: Vec<Vec<u32>> = prompts
            .iter()
            .zip(&truths)
            .map(|(p, t)| {
                std::iter::once(*p.last().unwrap())
                    .chain(t.iter().copied())
                    .collect()
            })
            .collect();
        let table = deltafin_tests::greedy_bigrams(&seqs);
        let dspark = Arc::new(deltafin_tests::agreeing_dspark(&base, &table));
        let arms = [
            Arm::Plain,
            Arm::Bigram(PolicyMode::Fixed, false),
            Arm::Bigram(PolicyMode::On, false),
            Arm::Bigram(PolicyMode::Auto, false),
            Arm::Bigram(PolicyMode::Auto, true),
            Arm::Dspark(PolicyMode::Fixed, false),
            Arm::Dspark(PolicyMode::On, false),
            Arm::Dspark(PolicyMode::Auto, false),
            Arm::Dspark(PolicyMode::Auto, true),
        ];
        let mut results: Vec<Outcome> = vec![Outcome::default(); arms.len()];
        let load_before = uptime();
        let order: Vec<usize> = (0..arms.len()).chain((0..arms.len()).rev()).collect();
        for (round, &i) in order.iter().enumerate() {
            let arm = arms[i];
            let first_round = round < arms.len();
            let t0 = Instant::now();
            let mut stats = SpecStats::default();
            let mut last = None;
            let mut session: Option<SpecPolicy> = None;
            for (p, truth) in prompts.iter().zip(&truths) {
                let (mode, carry, mut d): (PolicyMode, bool, Box<dyn Drafter>) = match arm {
                    Arm::Plain => {
                        let ids = greedy_ids(&model, p, n);
                        assert_eq!(&ids, truth);
                        continue;
                    }
                    Arm::Bigram(m, s) => {
                        (m, s, Box::new(BigramTable(table.iter().copied().collect())))
                    }
                    Arm::Dspark(m, s) => (
                        m,
                        s,
                        Box::new(DsparkDrafter::new(dspark.clone(), &model, 8192).unwrap()),
                    ),
                };
                let mut policy = match (&session, carry) {
                    (Some(prev), true) => prev.carry_over(),
                    _ => SpecPolicy::new(mode, BLOCK, 0.03),
                };
                let (ids, st) = generate_with_policy(
                    &model,
                    p,
                    n,
                    &STOP,
                    d.as_mut(),
                    &mut Greedy,
                    &mut policy,
                    &WallClock::new(),
                    &AtomicBool::new(false),
                    |c| {
                        last = Some(c.policy);
                        Ok(())
                    },
                )
                .unwrap();
                assert_eq!(&ids, truth, "{} on {p:?}", arm_name(arm));
                session = Some(policy);
                stats.verify_passes += st.verify_passes;
                stats.proposed += st.proposed;
                stats.accepted += st.accepted;
                stats.drafting_passes += st.drafting_passes;
            }
            let r = &mut results[i];
            r.secs.push(t0.elapsed().as_secs_f64());
            if first_round {
                r.stats = stats;
                r.last = last;
            } else {
                // Deterministic counters for fixed/on; auto may differ with the timings.
                assert!(
                    !matches!(arm, Arm::Bigram(PolicyMode::Fixed, _)) || r.stats == stats,
                    "{}",
                    arm_name(arm)
                );
            }
        }
        let plain_s = results[0].secs.iter().sum::<f64>() / 2.0;
        eprintln!(
            "mini, spine {}, {} prompts × {n} tokens ({tokens} tokens), width ≤ {BLOCK}; load average {load_before} → {}",
            spine_name(spine),
            prompts.len(),
            uptime()
        );
        eprintln!(
            "| drafter | policy | proposed | accepted | acceptance | mean accepted length | verify passes | tokens/s (A, B) | vs plain | final state, width |"
        );
        eprintln!("|---|---|---|---|---|---|---|---|---|---|");
        for (arm, r) in arms.iter().zip(&results) {
            let secs = r.secs.iter().sum::<f64>() / r.secs.len() as f64;
            let rates: Vec<String> = r
                .secs
                .iter()
                .map(|s| format!("{:.1}", tokens as f64 / s))
                .collect();
            let s = &r.stats;
            let (acc, mal, fin) = match arm {
                Arm::Plain => ("–".to_string(), "–".to_string(), "–".to_string()),
                _ => (
                    format!("{:.1} %", 100.0 * s.acceptance_rate()),
                    format!("{:.2}", s.mean_accepted_length()),
                    r.last
                        .map(|l| format!("{}, {}", l.state.as_str(), l.width))
                        .unwrap_or_default(),
                ),
            };
            let passes = if *arm == Arm::Plain {
                tokens - prompts.len()
            } else {
                s.verify_passes
            };
            eprintln!(
                "| {} | {} | {} | {acc} | {mal} | {passes} | {:.1} ({}) | {:.2}× | {fin} |",
                arm_name(*arm),
                s.proposed,
                s.accepted,
                tokens as f64 / secs,
                rates.join(", "),
                plain_s / secs,
            );
        }
    }
}

/// Seeded sampling at T = 1.0 (top-p 0.95, Moonshot's API setting) on mini: plain sampled
/// decoding against the fixed-width bigram drafter built from (a) the sampled trajectories
/// themselves (a drafter that agrees with K3's draws) and (b) the greedy trajectories (a drafter
/// that agrees with K3's argmax), and greedy decoding with (b) for comparison. Every drafted run
/// emits exactly the plain sampled ids (identity acceptance). Arms run A B B A.
///
/// A bigram drafter proposes one token, a point mass `q`: the classic rule accepts it with
/// `min(1, p(d)/q(d)) = p(d)`, the probability that K3's own draw is `d`, i.e. the identity
/// rule's acceptance: for such drafters identity costs nothing in acceptance.
#[test]
#[ignore = "measurement on mini; needs DELTAFIN_MINI"]
fn mini_sampled_drafting() {
    use deltafin_k3::sampling::{Sampler, Sampling};
    let root = mini_root();
    let n = 64;
    let tok = Tokenizer::from_dir(&root).unwrap();
    let prompts: Vec<Vec<u32>> = PROMPTS[..3]
        .iter()
        .map(|t| tok.encode_ordinary(t))
        .collect();
    let x = Sampling::new(1.0, 0, 0.95, 0.0, 0).unwrap();
    let seeded = |i: usize| {
        Sampler(Sampling {
            seed: 1000 + i as u64,
            ..x
        })
    };
    let bigrams = |runs: &[Vec<u32>]| -> HashMap<u32, u32> {
        let seqs: Vec<Vec<u32>> = prompts
            .iter()
            .zip(runs)
            .map(|(p, t)| {
                std::iter::once(*p.last().unwrap())
                    .chain(t.iter().copied())
                    .collect()
            })
            .collect();
        deltafin_tests::greedy_bigrams(&seqs).into_iter().collect()
    };
    for spine in spines() {
        let model = load(&root, spine);
        let plain_sampled = |i: usize, p: &[u32]| -> Vec<u32> {
            let opts = deltafin_k3::generate::GenerateOptions {
                max_new: Some(n),
                stop_ids: STOP.to_vec(),
                max_context: 4096,
                top_logits: 0,
            };
            deltafin_spec::generate_with(
                &model,
                p,
                &opts,
                &mut seeded(i),
                &AtomicBool::new(false),
                |_| Ok(()),
            )
            .unwrap()
            .ids
        };
        let sampled: Vec<Vec<u32>> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| plain_sampled(i, p))
            .collect();
        let greedy: Vec<Vec<u32>> = prompts.iter().map(|p| greedy_ids(&model, p, n)).collect();
        let tables = [bigrams(&sampled), bigrams(&greedy)];
        // Arms: 0 plain sampled, 1 sampled + sampled-bigram drafter, 2 sampled + greedy-bigram
        // drafter, 3 plain greedy, 4 greedy + greedy-bigram drafter.
        let names = [
            "T=1.0, plain",
            "T=1.0, drafter agreeing with the draws",
            "T=1.0, drafter agreeing with the argmax",
            "greedy, plain",
            "greedy, drafter agreeing with the argmax",
        ];
        let mut secs = vec![Vec::new(); names.len()];
        let mut stats = vec![SpecStats::default(); names.len()];
        let load_before = uptime();
        let order: Vec<usize> = (0..names.len()).chain((0..names.len()).rev()).collect();
        for &arm in &order {
            let t0 = Instant::now();
            let mut st = SpecStats::default();
            for (i, p) in prompts.iter().enumerate() {
                let want = if arm < 3 { &sampled[i] } else { &greedy[i] };
                let ids = match arm {
                    0 => plain_sampled(i, p),
                    3 => greedy_ids(&model, p, n),
                    _ => {
                        let table = if arm == 1 { &tables[0] } else { &tables[1] };
                        let mut d = BigramTable(table.clone());
                        let mut policy = SpecPolicy::new(PolicyMode::Fixed, BLOCK, 0.03);
                        let mut sampler = seeded(i);
                        let mut greedy_rule = Greedy;
                        let rule: &mut dyn deltafin_k3::generate::Choose = if arm == 4 {
                            &mut greedy_rule
                        } else {
                            &mut sampler
                        };
                        let (ids, s) = generate_with_policy(
                            &model,
                            p,
                            n,
                            &STOP,
                            &mut d,
                            rule,
                            &mut policy,
                            &WallClock::new(),
                            &AtomicBool::new(false),
                            |_| Ok(()),
                        )
                        .unwrap();
                        st.verify_passes += s.verify_passes;
                        st.proposed += s.proposed;
                        st.accepted += s.accepted;
                        st.drafting_passes += s.drafting_passes;
                        ids
                    }
                };
                assert_eq!(&ids, want, "{}", names[arm]);
            }
            secs[arm].push(t0.elapsed().as_secs_f64());
            stats[arm] = st;
        }
        let tokens = |arm: usize| -> usize {
            if arm < 3 { &sampled } else { &greedy }
                .iter()
                .map(Vec::len)
                .sum()
        };
        eprintln!(
            "mini, spine {}, {} prompts × ≤ {n} tokens, fixed width {BLOCK}; load average {load_before} → {}",
            spine_name(spine),
            prompts.len(),
            uptime()
        );
        eprintln!(
            "| run | proposed | accepted | acceptance | tokens/s (A, B) | vs its plain run |"
        );
        eprintln!("|---|---|---|---|---|---|");
        for arm in 0..names.len() {
            let mean = secs[arm].iter().sum::<f64>() / secs[arm].len() as f64;
            let base = if arm < 3 { 0 } else { 3 };
            let base_mean = secs[base].iter().sum::<f64>() / secs[base].len() as f64;
            let rates: Vec<String> = secs[arm]
                .iter()
                .map(|s| format!("{:.1}", tokens(arm) as f64 / s))
                .collect();
            let s = &stats[arm];
            let acc = if s.proposed == 0 {
                "–".to_string()
            } else {
                format!("{:.1} %", 100.0 * s.acceptance_rate())
            };
            eprintln!(
                "| {} | {} | {} | {acc} | {:.1} ({}) | {:.2}× |",
                names[arm],
                s.proposed,
                s.accepted,
                tokens(arm) as f64 / mean,
                rates.join(", "),
                base_mean / mean
            );
        }
    }
}
