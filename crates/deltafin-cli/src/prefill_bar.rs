//! The prefill progress bar of `deltafin run` (docs/CLI.md): prompt tokens done of all,
//! tokens per second and the time left, rewritten in place on stderr when stderr is a
//! terminal, quiet otherwise.

use deltafin_k3::prefix::PrefillProgress;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Least time between two redraws.
const REDRAW: Duration = Duration::from_millis(100);

pub struct PrefillBar {
    tty: bool,
    start: Instant,
    last: Option<Instant>,
    done: bool,
}

impl PrefillBar {
    pub fn new() -> PrefillBar {
        PrefillBar {
            tty: std::io::stderr().is_terminal(),
            start: Instant::now(),
            last: None,
            done: false,
        }
    }

    /// Redraw for `p` (at most every 100 ms, and once at the end).
    pub fn update(&mut self, p: PrefillProgress) {
        if !self.tty || self.done {
            return;
        }
        let now = Instant::now();
        let finished = p.done >= p.total as f64;
        if !finished && self.last.is_some_and(|t| now.duration_since(t) < REDRAW) {
            return;
        }
        self.last = Some(now);
        let _ = write!(
            std::io::stderr(),
            "\r\x1b[2K{}",
            line(p, self.start.elapsed())
        );
        if finished {
            self.done = true;
            let _ = writeln!(std::io::stderr());
        }
    }
}

/// The bar's text: `[deltafin] prefill 1234/5000 tokens (1024 reused) 45.2 token/s ETA 1m 12s`.
pub fn line(p: PrefillProgress, elapsed: Duration) -> String {
    let computed = (p.done - p.reused as f64).max(0.0);
    let secs = elapsed.as_secs_f64();
    let rate = if secs > 0.0 { computed / secs } else { 0.0 };
    let left = (p.total as f64 - p.done).max(0.0);
    let eta = if rate > 0.0 {
        let s = (left / rate).round() as u64;
        if s >= 60 {
            format!("{}m {:02}s", s / 60, s % 60)
        } else {
            format!("{s}s")
        }
    } else {
        "?".to_string()
    };
    let reused = if p.reused > 0 {
        format!(" ({} reused)", p.reused)
    } else {
        String::new()
    };
    format!(
        "[deltafin] prefill {}/{} tokens{reused} {rate:.1} token/s ETA {eta}",
        p.done.round() as u64,
        p.total
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_names_progress_speed_and_time_left() {
        let p = PrefillProgress {
            done: 1500.0,
            total: 5000,
            reused: 1000,
        };
        assert_eq!(
            line(p, Duration::from_secs(10)),
            "[deltafin] prefill 1500/5000 tokens (1000 reused) 50.0 token/s ETA 1m 10s"
        );
        let start = PrefillProgress {
            done: 0.0,
            total: 10,
            reused: 0,
        };
        assert_eq!(
            line(start, Duration::ZERO),
            "[deltafin] prefill 0/10 tokens 0.0 token/s ETA ?"
        );
    }
}
