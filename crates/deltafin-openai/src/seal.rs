//! Opaque reasoning tokens: an answer's reasoning as the exact ids K3 generated, handed to the
//! client so that it can send the reasoning back and have it rendered token for token
//! (docs/SERVER.md "Reasoning round trips"). The Responses API carries one as a reasoning
//! item's `encrypted_content`, the Messages API as a thinking block's `signature`.
//!
//! A token is `dfr1.<ids>.<mac>`: the ids as little-endian `u32`s and the first 16 bytes of
//! their HMAC-SHA-256 under the server's key, both base64url without padding. The ids are
//! not encrypted (the client already has the reasoning text); the MAC makes sure that what
//! comes back is what this server handed out, so that no client can smuggle ids the
//! tokenizer would never produce from text (the chat markers) into a prompt. The key lives in
//! `k3-meta/reasoning.key` (created on first use, mode 0600), so tokens stay valid across
//! restarts; on a read-only model root it lives in memory for the server's lifetime.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::path::{Path, PathBuf};

/// The prefix of every token this version writes.
pub const PREFIX: &str = "dfr1.";
/// Bytes of MAC kept in a token.
const MAC_BYTES: usize = 16;
/// Bytes of the key.
const KEY_BYTES: usize = 32;
/// The key file under a model root's `k3-meta/`.
pub const KEY_FILE: &str = "reasoning.key";

/// Why a token cannot be opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// Not something this server writes.
    #[error("it is not a deltafin reasoning token")]
    Malformed,
    /// Well formed, but not made by this server's key (another server, or altered).
    #[error(
        "it was not made by this server (another deltafin server or model root made it, or it was altered)"
    )]
    Forged,
}

/// Seals and opens reasoning tokens under one key.
#[derive(Clone)]
pub struct Sealer {
    key: [u8; KEY_BYTES],
    /// Where the key is kept (`None`: in memory only).
    pub key_file: Option<PathBuf>,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer")
            .field("key_file", &self.key_file)
            .finish_non_exhaustive()
    }
}

fn fresh_key() -> [u8; KEY_BYTES] {
    let mut key = [0u8; KEY_BYTES];
    if getrandom::fill(&mut key).is_err() {
        // No OS randomness: a key from the clock and the process still differs per start,
        // which is all an in-memory key needs (its tokens die with the process).
        let seed = format!("{:?}{}", std::time::SystemTime::now(), std::process::id());
        key.copy_from_slice(&<Sha256 as sha2::Digest>::digest(seed.as_bytes()));
    }
    key
}

impl Sealer {
    /// A sealer whose key lives only in memory.
    pub fn ephemeral() -> Sealer {
        Sealer {
            key: fresh_key(),
            key_file: None,
        }
    }

    /// The sealer of the state directory `dir` (a model root's `k3-meta/`): its key file,
    /// created when absent; `Err` with the reason when it can be neither read nor created
    /// (the caller then falls back to [`Sealer::ephemeral`] and says so).
    pub fn in_dir(dir: &Path) -> Result<Sealer, String> {
        let path = dir.join(KEY_FILE);
        match std::fs::read(&path) {
            Ok(bytes) if bytes.len() == KEY_BYTES => {
                let mut key = [0u8; KEY_BYTES];
                key.copy_from_slice(&bytes);
                return Ok(Sealer {
                    key,
                    key_file: Some(path),
                });
            }
            Ok(bytes) => {
                return Err(format!(
                    "{} holds {} bytes, not a {KEY_BYTES}-byte key; remove it to make a new one (reasoning handed out earlier then cannot be sent back)",
                    path.display(),
                    bytes.len()
                ));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        }
        let key = fresh_key();
        write_new_key(dir, &path, &key)?;
        // Two servers on one root may race to create it: whichever landed is the key.
        let landed =
            std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        if landed.len() != KEY_BYTES {
            return Err(format!("{} is not a {KEY_BYTES}-byte key", path.display()));
        }
        let mut key = [0u8; KEY_BYTES];
        key.copy_from_slice(&landed);
        Ok(Sealer {
            key,
            key_file: Some(path),
        })
    }

    fn mac(&self, payload: &[u8]) -> [u8; MAC_BYTES] {
        // HMAC takes a key of any length; a 32-byte key cannot fail.
        let mut mac = match <Hmac<Sha256> as Mac>::new_from_slice(&self.key) {
            Ok(m) => m,
            Err(_) => unreachable!("HMAC accepts every key length"),
        };
        mac.update(PREFIX.as_bytes());
        mac.update(payload);
        let full = mac.finalize().into_bytes();
        let mut out = [0u8; MAC_BYTES];
        out.copy_from_slice(&full[..MAC_BYTES]);
        out
    }

    /// The token of `ids`.
    pub fn seal(&self, ids: &[u32]) -> String {
        let payload: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
        let mac = self.mac(&payload);
        format!(
            "{PREFIX}{}.{}",
            URL_SAFE_NO_PAD.encode(&payload),
            URL_SAFE_NO_PAD.encode(mac)
        )
    }

    /// The ids of a token this server sealed.
    pub fn open(&self, token: &str) -> Result<Vec<u32>, SealError> {
        let rest = token.strip_prefix(PREFIX).ok_or(SealError::Malformed)?;
        let (payload, mac) = rest.split_once('.').ok_or(SealError::Malformed)?;
        let payload = URL_SAFE_NO_PAD
            .decode(payload)
            .map_err(|_| SealError::Malformed)?;
        let mac = URL_SAFE_NO_PAD
            .decode(mac)
            .map_err(|_| SealError::Malformed)?;
        if payload.len() % 4 != 0 || mac.len() != MAC_BYTES {
            return Err(SealError::Malformed);
        }
        // Constant-time comparison through the MAC crate's verifier.
        let mut check = match <Hmac<Sha256> as Mac>::new_from_slice(&self.key) {
            Ok(m) => m,
            Err(_) => unreachable!("HMAC accepts every key length"),
        };
        check.update(PREFIX.as_bytes());
        check.update(&payload);
        check
            .verify_truncated_left(&mac)
            .map_err(|_| SealError::Forged)?;
        Ok(payload
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

/// Writes a new key file without ever leaving a partial one: a private temporary file,
/// synced, then linked into place (an existing key wins).
fn write_new_key(dir: &Path, path: &Path, key: &[u8; KEY_BYTES]) -> Result<(), String> {
    use std::io::Write as _;
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let tmp = dir.join(format!(".{KEY_FILE}.{}.tmp", std::process::id()));
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        opts.mode(0o600);
    }
    let _ = std::fs::remove_file(&tmp);
    let written = opts
        .open(&tmp)
        .and_then(|mut f| f.write_all(key).and_then(|()| f.sync_all()));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("cannot write {}: {e}", tmp.display()));
    }
    // `hard_link` fails when the key exists: another server made it first, and it stays.
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(format!("cannot create {}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_refuse_changes() {
        let s = Sealer::ephemeral();
        for ids in [vec![], vec![0], vec![1, 163_587, 42, u32::MAX]] {
            let t = s.seal(&ids);
            assert!(t.starts_with(PREFIX));
            assert_eq!(s.open(&t).unwrap(), ids);
        }
        let t = s.seal(&[5, 6, 7]);
        // Another key: forged.
        assert_eq!(Sealer::ephemeral().open(&t), Err(SealError::Forged));
        // One id changed: forged.
        let (head, mac) = t.rsplit_once('.').unwrap();
        let other = s.seal(&[5, 6, 8]);
        let (other_head, _) = other.rsplit_once('.').unwrap();
        assert_eq!(
            s.open(&format!("{other_head}.{mac}")),
            Err(SealError::Forged)
        );
        assert_eq!(s.open(&format!("{head}.AAAA")), Err(SealError::Malformed));
        for junk in [
            "",
            "dfr1.",
            "dfr1.x.y",
            "sig",
            "dfr1.AAA.AAAAAAAAAAAAAAAAAAAAAA",
        ] {
            assert!(s.open(junk).is_err(), "{junk}");
        }
    }

    #[test]
    fn the_key_survives_a_restart_and_a_bad_key_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let a = Sealer::in_dir(dir.path()).unwrap();
        let t = a.seal(&[9, 8, 7]);
        let b = Sealer::in_dir(dir.path()).unwrap();
        assert_eq!(b.open(&t).unwrap(), vec![9, 8, 7]);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(dir.path().join(KEY_FILE))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        std::fs::write(dir.path().join(KEY_FILE), b"short").unwrap();
        let e = Sealer::in_dir(dir.path()).unwrap_err();
        assert!(e.contains("holds 5 bytes"), "{e}");
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }
}
