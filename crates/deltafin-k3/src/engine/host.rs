//! What the host says about memory (Linux `/proc`): the process's resident set, which the
//! memory plan counts as the runtime, and the memory available, which decides whether
//! resident experts are copied into huge-page memory.

/// Memory counters of this process from `/proc/self/status`, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcMemory {
    /// Resident set now (anonymous + file + shmem) and its peak.
    pub rss: u64,
    pub peak_rss: u64,
    pub rss_anon: u64,
    pub rss_file: u64,
    /// Anonymous memory in transparent huge pages (`/proc/self/smaps_rollup`; 0 where the
    /// file does not exist).
    pub anon_huge: u64,
}

/// Read `/proc/self/status`; `None` where it does not exist.
pub fn proc_memory() -> Option<ProcMemory> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    Some(parse_proc_memory(&text, &rollup))
}

fn parse_proc_memory(status: &str, rollup: &str) -> ProcMemory {
    let mut m = ProcMemory::default();
    for line in status.lines() {
        let mut it = line.split_whitespace();
        let (Some(key), Some(v)) = (it.next(), it.next()) else {
            continue;
        };
        let Ok(kb) = v.parse::<u64>() else { continue };
        match key {
            "VmRSS:" => m.rss = kb * 1024,
            "VmHWM:" => m.peak_rss = kb * 1024,
            "RssAnon:" => m.rss_anon = kb * 1024,
            "RssFile:" => m.rss_file = kb * 1024,
            _ => {}
        }
    }
    m.anon_huge = rollup
        .lines()
        .find_map(|l| l.strip_prefix("AnonHugePages:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024);
    m
}

/// `/proc/meminfo` figures in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    pub total: u64,
    pub available: u64,
}

/// Total and available memory from `/proc/meminfo` (Linux); `None` where it is unreadable.
pub fn meminfo() -> Option<MemInfo> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_meminfo(&text)
}

/// [`MemInfo`] from the text of `/proc/meminfo`; `None` without `MemTotal` and
/// `MemAvailable`.
pub fn parse_meminfo(text: &str) -> Option<MemInfo> {
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let rest = line[name.len()..].trim_start_matches(':').trim();
        let kb: u64 = rest.split_whitespace().next()?.parse().ok()?;
        Some(kb * 1024)
    };
    Some(MemInfo {
        total: field("MemTotal")?,
        available: field("MemAvailable")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_parses_total_and_available() {
        let m = parse_meminfo("MemTotal:       1000 kB\nMemFree: 10 kB\nMemAvailable:    500 kB\n")
            .unwrap();
        assert_eq!((m.total, m.available), (1000 * 1024, 500 * 1024));
        assert!(parse_meminfo("MemTotal: 1 kB\n").is_none());
    }

    #[test]
    fn proc_status_fields_in_bytes() {
        let m = parse_proc_memory(
            "Name: x\nVmHWM:  300 kB\nVmRSS:  200 kB\nRssAnon: 120 kB\nRssFile: 80 kB\nbad\n",
            "Rss: 1 kB\nAnonHugePages:   2048 kB\n",
        );
        assert_eq!(
            m,
            ProcMemory {
                rss: 200 * 1024,
                peak_rss: 300 * 1024,
                rss_anon: 120 * 1024,
                rss_file: 80 * 1024,
                anon_huge: 2048 * 1024,
            }
        );
        if cfg!(target_os = "linux") {
            assert!(proc_memory().is_some_and(|m| m.rss > 0));
        }
    }
}
