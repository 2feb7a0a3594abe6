//! From request bodies to PIC segments.
//!
//! * Chat: the chat template is rendered for the whole conversation (with the
//!   generation prompt) and cut at message boundaries, found by rendering each
//!   prefix of the conversation: message `k`'s segment is the text its rendering
//!   adds, so role headers and end markers travel with their message and the
//!   generation prompt with the last one. A message given as content parts is cut
//!   further so that each part is a segment of exactly its text (a private-use
//!   marker surrounds the parts while rendering); its role header and end marker join
//!   the neighbouring whole messages ([`attach_glue`]).
//! * Tools (`serve::tools`): the tool list becomes a segment of its own, after the
//!   system prompt's text (a cut is placed there), so the same tools are a hit in
//!   any conversation.
//! * Completions: a `segments` array, or a prompt cut at the separator string.
use super::tools::{self, ToolSet};
use super::types::{ChatMessageIn, HypicRequestExt, MessageContent};
use crate::error::ApiError;
use dataplane::pic::Mode;
use dataplane::tokenizer::Tokenizer;
use serde_json::{json, Value};

/// Joins content parts while rendering; never accepted in user text.
pub const PART_MARK: &str = "\u{10FFFD}";
/// At most this many messages per chat request.
pub const MAX_MESSAGES: usize = 1024;

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// Renders a conversation (with its tools, when given) and cuts it into segment texts
/// (non-empty, in order).
pub fn chat_segments(
    tok: &Tokenizer,
    msgs: &[ChatMessageIn],
    tools: Option<&ToolSet>,
) -> Result<Vec<String>, ApiError> {
    if msgs.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "'messages' must contain at least one message",
        ));
    }
    if msgs.len() > MAX_MESSAGES {
        return Err(ApiError::invalid_param(
            "messages",
            format!("at most {MAX_MESSAGES} messages per request"),
        ));
    }
    if !tok.has_chat_template() {
        return Err(ApiError::invalid(
            "no_chat_template",
            "the served model has no chat template; use /v1/completions",
        ));
    }
    let native = tools.is_some() && tok.template_renders_tools();
    let mut conv: Vec<Value> = Vec::with_capacity(msgs.len() + 1);
    // Per entry of `conv`: whether its content was given as parts (so that its role
    // header and end marker are template glue around exact part texts).
    let mut parts_msg: Vec<bool> = Vec::with_capacity(msgs.len() + 1);
    let mut any_text = false;
    for (i, m) in msgs.iter().enumerate() {
        if !ROLES.contains(&m.role.as_str()) {
            return Err(ApiError::invalid_param(
                &format!("messages[{i}].role"),
                format!(
                    "unknown role {:?} (expected one of {})",
                    m.role,
                    ROLES.join(", ")
                ),
            ));
        }
        let param = format!("messages[{i}].content");
        let parts: Vec<String> = match &m.content {
            // OpenAI allows null content only for assistant messages with tool calls.
            None if m.role == "assistant" && m.tool_calls.is_some() => vec![String::new()],
            None => {
                return Err(ApiError::invalid_param(
                    &param,
                    format!(
                        "'{param}' is missing or null; a message with role {:?} needs a string or an array of text parts",
                        m.role
                    ),
                ))
            }
            Some(MessageContent::Text(t)) => vec![t.clone()],
            Some(MessageContent::Parts(ps)) if ps.is_empty() => {
                return Err(ApiError::invalid_param(
                    &param,
                    format!(
                        "'{param}' is an empty array; \
                         give at least one text part (or a string)"
                    ),
                ))
            }
            Some(MessageContent::Parts(ps)) => {
                let mut v = Vec::with_capacity(ps.len());
                for (j, p) in ps.iter().enumerate() {
                    if p.kind != "text" {
                        return Err(ApiError::invalid_param(
                            &format!("{param}[{j}].type"),
                            format!(
                                "only text content parts are supported; '{param}[{j}]' has type {:?}",
                                p.kind
                            ),
                        ));
                    }
                    if let Some(f) = p.other_fields.first() {
                        return Err(ApiError::invalid_param(
                            &format!("{param}[{j}].{f}"),
                            format!(
                                "unknown field {f:?} in the text content part '{param}[{j}]' (a text part has 'type' and 'text')"
                            ),
                        ));
                    }
                    match &p.text {
                        Some(t) => v.push(t.clone()),
                        None => {
                            return Err(ApiError::invalid_param(
                                &format!("{param}[{j}].text"),
                                format!("the text content part '{param}[{j}]' needs a string 'text'"),
                            ))
                        }
                    }
                }
                v
            }
        };
        if parts.iter().any(|p| p.contains(PART_MARK)) {
            return Err(ApiError::invalid_param(
                &param,
                "content contains the reserved character U+10FFFD",
            ));
        }
        // Content parts are cut on both sides, so each part's segment is exactly its
        // text (reusable in any order); the role header and the end marker join the
        // neighbouring whole messages (`attach_glue`).
        let content = match &m.content {
            Some(MessageContent::Parts(_)) => {
                format!("{PART_MARK}{}{PART_MARK}", parts.join(PART_MARK))
            }
            _ => parts.join(PART_MARK),
        };
        any_text |= parts.iter().any(|p| !p.is_empty());
        let mut msg = json!({"role": m.role, "content": content});
        if let Some(calls) = &m.tool_calls {
            if m.role != "assistant" {
                return Err(ApiError::invalid_param(
                    &format!("messages[{i}].tool_calls"),
                    "only assistant messages carry tool_calls",
                ));
            }
            let calls = check_calls(i, calls)?;
            any_text |= !calls.is_empty();
            if native {
                msg["tool_calls"] = json!(calls
                    .iter()
                    .map(|(id, name, args)| json!({"id": id, "type": "function",
                        "function": {"name": name, "arguments": args}}))
                    .collect::<Vec<_>>());
            } else {
                let mut text = msg["content"].as_str().unwrap_or("").to_string();
                for (_, name, args) in &calls {
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&tools::call_text(name, args));
                }
                msg["content"] = json!(text);
            }
        }
        if m.role == "tool" {
            if native {
                msg["tool_call_id"] = json!(m.tool_call_id);
            } else {
                let c = msg["content"].as_str().unwrap_or("");
                msg = json!({"role": "user",
                    "content": format!("<tool_response>\n{c}\n</tool_response>")});
            }
        }
        conv.push(msg);
        parts_msg.push(matches!(m.content, Some(MessageContent::Parts(_))));
    }
    if let Some(t) = tools {
        // A cut right after the system prompt's text: what follows in that turn
        // (the tool list) is a segment of its own.
        let has_system = conv[0]["role"] == "system";
        if native {
            if has_system {
                let c = format!("{}{PART_MARK}", conv[0]["content"].as_str().unwrap_or(""));
                conv[0]["content"] = json!(c);
            }
        } else if has_system {
            let c = format!(
                "{}{PART_MARK}\n\n{}",
                conv[0]["content"].as_str().unwrap_or(""),
                tools::tools_text(&t.tools)
            );
            conv[0]["content"] = json!(c);
        } else {
            parts_msg.insert(0, false);
            conv.insert(
                0,
                json!({"role": "system", "content": tools::tools_text(&t.tools)}),
            );
        }
    }
    let tools_ctx = tools
        .filter(|_| native)
        .map(|t| Value::Array(t.tools.clone()));
    // An empty message is fine in a conversation, an empty conversation is not.
    if !any_text {
        return Err(ApiError::invalid_param(
            "messages",
            "every message in 'messages' has empty content; give some text to complete",
        ));
    }
    let render = |k: usize, gen: bool| {
        tok.apply_chat_template_with(&conv[..k], tools_ctx.as_ref(), gen)
            .map_err(|e| ApiError::invalid("chat_template_error", e.to_string()))
    };
    let full = render(conv.len(), true)?;
    let mut blocks = Vec::with_capacity(conv.len());
    let mut prev = String::new();
    let mut ok = true;
    for k in 1..conv.len() {
        let p = render(k, false)?;
        if !p.starts_with(prev.as_str()) {
            ok = false;
            break;
        }
        blocks.push(p[prev.len()..].to_string());
        prev = p;
    }
    let stable = ok && full.starts_with(prev.as_str());
    if stable {
        blocks.push(full[prev.len()..].to_string());
    } else {
        // The template is not prefix-stable (e.g. it rewrites earlier turns): one
        // segment per part of the whole rendering.
        blocks = vec![full];
    }
    let mut pieces: Vec<(String, Piece)> = vec![];
    for (k, b) in blocks.iter().enumerate() {
        let glued = stable && parts_msg.get(k).copied().unwrap_or(false);
        let split: Vec<&str> = b.split(PART_MARK).collect();
        let n = split.len();
        for (j, t) in split.into_iter().enumerate() {
            let kind = if glued && (j == 0 || j + 1 == n) {
                Piece::Glue
            } else if glued {
                Piece::Part
            } else {
                Piece::Whole
            };
            pieces.push((t.to_string(), kind));
        }
    }
    let segs = attach_glue(pieces);
    if segs.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "the conversation renders to an empty prompt",
        ));
    }
    Ok(segs)
}

/// What a piece of the rendered conversation is, for [`attach_glue`].
#[derive(Clone, Copy, Debug, PartialEq)]
enum Piece {
    /// A whole message's rendering (header, text, end marker).
    Whole,
    /// Exactly the text of one content part.
    Part,
    /// A role header or end marker around content parts.
    Glue,
}

/// Segment texts from the pieces: template glue around content parts joins a
/// neighbouring whole message (the one before, else the one after), so it does not
/// become a tiny segment of its own; part texts stay exactly their text (reusable in
/// any order). Glue between two parts messages merges into one piece, which stays a
/// segment only when no whole message is beside it. Empty pieces are dropped.
fn attach_glue(pieces: Vec<(String, Piece)>) -> Vec<String> {
    // Adjacent glue pieces first become one.
    let mut merged: Vec<(String, Piece)> = vec![];
    for (t, k) in pieces.into_iter().filter(|(t, _)| !t.is_empty()) {
        match merged.last_mut() {
            Some((prev, Piece::Glue)) if k == Piece::Glue => prev.push_str(&t),
            _ => merged.push((t, k)),
        }
    }
    let mut out: Vec<(String, Piece)> = Vec::with_capacity(merged.len());
    let mut carry = String::new(); // glue waiting for the next whole message
    let mut it = merged.into_iter().peekable();
    while let Some((t, k)) = it.next() {
        match k {
            Piece::Glue => {
                if let Some((prev, Piece::Whole)) = out.last_mut() {
                    prev.push_str(&t);
                } else if matches!(it.peek(), Some((_, Piece::Whole))) {
                    carry = t;
                } else {
                    out.push((t, Piece::Glue));
                }
            }
            Piece::Whole => out.push((std::mem::take(&mut carry) + &t, Piece::Whole)),
            Piece::Part => out.push((t, Piece::Part)),
        }
    }
    out.into_iter().map(|(t, _)| t).collect()
}

/// The `(id, name, arguments)` of an assistant message's `tool_calls`; arguments as
/// given (an object, or its JSON text).
///
/// Errors: 400 naming `messages[i].tool_calls[j]…` for a call that is not a function
/// call with a name.
fn check_calls(i: usize, calls: &Value) -> Result<Vec<(Value, String, Value)>, ApiError> {
    let param = format!("messages[{i}].tool_calls");
    let list = calls
        .as_array()
        .ok_or_else(|| ApiError::invalid_param(&param, format!("'{param}' must be an array")))?;
    let mut out = Vec::with_capacity(list.len());
    for (j, c) in list.iter().enumerate() {
        let f = c.get("function").filter(|f| f.is_object()).ok_or_else(|| {
            ApiError::invalid_param(
                &format!("{param}[{j}].function"),
                "a tool call needs a 'function' object with 'name' and 'arguments'",
            )
        })?;
        let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid_param(
                &format!("{param}[{j}].function.name"),
                "a tool call needs a string 'name'",
            )
        })?;
        let args = match f.get("arguments") {
            None => json!({}),
            Some(Value::String(s)) => serde_json::from_str(s).unwrap_or_else(|_| json!(s)),
            Some(v) => v.clone(),
        };
        out.push((
            c.get("id").cloned().unwrap_or(Value::Null),
            name.to_string(),
            args,
        ));
    }
    Ok(out)
}

/// Cuts a completions prompt at `sep` (empty pieces dropped).
pub fn split_prompt(prompt: &str, sep: &str) -> Vec<String> {
    if sep.is_empty() {
        return if prompt.is_empty() {
            vec![]
        } else {
            vec![prompt.to_string()]
        };
    }
    prompt
        .split(sep)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

/// Metric label and display name of a mode.
pub fn mode_name(m: &Mode) -> &'static str {
    match m {
        Mode::FullRecompute => "full_recompute",
        Mode::PrefixCache => "prefix_cache",
        Mode::NaiveAddition => "naive_addition",
        Mode::Hypic { .. } => "hypic",
    }
}

/// Parses a mode name (`full_recompute`/`full`, `prefix_cache`/`prefix`,
/// `naive_addition`/`naive`, `hypic`) with the hypic parameters.
pub fn parse_mode(name: &str, seam_width: usize, rope_fix: bool) -> Result<Mode, String> {
    Ok(match name {
        "full_recompute" | "full" => Mode::FullRecompute,
        "prefix_cache" | "prefix" => Mode::PrefixCache,
        "naive_addition" | "naive" => Mode::NaiveAddition,
        "hypic" => Mode::Hypic {
            seam_width,
            rope_fix,
        },
        other => {
            return Err(format!(
                "unknown mode {other:?} (expected full_recompute, prefix_cache, naive_addition or hypic)"
            ))
        }
    })
}

/// The mode a request asks for (the server default when it does not say).
pub fn request_mode(ext: Option<&HypicRequestExt>, default: Mode) -> Result<Mode, ApiError> {
    let (dw, dr) = match default {
        Mode::Hypic {
            seam_width,
            rope_fix,
        } => (seam_width, rope_fix),
        _ => (8, true),
    };
    let Some(ext) = ext else { return Ok(default) };
    let w = ext.seam_width.unwrap_or(dw);
    if w > 4096 {
        return Err(ApiError::invalid_param(
            "hypic.seam_width",
            "seam_width must be at most 4096",
        ));
    }
    let r = ext.rope_fix.unwrap_or(dr);
    match &ext.mode {
        None => Ok(match default {
            Mode::Hypic { .. } => Mode::Hypic {
                seam_width: w,
                rope_fix: r,
            },
            m => m,
        }),
        Some(name) => parse_mode(name, w, r).map_err(|e| ApiError::invalid_param("hypic.mode", e)),
    }
}

#[cfg(test)]
mod tests {
    use super::{attach_glue, Piece};

    fn p(t: &str, k: Piece) -> (String, Piece) {
        (t.to_string(), k)
    }

    #[test]
    fn glue_joins_whole_neighbours_and_parts_stay_exact() {
        use Piece::*;
        // system | header | A | B | end | question: the header joins the system turn,
        // the end marker the question; the parts stay exactly their text.
        let got = attach_glue(vec![
            p("<s>S</s>", Whole),
            p("<u>", Glue),
            p("A", Part),
            p("B", Part),
            p("</u>", Glue),
            p("<u>Q</u><a>", Whole),
        ]);
        assert_eq!(got, ["<s>S</s><u>", "A", "B", "</u><u>Q</u><a>"]);
        // Only parts messages: glue between them merges; first and last glue stay.
        let got = attach_glue(vec![
            p("<u>", Glue),
            p("A", Part),
            p("</u>", Glue),
            p("<u>", Glue),
            p("B", Part),
            p("", Part),
            p("</u><a>", Glue),
        ]);
        assert_eq!(got, ["<u>", "A", "</u><u>", "B", "</u><a>"]);
    }
}
