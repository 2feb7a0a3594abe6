//! `/v1/responses` (issue 22, item 5): text, forced tool calls and structured output
//! through the Responses shape, each input item a segment; stateful fields are 400s.
use crate::serve_common;

use serde_json::{json, Value};
use serve_common::{assert_error, start};

const RESP: &str = "/v1/responses";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_tools_and_json_through_the_responses_shape() {
    let s = start(|_| {}).await;
    // Text: one message item; usage in the Responses names.
    let (st, v) = s
        .post(
            RESP,
            &json!({"instructions": "Be brief.", "input": "Hello there",
            "max_output_tokens": 4, "temperature": 0}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "response");
    assert!(v["id"].as_str().unwrap().starts_with("resp"));
    let out = &v["output"][0];
    assert_eq!(out["type"], "message", "{v}");
    assert_eq!(out["content"][0]["type"], "output_text");
    assert_eq!(v["status"], "incomplete", "{v}");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(v["usage"]["output_tokens"], 4);
    let input_tokens = v["usage"]["input_tokens"].as_u64().unwrap();
    assert!(input_tokens > 0);
    // Items are segments: the same instructions and a second item reuse the first.
    let (st, v2) = s
        .post(
            RESP,
            &json!({"instructions": "Be brief.",
            "input": [{"role": "user", "content": "Hello there"},
                      {"role": "user", "content": [{"type": "input_text", "text": "And again"}]}],
            "max_output_tokens": 2, "temperature": 0}),
        )
        .await;
    assert_eq!(st, 200, "{v2}");
    assert!(
        v2["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{v2}"
    );
    // A forced function call.
    let tool = json!({"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": false}});
    let (st, v) = s
        .post(
            RESP,
            &json!({"input": "Time?", "tools": [tool],
            "tool_choice": {"type": "function", "name": "get_time"},
            "parallel_tool_calls": false, "max_output_tokens": 160, "temperature": 1.0, "seed": 2}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let calls: Vec<&Value> = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["type"] == "function_call")
        .collect();
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["name"], "get_time");
    let args: Value = serde_json::from_str(calls[0]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["zone"] == "UTC" || args["zone"] == "CET", "{args}");
    assert_eq!(v["status"], "completed");
    // A function call and its output in the input are accepted.
    let (st, v) = s
        .post(RESP, &json!({"input": [
            {"role": "user", "content": "Time?"},
            {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{\"zone\": \"UTC\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "12:00"}],
            "tools": [tool], "max_output_tokens": 3}))
        .await;
    assert_eq!(st, 200, "{v}");
    // Structured output through text.format.
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer",
        "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": false});
    let (st, v) = s
        .post(
            RESP,
            &json!({"input": "A digit?", "max_output_tokens": 32, "temperature": 1.0,
            "seed": 4, "text": {"format": {"type": "json_schema", "name": "d", "schema": schema,
            "strict": true}}}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let text = v["output"][0]["content"][0]["text"].as_str().unwrap();
    let j: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert!((0..=9).contains(&j["n"].as_i64().unwrap()), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stateful_or_bad_fields_are_400s_naming_the_field() {
    let s = start(|_| {}).await;
    for (body, code, param) in [
        (
            json!({"input": "x", "previous_response_id": "resp_1"}),
            "unsupported_parameter",
            "previous_response_id",
        ),
        (
            json!({"input": "x", "stream": true}),
            "unsupported_parameter",
            "stream",
        ),
        (
            json!({"input": [{"type": "input_image"}]}),
            "invalid_value",
            "input[0].type",
        ),
        (
            json!({"input": "x", "tools": [{"type": "web_search"}]}),
            "invalid_value",
            "tools[0].type",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "a b",
            "schema": {}}}}),
            "invalid_value",
            "text.format.name",
        ),
        (
            json!({"input": "x", "max_output_tokens": 0}),
            "invalid_value",
            "max_output_tokens",
        ),
        (json!({}), "invalid_value", "input"),
    ] {
        let (st, v) = s.post(RESP, &body).await;
        assert_error(st, &v, 400, code);
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
}
