//! Structured output over HTTP (issue 22, item 1): `response_format` `json_schema` and
//! `json_object` on chat and completions, enforced while decoding — every sampled
//! choice, streamed or not, parses and satisfies its schema, whatever the (random)
//! golden model prefers; bad formats are 400s naming the field.
use crate::serve_common;

use serde_json::{json, Value};
use serve_common::{assert_error, start};

const CHAT: &str = "/v1/chat/completions";
const COMPL: &str = "/v1/completions";

/// A schema whose every value is short (bounded strings, integers and arrays), so a
/// completion ends well within `max_tokens` whatever the model prefers.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 6},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"enum": ["C", "F"]},
            "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}
        },
        "required": ["city", "days", "unit", "tags"],
        "additionalProperties": false
    })
}

/// Checks `text` against [`schema`] by hand (no validator crate in the tests).
fn check(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {text}"));
    assert_eq!(o.len(), 4, "{text}");
    assert!(o["city"].as_str().unwrap().chars().count() <= 6, "{text}");
    assert!((1..=14).contains(&o["days"].as_i64().unwrap()), "{text}");
    assert!(["C", "F"].contains(&o["unit"].as_str().unwrap()), "{text}");
    let tags = o["tags"].as_array().unwrap();
    assert!(
        tags.len() <= 2 && tags.iter().all(Value::is_boolean),
        "{text}"
    );
}

fn format() -> Value {
    json!({"type": "json_schema",
        "json_schema": {"name": "forecast", "schema": schema(), "strict": true}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_choices_parse_and_match_on_every_seed() {
    let s = start(|_| {}).await;
    for seed in 0..4 {
        // Sampled at temperature 1.2, three choices in one batch.
        let body = json!({"messages": [{"role": "user", "content": "Weather?"}],
            "max_tokens": 96, "temperature": 1.2, "seed": seed, "n": 3,
            "response_format": format()});
        let (st, v) = s.post(CHAT, &body).await;
        assert_eq!(st, 200, "{v}");
        for c in v["choices"].as_array().unwrap() {
            assert_eq!(c["finish_reason"], "stop", "{v}");
            check(c["message"]["content"].as_str().unwrap());
        }
    }
    // Completions take the same field.
    let body = json!({"prompt": "Forecast:", "max_tokens": 96, "temperature": 0,
        "response_format": format()});
    let (st, v) = s.post(COMPL, &body).await;
    assert_eq!(st, 200, "{v}");
    check(v["choices"][0]["text"].as_str().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_json_schema_deltas_join_to_a_matching_value() {
    let s = start(|_| {}).await;
    let body = json!({"messages": [{"role": "user", "content": "Weather?"}],
        "max_tokens": 96, "temperature": 1.0, "seed": 11, "stream": true,
        "response_format": format()});
    let (st, data) = s.stream(CHAT, &body).await;
    assert_eq!(st, 200, "{data:?}");
    let mut text = String::new();
    let mut finish = Value::Null;
    for d in data.iter().filter(|d| *d != "[DONE]") {
        let v: Value = serde_json::from_str(d).unwrap();
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
        if !v["choices"][0]["finish_reason"].is_null() {
            finish = v["choices"][0]["finish_reason"].clone();
        }
    }
    assert_eq!(finish, "stop", "{data:?}");
    check(&text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_object_is_an_object_and_unconstrained_output_is_not_json() {
    let s = start(|_| {}).await;
    let base = json!({"messages": [{"role": "user", "content": "Give me JSON"}],
        "max_tokens": 48, "temperature": 0});
    let (st, plain) = s.post(CHAT, &base).await;
    assert_eq!(st, 200, "{plain}");
    let plain_text = plain["choices"][0]["message"]["content"].as_str().unwrap();
    // The random golden model does not write JSON by itself: the constraint does.
    assert!(
        serde_json::from_str::<Value>(plain_text).is_err(),
        "{plain_text:?}"
    );
    let mut b = base.clone();
    b["max_tokens"] = json!(200);
    b["response_format"] = json!({"type": "json_object"});
    b["logit_bias"] = json!({"2": 4}); // processors still apply before the mask
    let (st, v) = s.post(CHAT, &b).await;
    assert_eq!(st, 200, "{v}");
    let c = &v["choices"][0];
    let text = c["message"]["content"].as_str().unwrap();
    if c["finish_reason"] == "stop" {
        let j: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert!(j.is_object(), "{text}");
    } else {
        // Cut by max_tokens: still a prefix of an object.
        assert!(text.trim_start().starts_with('{'), "{text:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_response_formats_are_400s_naming_the_field() {
    let s = start(|_| {}).await;
    let chat = |rf: Value| {
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": rf})
    };
    for (rf, param) in [
        (json!({"type": "yaml"}), "response_format.type"),
        (
            json!({"type": "json_schema"}),
            "response_format.json_schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
            "response_format.json_schema.name",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "n", "schema": 3}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "n", "strict": true,
                "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}),
            "response_format.json_schema.schema",
        ),
    ] {
        for path in [CHAT, COMPL] {
            let mut body = chat(rf.clone());
            if path == COMPL {
                body = json!({"prompt": "x", "max_tokens": 4, "response_format": rf.clone()});
            }
            let (st, v) = s.post(path, &body).await;
            assert_error(st, &v, 400, "invalid_value");
            assert_eq!(v["error"]["param"], param, "{path} {rf}: {v}");
        }
    }
    // A json_schema object without its name is a type error naming the field.
    let (st, v) = s
        .post(
            CHAT,
            &chat(json!({"type": "json_schema", "json_schema": {}})),
        )
        .await;
    assert_error(st, &v, 400, "invalid_type");
    assert!(v.to_string().contains("name"), "{v}");
}
