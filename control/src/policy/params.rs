//! Policy parameter schemas (ABI v2, `policies/ABI.md`): a module declares its
//! parameters in the `hypic.params` custom section (JSON); the host checks the
//! schema at upload, checks every parameter value against it (upload,
//! activation, dry run, shadow), completes omitted parameters with their
//! defaults and encodes the values as the `name=value` lines the guest reads.

use serde::{Deserialize, Serialize};

use super::PolicyError;

/// Name of the Wasm custom section holding the parameter schema.
pub const PARAMS_SECTION: &str = "hypic.params";

/// Most parameters a schema may declare.
pub const MAX_PARAMS: usize = 64;

/// Longest parameter name, characters.
pub const MAX_NAME_LEN: usize = 64;

/// Longest description, characters.
pub const MAX_DESCRIPTION_LEN: usize = 512;

/// Default and largest `max_len` of a `string` parameter, bytes.
pub const MAX_STRING_LEN: usize = 256;

/// Most choices of an `enum` parameter.
pub const MAX_CHOICES: usize = 64;

/// Largest schema section, bytes.
pub const MAX_SECTION_BYTES: usize = 64 * 1024;

/// The type of one parameter and its constraints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum ParamType {
    /// A 64-bit signed integer within `[min, max]` (each bound optional).
    Int {
        /// Smallest allowed value.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        min: Option<i64>,
        /// Largest allowed value.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max: Option<i64>,
        /// Value used when the parameter is omitted.
        default: i64,
    },
    /// A finite 64-bit float within `[min, max]` (each bound optional).
    Float {
        /// Smallest allowed value.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        min: Option<f64>,
        /// Largest allowed value.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max: Option<f64>,
        /// Value used when the parameter is omitted.
        default: f64,
    },
    /// A boolean (passed to the guest as `0` or `1`).
    Bool {
        /// Value used when the parameter is omitted.
        default: bool,
    },
    /// Printable text without line breaks, at most `max_len` bytes.
    String {
        /// Longest value in bytes (default and at most [`MAX_STRING_LEN`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_len: Option<usize>,
        /// Value used when the parameter is omitted.
        default: String,
    },
    /// One of `choices`.
    Enum {
        /// The allowed values (distinct, printable, no line breaks).
        choices: Vec<String>,
        /// Value used when the parameter is omitted (one of `choices`).
        default: String,
    },
}

/// One declared parameter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ParamSpec {
    /// Name: 1 to [`MAX_NAME_LEN`] characters of `[A-Za-z0-9_]`.
    pub name: String,
    /// What it changes, for operators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Its type, constraints and default.
    #[serde(flatten)]
    pub ty: ParamType,
}

/// The parameters a policy module declares (`{"params": [...]}`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ParamSchema {
    /// The parameters, in the order a form shows them.
    pub params: Vec<ParamSpec>,
}

/// Reads the `hypic.params` custom section of `module` (Wasm binary) and
/// checks it; `Ok(None)` when the module has none.
///
/// Errors: [`PolicyError::Schema`] naming the problem (bad JSON, bad name,
/// duplicate, default outside the range, ...), or [`PolicyError::Invalid`]
/// when the module's sections cannot be read at all.
pub fn read_schema(module: &[u8]) -> Result<Option<ParamSchema>, PolicyError> {
    super::wasm::check_header(module)?;
    let mut found: Option<&[u8]> = None;
    for payload in wasmparser::Parser::new(0).parse_all(module) {
        let payload =
            payload.map_err(|e| PolicyError::Invalid(format!("not a Wasm module: {e}")))?;
        if let wasmparser::Payload::CustomSection(c) = payload {
            if c.name() == PARAMS_SECTION {
                if found.is_some() {
                    return Err(PolicyError::Schema(format!(
                        "the module has more than one `{PARAMS_SECTION}` section"
                    )));
                }
                found = Some(c.data());
            }
        }
    }
    found.map(parse_schema).transpose()
}

/// Parses and checks a schema's JSON text (the section's content).
///
/// Errors: [`PolicyError::Schema`] naming the problem.
pub fn parse_schema(json: &[u8]) -> Result<ParamSchema, PolicyError> {
    if json.len() > MAX_SECTION_BYTES {
        return Err(PolicyError::Schema(format!(
            "the `{PARAMS_SECTION}` section is {} bytes, over {MAX_SECTION_BYTES}",
            json.len()
        )));
    }
    let text = std::str::from_utf8(json)
        .map_err(|e| PolicyError::Schema(format!("the schema is not UTF-8: {e}")))?;
    let schema: ParamSchema = serde_json::from_str(text)
        .map_err(|e| PolicyError::Schema(format!("the schema is not valid: {e}")))?;
    check_schema(&schema)?;
    Ok(schema)
}

fn check_text(what: &str, v: &str) -> Result<(), String> {
    if v.chars().any(crate::auth::unsafe_in_names) {
        return Err(format!(
            "{what} must not contain control, line-break, bidirectional or zero-width characters"
        ));
    }
    Ok(())
}

/// Checks a parsed schema: names, bounds, choices, defaults.
///
/// Errors: [`PolicyError::Schema`] naming the parameter and the problem.
pub fn check_schema(s: &ParamSchema) -> Result<(), PolicyError> {
    if s.params.len() > MAX_PARAMS {
        return Err(PolicyError::Schema(format!(
            "{} parameters declared, at most {MAX_PARAMS}",
            s.params.len()
        )));
    }
    let mut seen = std::collections::HashSet::new();
    for (i, p) in s.params.iter().enumerate() {
        let at = format!("params[{i}] ({:?})", p.name);
        let fail = |m: String| PolicyError::Schema(format!("{at}: {m}"));
        if p.name.is_empty()
            || p.name.len() > MAX_NAME_LEN
            || !p
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err(fail(format!(
                "name must be 1 to {MAX_NAME_LEN} characters of [A-Za-z0-9_]"
            )));
        }
        if !seen.insert(p.name.as_str()) {
            return Err(fail("declared twice".into()));
        }
        if let Some(d) = &p.description {
            if d.chars().count() > MAX_DESCRIPTION_LEN {
                return Err(fail(format!(
                    "description is over {MAX_DESCRIPTION_LEN} characters"
                )));
            }
            check_text("the description", d).map_err(fail)?;
        }
        match &p.ty {
            ParamType::Int { min, max, default } => {
                if let (Some(lo), Some(hi)) = (min, max) {
                    if lo > hi {
                        return Err(fail(format!("min {lo} is above max {hi}")));
                    }
                }
                check_int(*default, *min, *max).map_err(|m| fail(format!("default {m}")))?;
            }
            ParamType::Float { min, max, default } => {
                for (n, b) in [("min", min), ("max", max)] {
                    if b.is_some_and(|b| !b.is_finite()) {
                        return Err(fail(format!("{n} must be finite")));
                    }
                }
                if let (Some(lo), Some(hi)) = (min, max) {
                    if lo > hi {
                        return Err(fail(format!("min {lo} is above max {hi}")));
                    }
                }
                check_float(*default, *min, *max).map_err(|m| fail(format!("default {m}")))?;
            }
            ParamType::Bool { .. } => {}
            ParamType::String { max_len, default } => {
                let cap = max_len.unwrap_or(MAX_STRING_LEN);
                if cap == 0 || cap > MAX_STRING_LEN {
                    return Err(fail(format!("max_len must be 1 to {MAX_STRING_LEN}")));
                }
                check_string(default, cap).map_err(|m| fail(format!("default {m}")))?;
            }
            ParamType::Enum { choices, default } => {
                if choices.is_empty() || choices.len() > MAX_CHOICES {
                    return Err(fail(format!("choices must list 1 to {MAX_CHOICES} values")));
                }
                let mut uniq = std::collections::HashSet::new();
                for c in choices {
                    check_string(c, MAX_STRING_LEN).map_err(|m| fail(format!("choice {m}")))?;
                    if c.is_empty() {
                        return Err(fail("a choice is empty".into()));
                    }
                    if !uniq.insert(c.as_str()) {
                        return Err(fail(format!("choice {c:?} is listed twice")));
                    }
                }
                if !choices.contains(default) {
                    return Err(fail(format!(
                        "default {default:?} is not one of the choices"
                    )));
                }
            }
        }
    }
    Ok(())
}

/// The allowed range of a number parameter in words: `from 0 to 100`,
/// `0 or more`, `at most 100`, `any value`.
pub fn range_text<T: std::fmt::Display>(min: Option<T>, max: Option<T>) -> String {
    match (min, max) {
        (Some(lo), Some(hi)) => format!("from {lo} to {hi}"),
        (Some(lo), None) => format!("{lo} or more"),
        (None, Some(hi)) => format!("at most {hi}"),
        (None, None) => "any value".into(),
    }
}

fn check_int(v: i64, min: Option<i64>, max: Option<i64>) -> Result<(), String> {
    let range = || range_text(min, max);
    if let Some(lo) = min.filter(|&lo| v < lo) {
        return Err(format!(
            "{v} is below the minimum {lo} (allowed: {})",
            range()
        ));
    }
    if let Some(hi) = max.filter(|&hi| v > hi) {
        return Err(format!(
            "{v} is above the maximum {hi} (allowed: {})",
            range()
        ));
    }
    Ok(())
}

fn check_float(v: f64, min: Option<f64>, max: Option<f64>) -> Result<(), String> {
    let range = || range_text(min, max);
    if !v.is_finite() {
        return Err(format!("{v} is not finite (allowed: {})", range()));
    }
    if let Some(lo) = min.filter(|&lo| v < lo) {
        return Err(format!(
            "{v} is below the minimum {lo} (allowed: {})",
            range()
        ));
    }
    if let Some(hi) = max.filter(|&hi| v > hi) {
        return Err(format!(
            "{v} is above the maximum {hi} (allowed: {})",
            range()
        ));
    }
    Ok(())
}

fn check_string(v: &str, max_len: usize) -> Result<(), String> {
    if v.len() > max_len {
        return Err(format!("is {} bytes, over {max_len}", v.len()));
    }
    check_text("", v).map_err(|m| m.trim_start().to_string())
}

fn param_err(name: &str, message: String) -> PolicyError {
    PolicyError::Param {
        name: name.to_string(),
        message,
    }
}

/// Checks `params` (a JSON object or null) against `schema` and returns the
/// effective parameters: every declared one, the given value or its default
/// (sorted by name).
///
/// Errors: [`PolicyError::Param`] naming the parameter (unknown name, wrong
/// type, out of range, not a choice), or naming `params` when it is not an
/// object.
pub fn resolve(
    schema: &ParamSchema,
    params: &serde_json::Value,
) -> Result<serde_json::Map<String, serde_json::Value>, PolicyError> {
    use serde_json::Value;
    let empty = serde_json::Map::new();
    let given = match params {
        Value::Null => &empty,
        Value::Object(o) => o,
        _ => {
            return Err(PolicyError::Param {
                name: String::new(),
                message: "params must be a JSON object".into(),
            })
        }
    };
    for k in given.keys() {
        if !schema.params.iter().any(|p| &p.name == k) {
            let names: Vec<&str> = schema.params.iter().map(|p| p.name.as_str()).collect();
            return Err(param_err(
                k,
                if names.is_empty() {
                    format!("unknown parameter {k:?}: the policy declares no parameters")
                } else {
                    format!(
                        "unknown parameter {k:?}: the policy declares {}",
                        names.join(", ")
                    )
                },
            ));
        }
    }
    let mut out = serde_json::Map::new();
    for p in &schema.params {
        let n = &p.name;
        let v = given.get(n);
        let value = match (&p.ty, v) {
            (ParamType::Int { default, .. }, None) => Value::from(*default),
            (ParamType::Int { min, max, .. }, Some(v)) => {
                let i = v.as_i64().ok_or_else(|| {
                    param_err(
                        n,
                        format!(
                            "{n} must be an integer (allowed: {}), got {v}",
                            range_text(*min, *max)
                        ),
                    )
                })?;
                check_int(i, *min, *max).map_err(|m| param_err(n, format!("{n}: {m}")))?;
                Value::from(i)
            }
            (ParamType::Float { default, .. }, None) => Value::from(*default),
            (ParamType::Float { min, max, .. }, Some(v)) => {
                let f = v.as_f64().filter(|_| v.is_number()).ok_or_else(|| {
                    param_err(
                        n,
                        format!(
                            "{n} must be a number (allowed: {}), got {v}",
                            range_text(*min, *max)
                        ),
                    )
                })?;
                check_float(f, *min, *max).map_err(|m| param_err(n, format!("{n}: {m}")))?;
                Value::from(f)
            }
            (ParamType::Bool { default }, None) => Value::from(*default),
            (ParamType::Bool { .. }, Some(v)) => Value::from(
                v.as_bool()
                    .ok_or_else(|| param_err(n, format!("{n} must be true or false, got {v}")))?,
            ),
            (ParamType::String { default, .. }, None) => Value::from(default.clone()),
            (ParamType::String { max_len, .. }, Some(v)) => {
                let s = v
                    .as_str()
                    .ok_or_else(|| param_err(n, format!("{n} must be a string, got {v}")))?;
                check_string(s, max_len.unwrap_or(MAX_STRING_LEN))
                    .map_err(|m| param_err(n, format!("{n} {m}")))?;
                Value::from(s)
            }
            (ParamType::Enum { default, .. }, None) => Value::from(default.clone()),
            (ParamType::Enum { choices, .. }, Some(v)) => {
                let s = v.as_str().filter(|s| choices.iter().any(|c| c == s));
                let s = s.ok_or_else(|| {
                    param_err(
                        n,
                        format!("{n} must be one of {}, got {v}", choices.join(", ")),
                    )
                })?;
                Value::from(s)
            }
        };
        out.insert(n.clone(), value);
    }
    Ok(out)
}

/// Encodes effective parameters (from [`resolve`]) as the ABI's
/// `name=value\n` lines, sorted by name: integers in decimal, booleans `0`/`1`, floats in
/// Rust's shortest round-trip decimal form, strings as they are.
///
/// Errors: [`PolicyError::Invalid`] when the lines exceed 4096 bytes.
pub fn encode_resolved(
    params: &serde_json::Map<String, serde_json::Value>,
) -> Result<Vec<u8>, PolicyError> {
    use serde_json::Value;
    let mut out = String::new();
    // Sorted by name whatever the map's own order (serde_json keeps insertion order
    // when a dependency enables `preserve_order`).
    let mut sorted: Vec<(&String, &Value)> = params.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    for (k, v) in sorted {
        let text = match v {
            Value::Bool(b) => (*b as i64).to_string(),
            Value::Number(n) => match n.as_i64() {
                Some(i) => i.to_string(),
                None => format!("{}", n.as_f64().unwrap_or(0.0)),
            },
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        out.push_str(&format!("{k}={text}\n"));
    }
    if out.len() > 4096 {
        return Err(PolicyError::Invalid("params exceed 4096 bytes".into()));
    }
    Ok(out.into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema(v: serde_json::Value) -> Result<ParamSchema, PolicyError> {
        parse_schema(v.to_string().as_bytes())
    }

    fn all_types() -> ParamSchema {
        schema(json!({"params": [
            {"name": "ttl_ms", "type": "int", "min": 0, "max": 100, "default": 10, "description": "d"},
            {"name": "ratio", "type": "float", "min": 0.0, "max": 1.0, "default": 0.5},
            {"name": "strict", "type": "bool", "default": false},
            {"name": "label", "type": "string", "max_len": 8, "default": "x"},
            {"name": "mode", "type": "enum", "choices": ["lru", "lfu"], "default": "lru"},
        ]}))
        .unwrap()
    }

    #[test]
    fn schema_errors_name_the_problem() {
        let cases = [
            (
                json!({"params": [{"name": "a b", "type": "int", "default": 1}]}),
                "params[0] (\"a b\"): name must be",
            ),
            (
                json!({"params": [{"name": "a", "type": "int", "default": 1}, {"name": "a", "type": "bool", "default": true}]}),
                "params[1] (\"a\"): declared twice",
            ),
            (
                json!({"params": [{"name": "a", "type": "int", "min": 5, "default": 1}]}),
                "default 1 is below the minimum 5",
            ),
            (
                json!({"params": [{"name": "a", "type": "int", "min": 5, "max": 1, "default": 3}]}),
                "min 5 is above max 1",
            ),
            (
                json!({"params": [{"name": "a", "type": "enum", "choices": ["x"], "default": "y"}]}),
                "default \"y\" is not one of the choices",
            ),
            (
                json!({"params": [{"name": "a", "type": "enum", "choices": ["x", "x"], "default": "x"}]}),
                "choice \"x\" is listed twice",
            ),
            (
                json!({"params": [{"name": "a", "type": "complex", "default": 1}]}),
                "the schema is not valid",
            ),
            (
                json!({"params": [{"name": "a", "type": "int"}]}),
                "missing field `default`",
            ),
            (
                json!({"params": [{"name": "a", "type": "string", "max_len": 4, "default": "toolong"}]}),
                "default is 7 bytes, over 4",
            ),
            (json!({"parameters": []}), "unknown field `parameters`"),
        ];
        for (v, want) in cases {
            let e = schema(v.clone()).unwrap_err().to_string();
            assert!(e.contains(want), "{v}: {e}");
        }
        assert!(parse_schema(b"{nope").is_err());
        assert_eq!(all_types().params.len(), 5);
    }

    #[test]
    fn values_are_checked_and_completed_with_defaults() {
        let s = all_types();
        let r = resolve(&s, &json!({"ttl_ms": 20, "mode": "lfu", "ratio": 1})).unwrap();
        assert_eq!(
            serde_json::Value::Object(r.clone()),
            json!({"ttl_ms": 20, "ratio": 1.0, "strict": false, "label": "x", "mode": "lfu"})
        );
        let lines = String::from_utf8(encode_resolved(&r).unwrap()).unwrap();
        assert_eq!(lines, "label=x\nmode=lfu\nratio=1\nstrict=0\nttl_ms=20\n");
        let bad = [
            (
                json!({"ttl_ms": 101}),
                "ttl_ms",
                "above the maximum 100 (allowed: from 0 to 100)",
            ),
            (json!({"ttl_ms": 1.5}), "ttl_ms", "must be an integer"),
            (json!({"ratio": "0.3"}), "ratio", "must be a number"),
            (json!({"ratio": -0.1}), "ratio", "below the minimum 0"),
            (json!({"strict": 1}), "strict", "true or false"),
            (json!({"label": "123456789"}), "label", "over 8"),
            (json!({"label": "a\nb"}), "label", "line-break"),
            (json!({"mode": "fifo"}), "mode", "one of lru, lfu"),
            (json!({"nope": 1}), "nope", "unknown parameter"),
        ];
        for (v, name, want) in bad {
            match resolve(&s, &v) {
                Err(PolicyError::Param { name: n, message }) => {
                    assert_eq!(n, name, "{v}");
                    assert!(message.contains(want), "{v}: {message}");
                }
                other => panic!("{v}: {other:?}"),
            }
        }
        assert!(resolve(&s, &json!([1])).is_err());
        assert!(resolve(&ParamSchema::default(), &json!({"x": 1}))
            .unwrap_err()
            .to_string()
            .contains("declares no parameters"));
    }

    #[test]
    fn builtin_modules_declare_valid_schemas() {
        for (name, _, bytes) in super::super::builtin::ALL {
            let s = read_schema(bytes)
                .unwrap_or_else(|e| panic!("{name}: {e}"))
                .unwrap_or_else(|| panic!("{name} has no {PARAMS_SECTION} section"));
            let defaults = resolve(&s, &serde_json::Value::Null).unwrap();
            assert_eq!(defaults.len(), s.params.len(), "{name}");
        }
        let ttl = read_schema(super::super::builtin::module("ttl").unwrap())
            .unwrap()
            .unwrap();
        assert_eq!(ttl.params[0].name, "ttl_ms");
        assert_eq!(
            ttl.params[0].ty,
            ParamType::Int {
                min: Some(0),
                max: None,
                default: 3_600_000
            }
        );
    }

    #[test]
    fn a_module_without_the_section_has_no_schema() {
        let m = wat::parse_str("(module)").unwrap();
        assert_eq!(read_schema(&m).unwrap(), None);
        let m = wat::parse_str(r#"(module (@custom "hypic.params" "{\"params\": 3}"))"#).unwrap();
        assert!(matches!(read_schema(&m), Err(PolicyError::Schema(_))));
    }
}
