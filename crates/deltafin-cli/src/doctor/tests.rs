use super::canaries::{canaries, worst_ratio};
use super::memory::huge_pages_check;
use super::*;
use deltafin_k3::text::chat::{ReasoningEffort, Thinking};

#[test]
fn canaries_pass_on_this_host() {
    for c in canaries() {
        assert_eq!(c.status, Status::Ok, "{}: {}", c.name, c.detail);
    }
}

#[test]
fn canary_detects_a_wrong_result() {
    let y = [1.0f32, 2.0];
    let reference = [1.0f64, 2.1];
    let scale = [1.0f64, 2.0];
    assert!(worst_ratio(&y, &reference, &scale) > 1.0);
    assert!(worst_ratio(&[f32::NAN], &[0.0], &[0.0]).is_infinite());
}

#[test]
fn the_huge_page_check_says_what_load_will_do() {
    for (mode, status, says) in [
        (Some("madvise"), Status::Ok, "copied into huge pages"),
        (Some("always"), Status::Ok, "copied into huge pages"),
        (Some("never"), Status::Info, "stay mapped in 4 KiB pages"),
        (None, Status::Info, "no transparent huge pages"),
    ] {
        let mut r = Report::default();
        huge_pages_check(&mut r, mode.map(String::from));
        assert_eq!(r.checks.len(), 1);
        assert_eq!(r.checks[0].status, status, "{mode:?}");
        assert!(r.checks[0].detail.contains(says), "{}", r.checks[0].detail);
        assert_eq!(r.facts["transparent_huge_pages"], json!(mode));
    }
}

/// The process RSS both plans are made with (measured twice it would differ).
const RUNTIME: u64 = 40_000_000;

fn parse(argv: &[&str]) -> crate::Command {
    use clap::Parser;
    crate::Cli::try_parse_from(argv).unwrap().command.unwrap()
}

/// The doctor's admitted context is the longest context `run`'s own memory plan accepts
/// with the same flags, and its reserved context is the one `run` and `serve` plan with.
#[test]
fn the_admitted_context_is_the_longest_the_run_plan_accepts() {
    use deltafin_k3::engine::{EngineError, PlanError};
    use deltafin_k3::synth::{SynthDims, SynthSpec, synthesize};
    use deltafin_k3::weights::checkpoint::Checkpoint;
    let d = tempfile::tempdir().unwrap();
    synthesize(d.path(), &SynthSpec::new(SynthDims::tiny(), 7)).unwrap();
    let root = d.path().display().to_string();
    let flags = [
        "--model-root",
        &root,
        "--memory-budget-gb",
        "0.2",
        "--spine",
        "bf16",
    ];
    let crate::Command::Doctor(doctor) = parse(&[&["deltafin", "doctor"][..], &flags].concat())
    else {
        panic!("not doctor")
    };
    let crate::Command::Run(run) = parse(&[&["deltafin", "run"][..], &flags].concat()) else {
        panic!("not run")
    };
    let config = crate::engine_config::engine_config(&doctor.model, None, None).unwrap();
    let ckpt = Checkpoint::open(d.path()).unwrap();
    let mut r = Report::default();
    plan::plan_checks(&mut r, &ckpt, &config, None, Some(RUNTIME));
    assert_eq!(r.problems(), 0, "{:?}", r.checks);
    let admitted = r.admitted_context.unwrap() as usize;
    assert!(admitted < ckpt.config().text.max_position_embeddings);

    let run_plan = |context: Option<usize>| {
        let mut c = crate::run::engine_config(&run, Thinking::On(ReasoningEffort::Max)).unwrap();
        if context.is_some() {
            c.context_tokens = context;
        }
        crate::session::builder(d.path(), &c)
            .runtime_bytes(RUNTIME)
            .plan()
    };
    let open = run_plan(None).unwrap().unwrap();
    assert_eq!(r.facts["reserved_context"], json!(open.context_tokens));
    let longest = run_plan(Some(admitted)).unwrap().unwrap();
    assert_eq!(longest.context_tokens, admitted);
    let e = run_plan(Some(admitted + 1)).unwrap_err();
    assert!(
        matches!(e, EngineError::Plan(PlanError::TooSmall { .. })),
        "{e:?}"
    );
}
