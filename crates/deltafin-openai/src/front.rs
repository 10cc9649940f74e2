//! The one request path of every generation API: which API a request came to, its body
//! parsed into the one [`GenRequest`] the engine runs (each API's strict parser, then the
//! shared limits), and the [`Reply`] that renders the answer in the API's shape.

use crate::engine::Engine;
use crate::error::ApiError;
use crate::messages::{self, MessagesMeta, reply::MessagesReply};
use crate::ollama::{self, OllamaMeta};
use crate::reply::{Reply, ReplyContext};
use crate::request::{self, GenRequest, Limits, Surface};
use crate::response::Shape;
use crate::responses::{self, ResponsesMeta, reply::ResponsesReply};
use crate::seal::Sealer;
pub use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use std::sync::Arc;

/// Which API a generation request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// OpenAI's completions or chat completions.
    OpenAi(Surface),
    /// Anthropic's Messages API (`/v1/messages`).
    Messages,
    /// OpenAI's Responses API (`/v1/responses`).
    Responses,
    /// Ollama's `/api/chat`.
    OllamaChat,
    /// Ollama's `/api/generate`.
    OllamaGenerate,
}

impl Api {
    /// The error in this API's shape.
    pub fn error(self, e: ApiError) -> Response {
        match self {
            Api::Messages => e.response_with_body(&messages::wire::error_body(&e)),
            Api::OllamaChat | Api::OllamaGenerate => e.response_with_body(&ollama::error_body(&e)),
            Api::OpenAi(_) | Api::Responses => e.into_response(),
        }
    }

    /// The field a prompt lives in, named by errors about the whole prompt (too long, no
    /// tokens).
    pub fn prompt_param(self) -> &'static str {
        match self {
            Api::OpenAi(Surface::Completions) | Api::OllamaGenerate => "prompt",
            Api::Responses => "input",
            Api::OpenAi(Surface::Chat) | Api::Messages | Api::OllamaChat => "messages",
        }
    }
}

/// The endpoint-specific part of a validated request: what its reply needs.
pub enum Front {
    /// Chat completions or completions.
    OpenAi(Surface),
    /// Anthropic Messages.
    Messages(MessagesMeta),
    /// OpenAI Responses.
    Responses(Box<ResponsesMeta>),
    /// Ollama chat or generate.
    Ollama(OllamaMeta),
}

/// What parsing needs from the server besides the body.
pub struct ParseContext<'a> {
    /// Server-wide limits.
    pub limits: Limits<'a>,
    /// The request's headers (Anthropic's version and beta names).
    pub headers: &'a HeaderMap,
    /// Opens the reasoning tokens of earlier answers sent back.
    pub sealer: &'a Sealer,
    /// Stored responses (`previous_response_id`).
    pub store: Option<&'a responses::store::Store>,
}

/// Parses a generation request body for `api`: the API's strict parser, then the limits
/// every endpoint shares.
pub fn parse(
    api: Api,
    json: &Value,
    cx: &ParseContext<'_>,
) -> Result<(GenRequest, Front), ApiError> {
    let (req, front) = match api {
        Api::OpenAi(surface) => (
            request::parse(json, surface, &cx.limits)?,
            Front::OpenAi(surface),
        ),
        Api::Messages => {
            messages::check_headers(cx.headers)?;
            let (r, meta) = messages::parse(json, &cx.limits, cx.sealer)?;
            (r, Front::Messages(meta))
        }
        Api::Responses => {
            let (r, meta) = responses::parse(json, &cx.limits, cx.sealer, cx.store)?;
            (r, Front::Responses(Box::new(meta)))
        }
        Api::OllamaChat | Api::OllamaGenerate => {
            let (r, meta) = ollama::parse(json, api == Api::OllamaChat, &cx.limits)?;
            (r, Front::Ollama(meta))
        }
    };
    request::check_limits(&req)?;
    Ok((req, front))
}

/// What a reply is built from besides the request's own part.
pub struct ReplyParts {
    /// Ids and counts.
    pub ctx: ReplyContext,
    /// The engine (tokenizer for log-probabilities).
    pub engine: Arc<Engine>,
    /// Seals reasoning for the client to send back.
    pub sealer: Sealer,
    /// Where Responses are stored.
    pub store: Option<Arc<responses::store::Store>>,
}

impl Front {
    /// The context the request may fill, when it asks for less than the server admits
    /// (Ollama's `options.num_ctx`).
    pub fn context_limit(&self) -> Option<usize> {
        match self {
            Front::Ollama(meta) => meta.num_ctx,
            _ => None,
        }
    }

    /// The reply that renders the answer to `req`.
    pub fn reply(self, req: &GenRequest, parts: ReplyParts) -> Box<dyn Reply> {
        let ReplyParts {
            ctx,
            engine,
            sealer,
            store,
        } = parts;
        match self {
            Front::OpenAi(surface) => Box::new(Shape {
                surface,
                id: ctx.id.clone(),
                created: ctx.created,
                engine,
                logprobs: req.logprobs.is_some(),
                include_usage: req.include_usage,
            }),
            Front::Messages(meta) => Box::new(MessagesReply::new(ctx, meta, sealer)),
            Front::Responses(meta) => Box::new(ResponsesReply::new(ctx, *meta, sealer, store)),
            Front::Ollama(meta) => Box::new(ollama::reply::OllamaReply::new(ctx, meta)),
        }
    }
}
