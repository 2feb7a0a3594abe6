//! Reading a JSON request body of the serving routes: [`parse_json`] turns
//! invalid UTF-8, malformed JSON and wrong types into the API's one error type,
//! [`crate::error::ApiError`] (400s naming the field), and [`field_rule`] lets a
//! deserialiser state the rule a field breaks.
use crate::error::ApiError;

/// Starts the message of a [`field_rule`] error.
const RULE_MARK: &str = "\u{1}rule:";

/// A deserialisation error that states the rule a field breaks, e.g. `must be a
/// string or an array of up to 4 strings`; [`parse_json`] puts the field's path in
/// front of it.
pub fn field_rule<E: serde::de::Error>(rule: impl std::fmt::Display) -> E {
    E::custom(format_args!("{RULE_MARK}{rule}"))
}

/// What serde expected, in JSON's terms (serde names Rust types: `i64`, `struct X`).
fn json_expected(exp: &str) -> String {
    match exp {
        "i8" | "i16" | "i32" | "i64" | "i128" | "isize" => "an integer".into(),
        "u8" | "u16" | "u32" | "u64" | "u128" | "usize" => "a non-negative integer".into(),
        "f32" | "f64" => "a number".into(),
        "a sequence" => "an array".into(),
        "a map" => "an object".into(),
        e if e.starts_with("struct ") || e.starts_with("enum ") => "an object".into(),
        e => e.into(),
    }
}

/// What serde found, in JSON's terms.
fn json_unexpected(unexp: &str) -> String {
    match unexp {
        "map" => return "an object".into(),
        "sequence" => return "an array".into(),
        "unit value" => return "null".into(),
        _ => {}
    }
    for (serde_word, json_word) in [
        ("floating point ", "the number "),
        ("integer ", "the number "),
        ("boolean ", "the boolean "),
        ("string ", "the string "),
    ] {
        if let Some(v) = unexp.strip_prefix(serde_word) {
            return format!("{json_word}{}", v.trim_matches('`'));
        }
    }
    unexp.into()
}

/// The message of a data error at `path` (non-empty): `'path' must be …`.
fn data_message(path: &str, msg: &str) -> String {
    if let Some(rule) = msg.strip_prefix(RULE_MARK) {
        return format!("'{path}' {rule}");
    }
    for prefix in ["invalid type: ", "invalid value: "] {
        if let Some(rest) = msg.strip_prefix(prefix) {
            if let Some((unexp, exp)) = rest.rsplit_once(", expected ") {
                return format!(
                    "'{path}' must be {} (got {})",
                    json_expected(exp),
                    json_unexpected(unexp)
                );
            }
        }
    }
    format!("invalid value for '{path}': {msg}")
}

/// JSON containers and separators (`[`, `{` and `,`: about one per array element
/// or object member, two per nested container) a request body may hold at most: a body of millions of empty arrays or strings is refused before
/// it is parsed into memory (a prompt of token ids is far below this).
pub const MAX_JSON_VALUES: usize = 1 << 20;

/// Counts the containers opened and separators outside strings in `bytes`, stopping once over `cap`. Cheap: one pass, no allocation.
fn json_values_over(bytes: &[u8], cap: usize) -> bool {
    let (mut n, mut in_str, mut esc) = (0usize, false, false);
    for &b in bytes {
        if in_str {
            if esc {
                esc = false;
            } else if b == b'\\' {
                esc = true;
            } else if b == b'"' {
                in_str = false;
            }
            continue;
        }
        match b {
            b'"' => in_str = true,
            b'[' | b'{' | b',' => {
                n += 1;
                if n > cap {
                    return true;
                }
            }
            _ => {}
        }
    }
    false
}

/// Parses a JSON request body: invalid UTF-8, malformed JSON and wrong types are
/// 400s naming the problem (and the field path for type errors). CPU-bound on a
/// large body: handlers call it through `routes::parse_body` (blocking pool,
/// bounded turns).
pub fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.is_empty() {
        return Err(ApiError::invalid(
            "invalid_json",
            "the request body is empty; send a JSON object",
        ));
    }
    if json_values_over(bytes, MAX_JSON_VALUES) {
        return Err(ApiError::invalid(
            "too_many_json_values",
            format!(
                "the request body holds more than {MAX_JSON_VALUES} JSON arrays, objects \
                 and separators (array elements and object members); send fewer"
            ),
        ));
    }
    if let Err(e) = std::str::from_utf8(bytes) {
        return Err(ApiError::invalid(
            "invalid_utf8",
            format!("the request body is not valid UTF-8 ({e})"),
        ));
    }
    // Syntax first, so that a truncated document is "malformed", not "wrong type".
    if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
        return Err(ApiError::invalid(
            "invalid_json",
            format!("malformed JSON: {e}"),
        ));
    }
    // A body is a JSON object (serde would read a struct from an array too, and
    // report the first element as `[0]`).
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => {}
        first => {
            let kind = match first {
                Some(b'[') => "an array",
                Some(b'"') => "a string",
                Some(b't' | b'f') => "a boolean",
                Some(b'n') => "null",
                _ => "a number",
            };
            return Err(ApiError::invalid(
                "invalid_type",
                format!("the request body must be a JSON object, not {kind}"),
            ));
        }
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize::<_, T>(de) {
        Ok(v) => Ok(v),
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            use serde_json::error::Category;
            match inner.classify() {
                Category::Syntax | Category::Eof | Category::Io => Err(ApiError::invalid(
                    "invalid_json",
                    format!("malformed JSON: {inner}"),
                )),
                Category::Data => {
                    // The bare message: the field's path says where, not line and column.
                    let full = inner.to_string();
                    let at = format!(" at line {} column {}", inner.line(), inner.column());
                    let msg = full.strip_suffix(at.as_str()).unwrap_or(&full);
                    if path.is_empty() || path == "." {
                        let msg = msg.strip_prefix(RULE_MARK).unwrap_or(msg);
                        return Err(ApiError::invalid(
                            "invalid_type",
                            format!("invalid request body: {msg}"),
                        ));
                    }
                    let mut err = ApiError::invalid("invalid_type", data_message(&path, msg));
                    err.param = Some(path);
                    Err(err)
                }
            }
        }
    }
}
