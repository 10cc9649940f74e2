//! Text: the tiktoken-based K3 tokenizer ([`tokenizer`]) and the XTML chat template
//! ([`chat`]) that turns a conversation into tokens and parses replies.

pub mod chat;
pub mod tokenizer;
