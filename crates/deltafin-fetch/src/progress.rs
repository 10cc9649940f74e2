//! Progress bars on stderr, for transfers here and for the `deltafin` commands' conversions.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

/// The template of a bar counting bytes.
pub const BYTES: &str = "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}";

/// A bar of `total` units drawn on stderr with `template` (indicatif's template syntax), or a
/// hidden one unless `show` and stderr is a terminal (a log file gets no bar).
pub fn stderr_bar(total: u64, template: &str, show: bool) -> ProgressBar {
    let target = if show && std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(total), target);
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bar_that_is_not_shown_still_counts() {
        let bar = stderr_bar(10, BYTES, false);
        assert!(bar.is_hidden());
        bar.inc(4);
        assert_eq!((bar.position(), bar.length()), (4, Some(10)));
    }
}
