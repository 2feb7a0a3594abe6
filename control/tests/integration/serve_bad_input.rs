//! Bad input to `hypic serve`, each case a clear OpenAI-style JSON error with the
//! right status; the server keeps serving afterwards.
use crate::serve_common;

use reqwest::Method;
use serde_json::json;
use serve_common::{assert_error, start, Srv};

async fn still_healthy(s: &Srv) {
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "hello", "max_tokens": 1}),
        )
        .await;
    assert_eq!(st, 200, "server unhealthy after bad input: {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_json() {
    let s = start(|_| {}).await;
    for body in [
        &b"{\"prompt\": \"x\""[..],
        b"not json",
        b"{\"prompt\": \"x\",}",
        b"",
    ] {
        let (st, _, v) = s
            .raw(
                Method::POST,
                "/v1/completions",
                Some(&s.token),
                body.to_vec(),
            )
            .await;
        assert_error(st, &v, 400, "invalid_json");
    }
    let (st, _, v) = s
        .raw(
            Method::POST,
            "/v1/chat/completions",
            Some(&s.token),
            b"[1, 2".to_vec(),
        )
        .await;
    assert_error(st, &v, 400, "invalid_json");
    still_healthy(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_of_the_wrong_type() {
    let s = start(|_| {}).await;
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": "ten"}),
            "max_tokens",
        ),
        ("/v1/completions", json!({"prompt": 42}), "prompt"),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": "hot"}),
            "temperature",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stream": "yes"}),
            "stream",
        ),
        (
            "/v1/completions",
            json!({"segments": [{"text": 1}]}),
            "segments[0].text",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}),
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "n": 1.5}),
            "n",
        ),
    ];
    for (path, body, param) in cases {
        let (st, v) = s.post(path, &body).await;
        assert_error(st, &v, 400, "invalid_type");
        assert!(
            v["error"]["param"]
                .as_str()
                .unwrap_or("")
                .starts_with(param)
                || v["error"]["message"].as_str().unwrap().contains(param),
            "{path} {body}: {v}"
        );
    }
    // `user` is accepted (it has no effect) and penalties are supported; out-of-range
    // values are not.
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "x", "max_tokens": 1, "user": "u", "presence_penalty": 0}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let (st, v) = s
        .post("/v1/completions", &json!({"prompt": "x", "temperature": 9}))
        .await;
    assert_error(st, &v, 400, "invalid_value");
    assert_eq!(v["error"]["param"], "temperature");
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "x", "hypic": {"mode": "magic"}}),
        )
        .await;
    assert_error(st, &v, 400, "invalid_value");
    let (st, v) = s
        .post("/v1/completions", &json!({"prompt": "x", "model": "gpt-9"}))
        .await;
    assert_error(st, &v, 404, "model_not_found");
    still_healthy(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_segment_id() {
    let s = start(|_| {}).await;
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"segments": [{"id": "no-such-doc", "version": 1}, {"text": "q"}]}),
        )
        .await;
    assert_error(st, &v, 404, "segment_not_found");
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"segments": [{"id": "bad id with spaces"}]}),
        )
        .await;
    assert!(st == 400 || st == 404, "{st} {v}");
    assert!(v["error"]["message"].is_string());
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"segments": [{"text": "a", "id": "b"}]}),
        )
        .await;
    assert_error(st, &v, 400, "invalid_value");
    still_healthy(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_over_the_context_limit() {
    let s = start(|_| {}).await;
    // The golden model's context is 4096 tokens.
    let long = "river city market ".repeat(3000);
    let (st, v) = s
        .post("/v1/completions", &json!({"prompt": long, "max_tokens": 1}))
        .await;
    assert_error(st, &v, 400, "context_length_exceeded");
    assert_eq!(v["error"]["param"], "prompt", "{v}");
    let (st, v) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": long}]}),
        )
        .await;
    assert_error(st, &v, 400, "context_length_exceeded");
    assert_eq!(v["error"]["param"], "messages", "{v}");
    // Prompt fits, prompt + max_tokens does not.
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "hello", "max_tokens": 5000}),
        )
        .await;
    assert_error(st, &v, 400, "context_length_exceeded");
    still_healthy(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_tokens_not_positive() {
    let s = start(|_| {}).await;
    for m in [0, -1, -1000] {
        let (st, v) = s
            .post("/v1/completions", &json!({"prompt": "x", "max_tokens": m}))
            .await;
        assert_error(st, &v, 400, "invalid_value");
        assert_eq!(v["error"]["param"], "max_tokens");
        let (st, v) = s
            .post(
                "/v1/chat/completions",
                &json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": m}),
            )
            .await;
        assert_error(st, &v, 400, "invalid_value");
    }
    let (st, v) = s
        .post("/v1/completions", &json!({"prompt": "x", "n": 0}))
        .await;
    assert_error(st, &v, 400, "invalid_value");
    still_healthy(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_utf8() {
    let s = start(|_| {}).await;
    let mut body = b"{\"prompt\": \"caf".to_vec();
    body.extend_from_slice(&[0xC3, 0x28, 0xFF]);
    body.extend_from_slice(b"\"}");
    for path in ["/v1/completions", "/v1/chat/completions", "/v1/segments"] {
        let (st, _, v) = s
            .raw(Method::POST, path, Some(&s.token), body.clone())
            .await;
        assert_error(st, &v, 400, "invalid_utf8");
    }
    still_healthy(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_megabyte_body_is_rejected_by_the_limit() {
    let s = start(|_| {}).await;
    let mut body = b"{\"prompt\": \"".to_vec();
    body.resize(100 << 20, b'a');
    body.extend_from_slice(b"\"}");
    let (st, h, v) = s
        .raw(Method::POST, "/v1/completions", Some(&s.token), body)
        .await;
    assert_error(st, &v, 413, "body_too_large");
    assert!(h
        .get("content-type")
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("application/json"));
    still_healthy(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_messages() {
    let s = start(|_| {}).await;
    let (st, v) = s
        .post("/v1/chat/completions", &json!({"messages": []}))
        .await;
    assert_error(st, &v, 400, "invalid_value");
    assert_eq!(v["error"]["param"], "messages");
    let (st, v) = s
        .post("/v1/chat/completions", &json!({"model": "tiny"}))
        .await;
    assert_error(st, &v, 400, "invalid_type");
    let (st, v) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "wizard", "content": "x"}]}),
        )
        .await;
    assert_error(st, &v, 400, "invalid_value");
    let (st, v) = s.post("/v1/completions", &json!({"prompt": ""})).await;
    assert_error(st, &v, 400, "invalid_value");
    let (st, v) = s.post("/v1/completions", &json!({"segments": []})).await;
    assert_error(st, &v, 400, "invalid_value");
    let (st, v) = s.post("/v1/completions", &json!({})).await;
    assert_error(st, &v, 400, "invalid_value");
    still_healthy(&s).await;
}

/// The error's `param`, and that its message has each of `words` and names no Rust
/// type (serde's `untagged enum StopSpec`, `struct ChatMessageIn`, `i64`).
fn assert_names(v: &serde_json::Value, param: Option<&str>, words: &[&str]) {
    let e = &v["error"];
    match param {
        Some(p) => assert_eq!(e["param"], p, "{v}"),
        None => assert!(e["param"].is_null(), "{v}"),
    }
    let m = e["message"].as_str().unwrap();
    for w in words {
        assert!(m.contains(w), "message lacks {w:?}: {v}");
    }
    for leak in [
        "untagged",
        "enum ",
        "struct ",
        "StopSpec",
        "MessageContent",
        "PromptSpec",
        "ContentPart",
        "ChatMessageIn",
        "i64",
        "u64",
        "usize",
        "f32",
        "\u{1}",
    ] {
        assert!(!m.contains(leak), "message leaks {leak:?}: {v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_must_be_a_json_object() {
    let s = start(|_| {}).await;
    for (body, kind) in [
        (&b"[\"hello\"]"[..], "not an array"),
        (b" [{\"prompt\": \"x\"}]", "not an array"),
        (b"[]", "not an array"),
        (b"\"hello\"", "not a string"),
        (b"5", "not a number"),
        (b"null", "not null"),
        (b"true", "not a boolean"),
    ] {
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let (st, _, v) = s
                .raw(Method::POST, path, Some(&s.token), body.to_vec())
                .await;
            assert_error(st, &v, 400, "invalid_type");
            assert_names(&v, None, &["the request body must be a JSON object", kind]);
        }
    }
    still_healthy(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn type_errors_in_json_terms() {
    let s = start(|_| {}).await;
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": "ten"}),
            "max_tokens",
            "'max_tokens' must be an integer (got the string \"ten\")",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "seed": -1}),
            "seed",
            "'seed' must be a non-negative integer (got the number -1)",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": [1]}),
            "temperature",
            "'temperature' must be a number (got an array)",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": ["hi"]}),
            "messages[0]",
            "'messages[0]' must be an object (got the string \"hi\")",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": {"role": "user"}}),
            "messages",
            "'messages' must be an array (got an object)",
        ),
    ];
    for (path, body, param, words) in cases {
        let (st, v) = s.post(path, &body).await;
        assert_error(st, &v, 400, "invalid_type");
        assert_names(&v, Some(param), &[words]);
    }
    still_healthy(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_of_the_wrong_type() {
    let s = start(|_| {}).await;
    let rule = "'stop' must be a string or an array of up to 4 strings";
    for (stop, found) in [
        (json!(5), "the number 5"),
        (json!([1, 2]), "element 0 is the number 1"),
        (json!(["a", true]), "element 1 is the boolean true"),
        (json!(["a", null]), "element 1 is null"),
        (json!({"a": 1}), "an object"),
        (json!(false), "the boolean false"),
        (json!(["a", "b", "c", "d", "e"]), "got 5"),
    ] {
        for (path, body) in [
            ("/v1/completions", json!({"prompt": "x", "stop": stop})),
            (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "x"}], "stop": stop}),
            ),
        ] {
            let (st, v) = s.post(path, &body).await;
            assert_error(st, &v, 400, "invalid_type");
            assert_names(&v, Some("stop"), &[rule, found]);
        }
    }
    // Null is "no stop sequences"; a string and up to four strings are fine.
    for stop in [json!(null), json!("zz"), json!(["zz", "yy", "xx", "ww"])] {
        let (st, v) = s
            .post(
                "/v1/completions",
                &json!({"prompt": "x", "max_tokens": 1, "stop": stop}),
            )
            .await;
        assert_eq!(st, 200, "{stop}: {v}");
    }
    // `prompt` is read the same way (a list of numbers is a token-id prompt, so a
    // mixed list is the error).
    let (st, v) = s
        .post("/v1/completions", &json!({"prompt": [1, true]}))
        .await;
    assert_error(st, &v, 400, "invalid_type");
    assert_names(
        &v,
        Some("prompt"),
        &[
            "'prompt' must be a string, an array of strings",
            "element 1",
        ],
    );
    still_healthy(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_content_of_the_wrong_type() {
    let s = start(|_| {}).await;
    let chat = |content: serde_json::Value| {
        json!({"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": content},
        ]})
    };
    let rule = "'messages[1].content' must be a string or an array of content parts";
    for (content, found) in [
        (json!(5), "the number 5"),
        (json!(true), "the boolean true"),
        (json!({"type": "text", "text": "x"}), "an object"),
    ] {
        let (st, v) = s.post("/v1/chat/completions", &chat(content)).await;
        assert_error(st, &v, 400, "invalid_type");
        assert_names(&v, Some("messages[1].content"), &[rule, found]);
    }
    // A part that is not an object names the part.
    for part in [json!(5), json!("hi"), json!(["text", "hi"])] {
        let (st, v) = s.post("/v1/chat/completions", &chat(json!([part]))).await;
        assert_error(st, &v, 400, "invalid_type");
        assert_names(
            &v,
            Some("messages[1].content[0]"),
            &["'messages[1].content[0]' must be a content part object"],
        );
    }
    // Image (and other non-text) parts: only text is supported.
    for part in [
        json!({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}),
        json!({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}),
    ] {
        let (st, v) = s
            .post(
                "/v1/chat/completions",
                &chat(json!([{"type": "text", "text": "what is this?"}, part])),
            )
            .await;
        assert_error(st, &v, 400, "invalid_value");
        assert_names(
            &v,
            Some("messages[1].content[1].type"),
            &[
                "only text content parts are supported",
                "messages[1].content[1]",
            ],
        );
    }
    // A text part with a wrongly typed, missing or unknown field.
    let cases = [
        (
            json!({"type": "text", "text": 7}),
            "invalid_type",
            "messages[1].content[0].text",
            "must be a string",
        ),
        (
            json!({"type": 3, "text": "x"}),
            "invalid_type",
            "messages[1].content[0].type",
            "must be a string",
        ),
        (
            json!({"text": "x"}),
            "invalid_type",
            "messages[1].content[0]",
            "'type'",
        ),
        (
            json!({"type": "text"}),
            "invalid_value",
            "messages[1].content[0].text",
            "needs a string 'text'",
        ),
        (
            json!({"type": "text", "text": "x", "txet": "y"}),
            "invalid_value",
            "messages[1].content[0].txet",
            "unknown field \"txet\"",
        ),
    ];
    for (part, code, param, words) in cases {
        let (st, v) = s.post("/v1/chat/completions", &chat(json!([part]))).await;
        assert_error(st, &v, 400, code);
        assert_names(&v, Some(param), &[words]);
    }
    still_healthy(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_segments_name_segments() {
    let s = start(|_| {}).await;
    let (st, v) = s.post("/v1/completions", &json!({"segments": []})).await;
    assert_error(st, &v, 400, "invalid_value");
    assert_names(&v, Some("segments"), &["'segments'", "empty array"]);
    // Segments that are all empty text: the prompt is empty, and it came from `segments`.
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"segments": [{"text": ""}, {"text": ""}]}),
        )
        .await;
    assert_error(st, &v, 400, "invalid_value");
    assert_names(&v, Some("segments"), &["'segments'", "empty"]);
    let (st, v) = s.post("/v1/completions", &json!({"prompt": ""})).await;
    assert_error(st, &v, 400, "invalid_value");
    assert_names(&v, Some("prompt"), &["'prompt' is empty"]);
    let (st, v) = s
        .post("/v1/completions", &json!({"prompt": ["hello", ""]}))
        .await;
    assert_error(st, &v, 400, "invalid_value");
    assert_names(&v, Some("prompt"), &["'prompt[1]' is empty"]);
    still_healthy(&s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_null_and_empty_content() {
    let s = start(|_| {}).await;
    let post = |msgs: serde_json::Value| {
        let s = &s;
        async move {
            s.post(
                "/v1/chat/completions",
                &json!({"messages": msgs, "max_tokens": 1}),
            )
            .await
        }
    };
    // Null or missing content: only valid for assistant tool calls (not supported).
    for role in ["user", "system", "assistant"] {
        for msg in [
            json!({"role": role, "content": null}),
            json!({"role": role}),
        ] {
            let (st, v) = post(json!([{"role": "user", "content": "hi"}, msg])).await;
            assert_error(st, &v, 400, "invalid_value");
            assert_names(
                &v,
                Some("messages[1].content"),
                &[
                    "'messages[1].content' is missing or null",
                    &format!("role {role:?}"),
                ],
            );
        }
    }
    // Null content is fine for an assistant message with tool calls; tool calls that
    // are not an array are not.
    let (st, v) = post(json!([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": null,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ]))
    .await;
    assert_eq!(st, 200, "{v}");
    let (st, v) = post(json!([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": {"id": "c1"}},
    ]))
    .await;
    assert_error(st, &v, 400, "invalid_value");
    assert_names(&v, Some("messages[1].tool_calls"), &["must be an array"]);
    // An empty array of parts.
    for role in ["user", "system"] {
        let (st, v) = post(json!([
            {"role": "user", "content": "hi"},
            {"role": role, "content": []},
        ]))
        .await;
        assert_error(st, &v, 400, "invalid_value");
        assert_names(
            &v,
            Some("messages[1].content"),
            &["'messages[1].content' is an empty array"],
        );
    }
    // Empty strings: fine in a conversation with text, a 400 when all are empty.
    for msgs in [
        json!([{"role": "user", "content": ""}]),
        json!([{"role": "system", "content": ""}, {"role": "user", "content": ""}]),
        json!([{"role": "user", "content": [{"type": "text", "text": ""}]}]),
    ] {
        let (st, v) = post(msgs.clone()).await;
        assert_error(st, &v, 400, "invalid_value");
        assert_names(&v, Some("messages"), &["'messages'", "empty content"]);
    }
    for msgs in [
        json!([{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]),
        json!([{"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "hi"}]}]),
    ] {
        let (st, v) = post(msgs.clone()).await;
        assert_eq!(st, 200, "{msgs}: {v}");
    }
    still_healthy(&s).await;
}
