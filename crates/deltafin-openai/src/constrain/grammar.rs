//! The grammar of a constrained chat answer, in llguidance's Lark dialect, over K3's XTML
//! output (docs/K3.md §8.5, docs/SERVER.md "Constrained decoding").
//!
//! The answer after the generation prompt is
//! `[REASONING <|close|>think<|sep|><|open|>response<|sep|>] CONTENT <|close|>response<|sep|>
//! [TOOLS] <|close|>message<|sep|><|end_of_msg|>`. Markers are written as token ids
//! (`<[163587]>`), so text can never spell one; free text (reasoning, unconstrained content,
//! string arguments) is any sequence of ordinary BPE tokens. JSON content is llguidance's
//! `%json` over the request's schema, compact (`,` and `:` without spaces, as the template
//! writes JSON). A tools block has the history shape of §8.4: call k carries `index="k"` and
//! names a declared tool (at most [`MAX_CALLS`] calls, one without `parallel_tool_calls`), and
//! its arguments are either argument pieces (declared keys in schema order, each value of its
//! schema) or one raw `json` block of the tool's parameter schema.

use deltafin_k3::text::tokenizer::{CLOSE, END_OF_MSG, OPEN, SEP};
use serde_json::{Value, json};
use std::fmt::Write;

/// Most calls a constrained tools block holds (`parallel_tool_calls`; one without it).
pub const MAX_CALLS: usize = 16;

/// What the answer's content must be.
#[derive(Clone, Copy, Debug)]
pub enum Content<'a> {
    /// Any text.
    Free,
    /// A JSON value of this schema (`{"type":"object"}` for `json_object`).
    Json(&'a Value),
}

/// What the answer's tools block may or must be.
#[derive(Clone, Copy, Debug)]
pub enum Tools<'a> {
    /// No tools block.
    Forbidden,
    /// An optional block calling these tools (`{"type":"function","function":{…}}` each).
    Optional(&'a [Value]),
    /// A block that must be there, calling these tools.
    Required(&'a [Value]),
}

/// The shape a constrained answer must have.
#[derive(Clone, Copy, Debug)]
pub struct Shape<'a> {
    /// The generation prompt opened `think` (the answer starts with reasoning).
    pub thinking: bool,
    /// The content.
    pub content: Content<'a>,
    /// The tools block.
    pub tools: Tools<'a>,
    /// More than one call per block allowed (`parallel_tool_calls`).
    pub parallel: bool,
}

fn tok(id: u32) -> String {
    format!("<[{id}]>")
}

fn lit(s: &str) -> String {
    // A Lark string literal uses JSON string syntax.
    Value::String(s.to_string()).to_string()
}

/// The template's attribute escape (docs/K3.md §8.1): `&` then `"`.
fn escape_attr(s: &str) -> String {
    s.replace('&', "&amp;").replace('"', "&quot;")
}

/// `%json` with compact separators.
fn json_rule(schema: &Value) -> Result<String, String> {
    let mut schema = match schema {
        Value::Object(m) => Value::Object(m.clone()),
        Value::Bool(true) => json!({}),
        _ => return Err("a JSON schema must be an object".into()),
    };
    schema["x-guidance"] = json!({
        "item_separator": ",", "key_separator": ":", "whitespace_flexible": false,
    });
    Ok(format!("%json {schema}"))
}

/// The JSON type name a piece's `type` attribute carries for a property schema, when the
/// schema has exactly one.
fn piece_type(schema: &Value) -> Option<&'static str> {
    let t = match schema.get("type") {
        Some(Value::String(t)) => t.as_str(),
        Some(_) => return None,
        None => {
            // An enum of strings only is a string.
            let all_str = schema
                .get("enum")
                .and_then(Value::as_array)
                .is_some_and(|e| !e.is_empty() && e.iter().all(Value::is_string));
            return all_str.then_some("string");
        }
    };
    Some(match t {
        "string" => "string",
        "number" | "integer" => "number",
        "boolean" => "boolean",
        "null" => "null",
        "object" => "object",
        "array" => "array",
        _ => return None,
    })
}

struct Builder {
    rules: String,
    next: usize,
    text: String,
}

impl Builder {
    fn rule(&mut self, body: String) -> String {
        let name = format!("r{}", self.next);
        self.next += 1;
        let _ = writeln!(self.rules, "{name}: {body}");
        name
    }

    /// A string piece value: the enum's strings, or any ordinary text.
    fn string_value(&mut self, schema: &Value) -> String {
        match schema.get("enum").and_then(Value::as_array) {
            Some(values) if values.iter().all(Value::is_string) && !values.is_empty() => {
                let alts: Vec<String> = values.iter().filter_map(Value::as_str).map(lit).collect();
                self.rule(alts.join(" | "))
            }
            _ => self.text.clone(),
        }
    }

    /// The arguments of one call to a tool with `params` (its parameter schema).
    fn arguments(&mut self, params: &Value) -> Result<String, String> {
        let raw = format!(
            "{} {} {} {} {} {} {}",
            tok(OPEN),
            lit("json type=\"object\""),
            tok(SEP),
            json_rule(params)?,
            tok(CLOSE),
            lit("json"),
            tok(SEP)
        );
        let mut alts = vec![self.rule(raw)];
        // Argument pieces, when every declared property has one type.
        let props = params.get("properties").and_then(Value::as_object);
        let required: Vec<&str> = params
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let empty = serde_json::Map::new();
        let props = props.unwrap_or(&empty);
        if props.values().all(|p| piece_type(p).is_some()) {
            let mut seq = Vec::new();
            for (key, p) in props {
                let Some(ty) = piece_type(p) else { continue };
                let value = if ty == "string" {
                    self.string_value(p)
                } else {
                    let j = json_rule(p)?;
                    self.rule(j)
                };
                let piece = format!(
                    "{} {} {} {value} {} {} {}",
                    tok(OPEN),
                    lit(&format!(
                        "argument key=\"{}\" type=\"{ty}\"",
                        escape_attr(key)
                    )),
                    tok(SEP),
                    tok(CLOSE),
                    lit("argument"),
                    tok(SEP)
                );
                let piece = self.rule(piece);
                seq.push(if required.contains(&key.as_str()) {
                    piece
                } else {
                    format!("{piece}?")
                });
            }
            alts.push(if seq.is_empty() {
                "\"\"".into()
            } else {
                self.rule(seq.join(" "))
            });
        }
        Ok(self.rule(alts.join(" | ")))
    }

    fn tools_block(&mut self, tools: &[Value], parallel: bool) -> Result<String, String> {
        // Each tool's arguments once; the calls at each index refer to them.
        let mut targets = Vec::new();
        for t in tools {
            let f = &t["function"];
            let name = f["name"]
                .as_str()
                .ok_or("a declared tool has no function name")?;
            let params = f.get("parameters").cloned().unwrap_or(json!({}));
            targets.push((escape_attr(name), self.arguments(&params)?));
        }
        if targets.is_empty() {
            return Err("no tool to call".into());
        }
        let count = if parallel { MAX_CALLS } else { 1 };
        // The calls from index `count` down to 1: call k, then optionally calls k+1….
        let mut rest: Option<String> = None;
        for k in (1..=count).rev() {
            let alts: Vec<String> = targets
                .iter()
                .map(|(name, args)| {
                    format!(
                        "{} {} {} {args} {} {} {}",
                        tok(OPEN),
                        lit(&format!("call tool=\"{name}\" index=\"{k}\"")),
                        tok(SEP),
                        tok(CLOSE),
                        lit("call"),
                        tok(SEP)
                    )
                })
                .collect();
            let call = self.rule(alts.join(" | "));
            rest = Some(match rest {
                Some(later) => self.rule(format!("{call} {later}?")),
                None => call,
            });
        }
        let calls = rest.ok_or("no tool to call")?;
        Ok(self.rule(format!(
            "{} {} {} {calls} {} {} {}",
            tok(OPEN),
            lit("tools"),
            tok(SEP),
            tok(CLOSE),
            lit("tools"),
            tok(SEP)
        )))
    }
}

/// The Lark grammar of an answer of `shape`, for a vocabulary whose ordinary (BPE) tokens
/// are the ids below `num_ranks`.
pub fn lark(shape: &Shape<'_>, num_ranks: u32) -> Result<String, String> {
    if num_ranks == 0 {
        return Err("the tokenizer has no ordinary tokens".into());
    }
    let mut b = Builder {
        rules: String::new(),
        next: 0,
        text: "text".into(),
    };
    let close_resp = format!("{} {} {}", tok(CLOSE), lit("response"), tok(SEP));
    let end = format!(
        "{} {} {} {}",
        tok(CLOSE),
        lit("message"),
        tok(SEP),
        tok(END_OF_MSG)
    );
    let content = match shape.content {
        Content::Free => "text".to_string(),
        Content::Json(schema) => {
            let j = json_rule(schema)?;
            b.rule(j)
        }
    };
    let answer = match shape.tools {
        Tools::Forbidden => format!("{content} {close_resp} {end}"),
        Tools::Required(tools) => {
            // A forced call is the whole answer: no content, as OpenAI answers a forced call.
            let block = b.tools_block(tools, shape.parallel)?;
            format!("{close_resp} {block} {end}")
        }
        Tools::Optional(tools) => {
            let block = b.tools_block(tools, shape.parallel)?;
            match shape.content {
                Content::Free => format!("{content} {close_resp} {block}? {end}"),
                // Either the JSON answer, or no content and calls.
                Content::Json(_) => {
                    format!("({content} {close_resp} {end}) | ({close_resp} {block} {end})")
                }
            }
        }
    };
    let think = if shape.thinking {
        format!(
            "text {} {} {} {} {} {} ",
            tok(CLOSE),
            lit("think"),
            tok(SEP),
            tok(OPEN),
            lit("response"),
            tok(SEP)
        )
    } else {
        String::new()
    };
    let mut g = String::new();
    let _ = writeln!(g, "start: {think}{answer}");
    let _ = writeln!(g, "text: <[0-{}]>*", num_ranks - 1);
    g.push_str(&b.rules);
    Ok(g)
}
