//! OpenAI-compatible request and response bodies, plus the `hypic` extensions.
//!
//! Known fields with a wrong type are rejected with a 400 naming the field. Fields
//! the server does not read are rejected too (a 400 naming the field, see
//! [`unsupported_field`]), so that no parameter is silently ignored; only `user`,
//! which has no effect on the answer, is accepted and ignored.
use super::errors::field_rule;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use std::fmt;

/// At most this many stop sequences per request.
pub const MAX_STOPS: usize = 4;

/// `stop`: one string or a list of strings.
#[derive(Clone, Debug)]
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

impl<'de> Deserialize<'de> for StopSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let rule = format!("must be a string or an array of up to {MAX_STOPS} strings");
        match string_or_strings(d, &rule)? {
            StringOrStrings::One(s) => Ok(StopSpec::One(s)),
            StringOrStrings::Many(v) if v.len() > MAX_STOPS => {
                Err(field_rule(format!("{rule} (got {})", v.len())))
            }
            StringOrStrings::Many(v) => Ok(StopSpec::Many(v)),
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

/// `prompt`: a string, a list of strings, a list of token ids or a list of lists of
/// token ids.
#[derive(Clone, Debug)]
pub enum PromptSpec {
    /// One prompt.
    One(String),
    /// Several prompts (one choice set each).
    Many(Vec<String>),
    /// Prompts given as token ids (`[ids]` is one prompt, `[[ids], …]` several). The
    /// ids are checked against the vocabulary by the route, which names the index.
    Tokens {
        /// One list of ids per prompt.
        prompts: Vec<Vec<i64>>,
        /// Whether the request nested the lists (`[[ids], …]`), for error paths.
        nested: bool,
    },
}

impl<'de> Deserialize<'de> for PromptSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde_json::Value;
        const RULE: &str = "must be a string, an array of strings, an array of token ids or an array of arrays of token ids";
        let bad = |what: String| -> D::Error { field_rule(format!("{RULE} ({what})")) };
        let id = |v: &Value| v.as_i64();
        match Value::deserialize(d)? {
            Value::String(s) => Ok(PromptSpec::One(s)),
            Value::Array(items) => match items.first() {
                None => Ok(PromptSpec::Many(Vec::new())),
                Some(Value::String(_)) => {
                    let mut out = Vec::with_capacity(items.len());
                    for (i, v) in items.into_iter().enumerate() {
                        match v {
                            Value::String(s) => out.push(s),
                            other => {
                                return Err(bad(format!("element {i} is {}", json_kind(&other))))
                            }
                        }
                    }
                    Ok(PromptSpec::Many(out))
                }
                Some(Value::Number(_)) => {
                    let mut ids = Vec::with_capacity(items.len());
                    for (i, v) in items.iter().enumerate() {
                        ids.push(id(v).ok_or_else(|| {
                            bad(format!("element {i} is {}, not a token id", json_kind(v)))
                        })?);
                    }
                    Ok(PromptSpec::Tokens {
                        prompts: vec![ids],
                        nested: false,
                    })
                }
                Some(Value::Array(_)) => {
                    let mut prompts = Vec::with_capacity(items.len());
                    for (i, v) in items.iter().enumerate() {
                        let Value::Array(row) = v else {
                            return Err(bad(format!("element {i} is {}", json_kind(v))));
                        };
                        let mut ids = Vec::with_capacity(row.len());
                        for (j, x) in row.iter().enumerate() {
                            ids.push(id(x).ok_or_else(|| {
                                bad(format!(
                                    "element [{i}][{j}] is {}, not a token id",
                                    json_kind(x)
                                ))
                            })?);
                        }
                        prompts.push(ids);
                    }
                    Ok(PromptSpec::Tokens {
                        prompts,
                        nested: true,
                    })
                }
                Some(other) => Err(bad(format!("element 0 is {}", json_kind(other)))),
            },
            other => Err(bad(format!("got {}", json_kind(&other)))),
        }
    }
}

/// `logit_bias`: token id (a decimal string, as JSON object keys are) → bias.
pub type LogitBias = std::collections::BTreeMap<String, f64>;

/// `response_format` (OpenAI): `{"type": "text"}` (the default), `{"type":
/// "json_object"}` (any JSON object) or `{"type": "json_schema", "json_schema": {...}}`;
/// the JSON formats are enforced while decoding (see `serve::structured`).
#[derive(Clone, Debug, Deserialize)]
pub struct ResponseFormat {
    /// `text`, `json_object` or `json_schema`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The schema of a `json_schema` format.
    #[serde(default)]
    pub json_schema: Option<JsonSchemaFormat>,
}

/// `response_format.json_schema`.
#[derive(Clone, Debug, Deserialize)]
pub struct JsonSchemaFormat {
    /// Name of the format (`a-z`, `A-Z`, `0-9`, `_`, `-`; at most 64 characters).
    pub name: String,
    /// What the format is for (not used in decoding).
    #[serde(default)]
    pub description: Option<String>,
    /// A JSON Schema; absent: any JSON value.
    #[serde(default)]
    pub schema: Option<serde_json::Value>,
    /// `true`: a schema keyword the grammar compiler does not support is a 400;
    /// `false` or absent: such keywords are ignored (the rest is still enforced).
    #[serde(default)]
    pub strict: Option<bool>,
}

/// Fields of a completions request that the server reads.
pub const COMPLETION_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "segments",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "n",
    "stream",
    "stream_options",
    "stop",
    "logprobs",
    "echo",
    "ignore_eos",
    "hypic",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "response_format",
    "user",
];

/// Fields of a chat request that the server reads.
pub const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "n",
    "stream",
    "stream_options",
    "stop",
    "logprobs",
    "top_logprobs",
    "ignore_eos",
    "hypic",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "user",
];

/// The first (in byte order) top-level field of the JSON object `body` that is not
/// in `known`, if any. A body that is not an object yields `None` (its parse error is
/// reported elsewhere).
pub fn unsupported_field(body: &[u8], known: &[&str]) -> Option<String> {
    let keys: std::collections::BTreeMap<String, IgnoredAny> = serde_json::from_slice(body).ok()?;
    keys.into_keys().find(|k| !known.contains(&k.as_str()))
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
    /// OpenAI presence penalty, -2..=2 (over the generated tokens).
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// OpenAI frequency penalty, -2..=2 (over the generated tokens).
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Hugging Face repetition penalty, (0, 10] (extension; over prompt and output).
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// Token id → bias in -100..=100, added to the logit.
    #[serde(default)]
    pub logit_bias: Option<LogitBias>,
    /// End-of-sequence tokens are masked until this many tokens (extension).
    #[serde(default)]
    pub min_tokens: Option<i64>,
    /// Output format: text, or JSON enforced while decoding (as for chat).
    #[serde(default)]
    pub response_format: Option<ResponseFormat>,
    /// HYPIC extension.
    #[serde(default)]
    pub hypic: Option<HypicRequestExt>,
}

/// A chat content part. Parts of any `type` are read (so that an image part is
/// answered "only text content parts are supported", naming the part); other fields
/// are kept by name for the same reason.
#[derive(Clone, Debug, Default)]
pub struct ContentPart {
    /// Only `text` is supported.
    pub kind: String,
    /// The text.
    pub text: Option<String>,
    /// Names of the other fields (none are allowed in a text part).
    pub other_fields: Vec<String>,
}

impl<'de> Deserialize<'de> for ContentPart {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ContentPart;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a content part object such as {\"type\": \"text\", \"text\": \"...\"}")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<ContentPart, A::Error> {
                let mut kind = None;
                let mut part = ContentPart::default();
                while let Some(k) = m.next_key::<String>()? {
                    match k.as_str() {
                        "type" => kind = Some(m.next_value::<String>()?),
                        "text" => part.text = m.next_value::<Option<String>>()?,
                        _ => {
                            m.next_value::<IgnoredAny>()?;
                            part.other_fields.push(k);
                        }
                    }
                }
                part.kind = kind.ok_or_else(|| {
                    field_rule("needs a 'type' (only \"text\" content parts are supported)")
                })?;
                Ok(part)
            }
        }
        d.deserialize_map(V)
    }
}

/// Chat message content: a string or a list of parts.
#[derive(Clone, Debug)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts (each is its own segment).
    Parts(Vec<ContentPart>),
}

impl MessageContent {
    /// Bytes of text: the string, or the sum of the parts' texts.
    pub fn text_bytes(&self) -> usize {
        match self {
            MessageContent::Text(t) => t.len(),
            MessageContent::Parts(ps) => ps
                .iter()
                .map(|p| p.text.as_ref().map_or(0, |t| t.len()))
                .sum(),
        }
    }
}

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MessageContent;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<MessageContent, E> {
                Ok(MessageContent::Text(v.to_string()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<MessageContent, E> {
                Ok(MessageContent::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<MessageContent, A::Error> {
                let mut parts = Vec::new();
                while let Some(p) = a.next_element::<ContentPart>()? {
                    parts.push(p);
                }
                Ok(MessageContent::Parts(parts))
            }
        }
        d.deserialize_any(V)
    }
}

/// One chat message.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessageIn {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Content (required: null is only valid for assistant tool calls, which are
    /// not supported).
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// Assistant tool calls (`[{"id", "type": "function", "function": {"name",
    /// "arguments"}}]`), validated when the conversation is rendered.
    #[serde(default)]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` message's call id.
    #[serde(default)]
    pub tool_call_id: Option<String>,
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
    /// Output format: text, or JSON enforced while decoding.
    #[serde(default)]
    pub response_format: Option<ResponseFormat>,
    /// Function tools the model may call (see `serve::tools`).
    #[serde(default)]
    pub tools: Option<serde_json::Value>,
    /// `none`, `auto`, `required` or `{"type": "function", "function": {"name"}}`.
    #[serde(default)]
    pub tool_choice: Option<serde_json::Value>,
    /// Allow several calls in one answer (default true).
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// Alternatives per token (0..=20), needs `logprobs: true`.
    #[serde(default)]
    pub top_logprobs: Option<i64>,
    /// Keep generating past end-of-sequence tokens (vLLM extension).
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// OpenAI presence penalty, -2..=2 (over the generated tokens).
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// OpenAI frequency penalty, -2..=2 (over the generated tokens).
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Hugging Face repetition penalty, (0, 10] (extension; over prompt and output).
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// Token id → bias in -100..=100, added to the logit.
    #[serde(default)]
    pub logit_bias: Option<LogitBias>,
    /// End-of-sequence tokens are masked until this many tokens (extension).
    #[serde(default)]
    pub min_tokens: Option<i64>,
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
    /// Of `computed`, the seam window recomputed at the segment's new position
    /// (a `hit` or `miss` after the first segment in `hypic` mode; else 0).
    #[serde(default)]
    pub seam: usize,
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
    /// Why the segment was not reused although the mode reuses work (every `miss`,
    /// and a `computed` segment that is not the query): `never_seen`, `evicted`,
    /// `invalidated`, `damaged`, `not_admitted`, `role_mismatch`,
    /// `too_short_for_seam` or `private_prefix_miss`. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub miss_reason: Option<String>,
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
    /// The scatter of the prompt's cold segments over segment-parallel workers
    /// (absent when none was scattered): per worker segments, tokens and times,
    /// scatter / combine / transfer ms, segments reassigned or recomputed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scatter: Option<dataplane::parallel::scatter::ScatterReport>,
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

/// A string, or an array of strings (read by [`string_or_strings`]).
enum StringOrStrings {
    One(String),
    Many(Vec<String>),
}

/// How a JSON value that is not a string reads in an error message.
fn json_kind(v: &serde_json::Value) -> String {
    use serde_json::Value;
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(_) => "a string".into(),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// Reads a string or an array of strings; anything else is `rule`, with what was
/// found (the error names the field itself, not one element of it).
fn string_or_strings<'de, D: Deserializer<'de>>(
    d: D,
    rule: &str,
) -> Result<StringOrStrings, D::Error> {
    struct V<'a>(&'a str);
    impl<'de> Visitor<'de> for V<'_> {
        type Value = StringOrStrings;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a string or an array of strings")
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<StringOrStrings, E> {
            Ok(StringOrStrings::One(v.to_string()))
        }
        fn visit_string<E: de::Error>(self, v: String) -> Result<StringOrStrings, E> {
            Ok(StringOrStrings::One(v))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<StringOrStrings, A::Error> {
            let mut out = Vec::new();
            while let Some(v) = a.next_element::<serde_json::Value>()? {
                match v {
                    serde_json::Value::String(s) => out.push(s),
                    other => {
                        return Err(field_rule(format!(
                            "{} (element {} is {})",
                            self.0,
                            out.len(),
                            json_kind(&other)
                        )))
                    }
                }
            }
            Ok(StringOrStrings::Many(out))
        }
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<StringOrStrings, E> {
            Err(field_rule(format!("{} (got the boolean {v})", self.0)))
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<StringOrStrings, E> {
            Err(field_rule(format!("{} (got the number {v})", self.0)))
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<StringOrStrings, E> {
            Err(field_rule(format!("{} (got the number {v})", self.0)))
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<StringOrStrings, E> {
            Err(field_rule(format!("{} (got the number {v})", self.0)))
        }
        fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<StringOrStrings, A::Error> {
            Err(field_rule(format!("{} (got an object)", self.0)))
        }
    }
    d.deserialize_any(V(rule))
}
