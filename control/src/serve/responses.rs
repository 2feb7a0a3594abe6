//! `POST /v1/responses`: the non-stateful subset of OpenAI's Responses API over the
//! chat path.
//!
//! A request is translated into a chat request (`instructions` → a system message;
//! each `input` item → a message, so each item is a segment exactly as a chat message
//! is; `function_call` items → assistant `tool_calls`; `function_call_output` items →
//! `tool` messages; flat function `tools` → chat tools; `text.format` →
//! `response_format`; `max_output_tokens` → `max_completion_tokens`), served by the
//! chat route, and its answer rewritten as a `response` object (`output` of `message`
//! and `function_call` items, `usage` with `input_tokens`/`output_tokens`).
//!
//! Not supported (400 `unsupported_parameter`): state (`previous_response_id`,
//! `conversation`), `stream`, background mode, and tool types other than `function`.
//! `store` is accepted and nothing is stored (`"store": false` in the answer).
use super::errors::parse_json;
use super::routes::{chat_inner, finish_response, rand_id, Tenant};
use super::types::unsupported_field;
use super::AppState;
use crate::error::ApiError;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

/// Fields of a responses request that the server reads.
pub const RESPONSES_FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "seed",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "store",
    "metadata",
    "user",
    "hypic",
];

/// `POST /v1/responses`.
#[utoipa::path(post, path = "/v1/responses", tag = "inference", summary = "OpenAI Responses API (non-stateful subset) with segment reuse: each input item is a segment", security(("bearer" = [])), request_body(content = Object, description = "Responses body: input (text or items), instructions, tools, tool_choice, text.format, max_output_tokens; the `hypic` extension is HYPIC's"), responses((status = 200, body = Object), (status = 400, description = "invalid input or an unsupported (stateful) field", body = crate::error::ErrorBody), (status = 401, description = "no or bad token", body = crate::error::ErrorBody), (status = 429, description = "queue full (`Retry-After`)", body = crate::error::ErrorBody)))]
pub async fn responses(
    State(s): State<AppState>,
    Tenant(p): Tenant,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = responses_inner(&s, &p, body).await;
    finish_response(&s, "responses", r)
}

async fn responses_inner(
    s: &AppState,
    p: &crate::auth::Principal,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(|e| super::routes::body_error(e, s.0.cfg.max_body_bytes))?;
    let req: Map<String, Value> = parse_json(&body)?;
    if let Some(f) = unsupported_field(&body, RESPONSES_FIELDS) {
        let why = match f.as_str() {
            "previous_response_id" | "conversation" | "background" => {
                "this server keeps no response state; send the whole input"
            }
            "stream" => "streaming is served on /v1/chat/completions; /v1/responses answers whole",
            _ => "it is not supported by this server",
        };
        return Err(ApiError {
            param: Some(f.clone()),
            ..ApiError::invalid(
                "unsupported_parameter",
                format!("the parameter '{f}' is not supported on /v1/responses: {why}"),
            )
        });
    }
    let chat = to_chat(&req)?;
    let bytes =
        Bytes::from(serde_json::to_vec(&chat).map_err(|e| ApiError::internal(e.to_string()))?);
    let out = match chat_inner(s, p, Ok(bytes)).await {
        Ok(r) => r,
        Err(mut e) => {
            e.param = e.param.map(|x| rename_param(&x));
            return Err(e);
        }
    };
    let (parts, b) = out.into_parts();
    if !parts.status.is_success() {
        return Ok(Response::from_parts(parts, b));
    }
    let bytes = axum::body::to_bytes(b, usize::MAX)
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| ApiError::internal(e.to_string()))?;
    let mut r = Json(to_response(&req, &v)).into_response();
    if let Some(stats) = parts.extensions.get::<super::reqlog::RequestStats>() {
        r.extensions_mut().insert(stats.clone());
    }
    Ok(r)
}

/// A chat field's name as the responses request spells it.
fn rename_param(p: &str) -> String {
    for (from, to) in [
        ("messages", "input"),
        ("response_format.json_schema", "text.format"),
        ("response_format", "text.format"),
        ("max_completion_tokens", "max_output_tokens"),
        ("tool_choice.function.name", "tool_choice.name"),
    ] {
        if let Some(rest) = p.strip_prefix(from) {
            // Chat message indices are shifted by `instructions`; name the field only.
            let rest = if to == "input" { "" } else { rest };
            return format!("{to}{rest}");
        }
    }
    if let Some(rest) = p.strip_prefix("tools[") {
        return format!("tools[{}", rest.replacen(".function", "", 1));
    }
    p.to_string()
}

fn bad(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::invalid_param(param, msg)
}

/// The chat request of a responses request.
fn to_chat(req: &Map<String, Value>) -> Result<Value, ApiError> {
    let mut messages: Vec<Value> = vec![];
    match req.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) => messages.push(json!({"role": "system", "content": t})),
        Some(_) => return Err(bad("instructions", "'instructions' must be a string")),
    }
    match req.get("input") {
        Some(Value::String(t)) => messages.push(json!({"role": "user", "content": t})),
        Some(Value::Array(items)) => {
            for (i, it) in items.iter().enumerate() {
                input_item(i, it, &mut messages)?;
            }
        }
        None | Some(Value::Null) => return Err(bad("input", "'input' is required")),
        Some(_) => {
            return Err(bad(
                "input",
                "'input' must be a string or an array of items",
            ))
        }
    }
    let mut chat = json!({ "messages": messages });
    for k in [
        "model",
        "temperature",
        "top_p",
        "seed",
        "parallel_tool_calls",
        "user",
        "hypic",
    ] {
        if let Some(v) = req.get(k) {
            chat[k] = v.clone();
        }
    }
    if let Some(v) = req.get("max_output_tokens") {
        chat["max_completion_tokens"] = v.clone();
    }
    if let Some(t) = req.get("tools").filter(|t| !t.is_null()) {
        let list = t
            .as_array()
            .ok_or_else(|| bad("tools", "'tools' must be an array"))?;
        let mut out = vec![];
        for (i, tool) in list.iter().enumerate() {
            if tool.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad(
                    &format!("tools[{i}].type"),
                    "only tools of type \"function\" are supported",
                ));
            }
            let mut f = Map::new();
            for k in ["name", "description", "parameters", "strict"] {
                if let Some(v) = tool.get(k) {
                    f.insert(k.into(), v.clone());
                }
            }
            out.push(json!({"type": "function", "function": f}));
        }
        chat["tools"] = json!(out);
    }
    match req.get("tool_choice") {
        None | Some(Value::Null) => {}
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            chat["tool_choice"] = json!({"type": "function", "function": {"name": o.get("name")}});
        }
        Some(v) => chat["tool_choice"] = v.clone(),
    }
    if let Some(fmt) = req.get("text").and_then(|t| t.get("format")) {
        let kind = fmt.get("type").and_then(Value::as_str).unwrap_or("");
        chat["response_format"] = match kind {
            "json_schema" => {
                let mut js = Map::new();
                for k in ["name", "description", "schema", "strict"] {
                    if let Some(v) = fmt.get(k) {
                        js.insert(k.into(), v.clone());
                    }
                }
                json!({"type": "json_schema", "json_schema": js})
            }
            _ => json!({"type": kind}),
        };
    }
    Ok(chat)
}

/// The text of a content given as a string or as `input_text`/`output_text` parts.
fn content_parts(param: &str, c: &Value) -> Result<Value, ApiError> {
    match c {
        Value::String(_) => Ok(c.clone()),
        Value::Array(parts) => {
            let mut out = vec![];
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                if !matches!(kind, "input_text" | "output_text" | "text") {
                    return Err(bad(
                        &format!("{param}[{j}].type"),
                        format!("only text parts are supported, not {kind:?}"),
                    ));
                }
                let text = p.get("text").and_then(Value::as_str).ok_or_else(|| {
                    bad(
                        &format!("{param}[{j}].text"),
                        "a text part needs a string 'text'",
                    )
                })?;
                out.push(json!({"type": "text", "text": text}));
            }
            Ok(json!(out))
        }
        _ => Err(bad(
            param,
            "content must be a string or an array of text parts",
        )),
    }
}

fn input_item(i: usize, it: &Value, messages: &mut Vec<Value>) -> Result<(), ApiError> {
    let p = format!("input[{i}]");
    let kind = it.get("type").and_then(Value::as_str).unwrap_or("message");
    match kind {
        "message" => {
            let role = it.get("role").and_then(Value::as_str).unwrap_or("");
            if !["system", "developer", "user", "assistant"].contains(&role) {
                return Err(bad(
                    &format!("{p}.role"),
                    format!("unknown role {role:?} (system, developer, user or assistant)"),
                ));
            }
            let c = it
                .get("content")
                .ok_or_else(|| bad(&format!("{p}.content"), "a message needs 'content'"))?;
            messages.push(json!({"role": role, "content": content_parts(&format!("{p}.content"), c)?}));
        }
        "function_call" => {
            let name = it.get("name").and_then(Value::as_str).ok_or_else(|| {
                bad(&format!("{p}.name"), "a function_call item needs a string 'name'")
            })?;
            let call = json!({"id": it.get("call_id"), "type": "function",
                "function": {"name": name, "arguments": it.get("arguments").cloned().unwrap_or(json!("{}"))}});
            // Consecutive calls belong to one assistant turn.
            match messages.last_mut() {
                Some(m) if m["role"] == "assistant" && m["tool_calls"].is_array() => {
                    if let Some(a) = m["tool_calls"].as_array_mut() {
                        a.push(call);
                    }
                }
                _ => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
        }
        "function_call_output" => {
            let out = match it.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
                None => return Err(bad(&format!("{p}.output"), "a function_call_output needs 'output'")),
            };
            messages.push(json!({"role": "tool", "tool_call_id": it.get("call_id"), "content": out}));
        }
        other => {
            return Err(bad(
                &format!("{p}.type"),
                format!("input items of type {other:?} are not supported (message, function_call, function_call_output)"),
            ))
        }
    }
    Ok(())
}

/// The `response` object of a chat completion `v` answering `req`.
fn to_response(req: &Map<String, Value>, v: &Value) -> Value {
    let c = &v["choices"][0];
    let m = &c["message"];
    let mut output = vec![];
    if let Some(t) = m["content"].as_str().filter(|t| !t.is_empty()) {
        output.push(
            json!({"type": "message", "id": rand_id("msg"), "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": t, "annotations": []}]}),
        );
    }
    for tc in m["tool_calls"].as_array().into_iter().flatten() {
        output.push(
            json!({"type": "function_call", "id": rand_id("fc"), "status": "completed",
            "call_id": tc["id"], "name": tc["function"]["name"],
            "arguments": tc["function"]["arguments"]}),
        );
    }
    let incomplete = c["finish_reason"] == "length";
    let u = &v["usage"];
    json!({
        "id": rand_id("resp"),
        "object": "response",
        "created_at": v["created"],
        "status": if incomplete { "incomplete" } else { "completed" },
        "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "error": null,
        "model": v["model"],
        "output": output,
        "instructions": req.get("instructions").cloned().unwrap_or(Value::Null),
        "max_output_tokens": req.get("max_output_tokens").cloned().unwrap_or(Value::Null),
        "temperature": req.get("temperature").cloned().unwrap_or(json!(1.0)),
        "top_p": req.get("top_p").cloned().unwrap_or(json!(1.0)),
        "tools": req.get("tools").cloned().unwrap_or(json!([])),
        "tool_choice": req.get("tool_choice").cloned().unwrap_or(json!("auto")),
        "parallel_tool_calls": req.get("parallel_tool_calls").cloned().unwrap_or(json!(true)),
        "text": req.get("text").cloned().unwrap_or(json!({"format": {"type": "text"}})),
        "metadata": req.get("metadata").cloned().unwrap_or(json!({})),
        "store": false,
        "usage": {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"],
        },
        "hypic": v["hypic"],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn items_become_messages_and_tools_chat_tools() {
        let req = map(json!({
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "3C"}
            ],
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "w"},
            "text": {"format": {"type": "json_schema", "name": "f", "schema": {"type": "object"}}},
            "max_output_tokens": 9
        }));
        let c = to_chat(&req).unwrap();
        let m = c["messages"].as_array().unwrap();
        assert_eq!(m.len(), 4);
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(
            m[1]["content"][0],
            json!({"type": "text", "text": "Weather?"})
        );
        assert_eq!(m[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(m[3]["role"], "tool");
        assert_eq!(m[3]["tool_call_id"], "c1");
        assert_eq!(c["tools"][0]["function"]["name"], "w");
        assert_eq!(c["tool_choice"]["function"]["name"], "w");
        assert_eq!(c["response_format"]["json_schema"]["name"], "f");
        assert_eq!(c["max_completion_tokens"], 9);
    }

    #[test]
    fn bad_items_name_the_field() {
        for (input, param) in [
            (json!([{"type": "image", "url": "x"}]), "input[0].type"),
            (json!([{"role": "robot", "content": "x"}]), "input[0].role"),
            (
                json!([{"role": "user", "content": [{"type": "input_image"}]}]),
                "input[0].content[0].type",
            ),
            (
                json!([{"type": "function_call_output", "call_id": "c"}]),
                "input[0].output",
            ),
            (json!(3), "input"),
        ] {
            let e = to_chat(&map(json!({"input": input}))).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param));
        }
        assert_eq!(rename_param("messages[3].content"), "input");
        assert_eq!(
            rename_param("response_format.json_schema.schema"),
            "text.format.schema"
        );
        assert_eq!(rename_param("tools[1].function.name"), "tools[1].name");
    }
}
