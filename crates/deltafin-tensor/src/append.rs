//! Append-only line files: router traces, the run events file, fetch receipts.
//!
//! A record is one line ending in `\n`, handed to the file in one piece. Two faults can
//! leave a line torn: a crash or a power loss in the middle of a write, and a full disk
//! (ENOSPC; EFBIG past a file-size limit) that takes only part of it. [`AppendFile`] makes
//! both harmless:
//!
//! - a record always starts on a fresh line: when the file does not end in `\n` (a torn
//!   line an earlier writer left), the record is preceded by one, so the torn line stays a
//!   line of its own instead of gluing onto the record;
//! - a write that fails part way is cut back (the file is truncated to its length before
//!   the record), so a full disk leaves no partial record behind, only the error.
//!
//! Readers skip a torn line and count it; for JSON lines [`is_torn_json`] tells a torn
//! line (a record cut short) from a bad one.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// How [`AppendFile::open`] opens its file.
#[derive(Clone, Copy, Debug, Default)]
pub struct AppendOptions {
    /// Permission bits of a file it creates (`None`: 0666 less the umask).
    pub mode: Option<u32>,
    /// Refuse a symbolic link at the path (`O_NOFOLLOW`).
    pub no_follow: bool,
    /// Empty an existing file first (one file per run) instead of appending to it.
    pub truncate: bool,
}

/// What an [`AppendFile`] writes into: a file, or a stand-in in tests.
pub trait AppendTarget {
    /// Its length in bytes.
    fn size(&self) -> io::Result<u64>;
    /// The byte at `offset` (below `len`).
    fn byte_at(&self, offset: u64) -> io::Result<u8>;
    /// Append some of `buf`, as `write(2)` on an `O_APPEND` file: how many bytes were taken.
    fn append(&mut self, buf: &[u8]) -> io::Result<usize>;
    /// Cut it to `len` bytes.
    fn truncate(&mut self, len: u64) -> io::Result<()>;
    /// Make what was written durable (`fdatasync`).
    fn sync(&mut self) -> io::Result<()>;
}

impl AppendTarget for File {
    fn size(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }
    fn byte_at(&self, offset: u64) -> io::Result<u8> {
        let mut b = [0u8; 1];
        self.read_exact_at(&mut b, offset)?;
        Ok(b[0])
    }
    fn append(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write(buf)
    }
    fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.set_len(len)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.sync_data()
    }
}

/// An append-only line file (see the module docs).
pub struct AppendFile<T: AppendTarget = File> {
    target: T,
    path: PathBuf,
}

impl AppendFile<File> {
    /// Open (creating it if absent) the line file at `path` for appending.
    pub fn open(path: &Path, opts: AppendOptions) -> io::Result<AppendFile<File>> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut o = OpenOptions::new();
        o.create(true);
        if opts.truncate {
            o.write(true).truncate(true);
        } else {
            o.append(true);
        }
        // Reading the last byte needs a readable descriptor.
        o.read(true);
        if let Some(mode) = opts.mode {
            o.mode(mode);
        }
        if opts.no_follow {
            o.custom_flags(libc::O_NOFOLLOW);
        }
        let file = o.open(path)?;
        Ok(AppendFile::over(file, path))
    }
}

impl<T: AppendTarget> AppendFile<T> {
    /// An append file over `target`, named `path` in messages.
    pub fn over(target: T, path: &Path) -> AppendFile<T> {
        AppendFile {
            target,
            path: path.to_path_buf(),
        }
    }

    /// The path it was opened at.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its length in bytes.
    pub fn len(&self) -> io::Result<u64> {
        self.target.size()
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Append `record` (one or more whole lines, ending in `\n`) on a fresh line, in one
    /// write where the system takes it whole. On an error nothing of it stays in the file
    /// (as far as the file can be cut back) and the error is returned. Returns the bytes
    /// added (the record, and the `\n` that ended a torn line).
    pub fn append(&mut self, record: &[u8]) -> io::Result<u64> {
        let before = self.target.size()?;
        let torn = before > 0 && self.target.byte_at(before - 1)? != b'\n';
        let prefixed;
        let buf: &[u8] = if torn {
            prefixed = [&b"\n"[..], record].concat();
            &prefixed
        } else {
            record
        };
        let mut done = 0;
        while done < buf.len() {
            match self.target.append(&buf[done..]) {
                Ok(0) => {
                    return Err(self.cut_back(before, io::ErrorKind::WriteZero.into()));
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.cut_back(before, e)),
            }
        }
        Ok(buf.len() as u64)
    }

    /// [`AppendFile::append`], then make the file durable.
    pub fn append_durable(&mut self, record: &[u8]) -> io::Result<u64> {
        let n = self.append(record)?;
        self.target.sync()?;
        Ok(n)
    }

    /// Truncate back to `len` after a failed write; returns `e` (the first error).
    fn cut_back(&mut self, len: u64, e: io::Error) -> io::Error {
        // Best effort: if even this fails, the torn record stays and readers skip it.
        let _ = self.target.truncate(len);
        e
    }
}

/// Whether `line` is a torn JSON record: the start of a JSON value cut short (the parser ran
/// out of input), as a crash or a full disk leaves one. A line that is bad in any other way
/// (not JSON, a wrong value) is not torn.
pub fn is_torn_json(line: &str) -> bool {
    !line.trim().is_empty()
        && matches!(serde_json::from_str::<serde_json::Value>(line), Err(e) if e.is_eof())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file on a disk with `room` bytes left: a write takes what fits, then ENOSPC.
    struct FullDisk {
        bytes: Vec<u8>,
        room: usize,
        truncate_fails: bool,
    }

    impl AppendTarget for FullDisk {
        fn size(&self) -> io::Result<u64> {
            Ok(self.bytes.len() as u64)
        }
        fn byte_at(&self, offset: u64) -> io::Result<u8> {
            Ok(self.bytes[offset as usize])
        }
        fn append(&mut self, buf: &[u8]) -> io::Result<usize> {
            let n = buf.len().min(self.room);
            if n == 0 {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
            self.bytes.extend_from_slice(&buf[..n]);
            self.room -= n;
            Ok(n)
        }
        fn truncate(&mut self, len: u64) -> io::Result<()> {
            if self.truncate_fails {
                return Err(io::Error::other("read-only"));
            }
            self.room += self.bytes.len() - len as usize;
            self.bytes.truncate(len as usize);
            Ok(())
        }
        fn sync(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn disk(bytes: &[u8], room: usize) -> AppendFile<FullDisk> {
        AppendFile::over(
            FullDisk {
                bytes: bytes.to_vec(),
                room,
                truncate_fails: false,
            },
            Path::new("t.jsonl"),
        )
    }

    #[test]
    fn a_full_disk_leaves_no_partial_record() {
        let mut f = disk(b"{\"a\": 1}\n", 12);
        let e = f.append(b"{\"b\": 22222}\n").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(f.target.bytes, b"{\"a\": 1}\n");
        // What fits still goes in whole.
        assert_eq!(f.append(b"{\"c\": 3}\n").unwrap(), 9);
        assert_eq!(f.target.bytes, b"{\"a\": 1}\n{\"c\": 3}\n");
        // A disk that cannot even be cut back keeps the torn record; the next record still
        // starts on a fresh line, and a reader sees the torn one as torn.
        let mut f = disk(b"", 5);
        f.target.truncate_fails = true;
        assert!(f.append(b"{\"b\": 2}\n").is_err());
        f.target.room = 100;
        f.append(b"{\"c\": 3}\n").unwrap();
        let text = String::from_utf8(f.target.bytes.clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines, ["{\"b\":", "{\"c\": 3}"]);
        assert!(is_torn_json(lines[0]) && !is_torn_json(lines[1]));
    }

    #[test]
    fn a_record_after_a_torn_line_starts_on_a_fresh_line() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("r.jsonl");
        std::fs::write(&p, "{\"a\": 1}\n{\"step\": 4, \"la").unwrap();
        let mut f = AppendFile::open(&p, AppendOptions::default()).unwrap();
        assert_eq!(f.append(b"{\"b\": 2}\n").unwrap(), 10);
        assert_eq!(f.append(b"{\"c\": 3}\n").unwrap(), 9);
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "{\"a\": 1}\n{\"step\": 4, \"la\n{\"b\": 2}\n{\"c\": 3}\n"
        );
        // Truncating opens start empty; a symlink is refused when asked.
        let opts = AppendOptions {
            truncate: true,
            no_follow: true,
            mode: Some(0o600),
        };
        let mut f = AppendFile::open(&p, opts).unwrap();
        f.append_durable(b"x\n").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"x\n");
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert!(AppendFile::open(&link, opts).is_err());
        assert!(AppendFile::open(&link, AppendOptions::default()).is_ok());
    }

    #[test]
    fn torn_json_is_told_from_bad_json() {
        for torn in ["{", "{\"a\": [1, 2", "{\"a\": \"tex", "[1,", "{\"a\": 1"] {
            assert!(is_torn_json(torn), "{torn}");
        }
        for whole_or_bad in [
            "{}",
            "{\"a\": 1}",
            "not json",
            "{\"a\": 1}}",
            "",
            "  ",
            "{,}",
        ] {
            assert!(!is_torn_json(whole_or_bad), "{whole_or_bad}");
        }
    }
}
