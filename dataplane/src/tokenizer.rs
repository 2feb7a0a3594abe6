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
        Ok(Tokenizer {
            inner,
            chat_template,
            bos_token,
            eos_token,
            eos_ids,
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
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        })
        .map_err(|e| Error::Tokenizer(format!("chat template: {e}")))
    }
}
