//! What the assembler releases: text, log-probabilities and tool-call pieces.

/// The exact log-probability of one emitted token and its most likely alternatives
/// (log-softmax of K3's final logits at that position).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The emitted (greedy) token.
    pub id: u32,
    /// `logit[id] − logsumexp(logits)`.
    pub logprob: f64,
    /// The most likely tokens, descending, ties by lower id.
    pub top: Vec<(u32, f64)>,
}

/// A token's log-probability with the character offset of its text in its channel.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenEntry {
    /// The log-probabilities.
    pub lp: TokenLogprob,
    /// Offset (in Unicode scalar values) of the token's text in the channel's text.
    pub text_offset: usize,
}

/// A piece of one tool call in the model's output, in the shape of OpenAI's streamed
/// `tool_calls` deltas: the first piece of a call carries its `id` and `name`, later pieces
/// append to its `arguments` (a JSON object text, complete once the call has closed).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ToolCallDelta {
    /// 0-based position of the call in this answer.
    pub index: usize,
    /// The call id (first piece only).
    pub id: Option<String>,
    /// The function name (first piece only).
    pub name: Option<String>,
    /// More of the arguments' JSON text.
    pub arguments: String,
}

impl ToolCallDelta {
    /// Whether this piece opens its call (carries the id and name).
    pub fn is_start(&self) -> bool {
        self.id.is_some() || self.name.is_some()
    }
}

/// Appends `piece` to `calls`, merging it into the last piece when it continues that call's
/// arguments: a list built this way holds one piece per call once the calls are complete.
pub fn push_tool_piece(calls: &mut Vec<ToolCallDelta>, piece: ToolCallDelta) {
    if !piece.is_start()
        && let Some(last) = calls.last_mut()
        && last.index == piece.index
    {
        last.arguments.push_str(&piece.arguments);
        return;
    }
    calls.push(piece);
}

/// Newly releasable output.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Delta {
    /// Reasoning text (chat only).
    pub reasoning: String,
    /// Content text (the completion text on `/v1/completions`).
    pub content: String,
    /// Log-probabilities of the reasoning tokens whose text starts in `reasoning`.
    pub reasoning_logprobs: Vec<TokenEntry>,
    /// Log-probabilities of the content tokens whose text starts in `content`.
    pub content_logprobs: Vec<TokenEntry>,
    /// Tool-call pieces, in order (chat only). A call's first piece carries its id and name;
    /// pieces that continue the same call are merged, so a [`Delta`] accumulated over a whole
    /// answer with [`Delta::extend`] holds exactly one piece per call.
    pub tool_calls: Vec<ToolCallDelta>,
    /// The ids of the whole reasoning, without the marker that closed it (chat with thinking
    /// only): released once, with the reasoning's last text. They let a client send the
    /// reasoning back exactly (an opaque reasoning token, docs/SERVER.md "Reasoning
    /// round trips").
    pub reasoning_ids: Vec<u32>,
}

impl Delta {
    /// Whether there is nothing to send.
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty()
            && self.content.is_empty()
            && self.reasoning_logprobs.is_empty()
            && self.content_logprobs.is_empty()
            && self.tool_calls.is_empty()
            && self.reasoning_ids.is_empty()
    }

    /// Appends `other` (tool-call pieces merged per call, see [`Delta::tool_calls`]).
    pub fn extend(&mut self, other: Delta) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
        self.reasoning_logprobs.extend(other.reasoning_logprobs);
        self.content_logprobs.extend(other.content_logprobs);
        self.reasoning_ids.extend(other.reasoning_ids);
        for piece in other.tool_calls {
            push_tool_piece(&mut self.tool_calls, piece);
        }
    }
}
