//! A forwarding proxy for the agent tests: every request goes to the server unchanged, except
//! that the first generation request of a run may get a forced `tool_choice` (a random model
//! never chooses to call a tool on its own). It records what went through.

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How to force a tool call.
#[derive(Clone, Copy, Debug)]
pub enum Force {
    /// OpenAI Responses: `{"type":"function","name":N}`.
    Responses,
    /// Anthropic Messages: `{"type":"tool","name":N}`.
    Messages,
    /// Chat completions: `{"type":"function","function":{"name":N}}`.
    Chat,
}

/// One request that went through.
#[derive(Clone, Debug)]
pub struct Seen {
    /// Its path (shown when a test fails).
    #[allow(dead_code)]
    pub path: String,
    pub body: Option<Value>,
    /// The tool call forced on it, if any.
    pub forced: Option<String>,
}

pub struct Proxy {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
}

/// The name of a tool with no required arguments among `preferred`, else the first tool
/// without required arguments, else the first tool.
fn pick(
    tools: &[Value],
    name_of: &dyn Fn(&Value) -> Option<String>,
    preferred: &[&str],
) -> Option<String> {
    let usable: Vec<&Value> = tools
        .iter()
        .filter(|t| t.get("defer_loading") != Some(&Value::Bool(true)))
        .filter(|t| name_of(t).is_some())
        .collect();
    let required = |t: &Value| {
        let schema = t
            .get("input_schema")
            .or_else(|| t.get("parameters"))
            .or_else(|| t.get("function").and_then(|f| f.get("parameters")));
        schema
            .and_then(|s| s.get("required"))
            .and_then(Value::as_array)
            .is_some_and(|r| !r.is_empty())
    };
    for p in preferred {
        if let Some(t) = usable.iter().find(|t| name_of(t).as_deref() == Some(*p)) {
            return name_of(t);
        }
    }
    usable
        .iter()
        .find(|t| !required(t))
        .or(usable.first())
        .and_then(|t| name_of(t))
}

fn force(body: &mut Value, how: Force, preferred: &[&str]) -> Option<String> {
    let tools = body.get("tools")?.as_array()?.clone();
    match how {
        Force::Responses => {
            let name = pick(
                &tools,
                &|t| {
                    (t["type"] == "function")
                        .then(|| t["name"].as_str().map(str::to_string))
                        .flatten()
                },
                preferred,
            )?;
            body["tool_choice"] = serde_json::json!({"type": "function", "name": name});
            Some(name)
        }
        Force::Messages => {
            let name = pick(
                &tools,
                &|t| t["name"].as_str().map(str::to_string),
                preferred,
            )?;
            body["tool_choice"] = serde_json::json!({"type": "tool", "name": name});
            Some(name)
        }
        Force::Chat => {
            let name = pick(
                &tools,
                &|t| t["function"]["name"].as_str().map(str::to_string),
                preferred,
            )?;
            body["tool_choice"] =
                serde_json::json!({"type": "function", "function": {"name": name}});
            Some(name)
        }
    }
}

fn is_generation(path: &str) -> bool {
    let path = path.split('?').next().unwrap_or(path);
    path.ends_with("/responses")
        || path.ends_with("/messages")
        || path.ends_with("/chat/completions")
}

impl Proxy {
    /// A proxy to `upstream` that forces a tool call (`how`, preferring the tools named in
    /// `preferred`) on the first generation request that declares tools.
    pub fn start(upstream: SocketAddr, how: Force, preferred: &'static [&'static str]) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let forced_once = Arc::new(Mutex::new(false));
        let log = seen.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let log = log.clone();
                let forced_once = forced_once.clone();
                std::thread::spawn(move || {
                    let _ = handle(conn, upstream, how, preferred, &log, &forced_once);
                });
            }
        });
        Proxy { addr, seen }
    }
}

fn handle(
    client: TcpStream,
    upstream: SocketAddr,
    how: Force,
    preferred: &[&str],
    log: &Mutex<Vec<Seen>>,
    forced_once: &Mutex<bool>,
) -> std::io::Result<()> {
    client.set_read_timeout(Some(Duration::from_secs(600)))?;
    let mut reader = BufReader::new(client.try_clone()?);
    let mut head = Vec::new();
    let mut line = String::new();
    reader.read_line(&mut line)?;
    if line.is_empty() {
        return Ok(());
    }
    let request_line = line.trim_end().to_string();
    let path = request_line.split(' ').nth(1).unwrap_or("").to_string();
    let mut length = 0usize;
    let mut chunked = false;
    loop {
        line.clear();
        reader.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let lower = l.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            length = v.trim().parse().unwrap_or(0);
            continue;
        }
        if lower.starts_with("transfer-encoding:") {
            chunked = lower.contains("chunked");
            continue;
        }
        if lower.starts_with("connection:") || lower.starts_with("accept-encoding:") {
            continue;
        }
        head.push(l.to_string());
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            line.clear();
            reader.read_line(&mut line)?;
            let n = usize::from_str_radix(line.trim().split(';').next().unwrap_or("0"), 16)
                .unwrap_or(0);
            if n == 0 {
                line.clear();
                reader.read_line(&mut line)?;
                break;
            }
            let mut chunk = vec![0u8; n + 2];
            reader.read_exact(&mut chunk)?;
            body.extend_from_slice(&chunk[..n]);
        }
    } else {
        body.resize(length, 0);
        reader.read_exact(&mut body)?;
    }
    let mut json: Option<Value> = serde_json::from_slice(&body).ok();
    let mut forced = None;
    if is_generation(&path)
        && let Some(v) = json.as_mut()
    {
        let mut once = forced_once.lock().unwrap();
        if !*once
            && v.get("tools")
                .and_then(Value::as_array)
                .is_some_and(|t| !t.is_empty())
        {
            forced = force(v, how, preferred);
            *once = forced.is_some();
        }
        if forced.is_some() {
            body = serde_json::to_vec(v).unwrap();
        }
    }
    log.lock().unwrap().push(Seen {
        path: path.clone(),
        body: json,
        forced,
    });
    let mut up = TcpStream::connect(upstream)?;
    let mut out = format!("{request_line}\r\n");
    for h in &head {
        out.push_str(h);
        out.push_str("\r\n");
    }
    out.push_str(&format!(
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    ));
    up.write_all(out.as_bytes())?;
    up.write_all(&body)?;
    // The answer goes back as it comes (streams included); the server closes after it.
    let mut client = client;
    std::io::copy(&mut up, &mut client)?;
    let _ = client.shutdown(Shutdown::Both);
    Ok(())
}
