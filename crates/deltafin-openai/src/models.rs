//! The names the server answers to: [`MODEL_ID`] and the `--model-alias` names
//! (docs/SERVER.md, "Model aliases").

use crate::MODEL_ID;

/// Longest model alias, in bytes.
pub const MAX_MODEL_ALIAS_BYTES: usize = 256;

/// Checks `--model-alias` names: each non-empty, at most [`MAX_MODEL_ALIAS_BYTES`] bytes,
/// without whitespace or control characters, different from [`MODEL_ID`] and from each other.
/// The error names the offending alias.
pub fn check_model_aliases(aliases: &[String]) -> Result<(), String> {
    for (i, a) in aliases.iter().enumerate() {
        if a.is_empty() {
            return Err("model alias must not be empty".into());
        }
        if a.len() > MAX_MODEL_ALIAS_BYTES {
            return Err(format!(
                "model alias {a:?} is {} bytes long; at most {MAX_MODEL_ALIAS_BYTES} are allowed",
                a.len()
            ));
        }
        if let Some(c) = a.chars().find(|c| c.is_whitespace() || c.is_control()) {
            return Err(format!(
                "model alias {a:?} contains {c:?}; an alias has no whitespace or control characters"
            ));
        }
        if a == MODEL_ID {
            return Err(format!(
                "model alias {a:?} is the model's own id; it is always accepted"
            ));
        }
        if aliases[..i].contains(a) {
            return Err(format!("model alias {a:?} is given twice"));
        }
    }
    Ok(())
}

/// Whether a request's `model` names this server's model.
pub fn is_served(name: &str, aliases: &[String]) -> bool {
    name == MODEL_ID || aliases.iter().any(|a| a == name)
}

/// What a refusal of an unknown model says about the names that would work:
/// ``only `deltafin-kimi-k3` `` or `` `deltafin-kimi-k3` and its aliases `a`, `b` ``.
pub fn served_names(aliases: &[String]) -> String {
    if aliases.is_empty() {
        return format!("only `{MODEL_ID}`");
    }
    let list: Vec<String> = aliases.iter().map(|a| format!("`{a}`")).collect();
    let noun = if aliases.len() == 1 {
        "alias"
    } else {
        "aliases"
    };
    format!("`{MODEL_ID}` and its {noun} {}", list.join(", "))
}

/// The refusal message for a request naming `name`.
pub fn unavailable(name: &str, aliases: &[String]) -> String {
    format!(
        "requested model `{name}` is unavailable; this server exposes {}",
        served_names(aliases)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn aliases_are_checked_by_name() {
        assert!(check_model_aliases(&[]).is_ok());
        assert!(check_model_aliases(&v(&["kimi-k3", "gpt-4o", "org/model:v1"])).is_ok());
        let err = |names: &[&str]| check_model_aliases(&v(names)).unwrap_err();
        assert_eq!(err(&[""]), "model alias must not be empty");
        assert!(
            err(&["a b"]).contains("\"a b\" contains ' '"),
            "{}",
            err(&["a b"])
        );
        assert!(err(&["a\tb"]).contains("'\\t'"));
        assert!(err(&["a\u{7}"]).contains("control"));
        assert!(err(&["x", "y", "x"]).contains("\"x\" is given twice"));
        assert!(err(&[MODEL_ID]).contains("the model's own id"));
        let long = "a".repeat(MAX_MODEL_ALIAS_BYTES + 1);
        assert!(err(&[long.as_str()]).contains("257 bytes"));
        let longest = "a".repeat(MAX_MODEL_ALIAS_BYTES);
        assert!(check_model_aliases(&v(&[longest.as_str()])).is_ok());
    }

    #[test]
    fn names_and_messages() {
        let aliases = v(&["a", "b"]);
        assert!(is_served(MODEL_ID, &[]));
        assert!(is_served("b", &aliases));
        assert!(!is_served("c", &aliases));
        assert!(!is_served("A", &aliases));
        assert_eq!(
            unavailable("x", &[]),
            format!("requested model `x` is unavailable; this server exposes only `{MODEL_ID}`")
        );
        assert_eq!(
            unavailable("x", &aliases),
            format!(
                "requested model `x` is unavailable; this server exposes `{MODEL_ID}` and its aliases `a`, `b`"
            )
        );
        assert!(unavailable("x", &v(&["a"])).ends_with("its alias `a`"));
    }
}
