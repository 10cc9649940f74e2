use super::*;
use crate::MODEL_ID;

const LIMITS: Limits<'static> = Limits {
    max_tokens: 1000,
    default_thinking: Thinking::On(ReasoningEffort::Max),
    model_aliases: &[],
};

fn chat(extra: Value) -> Result<(GenRequest, OllamaMeta), ApiError> {
    let mut body = json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    parse(&body, true, &LIMITS)
}

#[test]
fn chat_defaults_and_switches() {
    let (r, m) = chat(json!({})).unwrap();
    assert!(r.stream, "Ollama streams unless told not to");
    assert!(m.chat);
    assert_eq!(r.max_new, 1000);
    let Prompt::Chat { controls, .. } = &r.prompt else {
        panic!()
    };
    assert!(controls.thinking);
    let (r, _) = chat(json!({"think": false, "stream": false, "options": {"num_predict": 7, "temperature": 0.5, "seed": 3, "num_thread": 8}})).unwrap();
    assert!(!r.stream && r.max_new == 7 && r.sampling.unwrap().seed == 3);
    let Prompt::Chat { controls, .. } = &r.prompt else {
        panic!()
    };
    assert!(!controls.thinking);
    let (r, _) = chat(json!({"think": "low", "format": "json"})).unwrap();
    let Prompt::Chat { controls, .. } = &r.prompt else {
        panic!()
    };
    assert_eq!(
        (controls.thinking, controls.effort),
        (true, ReasoningEffort::Low)
    );
    assert_eq!(controls.response_format, Some(ResponseFormat::JsonObject));
    assert!(chat(json!({"model": format!("{MODEL_ID}:latest")})).is_ok());
    assert!(chat(json!({"keep_alive": "5m"})).is_ok());
}

#[test]
fn what_cannot_be_honoured_is_refused() {
    let e = |extra: Value| chat(extra).unwrap_err().message;
    assert!(e(json!({"options": {"repeat_penalty": 1.1}})).contains("repeat_penalty"));
    assert!(chat(json!({"options": {"repeat_penalty": 1.0}})).is_ok());
    assert!(e(json!({"options": {"mystery": 1}})).contains("mystery"));
    assert!(e(json!({"options": {"num_predict": 5000}})).contains("--max-tokens"));
    assert!(
        e(json!({"messages": [{"role": "user", "content": "x", "images": ["AAAA"]}]}))
            .contains("text-only")
    );
    assert!(e(json!({"model": "llama3"})).contains("llama3"));
    assert!(e(json!({"think": "max"})).contains("think"));
    assert!(e(json!({"foo": 1})).contains("`foo`"));
}

#[test]
fn tool_history_renders_as_chat() {
    let (r, _) = chat(json!({
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "thinking": "look", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny", "tool_name": "get_weather"}
        ]
    }))
    .unwrap();
    let Prompt::Chat { messages, controls } = &r.prompt else {
        panic!()
    };
    assert_eq!(controls.tools.len(), 1);
    assert_eq!(messages[1].tool_calls[0].arguments, "{\"city\":\"Paris\"}");
    assert_eq!(messages[1].reasoning_content.as_deref(), Some("look"));
    assert_eq!(messages[2].tool.as_deref(), Some("get_weather"));
}

#[test]
fn generate_raw_and_templated() {
    let g = |v: Value| parse(&v, false, &LIMITS);
    let (r, m) = g(json!({"model": MODEL_ID, "prompt": "Once", "raw": true})).unwrap();
    assert!(!m.chat);
    assert_eq!(r.prompt, Prompt::Raw("Once".into()));
    let (r, _) = g(json!({"model": MODEL_ID, "prompt": "Hi", "system": "be brief"})).unwrap();
    let Prompt::Chat { messages, .. } = &r.prompt else {
        panic!()
    };
    assert_eq!(
        (messages[0].role.as_str(), messages[1].role.as_str()),
        ("system", "user")
    );
    assert!(g(json!({"model": MODEL_ID, "prompt": "x", "template": "{{ .Prompt }}"})).is_err());
    assert!(g(json!({"model": MODEL_ID, "prompt": "x", "context": [1, 2]})).is_err());
    assert!(g(json!({"model": MODEL_ID, "prompt": ""})).is_err());
    assert!(g(json!({"model": MODEL_ID, "prompt": "x", "raw": true, "system": "s"})).is_err());
}

#[test]
fn timestamps_are_rfc3339() {
    let t = std::time::UNIX_EPOCH + std::time::Duration::new(1_765_065_600, 5);
    assert_eq!(timestamp(t), "2025-12-07T00:00:00.000000005Z");
    assert_eq!(
        timestamp(std::time::UNIX_EPOCH),
        "1970-01-01T00:00:00.000000000Z"
    );
}
