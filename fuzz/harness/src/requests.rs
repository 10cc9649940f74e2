//! Request bodies → validated requests, as the server takes them: the body bytes parsed as
//! JSON, through the server's one request path (`deltafin_openai::front::parse`: the
//! endpoint's parser, then the shared limits), then the prompt encoded (the XTML chat
//! template rendered with the request's controls) as `Engine::encode` does.

use crate::{MAX_INPUT, capped, kimi_tokenizer};
use deltafin_k3::text::chat::{ReasoningEffort, Thinking, encode_chat};
use deltafin_openai::engine::chat_options;
use deltafin_openai::front::{self, Api, HeaderMap, ParseContext};
use deltafin_openai::request::{GenRequest, Limits, Prompt, Surface};
use deltafin_openai::responses::store::Store;
use deltafin_openai::seal::Sealer;
use deltafin_openai::tokenize;
use serde_json::Value;
use std::sync::OnceLock;

/// The endpoints that generate.
#[derive(Clone, Copy)]
enum Endpoint {
    Chat,
    Completions,
    Responses,
    Messages,
    OllamaChat,
    OllamaGenerate,
}

/// `--model-alias` names the requests may use (one, so that the alias path is reachable).
fn aliases() -> &'static [String] {
    static ALIASES: OnceLock<Vec<String>> = OnceLock::new();
    ALIASES.get_or_init(|| vec!["kimi-k3".to_string()])
}

/// The body as the server reads it (`serde_json::from_slice` of the bytes).
fn body(data: &[u8]) -> Option<Value> {
    serde_json::from_slice(capped(data, MAX_INPUT)).ok()
}

fn generation(data: &[u8], endpoint: Endpoint) {
    let Some(json) = body(data) else {
        return;
    };
    let limits = Limits {
        max_tokens: 4096,
        default_thinking: Thinking::On(ReasoningEffort::Max),
        model_aliases: aliases(),
    };
    let api = match endpoint {
        Endpoint::Chat => Api::OpenAi(Surface::Chat),
        Endpoint::Completions => Api::OpenAi(Surface::Completions),
        Endpoint::Responses => Api::Responses,
        Endpoint::Messages => Api::Messages,
        Endpoint::OllamaChat => Api::OllamaChat,
        Endpoint::OllamaGenerate => Api::OllamaGenerate,
    };
    // One sealer and store for the whole run, as one server has: a stored response named by
    // `previous_response_id` is looked up, never found (the fuzzer stores nothing).
    static SEALER: OnceLock<Sealer> = OnceLock::new();
    static STORE: OnceLock<Store> = OnceLock::new();
    let headers = HeaderMap::new();
    let cx = ParseContext {
        limits,
        headers: &headers,
        sealer: SEALER.get_or_init(Sealer::ephemeral),
        store: Some(STORE.get_or_init(|| Store::in_memory(1 << 20))),
    };
    let Ok((req, _)) = front::parse(api, &json, &cx) else {
        return;
    };
    encode_prompt(&req);
}

/// The prompt ids of a validated request (`deltafin_openai::Engine::encode` without the
/// engine: raw text with specials off, or the chat template with the request's controls).
fn encode_prompt(req: &GenRequest) {
    let tok = kimi_tokenizer();
    match &req.prompt {
        Prompt::Raw(text) => {
            let _ = tok.encode_ordinary(text);
        }
        Prompt::Chat { messages, controls } => {
            let _ = encode_chat(tok, messages, &chat_options(controls));
        }
    }
}

/// `POST /v1/chat/completions`.
pub fn request_chat(data: &[u8]) {
    generation(data, Endpoint::Chat);
}

/// `POST /v1/completions`.
pub fn request_completions(data: &[u8]) {
    generation(data, Endpoint::Completions);
}

/// `POST /v1/responses`.
pub fn request_responses(data: &[u8]) {
    generation(data, Endpoint::Responses);
}

/// `POST /v1/messages`.
pub fn request_messages(data: &[u8]) {
    generation(data, Endpoint::Messages);
}

/// `POST /api/chat` (Ollama).
pub fn request_ollama_chat(data: &[u8]) {
    generation(data, Endpoint::OllamaChat);
}

/// `POST /api/generate` (Ollama).
pub fn request_ollama_generate(data: &[u8]) {
    generation(data, Endpoint::OllamaGenerate);
}

/// `POST /tokenize` and `POST /detokenize` (each body goes to both).
pub fn request_tokenize(data: &[u8]) {
    let Some(json) = body(data) else {
        return;
    };
    let tok = kimi_tokenizer();
    let _ = tokenize::tokenize(tok, &json);
    let _ = tokenize::detokenize(tok, &json);
}
