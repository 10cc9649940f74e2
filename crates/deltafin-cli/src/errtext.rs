//! An error and its causes as one line: `context: cause: cause`, as anyhow's `{:#}` writes
//! it, except that a cause whose text the line already holds is left out. Many errors put
//! their source in their own message (`{path}: {source}`) and also return it as their
//! source, which `{:#}` would print twice (`…: No space left on device (os error 28): No
//! space left on device (os error 28)`).

/// `e` with its causes, each said once.
pub fn describe(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for link in e.chain() {
        let text = link.to_string();
        if out.is_empty() {
            out = text;
        } else if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that says its source in its own message and returns it as its source.
    #[derive(Debug)]
    struct InFile {
        path: String,
        source: std::io::Error,
    }

    impl std::fmt::Display for InFile {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "{}: {}", self.path, self.source)
        }
    }

    impl std::error::Error for InFile {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.source)
        }
    }

    #[test]
    fn each_cause_is_said_once() {
        let io = std::io::Error::from_raw_os_error(28);
        let os = io.to_string();
        let e = anyhow::Error::new(InFile {
            path: "/m/k3-meta/t.jsonl".into(),
            source: io,
        })
        .context("cannot write the trace");
        assert_eq!(format!("{e:#}").matches(&os).count(), 2);
        let text = describe(&e);
        assert_eq!(
            text,
            format!("cannot write the trace: /m/k3-meta/t.jsonl: {os}")
        );
        // Causes that add something are kept.
        let e = anyhow::anyhow!("disk full").context("events file x.jsonl");
        assert_eq!(describe(&e), "events file x.jsonl: disk full");
    }
}
