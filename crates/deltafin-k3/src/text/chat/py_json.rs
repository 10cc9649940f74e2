//! Python-compatible JSON text (`json.dumps` spacing, key order, `ensure_ascii`, float
//! `repr`), as the template embeds tool schemas and arguments.

use serde_json::Value;

/// The XTML type name of a JSON value (§8.4).
pub(super) fn json_type(value: &Value) -> &'static str {
    match value {
        Value::String(_) => "string",
        Value::Number(_) => "number",
        Value::Bool(_) => "boolean",
        Value::Null => "null",
        Value::Object(_) => "object",
        Value::Array(_) => "array",
    }
}

/// Python `json.dumps(value, ensure_ascii=False, separators=(",", ":"))` of the value with
/// keys sorted at every level (`deep_sort_dict`).
pub(super) fn py_json_compact_sorted(value: &Value) -> String {
    py_json(value, ",", ":", true)
}

/// Python `json.dumps(value, ensure_ascii=False, separators=(item_sep, key_sep),
/// sort_keys=sort)`: floats use Python's `repr`, non-ASCII is kept, control characters are
/// escaped as Python does. Integers beyond 64 bits are held as floats by `serde_json` and
/// print as floats (Python would keep them exact).
pub fn py_json(value: &Value, item_sep: &str, key_sep: &str, sort: bool) -> String {
    let mut out = String::new();
    write_py_json(&mut out, value, item_sep, key_sep, sort);
    out
}

pub(super) fn write_py_json(
    out: &mut String,
    value: &Value,
    item_sep: &str,
    key_sep: &str,
    sort: bool,
) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                out.push_str(&i.to_string());
            } else if let Some(u) = n.as_u64() {
                out.push_str(&u.to_string());
            } else if let Some(f) = n.as_f64() {
                out.push_str(&py_float_repr(f));
            }
        }
        Value::String(s) => write_py_str(out, s, false),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                write_py_json(out, item, item_sep, key_sep, sort);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                write_py_str(out, k, false);
                out.push_str(key_sep);
                write_py_json(out, v, item_sep, key_sep, sort);
            }
            out.push('}');
        }
    }
}

/// A string as Python's `json` writes it: `encode_basestring`, or with `ensure_ascii`
/// `encode_basestring_ascii` (every character outside `' '..='~'` as `\uXXXX` UTF-16 units).
pub fn write_py_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python `float.__repr__` of a finite f64: the shortest round-trip digits, positional when
/// the decimal exponent is in -4..16 (with a `.0` for integral values), otherwise
/// `d.ddde±XX`.
pub(super) fn py_float_repr(f: f64) -> String {
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.to_string();
    }
    // Rust's `{:e}` gives the shortest round-trip digits, like Python's repr.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if negative { "-" } else { "" };
    if !(-4..16).contains(&exp) {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{first}{frac}e{esign}{:02}", exp.abs());
    }
    let decpt = exp + 1;
    let n = digits.len() as i32;
    if decpt <= 0 {
        format!("{sign}0.{}{digits}", "0".repeat((-decpt) as usize))
    } else if decpt >= n {
        format!("{sign}{digits}{}.0", "0".repeat((decpt - n) as usize))
    } else {
        let (int, frac) = digits.split_at(decpt as usize);
        format!("{sign}{int}.{frac}")
    }
}
