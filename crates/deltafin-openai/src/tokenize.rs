//! `POST /tokenize` and `POST /detokenize`, in llama-server's shapes (docs/SERVER.md,
//! "Tokenizer endpoints").

use crate::error::ApiError;
use deltafin_k3::text::tokenizer::{BOS, Tokenizer};
use serde_json::{Map, Value, json};

fn object<'v>(
    body: &'v Value,
    endpoint: &str,
    fields: &[&str],
) -> Result<&'v Map<String, Value>, ApiError> {
    let obj = body
        .as_object()
        .ok_or_else(|| ApiError::invalid("request body must be a JSON object"))?;
    for key in obj.keys() {
        if !fields.contains(&key.as_str()) {
            return Err(ApiError::invalid_param(
                key,
                format!(
                    "`{key}` is not supported by Deltafin's /{endpoint} endpoint (fields: {}); refusing to silently ignore it",
                    fields.join(", ")
                ),
            ));
        }
    }
    Ok(obj)
}

fn flag(obj: &Map<String, Value>, field: &str) -> Result<bool, ApiError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid_param(
            field,
            format!("`{field}` must be a boolean"),
        )),
    }
}

/// `{"content", "add_special"?, "parse_special"?, "with_pieces"?}` → `{"tokens": […]}`.
/// `content` is encoded as `/v1/completions` encodes a prompt: special-token spellings are
/// text unless `parse_special`; `add_special` puts `[BOS]` first. With `with_pieces`, each
/// token is `{"id", "piece"}`, `piece` its text, or its bytes when they are not UTF-8 alone.
pub fn tokenize(tok: &Tokenizer, body: &Value) -> Result<Value, ApiError> {
    let obj = object(
        body,
        "tokenize",
        &["content", "add_special", "parse_special", "with_pieces"],
    )?;
    let content = match obj.get("content") {
        Some(Value::String(s)) => s,
        None | Some(Value::Null) => {
            return Err(ApiError::invalid_param(
                "content",
                "`content` is required: the text to tokenize",
            ));
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "content",
                "`content` must be a JSON string",
            ));
        }
    };
    let add_special = flag(obj, "add_special")?;
    let parse_special = flag(obj, "parse_special")?;
    let with_pieces = flag(obj, "with_pieces")?;
    let mut ids = Vec::new();
    if add_special {
        ids.push(BOS);
    }
    ids.extend(tok.encode(content, parse_special));
    let tokens: Vec<Value> = if with_pieces {
        ids.iter()
            .map(|&id| {
                let bytes = tok.token_bytes(id).unwrap_or_default();
                let piece = match std::str::from_utf8(bytes) {
                    Ok(s) => json!(s),
                    Err(_) => json!(bytes),
                };
                json!({"id": id, "piece": piece})
            })
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(json!({ "tokens": tokens }))
}

/// `{"tokens": [ids]}` → `{"content": "…"}`: the ids' bytes concatenated (a special token is
/// its spelling), invalid UTF-8 replaced by U+FFFD. An id that is not an integer of the
/// vocabulary is a 400 naming its index.
pub fn detokenize(tok: &Tokenizer, body: &Value) -> Result<Value, ApiError> {
    let obj = object(body, "detokenize", &["tokens"])?;
    let items = match obj.get("tokens") {
        Some(Value::Array(a)) => a,
        None | Some(Value::Null) => {
            return Err(ApiError::invalid_param(
                "tokens",
                "`tokens` is required: an array of token ids",
            ));
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "tokens",
                "`tokens` must be an array of token ids",
            ));
        }
    };
    let vocab = tok.vocab_size();
    let mut ids = Vec::with_capacity(items.len());
    for (i, v) in items.iter().enumerate() {
        let param = format!("tokens[{i}]");
        let Some(n) = v.as_u64() else {
            return Err(ApiError::invalid_param(
                &param,
                format!("`{param}` must be a non-negative integer token id, not {v}"),
            ));
        };
        match u32::try_from(n) {
            Ok(id) if (id as usize) < vocab => ids.push(id),
            _ => {
                return Err(ApiError::invalid_param(
                    &param,
                    format!(
                        "`{param}` is {n}, not a token id of this model (0..={})",
                        vocab.saturating_sub(1)
                    ),
                ));
            }
        }
    }
    let content = tok
        .decode(&ids)
        .map_err(|e| ApiError::server(format!("cannot decode the tokens: {e}")))?;
    Ok(json!({ "content": content }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn kimi() -> Tokenizer {
        let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/kimi"));
        Tokenizer::from_dir(dir).expect("load assets/kimi tokenizer")
    }

    fn ids(v: &Value) -> Vec<u32> {
        v["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    }

    #[test]
    fn tokenize_matches_the_prompt_encoding() {
        let tok = kimi();
        let text = "The capital of France is <|open|>";
        let v = tokenize(&tok, &json!({"content": text})).unwrap();
        assert_eq!(ids(&v), tok.encode_ordinary(text));
        // The golden of docs/K3.md: the raw completion prompt, no BOS.
        let v = tokenize(&tok, &json!({"content": "The capital of France is"})).unwrap();
        assert_eq!(ids(&v), [1008, 10484, 318, 15383, 387]);
        let v = tokenize(&tok, &json!({"content": text, "parse_special": true})).unwrap();
        let parsed = ids(&v);
        assert_eq!(parsed.last(), Some(&tok.special_id("<|open|>").unwrap()));
        assert_eq!(parsed, tok.encode(text, true));
        let v = tokenize(&tok, &json!({"content": "a", "add_special": true})).unwrap();
        assert_eq!(ids(&v)[0], BOS);
        assert_eq!(ids(&v)[1..], tok.encode_ordinary("a")[..]);
        let v = tokenize(&tok, &json!({"content": ""})).unwrap();
        assert_eq!(v, json!({"tokens": []}));
    }

    #[test]
    fn pieces_are_text_or_bytes() {
        let tok = kimi();
        let v = tokenize(&tok, &json!({"content": "Hi 😀", "with_pieces": true})).unwrap();
        let pieces = v["tokens"].as_array().unwrap();
        let want = tok.encode_ordinary("Hi 😀");
        assert_eq!(pieces.len(), want.len());
        let mut bytes = Vec::new();
        for (p, id) in pieces.iter().zip(&want) {
            assert_eq!(p["id"], json!(id));
            match &p["piece"] {
                Value::String(s) => bytes.extend_from_slice(s.as_bytes()),
                Value::Array(b) => bytes.extend(b.iter().map(|x| x.as_u64().unwrap() as u8)),
                other => panic!("piece {other}"),
            }
            assert_eq!(p.as_object().unwrap().len(), 2);
        }
        assert_eq!(String::from_utf8(bytes).unwrap(), "Hi 😀");
    }

    #[test]
    fn detokenize_round_trips_and_names_bad_ids() {
        let tok = kimi();
        let text = "Paris <|open|> ünïcode";
        let ids = tok.encode(text, true);
        let v = detokenize(&tok, &json!({ "tokens": ids })).unwrap();
        assert_eq!(v, json!({"content": text}));
        assert_eq!(
            detokenize(&tok, &json!({"tokens": []})).unwrap(),
            json!({"content": ""})
        );
        let vocab = tok.vocab_size() as u64;
        for (bad, index, says) in [
            (json!([1, vocab]), "tokens[1]", "not a token id"),
            (json!([1, 2, -3]), "tokens[2]", "non-negative integer"),
            (json!(["a"]), "tokens[0]", "non-negative integer"),
            (json!([1.5]), "tokens[0]", "non-negative integer"),
            (json!([u64::MAX]), "tokens[0]", "not a token id"),
        ] {
            let e = detokenize(&tok, &json!({ "tokens": bad })).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(index), "{bad}");
            assert!(
                e.message.contains(says) && e.message.contains(index),
                "{}",
                e.message
            );
        }
    }

    #[test]
    fn bodies_are_strict() {
        let tok = kimi();
        for (body, param) in [
            (json!({}), "content"),
            (json!({"content": 1}), "content"),
            (json!({"content": "a", "add_special": "yes"}), "add_special"),
            (json!({"content": "a", "with_pieces": 1}), "with_pieces"),
            (json!({"content": "a", "extra": 1}), "extra"),
        ] {
            let e = tokenize(&tok, &body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
        assert!(
            tokenize(&tok, &json!([1]))
                .unwrap_err()
                .message
                .contains("JSON object")
        );
        for (body, param) in [
            (json!({}), "tokens"),
            (json!({"tokens": "1"}), "tokens"),
            (json!({"tokens": [], "content": "x"}), "content"),
        ] {
            let e = detokenize(&tok, &body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
    }
}
