//! Rendering options (reasoning effort, tool choice, response format) and [`ChatError`].

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
    /// The tokenizer's XTML marker ids differ from the K3 ids.
    #[error("tokenizer has {spelling} at {found:?}, expected id {expected}")]
    MarkerMismatch {
        /// The marker spelling.
        spelling: &'static str,
        /// The K3 id.
        expected: u32,
        /// The tokenizer's id.
        found: Option<u32>,
    },
}
