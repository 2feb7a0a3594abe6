//! Tool calling on chat completions: `tools`, `tool_choice`, `parallel_tool_calls`,
//! assistant `tool_calls` and `tool` messages in the conversation, and calls parsed
//! from the model's output into `message.tool_calls`.
//!
//! * **Format** (Qwen's): a call is `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`
//!   in the generated text; several calls follow each other, one per line.
//! * **Rendering**: a chat template that reads `tools` (Qwen's do) gets the tool
//!   objects and the messages with their `tool_calls` (arguments as JSON objects) and
//!   `tool_call_id`; for any other template the server writes the tool list into the
//!   system message itself ([`tools_text`]), assistant calls in the format above, and
//!   tool results as user turns wrapped in `<tool_response>` tags.
//! * **Caching**: the tool list is cut into a segment of its own (after the system
//!   prompt's text), so the same tool list across requests is a segment hit whatever
//!   the rest of the conversation.
//! * **Choice**: `auto` lets the model decide and parses what it wrote (a malformed
//!   block stays text); `none` parses nothing; `required` and a named function are
//!   enforced with a grammar ([`ToolSet::grammar`]): the output is one call (or, with
//!   `parallel_tool_calls`, one or more) whose `arguments` match the function's
//!   `parameters` schema.
use crate::error::ApiError;
use llguidance::api::TopLevelGrammar;
use serde_json::{json, Value};

/// Opening tag of a tool call in the generated text.
pub const CALL_OPEN: &str = "<tool_call>";
/// Closing tag of a tool call.
pub const CALL_CLOSE: &str = "</tool_call>";
/// Most tools per request (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq)]
pub enum Choice {
    /// Never call a tool; output is not parsed.
    None,
    /// The model decides.
    Auto,
    /// At least one call, enforced.
    Required,
    /// A call of this function, enforced.
    Named(String),
}

/// The validated tools of a request.
#[derive(Clone, Debug)]
pub struct ToolSet {
    /// The tool objects as given (`{"type": "function", "function": {...}}`).
    pub tools: Vec<Value>,
    /// Function names, in order.
    pub names: Vec<String>,
    /// `tool_choice`.
    pub choice: Choice,
    /// `parallel_tool_calls` (default true).
    pub parallel: bool,
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

impl ToolSet {
    /// Validates `tools`, `tool_choice` and `parallel_tool_calls`; `None` when the
    /// request has no tools (a `tool_choice` other than `none`/`auto` then is a 400).
    ///
    /// Errors: 400 naming the field (`tools[i].type`, `tools[i].function.name`, a
    /// duplicate name, `parameters` not an object, too many tools, an unknown or
    /// malformed `tool_choice`, a named function that is not in `tools`).
    pub fn parse(
        tools: Option<&Value>,
        choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Option<ToolSet>, ApiError> {
        let list = match tools {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) => Some(a),
            Some(_) => return Err(ApiError::invalid_param("tools", "'tools' must be an array")),
        };
        let choice = parse_choice(choice)?;
        let Some(list) = list.filter(|l| !l.is_empty()) else {
            return match choice {
                Choice::Required | Choice::Named(_) => Err(ApiError::invalid_param(
                    "tool_choice",
                    "tool_choice asks for a tool call but the request has no 'tools'",
                )),
                _ => Ok(None),
            };
        };
        if list.len() > MAX_TOOLS {
            return Err(ApiError::invalid_param(
                "tools",
                format!("at most {MAX_TOOLS} tools per request"),
            ));
        }
        let mut names = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::invalid_param(
                    &format!("tools[{i}].type"),
                    "only tools of type \"function\" are supported",
                ));
            }
            let f = t.get("function").filter(|f| f.is_object()).ok_or_else(|| {
                ApiError::invalid_param(
                    &format!("tools[{i}].function"),
                    "a function tool needs a 'function' object",
                )
            })?;
            let name = f.get("name").and_then(Value::as_str).unwrap_or("");
            if !valid_name(name) {
                return Err(ApiError::invalid_param(
                    &format!("tools[{i}].function.name"),
                    "a function name is 1 to 64 characters of a-z, A-Z, 0-9, '_' and '-'",
                ));
            }
            if names.iter().any(|n| n == name) {
                return Err(ApiError::invalid_param(
                    &format!("tools[{i}].function.name"),
                    format!("two tools are named {name:?}"),
                ));
            }
            match f.get("parameters") {
                None | Some(Value::Object(_)) => {}
                Some(_) => {
                    return Err(ApiError::invalid_param(
                        &format!("tools[{i}].function.parameters"),
                        "'parameters' must be a JSON Schema object",
                    ))
                }
            }
            names.push(name.to_string());
        }
        if let Choice::Named(n) = &choice {
            if !names.contains(n) {
                return Err(ApiError::invalid_param(
                    "tool_choice.function.name",
                    format!("tool_choice names {n:?}, which is not in 'tools'"),
                ));
            }
        }
        Ok(Some(ToolSet {
            tools: list.clone(),
            names,
            choice,
            parallel: parallel.unwrap_or(true),
        }))
    }

    /// Whether the output is parsed for calls.
    pub fn parses(&self) -> bool {
        self.choice != Choice::None
    }

    /// The grammar that enforces `required` / a named function: one call (more with
    /// `parallel_tool_calls`), each `{"name": <one of the allowed>, "arguments":
    /// <that function's parameters>}`. `None` for `auto` and `none`.
    pub fn grammar(&self) -> Option<TopLevelGrammar> {
        let allowed: Vec<&Value> = match &self.choice {
            Choice::None | Choice::Auto => return None,
            Choice::Required => self.tools.iter().collect(),
            Choice::Named(n) => self
                .tools
                .iter()
                .filter(|t| t["function"]["name"] == n.as_str())
                .collect(),
        };
        let alts: Vec<Value> = allowed
            .iter()
            .map(|t| {
                let f = &t["function"];
                let params = f
                    .get("parameters")
                    .cloned()
                    .unwrap_or_else(|| json!({"type": "object"}));
                json!({
                    "type": "object",
                    "properties": {"name": {"const": f["name"]}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": false
                })
            })
            .collect();
        let body = json!({
            "anyOf": alts,
            "x-guidance": {"whitespace_flexible": false, "item_separator": ", ",
                "key_separator": ": ", "lenient": true}
        });
        let start = if self.parallel {
            "start: call (\"\\n\" call)*"
        } else {
            "start: call"
        };
        let lark = format!(
            "{start}\ncall: {open} body {close}\nbody: %json {body}\n",
            open = serde_json::to_string(&format!("{CALL_OPEN}\n")).unwrap_or_default(),
            close = serde_json::to_string(&format!("\n{CALL_CLOSE}")).unwrap_or_default(),
        );
        Some(TopLevelGrammar::from_lark(lark))
    }
}

fn parse_choice(v: Option<&Value>) -> Result<Choice, ApiError> {
    let bad = || {
        ApiError::invalid_param(
            "tool_choice",
            "tool_choice is \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
        )
    };
    match v {
        None | Some(Value::Null) => Ok(Choice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(Choice::None),
            "auto" => Ok(Choice::Auto),
            "required" => Ok(Choice::Required),
            _ => Err(bad()),
        },
        Some(Value::Object(o)) => {
            if o.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad());
            }
            o.get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .map(|n| Choice::Named(n.to_string()))
                .ok_or_else(bad)
        }
        Some(_) => Err(bad()),
    }
}

/// The tool list as the server writes it into the system message for a template that
/// does not render tools: one JSON tool object per line inside `<tools>` tags, and how
/// to call one.
pub fn tools_text(tools: &[Value]) -> String {
    let mut s = String::from(
        "# Tools\n\nThese functions can be called; their signatures are listed inside \
         <tools></tools>, one JSON object per line:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&t.to_string());
    }
    s.push_str(
        "\n</tools>\n\nTo call one, write a JSON object with its name and its arguments \
         inside <tool_call></tool_call> tags, one block per call:\n<tool_call>\n\
         {\"name\": <function name>, \"arguments\": <arguments object>}\n</tool_call>",
    );
    s
}

/// One assistant call written in the output format (for a template that does not
/// render `tool_calls`). `arguments` is the object or the JSON text of one.
pub fn call_text(name: &str, arguments: &Value) -> String {
    let args = match arguments {
        Value::String(s) => serde_json::from_str::<Value>(s).unwrap_or(Value::String(s.clone())),
        v => v.clone(),
    };
    format!(
        "{CALL_OPEN}\n{}\n{CALL_CLOSE}",
        json!({"name": name, "arguments": args})
    )
}

/// A parsed call.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    /// Function name.
    pub name: String,
    /// Arguments as JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

impl Call {
    /// The `tool_calls` entry (`index` is the call's position, for stream deltas).
    pub fn to_json(&self, index: usize, id: &str) -> Value {
        json!({"index": index, "id": id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// Piece of generated text as the parser releases it.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    /// Ordinary content.
    Text(String),
    /// A complete, well-formed call.
    Call(Call),
}

/// Incremental parser of calls in generated text: text that could still be the start
/// of a call is held back until it is known.
#[derive(Debug, Default)]
pub struct CallParser {
    buf: String,
    /// A call just ended: a newline that follows separates calls and is dropped.
    after_call: bool,
}

/// The call in `block` (the text between the tags), if it is well-formed.
fn parse_block(block: &str) -> Option<Call> {
    let v: Value = serde_json::from_str(block.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments") {
        Some(Value::String(s)) => s.clone(),
        Some(a @ Value::Object(_)) => a.to_string(),
        None => "{}".into(),
        Some(_) => return None,
    };
    Some(Call { name, arguments })
}

impl CallParser {
    /// Feeds generated text; returns what can be released.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = vec![];
        loop {
            if self.after_call && !self.buf.is_empty() {
                // The newline between calls is part of the format, not content.
                if self.buf.starts_with('\n') {
                    self.buf.drain(..1);
                }
                self.after_call = false;
            }
            match self.buf.find(CALL_OPEN) {
                Some(start) => {
                    if start > 0 {
                        out.push(Piece::Text(self.buf[..start].to_string()));
                        self.buf.drain(..start);
                    }
                    let Some(end) = self.buf.find(CALL_CLOSE) else {
                        break; // inside a call: wait for its end
                    };
                    let block = &self.buf[CALL_OPEN.len()..end];
                    let all = self.buf[..end + CALL_CLOSE.len()].to_string();
                    match parse_block(block) {
                        Some(c) => {
                            out.push(Piece::Call(c));
                            self.after_call = true;
                        }
                        None => out.push(Piece::Text(all.clone())),
                    }
                    self.buf.drain(..all.len());
                }
                None => {
                    // Release all but a suffix that could begin the opening tag.
                    let keep = (1..CALL_OPEN.len())
                        .rev()
                        .find(|&k| self.buf.ends_with(&CALL_OPEN[..k]))
                        .unwrap_or(0);
                    let cut = self.buf.len() - keep;
                    if cut > 0 {
                        out.push(Piece::Text(self.buf[..cut].to_string()));
                        self.buf.drain(..cut);
                    }
                    break;
                }
            }
        }
        out
    }

    /// Releases what is held at the end of generation (an unfinished call is text).
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.buf);
        if rest.is_empty() {
            vec![]
        } else {
            vec![Piece::Text(rest)]
        }
    }
}

/// Splits a whole generated text into its content (`None` when only whitespace is
/// left) and its calls.
pub fn split_calls(text: &str) -> (Option<String>, Vec<Call>) {
    let mut p = CallParser::default();
    let mut pieces = p.push(text);
    pieces.extend(p.finish());
    let mut content = String::new();
    let mut calls = vec![];
    for x in pieces {
        match x {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(c) => calls.push(c),
        }
    }
    let content = if calls.is_empty() || !content.trim().is_empty() {
        Some(content)
    } else {
        None
    };
    (content, calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str) -> Value {
        json!({"type": "function", "function": {"name": name,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}})
    }

    #[test]
    fn parser_releases_text_holds_tag_prefixes_and_parses_calls_across_chunks() {
        let text = "Sure.<tool_call>\n{\"name\": \"get\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"put\", \"arguments\": \"{}\"}\n</tool_call>";
        // Every split into two chunks gives the same pieces, joined.
        for cut in (0..text.len()).filter(|&i| text.is_char_boundary(i)) {
            let mut p = CallParser::default();
            let mut v = p.push(&text[..cut]);
            v.extend(p.push(&text[cut..]));
            v.extend(p.finish());
            let mut txt = String::new();
            let mut calls = vec![];
            for x in v {
                match x {
                    Piece::Text(t) => txt.push_str(&t),
                    Piece::Call(c) => calls.push(c),
                }
            }
            assert_eq!(txt, "Sure.", "cut {cut}");
            assert_eq!(
                calls,
                vec![
                    Call {
                        name: "get".into(),
                        arguments: "{\"city\":\"Oslo\"}".into()
                    },
                    Call {
                        name: "put".into(),
                        arguments: "{}".into()
                    }
                ],
                "cut {cut}"
            );
        }
        // A "<" that does not become a tag is released once it cannot.
        let mut p = CallParser::default();
        assert_eq!(p.push("a <tool"), vec![Piece::Text("a ".into())]);
        assert_eq!(p.push("s>"), vec![Piece::Text("<tools>".into())]);
    }

    #[test]
    fn malformed_or_unfinished_calls_stay_text() {
        let (c, calls) = split_calls("<tool_call>\nnot json\n</tool_call>");
        assert!(calls.is_empty());
        assert_eq!(c.as_deref(), Some("<tool_call>\nnot json\n</tool_call>"));
        let (c, calls) = split_calls("x<tool_call>\n{\"name\": \"f\"");
        assert!(calls.is_empty());
        assert_eq!(c.as_deref(), Some("x<tool_call>\n{\"name\": \"f\""));
        let (c, calls) = split_calls("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>");
        assert_eq!(calls.len(), 1);
        assert_eq!(c, None);
    }

    #[test]
    fn tool_sets_validate_fields_by_name() {
        let ok = ToolSet::parse(Some(&json!([tool("a"), tool("b")])), None, None)
            .unwrap()
            .unwrap();
        assert_eq!(ok.names, vec!["a", "b"]);
        assert_eq!(ok.choice, Choice::Auto);
        assert!(ok.grammar().is_none());
        let named = json!({"type": "function", "function": {"name": "b"}});
        let t = ToolSet::parse(
            Some(&json!([tool("a"), tool("b")])),
            Some(&named),
            Some(false),
        )
        .unwrap()
        .unwrap();
        assert_eq!(t.choice, Choice::Named("b".into()));
        assert!(t.grammar().is_some());
        let cases: Vec<(Value, Option<Value>, &str)> = vec![
            (json!({"a": 1}), None, "tools"),
            (json!([{"type": "code"}]), None, "tools[0].type"),
            (json!([{"type": "function"}]), None, "tools[0].function"),
            (
                json!([tool("a"), tool("a b")]),
                None,
                "tools[1].function.name",
            ),
            (
                json!([tool("a"), tool("a")]),
                None,
                "tools[1].function.name",
            ),
            (
                json!([{"type": "function", "function": {"name": "a", "parameters": 3}}]),
                None,
                "tools[0].function.parameters",
            ),
            (json!([tool("a")]), Some(json!("sometimes")), "tool_choice"),
            (
                json!([tool("a")]),
                Some(json!({"type": "function", "function": {"name": "zz"}})),
                "tool_choice.function.name",
            ),
            (json!([]), Some(json!("required")), "tool_choice"),
        ];
        for (tools, choice, param) in cases {
            let e = ToolSet::parse(Some(&tools), choice.as_ref(), None).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{tools} {choice:?}");
        }
        let many: Vec<Value> = (0..=MAX_TOOLS).map(|i| tool(&format!("f{i}"))).collect();
        let e = ToolSet::parse(Some(&json!(many)), None, None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools"));
    }

    #[test]
    fn call_text_round_trips_through_the_parser() {
        let t = call_text("get", &json!("{\"city\": \"Oslo\"}"));
        let (c, calls) = split_calls(&t);
        assert_eq!(c, None);
        assert_eq!(calls[0].name, "get");
        let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert_eq!(args, json!({"city": "Oslo"}));
    }
}
