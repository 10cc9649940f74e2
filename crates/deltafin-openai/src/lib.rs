//! `deltafin-openai`: the strict OpenAI-compatible HTTP server behind `deltafin serve`.
//!
//! It implements a documented subset of `/v1/chat/completions` and `/v1/completions`
//! exactly, runs one generation at a time, and refuses every unsupported field with a 400
//! instead of silently ignoring it.
