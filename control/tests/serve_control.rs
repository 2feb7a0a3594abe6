//! The control plane inside `hypic serve`, end to end over a loopback port:
//! group grants against the real pools.
mod serve_common;

use hypic_control::auth::{load_or_create_secret, mint_token};
use hypic_control::catalog::Role;
use serde_json::{json, Value};
use serve_common::{assert_error, start, Srv};

const DOC_A: &str = "Document A. The river flows north through the old city and the market square.";
const Q: &str = "Question: where does the river flow?";

fn outcomes(v: &Value) -> Vec<String> {
    v["hypic"]["segments"]
        .as_array()
        .unwrap_or_else(|| panic!("no segments in {v}"))
        .iter()
        .map(|s| s["outcome"].as_str().unwrap().to_string())
        .collect()
}

fn token_for(s: &Srv, tenant: &str, role: Role) -> String {
    let (secret, _) = load_or_create_secret(&s.server.state.config().data_dir).unwrap();
    mint_token(&secret, "hypic", tenant, &format!("u@{tenant}"), role, 3600).unwrap()
}

async fn send(
    s: &Srv,
    method: reqwest::Method,
    token: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut b = s
        .client
        .request(method, format!("{}{path}", s.url))
        .bearer_auth(token);
    if let Some(v) = body {
        b = b.json(&v);
    }
    let r = b.send().await.unwrap();
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_member_reads_in_its_own_namespace_and_loses_access_on_revocation() {
    let s = start(|_| {}).await;
    let outsider = token_for(&s, "hooli", Role::Tenant);
    // acme registers a private segment: prefilled into acme's namespace.
    let (st, v) = s
        .post("/v1/segments", &json!({"id": "playbook", "content": DOC_A}))
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["hypic"]["residency"]["resident"], true, "{v}");
    let (st, v) = s
        .post_as(&s.op_token, "/v1/admin/groups", &json!({"id": "partners"}))
        .await;
    assert_eq!(st, 200, "{v}");
    let (st, v) = send(
        &s,
        reqwest::Method::PUT,
        &s.op_token,
        "/v1/admin/groups/partners/members/globex",
        None,
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let (st, v) = s
        .post(
            "/v1/segments/playbook/group-grants",
            &json!({"group": "partners"}),
        )
        .await;
    assert_eq!(st, 200, "{v}");

    // A fresh first segment per request, so no private prefix snapshot answers:
    // the catalog segment is looked up in the public pool every time.
    let req = |first: &str| json!({"segments": [{"text": first}, {"id": "playbook"}, {"text": Q}], "max_tokens": 2});
    // The owner hits its prefilled entry.
    let (st, a) = s.post("/v1/completions", &req("Intro one.")).await;
    assert_eq!(st, 200, "{a}");
    assert_eq!(outcomes(&a)[1], "hit", "{a}");
    // The member reads the segment but misses: its own namespace, never acme's entry.
    let (st, b1) = s
        .post_as(&s.token_b, "/v1/completions", &req("Intro one."))
        .await;
    assert_eq!(st, 200, "{b1}");
    assert_eq!(outcomes(&b1)[1], "miss", "{b1}");
    assert_eq!(b1["hypic"]["segments"][1]["shared"], false);
    assert_eq!(b1["hypic"]["segments"][1]["id"], "playbook");
    assert_eq!(
        b1["hypic"]["segments"][1]["content_hash"], a["hypic"]["segments"][1]["content_hash"],
        "same content"
    );
    // …and then hits the entry it built.
    let (_, b2) = s
        .post_as(&s.token_b, "/v1/completions", &req("Intro two."))
        .await;
    assert_eq!(outcomes(&b2)[1], "hit", "{b2}");
    // A tenant outside the group: 404, never a hit.
    let (st, e) = s
        .post_as(&outsider, "/v1/completions", &req("Intro one."))
        .await;
    assert_error(st, &e, 404, "segment_not_found");

    // Revoking the group grant: the member's next request gets nothing.
    let (st, v) = send(
        &s,
        reqwest::Method::DELETE,
        &s.token,
        "/v1/segments/playbook/group-grants/partners",
        None,
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let (st, e) = s
        .post_as(&s.token_b, "/v1/completions", &req("Intro two."))
        .await;
    assert_error(st, &e, 404, "segment_not_found");
    // Granted again, then the membership is removed: the same.
    let (st, _) = s
        .post(
            "/v1/segments/playbook/group-grants",
            &json!({"group": "partners"}),
        )
        .await;
    assert_eq!(st, 200);
    let (st, b3) = s
        .post_as(&s.token_b, "/v1/completions", &req("Intro three."))
        .await;
    assert_eq!(st, 200, "{b3}");
    let (st, v) = send(
        &s,
        reqwest::Method::DELETE,
        &s.op_token,
        "/v1/admin/groups/partners/members/globex",
        None,
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let (st, e) = s
        .post_as(&s.token_b, "/v1/completions", &req("Intro four."))
        .await;
    assert_error(st, &e, 404, "segment_not_found");
    // The owner is unaffected.
    let (st, a2) = s.post("/v1/completions", &req("Intro four.")).await;
    assert_eq!(st, 200);
    assert_eq!(outcomes(&a2)[1], "hit", "{a2}");
    s.server.stop().await;
}

