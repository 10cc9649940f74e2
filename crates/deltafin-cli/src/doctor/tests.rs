use super::canaries::{canaries, worst_ratio};
use super::memory::huge_pages_check;
use super::*;

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
