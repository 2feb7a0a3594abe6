//! OpenAI-compatible request and response bodies, plus the `hypic` extensions.
//!
//! Requests accept unknown fields (OpenAI clients send many optional parameters);
//! known fields with a wrong type are rejected with a 400 naming the field.
use serde::{Deserialize, Serialize};

/// `stop`: one string or a list of strings.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    /// One stop sequence.
    One(String),
    /// Several stop sequences.
    Many(Vec<String>),
}

impl StopSpec {
    /// The stop sequences as a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopSpec::One(s) => vec![s],
            StopSpec::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` before `[DONE]`.
    #[serde(default)]
    pub include_usage: bool,
}

/// The `hypic` request extension: reuse mode and namespace salt.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HypicRequestExt {
    /// `full_recompute` (`full`), `prefix_cache` (`prefix`), `naive_addition`
    /// (`naive`) or `hypic`.
    #[serde(default)]
    pub mode: Option<String>,
    /// Seam window for `hypic` mode (default: the server's).
    #[serde(default)]
    pub seam_width: Option<usize>,
    /// Re-rotate cached keys (default true; `false` is the ablation).
    #[serde(default)]
    pub rope_fix: Option<bool>,
    /// Client salt: narrows cache sharing to requests carrying the same salt, never
    /// widens it.
    #[serde(default)]
    pub salt: Option<String>,
}

/// One item of a completions `segments` array.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SegmentItem {
    /// Inline text (cached privately for the caller's tenant).
    #[serde(default)]
    pub text: Option<String>,
    /// A catalog segment id (registered with `POST /v1/segments`).
    #[serde(default)]
    pub id: Option<String>,
    /// The version the client expects (default: the current one).
    #[serde(default)]
    pub version: Option<i64>,
}

/// `prompt`: a string or a list of strings.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptSpec {
    /// One prompt.
    One(String),
    /// Several prompts (one choice set each).
    Many(Vec<String>),
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    /// Model id (optional; must match the served model when given).
    #[serde(default)]
    pub model: Option<String>,
    /// Prompt text; the configured separator (default `<<PIC_SEP>>`) cuts it into
    /// segments.
    #[serde(default)]
    pub prompt: Option<PromptSpec>,
    /// Explicit segments (instead of `prompt`); the last one is the query.
    #[serde(default)]
    pub segments: Option<Vec<SegmentItem>>,
    /// Maximum new tokens (≥ 1).
    #[serde(default)]
    pub max_tokens: Option<i64>,
    /// Sampling temperature, 0..=2 (0 = greedy).
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus mass, (0, 1].
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Top-k filter (extension; 0 = off).
    #[serde(default)]
    pub top_k: Option<usize>,
    /// RNG seed; choice `i` of `n` uses `seed + i`.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Number of choices.
    #[serde(default)]
    pub n: Option<i64>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Stop sequences.
    #[serde(default)]
    pub stop: Option<StopSpec>,
    /// Number of top log-probabilities per token (0..=5).
    #[serde(default)]
    pub logprobs: Option<i64>,
    /// Echo the prompt before the completion.
    #[serde(default)]
    pub echo: Option<bool>,
    /// Keep generating past end-of-sequence tokens (vLLM extension).
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// HYPIC extension.
    #[serde(default)]
    pub hypic: Option<HypicRequestExt>,
}

/// A chat content part.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContentPart {
    /// Only `text` is supported.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    #[serde(default)]
    pub text: Option<String>,
}

/// Chat message content: a string or a list of parts.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts (each is its own segment).
    Parts(Vec<ContentPart>),
}

/// One chat message.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessageIn {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Content (null is treated as empty, e.g. assistant tool calls).
    #[serde(default)]
    pub content: Option<MessageContent>,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    /// Model id (optional; must match the served model when given).
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation; each message (and each content part) is a segment.
    pub messages: Vec<ChatMessageIn>,
    /// Maximum new tokens (≥ 1).
    #[serde(default)]
    pub max_tokens: Option<i64>,
    /// Newer name of `max_tokens`.
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    /// Sampling temperature, 0..=2.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus mass, (0, 1].
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Top-k filter (extension).
    #[serde(default)]
    pub top_k: Option<usize>,
    /// RNG seed; choice `i` uses `seed + i`.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Number of choices.
    #[serde(default)]
    pub n: Option<i64>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Stop sequences.
    #[serde(default)]
    pub stop: Option<StopSpec>,
    /// Return log-probabilities of the output tokens.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// Alternatives per token (0..=20), needs `logprobs: true`.
    #[serde(default)]
    pub top_logprobs: Option<i64>,
    /// Keep generating past end-of-sequence tokens (vLLM extension).
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// HYPIC extension.
    #[serde(default)]
    pub hypic: Option<HypicRequestExt>,
}

/// `usage.prompt_tokens_details`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose work was reused from a cache.
    pub cached_tokens: usize,
}

/// `usage`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens (all choices).
    pub completion_tokens: usize,
    /// Sum.
    pub total_tokens: usize,
    /// Cache details.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// Per-segment report in the `hypic` response extension.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SegmentReport {
    /// Position in the request.
    pub index: usize,
    /// Tokens.
    pub tokens: usize,
    /// `computed`, `prefix_hit`, `hit` or `miss`.
    pub outcome: String,
    /// Tokens run through the model for it.
    pub computed: usize,
    /// Tokens reused.
    pub reused: usize,
    /// Content hash (model + tokens).
    pub content_hash: String,
    /// Catalog id when the segment came from the catalog.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Catalog version pinned for this request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<i64>,
    /// True when the shared (cross-tenant) namespace was used.
    pub shared: bool,
}

/// The `hypic` response extension.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct HypicResponseExt {
    /// Mode name.
    pub mode: String,
    /// Seam window (hypic mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seam_width: Option<usize>,
    /// RoPE fix (hypic mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_fix: Option<bool>,
    /// Tokens run through the model.
    pub tokens_computed: usize,
    /// Tokens reused.
    pub tokens_reused: usize,
    /// Segments served from a pool.
    pub hits: usize,
    /// Segments that missed the public pool.
    pub misses: usize,
    /// Submission to first token, ms (first choice).
    pub ttft_ms: f64,
    /// Time queued, ms (first choice).
    pub queued_ms: f64,
    /// One entry per segment.
    pub segments: Vec<SegmentReport>,
}

/// `logprobs` of a completions choice.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct CompletionLogprobs {
    /// Token strings.
    pub tokens: Vec<String>,
    /// Their log-probabilities.
    pub token_logprobs: Vec<f32>,
    /// Top alternatives per position.
    pub top_logprobs: Vec<serde_json::Map<String, serde_json::Value>>,
    /// Character offsets of each token in the choice text.
    pub text_offset: Vec<usize>,
}

/// One chat logprob entry.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ChatTopLogprob {
    /// Token string.
    pub token: String,
    /// Log-probability.
    pub logprob: f32,
    /// UTF-8 bytes of the token.
    pub bytes: Vec<u8>,
}

/// One chat logprob entry with alternatives.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ChatLogprob {
    /// Token string.
    pub token: String,
    /// Log-probability.
    pub logprob: f32,
    /// UTF-8 bytes of the token.
    pub bytes: Vec<u8>,
    /// Alternatives.
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// `logprobs` of a chat choice.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ChatLogprobs {
    /// One entry per generated token.
    pub content: Vec<ChatLogprob>,
}
