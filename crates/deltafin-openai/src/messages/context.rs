//! `context_management`: the edits Anthropic's API makes to a conversation before the model
//! reads it (docs/SERVER.md "Context management"). `clear_thinking_20251015` is implemented
//! as Anthropic documents it: the reasoning of all but the most recent assistant turns that
//! carry thinking is left out (`keep: {"type":"thinking_turns","value":N}`, N ≥ 1; the
//! default keeps 1), or nothing is (`keep: "all"`). Other edits are refused by name.

use super::wire::{bad, object, only_keys, string};
use crate::error::ApiError;
use deltafin_k3::text::chat::ChatMessage;
use serde_json::{Value, json};

/// The `type` of the thinking edit.
pub const CLEAR_THINKING: &str = "clear_thinking_20251015";

/// How many thinking turns a `clear_thinking` edit keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    /// Every turn's thinking.
    All,
    /// The thinking of the last N assistant turns that carry some.
    Turns(usize),
}

/// The edits of one request, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Edits {
    clear_thinking: Option<Keep>,
}

impl Edits {
    /// Reads `context_management` (absent: no edits).
    pub fn parse(v: Option<&Value>) -> Result<Edits, ApiError> {
        const P: &str = "context_management";
        let mut out = Edits::default();
        let Some(v) = v else { return Ok(out) };
        let obj = object(v, P, "`context_management`")?;
        only_keys(obj, &["edits"], P, "`context_management`")?;
        let Some(edits) = obj.get("edits").filter(|e| !e.is_null()) else {
            return Ok(out);
        };
        let edits = edits
            .as_array()
            .ok_or_else(|| bad(P, "`context_management.edits` must be an array"))?;
        for (i, e) in edits.iter().enumerate() {
            let p = format!("{P}.edits[{i}]");
            let e = object(e, &p, "an edit")?;
            match string(e, "type", &p, "an edit")? {
                CLEAR_THINKING => {
                    only_keys(e, &["type", "keep"], &p, "a clear_thinking edit")?;
                    if out.clear_thinking.is_some() {
                        return Err(bad(&p, "`clear_thinking_20251015` is given twice"));
                    }
                    let keep = match e.get("keep") {
                        None | Some(Value::Null) => Keep::Turns(1),
                        Some(k) if k == "all" => Keep::All,
                        Some(Value::Object(k)) => {
                            only_keys(k, &["type", "value"], &p, "`keep`")?;
                            if k.get("type") != Some(&Value::from("thinking_turns")) {
                                return Err(bad(&p, "`keep.type` must be \"thinking_turns\""));
                            }
                            match k.get("value").and_then(Value::as_u64) {
                                Some(n) if n >= 1 => {
                                    Keep::Turns(usize::try_from(n).unwrap_or(usize::MAX))
                                }
                                _ => {
                                    return Err(bad(
                                        &p,
                                        "`keep.value` must be an integer of at least 1",
                                    ));
                                }
                            }
                        }
                        Some(_) => {
                            return Err(bad(
                                &p,
                                "`keep` must be \"all\" or {\"type\":\"thinking_turns\",\"value\":N}",
                            ));
                        }
                    };
                    out.clear_thinking = Some(keep);
                }
                other => {
                    return Err(bad(
                        &p,
                        format!(
                            "context edit `{other}` is not implemented: Deltafin implements `{CLEAR_THINKING}`; leave the edit out (Claude Code: it sends only `{CLEAR_THINKING}` unless tool-result clearing is configured)"
                        ),
                    ));
                }
            }
        }
        Ok(out)
    }

    /// Applies the edits to `messages`; what was applied, as the response's
    /// `context_management` reports it (`None`: no edits were asked for).
    pub fn apply(&self, messages: &mut [ChatMessage]) -> Option<Value> {
        let keep = self.clear_thinking?;
        let thinking_turns: Vec<usize> = messages
            .iter()
            .enumerate()
            .filter(|(_, m)| {
                m.role == "assistant"
                    && (m.reasoning_ids.as_ref().is_some_and(|i| !i.is_empty())
                        || m.reasoning_content.as_ref().is_some_and(|t| !t.is_empty()))
            })
            .map(|(i, _)| i)
            .collect();
        let cleared = match keep {
            Keep::All => 0,
            Keep::Turns(n) => thinking_turns.len().saturating_sub(n),
        };
        for &i in &thinking_turns[..cleared] {
            messages[i].reasoning_content = None;
            messages[i].reasoning_ids = None;
        }
        let applied: Vec<Value> = if cleared > 0 {
            vec![json!({"type": CLEAR_THINKING, "cleared_thinking_turns": cleared})]
        } else {
            Vec::new()
        };
        Some(json!({"applied_edits": applied}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(reasoning: &str) -> ChatMessage {
        ChatMessage {
            role: "assistant".into(),
            reasoning_content: Some(reasoning.into()),
            ..Default::default()
        }
    }

    #[test]
    fn keep_all_changes_nothing_and_turns_keep_the_last() {
        let edits = |v: Value| Edits::parse(Some(&v)).unwrap();
        let mut m = vec![
            ChatMessage::new("user", "a"),
            turn("r1"),
            turn("r2"),
            turn("r3"),
        ];
        let all = edits(json!({"edits": [{"type": CLEAR_THINKING, "keep": "all"}]}));
        assert_eq!(all.apply(&mut m), Some(json!({"applied_edits": []})));
        assert_eq!(m[1].reasoning_content.as_deref(), Some("r1"));
        let two = edits(
            json!({"edits": [{"type": CLEAR_THINKING, "keep": {"type": "thinking_turns", "value": 2}}]}),
        );
        let applied = two.apply(&mut m).unwrap();
        assert_eq!(applied["applied_edits"][0]["cleared_thinking_turns"], 1);
        assert_eq!(m[1].reasoning_content, None);
        assert_eq!(m[2].reasoning_content.as_deref(), Some("r2"));
        // The default keeps one.
        let one = edits(json!({"edits": [{"type": CLEAR_THINKING}]}));
        one.apply(&mut m);
        assert_eq!(
            (
                m[2].reasoning_content.as_deref(),
                m[3].reasoning_content.as_deref()
            ),
            (None, Some("r3"))
        );
        assert_eq!(Edits::default().apply(&mut m), None);
    }

    #[test]
    fn other_edits_and_bad_values_are_refused_by_name() {
        let err = |v: Value| Edits::parse(Some(&v)).unwrap_err().message;
        assert!(
            err(json!({"edits": [{"type": "clear_tool_uses_20250919"}]}))
                .contains("clear_tool_uses_20250919")
        );
        assert!(err(json!({"edits": [{"type": CLEAR_THINKING, "keep": {"type": "thinking_turns", "value": 0}}]})).contains("at least 1"));
        assert!(err(json!({"edits": [{"type": CLEAR_THINKING, "x": 1}]})).contains("`x`"));
        assert!(err(json!({"edit": []})).contains("`edit`"));
    }
}
