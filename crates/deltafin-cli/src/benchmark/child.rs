//! One benchmark run: the relaunched binary with capped output capture and a timeout.

use anyhow::{Context, Result, anyhow};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Cap on each run's captured stdout.
pub const STDOUT_CAP: u64 = 64 << 20;
/// Cap on each run's captured stderr.
pub const STDERR_CAP: u64 = 16 << 20;

/// Copy up to `cap` bytes of `src` to `path`, counting the rest: (total bytes, truncated).
fn capture<R: Read + Send + 'static>(
    mut src: R,
    path: PathBuf,
    cap: u64,
) -> JoinHandle<std::io::Result<(u64, bool)>> {
    std::thread::spawn(move || {
        let mut f = File::create(&path)?;
        let mut buf = vec![0u8; 64 << 10];
        let mut total = 0u64;
        loop {
            let n = src.read(&mut buf)?;
            if n == 0 {
                break;
            }
            if total < cap {
                let keep = (cap - total).min(n as u64) as usize;
                f.write_all(&buf[..keep])?;
            }
            total += n as u64;
        }
        Ok((total, total > cap))
    })
}

/// How one run ended: exit status, whether it was killed at the timeout, wall time, and the
/// (total bytes, truncated) of each captured stream.
pub(super) struct ChildOutcome {
    pub(super) exit: Option<i32>,
    pub(super) timed_out: bool,
    pub(super) wall_seconds: f64,
    pub(super) stdout: (u64, bool),
    pub(super) stderr: (u64, bool),
}

pub(super) fn run_child(
    runner: &Path,
    args: &[String],
    env: &[(String, String)],
    dir: &Path,
    timeout: f64,
) -> Result<ChildOutcome> {
    let mut cmd = Command::new(runner);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let t = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {}", runner.display()))?;
    let out = child
        .stdout
        .take()
        .ok_or_else(|| anyhow!("the child's stdout was not captured"))?;
    let err = child
        .stderr
        .take()
        .ok_or_else(|| anyhow!("the child's stderr was not captured"))?;
    let out_t = capture(out, dir.join("stdout.txt"), STDOUT_CAP);
    let err_t = capture(err, dir.join("stderr.txt"), STDERR_CAP);
    let limit = Duration::from_secs_f64(timeout);
    let mut timed_out = false;
    let status = loop {
        if let Some(st) = child
            .try_wait()
            .context("cannot wait for a benchmark run")?
        {
            break st;
        }
        if t.elapsed() > limit {
            timed_out = true;
            let _ = child.kill();
            break child.wait().context("cannot reap a killed benchmark run")?;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let wall_seconds = t.elapsed().as_secs_f64();
    let join = |h: JoinHandle<std::io::Result<(u64, bool)>>, what: &str| -> Result<(u64, bool)> {
        h.join()
            .map_err(|_| anyhow!("the {what} capture thread panicked"))?
            .with_context(|| format!("cannot capture the run's {what}"))
    };
    Ok(ChildOutcome {
        exit: status.code(),
        timed_out,
        wall_seconds,
        stdout: join(out_t, "stdout")?,
        stderr: join(err_t, "stderr")?,
    })
}
