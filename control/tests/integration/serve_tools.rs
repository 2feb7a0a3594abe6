//! Tool calling over HTTP (issue 22, item 2): a required or named `tool_choice` is
//! enforced with a grammar, so even the random golden model makes a well-formed call
//! whose arguments match the schema, streamed and not; calls in the conversation and
//! `tool` results are accepted; the tool list is a segment of its own, so the same
//! tools in another conversation are a hit; a template that renders `tools` itself
//! gets them.
use crate::serve_common;

use hypic_control::serve::prompt::chat_segments;
use hypic_control::serve::tools::ToolSet;
use hypic_control::serve::types::ChatMessageIn;
use serde_json::{json, Value};
use serve_common::{assert_error, golden_model, start};

const CHAT: &str = "/v1/chat/completions";

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8},
                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time",
            "parameters": {"type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"], "additionalProperties": false}}}
    ])
}

fn check_weather(args: &str) {
    let a: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{e}: {args}"));
    assert!(a["city"].as_str().unwrap().chars().count() <= 8, "{args}");
    assert!((1..=7).contains(&a["days"].as_i64().unwrap()), "{args}");
    assert_eq!(a.as_object().unwrap().len(), 2, "{args}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_or_required_choice_is_a_well_formed_call() {
    let s = start(|_| {}).await;
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    for seed in 0..3 {
        let body = json!({"messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": tools(), "tool_choice": named, "max_tokens": 96, "temperature": 1.0,
            "seed": seed, "n": 2, "parallel_tool_calls": false});
        let (st, v) = s.post(CHAT, &body).await;
        assert_eq!(st, 200, "{v}");
        for c in v["choices"].as_array().unwrap() {
            assert_eq!(c["finish_reason"], "tool_calls", "{v}");
            let m = &c["message"];
            assert!(m["content"].is_null(), "{v}");
            let calls = m["tool_calls"].as_array().unwrap();
            assert_eq!(calls.len(), 1, "{v}");
            for call in calls {
                assert_eq!(call["type"], "function");
                assert!(call["id"].as_str().unwrap().starts_with("call"));
                assert_eq!(call["function"]["name"], "get_weather", "{v}");
                check_weather(call["function"]["arguments"].as_str().unwrap());
            }
        }
    }
    // required, one call only: the name is one of the tools, the arguments its own.
    let body = json!({"messages": [{"role": "user", "content": "Time?"}],
        "tools": tools(), "tool_choice": "required", "parallel_tool_calls": false,
        "max_tokens": 160, "temperature": 0.8, "seed": 5});
    let (st, v) = s.post(CHAT, &body).await;
    assert_eq!(st, 200, "{v}");
    let calls = v["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"));
    assert_eq!(calls.len(), 1, "{v}");
    let f = &calls[0]["function"];
    let args = f["arguments"].as_str().unwrap();
    match f["name"].as_str().unwrap() {
        "get_weather" => check_weather(args),
        "get_time" => {
            let a: Value = serde_json::from_str(args).unwrap();
            assert!(a["zone"] == "UTC" || a["zone"] == "CET", "{args}");
        }
        other => panic!("unknown tool {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_forced_call_arrives_as_tool_call_deltas() {
    let s = start(|_| {}).await;
    let body = json!({"messages": [{"role": "user", "content": "Weather?"}],
        "tools": tools(), "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 96, "temperature": 1.0, "seed": 3, "stream": true,
        "parallel_tool_calls": false});
    let (st, data) = s.stream(CHAT, &body).await;
    assert_eq!(st, 200, "{data:?}");
    let (mut name, mut args, mut content, mut finish) =
        (String::new(), String::new(), String::new(), Value::Null);
    for d in data.iter().filter(|d| *d != "[DONE]") {
        let v: Value = serde_json::from_str(d).unwrap();
        let c = &v["choices"][0];
        if let Some(t) = c["delta"]["content"].as_str() {
            content.push_str(t);
        }
        if let Some(calls) = c["delta"]["tool_calls"].as_array() {
            for call in calls {
                assert_eq!(call["index"], 0, "{d}");
                name.push_str(call["function"]["name"].as_str().unwrap_or(""));
                args.push_str(call["function"]["arguments"].as_str().unwrap_or(""));
            }
        }
        if !c["finish_reason"].is_null() {
            finish = c["finish_reason"].clone();
        }
    }
    assert_eq!(finish, "tool_calls", "{data:?}");
    assert_eq!(name, "get_weather");
    assert!(content.trim().is_empty(), "{content:?}");
    check_weather(&args);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_tools_in_another_conversation_are_a_segment_hit() {
    let s = start(|_| {}).await;
    let ask = |system: &str, user: &str| {
        json!({"messages": [{"role": "system", "content": system},
                            {"role": "user", "content": user}],
               "tools": tools(), "max_tokens": 2, "temperature": 0})
    };
    let (st, v1) = s.post(CHAT, &ask("You are terse.", "hi")).await;
    assert_eq!(st, 200, "{v1}");
    let outcomes = |v: &Value| -> Vec<Value> {
        v["hypic"]["segments"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["outcome"].clone())
            .collect()
    };
    // System text, tool list, user turn.
    assert_eq!(outcomes(&v1).len(), 3, "{v1}");
    let (st, v2) = s.post(CHAT, &ask("Be kind.", "what is the time?")).await;
    assert_eq!(st, 200, "{v2}");
    let o = outcomes(&v2);
    assert_eq!(o[1], "hit", "the tool list: {v2}");
    assert_eq!(o[0], "miss", "{v2}");
    let tools_tokens = v2["hypic"]["segments"][1]["tokens"].as_u64().unwrap();
    assert!(tools_tokens > 50, "{v2}");
    assert!(
        v2["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_and_tool_results_in_the_conversation_and_bad_tools() {
    let s = start(|_| {}).await;
    let convo = json!([
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 3}"}
    ]);
    let body = json!({"messages": convo, "tools": tools(), "max_tokens": 4, "temperature": 0});
    let (st, v) = s.post(CHAT, &body).await;
    assert_eq!(st, 200, "{v}");
    // tool_choice none: nothing is parsed, the tools are still rendered.
    let mut b = body.clone();
    b["tool_choice"] = json!("none");
    let (st, v2) = s.post(CHAT, &b).await;
    assert_eq!(st, 200, "{v2}");
    assert!(
        v2["choices"][0]["message"].get("tool_calls").is_none(),
        "{v2}"
    );
    assert_eq!(v["usage"]["prompt_tokens"], v2["usage"]["prompt_tokens"]);
    for (patch, param) in [
        (
            json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]}),
            "tools[0].function.name",
        ),
        (json!({"tool_choice": "always"}), "tool_choice"),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice.function.name",
        ),
        (
            json!({"tool_choice": "required",
                "response_format": {"type": "json_object"}}),
            "tool_choice",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
            "messages[0].tool_calls",
        ),
        (
            json!({"messages": [{"role": "assistant", "content": null,
                 "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]}),
            "messages[0].tool_calls[0].function.name",
        ),
    ] {
        let mut b = body.clone();
        for (k, val) in patch.as_object().unwrap() {
            b[k] = val.clone();
        }
        let (st, v) = s.post(CHAT, &b).await;
        assert_error(st, &v, 400, "invalid_value");
        assert_eq!(v["error"]["param"], param, "{b}: {v}");
    }
}

#[test]
fn a_template_that_reads_tools_renders_them_and_the_calls() {
    // The golden tokenizer with a template in the style of Qwen's: tools in the
    // system turn, assistant calls from `tool_calls`.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        golden_model().join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    let tpl = "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n{%- endif %}{%- for m in messages %}{%- if not (tools and loop.first and m.role == 'system') %}<|im_start|>{{ m.role }}\n{{ m.content }}{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}:{{ c.function.arguments.city }}</tool_call>{% endfor %}{%- endif %}<|im_end|>\n{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}";
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        json!({"chat_template": tpl, "eos_token": "<|im_end|>"}).to_string(),
    )
    .unwrap();
    let tok = dataplane::tokenizer::Tokenizer::from_dir(dir.path()).unwrap();
    assert!(tok.template_renders_tools());
    let msgs: Vec<ChatMessageIn> = serde_json::from_value(json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 2}"}}]}
    ]))
    .unwrap();
    let t = ToolSet::parse(Some(&tools()), None, None).unwrap().unwrap();
    let segs = chat_segments(&tok, &msgs, Some(&t)).unwrap();
    let joined = segs.concat();
    assert!(joined.contains("TOOLS:get_weather;get_time;"), "{segs:?}");
    // Arguments reach the template as an object.
    assert!(
        joined.contains("<tool_call>get_weather:Oslo</tool_call>"),
        "{segs:?}"
    );
    // The tool list is its own segment, cut after the system prompt's text.
    assert!(segs[0].ends_with("Be brief."), "{segs:?}");
    assert!(segs[1].starts_with("\n\nTOOLS:"), "{segs:?}");
}
