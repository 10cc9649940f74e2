//! The K3 XTML chat format (spec §8): rendering a conversation into segments and ids.
//!
//! A conversation renders to a list of [`Segment`]s: XTML markers as special ids, and every
//! other piece (tag names, each attribute piece, escaped values, bodies) as a separate text
//! segment. [`encode_chat`] encodes each text segment on its own with specials disallowed,
//! so BPE never merges across pieces and user text spelling `<|open|>` stays plain text.
//!
//! The renderer follows NeMo-Automodel 0.7.0's `build_chat_segments` (pinned by
//! `tests/fixtures/chat/goldens.json`), except where the spec says otherwise: the
//! thinking-effort message defaults to `max` when thinking is on (§8.3), and a message with
//! an unknown role is an error rather than skipped.

mod message;
mod options;
mod py_json;
mod render;
#[cfg(test)]
mod tests;

pub use message::*;
pub use options::*;
pub use py_json::*;
pub use render::*;
