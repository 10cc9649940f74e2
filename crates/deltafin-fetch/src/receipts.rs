//! Fetch receipts: the SHA-256 of every weight file fetched without a pinned digest (spine
//! tensors and routed experts by byte range, release shards the manifest does not pin),
//! recorded when it is fetched so that `setup --check` can re-hash it later
//! (docs/SETUP.md, "Fetch receipts").
//!
//! One append-only text file at the model root, `k3-meta/fetched.sha256`, a line per file:
//! `<sha256 hex> <size> <path relative to the root>`. The line is appended (one `write`,
//! `O_APPEND`, then `fsync`) before the file is published under its final name, so a
//! published file always has its receipt; a later line for the same path replaces an
//! earlier one (a refetch). Appends go through [`deltafin_tensor::append::AppendFile`]: a
//! receipt always starts on a fresh line, so a line a power loss cut short never glues onto
//! the next receipt, and a write the disk takes only part of is cut back. A line that does
//! not parse (a torn one) is counted and skipped; the file it named then has no receipt,
//! which the check reports.

use crate::error::FetchError;
use deltafin_tensor::append::{AppendFile, AppendOptions};
use std::collections::HashMap;
use std::path::Path;

/// The receipts file, under the model root.
pub const RECEIPTS_PATH: &str = "k3-meta/fetched.sha256";

/// The longest path a receipt line holds (longer ones are refused, not cut).
const MAX_PATH: usize = 1024;

/// `dest`'s path relative to `root`, with `/` separators, as a receipt names it.
pub fn relative_name(root: &Path, dest: &Path) -> Option<String> {
    let rel = dest.strip_prefix(root).ok()?;
    let parts: Option<Vec<&str>> = rel.components().map(|c| c.as_os_str().to_str()).collect();
    let name = parts?.join("/");
    let printable =
        !name.is_empty() && name.len() <= MAX_PATH && !name.chars().any(|c| c.is_control());
    printable.then_some(name)
}

/// Record that `dest` (under `root`) has `size` bytes hashing to `sha256` (lowercase hex).
pub fn record(root: &Path, dest: &Path, size: u64, sha256: &str) -> Result<(), FetchError> {
    let Some(name) = relative_name(root, dest) else {
        return Err(FetchError::Invalid(format!(
            "{}: not a printable path under the model root {}, so no receipt can name it",
            dest.display(),
            root.display()
        )));
    };
    let path = root.join(RECEIPTS_PATH);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(FetchError::io(dir))?;
    }
    let line = format!("{sha256} {size} {name}\n");
    AppendFile::open(&path, AppendOptions::default())
        .and_then(|mut f| f.append_durable(line.as_bytes()))
        .map(|_| ())
        .map_err(FetchError::io(&path))
}

/// The receipts of a model root.
#[derive(Clone, Debug, Default)]
pub struct Receipts {
    by_name: HashMap<String, (u64, String)>,
    /// Lines that did not parse (skipped).
    pub malformed: usize,
}

impl Receipts {
    /// Read `root`'s receipts; no file is no receipts.
    pub fn load(root: &Path) -> Result<Receipts, FetchError> {
        let path = root.join(RECEIPTS_PATH);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Receipts::default()),
            Err(e) => return Err(FetchError::io(&path)(e)),
        };
        Ok(Receipts::parse(&bytes))
    }

    /// Parse the receipts file's bytes.
    pub fn parse(bytes: &[u8]) -> Receipts {
        let mut r = Receipts::default();
        for line in bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            match parse_line(line) {
                Some((sha, size, name)) => {
                    r.by_name.insert(name, (size, sha));
                }
                None => r.malformed += 1,
            }
        }
        r
    }

    /// The recorded SHA-256 of `name` (relative to the root) when it was `size` bytes.
    pub fn sha256_of(&self, name: &str, size: u64) -> Option<&str> {
        self.by_name
            .get(name)
            .filter(|(s, _)| *s == size)
            .map(|(_, h)| h.as_str())
    }

    /// The recorded SHA-256 of `dest` under `root` at `size` bytes.
    pub fn sha256_at(&self, root: &Path, dest: &Path, size: u64) -> Option<&str> {
        relative_name(root, dest).and_then(|n| self.sha256_of(&n, size))
    }

    /// How many files have a receipt.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// No receipts.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

fn parse_line(line: &[u8]) -> Option<(String, u64, String)> {
    let text = std::str::from_utf8(line).ok()?;
    let (sha, rest) = text.split_once(' ')?;
    let (size, name) = rest.split_once(' ')?;
    let hex = sha.len() == 64 && sha.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    let size: u64 = size.parse().ok()?;
    let name_ok = !name.is_empty() && name.len() <= MAX_PATH && !name.chars().any(char::is_control);
    (hex && name_ok).then(|| (sha.to_string(), size, name.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

    #[test]
    fn a_receipt_after_a_torn_line_is_whole() {
        // A power loss cut the receipt of L1-E3 short; the next fetch records L1-E4.
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        record(root, &root.join("k3-experts/L1-E2.bin"), 10, A).unwrap();
        let p = root.join(RECEIPTS_PATH);
        let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
        std::io::Write::write_all(&mut f, format!("{B} 12 k3-experts/L1-E").as_bytes()).unwrap();
        drop(f);
        let e4 = root.join("k3-experts/L1-E4.bin");
        record(root, &e4, 12, A).unwrap();
        let r = Receipts::load(root).unwrap();
        assert_eq!(
            r.sha256_at(root, &e4, 12),
            Some(A),
            "{:?}",
            std::fs::read_to_string(&p)
        );
        assert_eq!(r.sha256_of("k3-experts/L1-E2.bin", 10), Some(A));
        // The torn line is a line of its own: here it still parses, naming no file.
        assert_eq!(r.len(), 3);
        assert_eq!(r.sha256_of("k3-experts/L1-E", 12), Some(B));
    }

    #[test]
    fn the_last_receipt_of_a_path_wins_and_cut_lines_are_skipped() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        let x = root.join("k3-experts/L1-E2.bin");
        record(root, &x, 10, A).unwrap();
        record(root, &x, 12, B).unwrap();
        record(root, &root.join("k3-resident/tensors/a.b"), 3, A).unwrap();
        // A power loss cut the last append.
        let p = root.join(RECEIPTS_PATH);
        let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
        std::io::Write::write_all(&mut f, b"cccc 5 k3-experts/L1-E3").unwrap();
        let r = Receipts::load(root).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r.malformed, 1);
        assert_eq!(r.sha256_at(root, &x, 12), Some(B));
        // A receipt is for its size only.
        assert_eq!(r.sha256_at(root, &x, 10), None);
        assert_eq!(r.sha256_of("k3-resident/tensors/a.b", 3), Some(A));
        assert_eq!(r.sha256_of("k3-experts/L1-E3", 5), None);
        // Paths outside the root have no name.
        assert!(record(root, Path::new("/elsewhere/x"), 1, A).is_err());
        assert!(Receipts::load(&root.join("none")).unwrap().is_empty());
        for bad in [
            &b"zz 1 a"[..],
            b"",
            b"aaaa",
            &format!("{A} x name").into_bytes(),
            &format!("{A} 1 ").into_bytes(),
            &[0xff, 0xfe],
        ] {
            assert!(parse_line(bad).is_none(), "{bad:?}");
        }
    }
}
