//! Tokenizer (`tokenizer.json` through the `tokenizers` crate) and chat template
//! (`tokenizer_config.json` → `chat_template`, rendered with minijinja).
use crate::error::{io_err, Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One chat message.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Message text.
    pub content: String,
}

/// A model's tokenizer plus its chat template and special tokens.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Token ids that end generation (from generation_config.json `eos_token_id`, else
    /// tokenizer_config.json `eos_token`).
    pub eos_ids: Vec<u32>,
    max_bytes_per_token: Option<usize>,
}

/// Longest UTF-8 input one token can stand for, relative to the normalised text:
/// NFC, NFD, NFKC and NFKD shrink a text by at most this factor (the largest
/// shrink of one character or of a canonical or compatibility decomposition is
/// 4 bytes to 1, e.g. U+107A5 to `q` under NFKC; NFC's is 3, e.g. U+212A to `K`).
pub const NORMALIZER_SHRINK: usize = 4;

/// Texts longer than this (bytes) are counted in pieces of about this size by
/// [`Tokenizer::encode_within`] before they are tokenised whole.
pub const PIECE_BYTES: usize = 64 << 10;

/// Tokens one cut between two pieces may add to their summed count (a cut falls
/// before a space that separates two words: a pre-token boundary of byte-level
/// BPE, where the count does not change).
const CUT_SLACK: usize = 4;

/// What [`Tokenizer::encode_within`] found.
#[derive(Clone, Debug, PartialEq)]
pub enum Bounded {
    /// The text's ids (at most the limit), exactly as [`Tokenizer::encode`] gives them.
    Fits(Vec<u32>),
    /// The text has more tokens than the limit.
    Over {
        /// A lower bound on its token count (above the limit).
        at_least: usize,
        /// False when the text was refused from its length alone, before any
        /// tokenisation.
        tokenised: bool,
    },
}

/// Factor by which a normaliser (serialised as tokenizer.json writes it) can shrink
/// a text, or `None` when it is not bounded (or not known).
fn shrink_factor(n: &serde_json::Value) -> Option<usize> {
    match n.get("type")?.as_str()? {
        "NFC" | "NFD" | "NFKC" | "NFKD" => Some(NORMALIZER_SHRINK),
        // Grow the text or map one byte to one character.
        "Prepend" | "ByteLevel" => Some(1),
        "Sequence" => n
            .get("normalizers")?
            .as_array()?
            .iter()
            .try_fold(1usize, |f, m| shrink_factor(m).map(|g| f.saturating_mul(g))),
        _ => None,
    }
}

/// Most input bytes one token can stand for, when the tokenizer bounds it: a BPE
/// model whose unknown characters do not fuse, a normaliser of known shrink, then
/// the longest vocabulary or added token. `None` otherwise (WordPiece, Unigram and
/// WordLevel map a whole unknown word to one token).
fn bytes_per_token_bound(t: &tokenizers::Tokenizer) -> Option<usize> {
    match t.get_model() {
        tokenizers::ModelWrapper::BPE(b) if !(b.unk_token.is_some() && b.fuse_unk) => {}
        _ => return None,
    }
    let shrink = match t.get_normalizer() {
        None => 1,
        Some(n) => shrink_factor(&serde_json::to_value(n).ok()?)?,
    };
    // A vocabulary string is at least as long in UTF-8 as the bytes it stands for
    // (byte-level BPE writes each byte as one character; `<0xNN>` byte tokens and
    // `▁` are longer than what they stand for).
    let longest_model = t
        .get_vocab(false)
        .keys()
        .map(|k| k.len())
        .max()
        .unwrap_or(1)
        .max(1);
    // Added tokens match the raw text, before normalisation.
    let longest_added = t
        .get_added_tokens_decoder()
        .values()
        .map(|a| a.content.len())
        .max()
        .unwrap_or(0);
    Some(longest_added.max(longest_model).saturating_mul(shrink))
}

/// End of the next piece of `text` (at most `max` bytes, unless one character is
/// longer): before the last space in the piece's second half that follows a
/// non-space and precedes a non-space; else the last character boundary.
fn piece_end(text: &str, max: usize) -> usize {
    if text.len() <= max {
        return text.len();
    }
    let b = text.as_bytes();
    let ws = |c: u8| c.is_ascii_whitespace();
    for p in (max / 2..max).rev() {
        if b[p] == b' ' && p > 0 && !ws(b[p - 1]) && p + 1 < b.len() && !ws(b[p + 1]) {
            return p;
        }
    }
    let mut p = max;
    while p > 0 && !text.is_char_boundary(p) {
        p -= 1;
    }
    if p == 0 {
        // Unreachable for `max >= 4`; keeps the loop moving otherwise.
        p = text
            .char_indices()
            .nth(1)
            .map(|(i, _)| i)
            .unwrap_or(text.len());
    }
    p
}

fn token_str(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(String::from),
        _ => None,
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`, and, when present, `tokenizer_config.json` (chat
    /// template, bos/eos strings) and `generation_config.json` (eos ids).
    ///
    /// Errors: missing or unparsable tokenizer.json, invalid JSON in the config files.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(Error::Io {
                path,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "tokenizer.json not found",
                ),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let read_json = |name: &str| -> Result<Option<serde_json::Value>> {
            let p = dir.join(name);
            if !p.exists() {
                return Ok(None);
            }
            let text = std::fs::read_to_string(&p).map_err(io_err(&p))?;
            serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| Error::Json {
                    path: p,
                    msg: e.to_string(),
                })
        };
        let tc = read_json("tokenizer_config.json")?;
        let gc = read_json("generation_config.json")?;
        let mut chat_template = None;
        let mut bos_token = None;
        let mut eos_token = None;
        if let Some(tc) = &tc {
            chat_template = match tc.get("chat_template") {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(a)) => a
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .or_else(|| a.first())
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(String::from),
                _ => None,
            };
            bos_token = token_str(tc.get("bos_token"));
            eos_token = token_str(tc.get("eos_token"));
        }
        if chat_template.is_none() {
            let p = dir.join("chat_template.jinja");
            if p.exists() {
                chat_template = Some(std::fs::read_to_string(&p).map_err(io_err(&p))?);
            }
        }
        let mut eos_ids: Vec<u32> = match gc.as_ref().and_then(|g| g.get("eos_token_id")) {
            Some(serde_json::Value::Number(n)) => {
                n.as_u64().map(|x| vec![x as u32]).unwrap_or_default()
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect(),
            _ => vec![],
        };
        if eos_ids.is_empty() {
            if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
                eos_ids.push(id);
            }
        }
        let max_bytes_per_token = bytes_per_token_bound(&inner);
        Ok(Tokenizer {
            inner,
            chat_template,
            bos_token,
            eos_token,
            eos_ids,
            max_bytes_per_token,
        })
    }

    /// Most bytes of input text one token can stand for, when this tokenizer bounds
    /// it (byte-level or byte-fallback BPE: the longest token in bytes times the
    /// normaliser's largest shrink, [`NORMALIZER_SHRINK`]; or the longest added
    /// token). A text of more than `limit ×` this many bytes has more than `limit`
    /// tokens. `None` for tokenizers that map a whole unknown word to one token.
    pub fn max_bytes_per_token(&self) -> Option<usize> {
        self.max_bytes_per_token
    }

    /// Encodes `text` when it has at most `limit` tokens, with memory bounded by
    /// the text's size only when it can fit:
    ///
    /// 1. a text of more than `limit × max_bytes_per_token()` bytes is refused
    ///    without tokenising;
    /// 2. a text longer than [`PIECE_BYTES`] is first counted in pieces of about
    ///    that size, cut before a space between two words (a pre-token boundary of
    ///    byte-level BPE; elsewhere at a character boundary), stopping as soon as
    ///    the count passes `limit` (allowing a few tokens per cut);
    /// 3. a text that may fit is encoded whole, so its ids are exactly
    ///    [`Tokenizer::encode`]'s.
    ///
    /// Errors: as [`Tokenizer::encode`].
    pub fn encode_within(&self, text: &str, limit: usize) -> Result<Bounded> {
        if let Some(b) = self.max_bytes_per_token {
            if text.len() > limit.saturating_mul(b) {
                return Ok(Bounded::Over {
                    at_least: text.len().div_ceil(b),
                    tokenised: false,
                });
            }
        }
        if text.len() > PIECE_BYTES {
            let (mut count, mut cuts, mut rest) = (0usize, 0usize, text);
            while !rest.is_empty() {
                let end = piece_end(rest, PIECE_BYTES);
                count += self.encode(&rest[..end])?.len();
                rest = &rest[end..];
                let slack = cuts * CUT_SLACK;
                if count > limit + slack {
                    return Ok(Bounded::Over {
                        at_least: count - slack,
                        tokenised: true,
                    });
                }
                cuts += usize::from(!rest.is_empty());
            }
        }
        let ids = self.encode(text)?;
        Ok(if ids.len() > limit {
            Bounded::Over {
                at_least: ids.len(),
                tokenised: true,
            }
        } else {
            Bounded::Fits(ids)
        })
    }

    /// Encodes text without adding special tokens beyond what the text contains.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The tokenizer serialised as `tokenizer.json` is written (vocabulary, merges,
    /// added tokens, pre-tokeniser and decoder), for libraries that read that format
    /// (e.g. a constrained-decoding library building its token trie).
    ///
    /// Errors: serialisation failed.
    pub fn to_json(&self) -> Result<String> {
        self.inner
            .to_string(false)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Id of a token string, if it exists.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// True when a chat template is available.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders the chat template (HF `apply_chat_template(tokenize=False)`).
    ///
    /// Errors: no chat template, template syntax/runtime error, empty message list.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let msgs: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
            .collect();
        self.apply_chat_template_with(&msgs, None, add_generation_prompt)
    }

    /// True when the chat template reads a `tools` variable (renders tool
    /// specifications itself, as the Qwen templates do).
    pub fn template_renders_tools(&self) -> bool {
        self.chat_template
            .as_deref()
            .is_some_and(|t| t.contains("tools"))
    }

    /// Renders messages given as JSON objects (`role`, `content` and whatever else the
    /// template reads, e.g. `tool_calls` with `function.arguments` as an object, or
    /// `tool_call_id`) with `tools` (the OpenAI tool objects) in the context when given.
    ///
    /// Errors: no template, an empty message list, a template error.
    pub fn apply_chat_template_with(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tpl = self.chat_template.as_deref().ok_or_else(|| {
            Error::Tokenizer("the model has no chat_template in tokenizer_config.json".into())
        })?;
        if messages.is_empty() {
            return Err(Error::Input("empty message list".into()));
        }
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", tpl)
            .map_err(|e| Error::Tokenizer(format!("chat template: {e}")))?;
        let t = env
            .get_template("chat")
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        t.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        })
        .map_err(|e| Error::Tokenizer(format!("chat template: {e}")))
    }
}

/// Tokens after the last released text beyond which a trailing U+FFFD is taken as
/// final (a UTF-8 character is at most 4 bytes, so an incomplete one spans at most
/// 3 byte-level tokens; the margin covers skipped special tokens).
const MAX_PENDING: usize = 8;

/// Incremental detokeniser of one generated sequence.
///
/// Each token decodes only a short window of recent ids: the ids of the last
/// released piece (the prefix, so that decoders which treat a leading space or
/// word start specially see the same context) and the ids not yet released. Text
/// is released only when the window's decoding grows past the prefix's and does
/// not end in U+FFFD, i.e. when no character is split across tokens still to come
/// (byte-level BPE splits CJK characters and emoji over several tokens). The
/// released pieces concatenate to [`Tokenizer::decode`] of all the ids.
#[derive(Clone, Debug, Default)]
pub struct DecodeStream {
    /// Ids from the start of the prefix window.
    ids: Vec<u32>,
    /// Ids of the prefix window (`ids[..read]`); the rest are not released yet.
    read: usize,
}

impl DecodeStream {
    /// An empty stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token; returns the text it completes (empty while a character is
    /// still incomplete).
    ///
    /// Errors: as [`Tokenizer::decode`].
    pub fn step(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[..self.read])?;
        let text = tok.decode(&self.ids)?;
        let pending = self.ids.len() - self.read;
        if text.len() <= prefix.len() || (text.ends_with('\u{FFFD}') && pending < MAX_PENDING) {
            return Ok(String::new());
        }
        Ok(self.release(&prefix, text))
    }

    /// The sequence is over: releases what is held back (an incomplete character
    /// becomes U+FFFD, as [`Tokenizer::decode`] writes it).
    ///
    /// Errors: as [`Tokenizer::decode`].
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        let prefix = tok.decode(&self.ids[..self.read])?;
        let text = tok.decode(&self.ids)?;
        if text.len() <= prefix.len() {
            return Ok(String::new());
        }
        Ok(self.release(&prefix, text))
    }

    /// Releases `text` past `prefix`; the released ids become the next prefix.
    fn release(&mut self, prefix: &str, text: String) -> String {
        let delta = match text.strip_prefix(prefix) {
            Some(d) => d.to_string(),
            None => {
                // Not prefix-stable (a decoder that rewrites across tokens): release
                // from the first character boundary at or after the prefix's length.
                let mut at = prefix.len();
                while !text.is_char_boundary(at) {
                    at += 1;
                }
                text[at..].to_string()
            }
        };
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        delta
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::normalizers::{NFC, NFD, NFKC, NFKD};
    use tokenizers::{NormalizedString, Normalizer};

    fn bundled() -> Tokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/hypic-tiny");
        Tokenizer::from_dir(&dir).expect("bundled tokenizer")
    }

    /// English, CJK, emoji, combining marks, digits, punctuation and newlines.
    fn mixed_text(bytes: usize) -> String {
        let words = [
            "the",
            "headquarters",
            "of",
            "a",
            "birdwatching",
            "club,",
            "你好世界",
            "🙂👍🏽",
            "naïve",
            "cafe\u{301}",
            "2024-11-29:",
            "x\ny",
            "(tab\there)",
            "日本語のテキスト",
            "don't",
            "  spaced",
            "end.\n\n",
        ];
        let mut s = String::new();
        let mut i = 0usize;
        while s.len() < bytes {
            s.push_str(words[(i * 7 + i / 3) % words.len()]);
            s.push(' ');
            i += 1;
        }
        s
    }

    #[test]
    fn the_bundled_tokenizer_bounds_bytes_per_token() {
        // The longest token is "Ġheadquartered" (15 UTF-8 bytes), NFC normaliser.
        assert_eq!(
            bundled().max_bytes_per_token(),
            Some(15 * NORMALIZER_SHRINK)
        );
    }

    /// Unicode normalisation shrinks no character, and no decomposition, by more
    /// than [`NORMALIZER_SHRINK`]: the bound behind `max_bytes_per_token`.
    #[test]
    fn normalisation_shrinks_by_at_most_the_stated_factor() {
        fn norm(n: &dyn Normalizer, s: &str) -> String {
            let mut ns = NormalizedString::from(s);
            n.normalize(&mut ns).unwrap();
            ns.get().to_string()
        }
        let forms: [&dyn Normalizer; 4] = [&NFC, &NFD, &NFKC, &NFKD];
        let mut worst = (0usize, 1usize, '\0');
        // Planes 4 to 13 are unassigned and 15 and 16 private use: nothing there
        // normalises to anything else.
        let assigned = (0..0x4_0000u32).chain(0xE_0000..0xF_0000);
        for c in assigned.filter_map(char::from_u32) {
            let one = c.to_string();
            let nfkd = norm(&NFKD, &one);
            if nfkd == one {
                // No decomposition: every form leaves the character as it is.
                continue;
            }
            for src in [one.clone(), norm(&NFD, &one), nfkd] {
                for f in forms {
                    let out = norm(f, &src).len().max(1);
                    if src.len() * worst.1 > worst.0 * out {
                        worst = (src.len(), out, c);
                    }
                }
            }
        }
        assert!(
            worst.0 <= NORMALIZER_SHRINK * worst.1,
            "{:?}: {} bytes normalise to {}",
            worst.2,
            worst.0,
            worst.1
        );
        assert_eq!(worst.0, NORMALIZER_SHRINK * worst.1, "the factor is tight");
    }

    #[test]
    fn pieces_cut_at_pre_token_boundaries_give_the_same_tokens() {
        let t = bundled();
        let text = mixed_text(300 << 10);
        let whole = t.encode(&text).unwrap();
        let (mut rest, mut joined, mut cuts) = (text.as_str(), vec![], 0);
        while !rest.is_empty() {
            let end = piece_end(rest, PIECE_BYTES);
            assert!(end <= PIECE_BYTES && end > 0);
            joined.extend(t.encode(&rest[..end]).unwrap());
            rest = &rest[end..];
            cuts += 1;
        }
        assert!(cuts >= 4, "{cuts} pieces");
        assert_eq!(joined, whole);
    }

    #[test]
    fn encode_within_gives_encode_s_ids_when_the_text_fits() {
        let t = bundled();
        for text in [
            String::new(),
            "你好，世界 🙂".to_string(),
            mixed_text(1000),
            mixed_text(200 << 10),
        ] {
            let ids = t.encode(&text).unwrap();
            assert_eq!(
                t.encode_within(&text, ids.len()).unwrap(),
                Bounded::Fits(ids.clone())
            );
            if !ids.is_empty() {
                assert_eq!(
                    t.encode_within(&text, ids.len() - 1).unwrap(),
                    Bounded::Over {
                        at_least: ids.len(),
                        tokenised: true
                    },
                    "{} bytes",
                    text.len()
                );
            }
        }
    }

    #[test]
    fn encode_within_refuses_long_text_early() {
        let t = bundled();
        let b = t.max_bytes_per_token().unwrap();
        // Past limit × bytes per token: refused from the length alone, at once.
        let huge = "a".repeat(16 << 20);
        let t0 = std::time::Instant::now();
        assert_eq!(
            t.encode_within(&huge, 16384).unwrap(),
            Bounded::Over {
                at_least: (16usize << 20).div_ceil(b),
                tokenised: false
            }
        );
        assert!(t0.elapsed().as_millis() < 100);
        // Under that bound but over the limit: counted in pieces, stopped early.
        let text = mixed_text(16384 * b - 1);
        match t.encode_within(&text, 16384).unwrap() {
            Bounded::Over {
                at_least,
                tokenised: true,
            } => assert!((16384..=16384 + 2 * PIECE_BYTES).contains(&at_least)),
            other => panic!("{other:?}"),
        }
    }

    /// Pieces a stream of `ids` releases, in order, and the final flush.
    fn stream(t: &Tokenizer, ids: &[u32]) -> Vec<String> {
        let mut d = DecodeStream::new();
        let mut out: Vec<String> = ids.iter().map(|&i| d.step(t, i).unwrap()).collect();
        out.push(d.flush(t).unwrap());
        out
    }

    #[test]
    fn streamed_cjk_and_emoji_concatenate_to_the_full_decode() {
        let t = bundled();
        let text = "你好，世界！🙂👍🏽 naïve café: 日本語のテキスト, 한국어 ok.";
        let ids = t.encode(text).unwrap();
        // The tokenizer is byte-level: some characters span several tokens, whose
        // lone decodings hold U+FFFD.
        let split = ids
            .iter()
            .filter(|&&i| t.decode(&[i]).unwrap().contains('\u{FFFD}'))
            .count();
        assert!(split >= 4, "{split} tokens hold part of a character");
        let pieces = stream(&t, &ids);
        assert_eq!(pieces.concat(), t.decode(&ids).unwrap());
        assert_eq!(pieces.concat(), text);
        for p in &pieces {
            assert!(!p.contains('\u{FFFD}'), "{pieces:?}");
        }
        // Every character is released by the token that completes it.
        let mut done = String::new();
        for (k, p) in pieces[..ids.len()].iter().enumerate() {
            done.push_str(p);
            let full = t.decode(&ids[..=k]).unwrap();
            assert_eq!(done, full.trim_end_matches('\u{FFFD}'), "after token {k}");
        }
    }

    #[test]
    fn a_sequence_ending_mid_character_flushes_a_replacement_char() {
        let t = bundled();
        let ids = t.encode("ok 🙂").unwrap();
        let cut = &ids[..ids.len() - 1];
        let full = t.decode(cut).unwrap();
        assert!(full.ends_with('\u{FFFD}'), "{full:?}");
        let pieces = stream(&t, cut);
        assert_eq!(pieces.concat(), full);
        // Bytes that never form a character are released once more tokens follow.
        let bad: Vec<u32> = std::iter::repeat_n(cut[cut.len() - 1], 12).collect();
        let pieces = stream(&t, &bad);
        assert_eq!(pieces.concat(), t.decode(&bad).unwrap());
        assert!(!pieces[..bad.len()].concat().is_empty(), "{pieces:?}");
    }
}
