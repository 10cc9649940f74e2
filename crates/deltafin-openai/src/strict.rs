//! The strictness every endpoint shares (docs/SERVER.md "Top-level request fields"): a field
//! an endpoint does not know is refused with a 400 that names it and the endpoint, never
//! ignored; so is an unknown key inside any object of a request. One wording for every API.

use crate::error::ApiError;
use serde_json::{Map, Value};

/// A 400 naming `param`.
pub fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid_param(param, message)
}

/// The refusal of a top-level field `endpoint` does not implement.
pub fn unknown_field(field: &str, endpoint: &str) -> ApiError {
    bad(
        field,
        format!(
            "`{field}` is not supported by Deltafin's native {endpoint} endpoint; refusing to silently ignore an unknown or generation-semantic field"
        ),
    )
}

/// Refuses the first top-level key of `obj` that is not in `fields`.
pub fn known_fields(
    obj: &Map<String, Value>,
    fields: &[&str],
    endpoint: &str,
) -> Result<(), ApiError> {
    match obj.keys().find(|k| !fields.contains(&k.as_str())) {
        Some(k) => Err(unknown_field(k, endpoint)),
        None => Ok(()),
    }
}

/// Refuses a key of `obj` (a block, a tool, an option object: `what`, at `param`) that is
/// not in `allowed`, naming it and where it is.
pub fn only_keys(
    obj: &Map<String, Value>,
    allowed: &[&str],
    param: &str,
    what: &str,
    endpoint: &str,
) -> Result<(), ApiError> {
    match obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(bad(
            param,
            format!(
                "`{k}` in {what} is not supported by Deltafin's native {endpoint} endpoint; refusing to silently ignore it"
            ),
        )),
        None => Ok(()),
    }
}

/// A required string field of `obj`.
pub fn string<'v>(
    obj: &'v Map<String, Value>,
    key: &str,
    param: &str,
    what: &str,
) -> Result<&'v str, ApiError> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s),
        None | Some(Value::Null) => Err(bad(param, format!("{what} needs a `{key}` string"))),
        Some(_) => Err(bad(
            param,
            format!("`{key}` of {what} must be a JSON string"),
        )),
    }
}

/// `v` as an object, else a 400 saying what `what` must be.
pub fn object<'v>(
    v: &'v Value,
    param: &str,
    what: &str,
) -> Result<&'v Map<String, Value>, ApiError> {
    v.as_object()
        .ok_or_else(|| bad(param, format!("{what} must be a JSON object")))
}

/// An optional field that, when given (not null), must be a string.
pub fn opt_string<'v>(obj: &'v Map<String, Value>, key: &str) -> Result<Option<&'v str>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(bad(key, format!("`{key}` must be a JSON string"))),
    }
}

/// Client metadata (`metadata`, `client_metadata`): an object of string values, with no
/// generation semantics.
pub fn string_map(v: Option<&Value>, key: &str) -> Result<(), ApiError> {
    match v {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Object(m)) if m.values().all(Value::is_string) => Ok(()),
        Some(_) => Err(bad(
            key,
            format!("`{key}` must be a JSON object of string values"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn refusals_name_the_field_and_the_endpoint() {
        let obj = json!({"a": 1, "zz": 2});
        let e = known_fields(obj.as_object().unwrap(), &["a"], "/v1/x").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("zz"));
        assert!(
            e.message
                .starts_with("`zz` is not supported by Deltafin's native /v1/x endpoint")
        );
        let e = only_keys(
            obj.as_object().unwrap(),
            &["a"],
            "tools[0]",
            "a tool",
            "/v1/x",
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0]"));
        assert!(e.message.contains("`zz` in a tool"), "{e}");
        assert!(string_map(Some(&json!({"k": "v"})), "metadata").is_ok());
        assert!(string_map(Some(&json!({"k": 1})), "metadata").is_err());
    }
}
