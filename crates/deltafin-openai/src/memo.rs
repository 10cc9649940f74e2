//! The response memo (docs/SERVER.md "Conversation state"): a finished answer kept under
//! the exact request that produced it, so an identical request is answered without running
//! the model. Bounded by entries and bytes, least recently used out first.
//!
//! The key is SHA-256 over everything the answer depends on: the endpoint, the prompt's
//! token ids, `max_new`, the stop sequences, `logprobs`, the sampling settings with their
//! seed (an unseeded sampled request draws a fresh seed, so it never repeats a key) and the
//! chat controls (tools, tool choice, response format: they decide the grammar). Whether
//! the answer streams is not in the key: a stored answer replays as JSON or as SSE.

use crate::outcome::{FinishReason, Usage};
use crate::output::Delta;
use crate::request::{GenRequest, Prompt};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

/// A stored answer: its whole output as one delta, and how it ended.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoEntry {
    pub delta: Delta,
    pub finish: FinishReason,
    pub usage: Usage,
}

impl MemoEntry {
    /// Bytes the entry accounts for: its text and tool-call pieces, its log-probabilities.
    fn bytes(&self) -> usize {
        let d = &self.delta;
        let calls: usize = d
            .tool_calls
            .iter()
            .map(|c| {
                c.id.as_ref().map_or(0, String::len)
                    + c.name.as_ref().map_or(0, String::len)
                    + c.arguments.len()
                    + 16
            })
            .sum();
        let lp = (d.reasoning_logprobs.len() + d.content_logprobs.len()) * 256;
        d.reasoning.len() + d.content.len() + calls + lp + 128
    }
}

struct Slot {
    entry: MemoEntry,
    bytes: usize,
    used: u64,
}

#[derive(Default)]
struct Inner {
    slots: HashMap<[u8; 32], Slot>,
    bytes: usize,
    clock: u64,
    hits: u64,
    misses: u64,
}

/// The memo; `entries == 0` or `bytes == 0` turns it off.
pub struct ResponseMemo {
    entries: usize,
    bytes: usize,
    inner: Mutex<Inner>,
}

/// Default entries (`--response-memo-entries`).
pub const DEFAULT_ENTRIES: usize = 32;
/// Default bytes (`--response-memo-bytes`, 64 MiB).
pub const DEFAULT_BYTES: usize = 64 << 20;
/// Largest `--response-memo-bytes` (1 GiB).
pub const MAX_BYTES: usize = 1 << 30;

impl ResponseMemo {
    pub fn new(entries: usize, bytes: usize) -> ResponseMemo {
        ResponseMemo {
            entries,
            bytes,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Whether anything can be stored.
    pub fn enabled(&self) -> bool {
        self.entries > 0 && self.bytes > 0
    }

    /// The key of `req` with prompt ids `prompt`.
    pub fn key(req: &GenRequest, prompt: &[u32]) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(format!("{:?}", req.surface));
        h.update((prompt.len() as u64).to_le_bytes());
        for id in prompt {
            h.update(id.to_le_bytes());
        }
        h.update((req.max_new as u64).to_le_bytes());
        h.update(format!("{:?}", req.stop));
        h.update(format!("{:?}", req.logprobs));
        h.update(format!("{:?}", req.sampling));
        if let Prompt::Chat { controls, .. } = &req.prompt {
            h.update(format!("{controls:?}"));
        }
        h.finalize().into()
    }

    /// The stored answer for `key`, if any.
    pub fn get(&self, key: &[u8; 32]) -> Option<MemoEntry> {
        if !self.enabled() {
            return None;
        }
        let mut m = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        m.clock += 1;
        let now = m.clock;
        match m.slots.get_mut(key) {
            Some(s) => {
                s.used = now;
                let e = s.entry.clone();
                m.hits += 1;
                Some(e)
            }
            None => {
                m.misses += 1;
                None
            }
        }
    }

    /// Keep `entry` under `key` (an entry larger than the byte budget is not kept).
    pub fn put(&self, key: [u8; 32], entry: MemoEntry) {
        let bytes = entry.bytes();
        if !self.enabled() || bytes > self.bytes {
            return;
        }
        let mut m = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        m.clock += 1;
        let used = m.clock;
        if let Some(old) = m.slots.remove(&key) {
            m.bytes -= old.bytes;
        }
        while m.slots.len() >= self.entries || m.bytes + bytes > self.bytes {
            let Some(oldest) = m.slots.iter().min_by_key(|(_, s)| s.used).map(|(k, _)| *k) else {
                break;
            };
            if let Some(s) = m.slots.remove(&oldest) {
                m.bytes -= s.bytes;
            }
        }
        m.bytes += bytes;
        m.slots.insert(key, Slot { entry, bytes, used });
    }

    /// `(hits, misses, entries, bytes)`.
    pub fn stats(&self) -> (u64, u64, usize, usize) {
        let m = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        (m.hits, m.misses, m.slots.len(), m.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(text: &str) -> MemoEntry {
        MemoEntry {
            delta: Delta {
                content: text.into(),
                ..Delta::default()
            },
            finish: FinishReason::Stop,
            usage: Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
                reasoning_tokens: 0,
            },
        }
    }

    #[test]
    fn least_recently_used_out_by_count_and_bytes() {
        let m = ResponseMemo::new(2, 10_000);
        m.put([1; 32], entry("a"));
        m.put([2; 32], entry("b"));
        assert!(m.get(&[1; 32]).is_some());
        m.put([3; 32], entry("c"));
        assert!(m.get(&[2; 32]).is_none());
        assert_eq!(m.get(&[1; 32]).unwrap().delta.content, "a");
        assert_eq!(m.get(&[3; 32]).unwrap().delta.content, "c");
        // Too large for the byte budget: not kept, nothing evicted.
        m.put([4; 32], entry(&"x".repeat(20_000)));
        assert!(m.get(&[4; 32]).is_none());
        assert_eq!(m.stats().2, 2);
        let off = ResponseMemo::new(0, 10_000);
        off.put([1; 32], entry("a"));
        assert!(off.get(&[1; 32]).is_none());
    }
}
