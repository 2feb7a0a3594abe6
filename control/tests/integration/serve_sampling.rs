//! Sampling controls, token-id prompts and the small OpenAI-surface details of
//! `hypic serve` (issue 22, items 3 and 4): penalties and `logit_bias` are validated
//! field by field and change the output, unsupported fields are a 400 naming the
//! field, a prompt of token ids answers exactly as its text, `/v1/models` carries
//! `created`, and errors a retry cannot fix say `x-should-retry: false`.
use crate::serve_common;

use dataplane::tokenizer::Tokenizer;
use reqwest::Method;
use serde_json::{json, Value};
use serve_common::{assert_error, golden_model, start};

const CHAT: &str = "/v1/chat/completions";
const COMPL: &str = "/v1/completions";

fn chat(extra: Value) -> Value {
    let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    b.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    b
}

fn compl(extra: Value) -> Value {
    let mut b = json!({"prompt": "The cat sat on", "max_tokens": 4});
    b.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_controls_are_400s_naming_the_field() {
    let s = start(|_| {}).await;
    let cases = [
        (json!({"presence_penalty": 2.5}), "presence_penalty"),
        (json!({"presence_penalty": -3}), "presence_penalty"),
        (json!({"frequency_penalty": 2.01}), "frequency_penalty"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"repetition_penalty": -1.0}), "repetition_penalty"),
        (json!({"repetition_penalty": 11}), "repetition_penalty"),
        (json!({"logit_bias": {"5": 101}}), "logit_bias"),
        (json!({"logit_bias": {"5": -100.5}}), "logit_bias"),
        (json!({"logit_bias": {"abc": 1}}), "logit_bias"),
        (json!({"logit_bias": {"-1": 1}}), "logit_bias"),
        (json!({"logit_bias": {"99999999": 1}}), "logit_bias"),
        (json!({"min_tokens": -1}), "min_tokens"),
        (json!({"min_tokens": 5}), "min_tokens"),
    ];
    for (path, body) in [(CHAT, chat as fn(Value) -> Value), (COMPL, compl)] {
        for (extra, field) in &cases {
            let b = body(extra.clone());
            let (st, v) = s.post(path, &b).await;
            assert_error(st, &v, 400, "invalid_value");
            assert_eq!(v["error"]["param"], *field, "{path} {b}: {v}");
        }
        // In range: accepted.
        let b = body(json!({"presence_penalty": -2, "frequency_penalty": 2,
            "repetition_penalty": 1.3, "logit_bias": {"7": -100, "8": 100}, "min_tokens": 4}));
        let (st, v) = s.post(path, &b).await;
        assert_eq!(st, 200, "{path}: {v}");
    }
    // A wrong type is a 400 naming the field too.
    let (st, v) = s
        .post(CHAT, &chat(json!({"logit_bias": {"5": "high"}})))
        .await;
    assert_error(st, &v, 400, "invalid_type");
    assert!(v.to_string().contains("logit_bias"), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_fields_are_400s_naming_the_field() {
    let s = start(|_| {}).await;
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    for (path, body, field) in [
        (CHAT, chat(json!({"functions": []})), "functions"),
        (CHAT, chat(json!({"frobnicate": 1})), "frobnicate"),
        (COMPL, compl(json!({"suffix": "x"})), "suffix"),
        (COMPL, compl(json!({"best_of": 2})), "best_of"),
        (COMPL, compl(json!({"tools": tools})), "tools"),
    ] {
        let (st, v) = s.post(path, &body).await;
        assert_error(st, &v, 400, "unsupported_parameter");
        assert_eq!(v["error"]["param"], field, "{path} {body}: {v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(field),
            "{v}"
        );
    }
    // The default format and `user` are accepted.
    let (st, v) = s
        .post(
            CHAT,
            &chat(json!({"response_format": {"type": "text"}, "user": "u"})),
        )
        .await;
    assert_eq!(st, 200, "{v}");
}

/// Greedy completion text of `body` (one choice).
async fn text_of(s: &serve_common::Srv, body: &Value) -> (String, Value) {
    let (st, v) = s.post(COMPL, body).await;
    assert_eq!(st, 200, "{body}: {v}");
    (v["choices"][0]["text"].as_str().unwrap().to_string(), v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_and_min_tokens_change_greedy_output() {
    let s = start(|_| {}).await;
    let tok = Tokenizer::from_dir(&golden_model()).unwrap();
    let base = json!({"prompt": "The cat sat on", "max_tokens": 6, "temperature": 0,
        "ignore_eos": true});
    let (plain, _) = text_of(&s, &base).await;
    // A +100 bias on one token makes greedy decoding emit only that token.
    let forced = tok.encode(" dog").unwrap()[0];
    let mut b = base.clone();
    b["logit_bias"] = json!({ forced.to_string(): 100 });
    let (biased, v) = text_of(&s, &b).await;
    assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
    assert_eq!(
        biased,
        tok.decode(&[forced; 6]).unwrap(),
        "plain: {plain:?}"
    );
    // A large frequency penalty forbids the repeat the bias would cause: tokens
    // differ from the all-`forced` answer after the first.
    b["frequency_penalty"] = json!(2);
    b["logit_bias"] = json!({ forced.to_string(): 1.5 });
    let (penalised, _) = text_of(&s, &b).await;
    assert_ne!(penalised, biased);
    // min_tokens: with every token but an EOS id suppressed, generation still runs
    // min_tokens tokens before the EOS can end it.
    let eos = *tok
        .eos_ids
        .first()
        .expect("the golden model has an EOS token");
    let b = json!({"prompt": "The cat sat on", "max_tokens": 6, "temperature": 0,
        "logit_bias": { eos.to_string(): 100 }});
    let (st, v) = s.post(COMPL, &b).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["usage"]["completion_tokens"], 0,
        "EOS first without min_tokens: {v}"
    );
    let mut b2 = b.clone();
    b2["min_tokens"] = json!(3);
    let (st, v) = s.post(COMPL, &b2).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_id_prompts_answer_as_their_text() {
    let s = start(|_| {}).await;
    let tok = Tokenizer::from_dir(&golden_model()).unwrap();
    let (a, b) = ("The cat sat on", "Once upon a time");
    let ids_a = tok.encode(a).unwrap();
    let ids_b = tok.encode(b).unwrap();
    let opts = json!({"max_tokens": 5, "temperature": 0, "ignore_eos": true});
    let with = |p: Value| {
        let mut x = opts.clone();
        x["prompt"] = p;
        x
    };
    let (text_a, va) = text_of(&s, &with(json!(a))).await;
    let (ids_out, vi) = text_of(&s, &with(json!(ids_a))).await;
    assert_eq!(ids_out, text_a);
    assert_eq!(va["usage"]["prompt_tokens"], vi["usage"]["prompt_tokens"]);
    // Several prompts as lists of ids: one choice each, in order, as the texts.
    let (st, many_text) = s.post(COMPL, &with(json!([a, b]))).await;
    assert_eq!(st, 200, "{many_text}");
    let (st, many_ids) = s.post(COMPL, &with(json!([ids_a, ids_b]))).await;
    assert_eq!(st, 200, "{many_ids}");
    let texts = |v: &Value| -> Vec<String> {
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["text"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(texts(&many_ids), texts(&many_text));
    assert_eq!(texts(&many_ids).len(), 2);
    // Echo gives the prompt's text back.
    let mut e = with(json!(ids_a));
    e["echo"] = json!(true);
    let (echoed, _) = text_of(&s, &e).await;
    assert_eq!(echoed, format!("{a}{text_a}"));
    // Out-of-range ids name their index; a list mixing kinds is a type error.
    let (st, v) = s.post(COMPL, &with(json!([1, 2, 4096]))).await;
    assert_error(st, &v, 400, "invalid_value");
    assert_eq!(v["error"]["param"], "prompt[2]", "{v}");
    let (st, v) = s.post(COMPL, &with(json!([[1, 2], [3, -1]]))).await;
    assert_error(st, &v, 400, "invalid_value");
    assert_eq!(v["error"]["param"], "prompt[1][1]", "{v}");
    let (st, v) = s.post(COMPL, &with(json!([1, "x"]))).await;
    assert_error(st, &v, 400, "invalid_type");
    let (st, v) = s.post(COMPL, &with(json!([]))).await;
    assert_error(st, &v, 400, "invalid_value");
    let (st, v) = s.post(COMPL, &with(json!([[]]))).await;
    assert_error(st, &v, 400, "invalid_value");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_have_created_and_unfixable_errors_say_do_not_retry() {
    let s = start(|_| {}).await;
    let (st, v) = s.get("/v1/models").await;
    assert_eq!(st, 200);
    let created = v["data"][0]["created"].as_u64().unwrap();
    assert!(created > 1_700_000_000, "{v}");
    let (_, one) = s.get("/v1/models/tiny").await;
    assert_eq!(one["created"].as_u64(), Some(created));
    let header = |h: &reqwest::header::HeaderMap| {
        h.get("x-should-retry")
            .map(|v| v.to_str().unwrap().to_string())
    };
    // 400 (bad field), 404 (unknown model), 409 (catalog version conflict).
    let (st, h, _) = s
        .raw(
            Method::POST,
            COMPL,
            Some(&s.token),
            br#"{"prompt": "x", "temperature": 9}"#.to_vec(),
        )
        .await;
    assert_eq!((st, header(&h).as_deref()), (400, Some("false")));
    let (st, h, _) = s
        .raw(
            Method::POST,
            COMPL,
            Some(&s.token),
            br#"{"prompt": "x", "model": "gpt-9"}"#.to_vec(),
        )
        .await;
    assert_eq!((st, header(&h).as_deref()), (404, Some("false")));
    let (st, v) = s
        .post(
            "/v1/segments",
            &json!({"id": "doc", "content": "some text"}),
        )
        .await;
    assert!(st == 200 || st == 201, "{v}");
    let (st, h, v) = s
        .raw(
            Method::POST,
            COMPL,
            Some(&s.token),
            serde_json::to_vec(&json!({"segments": [{"id": "doc", "version": 7}, {"text": "q"}]}))
                .unwrap(),
        )
        .await;
    assert_eq!((st, header(&h).as_deref()), (409, Some("false")), "{v}");
    // A 401 can be fixed (by a token): no header.
    let (st, h, _) = s
        .raw(Method::POST, COMPL, None, br#"{"prompt": "x"}"#.to_vec())
        .await;
    assert_eq!((st, header(&h)), (401, None));
}
