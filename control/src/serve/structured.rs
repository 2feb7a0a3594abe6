//! Structured output: `response_format` `json_object` / `json_schema` compiled to a
//! grammar with llguidance and enforced while decoding.
//!
//! The grammar compiler is built once per server from the model's tokenizer (a byte
//! trie over every token; special tokens can never be produced as text) on the first
//! request that needs it. Each request compiles its schema once ([`Grammars::compile`],
//! on the blocking pool); each of its sequences (`n > 1`) starts its own parser state
//! from the compiled grammar, so the constraint works within a batch and on both
//! backends (the scheduler samples every sequence on the host with
//! [`dataplane::sampling::Sampler`], which applies the mask after the logit processors).
//!
//! JSON is generated compactly (`", "` and `": "` separators, no other whitespace)
//! unless the schema sets llguidance's own `x-guidance` options. When the grammar is
//! complete only the model's end-of-sequence token is allowed, so a finished JSON value
//! ends the completion with `finish_reason: "stop"`; a completion cut by `max_tokens`
//! (`finish_reason: "length"`) can be incomplete JSON, as with OpenAI.
//!
//! Time and memory per request are bounded by llguidance's parser limits (grammar size,
//! lexer fuel per compile and per token, Earley items per token).
use super::types::ResponseFormat;
use crate::error::ApiError;
use dataplane::sampling::{Constraint, ConstraintSpec, TokenConstraint};
use dataplane::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex, OnceLock};

/// The per-server grammar compiler, built lazily from the tokenizer.
pub struct Grammars {
    tok: Arc<Tokenizer>,
    /// Rows of the model's logits (its vocabulary, which may exceed the tokenizer's).
    vocab: usize,
    factory: OnceLock<Result<Arc<ParserFactory>, String>>,
}

impl Grammars {
    /// A compiler for `tok`'s tokens over logits rows of `vocab` entries. Nothing is
    /// built until the first [`Grammars::compile`].
    pub fn new(tok: Arc<Tokenizer>, vocab: usize) -> Self {
        Grammars {
            tok,
            vocab,
            factory: OnceLock::new(),
        }
    }

    fn factory(&self) -> Result<Arc<ParserFactory>, String> {
        self.factory
            .get_or_init(|| build_factory(&self.tok, self.vocab).map(Arc::new))
            .clone()
    }

    /// The constraint of `format`, or `None` for `text`. Blocking (compiles the
    /// grammar): call it on the blocking pool.
    ///
    /// Errors (400 naming the field): an unknown `type`; `json_schema` without its
    /// `json_schema` object or with an invalid `name`; a schema the compiler rejects
    /// (its message). 500 when the tokenizer cannot be indexed.
    pub fn compile(&self, format: &ResponseFormat) -> Result<Option<Constraint>, ApiError> {
        let (schema, strict, describe) = match format.kind.as_str() {
            "text" => return Ok(None),
            "json_object" => (json!({"type": "object"}), false, "json_object".to_string()),
            "json_schema" => {
                let js = format.json_schema.as_ref().ok_or_else(|| {
                    ApiError::invalid_param(
                        "response_format.json_schema",
                        "response_format of type \"json_schema\" needs a 'json_schema' object",
                    )
                })?;
                check_name(&js.name)?;
                (
                    js.schema.clone().unwrap_or_else(|| json!({})),
                    js.strict.unwrap_or(false),
                    format!("json_schema {:?}", js.name),
                )
            }
            other => {
                return Err(ApiError::invalid_param(
                    "response_format.type",
                    format!(
                        "response_format type {other:?} is not one of \"text\", \"json_object\", \"json_schema\""
                    ),
                ))
            }
        };
        let param = if format.kind == "json_schema" {
            "response_format.json_schema.schema"
        } else {
            "response_format"
        };
        if !schema.is_object() && !schema.is_boolean() {
            return Err(ApiError::invalid_param(
                param,
                "the schema must be a JSON object (or a boolean schema)",
            ));
        }
        let g = TopLevelGrammar::from_json_schema(with_options(schema, strict));
        self.compile_grammar(g, describe, param).map(Some)
    }

    /// The constraint of an llguidance grammar (e.g. the forced tool call of
    /// `tools::ToolSet::grammar`). Blocking.
    ///
    /// Errors: 400 naming `param` when the grammar does not compile; 500 when the
    /// tokenizer cannot be indexed.
    pub fn compile_grammar(
        &self,
        grammar: TopLevelGrammar,
        describe: String,
        param: &str,
    ) -> Result<Constraint, ApiError> {
        let factory = self.factory().map_err(ApiError::internal)?;
        let parser = factory.create_parser(grammar).map_err(|e| {
            ApiError::invalid_param(param, format!("the schema cannot be enforced: {e}"))
        })?;
        Ok(Constraint(Arc::new(Compiled {
            parser: Mutex::new(parser),
            describe,
        })))
    }
}

/// OpenAI's rule for a format name.
fn check_name(name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid_param(
            "response_format.json_schema.name",
            "the name must be 1 to 64 characters of a-z, A-Z, 0-9, '_' and '-'",
        ))
    }
}

/// The schema with llguidance's compile options (`x-guidance`): compact separators,
/// no free whitespace, and `lenient` (unsupported keywords ignored) unless `strict`.
/// Options the schema sets itself are kept.
fn with_options(schema: Value, strict: bool) -> Value {
    let mut opts = json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
        "lenient": !strict,
    });
    match schema {
        Value::Object(mut m) => {
            if let Some(Value::Object(user)) = m.get("x-guidance") {
                for (k, v) in user {
                    opts[k] = v.clone();
                }
            }
            m.insert("x-guidance".into(), opts);
            Value::Object(m)
        }
        // `true`: any value; `false`: nothing (the compiler reports it).
        Value::Bool(true) => json!({ "x-guidance": opts }),
        other => other,
    }
}

/// The token trie of `tok` over `vocab` rows, its end-of-sequence token being the
/// tokenizer's first stop token, and the grammar compiler over it.
fn build_factory(tok: &Tokenizer, vocab: usize) -> Result<ParserFactory, String> {
    let text = tok.to_json().map_err(|e| e.to_string())?;
    let value: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let mut words = llguidance::token_bytes_from_tokenizer_json(&value)
        .map_err(|e| format!("indexing the tokenizer for structured output: {e}"))?;
    if words.len() > vocab {
        return Err(format!(
            "the tokenizer has {} tokens, more than the model's {vocab} logits",
            words.len()
        ));
    }
    // Rows without a token (padding of the embedding) can never be produced.
    words.resize(vocab, Vec::new());
    let eos = *tok
        .eos_ids
        .first()
        .ok_or("structured output needs an end-of-sequence token; the tokenizer has none")?;
    let mut info = TokRxInfo::new(vocab as u32, eos);
    info.tok_end_of_turn = tok.eos_ids.get(1).copied();
    let trie = TokTrie::from(&info, &words);
    let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
    let mut f = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
    f.quiet();
    Ok(f)
}

/// A compiled grammar; each sequence starts from a copy of its initial state.
struct Compiled {
    parser: Mutex<TokenParser>,
    describe: String,
}

impl ConstraintSpec for Compiled {
    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn start(&self) -> Result<Box<dyn TokenConstraint>, String> {
        let p = self
            .parser
            .lock()
            .map_err(|_| "the grammar's lock is poisoned".to_string())?
            .deep_clone();
        let m = Matcher::new(Ok(p));
        if let Some(e) = m.get_error() {
            return Err(e);
        }
        Ok(Box::new(Live(m)))
    }
}

/// One sequence's parser state.
struct Live(Matcher);

impl TokenConstraint for Live {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let allowed = self.0.compute_mask_or_eos().map_err(|e| e.to_string())?;
        let n = allowed.len();
        for (i, l) in logits.iter_mut().enumerate() {
            if i >= n || !allowed.is_allowed(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<(), String> {
        if self.0.is_stopped() {
            // The grammar is complete; the end-of-sequence token ends the sequence.
            return Ok(());
        }
        self.0.consume_token(token).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::types::JsonSchemaFormat;
    use std::path::PathBuf;

    fn grammars() -> Grammars {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/hypic-tiny");
        let tok = Tokenizer::from_dir(&dir).unwrap();
        Grammars::new(Arc::new(tok), 4096)
    }

    fn schema_format(schema: Value) -> ResponseFormat {
        ResponseFormat {
            kind: "json_schema".into(),
            json_schema: Some(JsonSchemaFormat {
                name: "t".into(),
                description: None,
                schema: Some(schema),
                strict: Some(true),
            }),
        }
    }

    /// Greedy decoding of a constrained "model" whose logits prefer token ids in a
    /// fixed pseudo-random order (and the ids in `boost` above that): whatever it
    /// prefers, the text must parse and match.
    fn drive(g: &Grammars, c: &Constraint, seed: u64, boost: &[u32]) -> String {
        let mut st = c.0.start().unwrap();
        let eos = g.tok.eos_ids[0];
        let mut out = vec![];
        let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        for _ in 0..400 {
            let mut row: Vec<f32> = (0..4096)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (x >> 40) as f32 / (1u64 << 24) as f32
                })
                .collect();
            for &b in boost {
                row[b as usize] = 1.5;
            }
            // Prefer ending once allowed, so values stay short.
            row[eos as usize] = 2.0;
            st.mask(&mut row).unwrap();
            let t = dataplane::sampling::argmax(&row);
            assert!(row[t as usize].is_finite(), "nothing allowed");
            st.commit(t).unwrap();
            if t == eos {
                return g.tok.decode(&out).unwrap();
            }
            out.push(t);
        }
        panic!("no end within 400 tokens: {:?}", g.tok.decode(&out));
    }

    #[test]
    fn json_schema_output_parses_and_has_the_required_fields() {
        let g = grammars();
        let schema = json!({
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
                "rain": {"type": "boolean"}
            },
            "required": ["city", "days", "rain"],
            "additionalProperties": false
        });
        let c = g.compile(&schema_format(schema)).unwrap().unwrap();
        for seed in 0..4 {
            let text = drive(&g, &c, seed, &[]);
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            assert!(v["city"].as_str().unwrap().chars().count() <= 12, "{text}");
            let d = v["days"].as_i64().unwrap();
            assert!((1..=9).contains(&d), "{text}");
            assert!(v["rain"].is_boolean(), "{text}");
            assert_eq!(v.as_object().unwrap().len(), 3, "{text}");
        }
    }

    #[test]
    fn json_object_output_is_an_object() {
        let g = grammars();
        let f = ResponseFormat {
            kind: "json_object".into(),
            json_schema: None,
        };
        let c = g.compile(&f).unwrap().unwrap();
        // Free strings are unbounded: a model that likes closing quotes and braces
        // ends them (what it writes in between is still up to the grammar).
        let closers: Vec<u32> = (0..4000u32)
            .filter(|&t| {
                let s = g.tok.decode(&[t]).unwrap();
                s == "\"" || s == "}" || s == "\":"
            })
            .collect();
        assert!(!closers.is_empty());
        let text = drive(&g, &c, 9, &closers);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v.is_object(), "{text}");
    }

    #[test]
    fn bad_formats_are_400_naming_the_field() {
        let g = grammars();
        let text = ResponseFormat {
            kind: "text".into(),
            json_schema: None,
        };
        assert!(g.compile(&text).unwrap().is_none());
        let e = g
            .compile(&ResponseFormat {
                kind: "yaml".into(),
                json_schema: None,
            })
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format.type"));
        let e = g
            .compile(&ResponseFormat {
                kind: "json_schema".into(),
                json_schema: None,
            })
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format.json_schema"));
        let mut f = schema_format(json!({"type": "object"}));
        f.json_schema.as_mut().unwrap().name = "no spaces allowed".into();
        assert_eq!(
            g.compile(&f).unwrap_err().param.as_deref(),
            Some("response_format.json_schema.name")
        );
        // Not a schema, and a schema no value satisfies.
        for bad in [
            json!(7),
            json!({"type": "integer", "minimum": 5, "maximum": 1}),
        ] {
            let e = g.compile(&schema_format(bad.clone())).unwrap_err();
            assert_eq!(
                e.param.as_deref(),
                Some("response_format.json_schema.schema"),
                "{bad}"
            );
            assert_eq!(e.status, 400);
        }
    }

    #[test]
    fn strict_rejects_unknown_keywords_and_lenient_ignores_them() {
        let g = grammars();
        let schema = json!({"type": "string", "format": "no-such-format-anywhere"});
        let mut f = schema_format(schema);
        assert!(g.compile(&f).is_err());
        f.json_schema.as_mut().unwrap().strict = Some(false);
        assert!(g.compile(&f).unwrap().is_some());
    }
}
