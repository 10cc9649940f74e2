//! How a generation ended and what it counted: shared by the engine, the response memo
//! and the API replies.

/// Why generation ended, as OpenAI names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// End of message / document.
    Stop,
    /// The stop sequence with this index in the request's list matched.
    StopSequence(usize),
    /// `max_tokens` reached or the context is full.
    Length,
    /// The answer ended with tool calls.
    ToolCalls,
}

impl FinishReason {
    /// OpenAI's `finish_reason`: `"stop"` (also for a stop sequence), `"length"` or
    /// `"tool_calls"`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::StopSequence(_) => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// Token counts of one generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// Templated prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens, excluding the terminal end-of-message / end-of-document token.
    pub completion_tokens: usize,
    /// Chat: generated tokens up to and including the marker that closes the thinking
    /// channel.
    pub reasoning_tokens: usize,
}
