//! Rendering options (thinking and its effort, tool choice, response format) and
//! [`ChatError`].

use std::fmt;
use std::str::FromStr;

use serde_json::Value;

/// The thinking effort of §8.3.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningEffort {
    /// `low`
    Low,
    /// `medium`
    Medium,
    /// `high`
    High,
    /// `max` (the default when thinking is on)
    Max,
}

impl ReasoningEffort {
    /// The template spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ReasoningEffort::Low => "low",
            ReasoningEffort::Medium => "medium",
            ReasoningEffort::High => "high",
            ReasoningEffort::Max => "max",
        }
    }
}

impl fmt::Display for ReasoningEffort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A reasoning effort that is not one of `low`, `medium`, `high`, `max`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid reasoning effort {value:?}: expected one of low, medium, high, max")]
pub struct ParseEffortError {
    /// The rejected value.
    pub value: String,
}

impl FromStr for ReasoningEffort {
    type Err = ParseEffortError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "low" => Ok(ReasoningEffort::Low),
            "medium" => Ok(ReasoningEffort::Medium),
            "high" => Ok(ReasoningEffort::High),
            "max" => Ok(ReasoningEffort::Max),
            _ => Err(ParseEffortError {
                value: s.to_string(),
            }),
        }
    }
}

/// Whether the model thinks, and at which effort: the one reading of the spellings users
/// send (`reasoning_effort` on the server, `--reasoning-effort` on the CLI), so that every
/// front end accepts the same words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Thinking {
    /// Thinking off: no think blocks, the generation prompt opens `response` (§8.3).
    Off,
    /// Thinking on at this effort.
    On(ReasoningEffort),
}

/// Every spelling [`Thinking::parse`] accepts, for messages and help texts.
pub const THINKING_SPELLINGS: &str =
    "`none`, `off`, `minimal` (thinking off), `low`, `medium`, `high`, `max`, `xhigh` (= `max`)";

/// A thinking setting that is none of [`THINKING_SPELLINGS`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid reasoning effort {value:?}: expected one of {THINKING_SPELLINGS}")]
pub struct ParseThinkingError {
    /// The rejected value, as given.
    pub value: String,
}

impl Thinking {
    /// Reads a thinking setting, trimmed and case-insensitive. `none` and `off` turn thinking
    /// off; so does `minimal` (OpenAI's lowest level), because the template has no level below
    /// `low` and the least thinking it can do is none. `low`, `medium`, `high`, `max` are the
    /// template's four efforts; `xhigh` (OpenAI's and Anthropic's level above `high`) is
    /// `max`, the template's highest.
    pub fn parse(raw: &str) -> Result<Thinking, ParseThinkingError> {
        match raw.trim().to_ascii_lowercase().as_str() {
            "none" | "off" | "minimal" => Ok(Thinking::Off),
            "xhigh" => Ok(Thinking::On(ReasoningEffort::Max)),
            level => level
                .parse::<ReasoningEffort>()
                .map(Thinking::On)
                .map_err(|_| ParseThinkingError {
                    value: raw.to_string(),
                }),
        }
    }

    /// Whether thinking is on.
    pub fn is_on(self) -> bool {
        matches!(self, Thinking::On(_))
    }

    /// The effort when thinking is on.
    pub fn effort(self) -> Option<ReasoningEffort> {
        match self {
            Thinking::Off => None,
            Thinking::On(effort) => Some(effort),
        }
    }

    /// Sets [`ChatOptions::thinking`] and [`ChatOptions::effort`] to this setting.
    pub fn apply(self, opts: &mut ChatOptions) {
        opts.thinking = self.is_on();
        opts.effort = self.effort();
    }
}

impl Thinking {
    /// Rendering options with this thinking and everything else at its default.
    pub fn chat_options(self) -> ChatOptions {
        let mut opts = ChatOptions::default();
        self.apply(&mut opts);
        opts
    }
}

impl fmt::Display for Thinking {
    /// `none` when off, else the effort's spelling.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Thinking::Off => f.write_str("none"),
            Thinking::On(e) => e.fmt(f),
        }
    }
}

impl FromStr for Thinking {
    type Err = ParseThinkingError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Thinking::parse(s)
    }
}

/// `tool_choice` values that add an internal system message (§8.2 step 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolChoice {
    /// `required`: the model must call a tool.
    Required,
    /// `none`: the model must not call tools.
    Forbidden,
}

/// `response_format` values that add an internal system message (§8.2 step 4).
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    /// `json_object`
    JsonObject,
    /// `json_schema` with the schema.
    JsonSchema(Value),
}

/// Rendering options.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatOptions {
    /// Thinking mode (default true): think blocks in assistant history, thinking-effort
    /// message, generation prompt opening `think`.
    pub thinking: bool,
    /// Thinking effort; `None` means `max` when thinking (§8.3). Ignored when not thinking.
    pub effort: Option<ReasoningEffort>,
    /// Append the assistant generation prompt (default true).
    pub add_generation_prompt: bool,
    /// Tools declared up front (JSON Schema function specs), rendered deep-sorted.
    pub tools: Vec<Value>,
    /// Optional `tool_choice` message after the conversation.
    pub tool_choice: Option<ToolChoice>,
    /// Optional `response_format` message after the conversation.
    pub response_format: Option<ResponseFormat>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        ChatOptions {
            thinking: true,
            effort: None,
            add_generation_prompt: true,
            tools: Vec::new(),
            tool_choice: None,
            response_format: None,
        }
    }
}

/// How a [`ChatError::MarkerMismatch`] describes what the tokenizer has for `spelling`.
fn marker_found(spelling: &str, found: Option<u32>) -> String {
    match found {
        Some(id) => format!("maps {spelling} to id {id}"),
        None => format!("has no special token {spelling}"),
    }
}

/// Errors from rendering or encoding a conversation.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// A message's role is not system, user, assistant or tool.
    #[error("message {index}: unknown role {role:?} (expected system, user, assistant or tool)")]
    UnknownRole {
        /// Message index.
        index: usize,
        /// The role given.
        role: String,
    },
    /// A tool message whose tool name cannot be resolved.
    #[error(
        "message {index}: tool message needs a tool name: set `tool` or `name`, or answer a preceding assistant tool call"
    )]
    UnresolvedToolName {
        /// Message index.
        index: usize,
    },
    /// Tool-call arguments that parse as JSON but not as an object.
    #[error(
        "message {index}: tool call {call} ({name}): arguments must be a JSON object, found {found}"
    )]
    ArgumentsNotObject {
        /// Message index.
        index: usize,
        /// 1-based call index.
        call: usize,
        /// Function name.
        name: String,
        /// The JSON type found.
        found: &'static str,
    },
    /// A message that cannot be parsed from JSON.
    #[error("invalid chat message: {reason}")]
    BadMessage {
        /// What is wrong.
        reason: String,
    },
    /// The tokenizer's XTML marker ids differ from the K3 ids: the install's
    /// `tokenizer_config.json` is damaged (a fault of the install, not of the messages).
    #[error(
        "the install's tokenizer_config.json {}: chat needs it at id {expected}",
        marker_found(spelling, *found)
    )]
    MarkerMismatch {
        /// The marker spelling.
        spelling: &'static str,
        /// The K3 id.
        expected: u32,
        /// The tokenizer's id.
        found: Option<u32>,
    },
}
